"""make_data end to end: sources x tokenizers, the validation split, size and spec errors."""
import json
import re
import time

import numpy as np
import pytest

from moejax.data import DataSpec, make_data
from moejax.data.iterator import windows
from moejax.data.sources import load_documents
from moejax.data.tokenizer import ByteTokenizer
from moejax.errors import ConfigError, DataError


def _take(it, n):
  return [next(it) for _ in range(n)]


def test_builtin_bytes_batches_come_from_the_training_split():
  data = make_data(DataSpec(val_fraction=0.1, seed=1), batch_size=8, seq_len=64)
  tokens_N = ByteTokenizer().encode_documents(load_documents("builtin", None))
  num_train = len(tokens_N) - len(data.val_tokens)
  np.testing.assert_array_equal(data.val_tokens, tokens_N[num_train:])
  assert abs(len(data.val_tokens) - 0.1 * len(tokens_N)) <= 1
  train_windows_WxL = windows(tokens_N[:num_train], 64)
  batches = _take(data.train, 3)
  for batch in batches:
    assert batch["inputs"].shape == (8, 64) and batch["inputs"].dtype == np.int32
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    for inputs_S, targets_S in zip(batch["inputs"], batch["targets"], strict=True):
      window_L = np.concatenate([inputs_S, targets_S[-1:]])
      assert np.all(train_windows_WxL == window_L, axis=1).any()
  text = "".join(data.tokenizer.decode(b["inputs"].ravel()) for b in batches)
  assert " the " in text


def test_builtin_tokenizes_in_under_a_second():
  docs = load_documents("builtin", None)
  best = min(_timed(lambda: ByteTokenizer().encode_documents(docs)) for _ in range(3))
  assert best < 1.0


def _timed(fn):
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def test_same_seed_same_batches_other_seed_other_batches():
  a, b, c = (_take(make_data(DataSpec(seed=s), batch_size=2, seq_len=32).train, 3)
             for s in (7, 7, 8))
  assert all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, b, strict=True))
  assert not all(np.array_equal(x["inputs"], z["inputs"]) for x, z in zip(a, c, strict=True))


def test_resume_through_make_data():
  spec = DataSpec(seed=3)
  data = make_data(spec, batch_size=4, seq_len=16)
  _take(data.train, 5)
  state = json.loads(json.dumps(data.train.get_state()))
  want = _take(data.train, 3)
  restored = make_data(spec, batch_size=4, seq_len=16)
  restored.train.set_state(state)
  for w, g in zip(want, _take(restored.train, 3), strict=True):
    np.testing.assert_array_equal(g["inputs"], w["inputs"])
  with pytest.raises(DataError, match=r"\(batch_size 4 there, 2 now\)"):
    make_data(spec, batch_size=2, seq_len=16).train.set_state(state)


def test_train_and_val_share_no_token_and_cover_the_stream(unique_words):
  text, tok = unique_words
  data = make_data(DataSpec("text", text, tok, val_fraction=0.2, seed=0), batch_size=2, seq_len=8)
  num_tokens = 501  # 500 words and one EOS.
  assert len(data.val_tokens) == 100 and data.num_val_batches == 6  # 99 // 8 = 12 windows.
  assert data.train.num_windows == 50  # 400 // 8.
  train_ids = {int(i) for b in _take(data.train, 25) for i in b["inputs"].ravel()}
  train_ids |= {int(i) for b in _take(data.train, 25) for i in b["targets"].ravel()}
  val_ids = {int(i) for b in data.val_batches(6) for k in b for i in b[k].ravel()}
  assert len(train_ids) == num_tokens - 100
  assert len(val_ids) == 97  # Tokens after the last full window are left out.
  assert not train_ids & val_ids
  assert max(train_ids) < data.tokenizer.vocab_size


def test_val_batches_are_fixed_across_calls_and_seeds():
  first = make_data(DataSpec(seed=0), batch_size=4, seq_len=32)
  other = make_data(DataSpec(seed=9), batch_size=4, seq_len=32)
  three = first.val_batches(3)
  assert len(three) == 3 and three[0]["inputs"].shape == (4, 32)
  for a, b, c in zip(three, first.val_batches(5)[:3], other.val_batches(3), strict=True):
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
    np.testing.assert_array_equal(a["targets"], c["targets"])
  assert not np.array_equal(three[0]["inputs"], three[1]["inputs"])


def test_val_batches_errors():
  data = make_data(DataSpec(), batch_size=4, seq_len=32)
  n = data.num_val_batches
  with pytest.raises(DataError, match=rf"^builtin corpus \(pydoc_data.topics\): validation split "
                                      rf"has \d+ tokens, enough for {n} batches of 4x32; "
                                      rf"asked for {n + 1}$"):
    data.val_batches(n + 1)
  with pytest.raises(DataError, match="no validation split"):
    make_data(DataSpec(val_fraction=0.0), batch_size=4, seq_len=32).val_batches(1)


def test_hf_tokenizing_goes_in_chunks_and_says_how_far_it_got(tmp_path, word_tokenizer_path,
                                                              monkeypatch):
  """Chunks of a few documents give the stream one batch gives; each chunk reports progress."""
  from moejax.data import pipeline, tokenizer
  path = tmp_path / "docs.jsonl"
  sentences = ["the cat sat on the mat", "a dog ran", "the bird sang a song in the park"]
  path.write_text("\n".join(json.dumps({"text": sentences[i % 3]}) for i in range(40)))
  spec = DataSpec("jsonl", str(path), word_tokenizer_path, val_fraction=0.25, seed=0)
  whole = make_data(spec, batch_size=2, seq_len=5)
  monkeypatch.setattr(tokenizer, "ENCODE_CHUNK_CHARS", 50)    # 2-3 documents a chunk
  monkeypatch.setattr(pipeline, "PROGRESS_SECONDS", 0.0)
  lines = []
  chunked = make_data(spec, batch_size=2, seq_len=5, log=lines.append)
  assert chunked.train.get_state() == whole.train.get_state()    # the stream's checksum too
  done = [int(n) for n in re.findall(r": (\d+) of 40 documents", "\n".join(lines))]
  assert len(done) >= 10 and done == sorted(done) and done[-1] == 40, lines
  assert lines[0].startswith(f"moejax: tokenizing {path}: ")


def test_jsonl_with_word_tokenizer(tmp_path, word_tokenizer_path):
  path = tmp_path / "docs.jsonl"
  path.write_text("\n".join(json.dumps({"text": "the cat sat on the mat"}) for _ in range(40)))
  data = make_data(DataSpec("jsonl", str(path), word_tokenizer_path, val_fraction=0.25, seed=0),
                   batch_size=2, seq_len=5)
  batch = next(data.train)
  text = data.tokenizer.decode(batch["inputs"][0])
  assert set(text.split()) <= {"the", "cat", "sat", "on", "mat"} and text
  assert data.tokenizer.eos_id in np.concatenate(
      [b["inputs"].ravel() for b in _take(data.train, 10)])


@pytest.mark.parametrize("source, content", [
    ("text", "plain bytes on a line\n" * 50),
    ("jsonl", "\n".join(json.dumps({"text": f"doc {i}"}) for i in range(200))),
])
def test_byte_tokenizer_on_files(tmp_path, source, content):
  path = tmp_path / f"corpus.{source}"
  path.write_text(content)
  data = make_data(DataSpec(source, str(path), "bytes", val_fraction=0.1, seed=0),
                   batch_size=2, seq_len=16)
  batch = next(data.train)
  assert batch["inputs"].max() <= 256
  assert data.tokenizer.decode(batch["inputs"][0]).strip()


def test_corpus_too_small_for_one_batch(tmp_path):
  path = tmp_path / "small.txt"
  path.write_text("hello")  # 5 bytes and EOS.
  pattern = (f"^{re.escape(str(path))}: corpus too small: the training split has 6 of 6 tokens, "
             f"but one batch of 4x16 needs 65: a smaller batch size or sequence length, or a "
             f"larger corpus$")
  with pytest.raises(DataError, match=pattern):
    make_data(DataSpec("text", str(path), "bytes", val_fraction=0.0, seed=0),
              batch_size=4, seq_len=16)


def test_validation_split_too_small(tmp_path):
  path = tmp_path / "medium.txt"
  path.write_text("x" * 999)
  with pytest.raises(DataError, match=r"the validation split \(val_fraction=0.01\) has 10 of "
                                      r"1000 tokens, but one batch of 4x16 needs 65: a larger "
                                      r"val_fraction \(or 0: none\), a smaller batch size or "
                                      r"sequence length, or a larger corpus$"):
    make_data(DataSpec("text", str(path), "bytes", val_fraction=0.01, seed=0),
              batch_size=4, seq_len=16)


def test_no_text_after_tokenization(tmp_path, erasing_tokenizer_path):
  path = tmp_path / "lower.txt"
  path.write_text("only lowercase words here\n")
  pattern = f"^{re.escape(str(path))}: no text after tokenization with .*erasing.json$"
  with pytest.raises(DataError, match=pattern):
    make_data(DataSpec("text", str(path), erasing_tokenizer_path, val_fraction=0.0, seed=0),
              batch_size=1, seq_len=1)


@pytest.mark.parametrize("kwargs, field", [
    ({"source": "csv"}, "source"),
    ({"val_fraction": 1.0}, "val_fraction"),
    ({"val_fraction": -0.1}, "val_fraction"),
    ({"seed": -1}, "seed"),
])
def test_bad_spec_fields(kwargs, field):
  with pytest.raises(ConfigError, match=f"^DataSpec.{field} must be"):
    DataSpec(**kwargs)
