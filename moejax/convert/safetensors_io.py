"""Safetensors checkpoints as Hugging Face lays them out: read one tensor (or one block of it) at a
time, write shards one tensor at a time.

A directory holds either `model.safetensors`, or shards `model-0000k-of-0000N.safetensors` listed
in `model.safetensors.index.json` (`weight_map`: tensor name -> shard file). Reading goes through
`safetensors.safe_open(...).get_slice`, which copies only the requested block out of the mapped
file. Writing streams: the shard plan (names, shapes, dtypes) is fixed first, so each shard's
header goes out before its data and no shard is ever assembled in memory.

Quantized checkpoints store a projection `X.weight` as float8 e4m3, or as 4- or 8-bit integers
packed into int32 words (`X.weight_packed` with its `X.weight_shape`), beside its scales, one per
block of (rows, cols) elements, the grid rounded up where a dimension is not a multiple of the
block (`WeightScales`): transformers' fine-grained FP8 (DeepSeek-V3, Qwen3-*-FP8, MiniMax-M2) as
`X.weight_scale_inv` per 128 x 128 block; compressed-tensors' float-quantized and pack-quantized
formats (llm-compressor's checkpoints; Kimi-K2-Thinking's INT4 experts) as `X.weight_scale` per
tensor, row, group of a row, or block. The reader dequantizes such a weight as it reads it
(value * scale in fp32, as transformers' FP8 does; compressed-tensors' products rounded to a
16-bit scale's dtype, as it rounds them) and hides the scale tensors, so the rest of import sees
ordinary fp32 weights.

MXFP4 checkpoints (quantization_config quant_method "mxfp4": OpenAI's gpt-oss) store each expert
projection `P` [E, C, R] as two uint8 tensors, `P_blocks` [E, R, C/32, 16] (two FP4 e2m1 codes a
byte, low nibble first) and `P_scales` [E, R, C/32] (one E8M0 exponent, 2**(byte - 127), per 32
values along C); the reader lists the pair as `P` ("MXFP4") and reads it as transformers'
`convert_moe_packed_tensors` dequantizes it (exact in fp32), axes swapped back to [E, C, R].

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
SIXTEEN_BIT = {"BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16)}
# Weights read through their block scales, and the scales' dtypes: fp32 ones, or powers of two
# (E8M0, DeepSeek's "ue8m0" scale format). safetensors' numpy reader has no float8 dtypes (it
# looks for numpy.float8_e4m3fn), so float8 tensors are read from the mapped file directly.
FP8_DTYPES = {"F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn)}
SCALE_DTYPES = (*READABLE_DTYPES, "F8_E8M0")
RAW_DTYPES = {**FP8_DTYPES, "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu)}
WRITABLE_DTYPES = {"float32": ("F32", np.dtype(np.float32)),
                   "bfloat16": ("BF16", np.dtype(ml_dtypes.bfloat16))}


@dataclasses.dataclass(frozen=True)
class WeightScales:
  """How a checkpoint's quantized weights carry their scales: weight X's scale is X + `suffix`;
  `blocks` are the (rows, cols) one scale covers, 0 for a whole dimension, tried in order
  against each scale's shape (compressed-tensors' strategies: tensor (0, 0), channel (1, 0),
  group (1, g), block (r, c)); `int_bits`, the widths of packed integer weights it may hold
  (compressed-tensors' pack-quantized: X.weight_packed, symmetric, offset by 2**(bits - 1))."""
  suffix: str
  blocks: tuple[tuple[int, int], ...]
  int_bits: tuple[int, ...] = ()
  in_scale_dtype: bool = False   # value * scale rounded to a 16-bit scale's dtype
                                 # (compressed-tensors'); else exact in fp32 (transformers' FP8)
  summary: str = ""              # in a few words, for the lines that name it ("FP8 in 128 x 128
                                 # blocks", "INT4 per 32 columns of a row")
  mxfp4: bool = False            # expert projections P stored as P_blocks + P_scales (gpt-oss)


# What `hf_config.weight_scales` returns for quant_method "mxfp4": no per-weight scale blocks
# (the FP8 and packed paths refuse their tensors); P_blocks + P_scales pairs read as P.
MXFP4_SCALES = WeightScales("_scales", (), mxfp4=True, summary="MXFP4 experts (FP4 per 32 values)")
MXFP4_BLOCK = 32                                       # values one E8M0 scale covers
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"    # P_blocks, P_scales
MXFP4_DTYPE = "MXFP4"                                  # the dtype `TensorReader.dtypes` lists P as
FP4_E2M1 = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
# byte -> its two values (low nibble first): one gather decodes a block's 16 bytes to 32 values
FP4_PAIRS = np.stack([FP4_E2M1[np.arange(256) & 15], FP4_E2M1[np.arange(256) >> 4]], axis=-1)
# The E8M0 NaN: refused where read (transformers' ldexp reads it as 2**128, inf for codes
# of 1 and up; no checkpoint should hold it).
E8M0_NAN = 255


PACKED_SUFFIX, SHAPE_SUFFIX = "_packed", "_shape"     # X.weight_packed, X.weight_shape
# Tensors of quantization schemes moejax does not read (activation order, asymmetric zero
# points, a second-level global scale): each would leave the weights read wrong.
UNREAD_SUFFIXES = {"_g_idx": "an activation-order permutation (actorder)",
                   "_zero_point": "zero points (asymmetric integers)",
                   "_global_scale": "a global scale (FP4 / tensor_group)"}


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

  `scales`: how quantized weights carry their scales when config.json declares them
  (`hf_config.weight_scales`), else None (a quantized tensor is then refused)."""

  def __init__(self, directory: str, scales: WeightScales | None = None):
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
    # quantized weight -> (its scale, the block one scale covers, the scale grid, the dtype the
    # product is rounded to or None)
    self._scales: dict[str, tuple[str, tuple[int, int], tuple[int, ...], np.dtype | None]] = {}
    self._raw: dict[str, tuple[str, int, str, tuple]] = {}     # float8 -> file, offset, ...
    self._packed: dict[str, tuple[str, int]] = {}   # X.weight -> (X.weight_packed, bits)
    self._mxfp4: dict[str, tuple[str, str, str]] = {}   # P -> (P_blocks, P_scales, scales' file)
    self._pair_mxfp4(scales)
    self._unpack_names(scales)
    self._pair_scales(scales)

  def _pair_mxfp4(self, scales: WeightScales | None) -> None:
    """Each MXFP4 pair P_blocks [E, R, G, 16] + P_scales [E, R, G] listed as P [E, G * 32, R],
    the layout transformers' convert_moe_packed_tensors gives it; the pair hidden."""
    paired = sorted(n[:-len(BLOCKS_SUFFIX)] for n in self.shapes if n.endswith(BLOCKS_SUFFIX)
                    and n[:-len(BLOCKS_SUFFIX)] + SCALES_SUFFIX in self.shapes)
    if scales is None or not scales.mxfp4:
      if paired:
        name = paired[0]
        raise CheckpointError(
            f"{self._path(self.files[name + BLOCKS_SUFFIX])}: tensors {name + BLOCKS_SUFFIX!r} "
            f"and {name + SCALES_SUFFIX!r} hold MXFP4 weights, but config.json declares no "
            "quantization_config with quant_method 'mxfp4'")
      return
    for name in sorted(self.shapes):
      for suffix, other, what in ((BLOCKS_SUFFIX, SCALES_SUFFIX, "blocks without their scales"),
                                  (SCALES_SUFFIX, BLOCKS_SUFFIX, "scales without their blocks")):
        if name.endswith(suffix) and name[:-len(suffix)] + other not in self.shapes:
          raise CheckpointError(
              f"{self._path(self.files[name])}: tensor {name!r} holds MXFP4 {what} "
              f"{name[:-len(suffix)] + other!r}; moejax reads MXFP4 weights as the pair only")
    for name in paired:
      blocks, scales_name = name + BLOCKS_SUFFIX, name + SCALES_SUFFIX
      for part in (blocks, scales_name):
        if self.dtypes[part] != "U8":
          raise CheckpointError(f"{self._path(self.files[part])}: tensor {part!r} has dtype "
                                f"{self.dtypes[part]}; MXFP4 blocks and scales are U8")
      shape = self.shapes[blocks]
      if len(shape) != 4 or shape[-1] != MXFP4_BLOCK // 2:
        # transformers swaps axes 1 and 2 of the values: the last two for 4-D blocks only
        raise CheckpointError(
            f"{self._path(self.files[blocks])}: tensor {blocks!r} has shape {shape}; MXFP4 "
            "blocks are [experts, rows, blocks of 32 values, 16 bytes] (as transformers' "
            "convert_moe_packed_tensors reads them)")
      if self.shapes[scales_name] != shape[:-1]:
        raise CheckpointError(
            f"{self._path(self.files[scales_name])}: tensor {scales_name!r} has shape "
            f"{self.shapes[scales_name]}; {blocks} {shape} needs one scale per block, "
            f"{shape[:-1]}")
      if name in self.shapes:
        raise CheckpointError(f"{self._path(self.files[name])}: tensor {name!r} is stored beside "
                              f"its MXFP4 blocks {blocks!r}; a checkpoint holds one or the other")
      experts, rows, groups, _ = shape
      self._mxfp4[name] = (blocks, scales_name, self.files[scales_name])
      self.files[name] = self.files[blocks]
      self.shapes[name] = (experts, groups * MXFP4_BLOCK, rows)
      self.dtypes[name] = MXFP4_DTYPE
      for hidden in (blocks, scales_name):     # read through `name` from here on
        del self.files[hidden], self.shapes[hidden], self.dtypes[hidden]

  def _unpack_names(self, scales: WeightScales | None) -> None:
    """Each packed integer weight X.weight_packed (+ X.weight_shape) listed as X.weight, of the
    shape it holds, its width found from the words per row."""
    for name in sorted(self.shapes):
      for suffix, what in UNREAD_SUFFIXES.items():
        if name.endswith(suffix):
          raise CheckpointError(f"{self._path(self.files[name])}: tensor {name!r} holds {what}, "
                                "which moejax does not read")
    for packed in sorted(n for n in self.shapes if n.endswith(PACKED_SUFFIX)):
      name = packed[:-len(PACKED_SUFFIX)]
      where = f"{self._path(self.files[packed])}: tensor {packed!r}"
      if self.dtypes[packed] != "I32":
        raise CheckpointError(f"{where} has dtype {self.dtypes[packed]}; packed weights are I32 "
                              "words")
      if scales is None or not scales.int_bits:
        raise CheckpointError(f"{where} holds packed integer weights but config.json declares "
                              "no compressed-tensors pack-quantized group")
      shape_name = name + SHAPE_SUFFIX
      if shape_name not in self.shapes or name in self.shapes:
        raise CheckpointError(f"{where} needs {shape_name!r} beside it (and no {name!r})")
      shape = tuple(int(n) for n in self._read_stored(self.files[shape_name], shape_name, ()))
      packed_shape = self.shapes[packed]
      bits = [b for b in scales.int_bits
              if len(shape) >= 2 and packed_shape[:-1] == shape[:-1]
              and packed_shape[-1] == -(-shape[-1] * b // 32)]
      if not bits:
        raise CheckpointError(f"{where} has shape {packed_shape}, which does not pack {shape} "
                              f"as {' or '.join(map(str, scales.int_bits))}-bit integers (the "
                              "widths config.json declares)")
      if len(bits) > 1:      # narrow enough that one word holds either width
        raise CheckpointError(f"{where} has shape {packed_shape}, which packs {shape} as "
                              f"{' or '.join(map(str, bits))}-bit integers alike, and "
                              "config.json declares both widths")
      self.files[name], self.shapes[name] = self.files[packed], shape
      self.dtypes[name] = f"I{bits[0]} packed"
      self._packed[name] = (packed, bits[0])
      for hidden in (shape_name, packed):     # read through `name` from here on
        del self.files[hidden], self.shapes[hidden], self.dtypes[hidden]

  def _pair_scales(self, scales: WeightScales | None) -> None:
    """Pairs each quantized weight with its scale tensor (its shape one of `scales.blocks`'
    grids), then hides the scales: import sees the weights only, in fp32."""
    suffix = scales.suffix if scales else "_scale_inv"
    quantized = sorted(n for n, d in self.dtypes.items() if d in FP8_DTYPES or n in self._packed)
    for name in quantized:
      where = f"{self._path(self.files[name])}: tensor {name!r}"
      scale, shape = name + suffix, self.shapes[name]
      if scales is None or scales.mxfp4:
        raise CheckpointError(f"{where} is {self.dtypes[name]} but config.json declares no FP8 "
                              "quantization_config (quant_method 'fp8' or compressed-tensors' "
                              "float-quantized)")
      if scale not in self.shapes:
        raise CheckpointError(f"{where} is {self.dtypes[name]} without its scales {scale!r}; "
                              "moejax reads quantized weights with their scales only")
      if len(shape) < 2:
        raise CheckpointError(f"{where} is {self.dtypes[name]} with shape {shape}; quantized "
                              "weights have at least two dimensions")
      grids = [(_grid(shape, block), block) for block in scales.blocks]
      found = ([(grid, size) for (grid, size), _ in grids if grid == self.shapes[scale]]
               or [(grid, size) for (grid, size), _ in grids
                   if _squeezed(grid) == _squeezed(self.shapes[scale])])
      if len({grid for grid, _ in found}) > 1:
        raise CheckpointError(
            f"{self._path(self.files[scale])}: tensor {scale!r} has shape {self.shapes[scale]}, "
            f"which reads as more than one of the quantization_config's blocks for {name} "
            f"{shape} ({', '.join(str(list(size)) for _, size in found)})")
      if not found:
        wanted = " or ".join(f"{g} (blocks of {list(b)})" for (g, _), b in grids)
        raise CheckpointError(
            f"{self._path(self.files[scale])}: tensor {scale!r} has shape {self.shapes[scale]}; "
            f"{name} {shape} needs {wanted} as config.json's quantization_config declares")
      if self.dtypes[scale] not in SCALE_DTYPES:
        raise CheckpointError(f"{self._path(self.files[scale])}: tensor {scale!r} has dtype "
                              f"{self.dtypes[scale]}; scales are read as "
                              f"{', '.join(SCALE_DTYPES)}")
      grid, size = found[0]
      self._scales[name] = (scale, size, grid, SIXTEEN_BIT.get(self.dtypes[scale])
                            if scales.in_scale_dtype else None)
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
          f"{orphans[0][:-len(suffix)]!r}, which is not stored quantized (F8_E4M3 or packed)")
    self._scale_files = {entry[0]: self.files.pop(entry[0]) for entry in self._scales.values()}
    self._scale_shapes = {scale: self.shapes.pop(scale) for scale in self._scale_files}
    for scale in self._scale_files:
      del self.dtypes[scale]

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
    """The index's weight_map, or {} for a single-file checkpoint. A directory holding both
    reads the single file, as transformers' `from_pretrained` does (the same weights in both)."""
    index_path = self._path(INDEX_FILE)
    if os.path.exists(self._path(SINGLE_FILE)):
      return {}
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
    if dtype not in READABLE_DTYPES and name not in self._scales and name not in self._mxfp4:
      raise CheckpointError(
          f"{self._path(self.files[name])}: tensor {name!r} has dtype {dtype}; moejax keeps fp32 "
          f"parameters and reads only {', '.join(READABLE_DTYPES)} (which fp32 holds exactly)")

  def read(self, name: str, index: tuple = ()) -> np.ndarray:
    """`tensor[index]` as fp32, reading only that block (index: ints and step-1 slices)."""
    self.check_dtype(name)
    if name in self._scales:
      return self._read_scaled(name, index)
    if name in self._mxfp4:
      return self._read_mxfp4(name, index)
    return self._read_plain(self.files[name], name, index)

  def _read_stored(self, fname: str, name: str, index: tuple) -> np.ndarray:
    """`tensor[index]` in its stored dtype, through safetensors (which reads only that block)."""
    sl = self._open(fname).get_slice(name)
    return np.asarray(sl[index] if index else sl[:])

  def _unpack(self, name: str, slices: tuple) -> np.ndarray:
    """Packed integer weight `name`'s [slices] as fp32: value i of a row sits at bits
    [i * bits, (i + 1) * bits) of the row's int32 words, stored plus 2**(bits - 1)
    (compressed-tensors' pack_to_int32); only the words the block covers are read."""
    packed, bits = self._packed[name]
    per_word = 32 // bits
    cols = range(*slices[-1].indices(self.shapes[name][-1]))
    first = cols.start // per_word
    words = self._read_stored(self.files[name], packed,
                            (*slices[:-1], slice(first, -(-cols.stop // per_word))))
    shifts = np.arange(per_word, dtype=np.uint32) * np.uint32(bits)
    values = (words.view(np.uint32)[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    values = values.reshape(*words.shape[:-1], -1)
    start = cols.start - first * per_word
    values = values[..., start:start + len(cols)]
    return (values.astype(np.int32) - (1 << (bits - 1))).astype(np.float32)

  def _read_plain(self, fname: str, name: str, index: tuple) -> np.ndarray:
    if name in self._raw:
      fname, offset, dtype, shape = self._raw[name]
      stored = np.memmap(self._path(fname), dtype=RAW_DTYPES[dtype], mode="r", offset=offset,
                         shape=shape)
      return np.asarray(stored[index]).astype(np.float32)
    return self._read_stored(fname, name, index).astype(np.float32, copy=False)

  def _block_ranges(self, name: str, index: tuple) -> tuple[list[range], tuple[int, ...]]:
    """Quantized tensor `name`'s [index] (ints and step-1 slices) as each axis' range, and the
    axes an int drops."""
    shape = self.shapes[name]
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    squeeze = tuple(axis for axis, i in enumerate(index) if not isinstance(i, slice))
    for axis in squeeze:
      if not -shape[axis] <= index[axis] < shape[axis]:
        raise IndexError(f"index {index[axis]} is out of bounds for axis {axis} of {name!r} "
                         f"{shape}")
    ranges = [range(i % n, i % n + 1) if axis in squeeze else range(*i.indices(n))
              for axis, (i, n) in enumerate(zip(index, shape))]
    if any(r.step != 1 for r in ranges):
      raise ValueError(f"quantized tensor {name!r}: block index {index} is not contiguous")
    return ranges, squeeze

  def _read_scaled(self, name: str, index: tuple) -> np.ndarray:
    """`dequantize(name)[index]`, reading only the block of its values and the scales that
    cover it."""
    scale, (bm, bn), grid, rounding = self._scales[name]
    ranges, squeeze = self._block_ranges(name, index)
    slices = tuple(slice(r.start, r.stop) for r in ranges)
    if any(len(r) == 0 for r in ranges):
      out = np.zeros([len(r) for r in ranges], np.float32)
      return out.squeeze(squeeze) if squeeze else out
    values = (self._unpack(name, slices) if name in self._packed
              else self._read_plain(self.files[name], name, slices))
    rows, cols = ranges[-2], ranges[-1]
    first_r, first_c = rows.start // bm, cols.start // bn
    scale_slices = (*slices[:-2], slice(first_r, -(-rows.stop // bm)),
                    slice(first_c, -(-cols.stop // bn)))
    if self._scale_shapes[scale] == grid:     # only the scales that cover the block
      scales = self._read_plain(self._scale_files[scale], scale, scale_slices)
    else:                                     # stored squeezed ([rows], [1], []): tiny
      scales = self._read_plain(self._scale_files[scale], scale, ()).reshape(grid)[scale_slices]
    # each row's and column's scale picked by index: the block's size, never a whole block's
    row_of = (np.arange(rows.start, rows.stop) // bm - first_r)[:, None]
    col_of = (np.arange(cols.start, cols.stop) // bn - first_c)[None, :]
    out = values * scales[..., row_of, col_of]
    if rounding is not None:
      out = out.astype(rounding).astype(np.float32)
    return out.squeeze(squeeze) if squeeze else out

  def _read_mxfp4(self, name: str, index: tuple) -> np.ndarray:
    """MXFP4 `name` [E, C, R]'s [index] as fp32, reading only the rows and 32-value blocks of
    P_blocks and P_scales [E, R, C/32, ...] that cover it: each value its FP4 code times
    2**(scale byte - 127), exact in fp32 (bit for bit transformers' float32 dequantization)."""
    blocks, scales_name, scales_file = self._mxfp4[name]
    ranges, squeeze = self._block_ranges(name, index)
    if any(len(r) == 0 for r in ranges):
      out = np.zeros([len(r) for r in ranges], np.float32)
      return out.squeeze(squeeze) if squeeze else out
    experts, cols, rows = ranges
    first_g = cols.start // MXFP4_BLOCK
    stored = (slice(experts.start, experts.stop), slice(rows.start, rows.stop),
              slice(first_g, -(-cols.stop // MXFP4_BLOCK)))
    codes = self._read_stored(self.files[name], blocks, stored)           # [e, r, g, 16]
    exponents = self._read_stored(scales_file, scales_name, stored)      # [e, r, g]
    if (exponents == E8M0_NAN).any():
      e, r, g = (int(i) for i in np.argwhere(exponents == E8M0_NAN)[0])
      raise CheckpointError(
          f"{self._path(scales_file)}: tensor {scales_name!r} holds the E8M0 NaN scale (byte 255) "
          f"at [{experts.start + e}, {rows.start + r}, {first_g + g}]; valid scales are bytes "
          "0 to 254")
    # E8M0 byte b is exactly 2**(b - 127) as fp32 (2**-127 a subnormal)
    scales = exponents.view(RAW_DTYPES["F8_E8M0"]).astype(np.float32)
    with np.errstate(over="ignore"):      # 2 * 2**127 and up: inf, as transformers' ldexp gives
      values = FP4_PAIRS[codes].reshape(*exponents.shape, MXFP4_BLOCK) * scales[..., None]
    start = cols.start - first_g * MXFP4_BLOCK
    values = values.reshape(*exponents.shape[:2], -1)[..., start:start + len(cols)]
    out = np.ascontiguousarray(values.swapaxes(-1, -2))                   # [e, c, r]
    return out.squeeze(squeeze) if squeeze else out

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
