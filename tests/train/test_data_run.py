"""What a run says about the data it reads, and the tokenizer it keeps in its workdir.

The runs train through the suite's canonical Trainer (tests/conftest.py `trainer`, compiled once
per session) on configs that differ from it only in `data.*` and `eval_batches`, which compile
nothing (`run` accepts such a Trainer).
"""
import dataclasses
import json
import re

import pytest

from moejax import weights
from moejax.data import load_tokenizer
from moejax.errors import DataError
from moejax.train.loop import run
from tests.data.conftest import word_level
from tests.train.conftest import records


def _on_text(cfg, path, **data):
  return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source="text",
                                                           path=str(path), **data))


def test_a_small_corpus_without_validation_says_its_epochs_and_logs_no_val_loss(
    trainer, tmp_path, capsys):
  cfg = trainer.cfg
  assert (cfg.batch_size, cfg.seq_len, cfg.steps) == (16, 64, 12)
  corpus = tmp_path / "small.txt"
  corpus.write_text(("the cat sat on the mat. " * 70)[:1546])   # + EOS: 24 windows of 65
  cfg = _on_text(cfg, corpus, val_fraction=0.0)
  run(cfg, str(tmp_path / "w"), trainer=trainer)
  out = capsys.readouterr().out
  assert ("moejax: data: 1,547 training tokens (24 windows of 65), no validation split "
          "(data.val_fraction=0: no val_loss); 12 steps read 8 epoch(s)") in out
  # After step s, 16 s windows are read: the last one is in epoch (16 s - 1) // 24 + 1.
  began = [(int(s), int(e)) for s, e in
           re.findall(r"step (\d+): epoch (\d+) of the training split began", out)]
  assert began == [(2, 2), (4, 3), (5, 4), (7, 5), (8, 6), (10, 7), (11, 8)]
  recs = records(tmp_path / "w")
  assert [r["step"] for r in recs] == list(range(1, 13))      # step 12 evaluates: nothing to
  assert not any("val_loss" in r for r in recs)


def test_a_validation_split_smaller_than_eval_batches_is_said(trainer, tmp_path, capsys):
  corpus = tmp_path / "corpus.txt"
  corpus.write_text(("a dog ran in the park. " * 200)[:4000])   # 1,600 validation tokens
  cfg = dataclasses.replace(_on_text(trainer.cfg, corpus, val_fraction=0.4), eval_batches=3)
  run(cfg, str(tmp_path / "w"), trainer=trainer, stop_at=1)
  out = capsys.readouterr().out
  assert ("the validation split holds 1 batch(es) of 16x64: val_loss is over 1, not "
          "config.eval_batches=3") in out
  assert "1,600 validation tokens" in out


def _tokenizer_dir(path, declare=None):
  """A word-level tokenizer.json whose vocabulary holds '<eot>' and '</s>'; `declare`: the file
  that names '<eot>' its EOS (else the first EOS candidate, '</s>', is)."""
  path.mkdir()
  tok = word_level(["the cat sat on the mat"], special_tokens=("[UNK]", "<eot>", "</s>"))
  tok.save(str(path / "tokenizer.json"))
  eot = tok.token_to_id("<eot>")
  if declare == "tokenizer_config.json":
    (path / declare).write_text(json.dumps({"eos_token": "<eot>", "model_max_length": 77}))
  elif declare == "config.json":
    (path / declare).write_text(json.dumps({"eos_token_id": eot}))
  return path, eot


@pytest.mark.parametrize("declare", ["tokenizer_config.json", "config.json"])
def test_the_kept_tokenizer_ends_documents_with_the_same_eos(tmp_path, declare):
  source, eot = _tokenizer_dir(tmp_path / "tok", declare)
  assert load_tokenizer(str(source)).eos_id == eot
  workdir = tmp_path / "w"
  workdir.mkdir()
  kept = weights.keep_tokenizer(str(source), str(workdir))
  assert kept == str(workdir / "tokenizer.json")
  assert load_tokenizer(str(workdir)).eos_id == eot     # was '</s>' without the declaration
  config = json.loads((workdir / "tokenizer_config.json").read_text())
  assert config["eos_token"] == "<eot>"
  if declare == "tokenizer_config.json":
    assert config["model_max_length"] == 77             # the rest of the file kept
  # Another tokenizer, declaring nothing, replaces the copy and its stale declaration.
  other, _ = _tokenizer_dir(tmp_path / "other")
  weights.keep_tokenizer(str(other), str(workdir))
  assert (workdir / "tokenizer.json").read_text() == (other / "tokenizer.json").read_text()
  assert load_tokenizer(str(workdir)).eos_token == "</s>"
  assert json.loads((workdir / "tokenizer_config.json").read_text()) == {"eos_token": "</s>"}


def test_keeping_a_tokenizer_from_the_workdir_itself(tmp_path):
  """The workdir as the tokenizer's folder by another path (a symlink: copyfile raised
  SameFileError), and a tokenizer file in the workdir under another name (never copied to
  tokenizer.json, where generate and evaluate look)."""
  source, eot = _tokenizer_dir(tmp_path / "w", "tokenizer_config.json")
  (tmp_path / "link").symlink_to(source)
  assert weights.keep_tokenizer(str(tmp_path / "link"), str(source)) == str(
      source / "tokenizer.json")
  (source / "tokenizer.json").rename(source / "mine.json")
  weights.keep_tokenizer(str(source / "mine.json"), str(source))
  assert load_tokenizer(str(source)).eos_id == eot


def test_a_run_that_fails_on_its_data_keeps_no_tokenizer(trainer, tmp_path):
  source, _ = _tokenizer_dir(tmp_path / "tok")
  corpus = tmp_path / "short.txt"
  corpus.write_text("the cat sat")
  cfg = _on_text(trainer.cfg, corpus, tokenizer=str(source))
  (tmp_path / "mine").mkdir()
  for workdir in (tmp_path / "runs" / "new", tmp_path / "mine"):
    with pytest.raises(DataError, match="corpus too small"):
      run(cfg, str(workdir))                     # fails before anything compiles
    assert not (workdir / "tokenizer.json").exists()
  # the workdir the failed start made is removed (not its parent); the user's own is kept
  assert (tmp_path / "runs").is_dir() and not (tmp_path / "runs" / "new").exists()
  assert (tmp_path / "mine" / "checkpoints").is_dir()


@pytest.mark.parametrize("leftover", ["metrics", "checkpoint", "other"])
def test_a_created_workdir_that_holds_a_result_is_kept(tmp_path, leftover):
  from moejax.train import workdir as workdir_lib
  workdir = tmp_path / "w"
  (workdir / "checkpoints").mkdir(parents=True)
  (workdir / ".lock").write_text("pid 1")
  (workdir / "metrics.jsonl").write_text("")
  (workdir / "events.out.tfevents.1.host").write_text("")
  {"metrics": lambda: (workdir / "metrics.jsonl").write_text('{"step": 1}\n'),
   "checkpoint": lambda: (workdir / "checkpoints" / "4").mkdir(),
   "other": lambda: (workdir / "profile").mkdir()}[leftover]()
  assert not workdir_lib.remove_if_unused(str(workdir)) and workdir.is_dir()
  {"metrics": lambda: (workdir / "metrics.jsonl").write_text(""),
   "checkpoint": lambda: (workdir / "checkpoints" / "4").rmdir(),
   "other": lambda: (workdir / "profile").rmdir()}[leftover]()
  assert workdir_lib.remove_if_unused(str(workdir)) and not workdir.exists()
