"""Token dispatch: send each token-expert assignment to where its expert's weights are, run the
experts, bring the results back. Static shapes throughout.

Letters: T tokens here, K experts per token, A = T*K assignments, D width, E experts in all,
El experts held per device, N devices, C per-destination buffer capacity (tokens).

Dropped assignments carry the sentinel expert id E and produce zeros.

  local   every expert's weights are here (single device, or FSDP after the gather).
  ep      experts partitioned over the N devices; `all_to_all` with a static per-destination
          buffer of C rows.
  fssdp   as ep, plus this step's replicas of hot experts (moejax.placement.planner); each
          assignment goes to one device holding its expert (`exchange` with a destination and
          the expert's index there). Dropless when C = A (the worst case: every assignment to one
          device); with a capacity factor c, C = ceil(c * A / N) and overflow is dropped and
          counted. On GPU `lax.ragged_all_to_all` would move only the fill; XLA:CPU lacks it, so
          the static-buffer exchange is the path that runs and is tested here.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from moejax.placement.experts import run_sorted
from moejax.sharding.prefetch import recomputes


@dataclasses.dataclass(frozen=True)
class Dispatch:
  """How the MoE block reaches its experts (static)."""
  kind: str = "local"                 # "local" | "ep" | "fssdp"
  axis_names: tuple = ()
  num_devices: int = 1
  devices_per_node: int = 1
  capacity_factor: float = 0.0        # ep / fssdp; 0 = dropless
  replica_slots: int = 0              # fssdp: M replica slots per device per layer
  overlap_degree: int = 0             # fssdp: t, distinct experts materialized per step
  calibrate: bool = False             # fssdp: re-plan after gating when it pays


LOCAL = Dispatch()


def ep_capacity(num_assignments: int, num_devices: int, capacity_factor: float) -> int:
  if capacity_factor <= 0:
    return num_assignments
  return min(num_assignments, max(1, math.ceil(capacity_factor * num_assignments / num_devices)))


def combine(y_AxD, weights_TxK):
  t, k = weights_TxK.shape
  y_TxKxD = y_AxD.reshape(t, k, -1).astype(jnp.float32)
  return jnp.einsum("tkd,tk->td", y_TxKxD, weights_TxK.astype(jnp.float32))


def local_experts(x_TxD, experts_TxK, weights_TxK, w_gate, w_up, w_down):
  """All experts held here. Returns (y_TxD fp32, overflow count 0)."""
  t, k = experts_TxK.shape
  x_AxD = jnp.repeat(x_TxD, k, axis=0)
  y_AxD = run_sorted(x_AxD, experts_TxK.reshape(-1), w_gate.shape[0], w_gate, w_up, w_down)
  return combine(y_AxD, weights_TxK), jnp.zeros((), jnp.int32)


def exchange(x_TxD, dest_A, local_id_A, weights_TxK, w_gate, w_up, w_down, *,
             dispatch: Dispatch, num_groups: int):
  """Sends assignment a (token a // K) to device dest_A[a] (N = nowhere), where it runs through
  local expert group local_id_A[a] of the receiver's `num_groups` weight groups, and brings the
  result back. Returns (y_TxD fp32, assignments dropped for lack of buffer room here,
  rows received here)."""
  t, k = weights_TxK.shape
  n, a, d = dispatch.num_devices, t * k, x_TxD.shape[-1]
  c = ep_capacity(a, n, dispatch.capacity_factor)
  valid_A = dest_A < n
  onehot_AxN = jax.nn.one_hot(dest_A, n, dtype=jnp.int32)
  pos_A = jnp.sum((jnp.cumsum(onehot_AxN, axis=0) - onehot_AxN) * onehot_AxN, axis=1)
  fits_A = valid_A & (pos_A < c)
  slot_A = jnp.where(fits_A, dest_A * c + pos_A, n * c)          # n*c: a discard row
  x_AxD = jnp.repeat(x_TxD, k, axis=0)
  send_x = jnp.zeros((n * c + 1, d), x_TxD.dtype).at[slot_A].set(x_AxD)[:-1]
  send_g = jnp.full((n * c + 1,), num_groups, jnp.int32).at[slot_A].set(local_id_A)[:-1]
  axes = dispatch.axis_names
  recv_x = lax.all_to_all(send_x.reshape(n, c, d), axes, 0, 0, tiled=True)
  recv_g = lax.all_to_all(send_g.reshape(n, c), axes, 0, 0, tiled=True).reshape(-1)
  y_recv = run_sorted(recv_x.reshape(n * c, d), recv_g, num_groups, w_gate, w_up, w_down)
  y_back = lax.all_to_all(y_recv.reshape(n, c, d), axes, 0, 0, tiled=True).reshape(n * c, d)
  y_AxD = jnp.where(fits_A[:, None], y_back[jnp.minimum(slot_A, n * c - 1)], 0)
  dropped = jnp.sum(valid_A & ~fits_A).astype(jnp.int32)
  received = jnp.sum(recv_g < num_groups).astype(jnp.int32)
  return combine(y_AxD, weights_TxK), dropped, received


def ep_experts(x_TxD, experts_TxK, weights_TxK, w_gate, w_up, w_down, *, dispatch: Dispatch):
  """Expert parallel: experts [El, ...] here (device d owns experts d*El .. d*El+El-1).
  Returns (y_TxD fp32, assignments dropped here, rows received here)."""
  n = dispatch.num_devices
  el = w_gate.shape[0]
  expert_A = experts_TxK.reshape(-1)
  dest_A = jnp.where(expert_A < el * n, expert_A // el, n)
  return exchange(x_TxD, dest_A, expert_A % el, weights_TxK, w_gate, w_up, w_down,
                  dispatch=dispatch, num_groups=el)


def ep_a2a_bytes(tokens_per_device: int, top_k: int, d_model: int, num_devices: int,
                 capacity_factor: float, *, remat: str, itemsize: int = 2) -> float:
  """Bytes per device per MoE layer per step moved by the ep all_to_alls (buffer capacity).

  Forward sends tokens out and results back (2 exchanges, plus 4-byte expert ids); backward
  does the same for the cotangents (2); a recomputing remat (full, minimal: an all_to_all is no
  matmul) repeats the forward (2).
  """
  n = num_devices
  c = ep_capacity(tokens_per_device * top_k, n, capacity_factor)
  frac = (n - 1) / n
  one = frac * n * c * d_model * itemsize
  ids = frac * n * c * 4
  forward = 2 * one + ids
  return forward * (2 if recomputes(remat) else 1) + 2 * one
