"""Which Hugging Face tensor holds each block of each moejax parameter, for every family.

Letters: L layers, E experts, D width, F expert hidden width, Fs shared expert width, V
vocabulary, HD = heads * head_dim, GD = kv heads * head_dim. A moejax leaf is `[*lead, *tail]`
with lead = () (embedding, head, final norm), (L,) (a layer parameter) or (L, E) (an expert
parameter); every lead index comes from one Hugging Face tensor (or one block of one). Linear
weights are stored [out, in] by torch and [in, out] by moejax, so their tails are transposed.
`MOE` below is `mlp` (OLMoE, Qwen) or `block_sparse_moe` (Mixtral's Hub layout).

  moejax leaf                 shape      Hugging Face tensor (layer i, expert e)          shape
  embed                       [V, D]     model.embed_tokens.weight                        [V, D]
  layers.attn.wq              [L, D, HD] model.layers.i.self_attn.q_proj.weight           [HD, D]^T
                                         (with model.attention_gate [L, D, 2HD], each head's
                                         query then gate rows; transformers' fused layout
                                         names MiniCPM5's q_gate_proj)
  layers.attn.wk / wv         [L, D, GD] model.layers.i.self_attn.{k,v}_proj.weight       [GD, D]^T
  layers.attn.wo              [L, HD, D] model.layers.i.self_attn.o_proj.weight           [D, HD]^T
  layers.attn.bq / bk / bv    [L, HD|GD] model.layers.i.self_attn.{q,k,v}_proj.bias       (Qwen2)
  layers.attn.q_norm / k_norm [L, *]     model.layers.i.self_attn.{q,k}_norm.weight       (OLMoE:
                                         HD / GD; Qwen3: head_dim; Mixtral, Qwen2: none)
  layers.attn_norm.scale      [L, D]     model.layers.i.input_layernorm.weight            [D]
  layers.ffn_norm.scale       [L, D]     model.layers.i.post_attention_layernorm.weight   [D]
                                         (none in a parallel block: Cohere2-MoE's one norm
                                         is input_layernorm)
                                         (FlexOlmo's, on the sublayers' outputs:
                                         post_attention_ and post_feedforward_layernorm;
                                         AfMoE's input_ and pre_mlp_layernorm)
  layers.attn_post_norm.scale [L, D]     (model.norm_position "sandwich", AfMoE)
  layers.ffn_post_norm.scale  [L, D]     model.layers.i.post_{attention,mlp}_layernorm.weight
  layers.attn.wg              [L, D, HD] model.layers.i.self_attn.gate_proj.weight        [HD, D]^T
                                         (model.attention_gate_own, AfMoE)
  layers.attn.sinks           [L, H]     model.layers.i.self_attn.sinks                   [H]
                                         (model.attention_sinks, Granite SWA; Flint's Hub
                                         layout: self_attn.softmax_offset)
  layers.moe.router           [L, D, E]  model.layers.i.MOE.gate.weight                   [E, D]^T
  layers.moe.w_gate           [L,E,D,F]  model.layers.i.MOE.experts.e.gate_proj.weight    [F, D]^T
  layers.moe.w_up             [L,E,D,F]  model.layers.i.MOE.experts.e.up_proj.weight      [F, D]^T
  layers.moe.w_down           [L,E,F,D]  model.layers.i.MOE.experts.e.down_proj.weight    [D, F]^T
                                         (Mixtral: experts.e.w1 / w3 / w2)
  layers.moe.shared_w_gate/up [L, D, Fs] model.layers.i.mlp.shared_expert.{gate,up}_proj.weight
  layers.moe.shared_w_down    [L, Fs, D] model.layers.i.mlp.shared_expert.down_proj.weight
  layers.moe.shared_gate      [L, D, 1]  model.layers.i.mlp.shared_expert_gate.weight     [1, D]^T
                                         (DeepSeek: mlp.shared_experts.*, no gate; Hy3's Hub
                                         layout: mlp.shared_mlp.*, its router mlp.router.gate,
                                         its score bias mlp.expert_bias)
  layers.moe.score_bias       [L, E]     model.layers.i.mlp.gate.e_score_correction_bias  [E]
                                         (MiniMax-M2: block_sparse_moe.e_score_correction_bias)
  layers.attn.wq_a / wq_b     latent attention (DeepSeek-V3): self_attn.q_a_proj / q_b_proj
  layers.attn.q_a_norm        (or q_proj without a q latent), q_a_layernorm, kv_a_proj_with_mqa,
  layers.attn.wkv_a / wkv_b   kv_b_proj (all [out, in]^T), kv_a_layernorm, o_proj
  layers.attn.kv_a_norm
  layers.attn.index_wq / ..    DeepSeek-V3.2's and GLM-5's indexer: self_attn.indexer.wq_b, wk,
                              weights_proj
  (index_wk, index_weights,   (the three [out, in]^T), k_norm.weight and k_norm.bias
   index_k_norm, _k_bias)
  dense_layers.*              the dense layers (model.dense_layers: DeepSeek's first k, Qwen's
                              mlp_only_layers): the same attention and norms, and
  dense_layers.mlp.w_gate/..  model.layers.i.mlp.{gate,up,down}_proj.weight; each group's j-th
                              layer is the j-th Hugging Face layer of its kind.
  final_norm                  [D]        model.norm.weight                                [D]
  lm_head                     [D, V]     lm_head.weight                                   [V, D]^T

That per-expert layout is what the Hub's checkpoints use and what `save_pretrained` writes by
default. transformers >= 5 holds experts fused in memory and, with
`save_pretrained(save_original_format=False)`, saves them so (Mixtral's `block_sparse_moe`
renamed `mlp`):
  model.layers.i.mlp.experts.gate_up_proj  [E, 2F, D]  (gate rows first, then up rows)
  model.layers.i.mlp.experts.down_proj     [E, D, F]
  model.layers.i.mlp.gate.weight           [E, D]
Import reads either layout; export writes the per-expert one.

gpt-oss (one layout, transformers' names; the Hub's MXFP4 experts read through
`safetensors_io`, dequantized): linear weights [out, in]^T as above, its experts [in, out] as
they are, gate and up interleaved, and biases on q, k, v, o, the router and the experts:
  layers.attn.bo              [L, D]     model.layers.i.self_attn.o_proj.bias
  layers.moe.router / router_b           model.layers.i.mlp.router.weight [E, D]^T / .bias [E]
  layers.moe.w_gate / w_up    [L,E,D,F]  model.layers.i.mlp.experts.gate_up_proj [E, D, 2F],
                                         columns 0, 2, 4, ... / 1, 3, 5, ...
  layers.moe.b_gate / b_up    [L, E, F]  model.layers.i.mlp.experts.gate_up_proj_bias [E, 2F], alike
  layers.moe.w_down           [L,E,F,D]  model.layers.i.mlp.experts.down_proj [E, F, D]
  layers.moe.b_down           [L, E, D]  model.layers.i.mlp.experts.down_proj_bias [E, D]

Llama 4 (one layout, transformers' names, under feed_forward): its experts [in, out] as they
are, gate and up as the two halves of gate_up_proj; the dense layers' MLP and the shared expert
under feed_forward too:
  layers.moe.router           [L, D, E]  model.layers.i.feed_forward.router.weight [E, D]^T
  layers.moe.w_gate / w_up    [L,E,D,F]  model.layers.i.feed_forward.experts.gate_up_proj
                                         [E, D, 2F], columns 0 .. F-1 / F .. 2F-1
  layers.moe.w_down           [L,E,F,D]  model.layers.i.feed_forward.experts.down_proj [E, F, D]
  layers.moe.shared_w_*                  model.layers.i.feed_forward.shared_expert.*_proj.weight
  dense_layers.mlp.w_*                   model.layers.i.feed_forward.*_proj.weight
Its published checkpoints are multimodal (Llama4ForConditionalGeneration): each name above
under language_model. (`TextLayout`), beside the vision encoder's, which import leaves.
Qwen3-VL-MoE's hold a Qwen3-MoE text model under model.language_model. with transformers' fused
expert names, [in, out] on the Hub (`IN_OUT_HALVES`, Llama 4's halves), [out, in] where
transformers 5 saved them (`FUSED`).
"""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from moejax.config import Config
from moejax.models import olmoe

PER_EXPERT = "per_expert"
FUSED = "fused"
# transformers' fused names held [in, out], gate's columns then up's (Qwen3-VL-MoE's Hub layout;
# transformers reads it by shape, `hf.load_hf`)
IN_OUT_HALVES = "in_out_halves"

# Tensors some checkpoints carry that hold no parameter (recomputed rotary tables).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class Source:
  """Block of a Hugging Face tensor that holds one lead index of a moejax leaf.

  The tensor is `[*prefix_dims, *tail_hf]`; the block is `tensor[prefix][row_offset + ...]`, where
  `row_offset` shifts the first tail axis (the gate or up half of a fused gate_up tensor), and
  `transpose` swaps the two tail axes to get moejax's [in, out]. `singleton`: the tensor has one
  more leading axis of size 1 (ERNIE's [1, E] score bias), read at index 0 and written back so.
  `stride` > 1: the block's last axis is the tensor's entries `column`, `column + stride`, ...
  (gpt-oss's fused gate_up_proj: gate and up alternate).
  """
  name: str
  prefix: tuple[int, ...] = ()
  row_offset: int = 0
  transpose: bool = False
  singleton: bool = False
  stride: int = 1          # the block is every `stride`-th entry of the tensor's last axis,
  column: int = 0          # from this one (gpt-oss's gate and up, interleaved; Llama 4's up:
                           # stride 1 from column F)
  in_columns: bool = False   # the block is part of the last axis (Llama 4's gate, column 0)
  # Whole-tensor sources (`whole`): the tensor's rows are `row_groups` groups of `group_rows`,
  # the block `group_take` rows of each from `row_offset` (Qwen3-Next's in_proj_qkvz: per key
  # head its q, k, v and z rows; one group: a row range of a tensor with a unit axis).
  row_groups: int = 1
  group_rows: int = 0
  group_take: int = 0
  unit_axis: int = -1      # >= 0: the tensor has an axis of size 1 there after the prefix,
                           # which the block drops (a depthwise Conv1d's [C, 1, K] weight)

  @property
  def whole(self) -> bool:
    """The block is cut from the whole tensor by row groups or past a unit axis (read whole)."""
    return self.row_groups > 1 or self.unit_axis >= 0

  def rows(self) -> int:
    """A `whole` source's tensor rows."""
    return self.row_groups * self.group_rows

  def from_tensor(self, tensor: np.ndarray) -> np.ndarray:
    """A `whole` source's block (in the tensor's orientation) from the tensor."""
    if self.unit_axis >= 0:
      tensor = np.take(tensor, 0, axis=self.unit_axis)
    grouped = tensor.reshape(self.row_groups, self.group_rows, *tensor.shape[1:])
    return grouped[:, self.row_offset:self.row_offset + self.group_take].reshape(
        self.row_groups * self.group_take, *tensor.shape[1:])

  def block_of(self, tensor: np.ndarray) -> np.ndarray:
    """A `whole` source's block as moejax holds it ([in, out]: transposed where it is)."""
    block = self.from_tensor(tensor)
    return block.T if self.transpose else block

  def into_tensor(self, out: np.ndarray, block: np.ndarray) -> None:
    """Writes a `whole` source's block (in the tensor's orientation) into the tensor `out`."""
    if self.unit_axis >= 0:
      out = np.moveaxis(out, self.unit_axis, 0)[0]      # a view without the unit axis
    grouped = out.reshape(self.row_groups, self.group_rows, *out.shape[1:])
    grouped[:, self.row_offset:self.row_offset + self.group_take] = block.reshape(
        self.row_groups, self.group_take, *block.shape[1:])

  @property
  def by_column(self) -> bool:
    """The block is a column range or stride of its tensor's last axis."""
    return self.in_columns or self.stride > 1 or self.column > 0

  def columns(self, start: int, stop: int) -> slice:
    """The tensor's last-axis entries of the block's columns start .. stop - 1."""
    return slice(self.column + start * self.stride,
                 self.column + (stop - 1) * self.stride + 1 if stop > start else
                 self.column + start * self.stride, self.stride)


@dataclasses.dataclass(frozen=True)
class LeafMap:
  path: tuple[str, ...]          # moejax parameter path, e.g. ("layers", "moe", "w_gate")
  shape: tuple[int, ...]         # moejax leaf shape
  lead: int                      # how many leading axes index Hugging Face tensors (0, 1 or 2)
  sources: dict                  # lead index tuple -> Source

  @property
  def tail(self) -> tuple[int, ...]:
    return self.shape[self.lead:]


def _layer(i: int) -> str:
  return f"model.layers.{i}"


def hf_layer_of(name: str) -> int | None:
  """The Hugging Face layer index a tensor name belongs to (None outside the layers)."""
  parts = name.split(".")
  if parts[:2] == ["model", "layers"] and len(parts) > 2 and parts[2].isdigit():
    return int(parts[2])
  return None


# Per family (Hub layout): the MoE block's module name, its experts' (gate, up, down) names and
# its shared expert's module name.
HUB_EXPERT_NAMES = {
    "olmoe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_next": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_5_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "minimax_m2": ("block_sparse_moe", ("w1", "w3", "w2")),
    "glm4_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "dots1": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "ernie4_5_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "deepseek_v2": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "deepseek_v3": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "deepseek_v32": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "glm_moe_dsa": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "glm4_moe_lite": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "solar_open": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "minicpm5_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "hy_v3": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "exaone_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "granitemoe": ("block_sparse_moe", ("gate_proj", "up_proj", "down_proj")),
    "granitemoeshared": ("block_sparse_moe", ("gate_proj", "up_proj", "down_proj")),
    "granitemoehybrid": ("block_sparse_moe", ("gate_proj", "up_proj", "down_proj")),
    "sarvam_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "param2moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "flex_olmo": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "hunyuan_v1_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "afmoe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "granitemoe_swa": ("block_sparse_moe", ("gate_proj", "up_proj", "down_proj")),
    "flint": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "kolibri1": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mellum": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "gpt_oss": ("mlp", ("gate_proj", "up_proj", "down_proj")),    # (unused: IN_OUT_EXPERTS)
    "cohere2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "llama4": ("feed_forward", ("gate_proj", "up_proj", "down_proj")),   # (IN_OUT_EXPERTS)
}
# Families whose experts are held fused in both layouts, [in, out]: (gate_up, down) under the
# MoE block's module, and how gate and up share gate_up's columns ("interleaved": every other
# one, gpt-oss's, with biases; "halves": gate's then up's, Llama 4's).
IN_OUT_EXPERTS = {"gpt_oss": ("experts.gate_up_proj", "experts.down_proj", "interleaved"),
                  "llama4": ("experts.gate_up_proj", "experts.down_proj", "halves")}
# The MoE block's module in both layouts where it is not `mlp` (Llama 4's feed_forward, which
# also holds its dense layers' MLP and its shared expert).
FEED_FORWARD_MODULE = {"llama4": "feed_forward"}
# The attention's sinks where the Hub's layout names them otherwise (transformers: sinks).
HUB_SINKS_NAME = {"flint": "softmax_offset"}
# The attention's q and k norms where they are not q_norm and k_norm (both layouts).
QK_NORM_NAMES = {"hunyuan_v1_moe": ("query_layernorm", "key_layernorm")}
# Families whose Hub layout names the attention otherwise (transformers renames it on load):
# its module, the fused q/k/v projection (q rows, then k, then v; bias alike), the output
# projection, the q-norm and the k-norm; and the embedding.
_SARVAM_ATTENTION = ("attention", "query_key_value", "dense", "query_layernorm", "key_layernorm")
HUB_ATTENTION_NAMES = {"sarvam_moe": _SARVAM_ATTENTION, "param2moe": _SARVAM_ATTENTION}
HUB_EMBED_NAME = {"sarvam_moe": "model.word_embeddings.weight",
                  "param2moe": "model.word_embeddings.weight"}
# Families whose Hub layout holds each layer's experts fused too, under these names (the gate
# rows of every expert, then its up rows: [E, 2F, D]; down: [E, D, F]): Granite's.
HUB_FUSED_EXPERTS = {"granitemoe": ("input_linear.weight", "output_linear.weight"),
                     "granitemoeshared": ("input_linear.weight", "output_linear.weight"),
                     "granitemoehybrid": ("input_linear.weight", "output_linear.weight"),
                     # Granite SWA's: transformers' own fused names (it converts no other)
                     "granitemoe_swa": ("experts.gate_up_proj", "experts.down_proj")}
# The MoE block's module in transformers' fused layout where it is not `mlp`.
FUSED_MOE_MODULE = {"granitemoe": "block_sparse_moe", "granitemoeshared": "block_sparse_moe",
                    "granitemoehybrid": "block_sparse_moe", "granitemoe_swa": "block_sparse_moe"}
# Shared experts held fused at the layer's level, [gate rows; up rows] then down (Granite's
# shared_mlp.input_linear / output_linear).
FUSED_SHARED_MODULE = {"granitemoeshared": "shared_mlp", "granitemoehybrid": "shared_mlp",
                       "granitemoe_swa": "shared_mlp"}
SHARED_EXPERT_MODULE = {"qwen2_moe": "shared_expert", "qwen3_next": "shared_expert",
                        "qwen3_5_moe": "shared_expert",
                        "glm4_moe": "shared_experts",
                        "dots1": "shared_experts", "ernie4_5_moe": "shared_experts",
                        "deepseek_v2": "shared_experts", "deepseek_v3": "shared_experts",
                        "deepseek_v32": "shared_experts", "glm_moe_dsa": "shared_experts",
                        "glm4_moe_lite": "shared_experts", "solar_open": "shared_experts",
                        "minicpm5_moe": "shared_experts", "hy_v3": "shared_experts",
                        "exaone_moe": "shared_experts", "sarvam_moe": "shared_experts",
                        "param2moe": "shared_experts", "hunyuan_v1_moe": "shared_mlp",
                        "afmoe": "shared_experts", "kolibri1": "shared_experts",
                        "cohere2_moe": "shared_experts", "llama4": "shared_expert"}
# ... where the Hub's layout names it otherwise (transformers renames it on load)
HUB_SHARED_EXPERT_MODULE = {"hy_v3": "shared_mlp"}
# A layer's two norms where they are not input_layernorm and post_attention_layernorm: FlexOlmo's
# sit on the sublayers' outputs (model.norm_position "post"); AfMoE's input norms, then its
# output norms (model.norm_position "sandwich": attn_post_norm, ffn_post_norm).
NORM_NAMES = {"flex_olmo": ("post_attention_layernorm", "post_feedforward_layernorm"),
              "afmoe": ("input_layernorm", "pre_mlp_layernorm")}
# ... and the output norms (Hub layout, transformers' fused one)
POST_NORM_NAMES = {
    "afmoe": (("post_attention_layernorm", "post_mlp_layernorm"),) * 2,
    "kolibri1": (("post_attn_norm", "post_ffn_norm"),
                 ("post_self_attn_layernorm", "post_mlp_layernorm"))}
# A score bias the Hub's layout keeps outside the MoE block, under the layer (Kolibri's; its
# fused layout: mlp.gate.e_score_correction_bias).
HUB_LAYER_SCORE_BIAS = {"kolibri1": "moe.router.expert_bias"}
# The router's module under the MoE block where it is not `gate`: (Hub layout, fused layout).
ROUTER_NAME = {"hy_v3": ("router.gate", "gate"), "granitemoe": ("router.layer", "router"),
               "granitemoeshared": ("router.layer", "router"),
               "granitemoehybrid": ("router.layer", "router"),
               "hunyuan_v1_moe": ("gate.wg", "gate.wg"), "afmoe": ("router.gate", "router.gate"),
               "granitemoe_swa": ("router", "router"), "gpt_oss": ("router", "router"),
               "llama4": ("router", "router")}
# The q projection of families whose attention has an output gate (`model.attention_gate`): each
# head's query rows followed by its gate rows, under this name in transformers' fused layout
# (the Hub's keeps q_proj; transformers renames it on load).
GATED_Q_NAME = {"minicpm5_moe": "q_gate_proj"}
# Families whose checkpoints hold multi-token-prediction layers after the last one (transformers
# does not load them either).
MTP_FAMILIES = ("minimax_m2", "glm4_moe", "deepseek_v3", "deepseek_v32", "glm_moe_dsa",
                "glm4_moe_lite", "hy_v3")
# Where the MoE block keeps its score bias, under its module (the others': gate.), in the Hub's
# layout and in transformers 5's fused one.
SCORE_BIAS_NAME = {"minimax_m2": ("e_score_correction_bias", "e_score_correction_bias"),
                   "ernie4_5_moe": ("moe_statics.e_score_correction_bias",
                                    "gate.moe_statics.e_score_correction_bias"),
                   "hy_v3": ("expert_bias", "e_score_correction_bias"),
                   "exaone_moe": ("e_score_correction_bias", "gate.e_score_correction_bias"),
                   "sarvam_moe": ("gate.expert_bias", "gate.e_score_correction_bias"),
                   "param2moe": ("gate.expert_bias", "gate.e_score_correction_bias"),
                   "afmoe": ("expert_bias", "expert_bias")}
# ... held [1, E] rather than [E]
SCORE_BIAS_SINGLETON = ("ernie4_5_moe",)
# Families whose checkpoints hold multi-token-prediction tensors under names with "mtp"
# (transformers' _keys_to_ignore_on_load_unexpected).
MTP_NAMED = ("ernie4_5_moe", "exaone_moe", "mellum", "qwen3_next", "qwen3_5_moe")


# Families whose Gated DeltaNet projects q, k and v in one tensor's rows (all q, all k, all v)
# and z, b and a in their own (Qwen3.5's), not grouped per key head (Qwen3-Next's)
SPLIT_LINEAR_PROJECTIONS = ("qwen3_5_moe",)


def _mamba_maps(cfg: Config, per_layer) -> None:
  """Mamba-2 (Granite-4.0-H's `mamba`): in_proj's rows are z, x, B, C, then dt; conv1d's
  [C, 1, K] taps and its bias over x, B and C; D is the skip, norm the gated norm's scale."""
  m = cfg.model
  D, K = m.d_model, m.linear_conv_taps
  inner, bc, H = m.linear_value_heads * m.linear_value_dim, m.linear_key_heads * m.linear_key_dim, \
      m.linear_value_heads
  for path, tail, offset in (("wz", inner, 0), ("wx", inner, inner), ("wb", bc, 2 * inner),
                             ("wc", bc, 2 * inner + bc), ("wdt", H, 2 * inner + 2 * bc)):
    per_layer(("attn", path), (D, tail), "mamba.in_proj.weight", True, row_offset=offset)
  channels = inner + 2 * bc
  for path, offset, take in (("conv_x", 0, inner), ("conv_b", inner, bc),
                             ("conv_c", inner + bc, bc)):
    per_layer(("attn", path), (K, take), "mamba.conv1d.weight", True, row_offset=offset,
              group_rows=channels, group_take=take, unit_axis=1)
    per_layer(("attn", f"{path}_bias"), (take,), "mamba.conv1d.bias", False, row_offset=offset)
  per_layer(("attn", "dt_bias"), (H,), "mamba.dt_bias", False)
  per_layer(("attn", "a_log"), (H,), "mamba.A_log", False)
  per_layer(("attn", "d_skip"), (H,), "mamba.D", False)
  per_layer(("attn", "out_norm"), (inner,), "mamba.norm.weight", False)
  per_layer(("attn", "wo"), (inner, D), "mamba.out_proj.weight", True)


def _linear_attention_maps(cfg: Config, per_layer) -> None:
  """Gated DeltaNet (`linear_attn`). Qwen3-Next's in_proj_qkvz's rows are, per key head, its q,
  its k, then its value heads' v and z; in_proj_ba's its value heads' b then a. Qwen3.5's
  in_proj_qkv holds every q, then every k, then every v; in_proj_z, in_proj_b and in_proj_a their
  own. conv1d's [C, 1, K] taps over q, k and v."""
  m = cfg.model
  D, Hk, Hv, Dk, Dv = (m.d_model, m.linear_key_heads, m.linear_value_heads, m.linear_key_dim,
                       m.linear_value_dim)
  r, K = Hv // Hk, m.linear_conv_taps
  if m.family in SPLIT_LINEAR_PROJECTIONS:
    for path, tail, offset in (("wq", Hk * Dk, 0), ("wk", Hk * Dk, Hk * Dk),
                               ("wv", Hv * Dv, 2 * Hk * Dk)):
      per_layer(("attn", path), (D, tail), "linear_attn.in_proj_qkv.weight", True,
                row_offset=offset)
    for path, tail, name in (("wz", Hv * Dv, "z"), ("wb", Hv, "b"), ("wa", Hv, "a")):
      per_layer(("attn", path), (D, tail), f"linear_attn.in_proj_{name}.weight", True)
  else:
    width = 2 * Dk + 2 * r * Dv
    for path, tail, offset, take in (("wq", Hk * Dk, 0, Dk), ("wk", Hk * Dk, Dk, Dk),
                                     ("wv", Hv * Dv, 2 * Dk, r * Dv),
                                     ("wz", Hv * Dv, 2 * Dk + r * Dv, r * Dv)):
      per_layer(("attn", path), (D, tail), "linear_attn.in_proj_qkvz.weight", True,
                row_offset=offset, row_groups=Hk, group_rows=width, group_take=take)
    for path, offset in (("wb", 0), ("wa", r)):
      per_layer(("attn", path), (D, Hv), "linear_attn.in_proj_ba.weight", True,
                row_offset=offset, row_groups=Hk, group_rows=2 * r, group_take=r)
  channels = 2 * Hk * Dk + Hv * Dv
  for path, offset, take in (("conv_q", 0, Hk * Dk), ("conv_k", Hk * Dk, Hk * Dk),
                             ("conv_v", 2 * Hk * Dk, Hv * Dv)):
    per_layer(("attn", path), (K, take), "linear_attn.conv1d.weight", True, row_offset=offset,
              group_rows=channels, group_take=take, unit_axis=1)
  per_layer(("attn", "dt_bias"), (Hv,), "linear_attn.dt_bias", False)
  per_layer(("attn", "a_log"), (Hv,), "linear_attn.A_log", False)
  per_layer(("attn", "out_norm"), (Dv,), "linear_attn.norm.weight", False)
  per_layer(("attn", "wo"), (Hv * Dv, D), "linear_attn.out_proj.weight", True)


def _attention_maps(cfg: Config, per_layer, experts: str) -> None:
  m = cfg.model
  D, HD = m.d_model, m.num_heads * m.head_dim
  if m.kv_lora_rank:          # multi-head latent attention (DeepSeek-V2/V3)
    H, R, Dr = m.num_heads, m.kv_lora_rank, m.qk_rope_head_dim
    qk = m.qk_nope_head_dim + Dr
    if m.q_lora_rank:
      per_layer(("attn", "wq_a"), (D, m.q_lora_rank), "self_attn.q_a_proj.weight", True)
      per_layer(("attn", "q_a_norm"), (m.q_lora_rank,), "self_attn.q_a_layernorm.weight", False)
      per_layer(("attn", "wq_b"), (m.q_lora_rank, H * qk), "self_attn.q_b_proj.weight", True)
    else:
      per_layer(("attn", "wq"), (D, H * qk), "self_attn.q_proj.weight", True)
    per_layer(("attn", "wkv_a"), (D, R + Dr), "self_attn.kv_a_proj_with_mqa.weight", True)
    per_layer(("attn", "kv_a_norm"), (R,), "self_attn.kv_a_layernorm.weight", False)
    per_layer(("attn", "wkv_b"), (R, H * (m.qk_nope_head_dim + m.v_head_dim)),
              "self_attn.kv_b_proj.weight", True)
    per_layer(("attn", "wo"), (H * m.v_head_dim, D), "self_attn.o_proj.weight", True)
    if m.index_topk:          # DeepSeek-V3.2's indexer
      Hi, Di = m.index_heads, m.index_head_dim
      for path, tail, name, transpose in (
          ("index_wq", (m.q_lora_rank, Hi * Di), "wq_b.weight", True),
          ("index_wk", (D, Di), "wk.weight", True),
          ("index_k_norm", (Di,), "k_norm.weight", False),
          ("index_k_bias", (Di,), "k_norm.bias", False),
          ("index_weights", (D, Hi), "weights_proj.weight", True)):
        per_layer(("attn", path), tail, f"self_attn.indexer.{name}", transpose)
    return
  GD = (m.num_kv_heads or m.num_heads) * m.head_dim
  # each head's query and gate rows (unless the gate has its own projection)
  QD = 2 * HD if m.attention_gate and not m.attention_gate_own else HD
  # (tensor, first row) of q, k and v; the module, output projection and q/k norms
  hub = HUB_ATTENTION_NAMES.get(m.family) if experts != FUSED else None
  if hub:                   # q, k, v fused in one projection's rows
    module, qkv, out, q_norm, k_norm = hub
    projections = ((qkv, 0), (qkv, QD), (qkv, QD + GD))
  else:
    module, out = "self_attn", "o_proj"
    q_norm, k_norm = QK_NORM_NAMES.get(m.family, ("q_norm", "k_norm"))
    gated = m.attention_gate and not m.attention_gate_own and experts == FUSED
    q_name = GATED_Q_NAME.get(m.family, "q_proj") if gated else "q_proj"
    projections = ((q_name, 0), ("k_proj", 0), ("v_proj", 0))
  parts = tuple(zip("qkv", (QD, GD, GD), projections))
  for part, width, (tensor, offset) in parts:
    per_layer(("attn", f"w{part}"), (D, width), f"{module}.{tensor}.weight", True,
              row_offset=offset)
  per_layer(("attn", "wo"), (HD, D), f"{module}.{out}.weight", True)
  if m.attention_out_bias:
    per_layer(("attn", "bo"), (D,), f"{module}.{out}.bias", False)
  if m.attention_sinks:
    sinks = HUB_SINKS_NAME.get(m.family, "sinks") if experts != FUSED else "sinks"
    per_layer(("attn", "sinks"), (m.num_heads,), f"{module}.{sinks}", False)
  if m.attention_gate_own:
    per_layer(("attn", "wg"), (D, HD), f"{module}.gate_proj.weight", True)
  if m.qkv_bias:
    for part, width, (tensor, offset) in parts:
      per_layer(("attn", f"b{part}"), (width,), f"{module}.{tensor}.bias", False,
                row_offset=offset)
  if m.qk_norm in ("full", "head"):      # ("l2" has no scale)
    q_width, k_width = (HD, GD) if m.qk_norm == "full" else (m.head_dim, m.head_dim)
    per_layer(("attn", "q_norm"), (q_width,), f"{module}.{q_norm}.weight", False)
    per_layer(("attn", "k_norm"), (k_width,), f"{module}.{k_norm}.weight", False)


@dataclasses.dataclass(frozen=True)
class TextLayout:
  """Where a multimodal checkpoint keeps its text model's tensors, beside the vision encoder's
  (which hold no moejax parameter): every name under `outer` (Llama 4's and Kimi-K2.5's
  language_model.model.layers..., language_model.lm_head.weight), or the model's own under
  model.`inner` (Qwen3-VL-MoE's model.language_model.layers..., lm_head.weight as it is). The
  default holds a text model's own names."""
  outer: str = ""
  inner: str = ""

  def name(self, text_name: str) -> str:
    """The checkpoint's name of the text model's tensor `text_name`."""
    if self.inner and text_name.startswith("model."):
      text_name = "model." + self.inner + text_name[len("model."):]
    return self.outer + text_name

  def text_name(self, name: str) -> str | None:
    """The text model's name of the checkpoint's tensor `name`; None outside the text model."""
    if not name.startswith(self.outer):
      return None
    name = name[len(self.outer):]
    if self.inner and name.startswith("model."):
      inside = name[len("model."):]
      return "model." + inside[len(self.inner):] if inside.startswith(self.inner) else None
    return name


TEXT_MODEL = TextLayout()


def leaf_maps(cfg: Config, experts: str = PER_EXPERT,
              layout: TextLayout = TEXT_MODEL) -> list[LeafMap]:
  """One LeafMap per moejax parameter, in the order of the exported files; its tensors named as
  `layout` places them."""
  maps = _leaf_maps(cfg, experts)
  if layout == TEXT_MODEL:
    return maps
  return [dataclasses.replace(leaf, sources={
      lead: dataclasses.replace(src, name=layout.name(src.name))
      for lead, src in leaf.sources.items()}) for leaf in maps]


def _leaf_maps(cfg: Config, experts: str) -> list[LeafMap]:
  m, moe = cfg.model, cfg.moe
  E, D, F, V = moe.num_experts, m.d_model, moe.expert_hidden, m.vocab_size
  Fs = moe.shared_expert_hidden
  hub_moe, (gate_name, up_name, down_name) = HUB_EXPERT_NAMES[m.family]
  feed_forward = FEED_FORWARD_MODULE.get(m.family, "mlp")
  moe_module = FUSED_MOE_MODULE.get(m.family, feed_forward) if experts == FUSED else hub_moe
  fused_names = (("experts.gate_up_proj", "experts.down_proj") if experts == FUSED
                 else HUB_FUSED_EXPERTS.get(m.family))
  embed_name = (HUB_EMBED_NAME.get(m.family, "model.embed_tokens.weight") if experts != FUSED
                else "model.embed_tokens.weight")
  maps = [LeafMap(("embed",), (V, D), 0, {(): Source(embed_name)})]
  # (group, the Hugging Face index of each of its layers), as the model stacks them
  groups = {group: [] for group in olmoe.layer_groups(cfg)}
  for i, (group, _) in enumerate(olmoe.layer_group_of(cfg)):
    groups[group].append(i)

  for group, hf_ids in groups.items():
    count = len(hf_ids)

    def per_layer(path, tail, suffix, transpose, group=group, hf_ids=hf_ids, singleton=False,
                  **where):
      sources = {(i,): Source(f"{_layer(hf_i)}.{suffix}", transpose=transpose,
                              prefix=(0,) if singleton else (), singleton=singleton, **where)
                 for i, hf_i in enumerate(hf_ids)}
      maps.append(LeafMap((group, *path), (len(hf_ids), *tail), 1, sources))

    if group in olmoe.LINEAR_GROUPS:
      (_mamba_maps if m.linear_kind == "mamba2" else _linear_attention_maps)(cfg, per_layer)
    else:
      _attention_maps(cfg, per_layer, experts)
    attn_norm, ffn_norm = NORM_NAMES.get(m.family, ("input_layernorm", "post_attention_layernorm"))
    per_layer(("attn_norm", "scale"), (D,), f"{attn_norm}.weight", False)
    if m.norm_position != "parallel":      # the parallel block's one norm feeds both
      per_layer(("ffn_norm", "scale"), (D,), f"{ffn_norm}.weight", False)
    if m.norm_position == "sandwich":
      post = POST_NORM_NAMES.get(m.family, POST_NORM_NAMES["afmoe"])[experts == FUSED]
      for path, name in zip(("attn_post_norm", "ffn_post_norm"), post):
        per_layer((path, "scale"), (D,), f"{name}.weight", False)
    if group not in olmoe.MOE_GROUPS:
      for name, tail, hf_name in (("w_gate", (D, m.dense_hidden), "gate_proj"),
                                  ("w_up", (D, m.dense_hidden), "up_proj"),
                                  ("w_down", (m.dense_hidden, D), "down_proj")):
        per_layer(("mlp", name), tail, f"{feed_forward}.{hf_name}.weight", True)
      continue
    router = ROUTER_NAME.get(m.family, ("gate", "gate"))[experts == FUSED]
    per_layer(("moe", "router"), (D, E), f"{moe_module}.{router}.weight", True)
    if moe.router_bias:
      per_layer(("moe", "router_b"), (E,), f"{moe_module}.{router}.bias", False)
    if moe.score_bias:
      hub_bias, fused_bias = SCORE_BIAS_NAME.get(m.family, ("gate.e_score_correction_bias",) * 2)
      bias = fused_bias if experts == FUSED else hub_bias
      path = f"{moe_module}.{bias}"
      if experts != FUSED and m.family in HUB_LAYER_SCORE_BIAS:
        path = HUB_LAYER_SCORE_BIAS[m.family]
      per_layer(("moe", "score_bias"), (E,), path, False,
                singleton=m.family in SCORE_BIAS_SINGLETON)
    if m.family in IN_OUT_EXPERTS or experts == IN_OUT_HALVES:
      held = IN_OUT_EXPERTS.get(m.family, ("experts.gate_up_proj", "experts.down_proj", "halves"))
      maps.extend(_in_out_expert_maps(cfg, group, hf_ids, f"{moe_module}.", moe.expert_bias,
                                      held))
    else:
      for name, tail, hf_name, offset in (("w_gate", (D, F), gate_name, 0),
                                          ("w_up", (D, F), up_name, F),
                                          ("w_down", (F, D), down_name, 0)):
        sources = {}
        for i, e in itertools.product(range(count), range(E)):
          if fused_names:
            fused = fused_names[name == "w_down"]
            sources[(i, e)] = Source(f"{_layer(hf_ids[i])}.{moe_module}.{fused}", prefix=(e,),
                                     row_offset=offset, transpose=True)
          else:
            sources[(i, e)] = Source(
                f"{_layer(hf_ids[i])}.{moe_module}.experts.{e}.{hf_name}.weight", transpose=True)
        maps.append(LeafMap((group, "moe", name), (count, E, *tail), 2, sources))
    if Fs and m.family in FUSED_SHARED_MODULE:
      shared = FUSED_SHARED_MODULE[m.family]
      for name, tail, hf_name, offset in (("shared_w_gate", (D, Fs), "input_linear", 0),
                                          ("shared_w_up", (D, Fs), "input_linear", Fs),
                                          ("shared_w_down", (Fs, D), "output_linear", 0)):
        per_layer(("moe", name), tail, f"{shared}.{hf_name}.weight", True, row_offset=offset)
    elif Fs:
      shared = SHARED_EXPERT_MODULE.get(m.family, "shared_expert")
      if experts != FUSED:
        shared = HUB_SHARED_EXPERT_MODULE.get(m.family, shared)
      for name, tail, hf_name in (("shared_w_gate", (D, Fs), "gate_proj"),
                                  ("shared_w_up", (D, Fs), "up_proj"),
                                  ("shared_w_down", (Fs, D), "down_proj")):
        per_layer(("moe", name), tail, f"{feed_forward}.{shared}.{hf_name}.weight", True)
      if moe.shared_expert_gate:
        per_layer(("moe", "shared_gate"), (D, 1), "mlp.shared_expert_gate.weight", True)

  maps.append(LeafMap(("final_norm",), (D,), 0, {(): Source("model.norm.weight")}))
  if not m.tie_embeddings:
    maps.append(LeafMap(("lm_head",), (D, V), 0, {(): Source("lm_head.weight", transpose=True)}))
  return maps


def _in_out_expert_maps(cfg: Config, group: str, hf_ids: list, module: str,
                        bias: bool, held: tuple) -> list[LeafMap]:
  """Experts held [in, out] as moejax holds them: gate_up_proj [E, D, 2F] (gpt-oss: gate in the
  even columns, up in the odd ones; Llama 4: gate's F columns, then up's) and down_proj
  [E, F, D]; their biases alike."""
  moe, D = cfg.moe, cfg.model.d_model
  E, F = moe.num_experts, moe.expert_hidden
  gate_up, down, split = held
  # (stride, column) of gate's and up's columns
  gate, up = ((2, 0), (2, 1)) if split == "interleaved" else ((1, 0), (1, F))
  whole = (1, 0)
  leaves = [("w_gate", (D, F), gate_up, gate), ("w_up", (D, F), gate_up, up),
            ("w_down", (F, D), down, whole)]
  if bias:
    leaves += [("b_gate", (F,), gate_up + "_bias", gate), ("b_up", (F,), gate_up + "_bias", up),
               ("b_down", (D,), down + "_bias", whole)]
  maps = []
  for name, tail, tensor, (stride, column) in leaves:
    sources = {(i, e): Source(f"{_layer(hf_i)}.{module}{tensor}", prefix=(e,),
                              stride=stride, column=column,
                              in_columns=tensor.startswith(gate_up))
               for (i, hf_i), e in itertools.product(enumerate(hf_ids), range(E))}
    maps.append(LeafMap((group, "moe", name), (len(hf_ids), E, *tail), 2, sources))
  return maps


def expected_shapes(cfg: Config, experts: str = PER_EXPERT,
                    layout: TextLayout = TEXT_MODEL) -> dict[str, tuple[int, ...]]:
  """Hugging Face tensor name -> the full shape `cfg` implies for it: the extent of every block
  its sources read (a fused tensor's experts along the prefix, its gate and up rows along the
  first tail axis)."""
  shapes = {}
  for leaf in leaf_maps(cfg, experts, layout):
    for src in leaf.sources.values():
      tail = list(leaf.tail[::-1] if src.transpose else leaf.tail)
      if src.whole:
        tail[0] = src.rows()
        if src.unit_axis >= 0:
          tail.insert(src.unit_axis, 1)
      else:
        tail[0] += src.row_offset
      tail[-1] = src.columns(0, tail[-1]).stop
      shape = (*(p + 1 for p in src.prefix), *tail)
      old = shapes.get(src.name)
      shapes[src.name] = shape if old is None else tuple(max(a, b) for a, b in zip(old, shape))
  return shapes


def detect_expert_layout(names) -> str:
  return FUSED if any(n.endswith(".experts.gate_up_proj") for n in names) else PER_EXPERT


def is_ignored(name: str, cfg: Config | None = None, layout: TextLayout = TEXT_MODEL) -> bool:
  """Tensors that hold no moejax parameter: recomputed rotary tables; those outside the text
  model as `layout` places it (a multimodal checkpoint's vision encoder); with `cfg`, layers past
  its last (DeepSeek-V3's and GLM-4.5's multi-token-prediction layers, which transformers does
  not load either) and a tied LM head's copy of the embedding."""
  if name.endswith(IGNORED_SUFFIXES):
    return True
  name = layout.text_name(name)
  if name is None:
    return True
  if cfg is None:
    return False
  if cfg.model.family in MTP_NAMED and "mtp" in name:
    return True
  layer = hf_layer_of(name)
  if layer is not None and layer >= cfg.model.num_layers and cfg.model.family in MTP_FAMILIES:
    return True
  return cfg.model.tie_embeddings and name == "lm_head.weight"
