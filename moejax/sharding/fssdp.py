"""FSSDP in the MoE block: sparse materialization of hot experts and their dispatch.

Letters: T tokens here, K experts per token, E experts, El = E/N owned per device, N devices,
M replica slots per device, D width, F expert hidden width.

Every expert is owned whole by one device (expert e by device e // El, like `ep`), with its
optimizer state. Each step and layer:
  1. `materialize`: plan replicas from the *predicted* loads (`fssdp_plan.materialize_plan`)
     and fetch them with SparseAllGather, before the layer's attention, so the transfer can hide
     behind it. SparseAllGather is one `psum_scatter` of an [N, M, ...] buffer in which each
     owner fills the slots that hold its experts: device d receives its M replica slots. Its
     transpose (the backward) is an `all_gather` of the replicas' gradients, of which each owner
     keeps and sums its own rows: SparseReduceScatter. Only gradients move; optimizer state never.
  2. After gating, every device learns all devices' routing counts (one all_gather of N x E
     ints) and computes the same balanced assignment of tokens to holders
     (`fssdp_plan.balanced_send`); tokens go local first, then within the node, then across.
     With `calibrate`, the plan is re-made from the actual counts and adopted (with a second,
     late SparseAllGather) when its modelled straggler is lower by a margin.
  3. The exchange is ep's `all_to_all` with a destination and the expert's local group there
     (owned experts 0..El-1, replica slots El..El+M-1).
On XLA:CPU the static buffers move their capacity (N*M expert slots for SpAG); with
`ragged_all_to_all` on GPU only the M filled slots per device would move. Metrics report both.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from moejax.layers.dispatch import Dispatch, exchange
from moejax.routing import router as router_lib
from moejax.sharding import fssdp_plan


def owner_of(num_experts: int, num_devices: int):
  return jnp.arange(num_experts, dtype=jnp.int32) // (num_experts // num_devices)


def sparse_all_gather(local_w_ElxR, replica_expert_NxM, *, dispatch: Dispatch):
  """Replicas [M, ...] of the experts `replica_expert_NxM[me]` (E = empty slot -> zeros)."""
  n = dispatch.num_devices
  el = local_w_ElxR.shape[0]
  e = el * n
  me = lax.axis_index(dispatch.axis_names)
  expert_NxM = replica_expert_NxM
  mine_NxM = (expert_NxM < e) & (expert_NxM // el == me)
  rows_NxMxR = local_w_ElxR[jnp.where(mine_NxM, expert_NxM % el, 0)]
  mask = mine_NxM.reshape(mine_NxM.shape + (1,) * (local_w_ElxR.ndim - 1))
  send_NxMxR = jnp.where(mask, rows_NxMxR, jnp.zeros((), local_w_ElxR.dtype))
  return lax.psum_scatter(send_NxMxR, dispatch.axis_names, scatter_dimension=0, tiled=False)


def materialize(predicted_load_E, w_gate, w_up, w_down, *, dispatch: Dispatch):
  """This step's plan and replica weights: (plan, (w_gate, w_up, w_down) of [El + M, ...])."""
  n, el = dispatch.num_devices, w_gate.shape[0]
  plan = fssdp_plan.materialize_plan(
      predicted_load_E, owner_of(el * n, n), num_devices=n,
      devices_per_node=dispatch.devices_per_node, replica_slots=dispatch.replica_slots,
      overlap_degree=dispatch.overlap_degree)
  weights = tuple(jnp.concatenate([w, sparse_all_gather(w, plan.replica_expert_NxM,
                                                        dispatch=dispatch)], axis=0)
                  for w in (w_gate, w_up, w_down))
  return plan, weights


def fssdp_experts(x_TxD, experts_TxK, weights_TxK, plan, w_gate, w_up, w_down, *,
                  dispatch: Dispatch):
  """Runs each assignment on one holder of its expert. w_* are [El + M, ...] (owned, then this
  step's replicas). Returns (y_TxD fp32, assignments dropped, placement stats)."""
  n, dpn = dispatch.num_devices, dispatch.devices_per_node
  el = w_gate.shape[0] - dispatch.replica_slots
  e = el * n
  me = lax.axis_index(dispatch.axis_names)
  counts_E = router_lib.expert_counts(experts_TxK, e)
  source_load_NxE = lax.all_gather(counts_E, dispatch.axis_names, axis=0, tiled=False)
  if dispatch.calibrate:
    # Re-plan with the actual loads; adopted (with a late SparseAllGather) only when it pays.
    # Every device computes the same decision from the same gathered counts.
    fresh, adopted = fssdp_plan.calibrate(
        plan, jnp.sum(source_load_NxE, axis=0), owner_of(e, n), num_devices=n,
        devices_per_node=dpn, replica_slots=dispatch.replica_slots,
        overlap_degree=dispatch.overlap_degree, actual_source_load_NxE=source_load_NxE)

    def late_gather(_):
      return tuple(jnp.concatenate([w[:el], sparse_all_gather(
          w[:el], fresh.replica_expert_NxM, dispatch=dispatch)], axis=0)
                   for w in (w_gate, w_up, w_down))

    w_gate, w_up, w_down = lax.cond(adopted, late_gather, lambda _: (w_gate, w_up, w_down),
                                    None)
    plan = fresh
  send_ExN = fssdp_plan.balanced_send(plan.holders_ExN, source_load_NxE,
                                      devices_per_node=dpn)[me]
  dest_TxK = fssdp_plan.dispatch_devices(experts_TxK, me, plan, devices_per_node=dpn,
                                         send_ExN=send_ExN)
  expert_A, dest_A = experts_TxK.reshape(-1), dest_TxK.reshape(-1)
  safe_e = jnp.minimum(expert_A, e - 1)
  owned_A = dest_A == safe_e // el
  replica_A = plan.replica_slot_ExN[safe_e, jnp.minimum(dest_A, n - 1)]
  local_id_A = jnp.where(owned_A, safe_e % el, el + jnp.maximum(replica_A, 0))
  y_TxD, dropped, received = exchange(x_TxD, dest_A, local_id_A, weights_TxK, w_gate, w_up,
                                      w_down, dispatch=dispatch,
                                      num_groups=el + dispatch.replica_slots)
  stats = placement_stats(received, dest_A, dispatch, x_TxD.shape[-1])
  stats["replicas"] = plan.num_replicas.astype(jnp.float32) / n
  return y_TxD, dropped, stats


def ep_stats(experts_TxK, received, dispatch: Dispatch, d_model: int, num_local: int):
  expert_A = experts_TxK.reshape(-1)
  n = dispatch.num_devices
  dest_A = jnp.where(expert_A < num_local * n, expert_A // num_local, n)
  stats = placement_stats(received, dest_A, dispatch, d_model)
  stats["replicas"] = jnp.zeros((), jnp.float32)
  return stats


def placement_stats(received, dest_A, dispatch: Dispatch, d_model: int, itemsize: int = 2):
  """This device's share of: straggler factor (max over devices of expert rows processed / mean)
  and token bytes sent to other devices of the node and to other nodes (there and back)."""
  n, dpn = dispatch.num_devices, dispatch.devices_per_node
  me = lax.axis_index(dispatch.axis_names)
  rows_N = lax.all_gather(received, dispatch.axis_names, axis=0, tiled=False).astype(jnp.float32)
  straggler = jnp.max(rows_N) / jnp.maximum(jnp.mean(rows_N), 1.0)
  valid_A = dest_A < n
  same_node_A = (dest_A // dpn) == (me // dpn)
  row_bytes = 2.0 * d_model * itemsize
  intra = jnp.sum(valid_A & same_node_A & (dest_A != me)) * row_bytes
  inter = jnp.sum(valid_A & ~same_node_A) * row_bytes
  return {"straggler": straggler / n, "token_bytes_intra_node": intra.astype(jnp.float32),
          "token_bytes_inter_node": inter.astype(jnp.float32)}
