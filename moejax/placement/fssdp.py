"""FSSDP in the MoE block: sparse materialization of hot experts and their dispatch.

Letters: T tokens here, K experts per token, E experts, L layers, N devices, El = E/N,
S = L*El storage slots per device, C the most experts one device owns in one layer
(fssdp.max_per_layer), M replica slots per device, D width, F expert hidden width.

Every expert is owned whole by one device, with its optimizer state; `Owners` says which (the
owner table of `moejax.placement.reshard`, heterogeneous across layers). Without one, expert
e is owned by device e // El, like `ep`. `owned_windows` turns a device's S stored slots into
[L, C] per-layer windows of its owned experts (a local gather, no communication; its gradient
scatters back into the slots). Each step and layer:
  1. `materialize`: plan replicas from the *predicted* loads (`planner.materialize_plan`)
     and fetch them with SparseAllGather, before the layer's attention, so the transfer can hide
     behind it. SparseAllGather is one `psum_scatter` of an [N, M, ...] buffer in which each
     owner fills the slots that hold its experts: device d receives its M replica slots. Its
     transpose (the backward) is an `all_gather` of the replicas' gradients in fp32, of which each
     owner keeps and sums its own rows in fp32: SparseReduceScatter. Only gradients move;
     optimizer state never.
  2. After gating, every device learns all devices' routing counts (one all_gather of N x E
     ints) and computes the same balanced assignment of tokens to holders
     (`planner.balanced_send`); tokens go local first, then within the node, then across.
     With `calibrate`, the plan is re-made from the actual counts and adopted (with a second,
     late SparseAllGather) when its modelled straggler is lower by a margin.
  3. The exchange is ep's `all_to_all` with a destination and the expert's local group there
     (owned experts 0..C-1 by their rank on the owner, replica slots C..C+M-1).
On XLA:CPU the static buffers move their capacity (N*M expert slots for SpAG); on GPU/TPU
`ragged_all_to_all` moves only the filled slots (`ragged_plan`, chosen by
`lax.platform_dependent`), and the token exchange only the filled rows
(`dispatch.send_blocks`). Metrics report capacity and fill.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from moejax.placement.dispatch import Dispatch, exchange
from moejax.routing import router as router_lib
from moejax.placement import ownership, planner


class Owners(NamedTuple):
  """One layer's (or, stacked, every layer's) ownership: owner_E, the device owning each expert,
  and rank_E, the expert's index among the experts of this layer its owner holds."""
  owner_E: jax.Array
  rank_E: jax.Array


def even_owners(num_experts: int, num_devices: int) -> Owners:
  """The even start (`ownership.initial_placement`) with each expert's rank on its owner."""
  owner_E = jnp.asarray(ownership.initial_placement(1, num_experts, num_devices)[0])
  return Owners(owner_E, jnp.arange(num_experts, dtype=jnp.int32) % (num_experts // num_devices))


def owned_windows(owner_LxE, local_w_LxElxR, me, *, num_devices: int, max_per_layer: int):
  """(Owners stacked over layers, windows [L, C, ...]): this device's experts of each layer, read
  from its S stored slots (see `moejax.placement.reshard`); `local_w_LxElxR` may be a pytree
  of such arrays. Row c of layer l holds the expert of rank c; rows past the layer's count hold
  other slots and are never addressed."""
  num_layers, num_experts = owner_LxE.shape
  slots = num_layers * (num_experts // num_devices)
  onehot_QxN = jax.nn.one_hot(owner_LxE.reshape(-1), num_devices, dtype=jnp.int32)
  slot_Q = jnp.sum((jnp.cumsum(onehot_QxN, axis=0) - onehot_QxN) * onehot_QxN, axis=1)
  count_LxN = jnp.sum(onehot_QxN.reshape(num_layers, num_experts, num_devices), axis=1)
  start_LxN = jnp.cumsum(count_LxN, axis=0) - count_LxN          # first slot of each layer
  start_LxE = jnp.take_along_axis(start_LxN, owner_LxE, axis=1)
  rank_LxE = slot_Q.reshape(num_layers, num_experts) - start_LxE
  slot_LxC = jnp.minimum(start_LxN[:, me][:, None] + jnp.arange(max_per_layer)[None, :], slots - 1)
  windows = jax.tree.map(lambda w: w.reshape((slots,) + w.shape[2:])[slot_LxC], local_w_LxElxR)
  return Owners(owner_LxE, rank_LxE), windows


def sparse_all_gather(local_w_CxR, replica_expert_NxM, *, dispatch: Dispatch,
                      owners: Owners | None = None):
  """Replicas [M, ...] of the experts `replica_expert_NxM[me]` (E = empty slot -> zeros).
  `local_w_CxR` holds this device's experts by rank (`owners`; default: the even ownership).
  Its transpose, SparseReduceScatter, sums each owned expert's replica gradients in fp32."""
  n = dispatch.num_devices
  if owners is None:
    owners = even_owners(local_w_CxR.shape[0] * n, n)
  e = owners.owner_E.shape[0]
  safe_NxM = jnp.minimum(replica_expert_NxM, e - 1)
  valid_NxM = replica_expert_NxM < e
  holder_NxM = jnp.where(valid_NxM, owners.owner_E[safe_NxM], n)   # who fills each slot
  rank_NxM = jnp.where(valid_NxM, owners.rank_E[safe_NxM], 0)
  return _sparse_all_gather(local_w_CxR, holder_NxM, rank_NxM, dispatch.axis_names)


def _masked(x_NxMxR, mine_NxM):
  mask = mine_NxM.reshape(mine_NxM.shape + (1,) * (x_NxMxR.ndim - 2))
  return jnp.where(mask, x_NxMxR, jnp.zeros((), x_NxMxR.dtype))


class RaggedPlan(NamedTuple):
  """Where each replica row travels in the ragged SparseAllGather (GPU), from the replicated
  plan alone. As owner, this device sends its rows in (destination, slot) order: `order` [N*M]
  lists first the flat (d, slot) indices it fills; `send_N` rows to each destination, from
  `start_N`, landing at `land_N` there. As receiver it gets `recv_N` rows from each owner,
  grouped by owner; received row j belongs in slot `slot_of_row[j]`."""
  order: jax.Array
  send_N: jax.Array
  start_N: jax.Array
  land_N: jax.Array
  recv_N: jax.Array
  slot_of_row: jax.Array


def ragged_plan(holder_NxM, me) -> RaggedPlan:
  n, m = holder_NxM.shape
  flat_NxM = jnp.arange(n * m, dtype=jnp.int32).reshape(n, m)
  mine_NxM = holder_NxM == me
  order = jnp.argsort(jnp.where(mine_NxM, flat_NxM, n * m).reshape(-1), stable=True)
  send_N = jnp.sum(mine_NxM, axis=1, dtype=jnp.int32)
  # count_OxD[o, d]: slots of device d that owner o fills (the empty-slot holder n drops out).
  count_OxD = jnp.sum(jax.nn.one_hot(holder_NxM, n, dtype=jnp.int32), axis=1).T
  before_OxD = jnp.cumsum(count_OxD, axis=0) - count_OxD       # rows from lower owners first
  mine_M = holder_NxM[me]
  slot_of_row = jnp.argsort(jnp.where(mine_M < n, mine_M * m + jnp.arange(m), n * m),
                            stable=True)
  return RaggedPlan(order.astype(jnp.int32), send_N, jnp.cumsum(send_N) - send_N,
                    before_OxD[me], count_OxD[:, me], slot_of_row.astype(jnp.int32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _sparse_all_gather(local_w_CxR, holder_NxM, rank_NxM, axis_names):
  """Device d receives its M slots, each filled by the owner of its expert (`holder`, the
  expert at `rank` among the owner's own; holder N: an empty slot, zeros). XLA:CPU: one
  psum_scatter of the [N, M, ...] buffer every owner fills with its rows; GPU/TPU: one
  `ragged_all_to_all` of the filled rows only (`ragged_plan`)."""
  def static(local_w_CxR, holder_NxM, rank_NxM):
    me = lax.axis_index(axis_names)
    send_NxMxR = _masked(local_w_CxR[rank_NxM], holder_NxM == me)
    return lax.psum_scatter(send_NxMxR, axis_names, scatter_dimension=0, tiled=False)

  def ragged(local_w_CxR, holder_NxM, rank_NxM):
    m = holder_NxM.shape[1]
    plan = ragged_plan(holder_NxM, lax.axis_index(axis_names))
    rows = local_w_CxR[rank_NxM.reshape(-1)[plan.order]]
    out = jnp.zeros((m,) + local_w_CxR.shape[1:], local_w_CxR.dtype)
    got = lax.ragged_all_to_all(rows, out, plan.start_N, plan.send_N, plan.land_N, plan.recv_N,
                                axis_name=axis_names)
    return jnp.zeros_like(got).at[plan.slot_of_row].set(got)

  return lax.platform_dependent(local_w_CxR, holder_NxM, rank_NxM, cpu=static, default=ragged)


def _sparse_all_gather_fwd(local_w_CxR, holder_NxM, rank_NxM, axis_names):
  like_Cx0 = jnp.zeros((local_w_CxR.shape[0], 0), local_w_CxR.dtype)   # its rows and dtype
  return (_sparse_all_gather(local_w_CxR, holder_NxM, rank_NxM, axis_names),
          (holder_NxM, rank_NxM, like_Cx0))


def _sparse_reduce_scatter(axis_names, res, g_MxR):
  """The replicas' gradients go home in fp32 (as the hook's reduce-scatter), where each owner
  sums those of its experts in fp32 and rounds once. XLA:CPU: an all_gather of every device's
  [M, ...] gradients, each owner keeping its rows; GPU/TPU: the ragged exchange reversed."""
  holder_NxM, rank_NxM, like_Cx0 = res
  shape = like_Cx0.shape[:1] + g_MxR.shape[1:]
  zeros_CxR = jnp.zeros(shape, jnp.float32)

  def static(g_MxR, holder_NxM, rank_NxM):
    me = lax.axis_index(axis_names)
    g_NxMxR = _masked(lax.all_gather(g_MxR, axis_names, axis=0), holder_NxM == me)
    return zeros_CxR.at[rank_NxM.reshape(-1)].add(g_NxMxR.reshape((-1,) + shape[1:]))

  def ragged(g_MxR, holder_NxM, rank_NxM):
    n, m = holder_NxM.shape
    plan = ragged_plan(holder_NxM, lax.axis_index(axis_names))
    back = jnp.zeros((n * m,) + shape[1:], jnp.float32)
    # Sent back in the order received; each row lands where its owner sent it from.
    rows = lax.ragged_all_to_all(
        g_MxR[plan.slot_of_row], back, jnp.cumsum(plan.recv_N) - plan.recv_N, plan.recv_N,
        lax.all_to_all(plan.start_N, axis_names, 0, 0, tiled=True), plan.send_N,
        axis_name=axis_names)
    return zeros_CxR.at[rank_NxM.reshape(-1)[plan.order]].add(rows)

  d_CxR = lax.platform_dependent(g_MxR.astype(jnp.float32), holder_NxM, rank_NxM, cpu=static,
                                 default=ragged)
  return d_CxR.astype(like_Cx0.dtype), None, None


_sparse_all_gather.defvjp(_sparse_all_gather_fwd, _sparse_reduce_scatter)


def materialize(predicted_load_E, w_gate, w_up, w_down, *, dispatch: Dispatch,
                owners: Owners | None = None):
  """This step's plan and weights: (plan, (w_gate, w_up, w_down) of [C + M, ...], owners).
  w_* hold this device's experts of the layer by rank (`owners`; default: even, C = El)."""
  n = dispatch.num_devices
  if owners is None:
    owners = even_owners(w_gate.shape[0] * n, n)
  plan = planner.materialize_plan(
      predicted_load_E, owners.owner_E, num_devices=n,
      devices_per_node=dispatch.devices_per_node, replica_slots=dispatch.replica_slots,
      overlap_degree=dispatch.overlap_degree)
  weights = tuple(jnp.concatenate([w, sparse_all_gather(w, plan.replica_expert_NxM,
                                                        dispatch=dispatch, owners=owners)], axis=0)
                  for w in (w_gate, w_up, w_down))
  return plan, weights, owners


def fssdp_experts(x_TxD, experts_TxK, weights_TxK, plan, w_gate, w_up, w_down, *,
                  dispatch: Dispatch, owners: Owners):
  """Runs each assignment on one holder of its expert. w_* are [C + M, ...] (owned by rank, then
  this step's replicas). Returns (y_TxD fp32, assignments dropped, placement stats)."""
  n, dpn = dispatch.num_devices, dispatch.devices_per_node
  c = w_gate.shape[0] - dispatch.replica_slots
  e = owners.owner_E.shape[0]
  me = lax.axis_index(dispatch.axis_names)
  counts_E = router_lib.expert_counts(experts_TxK, e)
  source_load_NxE = lax.all_gather(counts_E, dispatch.axis_names, axis=0, tiled=False)

  def run(plan, w_gate, w_up, w_down):
    send_ExN = planner.balanced_send(plan.holders_ExN, source_load_NxE,
                                     devices_per_node=dpn)[me]
    dest_TxK = planner.dispatch_devices(experts_TxK, me, plan, devices_per_node=dpn,
                                        send_ExN=send_ExN)
    expert_A, dest_A = experts_TxK.reshape(-1), dest_TxK.reshape(-1)
    safe_e = jnp.minimum(expert_A, e - 1)
    owned_A = dest_A == owners.owner_E[safe_e]
    replica_A = plan.replica_slot_ExN[safe_e, jnp.minimum(dest_A, n - 1)]
    local_id_A = jnp.where(owned_A, owners.rank_E[safe_e], c + jnp.maximum(replica_A, 0))
    y_TxD, dropped, received, needed = exchange(
        x_TxD, dest_A, local_id_A, weights_TxK, w_gate, w_up, w_down, dispatch=dispatch,
        num_groups=c + dispatch.replica_slots)
    stats = placement_stats(received, needed, dest_A, dispatch, x_TxD.shape[-1],
                            x_TxD.dtype.itemsize)
    stats["replicas"] = plan.num_replicas.astype(jnp.float32) / n
    return y_TxD, dropped, stats

  if not dispatch.calibrate:
    return run(plan, w_gate, w_up, w_down)
  # Re-plan with the actual loads; adopted (with a late SparseAllGather) only when it pays.
  # Every device computes the same decision from the same gathered counts. The late gather sits
  # in the branch with the exchange and expert compute, so it can overlap them (a collective
  # alone in a branch starts and finishes there).
  fresh, adopted = planner.calibrate(
      plan, jnp.sum(source_load_NxE, axis=0), owners.owner_E, num_devices=n,
      devices_per_node=dpn, replica_slots=dispatch.replica_slots,
      overlap_degree=dispatch.overlap_degree, actual_source_load_NxE=source_load_NxE)

  def late_gather(weights):
    return run(fresh, *(jnp.concatenate([w[:c], sparse_all_gather(
        w[:c], fresh.replica_expert_NxM, dispatch=dispatch, owners=owners)], axis=0)
                        for w in weights))

  # Not adopted, `fresh` is the current plan (its loads updated to the actual ones).
  return lax.cond(adopted, late_gather, lambda weights: run(fresh, *weights),
                  (w_gate, w_up, w_down))


def ep_stats(experts_TxK, received, needed, dispatch: Dispatch, d_model: int, num_local: int,
             itemsize: int = 2):
  expert_A = experts_TxK.reshape(-1)
  n = dispatch.num_devices
  dest_A = jnp.where(expert_A < num_local * n, expert_A // num_local, n)
  stats = placement_stats(received, needed, dest_A, dispatch, d_model, itemsize)
  stats["replicas"] = jnp.zeros((), jnp.float32)
  return stats


def placement_stats(received, needed, dest_A, dispatch: Dispatch, d_model: int,
                    itemsize: int = 2):
  """This device's share of: straggler factor (max over devices of expert rows processed / mean),
  the dispatch rows needed at one destination (`exchange`'s `needed`, the same everywhere) and
  token bytes sent to other devices of the node and to other nodes (there and back)."""
  n, dpn = dispatch.num_devices, dispatch.devices_per_node
  me = lax.axis_index(dispatch.axis_names)
  rows_N = lax.all_gather(received, dispatch.axis_names, axis=0, tiled=False).astype(jnp.float32)
  straggler = jnp.max(rows_N) / jnp.maximum(jnp.mean(rows_N), 1.0)
  valid_A = dest_A < n
  same_node_A = (dest_A // dpn) == (me // dpn)
  row_bytes = 2.0 * d_model * itemsize
  intra = jnp.sum(valid_A & same_node_A & (dest_A != me)) * row_bytes
  inter = jnp.sum(valid_A & ~same_node_A) * row_bytes
  return {"straggler": straggler / n, "dispatch_needed": needed.astype(jnp.float32) / n,
          "token_bytes_intra_node": intra.astype(jnp.float32),
          "token_bytes_inter_node": inter.astype(jnp.float32)}
