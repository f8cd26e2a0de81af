"""Mamba-2: a selective state-space layer in its chunked (SSD) form (Dao & Gu, "Transformers
are SSMs"); Granite-4.0-H's mamba layers (transformers' granitemoehybrid, Bamba's mixer).

Letters: B batch, S sequence, D model width, G groups (each group's B and C serve H/G
consecutive heads), N state width, H heads, P head width (I = H P the inner width), K the
convolution's taps, C channels of the convolution (x, B and C: I + 2 G N).

Per head a state M [N, P]. At each token, with dt = softplus(x wdt + dt_bias) > 0 and
A = -exp(a_log) < 0:

    M <- exp(dt A) M + B (dt x)^T
    y  = C^T M + d_skip x

x, B and C come from a causal depthwise convolution of K taps, with a bias, over their
projections, then SiLU; y is gated by SiLU(x wz), RMS-normalized over each group's I/G
channels, scaled by its weight [I] and projected back to D.

This is gated linear attention (q = C, k = B, v = dt x, log decay g = dt A) without Gated
DeltaNet's delta rule: `ssd` computes it by chunks (within a chunk the decayed, causally masked
(C B^T) v, batched over all chunks; one scan across chunks carries M), `ssd_by_token` one token
at a time (the reference and the decoding step). Its decoding state is Gated DeltaNet's
`LinearState` of the same widths (model.linear_key_heads = G, linear_key_dim = N,
linear_value_heads = H, linear_value_dim = P), so the decoder's linear-layer machinery (parameter
groups, decoding, memory) serves both (`model.linear_kind`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from moejax import profiling
from moejax.layers.linear_attention import CHUNK, LinearState, causal_conv, conv_init
from moejax.layers.matmul import dense
from moejax.sharding.axes import (ATTENTION, BIASES, CONV, DECAY, EMBED, HEAD, HEADS, KV_HEADS,
                                  NORM, NORMS, Q_HEADS, param)


def _by_group(c_BxSxGxN, b_BxSxGxN, v_BxSxHxP, g_BxSxH):
  """fp32 operands, heads split by group: C and B [B, G, S, N]; v [B, G, r, S, P]; g
  [B, G, r, S] (r = H/G heads per group)."""
  batch, seq, groups, _ = c_BxSxGxN.shape
  r = v_BxSxHxP.shape[2] // groups
  f32 = lambda x: jnp.swapaxes(x.astype(jnp.float32), 1, 2)   # noqa: E731  [B, *, S, ...]
  v = f32(v_BxSxHxP).reshape(batch, groups, r, seq, -1)
  g = f32(g_BxSxH).reshape(batch, groups, r, seq)
  return f32(c_BxSxGxN), f32(b_BxSxGxN), v, g


def _memory(memory_BxHxNxP, batch, groups, r, n, p):
  if memory_BxHxNxP is None:
    return jnp.zeros((batch, groups, r, n, p), jnp.float32)
  return memory_BxHxNxP.astype(jnp.float32).reshape(batch, groups, r, n, p)


def _heads_out(o_BxGxrxSxP, memory_BxGxrxNxP):
  """(o [B, S, H, P], memory [B, H, N, P])."""
  batch, groups, r, seq, p = o_BxGxrxSxP.shape
  o = jnp.moveaxis(o_BxGxrxSxP.reshape(batch, groups * r, seq, p), 2, 1)
  return o, memory_BxGxrxNxP.reshape(batch, groups * r, *memory_BxGxrxNxP.shape[3:])


def ssd_by_token(c_BxSxGxN, b_BxSxGxN, v_BxSxHxP, g_BxSxH, memory_BxHxNxP=None):
  """The recurrence one token at a time -> (o [B, S, H, P] fp32, final memory [B, H, N, P])."""
  c, b, v, g = _by_group(c_BxSxGxN, b_BxSxGxN, v_BxSxHxP, g_BxSxH)
  batch, groups, r, _, p = v.shape
  memory = _memory(memory_BxHxNxP, batch, groups, r, c.shape[-1], p)

  def step(memory, xs):
    c_t, b_t, v_t, g_t = xs                  # [B, G, N], [B, G, N], [B, G, r, P], [B, G, r]
    memory = (memory * jnp.exp(g_t)[..., None, None]
              + b_t[:, :, None, :, None] * v_t[..., None, :])
    return memory, jnp.einsum("bgn,bgrnp->bgrp", c_t, memory)

  memory, o_SxBxGxrxP = lax.scan(step, memory, (jnp.moveaxis(c, 2, 0), jnp.moveaxis(b, 2, 0),
                                               jnp.moveaxis(v, 3, 0), jnp.moveaxis(g, 3, 0)))
  return _heads_out(jnp.moveaxis(o_SxBxGxrxP, 0, 3), memory)


def ssd(c_BxSxGxN, b_BxSxGxN, v_BxSxHxP, g_BxSxH, memory_BxHxNxP=None, chunk: int = CHUNK):
  """The recurrence by chunks of `chunk` tokens -> (o [B, S, H, P] fp32, final memory).

  Within a chunk, with G_i the decay summed from the chunk's start to token i and
  Gamma_ij = exp(G_i - G_j) (j <= i): o_i = exp(G_i) C_i^T M0 + sum_{j<=i} Gamma_ij (C_i . B_j)
  v_j and M1 = exp(G_last) M0 + sum_j exp(G_last - G_j) B_j v_j^T. C . B is one product per
  group, shared by its heads; only the scan over chunks is sequential."""
  c, b, v, g = _by_group(c_BxSxGxN, b_BxSxGxN, v_BxSxHxP, g_BxSxH)
  batch, groups, r, seq, p = v.shape
  n_state = c.shape[-1]
  pad = -seq % chunk
  if pad:   # zero decay and zero input: padded tokens change nothing
    c, b = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (c, b))
    v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, pad), (0, 0)))
    g = jnp.pad(g, ((0, 0), (0, 0), (0, 0), (0, pad)))
  n = (seq + pad) // chunk
  c, b = (x.reshape(batch, groups, n, chunk, n_state) for x in (c, b))
  v = v.reshape(batch, groups, r, n, chunk, p)
  G = jnp.cumsum(g.reshape(batch, groups, r, n, chunk), axis=-1)          # [B, G, r, n, Cs]
  lower = jnp.tril(jnp.ones((chunk, chunk), bool))
  # exp only where j <= i: above the diagonal G_i - G_j > 0 could overflow
  gamma = jnp.exp(jnp.where(lower, G[..., :, None] - G[..., None, :], -jnp.inf))
  cb = jnp.einsum("bgnik,bgnjk->bgnij", c, b)                             # per group
  intra = jnp.einsum("bgnij,bgrnij,bgrnjp->bgrnip", cb, gamma, v)
  G_last = G[..., -1:]
  v_to_end = v * jnp.exp(G_last - G)[..., None]

  def step(memory, xs):        # memory [B, G, r, N, P]; xs: one chunk's
    c, b, v_to_end, G, G_last = xs
    o = jnp.einsum("bgck,bgrkp->bgrcp", c, memory) * jnp.exp(G)[..., None]
    memory = (memory * jnp.exp(G_last)[..., None]
              + jnp.einsum("bgck,bgrcp->bgrkp", b, v_to_end))
    return memory, o

  memory = _memory(memory_BxHxNxP, batch, groups, r, n_state, p)
  memory, inter = lax.scan(step, memory, (jnp.moveaxis(c, 2, 0), jnp.moveaxis(b, 2, 0),
                                          jnp.moveaxis(v_to_end, 3, 0), jnp.moveaxis(G, 3, 0),
                                          jnp.moveaxis(G_last, 3, 0)))
  o = intra + jnp.moveaxis(inter, 0, 3)                                   # [B, G, r, n, Cs, P]
  o = o.reshape(batch, groups, r, n * chunk, p)[:, :, :, :seq]
  return _heads_out(o, memory)


class Mamba2(nnx.Module):
  """Mamba-2 (module docstring): the gate z, x, B, C and time-step (wdt) projections of x, the
  convolution's taps and biases over x, B and C (conv_x, conv_b, conv_c [K, *] and their
  *_bias), each head's time-step bias (dt_bias), decay rate (a_log) and skip (d_skip), the
  gated norm's scale [I] and the output projection wo."""

  def __init__(self, d_model: int, *, groups: int, heads: int, state_dim: int, head_dim: int,
               conv_taps: int = 4, norm_eps: float = 1e-6, init_std: float, rngs: nnx.Rngs,
               chunk: int = CHUNK):
    if heads % groups:
      raise ValueError(f"mamba2: groups={groups} does not divide heads={heads}")
    init = jax.nn.initializers.normal(init_std)
    inner, bc = heads * head_dim, groups * state_dim

    def weight(shape, axes):
      return param(init(rngs.params(), shape, jnp.float32), axes, ATTENTION)

    self.wz = weight((d_model, inner), (EMBED, Q_HEADS))
    self.wx = weight((d_model, inner), (EMBED, Q_HEADS))
    self.wb = weight((d_model, bc), (EMBED, KV_HEADS))
    self.wc = weight((d_model, bc), (EMBED, KV_HEADS))
    self.wdt = weight((d_model, heads), (EMBED, HEAD))
    for name, width, axis in (("conv_x", inner, Q_HEADS), ("conv_b", bc, KV_HEADS),
                              ("conv_c", bc, KV_HEADS)):
      taps = conv_init(rngs, conv_taps, (conv_taps, width))
      setattr(self, name, param(taps, (CONV, axis), ATTENTION))
      bias = conv_init(rngs, conv_taps, (width,))
      setattr(self, f"{name}_bias", param(bias, (axis,), BIASES))
    # transformers' init: dt_bias 1, A = 1..H, skip 1
    self.dt_bias = param(jnp.ones((heads,), jnp.float32), (HEAD,), DECAY)
    self.a_log = param(jnp.log(jnp.arange(1, heads + 1, dtype=jnp.float32)), (HEAD,), DECAY)
    self.d_skip = param(jnp.ones((heads,), jnp.float32), (HEAD,), DECAY)
    self.out_norm = param(jnp.ones((inner,), jnp.float32), (NORM,), NORMS)
    self.wo = weight((inner, d_model), (HEADS, EMBED))
    self.groups, self.heads = groups, heads
    self.state_dim, self.head_dim = state_dim, head_dim
    self.norm_eps, self.chunk = norm_eps, chunk

  @profiling.scoped("attention")
  def __call__(self, x_BxSxD):
    return self.with_state(x_BxSxD)[0]

  def with_state(self, x_BxSxD, state: LinearState | None = None, *, by_token: bool = False):
    """(y [B, S, D], the state after the last token) from the state before the first (None:
    zeros); `by_token`: the recurrence one token at a time (decoding), else by chunks."""
    B, S, _ = x_BxSxD.shape
    G, H, N, P = self.groups, self.heads, self.state_dim, self.head_dim
    inner = H * P
    xbc = jnp.concatenate([dense(x_BxSxD, w[...]) for w in (self.wx, self.wb, self.wc)], -1)
    taps = jnp.concatenate([self.conv_x[...], self.conv_b[...], self.conv_c[...]], axis=-1)
    bias = jnp.concatenate([self.conv_x_bias[...], self.conv_b_bias[...],
                            self.conv_c_bias[...]], axis=-1)
    xbc, conv_BxKxC = causal_conv(xbc, taps, None if state is None else state.conv_BxKxC, bias)
    x = xbc[..., :inner].reshape(B, S, H, P).astype(jnp.float32)
    b = xbc[..., inner:inner + G * N].reshape(B, S, G, N)
    c = xbc[..., inner + G * N:].reshape(B, S, G, N)
    per_head = lambda p: p[...].astype(jnp.float32).reshape(1, 1, H)   # noqa: E731
    dt = jax.nn.softplus(dense(x_BxSxD, self.wdt[...], jnp.float32) + per_head(self.dt_bias))
    g = -jnp.exp(per_head(self.a_log)) * dt
    v = x * dt[..., None]
    memory = None if state is None else state.memory_BxHxDkxDv
    rule = ssd_by_token if by_token else functools.partial(ssd, chunk=self.chunk)
    o, memory = rule(c, b, v, g, memory)
    y = (o + per_head(self.d_skip)[..., None] * x).reshape(B, S, inner)
    y = y * jax.nn.silu(dense(x_BxSxD, self.wz[...], jnp.float32))
    # the gated norm: RMS over each group's I/G channels (norm_before_gate=False)
    y = y.reshape(B, S, G, inner // G)
    y = y * lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + self.norm_eps)
    y = y.reshape(B, S, inner) * self.out_norm[...].astype(jnp.float32).reshape(1, 1, inner)
    return dense(y.astype(x_BxSxD.dtype), self.wo[...]), LinearState(conv_BxKxC, memory)
