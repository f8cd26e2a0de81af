"""Byte and tokenizer.json tokenizers: round trips, EOS choice, load errors, check_vocab."""
import json
import re

import numpy as np
import pytest
from tokenizers import Tokenizer

from moejax.data.tokenizer import ByteTokenizer, HFTokenizer, check_vocab, load_tokenizer
from moejax.errors import DataError


def test_bytes_round_trip_non_ascii():
  tok = load_tokenizer("bytes")
  text = "héllo ✓ 🙂 \x00 end"
  ids = tok.encode(text)
  assert isinstance(tok, ByteTokenizer)
  assert ids == list(text.encode("utf-8"))
  assert tok.decode(ids) == text
  assert tok.decode(np.asarray(ids + [tok.eos_id], np.int32)) == text  # EOS decodes to nothing.
  assert (tok.vocab_size, tok.eos_id) == (257, 256)


def test_bytes_encode_documents_appends_eos_after_each():
  tok = ByteTokenizer()
  tokens_N = tok.encode_documents(["ab", "", "é"])
  assert tokens_N.dtype == np.int32
  assert tokens_N.tolist() == [97, 98, 256, 256, 0xC3, 0xA9, 256]


def test_hf_word_level_eos_from_vocab(word_tokenizer_path):
  tok = load_tokenizer(word_tokenizer_path)
  raw = Tokenizer.from_file(word_tokenizer_path)
  assert isinstance(tok, HFTokenizer)
  assert tok.eos_id == raw.token_to_id("<|endoftext|>")
  assert tok.vocab_size == raw.get_vocab_size()
  ids = tok.encode("the dog sang")
  assert ids == [raw.token_to_id(w) for w in ("the", "dog", "sang")]
  assert tok.decode(ids + [tok.eos_id]) == "the dog sang"
  tokens_N = tok.encode_documents(["the cat", "a song"])
  assert tokens_N.tolist() == tok.encode("the cat") + [tok.eos_id] + tok.encode("a song") + [
      tok.eos_id]


def test_hf_folder_path_reads_tokenizer_json(word_tokenizer_path):
  folder = word_tokenizer_path.rsplit("/", 1)[0]
  assert load_tokenizer(folder).encode("the cat") == load_tokenizer(word_tokenizer_path).encode(
      "the cat")


def test_hf_without_eos_token_gets_one_extra_id(bpe_no_eos_path):
  tok = load_tokenizer(bpe_no_eos_path)
  file_ids = Tokenizer.from_file(bpe_no_eos_path).get_vocab_size()
  assert tok.eos_token is None
  assert (tok.eos_id, tok.vocab_size) == (file_ids, file_ids + 1)
  ids = tok.encode("the mat")
  assert max(ids) < file_ids
  assert tok.decode(ids + [tok.eos_id]) == tok.decode(ids)
  assert "mat" in tok.decode(ids)


def test_missing_tokenizer_file(tmp_path):
  path = str(tmp_path / "nope.json")
  with pytest.raises(DataError, match=f"^{re.escape(path)}: tokenizer file not found$"):
    load_tokenizer(path)
  # A checkpoint that ships a tiktoken tokenizer instead (Kimi-K2): said so, with the way out.
  (tmp_path / "tiktoken.model").write_text("aGVsbG8= 0\n")
  with pytest.raises(DataError, match="holds a tiktoken tokenizer .* set --config.data.tokenizer"):
    load_tokenizer(str(tmp_path))


@pytest.mark.parametrize("content", ["{not json", json.dumps({"model": 3})])
def test_unparseable_tokenizer_file(tmp_path, content):
  path = tmp_path / "tokenizer.json"
  path.write_text(content)
  pattern = f"^{re.escape(str(path))}: not a valid tokenizer.json \\("
  with pytest.raises(DataError, match=pattern) as e:
    load_tokenizer(str(path))
  assert "\n" not in str(e.value)


def test_check_vocab(word_tokenizer_path):
  check_vocab(ByteTokenizer(), 257)
  check_vocab(ByteTokenizer(), 50304)
  with pytest.raises(DataError, match="^bytes: tokenizer vocab_size 257 exceeds the model's "
                                      "vocab_size 256;"):
    check_vocab(ByteTokenizer(), 256)
  tok = load_tokenizer(word_tokenizer_path)
  pattern = f"^{re.escape(word_tokenizer_path)}: .* {tok.vocab_size} .* vocab_size 4;"
  with pytest.raises(DataError, match=pattern):
    check_vocab(tok, 4)


def test_hf_eos_is_the_one_the_checkpoint_declares(tmp_path):
  """DeepSeek's EOS ('<｜end▁of▁sentence｜>', id 1) is none of EOS_CANDIDATES: the checkpoint's
  tokenizer_config.json or config.json (hf_config.json after from-hf) names it."""
  from tokenizers import models, pre_tokenizers
  eos = "<｜end▁of▁sentence｜>"
  vocab = {"<｜begin▁of▁sentence｜>": 0, eos: 1, "</s>": 2,
           **{w: i + 3 for i, w in enumerate(["a", "b", "c"])}}
  raw = Tokenizer(models.WordLevel(vocab, unk_token="a"))
  raw.pre_tokenizer = pre_tokenizers.Whitespace()
  declared = {"tokenizer_config.json": {"eos_token": {"content": eos, "special": True}},
              "config.json": {"eos_token_id": 1}, "hf_config.json": {"eos_token_id": [1, 2]},
              # a multimodal config.json (Llama 4's) declares it for its text model
              "multimodal/config.json": {"model_type": "llama4",
                                         "text_config": {"eos_token_id": [1, 2]}}}
  for name, content in [(None, None), *declared.items()]:
    folder = tmp_path / (name.split("/")[0] if name else "none")
    folder.mkdir()
    raw.save(str(folder / "tokenizer.json"))
    if name:
      (folder / name.split("/")[-1]).write_text(json.dumps(content), encoding="utf-8")
    tok = load_tokenizer(str(folder))
    if name is None:                       # nothing declared: the first candidate in the vocab
      assert (tok.eos_token, tok.eos_id) == ("</s>", 2)
    else:
      assert (tok.eos_token, tok.eos_id, tok.vocab_size) == (eos, 1, 6), name
  (tmp_path / "none" / "config.json").write_text('{"eos_token_id": 99}', encoding="utf-8")
  assert load_tokenizer(str(tmp_path / "none")).eos_id == 2    # an id outside the vocab: ignored


def _llama2_style(path) -> str:
  """A BPE whose normalizer prepends "▁" to every text (Llama 2's tokenizer.json): a text's
  start is seen, so no document can be cut."""
  from tokenizers import models, normalizers, trainers
  from tests.data.conftest import SENTENCES
  tok = Tokenizer(models.BPE(unk_token="[UNK]"))
  tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
  tok.train_from_iterator(SENTENCES * 3, trainers.BpeTrainer(vocab_size=120,
                                                             special_tokens=["[UNK]", "</s>"]))
  tok.save(str(path))
  return str(path)


# Llama 3's (and Qwen's, DeepSeek's) split pattern: a run of punctuation joins the newline after.
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                   r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _llama3_style(path, text) -> str:
  from tokenizers import Regex, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.train_from_iterator([text], trainers.BpeTrainer(
      vocab_size=280, special_tokens=["<|endoftext|>"], show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.save(str(path))
  return str(path)


@pytest.mark.parametrize("kind", ["byte_level", "sees_starts", "added_token_across_spaces",
                                  "punctuation_runs"])
def test_a_long_document_is_encoded_in_pieces_with_the_ids_of_it_whole(
    kind, bpe_no_eos_path, tmp_path, monkeypatch):
  """A document over PIECE_CHARS is encoded in pieces (bounded memory: a 25 MB document whole
  held 3.3 GB) only where a cut changes no id: the ids are those of the document whole."""
  from moejax.data import tokenizer as tokenizer_lib
  from tests.data.conftest import SENTENCES, word_level
  monkeypatch.setattr(tokenizer_lib, "PIECE_CHARS", 40)
  monkeypatch.setattr(tokenizer_lib, "CUT_CHECK_CHARS", 12)
  doc = ". ".join(SENTENCES * 20) + "\nthe end"
  if kind == "byte_level":
    path = bpe_no_eos_path
  elif kind == "sees_starts":
    path = _llama2_style(tmp_path / "llama2.json")
  elif kind == "punctuation_runs":
    # runs of dashes longer than the check's text, each ended by a newline: BPE merges a run by
    # its whole length, so a check that sees part of one passes cuts that change ids
    # (each run longer than a piece, so a piece's end falls in one and the next place to cut
    # after it is the newline that ends the run: refused, as it follows punctuation)
    doc = "".join(f"{SENTENCES[n % 3]}\n{'-' * n}\nnext {SENTENCES[n % 2]} " for n in range(41, 90))
    path = _llama3_style(tmp_path / "llama3.json", doc * 3 + "ab-\n" * 300)   # merges "-\n"
  else:
    # "cat sat" one added token: a cut between its words would split it, so the check refuses
    # those places and cuts at the next
    raw = word_level(SENTENCES)
    raw.add_tokens(["cat sat"])
    path = str(tmp_path / "added.json")
    raw.save(path)
  tok = load_tokenizer(path)
  raw = Tokenizer.from_file(path)
  pieces = tok._pieces(doc)
  assert "".join(pieces) == doc
  if kind == "sees_starts":
    assert pieces == [doc] and not tok._cuttable
  else:
    assert len(pieces) > 20 and tok._cuttable
  if kind == "added_token_across_spaces":
    assert not any(a.endswith("cat") and b.startswith(" sat") for a, b in zip(pieces, pieces[1:]))
    assert raw.token_to_id("cat sat") in tok.encode(doc)
  got = tok.encode_documents(["a b", doc, "", doc[:100]])
  want = [raw.encode(d, add_special_tokens=False).ids + [tok.eos_id]
          for d in ("a b", doc, "", doc[:100])]
  assert got.tolist() == [i for ids in want for i in ids]
  if kind != "sees_starts":
    # a stretch with nowhere to cut stays whole, and later documents are still cut
    assert tok._pieces("x" * 200) == ["x" * 200]
    assert tok._pieces(doc) == pieces
