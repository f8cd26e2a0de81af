"""Inference for the decoder (every family): a forward pass over new tokens that reads and
extends a KV cache, so each generated token costs one position, not the whole sequence.

Letters: B batch, S new tokens, T cache length (max positions), L layers, H query heads, G
key/value heads, Dk / Dv key and value head widths (both the head width but with latent
attention, whose cache holds its expanded per-head keys and values).

`forward_cached` runs the same layers as `olmoe.forward` (the same modules, one device), with
attention over the cache's first `start + S` positions. Linear-attention layers
(`model.linear_layers`, Gated DeltaNet) keep no keys: their state is the convolution's last
inputs and each value head's memory (`linear_attention.LinearState`), carried from one call to
the next, a prompt's by chunks and each new token's by the recurrence itself; the KV cache
holds the softmax-attention layers only. Routing has no admission here:
admission is a training-time load control whose choice for a token depends on the other tokens
of the batch, so a cached step (one token) would route differently from the full pass; each
token is routed by its top-k alone (`without_admission`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import Config
from moejax.layers.attention import attend, attend_selected
from moejax.layers.linear_attention import LinearState
from moejax.layers.norm import norm
from moejax.models import olmoe
from moejax.sharding import hook


class KVCache(NamedTuple):
  """Keys and values of the softmax-attention layers (L of them), and the linear-attention
  layers' state (Ll of them; None without)."""
  k_LxBxTxGxDk: jax.Array
  v_LxBxTxGxDv: jax.Array
  # DeepSeek sparse attention's indexer keys (model.index_topk > 0), else None
  index_k_LxBxTxDi: jax.Array | None = None
  # Gated DeltaNet: the convolution's last K - 1 inputs, and the memory (fp32)
  conv_LxBxKxC: jax.Array | None = None
  memory_LxBxHxDkxDv: jax.Array | None = None

  @property
  def max_len(self) -> int:
    return self.k_LxBxTxGxDk.shape[2]


def without_admission(cfg: Config) -> Config:
  return dataclasses.replace(cfg, routing=dataclasses.replace(cfg.routing, admission="none"))


def init_cache(cfg: Config, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
  m = cfg.model
  if m.kv_lora_rank:
    k_width, v_width, heads = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim, m.num_heads
  else:
    k_width, v_width, heads = m.head_dim, m.head_dim, m.num_kv_heads or m.num_heads
  softmax = m.num_layers - len(m.linear_layers)
  lead = (softmax, batch, max_len, heads)
  index_k = (jnp.zeros((softmax, batch, max_len, m.index_head_dim), dtype)
             if m.index_topk else None)
  conv = memory = None
  if m.linear_layers:
    linear, hv = len(m.linear_layers), m.linear_value_heads
    channels = 2 * m.linear_key_heads * m.linear_key_dim + hv * m.linear_value_dim
    conv = jnp.zeros((linear, batch, m.linear_conv_taps - 1, channels), dtype)
    memory = jnp.zeros((linear, batch, hv, m.linear_key_dim, m.linear_value_dim), jnp.float32)
  return KVCache(jnp.zeros(lead + (k_width,), dtype), jnp.zeros(lead + (v_width,), dtype),
                 index_k, conv, memory)


def cast_params(params: dict, dtype, cfg: Config | None = None) -> dict:
  """`params` in `dtype`; with `cfg`, its `axes.FLOAT32_GROUPS` (DeepSeek's router and score
  bias) stay float32, as in training."""
  if cfg is None:
    return jax.tree.map(lambda x: x.astype(dtype), params)
  return {group: hook.local_gather(group, tree, dtype=dtype, param_meta=olmoe.param_meta(cfg))[0]
          for group, tree in params.items()}


def forward_cached(cfg: Config, params: dict, tokens_BxS, cache: KVCache, start):
  """Logits [B, S, V] (fp32) of tokens at positions start..start+S-1, and the cache with their
  keys and values written in; start + S must not exceed the cache's length (`generate` sizes it
  to the prompt plus the new tokens). `params` in the compute dtype (`cast_params`); `cfg` without
  admission (`without_admission`). With linear-attention layers the tokens must follow the
  cache's last ones (start = the tokens it has seen): their state holds every earlier token and
  cannot be rewound to an earlier start, as softmax layers' overwritten positions can (keep the
  cache an earlier call returned to go back)."""
  olmoe.check_tokens(cfg, tokens_BxS)
  s = tokens_BxS.shape[1]
  if s > cache.max_len:
    raise ValueError(f"{s} new tokens do not fit a KV cache of {cache.max_len} positions")
  # A start held on the host is checked; one on the device (`generate` sizes its cache up front)
  # is not read back: past the cache's end its writes would clamp.
  if isinstance(start, (int, np.integer)) and int(start) + s > cache.max_len:
    raise ValueError(f"start={int(start)} + {s} new tokens do not fit a KV cache of "
                     f"{cache.max_len} positions")
  return _forward_cached(cfg, params, tokens_BxS, cache, start)


@functools.partial(jax.jit, static_argnums=0)
def _forward_cached(cfg: Config, params: dict, tokens_BxS, cache: KVCache, start):
  s = tokens_BxS.shape[1]
  positions_S = start + jnp.arange(s, dtype=jnp.int32)
  visible_SxT = jnp.arange(cache.max_len)[None, :] <= positions_S[:, None]   # causal, filled
  h_BxSxD = olmoe.embed_scaled(cfg, params["embed"], tokens_BxS)

  def layer_step(group, kind, h_BxSxD, inputs):
    layer_params, k_BxTxGxDk, v_BxTxGxDv, index_k_BxTxDi = inputs
    layer = olmoe.layer_from_params(cfg, layer_params, group, kind)
    attn = layer.attn
    cached = {}

    def attention(x_BxSxD):
      rotary = attn.rotary_at(positions_S)
      q, k, v = attn.qkv(x_BxSxD, rotary)
      write = lambda cache_BxTx_, new_BxSx_: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
          cache_BxTx_, new_BxSx_.astype(cache_BxTx_.dtype), start, axis=1)
      k_all, v_all = write(k_BxTxGxDk, k), write(v_BxTxGxDv, v)
      index_k_all = None
      visible = visible_SxT[None]
      if index_k_BxTxDi is not None:      # DeepSeek sparse attention: the indexer's selection
        index_k_all = write(index_k_BxTxDi, attn.index_keys(x_BxSxD, rotary))
        if attn.sparse_over(cache.max_len):
          visible = attn.select_keys(x_BxSxD, rotary, index_k_all, visible_SxT)
      cached["kv"] = (k_all, v_all, index_k_all)
      if kind.window:      # the sliding window: keys within W - 1 positions before the query
        visible = visible & (positions_S[:, None] - jnp.arange(cache.max_len)[None, :]
                             < kind.window)[None]
      if kind.chunk:       # the chunk: keys in the query's own chunk of positions
        visible = visible & (positions_S[:, None] // kind.chunk
                             == jnp.arange(cache.max_len)[None, :] // kind.chunk)[None]
      if index_k_all is not None:     # by blocks of queries: a long prompt's scores stay small
        out_BxSxHxDv = attend_selected(q, k_all.astype(q.dtype), v_all.astype(q.dtype), visible,
                                       scale=attn.softmax_scale)
      else:
        out_BxSxHxDv = attend(q, k_all.astype(q.dtype), v_all.astype(q.dtype),
                              mask=visible[:, None], scale=attn.softmax_scale,
                              sinks_H=attn.sinks_H())
      return attn.project_out(out_BxSxHxDv, x_BxSxD)

    h_BxSxD, _ = layer.sublayers(h_BxSxD, attention,
                                 lambda x: (layer.feed_forward(x), None))
    return h_BxSxD, cached["kv"]

  def linear_step(group, kind, h_BxSxD, inputs):
    """A Gated DeltaNet layer from its state: the new tokens by chunks (a prompt) or one token
    by the recurrence."""
    layer_params, conv_BxKxC, memory_BxHxDkxDv = inputs
    layer = olmoe.layer_from_params(cfg, layer_params, group, kind)
    state = {}

    def attention(x_BxSxD):
      y_BxSxD, state["new"] = layer.attn.with_state(
          x_BxSxD, LinearState(conv_BxKxC, memory_BxHxDkxDv), by_token=s == 1)
      return y_BxSxD

    h_BxSxD, _ = layer.sublayers(h_BxSxD, attention, lambda x: (layer.feed_forward(x), None))
    new = state["new"]
    return h_BxSxD, (new.conv_BxKxC.astype(conv_BxKxC.dtype), new.memory_BxHxDkxDv)

  kv_cache = tuple(cache)[:3]      # (no softmax layers: [0, ...] arrays, returned as they are)
  linear_cache = (cache.conv_LxBxKxC, cache.memory_LxBxHxDkxDv)
  kv_scans, linear_scans = [], []   # per scan of layers: its part of the cache, updated
  position = linear_position = 0    # where the scan's layers are in the cache's
  for scan in olmoe.layer_scans(cfg):     # the training forward's scans: a period a step
    repeats = scan.repeats
    groups = list(dict.fromkeys(group for group, _, _ in scan.period))
    kinds = [kind for _, _, kind in scan.period]
    n_kv, n_linear = sum(not k.linear for k in kinds), sum(k.linear for k in kinds)

    def periods(tree, first, n, repeats=repeats):   # rows first.. as [R, n, ...]
      return jax.tree.map(lambda x: x[first:first + repeats * n].reshape(
          (repeats, n) + x.shape[1:]), tree)

    layers = {group: periods(params[group],
                             next(i for g, i, _ in scan.period if g == group),
                             sum(g == group for g, _, _ in scan.period)) for group in groups}
    kv = periods(kv_cache, position, n_kv) if n_kv else None
    linear = periods(linear_cache, linear_position, n_linear) if n_linear else None

    def body(h_BxSxD, xs, period=scan.period):
      layers, kv, linear = xs
      at = dict.fromkeys(layers, 0)
      kv_out, linear_out = [], []
      for group, _, kind in period:
        layer_params = jax.tree.map(lambda x, i=at[group]: x[i], layers[group])
        at[group] += 1
        if kind.linear:
          i = len(linear_out)
          h_BxSxD, state = linear_step(group, kind, h_BxSxD,
                                       (layer_params, linear[0][i], linear[1][i]))
          linear_out.append(state)
        else:
          cached = jax.tree.map(lambda x, i=len(kv_out): x[i], kv)
          h_BxSxD, written = layer_step(group, kind, h_BxSxD, (layer_params, *cached))
          kv_out.append(written)
      stack = lambda outs: jax.tree.map(lambda *x: jnp.stack(x), *outs) if outs else None  # noqa
      return h_BxSxD, (stack(kv_out), stack(linear_out))

    h_BxSxD, (kv_new, linear_new) = jax.lax.scan(body, h_BxSxD, (layers, kv, linear))
    rows = lambda tree: jax.tree.map(   # noqa: E731  [R, n, ...] -> [R * n, ...], model order
        lambda x: x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:]), tree)
    if n_kv:
      kv_scans.append(rows(kv_new))
      position += repeats * n_kv
    if n_linear:
      linear_scans.append(rows(linear_new))
      linear_position += repeats * n_linear
  h_BxSxD = norm(h_BxSxD, params["final_norm"], cfg.model.norm_eps, cfg.model.norm_kind)
  head_DxV = params["embed"].T if cfg.model.tie_embeddings else params["lm_head"]
  join = lambda runs: jax.tree.map(lambda *x: jnp.concatenate(x, axis=0), *runs)  # noqa: E731
  kv = join(kv_scans) if kv_scans else kv_cache
  linear = join(linear_scans) if linear_scans else (None, None)
  return olmoe.lm_logits(cfg, h_BxSxD, head_DxV), KVCache(*kv, *linear)


def sample(logits_BxV, key, *, temperature: float, top_p: float):
  """Next token ids [B]: greedy at temperature 0; else softmax(logits / temperature) sampled
  from the smallest set of tokens whose probability reaches top_p (nucleus sampling)."""
  if temperature <= 0:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  # The largest logit subtracted first (softmax does not change): a small temperature then
  # sends the others to -inf and the largest stays 0 (greedy), where dividing the raw logits
  # overflowed to +-inf and sampled among them.
  logits_BxV = logits_BxV.astype(jnp.float32)
  logits_BxV = (logits_BxV - jnp.max(logits_BxV, axis=-1, keepdims=True)) / temperature
  if top_p < 1.0:
    sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
    cumulative_BxV = jnp.cumsum(jax.nn.softmax(sorted_BxV, axis=-1), axis=-1)
    # The smallest logit still inside the nucleus: everything below it is cut.
    inside_B = jnp.minimum(jnp.sum(cumulative_BxV < top_p, axis=-1), logits_BxV.shape[-1] - 1)
    cutoff_B = jnp.take_along_axis(sorted_BxV, inside_B[:, None], axis=-1)
    logits_BxV = jnp.where(logits_BxV < cutoff_B, -jnp.inf, logits_BxV)
  return jax.random.categorical(key, logits_BxV, axis=-1).astype(jnp.int32)


def generate(cfg: Config, params: dict, prompt_BxP, *, max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, dtype=jnp.float32,
             eos_id: int | None = None, on_token=None, vocab_limit: int | None = None):
  """Prompt [B, P] -> (tokens [B, P + N], logits [B, N, V] of each generated token's step).
  The prompt fills the cache in one pass; then one token per step. Stops early when every row
  has produced `eos_id`. `on_token(ids_B)` is called with each new token (streaming).
  `vocab_limit`: ids from it on are never sampled (a model's vocabulary padded past its
  tokenizer's: ids no text decodes to); the logits returned are the model's own."""
  cfg = without_admission(cfg)
  params = cast_params(params, dtype, cfg)
  batch, prompt_len = prompt_BxP.shape
  cache = init_cache(cfg, batch, prompt_len + max_new_tokens, dtype)
  logits_BxSxV, cache = forward_cached(cfg, params, jnp.asarray(prompt_BxP, jnp.int32), cache,
                                       jnp.int32(0))
  key = jax.random.key(seed)
  tokens, step_logits = [jnp.asarray(prompt_BxP, jnp.int32)], []
  done_B = jnp.zeros((batch,), bool)
  for i in range(max_new_tokens):
    last_BxV = logits_BxSxV[:, -1]
    step_logits.append(last_BxV)
    if vocab_limit is not None and vocab_limit < last_BxV.shape[-1]:
      last_BxV = jnp.where(jnp.arange(last_BxV.shape[-1]) < vocab_limit, last_BxV, -jnp.inf)
    next_B = sample(last_BxV, jax.random.fold_in(key, i), temperature=temperature, top_p=top_p)
    if eos_id is not None:          # a row that has ended keeps emitting EOS
      next_B = jnp.where(done_B, eos_id, next_B)
    tokens.append(next_B[:, None])
    if on_token is not None:
      on_token(next_B)
    if eos_id is not None:
      done_B = done_B | (next_B == eos_id)
      if bool(jnp.all(done_B)):
        break
    if i + 1 < max_new_tokens:
      logits_BxSxV, cache = forward_cached(cfg, params, next_B[:, None], cache,
                                           jnp.int32(prompt_len + i))
  return jnp.concatenate(tokens, axis=1), jnp.stack(step_logits, axis=1)
