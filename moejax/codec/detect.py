"""Change detection: which blocks (or values) of a shard's exponents changed since the last gather.

Two detectors, chosen by `CodecSpec.detect`:

* "exact" compares the exponents with the sender's own copy of its previous exponents
  (N bytes of state per shard). It never reports a changed block as unchanged.
* "hash" keeps two 64-bit hashes per block instead (16 bytes per block of B values, so 16/B
  bytes per value) and calls a block changed when either hash differs. A changed block goes
  unnoticed only when both hashes collide; for a given change that happens with probability
  about 2^-128, which is the price of the smaller state.

Hashes: jax_enable_x64 is off, so 64-bit words are (hi, lo) pairs of uint32 and all 64-bit
arithmetic (add, multiply, shift) is emulated exactly, modulo 2^64. A block's exponents are
packed four to a uint32 word w_j (`bits.pack_bits`, width 8). Hash number s (s = 0, 1) of a
block is

    H_s = XOR over j of splitmix64_mix(((j << 32) | w_j) + SEED_s)      (mod 2^64)

where splitmix64_mix is the SplitMix64 output function (Steele, Lea, Flood 2014):
z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31.
The position j in the high half makes the hash order-sensitive; the two seeds make the two
hashes independent in practice. The 2 x 64 bits come back as 4 uint32 per block:
(H_0 hi, H_0 lo, H_1 hi, H_1 lo).

Letters: N values, NB blocks, B values per block, J uint32 words per block.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moejax.codec import bits

GOLDEN_GAMMA = 0x9E3779B97F4A7C15
MIX_1 = 0xBF58476D1CE4E5B9
MIX_2 = 0x94D049BB133111EB
SEEDS = (GOLDEN_GAMMA, (2 * GOLDEN_GAMMA) % 2**64)
HASH_WORDS = 4  # uint32 words per block: two 64-bit hashes


def num_blocks(n: int, block_size: int) -> int:
  return -(-n // block_size)


def shard_block_size(n: int, block_size: int) -> int:
  """Values per block of an n-value shard under a configured `block_size`: the shard's
  ceil(n / block_size) blocks made as even as they go. The block count is unchanged, but a
  shard smaller than one block is one block of n values (not padded to `block_size`: a 64-value
  norm shard's changed block cost 512 exponents), and no shard pads more than NB - 1 values."""
  return -(-n // num_blocks(n, block_size))


def block_view(values_N: jax.Array, block_size: int) -> jax.Array:
  """[N] -> [NB, B], zero-padded at the end (padding never changes, so never reports a change)."""
  n = values_N.shape[0]
  nb = num_blocks(n, block_size)
  return jnp.pad(values_N, (0, nb * block_size - n)).reshape(nb, block_size)


def changed_values(exp_N: jax.Array, prev_N: jax.Array) -> jax.Array:
  """[N] bool: the exponent differs from the previous one."""
  return exp_N != prev_N


def changed_blocks(exp_N: jax.Array, prev_N: jax.Array, block_size: int) -> jax.Array:
  """[NB] bool: some exponent in the block differs from the previous one (exact)."""
  return jnp.any(block_view(changed_values(exp_N, prev_N), block_size), axis=1)


# ----------------------------------------------------------------------------------------------
# 64-bit arithmetic on (hi, lo) uint32 pairs.

_M16 = np.uint32(0xFFFF)


def _split64(c: int):
  return np.uint32(c >> 32), np.uint32(c & 0xFFFFFFFF)


def _mul32_wide(a, b):
  """Full 64-bit product of two uint32 arrays, as (hi, lo)."""
  a0, a1 = a & _M16, a >> np.uint32(16)
  b0, b1 = b & _M16, b >> np.uint32(16)
  p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
  mid = (p00 >> np.uint32(16)) + (p01 & _M16) + (p10 & _M16)
  lo = (mid << np.uint32(16)) | (p00 & _M16)
  hi = p11 + (p01 >> np.uint32(16)) + (p10 >> np.uint32(16)) + (mid >> np.uint32(16))
  return hi, lo


def _mul64_const(x, c: int):
  """(x * c) mod 2^64 for a Python constant c."""
  hi, lo = x
  c_hi, c_lo = _split64(c)
  p_hi, p_lo = _mul32_wide(lo, c_lo)
  return p_hi + lo * c_hi + hi * c_lo, p_lo


def _add64_const(x, c: int):
  hi, lo = x
  c_hi, c_lo = _split64(c)
  new_lo = lo + c_lo
  carry = (new_lo < lo).astype(jnp.uint32)
  return hi + c_hi + carry, new_lo


def _xor_shr64(x, s: int):
  """x ^ (x >> s) for 0 < s < 32."""
  hi, lo = x
  s = np.uint32(s)
  return hi ^ (hi >> s), lo ^ ((lo >> s) | (hi << (np.uint32(32) - s)))


def splitmix64_mix(x):
  """SplitMix64 output function on a (hi, lo) pair of uint32 arrays."""
  x = _mul64_const(_xor_shr64(x, 30), MIX_1)
  x = _mul64_const(_xor_shr64(x, 27), MIX_2)
  return _xor_shr64(x, 31)


def block_hashes(exp_N: jax.Array, block_size: int) -> jax.Array:
  """[N] uint8 exponents -> [NB, 4] uint32: two 64-bit hashes per block (see module docstring)."""
  words_NBxJ = bits.pack_bits(block_view(exp_N, block_size), 8)
  pos_J = jnp.arange(words_NBxJ.shape[1], dtype=jnp.uint32)
  pos_NBxJ = jnp.broadcast_to(pos_J[None, :], words_NBxJ.shape)
  out = []
  for seed in SEEDS:
    hi, lo = splitmix64_mix(_add64_const((pos_NBxJ, words_NBxJ), seed))
    out += [jnp.bitwise_xor.reduce(hi, axis=1), jnp.bitwise_xor.reduce(lo, axis=1)]
  return jnp.stack(out, axis=1)


def changed_blocks_hashed(hashes_NBx4: jax.Array, prev_NBx4: jax.Array) -> jax.Array:
  """[NB] bool: either hash of the block differs from the previous one."""
  return jnp.any(hashes_NBx4 != prev_NBx4, axis=1)


def block_hashes_reference(exp: np.ndarray, block_size: int) -> np.ndarray:
  """Plain-Python SplitMix64 version of `block_hashes`, for tests."""
  mask = 2**64 - 1

  def mix(z):
    z = ((z ^ (z >> 30)) * MIX_1) & mask
    z = ((z ^ (z >> 27)) * MIX_2) & mask
    return z ^ (z >> 31)

  exp = np.asarray(exp, np.uint8).reshape(-1)
  nb = num_blocks(exp.size, block_size)
  blocks = np.zeros(nb * block_size, np.uint8)
  blocks[:exp.size] = exp
  blocks = blocks.reshape(nb, block_size)
  words_per_block = bits.packed_words(block_size, 8)
  out = np.zeros((nb, HASH_WORDS), np.uint32)
  for b in range(nb):
    padded = np.zeros(words_per_block * 4, np.uint8)
    padded[:block_size] = blocks[b]
    words = [int.from_bytes(padded[4 * j:4 * j + 4].tobytes(), "little")
             for j in range(words_per_block)]
    for s, seed in enumerate(SEEDS):
      h = 0
      for j, w in enumerate(words):
        h ^= mix((((j << 32) | w) + seed) & mask)
      out[b, 2 * s], out[b, 2 * s + 1] = h >> 32, h & 0xFFFFFFFF
  return out
