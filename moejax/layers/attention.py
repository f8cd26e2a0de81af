"""Causal self-attention with rotary embeddings, the families' variants as options.

Letters: B batch, S sequence, D model width, H query heads, G key/value heads, Dh head width.

  grouped-query  `num_kv_heads` G dividing H: each k/v head serves H/G query heads (Mixtral,
                 Qwen); G = H is multi-head attention (OLMoE).
  QK-norm        "full": RMSNorm over the whole projected q (width H*Dh) and k (G*Dh) before the
                 heads are split (OLMoE); "head": over each head's Dh, one scale shared by the
                 heads (Qwen3); "l2": over each head's Dh without a scale, of the rotated q and
                 k, on rotated layers only (Llama 4); "none" (Mixtral, Qwen2).
  qkv bias       biases on the q, k and v projections, not the output one (Qwen2).
  out bias       a bias on the output projection (gpt-oss, beside qkv bias).
  output gate    the output of each query channel scaled by sigmoid(x Wg) before the output
                 projection (MiniCPM5-MoE, Qwen3-Next); Wg is stored inside Wq, each head's
                 query columns followed by its gate columns, as the checkpoints hold them; or,
                 `gate_own`, its own parameter wg [D, H*Dh] (AfMoE's gate_proj).
  latent         `LatentAttention`: DeepSeek-V2/V3's multi-head latent attention (below).
  sliding window `window` W > 0: each query sees itself and the W - 1 tokens before it
                 (Mistral's, EXAONE's sliding layers); 0: the whole sequence.
  chunks         `chunk` C > 0: each query sees the keys before it within its chunk of positions
                 [n C, (n + 1) C) (Llama 4's chunked layers): the sequence is cut into chunks
                 that attend causally each on its own, as a batch.
  no rotary      `rotary=False`: q and k are not rotated (EXAONE 4's global layers, NoPE);
                 `temperature` (scale, floor) > 0 then multiplies each query at position p by
                 1 + scale ln(1 + floor((p + 1) / floor)) (Llama 4's NoPE layers).
  sinks          a learned logit per query head that joins each query's softmax denominator
                 and adds no value (gpt-oss's and Granite SWA's attention sinks): the output is
                 scaled by sigmoid(logsumexp(scores) - sink).

Rotary embeddings (`moejax.layers.rope`: plain, YaRN- or Llama 3-scaled) use the half-split (rotate_half)
convention; latent attention's rotary part is stored interleaved (pairs (x0, x1), (x2, x3), ...),
as DeepSeek's checkpoints are.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from moejax import profiling
from moejax.layers.matmul import dense
from moejax.layers.norm import initial_scale, layer_norm, norm, rms_norm
from moejax.layers.rope import (NO_SCALING, RopeScaling, apply_rotary, rotary_at,  # noqa: F401
                                rotary_tables)
from moejax.sharding.axes import (ATTENTION, BIASES, EMBED, HEAD, HEADS, INDEXER, KV_HEADS,
                                  LATENT, NORM, NORMS, Q_HEADS, SINKS, param)

QK_NORMS = ("full", "head", "l2", "none")
LATENT_NORM_EPS = 1e-6   # DeepSeek's latent norms use their module default, not rms_norm_eps
INDEX_QUERY_BLOCK = 512  # queries the DSA indexer scores at once (its [Sb, Hi, T] fp32 scores)


def attend(q_BxSxHxDk, k_BxTxGxDk, v_BxTxGxDv, *, mask=None, is_causal=False, scale=None,
           window: int = 0, sinks_H=None, chunk: int = 0):
  """Softmax attention scaled by `scale` (default 1/sqrt(Dk)); `window` W > 0: query i sees keys
  i - W + 1 .. i (with `is_causal`); `chunk` C > 0 (with `is_causal`, queries and keys the same
  positions, no mask): query i sees keys C floor(i / C) .. i; `sinks_H`: each head's sink logit
  (`attend_with_sinks`).
  Values and keys may differ in width (latent attention): `jax.nn.dot_product_attention` takes
  one width, so the narrower side is zero-padded (zeros add nothing to q.k or to the output)
  and the output cut back to Dv. On CUDA, where `cudnn_applies`, cuDNN's flash attention (its
  sliding window too); XLA's otherwise."""
  s = q_BxSxHxDk.shape[1]
  if chunk and s > chunk:
    if not is_causal or mask is not None or k_BxTxGxDk.shape[1] != s:
      raise ValueError("attend: chunk needs is_causal self-attention without a mask (a cached "
                       "step masks the chunk itself)")
    spec = _explicit_spec(q_BxSxHxDk)
    # The chunks as a batch, each causal on its own: padding to whole chunks adds keys after
    # every real query, which causality hides from them. (Under an Explicit mesh the batch
    # axis keeps its sharding, the chunks minor to it.)
    b, n = q_BxSxHxDk.shape[0], -(-s // chunk)

    def reshape(x, shape):
      if spec is None:
        return x.reshape(shape)
      return jax.lax.reshape(x, shape, out_sharding=jax.sharding.PartitionSpec(
          spec[0], *(None,) * (len(shape) - 1)))

    def fold(x):
      x = jnp.pad(x, ((0, 0), (0, n * chunk - s), (0, 0), (0, 0)))
      return reshape(x, (b * n, chunk, *x.shape[2:]))

    out = attend(fold(q_BxSxHxDk), fold(k_BxTxGxDk), fold(v_BxTxGxDv), is_causal=True,
                 scale=scale, window=window, sinks_H=sinks_H)
    return reshape(out, (b, n * chunk, *out.shape[2:]))[:, :s]
  if sinks_H is not None:
    return attend_with_sinks(q_BxSxHxDk, k_BxTxGxDk, v_BxTxGxDv, sinks_H, mask=mask,
                             is_causal=is_causal, scale=scale, window=window)
  dk, dv = q_BxSxHxDk.shape[-1], v_BxTxGxDv.shape[-1]
  pad = lambda x, width: jnp.pad(x, ((0, 0),) * 3 + ((0, width - x.shape[-1]),))  # noqa: E731
  if dv < dk:
    v_BxTxGxDv = pad(v_BxTxGxDv, dk)
  elif dk < dv:
    q_BxSxHxDk, k_BxTxGxDk = pad(q_BxSxHxDk, dv), pad(k_BxTxGxDk, dv)
  xla = functools.partial(jax.nn.dot_product_attention, mask=mask, is_causal=is_causal,
                          scale=dk ** -0.5 if scale is None else scale,
                          local_window_size=(window - 1, 0) if window else None)
  if not (on_gpu() and cudnn_applies(q_BxSxHxDk, k_BxTxGxDk, v_BxTxGxDv, mask)):
    return xla(q_BxSxHxDk, k_BxTxGxDk, v_BxTxGxDv)[..., :dv]
  # cuDNN's flash attention on CUDA: on an H200 at OLMoE-1B-7B's shapes (batch 8 x 4096, 16
  # heads of 128) 8.2x XLA's materialized path forward and 7.3x forward+backward
  # (scripts/device_check.py, `attention`). Only traced where a GPU is: jax checks cuDNN's
  # version while tracing it.
  cudnn = functools.partial(xla, implementation="cudnn")
  out = lax.platform_dependent(q_BxSxHxDk, k_BxTxGxDk, v_BxTxGxDv, cuda=cudnn, default=xla)
  return out[..., :dv]


def attend_selected(q_BxSxHxDk, k_BxTxGxDk, v_BxTxGxDv, selected_BxSxT, *, scale=None,
                    block: int | None = None):
  """Softmax attention of each query over the keys `selected_BxSxT` marks (DeepSeek sparse
  attention's selection, causal already), `block` queries at a time (default
  INDEX_QUERY_BLOCK), each block rematerialized in the backward: a masked attention holds its
  scores, fp32 [B, H, Sb, T], which for the whole sequence at once is [B, H, S, T] (at
  DeepSeek-V3.2's 128 heads and 4096 tokens, 16 GiB a sequence with the probabilities)."""
  block = INDEX_QUERY_BLOCK if block is None else block
  dtype = q_BxSxHxDk.dtype
  # k and v enter every block: their gradients sum over the blocks, which in their own dtype
  # (bf16) would round once per block (0.0036 -> 0.0083 relative error from 8 to 256 blocks,
  # found by review); read as fp32 copies, the sum runs in fp32 and rounds once.
  k32, v32 = (x.astype(jnp.float32) for x in (k_BxTxGxDk, v_BxTxGxDv))
  one = jax.checkpoint(lambda q, mask: attend(q, k32.astype(dtype), v32.astype(dtype),
                                              mask=mask[:, None], scale=scale))
  return by_query_blocks(one, (q_BxSxHxDk, selected_BxSxT), (1, 1), block)


def by_query_blocks(fn, per_query, per_query_axes, block: int):
  """fn over `block` queries at a time: the `per_query` arrays cut along their
  `per_query_axes` (the last block padded: padded queries see no key), fn's results (each
  [B, Sb, ...]) joined along the queries again; one call where one block holds them all."""
  s = per_query[0].shape[per_query_axes[0]]
  n = -(-s // block)
  if n == 1:
    return fn(*per_query)
  pad = n * block - s

  def blocks(x, axis):
    x = jnp.pad(x, [(0, pad) if i == axis else (0, 0) for i in range(x.ndim)])
    x = x.reshape(*x.shape[:axis], n, block, *x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)

  out = lax.map(lambda args: fn(*args),
                tuple(blocks(x, axis) for x, axis in zip(per_query, per_query_axes)))
  join = lambda y: jnp.moveaxis(y, 0, 1).reshape(     # noqa: E731
      y.shape[1], n * block, *y.shape[3:])[:, :s]
  return jax.tree.map(join, out)


def _explicit_spec(x):
  """x's PartitionSpec where it is typed with a mesh's Explicit axes, else None."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if not any(kind == jax.sharding.AxisType.Explicit for kind in getattr(mesh, "axis_types", ())):
    return None
  spec = tuple(sharding.spec)
  return spec + (None,) * (x.ndim - len(spec))


def attend_with_sinks(q_BxSxHxDk, k_BxTxGxDk, v_BxTxGxDv, sinks_H, *, mask=None,
                      is_causal=False, scale=None, window: int = 0):
  """Softmax attention whose denominator also holds exp(sink) per head: the scores in fp32, one
  sink column per head appended before the softmax and dropped after it. Written out (XLA's
  materialized form) because neither `jax.nn.dot_product_attention` nor cuDNN takes a sink,
  and its logsumexp residual carries no gradient. `mask` [B or 1, 1, S, T] bool, as `attend`."""
  b, s, h, dk = q_BxSxHxDk.shape
  t, g = k_BxTxGxDk.shape[1], k_BxTxGxDk.shape[2]
  q_BxSxGxRxDk = q_BxSxHxDk.reshape(b, s, g, h // g, dk)
  scores_BxGxRxSxT = jnp.einsum("bsgrd,btgd->bgrst", q_BxSxGxRxDk, k_BxTxGxDk,
                                preferred_element_type=jnp.float32)
  scores_BxGxRxSxT = scores_BxGxRxSxT * (dk ** -0.5 if scale is None else scale)
  visible_SxT = jnp.ones((s, t), bool)
  if is_causal:       # query i sees keys j <= i (as jax.nn.dot_product_attention's is_causal)
    distance_SxT = jnp.arange(s)[:, None] - jnp.arange(t)[None, :]
    visible_SxT = (distance_SxT >= 0) & ((distance_SxT < window) if window else True)
  visible = visible_SxT[None, None, None]
  if mask is not None:       # [B|1, 1, S, T]
    visible = visible & mask[:, :, None]
  scores_BxGxRxSxT = jnp.where(visible, scores_BxGxRxSxT, -jnp.inf)
  sinks_GxR = sinks_H.astype(jnp.float32).reshape(g, h // g)
  sink_BxGxRxSx1 = jnp.broadcast_to(sinks_GxR[None, :, :, None, None],
                                    (b, g, h // g, s, 1))
  probs = jax.nn.softmax(jnp.concatenate([scores_BxGxRxSxT, sink_BxGxRxSx1], axis=-1),
                         axis=-1)[..., :t]
  out_BxSxGxRxDv = jnp.einsum("bgrst,btgd->bsgrd", probs.astype(v_BxTxGxDv.dtype), v_BxTxGxDv)
  return out_BxSxGxRxDv.reshape(b, s, h, v_BxTxGxDv.shape[-1])


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def cudnn_applies(q_BxSxHxDh, k_BxTxGxDh, v_BxTxGxDh, mask) -> bool:
  """cuDNN's fused attention takes these: no explicit mask (causal is a flag), one 16-bit float
  dtype, head width a multiple of 8 up to 128."""
  dtypes = {jnp.dtype(x.dtype) for x in (q_BxSxHxDh, k_BxTxGxDh, v_BxTxGxDh)}
  dh = q_BxSxHxDh.shape[-1]
  return (mask is None and len(dtypes) == 1
          and dtypes <= {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)}
          and dh % 8 == 0 and dh <= 128)


class Attention(nnx.Module):
  def __init__(self, d_model: int, num_heads: int, head_dim: int, *, rope_theta: float,
               norm_eps: float, init_std: float, rngs: nnx.Rngs, num_kv_heads: int = 0,
               qk_norm: str = "full", qkv_bias: bool = False,
               rope_scaling: RopeScaling = NO_SCALING, rotary_dim: int = 0,
               rotary_interleaved: bool = False, output_gate: bool = False, window: int = 0,
               rotary: bool = True, softmax_scale: float = 0.0, qk_norm_after_rope: bool = False,
               gate_own: bool = False, sinks: bool = False, out_bias: bool = False,
               chunk: int = 0, temperature: tuple[float, int] = (0.0, 0),
               norm_kind: str = "rms"):
    num_kv_heads = num_kv_heads or num_heads
    if qk_norm not in QK_NORMS:
      raise ValueError(f"qk_norm={qk_norm!r}: must be one of {', '.join(QK_NORMS)}")
    if num_heads % num_kv_heads:
      raise ValueError(f"num_kv_heads={num_kv_heads} does not divide num_heads={num_heads}")
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    init = jax.nn.initializers.normal(init_std)
    # With the output gate, each head's q columns are followed by its gate's (or, gate_own, the
    # gate has its own weight, sharded as wq).
    gate_in_q = output_gate and not gate_own
    wq_width = 2 * q_width if gate_in_q else q_width
    self.wq = param(init(rngs.params(), (d_model, wq_width), jnp.float32), (EMBED, Q_HEADS),
                    ATTENTION)
    if output_gate and gate_own:
      self.wg = param(init(rngs.params(), (d_model, q_width), jnp.float32), (EMBED, Q_HEADS),
                      ATTENTION)
    self.wk = param(init(rngs.params(), (d_model, kv_width), jnp.float32), (EMBED, KV_HEADS),
                    ATTENTION)
    self.wv = param(init(rngs.params(), (d_model, kv_width), jnp.float32), (EMBED, KV_HEADS),
                    ATTENTION)
    self.wo = param(init(rngs.params(), (q_width, d_model), jnp.float32), (HEADS, EMBED),
                    ATTENTION)
    if sinks:     # zero logits: transformers' init
      self.sinks = param(jnp.zeros((num_heads,), jnp.float32), (HEAD,), SINKS)
    if qkv_bias:
      self.bq = param(jnp.zeros((wq_width,), jnp.float32), (Q_HEADS,), BIASES)
      self.bk = param(jnp.zeros((kv_width,), jnp.float32), (KV_HEADS,), BIASES)
      self.bv = param(jnp.zeros((kv_width,), jnp.float32), (KV_HEADS,), BIASES)
    if out_bias:
      self.bo = param(jnp.zeros((d_model,), jnp.float32), (EMBED,), BIASES)
    if qk_norm in ("full", "head"):
      q_norm, k_norm = (q_width, kv_width) if qk_norm == "full" else (head_dim, head_dim)
      self.q_norm = param(initial_scale(q_norm, norm_kind), (NORM,), NORMS)
      self.k_norm = param(initial_scale(k_norm, norm_kind), (NORM,), NORMS)
    self.norm_kind = norm_kind     # of the QK-norm's scale: plain, or zero-centered (1 + w)
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.qk_norm, self.qkv_bias, self.output_gate = qk_norm, qkv_bias, output_gate
    self.gate_own = output_gate and gate_own
    self.has_sinks, self.out_bias = sinks, out_bias
    self.window, self.rotary, self.chunk = window, rotary, chunk
    # Llama 4's query temperature, on unrotated layers only
    self.temperature = (0.0, 0) if rotary else tuple(temperature)
    self.qk_norm_after_rope = qk_norm_after_rope
    self.rope_theta, self.rope_scaling, self.norm_eps = rope_theta, rope_scaling, norm_eps
    self.rotary_dim = rotary_dim or head_dim      # partial rotary: its first dims only
    self.rotary_interleaved = rotary_interleaved
    # YaRN scales cos and sin here, not the softmax (transformers' Llama-style models).
    self.softmax_scale = softmax_scale or head_dim ** -0.5

  @profiling.scoped("attention")
  def __call__(self, x_BxSxD):
    s = x_BxSxD.shape[1]
    q, k, v = self.qkv(x_BxSxD, self.rotary_at(jnp.arange(s, dtype=jnp.float32)))
    return self.project_out(attend(q, k, v, is_causal=True, scale=self.softmax_scale,
                                   window=self.window, sinks_H=self.sinks_H(),
                                   chunk=self.chunk), x_BxSxD)

  def sinks_H(self):
    """Each head's sink logit [H] (fp32), or None without sinks."""
    return self.sinks[...] if self.has_sinks else None

  def rotary_at(self, positions_S):
    """(cos, sin) [S, Dh] of these positions, this layer's RoPE, and the queries' temperature
    [S] (fp32; None without one) (for `qkv`)."""
    scale, floor = self.temperature
    q_scale_S = None
    if scale:      # computed as transformers does, in fp32 from the positions
      q_scale_S = jnp.log1p(jnp.floor((positions_S.astype(jnp.float32) + 1.0) / floor)) * scale + 1
    return (*rotary_at(positions_S, self.rotary_dim, self.rope_theta, self.rope_scaling),
            q_scale_S)

  def _q_columns(self, part: int):
    """(weight, bias or None) of the queries (part 0) or, with the output gate, of the gate
    (part 1): each head's query columns are followed by its gate's in wq / bq. Slicing the
    weight, not the projection, keeps each matmul to the columns it needs (`qkv` and
    `project_out` are called apart by a KV-cached step)."""
    w, b = self.wq[...], self.bq[...] if self.qkv_bias else None
    if self.gate_own:
      return (self.wg[...], None) if part else (w, b)
    if not self.output_gate:
      return w, b
    pick = lambda x: x.reshape(*x.shape[:-1], self.num_heads, 2, self.head_dim)[  # noqa: E731
        ..., part, :].reshape(*x.shape[:-1], -1)
    return pick(w), None if b is None else pick(b)

  def _project(self, x_BxSxD, w, b):
    w = w.astype(x_BxSxD.dtype)
    if b is None:
      return dense(x_BxSxD, w)
    # The bias added in fp32: its gradient sums the cotangent over every token, which in bf16
    # loses most of it (0.52 of the true sum at 16k tokens a device).
    y = dense(x_BxSxD, w, jnp.float32) + b.astype(jnp.float32)[None, None, :]
    return y.astype(x_BxSxD.dtype)

  def qkv(self, x_BxSxD, rotary):
    """q [B, S, H, Dh], k and v [B, S, G, Dh]: projected, QK-normed, q and k rotated by
    `rotary` = (cos, sin) [S, rotary_dim] and the queries' temperature [S] or None of the
    tokens' positions (`self.rotary_at`, which a KV-cached step calls with its own positions)."""
    b, s, _ = x_BxSxD.shape
    bk, bv = (self.bk[...], self.bv[...]) if self.qkv_bias else (None, None)
    q = self._project(x_BxSxD, *self._q_columns(0))
    k = self._project(x_BxSxD, self.wk[...], bk)
    v = self._project(x_BxSxD, self.wv[...], bv)
    if self.qk_norm == "full":
      q = norm(q, self.q_norm[...], self.norm_eps, self.norm_kind)
      k = norm(k, self.k_norm[...], self.norm_eps, self.norm_kind)
    q_BxSxHxDh = q.reshape(b, s, self.num_heads, self.head_dim)
    k_BxSxGxDh = k.reshape(b, s, self.num_kv_heads, self.head_dim)
    v_BxSxGxDh = v.reshape(b, s, self.num_kv_heads, self.head_dim)
    head_norm = self.qk_norm == "head"
    if head_norm and not self.qk_norm_after_rope:
      q_BxSxHxDh, k_BxSxGxDh = self._head_norm(q_BxSxHxDh, k_BxSxGxDh)
    q_BxSxHxDh, k_BxSxGxDh = self._rotate(q_BxSxHxDh, k_BxSxGxDh, rotary)
    if head_norm and self.qk_norm_after_rope:      # Hunyuan-A13B: the rotated q and k
      q_BxSxHxDh, k_BxSxGxDh = self._head_norm(q_BxSxHxDh, k_BxSxGxDh)
    if self.qk_norm == "l2" and self.rotary:       # Llama 4: unscaled, rotated layers only
      ones = jnp.ones((self.head_dim,), jnp.float32)
      q_BxSxHxDh = rms_norm(q_BxSxHxDh, ones, self.norm_eps)
      k_BxSxGxDh = rms_norm(k_BxSxGxDh, ones, self.norm_eps)
    q_scale_S = rotary[2] if len(rotary) > 2 else None
    if q_scale_S is not None:
      q_BxSxHxDh = (q_BxSxHxDh.astype(jnp.float32) * q_scale_S[None, :, None, None]).astype(
          q_BxSxHxDh.dtype)
    return q_BxSxHxDh, k_BxSxGxDh, v_BxSxGxDh

  def _head_norm(self, q_BxSxHxDh, k_BxSxGxDh):
    return (norm(q_BxSxHxDh, self.q_norm[...], self.norm_eps, self.norm_kind),
            norm(k_BxSxGxDh, self.k_norm[...], self.norm_eps, self.norm_kind))

  def _rotate(self, q_BxSxHxDh, k_BxSxGxDh, rotary):
    if not self.rotary:
      return q_BxSxHxDh, k_BxSxGxDh
    cos, sin = rotary[:2]
    if self.rotary_interleaved:
      # Neighbour pairs, as halves: q and k permuted alike leave q.k unchanged (and the cache
      # holds k permuted, consistently).
      q_BxSxHxDh, k_BxSxGxDh = (jnp.concatenate(
          [_deinterleave(x[..., :self.rotary_dim]), x[..., self.rotary_dim:]], axis=-1)
          for x in (q_BxSxHxDh, k_BxSxGxDh))
    return apply_rotary(q_BxSxHxDh, cos, sin), apply_rotary(k_BxSxGxDh, cos, sin)

  def project_out(self, out_BxSxHxDh, x_BxSxD):
    """The heads' outputs projected back to D; `x_BxSxD` is the attention's input (the output
    gate's)."""
    b, s = out_BxSxHxDh.shape[:2]
    out_BxSxHD = out_BxSxHxDh.reshape(b, s, -1)
    if self.output_gate:
      gate_BxSxHD = self._project(x_BxSxD, *self._q_columns(1))
      out_BxSxHD = out_BxSxHD * jax.nn.sigmoid(gate_BxSxHD)
    return self._project(out_BxSxHD, self.wo[...], self.bo[...] if self.out_bias else None)


def _deinterleave(x):
  """Pairs (x0, x1), (x2, x3), ... -> (x0, x2, ...) then (x1, x3, ...): rotating the result
  half-split rotates each stored pair by one frequency (q and k alike, so q.k is unchanged)."""
  return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class LatentAttention(nnx.Module):
  """Multi-head latent attention (DeepSeek-V2/V3). Letters: R the kv latent, Rq the q latent,
  Dn / Dr / Dv a head's non-rotary q/k part, rotary part and value width.

    q        = x Wq  or  norm(x Wq_a) Wq_b                    [B, S, H, Dn + Dr]
    latent   = x Wkv_a = (c [R], k_rot [Dr])
    k, v     = norm(c) Wkv_b split per head into [Dn] and [Dv]; every head's key ends in the
               one rotated k_rot
  attention scaled by 1/sqrt(Dn + Dr) (under YaRN times its mscale_all_dim term squared), output
  [H*Dv] -> D. The same `qkv` / `project_out` interface as `Attention` (one kv head per query
  head)."""

  def __init__(self, d_model: int, num_heads: int, *, q_lora_rank: int, kv_lora_rank: int,
               qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, rope_theta: float,
               init_std: float, rngs: nnx.Rngs, rope_scaling: RopeScaling = NO_SCALING,
               window: int = 0, rotary: bool = True, softmax_scale: float = 0.0,
               chunk: int = 0, index: tuple[int, int, int] = (0, 0, 0),
               index_interleaved: bool = False, index_loss: bool = False):
    init = jax.nn.initializers.normal(init_std)
    h, qk = num_heads, qk_nope_head_dim + qk_rope_head_dim
    if q_lora_rank:
      self.wq_a = param(init(rngs.params(), (d_model, q_lora_rank), jnp.float32), (EMBED, LATENT),
                        ATTENTION)
      self.q_a_norm = param(jnp.ones((q_lora_rank,), jnp.float32), (NORM,), NORMS)
      self.wq_b = param(init(rngs.params(), (q_lora_rank, h * qk), jnp.float32),
                        (LATENT, Q_HEADS), ATTENTION)
    else:
      self.wq = param(init(rngs.params(), (d_model, h * qk), jnp.float32), (EMBED, Q_HEADS),
                      ATTENTION)
    self.wkv_a = param(init(rngs.params(), (d_model, kv_lora_rank + qk_rope_head_dim),
                            jnp.float32), (EMBED, LATENT), ATTENTION)
    self.kv_a_norm = param(jnp.ones((kv_lora_rank,), jnp.float32), (NORM,), NORMS)
    self.wkv_b = param(init(rngs.params(), (kv_lora_rank, h * (qk_nope_head_dim + v_head_dim)),
                            jnp.float32), (LATENT, KV_HEADS), ATTENTION)
    self.wo = param(init(rngs.params(), (h * v_head_dim, d_model), jnp.float32), (HEADS, EMBED),
                    ATTENTION)
    self.index_topk, self.index_heads, self.index_head_dim = index
    self.index_interleaved = index_interleaved
    self.index_loss = bool(self.index_topk) and index_loss     # `with_index_loss`
    if self.index_topk:       # DeepSeek-V3.2's lightning indexer (`index_keys`, `select_keys`)
      hi, di = self.index_heads, self.index_head_dim
      self.index_wq = param(init(rngs.params(), (q_lora_rank, hi * di), jnp.float32),
                            (LATENT, Q_HEADS), INDEXER)
      self.index_wk = param(init(rngs.params(), (d_model, di), jnp.float32), (EMBED, KV_HEADS),
                            INDEXER)
      self.index_k_norm = param(jnp.ones((di,), jnp.float32), (NORM,), INDEXER)
      self.index_k_bias = param(jnp.zeros((di,), jnp.float32), (NORM,), INDEXER)
      self.index_weights = param(init(rngs.params(), (d_model, hi), jnp.float32), (EMBED, HEAD),
                                 INDEXER)
    self.num_heads, self.q_lora_rank, self.kv_lora_rank = num_heads, q_lora_rank, kv_lora_rank
    self.nope, self.rotary_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    self.rope_theta, self.rope_scaling = rope_theta, rope_scaling
    self.window, self.rotary, self.chunk = window, rotary, chunk
    # Under YaRN DeepSeek scales all of q.k, the non-rotary part too (mscale_all_dim).
    self.softmax_scale = softmax_scale or (qk ** -0.5) * rope_scaling.latent_softmax_scale

  def __call__(self, x_BxSxD):
    return self._attention(x_BxSxD, with_loss=False)[0]

  def rotary_at(self, positions_S):
    """(cos, sin) [S, Dr] of these positions, this layer's RoPE (for `qkv`)."""
    return rotary_at(positions_S, self.rotary_dim, self.rope_theta, self.rope_scaling)

  def with_index_loss(self, x_BxSxD):
    """(the attention's output, the indexer's loss summed over the queries): DeepSeek-V3.2's
    L_I, per query the KL divergence of the indexer's softmax over the keys the attention saw
    (its selection, or every earlier key while there are no more than index_topk) from the
    attention's own distribution over them averaged over the heads. Only the indexer gets its
    gradient: its inputs are detached, the attention's distribution is a constant."""
    return self._attention(x_BxSxD, with_loss=True)

  @profiling.scoped("attention")
  def _attention(self, x_BxSxD, with_loss: bool):
    """(output, the indexer's loss or None): past index_topk keys each query attends to its
    index_topk best earlier keys, else to every earlier one (the window's or chunk's)."""
    s = x_BxSxD.shape[1]
    rotary = self.rotary_at(jnp.arange(s, dtype=jnp.float32))
    q, k, v = self.qkv(x_BxSxD, rotary)
    sparse = self.sparse_over(s)
    index_k = self.index_keys(x_BxSxD, rotary) if sparse or with_loss else None
    causal_SxS = jnp.arange(s)[None, :] <= jnp.arange(s)[:, None]
    if sparse:
      seen_BxSxT = self.select_keys(x_BxSxD, rotary, index_k, causal_SxS)
      out = attend_selected(q, k, v, seen_BxSxT, scale=self.softmax_scale)
    else:
      seen_BxSxT = causal_SxS[None]
      out = attend(q, k, v, is_causal=True, scale=self.softmax_scale, window=self.window,
                   chunk=self.chunk)
    loss = None
    if with_loss:
      loss = self._index_kl(x_BxSxD, rotary, index_k, lax.stop_gradient(q),
                            lax.stop_gradient(k), seen_BxSxT)
    return self.project_out(out, x_BxSxD), loss

  def _index_queries(self, x_BxSxD, rotary):
    """The indexer's queries [B, S, Hi, Di] and head weights [B, S, Hi] (fp32, / sqrt(Hi)), from
    the attention's q latent detached (its loss trains the indexer alone)."""
    b, s, _ = x_BxSxD.shape
    hi, di = self.index_heads, self.index_head_dim
    q_latent = lax.stop_gradient(self._q_latent(x_BxSxD))
    q_BxSxHixDi = dense(q_latent, self.index_wq[...].astype(x_BxSxD.dtype))
    q_BxSxHixDi = self._index_rotate(q_BxSxHixDi.reshape(b, s, hi, di), rotary)
    w_BxSxHi = dense(x_BxSxD, self.index_weights[...].astype(x_BxSxD.dtype),
                     jnp.float32) * hi ** -0.5
    return q_BxSxHixDi, w_BxSxHi

  def _index_scores(self, q_BxSbxHixDi, w_BxSbxHi, k_BxTxDi):
    """The indexer's scores [B, Sb, T] (fp32): sum_h w_h relu(q_h . k / sqrt(Di))."""
    scores = jnp.einsum("bshd,btd->bsht", q_BxSbxHixDi.astype(jnp.float32),
                        k_BxTxDi.astype(jnp.float32))
    return jnp.einsum("bsh,bsht->bst", w_BxSbxHi,
                      jax.nn.relu(scores * self.index_head_dim ** -0.5))

  def _index_kl(self, x_BxSxD, rotary, index_k_BxTxDi, q_BxSxHxDk, k_BxTxHxDk, seen_BxSxT):
    """The indexer's KL loss summed over the queries (`with_index_loss`); `seen_BxSxT` the keys
    each query's attention saw (at least itself)."""
    x_BxSxD = lax.stop_gradient(x_BxSxD)
    q_BxSxHixDi, w_BxSxHi = self._index_queries(x_BxSxD, rotary)
    # A large finite floor, not -inf: a padded block's rows see nothing, and a softmax of -infs
    # would put NaN into the gradient though the rows are dropped.
    floor = jnp.finfo(jnp.float32).min / 2

    def block(q_i, w_i, q_a, seen_BxSbxT):
      index_BxSbxT = jnp.where(seen_BxSbxT, self._index_scores(q_i, w_i, index_k_BxTxDi), floor)
      log_q = jax.nn.log_softmax(index_BxSbxT, axis=-1)
      scores_BxHxSbxT = jnp.einsum("bshd,bthd->bhst", q_a, k_BxTxHxDk,
                                   preferred_element_type=jnp.float32) * self.softmax_scale
      p_BxSbxT = jnp.mean(jax.nn.softmax(jnp.where(seen_BxSbxT[:, None], scores_BxHxSbxT, floor),
                                         axis=-1), axis=1)
      terms = p_BxSbxT * (jnp.log(jnp.where(p_BxSbxT > 0, p_BxSbxT, 1.0)) - log_q)
      return jnp.sum(jnp.where(seen_BxSbxT, terms, 0.0), axis=-1)       # [B, Sb]

    seen = jnp.broadcast_to(seen_BxSxT, (x_BxSxD.shape[0], *seen_BxSxT.shape[1:]))
    kl_BxS = by_query_blocks(block, (q_BxSxHixDi, w_BxSxHi, q_BxSxHxDk, seen), (1, 1, 1, 1),
                             INDEX_QUERY_BLOCK)
    return jnp.sum(kl_BxS)

  def sparse_over(self, keys: int) -> bool:
    """Whether DeepSeek sparse attention leaves out any of `keys` keys: with no more keys than
    index_topk every visible key is selected, and attention is dense, exactly."""
    return bool(self.index_topk) and keys > self.index_topk

  def _q_latent(self, x_BxSxD):
    return rms_norm(dense(x_BxSxD, self.wq_a[...].astype(x_BxSxD.dtype)), self.q_a_norm[...],
                    LATENT_NORM_EPS)

  def index_keys(self, x_BxSxD, rotary):
    """The DSA indexer's keys [B, S, Di] (one head): LayerNormed, the first Dr rotated
    (`_index_rotate`). Their input detached: only the indexer's loss reaches them."""
    x_BxSxD = lax.stop_gradient(x_BxSxD)
    k_BxSxDi = layer_norm(dense(x_BxSxD, self.index_wk[...].astype(x_BxSxD.dtype)),
                          self.index_k_norm[...], LATENT_NORM_EPS, self.index_k_bias[...])
    return self._index_rotate(k_BxSxDi[:, :, None], rotary)[:, :, 0]

  def _index_rotate(self, x_BxSxNxDi, rotary):
    """The first Dr dims rotated: as halves (DeepSeek-V3.2), or as neighbour pairs (GLM-5),
    taken apart into halves first (q and k alike, so q.k is the pairs')."""
    if self.index_interleaved:
      x_BxSxNxDi = jnp.concatenate([_deinterleave(x_BxSxNxDi[..., :self.rotary_dim]),
                                    x_BxSxNxDi[..., self.rotary_dim:]], axis=-1)
    return apply_rotary(x_BxSxNxDi, *rotary[:2])

  def select_keys(self, x_BxSxD, rotary, index_k_BxTxDi, visible_SxT):
    """bool [B, S, T]: the visible keys (`visible_SxT`) among each query's index_topk best by
    the indexer's score, sum over its heads of w_h relu(q_h . k / sqrt(Di)) with w = x Ww /
    sqrt(Hi) (DeepSeek-V3.2's lightning indexer; in fp32, as transformers). No gradient."""
    x_BxSxD = lax.stop_gradient(x_BxSxD)
    k_BxTxDi = lax.stop_gradient(index_k_BxTxDi)
    q_BxSxHixDi, w_BxSxHi = self._index_queries(x_BxSxD, rotary)
    topk = min(self.index_topk, k_BxTxDi.shape[1])

    def block(q_BxSbxHixDi, w_BxSbxHi, visible_SbxT):
      index_BxSbxT = jnp.where(visible_SbxT[None],
                               self._index_scores(q_BxSbxHixDi, w_BxSbxHi, k_BxTxDi), -jnp.inf)
      # exactly index_topk keys, ties to the earlier key (lax.top_k's order; torch.topk's is
      # its own): a key whose heads all relu to 0 ties with others so, often with few heads
      _, best_BxSbxK = lax.top_k(index_BxSbxT, topk)
      pick = jax.vmap(jax.vmap(lambda row_T, keys_K: row_T.at[keys_K].set(True)))
      # (zeros_like: typed with the scores' batch sharding under an Explicit mesh, as the
      # indices are, which vmap needs; found by review)
      return pick(jnp.zeros_like(index_BxSbxT, bool), best_BxSbxK) & visible_SbxT[None]

    return lax.stop_gradient(by_query_blocks(
        block, (q_BxSxHixDi, w_BxSxHi, visible_SxT), (1, 1, 0), INDEX_QUERY_BLOCK))

  def qkv(self, x_BxSxD, rotary):
    """q and k [B, S, H, Dn + Dr], v [B, S, H, Dv]; `rotary` (cos, sin) [S, Dr]."""
    b, s, _ = x_BxSxD.shape
    h, dt = self.num_heads, x_BxSxD.dtype
    if self.q_lora_rank:
      q = dense(self._q_latent(x_BxSxD), self.wq_b[...].astype(dt))
    else:
      q = dense(x_BxSxD, self.wq[...].astype(dt))
    q_BxSxHxQk = q.reshape(b, s, h, self.nope + self.rotary_dim)
    latent = dense(x_BxSxD, self.wkv_a[...].astype(dt))
    c_BxSxR, k_rot_BxSxDr = latent[..., :self.kv_lora_rank], latent[..., self.kv_lora_rank:]
    kv = dense(rms_norm(c_BxSxR, self.kv_a_norm[...], LATENT_NORM_EPS), self.wkv_b[...].astype(dt))
    kv_BxSxHx_ = kv.reshape(b, s, h, self.nope + self.v_head_dim)
    cos, sin = rotary
    rotate = apply_rotary if self.rotary else lambda x, cos, sin: x     # noqa: E731
    q_rot = rotate(_deinterleave(q_BxSxHxQk[..., self.nope:]), cos, sin)
    k_rot_BxSx1xDr = rotate(_deinterleave(k_rot_BxSxDr)[:, :, None, :], cos, sin)
    q_BxSxHxQk = jnp.concatenate([q_BxSxHxQk[..., :self.nope], q_rot], axis=-1)
    k_BxSxHxQk = jnp.concatenate(
        [kv_BxSxHx_[..., :self.nope],
         jnp.broadcast_to(k_rot_BxSx1xDr, (b, s, h, self.rotary_dim))], axis=-1)
    return q_BxSxHxQk, k_BxSxHxQk, kv_BxSxHx_[..., self.nope:]

  def sinks_H(self):
    """None: latent attention has no sinks."""
    return None

  def project_out(self, out_BxSxHxDv, x_BxSxD=None):
    """The heads' outputs projected back to D (no output gate: `x_BxSxD` is not read)."""
    b, s = out_BxSxHxDv.shape[:2]
    return dense(out_BxSxHxDv.reshape(b, s, -1), self.wo[...].astype(out_BxSxHxDv.dtype))
