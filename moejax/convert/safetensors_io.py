"""Safetensors checkpoints as Hugging Face lays them out: read one tensor (or one block of it) at a
time, write shards one tensor at a time.

A directory holds either `model.safetensors`, or shards `model-0000k-of-0000N.safetensors` listed
in `model.safetensors.index.json` (`weight_map`: tensor name -> shard file). Reading goes through
`safetensors.safe_open(...).get_slice`, which copies only the requested block out of the mapped
file. Writing streams: the shard plan (names, shapes, dtypes) is fixed first, so each shard's
header goes out before its data and no shard is ever assembled in memory.

File format (https://github.com/huggingface/safetensors): 8-byte little-endian header length N,
N bytes of JSON header ({name: {dtype, shape, data_offsets}}, "__metadata__"), then the data.
"""
from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Callable, Iterable

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from moejax.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Dtypes whose every value an fp32 parameter holds exactly.
READABLE_DTYPES = ("F32", "BF16", "F16")
WRITABLE_DTYPES = {"float32": ("F32", np.dtype(np.float32)),
                   "bfloat16": ("BF16", np.dtype(ml_dtypes.bfloat16))}


def shard_file_name(k: int, n: int) -> str:
  return f"model-{k:05d}-of-{n:05d}.safetensors"


class TensorReader:
  """Name -> (file, shape, dtype) for every tensor in a Hugging Face safetensors directory."""

  def __init__(self, directory: str):
    self.directory = directory
    self._stack = contextlib.ExitStack()
    self._handles: dict[str, object] = {}
    self.files: dict[str, str] = {}
    self.shapes: dict[str, tuple[int, ...]] = {}
    self.dtypes: dict[str, str] = {}
    index = self._read_index()
    for fname in sorted(set(index.values())) if index else [SINGLE_FILE]:
      handle = self._open(fname)
      present = set(handle.keys())
      listed = {n for n, f in index.items() if f == fname} if index else present
      missing = sorted(listed - present)
      if missing:
        raise CheckpointError(f"{self._path(fname)}: tensor {missing[0]!r} is listed in "
                              f"{INDEX_FILE} but not stored in this shard")
      for name in listed:
        sl = handle.get_slice(name)
        self.files[name] = fname
        self.shapes[name] = tuple(int(s) for s in sl.get_shape())
        self.dtypes[name] = sl.get_dtype()
    self.release()

  def _path(self, fname: str) -> str:
    return os.path.join(self.directory, fname)

  def _read_index(self) -> dict[str, str]:
    """The index's weight_map, or {} for a single-file checkpoint."""
    index_path = self._path(INDEX_FILE)
    if os.path.exists(index_path):
      try:
        with open(index_path) as f:
          weight_map = dict(json.load(f)["weight_map"])
      except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index_path}: not a safetensors index with a weight_map ({e})"
                              ) from None
      for fname in sorted(set(weight_map.values())):
        if not os.path.exists(self._path(fname)):
          example = next(k for k, v in weight_map.items() if v == fname)
          raise CheckpointError(f"{self._path(fname)}: shard listed in {INDEX_FILE} is missing "
                                f"(it should hold {example!r} among others)")
      if not weight_map:
        raise CheckpointError(f"{index_path}: the weight_map is empty")
      return weight_map
    if os.path.exists(self._path(SINGLE_FILE)):
      return {}
    raise CheckpointError(f"{self.directory}: no {SINGLE_FILE} or {INDEX_FILE} (a Hugging Face "
                          "checkpoint saved with safetensors is expected)")

  def _open(self, fname: str):
    if fname not in self._handles:
      try:
        self._handles[fname] = self._stack.enter_context(safe_open(self._path(fname), "numpy"))
      except (OSError, SafetensorError) as e:
        reason = " ".join(str(e).split())
        raise CheckpointError(f"{self._path(fname)}: cannot read as safetensors ({reason})"
                              ) from None
    return self._handles[fname]

  def names(self) -> list[str]:
    return sorted(self.shapes)

  def check_dtype(self, name: str) -> None:
    dtype = self.dtypes[name]
    if dtype not in READABLE_DTYPES:
      raise CheckpointError(
          f"{self._path(self.files[name])}: tensor {name!r} has dtype {dtype}; moejax keeps fp32 "
          f"parameters and reads only {', '.join(READABLE_DTYPES)} (which fp32 holds exactly)")

  def read(self, name: str, index: tuple = ()) -> np.ndarray:
    """`tensor[index]` as fp32, reading only that block (index: ints and step-1 slices)."""
    self.check_dtype(name)
    sl = self._open(self.files[name]).get_slice(name)
    block = sl[index] if index else sl[:]
    return np.asarray(block).astype(np.float32, copy=False)

  def release(self):
    """Closes the open files. Their mapped pages count as this process's memory while open, so
    a reader that walks a large checkpoint releases them as it goes; reads reopen on demand."""
    self._stack.close()
    self._stack = contextlib.ExitStack()
    self._handles.clear()

  def close(self):
    self.release()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def plan_shards(entries: list[tuple[str, tuple[int, ...]]], itemsize_of: Callable[[str], int],
                max_shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
  """Greedy, in order: a new shard starts when the next tensor would overflow the current one.
  `itemsize_of(name)`: bytes per element of that tensor."""
  shards, current, size = [], [], 0
  for name, shape in entries:
    nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize_of(name)
    if current and size + nbytes > max_shard_bytes:
      shards.append(current)
      current, size = [], 0
    current.append((name, shape))
    size += nbytes
  if current:
    shards.append(current)
  return shards


def _header(entries, dtype_of) -> bytes:
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, shape in entries:
    st_dtype, np_dtype = dtype_of(name)
    nbytes = int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize
    header[name] = {"dtype": st_dtype, "shape": list(shape),
                    "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-(8 + len(raw)) % 8)          # data starts 8-byte aligned, like safetensors does
  return struct.pack("<Q", len(raw)) + raw


def write_tensors(directory: str, entries: Iterable[tuple[str, tuple[int, ...]]],
                  produce: Callable[[str], np.ndarray], *, dtype: str = "float32",
                  max_shard_bytes: int = 5_000_000_000,
                  keep_fp32: Callable[[str], bool] = lambda name: False) -> list[str]:
  """Writes tensors `produce(name)` (called once each, in order) as safetensors shards, in
  `dtype` but those `keep_fp32` names, which stay float32.

  One shard -> `model.safetensors`; more -> `model-0000k-of-0000N.safetensors` and the index.
  Returns the file names written.
  """
  if dtype not in WRITABLE_DTYPES:
    raise CheckpointError(f"export dtype {dtype!r}: must be one of {', '.join(WRITABLE_DTYPES)}")

  def dtype_of(name):
    return WRITABLE_DTYPES["float32" if keep_fp32(name) else dtype]

  entries = [(n, tuple(int(s) for s in shape)) for n, shape in entries]
  shards = plan_shards(entries, lambda name: dtype_of(name)[1].itemsize, max_shard_bytes)
  names = ([SINGLE_FILE] if len(shards) == 1
           else [shard_file_name(k + 1, len(shards)) for k in range(len(shards))])
  os.makedirs(directory, exist_ok=True)
  weight_map, total = {}, 0
  for fname, shard in zip(names, shards):
    with open(os.path.join(directory, fname), "wb") as f:
      f.write(_header(shard, dtype_of))
      for name, shape in shard:
        x = np.asarray(produce(name))
        if x.shape != shape:
          raise CheckpointError(f"tensor {name!r}: produced shape {x.shape}, planned {shape}")
        x = np.ascontiguousarray(x.astype(dtype_of(name)[1], copy=False))
        f.write(x.reshape(-1).view(np.uint8).data)
        total += x.nbytes
        weight_map[name] = fname
  index_path = os.path.join(directory, INDEX_FILE)
  if len(shards) > 1:
    with open(index_path, "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                f, indent=2)
  elif os.path.exists(index_path):
    os.remove(index_path)
  return names
