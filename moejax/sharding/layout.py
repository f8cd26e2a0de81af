"""Where each parameter lives: one `Layout` per parameter leaf, and the specs derived from it.

Kinds:
  shard      ZeRO-3: sliced along `dim` across all devices, gathered just in time by the hook,
             gradient reduce-scattered back.
  replicate  too small or indivisible: every device holds all of it; gradient summed (psum).
  expert     expert-parallel: sliced along the expert axis `dim`; each device owns whole experts,
             used where they live; the gradient is already complete on the owner.

Layer parameters are stacked with a leading layer axis (`lax.scan`); that axis is never sharded.
"""
from __future__ import annotations

import dataclasses

import jax
from jax.sharding import PartitionSpec as P

from moejax.sharding.mesh import DEVICES

EXPERT_PARAM_NAMES = ("w_gate", "w_up", "w_down")


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


def _path_names(path) -> list[str]:
  return [str(getattr(k, "key", getattr(k, "name", k))) for k in path]


def is_expert_param(path) -> bool:
  names = _path_names(path)
  return "moe" in names and names[-1] in EXPERT_PARAM_NAMES


def _layout_for(path, shape, placement: str, n: int) -> Layout:
  names = _path_names(path)
  stacked = names[0] == "layers"
  first = 1 if stacked else 0
  if is_expert_param(path) and placement in ("ep", "fssdp"):
    return Layout("expert", first)       # [L, E, ...]: experts partitioned over devices
  if n == 1:
    return Layout("replicate")
  candidates = [d for d in range(first, len(shape)) if shape[d] % n == 0]
  if not candidates:
    return Layout("replicate")
  return Layout("shard", max(candidates, key=lambda d: (shape[d], -d)))


def param_layouts(param_shapes, placement: str, num_devices: int):
  """Pytree of `Layout`, one per parameter, from shapes (e.g. the output of `eval_shape`)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: _layout_for(path, x.shape, placement, num_devices), param_shapes)


def param_specs(param_shapes, layouts):
  return jax.tree.map(lambda x, lay: lay.spec(len(x.shape)), param_shapes, layouts,
                      is_leaf=lambda v: isinstance(v, Layout))
