"""Gated DeltaNet: linear attention with a decaying, delta-rule memory (Qwen3-Next's and
Qwen3.5's linear layers; Yang et al., "Gated Delta Networks").

Letters: B batch, S sequence, D model width, Hk key heads, Hv value heads (a multiple of Hk:
each key head serves Hv/Hk consecutive value heads), Dk key width, Dv value width, K the
convolution's taps, C channels of the convolution (q, k and v: 2 Hk Dk + Hv Dv), Nc chunks of
`chunk` tokens (Cs).

Per value head a memory M [Dk, Dv] replaces the KV cache. At each token, with q and k
L2-normalized and q scaled by 1/sqrt(Dk):

    M <- exp(g) M                          g = -exp(a_log) softplus(x wa + dt_bias) <= 0
    M <- M + k (beta (v - k^T M))^T        beta = sigmoid(x wb): the delta rule's step
    o  = q^T M

q, k and v come from a causal depthwise convolution of K taps over their projections, then
SiLU; the output is RMS-normalized per head, scaled by its weight and by SiLU(x wz), and
projected back to D.

`gated_delta_rule` computes the recurrence chunk by chunk (the WY form: within a chunk every
token's update is one lower-triangular solve, across chunks one scan carries M), in fp32;
`gated_delta_rule_by_token` is the recurrence itself, one token at a time: the reference and
the decoding step.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from moejax import profiling
from moejax.layers.matmul import dense
from moejax.layers.norm import rms_norm
from moejax.sharding.axes import (ATTENTION, CONV, DECAY, EMBED, HEAD, HEADS, KV_HEADS, NORM,
                                  NORMS, Q_HEADS, param)

CHUNK = 64          # tokens per chunk of `gated_delta_rule` (FLA's and transformers')
L2_EPS = 1e-6       # inside the L2 norm's rsqrt, as FLA and transformers


class LinearState(NamedTuple):
  """A Gated DeltaNet layer's decoding state: the convolution's last K - 1 inputs
  [B, K-1, C] (compute dtype) and each value head's memory [B, Hv, Dk, Dv] (fp32)."""
  conv_BxKxC: jax.Array
  memory_BxHxDkxDv: jax.Array


def l2_normalize(x):
  return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def _prepare(q_BxSxHkxDk, k_BxSxHkxDk, v_BxSxHvxDv, g_BxSxHv, beta_BxSxHv):
  """fp32 [B, Hv, S, *] operands: q and k repeated to the value heads and L2-normalized, q
  scaled by 1/sqrt(Dk)."""
  repeat = v_BxSxHvxDv.shape[2] // q_BxSxHkxDk.shape[2]
  f32 = lambda x: jnp.swapaxes(x.astype(jnp.float32), 1, 2)   # noqa: E731
  q = l2_normalize(f32(jnp.repeat(q_BxSxHkxDk, repeat, axis=2)))
  k = l2_normalize(f32(jnp.repeat(k_BxSxHkxDk, repeat, axis=2)))
  q = q * q.shape[-1] ** -0.5
  return q, k, f32(v_BxSxHvxDv), f32(g_BxSxHv), f32(beta_BxSxHv)


def gated_delta_rule_by_token(q_BxSxHkxDk, k_BxSxHkxDk, v_BxSxHvxDv, g_BxSxHv, beta_BxSxHv,
                              memory_BxHxDkxDv=None):
  """The recurrence one token at a time -> (o [B, S, Hv, Dv] fp32, final memory)."""
  q, k, v, g, beta = _prepare(q_BxSxHkxDk, k_BxSxHkxDk, v_BxSxHvxDv, g_BxSxHv, beta_BxSxHv)
  B, H, _, Dk = k.shape
  Dv = v.shape[-1]
  memory = (jnp.zeros((B, H, Dk, Dv), jnp.float32) if memory_BxHxDkxDv is None
            else memory_BxHxDkxDv.astype(jnp.float32))

  def step(memory, xs):
    q_t, k_t, v_t, g_t, beta_t = xs           # [B, H, *]
    memory = memory * jnp.exp(g_t)[..., None, None]
    delta = (v_t - jnp.einsum("bhk,bhkv->bhv", k_t, memory)) * beta_t[..., None]
    memory = memory + k_t[..., :, None] * delta[..., None, :]
    return memory, jnp.einsum("bhk,bhkv->bhv", q_t, memory)

  at_t = lambda x: jnp.moveaxis(x, 2, 0)     # noqa: E731  [S, B, H, *]
  memory, o_SxBxHxDv = lax.scan(step, memory, tuple(map(at_t, (q, k, v, g, beta))))
  return jnp.transpose(o_SxBxHxDv, (1, 0, 2, 3)), memory


def gated_delta_rule(q_BxSxHkxDk, k_BxSxHkxDk, v_BxSxHvxDv, g_BxSxHv, beta_BxSxHv,
                     memory_BxHxDkxDv=None, chunk: int = CHUNK):
  """The recurrence by chunks of `chunk` tokens -> (o [B, S, Hv, Dv] fp32, final memory).

  Within a chunk, with G_i the decay summed from the chunk's start to token i and
  Gamma_ij = exp(G_i - G_j) (j <= i), the updates u (the delta rule's beta (v - k^T M) of
  each token, memory before it) solve (I + L) u = beta v - beta exp(G) k^T M0, L_ij =
  beta_i k_i^T k_j Gamma_ij below the diagonal: one triangular solve per chunk, batched over
  all chunks; then o_i = exp(G_i) q_i^T M0 + sum_{j<=i} Gamma_ij (q_i . k_j) u_j and
  M1 = exp(G_last) M0 + sum_j exp(G_last - G_j) k_j u_j^T, by one scan over the chunks."""
  q, k, v, g, beta = _prepare(q_BxSxHkxDk, k_BxSxHkxDk, v_BxSxHvxDv, g_BxSxHv, beta_BxSxHv)
  B, H, S, Dk = k.shape
  Dv = v.shape[-1]
  pad = -S % chunk
  if pad:   # zero decay (g = 0) and zero beta: padded tokens change nothing
    q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
    g, beta = (jnp.pad(x, ((0, 0), (0, 0), (0, pad))) for x in (g, beta))
  n = (S + pad) // chunk
  by_chunk = lambda x: x.reshape(B, H, n, chunk, *x.shape[3:])   # noqa: E731
  q, k, v, g, beta = map(by_chunk, (q, k, v, g, beta))
  G = jnp.cumsum(g, axis=-1)                                     # [B, H, n, Cs]
  lower = jnp.tril(jnp.ones((chunk, chunk), bool)).reshape(1, 1, 1, chunk, chunk)
  # exp only where j <= i: above the diagonal G_i - G_j > 0 could overflow
  gamma = jnp.exp(jnp.where(lower, G[..., :, None] - G[..., None, :], -jnp.inf))
  k_beta = k * beta[..., None]
  # L below the diagonal; the solve reads the diagonal as ones (unit_diagonal): I + L
  strictly = jnp.einsum("...ik,...jk->...ij", k_beta, k) * gamma
  solve = lambda rhs: lax.linalg.triangular_solve(   # noqa: E731  (I + L)^-1 rhs
      strictly, rhs, left_side=True, lower=True, unit_diagonal=True)
  u0 = solve(v * beta[..., None])                    # the updates with M0 = 0
  w = solve(k_beta * jnp.exp(G)[..., None])          # ... and their change per unit of M0
  qk = jnp.einsum("...ik,...jk->...ij", q, k) * gamma
  q_decayed = q * jnp.exp(G)[..., None]
  G_last = G[..., -1:]
  k_to_end = k * jnp.exp(G_last - G)[..., None]

  def step(memory, xs):            # memory [B, H, Dk, Dv]; xs: one chunk's [B, H, Cs, *]
    u0, w, qk, q_decayed, k_to_end, G_last = xs
    u = u0 - jnp.einsum("bhck,bhkv->bhcv", w, memory)
    o = jnp.einsum("bhck,bhkv->bhcv", q_decayed, memory) + jnp.einsum("bhij,bhjv->bhiv", qk, u)
    memory = memory * jnp.exp(G_last)[..., None] + jnp.einsum("bhck,bhcv->bhkv", k_to_end, u)
    return memory, o

  memory = (jnp.zeros((B, H, Dk, Dv), jnp.float32) if memory_BxHxDkxDv is None
            else memory_BxHxDkxDv.astype(jnp.float32))
  at_chunk = lambda x: jnp.moveaxis(x, 2, 0)         # noqa: E731  [n, B, H, ...]
  memory, o = lax.scan(step, memory,
                       tuple(map(at_chunk, (u0, w, qk, q_decayed, k_to_end, G_last))))
  o_BxHxSxDv = jnp.moveaxis(o, 0, 2).reshape(B, H, n * chunk, Dv)[:, :, :S]
  return jnp.swapaxes(o_BxHxSxDv, 1, 2), memory


def causal_conv(x_BxSxC, taps_KxC, past_BxKxC=None, bias_C=None):
  """Depthwise causal convolution, then SiLU: y_t = silu(sum_j w_j x_{t-K+1+j} + bias) (torch's
  Conv1d with K - 1 zeros of left padding, cut to S; `bias_C` None: none), the K - 1 inputs
  before the first `past_BxKxC` (zeros when None). Returns (y [B, S, C], the last K - 1 inputs
  [B, K-1, C])."""
  K = taps_KxC.shape[0]
  B, S, C = x_BxSxC.shape
  past = (jnp.zeros((B, K - 1, C), x_BxSxC.dtype) if past_BxKxC is None
          else past_BxKxC.astype(x_BxSxC.dtype))
  padded = jnp.concatenate([past, x_BxSxC], axis=1)                   # [B, S + K - 1, C]
  taps = taps_KxC.astype(jnp.float32)
  y = sum(padded[:, j:j + S].astype(jnp.float32) * taps[j].reshape(1, 1, C) for j in range(K))
  if bias_C is not None:
    y = y + bias_C.astype(jnp.float32).reshape(1, 1, C)
  return jax.nn.silu(y).astype(x_BxSxC.dtype), padded[:, S:]


def conv_init(rngs: nnx.Rngs, taps: int, shape):
  """torch's Conv1d default for a depthwise convolution of `taps` taps (its weights and bias):
  uniform within 1/sqrt(taps)."""
  bound = 1.0 / math.sqrt(taps)
  return jax.random.uniform(rngs.params(), shape, jnp.float32, -bound, bound)


class GatedDeltaNet(nnx.Module):
  """Gated DeltaNet (module docstring): the q, k, v, output-gate z, beta (wb) and decay (wa)
  projections of x, the convolution's taps over q, k and v (conv_q, conv_k, conv_v [K, *]),
  each value head's decay rate (a_log) and time-step bias (dt_bias), the output norm's scale
  [Dv] (shared by the heads) and the output projection wo."""

  def __init__(self, d_model: int, *, key_heads: int, value_heads: int, key_dim: int,
               value_dim: int, conv_taps: int = 4, norm_eps: float = 1e-6, init_std: float,
               rngs: nnx.Rngs, chunk: int = CHUNK):
    if value_heads % key_heads:
      raise ValueError(f"linear attention: key_heads={key_heads} does not divide "
                       f"value_heads={value_heads}")
    init = jax.nn.initializers.normal(init_std)
    kw, vw = key_heads * key_dim, value_heads * value_dim

    def weight(shape, axes):
      return param(init(rngs.params(), shape, jnp.float32), axes, ATTENTION)

    self.wq = weight((d_model, kw), (EMBED, KV_HEADS))
    self.wk = weight((d_model, kw), (EMBED, KV_HEADS))
    self.wv = weight((d_model, vw), (EMBED, Q_HEADS))
    self.wz = weight((d_model, vw), (EMBED, Q_HEADS))
    self.wb = weight((d_model, value_heads), (EMBED, HEAD))
    self.wa = weight((d_model, value_heads), (EMBED, HEAD))
    for name, width, axis in (("conv_q", kw, KV_HEADS), ("conv_k", kw, KV_HEADS),
                              ("conv_v", vw, Q_HEADS)):
      taps = conv_init(rngs, conv_taps, (conv_taps, width))
      setattr(self, name, param(taps, (CONV, axis), ATTENTION))
    # transformers' init: dt_bias 1, decay rates exp(a_log) uniform in [0.01, 16)
    self.dt_bias = param(jnp.ones((value_heads,), jnp.float32), (HEAD,), DECAY)
    rates = jax.random.uniform(rngs.params(), (value_heads,), jnp.float32, 0.01, 16.0)
    self.a_log = param(jnp.log(rates), (HEAD,), DECAY)
    self.out_norm = param(jnp.ones((value_dim,), jnp.float32), (NORM,), NORMS)
    self.wo = weight((vw, d_model), (HEADS, EMBED))
    self.key_heads, self.value_heads = key_heads, value_heads
    self.key_dim, self.value_dim = key_dim, value_dim
    self.norm_eps, self.chunk = norm_eps, chunk

  @profiling.scoped("attention")
  def __call__(self, x_BxSxD):
    return self.with_state(x_BxSxD)[0]

  def with_state(self, x_BxSxD, state: LinearState | None = None, *, by_token: bool = False):
    """(y [B, S, D], the state after the last token) from the state before the first (None:
    zeros); `by_token`: the recurrence one token at a time (decoding), else by chunks."""
    B, S, _ = x_BxSxD.shape
    Hk, Hv, Dk, Dv = self.key_heads, self.value_heads, self.key_dim, self.value_dim
    qkv = jnp.concatenate([dense(x_BxSxD, w[...]) for w in (self.wq, self.wk, self.wv)], -1)
    taps = jnp.concatenate([self.conv_q[...], self.conv_k[...], self.conv_v[...]], axis=-1)
    qkv, conv_BxKxC = causal_conv(qkv, taps, None if state is None else state.conv_BxKxC)
    q = qkv[..., :Hk * Dk].reshape(B, S, Hk, Dk)
    k = qkv[..., Hk * Dk:2 * Hk * Dk].reshape(B, S, Hk, Dk)
    v = qkv[..., 2 * Hk * Dk:].reshape(B, S, Hv, Dv)
    beta = jax.nn.sigmoid(dense(x_BxSxD, self.wb[...], jnp.float32))
    per_head = lambda p: p[...].astype(jnp.float32).reshape(1, 1, Hv)   # noqa: E731
    g = -jnp.exp(per_head(self.a_log)) * jax.nn.softplus(
        dense(x_BxSxD, self.wa[...], jnp.float32) + per_head(self.dt_bias))
    memory = None if state is None else state.memory_BxHxDkxDv
    if by_token:
      o, memory = gated_delta_rule_by_token(q, k, v, g, beta, memory)
    else:
      o, memory = gated_delta_rule(q, k, v, g, beta, memory, self.chunk)
    z = dense(x_BxSxD, self.wz[...], jnp.float32).reshape(B, S, Hv, Dv)
    o = rms_norm(o, self.out_norm[...], self.norm_eps) * jax.nn.silu(z)
    y = dense(o.reshape(B, S, Hv * Dv).astype(x_BxSxD.dtype), self.wo[...])
    return y, LinearState(conv_BxKxC, memory)
