"""python -m moejax.generate on the canonical run's checkpoint (tests/conftest.py `trained`):
greedy continuation of a prompt, reproducible sampling, one-line errors with exit code 2."""
from moejax import generate


def _generate(capsys, *argv):
  assert generate.main(list(argv)) == 0
  return capsys.readouterr().out


def test_greedy_and_sampled_continuations(trained, capsys):
  greedy = _generate(capsys, str(trained), "--prompt", "The ", "--max-new-tokens", "8")
  assert greedy.startswith("The ") and len(greedy) > len("The \n")
  assert _generate(capsys, str(trained), "--prompt", "The ", "--max-new-tokens", "8") == greedy
  sampled = [_generate(capsys, str(trained), "--prompt", "The ", "--max-new-tokens", "8",
                       "--temperature", "1.0", "--top-p", "0.95", "--seed", str(seed))
             for seed in (1, 1, 2)]
  assert sampled[0] == sampled[1] != sampled[2]


def test_bad_input_is_one_line_exit_2(trained, tmp_path, capsys):
  for argv, message in (
      ([str(tmp_path / "nothing"), "--prompt", "x"], f"{tmp_path / 'nothing'}: no such"),
      ([str(trained), "--prompt", ""], "--prompt '': encodes to no tokens"),
      ([str(trained), "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens=0"),
      ([str(trained), "--prompt", "x", "--temperature", "nan"], "--temperature=nan"),
      ([str(trained), "--prompt", "x", "--temperature", "inf"], "--temperature=inf"),
      ([str(trained), "--prompt", "x", "--top-p", "nan"], "--top-p=nan"),
      ([str(trained), "--prompt", "x", "--seed", str(2 ** 64)], f"--seed={2 ** 64}"),
      ([str(trained), "--prompt", "x", "--max-new-tokens", str(10 ** 12)],
       "--max-new-tokens: a KV cache of")):
    assert generate.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_a_hugging_face_directory_generates_like_its_source(trained, tmp_path, capsys):
  from moejax.convert import checkpoint_io, hf
  cfg, params, _ = checkpoint_io.load_params(str(trained))
  hf.save_hf(params, cfg, str(tmp_path / "hf"))           # config.json + model.safetensors
  argv = ("--prompt", "The ", "--max-new-tokens", "6")
  # Its config names no tokenizer: refused without tokenizer.json or --tokenizer.
  assert generate.main([str(tmp_path / "hf"), *argv]) == 2
  assert "no tokenizer.json beside these Hugging Face weights" in capsys.readouterr().err
  assert (_generate(capsys, str(tmp_path / "hf"), *argv, "--tokenizer", "bytes")
          == _generate(capsys, str(trained), *argv))
  # Past the length the run trained at: a note (a Hugging Face directory names no such length)
  assert generate.trained_here(str(trained)) and generate.trained_here(
      str(trained / "checkpoints" / "12"))
  (tmp_path / "imported").mkdir()
  (tmp_path / "imported" / "hf_config.json").write_text("{}")        # a from-hf output
  assert not generate.trained_here(str(tmp_path / "hf"))
  assert not generate.trained_here(str(tmp_path / "imported"))
  assert generate.main([str(trained), "--prompt", "The ", "--max-new-tokens", "61"]) == 0
  assert ("moejax: note: generating to position 65, past the run's seq_len=64: positions it "
          "never trained at") in capsys.readouterr().err


def test_a_tiny_temperature_samples_like_greedy():
  import jax
  import jax.numpy as jnp
  from moejax.models import decode
  logits_BxV = jax.random.normal(jax.random.key(0), (4, 50)) * 30.0
  greedy_B = decode.sample(logits_BxV, jax.random.key(1), temperature=0.0, top_p=1.0)
  for temperature, top_p in ((1e-38, 1.0), (1e-30, 0.9)):
    # Dividing the raw logits overflowed to +-inf and sampled among the positive ones.
    assert jnp.array_equal(decode.sample(logits_BxV, jax.random.key(1), temperature=temperature,
                                         top_p=top_p), greedy_B)


def _sentencepiece_tokenizer(path, bos: bool):
  from tokenizers import SentencePieceBPETokenizer
  from tokenizers.processors import TemplateProcessing
  tok = SentencePieceBPETokenizer()
  tok.train_from_iterator(["The model runs the step, and the step runs the model."] * 20,
                          vocab_size=120, special_tokens=["<s>", "</s>"])
  if bos:
    tok.post_processor = TemplateProcessing(single="<s> $A",
                                            special_tokens=[("<s>", tok.token_to_id("<s>"))])
  tok.save(str(path))
  from moejax.data.tokenizer import load_tokenizer
  return load_tokenizer(str(path))


def test_prompts_get_the_tokenizers_bos_and_continuations_keep_their_space(tmp_path):
  import numpy as np
  tok = _sentencepiece_tokenizer(tmp_path / "bos.json", bos=True)
  # A prompt is encoded as transformers encodes it: with the post-processor's BOS.
  ids = generate.encode_prompt(tok, "The model", tok.vocab_size)[0]
  assert ids[0] == tok._tok.token_to_id("<s>") and ids[1:].tolist() == tok.encode("The model")
  # SentencePiece marks a word's leading space in its first piece ("\u2581runs"), which decoding
  # a sequence alone drops: the continuation is decoded with the prompt, then cut.
  tok = _sentencepiece_tokenizer(tmp_path / "plain.json", bos=False)
  prompt_ids = np.asarray(tok.encode("The model"))
  new_ids = np.asarray(tok.encode("The model runs the step"))[prompt_ids.size:]
  assert not tok.decode(new_ids).startswith(" ")
  assert "The model" + generate.continuation(tok, prompt_ids, new_ids) == "The model runs the step"


def test_step_is_refused_for_a_hugging_face_directory(trained, tmp_path, capsys):
  from moejax.convert import checkpoint_io, hf
  cfg, params, _ = checkpoint_io.load_params(str(trained))
  hf.save_hf(params, cfg, str(tmp_path / "hf"))
  assert generate.main([str(tmp_path / "hf"), "--prompt", "x", "--step", "5"]) == 2
  assert "--step=5: " in capsys.readouterr().err
