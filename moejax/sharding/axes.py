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
  MLP           expert hidden width F
  EXPERT        the experts of a layer: one weight matrix per expert
  EXPERT_SCORE  the router's output, one score per expert (a feature axis, not separate experts)
  NORM          a norm's scale
  LAYERS        the stacked axis of scanned layers (added by the model that stacks them); never
                sharded
Groups: EMBEDDINGS, ATTENTION, ROUTER, NORMS, EXPERTS (`GROUPS`). They name the parameter's part
of the model in gather reports and decide weight decay (none on norms).

The model publishes the declarations of its parameter tree (`declare`, done by
`moejax.models.olmoe.param_meta`), so code that sees a parameter only by its path (optimizer
moments, a gathered group's leaves) reads what was declared (`declared`, `declared_at`).
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
EXPERT = "expert"
EXPERT_SCORE = "expert_score"
NORM = "norm"
LAYERS = "layers"
AXES = (VOCAB, EMBED, Q_HEADS, KV_HEADS, HEADS, MLP, EXPERT, EXPERT_SCORE, NORM, LAYERS)

EMBEDDINGS = "embeddings"
ATTENTION = "attention"
ROUTER = "router"
NORMS = "norms"
EXPERTS = "experts"
GROUPS = (ATTENTION, ROUTER, NORMS, EXPERTS, EMBEDDINGS)


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


# -- the model's published declarations, by path ---------------------------------------------------
_DECLARED: dict[tuple[str, str], tuple[tuple[str, ...], str]] = {}


def _split(path) -> tuple[str, str]:
  """(top-level key, keystr of the rest): how the gather groups name their leaves."""
  return str(path[0].key), jax.tree_util.keystr(tuple(path[1:]))


def declare(meta_tree) -> None:
  """Publishes a model's declarations ({top-level key: tree of `ParamMeta`}) by path. A path
  declared again must declare the same axes and group."""
  for path, meta in jax.tree_util.tree_leaves_with_path(meta_tree):
    key, value = _split(path), (meta.axes, meta.group)
    if _DECLARED.setdefault(key, value) != value:
      raise ValueError(f"parameter {key[0]}{key[1]} declared as {value}, before as "
                       f"{_DECLARED[key]}")


def declared(top: str, path: str) -> tuple[tuple[str, ...], str]:
  """(logical axes, group) of the parameter `top` + `path` (a keystr, e.g. "['moe']['w_up']")."""
  if not _DECLARED:
    raise RuntimeError("no model has declared its parameters yet "
                       "(moejax.models.olmoe.param_meta declares them)")
  try:
    return _DECLARED[(top, path)]
  except KeyError:
    raise KeyError(f"parameter {top}{path} was not declared (declare it with "
                   "moejax.sharding.axes.param where it is defined)") from None


def declared_at(path) -> tuple[tuple[str, ...], str] | None:
  """The declaration of the parameter a tree path ends in: a path into the parameters, or into a
  tree holding them (optimizer moments); None where the path ends in no parameter. Entries may
  be jax key entries or plain strings."""
  names = []
  for entry in reversed(tuple(path)):
    if isinstance(entry, str):
      names.append(entry)
    elif isinstance(entry, jax.tree_util.DictKey):
      names.append(str(entry.key))
    else:
      break
  names.reverse()
  for start in range(len(names)):   # the longest declared tail
    key = (names[start], jax.tree_util.keystr(tuple(jax.tree_util.DictKey(n)
                                                    for n in names[start + 1:])))
    if key in _DECLARED:
      return _DECLARED[key]
  if not _DECLARED:
    raise RuntimeError("no model has declared its parameters yet "
                       "(moejax.models.olmoe.param_meta declares them)")
  return None
