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
      ([str(trained), "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens=0")):
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
