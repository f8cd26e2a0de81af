"""Document sources: the built-in corpus, text and JSONL files, and their errors."""
import json
import re

import pytest

from moejax.data.sources import load_documents
from moejax.errors import DataError


def _raises(path, problem):
  """pytest.raises for a one-line DataError that starts with `path` and ends with `problem`."""
  return pytest.raises(DataError, match=f"^{re.escape(str(path))}{problem}$")


def test_builtin_is_pydoc_topics_in_sorted_order():
  from pydoc_data.topics import topics

  docs = load_documents("builtin", None)
  assert docs == [topics[k] for k in sorted(topics)]
  assert len(docs) >= 50
  assert sum(map(len, docs)) > 300_000
  assert any("assert" in d for d in docs)


def test_builtin_takes_no_path(tmp_path):
  with pytest.raises(DataError, match="^source 'builtin' takes no path"):
    load_documents("builtin", str(tmp_path))


def test_text_file_is_one_document(tmp_path):
  path = tmp_path / "a.txt"
  path.write_text("first line\n\nsecond paragraph é\n", encoding="utf-8")
  assert load_documents("text", str(path)) == ["first line\n\nsecond paragraph é\n"]


def test_jsonl_one_document_per_line_blank_lines_skipped(tmp_path):
  path = tmp_path / "a.jsonl"
  lines = [json.dumps({"text": "one", "id": 1}), "", json.dumps({"text": "two\nlines"}),
           "  ", json.dumps({"text": "three\u2028sep"})]
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")
  assert load_documents("jsonl", str(path)) == ["one", "two\nlines", "three\u2028sep"]


@pytest.mark.parametrize("source", ["text", "jsonl"])
def test_missing_file(tmp_path, source):
  path = tmp_path / "missing.txt"
  with _raises(path, ": file not found"):
    load_documents(source, str(path))
  pattern = tmp_path / "*.jsonl"
  (tmp_path / "a.jsonl").write_text('{"text": "a"}')
  with _raises(pattern, re.escape(": file not found (a pattern is not expanded: name one file; "
                                  "one JSONL file holds many documents)")):
    load_documents(source, str(pattern))


def test_a_byte_order_mark_is_not_text(tmp_path):
  (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfhello")
  (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "hi"}\n')
  assert load_documents("text", str(tmp_path / "bom.txt")) == ["hello"]
  assert load_documents("jsonl", str(tmp_path / "bom.jsonl")) == ["hi"]   # was refused


@pytest.mark.parametrize("source", ["text", "jsonl"])
def test_empty_file(tmp_path, source):
  path = tmp_path / "empty"
  path.write_bytes(b"")
  with _raises(path, ": file is empty"):
    load_documents(source, str(path))


def test_whitespace_only_text_file(tmp_path):
  path = tmp_path / "blank.txt"
  path.write_text(" \n\t\n")
  with _raises(path, ": file has no text"):
    load_documents("text", str(path))


def test_jsonl_with_only_empty_texts(tmp_path):
  path = tmp_path / "blank.jsonl"
  path.write_text('{"text": ""}\n{"text": "  "}\n')
  with _raises(path, ": file has no text"):
    load_documents("jsonl", str(path))


def test_directory_is_not_a_file(tmp_path):
  with _raises(tmp_path, ": not a regular file"):
    load_documents("text", str(tmp_path))


def test_not_utf8(tmp_path):
  path = tmp_path / "latin1.txt"
  path.write_bytes("abc é".encode("latin-1"))
  with _raises(path, r": not UTF-8 text \(bad byte at offset 4\)"):
    load_documents("text", str(path))


@pytest.mark.parametrize("bad_line, problem", [
    ('{"text": "unterminated', r":3: not valid JSON \(.*\)"),
    ('{"body": "x"}', r":3: expected a string field 'text', no field 'text'"),
    ('{"text": 7}', r":3: expected a string field 'text', 'text' is int"),
    ('["text"]', r":3: expected a JSON object with a string field 'text', got list"),
])
def test_bad_jsonl_line_names_line_number(tmp_path, bad_line, problem):
  path = tmp_path / "bad.jsonl"
  path.write_text(f'{{"text": "ok"}}\n\n{bad_line}\n{{"text": "after"}}\n')
  with _raises(path, problem):
    load_documents("jsonl", str(path))


def test_unknown_source_and_missing_path():
  with pytest.raises(DataError, match="^unknown data source 'csv'; valid: builtin, text, jsonl$"):
    load_documents("csv", "x.csv")
  with pytest.raises(DataError, match="^source 'jsonl' needs a path to a file$"):
    load_documents("jsonl", None)
