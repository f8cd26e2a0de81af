"""Causal self-attention with rotary embeddings, the families' variants as options.

Letters: B batch, S sequence, D model width, H query heads, G key/value heads, Dh head width.

  grouped-query  `num_kv_heads` G dividing H: each k/v head serves H/G query heads (Mixtral,
                 Qwen); G = H is multi-head attention (OLMoE).
  QK-norm        "full": RMSNorm over the whole projected q (width H*Dh) and k (G*Dh) before the
                 heads are split (OLMoE); "head": over each head's Dh, one scale shared by the
                 heads (Qwen3); "none" (Mixtral, Qwen2).
  qkv bias       biases on the q, k and v projections, not the output one (Qwen2).

Rotary embeddings use the half-split (rotate_half) convention.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.layers.matmul import dense
from moejax.layers.norm import rms_norm
from moejax.sharding.axes import (ATTENTION, BIASES, EMBED, HEADS, KV_HEADS, NORM, NORMS, Q_HEADS,
                                  param)

QK_NORMS = ("full", "head", "none")


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
               norm_eps: float, init_std: float, rngs: nnx.Rngs, num_kv_heads: int = 0,
               qk_norm: str = "full", qkv_bias: bool = False):
    num_kv_heads = num_kv_heads or num_heads
    if qk_norm not in QK_NORMS:
      raise ValueError(f"qk_norm={qk_norm!r}: must be one of {', '.join(QK_NORMS)}")
    if num_heads % num_kv_heads:
      raise ValueError(f"num_kv_heads={num_kv_heads} does not divide num_heads={num_heads}")
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    init = jax.nn.initializers.normal(init_std)
    self.wq = param(init(rngs.params(), (d_model, q_width), jnp.float32), (EMBED, Q_HEADS),
                    ATTENTION)
    self.wk = param(init(rngs.params(), (d_model, kv_width), jnp.float32), (EMBED, KV_HEADS),
                    ATTENTION)
    self.wv = param(init(rngs.params(), (d_model, kv_width), jnp.float32), (EMBED, KV_HEADS),
                    ATTENTION)
    self.wo = param(init(rngs.params(), (q_width, d_model), jnp.float32), (HEADS, EMBED),
                    ATTENTION)
    if qkv_bias:
      self.bq = param(jnp.zeros((q_width,), jnp.float32), (Q_HEADS,), BIASES)
      self.bk = param(jnp.zeros((kv_width,), jnp.float32), (KV_HEADS,), BIASES)
      self.bv = param(jnp.zeros((kv_width,), jnp.float32), (KV_HEADS,), BIASES)
    if qk_norm != "none":
      q_norm, k_norm = (q_width, kv_width) if qk_norm == "full" else (head_dim, head_dim)
      self.q_norm = param(jnp.ones((q_norm,), jnp.float32), (NORM,), NORMS)
      self.k_norm = param(jnp.ones((k_norm,), jnp.float32), (NORM,), NORMS)
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.qk_norm, self.qkv_bias = qk_norm, qkv_bias
    self.rope_theta, self.norm_eps = rope_theta, norm_eps

  def __call__(self, x_BxSxD):
    s = x_BxSxD.shape[1]
    q_BxSxHxDh, k_BxSxGxDh, v_BxSxGxDh = self.qkv(
        x_BxSxD, rotary_tables(s, self.head_dim, self.rope_theta))
    out_BxSxHxDh = jax.nn.dot_product_attention(q_BxSxHxDh, k_BxSxGxDh, v_BxSxGxDh,
                                                is_causal=True)
    return self.project_out(out_BxSxHxDh)

  def _project(self, x_BxSxD, w, b):
    y = dense(x_BxSxD, w[...].astype(x_BxSxD.dtype))
    return y if b is None else y + b[...].astype(y.dtype)[None, None, :]

  def qkv(self, x_BxSxD, rotary):
    """q [B, S, H, Dh], k and v [B, S, G, Dh]: projected, QK-normed, q and k rotated by
    `rotary` = (cos, sin) [S, Dh] of the tokens' positions (`rotary_tables`, or `rotary_at` with
    a KV cache)."""
    b, s, _ = x_BxSxD.shape
    bias = (self.bq, self.bk, self.bv) if self.qkv_bias else (None, None, None)
    q = self._project(x_BxSxD, self.wq, bias[0])
    k = self._project(x_BxSxD, self.wk, bias[1])
    v = self._project(x_BxSxD, self.wv, bias[2])
    if self.qk_norm == "full":
      q = rms_norm(q, self.q_norm[...], self.norm_eps)
      k = rms_norm(k, self.k_norm[...], self.norm_eps)
    q_BxSxHxDh = q.reshape(b, s, self.num_heads, self.head_dim)
    k_BxSxGxDh = k.reshape(b, s, self.num_kv_heads, self.head_dim)
    v_BxSxGxDh = v.reshape(b, s, self.num_kv_heads, self.head_dim)
    if self.qk_norm == "head":
      q_BxSxHxDh = rms_norm(q_BxSxHxDh, self.q_norm[...], self.norm_eps)
      k_BxSxGxDh = rms_norm(k_BxSxGxDh, self.k_norm[...], self.norm_eps)
    cos, sin = rotary
    return (apply_rotary(q_BxSxHxDh, cos, sin), apply_rotary(k_BxSxGxDh, cos, sin),
            v_BxSxGxDh)

  def project_out(self, out_BxSxHxDh):
    b, s = out_BxSxHxDh.shape[:2]
    return dense(out_BxSxHxDh.reshape(b, s, -1), self.wo[...].astype(out_BxSxHxDh.dtype))
