"""Document sources: the built-in corpus, a plain text file, a JSONL file.

- "builtin": the English documentation that ships with CPython (`pydoc_data.topics`), one
  document per topic, in sorted topic order. Needs no download and no path.
- "text": a UTF-8 text file (a leading byte-order mark is dropped); the whole file is one
  document (use JSONL for many documents).
- "jsonl": one JSON object per line with a string field `text`, one document per line. Blank
  lines are skipped.

Every problem with a file raises `DataError` with a one-line message that starts with the path.
"""
from __future__ import annotations

import json
import os

from moejax.errors import DataError

SOURCES = ("builtin", "text", "jsonl")
BUILTIN_NAME = "builtin corpus (pydoc_data.topics)"


def load_documents(source: str, path: str | None) -> list[str]:
  """Returns the documents of `source`, in a fixed order."""
  if source == "builtin":
    if path:
      raise DataError(f"source 'builtin' takes no path, got {path!r}")
    return _builtin()
  if source not in SOURCES:
    raise DataError(f"unknown data source {source!r}; valid: {', '.join(SOURCES)}")
  if not path:
    raise DataError(f"source {source!r} needs a path to a file")
  text = _read_text(path)
  docs = [text] if source == "text" else _parse_jsonl(path, text)
  if not any(d.strip() for d in docs):
    raise DataError(f"{path}: file has no text")
  return docs


def _builtin() -> list[str]:
  from pydoc_data.topics import topics  # pylint: disable=g-import-not-at-top

  return [topics[k] for k in sorted(topics)]


def _read_text(path: str) -> str:
  if not os.path.exists(path):
    if any(c in path for c in "*?["):
      raise DataError(f"{path}: file not found (a pattern is not expanded: name one file; one "
                      "JSONL file holds many documents)")
    raise DataError(f"{path}: file not found")
  if not os.path.isfile(path):
    raise DataError(f"{path}: not a regular file")
  with open(path, "rb") as f:
    raw = f.read()
  if not raw:
    raise DataError(f"{path}: file is empty")
  try:
    return raw.decode("utf-8-sig")   # a byte-order mark is not text
  except UnicodeDecodeError as e:
    raise DataError(f"{path}: not UTF-8 text (bad byte at offset {e.start})") from None


def _parse_jsonl(path: str, text: str) -> list[str]:
  docs = []
  for lineno, line in enumerate(text.split("\n"), start=1):
    if not line.strip():
      continue
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
    docs.append(obj["text"])
  return docs
