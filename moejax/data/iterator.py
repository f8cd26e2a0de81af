"""The training batch iterator: shuffled windows of a token stream, resumable from a small state.

Letters: N tokens, W windows, S sequence length, L = S + 1 tokens per window, B batch size.

Window w is `tokens[w*S : w*S + L]`, so consecutive windows share one token and every token but
the first is a target exactly once per epoch. The pipeline is grain's MapDataset: windows ->
shuffle -> repeat forever -> batch. Grain's shuffle of a repeated dataset draws a new permutation
for each epoch from (seed, epoch). Epochs count windows, so a batch may straddle two epochs and
no window is ever dropped.

The position is grain's index of the next batch. `get_state()` returns it together with what the
stream was built from (seed, shapes, token count and checksum), all plain ints; `set_state()`
refuses a state from a different stream rather than silently yielding other batches.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import functools
import os
import zlib

import grain
import numpy as np

from moejax.errors import DataError


def num_windows(num_tokens: int, seq_len: int) -> int:
  """How many windows of seq_len + 1 tokens, with stride seq_len, fit in num_tokens."""
  return max(num_tokens - 1, 0) // seq_len


def windows(tokens_N: np.ndarray, seq_len: int) -> np.ndarray:
  """[W, L] read-only view of the windows of tokens_N (no copy; tokens_N's dtype, int32 when
  there is none)."""
  w = num_windows(len(tokens_N), seq_len)
  if w == 0:
    return np.zeros((0, seq_len + 1), np.int32)
  view_NxL = np.lib.stride_tricks.sliding_window_view(tokens_N, seq_len + 1)
  return view_NxL[: w * seq_len : seq_len]


def to_example(windows_BxL: np.ndarray, ids: IdBound | None = None) -> dict[str, np.ndarray]:
  """Batch of windows -> {"inputs": int32[B, S], "targets": int32[B, S]} (targets shifted by 1).
  `ids`: the bound a prepared corpus's ids must keep (`IdBound.check`)."""
  if ids is not None:
    ids.check(windows_BxL)
  return {
      "inputs": np.ascontiguousarray(windows_BxL[:, :-1], np.int32),
      "targets": np.ascontiguousarray(windows_BxL[:, 1:], np.int32),
  }


@dataclasses.dataclass(frozen=True)
class IdBound:
  """Ids read from a file (a prepared corpus) stay below its tokenizer's vocabulary size
  `limit`: one at or above it is a damaged file, which the model would read as an embedding row
  of NaNs or another token's. `where` names the file."""
  limit: int
  where: str

  def check(self, ids: np.ndarray) -> None:
    """Raises DataError (input "path") if any of `ids` is at or above the limit."""
    top = int(ids.max(initial=0))
    if top >= self.limit:
      raise DataError(f"{self.where}: token id {top} read, outside the {self.limit} ids of the "
                      "tokenizer it was prepared with: the file is damaged (python -m "
                      f"moejax.data.prepare --verify {os.path.dirname(self.where) or '.'} checks "
                      "it); prepare the corpus again",
                      "path")


class WindowBatches(collections.abc.Sequence):
  """Batches i = 0..count-1 of consecutive windows, each made when read (an evaluation over a
  whole corpus holds one batch, not every window as int32)."""

  def __init__(self, windows_WxL: np.ndarray, batch_size: int, count: int,
               ids: IdBound | None = None):
    self.windows_WxL, self.batch_size, self.count, self.ids = windows_WxL, batch_size, count, ids

  def __len__(self) -> int:
    return self.count

  def __getitem__(self, i):
    if isinstance(i, slice):
      return [self[j] for j in range(*i.indices(self.count))]
    if not -self.count <= i < self.count:
      raise IndexError(i)
    b, i = self.batch_size, i % self.count
    return to_example(self.windows_WxL[i * b:(i + 1) * b], self.ids)


def int32_crc32(tokens_N: np.ndarray, block: int = 1 << 24) -> int:
  """The CRC-32 of tokens_N's ids as int32 bytes, `block` tokens at a time (no whole copy)."""
  crc = 0
  for start in range(0, len(tokens_N), block):
    crc = zlib.crc32(np.ascontiguousarray(tokens_N[start:start + block], np.int32).data, crc)
  return crc


def shuffle_seed(seed: int) -> int:
  """The 32-bit seed grain shuffles with, mixed from `seed` so that nearby seeds are unrelated."""
  return int(np.random.SeedSequence([seed, 0x5EED]).generate_state(1)[0])


class TrainIterator:
  """Infinite iterator of training batches; `next(it)` -> {"inputs", "targets"}: int32[B, S]."""

  def __init__(self, tokens_N: np.ndarray, *, batch_size: int, seq_len: int, seed: int,
               prefetch: int = 2, fingerprint: int | None = None, ids: IdBound | None = None):
    """`fingerprint`: what names the token stream in the state (default: the CRC-32 of its
    int32 bytes, which reads every token; a prepared corpus gives its file's, and is mapped,
    not copied: uint16 / uint32 ids become int32 a batch at a time). A state naming the stream
    by its int32 CRC-32 (a run on the corpus's source files) is still accepted then, after
    reading every token once to check it. `ids`: the bound a prepared corpus's ids keep,
    checked a batch at a time."""
    self._named_by_file = fingerprint is not None
    self._tokens_N = tokens_N if self._named_by_file else None
    if fingerprint is None:
      tokens_N = np.asarray(tokens_N, np.int32)
      fingerprint = int32_crc32(tokens_N)
    windows_WxL = windows(tokens_N, seq_len)
    if len(windows_WxL) < batch_size:
      raise DataError(f"{len(tokens_N)} tokens make {len(windows_WxL)} windows of {seq_len + 1}, "
                      f"fewer than one batch of {batch_size}")
    self.batch_size, self.seq_len, self.num_windows = batch_size, seq_len, len(windows_WxL)
    self.num_tokens = len(tokens_N)
    self._stream = {
        "seed": int(seed),
        "batch_size": int(batch_size),
        "seq_len": int(seq_len),
        "num_tokens": int(len(tokens_N)),
        "tokens_crc32": int(fingerprint),
    }
    ds = (grain.MapDataset.source(windows_WxL)
          .shuffle(seed=shuffle_seed(seed))
          .repeat()
          .batch(batch_size, drop_remainder=True)
          .map(functools.partial(to_example, ids=ids)))
    options = grain.ReadOptions(num_threads=1 if prefetch else 0, prefetch_buffer_size=prefetch)
    self._it = ds.to_iter_dataset(options).__iter__()

  def __iter__(self) -> TrainIterator:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._it)

  @property
  def windows_read(self) -> int:
    """Windows in the batches returned so far (over every epoch)."""
    return self._it.get_state()["next_index"] * self.batch_size

  @property
  def epoch_read(self) -> int:
    """The epoch (0-based) of the last window returned (0 before any)."""
    return max(0, self.windows_read - 1) // self.num_windows

  @property
  def epoch(self) -> int:
    """The epoch the next batch starts in (0-based)."""
    return self._it.get_state()["next_index"] * self.batch_size // self.num_windows

  def get_state(self) -> dict[str, int]:
    return {"next_batch": int(self._it.get_state()["next_index"]), **self._stream}

  def set_state(self, state) -> None:
    for key, want in self._stream.items():
      if key not in state:
        raise DataError(f"data iterator state lacks '{key}' (keys: {sorted(state)})")
      if int(state[key]) != want and not (key == "tokens_crc32" and self._named_by_file and
                                          int32_crc32(self._tokens_N) == int(state[key])):
        back = ("; a checkpoint taken on a prepared corpus (data.source='tokens') resumes on "
                "that directory, not on the files it was prepared from"
                if key == "tokens_crc32" and not self._named_by_file else "")
        raise DataError(f"the checkpoint's data position is for other training data ({key} "
                        f"{int(state[key])} there, {want} now): resume with the data.source, "
                        "data.path, data.tokenizer, data.val_fraction, seed, batch_size and "
                        f"seq_len it was saved with, or train in a new --workdir{back}")
    if "next_batch" not in state or int(state["next_batch"]) < 0:
      raise DataError(f"data iterator state needs a non-negative 'next_batch', got "
                      f"{state.get('next_batch')!r}")
    self._it.set_state({"next_index": int(state["next_batch"])})

  def close(self) -> None:
    close = getattr(self._it, "close", None)
    if close is not None:
      close()
