"""python -m moejax.evaluate on the canonical run (tests/conftest.py `trained`): on the training
corpus's validation split it gives the loop's val_loss, on a file every window's loss; bad input
is one line and exit code 2."""
import json
import math

import numpy as np

from moejax import evaluate, weights
from tests.train.conftest import records


def test_validation_split_gives_the_loops_val_loss(trainer, trained):
  last = records(trained)[-1]            # step 12: evaluated on params saved at step 12
  params = weights.load_params(str(trained))
  batches = evaluate.batches(trainer.cfg, "builtin", "val", "bytes", trainer.cfg.eval_batches)
  assert evaluate.mean_loss(trainer, params, batches) == last["val_loss"]


def test_cli_validation_split_defaults_to_the_loops_batches(trained, capsys):
  assert evaluate.main([str(trained), "--data", "builtin", "--split", "val"]) == 0
  out = capsys.readouterr().out
  assert f"loss {records(trained)[-1]['val_loss']:.4f} nats/token" in out
  assert "(1 batch of " in out               # the canonical run's eval_batches


def test_what_the_run_computed_otherwise_is_named():
  """Dropped dispatch rows and per-device admission capacities make a run's val_loss one that
  evaluation (every assignment, fsdp, this host's devices) does not reproduce: said, not
  hidden; the canonical run has neither."""
  from tests.helpers import canonical_config, tiny_config
  assert evaluate.differences_from_training(canonical_config("fsdp"), 8) == []
  drop = tiny_config(**{"moe.placement": "ep", "moe.dispatch_capacity_factor": 0.5,
                        "moe.dispatch_overflow": "drop"})
  (note,) = evaluate.differences_from_training(drop, 8)
  assert note.startswith("the run's val_loss dropped the assignments past its ep dispatch")
  strict = tiny_config(**{"routing.admission": "strict"})
  (note,) = evaluate.differences_from_training(strict, 2)
  assert "admits each expert's capacity per device: the loss depends on the device count (2 " in note


def test_cli_scores_a_file(trained, tmp_path, capsys):
  text = tmp_path / "held_out.jsonl"
  lines = [json.dumps({"text": f"Line {i}: the quick brown fox jumps over the lazy dog."})
           for i in range(200)]
  text.write_text("\n".join(lines))
  assert evaluate.main([str(trained), "--data", str(text), "--batches", "2"]) == 0
  out = capsys.readouterr().out
  assert out.startswith(f"{text} (all): loss ")
  assert "over 2,048 tokens (2 batches of 16 x 64)" in out
  # Another window: the same file scored in windows of 32 tokens, 4 to a batch.
  assert evaluate.main([str(trained), "--data", str(text), "--batches", "2", "--seq-len", "32",
                        "--batch-size", "4"]) == 0
  captured = capsys.readouterr()
  assert "over 256 tokens (2 batches of 4 x 32)" in captured.out
  assert "note" not in captured.err                 # shorter than the run's 64: no note
  # The whole file: its windows past the last whole batch are said to be left out.
  assert evaluate.main([str(trained), "--data", str(text)]) == 0      # 170 windows of 65
  captured = capsys.readouterr()
  assert "over 10,240 tokens (10 batches of 16 x 64)" in captured.out
  assert captured.err.splitlines() == [
      f"moejax: note: 10 of {text}'s 170 windows are left out (batches are whole: 10 of 16; a "
      "--batch-size that divides the windows scores every one)"], captured.err
  # Longer than the run trained at: said (positions it never trained at), then scored.
  assert evaluate.main([str(trained), "--data", str(text), "--batches", "1", "--seq-len", "128",
                        "--batch-size", "4"]) == 0
  captured = capsys.readouterr()
  assert "over 512 tokens (1 batch of 4 x 128)" in captured.out
  assert ("moejax: note: --seq-len=128 scores positions past the run's seq_len=64"
          in captured.err)
  loss = float(out.split("loss ")[1].split()[0])
  # A JSONL file by another name reads as JSONL with --source jsonl (as text by its name).
  renamed = tmp_path / "held_out.json"
  renamed.write_text(text.read_text())
  assert evaluate.main([str(trained), "--data", str(renamed), "--batches", "2",
                        "--source", "jsonl"]) == 0
  assert f"loss {loss:.4f} " in capsys.readouterr().out
  perplexity = float(out.split("perplexity ")[1].split()[0])
  assert 0 < loss < 10 and np.isclose(perplexity, math.exp(loss), rtol=1e-3)


def test_bad_input_is_one_line_exit_2(trained, tmp_path, capsys):
  binary = tmp_path / "bad.txt"
  binary.write_bytes(b"\xff\xfe\x00")
  small = tmp_path / "small.txt"
  small.write_text("a few words, far fewer than a batch")
  for argv, message in (
      ([str(tmp_path / "nothing"), "--data", "builtin"], f"{tmp_path / 'nothing'}: no such"),
      ([str(trained), "--data", str(tmp_path / "missing.txt")], "missing.txt: file not found"),
      ([str(trained), "--data", str(binary)], "bad.txt: not UTF-8 text"),
      ([str(trained), "--data", "builtin", "--seq-len", "0"], "--seq-len=0"),
      # a file whose training half is too small for a batch: the val split says it is training's
      ([str(trained), "--data", str(small), "--split", "val"],
       "--split val takes the run's validation windows, splitting")):
    assert evaluate.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_a_non_finite_loss_is_an_error_naming_its_source(trained, monkeypatch, capsys):
  """A loss of nan or inf is exit 2 with one line: the first non-finite parameter when there is
  one, else that the logits overflowed on this data (finite parameters: an LM head of 3e38,
  finite in fp32 and bf16, whose products are not)."""
  import jax
  from moejax.convert import checkpoint_io
  real_load = checkpoint_io.load_model

  def with_leaf(name: str, fill: float):
    def load(*args, **kwargs):
      cfg, params, tok = real_load(*args, **kwargs)
      leaf = np.asarray(params[name])
      return cfg, {**params, name: np.full_like(leaf, fill)}, tok
    return load

  for name, fill, message in (
      ("embed", np.nan, "parameter ['embed'] holds non-finite values"),
      ("lm_head", 3e38, "every parameter is finite: the forward pass overflowed")):
    monkeypatch.setattr(checkpoint_io, "load_model", with_leaf(name, fill))
    assert evaluate.main([str(trained), "--data", "builtin", "--split", "val"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert "nats/token" not in captured.out
    assert len(err) == 1 and err[0].startswith(f"error: {trained}: the loss on builtin (val) is ")
    assert message in err[0], err
  assert evaluate.perplexity(800.0) == math.inf and evaluate.perplexity(1.0) == math.e
