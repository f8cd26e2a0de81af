"""FSSDP sharding: which device owns each expert (with its optimizer state), host-side numpy.

Runs every `reshard_every` steps, outside the compiled step. Every expert of every MoE layer is
owned whole by one device; the per-step planner (`moejax.placement.planner`) adds ephemeral
replicas on top of this placement.

Letters: L layers, E experts per layer, N devices, G nodes, Dn devices per node (N = G * Dn),
S storage slots per device (S = L * E / N by default), C = C_max, the static bound on the number
of experts one device owns in one layer (fssdp.max_per_layer: the per-layer window the train step
reads, see `moejax.placement.reshard`), M moves.

Storage. Expert parameters and their optimizer state live in one flat array of N * S slots per
parameter, leading axis sharded evenly over the devices: device n holds slots [n*S, (n+1)*S).
Within a device, owned experts sit in (layer, expert) order, so one layer's experts are
contiguous: `SlotTables.local_slot_LxNxC` gives their positions. Unused slots (only when
`slots_per_device` exceeds L*E/N) hold nothing (layer and expert -1). The train step keeps ep's
[L, E, ...] arrays and reads each device's part of them as its S slots (`moejax.placement.reshard`).

Placements:
  `initial_placement`        even, like ep: device n owns experts [n*E/N, (n+1)*E/N) of every
                             layer.
  `heterogeneous_placement`  cross-layer heterogeneous: every device still holds S slots summed
                             over layers, but a layer may give a device more or fewer of its
                             experts (at most `max_per_layer`), so that the load each node and
                             device owns in each layer balances. Algorithm in its docstring.

Resharding (`reshard_moves`) returns the moved experts, the bytes that move, and the permutation
of storage slots old -> new, applied to parameters and optimizer state together
(`apply_permutation` on flat storage; `reshard.permute_experts` on the train state).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import numpy as np


def _check_devices(num_experts: int, num_layers: int, num_devices: int, devices_per_node: int = 1):
  if num_devices < 1 or devices_per_node < 1 or num_devices % devices_per_node:
    raise ValueError(f"num_devices={num_devices} must be a positive multiple of "
                     f"devices_per_node={devices_per_node}")
  if (num_layers * num_experts) % num_devices:
    raise ValueError(f"num_layers * num_experts = {num_layers * num_experts} expert slots do not "
                     f"divide evenly over num_devices={num_devices}")


def default_max_per_layer(num_experts: int, num_devices: int) -> int:
  """C_max used when none is given: twice the even share ceil(E/N), at most E."""
  return min(num_experts, 2 * math.ceil(num_experts / num_devices))


def initial_placement(num_layers: int, num_experts: int, num_devices: int) -> np.ndarray:
  """owner_LxE int32: contiguous blocks of E/N experts per device in every layer (as ep)."""
  if num_experts % num_devices:
    raise ValueError(f"num_experts={num_experts} is not divisible by num_devices={num_devices}: "
                     "the even placement gives every device the same number of experts per layer")
  per_device = num_experts // num_devices
  owner_E = np.arange(num_experts, dtype=np.int32) // per_device
  return np.tile(owner_E, (num_layers, 1))


def experts_per_device(owner_LxE: np.ndarray, num_devices: int) -> np.ndarray:
  """count_LxN int32: how many experts of each layer each device owns."""
  owner_LxE = np.asarray(owner_LxE)
  num_layers = owner_LxE.shape[0]
  count_LxN = np.zeros((num_layers, num_devices), np.int32)
  for l in range(num_layers):
    count_LxN[l] = np.bincount(owner_LxE[l], minlength=num_devices)
  return count_LxN


def owned_load(load_LxE: np.ndarray, owner_LxE: np.ndarray, num_devices: int) -> np.ndarray:
  """load_LxN float64: the load (routed assignments) each device owns in each layer.

  This is the hot-path ingress of a device under owner-only dispatch (ep). Node figures:
  `owned_load(...).reshape(L, G, Dn).sum(-1)`.
  """
  load_LxE = np.asarray(load_LxE, np.float64)
  owner_LxE = np.asarray(owner_LxE)
  out_LxN = np.zeros((load_LxE.shape[0], num_devices))
  for l in range(load_LxE.shape[0]):
    out_LxN[l] = np.bincount(owner_LxE[l], weights=load_LxE[l], minlength=num_devices)
  return out_LxN


def heterogeneous_placement(load_LxE: np.ndarray, num_devices: int, devices_per_node: int, *,
                            slots_per_device: int | None = None,
                            max_per_layer: int | None = None,
                            previous_owner_LxE: np.ndarray | None = None,
                            stickiness: float = 0.1) -> np.ndarray:
  """owner_LxE int32 balancing the load each node and device owns in each layer.

  Constraints (always met): device n owns at most `slots_per_device` experts summed over layers
  (default exactly L*E/N each) and at most `max_per_layer` experts of any one layer (default
  `default_max_per_layer(E, N)` = 2*ceil(E/N); this is the C_max the train step sizes its static
  per-layer buffers with; `slot_tables` reports it as C).

  Algorithm (greedy longest-processing-time first, hierarchical):
    1. Normalize each layer's load to fractions of that layer's total (uniform where a layer has
       no load), so layers compete on equal terms.
    2. Visit all (layer, expert) pairs hottest first (ties: lower layer, then lower expert).
    3. For each, among devices with a free slot and fewer than `max_per_layer` experts of that
       layer, pick the node whose devices own the least load of that layer, then within it the
       device that owns the least load of that layer (ties: more free slots, then lower index),
       and place the expert there. Hot experts thus land on different nodes and devices, and the
       rest fill in around them until every node's and device's share of each layer evens out.
    4. If no device qualifies (every device with a free slot already has `max_per_layer` experts
       of this layer), repair with one move: take a full device B below the cap for this layer,
       move its coldest expert of another layer to a device A with a free slot that has room for
       that layer, and place the expert on B. Such a pair always exists while
       `max_per_layer * N >= E` (pigeonhole over B's other-layer experts), so placement never
       fails.
  Stickiness: with `previous_owner_LxE` (the current placement), an expert stays on its current
  owner whenever that device qualifies and its node's and its own load of the layer are within
  `stickiness / N` (a fraction of the layer's load) of the least loaded choice, so re-sharding
  on noisy loads moves few experts.
  Uniform loads give every device E/N experts of every layer (when E % N == 0).
  """
  load_LxE = np.asarray(load_LxE, np.float64)
  num_layers, num_experts = load_LxE.shape
  n = num_devices
  _check_devices(num_experts, num_layers, n, devices_per_node)
  if np.any(~np.isfinite(load_LxE)) or np.any(load_LxE < 0):
    raise ValueError("load_LxE must be finite and non-negative")
  slots = num_layers * num_experts // n if slots_per_device is None else int(slots_per_device)
  if slots * n < num_layers * num_experts:
    raise ValueError(f"slots_per_device={slots} x {n} devices cannot hold "
                     f"{num_layers * num_experts} experts")
  cap = default_max_per_layer(num_experts, n) if max_per_layer is None else int(max_per_layer)
  if cap * n < num_experts:
    raise ValueError(f"max_per_layer={cap} x {n} devices cannot hold the {num_experts} experts "
                     "of a layer")

  slack = stickiness / n
  if previous_owner_LxE is not None:
    previous_owner_LxE = np.asarray(previous_owner_LxE)
    if previous_owner_LxE.shape != load_LxE.shape:
      raise ValueError(f"previous_owner_LxE has shape {previous_owner_LxE.shape}, "
                       f"expected {load_LxE.shape}")
  totals_L = load_LxE.sum(axis=1, keepdims=True)
  frac_LxE = np.where(totals_L > 0, load_LxE / np.where(totals_L > 0, totals_L, 1.0),
                      1.0 / num_experts)
  node_of_N = np.arange(n) // devices_per_node
  owner_LxE = np.full((num_layers, num_experts), -1, np.int32)
  count_LxN = np.zeros((num_layers, n), np.int32)
  free_N = np.full(n, slots, np.int64)
  dev_load_LxN = np.zeros((num_layers, n))

  def place(l, e, d):
    owner_LxE[l, e] = d
    count_LxN[l, d] += 1
    free_N[d] -= 1
    dev_load_LxN[l, d] += frac_LxE[l, e]

  def unplace(l, e):
    d = owner_LxE[l, e]
    owner_LxE[l, e] = -1
    count_LxN[l, d] -= 1
    free_N[d] += 1
    dev_load_LxN[l, d] -= frac_LxE[l, e]

  flat_order = np.lexsort((np.tile(np.arange(num_experts), num_layers),
                           np.repeat(np.arange(num_layers), num_experts), -frac_LxE.ravel()))
  for idx in flat_order:
    l, e = divmod(int(idx), num_experts)
    ok_N = (free_N > 0) & (count_LxN[l] < cap)
    if not ok_N.any():
      _repair(l, free_N, count_LxN, cap, owner_LxE, frac_LxE, place, unplace)
      ok_N = (free_N > 0) & (count_LxN[l] < cap)
    node_load_G = np.bincount(node_of_N, weights=dev_load_LxN[l])
    node_ok_G = np.bincount(node_of_N, weights=ok_N.astype(np.float64)) > 0
    g = int(np.argmin(np.where(node_ok_G, node_load_G, np.inf)))
    cand = np.flatnonzero(ok_N & (node_of_N == g))
    d = int(cand[np.lexsort((cand, -free_N[cand], dev_load_LxN[l, cand]))[0]])
    if previous_owner_LxE is not None:
      p = int(previous_owner_LxE[l, e])
      gp = node_of_N[p]
      near = np.flatnonzero(ok_N & (node_of_N == gp))
      if (ok_N[p] and node_load_G[gp] <= node_load_G[g] + slack
          and dev_load_LxN[l, p] <= dev_load_LxN[l, near].min() + slack):
        d = p
    place(l, e, d)
  return owner_LxE


def _repair(l, free_N, count_LxN, cap, owner_LxE, frac_LxE, place, unplace):
  """Frees a slot for layer l on a full device B by moving one of B's other-layer experts to a
  device A that has a free slot (see step 4 of `heterogeneous_placement`)."""
  best = None
  for b in np.flatnonzero((free_N == 0) & (count_LxN[l] < cap)):
    held = np.argwhere(owner_LxE == b)
    for a in np.flatnonzero(free_N > 0):
      for l2, e2 in held:
        if l2 != l and count_LxN[l2, a] < cap:
          key = (frac_LxE[l2, e2], int(b), int(a), int(l2), int(e2))
          if best is None or key < best:
            best = key
  if best is None:   # unreachable while cap * N >= E (see the docstring)
    raise RuntimeError(f"no feasible repair for layer {l} on {free_N.shape[0]} devices")
  _, b, a, l2, e2 = best
  unplace(l2, e2)
  place(l2, e2, a)


class SlotTables(NamedTuple):
  """Where each owned expert lives in flat storage (see the module docstring).

  expert_at_slot_NxSx2  (layer, expert) in each storage slot, (-1, -1) if empty.
  slot_of_LxE           global storage slot (n * S + local) of each expert.
  local_experts_LxNxC   expert ids device n owns in layer l, ascending, padded with -1 to C.
  local_slot_LxNxC      their local slot indices on device n (0..S-1), padded with -1.
  """
  expert_at_slot_NxSx2: np.ndarray
  slot_of_LxE: np.ndarray
  local_experts_LxNxC: np.ndarray
  local_slot_LxNxC: np.ndarray


def slot_tables(owner_LxE: np.ndarray, num_devices: int, *, slots_per_device: int | None = None,
                max_per_layer: int | None = None) -> SlotTables:
  """Storage tables for a placement. C = `max_per_layer` if given (must cover the placement),
  else the largest number of experts any device owns in one layer."""
  owner_LxE = np.asarray(owner_LxE, np.int32)
  num_layers, num_experts = owner_LxE.shape
  n = num_devices
  if slots_per_device is None:
    _check_devices(num_experts, num_layers, n)
  if owner_LxE.min() < 0 or owner_LxE.max() >= n:
    raise ValueError(f"owner_LxE holds devices outside [0, {n})")
  slots = num_layers * num_experts // n if slots_per_device is None else int(slots_per_device)
  count_LxN = experts_per_device(owner_LxE, n)
  per_device_N = count_LxN.sum(axis=0)
  if per_device_N.max() > slots:
    raise ValueError(f"device {int(per_device_N.argmax())} owns {int(per_device_N.max())} experts, "
                     f"more than slots_per_device={slots}")
  c = int(count_LxN.max()) if max_per_layer is None else int(max_per_layer)
  if count_LxN.max() > c:
    raise ValueError(f"a device owns {int(count_LxN.max())} experts of one layer, more than "
                     f"max_per_layer={c}")
  expert_at_slot = np.full((n, slots, 2), -1, np.int32)
  slot_of_LxE = np.zeros((num_layers, num_experts), np.int32)
  local_experts = np.full((num_layers, n, c), -1, np.int32)
  local_slot = np.full((num_layers, n, c), -1, np.int32)
  for d in range(n):
    layers, experts = np.nonzero(owner_LxE == d)      # row-major: (layer, expert) order
    expert_at_slot[d, :len(layers)] = np.stack([layers, experts], axis=1)
    slot_of_LxE[layers, experts] = d * slots + np.arange(len(layers))
    for l in range(num_layers):
      idx = np.flatnonzero(layers == l)
      local_experts[l, d, :len(idx)] = experts[idx]
      local_slot[l, d, :len(idx)] = idx
  return SlotTables(expert_at_slot, slot_of_LxE, local_experts, local_slot)


class Reshard(NamedTuple):
  """What moving from one placement to another costs and how to apply it.

  moves_Mx4     int32 rows (layer, expert, from_device, to_device), one per expert whose owner
                changes, in (layer, expert) order.
  num_moves     M.
  bytes_moved   M * expert_bytes (pass the bytes of one expert's parameters and optimizer state).
  perm          int32 [N*S]: new_storage[j] = old_storage[perm[j]] (a permutation; empty new
                slots take empty old slots).
  """
  moves_Mx4: np.ndarray
  num_moves: int
  bytes_moved: int
  perm: np.ndarray


def reshard_moves(old_owner_LxE: np.ndarray, new_owner_LxE: np.ndarray, *,
                  expert_bytes: int = 0, num_devices: int | None = None,
                  slots_per_device: int | None = None) -> Reshard:
  """Moves, bytes and the storage permutation from `old_owner_LxE` to `new_owner_LxE`.

  `num_devices` defaults to the largest device id in either placement plus one (pass it when
  the last devices may own nothing); `slots_per_device` to L*E/N.
  """
  old = np.asarray(old_owner_LxE, np.int32)
  new = np.asarray(new_owner_LxE, np.int32)
  if old.shape != new.shape:
    raise ValueError(f"placements differ in shape: {old.shape} vs {new.shape}")
  num_layers, num_experts = old.shape
  n = int(max(old.max(), new.max())) + 1 if num_devices is None else int(num_devices)
  if slots_per_device is None:
    _check_devices(num_experts, num_layers, n)
    slots = num_layers * num_experts // n
  else:
    slots = int(slots_per_device)
  return _reshard(old, new, n, slots, expert_bytes)


def _reshard(old, new, n, slots, expert_bytes) -> Reshard:
  t_old = slot_tables(old, n, slots_per_device=slots)
  t_new = slot_tables(new, n, slots_per_device=slots)
  total = n * slots
  perm = np.full(total, -1, np.int32)
  perm[t_new.slot_of_LxE.ravel()] = t_old.slot_of_LxE.ravel()
  empty_old = np.setdiff1d(np.arange(total), t_old.slot_of_LxE.ravel())
  perm[perm < 0] = empty_old          # same count on both sides: a bijection
  moved = np.argwhere(old != new)
  moves = np.stack([moved[:, 0], moved[:, 1], old[old != new], new[old != new]],
                   axis=1).astype(np.int32) if len(moved) else np.zeros((0, 4), np.int32)
  return Reshard(moves, len(moves), len(moves) * int(expert_bytes), perm)


def apply_permutation(storage, perm):
  """new storage = old storage gathered along the slot axis (axis 0) by `perm`, for every leaf
  of a pytree of arrays (numpy or jax), e.g. parameters and optimizer state together."""
  return jax.tree.map(lambda x: x[perm], storage)
