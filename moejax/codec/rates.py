"""Change rates of every codec mode for one shard, whatever mode it is in: what the run-time
choice (`moejax.train.codec_control`) measures before it picks a mode per parameter.

`change_counts(bits, prev_bits, layout, block_size)` -> int32 [len(RATE_KINDS)], one column per
rate kind (`CodecSpec.rate_kind`, and "far" for delta mode's far list).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.codec import bits
from moejax.codec import detect
from moejax.codec import word

RATE_KINDS = ("element", "block", "word") + tuple(f"delta{k}" for k in word.DELTA_BITS) + ("far",)


def change_counts(bits_N: jax.Array, prev_bits_N: jax.Array, layout, block_size: int) -> jax.Array:
  """Bit patterns of a shard now and at the previous gather ([N], `layout.uint_dtype`) ->
  int32 [len(RATE_KINDS)]: values whose exponent changed, blocks holding such a value, values
  with any bit changed, for each delta code width K the values that move too far for a code
  (escapes), and the values that move more than NEAR_MAX (far escapes)."""
  exp_N, _ = bits.split_bits(bits_N, layout)
  prev_N, _ = bits.split_bits(prev_bits_N, layout)
  exp_changed = detect.changed_values(exp_N, prev_N)
  block = detect.shard_block_size(exp_changed.shape[0], block_size)   # as the patch's blocks
  blocks = jnp.any(detect.block_view(exp_changed, block), axis=1)
  d_N = jnp.abs(word.key_delta(bits_N, prev_bits_N, layout.total_bits))   # |INT_MIN| < 0: far
  esc = [jnp.sum((d_N > reach) | (d_N < 0), dtype=jnp.int32)
         for reach in [2 ** (k - 1) - 1 for k in word.DELTA_BITS] + [word.NEAR_MAX]]
  return jnp.stack([jnp.sum(exp_changed, dtype=jnp.int32), jnp.sum(blocks, dtype=jnp.int32),
                    jnp.sum(detect.changed_values(bits_N, prev_bits_N), dtype=jnp.int32), *esc])
