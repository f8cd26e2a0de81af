"""Document sources: the built-in corpus, a plain text file, a JSONL file.

- "builtin": the English documentation that ships with CPython (`pydoc_data.topics`), one
  document per topic, in sorted topic order. Needs no download and no path.
- "text": a UTF-8 text file (a leading byte-order mark is dropped); the whole file is one
  document (use JSONL for many documents).
- "jsonl": one JSON object per line with a string field `text`, one document per line. Blank
  lines are skipped.
- "tokens" is not a document source: a directory written by `python -m moejax.data.prepare`
  (`moejax.data.prepared`), the token stream of one of the above.

Every problem with a file raises `DataError` with a one-line message that starts with the path.
"""
from __future__ import annotations

import json
import os
from typing import Iterator

from moejax.errors import DataError

DOCUMENT_SOURCES = ("builtin", "text", "jsonl")
# "tokens": a corpus tokenized once into a directory (moejax.data.prepared), read in place.
SOURCES = DOCUMENT_SOURCES + ("tokens",)
BUILTIN_NAME = "builtin corpus (pydoc_data.topics)"


def source_of(path: str, source: str | None = None) -> str:
  """What a command's `--data PATH [--source S]` reads: `source` if given, else by the name:
  'builtin', tokens for a directory, jsonl for a .jsonl file, text otherwise."""
  if path == "builtin":
    if source is not None:
      raise DataError(f"--source={source} reads a file; --data builtin is the built-in corpus")
    return "builtin"
  if source is None and os.path.isdir(path):
    return "tokens"
  return source or ("jsonl" if path.endswith(".jsonl") else "text")


def load_documents(source: str, path: str | None) -> list[str]:
  """Returns the documents of `source`, in a fixed order."""
  return list(iter_documents(source, path))


def iter_documents(source: str, path: str | None) -> Iterator[str]:
  """The documents of `source`, in a fixed order, one at a time: a JSONL file is read line by
  line, so memory holds one document (`python -m moejax.data.prepare` streams a corpus larger
  than memory). Raises DataError as `load_documents` does; a file with no text is refused
  after its last line."""
  if source == "builtin":
    if path:
      raise DataError(f"source 'builtin' takes no path, got {path!r}")
    yield from _builtin()
    return
  if source not in DOCUMENT_SOURCES:
    raise DataError(f"unknown data source {source!r}; valid: {', '.join(DOCUMENT_SOURCES)}")
  if not path:
    raise DataError(f"source {source!r} needs a path to a file")
  _check_file(path)
  docs = iter([_read_text(path)]) if source == "text" else _jsonl_documents(path)
  has_text = False
  for doc in docs:
    has_text = has_text or bool(doc.strip())
    yield doc
  if not has_text:
    raise DataError(f"{path}: file has no text")


def _builtin() -> list[str]:
  from pydoc_data.topics import topics  # pylint: disable=g-import-not-at-top

  return [topics[k] for k in sorted(topics)]


def _check_file(path: str) -> None:
  if not os.path.exists(path):
    if any(c in path for c in "*?["):
      raise DataError(f"{path}: file not found (a pattern is not expanded: name one file; one "
                      "JSONL file holds many documents)")
    raise DataError(f"{path}: file not found")
  if not os.path.isfile(path):
    raise DataError(f"{path}: not a regular file")
  if os.path.getsize(path) == 0:
    raise DataError(f"{path}: file is empty")


def _read_text(path: str) -> str:
  with open(path, "rb") as f:
    raw = f.read()
  return _decode(path, raw, 0)


def _decode(path: str, raw: bytes, offset: int) -> str:
  """`raw` (read from `path` at byte `offset`) as text; a byte-order mark at the file's start
  is not text."""
  try:
    return raw.decode("utf-8-sig" if offset == 0 else "utf-8")
  except UnicodeDecodeError as e:
    raise DataError(f"{path}: not UTF-8 text (bad byte at offset {offset + e.start})") from None


def _jsonl_documents(path: str) -> Iterator[str]:
  offset = 0
  with open(path, "rb") as f:
    for lineno, raw in enumerate(f, start=1):
      line = _decode(path, raw, offset)
      offset += len(raw)
      if line.strip():
        yield _jsonl_document(path, lineno, line)


def _jsonl_document(path: str, lineno: int, line: str) -> str:
  try:
    obj = json.loads(line)
  except json.JSONDecodeError as e:
    raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
  if not isinstance(obj, dict):
    raise DataError(f"{path}:{lineno}: expected a JSON object with a string field 'text', "
                    f"got {type(obj).__name__}")
  if not isinstance(obj.get("text"), str):
    found = "no field 'text'" if "text" not in obj else f"'text' is {type(obj['text']).__name__}"
    raise DataError(f"{path}:{lineno}: expected a string field 'text', {found}")
  return obj["text"]
