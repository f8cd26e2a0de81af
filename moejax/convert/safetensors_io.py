"""Safetensors checkpoints as Hugging Face lays them out: read one tensor (or one block of it) at a
time, write shards one tensor at a time.

A directory holds either `model.safetensors`, or shards `model-0000k-of-0000N.safetensors` listed
in `model.safetensors.index.json` (`weight_map`: tensor name -> shard file). Reading goes through
`safetensors.safe_open(...).get_slice`, which copies only the requested block out of the mapped
file. Writing streams: the shard plan (names, shapes, dtypes) is fixed first, so each shard's
header goes out before its data and no shard is ever assembled in memory.

FP8 checkpoints store a projection `X.weight` as float8 e4m3 beside its scales, one per block of
(rows, cols) elements, the grid rounded up where a dimension is not a multiple of the block
(`Fp8Scales`): transformers' fine-grained FP8 (DeepSeek-V3, Qwen3-*-FP8, MiniMax-M2) as
`X.weight_scale_inv` per 128 x 128 block; compressed-tensors' float-quantized format (the FP8
checkpoints llm-compressor makes) as `X.weight_scale` per tensor, row, group of a row, or block.
The reader dequantizes such a weight as it reads it (value * scale, one fp32 rounding, as
transformers does) and hides the scale tensors, so the rest of import sees ordinary fp32
weights.

File format (https://github.com/huggingface/safetensors): 8-byte little-endian header length N,
N bytes of JSON header ({name: {dtype, shape, data_offsets}}, "__metadata__"), then the data.
"""
from __future__ import annotations

import contextlib
import dataclasses
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
# Weights read through their block scales, and the scales' dtypes: fp32 ones, or powers of two
# (E8M0, DeepSeek's "ue8m0" scale format). safetensors' numpy reader has no float8 dtypes (it
# looks for numpy.float8_e4m3fn), so float8 tensors are read from the mapped file directly.
FP8_DTYPES = {"F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn)}
SCALE_DTYPES = (*READABLE_DTYPES, "F8_E8M0")
RAW_DTYPES = {**FP8_DTYPES, "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu)}
WRITABLE_DTYPES = {"float32": ("F32", np.dtype(np.float32)),
                   "bfloat16": ("BF16", np.dtype(ml_dtypes.bfloat16))}


@dataclasses.dataclass(frozen=True)
class Fp8Scales:
  """How a checkpoint's FP8 weights carry their scales: weight X's scale is X + `suffix`;
  `blocks` are the (rows, cols) one scale covers, 0 for a whole dimension, tried in order
  against each scale's shape (compressed-tensors' strategies: tensor (0, 0), channel (1, 0),
  group (1, g), block (r, c))."""
  suffix: str
  blocks: tuple[tuple[int, int], ...]


def _grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[tuple[int, ...], tuple]:
  """(the scale grid of an FP8 weight of `shape` in `block`s, the block's realized size)."""
  size = tuple(n if b == 0 else b for n, b in zip(shape[-2:], block))
  return (*shape[:-2], *(-(-n // b) for n, b in zip(shape[-2:], size))), size


def _squeezed(shape) -> tuple[int, ...]:
  return tuple(n for n in shape if n != 1)


def shard_file_name(k: int, n: int) -> str:
  return f"model-{k:05d}-of-{n:05d}.safetensors"


class TensorReader:
  """Name -> (file, shape, dtype) for every tensor in a Hugging Face safetensors directory.

  `fp8`: how FP8 weights carry their scales when config.json declares them
  (`hf_config.fp8_scales`), else None (an FP8 tensor is then refused)."""

  def __init__(self, directory: str, fp8: Fp8Scales | None = None):
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
    # fp8 weight -> (its scale, the block one scale covers, the scale grid)
    self._scales: dict[str, tuple[str, tuple[int, int], tuple[int, ...]]] = {}
    self._raw: dict[str, tuple[str, int, str, tuple]] = {}     # float8 -> file, offset, ...
    self._pair_scales(fp8)

  def _pair_scales(self, fp8: Fp8Scales | None) -> None:
    """Pairs each FP8 weight with its scale tensor (its shape one of `fp8.blocks`' grids), then
    hides the scales: import sees the weights only, in fp32."""
    suffix = fp8.suffix if fp8 else "_scale_inv"
    for name in sorted(n for n, d in self.dtypes.items() if d in FP8_DTYPES):
      where = f"{self._path(self.files[name])}: tensor {name!r}"
      scale, shape = name + suffix, self.shapes[name]
      if fp8 is None:
        raise CheckpointError(f"{where} is {self.dtypes[name]} but config.json declares no FP8 "
                              "quantization_config (quant_method 'fp8' or compressed-tensors' "
                              "float-quantized)")
      if scale not in self.shapes:
        raise CheckpointError(f"{where} is {self.dtypes[name]} without its scales {scale!r}; "
                              "moejax reads FP8 weights with their scales only")
      if len(shape) < 2:
        raise CheckpointError(f"{where} is {self.dtypes[name]} with shape {shape}; FP8 weights "
                              "have at least two dimensions")
      grids = [(_grid(shape, block), block) for block in fp8.blocks]
      found = [(grid, size) for (grid, size), _ in grids
               if _squeezed(grid) == _squeezed(self.shapes[scale])]
      if not found:
        wanted = " or ".join(f"{g} (blocks of {list(b)})" for (g, _), b in grids)
        raise CheckpointError(
            f"{self._path(self.files[scale])}: tensor {scale!r} has shape {self.shapes[scale]}; "
            f"{name} {shape} needs {wanted} as config.json's quantization_config declares")
      if self.dtypes[scale] not in SCALE_DTYPES:
        raise CheckpointError(f"{self._path(self.files[scale])}: tensor {scale!r} has dtype "
                              f"{self.dtypes[scale]}; FP8 scales are read as "
                              f"{', '.join(SCALE_DTYPES)}")
      grid, size = found[0]
      self._scales[name] = (scale, size, grid)
    raw = [n for n in self.shapes if self.dtypes[n] in RAW_DTYPES]
    for fname in sorted({self.files[n] for n in raw}):
      offsets = self._data_offsets(fname)
      self._raw.update({n: (fname, offsets[n], self.dtypes[n], self.shapes[n])
                        for n in raw if self.files[n] == fname})
    orphans = sorted(n for n in self.shapes
                     if n.endswith(suffix) and n[:-len(suffix)] not in self._scales)
    if orphans:
      raise CheckpointError(
          f"{self._path(self.files[orphans[0]])}: tensor {orphans[0]!r} scales "
          f"{orphans[0][:-len(suffix)]!r}, which is not stored as FP8 (F8_E4M3)")
    self._scale_files = {scale: self.files.pop(scale) for scale, _, _ in self._scales.values()}
    for scale in self._scale_files:
      del self.shapes[scale], self.dtypes[scale]

  def _data_offsets(self, fname: str) -> dict[str, int]:
    """Each tensor's offset in `fname` (safetensors' reader does not give them)."""
    with open(self._path(fname), "rb") as f:
      (n,) = struct.unpack("<Q", f.read(8))
      header = json.loads(f.read(n))
    return {name: 8 + n + int(v["data_offsets"][0])
            for name, v in header.items() if name != "__metadata__"}

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
    if dtype not in READABLE_DTYPES and name not in self._scales:
      raise CheckpointError(
          f"{self._path(self.files[name])}: tensor {name!r} has dtype {dtype}; moejax keeps fp32 "
          f"parameters and reads only {', '.join(READABLE_DTYPES)} (which fp32 holds exactly)")

  def read(self, name: str, index: tuple = ()) -> np.ndarray:
    """`tensor[index]` as fp32, reading only that block (index: ints and step-1 slices)."""
    self.check_dtype(name)
    if name in self._scales:
      return self._read_fp8(name, index)
    return self._read_plain(self.files[name], name, index)

  def _read_plain(self, fname: str, name: str, index: tuple) -> np.ndarray:
    if name in self._raw:
      fname, offset, dtype, shape = self._raw[name]
      stored = np.memmap(self._path(fname), dtype=RAW_DTYPES[dtype], mode="r", offset=offset,
                         shape=shape)
      return np.asarray(stored[index]).astype(np.float32)
    sl = self._open(fname).get_slice(name)
    block = sl[index] if index else sl[:]
    return np.asarray(block).astype(np.float32, copy=False)

  def _read_fp8(self, name: str, index: tuple) -> np.ndarray:
    """`dequantize(name)[index]`, reading only the FP8 block (and every scale: at most one per
    row of the weight, so far fewer than its values)."""
    shape, (scale, (bm, bn), grid) = self.shapes[name], self._scales[name]
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    squeeze = tuple(axis for axis, i in enumerate(index) if not isinstance(i, slice))
    ranges = [range(i, i + 1) if axis in squeeze else range(*i.indices(n))
              for axis, (i, n) in enumerate(zip(index, shape))]
    if any(r.step != 1 for r in ranges):
      raise ValueError(f"FP8 tensor {name!r}: block index {index} is not contiguous")
    slices = tuple(slice(r.start, r.stop) for r in ranges)
    values = self._read_plain(self.files[name], name, slices)
    rows, cols = ranges[-2], ranges[-1]
    first_r, first_c = rows.start // bm, cols.start // bn
    scale_slices = (*slices[:-2], slice(first_r, -(-rows.stop // bm)),
                    slice(first_c, -(-cols.stop // bn)))
    scales = self._read_plain(self._scale_files[scale], scale, ()).reshape(grid)[scale_slices]
    scales = np.repeat(np.repeat(scales, bm, axis=-2), bn, axis=-1)
    r0, c0 = rows.start - first_r * bm, cols.start - first_c * bn
    scales = scales[..., r0:r0 + len(rows), c0:c0 + len(cols)]
    return (values * scales).squeeze(squeeze) if squeeze else values * scales

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
