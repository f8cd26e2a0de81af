"""FSSDP re-sharding: cross-layer heterogeneous expert ownership in the stored layout.

Letters: L layers, E experts per layer, N devices, El = E/N, S = L*El storage slots per device,
C = fssdp.max_per_layer, the most experts one device may own in one layer.

Storage. Each expert parameter is stored as ep stores it, [L, E, ...] sharded on the expert axis,
but read as a pool: device d holds the S storage positions (l, j) with d*El <= j < (d+1)*El, and
its local slot k = l*El + (j - d*El). Which expert sits in which slot is a pure function of the
owner table `owner_LxE` (the train state's `expert_owner`, checkpointed): each device's experts
fill its slots in (layer, expert) order (`ownership.slot_tables`). So every device holds S
slots, while a layer may give a device anywhere from 0 to C of its experts. The initial owners
(expert e of every layer on device e // El) put every expert at its own position: ep's layout.
Shapes, shardings and optimizer state never change; only the table and which expert is where.

In the step (`moejax.placement.fssdp.owned_windows`) device d reads layer l's experts as one
static window of C slots starting at that layer's first slot; they are the layer's owned experts
that SparseAllGather replicates and the dispatch addresses. The router is never permuted.

Re-sharding (`plan_reshard`) asks `ownership.heterogeneous_placement` for new owners (sticky:
experts stay unless moving pays), then applies one permutation of storage positions to the
expert parameters and their optimizer moments together (`permute_experts`): the only place
optimizer state is ever copied. Checkpoints hold the canonical order (position (l, e) holds
expert (l, e)), the order `load_params` and every placement read, plus the owner table.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from moejax.placement import ownership
from moejax.sharding.axes import ends_with


@dataclasses.dataclass(frozen=True)
class Resharding:
  owner_LxE: np.ndarray     # the new owners
  perm_LxE: np.ndarray      # storage position (l, j) takes what was at flat position perm[l, j]
  moved: int                # experts whose owning device changed
  moved_bytes: int          # their parameters and optimizer moments


def _position_of_slot(num_layers: int, num_experts: int, num_devices: int) -> np.ndarray:
  """[N*S]: the flat storage position l*E + j of pool slot g = d*S + k."""
  el = num_experts // num_devices
  g = np.arange(num_layers * num_experts)
  d, k = np.divmod(g, num_layers * el)
  return ((k // el) * num_experts + d * el + k % el).astype(np.int32)


def positions(owner_LxE, num_devices: int) -> np.ndarray:
  """[L, E]: the flat storage position of each expert under `owner_LxE`."""
  owner_LxE = np.asarray(owner_LxE, np.int32)
  num_layers, num_experts = owner_LxE.shape
  slot_LxE = ownership.slot_tables(owner_LxE, num_devices).slot_of_LxE
  return _position_of_slot(num_layers, num_experts, num_devices)[slot_LxE]


def to_canonical(owner_LxE, num_devices: int) -> np.ndarray:
  """perm_LxE taking stored experts to canonical order (position (l, e) holds expert (l, e))."""
  return positions(owner_LxE, num_devices)


def from_canonical(owner_LxE, num_devices: int) -> np.ndarray:
  """perm_LxE taking canonical order to the storage of `owner_LxE`."""
  pos_LxE = positions(owner_LxE, num_devices)
  return np.argsort(pos_LxE.ravel()).astype(np.int32).reshape(pos_LxE.shape)


def is_identity(perm_LxE) -> bool:
  return bool(np.array_equal(np.asarray(perm_LxE).ravel(), np.arange(np.size(perm_LxE))))


def plan_reshard(load_LxE, owner_LxE, num_devices: int, devices_per_node: int, *,
                 max_per_layer: int, bytes_per_expert: int) -> Resharding:
  """New owners balancing each layer's load over nodes and devices, and the storage move."""
  owner_LxE = np.asarray(owner_LxE, np.int32)
  num_layers, num_experts = owner_LxE.shape
  new_LxE = ownership.heterogeneous_placement(
      np.asarray(load_LxE, np.float64), num_devices, devices_per_node,
      max_per_layer=max_per_layer, previous_owner_LxE=owner_LxE)
  move = ownership.reshard_moves(owner_LxE, new_LxE, expert_bytes=bytes_per_expert,
                                   num_devices=num_devices)
  position_G = _position_of_slot(num_layers, num_experts, num_devices)
  perm = np.empty(num_layers * num_experts, np.int32)
  perm[position_G] = position_G[move.perm]
  return Resharding(new_LxE, perm.reshape(num_layers, num_experts), move.num_moves,
                    move.bytes_moved)


def permute_experts(tree, perm_LxE, *, expert_paths):
  """Every expert leaf ([L, E, ...]: a leaf whose path ends in one of `expert_paths`, parameters
  and the optimizer's moments alike) gathered by `perm_LxE` over its flattened (layer, expert)
  axes; other leaves unchanged."""
  def permute(path, x):
    if not any(ends_with(path, names) for names in expert_paths):
      return x
    flat = x.reshape((-1,) + x.shape[2:])[perm_LxE.reshape(-1)]
    return flat.reshape(x.shape)

  return jax.tree_util.tree_map_with_path(permute, tree)
