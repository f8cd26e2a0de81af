"""Typed, validated configuration.

Config files (`configs/*.py`) start from `default_config_dict()` (these dataclasses' defaults as an
`ml_collections.ConfigDict`) and set only what differs; `from_config_dict` turns the result into
the frozen dataclasses below at the boundary, so the library never reads a ConfigDict. Every check
lives here and raises `ConfigError` naming the field, the value and what would be valid. Valid
choices come from the modules that own them.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

import ml_collections

from moejax.codec.gather import COMPRESSED_MODES, DETECTORS, MODES, TRANSPORTS
from moejax.codec.replicas import REPLICA_CODECS
from moejax.codec.word import DELTA_BITS
from moejax.data.sources import SOURCES as DATA_SOURCES
from moejax.layers.attention import QK_NORMS
from moejax.layers.norm import NORM_KINDS, NORM_POSITIONS
from moejax.layers.rope import ROPE_SCALINGS, RopeScaling
from moejax.families import FAMILIES
from moejax.errors import ConfigError
from moejax.placement import PLACEMENTS
from moejax.placement.dispatch import EXCHANGE_BUFFERS, OVERFLOW_POLICIES
from moejax.placement.experts import ACTIVATIONS
from moejax.routing.admission import POLICIES as ADMISSIONS
from moejax.routing.router import GROUP_SCORES, SCORE_FUNCTIONS as SCORES
from moejax.sharding.hook import COMPUTE_DTYPES, REDUCE_DTYPES
from moejax.sharding.prefetch import REMAT_MODES, SCATTER_AHEAD_MODES

CODEC_MODES = MODES + ("auto",)            # auto: chosen per parameter at run time (config-level)
CODEC_COMM_MODELS = ("profile", "bytes")   # read by moejax.train.codec_control, which imports us
LINEAR_KINDS = ("gated_deltanet", "mamba2")  # model.linear_kind

# Old field -> (new field, what it is). Either spelling of an old field raises a ConfigError
# naming the new one, from a config dict (`from_config_dict`) or a --config.FIELD override.
RENAMED = {
    "moe.capacity_factor": ("moe.dispatch_capacity_factor",
                            "the ep/fssdp dispatch buffer size; 0 = dropless"),
    "routing.capacity_factor": ("routing.admission_capacity_factor",
                                "admission capacity per expert after routing.warmup_steps"),
    "routing.capacity_factor_warmup": ("routing.admission_capacity_factor_warmup",
                                       "admission capacity per expert before routing.warmup_steps"),
}


def check_not_renamed(field: str) -> None:
  """Raises ConfigError if `field` (a dotted path such as "moe.capacity_factor") was renamed."""
  if field in RENAMED:
    new, what = RENAMED[field]
    raise ConfigError(f"config.{field} was renamed: use config.{new} ({what})")


def upgrade_saved(saved: dict) -> dict:
  """A config dict saved by an earlier version (a checkpoint's config/ item) with renamed fields
  under their new names and retyped ones in their new type (remat: true/false -> full/none); a
  user's config still gets the error above."""
  out = {k: dict(v) if isinstance(v, dict) else v for k, v in saved.items()}
  if isinstance(out.get("remat"), bool):
    out["remat"] = "full" if out["remat"] else "none"
  for old, (new, _) in RENAMED.items():
    (og, of), (ng, nf) = old.split("."), new.split(".")
    if of in out.get(og, {}):
      out.setdefault(ng, {})[nf] = out[og].pop(of)
  return out


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  family: str = "olmoe"
  """The Hugging Face architecture the weights import from and export to: one of
  `moejax.families.FAMILIES`. The decoder itself reads only the options below."""
  vocab_size: int = 320
  """Embedding and output rows (the byte tokenizer needs at least 257)."""
  d_model: int = 64
  """Width of the residual stream."""
  num_layers: int = 2
  """Decoder layers, each attention then an MLP: a dense one in `dense_layers`, MoE in the
  rest."""
  dense_layers: tuple = ()
  """Indices of the layers with a dense SwiGLU MLP instead of experts, ascending (DeepSeek's
  first_k_dense_replace: the first k; Qwen2-MoE's mlp_only_layers / decoder_sparse_step); at
  least one layer stays MoE."""
  dense_hidden: int = 0
  """Hidden width of the dense layers' MLP (DeepSeek's intermediate_size)."""
  num_heads: int = 4
  """Attention heads."""
  head_dim: int = 16
  """Width of one head; even (rotary embeddings rotate pairs). With multi-head latent attention
  the q/k head width, qk_nope_head_dim + qk_rope_head_dim."""
  num_kv_heads: int = 0
  """Key/value heads (grouped-query attention), dividing num_heads; 0 = num_heads."""
  qk_norm: str = "full"
  """RMSNorm of q and k: one of `moejax.layers.attention.QK_NORMS` (full: over all heads' width,
  OLMoE; head: per head, Qwen3; l2: per head without a scale, of the rotated q and k, on the
  rotated layers only, Llama 4's; none: Mixtral, Qwen2)."""
  qkv_bias: bool = False
  """Biases on the q, k and v projections (Qwen2-MoE)."""
  attention_out_bias: bool = False
  """A bias on the attention's output projection (gpt-oss)."""
  qk_norm_after_rope: bool = False
  """Per-head QK-norm (qk_norm "head") of the rotated q and k rather than before the rotation
  (Hunyuan-A13B)."""
  norm_position: str = "pre"
  """Where each layer's norms sit: one of `moejax.layers.norm.NORM_POSITIONS` ("pre": on
  each sublayer's input; "post": on each sublayer's output before it joins the residual
  stream, OLMo 2's and FlexOlmo's; "sandwich": both, four norms a layer, AfMoE's; "parallel":
  one norm whose output attention and the MLP read side by side, both outputs joining the
  residual stream, Cohere's)."""
  norm_kind: str = "rms"
  """What the residual stream's norms compute: one of `moejax.layers.norm.NORM_KINDS` (rms:
  RMSNorm; layer: LayerNorm without a bias, mean subtracted, Cohere's; rms_zero_centered:
  RMSNorm scaled by 1 + its stored weight, Qwen3-Next's, whose QK-norm is so too)."""
  embed_scale: float = 1.0
  """The embedding's output is multiplied by this (Granite's embedding_multiplier)."""
  residual_scale: float = 1.0
  """Each sublayer's output (attention, MLP) is multiplied by this before it joins the residual
  stream (Granite's residual_multiplier)."""
  attention_scale: float = 0.0
  """The softmax scale of q.k; 0 = 1/sqrt(q/k head width) (Granite's attention_multiplier)."""
  logit_divisor: float = 1.0
  """The logits are divided by this (Granite's logits_scaling)."""
  sliding_window: int = 0
  """Tokens a query of a `sliding_layers` layer sees: itself and the sliding_window - 1 before
  it (Mixtral's, Qwen's and EXAONE's sliding_window); 0 = no sliding layers."""
  sliding_layers: tuple = ()
  """Indices of the layers whose attention slides within model.sliding_window, ascending; the
  others attend to the whole sequence."""
  sliding_rope_theta: float = 0.0
  """> 0: the sliding layers rotate by plain RoPE of this base (Mellum's and Gemma 3's local
  layers; rope_theta and rope_scaling then apply to the other layers only); 0: one RoPE for
  all."""
  nope_layers: tuple = ()
  """Indices of the layers whose q and k are not rotated (no positional encoding: EXAONE 4's
  global layers), ascending."""
  nope_temperature: float = 0.0
  """> 0: the `nope_layers`' queries are scaled by 1 + nope_temperature * ln(1 + floor((position
  + 1) / nope_temperature_floor)), sharper attention far into a long context (Llama 4's
  attn_temperature_tuning with attn_scale); 0: not scaled."""
  nope_temperature_floor: int = 8192
  """The positions one step of nope_temperature covers (Llama 4's floor_scale)."""
  attention_chunk: int = 0
  """Tokens of one attention chunk: a query of a `chunked_layers` layer sees the keys before it
  within its own chunk of positions [n * chunk, (n + 1) * chunk) (Llama 4's
  attention_chunk_size); 0 = no chunked layers."""
  chunked_layers: tuple = ()
  """Indices of the layers whose attention stays within its chunk (model.attention_chunk),
  ascending; none of them sliding."""
  linear_layers: tuple = ()
  """Indices of the layers whose attention is Gated DeltaNet linear attention
  (`moejax.layers.linear_attention`; Qwen3-Next's linear_attention layers), ascending; the
  others softmax attention. Their width: the linear_* fields below."""
  linear_kind: str = "gated_deltanet"
  """What the linear layers compute (`LINEAR_KINDS`): "gated_deltanet" (Qwen3-Next's,
  `moejax.layers.linear_attention`) or "mamba2" (Granite-4.0-H's, `moejax.layers.state_space`;
  its groups, state width, heads and head width are linear_key_heads, linear_key_dim,
  linear_value_heads and linear_value_dim, its convolution biased)."""
  linear_key_heads: int = 0
  """Linear attention: q/k heads (linear_num_key_heads)."""
  linear_value_heads: int = 0
  """Linear attention: value heads, a multiple of linear_key_heads (linear_num_value_heads)."""
  linear_key_dim: int = 0
  """Linear attention: width of a q/k head (linear_key_head_dim)."""
  linear_value_dim: int = 0
  """Linear attention: width of a value head (linear_value_head_dim)."""
  linear_conv_taps: int = 4
  """Linear attention: taps of the causal convolution over q, k and v (linear_conv_kernel_dim)."""
  attention_gate: bool = False
  """Scale the attention output, before its projection, by a sigmoid gate of the token (one
  gate value per query channel; MiniCPM5-MoE, Qwen3-Next): the q projection is twice as wide,
  each head's query followed by its gate, as such checkpoints store it."""
  attention_sinks: bool = False
  """A learned logit per query head in each query's softmax denominator, adding no value
  (attn.sinks; gpt-oss's and Granite SWA's attention sinks)."""
  attention_gate_own: bool = False
  """With attention_gate: the gate's weight is its own [D, H*Dh] parameter (attn.wg, AfMoE's
  gate_proj) rather than columns of the q projection."""
  kv_lora_rank: int = 0
  """> 0: multi-head latent attention (DeepSeek-V2/V3): keys and values from a latent of this
  width, shared by the heads; 0: standard (grouped-query) attention."""
  q_lora_rank: int = 0
  """MLA: queries from a latent of this width; 0 = projected directly."""
  qk_nope_head_dim: int = 0
  """MLA: the part of each q/k head without rotary embedding."""
  qk_rope_head_dim: int = 0
  """MLA: the rotary part of each q/k head (one key part shared by all heads); even."""
  v_head_dim: int = 0
  """MLA: width of one value head."""
  index_topk: int = 0
  """> 0: DeepSeek sparse attention (DeepSeek-V3.2's DSA), on latent attention with a q latent:
  a lightning indexer scores every visible key per query and each query attends to the
  index_topk best only (exact dense attention while a sequence has no more keys); 0 = dense."""
  index_heads: int = 0
  """DSA: the indexer's query heads (index_n_heads)."""
  index_head_dim: int = 0
  """DSA: the width of the indexer's query and key heads, its first qk_rope_head_dim rotated
  (index_head_dim)."""
  index_rotary_interleaved: bool = False
  """DSA: the indexer's rotated dims pair up as neighbours (GLM-5's), not as halves
  (DeepSeek-V3.2's)."""
  train_indexer: bool = True
  """DSA: train the indexer by its own loss (DeepSeek-V3.2's L_I: per query, the KL divergence of
  the indexer's softmax from the attention's distribution averaged over its heads, over the keys
  the attention saw), which alone reaches it (its inputs are detached, the selection carries no
  gradient); False freezes it (`axes.OWN_LOSS`). A switch, not a weight: the indexer's gradients
  are clipped apart and Adam undoes any constant scale of them."""
  tie_embeddings: bool = False
  """The LM head is the embedding's transpose (no lm_head parameter)."""
  rope_theta: float = 10000.0
  """Rotary embedding base."""
  rotary_dim: int = 0
  """Width of the rotated part of each q/k head, its first dims (partial rotary: GLM-4.5's
  partial_rotary_factor 0.5 rotates half the head); even; 0 = the whole head. Latent attention
  rotates qk_rope_head_dim instead."""
  rotary_interleaved: bool = False
  """The rotated dims pair up as neighbours (x0, x1), (x2, x3), ... (ERNIE-4.5, GPT-J) rather
  than as halves (x_i, x_{i + Dh/2}). Latent attention's rotary part is always interleaved."""
  rope_scaling: str = "none"
  """RoPE frequency scaling: one of `moejax.layers.rope.ROPE_SCALINGS`; "yarn" extends a context
  of rope_original_max_len positions by rope_factor (YaRN; DeepSeek-V3's published weights,
  Qwen's long-context configs); "llama3" does so by Llama 3's rule (Llama 4 Scout's
  published weights). The rope_* fields below are theirs, read only under a scaling (factor and
  original_max_len by both, the beta and mscale fields by YaRN, the freq factors by Llama 3's)."""
  rope_factor: float = 1.0
  """YaRN and Llama 3's scaling: how many times the original context the model is to reach
  (>= 1)."""
  rope_original_max_len: int = 0
  """YaRN and Llama 3's scaling: the context the weights were pretrained on
  (original_max_position_embeddings)."""
  rope_beta_fast: float = 32.0
  """YaRN: rotary pairs turning more than this many times over the original context keep their
  frequency."""
  rope_beta_slow: float = 1.0
  """YaRN: pairs turning fewer times than this are interpolated (frequency / rope_factor)."""
  rope_mscale: float = 0.0
  """YaRN: with rope_mscale_all_dim, cos and sin are scaled by mscale(rope_mscale) /
  mscale(rope_mscale_all_dim), mscale(m) = 0.1 m ln(rope_factor) + 1; 0: by mscale(1)."""
  rope_mscale_all_dim: float = 0.0
  """YaRN: see rope_mscale; latent attention also multiplies its softmax scale by
  mscale(rope_mscale_all_dim)^2 (DeepSeek)."""
  rope_attention_factor: float = 0.0
  """YaRN: scales cos and sin by this instead of the mscale rule above; 0: that rule."""
  rope_truncate: bool = True
  """YaRN: round the correction range to whole pairs (transformers' `truncate`)."""
  rope_low_freq_factor: float = 1.0
  """Llama 3's scaling: pairs whose wavelength exceeds rope_original_max_len / this are slowed
  by rope_factor."""
  rope_high_freq_factor: float = 4.0
  """Llama 3's scaling: pairs whose wavelength is below rope_original_max_len / this keep their
  frequency; those between the two blend."""
  norm_eps: float = 1e-5
  """RMSNorm epsilon (layer norms and QK-norm)."""
  init_std: float = 0.02
  """Standard deviation of the normal weight initializer."""


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  num_experts: int = 8
  """Experts per layer (E)."""
  top_k: int = 2
  """Experts each token is routed to (K)."""
  expert_hidden: int = 64
  """Hidden width of one expert's SwiGLU MLP."""
  score: str = "softmax"
  """Router score function: one of `moejax.routing.router.SCORE_FUNCTIONS`."""
  renormalize: bool = False
  """Rescale each token's top-k weights to sum to 1."""
  routed_scale: float = 1.0
  """Multiplies the routed experts' weights (DeepSeek's routed_scaling_factor)."""
  expert_groups: int = 1
  """Group-limited top-k (DeepSeek's n_group): experts split into this many groups, each scored
  as moe.group_score says; 1 = no grouping."""
  top_groups: int = 1
  """Groups a token may choose its experts from (topk_group); top_k comes from their experts."""
  group_score: str = "top2"
  """A group's score under group-limited top-k: one of `moejax.routing.router.GROUP_SCORES`
  (top2: the sum of its two best experts' scores, DeepSeek-V3; max: its best, DeepSeek-V2)."""
  score_bias: bool = False
  """A per-expert bias added to the scores for the top-k choice only, not to the weights
  (DeepSeek-V3's e_score_correction_bias; auxiliary-loss-free balancing)."""
  score_bias_on_logits: bool = False
  """The score bias is added to the router's logits, before the score function, for the choice
  (Kolibri's), rather than to the scores."""
  router_float32: bool = False
  """Gather and apply the router in float32 under any compute dtype, as with a score bias (which
  always does): Flint's checkpoints and transformers keep its router so. (A trained router bias,
  moe.router_bias, is gathered in the compute dtype, as gpt-oss's transformers code runs it,
  and added to the fp32 logits.)"""
  router_bias: bool = False
  """A trained bias added to the router's logits, for the choice and the weights alike
  (gpt-oss's router.bias); unlike score_bias, it learns from the loss."""
  expert_bias: bool = False
  """Biases on each expert's gate, up and down projections (gpt-oss), placed with the experts."""
  activation: str = "swiglu"
  """The experts' activation: one of `moejax.placement.experts.ACTIVATIONS` (swiglu:
  silu(gate) * up; swiglu_clamped: gpt-oss's, gate clipped above at swiglu_limit and up to
  [-swiglu_limit, swiglu_limit], then gate * sigmoid(swiglu_alpha * gate) * (up + 1))."""
  swiglu_alpha: float = 1.702
  """swiglu_clamped's sigmoid slope (gpt-oss's swiglu_alpha)."""
  swiglu_limit: float = 7.0
  """swiglu_clamped's clamp (gpt-oss's swiglu_limit)."""
  score_bias_rate: float = 0.0
  """Each step the bias of an expert above the mean load drops by this much, one below it rises
  (DeepSeek-V3's bias update speed, 0.001); 0 = the bias stays as loaded."""
  weights_on_input: bool = False
  """Each routed expert's weight scales the token on its way in, not the expert's output
  (Llama 4's: expert(w * x) rather than w * expert(x)); the outputs are then summed."""
  shared_expert_hidden: int = 0
  """Hidden width of the shared expert every token passes through besides its routed ones
  (Qwen2-MoE's shared_expert_intermediate_size; DeepSeek's shared experts summed); 0 = none."""
  shared_expert_gate: bool = False
  """Scale the shared expert's output by a sigmoid gate of the token (Qwen2-MoE)."""
  shared_expert_scale: float = 1.0
  """Multiplies the shared expert's output (Cohere2-MoE's "average" of routed and shared:
  0.5, with moe.routed_scale 0.5)."""
  aux_loss_weight: float = 0.01
  """Weight of the load-balancing loss."""
  z_loss_weight: float = 0.001
  """Weight of the router z-loss."""
  placement: str = "fsdp"
  """How experts and tokens meet: one of `moejax.placement.PLACEMENTS`."""
  dispatch_capacity_factor: float = 2.0
  """ep/fssdp dispatch buffer: per destination ceil(factor * assignments / devices) rows, the
  starting size (see `dispatch_overflow`); 0 = dropless: N x T x min(K, experts a device
  holds) rows per device (a token sends one row per expert), the worst case, only when asked
  for (at scale it may not fit). Packed exchange buffers (`exchange_buffers`, the GPU's) send
  from the T x K rows whatever the factor: under dispatch_overflow="grow" with a receive capacity they apply no cap
  (a cap would only drop rows and rerun the step) and `receive_capacity_factor` bounds what a
  device receives; under "drop", or with every received row run, the cap applies."""
  dispatch_chunks: int = 1
  """ep/fssdp: the token exchange in this many pieces (a destination's rows dealt to them in
  turn), each sent, run through the experts and returned on its own, so one piece's exchange
  can overlap another's expert matmuls (on GPU, with a schedule that knows what each costs:
  `schedule_latencies="model"`). The same dispatch drops and outputs (each piece's experts run
  ceil(1 / pieces) of the receive capacity, so a piece may overflow it where one exchange
  would not: the step reruns); the expert weights' gradients are summed over the pieces
  (within bf16 rounding of one exchange's). 1: one exchange."""
  dispatch_overflow: str = "grow"
  """A step whose dispatch buffers overflow: one of `moejax.placement.dispatch.OVERFLOW_POLICIES`
  (grow: no update, the buffers are resized from the measured loads and the step reruns,
  lossless; drop: the overflow is dropped and counted in ep_dropped_frac)."""
  receive_capacity_factor: float = 1.25
  """ep/fssdp under dispatch_overflow="grow" with bounded buffers: each device runs
  ceil(factor * T * K) of the rows it received through its experts (ceil(1 / pieces) of that
  per piece with `dispatch_chunks`), the starting size
  (a device that receives more overflows and the step reruns with room for what it received;
  `moejax.placement.dispatch.receive_capacity`). The receive buffer holds about
  dispatch_capacity_factor x T x K rows, which the GPU's grouped matmuls would compute whole;
  0 = all of them. With dropless blocks (dispatch_capacity_factor 0, exchange_buffers
  "blocks": the CPU's) every received row runs; packed buffers (the GPU's) hold these rows
  alone, dropless or not."""
  exchange_buffers: str = "auto"
  """ep/fssdp: the token exchange's buffers, one of `moejax.placement.dispatch.EXCHANGE_BUFFERS`
  (blocks: N x C rows each way, every destination's block whole, the only form XLA:CPU runs;
  packed: the T x K rows sent and the rows the experts run received, by `ragged_all_to_all`,
  GPU/TPU; auto: packed where the mesh's devices are not CPUs)."""


@dataclasses.dataclass(frozen=True)
class FssdpConfig:
  """moe.placement='fssdp': owners plus this step's replicas of hot experts."""
  replica_slots: int = 2
  """M: replica slots per device per layer."""
  overlap_degree: int = 4
  """t: distinct experts materialized per layer and step."""
  owner_sends: int = -1
  """The most replica slots one owner fills per layer and step, over all its experts: it sizes
  SparseAllGather's send rows and SparseReduceScatter's fp32 receive rows on GPU (that many
  experts per device instead of N * M); -1 = overlap_degree (the paper's t is the expert chunks
  one link can take within the attention window; here an owner's link sends one per replica),
  0 = no bound (N * M)."""
  window: int = 5
  """Load predictor: the mean of the last `window` steps' loads."""
  reshard_every: int = 100
  """Steps between re-shardings of owners (parameters and optimizer state move); 0 = never."""
  max_per_layer: int = 0
  """C: the most experts of one layer a device may own after re-sharding (a static buffer);
  0 = min(E, 2 * E/N); E/N keeps every layer's counts equal."""
  calibrate: bool = True
  """Re-plan from the actual loads after gating when it pays."""
  replica_codec: str = ""
  """One of `moejax.codec.replicas.REPLICA_CODECS`: "delta" sends a replica whose device held
  the same expert last step (in any slot) as a delta patch (lossless), "off" always plain; ""
  (default) = delta when codec.mode is not off."""

  def resolved_owner_sends(self) -> int:
    """`owner_sends` with -1 resolved (0: no bound)."""
    return self.overlap_degree if self.owner_sends == -1 else self.owner_sends

  def resolved_replica_codec(self, codec_mode: str) -> str:
    return self.replica_codec or ("off" if codec_mode == "off" else "delta")


@dataclasses.dataclass(frozen=True)
class RoutingConfig:
  admission: str = "none"
  """Capacity-limited affinity admission: one of `moejax.routing.admission.POLICIES`."""
  threshold: float = -1.0
  """Least cosine similarity (token's router input, expert's router vector) to be admitted."""
  admission_capacity_factor: float = 1.25
  """Capacity per expert = ceil(factor * tokens * top_k / experts) per device, after
  `warmup_steps`."""
  admission_capacity_factor_warmup: float = 2.0
  """The factor while step < `warmup_steps`."""
  warmup_steps: int = 0
  """Steps that use `admission_capacity_factor_warmup`."""
  locality_weight: float = 0.0
  """Weight of a loss favouring experts on the token's own node (ep placement); 0 = off."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
  source: str = "builtin"
  """One of `moejax.data.sources.SOURCES`; builtin needs no file."""
  path: str = ""
  """The text or jsonl file, or for data.source='tokens' the directory `python -m
  moejax.data.prepare` wrote (unused for 'builtin')."""
  tokenizer: str = "bytes"
  """"bytes", a path to a Hugging Face tokenizer.json (or its folder), or "init_from": the
  tokenizer.json beside config.init_from's weights (the Hugging Face presets)."""
  val_fraction: float = 0.05
  """The last this fraction of the token stream is the validation split (0: none, no
  val_loss; the whole stream trains)."""


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  lr: float = 3e-3
  """Peak learning rate (AdamW), reached after `warmup_steps`."""
  min_lr_ratio: float = 0.1
  """Cosine decay ends at lr * min_lr_ratio at the last step."""
  warmup_steps: int = 10
  """Steps of linear warm-up from 0."""
  weight_decay: float = 0.1
  """AdamW decoupled weight decay (not on norm scales)."""
  b1: float = 0.9
  """Adam beta1."""
  b2: float = 0.95
  """Adam beta2."""
  eps: float = 1e-8
  """Adam epsilon."""
  clip_norm: float = 1.0
  """Global gradient-norm clip; 0 = off."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  shape: tuple = (1, -1)
  """(nodes, devices per node); -1 fills in the rest of the devices. Devices of one node share a
  fast interconnect; placement and dispatch use this to prefer intra-node traffic."""


@dataclasses.dataclass(frozen=True)
class CodecConfig:
  mode: str = "off"
  """One of `moejax.codec.gather.MODES` (every sharded parameter in that mode), or auto: a mode
  per parameter (or plain), chosen and re-chosen from measured change rates."""
  block_size: int = 512
  """Values per block (block mode), at most: a shard's ceil(n / block_size) blocks are made
  even (a shard smaller than one block is one block of its size)."""
  warmup_steps: int = 30
  """Gathers that send everything while caches fill."""
  detect: str = "exact"
  """One of `moejax.codec.gather.DETECTORS`; hash (block mode): 128-bit block hashes, less
  memory."""
  capacity_fraction: float = 0.0
  """Patch capacity as a fraction of a shard; 0 = the mode's default."""
  select: bool = False
  """A fixed mode only where it pays (benefit vs cost), capacities sized from measured rates;
  always on for auto (moejax.train.codec_control)."""
  delta_bits: int = 3
  """Delta mode: code bits per value, one of `moejax.codec.word.DELTA_BITS`."""
  cache_budget_bytes: int = 0
  """Codec state per device of the selected parameters; 0 = no limit."""
  reselect_every: int = 0
  """Steps between re-decisions from live rates; 0 = decide once."""
  capacity_margin: float = 1.25
  """Selected capacity = the worst device's change rate times this margin."""
  comm_model: str = "profile"
  """Gain measured in seconds from a profile of the mesh ("profile") or in bytes saved
  ("bytes")."""
  transport: str = "auto"
  """How a gather group's payload travels, one of `moejax.codec.gather.TRANSPORTS`: "single": one
  collective in no conditional (each pool its patch or, falling back, its bit patterns; on GPU
  only the used words move), so it can overlap the layer compute; "cond": a conditional per pool
  runs only the agreed path, its own collective inside; "auto": "cond" on XLA:CPU (whose
  collectives never overlap compute) and "single" elsewhere."""

  @property
  def controlled(self) -> bool:
    """Parameters and capacities are chosen at run time from measurements (plain until then)."""
    return self.mode == "auto" or (self.select and self.mode != "off")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Saves go to WORKDIR/checkpoints (moejax.train.checkpoint); a rerun resumes from the latest."""
  every: int = 100
  """Save every N steps; 0 = only at the end (the last step always saves)."""
  keep: int = 3
  """How many of the latest checkpoints to keep (a rerun that finds more prunes the oldest)."""


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """Multi-process jobs (moejax.distributed): how the loss of a process is noticed."""
  heartbeat_timeout_s: int = 30
  """Seconds a process may go without a heartbeat before the others count it as lost and stop
  with one line naming it (exit 2); a process that dies is noticed at once. jax.distributed's
  own heartbeat timeout is set to twice this plus `moejax.distributed.JAX_MARGIN_S`."""


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelConfig = ModelConfig()
  """Decoder shapes."""
  moe: MoEConfig = MoEConfig()
  """The MoE layers: experts, router, placement."""
  routing: RoutingConfig = RoutingConfig()
  """Admission of routed tokens (capacity per expert)."""
  fssdp: FssdpConfig = FssdpConfig()
  """fssdp placement only."""
  data: DataConfig = DataConfig()
  """Training and validation data."""
  optim: OptimConfig = OptimConfig()
  """Optimizer and learning-rate schedule."""
  mesh: MeshConfig = MeshConfig()
  """Device mesh."""
  codec: CodecConfig = CodecConfig()
  """Compressed parameter all-gather."""
  checkpoint: CheckpointConfig = CheckpointConfig()
  """Periodic saves and resume."""
  distributed: DistributedConfig = DistributedConfig()
  """Multi-process jobs: heartbeats between the processes."""
  steps: int = 200
  """Training steps (the schedule's length)."""
  batch_size: int = 16
  """Global batch, in sequences."""
  seq_len: int = 64
  """Tokens per sequence."""
  seed: int = 0
  """Seeds the initialization and the data order."""
  log_every: int = 10
  """Steps between printed and logged metrics."""
  eval_every: int = 50
  """Steps between validation losses (and at the last step)."""
  eval_batches: int = 4
  """Validation batches per evaluation."""
  remat: str = "full"
  """What each layer keeps for its backward pass: one of `moejax.sharding.prefetch.REMAT_MODES`
  (full: only its input, everything recomputed; minimal: also its matmul outputs; none:
  everything). full is the fastest measured on CPU (bench/step.py) and the leanest."""
  init_from: str = ""
  """Start from these weights (a Hugging Face directory of any family, or a moejax checkpoint /
  from-hf output) instead of a random init, when the workdir has no checkpoint to resume."""
  prefetch: bool = True
  """Issue layer i+1's parameter gather before layer i's compute (moejax.sharding.prefetch).
  Another program, not other math: the same in float32; bf16 losses move in the 5th-6th digit
  (XLA fuses the two programs apart), as between device counts."""
  scatter_ahead: str = "auto"
  """With prefetch, where the backward reduce-scatters a layer's gradient: "always" under the
  backward of the layer before it (the collective overlaps its matmuls; one layer's gradient of
  zeros more a step), "never" at the end of its own layer's (the next waits for it), "auto"
  ahead on GPU/TPU and in place on XLA:CPU. Bit-identical results either way; "never" can win
  where the network alone sets the step (bench/projection.py)."""
  schedule_latencies: str = "xla"
  """What XLA:GPU's scheduler places each collective's start and done by: "xla", its own
  estimate (constants: a collective is hidden by one matmul, a ragged all-to-all costs nothing,
  so the codec's payload exchange and fssdp's runs synchronously), or "model": every
  instruction's time from moejax's cost model (`moejax.perf.latencies`: FLOPs and bytes at the
  GPU's calibrated rates, collectives at `schedule_cluster`'s links), given to XLA as a
  profile; the step is then compiled twice at its first call. Another schedule, the same math
  (bit-identical results). XLA:CPU's collectives never overlap compute: there it changes
  nothing but the compile time."""
  schedule_cluster: str = "auto"
  """The cluster `schedule_latencies="model"` prices collectives on: a `moejax.perf` cluster
  (h200, h100, themis-a, themis-b, ciera-a100), or "auto": the preset of this job's GPU kind
  (H200 -> h200, A100 -> themis-a, any other -> h100)."""
  compute_dtype: str = "bfloat16"
  """What gathered parameters and activations are computed in: bfloat16, or float32 (exact
  comparisons with a reference, e.g. a fine-tune's first step against transformers; codec off).
  Master weights, gradients and optimizer state are float32 either way."""
  reduce_dtype: str = "float32"
  """What the gathered parameters' gradients are summed in across devices (the fsdp
  reduce-scatter, the replicated parameters' all-reduce): float32, or bfloat16 (half the bytes
  of the collective that dominates a step across nodes; each hop of the reduction rounds to bf16,
  as PyTorch FSDP's reduce_dtype does). Parameters gathered in float32 (axes.FLOAT32_GROUPS:
  router biases, DeepSeek-V3's router, attention sinks, linear-attention decays) and FSSDP's
  SparseReduceScatter stay float32; the optimizer always gets float32 gradients."""


SCHEDULE_LATENCIES = ("xla", "model")
"""Config `schedule_latencies`: XLA's own estimate, or `moejax.perf.latencies`' prices (the
cluster, `schedule_cluster`, is checked where the step is made: `moejax.perf` reads configs)."""


def default_config_dict() -> ml_collections.ConfigDict:
  """`Config()` as a ConfigDict: what config files start from (absl `--config.x.y=` overrides
  are type-checked against these values)."""
  return ml_collections.ConfigDict(dataclasses.asdict(Config()))


def published_fine_tuning(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """What the presets of published Hugging Face models share (configs/mixtral.py and the
  others): the checkpoint's tokenizer.json (pass --config.init_from=HF_DIR), a fine-tuning
  learning rate and schedule, and a batch of 64 x 4096 tokens (override for one host)."""
  c.data.tokenizer = "init_from"
  c.optim.update(lr=1e-5, warmup_steps=100)
  c.checkpoint.every = 500
  c.steps = 2000
  c.batch_size = 64
  c.seq_len = 4096
  return c


def _type_name(tp) -> str:
  return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp, path: str):
  """Checks one leaf value against the annotated type, allowing int -> float."""
  if tp is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ConfigError(f"config.{path}={value!r}: expected a number")
    return float(value)
  if tp is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise ConfigError(f"config.{path}={value!r}: expected an integer")
    return value
  if tp is bool:
    if not isinstance(value, bool):
      raise ConfigError(f"config.{path}={value!r}: expected true or false")
    return value
  if tp is str:
    if not isinstance(value, str):
      raise ConfigError(f"config.{path}={value!r}: expected a string")
    return value
  if tp is tuple:
    if not isinstance(value, (tuple, list)) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value):
      raise ConfigError(f"config.{path}={value!r}: expected a tuple of integers")
    return tuple(value)
  raise TypeError(f"unsupported config type {_type_name(tp)} at {path}")


def _build(cls, cd, prefix: str):
  hints = typing.get_type_hints(cls)
  fields = {f.name for f in dataclasses.fields(cls)}
  keys = set(cd.keys())
  for key in sorted(keys):
    check_not_renamed(prefix + key)
  unknown = sorted(keys - fields)
  if unknown:
    raise ConfigError(f"unknown config field config.{prefix}{unknown[0]} "
                      f"(valid: {', '.join(sorted(fields))})")
  kwargs = {}
  for name in fields & keys:
    tp, value = hints[name], cd[name]
    if dataclasses.is_dataclass(tp):
      if not hasattr(value, "keys"):
        raise ConfigError(f"config.{prefix}{name} must be a group of fields, got {value!r}")
      kwargs[name] = _build(tp, value, f"{prefix}{name}.")
    else:
      kwargs[name] = _convert(value, tp, prefix + name)
  return cls(**kwargs)


def from_config_dict(cd) -> Config:
  """ConfigDict (or nested dict) -> validated `Config`."""
  config = _build(Config, cd, "")
  validate(config)
  return config


def _check(ok: bool, message: str):
  if not ok:
    raise ConfigError(message)


def _choice(value, field: str, valid: tuple):
  _check(value in valid,
         f"config.{field}={value!r}: must be one of {', '.join(str(v) for v in valid)}")


def _floats(obj, prefix: str = ""):
  """(dotted field, value) of every float field of a config dataclass, nested ones too."""
  for f in dataclasses.fields(obj):
    value = getattr(obj, f.name)
    if dataclasses.is_dataclass(value):
      yield from _floats(value, f"{prefix}{f.name}.")
    elif isinstance(value, float):
      yield prefix + f.name, value


def _validate_linear(c: Config) -> None:
  """model.linear_layers and their widths (Gated DeltaNet)."""
  m = c.model
  layers = m.linear_layers
  _check(list(layers) == sorted(set(layers)) and all(0 <= i < m.num_layers for i in layers),
         f"config.model.linear_layers={layers}: must be ascending distinct layer indices in [0, "
         f"model.num_layers={m.num_layers})")
  widths = ("linear_key_heads", "linear_value_heads", "linear_key_dim", "linear_value_dim")
  if not layers:
    _check(not any(getattr(m, f) for f in widths),
           "config.model.linear_key_heads / linear_value_heads / linear_key_dim / "
           "linear_value_dim size linear attention: they need model.linear_layers")
    return
  _choice(m.linear_kind, "model.linear_kind", LINEAR_KINDS)
  for field in widths:
    _check(getattr(m, field) > 0, f"config.model.{field}={getattr(m, field)}: "
           f"model.linear_layers={layers} need it > 0")
  _check(m.linear_value_heads % m.linear_key_heads == 0,
         f"config.model.linear_value_heads={m.linear_value_heads}: must be a multiple of "
         f"model.linear_key_heads={m.linear_key_heads} (each key head serves as many value heads)")
  _check(m.linear_conv_taps >= 1, f"config.model.linear_conv_taps={m.linear_conv_taps}: must be "
         ">= 1")
  _check(not m.kv_lora_rank, "config.model.linear_layers: not with latent attention "
         "(model.kv_lora_rank > 0)")
  _check(m.norm_position == "pre", f"config.model.linear_layers: need model.norm_position='pre' "
         f"(here {m.norm_position!r})")
  other = sorted(set(layers) & set(m.sliding_layers + m.chunked_layers + m.nope_layers))
  _check(not other, f"config.model.linear_layers share layers {other} with model.sliding_layers "
         "/ chunked_layers / nope_layers, which are softmax attention's")


def validate(c: Config) -> None:
  """Cross-field checks that do not need devices (mesh checks live in sharding.mesh)."""
  m, moe = c.model, c.moe
  for field, value in _floats(c):   # inf or nan ends in a NaN loss that blames the lr
    _check(math.isfinite(value), f"config.{field}={value}: must be a finite number")
  _check(0 <= c.seed < 2 ** 63, f"config.seed={c.seed}: must be in [0, 2^63)")
  for field, value in [("model.rope_theta", m.rope_theta), ("model.norm_eps", m.norm_eps),
                       ("model.init_std", m.init_std)]:
    _check(value > 0, f"config.{field}={value}: must be positive")
  for field, value in [("moe.aux_loss_weight", moe.aux_loss_weight),
                       ("moe.z_loss_weight", moe.z_loss_weight),
                       ("optim.weight_decay", c.optim.weight_decay)]:
    _check(value >= 0, f"config.{field}={value}: must be >= 0")
  # 0 divides a moment by a square root that is 0 for a parameter with no gradient (an
  # embedding row no token uses): NaN weights, saved before the loss shows them.
  _check(c.optim.eps > 0, f"config.optim.eps={c.optim.eps}: must be positive (Adam divides by "
         "sqrt(v) + eps, and v is 0 where a parameter never had a gradient)")
  for field, value in [("optim.b1", c.optim.b1), ("optim.b2", c.optim.b2)]:
    _check(0 <= value < 1, f"config.{field}={value}: an Adam decay rate, in [0, 1)")
  for field, value in [("model.vocab_size", m.vocab_size), ("model.d_model", m.d_model),
                       ("model.num_layers", m.num_layers), ("model.num_heads", m.num_heads),
                       ("model.head_dim", m.head_dim), ("moe.num_experts", moe.num_experts),
                       ("moe.top_k", moe.top_k), ("moe.expert_hidden", moe.expert_hidden),
                       ("steps", c.steps), ("batch_size", c.batch_size), ("seq_len", c.seq_len),
                       ("log_every", c.log_every), ("eval_every", c.eval_every),
                       ("eval_batches", c.eval_batches), ("checkpoint.keep", c.checkpoint.keep),
                       ("codec.block_size", c.codec.block_size)]:
    _check(value > 0, f"config.{field}={value}: must be positive")
  _choice(c.remat, "remat", REMAT_MODES)
  _choice(c.scatter_ahead, "scatter_ahead", SCATTER_AHEAD_MODES)
  _choice(c.schedule_latencies, "schedule_latencies", SCHEDULE_LATENCIES)
  _choice(c.compute_dtype, "compute_dtype", tuple(COMPUTE_DTYPES))
  _choice(c.reduce_dtype, "reduce_dtype", tuple(REDUCE_DTYPES))
  _check(c.reduce_dtype == "float32" or c.compute_dtype == "bfloat16",
         f"config.reduce_dtype={c.reduce_dtype!r} needs compute_dtype='bfloat16' (a float32 "
         "computation sums its gradients in float32)")
  _check(c.compute_dtype == "bfloat16" or c.codec.mode == "off",
         f"config.compute_dtype={c.compute_dtype!r} needs codec.mode='off' (the codec gathers "
         "bfloat16 bit patterns)")
  _choice(m.family, "model.family", FAMILIES)
  _choice(m.qk_norm, "model.qk_norm", QK_NORMS)
  _check(m.rotary_dim >= 0 and m.rotary_dim % 2 == 0 and m.rotary_dim <= m.head_dim,
         f"config.model.rotary_dim={m.rotary_dim}: an even width up to model.head_dim="
         f"{m.head_dim} (0 = the whole head)")
  _check(not (m.rotary_interleaved and m.kv_lora_rank),
         "config.model.rotary_interleaved=True: latent attention's rotary part is interleaved "
         "already; leave it False")
  _check(not (m.rotary_dim and m.kv_lora_rank),
         f"config.model.rotary_dim={m.rotary_dim}: latent attention rotates "
         "model.qk_rope_head_dim; leave rotary_dim 0")
  _choice(m.rope_scaling, "model.rope_scaling", ROPE_SCALINGS)
  _check(not (m.attention_gate and m.kv_lora_rank),
         "config.model.attention_gate=True: latent attention (model.kv_lora_rank > 0) has no "
         "output gate; leave it False")
  if m.rope_scaling != "none":
    name = "YaRN" if m.rope_scaling == "yarn" else "Llama 3's scaling"
    _check(m.rope_factor >= 1, f"config.model.rope_factor={m.rope_factor}: {name}'s context "
           "extension factor, >= 1".replace("scaling's", "scaling"))
    _check(m.rope_original_max_len > 0,
           f"config.model.rope_original_max_len={m.rope_original_max_len}: {name} needs the "
           "context the weights were pretrained on (original_max_position_embeddings), > 0")
  if m.rope_scaling == "llama3":
    _check(m.rope_high_freq_factor >= m.rope_low_freq_factor > 0,
           f"config.model.rope_low_freq_factor={m.rope_low_freq_factor}, rope_high_freq_factor="
           f"{m.rope_high_freq_factor}: Llama 3's scaling needs high >= low > 0 (1 and 4 by "
           "default)")
  if m.rope_scaling == "yarn":
    _check(m.rope_beta_fast > m.rope_beta_slow > 0,
           f"config.model.rope_beta_fast={m.rope_beta_fast}, rope_beta_slow={m.rope_beta_slow}: "
           "YaRN needs rope_beta_fast > rope_beta_slow > 0 (rotations over the original "
           "context; 32 and 1 by default)")
    for field in ("rope_mscale", "rope_mscale_all_dim", "rope_attention_factor"):
      _check(getattr(m, field) >= 0, f"config.model.{field}={getattr(m, field)}: must be >= 0 "
             "(0: not set)")
  _check(m.num_kv_heads >= 0 and m.num_heads % (m.num_kv_heads or m.num_heads) == 0,
         f"config.model.num_kv_heads={m.num_kv_heads}: must divide model.num_heads="
         f"{m.num_heads} (0 = num_heads)")
  _check(moe.shared_expert_hidden >= 0,
         f"config.moe.shared_expert_hidden={moe.shared_expert_hidden}: must be >= 0 (0 = none)")
  _check(0 < moe.shared_expert_scale < math.inf,
         f"config.moe.shared_expert_scale={moe.shared_expert_scale}: must be positive and finite")
  _check(moe.shared_expert_scale == 1.0 or moe.shared_expert_hidden > 0,
         f"config.moe.shared_expert_scale={moe.shared_expert_scale} needs a shared expert "
         "(moe.shared_expert_hidden > 0)")
  _check(not moe.shared_expert_gate or moe.shared_expert_hidden > 0,
         "config.moe.shared_expert_gate=True needs moe.shared_expert_hidden > 0 (a shared "
         "expert to gate)")
  _check(m.head_dim % 2 == 0 or m.kv_lora_rank > 0,
         f"config.model.head_dim={m.head_dim}: must be even (rotary)")
  _check(list(m.dense_layers) == sorted(set(m.dense_layers))
         and all(0 <= i < m.num_layers for i in m.dense_layers)
         and len(m.dense_layers) < m.num_layers,
         f"config.model.dense_layers={m.dense_layers}: must be ascending distinct layer indices "
         f"in [0, model.num_layers={m.num_layers}), leaving at least one MoE layer")
  _check(m.dense_hidden >= 0, f"config.model.dense_hidden={m.dense_hidden}: must be >= 0 (0: no "
         "dense layers)")
  for field in ("sliding_layers", "nope_layers", "chunked_layers"):
    layers = getattr(m, field)
    _check(list(layers) == sorted(set(layers)) and all(0 <= i < m.num_layers for i in layers),
           f"config.model.{field}={layers}: must be ascending distinct layer indices in [0, "
           f"model.num_layers={m.num_layers})")
  _choice(m.norm_position, "model.norm_position", NORM_POSITIONS)
  _choice(m.norm_kind, "model.norm_kind", NORM_KINDS)
  _check(not (m.attention_sinks and m.kv_lora_rank),
         "config.model.attention_sinks=True: latent attention (model.kv_lora_rank > 0) has no "
         "sinks")
  _check(m.attention_gate or not m.attention_gate_own,
         "config.model.attention_gate_own=True: needs model.attention_gate=True (the gate whose "
         "weight it is)")
  _check(not m.qk_norm_after_rope or m.qk_norm == "head",
         f"config.model.qk_norm_after_rope=True needs model.qk_norm='head' (here "
         f"{m.qk_norm!r}): the norm is per head")
  for field in ("embed_scale", "residual_scale", "logit_divisor"):
    _check(getattr(m, field) > 0, f"config.model.{field}={getattr(m, field)}: must be > 0 (1: "
           "no scaling)")
  _check(m.attention_scale >= 0, f"config.model.attention_scale={m.attention_scale}: must be >= "
         "0 (0: 1/sqrt(head width))")
  _check(m.sliding_window >= 0, f"config.model.sliding_window={m.sliding_window}: must be >= 0 "
         "(0: no sliding layers)")
  _check(bool(m.sliding_window) == bool(m.sliding_layers),
         f"config.model.sliding_window={m.sliding_window} with model.sliding_layers="
         f"{m.sliding_layers}: a window needs the layers it applies to, and layers a window > 0"),
  _check(m.attention_chunk >= 0 and bool(m.attention_chunk) == bool(m.chunked_layers),
         f"config.model.attention_chunk={m.attention_chunk} with model.chunked_layers="
         f"{m.chunked_layers}: a chunk (> 0) needs the layers it applies to, and chunked layers "
         "a chunk > 0")
  both = sorted(set(m.chunked_layers) & set(m.sliding_layers))
  _check(not both, f"config.model.chunked_layers and model.sliding_layers share layers {both}: "
         "a layer's attention slides or stays within its chunk, not both")
  _check(0 <= m.nope_temperature < math.inf and m.nope_temperature_floor > 0
         and (m.nope_layers or not m.nope_temperature),
         f"config.model.nope_temperature={m.nope_temperature}, nope_temperature_floor="
         f"{m.nope_temperature_floor}: the scale must be >= 0 and finite (> 0 only with "
         "model.nope_layers, the layers it scales) and the floor > 0")
  _check(not (m.nope_temperature and m.kv_lora_rank),
         f"config.model.nope_temperature={m.nope_temperature}: latent attention "
         "(model.kv_lora_rank > 0) has no query temperature; leave it 0")
  _check(m.qk_norm != "l2" or not m.kv_lora_rank,
         "config.model.qk_norm='l2': latent attention (model.kv_lora_rank > 0) normalizes its "
         "latents, not q and k; use 'none'")
  _check(0 <= m.sliding_rope_theta < math.inf and (m.sliding_layers or not m.sliding_rope_theta),
         f"config.model.sliding_rope_theta={m.sliding_rope_theta}: must be >= 0 and finite, and "
         "> 0 only with model.sliding_layers (0: the sliding layers rotate as the others)")
  _check(not m.dense_layers or m.dense_hidden > 0,
         f"config.model.dense_hidden={m.dense_hidden}: model.dense_layers={m.dense_layers} "
         "needs a positive dense MLP width")
  for field in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim"):
    _check(getattr(m, field) >= 0, f"config.model.{field}={getattr(m, field)}: must be >= 0")
  if m.kv_lora_rank:
    _check(m.qk_rope_head_dim > 0 and m.qk_rope_head_dim % 2 == 0,
           f"config.model.qk_rope_head_dim={m.qk_rope_head_dim}: multi-head latent attention "
           "(model.kv_lora_rank > 0) needs a positive even rotary width")
    _check(m.v_head_dim > 0, f"config.model.v_head_dim={m.v_head_dim}: multi-head latent "
           "attention (model.kv_lora_rank > 0) needs a positive value head width")
    _check(m.head_dim == m.qk_nope_head_dim + m.qk_rope_head_dim,
           f"config.model.head_dim={m.head_dim}: with multi-head latent attention it is the q/k "
           f"head width, model.qk_nope_head_dim + qk_rope_head_dim = "
           f"{m.qk_nope_head_dim + m.qk_rope_head_dim}")
    _check(m.num_kv_heads in (0, m.num_heads) and m.qk_norm == "none" and not m.qkv_bias
           and not m.attention_out_bias,
           "config.model.kv_lora_rank > 0 (multi-head latent attention) takes no num_kv_heads, "
           "qk_norm, qkv_bias or attention_out_bias: set them to 0, 'none', False and False")
  else:
    _check(not (m.q_lora_rank or m.qk_nope_head_dim or m.qk_rope_head_dim or m.v_head_dim),
           "config.model.q_lora_rank / qk_nope_head_dim / qk_rope_head_dim / v_head_dim are "
           "multi-head latent attention's: they need model.kv_lora_rank > 0")
  for field in ("index_topk", "index_heads", "index_head_dim"):
    _check(getattr(m, field) >= 0, f"config.model.{field}={getattr(m, field)}: must be >= 0")
  if m.index_topk:
    _check(m.kv_lora_rank > 0 and m.q_lora_rank > 0,
           f"config.model.index_topk={m.index_topk}: DeepSeek sparse attention's indexer reads "
           "latent attention's q latent (needs model.kv_lora_rank > 0 and q_lora_rank > 0)")
    _check(m.index_heads > 0 and m.index_head_dim >= m.qk_rope_head_dim
           and m.index_head_dim % 2 == 0,
           f"config.model.index_heads={m.index_heads}, index_head_dim={m.index_head_dim}: the "
           "indexer needs heads, each even and at least model.qk_rope_head_dim="
           f"{m.qk_rope_head_dim} wide")
    _check(not (m.sliding_layers or m.chunked_layers),
           f"config.model.index_topk={m.index_topk}: DeepSeek sparse attention selects among all "
           "earlier keys (no model.sliding_layers or chunked_layers)")
  else:
    _check(not (m.index_heads or m.index_head_dim or m.index_rotary_interleaved),
           f"config.model.index_heads={m.index_heads}, index_head_dim={m.index_head_dim}, "
           f"index_rotary_interleaved={m.index_rotary_interleaved}: an indexer needs "
           "model.index_topk > 0; leave them 0 and False")
  _validate_linear(c)
  _check(moe.routed_scale > 0, f"config.moe.routed_scale={moe.routed_scale}: must be positive")
  _check(moe.expert_groups > 0 and moe.num_experts % moe.expert_groups == 0
         and (moe.expert_groups == 1 or moe.num_experts // moe.expert_groups >= 2),
         f"config.moe.expert_groups={moe.expert_groups}: must divide moe.num_experts="
         f"{moe.num_experts} into groups of at least 2 experts (1 = no grouping)")
  _check(1 <= moe.top_groups <= moe.expert_groups
         and (moe.expert_groups == 1
              or moe.top_groups * (moe.num_experts // moe.expert_groups) >= moe.top_k),
         f"config.moe.top_groups={moe.top_groups}: must be in [1, moe.expert_groups="
         f"{moe.expert_groups}] with enough experts for moe.top_k={moe.top_k}")
  _check(moe.score_bias_rate >= 0,
         f"config.moe.score_bias_rate={moe.score_bias_rate}: must be >= 0 (0 = fixed)")
  _choice(moe.activation, "moe.activation", ACTIVATIONS)
  for field in ("swiglu_alpha", "swiglu_limit"):
    _check(0 < getattr(moe, field) < math.inf,
           f"config.moe.{field}={getattr(moe, field)}: must be positive and finite")
  _check(moe.activation == "swiglu_clamped"
         or (moe.swiglu_alpha, moe.swiglu_limit) == (MoEConfig.swiglu_alpha,
                                                     MoEConfig.swiglu_limit),
         f"config.moe.swiglu_alpha/swiglu_limit ({moe.swiglu_alpha}, {moe.swiglu_limit}) apply to "
         "moe.activation='swiglu_clamped' only: set it, or leave them at their defaults")
  _check(moe.score_bias or not moe.score_bias_on_logits,
         "config.moe.score_bias_on_logits=True needs moe.score_bias=True (the bias it places)")
  _check(moe.score_bias or moe.score_bias_rate == 0,
         f"config.moe.score_bias_rate={moe.score_bias_rate} needs moe.score_bias=True (a bias to "
         "update)")
  _check(moe.top_k <= moe.num_experts,
         f"config.moe.top_k={moe.top_k}: must be at most moe.num_experts={moe.num_experts}")
  _choice(moe.placement, "moe.placement", PLACEMENTS)
  for field in ("replica_slots", "overlap_degree", "window"):
    value = getattr(c.fssdp, field)
    _check(value > 0, f"config.fssdp.{field}={value}: must be positive")
  for field in ("replica_slots", "overlap_degree"):   # replicas of distinct experts of a layer
    value = getattr(c.fssdp, field)
    _check(value <= moe.num_experts or moe.placement != "fssdp",
           f"config.fssdp.{field}={value}: must be at most moe.num_experts={moe.num_experts} "
           "(replicas are of distinct experts)")
  _check(c.fssdp.replica_codec in ("",) + REPLICA_CODECS,
         f"config.fssdp.replica_codec={c.fssdp.replica_codec!r}: must be one of "
         f"{', '.join(REPLICA_CODECS)} (or '' to follow codec.mode)")
  _check(moe.placement != "fssdp" or c.fssdp.resolved_replica_codec(c.codec.mode) == "off"
         or c.compute_dtype == "bfloat16",
         f"config.fssdp.replica_codec={c.fssdp.replica_codec!r} needs compute_dtype='bfloat16' "
         f"(its delta codes count bfloat16 units in the last place; got {c.compute_dtype!r}): "
         "set fssdp.replica_codec='off'")
  _check(c.fssdp.owner_sends >= -1,
         f"config.fssdp.owner_sends={c.fssdp.owner_sends}: must be -1 (= overlap_degree), 0 "
         "(no bound) or a positive count of replica slots")
  _check(c.fssdp.reshard_every >= 0,
         f"config.fssdp.reshard_every={c.fssdp.reshard_every}: must be >= 0 (0 = never)")
  _check(0 <= c.fssdp.max_per_layer <= moe.num_experts,
         f"config.fssdp.max_per_layer={c.fssdp.max_per_layer}: must be in [0, "
         f"moe.num_experts={moe.num_experts}] (0 = default)")
  _choice(moe.score, "moe.score", SCORES)
  _choice(moe.group_score, "moe.group_score", GROUP_SCORES)
  _check(moe.dispatch_capacity_factor >= 0,
         f"config.moe.dispatch_capacity_factor={moe.dispatch_capacity_factor}: must be >= 0 "
         "(0 = dropless)")
  _choice(moe.dispatch_overflow, "moe.dispatch_overflow", OVERFLOW_POLICIES)
  _check(moe.receive_capacity_factor >= 0,
         f"config.moe.receive_capacity_factor={moe.receive_capacity_factor}: must be >= 0 "
         "(0 = every received row)")
  _choice(moe.exchange_buffers, "moe.exchange_buffers", EXCHANGE_BUFFERS)
  _check(moe.dispatch_chunks >= 1,
         f"config.moe.dispatch_chunks={moe.dispatch_chunks}: must be at least 1 (1: the "
         "exchange in one piece)")
  _choice(c.routing.admission, "routing.admission", ADMISSIONS)
  _check(-1.0 <= c.routing.threshold <= 1.0,
         f"config.routing.threshold={c.routing.threshold}: a cosine similarity, in [-1, 1]")
  for field in ("admission_capacity_factor", "admission_capacity_factor_warmup"):
    value = getattr(c.routing, field)
    _check(value > 0, f"config.routing.{field}={value}: must be positive")
  _check(c.routing.warmup_steps >= 0,
         f"config.routing.warmup_steps={c.routing.warmup_steps}: must be >= 0")
  _check(c.routing.locality_weight >= 0,
         f"config.routing.locality_weight={c.routing.locality_weight}: must be >= 0")
  _choice(c.data.source, "data.source", DATA_SOURCES)
  _check(c.data.source == "builtin" or bool(c.data.path),
         f"config.data.path is empty: data.source={c.data.source!r} needs "
         f"{'the directory moejax.data.prepare wrote' if c.data.source == 'tokens' else 'a file path'}")
  _check(bool(c.data.tokenizer.strip()),
         "config.data.tokenizer is empty: 'bytes', 'init_from' or a path to a tokenizer.json "
         "(or its folder)")
  _check(0.0 <= c.data.val_fraction < 0.5,
         f"config.data.val_fraction={c.data.val_fraction}: must be in [0, 0.5) (0: no "
         "validation split, no val_loss)")
  o = c.optim
  _check(o.lr > 0, f"config.optim.lr={o.lr}: must be positive")
  _check(0 <= o.min_lr_ratio <= 1, f"config.optim.min_lr_ratio={o.min_lr_ratio}: must be in [0, 1]")
  _check(o.warmup_steps >= 0, f"config.optim.warmup_steps={o.warmup_steps}: must be >= 0")
  _check(o.clip_norm >= 0, f"config.optim.clip_norm={o.clip_norm}: must be >= 0 (0 = off)")
  _check(len(c.mesh.shape) == 2 and c.mesh.shape.count(-1) <= 1
         and all(s == -1 or s > 0 for s in c.mesh.shape),
         f"config.mesh.shape={c.mesh.shape}: must be (nodes, devices_per_node), "
         "positive, with at most one -1")
  _choice(c.codec.mode, "codec.mode", CODEC_MODES)
  _choice(c.codec.detect, "codec.detect", DETECTORS)
  _choice(c.codec.transport, "codec.transport", TRANSPORTS)
  _check(c.codec.detect == "exact" or c.codec.mode in ("block", "auto"),
         f"config.codec.detect={c.codec.detect!r} needs codec.mode='block' or 'auto' (hashes "
         "tell which blocks changed, not which values)")
  _check(not c.codec.select or c.codec.mode != "off",
         f"config.codec.select=True needs codec.mode to be one of {', '.join(COMPRESSED_MODES)} "
         "(auto always "
         "selects)")
  _choice(c.codec.delta_bits, "codec.delta_bits", DELTA_BITS)
  _check(c.codec.cache_budget_bytes >= 0,
         f"config.codec.cache_budget_bytes={c.codec.cache_budget_bytes}: must be >= 0 "
         "(0 = no limit)")
  _check(c.codec.reselect_every >= 0,
         f"config.codec.reselect_every={c.codec.reselect_every}: must be >= 0 (0 = decide once)")
  _check(c.codec.capacity_margin >= 1,
         f"config.codec.capacity_margin={c.codec.capacity_margin}: must be >= 1")
  _choice(c.codec.comm_model, "codec.comm_model", CODEC_COMM_MODELS)
  _check(0 <= c.codec.capacity_fraction <= 1,
         f"config.codec.capacity_fraction={c.codec.capacity_fraction}: must be in [0, 1]")
  _check(c.codec.warmup_steps >= 0,
         f"config.codec.warmup_steps={c.codec.warmup_steps}: must be >= 0")
  _check(c.checkpoint.every >= 0, f"config.checkpoint.every={c.checkpoint.every}: must be >= 0")
  _check(c.distributed.heartbeat_timeout_s > 0,
         f"config.distributed.heartbeat_timeout_s={c.distributed.heartbeat_timeout_s}: must be "
         "positive (seconds)")


def unused_settings(c: Config) -> list[str]:
  """Fields set away from their defaults that this config's modes never read: not errors (one
  config often serves several runs, e.g. codec.mode=off or moe.placement=ep as the baseline of
  the same settings), but a run says so once, so a setting that does nothing is not mistaken for
  one that did."""
  notes = []
  if c.codec.controlled and c.steps <= c.codec.warmup_steps:
    notes.append(f"config.codec.mode={c.codec.mode!r} chooses its modes after "
                 f"codec.warmup_steps={c.codec.warmup_steps} steps, and this run ends at "
                 f"config.steps={c.steps}: every gather stays plain (a smaller "
                 "codec.warmup_steps chooses sooner)")
  for field in ("reselect_every", "cache_budget_bytes"):
    value = getattr(c.codec, field)
    if value and not c.codec.controlled:
      notes.append(f"config.codec.{field}={value} has no effect: it acts on a codec chosen at "
                   "run time (codec.mode='auto', or a compressed mode with codec.select=True)")
  if c.codec.capacity_fraction and c.codec.mode == "off":
    notes.append(f"config.codec.capacity_fraction={c.codec.capacity_fraction} has no effect: "
                 "codec.mode='off' compresses nothing (it sizes a fixed mode's patches)")
  elif c.codec.capacity_fraction and c.codec.controlled:
    notes.append(f"config.codec.capacity_fraction={c.codec.capacity_fraction} has no effect: it "
                 "sizes a fixed mode's patches (codec.select=False); auto and select size them "
                 "from measured rates")
  if c.routing.admission == "reroute" and c.moe.top_k >= c.moe.num_experts:
    notes.append(f"config.routing.admission='reroute' has no effect beyond 'strict': with "
                 f"moe.top_k={c.moe.top_k} of moe.num_experts={c.moe.num_experts} every expert "
                 "is already one of each token's, so a rejected assignment has nowhere to go")
  if c.routing.locality_weight and c.moe.placement != "ep":
    notes.append(f"config.routing.locality_weight={c.routing.locality_weight} has no effect: "
                 f"the locality loss favours experts on a token's node under ep "
                 f"(moe.placement={c.moe.placement!r})")
  if c.schedule_cluster != "auto" and c.schedule_latencies != "model":
    notes.append(f"config.schedule_cluster={c.schedule_cluster!r} has no effect: it prices the "
                 f"schedule of schedule_latencies='model' (here {c.schedule_latencies!r})")
  if c.fssdp.replica_codec and c.moe.placement != "fssdp":
    notes.append(f"config.fssdp.replica_codec={c.fssdp.replica_codec!r} has no effect: it codes "
                 f"fssdp's expert replicas (moe.placement={c.moe.placement!r})")
  if (c.moe.placement != "fsdp"
      and c.moe.receive_capacity_factor != MoEConfig.receive_capacity_factor
      and c.moe.dispatch_overflow != "grow"):
    notes.append(f"config.moe.receive_capacity_factor={c.moe.receive_capacity_factor} has no "
                 "effect: it bounds the rows run through the experts where an overflow grows the "
                 f"buffers (here moe.dispatch_overflow={c.moe.dispatch_overflow!r})")
  unread = [  # (group, fields, whether this config reads them, when it would)
      ("fssdp", ("replica_slots", "overlap_degree", "owner_sends", "window", "reshard_every",
                 "max_per_layer", "calibrate"), c.moe.placement == "fssdp",
       f"moe.placement='fssdp' (here {c.moe.placement!r})"),
      ("moe", ("dispatch_capacity_factor", "dispatch_overflow", "dispatch_chunks",
               "receive_capacity_factor", "exchange_buffers"), c.moe.placement != "fsdp",
       "moe.placement is 'ep' or 'fssdp', whose tokens travel (here 'fsdp')"),
      ("routing", ("threshold", "admission_capacity_factor", "admission_capacity_factor_warmup",
                   "warmup_steps"), c.routing.admission != "none",
       "routing.admission is not 'none'"),
      ("codec", ("block_size", "warmup_steps", "detect", "select", "delta_bits", "transport"),
       c.codec.mode != "off", "codec.mode is not 'off'"),
      ("codec", ("capacity_margin", "comm_model"), c.codec.mode == "off" or c.codec.controlled,
       "the codec is chosen at run time (codec.mode='auto', or codec.select=True)"),
      ("model", ("dense_hidden",), bool(c.model.dense_layers), "model.dense_layers is not empty"),
      ("moe", ("group_score",), c.moe.expert_groups > 1, "moe.expert_groups > 1"),
      ("model", YARN_FIELDS, c.model.rope_scaling != "none",
       "model.rope_scaling is 'yarn' or 'llama3'"),
      ("model", ("nope_temperature_floor",), c.model.nope_temperature > 0,
       "model.nope_temperature > 0")]
  for group, fields, read, when in unread:
    if read:
      continue
    default = type(getattr(c, group))()
    changed = [f"config.{group}.{f}={getattr(getattr(c, group), f)!r}" for f in fields
               if getattr(getattr(c, group), f) != getattr(default, f)]
    if changed:
      notes.append(f"{', '.join(changed)} {'has' if len(changed) == 1 else 'have'} no effect: "
                   f"read only when {when}")
  return notes


# model.rope_<x> for each field <x> of RopeScaling but its kind (model.rope_scaling): YaRN's and
# Llama 3's settings, read only under a scaling.
YARN_FIELDS = tuple(f"rope_{f.name}" for f in dataclasses.fields(RopeScaling) if f.name != "kind")


def rope_scaling(m: ModelConfig) -> RopeScaling:
  """The model's RoPE scaling (`moejax.layers.rope`) from its rope_* fields."""
  if m.rope_scaling == "none":
    return RopeScaling()
  return RopeScaling(kind=m.rope_scaling,
                     **{field[len("rope_"):]: getattr(m, field) for field in YARN_FIELDS})


def num_params(c: Config) -> dict[str, int]:
  """Total and active (per token) parameter counts, from the shapes alone (every option of the
  decoder; tests check them against the model's parameter leaves)."""
  m, moe = c.model, c.moe
  d, h = m.d_model, m.num_heads
  if m.kv_lora_rank:        # multi-head latent attention: latents, their norms, up-projections
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    attn = (d * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * h * qk if m.q_lora_rank
            else d * h * qk)
    attn += (d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
             + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim) + h * m.v_head_dim * d)
    if m.index_topk:        # DSA's indexer: q from the q latent, one key head, its norm, weights
      attn += (m.q_lora_rank * m.index_heads * m.index_head_dim + d * m.index_head_dim
               + 2 * m.index_head_dim + d * m.index_heads)
  else:
    q_width, kv_width = h * m.head_dim, (m.num_kv_heads or h) * m.head_dim
    gates = 2 if m.attention_gate else 1                # the q projection (or wg): the gate
    attn = (gates + 1) * d * q_width + 2 * d * kv_width  # q (and gate), o; k, v
    q_biases = 1 if m.attention_gate_own else gates     # an own gate weight has no bias
    attn += (q_biases * q_width + 2 * kv_width) if m.qkv_bias else 0
    attn += d if m.attention_out_bias else 0
    attn += {"full": q_width + kv_width, "head": 2 * m.head_dim, "l2": 0, "none": 0}[m.qk_norm]
    attn += h if m.attention_sinks else 0                # one sink logit per head
  norms = {"sandwich": 4, "parallel": 1}.get(m.norm_position, 2) * d   # the layer's norms
  expert = expert_values(c)
  shared = 3 * d * moe.shared_expert_hidden + (d if moe.shared_expert_gate else 0)
  router = d * moe.num_experts + moe.num_experts * (moe.score_bias + moe.router_bias)
  # each layer's attention: softmax, or linear in model.linear_layers
  attns = [(linear_attention_values(c) if i in m.linear_layers else attn) + norms
           for i in range(m.num_layers)]
  dense = sum(attns[i] + 3 * d * m.dense_hidden for i in m.dense_layers)
  moe_attn = sum(a for i, a in enumerate(attns) if i not in m.dense_layers)
  moe_layers = m.num_layers - len(m.dense_layers)
  embed = (1 if m.tie_embeddings else 2) * m.vocab_size * d + d   # + final norm
  total = embed + dense + moe_attn + moe_layers * (router + shared + moe.num_experts * expert)
  active = embed + dense + moe_attn + moe_layers * (router + shared + moe.top_k * expert)
  return {"total": total, "active": active}


def linear_attention_values(c: Config) -> int:
  """Values of one linear layer's attention. Gated DeltaNet: q, k, v, z, b, a and output
  projections, the convolution's taps, the decay's two values per value head and the output
  norm; Mamba-2 as its comments say."""
  m = c.model
  kw, vw = m.linear_key_heads * m.linear_key_dim, m.linear_value_heads * m.linear_value_dim
  if m.linear_kind == "mamba2":   # z, x, B, C, dt; taps and biases; dt_bias, a_log, d_skip; norm
    return (m.d_model * (2 * kw + 2 * vw + m.linear_value_heads) + vw * m.d_model
            + (m.linear_conv_taps + 1) * (2 * kw + vw) + 3 * m.linear_value_heads + vw)
  return (m.d_model * (2 * kw + 2 * vw + 2 * m.linear_value_heads) + vw * m.d_model
          + m.linear_conv_taps * (2 * kw + vw) + 2 * m.linear_value_heads + m.linear_value_dim)


def expert_values(c: Config) -> int:
  """Values of one routed expert: its three matrices, and its biases where it has them."""
  d, f = c.model.d_model, c.moe.expert_hidden
  return 3 * d * f + ((2 * f + d) if c.moe.expert_bias else 0)


def num_moe_layers(c: Config) -> int:
  """Decoder layers with experts (all but `model.dense_layers`)."""
  return c.model.num_layers - len(c.model.dense_layers)
