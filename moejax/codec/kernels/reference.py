"""Pure-jnp encode and decode of one shard's wire: the codec's own `bits`, `detect` and
`payload` functions, composed. This is the path on every platform but CUDA and the reference the
kernels are tested against.

encode: bit patterns [N] and the previous exponents [NP] -> exponents [NP] (the next `prev`),
  the wire [L] = packed sign+mantissa then the patch of the first C changed units, and the
  numbers of changed values and of changed blocks (exact detection).
decode: the cache of the other W-1 shards [R, NP], every device's wire [W, L], this device's
  exponents [NP] and its index `me` -> bit patterns [W, N] of all shards and the patched cache.
  Cache row r belongs to device r + (r >= me).

Letters: N values, NP cached exponents, NB blocks, R = W - 1 cached shards, W devices, L wire
words.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax.codec import bits
from moejax.codec import detect
from moejax.codec import payload


class Encoded(NamedTuple):
  exp: jax.Array             # [NP] uint8: this shard's exponents, zero padded
  wire: jax.Array            # [L] uint32: packed sign+mantissa, then the patch
  value_changes: jax.Array   # int32: values whose exponent differs from prev
  block_changes: jax.Array   # int32: blocks holding such a value

  def count(self, fmt: payload.Format) -> jax.Array:
    """Changed units (blocks or values): over `fmt.capacity` the patch is not decodable."""
    return self.block_changes if fmt.mode == "block" else self.value_changes


def encode(bits_N: jax.Array, prev_NP: jax.Array, fmt: payload.Format,
           layout: bits.Layout) -> Encoded:
  exp_N, rest_N = bits.split_bits(bits_N, layout)
  exp_NP = jnp.pad(exp_N, (0, fmt.cache_width - fmt.n))
  changed_NP = detect.changed_values(exp_NP, prev_NP)
  changed_NB = jnp.any(detect.block_view(changed_NP, fmt.block_size), axis=1)
  patch_P, _ = payload.encode(exp_NP, changed_NB if fmt.mode == "block" else changed_NP, fmt)
  wire_L = jnp.concatenate([bits.pack_bits(rest_N, layout.rest_bits), patch_P])
  return Encoded(exp_NP, wire_L, jnp.sum(changed_NP, dtype=jnp.int32),
                 jnp.sum(changed_NB, dtype=jnp.int32))


def decode(cache_RxNP: jax.Array, wire_WxL: jax.Array, own_NP: jax.Array, me: jax.Array,
           fmt: payload.Format, layout: bits.Layout) -> tuple[jax.Array, jax.Array]:
  w = wire_WxL.shape[0]
  rest_words = bits.packed_words(fmt.n, layout.rest_bits)
  r = jnp.arange(w - 1, dtype=jnp.int32)
  others_R = r + (r >= me).astype(jnp.int32)
  d = jnp.arange(w, dtype=jnp.int32)
  rows_W = jnp.where(d == me, w - 1, d - (d > me).astype(jnp.int32))
  rest_WxN = bits.unpack_bits(wire_WxL[:, :rest_words], layout.rest_bits, fmt.n)
  cache_RxNP = payload.decode(cache_RxNP, jnp.take(wire_WxL[:, rest_words:], others_R, axis=0),
                              fmt)
  exp_WxNP = jnp.take(jnp.concatenate([cache_RxNP, own_NP[None]]), rows_W, axis=0)
  return bits.merge_bits(exp_WxNP[:, :fmt.n], rest_WxN, layout), cache_RxNP
