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

Pools. A model whose MoE layers stack as more than one parameter group (softmax and linear
attention layers: `moejax.models.olmoe.MOE_GROUPS`) stores each group's experts in its own
[L_g, E, ...] arrays, so each group is its own pool of S_g = L_g*El slots per device: the owner
table stays one [L, E] over every MoE layer (model order), while slots, positions, placements and
permutations are per pool (`pools`: each pool's rows of [L, E]; None: one pool of every row), a
position being flat within its pool's arrays. Cross-layer heterogeneity then spans the layers of
one group (Qwen3-Next-80B's 36 linear or 12 softmax MoE layers), never both.

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


def pool_rows(pools, num_layers: int) -> tuple[tuple[int, ...], ...]:
  """Each pool's rows of [L, E] (`pools` None: one pool of every row)."""
  return tuple(pools) if pools else (tuple(range(num_layers)),)


def by_pool(fn, pools, *arrays_LxE) -> np.ndarray:
  """`fn` of each pool's rows of the [L, E] arrays, its [rows, E] result put back at those rows."""
  num_layers = np.shape(arrays_LxE[0])[0]
  out = None
  for rows in pool_rows(pools, num_layers):
    part = np.asarray(fn(*(np.asarray(a)[list(rows)] for a in arrays_LxE)))
    if out is None:
      out = np.empty((num_layers,) + part.shape[1:], part.dtype)
    out[list(rows)] = part
  return out


def positions(owner_LxE, num_devices: int, pools=None) -> np.ndarray:
  """[L, E]: the flat storage position of each expert under `owner_LxE`, within its pool."""
  def one_pool(owner_LxE):
    num_layers, num_experts = owner_LxE.shape
    slot_LxE = ownership.slot_tables(owner_LxE.astype(np.int32), num_devices).slot_of_LxE
    return _position_of_slot(num_layers, num_experts, num_devices)[slot_LxE]
  return by_pool(one_pool, pools, owner_LxE)


def to_canonical(owner_LxE, num_devices: int, pools=None) -> np.ndarray:
  """perm_LxE taking stored experts to canonical order (position (l, e) holds expert (l, e))."""
  return positions(owner_LxE, num_devices, pools)


def from_canonical(owner_LxE, num_devices: int, pools=None) -> np.ndarray:
  """perm_LxE taking canonical order to the storage of `owner_LxE`."""
  def one_pool(pos_LxE):
    return np.argsort(pos_LxE.ravel()).astype(np.int32).reshape(pos_LxE.shape)
  return by_pool(one_pool, pools, positions(owner_LxE, num_devices, pools))


def is_identity(perm_LxE) -> bool:
  return bool(np.array_equal(np.asarray(perm_LxE).ravel(), np.arange(np.size(perm_LxE))))


def plan_reshard(load_LxE, owner_LxE, num_devices: int, devices_per_node: int, *,
                 max_per_layer: int, bytes_per_expert: int, pools=None) -> Resharding:
  """New owners balancing each layer's load over nodes and devices, and the storage move (each
  pool's on its own)."""
  parts = [_plan_pool(np.asarray(load_LxE)[list(rows)], np.asarray(owner_LxE)[list(rows)],
                      num_devices, devices_per_node, max_per_layer=max_per_layer,
                      bytes_per_expert=bytes_per_expert)
           for rows in pool_rows(pools, np.shape(owner_LxE)[0])]
  if len(parts) == 1:
    return parts[0]
  owner, perm = np.empty_like(np.asarray(owner_LxE, np.int32)), np.empty_like(owner_LxE, np.int32)
  for rows, part in zip(pools, parts):
    owner[list(rows)], perm[list(rows)] = part.owner_LxE, part.perm_LxE
  return Resharding(owner, perm, sum(p.moved for p in parts), sum(p.moved_bytes for p in parts))


def _plan_pool(load_LxE, owner_LxE, num_devices: int, devices_per_node: int, *,
               max_per_layer: int, bytes_per_expert: int) -> Resharding:
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


def permute_experts(tree, perm_LxE, *, expert_paths, group_pools=()):
  """Every expert leaf ([L, E, ...]: a leaf whose path ends in one of `expert_paths`, parameters
  and the optimizer's moments alike) gathered by `perm_LxE` over its flattened (layer, expert)
  axes; other leaves unchanged. `group_pools` ((group, rows), ...): a leaf under `group` (its
  path's first name) takes those rows of `perm_LxE`; empty: every leaf all of them."""
  rows_of = dict(group_pools)

  def permute(path, x):
    names = next((names for names in expert_paths if ends_with(path, names)), None)
    if names is None:
      return x
    perm = perm_LxE[np.asarray(rows_of[names[0]])] if rows_of else perm_LxE
    flat = x.reshape((-1,) + x.shape[2:])[perm.reshape(-1)]
    return flat.reshape(x.shape)

  return jax.tree_util.tree_map_with_path(permute, tree)
