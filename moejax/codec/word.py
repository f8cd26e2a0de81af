"""Whole-word patches: receivers cache every value of a shard, senders ship the values that changed.

Where values change rarely as a whole (small learning rates, rarely used embedding rows, norms),
shipping the changed values outright beats shipping every sign+mantissa (exponent modes). A
word patch is a flat uint32 vector of static size:

  [bitmap of changed values: N bits][the first C changed values, in order: C values of
   `value_bits` bits each (the full bit pattern: 16 for bf16/fp16, 32 for fp32)]

Unused value slots are zero. A value "changed" when any of its bits differs from the previous
gather's (`detect.changed_values` on the bit patterns), so a patch is exact for every bit pattern
(NaN payloads, -0.0, subnormals). As in the exponent formats, a patch whose change count exceeds
its capacity is not decodable; `encode` returns the count so the caller can agree on a dense
fallback first.

The cache of one shard holds its N bit patterns (`cache_width` = N) in the float's unsigned type.

Letters: N values in a shard, C capacity (values), R cached shards (rows), P patch words.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from moejax.codec import bits
from moejax.codec import detect
from moejax.codec import payload


@dataclasses.dataclass(frozen=True)
class WordFormat:
  """Static description of one shard's word patch."""
  n: int
  value_bits: int   # bits of one value (the float's width)
  capacity: int     # changed values a patch holds

  mode = "word"

  def __post_init__(self):
    if self.n < 1 or self.capacity < 1:
      raise ValueError(f"n and capacity must be >= 1, got {self}")
    if self.value_bits not in (16, 32):
      raise ValueError(f"value_bits must be 16 or 32, got {self.value_bits}")

  @classmethod
  def create(cls, n: int, value_bits: int, capacity_fraction: float) -> "WordFormat":
    """Capacity = ceil(fraction * n), at least 1 and at most n."""
    return cls(n, value_bits, min(n, max(1, math.ceil(capacity_fraction * n))))

  @property
  def cache_width(self) -> int:
    return self.n

  @property
  def sections(self) -> tuple[int, int]:
    """Words of the two parts of a patch: (bitmap, values)."""
    return bits.packed_words(self.n, 1), bits.packed_words(self.capacity, self.value_bits)

  @property
  def words(self) -> int:
    """P: uint32 words of one patch."""
    return sum(self.sections)

  def fill_bits(self, count):
    """Bits the patch's content needs for `count` changed values."""
    return self.n + count * self.value_bits


def changed(bits_N: jax.Array, prev_N: jax.Array) -> jax.Array:
  """[N] bool: the bit pattern differs from the previous one."""
  return detect.changed_values(bits_N, prev_N)


def encode(bits_N: jax.Array, changed_N: jax.Array, fmt: WordFormat) -> tuple[jax.Array, jax.Array]:
  """Bit patterns [N] (unsigned) and a change mask [N] -> (patch [P] uint32, number of changed
  values int32). Holds the first C changes when over capacity."""
  count = jnp.sum(changed_N, dtype=jnp.int32)
  idx_C = payload.first_true(changed_N, fmt.capacity, fmt.n)
  vals_C = jnp.take(bits_N, idx_C, mode="fill", fill_value=0)
  return jnp.concatenate([bits.pack_bits(changed_N, 1),
                          bits.pack_bits(vals_C, fmt.value_bits)]), count


def decode(cache_RxN: jax.Array, patches_RxP: jax.Array, fmt: WordFormat) -> jax.Array:
  """Apply R patches to R cached shards ([R, N] unsigned bit patterns). A patch over capacity
  applies only the first C changes (callers fall back before decoding such patches)."""
  r = cache_RxN.shape[0]
  head = fmt.sections[0]
  changed_RxN = bits.unpack_bits(patches_RxP[:, :head], 1, fmt.n).astype(bool)
  idx_RxC = payload.first_true(changed_RxN, fmt.capacity, fmt.n)
  vals_RxC = bits.unpack_bits(patches_RxP[:, head:], fmt.value_bits, fmt.capacity)
  rows_Rx1 = jnp.arange(r, dtype=jnp.int32)[:, None]
  return cache_RxN.at[rows_Rx1, idx_RxC].set(vals_RxC.astype(cache_RxN.dtype), mode="drop")
