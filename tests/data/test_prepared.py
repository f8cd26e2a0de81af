"""Prepared corpora (`python -m moejax.data.prepare`, data.source=tokens): the same stream,
batches and validation split as the source they were prepared from, read in place; their errors."""
import json
import os
import re

import numpy as np
import pytest

from moejax.data import DataSpec, make_data, prepared
from moejax.data.prepare import main as prepare_main
from moejax.data.sources import iter_documents
from moejax.data.tokenizer import ByteTokenizer, load_tokenizer
from moejax.errors import DataError

SENTENCES = ["the cat sat on the mat", "a dog ran", "the bird sang a song in the park"]


def _corpus(tmp_path, count=60):
  path = tmp_path / "docs.jsonl"
  path.write_text("\n".join(json.dumps({"text": SENTENCES[i % 3] + f" {i}" * (i % 4)})
                            for i in range(count)) + "\n")
  return str(path)


def _take(it, n):
  return [next(it) for _ in range(n)]


def _same_batches(a, b):
  return all(np.array_equal(x[k], y[k]) and x[k].dtype == y[k].dtype == np.int32
             for x, y in zip(a, b, strict=True) for k in ("inputs", "targets"))


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_prepared_corpus_trains_on_the_source_s_batches_and_resumes(tmp_path, word_tokenizer_path,
                                                                    monkeypatch, dtype):
  """Documents encoded in chunks of 2-3, written as uint16 or uint32: the training batches (over
  an epoch boundary), the validation batches and a resumed position equal the source's."""
  from moejax.data import tokenizer as tokenizer_lib
  monkeypatch.setattr(tokenizer_lib, "ENCODE_CHUNK_CHARS", 50)
  monkeypatch.setattr(tokenizer_lib, "ENCODE_CHUNK_DOCUMENTS", 2)
  monkeypatch.setattr(prepared, "dtype_for", lambda vocab_size: dtype)
  path, out = _corpus(tmp_path), str(tmp_path / "prepared")
  tokenizer = load_tokenizer(word_tokenizer_path)
  meta = prepared.write([("jsonl", path)], tokenizer, out)
  assert meta["dtype"] == dtype and meta["num_documents"] == 60
  assert sorted(os.listdir(out)) == ["meta.json", "tokens.bin"]
  assert not os.path.exists(out + ".partial")
  source = make_data(DataSpec("jsonl", path, word_tokenizer_path, 0.2, seed=4), batch_size=3,
                     seq_len=7)
  tokens = make_data(DataSpec("tokens", out, word_tokenizer_path, 0.2, seed=4), batch_size=3,
                     seq_len=7)
  assert isinstance(tokens.val_tokens, np.memmap) and tokens.val_tokens.dtype == dtype
  np.testing.assert_array_equal(tokens.val_tokens, source.val_tokens)
  assert tokens.train.num_windows == source.train.num_windows
  steps = source.train.num_windows // 3 + 2                   # into the second epoch
  assert _same_batches(_take(tokens.train, steps), _take(source.train, steps))
  assert _same_batches(tokens.val_batches(2), source.val_batches(2))
  state = tokens.train.get_state()
  resumed = make_data(DataSpec("tokens", out, word_tokenizer_path, 0.2, seed=4), batch_size=3,
                      seq_len=7)
  resumed.train.set_state(state)
  assert _same_batches(_take(resumed.train, 4), _take(source.train, 4))
  # A run on the source files moves to the prepared corpus: its position (the stream named by
  # its int32 CRC-32) is checked against the tokens and accepted; other data's is refused.
  moved = make_data(DataSpec("tokens", out, word_tokenizer_path, 0.2, seed=4), batch_size=3,
                    seq_len=7)
  moved.train.set_state(source.train.get_state())
  assert moved.train.get_state()["tokens_crc32"] == meta["crc32"]
  assert _same_batches(_take(moved.train, 4), _take(source.train, 4))
  other = {**source.train.get_state(), "tokens_crc32": source.train.get_state()["tokens_crc32"] ^ 1}
  with pytest.raises(DataError, match=r"^the checkpoint's data position is for other training "
                                      r"data \(tokens_crc32 "):
    moved.train.set_state(other)
  # Not back: the prepared corpus's position on the source files is refused, saying why.
  with pytest.raises(DataError, match=r"a checkpoint taken on a prepared corpus \(data.source="
                                      r"'tokens'\) resumes on that directory, not on the files"):
    source.train.set_state(moved.train.get_state())


def test_a_corpus_in_shards_is_one_stream_in_the_order_given(tmp_path):
  lines = open(_corpus(tmp_path)).read().splitlines(keepends=True)
  shards = [tmp_path / f"shard{i}.jsonl" for i in range(3)]
  for i, shard in enumerate(shards):
    shard.write_text("".join(lines[i * 20:(i + 1) * 20]))
  assert prepare_main(["--data", *map(str, shards), "--out", str(tmp_path / "sharded")]) == 0
  assert prepare_main(["--data", str(tmp_path / "docs.jsonl"), "--out", str(tmp_path / "one")]) == 0
  sharded, one = (open(tmp_path / d / "tokens.bin", "rb").read() for d in ("sharded", "one"))
  assert sharded == one and len(one) > 1000
  meta = json.load(open(tmp_path / "sharded" / "meta.json"))
  assert [i["path"] for i in meta["inputs"]] == list(map(str, shards))


def test_a_preparation_that_fails_leaves_nothing(tmp_path, monkeypatch):
  """A write error (a full disk) is one line; another preparation of the same directory that
  finished first is kept, and this one's refused; neither leaves its partial directory."""
  import errno
  path, out = _corpus(tmp_path), str(tmp_path / "p")
  write_into = prepared._write_into

  def disk_full(directory, *args):
    write_into(directory, *args)
    raise OSError(errno.ENOSPC, "No space left on device", os.path.join(directory, "tokens.bin"))

  monkeypatch.setattr(prepared, "_write_into", disk_full)
  with pytest.raises(DataError, match=r"^.*/p.partial-\d+-[0-9a-f]{8}/tokens.bin: No space left "
                                      r"on device$"):
    prepared.write([("jsonl", path)], ByteTokenizer(), out)
  assert sorted(os.listdir(tmp_path)) == ["docs.jsonl"]

  def beaten(directory, *args):
    meta = write_into(directory, *args)
    monkeypatch.setattr(prepared, "_write_into", write_into)
    prepared.write([("text", path)], ByteTokenizer(), out)     # the other one, finished first
    return meta

  monkeypatch.setattr(prepared, "_write_into", beaten)
  with pytest.raises(DataError, match=r"^.*/p: another preparation finished it first \(this "
                                      r"one's tokens are discarded\)$"):
    prepared.write([("jsonl", path)], ByteTokenizer(), out)
  assert sorted(os.listdir(tmp_path)) == ["docs.jsonl", "p"]
  assert json.load(open(os.path.join(out, "meta.json")))["inputs"][0]["source"] == "text"


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_a_stopped_preparation_removes_what_it_wrote_in_one_line(tmp_path, monkeypatch, capsys,
                                                                 signum):
  """SIGTERM killed the command with its partial directory left; Ctrl-C removed it with a
  traceback. The signal comes (really sent to this process) while tokens are written."""
  import signal
  import time
  from moejax.data import prepare
  path, out = _corpus(tmp_path), str(tmp_path / "p")
  write_into = prepared._write_into

  def signalled(directory, *args):
    write_into(directory, *args)
    os.kill(os.getpid(), getattr(signal, signum))
    time.sleep(5)                                  # the handler raises before this ends
    raise AssertionError("not stopped")

  monkeypatch.setattr(prepared, "_write_into", signalled)
  # Python's own Ctrl-C handler, whatever this process inherited (a job started in the
  # background of a shell ignores SIGINT, and Python keeps that)
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    code = prepare.main(["--data", path, "--out", out])
  finally:
    signal.signal(signal.SIGINT, previous)
  assert code == 128 + getattr(signal, signum)
  err = capsys.readouterr().err
  assert err == f"moejax: preparation stopped ({signum}): nothing written to {out}\n", err
  assert sorted(os.listdir(tmp_path)) == ["docs.jsonl"]
  assert signal.getsignal(signal.SIGTERM) is not prepare._stop      # restored


def test_documents_are_read_one_line_at_a_time(tmp_path):
  """A bad line is reported when reached: the lines before it came out first."""
  path = tmp_path / "late.jsonl"
  path.write_text('{"text": "one"}\n{"text": "two"}\nnot json\n')
  docs = iter_documents("jsonl", str(path))
  assert [next(docs), next(docs)] == ["one", "two"]
  with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:3: not valid JSON"):
    next(docs)


def test_reading_a_prepared_corpus_refuses_what_it_cannot_use(tmp_path, word_tokenizer_path):
  path, out = _corpus(tmp_path), str(tmp_path / "p")
  bytes_tokenizer = ByteTokenizer()
  prepared.write([("jsonl", path)], bytes_tokenizer, out)

  def refused(where, pattern, tokenizer=bytes_tokenizer, field="path"):
    with pytest.raises(DataError, match=pattern) as e:
      prepared.read(where, tokenizer)
    assert e.value.input == field and "\n" not in str(e.value)

  refused(str(tmp_path / "q"), r"q: not found \(data.source=tokens reads a directory written by "
                               r"python -m moejax.data.prepare\)$")
  refused(os.path.join(out, "tokens.bin"), r"tokens.bin: name the prepared directory that holds "
                                           r"it, .*/p$")
  refused(path, r"docs.jsonl: is a file \(data.source=tokens")
  refused(out, r"tokenizer.json: not the tokenizer .*/p was prepared with \(bytes; this one, "
               r"SHA-256 [0-9a-f]{12}\.\.\.\): name that file, or prepare the corpus with this "
               r"one$", load_tokenizer(word_tokenizer_path), "tokenizer")
  os.rename(out, out + ".partial-x1")         # as a killed preparation leaves it
  refused(out, r"p: not prepared \(.*p.partial-x1 holds a preparation that is running or was "
               r"killed: wait for it, or remove it and run python -m moejax.data.prepare again\)$")
  os.rename(out + ".partial-x1", out)
  tokens_bin = os.path.join(out, "tokens.bin")
  with open(tokens_bin, "r+b") as f:
    size = f.seek(0, 2)
    f.truncate(size - 2)
  refused(out, rf"tokens.bin: {size - 2:,} bytes, but meta.json says {size // 2:,} uint16 tokens "
               rf"\({size:,} bytes\): prepare the corpus again$")
  meta_file = os.path.join(out, "meta.json")
  meta = json.load(open(meta_file))
  for damaged, pattern in [("{", r"meta.json: unreadable \("),
                           (json.dumps({**meta, "format": "v0"}),
                            r"meta.json: format 'v0', expected 'moejax-tokens-1'$"),
                           (json.dumps({**meta, "crc32": "x"}),
                            r"meta.json: field 'crc32' is 'x', expected int: prepare the corpus "
                            r"again$")]:
    with open(meta_file, "w") as f:
      f.write(damaged)
    refused(out, pattern)
  os.remove(meta_file)
  refused(out, r"p: no meta.json: not a directory written by python -m moejax.data.prepare$")


def test_prepare_command(tmp_path, capsys, erasing_tokenizer_path):
  """Writes once, refuses to overwrite, verifies a copy, leaves nothing behind when it fails;
  every refusal one line and exit code 2."""
  path, out = _corpus(tmp_path), str(tmp_path / "p")
  assert prepare_main(["--data", path, "--out", out]) == 0
  printed = capsys.readouterr().out
  assert "moejax: prepared " in printed and "documents (each ended by EOS id 256)" in printed
  assert prepare_main(["--verify", out]) == 0
  assert capsys.readouterr().out.strip() == f"{out}: tokens match their CRC-32"

  def error(argv):
    assert prepare_main(argv) == 2
    return capsys.readouterr().err.strip()

  assert error(["--data", path, "--out", out]) == (
      f"error: {out}: already exists (remove it, or choose another output directory)")
  with open(os.path.join(out, "tokens.bin"), "r+b") as f:
    f.seek(3)
    f.write(b"\xff")
  assert re.fullmatch(r"error: .*tokens.bin: CRC-32 0x[0-9a-f]{8}, meta.json says 0x[0-9a-f]{8}: "
                      r"the file is damaged; prepare the corpus again", error(["--verify", out]))
  assert error(["--data", out, "--out", str(tmp_path / "r")]).startswith(
      f"error: --data {out}: a directory is already prepared")
  assert error(["--out", out]) == "error: --data and --out are required (or --verify DIR)"
  again = os.path.join(os.path.dirname(path), ".", "docs.jsonl")      # the same file
  assert error(["--data", path, again, "--out", str(tmp_path / "r")]) == (
      f"error: --data names {again} twice")
  assert error(["--data", "builtin", path, "--out", str(tmp_path / "r")]) == (
      "error: --data builtin is a corpus of its own: name it alone")
  lowercase = tmp_path / "lowercase.txt"
  lowercase.write_text(" ".join(SENTENCES))
  assert error(["--data", str(lowercase), "--tokenizer", erasing_tokenizer_path, "--out",
                str(tmp_path / "e")]).startswith(f"error: {lowercase}: no text after tokenization")
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"text": "fine"}\n' * 3 + "not json\n")
  assert error(["--data", str(bad), "--out", str(tmp_path / "e")]) == (
      f"error: {bad}:4: not valid JSON (Expecting value)")
  assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "docs.jsonl", "erasing.json",
                                         "lowercase.txt", "p"]


def test_training_and_evaluation_read_a_prepared_corpus(tmp_path, word_tokenizer_path):
  """The loop's data (errors named by their config field) and `moejax.evaluate`'s batches."""
  import dataclasses
  from moejax import evaluate
  from moejax.config import Config, DataConfig
  from moejax.train.loop import training_data
  path, out = _corpus(tmp_path), str(tmp_path / "p")
  prepared.write([("jsonl", path)], load_tokenizer(word_tokenizer_path), out)
  cfg = dataclasses.replace(Config(), batch_size=2, seq_len=6,
                            data=DataConfig("tokens", out, word_tokenizer_path, 0.2))
  from_jsonl = dataclasses.replace(cfg, data=DataConfig("jsonl", path, word_tokenizer_path, 0.2))
  assert _same_batches(_take(training_data(cfg).train, 3),
                       _take(training_data(from_jsonl).train, 3))
  for split in ("all", "val"):
    assert _same_batches(evaluate.batches(cfg, out, split, word_tokenizer_path),
                         evaluate.batches(cfg, path, split, word_tokenizer_path))
  with pytest.raises(DataError, match=r"^config.data.tokenizer='bytes': bytes: not the tokenizer"):
    training_data(dataclasses.replace(cfg, data=DataConfig("tokens", out, "bytes", 0.2)))
  with pytest.raises(DataError, match=r"^config.data.path='.*/q': .*/q: not found"):
    training_data(dataclasses.replace(cfg, data=DataConfig("tokens", str(tmp_path / "q"),
                                                           word_tokenizer_path, 0.2)))


def test_an_id_outside_the_tokenizer_stops_the_batch_that_reads_it(tmp_path, word_tokenizer_path):
  """tokens.bin damaged in place (its size right, an id at or above the tokenizer's vocabulary):
  the batch that reads it stops training, validation or evaluation with one line naming the
  file, where the model would have read an embedding row of NaNs."""
  import dataclasses
  from moejax import evaluate
  from moejax.config import Config, DataConfig
  path, out = _corpus(tmp_path), str(tmp_path / "p")
  tokenizer = load_tokenizer(word_tokenizer_path)
  meta = prepared.write([("jsonl", path)], tokenizer, out)
  spec = DataSpec("tokens", out, word_tokenizer_path, 0.2)
  clean = make_data(spec, batch_size=2, seq_len=6)
  epoch = clean.train.num_windows // 2 + 1
  _take(clean.train, epoch)
  clean.val_batches(clean.num_val_batches)
  ids = np.memmap(os.path.join(out, "tokens.bin"), dtype=meta["dtype"], mode="r+")
  num_train = meta["num_tokens"] - len(clean.val_tokens)
  ids[num_train // 2] = tokenizer.vocab_size          # the first id outside
  ids[num_train + 3] = np.iinfo(ids.dtype).max
  ids.flush()
  pattern = (r"^.*/p/tokens.bin: token id {} read, outside the {} ids of the tokenizer it was "
             r"prepared with: the file is damaged \(python -m moejax.data.prepare --verify .*/p "
             r"checks it\); prepare the corpus again(\n|$)")   # (grain adds a note below)
  damaged = make_data(spec, batch_size=2, seq_len=6)
  with pytest.raises(DataError, match=pattern.format(tokenizer.vocab_size,
                                                     tokenizer.vocab_size)):
    _take(damaged.train, epoch)
  top = pattern.format(np.iinfo(ids.dtype).max, tokenizer.vocab_size)
  with pytest.raises(DataError, match=top):
    damaged.val_batches(damaged.num_val_batches)
  cfg = dataclasses.replace(Config(), batch_size=2, seq_len=6,
                            data=DataConfig("tokens", out, word_tokenizer_path, 0.2))
  with pytest.raises(DataError, match=top):
    evaluate.batches(cfg, out, "val", word_tokenizer_path)
  batches = evaluate.batches(cfg, out, "all", word_tokenizer_path)
  with pytest.raises(DataError, match=pattern.format(r"\d+", tokenizer.vocab_size)):
    list(batches)


def test_meta_names_the_tokenizer_by_an_absolute_path(tmp_path, word_tokenizer_path, monkeypatch):
  """A tokenizer given by a relative path was kept as typed, and the refusal of another
  tokenizer named a file that did not resolve from where training ran."""
  monkeypatch.chdir(os.path.dirname(word_tokenizer_path))
  tokenizer = load_tokenizer(os.path.basename(word_tokenizer_path))
  meta = prepared.write([("jsonl", _corpus(tmp_path))], tokenizer, str(tmp_path / "p"))
  assert meta["tokenizer"] == os.path.abspath(word_tokenizer_path)
