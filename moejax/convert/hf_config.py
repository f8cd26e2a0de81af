"""Hugging Face config.json <-> moejax `Config`, for every family of `moejax.families`.

Only what moejax models is carried over; a config that asks for something moejax does not model
(clipped q/k/v, RoPE scaled other than by YaRN or Llama 3's rule, sliding windows where
the family's transformers code has none,
another activation, quantizations moejax cannot dequantize) is refused with one line naming the
field, rather than converted into a different model. Each family fixes some options of the decoder
(`FAMILY_SPECS`); the rest are read from its fields:

  config.json                          moejax
  model_type                           model.family (kimi_k2: deepseek_v3, MODEL_TYPE_ALIASES;
                                        llama4, kimi_k25, qwen3_vl_moe, glm4v_moe: their
                                        text_config's, TEXT_CONFIG_WRAPPERS)
  vocab_size                           model.vocab_size
  hidden_size                          model.d_model
  num_hidden_layers                    model.num_layers
  num_attention_heads                  model.num_heads
  num_key_value_heads                  model.num_kv_heads
  head_dim (or hidden/heads)           model.head_dim
  rope_theta (or rope_parameters.rope_theta)  model.rope_theta
  rope_scaling / rope_parameters: yarn  model.rope_scaling="yarn", rope_factor,
   (factor, original_max_position_      rope_original_max_len, rope_beta_fast / _slow,
   embeddings, beta_fast, beta_slow,    rope_mscale, rope_mscale_all_dim,
   mscale, mscale_all_dim,              rope_attention_factor, rope_truncate
   attention_factor, truncate)
  ... llama3 (factor, original_max_     model.rope_scaling="llama3", rope_factor,
   position_embeddings, low_freq_      rope_original_max_len, rope_low_freq_factor /
   factor, high_freq_factor)            _high_freq_factor
  rms_norm_eps                         model.norm_eps
  initializer_range                    model.init_std
  qkv_bias (qwen2_moe)                 model.qkv_bias
  num_experts / num_local_experts      moe.num_experts
  num_experts_per_tok                  moe.top_k
  intermediate_size / moe_intermediate_size  moe.expert_hidden
  shared_expert_intermediate_size      moe.shared_expert_hidden (qwen2_moe, with its gate)
  norm_topk_prob (mixtral: always)     moe.renormalize
  router_aux_loss_coef                 moe.aux_loss_weight
  router_z_loss_coef (olmoe)           moe.z_loss_weight
  tie_word_embeddings                  model.tie_embeddings
  sliding_window, layer_types          model.sliding_window, sliding_layers (Mixtral: every
   (mixtral, dots1, exaone_moe)        layer; dots.llm1: else from max_window_layers on;
                                       EXAONE: else by sliding_window_pattern, and its full
                                       layers model.nope_layers); other families: none slides
  mlp_only_layers, decoder_sparse_step model.dense_layers: layer i is dense if listed or if
   (qwen2_moe, qwen3_moe)              (i + 1) % step != 0 (transformers' rule); with
                                       intermediate_size as model.dense_hidden
 DeepSeek-V2 and V3 (deepseek_v2, deepseek_v3) besides:
  q_lora_rank (None: 0), kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
                                       model.* (latent attention; model.head_dim = nope + rope)
  first_k_dense_replace, intermediate_size  model.dense_layers (the first k), model.dense_hidden
  n_shared_experts * moe_intermediate_size  moe.shared_expert_hidden
  n_group, topk_group                  moe.expert_groups, moe.top_groups
  routed_scaling_factor                moe.routed_scale
  V3 (always): sigmoid scores with e_score_correction_bias, groups scored by their two best:
                                       moe.score="sigmoid", moe.score_bias, group_score="top2"
  V2: topk_method greedy (no groups) or group_limited_greedy (groups scored by their best,
   moe.group_score="max"), softmax, no renormalization; aux_loss_alpha: moe.aux_loss_weight
 GLM-4.7-Flash (glm4_moe_lite): DeepSeek-V3's latent attention and router (its own defaults:
  no groups, routed scaling 1.8, q latent 768, one shared expert); mlp_layer_types ("dense" /
  "sparse" per layer; transformers' default the first layer dense) -> model.dense_layers
 GLM-4.5, dots.llm1, Solar Open and MiniCPM5-MoE (glm4_moe, dots1, solar_open, minicpm5_moe;
  `FamilySpec.sigmoid_moe`): standard attention, the leading dense layers (none in Solar Open;
  MiniCPM5: mlp_layer_types, else first_k_dense_replace), shared experts, groups and routed
  scaling as DeepSeek-V3's (and its sigmoid router with the score bias); GLM and Solar Open:
  attention_bias -> model.qkv_bias; GLM: use_qk_norm -> model.qk_norm "head" / "none";
  MiniCPM5: always model.attention_gate (q_gate_proj: each head's query rows, then its gate's)
  partial_rotary_factor (glm4_moe, minimax_m2; MiniMax's legacy rotary_dim)  model.rotary_dim
 MiniMax-M2 (minimax_m2): QK-norm over all heads' width ("full"), sigmoid scores with the score
  bias beside the gate, always renormalized
 ERNIE-4.5 (ernie4_5_moe): moe_k, moe_num_experts, moe_num_shared_experts; moe_layer_start_index
  / _end_index / _interval -> model.dense_layers; neighbour-pair rotary
  (model.rotary_interleaved); softmax scores with moe_statics' [1, E] selection bias
 Hy3 (hy_v3): GLM-4.5's kind of router under num_shared_experts / router_scaling_factor, no
  groups, always renormalized; EXAONE-MoE (exaone_moe): the same with num_shared_experts and
  groups, sliding_window / layer_types as above
 Sarvam-MoE and Param2 (sarvam_moe, param2moe): GLM-4.5's fields with their defaults, and
  num_experts / num_shared_experts / use_qkv_bias as aliases that win (field_aliases)
 Granite (granitemoe, granitemoeshared): embedding_multiplier, residual_multiplier,
  attention_multiplier, logits_scaling -> model.embed_scale, residual_scale, attention_scale,
  logit_divisor; shared_intermediate_size -> moe.shared_expert_hidden (ungated)
 FlexOlmo (flex_olmo): model.norm_position "post"; Hunyuan-A13B (hunyuan_v1_moe): moe_topk,
  QK-norm after RoPE, a shared MLP of intermediate_size, "dynamic" RoPE with alpha as plain
  RoPE of base theta * alpha^(d / (d - 2)), per-layer lists of one value
 Llama 4 (llama4_text; a multimodal llama4 config.json is read as its text_config, by
  `text_model_config`): no_rope_layers (1 rotated; empty: every no_rope_layer_interval-th
  unrotated) -> model.nope_layers; attention_chunk_size and layer_types ("chunked_attention";
  absent: the rotated layers) -> model.attention_chunk, chunked_layers; attn_temperature_tuning,
  attn_scale, floor_scale -> model.nope_temperature, nope_temperature_floor; use_qk_norm ->
  model.qk_norm "l2" / "none"; moe_layers (else every interleave_moe_layer_step-th) and
  intermediate_size_mlp -> model.dense_layers, dense_hidden; always neighbour-pair rotary, a
  shared expert of the experts' width, sigmoid top-k not renormalized, the weights on the
  experts' inputs (moe.weights_on_input)
"""
from __future__ import annotations

import copy
import dataclasses
import math

from moejax.config import Config, ModelConfig, validate
from moejax.errors import CheckpointError, ConfigError
from moejax.convert.hf_names import MTP_FAMILIES, MTP_NAMED, TextLayout
from moejax.convert.safetensors_io import MXFP4_SCALES, WeightScales
from moejax.families import FAMILIES



@dataclasses.dataclass(frozen=True)
class FamilySpec:
  """What one Hugging Face architecture fixes and where it keeps the rest."""
  model_type: str
  architecture: str
  qk_norm: str                         # the architecture's QK-norm (model.qk_norm)
  experts_key: str                     # config.json field of the experts per layer (written)
  expert_hidden_key: str               # ... of one routed expert's hidden width
  renormalize_key: str | None          # ... of top-k renormalization; None: always on
  experts_aliases: tuple = ()          # other names the experts per layer are read under
  # transformers' defaults for fields a config.json may leave out
  default_rope_theta: float = 10000.0
  default_norm_eps: float = 1e-5
  shared_expert: bool = False          # a gated shared expert in every layer (Qwen2-MoE) ...
  shared_gate: bool = True             # ... without its gate (Flint)
  qkv_bias_key: str | None = None      # ... of q/k/v biases; None: never
  qkv_bias_default: bool = False
  renormalize_default: bool = False    # transformers' default when renormalize_key is absent
  z_loss_key: str | None = None        # ... of the router z-loss weight, if it has one
  dense_pattern: bool = False          # dense layers from mlp_only_layers / decoder_sparse_step
  default_mlp_only: tuple = ()         # ... mlp_only_layers absent or null (Flint: (0, 1))
  qk_norm_key: str | None = None       # ... of whether qk_norm is on (GLM's use_qk_norm: "none"
                                       # when false)
  partial_rotary: float | None = None  # partial_rotary_factor when absent; None: always 1 (the
                                       # architecture rotates whole heads)
  sigmoid_moe: bool = False            # standard attention, leading dense layers,
                                       # n_shared_experts, DeepSeek-V3's grouped sigmoid router
                                       # with a score bias (GLM-4.5, dots.llm1)
  default_first_dense: int = 0         # ... transformers' first_k_dense_replace default
  default_shared: int | None = None    # ... its n_shared_experts default (None: required)
  norm_over_hidden: bool = False       # "full" QK-norm is over hidden_size (OLMoE), so the q
                                       # width must equal it
  rotary_dim_key: str | None = None    # a legacy field of the rotated width (MiniMax-M2's
                                       # rotary_dim), read when no partial_rotary_factor is given
  score: str = "softmax"               # the router's scores and score bias, where neither
  score_bias: bool = False             # `deepseek` nor `sigmoid_moe` sets them (MiniMax-M2)
  bias_on_logits: bool = False         # ... the bias added to the logits (Kolibri)
  router_float32: bool = False         # its router kept in float32 (Flint): moe.router_float32
  default_aux: float | None = None     # transformers' router_aux_loss_coef default (None: the
                                       # base config's)
  default_head_dim: int | None = None  # transformers' head_dim default (None: hidden / heads)
  default_kv_heads: int | None = None  # ... num_key_value_heads default when the field is
                                       # absent (None: as many as the query heads; null is)
  top_k_key: str = "num_experts_per_tok"   # ... of the experts per token (ERNIE's moe_k)
  default_top_k: int | None = None     # ... its transformers default (None: required)
  default_tie: bool = False            # transformers' tie_word_embeddings default
  aliases_win: bool = False            # an alias's value wins over its field's (attribute_map)
  ernie: bool = False                  # ERNIE-4.5: neighbour-pair rotary, MoE layers from
                                       # moe_layer_start_index to _end_index every _interval,
                                       # moe_num_shared_experts, softmax with a selection bias
  default_sliding_window: int | None = None   # sliding_window when absent (transformers')
  sliding: str = ""                    # which layers slide within sliding_window (`_sliding`):
                                       # "" none; "all" every layer (Mixtral); "from_layer"
                                       # layer_types, else from max_window_layers on (dots.llm1);
                                       # "exaone" layer_types, else all but every
                                       # sliding_window_pattern-th, the others unrotated;
                                       # "afmoe" the same by global_attn_every_n_layers;
                                       # "listed" layer_types, else none; "granite_swa"
                                       # layer_types, else all but every 4th from layer 0;
                                       # "flint" layer_types, else all but layers 0, 1, every
                                       # 4th from 1 and the last, the others unrotated (all
                                       # without a window); "kolibri" layer_types, else all
                                       # but every 5th, the others unrotated (none without a
                                       # window); "gpt_oss" layer_types, else every other from
                                       # layer 0; "cohere" layer_types, else the first
                                       # first_k_dense_replace layers by
                                       # prefix_dense_sliding_window_pattern, the rest by
                                       # sliding_window_pattern (every n-th global)
  deepseek: str = ""                   # "v2" / "v3": latent attention, leading dense layers,
                                       # n_shared_experts; v3: grouped sigmoid routing with a
                                       # score bias; v2: softmax, greedy or grouped by the best
  deepseek_defaults: tuple = ()        # ... (field, transformers' default) where the family's
                                       # config class differs from DeepseekV3Config
  all_moe: bool = False                # experts in every layer: first_k_dense_replace is
                                       # not read (transformers' SolarOpen drops the field)
  layer_types_key: str | None = None   # dense layers from this per-layer list's "dense"
                                       # entries rather than first_k_dense_replace (GLM-4.7-
                                       # Flash's mlp_layer_types; absent: the first layer dense)
  layer_types_fallback: bool = False   # ... absent: first_k_dense_replace leading dense layers
                                       # (default_first_dense; MiniCPM5-MoE)
  attention_gate: bool = False         # a sigmoid output gate in every attention, its weight in
                                       # the q projection (MiniCPM5-MoE's q_gate_proj) ...
  attention_gate_own: bool = False     # ... or its own (AfMoE's gate_proj)
  first_dense_key: str = "first_k_dense_replace"   # sigmoid_moe's leading dense layers (AfMoE:
                                       # num_dense_layers)
  mup: bool = False                    # mup_enabled: the embedding scaled by sqrt(hidden_size)
  rope_per_type: bool = False          # rope_parameters holds one RoPE dict per layer type
                                       # (Mellum's; the sliding layers' plain RoPE:
                                       # model.sliding_rope_theta)
  attention_sinks: bool = False        # a sink logit per head in every attention (self_attn.sinks)
  layer_thetas: bool = False           # layer_rope_theta: a RoPE base per layer, 0 unrotated
                                       # (Granite SWA)
  first_dense_default: int = 1         # layer_types_key absent and no first_k_dense_replace
                                       # fallback: this many leading dense layers
  # sigmoid_moe's fields under other names (Hy3: num_shared_experts, router_scaling_factor),
  # transformers' routed scaling default, and whether the config has expert groups at all
  shared_key: str = "n_shared_experts"
  routed_scale_key: str = "routed_scaling_factor"
  default_routed_scale: float = 1.0
  expert_groups: bool = True
  qk_norm_default: bool = False        # qk_norm_key's transformers default
  field_aliases: tuple = ()            # (alias, field): a config.json's alias stands for the
                                       # field, its value winning (transformers' attribute_map:
                                       # Sarvam's num_experts, use_qkv_bias); exports write the
                                       # field
  norm_position: str = "pre"           # model.norm_position (FlexOlmo: "post")
  hunyuan: bool = False                # Hunyuan-A13B: QK-norm after RoPE, a shared MLP of the
                                       # experts' width, NTK-alpha RoPE, per-layer lists
  layer_lists: tuple = ()              # fields a config may give per layer; moejax takes one
                                       # value each (all entries equal)
  granite: str = ""                    # Granite's multipliers (embedding, residual, attention,
                                       # logits); "shared": shared_intermediate_size too
  gpt_oss: bool = False                # gpt-oss: attention_bias on q, k, v and o alike, a router
                                       # bias, biased experts with the clamped SwiGLU
                                       # (swiglu_alpha, swiglu_limit)
  cohere: bool = False                 # Cohere2-MoE: parallel blocks, LayerNorm unless
                                       # rms_norm_eps, attention_bias on q, k, v and o,
                                       # interleaved rotary, NoPE on the full layers (dense ones
                                       # rotated when prefix_dense_sliding_window_pattern is 1),
                                       # the shared experts summed or averaged, logit_scale
  llama4: bool = False                 # Llama 4: `_llama4_fields`
  dsa: tuple = ()                      # DeepSeek sparse attention, an indexer in every layer:
                                       # transformers' defaults of index_topk, index_n_heads,
                                       # index_head_dim
  dsa_interleaved: bool = False        # ... its rotated dims neighbour pairs (GLM-5's)
  linear: str = ""                     # model.linear_kind of layer_types' linear layers
                                       # (`_linear_fields`): "gated_deltanet" (Qwen3-Next:
                                       # zero-centered norms, a gated softmax attention
                                       # elsewhere) or "mamba2" (Granite-4.0-H: its mamba
                                       # layers, NoPE unless position_embedding_type is rope)
  default_rope: tuple = ()             # (key, value) of the RoPE dict its config class sets
                                       # when config.json gives none (gpt-oss: YaRN)
  # Fields that must hold these values (moejax has no equivalent of the others); export writes
  # them so.
  required: tuple = ()


_COMMON_REQUIRED = (("hidden_act", "silu", "moejax experts are SwiGLU"),)
# Values transformers treats as the same function (its ACT2FN maps "swish" to SiLU).
_SAME_AS = {("hidden_act", "swish"): "silu"}
_NO_SLIDING_WINDOW = (("use_sliding_window", False, "moejax attends to the whole sequence"),)

def _glm_named(model_type: str, **defaults) -> FamilySpec:
  """Sarvam's and Param2's families: GLM-4.5's architecture (transformers runs them as
  Glm4MoeForCausalLM) with their own defaults, the names of Sarvam's original config
  (attribute_map) and, in the Hub's layout, their own tensor names (`hf_names`)."""
  return FamilySpec(
      model_type, "Glm4MoeForCausalLM", "head", "n_routed_experts", "moe_intermediate_size",
      "norm_topk_prob", experts_aliases=("num_local_experts",), renormalize_default=True,
      qkv_bias_key="attention_bias", qk_norm_key="use_qk_norm", qk_norm_default=True,
      partial_rotary=1.0, sigmoid_moe=True, default_first_dense=1, default_aux=0.0,
      default_norm_eps=1e-6, default_head_dim=64, default_routed_scale=2.5, aliases_win=True,
      field_aliases=(("num_experts", "n_routed_experts"), ("num_shared_experts", "n_shared_experts"),
                     ("use_qkv_bias", "attention_bias")),
      required=_COMMON_REQUIRED, **defaults)


FAMILY_SPECS = {
    "olmoe": FamilySpec(
        "olmoe", "OlmoeForCausalLM", "full", "num_experts", "intermediate_size",
        "norm_topk_prob", z_loss_key="router_z_loss_coef", norm_over_hidden=True,
        experts_aliases=("num_local_experts",), aliases_win=True,
        required=_COMMON_REQUIRED + (
            ("clip_qkv", None, "moejax does not clip q/k/v"),
            ("attention_bias", False, "moejax attention projections have no bias"))),
    "mixtral": FamilySpec(
        "mixtral", "MixtralForCausalLM", "none", "num_local_experts", "intermediate_size", None,
        default_rope_theta=1e6, experts_aliases=("num_experts",), aliases_win=True,
        default_kv_heads=8, sliding="all",
        required=_COMMON_REQUIRED + (
            ("router_jitter_noise", 0.0, "moejax's router adds no noise"),)),
    "qwen2_moe": FamilySpec(
        "qwen2_moe", "Qwen2MoeForCausalLM", "none", "num_experts", "moe_intermediate_size",
        "norm_topk_prob", shared_expert=True, qkv_bias_key="qkv_bias", qkv_bias_default=True,
        default_norm_eps=1e-6, dense_pattern=True,
        required=_COMMON_REQUIRED + _NO_SLIDING_WINDOW),
    "qwen3_moe": FamilySpec(
        "qwen3_moe", "Qwen3MoeForCausalLM", "head", "num_experts", "moe_intermediate_size",
        "norm_topk_prob", experts_aliases=("num_local_experts",),   # transformers 5 writes it
        default_norm_eps=1e-6, dense_pattern=True,
        aliases_win=True, default_kv_heads=4,
        required=_COMMON_REQUIRED + _NO_SLIDING_WINDOW + (
            ("attention_bias", False, "moejax attention projections have no bias"),)),
    "minimax_m2": FamilySpec(
        "minimax_m2", "MiniMaxM2ForCausalLM", "full", "num_local_experts", "intermediate_size",
        None, experts_aliases=("num_experts",), default_norm_eps=1e-6, partial_rotary=1.0,
        rotary_dim_key="rotary_dim", score="sigmoid", score_bias=True, default_rope_theta=5e6,
        default_aux=0.001, default_head_dim=128,
        aliases_win=True, default_kv_heads=8,
        required=_COMMON_REQUIRED + (
            ("router_jitter_noise", 0.0, "moejax's router adds no noise"),
            ("use_qk_norm", True, "transformers' MiniMaxM2 always normalizes q and k"),
            ("scoring_func", "sigmoid", "MiniMax-M2 routes with sigmoids"),
            ("use_routing_bias", True, "transformers' MiniMaxM2 always adds the score bias"),
            ("shared_intermediate_size", 0, "MiniMax-M2 has no shared expert"),
            ("attention_bias", False, "moejax attention projections have no bias"))),
    "ernie4_5_moe": FamilySpec(
        "ernie4_5_moe", "Ernie4_5_MoeForCausalLM", "none", "moe_num_experts",
        "moe_intermediate_size", None, experts_aliases=("num_experts",), score_bias=True,
        top_k_key="moe_k", default_tie=True, default_rope_theta=500000.0, default_aux=0.001,
        ernie=True, aliases_win=True,
        default_kv_heads=4,
        required=_COMMON_REQUIRED + (
            ("use_bias", False, "moejax's projections have no bias"),)),
    "glm4_moe": FamilySpec(
        "glm4_moe", "Glm4MoeForCausalLM", "head", "n_routed_experts", "moe_intermediate_size",
        "norm_topk_prob", experts_aliases=("num_local_experts",), renormalize_default=True,
        qkv_bias_key="attention_bias", qk_norm_key="use_qk_norm", partial_rotary=0.5,
        sigmoid_moe=True, default_first_dense=1, default_shared=1, default_aux=0.0,
        aliases_win=True, default_kv_heads=8,
        required=_COMMON_REQUIRED),
    "dots1": FamilySpec(
        "dots1", "Dots1ForCausalLM", "head", "n_routed_experts", "moe_intermediate_size",
        "norm_topk_prob", experts_aliases=("num_local_experts",), default_norm_eps=1e-6,
        sigmoid_moe=True, sliding="from_layer", default_sliding_window=4096, default_aux=0.0,
        aliases_win=True,
        required=_COMMON_REQUIRED + (
            ("attention_bias", False, "moejax attention projections have no bias"),)),
    "deepseek_v2": FamilySpec(
        "deepseek_v2", "DeepseekV2ForCausalLM", "none", "n_routed_experts",
        "moe_intermediate_size", "norm_topk_prob", experts_aliases=("num_experts",),
        default_norm_eps=1e-6, deepseek="v2",
        required=_COMMON_REQUIRED + (
            ("attention_bias", False, "moejax attention projections have no bias"),
            ("mlp_bias", False, "moejax MLPs have no bias"),
            ("norm_topk_prob", False, "transformers' DeepseekV2 never renormalizes the top-k "
             "weights"),
            ("scoring_func", "softmax", "DeepSeek-V2 routes with a softmax"),
            ("moe_layer_freq", 1, "transformers' DeepseekV2 puts experts in every layer after "
             "first_k_dense_replace"))),
    "deepseek_v3": FamilySpec(
        "deepseek_v3", "DeepseekV3ForCausalLM", "none", "n_routed_experts",
        "moe_intermediate_size", "norm_topk_prob", experts_aliases=("num_local_experts",),
        default_norm_eps=1e-6, deepseek="v3", renormalize_default=True, default_aux=0.0,
        aliases_win=True,
        required=_COMMON_REQUIRED + (
            ("attention_bias", False, "moejax attention projections have no bias"),
            ("rope_interleave", True, "moejax reads DeepSeek's rotary dimensions interleaved"))),
    "deepseek_v32": FamilySpec(
        "deepseek_v32", "DeepseekV32ForCausalLM", "none", "n_routed_experts",
        "moe_intermediate_size", "norm_topk_prob", experts_aliases=("num_local_experts",),
        default_norm_eps=1e-6, deepseek="v3", renormalize_default=True, default_aux=0.0,
        deepseek_defaults=(("n_shared_experts", 1),), layer_types_key="mlp_layer_types",
        layer_types_fallback=True, default_first_dense=3, dsa=(2048, 64, 128), aliases_win=True,
        field_aliases=(("num_experts", "n_routed_experts"),),     # its __post_init__'s
        required=_COMMON_REQUIRED + (
            ("attention_bias", False, "moejax attention projections have no bias"),
            ("mlp_bias", False, "moejax MLPs have no bias"))),
    "glm_moe_dsa": FamilySpec(
        "glm_moe_dsa", "GlmMoeDsaForCausalLM", "none", "n_routed_experts",
        "moe_intermediate_size", "norm_topk_prob", experts_aliases=("num_local_experts",),
        deepseek="v3", renormalize_default=True, default_aux=0.0,
        deepseek_defaults=(("n_shared_experts", 1), ("q_lora_rank", 2048), ("n_group", 1),
                           ("topk_group", 1)),
        layer_types_key="mlp_layer_types", layer_types_fallback=True, default_first_dense=3,
        dsa=(2048, 32, 128), dsa_interleaved=True, aliases_win=True,
        field_aliases=(("num_experts", "n_routed_experts"),),
        required=_COMMON_REQUIRED + (
            ("attention_bias", False, "moejax attention projections have no bias"),
            ("mlp_bias", False, "moejax MLPs have no bias"))),
    "glm4_moe_lite": FamilySpec(
        "glm4_moe_lite", "Glm4MoeLiteForCausalLM", "none", "n_routed_experts",
        "moe_intermediate_size", "norm_topk_prob", experts_aliases=("num_local_experts",),
        deepseek="v3", renormalize_default=True, default_aux=0.0,
        deepseek_defaults=(("q_lora_rank", 768), ("n_group", 1), ("topk_group", 1),
                           ("routed_scaling_factor", 1.8), ("n_shared_experts", 1)),
        layer_types_key="mlp_layer_types",
        aliases_win=True,
        required=_COMMON_REQUIRED + (
            ("attention_bias", False, "moejax attention projections have no bias"),
            ("rope_interleave", True, "moejax reads latent attention's rotary dimensions "
             "interleaved"))),
    "solar_open": FamilySpec(
        "solar_open", "SolarOpenForCausalLM", "none", "n_routed_experts", "moe_intermediate_size",
        "norm_topk_prob", experts_aliases=("num_local_experts",), renormalize_default=True,
        qkv_bias_key="attention_bias", sigmoid_moe=True, default_shared=1, default_aux=0.0,
        default_rope_theta=1e6, default_head_dim=128, all_moe=True,
        aliases_win=True, default_kv_heads=8,
        required=_COMMON_REQUIRED),
    "minicpm5_moe": FamilySpec(
        "minicpm5_moe", "MiniCPM5MoeForCausalLM", "none", "n_routed_experts",
        "moe_intermediate_size", "norm_topk_prob", experts_aliases=("num_local_experts",),
        renormalize_default=True, default_norm_eps=1e-6, default_rope_theta=5e6,
        sigmoid_moe=True, default_first_dense=1, default_shared=1, default_aux=0.0,
        default_routed_scale=3.66, default_head_dim=128, default_kv_heads=2,
        layer_types_key="mlp_layer_types",
        layer_types_fallback=True, attention_gate=True, aliases_win=True,
        required=_COMMON_REQUIRED + (
            ("attention_bias", False, "moejax attention projections have no bias (MiniCPM5's "
             "would bias the output projection too)"),
            ("use_gated_attention", True, "transformers' MiniCPM5-MoE always gates its "
             "attention"))),
    "hy_v3": FamilySpec(
        "hy_v3", "HYV3ForCausalLM", "head", "num_experts", "moe_intermediate_size", None,
        experts_aliases=("num_local_experts",), default_rope_theta=11158840.0,
        default_head_dim=128, default_kv_heads=8, sigmoid_moe=True, default_shared=1,
        default_aux=0.0, shared_key="num_shared_experts", routed_scale_key="router_scaling_factor",
        default_routed_scale=2.826, expert_groups=False, layer_types_key="mlp_layer_types",
        aliases_win=True,
        required=_COMMON_REQUIRED + (
            ("attention_bias", False, "moejax attention projections have no bias"),
            ("mlp_bias", False, "moejax MLPs have no bias"))),
    "exaone_moe": FamilySpec(
        "exaone_moe", "ExaoneMoeForCausalLM", "head", "num_experts", "moe_intermediate_size",
        "norm_topk_prob", renormalize_default=True, sigmoid_moe=True, default_first_dense=1,
        default_shared=1, default_aux=0.0, shared_key="num_shared_experts",
        default_routed_scale=2.5, layer_types_key="mlp_layer_types", layer_types_fallback=True,
        default_kv_heads=32, sliding="exaone", default_sliding_window=4096,
        required=_COMMON_REQUIRED),
    "granitemoe": FamilySpec(
        "granitemoe", "GraniteMoeForCausalLM", "none", "num_local_experts", "intermediate_size",
        None, default_norm_eps=1e-6, default_aux=0.001, granite="moe",
        required=_COMMON_REQUIRED + (
            ("attention_bias", False, "moejax attention projections have no bias"),)),
    "granitemoeshared": FamilySpec(
        "granitemoeshared", "GraniteMoeSharedForCausalLM", "none", "num_local_experts",
        "intermediate_size", None, default_norm_eps=1e-6, default_aux=0.001, granite="shared",
        required=_COMMON_REQUIRED + (
            ("attention_bias", False, "moejax attention projections have no bias"),)),
    "sarvam_moe": _glm_named("sarvam_moe", default_rope_theta=8e6, default_kv_heads=4,
                             default_shared=1),
    "param2moe": _glm_named("param2moe", default_rope_theta=5e5, default_kv_heads=8,
                            default_shared=2, default_tie=True),
    "flex_olmo": FamilySpec(
        "flex_olmo", "FlexOlmoForCausalLM", "full", "num_experts", "intermediate_size",
        "norm_topk_prob", experts_aliases=("num_local_experts",), aliases_win=True,
        default_rope_theta=500000.0, default_norm_eps=1e-6, default_aux=0.01,
        norm_position="post",
        required=_COMMON_REQUIRED + (
            ("attention_bias", False, "moejax attention projections have no bias"),)),
    "hunyuan_v1_moe": FamilySpec(
        "hunyuan_v1_moe", "HunYuanMoEV1ForCausalLM", "head", "num_experts", "intermediate_size",
        None, top_k_key="moe_topk", default_aux=0.0, hunyuan=True,
        layer_lists=("num_experts", "moe_topk", "num_shared_expert", "moe_intermediate_size"),
        required=_COMMON_REQUIRED + (
            ("attention_bias", False, "moejax attention projections have no bias"),
            ("use_qk_norm", True, "transformers' HunYuan always normalizes q and k"),
            ("use_cla", False, "moejax has no cross-layer attention"),
            ("use_mixed_mlp_moe", True, "transformers' HunYuan always adds its shared MLP"))),
    "afmoe": FamilySpec(
        "afmoe", "AfmoeForCausalLM", "head", "num_experts", "moe_intermediate_size", None,
        default_head_dim=128, sigmoid_moe=True, default_first_dense=1, default_shared=2,
        default_aux=0.0, shared_key="num_shared_experts", routed_scale_key="route_scale",
        expert_groups=False, first_dense_key="num_dense_layers", attention_gate=True,
        attention_gate_own=True, norm_position="sandwich", sliding="afmoe",
        default_sliding_window=1024, mup=True,
        required=_COMMON_REQUIRED + (
            ("attention_bias", False, "moejax attention projections have no bias"),)),
    "granitemoe_swa": FamilySpec(
        "granitemoe_swa", "GraniteMoeSWAForCausalLM", "none", "num_local_experts",
        "intermediate_size", None, default_norm_eps=1e-6, default_aux=0.001, granite="shared",
        sliding="granite_swa", default_sliding_window=128, attention_sinks=True,
        layer_thetas=True,
        required=_COMMON_REQUIRED + (
            ("attention_bias", False, "moejax attention projections have no bias"),)),
    "flint": FamilySpec(
        "flint", "FlintForCausalLM", "head", "num_experts", "moe_intermediate_size",
        "norm_topk_prob", renormalize_default=True, shared_expert=True, shared_gate=False,
        default_norm_eps=1e-6, default_head_dim=128, default_kv_heads=4, default_aux=0.0005,
        dense_pattern=True, default_mlp_only=(0, 1), score="sigmoid", sliding="flint",
        default_sliding_window=513, attention_sinks=True, router_float32=True,
        required=_COMMON_REQUIRED + (
            ("attention_bias", False, "moejax attention projections have no bias"),)),
    "kolibri1": FamilySpec(
        "kolibri1", "Kolibri1ForCausalLM", "head", "num_local_experts", "moe_intermediate_size",
        "norm_topk_prob", experts_aliases=("num_experts",), aliases_win=True, shared_expert=True, shared_gate=False, score="sigmoid",
        score_bias=True, bias_on_logits=True, default_norm_eps=1e-6, default_head_dim=128,
        default_kv_heads=4, default_aux=0.0, norm_position="sandwich", sliding="kolibri",
        default_sliding_window=513,
        required=_COMMON_REQUIRED),
    "mellum": FamilySpec(
        "mellum", "MellumForCausalLM", "head", "num_local_experts", "moe_intermediate_size",
        "norm_topk_prob", experts_aliases=("num_experts",), aliases_win=True,
        renormalize_default=True, default_norm_eps=1e-6, default_head_dim=128,
        default_kv_heads=4, default_aux=0.001, layer_types_key="mlp_layer_types",
        first_dense_default=0, sliding="listed", default_sliding_window=1024,
        rope_per_type=True,
        required=_COMMON_REQUIRED + (
            ("attention_bias", False, "moejax attention projections have no bias"),)),
    "gpt_oss": FamilySpec(
        "gpt_oss", "GptOssForCausalLM", "none", "num_local_experts", "intermediate_size", None,
        experts_aliases=("num_experts",), aliases_win=True, default_rope_theta=150000.0,
        default_head_dim=64, default_kv_heads=8, default_aux=0.001,
        qkv_bias_key="attention_bias", qkv_bias_default=True, sliding="gpt_oss",
        default_sliding_window=128, attention_sinks=True, gpt_oss=True,
        default_rope=(("rope_type", "yarn"), ("factor", 32.0), ("beta_fast", 32.0),
                      ("beta_slow", 1.0), ("truncate", False),
                      ("original_max_position_embeddings", 4096)),
        required=_COMMON_REQUIRED),
    "cohere2_moe": FamilySpec(
        "cohere2_moe", "Cohere2MoeForCausalLM", "none", "num_experts", "intermediate_size",
        "norm_topk_prob", renormalize_default=True, default_head_dim=128, default_tie=True,
        qkv_bias_key="attention_bias", layer_types_key="mlp_layer_types",
        layer_types_fallback=True, first_dense_default=0, norm_position="parallel",
        sliding="cohere", default_sliding_window=4096, cohere=True,
        required=_COMMON_REQUIRED),
    "qwen3_next": FamilySpec(
        "qwen3_next", "Qwen3NextForCausalLM", "head", "num_experts", "moe_intermediate_size",
        "norm_topk_prob", renormalize_default=True, shared_expert=True, dense_pattern=True,
        default_norm_eps=1e-6, default_head_dim=256, default_kv_heads=2, default_aux=0.001,
        partial_rotary=0.25, attention_gate=True, linear="gated_deltanet",
        required=_COMMON_REQUIRED + (
            ("attention_bias", False, "moejax attention projections have no bias"),)),
    "qwen3_5_moe": FamilySpec(
        "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", "head", "num_experts",
        "moe_intermediate_size", None, shared_expert=True, all_moe=True, default_norm_eps=1e-6,
        default_head_dim=256, default_kv_heads=2, default_aux=0.001, partial_rotary=0.25,
        attention_gate=True, linear="gated_deltanet",
        required=_COMMON_REQUIRED + (
            ("attention_bias", False, "moejax attention projections have no bias"),)),
    "granitemoehybrid": FamilySpec(
        "granitemoehybrid", "GraniteMoeHybridForCausalLM", "none", "num_local_experts",
        "intermediate_size", None, default_norm_eps=1e-6, default_aux=0.001, granite="shared",
        linear="mamba2",
        required=_COMMON_REQUIRED + (
            ("attention_bias", False, "moejax attention projections have no bias"),
            ("mamba_conv_bias", True, "moejax's Mamba-2 convolution has a bias"),
            ("mamba_proj_bias", False, "moejax's Mamba-2 projections have no bias"))),
    "llama4": FamilySpec(
        "llama4_text", "Llama4ForCausalLM", "l2", "num_local_experts", "intermediate_size", None,
        default_rope_theta=500000.0, default_head_dim=128, default_kv_heads=8, default_aux=0.001,
        qkv_bias_key="attention_bias", qk_norm_key="use_qk_norm", qk_norm_default=True,
        score="sigmoid", llama4=True, default_top_k=1,
        required=_COMMON_REQUIRED),
}
assert tuple(FAMILY_SPECS) == FAMILIES
MODEL_TYPES = {spec.model_type: name for name, spec in FAMILY_SPECS.items()}
# model_type values of checkpoints published with another family's architecture under their own
# name: Kimi-K2 is DeepSeek-V3's (its README's advice for frameworks without "kimi_k2": read it
# as "deepseek_v3"). Exports write the family's own model_type.
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}
@dataclasses.dataclass(frozen=True)
class TextWrapper:
  """A multimodal config whose text model is a family's: the text_config's model_type (and the
  other names its text_config may carry for it), the text model's fields transformers takes
  from the outer config (with their defaults there), the text config class's defaults where
  they differ from the family's (set where absent), fields that hold one value whatever the
  config says (set), RoPE keys that change nothing for text, and where the checkpoint keeps the
  text model's tensors (`hf_names.TextLayout`); `in_out_experts`: its fused experts may be held
  [in, out] (told apart by shape, as transformers reads them)."""
  text_model_type: str
  outer_fields: tuple = ()
  text_model_types: tuple = ()
  either_fields: tuple = ()       # booleans true if the outer config or the text_config says so
  text_defaults: tuple = ()
  fixed_fields: tuple = ()
  text_rope_keys: tuple = ()
  layout: TextLayout = TextLayout(outer="language_model.")
  in_out_experts: bool = False


# Multimodal configs by model_type. Llama 4's published checkpoints are
# Llama4ForConditionalGeneration; Kimi-K2.5's (and K2.6's) KimiK25ForConditionalGeneration, a
# DeepSeek-V3 text model (text_config model_type kimi_k2) whose LM head transformers ties by the
# outer tie_word_embeddings (default true), not the text_config's. Qwen3-VL-MoE's
# (Qwen3VLMoeForConditionalGeneration) text model is Qwen3-MoE's: its router always
# renormalizes the top-k (no norm_topk_prob), its LM head tied by the outer config (default
# false), its multimodal RoPE (mrope_section) plain RoPE for text, whose three position ids are
# equal; its tensors under model.language_model. (`hf_names.TextLayout`), lm_head beside it.
# GLM-4.5V's and GLM-4.6V's (Glm4vMoeForConditionalGeneration) is GLM-4.5's, laid out as Qwen3-VL's.
# Qwen3.5-MoE's (below) is its own family's.
TEXT_CONFIG_WRAPPERS = {
    "llama4": TextWrapper("llama4_text"),
    "kimi_k25": TextWrapper("deepseek_v3", outer_fields=(("tie_word_embeddings", True),)),
    "qwen3_vl_moe": TextWrapper(
        "qwen3_moe", outer_fields=(("tie_word_embeddings", False),),
        text_model_types=("qwen3_vl_moe_text",),
        # Qwen3VLMoeTextConfig's defaults where Qwen3MoeConfig's differ
        text_defaults=(("num_attention_heads", 16), ("num_key_value_heads", 16),
                       ("num_experts", 60), ("num_experts_per_tok", 4),
                       ("moe_intermediate_size", 1408), ("intermediate_size", 5632),
                       ("max_position_embeddings", 128000), ("rope_theta", 500000.0)),
        fixed_fields=(("norm_topk_prob", True),),
        text_rope_keys=("mrope_section", "mrope_interleaved"),
        layout=TextLayout(inner="language_model."), in_out_experts=True),
    "glm4v_moe": TextWrapper(
        "glm4_moe", outer_fields=(("tie_word_embeddings", False),),
        text_model_types=("glm4v_moe_text",),
        # Glm4vMoeTextConfig's defaults where Glm4MoeConfig's differ
        text_defaults=(("attention_bias", True), ("vocab_size", 151424),
                       ("max_position_embeddings", 65536), ("router_aux_loss_coef", 0.0001)),
        fixed_fields=(("use_qk_norm", False),),
        text_rope_keys=("mrope_section",),
        # transformers 5 ties the head when an older save says so inside text_config
        either_fields=("tie_word_embeddings",),
        layout=TextLayout(inner="language_model.")),
    # Qwen3.5-MoE's (Qwen3_5MoeForConditionalGeneration): its own text model, laid out as
    # Qwen3-VL's, its interleaved multimodal RoPE plain for text
    "qwen3_5_moe": TextWrapper(
        "qwen3_5_moe_text", outer_fields=(("tie_word_embeddings", False),),
        text_rope_keys=("mrope_section", "mrope_interleaved"),
        layout=TextLayout(inner="language_model.")),
}


def text_wrapper(hf) -> TextWrapper | None:
  """The `TextWrapper` of a multimodal config.json (None for a text model's own)."""
  return TEXT_CONFIG_WRAPPERS.get(hf.get("model_type")) if isinstance(hf, dict) else None


def text_model_config(hf, where: str = "config.json"):
  """The config.json of the text model: `hf` itself, or the text_config of a multimodal config
  (`TEXT_CONFIG_WRAPPERS`), with the outer quantization_config where it has none."""
  wrapper = text_wrapper(hf)
  if wrapper is None:
    return hf
  text = hf.get("text_config")
  want = wrapper.text_model_type
  if not isinstance(text, dict):
    raise CheckpointError(f"{where}: model_type={hf['model_type']!r} needs text_config, the "
                          f"{want} config of its text model (got {text!r})")
  text = dict(text)
  given = text.setdefault("model_type", want)
  if given in wrapper.text_model_types:
    text["model_type"] = want
  elif canonical_model_type(given) != want:
    names = " or ".join(repr(t) for t in (want, *wrapper.text_model_types))
    raise CheckpointError(f"{where}: text_config.model_type={given!r}; a "
                          f"{hf['model_type']} config's text model is {names}")
  if "quantization_config" in hf:
    text.setdefault("quantization_config", hf["quantization_config"])
  for field, default in wrapper.outer_fields:
    text[field] = hf.get(field, default) or (
        field in wrapper.either_fields and text.get(field) is True)
  rope, _ = _rope_dict(text)
  for field, default in wrapper.text_defaults:
    if not (field == "rope_theta" and isinstance(rope, dict) and "rope_theta" in rope):
      text.setdefault(field, default)
  text.update(wrapper.fixed_fields)
  for key in ("rope_scaling", "rope_parameters"):
    if isinstance(text.get(key), dict) and wrapper.text_rope_keys:
      text[key] = {k: v for k, v in text[key].items() if k not in wrapper.text_rope_keys}
  return text


def canonical_model_type(model_type):
  """The family's model_type a config.json's `model_type` stands for (itself unless aliased)."""
  return MODEL_TYPE_ALIASES.get(model_type, model_type) if isinstance(model_type, str) else (
      model_type)


def _get(hf: dict, key: str, kind, where: str, default=None):
  value = hf.get(key, default)
  if value is None:
    state = "null" if key in hf else "missing"
    raise CheckpointError(f"{where}: field {key!r} is {state} (expected "
                          f"{getattr(kind, '__name__', kind)})")
  ok = (isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float
        else isinstance(value, kind) and not (kind is int and isinstance(value, bool)))
  if not ok:
    raise CheckpointError(f"{where}: {key}={value!r} should be {getattr(kind, '__name__', kind)}")
  return float(value) if kind is float else value


def _refuse(where: str, key: str, value, why: str):
  raise CheckpointError(f"{where}: {key}={value!r} is not supported: {why}")


# model.rope_* field -> its key in transformers' rope dict (factor and the original context
# apart), and the field's default
_YARN_KEYS = dict(rope_beta_fast="beta_fast", rope_beta_slow="beta_slow", rope_mscale="mscale",
                  rope_mscale_all_dim="mscale_all_dim",
                  rope_attention_factor="attention_factor", rope_truncate="truncate")
_YARN_DEFAULTS = {field: getattr(ModelConfig(), field) for field in _YARN_KEYS}
_LLAMA3_KEYS = dict(rope_low_freq_factor="low_freq_factor",
                    rope_high_freq_factor="high_freq_factor")
_LLAMA3_DEFAULTS = {field: getattr(ModelConfig(), field) for field in _LLAMA3_KEYS}


def _rope_dict(hf: dict) -> tuple:
  """(the RoPE dict transformers reads, its key): rope_scaling wins over rope_parameters (a
  transformers 5 config with YaRN added by hand under rope_scaling runs YaRN)."""
  for key in ("rope_scaling", "rope_parameters"):
    if hf.get(key):
      return hf[key], key
  return None, "rope_scaling"


def _rope(hf: dict, where: str, default_theta: float, alpha_head_dim: int = 0) -> dict:
  """model.rope_theta and the rope_* fields from rope_theta and rope_scaling (transformers < 5,
  the Hub's configs) or rope_parameters (transformers >= 5), as transformers reads them.
  `alpha_head_dim` > 0: "dynamic" with a fixed `alpha` is Hunyuan's NTK-alpha RoPE, whose
  frequencies are plain RoPE's of base theta * alpha^(d / (d - 2)), d that head width."""
  rope, key = _rope_dict(hf)
  theta = hf.get("rope_theta", default_theta)
  fields = dict(rope_scaling="none", rope_factor=1.0, rope_original_max_len=0, **_YARN_DEFAULTS,
                **_LLAMA3_DEFAULTS)
  if rope is not None:
    if not isinstance(rope, dict):
      _refuse(where, key, rope, "expected a dict with rope_type and rope_theta")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    alpha = rope.get("alpha") if alpha_head_dim and rope_type == "dynamic" else None
    if alpha is not None:
      if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        _refuse(where, f"{key}.alpha", alpha, "expected a positive number")
    elif rope_type not in ("default", "yarn", "llama3"):
      _refuse(where, f"{key}.rope_type", rope_type,
              "moejax implements plain (default) RoPE, yarn and llama3 only")
    theta = rope.get("rope_theta", theta)
    if alpha is not None:    # Hunyuan's NTK-alpha: plain RoPE of a stretched base
      theta = theta * alpha ** (alpha_head_dim / (alpha_head_dim - 2))
    if rope_type == "yarn":
      fields.update(_yarn(hf, rope, f"{where}: {key}"))
    if rope_type == "llama3":
      fields.update(_llama3(rope, f"{where}: {key}", hf.get("max_position_embeddings")))
  if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
    _refuse(where, "rope_theta", theta, "expected a positive number")
  return dict(fields, rope_theta=float(theta))


# Mellum's config class defaults, per layer type
_TYPED_ROPE_DEFAULTS = {"full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}


def _typed_rope(hf: dict, where: str, sliding_layers: tuple, layers: int) -> dict:
  """model.rope_* and sliding_rope_theta from a rope_parameters of one RoPE dict per layer
  type (Mellum's): the full layers' RoPE as `_rope` reads it (plain, YaRN or Llama 3's), the sliding
  layers' plain RoPE of its own base. transformers reads only the types layer_types uses, and
  rotates whole heads (a partial factor would not broadcast)."""
  if hf.get("rope_scaling"):
    _refuse(where, "rope_scaling", hf["rope_scaling"], "this family reads rope_parameters, one "
            "RoPE dict per layer type")
  rope = hf.get("rope_parameters")
  rope = _TYPED_ROPE_DEFAULTS if rope is None else rope
  if not isinstance(rope, dict) or not all(isinstance(rope.get(t), dict) for t in (
      _ATTENTION_TYPES[1] if i in sliding_layers else _ATTENTION_TYPES[0]
      for i in range(layers))):
    _refuse(where, "rope_parameters", rope, "expected one RoPE dict for each layer type "
            "layer_types uses ('full_attention', 'sliding_attention')")
  for kind, params in rope.items():
    if isinstance(params, dict) and params.get("partial_rotary_factor", 1.0) != 1.0:
      _refuse(where, f"rope_parameters.{kind}.partial_rotary_factor",
              params["partial_rotary_factor"], "transformers rotates whole heads here (needs "
              "1.0)")
  # transformers reads YaRN's original context from the type's dict (else
  # max_position_embeddings, never the top-level field) and its truncate from the outer dict,
  # which has none: always on
  outer = {k: v for k, v in hf.items() if k != "original_max_position_embeddings"}

  def read(kind: str) -> dict:     # (no layer of an absent kind: its class default, unused)
    params = rope.get(kind) if isinstance(rope.get(kind), dict) else _TYPED_ROPE_DEFAULTS[kind]
    params = {k: v for k, v in params.items() if k != "truncate"}
    return _rope(dict(outer, rope_parameters=params, rope_theta=None), f"{where}: {kind}", 1.0)

  fields = read("full_attention")
  if not sliding_layers:
    return dict(fields, sliding_rope_theta=0.0)
  local = read("sliding_attention")
  if local == fields:            # one RoPE for all
    return dict(fields, sliding_rope_theta=0.0)
  if local["rope_scaling"] != "none":
    _refuse(where, "rope_parameters.sliding_attention.rope_type", "yarn", "moejax's sliding "
            "layers take the full layers' RoPE or plain RoPE of their own base "
            "(model.sliding_rope_theta)")
  return dict(fields, sliding_rope_theta=local["rope_theta"])


def _rotary_dim(hf: dict, spec: FamilySpec, head_dim: int, where: str) -> int:
  """model.rotary_dim from partial_rotary_factor (the rope dict's, else the top-level one, as
  transformers' standardize_rope_params takes them; else the architecture's default)."""
  rope, _ = _rope_dict(hf)
  rope = rope if isinstance(rope, dict) else {}
  key = "partial_rotary_factor"
  if key in rope:
    factor = rope[key]
  elif key in hf:
    factor = hf[key]
  elif spec.rotary_dim_key and hf.get(spec.rotary_dim_key) is not None:
    width = _get(hf, spec.rotary_dim_key, int, where)
    factor = width / head_dim
  else:       # Glm4MoeConfig's default when the field is absent (null is no factor: 1)
    factor = spec.partial_rotary
  factor = 1.0 if factor is None else factor
  if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
    _refuse(where, "partial_rotary_factor", factor, "expected a number in (0, 1]")
  if factor != 1.0 and spec.partial_rotary is None:
    _refuse(where, "partial_rotary_factor", factor,
            f"{spec.architecture} rotates whole heads (needs 1.0)")
  dim = int(head_dim * factor)
  if dim % 2 or dim == 0:
    _refuse(where, "partial_rotary_factor", factor,
            f"rotates {dim} of head_dim={head_dim} dims; moejax rotates pairs (an even width)")
  return 0 if dim == head_dim else dim


def _partial_rotary_factor(m) -> float:
  """The factor transformers reads back as `m`'s rotated width: it takes int(head_dim * factor),
  and rotary_dim / head_dim can land just below a whole number (58 / 100 * 100 = 57.999...)."""
  width = m.rotary_dim or m.head_dim
  factor = width / m.head_dim
  while int(m.head_dim * factor) < width:
    factor = math.nextafter(factor, math.inf)
  return factor


def _yarn(hf: dict, rope: dict, where: str) -> dict:
  # transformers' rule: a top-level original_max_position_embeddings wins, then the rope dict's,
  # then max_position_embeddings; factor null means max_position_embeddings / original.
  original = hf.get("original_max_position_embeddings") or rope.get(
      "original_max_position_embeddings") or hf.get("max_position_embeddings")
  if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
    raise CheckpointError(f"{where}: yarn needs original_max_position_embeddings, a positive "
                          f"integer (got {original!r})")
  factor = rope.get("factor")
  if factor is None and isinstance(hf.get("max_position_embeddings"), int):
    factor = hf["max_position_embeddings"] / original
  if isinstance(factor, bool) or not isinstance(factor, (int, float)):
    raise CheckpointError(f"{where}: yarn's factor={factor!r} should be a number")
  fields = dict(rope_scaling="yarn", rope_factor=float(factor), rope_original_max_len=original)
  for field, key in _YARN_KEYS.items():
    value = rope.get(key)
    if field in ("rope_beta_fast", "rope_beta_slow"):
      value = value or None      # transformers: `get("beta_fast") or 32`
    if field == "rope_truncate" and key in rope and value is None:
      value = False              # transformers: `get("truncate", True)` tests a null as false
    if value is None:
      continue
    kind = bool if field == "rope_truncate" else float
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
      raise CheckpointError(f"{where}: {key}={value!r} should be a number")
    if kind is bool and not isinstance(value, bool):
      raise CheckpointError(f"{where}: {key}={value!r} should be true or false")
    fields[field] = kind(value)
  return fields


def _llama3(rope: dict, where: str, max_positions=None) -> dict:
  """Llama 3's scaling from its rope dict: every key transformers reads, which it requires."""
  fields = dict(rope_scaling="llama3")
  for field, key in (("rope_factor", "factor"),
                     ("rope_original_max_len", "original_max_position_embeddings"),
                     *_LLAMA3_KEYS.items()):
    value = rope.get(key)
    if field == "rope_original_max_len" and value is None:   # transformers' fallback
      value = max_positions
    kind = int if field == "rope_original_max_len" else float
    if (isinstance(value, bool) or not isinstance(value, (int, float))
        or (kind is int and not isinstance(value, int)) or value <= 0):
      raise CheckpointError(f"{where}: llama3 needs {key}, a positive "
                            f"{'integer' if kind is int else 'number'} (got {value!r})")
    fields[field] = kind(value)
  return fields


def _rope_to_hf(m) -> dict:
  """The rope dict of `m`'s RoPE (transformers' keys; rope_theta left to the caller)."""
  if m.rope_scaling == "none":
    return {"rope_type": "default"}
  out = {"rope_type": m.rope_scaling, "factor": m.rope_factor,
         "original_max_position_embeddings": m.rope_original_max_len}
  if m.rope_scaling == "llama3":
    return dict(out, **{key: getattr(m, field) for field, key in _LLAMA3_KEYS.items()})
  for field, key in _YARN_KEYS.items():
    if getattr(m, field) != _YARN_DEFAULTS[field] or field.startswith("rope_beta"):
      out[key] = getattr(m, field)
  return out


def _rope_scaling_field(m, rope: dict):
  """config.json's rope_scaling for `m`'s RoPE dict: null without scaling (transformers < 5's
  field, which a config class's default YaRN would not fill where it is given)."""
  if m.rope_scaling == "none":
    return None
  return {k: v for k, v in rope.items() if k != "partial_rotary_factor"}


def family_of(hf: dict, where: str = "config.json") -> FamilySpec:
  if not isinstance(hf, dict):
    raise CheckpointError(f"{where}: expected a JSON object")
  model_type = canonical_model_type(hf.get("model_type"))
  if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
    valid = ", ".join([f"{s.model_type!r} ({s.architecture})" for s in FAMILY_SPECS.values()]
                      + [f"{k!r} (as {v!r})" for k, v in MODEL_TYPE_ALIASES.items()]
                      + [f"{k!r} (its text_config, {w.text_model_type!r})"
                         for k, w in TEXT_CONFIG_WRAPPERS.items()])
    raise CheckpointError(f"{where}: model_type={model_type!r} cannot be converted (valid: "
                          f"{valid})")
  return FAMILY_SPECS[MODEL_TYPES[model_type]]


def _kv_heads(hf: dict, spec: FamilySpec, heads: int):
  """num_key_value_heads as transformers reads it: absent, the config class's default; null (or
  the class's default None), as many as the query heads."""
  kv_heads = hf["num_key_value_heads"] if "num_key_value_heads" in hf else spec.default_kv_heads
  return kv_heads or heads


def _head_dim(hf: dict, spec: FamilySpec, where: str) -> int:
  if spec.deepseek:      # latent attention: each head's q.k width; head_dim, if any, is Dr
    return _get(hf, "qk_nope_head_dim", int, where) + _get(hf, "qk_rope_head_dim", int, where)
  heads = _get(hf, "num_attention_heads", int, where)
  hidden = _get(hf, "hidden_size", int, where)
  # absent: the config class's default; null: hidden / heads, as the attention reads it
  head_dim = hf["head_dim"] if "head_dim" in hf else spec.default_head_dim
  if spec.norm_over_hidden and head_dim is not None and head_dim * heads != hidden:
    _refuse(where, "head_dim", head_dim,
            f"OLMoE normalizes q over hidden_size={hidden}, so num_attention_heads * head_dim "
            f"must equal it ({heads} * {head_dim} = {heads * head_dim})")
  if head_dim is None and hidden % heads:
    _refuse(where, "hidden_size", hidden, f"not divisible by num_attention_heads={heads}")
  return head_dim or hidden // heads


FP8_DEFAULT_BLOCK = (128, 128)      # transformers' FineGrainedFP8Config weight_block_size
_FP8_FORMATS = (None, "e4m3", "float8_e4m3fn")
# compressed-tensors' weight strategies -> the block one scale covers (0: a whole dimension)
_CT_BLOCKS = {"tensor": lambda w: (0, 0), "channel": lambda w: (1, 0),
              "group": lambda w: (1, w.get("group_size")),
              "block": lambda w: tuple(w.get("block_structure") or ())}


def _positive_pair(block) -> bool:
  return (isinstance(block, (list, tuple)) and len(block) == 2
          and all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in block))


def _per(block: tuple[int, int]) -> str:
  """What one scale covers, in words (`quantization_summary`)."""
  rows, cols = block
  if (rows, cols) == (0, 0):
    return "one scale per tensor"
  if rows == 1:
    return {0: "per row", 1: "per value"}.get(cols, f"per {cols} columns of a row")
  return f"in {rows} x {cols} blocks"


def weight_scales(hf: dict, where: str = "config.json") -> WeightScales | None:
  """How the quantized weights of a checkpoint carry their scales, None for an unquantized one:
  gpt-oss's MXFP4 experts (quant_method "mxfp4": FP4 values with a power-of-two scale per 32,
  `safetensors_io.MXFP4_SCALES`), transformers' fine-grained FP8 (quant_method "fp8":
  DeepSeek-V3, Qwen3-*-FP8, MiniMax-M2), or
  compressed-tensors' float-quantized (8-bit float) and pack-quantized (symmetric 4- or 8-bit
  integer: Kimi-K2-Thinking's experts) formats, per tensor, row, group or block, activations
  quantized dynamically or not at all. Every other quantization is refused: its weights would
  read wrong."""
  q = hf.get("quantization_config")
  if q is None:
    return None
  fix = ("moejax dequantizes FP8, MXFP4 experts and symmetric integer weights only "
         "(quant_method 'fp8', 'mxfp4', or 'compressed-tensors' with format 'float-quantized' "
         "or 'pack-quantized'); dequantize other formats to bfloat16 first")
  method = q.get("quant_method") if isinstance(q, dict) else None
  if method == "mxfp4":        # gpt-oss's experts; the rest of its checkpoint stays bf16
    return MXFP4_SCALES
  if method == "fp8":
    if q.get("fmt") not in _FP8_FORMATS:
      _refuse(where, "quantization_config.fmt", q["fmt"], "moejax reads e4m3 FP8 weights only")
    if q.get("activation_scheme") not in (None, "dynamic"):
      _refuse(where, "quantization_config.activation_scheme", q["activation_scheme"],
              "moejax reads weights with dynamic activation scaling only (no activation scales)")
    block = q["weight_block_size"] if "weight_block_size" in q else FP8_DEFAULT_BLOCK
    if block is None:             # transformers: one scale per tensor
      block = (0, 0)
    elif not _positive_pair(block) or 0 in block:
      _refuse(where, "quantization_config.weight_block_size", block,
              "expected [rows, cols], two positive integers (per-tensor or per-channel FP8 "
              "scales are not read)")
    return WeightScales("_scale_inv", (tuple(block),), summary=f"FP8 {_per(tuple(block))}")
  if method != "compressed-tensors":
    _refuse(where, "quantization_config", q, fix)
  groups = q.get("config_groups")
  if not isinstance(groups, dict) or not groups:
    _refuse(where, "quantization_config.config_groups", groups, "expected the groups of "
            "compressed-tensors' float-quantized or pack-quantized format")
  if q.get("kv_cache_scheme") is not None:
    _refuse(where, "quantization_config.kv_cache_scheme", q["kv_cache_scheme"],
            "moejax reads weights only (no kv-cache scales)")
  for field in ("transform_config", "sparsity_config"):
    value = q.get(field)       # rotated or sparse-compressed weights would read as plain ones
    if value and not (field == "sparsity_config" and isinstance(value, dict)
                      and value.get("format") in (None, "dense")):
      _refuse(where, f"quantization_config.{field}", value, "moejax reads weights stored "
              "as they are used (no rotations, no sparse compression)")
  blocks, int_bits, parts = [], [], []
  for name, group in sorted(groups.items()):
    key = f"quantization_config.config_groups.{name}"
    group = group if isinstance(group, dict) else {}
    fmt = group.get("format", q.get("format"))
    w = group.get("weights") or {}
    if not isinstance(w, dict):
      _refuse(where, f"{key}.weights", w, "expected compressed-tensors' weights scheme (a JSON "
              "object)")
    strategy = w.get("strategy")
    number = (w.get("num_bits"), w.get("type"), w.get("symmetric", True))
    if fmt not in ("float-quantized", "pack-quantized"):
      _refuse(where, f"{key}.format", fmt, fix)
    if (number not in ((8, "float", True),) if fmt == "float-quantized"
        else number not in ((4, "int", True), (8, "int", True))) or strategy not in _CT_BLOCKS:
      _refuse(where, f"{key}.weights", w, "moejax reads symmetric 8-bit float "
              "(float-quantized) or 4- and 8-bit integer (pack-quantized) weights per tensor, "
              f"channel, group or block ({fix})")
    if w.get("actorder") not in (None, False, "static", "weight"):
      _refuse(where, f"{key}.weights.actorder", w["actorder"], "moejax reads weights stored "
              "in their own column order (no activation-order permutation, g_idx)")
    block = _CT_BLOCKS[strategy](w)
    if not _positive_pair(block) or (strategy in ("group", "block") and 0 in block):
      _refuse(where, f"{key}.weights", w, f"strategy {strategy!r} needs its "
              f"{'group_size' if strategy == 'group' else 'block_structure [rows, cols]'}")
    for kind in ("input_activations", "output_activations"):
      act = group.get(kind)
      if act is not None and not (kind == "input_activations" and isinstance(act, dict)
                                  and act.get("dynamic") is True):
        _refuse(where, f"{key}.{kind}", act, "moejax reads weights with dynamic activation "
                "scaling only (no activation scales)")
    if block not in blocks:
      blocks.append(block)
    if fmt == "pack-quantized" and number[0] not in int_bits:
      int_bits.append(number[0])
    part = f"{'INT' if fmt == 'pack-quantized' else 'FP'}{number[0]} {_per(block)}"
    if part not in parts:
      parts.append(part)
  # compressed-tensors dequantizes in the scale's dtype (x_q.to(scale.dtype) * scale): a bf16
  # scale rounds each value to bf16, as transformers' and vLLM's weights then are
  return WeightScales("_scale", tuple(blocks), tuple(int_bits), in_scale_dtype=True,
                      summary=", ".join(parts))


def quantization_summary(hf: dict, where: str = "config.json") -> str | None:
  """How a checkpoint's weights are quantized, in a few words ("FP8 in 128 x 128 blocks",
  "INT4 per 32 columns of a row"), None when they are not; for the lines that say a run or a
  conversion started from dequantized weights."""
  scales = weight_scales(hf, where)
  return scales.summary if scales else None


def _unaliased(hf: dict, spec: FamilySpec, where: str = "config.json") -> dict:
  """`hf` with each `spec.field_aliases` alias given read as its field (the alias's value wins,
  as transformers' attribute_map sets the field from it), and each `spec.layer_lists` field
  given per layer read as its one value."""
  given = {field: hf[alias] for alias, field in spec.field_aliases if alias in hf}
  for key in spec.layer_lists:
    values = hf.get(key)
    if isinstance(values, list):
      if not values or any(v != values[0] for v in values):
        _refuse(where, key, values, "moejax's layers are alike (needs one value for all)")
      given[key] = values[0]
  return dict(hf, **given) if given else hf


def check_supported(hf: dict, where: str = "config.json") -> FamilySpec:
  """The family of `hf`; raises CheckpointError if moejax cannot represent it exactly."""
  hf = text_model_config(hf, where)
  spec = family_of(hf, where)
  hf = _unaliased(hf, spec, where)
  weight_scales(hf, where)
  for key, want, why in spec.required:
    value = hf.get(key, want)
    if key == "mlp_only_layers" and value is None:
      value = []
    if value is None and want is False:     # transformers tests these flags' truth
      value = False
    if isinstance(value, str):
      value = _SAME_AS.get((key, value), value)
    if value != want:
      _refuse(where, key, value, f"{why} (needs {want!r})")
  sliding = _sliding(hf, spec, where)
  attn_types = hf.get("attn_type_list") or []      # MiniMax's: 1 softmax, 0 linear attention
  if any(t != 1 for t in attn_types):
    _refuse(where, "attn_type_list", attn_types, "moejax's layers are all softmax attention "
            "(needs every entry 1)")
  heads = _get(hf, "num_attention_heads", int, where)
  kv_heads = _kv_heads(hf, spec, heads)
  if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or heads % kv_heads:
    _refuse(where, "num_key_value_heads", kv_heads,
            f"must divide num_attention_heads={heads}")
  if spec.deepseek:
    if kv_heads != heads:
      _refuse(where, "num_key_value_heads", kv_heads, f"latent attention has one key per query "
              f"head (needs num_attention_heads={heads})")
    if not hf.get("n_shared_experts", dict(spec.deepseek_defaults).get("n_shared_experts")):
      _refuse(where, "n_shared_experts", hf.get("n_shared_experts"),
              "a positive count is needed (moejax's DeepSeek layers always have shared experts)")
    if spec.deepseek_defaults and hf.get("head_dim") not in (None, hf.get("qk_rope_head_dim")):
      _refuse(where, "head_dim", hf["head_dim"], "transformers reads it as qk_rope_head_dim "
              f"(attribute_map), which is {hf.get('qk_rope_head_dim')!r}")
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
      _get(hf, key, int, where)
  if spec.ernie and _get(hf, "moe_norm_min", float, where, 1e-12) > 1e-12:
    _refuse(where, "moe_norm_min", hf["moe_norm_min"], "moejax divides the top-k weights by "
            "their sum, which transformers' clamp at the published 1e-12 never reaches")
  if spec.sigmoid_moe and _get(hf, spec.shared_key, int, where, spec.default_shared) < 1:
    _refuse(where, spec.shared_key, hf.get(spec.shared_key),
            "a positive count is needed (moejax's layers of this family always have a shared "
            "expert)")
  if spec.shared_expert and not hf.get("shared_expert_intermediate_size"):
    _refuse(where, "shared_expert_intermediate_size", hf.get("shared_expert_intermediate_size"),
            "a positive width is needed (the shared expert is always there)")
  # (DeepSeek: only its refusal of a partial factor; the rotated width is qk_rope_head_dim)
  head_dim = _head_dim(hf, spec, where)
  _rotary_dim(hf, spec, _get(hf, "qk_rope_head_dim", int, where) if spec.deepseek else head_dim,
              where)
  _rope_fields(hf, spec, where, head_dim, sliding["sliding_layers"])
  return spec


def _rope_fields(hf: dict, spec: FamilySpec, where: str, head_dim: int,
                 sliding_layers: tuple) -> dict:
  """model.rope_* (and sliding_rope_theta) of `hf` as its family reads them."""
  if spec.rope_per_type:
    return _typed_rope(hf, where, sliding_layers, _get(hf, "num_hidden_layers", int, where))
  if spec.default_rope and _rope_dict(hf)[0] is None:     # its config class's RoPE
    hf = dict(hf, rope_parameters=dict(spec.default_rope))
  if spec.cohere:     # transformers' Cohere2MoeConfig keeps rope_scaling apart, unread
    hf = {k: v for k, v in hf.items() if k != "rope_scaling"}
  fields = dict(_rope(hf, where, spec.default_rope_theta, head_dim if spec.hunyuan else 0),
                sliding_rope_theta=0.0)
  if spec.deepseek and fields["rope_scaling"] == "llama3":
    _refuse(where, "rope_type", "llama3", "moejax's latent attention takes YaRN's softmax "
            "scale only (DeepSeek's checkpoints scale RoPE by yarn)")
  if spec.layer_thetas:
    fields.update(_layer_thetas(hf, where, sliding_layers, fields))
  return fields


def _layer_thetas(hf: dict, where: str, sliding_layers: tuple, fields: dict) -> dict:
  """model.rope_theta, sliding_rope_theta and nope_layers from layer_rope_theta (Granite SWA:
  each layer's RoPE base, 0 unrotated; absent, the RoPE dict's for all): the full layers' one
  base is the model's, the sliding layers' one base their own (plain RoPE: refused beside a
  scaled one); a kind whose layers differ in base is refused."""
  layers = _get(hf, "num_hidden_layers", int, where)
  thetas = hf.get("layer_rope_theta")
  if thetas is None:
    return {}
  if (not isinstance(thetas, list) or len(thetas) != layers
      or not all(isinstance(t, (int, float)) and not isinstance(t, bool) and t >= 0
                 for t in thetas)):
    _refuse(where, "layer_rope_theta", thetas, f"expected num_hidden_layers={layers} numbers, "
            "each a RoPE base or 0 (unrotated)")
  full = {float(t) for i, t in enumerate(thetas) if t and i not in sliding_layers}
  local = {float(t) for i, t in enumerate(thetas) if t and i in sliding_layers}
  if len(full) > 1 or len(local) > 1:
    _refuse(where, "layer_rope_theta", thetas, "moejax's layers of one kind (sliding or not) "
            "share one RoPE base")
  theta = full.pop() if full else local.pop() if local and not full else fields["rope_theta"]
  local_theta = local.pop() if local else theta
  if local_theta != theta and fields["rope_scaling"] != "none":
    _refuse(where, "layer_rope_theta", thetas, "moejax's sliding layers take the model's RoPE "
            "or plain RoPE of their own base, not a scaled one of their own")
  return dict(rope_theta=theta, sliding_rope_theta=0.0 if local_theta == theta else local_theta,
              nope_layers=tuple(i for i, t in enumerate(thetas) if not t))


_ATTENTION_TYPES = ("full_attention", "sliding_attention")
# Families whose absent layer_types come from every n-th layer attending to all (this field n),
# those full layers unrotated (NoPE): EXAONE-MoE's and AfMoE's.
_PATTERNED = {"exaone": "sliding_window_pattern", "afmoe": "global_attn_every_n_layers"}
# ... and every family whose full layers are unrotated wherever layers slide
_FULL_UNROTATED = (*_PATTERNED, "flint", "kolibri")
# Granite's multipliers: model field -> config.json field (transformers' default 1.0 each; its
# attention_multiplier is the softmax scale itself)
_GRANITE_SCALES = {"embed_scale": "embedding_multiplier", "residual_scale": "residual_multiplier",
                   "attention_scale": "attention_multiplier", "logit_divisor": "logits_scaling"}


def _sliding(hf: dict, spec: FamilySpec, where: str) -> dict:
  """model.sliding_window, sliding_layers and nope_layers as the family's transformers code reads
  sliding_window, layer_types and the family's rule for absent layer_types (`spec.sliding`);
  a sliding layer in a family transformers never slides is refused."""
  layers = _get(hf, "num_hidden_layers", int, where)
  none = dict(sliding_window=0, sliding_layers=(), nope_layers=())
  if spec.llama4 or spec.linear:   # no sliding layer; their layer_types are chunks
    return none                    # (`_llama4_fields`), linear attention (`_linear_fields`)
  types = hf.get("layer_types")
  if spec.dsa:            # every layer's attention indexed (DeepseekV32Config's default)
    if types is not None and types != ["indexed_attention"] * layers:
      _refuse(where, "layer_types", types, f"{spec.architecture} indexes every layer's "
              f"attention (needs num_hidden_layers={layers} 'indexed_attention' entries)")
    return none
  if types is not None and (not isinstance(types, list) or len(types) != layers
                            or not all(t in _ATTENTION_TYPES for t in types)):
    _refuse(where, "layer_types", types, f"expected num_hidden_layers={layers} entries, each "
            "'full_attention' or 'sliding_attention'")
  if not spec.sliding:
    if types and "sliding_attention" in types:
      _refuse(where, "layer_types", "sliding_attention", f"{spec.architecture} attends to the "
              "whole sequence in every layer (needs 'full_attention')")
    return none
  window = hf.get("sliding_window", spec.default_sliding_window)
  if window is None and spec.sliding in _PATTERNED:    # its config class types it int
    _refuse(where, "sliding_window", window, f"{spec.architecture}'s sliding layers need a "
            "number of tokens")
  if window is None:     # no window: every layer attends to all, rotated (Flint's: unrotated)
    return dict(none, nope_layers=tuple(range(layers))) if spec.sliding == "flint" else none
  window = _get(hf, "sliding_window", int, where, spec.default_sliding_window)
  if window < 1:
    _refuse(where, "sliding_window", window, "expected a positive number of tokens or null")
  if spec.sliding == "all":
    sliding = range(layers)
  elif types is not None:
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
  elif spec.sliding == "from_layer":
    sliding = range(_get(hf, "max_window_layers", int, where, 62), layers)
  elif spec.sliding == "listed":      # no list: every layer attends to all
    sliding = ()
  elif spec.sliding == "granite_swa":
    sliding = [i for i in range(layers) if i % 4]
  elif spec.sliding == "flint":
    sliding = [i for i in range(2, layers - 1) if i % 4 != 1]
  elif spec.sliding == "kolibri":
    sliding = [i for i in range(layers) if (i + 1) % 5]
  elif spec.sliding == "gpt_oss":
    sliding = [i for i in range(layers) if i % 2 == 0]
  elif spec.sliding == "cohere":
    sliding = _cohere_sliding(hf, where, layers)
  else:   # EXAONE, AfMoE: transformers derives the list from an integer pattern
    key = _PATTERNED[spec.sliding]
    pattern = _get(hf, key, int, where, 4)
    if pattern < 1:
      _refuse(where, key, pattern, "expected a positive integer")
    sliding = [i for i in range(layers) if (i + 1) % pattern]
  sliding = tuple(sliding)
  nope = (tuple(i for i in range(layers) if i not in sliding)
          if spec.sliding in _FULL_UNROTATED else ())
  return dict(sliding_window=window if sliding else 0, sliding_layers=sliding, nope_layers=nope)


_COHERE_COMBINE = {"sum": 1.0, "average": 0.5}   # shared_expert_combination_strategy -> the
                                                  # routed and shared outputs' scale


def _reciprocal(x: float) -> float:
  """1 / x, or a neighbouring float whose reciprocal is exactly x where 1 / x's is not (so
  logit_scale and model.logit_divisor read back as they were written)."""
  r = 1.0 / x
  exact = [c for c in (r, math.nextafter(r, math.inf), math.nextafter(r, -math.inf))
           if 1.0 / c == x]
  return min(exact, key=lambda c: len(repr(c))) if exact else r   # the shortest: 49.0, not
                                                                  # 49.00000000000001


def _cohere_sliding(hf: dict, where: str, layers: int) -> list[int]:
  """Cohere2-MoE's sliding layers without layer_types: the first first_k_dense_replace layers
  slide but every prefix_dense_sliding_window_pattern-th, the rest but every
  sliding_window_pattern-th (counted from the first of them)."""
  first = _get(hf, "first_k_dense_replace", int, where, 0)
  patterns = []
  for key, default in (("prefix_dense_sliding_window_pattern", 1), ("sliding_window_pattern", 4)):
    n = _get(hf, key, int, where, default)
    if n < 1:
      _refuse(where, key, n, "expected a positive integer")
    patterns.append(n)
  prefix, rest = patterns
  return ([i for i in range(min(first, layers)) if (i + 1) % prefix]
          + [first + i for i in range(layers - first) if (i + 1) % rest])


def _cohere_fields(hf: dict, where: str, sliding_layers: tuple, dense: tuple) -> tuple[dict, dict]:
  """Cohere2-MoE's model and moe fields (`FamilySpec.cohere`)."""
  layers = _get(hf, "num_hidden_layers", int, where)
  rms = hf.get("rms_norm_eps") is not None
  eps = _get(hf, "rms_norm_eps" if rms else "layer_norm_eps", float, where, 1e-5)
  scale = _get(hf, "logit_scale", float, where, 0.0625)
  if not 0 < scale < math.inf:
    _refuse(where, "logit_scale", scale, "expected a positive number")
  prefix = _get(hf, "prefix_dense_sliding_window_pattern", int, where, 1)
  # transformers rotates the sliding layers, and the dense ones where the prefix pattern is 1
  rotated = set(sliding_layers) | (set(dense) if prefix == 1 else set())
  expert_hidden = _get(hf, "intermediate_size", int, where)
  dense_hidden = expert_hidden      # null: the dense MLP as wide as an expert (transformers')
  if hf.get("prefix_dense_intermediate_size") is not None:
    dense_hidden = _get(hf, "prefix_dense_intermediate_size", int, where)
    if dense_hidden < 1:
      _refuse(where, "prefix_dense_intermediate_size", dense_hidden,
              "expected a positive width or null")
  # (a null sliding_window reads as transformers' layers mean it, every layer attending to all,
  # the dense ones rotated by the prefix rule; transformers 5.25 itself cannot run it)
  model = dict(norm_kind="rms" if rms else "layer", norm_eps=eps,
               logit_divisor=_reciprocal(scale),
               rotary_interleaved=True, dense_hidden=dense_hidden if dense else 0,
               nope_layers=tuple(i for i in range(layers) if i not in rotated))
  selection = hf.get("expert_selection_fn", "softmax")
  if selection not in ("softmax", "sigmoid"):
    _refuse(where, "expert_selection_fn", selection, "expected 'softmax' or 'sigmoid'")
  shared = _get(hf, "num_shared_experts", int, where, 0)
  combine = hf.get("shared_expert_combination_strategy", "average")
  if shared and combine not in _COHERE_COMBINE:
    _refuse(where, "shared_expert_combination_strategy", combine, "expected 'sum' or 'average'")
  both = _COHERE_COMBINE[combine] if shared else 1.0
  # a softmax over the top-k logits is the top-k of a softmax renormalized, whatever
  # norm_topk_prob says; sigmoids are renormalized where it says so
  renormalize = selection == "softmax" or _get(hf, "norm_topk_prob", bool, where, True)
  moe = dict(score=selection, renormalize=renormalize, shared_expert_hidden=shared * expert_hidden,
             shared_expert_gate=False, routed_scale=both, shared_expert_scale=both)
  return model, moe


def _layer_list(hf: dict, key: str, where: str, layers: int, valid: tuple):
  """A per-layer list field (an entry per layer, each one of `valid`; transformers reads the
  first `layers` of a longer one), or None where absent, null or empty."""
  values = hf.get(key) or None
  if values is not None and (not isinstance(values, list) or len(values) < layers
                             or not all(v in valid for v in values[:layers])):
    _refuse(where, key, values, f"expected num_hidden_layers={layers} entries, each one of "
            f"{', '.join(map(repr, valid))}")
  return None if values is None else values[:layers]


def _positive(hf: dict, key: str, where: str, default, kind=int):
  value = _get(hf, key, kind, where, default)
  if value <= 0 or (kind is float and not math.isfinite(value)):
    _refuse(where, key, value, "expected a positive number")
  return value


def _llama4_fields(hf: dict, where: str, expert_hidden: int) -> tuple[dict, dict]:
  """Llama 4's model and moe fields (`FamilySpec.llama4`), as transformers' Llama4TextConfig
  fills in what config.json leaves out."""
  layers = _get(hf, "num_hidden_layers", int, where)
  rotated = _layer_list(hf, "no_rope_layers", where, layers, (0, 1))
  if not rotated:       # absent or empty: every no_rope_layer_interval-th layer unrotated
    interval = _positive(hf, "no_rope_layer_interval", where, 4)
    rotated = [int((i + 1) % interval != 0) for i in range(layers)]
  nope = tuple(i for i, r in enumerate(rotated) if not r)
  chunk = hf.get("attention_chunk_size", 8192)
  if chunk is not None:
    chunk = _positive(hf, "attention_chunk_size", where, 8192)
  types = _layer_list(hf, "layer_types", where, layers, ("chunked_attention", "full_attention"))
  if types is None:
    types = ["chunked_attention" if r and chunk is not None else "full_attention"
             for r in rotated]
  chunked = tuple(i for i, t in enumerate(types) if t == "chunked_attention")
  if chunked and chunk is None:
    _refuse(where, "layer_types", types, "chunked layers need attention_chunk_size (null)")
  tuning = hf.get("attn_temperature_tuning", True)     # tested for truth (Scout's is 4)
  if not isinstance(tuning, (bool, int, float)):
    _refuse(where, "attn_temperature_tuning", tuning, "expected true, false or a number")
  scale = _get(hf, "attn_scale", float, where, 0.1)
  floor = _positive(hf, "floor_scale", where, 8192, float)
  if floor != int(floor):
    _refuse(where, "floor_scale", floor, "moejax's nope_temperature_floor is a whole number of "
            "positions")
  temperature = scale if tuning and nope else 0.0
  moe_layers = hf.get("moe_layers")
  if moe_layers is None:
    step = _positive(hf, "interleave_moe_layer_step", where, 1)
    moe_layers = list(range(step - 1, layers, step))
  if not isinstance(moe_layers, list) or not all(
      isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in moe_layers):
    _refuse(where, "moe_layers", moe_layers, f"expected layer indices below {layers}")
  dense = tuple(i for i in range(layers) if i not in moe_layers)
  model = dict(nope_layers=nope, attention_chunk=chunk if chunked else 0, chunked_layers=chunked,
               nope_temperature=temperature,
               nope_temperature_floor=int(floor) if temperature else ModelConfig(
               ).nope_temperature_floor,
               rotary_interleaved=True, dense_layers=dense,
               dense_hidden=_positive(hf, "intermediate_size_mlp", where, 16384) if dense else 0)
  moe = dict(renormalize=False, weights_on_input=True, shared_expert_hidden=expert_hidden,
             shared_expert_gate=False)
  return model, moe


def _dense_pattern(hf: dict, where: str, default_listed: tuple = ()) -> dict:
  """Qwen-MoE's dense layers: those in mlp_only_layers (absent or null: `default_listed`) and
  those off decoder_sparse_step."""
  layers = _get(hf, "num_hidden_layers", int, where)
  step = _get(hf, "decoder_sparse_step", int, where, 1)
  listed = hf.get("mlp_only_layers")
  listed = list(default_listed) if listed is None else listed
  if step < 1:
    _refuse(where, "decoder_sparse_step", step, "expected a positive integer")
  if not isinstance(listed, list) or not all(isinstance(i, int) and 0 <= i < layers
                                             for i in listed):
    _refuse(where, "mlp_only_layers", listed, f"expected layer indices below {layers}")
  dense = tuple(i for i in range(layers) if i in listed or (i + 1) % step)
  return dict(dense_layers=dense,
              dense_hidden=_get(hf, "intermediate_size", int, where) if dense else 0)


def _leading_dense_and_shared(hf: dict, where: str, first_dense: int, shared: int | None,
                              shared_key: str = "n_shared_experts",
                              dense_key: str = "first_k_dense_replace") -> tuple[dict, dict]:
  """DeepSeek's, GLM-4.5's and dots.llm1's first_k_dense_replace leading dense layers (width
  intermediate_size) and n_shared_experts ungated shared experts of the routed width; the
  defaults are transformers' for absent fields (None: required)."""
  dense = tuple(range(_get(hf, dense_key, int, where, first_dense)))
  model = dict(dense_layers=dense,
               dense_hidden=_get(hf, "intermediate_size", int, where) if dense else 0)
  moe = dict(shared_expert_hidden=_get(hf, shared_key, int, where, shared)
             * _get(hf, "moe_intermediate_size", int, where), shared_expert_gate=False)
  return model, moe


def _mlp_layer_types(hf: dict, spec: FamilySpec, where: str) -> tuple[int, ...]:
  """The dense layers of a per-layer "dense" / "sparse" list (`FamilySpec.layer_types_key`);
  absent, transformers' default: the first layer dense, or first_k_dense_replace's leading
  layers (`FamilySpec.layer_types_fallback`)."""
  layers = _get(hf, "num_hidden_layers", int, where)
  types = hf.get(spec.layer_types_key)
  if types is None:
    first = (_get(hf, "first_k_dense_replace", int, where, spec.default_first_dense)
             if spec.layer_types_fallback else spec.first_dense_default)
    types = ["dense"] * first + ["sparse"] * (layers - first)
  if (not isinstance(types, list) or len(types) != layers
      or not all(t in ("dense", "sparse") for t in types)):
    _refuse(where, spec.layer_types_key, types,
            f"expected num_hidden_layers={layers} entries, each 'dense' or 'sparse'")
  return tuple(i for i, t in enumerate(types) if t == "dense")


def _every_layer_indexed(hf: dict, where: str) -> None:
  """GLM-5's indexer_types (or the index_topk_pattern / _freq and index_skip_topk_offset they
  come from, as transformers derives them): moejax runs every layer's own indexer; a "shared"
  layer, reusing the previous layer's selection, is refused."""
  layers = _get(hf, "num_hidden_layers", int, where)
  types = hf.get("indexer_types")
  key = "indexer_types"
  if types is None and hf.get("index_topk_pattern") is not None:
    key, pattern = "index_topk_pattern", hf["index_topk_pattern"]
    types = ([{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
             if isinstance(pattern, str) else pattern)
  elif types is None:
    key = "index_topk_freq"
    freq = max(_get(hf, "index_topk_freq", int, where, 1), 1)
    offset = _get(hf, "index_skip_topk_offset", int, where, 2)
    types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
  if not isinstance(types, list) or types != ["full"] * layers:
    _refuse(where, key, hf.get(key), "moejax runs every layer's own indexer (needs "
            f"num_hidden_layers={layers} 'full' layers; a 'shared' layer reuses the previous "
            "one's selection)")


def _deepseek_fields(hf: dict, spec: FamilySpec, where: str) -> tuple[dict, dict]:
  """DeepSeek-V2's or V3's model and moe fields (`FamilySpec.deepseek`)."""
  version = spec.deepseek
  nope, rope = _get(hf, "qk_nope_head_dim", int, where), _get(hf, "qk_rope_head_dim", int, where)
  # Absent fields take transformers' defaults: DeepseekV2Config's / V3Config's, or the family's
  # own (q_lora_rank null: no q latent).
  defaults = {"first_k_dense_replace": 3 if version == "v3" else 0, "q_lora_rank": 1536,
              "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
              "n_shared_experts": None, **dict(spec.deepseek_defaults)}
  model, moe = _leading_dense_and_shared(hf, where, defaults["first_k_dense_replace"],
                                         defaults["n_shared_experts"])
  if spec.layer_types_key:
    dense = _mlp_layer_types(hf, spec, where)
    model.update(dense_layers=dense,
                 dense_hidden=_get(hf, "intermediate_size", int, where) if dense else 0)
  q_default = defaults["q_lora_rank"]
  q_lora_rank = (_get(hf, "q_lora_rank", int, where, q_default)
                 if hf.get("q_lora_rank", q_default) else 0)
  model.update(kv_lora_rank=_get(hf, "kv_lora_rank", int, where),
               q_lora_rank=q_lora_rank,
               qk_nope_head_dim=nope, qk_rope_head_dim=rope,
               v_head_dim=_get(hf, "v_head_dim", int, where), head_dim=nope + rope)
  if spec.dsa:      # the family's config class's defaults (`FamilySpec.dsa`)
    if not q_lora_rank:
      _refuse(where, "q_lora_rank", hf.get("q_lora_rank"), "DeepSeek sparse attention's "
              "indexer reads the q latent (a positive rank is needed)")
    topk, heads, width = spec.dsa
    model.update(index_topk=_get(hf, "index_topk", int, where, topk),
                 index_heads=_get(hf, "index_n_heads", int, where, heads),
                 index_head_dim=_get(hf, "index_head_dim", int, where, width),
                 index_rotary_interleaved=spec.dsa_interleaved)
    _every_layer_indexed(hf, where)
  if version == "v3":
    moe.update(score="sigmoid", score_bias=True, group_score="top2",
               expert_groups=_get(hf, "n_group", int, where, defaults["n_group"]),
               top_groups=_get(hf, "topk_group", int, where, defaults["topk_group"]),
               routed_scale=_get(hf, "routed_scaling_factor", float, where,
                                 defaults["routed_scaling_factor"]))
    return model, moe
  method = hf.get("topk_method", "greedy")
  if method not in ("greedy", "group_limited_greedy"):
    _refuse(where, "topk_method", method, "DeepSeek-V2 routes greedy or group_limited_greedy")
  grouped = method == "group_limited_greedy"
  moe.update(score="softmax", score_bias=False, renormalize=False, group_score="max",
             expert_groups=_get(hf, "n_group", int, where) if grouped else 1,
             top_groups=_get(hf, "topk_group", int, where) if grouped else 1,
             routed_scale=_get(hf, "routed_scaling_factor", float, where, 1.0))
  if hf.get("aux_loss_alpha") is not None:    # the Hub's configs; transformers drops it
    moe["aux_loss_weight"] = _get(hf, "aux_loss_alpha", float, where)
  return model, moe


def _sigmoid_moe_fields(hf: dict, spec: FamilySpec, where: str) -> tuple[dict, dict]:
  """GLM-4.5's, dots.llm1's, Solar Open's and MiniCPM5's model and moe fields
  (`FamilySpec.sigmoid_moe`), transformers' defaults for absent ones."""
  # (all_moe: its config class has no first_k_dense_replace; transformers ignores one given)
  model, moe = _leading_dense_and_shared(
      {k: v for k, v in hf.items() if k != "first_k_dense_replace"} if spec.all_moe else hf,
      where, spec.default_first_dense, spec.default_shared, spec.shared_key,
      spec.first_dense_key)
  if spec.layer_types_key:
    dense = _mlp_layer_types(hf, spec, where)
    model.update(dense_layers=dense,
                 dense_hidden=_get(hf, "intermediate_size", int, where) if dense else 0)
  moe.update(score="sigmoid", score_bias=True, group_score="top2",
             # null groups (dots.llm1's published config) are no grouping
             expert_groups=(_get(hf, "n_group", int, where, 1)
                            if spec.expert_groups and hf.get("n_group") else 1),
             top_groups=(_get(hf, "topk_group", int, where, 1)
                         if spec.expert_groups and hf.get("topk_group") else 1),
             routed_scale=_get(hf, spec.routed_scale_key, float, where,
                               spec.default_routed_scale))
  return model, moe


def _aliased(hf: dict, spec: FamilySpec, key: str, aliases: tuple, where: str,
             default: int | None = None) -> int:
  """An integer config.json may hold under `key` or an alias: the key's, else the first alias
  given. Where transformers' attribute_map sends the alias to the field
  (`FamilySpec.aliases_win`: ERNIE's num_experts_per_tok over moe_k), the alias's value is the
  one it uses."""
  given = [k for k in aliases if k != key and hf.get(k) is not None]
  if spec.aliases_win and given:
    return _get(hf, given[0], int, where)
  return _get(hf, key, int, where, hf[given[0]] if given else default)


def _ernie_layers(hf: dict, where: str) -> tuple[int, int, int]:
  """ERNIE-4.5's MoE layers: (start, end, interval); layer i has experts when (i + 1) % interval
  == 0 and start <= i <= end (end -1: the last), transformers' rule."""
  layers = _get(hf, "num_hidden_layers", int, where)
  start = _get(hf, "moe_layer_start_index", int, where, 1)
  end = _get(hf, "moe_layer_end_index", int, where, -1)
  interval = _get(hf, "moe_layer_interval", int, where, 1)
  if interval < 1:
    _refuse(where, "moe_layer_interval", interval, "expected a positive integer")
  return start, layers - 1 if end == -1 else end, interval


def _ernie_pattern(m) -> tuple[int, int, int] | None:
  """(moe_layer_start_index, moe_layer_end_index, moe_layer_interval) whose MoE layers are
  `m`'s, or None."""
  moe_layers = [i for i in range(m.num_layers) if i not in m.dense_layers]
  start, end = moe_layers[0], moe_layers[-1]
  for interval in range(1, m.num_layers + 1):
    if [i for i in range(start, end + 1) if (i + 1) % interval == 0] == moe_layers:
      return start, end, interval
  return None


# model.linear_* <- config.json (Qwen3-Next), with transformers' defaults
_LINEAR_FIELDS = {"linear_key_heads": ("linear_num_key_heads", 16),
                  "linear_value_heads": ("linear_num_value_heads", 32),
                  "linear_key_dim": ("linear_key_head_dim", 128),
                  "linear_value_dim": ("linear_value_head_dim", 128),
                  "linear_conv_taps": ("linear_conv_kernel_dim", 4)}
_LINEAR_TYPES = ("linear_attention", "full_attention")
# ... Granite-4.0-H's (granitemoehybrid), from its mamba_* fields: G, N, H, P, taps
_MAMBA_FIELDS = {"linear_key_heads": ("mamba_n_groups", 1),
                 "linear_key_dim": ("mamba_d_state", 256),
                 "linear_value_heads": ("mamba_n_heads", 128),
                 "linear_conv_taps": ("mamba_d_conv", 4)}
# the Hub's names of its layer types (transformers reads them as _LINEAR_TYPES)
_MAMBA_TYPES = ("mamba", "attention")


def _linear_fields(hf: dict, spec: FamilySpec, where: str) -> dict:
  """The linear layers' model fields (`FamilySpec.linear`): model.linear_layers from layer_types
  (Qwen3-Next's absent: every full_attention_interval-th layer full, the others linear, as
  transformers fills it), the linear_* widths; zero-centered norms (Gated DeltaNet) or NoPE
  softmax layers unless position_embedding_type is "rope" (Mamba-2)."""
  if spec.linear == "mamba2":
    return _mamba_fields(hf, where)
  layers = _get(hf, "num_hidden_layers", int, where)
  types = hf.get("layer_types")
  if types is None:
    interval = _get(hf, "full_attention_interval", int, where, 4)
    if interval < 1:
      _refuse(where, "full_attention_interval", interval, "expected a positive integer")
    types = [_LINEAR_TYPES[(i + 1) % interval == 0] for i in range(layers)]
  if (not isinstance(types, list) or len(types) != layers
          or any(t not in _LINEAR_TYPES for t in types)):
    _refuse(where, "layer_types", types, f"expected {layers} entries (num_hidden_layers), each "
            f"one of {', '.join(_LINEAR_TYPES)}")
  fields = {field: _get(hf, key, int, where, default)
            for field, (key, default) in _LINEAR_FIELDS.items()}
  return dict(fields, norm_kind="rms_zero_centered", linear_kind="gated_deltanet",
              linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"))


def _mamba_fields(hf: dict, where: str) -> dict:
  layers = _get(hf, "num_hidden_layers", int, where)
  d_model = _get(hf, "hidden_size", int, where)
  types = hf.get("layer_types", ["mamba"] * layers)
  if (not isinstance(types, list) or len(types) != layers
          or any(t not in _MAMBA_TYPES + _LINEAR_TYPES for t in types)):
    _refuse(where, "layer_types", types, f"expected {layers} entries (num_hidden_layers), each "
            f"one of {', '.join(_MAMBA_TYPES + _LINEAR_TYPES)}")
  fields = {field: _get(hf, key, int, where, default)
            for field, (key, default) in _MAMBA_FIELDS.items()}
  inner = _get(hf, "mamba_expand", int, where, 2) * d_model
  head_dim = hf.get("mamba_d_head", "auto")
  head_dim = inner // fields["linear_value_heads"] if head_dim == "auto" else _get(
      hf, "mamba_d_head", int, where)
  if head_dim * fields["linear_value_heads"] != inner:
    _refuse(where, "mamba_d_head", head_dim, f"mamba_n_heads x mamba_d_head must be mamba_expand "
            f"x hidden_size = {inner}")
  limit = hf.get("time_step_limit")
  # (transformers writes its infinite bound as {"__float__": "Infinity"})
  bounds = [float(b["__float__"]) if isinstance(b, dict) and "__float__" in b else b
            for b in limit] if isinstance(limit, list) else None
  if limit is not None and (bounds is None or len(bounds) != 2
                            or not all(isinstance(b, (int, float)) for b in bounds)
                            or bounds[0] > 0 or bounds[1] < math.inf):
    _refuse(where, "time_step_limit", limit, "moejax's Mamba-2 does not clamp the time step "
            "(transformers' default (0, inf))")
  linear = tuple(i for i, t in enumerate(types) if t in ("mamba", "linear_attention"))
  rope = hf.get("position_embedding_type")
  if rope not in (None, "nope", "rope"):
    _refuse(where, "position_embedding_type", rope, "expected null, 'nope' or 'rope'")
  return dict(fields, linear_value_dim=head_dim, linear_kind="mamba2", linear_layers=linear,
              nope_layers=() if rope == "rope" else tuple(i for i in range(layers)
                                                          if i not in linear))


def _ernie_fields(hf: dict, where: str) -> tuple[dict, dict]:
  """ERNIE-4.5's model and moe fields (`FamilySpec.ernie`)."""
  layers = _get(hf, "num_hidden_layers", int, where)
  start, end, interval = _ernie_layers(hf, where)
  dense = tuple(i for i in range(layers)
                if not ((i + 1) % interval == 0 and start <= i <= end))
  model = dict(dense_layers=dense, rotary_interleaved=True,
               dense_hidden=_get(hf, "intermediate_size", int, where) if dense else 0)
  moe = dict(shared_expert_hidden=_get(hf, "moe_num_shared_experts", int, where, 2)
             * _get(hf, "moe_intermediate_size", int, where), shared_expert_gate=False)
  return model, moe


def config_from_hf(hf: dict, base: Config | None = None, where: str = "config.json") -> Config:
  """The moejax `Config` of a config.json of any family; fields moejax does not take from it come
  from `base` (default: `Config()`). A multimodal config is read as its text model's
  (`text_model_config`)."""
  hf = text_model_config(hf, where)
  spec = check_supported(hf, where)
  hf = _unaliased(hf, spec, where)
  base = Config() if base is None else base
  heads = _get(hf, "num_attention_heads", int, where)
  kv_heads = _kv_heads(hf, spec, heads)
  head_dim = _head_dim(hf, spec, where)
  sliding = _sliding(hf, spec, where)
  model = dataclasses.replace(
      base.model,
      family=MODEL_TYPES[spec.model_type],
      vocab_size=_get(hf, "vocab_size", int, where),
      d_model=_get(hf, "hidden_size", int, where),
      num_layers=_get(hf, "num_hidden_layers", int, where),
      num_heads=heads,
      # 0: as many as query heads, the typed default, so multi-head configs compare equal
      num_kv_heads=0 if kv_heads == heads else kv_heads,
      head_dim=head_dim,
      rotary_dim=0 if spec.deepseek else _rotary_dim(hf, spec, head_dim, where),
      qk_norm=(spec.qk_norm if not spec.qk_norm_key
               or _get(hf, spec.qk_norm_key, bool, where, spec.qk_norm_default) else "none"),
      qkv_bias=(_get(hf, spec.qkv_bias_key, bool, where, spec.qkv_bias_default)
                if spec.qkv_bias_key else False),
      attention_gate=spec.attention_gate, attention_gate_own=spec.attention_gate_own,
      attention_sinks=spec.attention_sinks,
      norm_position=spec.norm_position,
      **{**sliding, **_rope_fields(hf, spec, where, head_dim, sliding["sliding_layers"])},
      # (Cohere: rms_norm_eps null means LayerNorm, read with its eps by _cohere_fields)
      norm_eps=(_get(hf, "rms_norm_eps", float, where, spec.default_norm_eps)
                if not spec.cohere else spec.default_norm_eps),
      init_std=_get(hf, "initializer_range", float, where, base.model.init_std),
      tie_embeddings=_get(hf, "tie_word_embeddings", bool, where, spec.default_tie),
      kv_lora_rank=0, q_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0, v_head_dim=0,
      dense_layers=(), dense_hidden=0,
      # the options only some families set (below), at their defaults for the others, so
      # nothing of `base`'s family carries over
      rotary_interleaved=False, qk_norm_after_rope=False,
      **{field: getattr(ModelConfig(), field) for field in (
          *_GRANITE_SCALES, "attention_chunk", "chunked_layers", "nope_temperature",
          "nope_temperature_floor", "index_topk", "index_heads", "index_head_dim",
          "index_rotary_interleaved", *_LINEAR_FIELDS, "linear_layers", "linear_kind")})
  if spec.dense_pattern:
    model = dataclasses.replace(model, **_dense_pattern(hf, where, spec.default_mlp_only))
  if spec.layer_types_key and not (spec.deepseek or spec.sigmoid_moe):    # Mellum
    dense = _mlp_layer_types(hf, spec, where)
    model = dataclasses.replace(model, dense_layers=dense, dense_hidden=_get(
        hf, "intermediate_size", int, where) if dense else 0)
  moe = dataclasses.replace(
      base.moe,
      num_experts=_aliased(hf, spec, spec.experts_key, spec.experts_aliases, where),
      top_k=_aliased(hf, spec, spec.top_k_key, ("num_experts_per_tok",), where,
                     spec.default_top_k),
      expert_hidden=_get(hf, spec.expert_hidden_key, int, where),
      shared_expert_hidden=(_get(hf, "shared_expert_intermediate_size", int, where)
                            if spec.shared_expert else 0),
      shared_expert_gate=spec.shared_expert and spec.shared_gate,
      score=spec.score, score_bias_on_logits=spec.bias_on_logits,
      router_float32=spec.router_float32 or base.moe.router_float32,
      # transformers declares it `bool | None` and tests its truth: null is off
      renormalize=((hf.get(spec.renormalize_key, spec.renormalize_default) is not None
                    and _get(hf, spec.renormalize_key, bool, where, spec.renormalize_default))
                   if spec.renormalize_key else True),
      aux_loss_weight=_get(hf, "router_aux_loss_coef", float, where,
                           base.moe.aux_loss_weight if spec.default_aux is None
                           else spec.default_aux),
      z_loss_weight=(_get(hf, spec.z_loss_key, float, where, base.moe.z_loss_weight)
                     if spec.z_loss_key else base.moe.z_loss_weight),
      score_bias=spec.score_bias, expert_groups=1, top_groups=1, group_score="top2",
      routed_scale=1.0, weights_on_input=False)
  if spec.deepseek or spec.sigmoid_moe or spec.ernie:
    model_fields, moe_fields = (_deepseek_fields(hf, spec, where) if spec.deepseek
                                else _ernie_fields(hf, where) if spec.ernie
                                else _sigmoid_moe_fields(hf, spec, where))
    model = dataclasses.replace(model, **model_fields)
    moe = dataclasses.replace(moe, **moe_fields)
  if spec.hunyuan:     # its shared MLP is as wide as the experts (both intermediate_size)
    model = dataclasses.replace(model, qk_norm_after_rope=True)
    moe = dataclasses.replace(moe, shared_expert_hidden=moe.expert_hidden,
                              shared_expert_gate=False)
  if spec.mup and _get(hf, "mup_enabled", bool, where, False):
    model = dataclasses.replace(model, embed_scale=math.sqrt(model.d_model))
  if spec.granite:
    model = dataclasses.replace(model, **{
        field: _get(hf, key, float, where, 1.0) for field, key in _GRANITE_SCALES.items()})
    if spec.granite == "shared":
      moe = dataclasses.replace(moe, shared_expert_hidden=_get(
          hf, "shared_intermediate_size", int, where, 0), shared_expert_gate=False)
  if spec.cohere:
    model_fields, moe_fields = _cohere_fields(hf, where, model.sliding_layers, model.dense_layers)
    model = dataclasses.replace(model, **model_fields)
    moe = dataclasses.replace(moe, **moe_fields)
  else:
    model = dataclasses.replace(model, norm_kind="rms")
    moe = dataclasses.replace(moe, shared_expert_scale=1.0)
  if spec.llama4:
    model_fields, moe_fields = _llama4_fields(hf, where, moe.expert_hidden)
    model = dataclasses.replace(model, **model_fields)
    moe = dataclasses.replace(moe, **moe_fields)
  if spec.linear:
    model = dataclasses.replace(model, **_linear_fields(hf, spec, where))
  if spec.gpt_oss or spec.cohere or spec.llama4:   # attention_bias biases o too
    model = dataclasses.replace(model, attention_out_bias=model.qkv_bias)
  if spec.gpt_oss:
    moe = dataclasses.replace(
        moe, router_bias=True, expert_bias=True, activation="swiglu_clamped",
        swiglu_alpha=_get(hf, "swiglu_alpha", float, where, 1.702),
        swiglu_limit=_get(hf, "swiglu_limit", float, where, 7.0))
  else:
    if not (spec.cohere or spec.llama4):
      model = dataclasses.replace(model, attention_out_bias=False)
    moe = dataclasses.replace(moe, router_bias=False, expert_bias=False, activation="swiglu",
                              swiglu_alpha=1.702, swiglu_limit=7.0)
  if not moe.score_bias:
    moe = dataclasses.replace(moe, score_bias_rate=0.0)
  cfg = dataclasses.replace(base, model=model, moe=moe)
  try:
    validate(cfg)
  except ConfigError as e:
    raise CheckpointError(f"{where}: gives an invalid moejax config: {e}") from None
  return cfg


def check_exportable(cfg: Config) -> FamilySpec:
  """The family spec of `cfg.model.family`; raises CheckpointError naming the first option that
  family's Hugging Face architecture cannot hold."""
  m, moe = cfg.model, cfg.moe
  spec = FAMILY_SPECS[m.family]
  what = f"Hugging Face {m.family} ({spec.architecture})"

  def need(field: str, value, want, why: str = ""):
    if value != want:
      raise CheckpointError(f"config.{field}={value!r}: {what} needs {want!r}{why}; choose "
                            "another config.model.family or change the field")

  if spec.all_moe:
    need("model.dense_layers", m.dense_layers, (), " (experts in every layer)")
  if spec.deepseek or spec.sigmoid_moe:
    need("model.dense_layers", m.dense_layers, tuple(range(len(m.dense_layers))),
         " (its dense layers lead: first_k_dense_replace)")
    if spec.deepseek == "v2":
      need("moe.score", moe.score, "softmax", " (it routes with a softmax)")
      need("moe.score_bias", moe.score_bias, False, " (no score bias)")
      need("moe.renormalize", moe.renormalize, False, " (it never renormalizes the top-k)")
    else:
      need("moe.score", moe.score, "sigmoid", " (it routes with sigmoids)")
      need("moe.score_bias", moe.score_bias, True, " (its router always has the bias)")
    if not spec.expert_groups:
      need("moe.expert_groups", moe.expert_groups, 1, " (no expert groups)")
    if moe.expert_groups > 1:
      need("moe.group_score", moe.group_score, "max" if spec.deepseek == "v2" else "top2",
           " (how its groups are scored)")
    if spec.deepseek and m.rope_scaling == "llama3":
      raise CheckpointError(f"config.model.rope_scaling='llama3': {what} scales latent "
                            "attention's RoPE by yarn only here (transformers would change its "
                            "softmax scale); choose another config.model.family or 'yarn'")
    if spec.dsa and not m.index_topk:
      raise CheckpointError(f"config.model.index_topk=0: {what} has DeepSeek sparse attention "
                            "in every layer; choose another config.model.family or set "
                            "model.index_topk, index_heads and index_head_dim")
    if spec.dsa:
      need("model.index_rotary_interleaved", m.index_rotary_interleaved, spec.dsa_interleaved,
           " (how its indexer rotates)")
    if spec.sigmoid_moe:
      need("model.kv_lora_rank", m.kv_lora_rank, 0, " (no latent attention)")
    elif not m.kv_lora_rank:
      raise CheckpointError(f"config.model.kv_lora_rank=0: {what} has latent attention only; "
                            "choose another config.model.family or set the latent fields")
  elif spec.cohere:
    need("model.kv_lora_rank", m.kv_lora_rank, 0, " (no latent attention)")
    need("moe.score_bias", moe.score_bias, False, " (no score bias)")
    need("moe.expert_groups", moe.expert_groups, 1, " (no expert groups)")
    if moe.score == "softmax":
      need("moe.renormalize", moe.renormalize, True, " (its softmax is over the top-k logits)")
    if moe.score not in ("softmax", "sigmoid"):
      need("moe.score", moe.score, "softmax", " (or sigmoid: expert_selection_fn)")
    both = (moe.routed_scale, moe.shared_expert_scale)
    if both not in ((1.0, 1.0), (0.5, 0.5)) or (both != (1.0, 1.0)
                                                and not moe.shared_expert_hidden):
      raise CheckpointError(
          f"config.moe.routed_scale={moe.routed_scale}, shared_expert_scale="
          f"{moe.shared_expert_scale}: {what} sums its routed and shared experts (1.0, 1.0) or "
          "averages them (0.5, 0.5, with a shared expert); choose another config.model.family "
          "or change the fields")
    full = set(range(m.num_layers)) - set(m.sliding_layers)
    ways = {tuple(sorted(full)), tuple(sorted(full - set(m.dense_layers)))}
    if tuple(sorted(m.nope_layers)) not in ways:
      raise CheckpointError(
          f"config.model.nope_layers={m.nope_layers!r}: {what} leaves its full layers unrotated "
          f"(or all but its dense ones): {' or '.join(map(str, sorted(ways)))}; choose another "
          "config.model.family or change the field")
  else:
    need("moe.score", moe.score, spec.score, f" (it routes with {spec.score} scores)")
    need("model.kv_lora_rank", m.kv_lora_rank, 0, " (no latent attention)")
    if not (spec.dense_pattern or spec.ernie or spec.layer_types_key or spec.llama4):
      need("model.dense_layers", m.dense_layers, (), " (no dense layers)")
    need("moe.score_bias", moe.score_bias, spec.score_bias,
         " (its router has the score bias)" if spec.score_bias else " (no score bias)")
    need("moe.expert_groups", moe.expert_groups, 1, " (no expert groups)")
    need("moe.routed_scale", moe.routed_scale, 1.0, " (no routed scaling)")
  if moe.score_bias:
    need("moe.score_bias_on_logits", moe.score_bias_on_logits, spec.bias_on_logits,
         " (where its router adds the bias)")
  need("model.rotary_interleaved", m.rotary_interleaved, spec.ernie or spec.cohere or spec.llama4,
       " (how its rotary dims pair up)")
  need("model.norm_position", m.norm_position, spec.norm_position, " (where its layers' norms "
       "sit)")
  need("model.qk_norm_after_rope", m.qk_norm_after_rope, spec.hunyuan,
       " (where its QK-norm sits)")
  if spec.hunyuan:
    need("moe.shared_expert_hidden", moe.shared_expert_hidden, moe.expert_hidden,
         " (its shared MLP is as wide as an expert: both intermediate_size)")
  need("model.attention_gate", m.attention_gate, spec.attention_gate,
       " (its attention's output gate)" if spec.attention_gate else " (no attention gate)")
  if spec.attention_gate:
    need("model.attention_gate_own", m.attention_gate_own, spec.attention_gate_own,
         " (the gate's weight its own projection)" if spec.attention_gate_own
         else " (the gate's weight in the q projection)")
  full = tuple(i for i in range(m.num_layers) if i not in m.sliding_layers)
  if not spec.sliding:
    need("model.sliding_window", m.sliding_window, 0, " (no sliding window)")
  elif spec.sliding == "all" and m.sliding_window:
    need("model.sliding_layers", m.sliding_layers, tuple(range(m.num_layers)),
         " (its sliding window covers every layer)")
  if not (spec.rope_per_type or spec.layer_thetas):
    need("model.sliding_rope_theta", m.sliding_rope_theta, 0.0, " (one RoPE for every layer)")
  if spec.rope_per_type and m.rope_scaling == "yarn":
    need("model.rope_truncate", m.rope_truncate, True, " (transformers truncates its per-type "
         "YaRN always)")
  rotated_sliding = [i for i in m.sliding_layers if i not in m.nope_layers]
  if spec.layer_thetas and m.rope_scaling != "none" and rotated_sliding:
    need("model.sliding_rope_theta", m.sliding_rope_theta, 0.0, " (its per-layer bases all "
         "take the model's YaRN: the sliding layers cannot rotate by plain RoPE of their own)")
  patterned = spec.sliding in _FULL_UNROTATED
  if not (spec.layer_thetas or spec.cohere or spec.llama4 or spec.linear == "mamba2"):
    # Granite SWA: any unrotated (layer_rope_theta 0); Cohere and Granite-4.0-H: their own
    # rules, above
    need("model.nope_layers", m.nope_layers, full if patterned else (),
         " (it leaves its full layers unrotated)" if patterned else " (it rotates every layer)")
  need("model.attention_sinks", m.attention_sinks, spec.attention_sinks,
       " (its attention's sinks)" if spec.attention_sinks else " (no attention sinks)")
  need("moe.router_bias", moe.router_bias, spec.gpt_oss,
       " (its router's bias)" if spec.gpt_oss else " (no router bias)")
  need("moe.expert_bias", moe.expert_bias, spec.gpt_oss,
       " (its experts' biases)" if spec.gpt_oss else " (no expert biases)")
  need("moe.activation", moe.activation, "swiglu_clamped" if spec.gpt_oss else "swiglu",
       " (its experts' activation)")
  both_biased = spec.gpt_oss or spec.cohere or spec.llama4
  need("model.attention_out_bias", m.attention_out_bias, m.qkv_bias and both_biased,
       " (attention_bias biases q, k, v and o alike)" if both_biased
       else " (no output-projection bias)")
  need("moe.weights_on_input", moe.weights_on_input, spec.llama4,
       " (its routed weights scale the experts' inputs)" if spec.llama4
       else " (its routed weights scale the experts' outputs)")
  if not spec.dsa:
    need("model.index_topk", m.index_topk, 0, " (no sparse-attention indexer)")
  if not spec.llama4:
    need("model.attention_chunk", m.attention_chunk, 0, " (no chunked attention)")
    need("model.nope_temperature", m.nope_temperature, 0.0, " (no query temperature)")
  else:
    need("moe.renormalize", moe.renormalize, False, " (it never renormalizes the top-k)")
    need("moe.shared_expert_hidden", moe.shared_expert_hidden, moe.expert_hidden,
         " (a shared expert as wide as a routed one: both intermediate_size)")
  if spec.linear:
    need("model.linear_kind", m.linear_kind, spec.linear, "")
  if spec.linear == "gated_deltanet":
    need("model.norm_kind", m.norm_kind, "rms_zero_centered", " (its norms scale by 1 + w)")
  elif not spec.linear:
    need("model.linear_layers", m.linear_layers, (), " (no linear attention)")
  if spec.linear == "mamba2":
    softmax = tuple(i for i in range(m.num_layers) if i not in m.linear_layers)
    if m.nope_layers not in ((), softmax):
      raise CheckpointError(
          f"config.model.nope_layers={m.nope_layers!r}: {what} rotates every softmax layer "
          f"(position_embedding_type rope: ()) or none (null: {softmax!r})")
    if (m.linear_value_heads * m.linear_value_dim) % m.d_model:
      raise CheckpointError(
          f"config.model.linear_value_heads x linear_value_dim = "
          f"{m.linear_value_heads * m.linear_value_dim}: {what} needs a multiple of "
          f"model.d_model={m.d_model} (mamba_expand x hidden_size)")
  if not (spec.cohere or spec.linear == "gated_deltanet"):
    need("model.norm_kind", m.norm_kind, "rms", " (RMSNorm)")
    need("moe.shared_expert_scale", moe.shared_expert_scale, 1.0, " (no shared-expert scale)")
  if spec.ernie:
    if _ernie_pattern(m) is None:
      raise CheckpointError(
          f"config.model.dense_layers={m.dense_layers!r}: {what} puts experts in the layers "
          "from moe_layer_start_index to moe_layer_end_index every moe_layer_interval, and no "
          "such pattern gives these dense layers")

  if spec.qk_norm_key and m.qk_norm == "none":
    pass                                # the architecture's QK-norm switched off
  else:
    need("model.qk_norm", m.qk_norm, spec.qk_norm)
  if spec.partial_rotary is None:
    need("model.rotary_dim", m.rotary_dim, 0, " (it rotates whole heads)")
  if not spec.qkv_bias_key:
    need("model.qkv_bias", m.qkv_bias, False)
  if spec.renormalize_key is None and not spec.llama4:
    need("moe.renormalize", moe.renormalize, True)
  need("moe.shared_expert_gate", moe.shared_expert_gate, spec.shared_expert and spec.shared_gate)
  if spec.deepseek or spec.sigmoid_moe or spec.ernie:   # n shared experts of the routed width
    count = "moe_num_shared_experts" if spec.ernie else spec.shared_key
    positive = not spec.ernie          # the others' layers always have one
    if (positive and not moe.shared_expert_hidden) or moe.shared_expert_hidden % moe.expert_hidden:
      raise CheckpointError(
          f"config.moe.shared_expert_hidden={moe.shared_expert_hidden}: {what} needs a "
          f"{'positive ' if positive else ''}multiple of moe.expert_hidden={moe.expert_hidden} "
          f"({count} of its width)")
  elif spec.cohere:
    if moe.shared_expert_hidden % moe.expert_hidden:
      raise CheckpointError(
          f"config.moe.shared_expert_hidden={moe.shared_expert_hidden}: {what} needs a multiple "
          f"of moe.expert_hidden={moe.expert_hidden} (num_shared_experts of its width)")
  elif not (spec.shared_expert or spec.granite == "shared" or spec.hunyuan or spec.llama4):
    need("moe.shared_expert_hidden", moe.shared_expert_hidden, 0)
  if not spec.granite:
    for field in _GRANITE_SCALES:     # each at ModelConfig's default: no scaling
      if spec.mup and field == "embed_scale" and m.embed_scale == math.sqrt(m.d_model):
        continue                      # mup_enabled
      if spec.cohere and field == "logit_divisor":
        continue                      # logit_scale
      need(f"model.{field}", getattr(m, field), getattr(ModelConfig(), field),
           " (no such multiplier)" if not spec.mup or field != "embed_scale"
           else f" or sqrt(d_model) = {math.sqrt(m.d_model)!r} (mup_enabled)")
  if spec.norm_over_hidden and m.num_heads * m.head_dim != m.d_model:
    raise CheckpointError(
        f"config.model.num_heads * head_dim = {m.num_heads * m.head_dim} differs from d_model="
        f"{m.d_model}; {what} normalizes q over hidden_size and needs them equal")
  return spec


# config.json's key naming a tokenizer that no tokenizer.json holds: "bytes" for weights trained
# on UTF-8 bytes (moejax's to-hf of such a run), read by generate / evaluate (`load_model`).
TOKENIZER_KEY = "moejax_tokenizer"


def hf_config_from(cfg: Config, base: dict | None = None, *, dtype: str = "float32",
                   eos_token_id: int | None = None) -> dict:
  """A config.json of `cfg.model.family` for `cfg`. Fields moejax does not model (token ids,
  maximum length) come from `base`, e.g. the config.json the parameters were imported from;
  `eos_token_id` (the run's tokenizer's EOS) without a `base`, so that generation with
  transformers stops where the documents a model trained from scratch ended (an imported
  model's token ids are its source's, even where that names none)."""
  spec = check_exportable(cfg)
  m, moe = cfg.model, cfg.moe
  if base and canonical_model_type(base.get("model_type")) != spec.model_type:
    base = None      # another family's fields would not belong
  hf = copy.deepcopy(base) if base else {
      "bos_token_id": None, "eos_token_id": eos_token_id, "pad_token_id": None,
      "max_position_embeddings": 4096, "use_cache": True}
  # auto_map names remote code the export does not carry (trust_remote_code would fail on it)
  # (TOKENIZER_KEY: a base exported from a run on bytes; save_hf says it again where it holds)
  for stale in ("torch_dtype", "dtype", "transformers_version", "head_dim", "auto_map",
                TOKENIZER_KEY,
                *spec.experts_aliases, *(alias for alias, _ in spec.field_aliases)):
    hf.pop(stale, None)
  hf.update({
      "architectures": [spec.architecture],
      "model_type": spec.model_type,
      "vocab_size": m.vocab_size,
      "hidden_size": m.d_model,
      "num_hidden_layers": m.num_layers,
      "num_attention_heads": m.num_heads,
      "num_key_value_heads": m.num_kv_heads or m.num_heads,
      "rope_theta": m.rope_theta,
      "rms_norm_eps": m.norm_eps,
      "initializer_range": m.init_std,
      spec.experts_key: moe.num_experts,
      "num_experts_per_tok": moe.top_k,
      spec.expert_hidden_key: moe.expert_hidden,
      "router_aux_loss_coef": moe.aux_loss_weight,
      "hidden_act": "silu",
      "attention_dropout": hf.get("attention_dropout", 0.0),
      "tie_word_embeddings": m.tie_embeddings,
      "output_router_logits": hf.get("output_router_logits", False),
  })
  if spec.all_moe:              # fields its config class does not have
    hf.pop("first_k_dense_replace", None)
    hf.pop("intermediate_size", None)
  elif spec.deepseek or spec.sigmoid_moe:
    hf.update({
        spec.first_dense_key: len(m.dense_layers),
        "intermediate_size": m.dense_hidden or hf.get("intermediate_size", moe.expert_hidden)})
  if spec.deepseek or spec.sigmoid_moe:
    hf.update({spec.shared_key: moe.shared_expert_hidden // moe.expert_hidden,
               spec.routed_scale_key: moe.routed_scale})
    if spec.expert_groups:
      hf.update({"n_group": moe.expert_groups, "topk_group": moe.top_groups})
  if spec.deepseek:
    hf.update({
        "q_lora_rank": m.q_lora_rank or None, "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim, "head_dim": m.qk_rope_head_dim})
    if spec.dsa:
      hf.update({"index_topk": m.index_topk, "index_n_heads": m.index_heads,
                 "index_head_dim": m.index_head_dim})
    if spec.deepseek == "v2":
      hf.update({"topk_method": "group_limited_greedy" if moe.expert_groups > 1 else "greedy",
                 "aux_loss_alpha": moe.aux_loss_weight})
      hf.pop("router_aux_loss_coef", None)
  elif not spec.norm_over_hidden:        # OLMoE: hidden / heads
    hf["head_dim"] = m.head_dim
  if spec.layer_types_key:     # transformers reads this list; vLLM first_k_dense_replace
    hf[spec.layer_types_key] = ["dense" if i in m.dense_layers else "sparse"
                                for i in range(m.num_layers)]
    if not (spec.deepseek or spec.sigmoid_moe or spec.cohere):   # Mellum: the dense MLP's
      hf["intermediate_size"] = m.dense_hidden or hf.get("intermediate_size", moe.expert_hidden)
  if spec.model_type in MTP_NAMED and spec.layer_types_key:   # Mellum: no MTP layer written
    hf.update({"num_nextn_predict_layers": None, "mtp_layer_types": None,
               "mtp_mlp_layer_types": None})
    hf.pop("num_mtp_layers", None)
  if spec.model_type in MTP_FAMILIES and spec.model_type != "minimax_m2":
    hf["num_nextn_predict_layers"] = 0    # the export holds no multi-token-prediction layer
  if spec.sliding:
    # A number even where no layer slides where transformers needs one: EXAONE's, AfMoE's
    # and Flint's configs type it int, Granite SWA's, Kolibri's, gpt-oss's and Cohere2-MoE's
    # models build the sliding mask whatever the layers (their full layers stay NoPE, or rotate
    # by their bases)
    numeric = spec.sliding in (*_FULL_UNROTATED, "granite_swa", "gpt_oss", "cohere")
    hf["sliding_window"] = m.sliding_window or (
        (hf.get("sliding_window") or spec.default_sliding_window) if numeric else None)
    if spec.sliding != "all":      # the list wins over the family's rule
      hf["layer_types"] = [_ATTENTION_TYPES[i in m.sliding_layers] for i in range(m.num_layers)]
  if spec.model_type == "minimax_m2" and hf.get("use_mtp"):   # ... nor MiniMax's modules
    hf.update({"use_mtp": False, "num_mtp_modules": 0})
  if spec.qk_norm_key:
    hf[spec.qk_norm_key] = m.qk_norm != "none"
  if spec.ernie:
    start, end, interval = _ernie_pattern(m)
    hf.update({"moe_layer_start_index": start, "moe_layer_end_index": end,
               "moe_layer_interval": interval,
               "moe_num_shared_experts": moe.shared_expert_hidden // moe.expert_hidden,
               "num_nextn_predict_layers": None,   # the export holds no MTP tensors
               "intermediate_size": m.dense_hidden or hf.get("intermediate_size",
                                                             moe.expert_hidden)})
  if spec.top_k_key != "num_experts_per_tok":
    hf[spec.top_k_key] = hf.pop("num_experts_per_tok")
  if spec.dense_pattern:
    hf.update({"mlp_only_layers": list(m.dense_layers), "decoder_sparse_step": 1})
    if m.dense_layers:
      hf["intermediate_size"] = m.dense_hidden
  if spec.renormalize_key:
    hf[spec.renormalize_key] = moe.renormalize
  if spec.qkv_bias_key:
    hf[spec.qkv_bias_key] = m.qkv_bias
  if spec.hunyuan:      # the per-layer fields other readers take, as one value each
    hf.update({"moe_intermediate_size": moe.expert_hidden, "num_shared_expert": 1})
  if spec.mup:
    hf["mup_enabled"] = m.embed_scale != 1.0
  if spec.cohere:
    full = set(range(m.num_layers)) - set(m.sliding_layers)
    rotated_dense = bool(full & set(m.dense_layers) - set(m.nope_layers))
    prefix = hf.get("prefix_dense_sliding_window_pattern") or 1
    hf.update({
        "rms_norm_eps": m.norm_eps if m.norm_kind == "rms" else None,
        "layer_norm_eps": m.norm_eps if m.norm_kind == "layer" else hf.get("layer_norm_eps",
                                                                             1e-5),
        "logit_scale": _reciprocal(m.logit_divisor), "expert_selection_fn": moe.score,
        "num_shared_experts": moe.shared_expert_hidden // moe.expert_hidden,
        "shared_expert_combination_strategy": "average" if moe.routed_scale == 0.5 else "sum",
        "prefix_dense_intermediate_size": m.dense_hidden or None,
        # (layer_types written: the patterns only say which dense layers rotate)
        "prefix_dense_sliding_window_pattern": 1 if rotated_dense else (
            prefix if prefix != 1 or not full & set(m.dense_layers) else 2)})
  if spec.llama4:
    moe_layers = [i for i in range(m.num_layers) if i not in m.dense_layers]
    steps = [s for s in range(1, m.num_layers + 1)
             if moe_layers == list(range(s - 1, m.num_layers, s))]
    hf.update({
        "no_rope_layers": [int(i not in m.nope_layers) for i in range(m.num_layers)],
        "attention_chunk_size": m.attention_chunk or None,
        "layer_types": ["chunked_attention" if i in m.chunked_layers else "full_attention"
                        for i in range(m.num_layers)],
        "attn_temperature_tuning": m.nope_temperature > 0,
        "attn_scale": m.nope_temperature or hf.get("attn_scale", 0.1),
        "floor_scale": m.nope_temperature_floor,
        # the list wins; the step as other readers (vLLM) take it, where one gives the list
        "moe_layers": moe_layers, "interleave_moe_layer_step": steps[0] if steps else 1,
        "intermediate_size_mlp": m.dense_hidden or hf.get("intermediate_size_mlp", 16384)})
  if spec.linear == "mamba2":
    hf["layer_types"] = [_MAMBA_TYPES[i not in m.linear_layers] for i in range(m.num_layers)]
    hf.update({key: getattr(m, field) for field, (key, _) in _MAMBA_FIELDS.items()})
    hf.update(mamba_d_head=m.linear_value_dim,
              mamba_expand=m.linear_value_heads * m.linear_value_dim // m.d_model,
              position_embedding_type=None if m.nope_layers else "rope")
    hf.pop("time_step_limit", None)
  elif spec.linear:
    hf.pop("full_attention_interval", None)      # the list wins; transformers writes it
    for mtp in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
      if mtp in hf:       # the export holds no multi-token-prediction module (`mtp.*`)
        hf[mtp] = 0
    hf["layer_types"] = [_LINEAR_TYPES[i not in m.linear_layers] for i in range(m.num_layers)]
    hf.update({key: getattr(m, field) for field, (key, _) in _LINEAR_FIELDS.items()})
  if spec.gpt_oss:
    hf.update({"swiglu_alpha": moe.swiglu_alpha, "swiglu_limit": moe.swiglu_limit})
    if "experts_per_token" in hf:     # the Hub's copy of the top-k (other readers take it)
      hf["experts_per_token"] = moe.top_k
  if spec.layer_thetas:      # each layer's base: 0 unrotated, the sliding layers' own if any
    hf["layer_rope_theta"] = [
        0.0 if i in m.nope_layers else (m.sliding_rope_theta or m.rope_theta)
        if i in m.sliding_layers else m.rope_theta for i in range(m.num_layers)]
  if spec.granite:
    hf.update({key: getattr(m, field) for field, key in _GRANITE_SCALES.items()})
    hf["attention_multiplier"] = m.attention_scale or m.head_dim ** -0.5
    if spec.granite == "shared":
      hf["shared_intermediate_size"] = moe.shared_expert_hidden
  if spec.shared_expert:
    hf["shared_expert_intermediate_size"] = moe.shared_expert_hidden
    if not spec.all_moe:       # (a field of the config class: its dense MLP's width, unused)
      hf.setdefault("intermediate_size", moe.shared_expert_hidden)
  if spec.z_loss_key:
    hf[spec.z_loss_key] = moe.z_loss_weight
  for key, want, _ in spec.required:
    hf[key] = want
  hf.pop("quantization_config", None)      # exports are unquantized (FP8 imports dequantized)
  # transformers >= 5 writes "dtype"; older versions, and the Hub's configs, "torch_dtype".
  hf["dtype" if base and "dtype" in base else "torch_dtype"] = dtype
  rope = _rope_to_hf(m)
  if spec.partial_rotary is not None:
    hf["partial_rotary_factor"] = rope["partial_rotary_factor"] = _partial_rotary_factor(m)
  if spec.rotary_dim_key:                 # what other readers (vLLM) take
    hf[spec.rotary_dim_key] = m.rotary_dim or m.head_dim
  hf.pop("original_max_position_embeddings", None)     # it would win over the rope dict's
  if m.rope_scaling != "none":
    # transformers before 4.54 takes the factor from max_position_embeddings / original
    hf["max_position_embeddings"] = max(hf.get("max_position_embeddings") or 0,
                                        round(m.rope_original_max_len * m.rope_factor))
  if spec.rope_per_type:     # one dict per layer type; the sliding layers' own plain RoPE
    full = {"rope_theta": m.rope_theta, **rope}
    hf["rope_parameters"] = {"full_attention": full, "sliding_attention": (
        {"rope_type": "default", "rope_theta": m.sliding_rope_theta} if m.sliding_rope_theta
        else full)}
    hf.pop("rope_scaling", None)      # even null, transformers would read it over the dicts
    hf.pop("rope_theta")
  elif isinstance(hf.get("rope_parameters"), dict) or spec.default_rope or spec.cohere:
    # transformers >= 5's own layout (and where no dict would read as the class's YaRN)
    hf["rope_parameters"] = {"rope_theta": m.rope_theta, **rope}
    # the same scaling where transformers 4 (and readers of its field) look for it; it wins over
    # rope_parameters in transformers 5, so it says the same, or nothing
    hf["rope_scaling"] = _rope_scaling_field(m, rope)
  else:
    hf.pop("rope_parameters", None)
    hf["rope_scaling"] = _rope_scaling_field(m, rope)
  return dict(sorted(hf.items()))
