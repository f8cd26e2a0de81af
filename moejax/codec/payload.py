"""Exponent patches with static shapes: what a sender ships so receivers can update their caches.

Two formats, both a flat uint32 word vector of a size fixed by the shard size and a capacity:

* block:   [bitmap of changed blocks: NB bits][exponents of the first C changed blocks, in block
           order: C * B values of `exp_bits` bits]. Unused slots are zero.
* element: [positions of the first C changed values: C values of `pos_bits` bits][their new
           exponents: C values of `exp_bits` bits]. Unused slots repeat position 0 with its
           current exponent: writing it is always right, so no sentinel (and no extra position
           bit) is needed.

Everything is packed with `bits.pack_bits`, so positions take `pos_bits = bit_length(
cache_width - 1)` bits (20 bits for 2^20 values) and float16 exponents 5 bits. A patch whose
change count exceeds its capacity is not decodable; `encode` returns the count so that the caller
can agree on a dense fallback before anything is decoded.

The cache of one shard holds `cache_width` exponents: N rounded up to whole blocks in block mode,
N in element mode.

Letters: N values in a shard, NB blocks, B values per block, C capacity (blocks or values),
R cached shards (rows), P patch words.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from moejax.codec import bits
from moejax.codec import detect

MODES = ("block", "element")


@dataclasses.dataclass(frozen=True)
class Format:
  """Static description of one shard's patch."""
  mode: str
  n: int
  exp_bits: int
  block_size: int
  capacity: int   # changed blocks (block mode) or changed values (element mode) a patch holds

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
    if self.n < 1 or self.block_size < 1 or self.capacity < 1:
      raise ValueError(f"n, block_size and capacity must be >= 1, got {self}")

  @classmethod
  def create(cls, mode: str, n: int, exp_bits: int, block_size: int,
             capacity_fraction: float) -> "Format":
    """Capacity = ceil(fraction * units), at least 1 and at most all units (blocks or values);
    the configured block size evened out over the shard (`detect.shard_block_size`)."""
    block_size = detect.shard_block_size(n, block_size)
    units = detect.num_blocks(n, block_size) if mode == "block" else n
    capacity = min(units, max(1, math.ceil(capacity_fraction * units)))
    return cls(mode, n, exp_bits, block_size, capacity)

  @property
  def num_blocks(self) -> int:
    return detect.num_blocks(self.n, self.block_size)

  @property
  def cache_width(self) -> int:
    return self.num_blocks * self.block_size if self.mode == "block" else self.n

  @property
  def pos_bits(self) -> int:
    return max(1, (self.cache_width - 1).bit_length())

  @property
  def sections(self) -> tuple[int, int]:
    """Words of the two parts of a patch (bitmap, blocks) or (positions, exponents)."""
    if self.mode == "block":
      return (bits.packed_words(self.num_blocks, 1),
              bits.packed_words(self.capacity * self.block_size, self.exp_bits))
    return (bits.packed_words(self.capacity, self.pos_bits),
            bits.packed_words(self.capacity, self.exp_bits))

  @property
  def words(self) -> int:
    """P: uint32 words of one patch."""
    return sum(self.sections)

  def fill_bits(self, count):
    """Bits the patch's content needs for `count` changed units (no padding, no unused slots)."""
    if self.mode == "block":
      return float(self.num_blocks) + count * self.block_size * self.exp_bits
    return count * (self.pos_bits + self.exp_bits)


# Above this many entries `first_true` ranks by a running count instead of sorting: slower to
# compile on XLA:CPU, much faster to run on long shards.
SORT_MAX = 1 << 16


def first_true(mask: jax.Array, size: int, fill_value: int) -> jax.Array:
  """Indices of the first `size` True entries along the last axis, in order, padded with
  `fill_value` ([..., size] int32): `jnp.nonzero(mask, size=...)` for any leading axes. Up to
  SORT_MAX entries it is one sort of the keys (index where True, n where False), which compiles
  far faster on XLA:CPU than nonzero; above, each True entry's rank is its running count, and
  on CPU a binary search of that count finds each slot's entry, elsewhere each entry is
  written to its rank's slot."""
  mask = jnp.asarray(mask, jnp.bool_)    # (the running count reads it as bits)
  n = mask.shape[-1]
  if n > SORT_MAX:
    return lax.platform_dependent(
        mask, cpu=functools.partial(_searched_ranks, size=size, fill_value=fill_value),
        default=functools.partial(_scattered_ranks, size=size, fill_value=fill_value))
  key = jnp.where(mask, jnp.arange(n, dtype=jnp.int32), jnp.int32(n))
  if size > n:
    key = jnp.concatenate([key, jnp.full(mask.shape[:-1] + (size - n,), n, jnp.int32)], axis=-1)
  first = lax.sort(key, dimension=key.ndim - 1)[..., :size]
  return jnp.where(first < n, first, jnp.int32(fill_value))


def _searched_ranks(mask: jax.Array, size: int, fill_value: int) -> jax.Array:
  """`first_true` on XLA:CPU: the j-th True entry is where the running count first reaches
  j + 1, a binary search per slot (log n gathers of `size` entries). Not a scatter of every
  entry to its rank: XLA:CPU runs scatters one element at a time (7 x 430k entries: 31 -> 18
  ms)."""
  n = mask.shape[-1]
  count = bits.running_count(mask)
  targets = jnp.arange(1, size + 1, dtype=jnp.int32)
  search = lambda c: jnp.searchsorted(c, targets, side="left", method="scan")  # noqa: E731
  idx = jax.vmap(search)(count.reshape(-1, n)).reshape(mask.shape[:-1] + (size,))
  return jnp.where(idx < n, idx.astype(jnp.int32), jnp.int32(fill_value))


def _scattered_ranks(mask: jax.Array, size: int, fill_value: int) -> jax.Array:
  """`first_true` on GPU and TPU: one scatter of each True entry to the slot of its rank
  (entries ranked past `size`, and False ones, fall outside and are dropped). The binary search
  is log n passes over the slots: on an H200 at OLMoE-1B-7B's shapes 23 passes of a coded
  replica's 1.5M slots in each of 16 layers, 285 ms of fssdp's step against about 5 for this
  (`scripts/gpu_schedule.py`, priced by `moejax.perf.latencies`)."""
  n = mask.shape[-1]
  mask_RxN = mask.reshape(-1, n)
  slot_RxN = jnp.where(mask_RxN, bits.running_count(mask_RxN) - 1, size)
  rows_Rx1 = jnp.arange(mask_RxN.shape[0], dtype=jnp.int32)[:, None]
  index_RxN = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), mask_RxN.shape)
  first_RxS = jnp.full((mask_RxN.shape[0], size), fill_value, jnp.int32).at[
      rows_Rx1, slot_RxN].set(index_RxN, mode="drop")
  return first_RxS.reshape(mask.shape[:-1] + (size,))


def encode(exp_N: jax.Array, changed: jax.Array, fmt: Format) -> tuple[jax.Array, jax.Array]:
  """Exponents [cache_width] uint8 and a change mask ([NB] block mode, [N] element mode) ->
  (patch [P] uint32, number of changed units int32). Holds the first C changes when over."""
  count = jnp.sum(changed, dtype=jnp.int32)
  c = fmt.capacity
  if fmt.mode == "block":
    idx_C = first_true(changed, c, fmt.num_blocks)
    blocks_CxB = jnp.take(exp_N.reshape(fmt.num_blocks, fmt.block_size), idx_C, axis=0,
                          mode="fill", fill_value=0)
    parts = [bits.pack_bits(changed, 1), bits.pack_bits(blocks_CxB.reshape(-1), fmt.exp_bits)]
  else:
    pos_C = first_true(changed, c, 0)
    vals_C = exp_N[pos_C]
    parts = [bits.pack_bits(pos_C, fmt.pos_bits), bits.pack_bits(vals_C, fmt.exp_bits)]
  return jnp.concatenate(parts), count


def decode(cache_RxN: jax.Array, patches_RxP: jax.Array, fmt: Format) -> jax.Array:
  """Apply R patches to R cached shards ([R, cache_width] uint8). A patch over capacity applies
  only the first C changes (callers fall back before decoding such patches)."""
  r = cache_RxN.shape[0]
  c = fmt.capacity
  head = fmt.sections[0]
  rows_Rx1 = jnp.arange(r, dtype=jnp.int32)[:, None]
  if fmt.mode == "block":
    changed_RxNB = bits.unpack_bits(patches_RxP[:, :head], 1, fmt.num_blocks).astype(bool)
    idx_RxC = first_true(changed_RxNB, c, fmt.num_blocks)
    blocks_RxCxB = bits.unpack_bits(patches_RxP[:, head:], fmt.exp_bits, c * fmt.block_size)
    blocks_RxCxB = blocks_RxCxB.astype(jnp.uint8).reshape(r, c, fmt.block_size)
    cache_RxNBxB = cache_RxN.reshape(r, fmt.num_blocks, fmt.block_size)
    cache_RxNBxB = cache_RxNBxB.at[rows_Rx1, idx_RxC].set(blocks_RxCxB, mode="drop")
    return cache_RxNBxB.reshape(r, fmt.cache_width)
  pos_RxC = bits.unpack_bits(patches_RxP[:, :head], fmt.pos_bits, c).astype(jnp.int32)
  vals_RxC = bits.unpack_bits(patches_RxP[:, head:], fmt.exp_bits, c).astype(jnp.uint8)
  return cache_RxN.at[rows_Rx1, pos_RxC].set(vals_RxC, mode="promise_in_bounds")

