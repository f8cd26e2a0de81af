"""Where each parameter lives: one `Layout` per parameter leaf, from its declared logical axes and
the placement's rules table; and the specs derived from it.

Kinds:
  shard      ZeRO-3: sliced along `dim` across all devices, gathered just in time by the hook,
             gradient reduce-scattered back.
  replicate  no rule applies (or one device): every device holds all of it; gradient summed (psum).
  expert     expert-parallel: sliced along the expert axis `dim`; each device owns whole experts,
             used where they live; the gradient is already complete on the owner.

Rules. A placement's table is an ordered preference of (logical axis, kind): the first axis the
parameter declares whose size the device count divides is split over all devices (`DEVICES`)
with that kind; with none, the parameter is replicated. Sizes only decide divisibility; which
axis is chosen comes from the names. One device replicates whatever would be sharded (expert
entries stay `expert`: one device owns every expert). An expert entry the device count does not
divide is an error (the ep/fssdp dispatch needs whole experts on their owners), not a fallback.
The stacked layer axis (`axes.LAYERS`) is never sharded: it is in no table.

  fsdp         vocab, heads, embed, q_heads, kv_heads, mlp, latent, expert, expert_score, norm
  ep, fssdp    expert (expert-parallel), then fsdp's

so embedding and LM head split the vocabulary, every matrix that reads the model width splits
it (attention q/k/v, router, the three expert matrices under fsdp), the attention output
projection splits its input heads (each device holds whole rows of every matrix it shards but
the LM head and w_down), norm scales their only axis; under ep and fssdp each device owns E/N
whole experts.
"""
from __future__ import annotations

import dataclasses

import jax
from jax.sharding import PartitionSpec as P

from moejax.sharding import axes as ax
from moejax.sharding.mesh import DEVICES

SHARD, REPLICATE, EXPERT = "shard", "replicate", "expert"

FSDP_RULES = ((ax.VOCAB, SHARD), (ax.HEADS, SHARD), (ax.EMBED, SHARD), (ax.Q_HEADS, SHARD),
              (ax.KV_HEADS, SHARD), (ax.MLP, SHARD), (ax.LATENT, SHARD), (ax.EXPERT, SHARD),
              (ax.EXPERT_SCORE, SHARD), (ax.NORM, SHARD))
EXPERT_PARALLEL_RULES = ((ax.EXPERT, EXPERT),) + FSDP_RULES
RULES = {"fsdp": FSDP_RULES, "ep": EXPERT_PARALLEL_RULES, "fssdp": EXPERT_PARALLEL_RULES}


@dataclasses.dataclass(frozen=True)
class Layout:
  kind: str          # "shard" | "replicate" | "expert"
  dim: int = -1      # sharded axis of the stored (possibly layer-stacked) array

  def spec(self, ndim: int) -> P:
    if self.kind == "replicate":
      return P()
    axes = [None] * ndim
    axes[self.dim] = DEVICES
    return P(*axes)

  def unstacked(self) -> "Layout":
    """The same layout for one layer's slice (leading layer axis removed)."""
    return self if self.kind == "replicate" else dataclasses.replace(self, dim=self.dim - 1)


def layout_for(meta: ax.ParamMeta, rules, num_devices: int) -> Layout:
  """One parameter's layout under one rules table (see the module docstring)."""
  for axis, kind in rules:
    if axis == ax.LAYERS:
      raise ValueError("the stacked layer axis is never sharded: it has no rule")
    if axis not in meta.axes:
      continue
    dim = meta.axes.index(axis)
    if meta.shape[dim] % num_devices:
      if kind == EXPERT:
        raise ValueError(f"a parameter with logical axes {meta.axes} and shape {meta.shape}: "
                         f"its {meta.shape[dim]} experts are not divisible by the "
                         f"{num_devices} devices")
      continue
    if kind == SHARD and num_devices == 1:
      return Layout(REPLICATE)
    return Layout(kind, dim)
  return Layout(REPLICATE)


def param_layouts(param_meta, placement: str, num_devices: int):
  """Pytree of `Layout` like the parameters, from their declarations (a tree of
  `axes.ParamMeta`, e.g. `moejax.models.olmoe.param_meta(cfg)`) and the placement's table."""
  rules = RULES[placement]
  return jax.tree.map(lambda meta: layout_for(meta, rules, num_devices), param_meta)


def param_specs(param_shapes, layouts):
  return jax.tree.map(lambda x, lay: lay.spec(len(x.shape)), param_shapes, layouts,
                      is_leaf=lambda v: isinstance(v, Layout))
