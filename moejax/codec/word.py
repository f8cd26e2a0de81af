"""Whole-word patches: receivers cache every value of a shard, senders ship what changed.

Where values change rarely as a whole (small learning rates, rarely used embedding rows, norms),
shipping the changed values outright beats shipping every sign+mantissa (exponent modes). A
patch is a flat uint32 vector of static size:

  word:  [bitmap of changed values: N bits][the first C changed values, in order: C values of
          `value_bits` bits each (the full bit pattern: 16 for bf16/fp16, 32 for fp32)]
  delta: [a code per value: N codes of K bits (K = 3: as K bit planes, `pack_codes`)]
         [the first C escapes, in order: C signed bytes]
         [the first F far escapes, in order: F full bit patterns]

`word` mode: the bitmap says which values changed, and every changed value travels whole.
`delta` mode (K = 2, 3 or 4; 8 for expert replicas, where every move within 127 units is a
code and every escape a whole value): most values move by a few units in the last place from
one step to the next, so a code says "unchanged", "moved by d" for 1 <= |d| <= D = 2^(K-1) - 1,
or "escaped".
An escape carries d in a signed byte when |d| <= 127 and otherwise the byte -128 and the whole new
value in the far list. d is the difference of the values' order keys (`order_key`: the bit
pattern mapped one to one onto integers in the floats' order, so +-0.0, subnormals, infinities
and NaN payloads all have a key), so adding d to the cached key gives the new bit pattern
exactly. Codes: 0 unchanged, 1..D for d = 1..D, D+1..2D for d = -1..-D, 2D+1 escaped.

Unused value slots are zero. A value "changed" when any of its bits differs from the previous
gather's (`detect.changed_values` on the bit patterns), so a patch is exact for every bit pattern
(NaN payloads, -0.0, subnormals). As in the exponent formats, a patch whose escape (or far escape)
count exceeds its capacity is not decodable; `encode` returns the counts so the caller can agree
on a dense fallback first.

The cache of one shard holds its N bit patterns (`cache_width` = N) in the float's unsigned type,
in both modes (a switch between them keeps the caches).

Letters: N values in a shard, C capacity (values), F far capacity, R cached shards (rows), P patch
words.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from moejax.codec import bits
from moejax.codec import detect
from moejax.codec import payload

DELTA_BITS = (2, 3, 4)             # code widths of delta mode
CODE_BITS = (1,) + DELTA_BITS + (8,)   # 8: a byte per value (`moejax.codec.replicas`)
NEAR_BITS = 8                      # an escape's d, when |d| <= NEAR_MAX
NEAR_MAX = 127                     # larger moves travel as whole values ("far")
_FAR = np.uint32(1 << (NEAR_BITS - 1))   # the byte -128: "the value is in the far list"


@dataclasses.dataclass(frozen=True)
class WordFormat:
  """Static description of one shard's word or delta patch."""
  n: int
  value_bits: int        # bits of one value (the float's width)
  capacity: int          # C: changed values (word) or escapes (delta) a patch holds
  code_bits: int = 1     # K: 1 = word mode (a bitmap), 2-4 = delta mode
  far_capacity: int = 0  # F: delta mode's whole values (escapes with |d| > 127); 0 in word mode

  def __post_init__(self):
    if self.n < 1 or self.capacity < 1:
      raise ValueError(f"n and capacity must be >= 1, got {self}")
    if self.value_bits not in (16, 32):
      raise ValueError(f"value_bits must be 16 or 32, got {self.value_bits}")
    if self.code_bits not in CODE_BITS:
      raise ValueError(f"code_bits must be one of {CODE_BITS}, got {self.code_bits}")
    if (self.far_capacity < 1) == (self.code_bits > 1):
      raise ValueError(f"far_capacity must be >= 1 in delta mode and 0 in word mode, got {self}")

  @classmethod
  def create(cls, n: int, value_bits: int, capacity_fraction: float, code_bits: int = 1,
             far_fraction: float = 0.0) -> "WordFormat":
    """Capacities = ceil(fraction * n), at least 1 and at most n (far: delta mode only)."""
    size = lambda f: min(n, max(1, math.ceil(f * n)))   # noqa: E731
    return cls(n, value_bits, size(capacity_fraction), code_bits,
               size(far_fraction) if code_bits > 1 else 0)

  @property
  def mode(self) -> str:
    return "word" if self.code_bits == 1 else "delta"

  @property
  def max_delta(self) -> int:
    """D: the largest |d| a code carries (0 in word mode)."""
    return 2 ** (self.code_bits - 1) - 1 if self.code_bits > 1 else 0

  @property
  def escape(self) -> int:
    return 2 ** self.code_bits - 1

  @property
  def slot_bits(self) -> int:
    """Bits of one escape slot: the whole value (word), a signed byte (delta)."""
    return self.value_bits if self.code_bits == 1 else NEAR_BITS

  @property
  def cache_width(self) -> int:
    return self.n

  @property
  def sections(self) -> tuple[int, int, int]:
    """Words of the parts of a patch: (codes, escapes, far values)."""
    return (bits.packed_words(self.n, self.code_bits),
            bits.packed_words(self.capacity, self.slot_bits),
            bits.packed_words(self.far_capacity, self.value_bits) if self.far_capacity else 0)

  @property
  def words(self) -> int:
    """P: uint32 words of one patch."""
    return sum(self.sections)

  def fill_bits(self, count, far=0):
    """Bits the patch's content needs for `count` escapes, `far` of them whole values."""
    # a float, not a Python int: a shard's code bits pass 2^31 at DeepSeek-V3's sizes
    return float(self.n * self.code_bits) + count * self.slot_bits + far * self.value_bits


def changed(bits_N: jax.Array, prev_N: jax.Array) -> jax.Array:
  """[N] bool: the bit pattern differs from the previous one."""
  return detect.changed_values(bits_N, prev_N)


def order_key(bits_N: jax.Array, value_bits: int) -> jax.Array:
  """Bit patterns -> uint32 keys, one to one, increasing with the float value (negative values
  reversed below the positive ones; -0.0 just below +0.0; NaNs at the ends)."""
  sign, mask = np.uint32(1 << (value_bits - 1)), np.uint32((1 << value_bits) - 1)
  u = bits_N.astype(jnp.uint32)
  return jnp.where((u & sign) != 0, ~u & mask, u | sign)


def from_key(key_N: jax.Array, value_bits: int, dtype) -> jax.Array:
  """Inverse of `order_key`, as `dtype` (the float's unsigned type)."""
  sign, mask = np.uint32(1 << (value_bits - 1)), np.uint32((1 << value_bits) - 1)
  key_N = key_N & mask             # keys are added to modulo 2^value_bits
  return jnp.where((key_N & sign) != 0, key_N ^ sign, ~key_N & mask).astype(dtype)


def key_delta(bits_N: jax.Array, prev_N: jax.Array, value_bits: int) -> jax.Array:
  """int32 [N]: d with order_key(bits) = order_key(prev) + d (mod 2^value_bits), d taken in
  [-2^(value_bits-1), 2^(value_bits-1))."""
  shift = np.uint32(32 - value_bits)
  diff = order_key(bits_N, value_bits) - order_key(prev_N, value_bits)   # wraps mod 2^32
  return jax.lax.shift_right_arithmetic(
      jax.lax.bitcast_convert_type(diff << shift, jnp.int32), jnp.int32(32 - value_bits))


def codes(bits_N: jax.Array, prev_N: jax.Array, fmt: WordFormat, d_N: jax.Array | None = None):
  """uint32 [N] codes of the change from `prev_N` to `bits_N` (see the module docstring).
  `d_N`: their `key_delta`, when the caller has it (delta mode)."""
  if fmt.code_bits == 1:
    return changed(bits_N, prev_N).astype(jnp.uint32)
  d_N = key_delta(bits_N, prev_N, fmt.value_bits) if d_N is None else d_N
  m = fmt.max_delta
  small = jnp.where(d_N > 0, d_N, m - d_N).astype(jnp.uint32)        # 1..D, D+1..2D
  in_range = (d_N >= -m) & (d_N <= m)
  # order_key is one to one: d = 0 exactly when the bit pattern is unchanged.
  return jnp.where(d_N == 0, np.uint32(0), jnp.where(in_range, small, np.uint32(fmt.escape)))


def _far(codes_N: jax.Array, d_N: jax.Array, fmt: WordFormat) -> jax.Array:
  """[N] bool: escapes whose move does not fit the escape byte (delta mode)."""
  return (codes_N == fmt.escape) & ((d_N > NEAR_MAX) | (d_N < -NEAR_MAX))


def escapes(codes_N: jax.Array, fmt: WordFormat, d_N: jax.Array | None = None):
  """(escapes, far escapes) int32 of a patch: what its capacities must hold."""
  count = jnp.sum(codes_N == fmt.escape, dtype=jnp.int32)
  if fmt.code_bits == 1:
    return count, jnp.int32(0)
  return count, jnp.sum(_far(codes_N, d_N, fmt), dtype=jnp.int32)


def pack_codes(codes_N: jax.Array, code_bits: int) -> jax.Array:
  """Codes [N] -> the codes section of a patch, as many words as `bits.pack_bits`. A width that
  does not divide 32 (3) travels as bit planes (the codes' bit k of 32 values in one word), so
  the receiver unpacks them by shifts alone: `bits.pack_bits` packs such widths across word
  boundaries, and unpacking that takes gathers, which XLA:CPU runs element by element."""
  if 32 % code_bits == 0:
    return bits.pack_bits(codes_N, code_bits)
  return jnp.concatenate([bits.pack_bits((codes_N >> np.uint32(k)) & np.uint32(1), 1)
                          for k in range(code_bits)])


def unpack_codes(words: jax.Array, code_bits: int, n: int) -> jax.Array:
  """Inverse of `pack_codes`: [..., packed_words(n, code_bits)] -> [..., n] uint32."""
  if 32 % code_bits == 0:
    return bits.unpack_bits(words, code_bits, n)
  g = bits.packed_words(n, 1)
  out = bits.unpack_bits(words[..., :g], 1, n)
  for k in range(1, code_bits):
    out = out | (bits.unpack_bits(words[..., k * g:(k + 1) * g], 1, n) << np.uint32(k))
  return out


def encode(bits_N: jax.Array, codes_N: jax.Array, fmt: WordFormat, d_N: jax.Array | None = None):
  """Bit patterns [N] (unsigned), their codes [N] (`codes`; in word mode the change mask will
  do) and, in delta mode, their `key_delta` -> (patch [P] uint32, escapes int32, far escapes
  int32). Holds the first C escapes (and F far ones) when over capacity."""
  codes_N = codes_N.astype(jnp.uint32)
  escaped_N = codes_N == fmt.escape
  idx_C = payload.first_true(escaped_N, fmt.capacity, fmt.n)
  if fmt.code_bits == 1:
    vals_C = jnp.take(bits_N, idx_C, mode="fill", fill_value=0)
    return (jnp.concatenate([bits.pack_bits(codes_N, 1), bits.pack_bits(vals_C, fmt.value_bits)]),
            *escapes(codes_N, fmt))
  if d_N is None:
    raise ValueError("delta mode needs d_N (key_delta): escapes carry their move")
  far_N = _far(codes_N, d_N, fmt)
  near_C = jnp.where(jnp.take(far_N, idx_C, mode="fill", fill_value=False), _FAR,
                     jnp.take(d_N, idx_C, mode="fill", fill_value=0).astype(jnp.uint32)
                     & np.uint32(0xFF))
  idx_F = payload.first_true(far_N, fmt.far_capacity, fmt.n)
  vals_F = jnp.take(bits_N, idx_F, mode="fill", fill_value=0)
  return (jnp.concatenate([pack_codes(codes_N, fmt.code_bits),
                           bits.pack_bits(near_C, NEAR_BITS),
                           bits.pack_bits(vals_F, fmt.value_bits)]),
          *escapes(codes_N, fmt, d_N))


def decode(cache_RxN: jax.Array, patches_RxP: jax.Array, fmt: WordFormat) -> jax.Array:
  """Apply R patches to R cached shards ([R, N] unsigned bit patterns). A patch over capacity
  applies only the first C escapes (F far ones); callers fall back before decoding such
  patches."""
  return decode_pool([cache_RxN], patches_RxP, fmt, [(0, fmt.n)])[0]


def decode_pool(caches, patches_RxP: jax.Array, fmt: WordFormat, bounds) -> list[jax.Array]:
  """`decode` of a pooled patch (`fmt` over K shards' values concatenated, shard k at
  bounds[k]) into the K shards' own caches ([R, N_k] each) -> the K new caches. The codes are
  unpacked and ranked once for the pool; each cache is updated from its own slice of them, so
  the caches are never concatenated.

  No scatter: the j-th escape of a row takes slot j of the patch, so each value reads the slot
  at its escape rank (a running count) in one gather. In delta mode the slot word holds the
  escape byte and, for a far escape, its whole new bit pattern above it (16-bit floats; 32-bit
  ones gather their far values apart): the far list is in escape order too, so slot j's far
  value is the one at its far rank among the slots. XLA:CPU runs scatters one element at a
  time: locating the escapes by scattering every position took 32 of the 57 ms this decode took
  for 7 x 430k bf16 values."""
  head, mid, _ = fmt.sections
  # The patches materialized first: inside the train step they arrive as a select of the other
  # devices' rows of the gathered payload, which XLA:CPU otherwise recomputes for each value it
  # unpacks (the codes' unpacking, peer delta x8: 962 -> 423 ms of thread time per step).
  patches_RxP = jax.lax.optimization_barrier(patches_RxP)
  # Codes materialized once, in bytes: XLA:CPU otherwise fuses their unpacking (gathers) into
  # each of their consumers and recomputes it there (delta decode of 7 x 131k values: 21 -> 8
  # ms).
  codes_RxN = jax.lax.optimization_barrier(
      unpack_codes(patches_RxP[:, :head], fmt.code_bits, fmt.n).astype(jnp.uint8))
  escaped_RxN = codes_RxN == fmt.escape
  # Ranks and the escape slots materialized once each: fused into their consumers (the slot
  # gather, the applied mask), they are recomputed per use (one device, 7 x 430k: 19 -> 7 ms).
  rank_RxN = jax.lax.optimization_barrier(bits.running_count(escaped_RxN) - 1)
  if fmt.code_bits == 1:
    slots_RxC = bits.unpack_bits(patches_RxP[:, head:], fmt.value_bits, fmt.capacity)
  else:
    near_RxC = bits.unpack_bits(patches_RxP[:, head:head + mid], NEAR_BITS, fmt.capacity)
    far_RxC = near_RxC == _FAR
    far_rank_RxC = bits.running_count(far_RxC) - 1
    vals_RxF = bits.unpack_bits(patches_RxP[:, head + mid:], fmt.value_bits, fmt.far_capacity)
    far_vals_RxC = jnp.take_along_axis(vals_RxF, jnp.clip(far_rank_RxC, 0, fmt.far_capacity - 1),
                                       axis=1)
    # Bit 8: a far escape past the far list's capacity, which stays as cached.
    slots_RxC = near_RxC | ((far_RxC & (far_rank_RxC >= fmt.far_capacity)).astype(jnp.uint32)
                            << 8)
    if fmt.value_bits <= 16:   # slot word: the escape byte, and the far value above bit 16
      slots_RxC = jnp.where(far_RxC, (far_vals_RxC << 16) | slots_RxC, slots_RxC)
  # Escapes past the capacity stay as cached (`decode`'s contract; the caller has fallen back).
  applied_RxN = escaped_RxN & (rank_RxN < fmt.capacity)
  rank_RxN = jnp.clip(rank_RxN, 0, fmt.capacity - 1)
  slots_RxC = jax.lax.optimization_barrier(slots_RxC)   # once, as rank_RxN above
  slot_RxN = jnp.take_along_axis(slots_RxC, rank_RxN, axis=1)
  if fmt.code_bits > 1:
    far_val_RxN = (slot_RxN >> 16 if fmt.value_bits <= 16
                   else jnp.take_along_axis(far_vals_RxC, rank_RxN, axis=1))
  m = fmt.max_delta
  out = []
  for cache_RxN, (a, b) in zip(caches, bounds):
    whole = (a, b) == (0, fmt.n)
    cut = (lambda x: x) if whole else (lambda x: x[:, a:b])   # noqa: E731
    slot, applied = cut(slot_RxN), cut(applied_RxN)
    if fmt.code_bits == 1:
      out.append(jnp.where(applied, slot.astype(cache_RxN.dtype), cache_RxN))
      continue
    escaped, codes = cut(escaped_RxN), cut(codes_RxN).astype(jnp.uint32)
    near = slot & np.uint32(0xFF)
    far = escaped & (near == _FAR)
    applied = applied & ((slot & np.uint32(0x100)) == 0)
    sext = (near ^ _FAR) - _FAR                                        # int8 -> mod 2^32
    d = jnp.where(escaped, sext, jnp.where(codes <= m, codes, np.uint32(m) - codes))
    key = order_key(cache_RxN, fmt.value_bits) + d
    moved = jnp.where(far, cut(far_val_RxN).astype(cache_RxN.dtype),
                      from_key(key, fmt.value_bits, cache_RxN.dtype))
    out.append(jnp.where((codes != 0) & (applied | jnp.logical_not(escaped)), moved, cache_RxN))
  return out
