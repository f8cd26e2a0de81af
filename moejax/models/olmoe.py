"""The MoE decoder LM: embedding -> L x (RMSNorm, rotary attention, RMSNorm, MoE or dense MLP) ->
RMSNorm -> LM head (untied, or the embedding's transpose). Layers run under `lax.scan` over
stacked parameters, one scan per run of equal layers or per repeating pattern of layers
(`layer_scans`; a scan's iteration runs the pattern's period): the `model.dense_layers` have a
dense MLP (parameter group "dense_layers", stacked in model order), the others MoE ("layers");
the `model.linear_layers` (Gated DeltaNet linear attention, other parameters than softmax
attention's) stack apart: "linear_layers" (MoE) and "dense_linear_layers". Layers are equal
when their group and attention kind are (`AttentionKind`: a sliding window, a chunk, no
rotary, which the parameters do not show).

One decoder for every family (`configs/`): OLMoE, Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek
differ only in options of the config (grouped-query or multi-head latent attention, QK-norm full
/ per head / none, qkv biases, a shared expert with or without a gate, dense layers, the
router's renormalization, scale, expert groups and selection bias), never in code paths per
family.

Letters: B batch, S sequence, D width, V vocabulary, L layers.

Parameters are a plain nested dict of fp32 arrays (`init_params`), layer parameters stacked with a
leading L axis. Each declares its logical axes and group where it is defined
(`moejax.sharding.axes.param`); `param_meta` reads the declarations abstractly, for the
placement's rules table (`moejax.sharding.layout`), reports and weight decay.

`forward` is the single forward pass used everywhere: on one device, and inside the sharded train
step, where `gather(name, shards)` turns each parameter group's shards into full bf16 parameters
just in time (the sharding hook) and `dispatch` says where experts live.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.config import Config, rope_scaling
from moejax.layers.attention import NO_SCALING, Attention, LatentAttention
from moejax.layers.linear_attention import GatedDeltaNet
from moejax.layers.state_space import Mamba2
from moejax.layers.matmul import dense
from moejax.layers.mlp import MLP
from moejax.placement.dispatch import LOCAL, Dispatch
from moejax.layers.moe import MoEBlock, MoESpec, finish_aux
from moejax.layers.norm import RMSNorm, initial_scale, norm
from moejax.sharding import axes
from moejax.sharding.axes import EMBED, EMBEDDINGS, NORM, NORMS, VOCAB, param
from moejax.sharding.hook import COMPUTE_DTYPES, local_gather
from moejax.sharding.prefetch import Sublayer, interleave_rows, scan_period


def moe_spec(cfg: Config) -> MoESpec:
  moe, r = cfg.moe, cfg.routing
  return MoESpec(moe.num_experts, moe.top_k, score=moe.score, renormalize=moe.renormalize,
                 admission=r.admission, threshold=r.threshold, capacity_factor=r.admission_capacity_factor,
                 capacity_factor_warmup=r.admission_capacity_factor_warmup, warmup_steps=r.warmup_steps,
                 locality_weight=r.locality_weight, shared_hidden=moe.shared_expert_hidden,
                 shared_gate=moe.shared_expert_gate, shared_scale=moe.shared_expert_scale,
                 routed_scale=moe.routed_scale,
                 groups=moe.expert_groups, top_groups=moe.top_groups,
                 group_score=moe.group_score, score_bias=moe.score_bias,
                 bias_on_logits=moe.score_bias_on_logits, router_float32=moe.router_float32,
                 router_bias=moe.router_bias, expert_bias=moe.expert_bias,
                 activation=moe.activation, swiglu_alpha=moe.swiglu_alpha,
                 swiglu_limit=moe.swiglu_limit, weights_on_input=moe.weights_on_input)


MOE_LAYERS = "layers"           # the parameter group of the MoE layers (stacked)
DENSE_LAYERS = "dense_layers"   # ... of the dense layers (model.dense_layers), when there are any
# ... of the layers with linear attention (model.linear_layers), MoE and dense
LINEAR_MOE_LAYERS = "linear_layers"
LINEAR_DENSE_LAYERS = "dense_linear_layers"
LAYER_GROUPS = (DENSE_LAYERS, MOE_LAYERS, LINEAR_DENSE_LAYERS, LINEAR_MOE_LAYERS)
MOE_GROUPS = (MOE_LAYERS, LINEAR_MOE_LAYERS)
LINEAR_GROUPS = (LINEAR_DENSE_LAYERS, LINEAR_MOE_LAYERS)


def _group(cfg: Config, layer: int) -> str:
  m = cfg.model
  if layer in m.linear_layers:
    return LINEAR_DENSE_LAYERS if layer in m.dense_layers else LINEAR_MOE_LAYERS
  return DENSE_LAYERS if layer in m.dense_layers else MOE_LAYERS


def layer_groups(cfg: Config) -> dict[str, int]:
  """{stacked layer group: its layers}, the groups that have layers (`LAYER_GROUPS` order),
  each stacked in model order."""
  counts = {group: 0 for group in LAYER_GROUPS}
  for layer in range(cfg.model.num_layers):
    counts[_group(cfg, layer)] += 1
  return {group: n for group, n in counts.items() if n}


def layer_group_of(cfg: Config) -> list[tuple[str, int]]:
  """(group, index within its group) of each decoder layer, in model order."""
  seen = {group: 0 for group in LAYER_GROUPS}
  out = []
  for i in range(cfg.model.num_layers):
    group = _group(cfg, i)
    out.append((group, seen[group]))
    seen[group] += 1
  return out


def moe_rows(cfg: Config) -> dict[str, tuple[int, ...] | None]:
  """{MoE layer group: the positions of its layers among all MoE layers (model order), in its
  own order}: the rows of a step's [L, E] arrays (loads) each group's layers are; None where
  one group holds every MoE layer."""
  groups = [group for group, _ in layer_group_of(cfg) if group in MOE_GROUPS]
  if len(set(groups)) == 1:
    return {groups[0]: None}
  return {g: tuple(i for i, group in enumerate(groups) if group == g) for g in MOE_GROUPS
          if g in groups}


def group_kind(group: str) -> "AttentionKind":
  """The attention kind a group's parameters are made for (linear or softmax attention)."""
  return AttentionKind(linear=group in LINEAR_GROUPS)


@dataclasses.dataclass(frozen=True)
class AttentionKind:
  """What differs between layers' attention without showing in their parameters: a sliding
  window (0: the whole sequence), a chunk the attention stays within (0: none), whether q and k
  are rotated, and by which RoPE (rope_theta > 0: plain RoPE of this base, the sliding layers'
  own; 0: the model's)."""
  window: int = 0
  rotary: bool = True
  rope_theta: float = 0.0
  chunk: int = 0
  linear: bool = False      # Gated DeltaNet linear attention (model.linear_layers)


def attention_kind(cfg: Config, layer: int) -> AttentionKind:
  """The attention kind of decoder layer `layer` (model.sliding_layers, model.nope_layers,
  model.sliding_rope_theta, model.chunked_layers, model.linear_layers)."""
  m = cfg.model
  if layer in m.linear_layers:
    return AttentionKind(linear=True)
  sliding = layer in m.sliding_layers
  return AttentionKind(m.sliding_window if sliding else 0, layer not in m.nope_layers,
                       m.sliding_rope_theta if sliding else 0.0,
                       m.attention_chunk if layer in m.chunked_layers else 0)


class LayerScan(NamedTuple):
  """One scan of the forward pass: `period` (each layer's group, its index within the group in
  the scan's first period, and its attention kind) repeated `repeats` times."""
  period: tuple[tuple[str, int, AttentionKind], ...]
  repeats: int

  def layers_of(self, group: str) -> int:
    """The scan's layers of `group`."""
    return sum(g == group for g, _, _ in self.period) * self.repeats

  @property
  def num_layers(self) -> int:
    return len(self.period) * self.repeats


MAX_PERIOD = 8      # the longest repeating pattern of layers scanned as one period


def layer_scans(cfg: Config) -> list[LayerScan]:
  """The forward's scans, in model order: a run of equal layers is a period of one layer
  (DeepSeek's leading dense layers, then its MoE layers: two scans); a pattern of different
  layers that repeats is one scan over its period, which traces and compiles the pattern once
  and prefetches across its layers (gpt-oss's alternating sliding and full layers: 18 x
  [sliding, full]; Qwen3-Next's 12 x [linear, linear, linear, full]; Llama 4's dense / MoE and
  chunked / unrotated layers: 12 x 4). At each layer the period covering the most layers
  (repeated at least twice) wins, the shortest on a tie."""
  layers = [(group, index, attention_kind(cfg, layer))
            for layer, (group, index) in enumerate(layer_group_of(cfg))]
  keys = [(group, kind) for group, _, kind in layers]

  def repeats(i: int, p: int) -> int:
    r = 1
    while keys[i + r * p:i + (r + 1) * p] == keys[i:i + p]:
      r += 1
    return r

  scans, i = [], 0
  while i < len(keys):
    p, r = 1, repeats(i, 1)
    for q in range(2, min(MAX_PERIOD, (len(keys) - i) // 2) + 1):
      rq = repeats(i, q)
      if rq >= 2 and q * rq > p * r:
        p, r = q, rq
    scans.append(LayerScan(tuple(layers[i:i + p]), r))
    i += p * r
  return scans


def scanned_layers(cfg: Config, group: str) -> list[tuple[int, int]]:
  """(the group's layers in it, all its layers) for each scan holding `group`'s layers: how
  often the scan gathers them (`hook.gathers_per_layer`)."""
  return [(scan.layers_of(group), scan.num_layers) for scan in layer_scans(cfg)
          if scan.layers_of(group)]


def _attention(cfg: Config, rngs: nnx.Rngs, kind: AttentionKind):
  m = cfg.model
  if kind.linear and m.linear_kind == "mamba2":
    return Mamba2(m.d_model, groups=m.linear_key_heads, heads=m.linear_value_heads,
                  state_dim=m.linear_key_dim, head_dim=m.linear_value_dim,
                  conv_taps=m.linear_conv_taps, norm_eps=m.norm_eps, init_std=m.init_std,
                  rngs=rngs)
  if kind.linear:
    return GatedDeltaNet(m.d_model, key_heads=m.linear_key_heads,
                         value_heads=m.linear_value_heads, key_dim=m.linear_key_dim,
                         value_dim=m.linear_value_dim, conv_taps=m.linear_conv_taps,
                         norm_eps=m.norm_eps, init_std=m.init_std, rngs=rngs)
  # a kind's own RoPE is plain; the model's may be scaled
  theta, scaling = (kind.rope_theta, NO_SCALING) if kind.rope_theta else (m.rope_theta,
                                                                          rope_scaling(m))
  if m.kv_lora_rank:
    return LatentAttention(m.d_model, m.num_heads, q_lora_rank=m.q_lora_rank,
                           kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
                           qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
                           rope_theta=theta, init_std=m.init_std, rngs=rngs,
                           rope_scaling=scaling, window=kind.window,
                           rotary=kind.rotary, softmax_scale=m.attention_scale,
                           chunk=kind.chunk,
                           index=(m.index_topk, m.index_heads, m.index_head_dim),
                           index_interleaved=m.index_rotary_interleaved,
                           index_loss=m.train_indexer)
  return Attention(m.d_model, m.num_heads, m.head_dim, rope_theta=theta,
                   norm_eps=m.norm_eps, init_std=m.init_std, rngs=rngs,
                   num_kv_heads=m.num_kv_heads, qk_norm=m.qk_norm, qkv_bias=m.qkv_bias,
                   rope_scaling=scaling, rotary_dim=m.rotary_dim,
                   rotary_interleaved=m.rotary_interleaved, output_gate=m.attention_gate,
                   window=kind.window, rotary=kind.rotary, softmax_scale=m.attention_scale,
                   qk_norm_after_rope=m.qk_norm_after_rope, gate_own=m.attention_gate_own,
                   sinks=m.attention_sinks, out_bias=m.attention_out_bias, chunk=kind.chunk,
                   temperature=(m.nope_temperature, m.nope_temperature_floor),
                   norm_kind="rms_zero_centered" if m.norm_kind == "rms_zero_centered" else "rms")


class _Sublayers:
  """Where a layer's norms sit (model.norm_position): on each sublayer's input ("pre"), on its
  output before it joins the residual stream ("post", OLMo 2's; the same two norms), both
  ("sandwich", AfMoE's: two more norms, attn_post_norm and ffn_post_norm), or one norm whose
  output both sublayers read side by side ("parallel", Cohere's: attn_norm alone); the
  KV-cached step calls these too (`sublayers`)."""

  def _make_norms(self, m) -> None:
    make = lambda: RMSNorm(m.d_model, eps=m.norm_eps, kind=m.norm_kind)   # noqa: E731
    self.attn_norm = make()
    if m.norm_position != "parallel":      # the parallel block's one norm feeds both
      self.ffn_norm = make()
    if m.norm_position == "sandwich":
      self.attn_post_norm = make()
      self.ffn_post_norm = make()
    self.residual_scale, self.norm_position = m.residual_scale, m.norm_position

  def sublayers(self, h_BxSxD, attention, feed_forward):
    """The layer's residual stream after `attention(x)` and `feed_forward(x)` (which returns
    (y, aux)) on their inputs: one after the other, or side by side on one norm's output
    (the parallel block); -> (h, aux)."""
    if self.norm_position == "parallel":     # (residual + attention) + MLP, as Cohere sums
      x_BxSxD = self.attn_norm(h_BxSxD)
      y_attn = attention(x_BxSxD)
      y_ffn, aux = feed_forward(x_BxSxD)
      h_BxSxD = join_residual(h_BxSxD, y_attn, self.residual_scale)
      return join_residual(h_BxSxD, y_ffn, self.residual_scale), aux
    h_BxSxD = join_residual(h_BxSxD, self.attn_out(attention(self.attn_in(h_BxSxD))),
                            self.residual_scale)
    y_BxSxD, aux = feed_forward(self.ffn_in(h_BxSxD))
    return join_residual(h_BxSxD, self.ffn_out(y_BxSxD), self.residual_scale), aux

  def attention_and_losses(self):
    """(the layer's attention as `sublayers` calls it, the list its indexer's loss lands in
    when it computes one: DeepSeek-V3.2's, training)."""
    losses = []
    if not getattr(self.attn, "index_loss", False):
      return self.attn, losses

    def attention(x_BxSxD):
      y_BxSxD, loss = self.attn.with_index_loss(x_BxSxD)
      losses.append(loss)
      return y_BxSxD

    return attention, losses

  def attn_in(self, h_BxSxD):
    return h_BxSxD if self.norm_position == "post" else self.attn_norm(h_BxSxD)

  def attn_out(self, y_BxSxD):
    if self.norm_position == "pre":
      return y_BxSxD
    return (self.attn_norm if self.norm_position == "post" else self.attn_post_norm)(y_BxSxD)

  def ffn_in(self, h_BxSxD):
    return h_BxSxD if self.norm_position == "post" else self.ffn_norm(h_BxSxD)

  def ffn_out(self, y_BxSxD):
    if self.norm_position == "pre":
      return y_BxSxD
    return (self.ffn_norm if self.norm_position == "post" else self.ffn_post_norm)(y_BxSxD)


def join_residual(h_BxSxD, y_BxSxD, scale: float):
  """The residual stream after a sublayer's output `y` joins it, scaled (model.residual_scale)."""
  return h_BxSxD + (y_BxSxD if scale == 1.0 else y_BxSxD * scale)


def embed_scaled(cfg: Config, embed_VxD, tokens_BxS):
  """The tokens' embeddings times model.embed_scale."""
  x_BxSxD = embed(embed_VxD, tokens_BxS)
  scale = cfg.model.embed_scale
  return x_BxSxD if scale == 1.0 else x_BxSxD * jnp.asarray(scale, x_BxSxD.dtype)


def lm_logits(cfg: Config, h_BxSxD, head_DxV):
  """fp32 logits [B, S, V], divided by model.logit_divisor."""
  logits_BxSxV = dense(h_BxSxD, head_DxV, jnp.float32)
  divisor = cfg.model.logit_divisor
  return logits_BxSxV if divisor == 1.0 else logits_BxSxV / divisor


class DenseLayer(_Sublayers, nnx.Module):
  """A layer without experts: attention, then a dense SwiGLU MLP."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs, kind: AttentionKind = AttentionKind()):
    m = cfg.model
    self._make_norms(m)
    self.attn = _attention(cfg, rngs, kind)
    self.mlp = MLP(m.d_model, m.dense_hidden, init_std=m.init_std, rngs=rngs)

  def feed_forward(self, x_BxSxD):
    return self.mlp(x_BxSxD)

  def __call__(self, h_BxSxD):
    return self.with_aux(h_BxSxD)[0]

  def with_aux(self, h_BxSxD):
    """(h, aux): aux {"index_loss"} where the attention's indexer computes its loss, else {}."""
    attention, losses = self.attention_and_losses()
    h_BxSxD, _ = self.sublayers(h_BxSxD, attention, lambda x: (self.mlp(x), None))
    return h_BxSxD, ({"index_loss": losses[0]} if losses else {})


class DecoderLayer(_Sublayers, nnx.Module):
  def __init__(self, cfg: Config, *, rngs: nnx.Rngs, kind: AttentionKind = AttentionKind()):
    m, moe = cfg.model, cfg.moe
    self._make_norms(m)
    self.attn = _attention(cfg, rngs, kind)
    self.moe = MoEBlock(m.d_model, moe.expert_hidden,
                        moe_spec(cfg), init_std=m.init_std, rngs=rngs)

  def feed_forward(self, x_BxSxD):
    """The MoE block alone, routed by top-k (decoding)."""
    return self.moe(x_BxSxD)[0]

  def __call__(self, h_BxSxD, *, dispatch: Dispatch = LOCAL, axis_name=None, step=0,
               predicted_load_E=None, expert_owners=None, replica_state=None,
               defer_reductions=False):
    """-> (h, aux); `defer_reductions`: the MoE block's (`MoEBlock.__call__`)."""
    materialized = None
    if dispatch.kind == "fssdp":   # issued before attention: the transfer overlaps it
      materialized = self.moe.materialize(predicted_load_E, h_BxSxD.dtype, dispatch=dispatch,
                                          owners=expert_owners, replica_state=replica_state)
    attention, losses = self.attention_and_losses()
    h_BxSxD, aux = self.sublayers(h_BxSxD, attention, lambda x: self.moe(
        x, dispatch=dispatch, axis_name=axis_name, step=step, materialized=materialized,
        defer_reductions=defer_reductions))
    return h_BxSxD, (dict(aux, index_loss=losses[0]) if losses else aux)


def _layer_class(group: str):
  return DecoderLayer if group in MOE_GROUPS else DenseLayer


def _layer_params(cfg: Config, group: str, key) -> dict:
  layer = _layer_class(group)(cfg, rngs=nnx.Rngs(params=key), kind=group_kind(group))
  return nnx.to_pure_dict(nnx.state(layer, nnx.Param))


def _outer_params(cfg: Config, k_embed, k_head) -> dict[str, nnx.Param]:
  """The parameters outside the layers: embedding, final norm, LM head unless tied."""
  m = cfg.model
  init = jax.nn.initializers.normal(m.init_std)
  out = {
      "embed": param(init(k_embed, (m.vocab_size, m.d_model), jnp.float32), (VOCAB, EMBED),
                     EMBEDDINGS),
      "final_norm": param(initial_scale(m.d_model, m.norm_kind), (NORM,), NORMS),
  }
  if not m.tie_embeddings:
    out["lm_head"] = param(init(k_head, (m.d_model, m.vocab_size), jnp.float32), (EMBED, VOCAB),
                           EMBEDDINGS)
  return out


def init_params(cfg: Config, key: jax.Array) -> dict:
  k_embed, k_layers, k_head = jax.random.split(key, 3)
  outer = {name: p[...] for name, p in _outer_params(cfg, k_embed, k_head).items()}
  keys_L = jax.random.split(k_layers, cfg.model.num_layers)
  for group in layer_groups(cfg):
    ids = [i for i, (g, _) in enumerate(layer_group_of(cfg)) if g == group]
    outer[group] = jax.vmap(functools.partial(_layer_params, cfg, group))(keys_L[jnp.asarray(ids)])
  return outer


@functools.cache
def param_meta(cfg: Config) -> dict:
  """The parameters' declarations, a tree of `axes.ParamMeta` like `init_params`' output: stored
  shapes, logical axes (layer parameters stacked on a leading `LAYERS` axis) and groups, read
  from each parameter's metadata where it is defined, abstractly (nothing is allocated)."""
  key = jax.random.key(0)
  outer = nnx.eval_shape(lambda: _outer_params(cfg, key, key))
  is_var = lambda v: isinstance(v, nnx.Variable)
  meta = {name: axes.meta_of(p) for name, p in outer.items()}
  for group, count in layer_groups(cfg).items():
    _, layer = _layer_template(cfg, group, group_kind(group))
    stacked = functools.partial(axes.meta_of, stacked=count)
    meta[group] = nnx.to_pure_dict(jax.tree.map(stacked, layer, is_leaf=is_var))
  return meta


@functools.cache
def _layer_template(cfg: Config, group: str = MOE_LAYERS, kind: AttentionKind = AttentionKind()):
  return nnx.split(nnx.eval_shape(lambda: _layer_class(group)(cfg, rngs=nnx.Rngs(0), kind=kind)))


def _check_layer_params(want: dict, got, path: str = "") -> None:
  """ValueError naming the first key missing, extra, or with another rank than one layer's
  (stacked parameters, params["layers"], have one axis more); sizes may differ (a device's
  expert shards)."""
  if not isinstance(got, dict):
    raise ValueError(f"layer_from_params: layer_params{path} is {type(got).__name__}, not a dict")
  for key in sorted(set(want) | set(got), key=str):
    where = f"{path}[{key!r}]"
    if key not in got:
      raise ValueError(f"layer_from_params: layer_params{where} is missing")
    if key not in want:
      raise ValueError(f"layer_from_params: layer_params{where} is not a parameter of this "
                       "layer")
    if isinstance(want[key], dict):
      _check_layer_params(want[key], got[key], where)
    elif jnp.ndim(got[key]) != len(want[key].shape):
      raise ValueError(f"layer_from_params: layer_params{where} has shape "
                       f"{tuple(jnp.shape(got[key]))}, one layer's is {tuple(want[key].shape)} "
                       "(pass one layer's slice of stacked parameters)")


def layer_from_params(cfg: Config, layer_params: dict, group: str = MOE_LAYERS,
                      kind: AttentionKind = AttentionKind()):
  """A layer module (DecoderLayer, or DenseLayer for `DENSE_LAYERS`) of attention `kind` holding
  the given (one layer's) parameter arrays."""
  graphdef, template = _layer_template(cfg, group, kind)
  _check_layer_params(nnx.to_pure_dict(template), layer_params)
  state = jax.tree.map(lambda v: v, template)
  nnx.replace_by_pure_dict(state, layer_params)
  return nnx.merge(graphdef, state)


def embed(embed_VxD, tokens_BxS):
  """The tokens' rows [B, S, D], in the table's dtype. Looked up in fp32, so the backward's
  scatter-add sums a token's occurrences in fp32: in bf16 a row stops growing once it is 2^8
  times one occurrence's cotangent (a byte token seen 2845 times in a 16k-token step got 0.58
  of its gradient)."""
  return jnp.take(embed_VxD.astype(jnp.float32), tokens_BxS, axis=0).astype(embed_VxD.dtype)


def check_tokens(cfg: Config, tokens_BxS) -> None:
  """Token ids [B, S] of an integer type; ids held as values (not traced under `jit`) must lie
  in [0, vocab_size): `jnp.take` fills an id outside with a row of NaNs, which reaches every
  logit through attention. Traced ids are not read back (the data path checks its files)."""
  if isinstance(tokens_BxS, jax.core.Tracer):
    return
  tokens = np.asarray(tokens_BxS)
  if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f"tokens must be [batch, seq] integer ids, got shape {tokens.shape} "
                     f"dtype {tokens.dtype}")
  if tokens.size and (tokens.min() < 0 or tokens.max() >= cfg.model.vocab_size):
    raise ValueError(f"token ids must lie in [0, {cfg.model.vocab_size}) (model.vocab_size), "
                     f"got ids from {tokens.min()} to {tokens.max()}")


def forward(cfg: Config, params: dict, tokens_BxS, *, gather=None,
            dispatch: Dispatch = LOCAL, axis_name=None, remat: str = "full",
            prefetch: bool = False, step=0, scatter_ahead: str = "auto"):
  """Returns (logits_BxSxV fp32, aux) with aux a dict of per-layer arrays [L, ...]. `gather`
  None: whole parameters cast to `cfg.compute_dtype` (`hook.local_gather`)."""
  logits, aux_L, _, _ = forward_with_state(cfg, params, tokens_BxS, gather=gather,
                                           dispatch=dispatch, axis_name=axis_name, remat=remat,
                                           prefetch=prefetch, step=step,
                                           scatter_ahead=scatter_ahead)
  return logits, aux_L


def forward_with_state(cfg: Config, params: dict, tokens_BxS, *, gather=None,
                       states=None, dispatch: Dispatch = LOCAL, axis_name=None,
                       remat: str = "full", prefetch: bool = False, step=0,
                       predicted_load_LxE=None, expert_owners_L=None, replica_state_L=None,
                       scatter_ahead: str = "auto"):
  """The forward pass with the gather hook's state threaded through.

  `gather(group, shards, group_states) -> (full, new_group_states, stats)`; `states` is
  {group: group_states} (layer states stacked on a leading L axis) or None.
  `predicted_load_LxE` (fssdp dispatch) is the load predictor's expected tokens per expert;
  `expert_owners_L` (fssdp, `fssdp.Owners` stacked over layers) who owns each expert, when the
  layer's expert weights are owned windows (`fssdp.owned_windows`) rather than the even split;
  `replica_state_L` (fssdp's replica codec, stacked over the MoE layers) what each layer's
  replica slots held last step (its next value is `aux_L["replica_state"]`).
  `scatter_ahead` (with prefetch): where the backward reduce-scatters a layer's weight gradient
  (`prefetch.SCATTER_AHEAD_MODES`, config.scatter_ahead).
  Returns (logits_BxSxV, aux_L, new_states, stats) with stats {group: stats of its gathers}
  (a layer group's stacked over its layers); aux_L covers the MoE layers, but "index_loss"
  (DeepSeek-V3.2's indexers training: each layer's loss summed over its queries), every layer.
  """
  check_tokens(cfg, tokens_BxS)
  if gather is None:
    gather = functools.partial(local_gather, dtype=COMPUTE_DTYPES[cfg.compute_dtype],
                               param_meta=param_meta(cfg))
  states = states if states is not None else {g: None for g in params}
  new_states, stats = {}, {}

  def gather_group(group):
    full, new_states[group], stats[group] = gather(group, params[group], states[group])
    return full

  embed_VxD = gather_group("embed")
  h_BxSxD = embed_scaled(cfg, embed_VxD, tokens_BxS)

  def dense_step(group, kind, h_BxSxD, layer_params, consts, period):
    del consts, period
    return layer_from_params(cfg, layer_params, group, kind).with_aux(h_BxSxD)

  def moe_step(group, kind, moe_per_period, moe_offset, h_BxSxD, layer_params, consts, period):
    step, predicted_load_LxE, owners_L, replicas_L = consts
    layer = layer_from_params(cfg, layer_params, group, kind)
    layer_index = period * moe_per_period + moe_offset    # among the scan's MoE layers

    def at(tree):   # this layer's slice of a per-layer input
      return None if tree is None else jax.tree.map(lambda x: x[layer_index], tree)

    # The routing losses' and statistics' counts are summed after the scans, all layers in one
    # collective: a psum in the layer's body would hold the GPU's collective slot, and the next
    # layer's prefetched gather could span only what follows it (scripts/gpu_schedule.py).
    return layer(h_BxSxD, dispatch=dispatch, axis_name=axis_name, step=step,
                 predicted_load_E=at(predicted_load_LxE), expert_owners=at(owners_L),
                 replica_state=at(replicas_L), defer_reductions=True)

  counts = layer_groups(cfg)
  num_moe = sum(counts.get(group, 0) for group in MOE_GROUPS)
  outputs = {group: [] for group in counts}      # per scan: (new states, stats)
  moe_aux, index_losses = [], []    # the scans' MoE layers' aux; the indexers' losses
  moe_first = 0           # the scan's first MoE layer among all MoE layers
  for scan in layer_scans(cfg):
    groups = list(dict.fromkeys(group for group, _, _ in scan.period))   # the scan's sources
    moe_per_period = sum(group in MOE_GROUPS for group, _, _ in scan.period)
    sublayers, offsets, moe_offset = [], dict.fromkeys(groups, 0), 0
    for group, _, kind in scan.period:

      def gather_layer(shards, state, rebuild_from=None, group=group):
        if rebuild_from is None:
          return gather(group, shards, state)
        return gather(group, shards, state, rebuild_from)

      if group in MOE_GROUPS:
        fn = functools.partial(moe_step, group, kind, moe_per_period, moe_offset)
        moe_offset += 1
      else:
        fn = functools.partial(dense_step, group, kind)
      sublayers.append(Sublayer(fn, gather_layer, groups.index(group), offsets[group]))
      offsets[group] += 1

    def part(tree, group):    # the scan's layers of a group's stacked tree
      first = next(index for g, index, _ in scan.period if g == group)
      count = scan.layers_of(group)
      if count == counts[group]:     # the scan holds the group: no slicing
        return tree
      return jax.tree.map(lambda x: x[first:first + count], tree)

    consts = ()
    if moe_per_period:        # per-MoE-layer inputs: this scan's MoE layers
      count = moe_per_period * scan.repeats
      moe_part = (lambda tree: tree) if count == num_moe else (   # noqa: E731
          lambda tree, a=moe_first: jax.tree.map(lambda x: x[a:a + count], tree))
      consts = (jnp.asarray(step, jnp.int32), moe_part(predicted_load_LxE),
                moe_part(expert_owners_L), moe_part(replica_state_L))
      moe_first += count
    h_BxSxD, aux_P, states_S, stats_S = scan_period(
        sublayers, h_BxSxD, [part(params[g], g) for g in groups],
        [part(states[g], g) for g in groups], consts, remat=remat, prefetch=prefetch,
        scatter_ahead=scatter_ahead)
    for group, group_states, group_stats in zip(groups, states_S, stats_S):
      outputs[group].append((group_states, group_stats))
    moe = [aux for (group, _, _), aux in zip(scan.period, aux_P) if group in MOE_GROUPS]
    dense = [aux for (group, _, _), aux in zip(scan.period, aux_P) if group not in MOE_GROUPS]
    if moe:
      moe_aux.append(interleave_rows(moe))
    if dense and "index_loss" in dense[0]:
      index_losses.append(interleave_rows([aux["index_loss"] for aux in dense]))
  join = lambda trees: trees[0] if len(trees) == 1 else jax.tree.map(   # noqa: E731
      lambda *xs: jnp.concatenate(xs, axis=0), *trees)
  for group, out in outputs.items():     # the scans' outputs back in their group's layer order
    new_states[group], stats[group] = join(out)
  aux_L = finish_aux(join(moe_aux), cfg.moe.top_k, axis_name, dispatch) if moe_aux else {}
  # DeepSeek-V3.2's indexers' losses, every layer's: the one entry of aux_L not over the MoE
  # layers only
  if "index_loss" in aux_L:
    index_losses.append(aux_L.pop("index_loss"))
  if index_losses:
    aux_L = dict(aux_L, index_loss=jnp.concatenate(index_losses))
  h_BxSxD = norm(h_BxSxD, gather_group("final_norm"), cfg.model.norm_eps, cfg.model.norm_kind)
  head_DxV = embed_VxD.T if cfg.model.tie_embeddings else gather_group("lm_head")
  logits_BxSxV = lm_logits(cfg, h_BxSxD, head_DxV)
  return logits_BxSxV, aux_L, new_states, stats
