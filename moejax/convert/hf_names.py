"""Which Hugging Face `OlmoeForCausalLM` tensor holds each block of each moejax parameter.

Letters: L layers, E experts, D width, F expert hidden width, V vocabulary, HD = heads * head_dim.
A moejax leaf is `[*lead, *tail]` with lead = () (embedding, head, final norm), (L,) (a layer
parameter) or (L, E) (an expert parameter); every lead index comes from one Hugging Face tensor
(or one block of one). Linear weights are stored [out, in] by torch and [in, out] by moejax, so
their tails are transposed.

  moejax leaf                 shape      Hugging Face tensor (layer i, expert e)          shape
  embed                       [V, D]     model.embed_tokens.weight                        [V, D]
  layers.attn.wq / wk / wv    [L, D, HD] model.layers.i.self_attn.{q,k,v}_proj.weight     [HD, D]^T
  layers.attn.wo              [L, HD, D] model.layers.i.self_attn.o_proj.weight           [D, HD]^T
  layers.attn.q_norm / k_norm [L, HD]    model.layers.i.self_attn.{q,k}_norm.weight       [HD]
  layers.attn_norm.scale      [L, D]     model.layers.i.input_layernorm.weight            [D]
  layers.ffn_norm.scale       [L, D]     model.layers.i.post_attention_layernorm.weight   [D]
  layers.moe.router           [L, D, E]  model.layers.i.mlp.gate.weight                   [E, D]^T
  layers.moe.w_gate           [L,E,D,F]  model.layers.i.mlp.experts.e.gate_proj.weight    [F, D]^T
  layers.moe.w_up             [L,E,D,F]  model.layers.i.mlp.experts.e.up_proj.weight      [F, D]^T
  layers.moe.w_down           [L,E,F,D]  model.layers.i.mlp.experts.e.down_proj.weight    [D, F]^T
  final_norm                  [D]        model.norm.weight                                [D]
  lm_head                     [D, V]     lm_head.weight                                   [V, D]^T

That per-expert layout is what the Hub's OLMoE checkpoints use and what `save_pretrained` writes
by default. transformers >= 5 holds experts fused in memory and, with
`save_pretrained(save_original_format=False)`, saves them so:
  model.layers.i.mlp.experts.gate_up_proj  [E, 2F, D]  (gate rows first, then up rows)
  model.layers.i.mlp.experts.down_proj     [E, D, F]
Import reads either layout; export writes the per-expert one.
"""
from __future__ import annotations

import dataclasses
import itertools

from moejax.config import Config

PER_EXPERT = "per_expert"
FUSED = "fused"

# Tensors some checkpoints carry that hold no parameter (recomputed rotary tables).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class Source:
  """Block of a Hugging Face tensor that holds one lead index of a moejax leaf.

  The tensor is `[*prefix_dims, *tail_hf]`; the block is `tensor[prefix][row_offset + ...]`, where
  `row_offset` shifts the first tail axis (the gate or up half of a fused gate_up tensor), and
  `transpose` swaps the two tail axes to get moejax's [in, out].
  """
  name: str
  prefix: tuple[int, ...] = ()
  row_offset: int = 0
  transpose: bool = False


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


def leaf_maps(cfg: Config, experts: str = PER_EXPERT) -> list[LeafMap]:
  """One LeafMap per moejax parameter, in the order of the exported files."""
  m, moe = cfg.model, cfg.moe
  L, E, D, F, V = m.num_layers, moe.num_experts, m.d_model, moe.expert_hidden, m.vocab_size
  HD = m.num_heads * m.head_dim
  maps = [LeafMap(("embed",), (V, D), 0, {(): Source("model.embed_tokens.weight")})]

  def per_layer(path, tail, suffix, transpose):
    sources = {(i,): Source(f"{_layer(i)}.{suffix}", transpose=transpose) for i in range(L)}
    maps.append(LeafMap(("layers", *path), (L, *tail), 1, sources))

  for name, tail in (("wq", (D, HD)), ("wk", (D, HD)), ("wv", (D, HD)), ("wo", (HD, D))):
    per_layer(("attn", name), tail, f"self_attn.{name[1]}_proj.weight", True)
  per_layer(("attn", "q_norm"), (HD,), "self_attn.q_norm.weight", False)
  per_layer(("attn", "k_norm"), (HD,), "self_attn.k_norm.weight", False)
  per_layer(("attn_norm", "scale"), (D,), "input_layernorm.weight", False)
  per_layer(("ffn_norm", "scale"), (D,), "post_attention_layernorm.weight", False)
  per_layer(("moe", "router"), (D, E), "mlp.gate.weight", True)

  for name, tail, hf_name, offset in (("w_gate", (D, F), "gate_proj", 0),
                                      ("w_up", (D, F), "up_proj", F),
                                      ("w_down", (F, D), "down_proj", 0)):
    sources = {}
    for i, e in itertools.product(range(L), range(E)):
      if experts == FUSED:
        fused = "down_proj" if name == "w_down" else "gate_up_proj"
        sources[(i, e)] = Source(f"{_layer(i)}.mlp.experts.{fused}", prefix=(e,),
                                 row_offset=offset, transpose=True)
      else:
        sources[(i, e)] = Source(f"{_layer(i)}.mlp.experts.{e}.{hf_name}.weight", transpose=True)
    maps.append(LeafMap(("layers", "moe", name), (L, E, *tail), 2, sources))

  maps.append(LeafMap(("final_norm",), (D,), 0, {(): Source("model.norm.weight")}))
  maps.append(LeafMap(("lm_head",), (D, V), 0, {(): Source("lm_head.weight", transpose=True)}))
  return maps


def expected_shapes(cfg: Config, experts: str = PER_EXPERT) -> dict[str, tuple[int, ...]]:
  """Hugging Face tensor name -> the full shape `cfg` implies for it."""
  F, E = cfg.moe.expert_hidden, cfg.moe.num_experts
  shapes = {}
  for leaf in leaf_maps(cfg, experts):
    for src in leaf.sources.values():
      tail = leaf.tail[::-1] if src.transpose else leaf.tail
      if src.name.endswith("experts.gate_up_proj"):
        shapes[src.name] = (E, 2 * F, *tail[1:])
      elif src.prefix:
        shapes[src.name] = (E, *tail)
      else:
        shapes[src.name] = tuple(tail)
  return shapes


def detect_expert_layout(names) -> str:
  names = set(names)
  return FUSED if "model.layers.0.mlp.experts.gate_up_proj" in names else PER_EXPERT


def is_ignored(name: str) -> bool:
  return name.endswith(IGNORED_SUFFIXES)
