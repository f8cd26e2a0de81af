"""Prepared corpora: a document source tokenized once into a directory, read in place.

Tokenizing at every start holds the whole corpus, its documents and its ids in each process's
memory and costs the tokenizer's time again at every resume (a 200 MB JSONL: 19 s and 1.4 GB
on a 2-core machine). `write` (`python -m moejax.data.prepare`) streams the documents
through the tokenizer once; `data.source="tokens"` then memory-maps the result, so a run starts
in a moment and every process of a job shares the operating system's page cache.

A prepared corpus is a directory:
  tokens.bin  the same token stream `make_data` builds from the documents (each document's
              ids, then EOS), little-endian uint16 where the tokenizer's ids fit, else uint32
  meta.json   FORMAT, the dtype and length, the tokenizer (name, SHA-256 of its file, vocab
              size, EOS id), the CRC-32 of tokens.bin, what it was prepared from
It is written into a directory of its own beside DIR (DIR.partial-*), synced, and renamed to DIR
when complete, so a DIR is never half written.
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import itertools
import json
import os
import secrets
import shutil
import time
import zlib
from typing import Callable, Sequence

import numpy as np

from moejax.data.iterator import IdBound
from moejax.data.sources import BUILTIN_NAME, iter_documents
from moejax.data.tokenizer import ByteTokenizer, Tokenizer, document_chunks
from moejax.errors import DataError

FORMAT = "moejax-tokens-1"
TOKENS_FILE = "tokens.bin"
META_FILE = "meta.json"
PARTIAL_SUFFIX = ".partial"
PROGRESS_SECONDS = 10.0
_META_FIELDS = {"format": str, "dtype": str, "num_tokens": int, "num_documents": int,
                "tokenizer": str, "tokenizer_sha256": str, "vocab_size": int, "eos_id": int,
                "crc32": int, "inputs": list}
_DTYPES = ("uint16", "uint32")


@dataclasses.dataclass(frozen=True)
class Prepared:
  """A prepared corpus opened for reading: `tokens_N` maps tokens.bin (no copy); `ids`, the
  bound its ids keep (its tokenizer's vocabulary size), for the readers to check each batch
  against (a size check alone passes a damaged file)."""
  tokens_N: np.ndarray
  meta: dict
  ids: IdBound


def tokenizer_sha256(tokenizer: Tokenizer) -> str:
  """What names a tokenizer's ids: the SHA-256 of its tokenizer.json ("bytes" for bytes)."""
  if isinstance(tokenizer, ByteTokenizer):
    return "bytes"
  with open(tokenizer.name, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def dtype_for(vocab_size: int) -> str:
  return "uint16" if vocab_size <= 1 << 16 else "uint32"


def write(inputs: Sequence[tuple[str, str | None]], tokenizer: Tokenizer, out: str,
          log: Callable[[str], None] | None = None) -> dict:
  """Tokenizes the documents of `inputs`, (source, path) pairs read in order (a corpus in
  shards), into the directory `out`, as `make_data` would tokenize one of them; returns its
  meta. JSONL documents are read one at a time and encoded in the tokenizer's
  `document_chunks`, so memory holds one chunk whatever the corpus's size; a text file is one
  document, read whole (and encoded in pieces: `HFTokenizer._pieces`).

  Written in a directory of its own beside `out` (DIR.partial-*), synced, then renamed: a
  preparation that fails or is interrupted removes it, one killed leaves it (never `out`), and
  two preparations of one `out` at once never mix (the second to finish is refused)."""
  if not inputs:
    raise DataError("nothing to prepare: name at least one input")
  out = os.path.abspath(out)
  if os.path.exists(out):
    raise DataError(f"{out}: already exists (remove it, or choose another output directory)")
  names = [path if source != "builtin" else BUILTIN_NAME for source, path in inputs]
  name = names[0] if len(names) == 1 else f"{len(names)} files ({names[0]}, ...)"
  started = time.perf_counter()
  # Its own name (mkdir fails on an existing one), made with the umask's mode as `out` would be.
  partial = f"{out}{PARTIAL_SUFFIX}-{os.getpid()}-{secrets.token_hex(4)}"
  try:
    os.mkdir(partial)
  except OSError as e:
    raise DataError(f"{out}: cannot be created ({e.strerror})") from None
  try:
    meta = _write_into(partial, inputs, tokenizer, name, log)
    try:
      os.rename(partial, out)
    except OSError:
      if os.path.exists(out):
        raise DataError(f"{out}: another preparation finished it first (this one's tokens are "
                        "discarded)") from None
      raise
  except OSError as e:
    shutil.rmtree(partial, ignore_errors=True)
    raise DataError(f"{e.filename or out}: {e.strerror or e}") from None
  except BaseException:
    shutil.rmtree(partial, ignore_errors=True)
    raise
  if log is not None:
    eos = getattr(tokenizer, "eos_token", "")          # None: a tokenizer.json without one
    ends = (f"each ended by id {tokenizer.eos_id}, an EOS the tokenizer lacks, added past its "
            "ids" if eos is None else f"each ended by EOS "
            + (f"{eos!r} (id {tokenizer.eos_id})" if eos else f"id {tokenizer.eos_id}"))
    log(f"moejax: prepared {name}: {meta['num_documents']:,} documents ({ends}), "
        f"{meta['num_tokens']:,} tokens ({meta['dtype']}) in {out}, "
        f"{time.perf_counter() - started:.0f} s")
  return meta


def _write_into(directory: str, inputs: Sequence[tuple[str, str | None]], tokenizer: Tokenizer,
                name: str, log: Callable[[str], None] | None) -> dict:
  dtype = np.dtype(dtype_for(tokenizer.vocab_size))
  started = last = time.perf_counter()
  num_tokens = num_documents = crc = 0
  has_text = False
  with open(os.path.join(directory, TOKENS_FILE), "wb") as f:
    docs = itertools.chain.from_iterable(iter_documents(s, p) for s, p in inputs)
    for chunk in document_chunks(docs):
      tokens_N = tokenizer.encode_documents(chunk)
      has_text = has_text or bool(np.any(tokens_N != tokenizer.eos_id))
      data = tokens_N.astype(dtype.newbyteorder("<")).tobytes()
      f.write(data)
      crc = zlib.crc32(data, crc)
      num_tokens += len(tokens_N)
      num_documents += len(chunk)
      now = time.perf_counter()
      if log is not None and now - last >= PROGRESS_SECONDS:
        log(f"moejax: preparing {name}: {num_documents:,} documents, {num_tokens:,} tokens, "
            f"{now - started:.0f} s")
        last = now
    f.flush()
    os.fsync(f.fileno())
  if not has_text:                  # as make_data refuses it
    raise DataError(f"{name}: no text after tokenization with {tokenizer.name}", "path")
  meta = {"format": FORMAT, "dtype": dtype.name, "num_tokens": num_tokens,
          # a path as absolute as the inputs' (a relative one named another file elsewhere)
          "num_documents": num_documents,
          "tokenizer": (os.path.abspath(tokenizer.name) if os.path.isfile(tokenizer.name)
                        else tokenizer.name),
          "tokenizer_sha256": tokenizer_sha256(tokenizer),
          "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id, "crc32": crc,
          "inputs": [{"source": s, "path": os.path.abspath(p) if p else ""} for s, p in inputs]}
  with open(os.path.join(directory, META_FILE), "w", encoding="utf-8") as f:
    json.dump(meta, f, indent=1)
    f.flush()
    os.fsync(f.fileno())
  return meta


def read(path: str, tokenizer: Tokenizer) -> Prepared:
  """Opens the prepared corpus `path` for `tokenizer`. Raises DataError (one line naming the
  file, with input "path" or "tokenizer") for a directory that is not a complete prepared
  corpus, or that another tokenizer prepared."""
  where = os.path.abspath(path)
  if not os.path.isdir(where):
    unfinished = sorted(glob.glob(glob.escape(where + PARTIAL_SUFFIX) + "-*"))
    if unfinished:
      raise DataError(f"{path}: not prepared ({unfinished[0]} holds a preparation that is "
                      "running or was killed: wait for it, or remove it and run python -m "
                      "moejax.data.prepare again)", "path")
    if os.path.basename(where) in (TOKENS_FILE, META_FILE):
      raise DataError(f"{path}: name the prepared directory that holds it, "
                      f"{os.path.dirname(path) or '.'}", "path")
    state = "is a file" if os.path.exists(where) else "not found"
    raise DataError(f"{path}: {state} (data.source=tokens reads a directory written by "
                    "python -m moejax.data.prepare)", "path")
  meta = _read_meta(path)
  tokens_file = os.path.join(path, TOKENS_FILE)
  dtype = np.dtype(meta["dtype"]).newbyteorder("<")
  want = meta["num_tokens"] * dtype.itemsize
  size = os.path.getsize(tokens_file) if os.path.isfile(tokens_file) else None
  if size != want:
    found = "missing" if size is None else f"{size:,} bytes"
    raise DataError(f"{tokens_file}: {found}, but {META_FILE} says {meta['num_tokens']:,} "
                    f"{meta['dtype']} tokens ({want:,} bytes): prepare the corpus again", "path")
  sha = tokenizer_sha256(tokenizer)
  if sha != meta["tokenizer_sha256"]:
    theirs, ours = (name if digest == "bytes" else f"{name}, SHA-256 {digest[:12]}..."
                    for name, digest in ((meta["tokenizer"], meta["tokenizer_sha256"]),
                                         ("this one", sha)))
    raise DataError(f"{tokenizer.name}: not the tokenizer {path} was prepared with ({theirs}; "
                    f"{ours}): name that file, or prepare the corpus with this one", "tokenizer")
  if (meta["vocab_size"], meta["eos_id"]) != (tokenizer.vocab_size, tokenizer.eos_id):
    raise DataError(f"{tokenizer.name}: resolves vocab_size {tokenizer.vocab_size} and EOS id "
                    f"{tokenizer.eos_id}, but {path} was prepared with {meta['vocab_size']} and "
                    f"{meta['eos_id']} (the files beside tokenizer.json declare the EOS): "
                    "prepare the corpus again", "tokenizer")
  tokens_N = np.memmap(tokens_file, dtype=dtype, mode="r", shape=(meta["num_tokens"],))
  return Prepared(tokens_N=tokens_N, meta=meta, ids=IdBound(meta["vocab_size"], tokens_file))


def _read_meta(path: str) -> dict:
  meta_file = os.path.join(path, META_FILE)
  try:
    with open(meta_file, encoding="utf-8") as f:
      meta = json.load(f)
  except FileNotFoundError:
    raise DataError(f"{path}: no {META_FILE}: not a directory written by "
                    "python -m moejax.data.prepare", "path") from None
  except (OSError, ValueError) as e:
    raise DataError(f"{meta_file}: unreadable ({e}): prepare the corpus again", "path") from None
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
    raise DataError(f"{meta_file}: format {found!r}, expected {FORMAT!r}", "path")
  for field, kind in _META_FIELDS.items():
    value = meta.get(field)
    if not isinstance(value, kind) or isinstance(value, bool):
      raise DataError(f"{meta_file}: field {field!r} is {value!r}, expected "
                      f"{kind.__name__}: prepare the corpus again", "path")
  if meta["dtype"] not in _DTYPES:
    raise DataError(f"{meta_file}: dtype {meta['dtype']!r} (expected one of {_DTYPES}): prepare "
                    "the corpus again", "path")
  for field, low, high in (("num_tokens", 1, None), ("num_documents", 1, None),
                           ("vocab_size", 1, None), ("eos_id", 0, None), ("crc32", 0, 1 << 32)):
    if meta[field] < low or (high is not None and meta[field] >= high):
      valid = f">= {low}" if high is None else f"in [{low}, {high})"
      raise DataError(f"{meta_file}: {field}={meta[field]} (expected {valid}): prepare the "
                      "corpus again", "path")
  return meta


def verify(path: str) -> None:
  """Reads tokens.bin whole and checks its CRC-32 against meta.json (a copy's integrity);
  raises DataError if they differ."""
  meta = _read_meta(path)
  crc = 0
  try:
    with open(os.path.join(path, TOKENS_FILE), "rb") as f:
      for block in iter(lambda: f.read(1 << 24), b""):
        crc = zlib.crc32(block, crc)
  except OSError as e:
    raise DataError(f"{os.path.join(path, TOKENS_FILE)}: unreadable ({e.strerror})",
                    "path") from None
  if crc != meta["crc32"]:
    raise DataError(f"{os.path.join(path, TOKENS_FILE)}: CRC-32 {crc:#010x}, {META_FILE} says "
                    f"{meta['crc32']:#010x}: the file is damaged; prepare the corpus again",
                    "path")
