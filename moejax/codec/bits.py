"""Bit layout of floating-point values: exponent field vs sign+mantissa, and dense bit packing.

A value's bit pattern is split into its exponent field (the part the codec caches and patches)
and the rest (sign bit and mantissa, shipped on every gather):

  dtype     bits  exponent  rest (sign, mantissa)
  bfloat16  16    8         1 + 7  = 8
  float16   16    5         1 + 10 = 11
  float32   32    8         1 + 23 = 24

`split` and `merge` are exact inverses on every bit pattern (NaN payloads, +-Inf, subnormals,
-0.0): they only move bits, through `lax.bitcast_convert_type`, and never look at values.
Exponents come back as uint8; the rest as the narrowest unsigned type that holds it.

`pack_bits` stores values of `width` bits back to back in uint32 words (no padding to a byte or
a half word), 32 values per `width` words; `unpack_bits` is its inverse. Bit k of value i lands
at bit (i * width + k) of the little-endian bit string formed by the words. Shapes are static:
N values take `packed_words(N, width)` words. Both act on the last axis and keep leading axes.

Letters: N values, G groups of 32 values.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where the exponent sits in a floating-point format."""
  name: str
  dtype: np.dtype
  uint_dtype: np.dtype     # same width as dtype, for bitcasts
  rest_dtype: np.dtype     # narrowest unsigned type holding sign + mantissa
  exp_bits: int
  mant_bits: int

  @property
  def total_bits(self) -> int:
    return 1 + self.exp_bits + self.mant_bits

  @property
  def rest_bits(self) -> int:
    return 1 + self.mant_bits

  @property
  def itemsize(self) -> int:
    return self.total_bits // 8


LAYOUTS = {
    np.dtype(jnp.bfloat16): Layout("bfloat16", np.dtype(jnp.bfloat16), np.dtype(np.uint16),
                                   np.dtype(np.uint8), exp_bits=8, mant_bits=7),
    np.dtype(np.float16): Layout("float16", np.dtype(np.float16), np.dtype(np.uint16),
                                 np.dtype(np.uint16), exp_bits=5, mant_bits=10),
    np.dtype(np.float32): Layout("float32", np.dtype(np.float32), np.dtype(np.uint32),
                                 np.dtype(np.uint32), exp_bits=8, mant_bits=23),
}


def layout_of(dtype) -> Layout:
  """The layout of bfloat16, float16 or float32; ValueError for anything else."""
  dtype = np.dtype(dtype)
  if dtype not in LAYOUTS:
    raise ValueError(f"dtype must be one of {[l.name for l in LAYOUTS.values()]}, got {dtype}")
  return LAYOUTS[dtype]


def _u(dtype, value):
  return np.asarray(value, dtype=dtype)


def split_bits(bits: jax.Array, layout: Layout) -> tuple[jax.Array, jax.Array]:
  """Bit patterns (layout.uint_dtype) -> (exponent uint8, rest layout.rest_dtype), any shape."""
  u = layout.uint_dtype
  exp = (bits >> _u(u, layout.mant_bits)) & _u(u, (1 << layout.exp_bits) - 1)
  sign = bits >> _u(u, layout.total_bits - 1)
  rest = (sign << _u(u, layout.mant_bits)) | (bits & _u(u, (1 << layout.mant_bits) - 1))
  return exp.astype(jnp.uint8), rest.astype(layout.rest_dtype)


def merge_bits(exp: jax.Array, rest: jax.Array, layout: Layout) -> jax.Array:
  """Inverse of `split_bits`: (exponent, rest) -> bit patterns (layout.uint_dtype)."""
  u = layout.uint_dtype
  exp = exp.astype(u) & _u(u, (1 << layout.exp_bits) - 1)
  rest = rest.astype(u)
  sign = (rest >> _u(u, layout.mant_bits)) & _u(u, 1)
  mant = rest & _u(u, (1 << layout.mant_bits) - 1)
  return ((sign << _u(u, layout.total_bits - 1)) | (exp << _u(u, layout.mant_bits)) | mant)


def split(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Floating-point array -> (exponent uint8, rest), same shape, exact for every bit pattern."""
  layout = layout_of(x.dtype)
  return split_bits(lax.bitcast_convert_type(x, layout.uint_dtype), layout)


def merge(exp: jax.Array, rest: jax.Array, dtype) -> jax.Array:
  """Inverse of `split`."""
  layout = layout_of(dtype)
  return lax.bitcast_convert_type(merge_bits(exp, rest, layout), layout.dtype)


# ----------------------------------------------------------------------------------------------
# Dense packing of `width`-bit values into uint32 words.


def packed_words(n: int, width: int) -> int:
  """Number of uint32 words that `pack_bits` makes from n values of `width` bits."""
  _check_width(width)
  return -(-n // 32) * width


# Ragged exchanges (`lax.ragged_all_to_all`) move rows of this many words: their int32 offsets
# and sizes count rows, not words, so they stay below 2^31 up to 2^38 words a buffer (offsets in
# words wrapped once a gathered layer's payload passed 2^31 words: DeepSeek-V3's experts on 64
# devices). The price is at most CHUNK_WORDS - 1 words of padding per transfer.
CHUNK_WORDS = 128


def chunks(words):
  """Rows of CHUNK_WORDS that hold `words` uint32 words (an int or an int32 array)."""
  return (words + (CHUNK_WORDS - 1)) // CHUNK_WORDS


def _check_width(width: int):
  if not 1 <= width <= 32:
    raise ValueError(f"width must be in [1, 32] bits, got {width}")


def _lead(a: np.ndarray, ndim: int) -> np.ndarray:
  """Give a static table leading singleton axes (rank promotion stays explicit)."""
  return a.reshape((1,) * (ndim - a.ndim) + a.shape)


def _mask(width: int) -> np.uint32:
  return np.uint32((1 << width) - 1)


@functools.lru_cache(maxsize=None)
def _pack_plan(width: int):
  """Static plan for widths that do not divide 32: word j of a group ORs up to K values, the
  k-th being value first_j + k, shifted right by rsh and left by lsh (unused pairs masked)."""
  j = np.arange(width)
  first = (32 * j) // width          # first value with bits in word j
  plan = []
  for k in range(-(-32 // width) + 1):
    value = first + k
    offset = width * value - 32 * j  # where the value starts, relative to the word's bit 0
    used = (value < 32) & (offset < 32)
    if not used.any():
      break
    plan.append((np.minimum(value, 31).astype(np.int32),
                 np.where(used, np.maximum(offset, 0), 0).astype(np.uint32),
                 np.where(used, np.maximum(-offset, 0), 0).astype(np.uint32), used))
  return plan


@functools.lru_cache(maxsize=None)
def _unpack_plan(width: int):
  """Value i of a group: low bits from word j0 (shifted right by off), the rest (if it spills)
  from word j0 + 1 (shifted left by 32 - off)."""
  start = width * np.arange(32)
  j0, off = start // 32, start % 32
  spills = off + width > 32
  return (j0.astype(np.int32), off.astype(np.uint32),
          np.where(spills, j0 + 1, j0).astype(np.int32),
          np.where(spills, 32 - off, 0).astype(np.uint32), spills)


def pack_bits(values: jax.Array, width: int) -> jax.Array:
  """[..., N] unsigned values (low `width` bits used) -> [..., packed_words(N, width)] uint32."""
  _check_width(width)
  *lead, n = values.shape
  groups = -(-n // 32)
  v = jnp.pad(values.astype(jnp.uint32), [(0, 0)] * len(lead) + [(0, groups * 32 - n)])
  v = v & _mask(width)
  if 32 % width == 0:                # whole values per word: shift and add
    per_word = 32 // width
    v_WxP = v.reshape(*lead, groups * width, per_word)
    shifts = _lead(width * np.arange(per_word, dtype=np.uint32), v_WxP.ndim)
    return jnp.sum(v_WxP << shifts, axis=-1, dtype=jnp.uint32)
  v_GxV = v.reshape(*lead, groups, 32)
  words = None
  for value, lsh, rsh, used in _pack_plan(width):
    part = jnp.take(v_GxV, value, axis=-1)           # [..., G, width]
    part = (part >> _lead(rsh, part.ndim)) << _lead(lsh, part.ndim)
    if not used.all():
      part = jnp.where(_lead(used, part.ndim), part, np.uint32(0))
    words = part if words is None else words | part
  return words.reshape(*lead, groups * width)


def unpack_bits(words: jax.Array, width: int, n: int) -> jax.Array:
  """Inverse of `pack_bits`: [..., packed_words(n, width)] uint32 -> [..., n] uint32."""
  _check_width(width)
  *lead, m = words.shape
  groups = -(-n // 32)
  if m != groups * width:
    raise ValueError(f"expected {groups * width} words for {n} values of {width} bits, got {m}")
  if 32 % width == 0:
    shifts = _lead(width * np.arange(32 // width, dtype=np.uint32), words.ndim + 1)
    out = (words[..., None] >> shifts) & _mask(width)
  else:
    w_GxW = words.reshape(*lead, groups, width)
    j0, off, j1, hsh, spills = _unpack_plan(width)
    lo = jnp.take(w_GxW, j0, axis=-1) >> _lead(off, w_GxW.ndim)
    hi = jnp.take(w_GxW, j1, axis=-1) << _lead(hsh, w_GxW.ndim)
    out = jnp.where(_lead(spills, w_GxW.ndim), lo | hi, lo) & _mask(width)
  return out.reshape(*lead, groups * 32)[..., :n]


def running_count(mask: jax.Array) -> jax.Array:
  """[..., N] bool -> [..., N] int32: True entries up to and including each position (an
  inclusive `cumsum`). XLA:CPU runs `lax.cumsum` as a window reduction, about 3 ns a value
  (7 x 430k: 9.5 ms); here the mask is packed 32 values to a word, only the words' popcounts
  are summed that way (32x fewer), and each value adds the popcount of its word's bits up to
  it: 4.4 ms."""
  *lead, n = mask.shape
  groups = -(-n // 32)
  words_G = pack_bits(mask, 1)                                            # [..., G]
  count_G = lax.population_count(words_G).astype(jnp.int32)
  # Materialized: fused into the per-value sum, XLA:CPU recomputes the cumsum's window levels
  # (slices, pads and index arithmetic) for every value (peer delta x8, the decode's ranks:
  # 1632 -> 498 ms of thread time per step).
  before_G = lax.optimization_barrier(lax.cumsum(count_G, axis=count_G.ndim - 1) - count_G)
  upto_32 = (np.uint32(2) << np.arange(32, dtype=np.uint32)) - np.uint32(1)   # bits 0..k
  within_Gx32 = lax.population_count(words_G[..., None] & _lead(upto_32, words_G.ndim + 1))
  out = before_G[..., None] + within_Gx32.astype(jnp.int32)
  return out.reshape(*lead, groups * 32)[..., :n]
