"""Causal self-attention with rotary embeddings and QK-norm (OLMoE).

Letters: B batch, S sequence, D model width, H heads, Dh head width.
QK-norm normalizes the whole projected q (and k) vector of width H*Dh before the heads are split,
as OLMoE does. Rotary embeddings use the half-split (rotate_half) convention.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.layers.matmul import dense
from moejax.layers.norm import rms_norm
from moejax.sharding.axes import ATTENTION, EMBED, HEADS, KV_HEADS, NORM, NORMS, Q_HEADS, param


def rotary_tables(seq_len: int, head_dim: int, theta: float):
  """(cos, sin) [S, Dh] for positions 0..seq_len-1."""
  return rotary_at(jnp.arange(seq_len, dtype=jnp.float32), head_dim, theta)


def rotary_at(positions_S, head_dim: int, theta: float):
  """(cos, sin) [S, Dh] for the given token positions (a KV-cached step's are not 0..S-1)."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles_SxHalf = positions_S.astype(jnp.float32)[:, None] * inv_freq[None, :]
  angles_SxDh = jnp.concatenate([angles_SxHalf, angles_SxHalf], axis=-1)
  return jnp.cos(angles_SxDh), jnp.sin(angles_SxDh)


def apply_rotary(x_BxSxHxDh, cos_SxDh, sin_SxDh):
  x32 = x_BxSxHxDh.astype(jnp.float32)
  half = x32.shape[-1] // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  cos, sin = cos_SxDh[None, :, None, :], sin_SxDh[None, :, None, :]
  return (x32 * cos + rotated * sin).astype(x_BxSxHxDh.dtype)


class Attention(nnx.Module):
  def __init__(self, d_model: int, num_heads: int, head_dim: int, *, rope_theta: float,
               norm_eps: float, init_std: float, rngs: nnx.Rngs):
    hd = num_heads * head_dim
    init = jax.nn.initializers.normal(init_std)
    self.wq = param(init(rngs.params(), (d_model, hd), jnp.float32), (EMBED, Q_HEADS), ATTENTION)
    self.wk = param(init(rngs.params(), (d_model, hd), jnp.float32), (EMBED, KV_HEADS), ATTENTION)
    self.wv = param(init(rngs.params(), (d_model, hd), jnp.float32), (EMBED, KV_HEADS), ATTENTION)
    self.wo = param(init(rngs.params(), (hd, d_model), jnp.float32), (HEADS, EMBED), ATTENTION)
    self.q_norm = param(jnp.ones((hd,), jnp.float32), (NORM,), NORMS)
    self.k_norm = param(jnp.ones((hd,), jnp.float32), (NORM,), NORMS)
    self.num_heads, self.head_dim = num_heads, head_dim
    self.rope_theta, self.norm_eps = rope_theta, norm_eps

  def __call__(self, x_BxSxD):
    s = x_BxSxD.shape[1]
    q_BxSxHxDh, k_BxSxHxDh, v_BxSxHxDh = self.qkv(
        x_BxSxD, rotary_tables(s, self.head_dim, self.rope_theta))
    out_BxSxHxDh = jax.nn.dot_product_attention(q_BxSxHxDh, k_BxSxHxDh, v_BxSxHxDh,
                                                is_causal=True)
    return self.project_out(out_BxSxHxDh)

  def qkv(self, x_BxSxD, rotary):
    """q, k, v [B, S, H, Dh]: projected, QK-normed, q and k rotated by `rotary` = (cos, sin)
    [S, Dh] of the tokens' positions (`rotary_tables`, or `rotary_at` with a KV cache)."""
    b, s, _ = x_BxSxD.shape
    dtype = x_BxSxD.dtype
    q = rms_norm(dense(x_BxSxD, self.wq[...].astype(dtype)), self.q_norm[...], self.norm_eps)
    k = rms_norm(dense(x_BxSxD, self.wk[...].astype(dtype)), self.k_norm[...], self.norm_eps)
    v = dense(x_BxSxD, self.wv[...].astype(dtype))
    shape = (b, s, self.num_heads, self.head_dim)
    q_BxSxHxDh, k_BxSxHxDh, v_BxSxHxDh = q.reshape(shape), k.reshape(shape), v.reshape(shape)
    cos, sin = rotary
    return apply_rotary(q_BxSxHxDh, cos, sin), apply_rotary(k_BxSxHxDh, cos, sin), v_BxSxHxDh

  def project_out(self, out_BxSxHxDh):
    b, s = out_BxSxHxDh.shape[:2]
    return dense(out_BxSxHxDh.reshape(b, s, -1), self.wo[...].astype(out_BxSxHxDh.dtype))
