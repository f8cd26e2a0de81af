"""The encode/decode ops in plain numpy, bit by bit: the oracle of the Triton interpreter tests.

No jax here (the interpreter tests run in an environment with torch and triton but without
jax). The tests of the main environment check that these functions equal the pure-jnp reference
(`reference.py`, built from `bits`, `detect` and `payload`) bit for bit, and the interpreter tests
check the Triton kernels against these functions, so the kernels are tied to the jnp reference.

Bit patterns are unsigned integers of the float's width (uint16 or uint32); the formats are the
ones of `payload` (see `geometry`). Letters as in `geometry`, plus R cached shards (W - 1) and
W devices.
"""
from __future__ import annotations

import numpy as np

from moejax.codec.kernels.geometry import Geometry


def uint_dtype(g: Geometry) -> np.dtype:
  return np.dtype(np.uint16 if g.total_bits == 16 else np.uint32)


def split(bits_N: np.ndarray, g: Geometry) -> tuple[np.ndarray, np.ndarray]:
  """Bit patterns -> (exponent uint8, sign+mantissa uint64)."""
  b = np.asarray(bits_N).astype(np.uint64)
  exp = (b >> np.uint64(g.mant_bits)) & np.uint64((1 << g.exp_bits) - 1)
  sign = b >> np.uint64(g.total_bits - 1)
  rest = (sign << np.uint64(g.mant_bits)) | (b & np.uint64((1 << g.mant_bits) - 1))
  return exp.astype(np.uint8), rest


def merge(exp: np.ndarray, rest: np.ndarray, g: Geometry) -> np.ndarray:
  e = np.asarray(exp).astype(np.uint64) & np.uint64((1 << g.exp_bits) - 1)
  r = np.asarray(rest).astype(np.uint64)
  sign = (r >> np.uint64(g.mant_bits)) & np.uint64(1)
  mant = r & np.uint64((1 << g.mant_bits) - 1)
  out = (sign << np.uint64(g.total_bits - 1)) | (e << np.uint64(g.mant_bits)) | mant
  return out.astype(uint_dtype(g))


def pack(values: np.ndarray, width: int) -> np.ndarray:
  """[n] values -> uint32 words: bit k of value i is bit i * width + k of the words' little-endian
  bit string, whole groups of 32 values (zero padded)."""
  v = np.asarray(values).astype(np.uint64).reshape(-1)
  n = v.size
  bit_string = ((v[:, None] >> np.arange(width, dtype=np.uint64)) & np.uint64(1)).reshape(-1)
  padded = np.zeros(-(-n // 32) * 32 * width, np.uint64)
  padded[:bit_string.size] = bit_string
  words = padded.reshape(-1, 32) << np.arange(32, dtype=np.uint64)
  return words.sum(axis=1).astype(np.uint32)


def unpack(words: np.ndarray, width: int, n: int) -> np.ndarray:
  """Inverse of `pack`: the first n values, as uint64."""
  w = np.asarray(words).astype(np.uint64).reshape(-1)
  bit_string = ((w[:, None] >> np.arange(32, dtype=np.uint64)) & np.uint64(1)).reshape(-1)
  b = bit_string[:n * width].reshape(n, width)
  return (b << np.arange(width, dtype=np.uint64)).sum(axis=1).astype(np.uint64)


def encode(bits_N: np.ndarray, prev_NP: np.ndarray, g: Geometry):
  """-> (exponents [NP] uint8, wire [L] uint32, changed values, changed blocks)."""
  exp_N, rest_N = split(bits_N, g)
  exp_NP = np.zeros(g.cache_width, np.uint8)
  exp_NP[:g.n] = exp_N
  changed_NP = exp_NP != np.asarray(prev_NP, np.uint8)
  padded = np.zeros(g.num_blocks * g.block_size, bool)
  padded[:g.cache_width] = changed_NP
  changed_NB = padded.reshape(g.num_blocks, g.block_size).any(axis=1)
  units = changed_NB if g.mode == "block" else changed_NP
  idx = np.flatnonzero(units)[:g.capacity]
  if g.mode == "block":
    blocks_CxB = np.zeros((g.capacity, g.block_size), np.uint8)
    blocks_CxB[:idx.size] = exp_NP.reshape(g.num_blocks, g.block_size)[idx]
    patch = [pack(changed_NB, 1), pack(blocks_CxB, g.exp_bits)]
  else:
    pos_C = np.zeros(g.capacity, np.int64)     # unused slots: position 0, its current exponent
    pos_C[:idx.size] = idx
    patch = [pack(pos_C, g.pos_bits), pack(exp_NP[pos_C], g.exp_bits)]
  wire = np.concatenate([pack(rest_N, g.rest_bits)] + patch)
  return exp_NP, wire, int(changed_NP.sum()), int(changed_NB.sum())


def decode(cache_RxNP: np.ndarray, wire_WxL: np.ndarray, own_NP: np.ndarray, me: int,
           g: Geometry):
  """-> (bit patterns [W, N], patched cache [R, NP]). Cache row r belongs to device
  r + (r >= me); device `me` takes `own_NP`."""
  wire_WxL = np.asarray(wire_WxL, np.uint32)
  w = wire_WxL.shape[0]
  cache = np.array(cache_RxNP, np.uint8, copy=True)
  b = g.block_size
  for r in range(w - 1):
    patch = wire_WxL[r + (r >= me), g.rest_words:]
    head, tail = patch[:g.head_words], patch[g.head_words:]
    if g.mode == "block":
      idx = np.flatnonzero(unpack(head, 1, g.num_blocks))[:g.capacity]
      blocks_CxB = unpack(tail, g.exp_bits, g.capacity * b).reshape(g.capacity, b)
      for k, blk in enumerate(idx):
        cache[r, blk * b:(blk + 1) * b] = blocks_CxB[k]
    else:
      pos_C = unpack(head, g.pos_bits, g.capacity).astype(np.int64)
      cache[r, pos_C] = unpack(tail, g.exp_bits, g.capacity)
  out = np.zeros((w, g.n), uint_dtype(g))
  for d in range(w):
    exp = own_NP if d == me else cache[d - (d > me)]
    rest = unpack(wire_WxL[d, :g.rest_words], g.rest_bits, g.n)
    out[d] = merge(np.asarray(exp)[:g.n], rest, g)
  return out, cache
