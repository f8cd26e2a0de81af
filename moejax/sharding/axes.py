"""Logical axes and groups of parameters, declared where each parameter is defined.

A parameter names one logical axis per dimension and the group it belongs to, with `param`:
flax's logical-axis metadata (`out_sharding`, never applied eagerly) plus a `group` entry. Where a
parameter lives is decided from those names alone by the placement's rules table
(`moejax.sharding.layout`); nothing reads sharding from shapes or parameter names.

Logical axes:
  VOCAB         vocabulary: embedding rows, LM-head columns
  EMBED         model width D
  Q_HEADS       the query projection's output, heads x head width, fused
  KV_HEADS      the key / value projections' output, KV heads x head width, fused
  HEADS         the attention output entering the output projection, heads x head width, fused
  MLP           hidden width of an MLP: a routed expert's F, the shared expert's, a dense layer's
  LATENT        a low-rank latent of multi-head latent attention (the q or kv compression)
  EXPERT        the experts of a layer: one weight matrix per expert
  EXPERT_SCORE  the router's output, one score per expert (a feature axis, not separate experts)
  NORM          a norm's scale
  HEAD          one value per query head (attention sinks; linear attention's per value
                head); in no rules table: replicated
  CONV          a causal convolution's taps (linear attention's); in no rules table: replicated
  LAYERS        the stacked axis of scanned layers (added by the model that stacks them); never
                sharded
Groups: EMBEDDINGS, ATTENTION, BIASES, ROUTER, ROUTER_FP32, ROUTER_BIAS, NORMS, EXPERTS (routed),
SHARED_EXPERTS, DENSE_MLP, SINKS, INDEXER, DECAY (`GROUPS`). They name the parameter's part of the
model in gather reports and decide weight decay (none on norms and biases: `NO_DECAY`).
ROUTER_BIAS is the selection-only score bias: no gradient reaches it (the train step moves it from the load), and it
is gathered in float32 (`FLOAT32_GROUPS`: a bf16 bias would reorder close scores), and so is
the router beside it (ROUTER_FP32: DeepSeek-V3 keeps both in float32), and the attention sinks
(SINKS: softmax logits, no weight decay; Flint keeps them in float32), and linear attention's
decay rates and time-step biases (DECAY: exponentiated; no weight decay, as FLA trains them).
INDEXER (DeepSeek sparse attention's key selector) learns from a loss of its own only (`OWN_LOSS`): its gradients are
clipped apart from the others', and with that loss's weight 0 the optimizer leaves it as it is.

The model reads its declarations into a tree of `ParamMeta` (`moejax.models.olmoe.param_meta`);
what needs them takes that tree: the layouts, the Gatherer (report groups), the optimizer (weight
decay) and the placement (which leaves are experts, `expert_paths`).
"""
from __future__ import annotations

import dataclasses

import jax
from flax import nnx

VOCAB = "vocab"
EMBED = "embed"
Q_HEADS = "q_heads"
KV_HEADS = "kv_heads"
HEADS = "heads"
MLP = "mlp"
LATENT = "latent"
EXPERT = "expert"
EXPERT_SCORE = "expert_score"
NORM = "norm"
HEAD = "head"
CONV = "conv"
LAYERS = "layers"
AXES = (VOCAB, EMBED, Q_HEADS, KV_HEADS, HEADS, MLP, LATENT, EXPERT, EXPERT_SCORE, NORM, HEAD,
        CONV, LAYERS)

EMBEDDINGS = "embeddings"
ATTENTION = "attention"
ROUTER = "router"
NORMS = "norms"
EXPERTS = "experts"
SHARED_EXPERTS = "shared_experts"
BIASES = "biases"
ROUTER_BIAS = "router_bias"
ROUTER_FP32 = "router_fp32"
DENSE_MLP = "dense_mlp"
SINKS = "sinks"
INDEXER = "indexer"
DECAY = "decay"     # linear attention's decay rates and time-step biases (a_log, dt_bias)
GROUPS = (ATTENTION, BIASES, ROUTER, ROUTER_FP32, ROUTER_BIAS, NORMS, EXPERTS, SHARED_EXPERTS,
          DENSE_MLP, EMBEDDINGS, SINKS, INDEXER, DECAY)
NO_DECAY = (NORMS, BIASES, ROUTER_BIAS, SINKS, INDEXER, DECAY)  # groups without weight decay
# groups trained by a loss of their own alone (DeepSeek-V3.2's indexer: its KL loss, its inputs
# detached, its selection without gradient), model.train_indexer
OWN_LOSS = (INDEXER,)
# gathered (or cast) in float32 whatever the compute dtype
FLOAT32_GROUPS = (ROUTER_BIAS, ROUTER_FP32, SINKS, DECAY)


@dataclasses.dataclass(frozen=True)
class ParamMeta:
  """What a parameter declares: its stored shape, one logical axis per dimension, its group."""
  shape: tuple[int, ...]
  axes: tuple[str, ...]
  group: str


def _check(axes: tuple[str, ...], group: str, ndim: int) -> None:
  if len(axes) != ndim:
    raise ValueError(f"logical axes {axes} name {len(axes)} dimensions of a {ndim}-d parameter")
  unknown = [a for a in axes if a not in AXES]
  if unknown or len(set(axes)) != len(axes):
    raise ValueError(f"logical axes {axes}: each must be one of {AXES}, each at most once")
  if group not in GROUPS:
    raise ValueError(f"parameter group {group!r}: must be one of {GROUPS}")


def param(value, axes: tuple[str, ...], group: str) -> nnx.Param:
  """An `nnx.Param` declaring its logical axes and group (stored as metadata only: the value is
  not sharded when it is created)."""
  axes = tuple(axes)
  _check(axes, group, len(value.shape))
  return nnx.Param(value, out_sharding=axes, eager_sharding=False, group=group)


def meta_of(variable: nnx.Variable, *, stacked: int | None = None) -> ParamMeta:
  """A `param`'s declaration; `stacked=L`: as stored stacked over L layers (axis LAYERS first)."""
  metadata = variable.get_metadata()
  if "group" not in metadata or not metadata.get("out_sharding"):
    raise ValueError("a parameter without declared logical axes and group: create it with "
                     "moejax.sharding.axes.param(value, axes, group)")
  shape, axes = tuple(variable.get_value().shape), tuple(metadata["out_sharding"])
  if stacked is not None:
    shape, axes = (stacked,) + shape, (LAYERS,) + axes
  _check(axes, metadata["group"], len(shape))
  return ParamMeta(shape, axes, metadata["group"])


def expert_paths(param_meta) -> tuple[tuple[str, ...], ...]:
  """Paths (key names) of the parameters that declare an expert axis, one matrix per expert."""
  return tuple(tuple(str(k.key) for k in path)
               for path, meta in jax.tree_util.tree_leaves_with_path(param_meta)
               if EXPERT in meta.axes)


def ends_with(path, names: tuple[str, ...]) -> bool:
  """Whether a tree path (jax key entries) ends in the dict keys `names`: the parameter at
  `names`, or its copy inside a tree holding the parameters (optimizer moments)."""
  tail = []
  for entry in reversed(tuple(path)):
    if not isinstance(entry, jax.tree_util.DictKey) or len(tail) == len(names):
      break
    tail.append(str(entry.key))
  return tuple(reversed(tail)) == tuple(names)
