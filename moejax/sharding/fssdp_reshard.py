"""FSSDP re-sharding: move whole experts (parameters and optimizer state together) to new owners.

Ownership is positional: device d owns the experts stored at indices d*El .. d*El+El-1 of every
layer. Re-sharding therefore *relabels* experts: it permutes, per layer, the expert axis of the
expert weights, the matching router columns, their optimizer moments and the load history,
all with the same permutation. The model computes the same function afterwards (an MoE layer is
equivariant under a consistent relabeling of its experts), so training continues unchanged while
each expert now lives on the device the placement chose. This is the only place optimizer state
is ever copied. Each layer keeps E/N experts per device (per-layer counts stay equal; the
cross-layer heterogeneous placement of `fssdp_shard` is planned and benchmarked, not yet stored).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from moejax.sharding import fssdp_shard
from moejax.sharding.layout import EXPERT_PARAM_NAMES


@dataclasses.dataclass(frozen=True)
class Relabel:
  perm_LxE: np.ndarray      # new expert index j of layer l holds old expert perm_LxE[l, j]
  moved: int                # experts whose owning device changed
  moved_bytes: int          # their parameters and optimizer moments


def plan_relabel(load_LxE, num_devices: int, devices_per_node: int, *,
                 bytes_per_expert: int) -> Relabel:
  """New owners balancing each layer's load over nodes and devices, as a permutation."""
  load_LxE = np.asarray(load_LxE, np.float64)
  num_layers, num_experts = load_LxE.shape
  per_device = num_experts // num_devices
  current_owner_LxE = np.broadcast_to(np.arange(num_experts) // per_device,
                                      load_LxE.shape).astype(np.int32)
  owner_LxE = fssdp_shard.heterogeneous_placement(
      load_LxE, num_devices, devices_per_node, max_per_layer=per_device,
      previous_owner_LxE=current_owner_LxE)
  # Stable sort by new owner: each device's experts keep their relative order.
  perm_LxE = np.argsort(owner_LxE, axis=1, kind="stable").astype(np.int32)
  moved = int(np.sum(owner_LxE != current_owner_LxE))
  return Relabel(perm_LxE, moved, moved * bytes_per_expert)


def _kind(path) -> str:
  names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
  if names[0] == "layers" and "moe" in names:
    if names[-1] in EXPERT_PARAM_NAMES:
      return "expert"        # [L, E, ...]
    if names[-1] == "router":
      return "router"        # [L, D, E]
  return "none"


def _permute(x, kind: str, perm_LxE):
  if kind == "expert":
    return jnp.take_along_axis(x, perm_LxE.reshape(perm_LxE.shape + (1,) * (x.ndim - 2)),
                               axis=1)
  if kind == "router":
    return jnp.take_along_axis(x, perm_LxE[:, None, :], axis=2)
  return x


def apply_relabel(state, perm_LxE, tx: optax.GradientTransformation):
  """The train state with every expert-indexed array permuted (jit this with donation):
  parameters, the optimizer's parameter-shaped moments, and the load history."""
  perm_LxE = jnp.asarray(perm_LxE)
  kinds = jax.tree_util.tree_map_with_path(lambda p, _: _kind(p), state.params)
  params = jax.tree.map(lambda x, k: _permute(x, k, perm_LxE), state.params, kinds)
  opt_state = optax.tree_map_params(tx, lambda m, k: _permute(m, k, perm_LxE), state.opt_state,
                                    kinds)
  history = state.load_history
  if history is not None:
    history = history._replace(loads_WxLxE=jnp.take_along_axis(
        history.loads_WxLxE, perm_LxE[None], axis=2))
  return state.replace(params=params, opt_state=opt_state, load_history=history)
