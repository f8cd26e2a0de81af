"""From a DataSpec to training batches and fixed validation batches.

Letters: N tokens, S sequence length, L = S + 1 tokens per window, B batch size.

The documents of the source are tokenized into one stream (each document followed by EOS, in the
source's order). The last `val_fraction` of that stream is the validation split and the rest is
the training split; the split depends only on the corpus and the fraction, not on the seed, so
runs with different seeds are evaluated on the same tokens. The two splits share no token.
Training batches come from `TrainIterator` (shuffled, resumable); validation batches are a fixed
list: the validation windows in one permutation that is the same for every seed.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from moejax.data import prepared
from moejax.data.iterator import IdBound, TrainIterator, num_windows, to_example, windows
from moejax.data.sources import BUILTIN_NAME, SOURCES, load_documents
from moejax.data.tokenizer import Tokenizer, load_tokenizer
from moejax.errors import ConfigError, DataError

PROGRESS_SECONDS = 10.0   # tokenizing longer than this says how far it got
_VAL_ORDER_SEED = 0  # Fixed: the validation batches must not depend on the training seed.


@dataclasses.dataclass(frozen=True)
class DataSpec:
  """What to train on. `path` is required for "text" and "jsonl" (a file) and "tokens" (a
  directory `python -m moejax.data.prepare` wrote), absent for "builtin"."""
  source: str = "builtin"
  path: str | None = None
  tokenizer: str = "bytes"
  val_fraction: float = 0.05
  seed: int = 0

  def __post_init__(self):
    if self.source not in SOURCES:
      raise ConfigError(f"DataSpec.source must be one of {SOURCES}, got {self.source!r}")
    if not 0.0 <= self.val_fraction < 1.0:
      raise ConfigError(f"DataSpec.val_fraction must be in [0, 1), got {self.val_fraction!r}")
    if not isinstance(self.seed, int) or self.seed < 0:
      raise ConfigError(f"DataSpec.seed must be a non-negative int, got {self.seed!r}")


@dataclasses.dataclass
class Data:
  """What `make_data` returns: the tokenizer, the training iterator, the validation split."""
  tokenizer: Tokenizer
  train: TrainIterator
  val_tokens: np.ndarray  # int32[N_val], or uint16 / uint32 mapped from a prepared corpus
  batch_size: int
  seq_len: int
  name: str
  ids: IdBound | None = None   # a prepared corpus's: its ids are checked a batch at a time

  @property
  def num_val_batches(self) -> int:
    """How many distinct validation batches `val_batches` can return."""
    return num_windows(len(self.val_tokens), self.seq_len) // self.batch_size

  def val_batches(self, num_batches: int) -> list[dict[str, np.ndarray]]:
    """The first `num_batches` validation batches; the same list every call, for every seed."""
    if len(self.val_tokens) == 0:
      raise DataError(f"{self.name}: no validation split (val_fraction is 0)")
    if num_batches > self.num_val_batches:
      raise DataError(
          f"{self.name}: validation split has {len(self.val_tokens)} tokens, enough for "
          f"{self.num_val_batches} batches of {self.batch_size}x{self.seq_len}; "
          f"asked for {num_batches}")
    windows_WxL = windows(self.val_tokens, self.seq_len)
    order_W = np.random.default_rng(_VAL_ORDER_SEED).permutation(len(windows_WxL))
    b = self.batch_size
    return [to_example(windows_WxL[order_W[i * b:(i + 1) * b]], self.ids)
            for i in range(num_batches)]


def split_tokens(tokens_N: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
  """(train, val): val is the last round(N * val_fraction) tokens."""
  num_val = int(round(len(tokens_N) * val_fraction))
  return tokens_N[:len(tokens_N) - num_val], tokens_N[len(tokens_N) - num_val:]


def make_data(spec: DataSpec, *, batch_size: int, seq_len: int, prefetch: int = 2,
              log: Callable[[str], None] | None = None) -> Data:
  """Loads, tokenizes and splits the corpus; raises DataError if it cannot fill one batch.
  `log`: where to say how tokenizing goes, every PROGRESS_SECONDS while it runs."""
  if batch_size < 1 or seq_len < 1:
    raise ConfigError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
  try:
    tokenizer = load_tokenizer(spec.tokenizer)
  except DataError as e:
    raise DataError(str(e), "tokenizer") from None
  name = spec.path if spec.source != "builtin" else BUILTIN_NAME
  if spec.source == "tokens":
    # Tokenized once by `python -m moejax.data.prepare`: mapped, not read; its CRC-32 (of the
    # whole stream, from meta.json) names the stream in the iterator's state.
    corpus = prepared.read(spec.path, tokenizer)
    tokens_N, fingerprint, ids = corpus.tokens_N, corpus.meta["crc32"], corpus.ids
  else:
    tokens_N, fingerprint, ids = _tokenize(spec, tokenizer, name, log), None, None
  train_N, val_N = split_tokens(tokens_N, spec.val_fraction)
  _check_fits(name, "training split", train_N, batch_size, seq_len, len(tokens_N))
  if spec.val_fraction > 0:
    _check_fits(name, f"validation split (val_fraction={spec.val_fraction})", val_N, batch_size,
                seq_len, len(tokens_N))
  train = TrainIterator(train_N, batch_size=batch_size, seq_len=seq_len, seed=spec.seed,
                        prefetch=prefetch, fingerprint=fingerprint, ids=ids)
  return Data(tokenizer=tokenizer, train=train, val_tokens=val_N, batch_size=batch_size,
              seq_len=seq_len, name=name, ids=ids)


def _tokenize(spec: DataSpec, tokenizer: Tokenizer, name: str,
              log: Callable[[str], None] | None) -> np.ndarray:
  """The documents of `spec` as one int32 token stream, each followed by EOS."""
  try:
    docs = load_documents(spec.source, spec.path)
  except DataError as e:
    raise DataError(str(e), "path") from None
  started = last = time.perf_counter()

  def progress(done: int, total: int):
    nonlocal last
    now = time.perf_counter()
    if log is not None and (now - last >= PROGRESS_SECONDS or
                            (done == total and now - started >= PROGRESS_SECONDS)):
      log(f"moejax: tokenizing {name}: {done:,} of {total:,} documents, "
          f"{now - started:.0f} s")
      last = now

  tokens_N = tokenizer.encode_documents(docs, progress)
  del docs
  if not np.any(tokens_N != tokenizer.eos_id):
    raise DataError(f"{name}: no text after tokenization with {tokenizer.name}")
  return tokens_N


def _check_fits(name: str, what: str, tokens_N: np.ndarray, batch_size: int, seq_len: int,
                total: int) -> None:
  if num_windows(len(tokens_N), seq_len) < batch_size:
    raise DataError(
        f"{name}: corpus too small: the {what} has {len(tokens_N)} of {total} tokens, but one "
        f"batch of {batch_size}x{seq_len} needs {batch_size * seq_len + 1}: "
        f"{'a larger val_fraction (or 0: none), ' if 'validation' in what else ''}a smaller batch "
        "size or sequence length, or a larger corpus")
