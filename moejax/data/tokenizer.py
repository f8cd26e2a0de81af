"""Tokenizers: bytes, or a Hugging Face `tokenizer.json`, behind one small interface.

Both classes have `name`, `vocab_size`, `eos_id`, `encode(text) -> list[int]`,
`decode(ids) -> str` and `encode_documents(docs, progress=None) -> int32[N]`, the token stream the pipeline
trains on: every document's ids followed by `eos_id`. `encode` adds no special tokens (no BOS,
no post-processor template) unless asked (`special_tokens=True`: a prompt for generation, as
transformers encodes it); documents are separated by the one EOS that `encode_documents`
appends. `decode` leaves special tokens (EOS included) out of the text.
"""
from __future__ import annotations

import json
import os
import re
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from moejax.errors import DataError

ENCODE_CHUNK_CHARS = 1 << 22   # characters a Hugging Face tokenizer encodes per batch
ENCODE_CHUNK_DOCUMENTS = 1 << 14   # and at most this many documents (empty ones take no chars)
# A longer document is encoded in pieces of about this many characters (a tokenizer holds about
# 130 bytes a character while it encodes one text: a 25 MB document whole peaked at 3.3 GB).
PIECE_CHARS = 1 << 20
CUT_CHECK_CHARS = 256   # the text either side of a cut encoded whole and in two, to check it
CUT_TRIES = 8           # candidates tried for one cut before the rest is encoded whole
# Where a piece may end: after a letter or digit, before a space or newline and a non-space (not
# after punctuation: Llama 3's pattern glues a run of it to the newline after, and a run longer
# than the check's text merges by its whole length).
_CUT = re.compile(r"(?<=[^\W_])[ \n](?=\S)")
# A text whose cut any tokenizer that may cut passes: one that fails it sees a text's start.
_PROBE = ("the cat sat on the mat", " and the dog ran in the park")
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"   # beside tokenizer.json: may declare the EOS
# Looked up in this order in a tokenizer.json's vocabulary; the first one present is EOS.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eos|>", "[EOS]")


class ByteTokenizer:
  """UTF-8 bytes: ids 0..255 are the bytes, 256 is EOS."""

  name = "bytes"
  eos_id = 256
  vocab_size = 257

  def encode(self, text: str, special_tokens: bool = False) -> list[int]:
    del special_tokens   # bytes have none
    return _utf8(text).tolist()

  def decode(self, ids: Iterable[int]) -> str:
    ids_N = _as_ids(ids)
    return ids_N[ids_N < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

  def encode_documents(self, docs: Sequence[str],
                       progress: Callable[[int, int], None] | None = None) -> np.ndarray:
    del progress   # one pass over the bytes: fast
    eos_1 = np.full((1,), self.eos_id, np.int32)
    return _concat_with_eos([_utf8(d) for d in docs], eos_1)

  def __repr__(self) -> str:
    return "ByteTokenizer()"


class HFTokenizer:
  """A `tokenizers.Tokenizer` read from a tokenizer.json file (or a folder holding one).

  EOS is the one the checkpoint declares beside the file (`tokenizer_config.json`'s `eos_token`,
  else the `eos_token_id` of `config.json` or of a from-hf checkpoint's `hf_config.json`: the id
  the model was trained to end documents with, e.g. DeepSeek's `<｜end▁of▁sentence｜>`), else the
  first of `EOS_CANDIDATES` in the vocabulary. A tokenizer that has none of them gets one extra
  id right after its largest id, so that `vocab_size` is one more than the file's; that id
  decodes to nothing.
  """

  def __init__(self, path: str):
    import tokenizers  # Imported here: only needed for tokenizer.json files.

    if os.path.isdir(path):
      path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
      beside = os.path.dirname(path)
      if os.path.isfile(os.path.join(beside, "tiktoken.model")):   # Kimi-K2's, for one
        raise DataError(f"{path}: tokenizer file not found; {beside} holds a tiktoken tokenizer "
                        "(tiktoken.model), which moejax does not read: set --config.data.tokenizer "
                        "to a tokenizer.json of the same vocabulary")
      raise DataError(f"{path}: tokenizer file not found")
    try:
      self._tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception for every parse error.
      reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      raise DataError(f"{path}: not a valid tokenizer.json ({reason})") from None
    self.name = path
    self._cuttable = None          # whether long documents may be cut (`_may_cut`), once known
    vocab = self._tok.get_vocab(with_added_tokens=True)
    if not vocab:
      raise DataError(f"{path}: tokenizer has an empty vocabulary")
    num_ids = max(vocab.values()) + 1
    eos = _declared_eos(os.path.dirname(os.path.abspath(path)), vocab)
    if eos is None:
      eos = next((t for t in EOS_CANDIDATES if t in vocab), None)
    if eos is not None:
      self.eos_token, self.eos_id, self.vocab_size = eos, vocab[eos], num_ids
    else:
      self.eos_token, self.eos_id, self.vocab_size = None, num_ids, num_ids + 1

  def encode(self, text: str, special_tokens: bool = False) -> list[int]:
    """`special_tokens`: apply the file's post-processor (e.g. the BOS that Llama-style
    tokenizers put in front), as transformers' tokenizer does by default; for a prompt."""
    return self._tok.encode(text, add_special_tokens=special_tokens).ids

  def decode(self, ids: Iterable[int]) -> str:
    ids_N = _as_ids(ids)
    if self.eos_token is None:
      ids_N = ids_N[ids_N != self.eos_id]
    return self._tok.decode(ids_N.tolist(), skip_special_tokens=True)

  def encode_documents(self, docs: Sequence[str],
                       progress: Callable[[int, int], None] | None = None) -> np.ndarray:
    """`progress(documents done, documents)` after each chunk. Encoded in `document_chunks`,
    whose ids are kept as int32 and their `Encoding`s dropped (each holds offsets and token
    strings: one batch of a 60 MB JSONL peaked at 3.9 GB)."""
    eos_1 = np.full((1,), self.eos_id, np.int32)
    ids, done = [], 0
    for chunk in document_chunks(docs):
      pieces, ends = [], []          # a document longer than PIECE_CHARS is several pieces
      for doc in chunk:
        pieces.extend(self._pieces(doc))
        ends.append(len(pieces))
      piece_ids = []
      for batch in document_chunks(pieces):   # a long document's pieces a batch's worth at once
        piece_ids.extend(self._encode_batch(batch))
      start = 0
      for end in ends:
        ids.append(piece_ids[start] if end == start + 1 else np.concatenate(piece_ids[start:end]))
        start = end
      done += len(chunk)
      if progress is not None:
        progress(done, len(docs))
    return _concat_with_eos(ids, eos_1)

  def _encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)   # no offsets
    return [np.asarray(e.ids, np.int32) for e in encode(texts, add_special_tokens=False)]

  def _pieces(self, doc: str) -> list[str]:
    """`doc` cut about every PIECE_CHARS characters where the cut changes no id (`_cut_keeps_ids`).
    A tokenizer without a pre-tokenizer, or one that sees a text's start (a normalizer that
    prepends "▁" to every text, as Llama 2's), keeps its documents whole; so does a stretch with
    no such place (CUT_TRIES candidates tried for each cut: the rest stays one piece)."""
    if len(doc) <= PIECE_CHARS or not self._may_cut():
      return [doc]
    pieces, start = [], 0
    while len(doc) - start > PIECE_CHARS:
      cut = next((m.start() for _, m in zip(range(CUT_TRIES),
                                             _CUT.finditer(doc, start + PIECE_CHARS))
                  if self._cut_keeps_ids(doc, m.start())), None)
      if cut is None:
        break
      pieces.append(doc[start:cut])
      start = cut
    pieces.append(doc[start:])
    return pieces

  def _may_cut(self) -> bool:
    """Whether documents may be cut at all: the tokenizer splits text into words before its
    model (a pre-tokenizer) and encodes the probe text in two halves as whole."""
    if self._cuttable is None:
      text = "".join(_PROBE)
      self._cuttable = (self._tok.pre_tokenizer is not None
                        and self._cut_keeps_ids(text, len(_PROBE[0]), margin=len(_PROBE[0])))
    return self._cuttable

  def _cut_keeps_ids(self, doc: str, cut: int, margin: int = CUT_CHECK_CHARS) -> bool:
    """Whether cutting `doc` at `cut` changes no id: in the `margin` characters either side the
    pre-tokenizer's words do not cross the cut (nor does the word at the cut touch the text's
    ends), and the text encodes to the same ids whole as in its two halves."""
    left, right = doc[max(0, cut - margin):cut], doc[cut:cut + margin]
    spans = [span for _, span in self._tok.pre_tokenizer.pre_tokenize_str(left + right)]
    at = len(left)
    if (any(a < at < b for a, b in spans) or sum(b <= at for _, b in spans) < 2
        or sum(a >= at for a, _ in spans) < 2):
      return False
    whole, a, b = self._encode_batch([left + right, left, right])
    return np.array_equal(whole, np.concatenate([a, b]))

  def __repr__(self) -> str:
    return f"HFTokenizer({self.name!r})"


Tokenizer = ByteTokenizer | HFTokenizer


def document_chunks(docs: Iterable[str]) -> Iterator[list[str]]:
  """`docs` in order, in lists of about ENCODE_CHUNK_CHARS characters (the document that
  reaches it included) or ENCODE_CHUNK_DOCUMENTS documents: what a tokenizer encodes at once.
  Documents are encoded apart, so the chunks change no id; `docs` is read as it goes."""
  chunk, chars = [], 0
  for doc in docs:
    chunk.append(doc)
    chars += len(doc)
    if chars >= ENCODE_CHUNK_CHARS or len(chunk) >= ENCODE_CHUNK_DOCUMENTS:
      yield chunk
      chunk, chars = [], 0
  if chunk:
    yield chunk


def read_json(path: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, ValueError):
    return {}
  return data if isinstance(data, dict) else {}


def _declared_eos(directory: str, vocab: dict) -> str | None:
  """The EOS token the checkpoint's files beside tokenizer.json name, if it is in `vocab`."""
  token = read_json(os.path.join(directory, TOKENIZER_CONFIG_FILE)).get("eos_token")
  if isinstance(token, dict):
    token = token.get("content")
  if isinstance(token, str) and token in vocab:
    return token
  by_id = {i: t for t, i in vocab.items()}
  for name in ("config.json", "hf_config.json"):
    config = read_json(os.path.join(directory, name))
    text = config.get("text_config")       # a multimodal config's text model (Llama 4's)
    ids = config.get("eos_token_id", text.get("eos_token_id") if isinstance(text, dict) else None)
    for i in ids if isinstance(ids, list) else [ids]:
      if isinstance(i, int) and i in by_id:
        return by_id[i]
  return None


def load_tokenizer(spec: str) -> Tokenizer:
  """"bytes" -> ByteTokenizer; anything else is a path to a tokenizer.json (or its folder)."""
  if spec == "bytes":
    return ByteTokenizer()
  return HFTokenizer(spec)


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
  """Raises DataError if the tokenizer can produce ids the model's embedding cannot hold."""
  if tokenizer.vocab_size > model_vocab_size:
    raise DataError(
        f"{tokenizer.name}: tokenizer vocab_size {tokenizer.vocab_size} exceeds the model's "
        f"vocab_size {model_vocab_size}; set config.model.vocab_size to at least "
        f"{tokenizer.vocab_size}")


def _as_ids(ids: Iterable[int]) -> np.ndarray:
  return np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), np.int64).reshape(-1)


def _utf8(text: str) -> np.ndarray:
  return np.frombuffer(text.encode("utf-8"), np.uint8)


def _concat_with_eos(ids: list[np.ndarray], eos_1: np.ndarray) -> np.ndarray:
  parts = []
  for ids_N in ids:
    parts.extend((ids_N, eos_1))
  return np.concatenate(parts).astype(np.int32) if parts else np.zeros((0,), np.int32)
