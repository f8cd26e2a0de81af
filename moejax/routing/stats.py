"""Routing telemetry for one MoE layer and one step: fp32 scalars from the routing decisions.

Letters: T tokens (on this device), E experts, K slots per token.

Figures (all over kept assignments, i.e. expert ids in [0, E) where `kept_TxK` is True):
  load_max, load_mean, load_std  tokens per expert: max, mean and population std over experts
  top1_share                     load_max / total kept assignments (0 when nothing is kept)
  load_entropy                   entropy of the load distribution over experts, normalized by
                                 log(E): 1 = perfectly balanced, 0 = all on one expert (0 if E=1)
  experts_per_token              kept assignments per token
  dropped_frac                   fraction of the T*K slots not kept
  rerouted_frac                  fraction of the T*K slots kept on a rerouted expert

`axis_name` follows the share convention of router.py: inside `shard_map` the counts are summed
over that axis and each device returns its share, so that summing a figure over the axis gives
the value a single device would compute on the whole global batch. Figures that are not sums
(max, std, entropy) are computed from the global counts and split evenly over the axis.
Without `axis_name` (plain `jit`) the figures describe the tokens given.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from moejax.routing.router import _psum, expert_counts

STAT_KEYS = ("load_max", "load_mean", "load_std", "top1_share", "load_entropy",
             "experts_per_token", "dropped_frac", "rerouted_frac")


def routing_stats(experts_TxK: jax.Array, num_experts: int, *,
                  kept_TxK: jax.Array | None = None, rerouted_TxK: jax.Array | None = None,
                  axis_name=None, local_load_E: jax.Array | None = None,
                  mask_T: jax.Array | None = None) -> dict[str, jax.Array]:
  """Telemetry dict with keys STAT_KEYS (see the module docstring); no gradients.
  `local_load_E`: this device's kept assignments per expert, when the caller has counted them
  (`router.expert_counts(experts_TxK, num_experts, kept_TxK)`); else they are counted here.
  `mask_T` [T] bool: the real tokens (padding, marked False, has no slots: it is neither kept
  nor dropped)."""
  experts_TxK = jax.lax.stop_gradient(experts_TxK)
  num_tokens, k = experts_TxK.shape
  kept_mask_TxK = (experts_TxK >= 0) & (experts_TxK < num_experts)
  if kept_TxK is not None:
    kept_mask_TxK = kept_mask_TxK & kept_TxK
  if mask_T is not None:
    kept_mask_TxK = kept_mask_TxK & mask_T[:, None]
  rerouted = jnp.zeros((), jnp.int32)
  if rerouted_TxK is not None:
    rerouted = jnp.sum(rerouted_TxK & kept_mask_TxK, dtype=jnp.int32)

  if local_load_E is None:
    local_load_E = expert_counts(experts_TxK, num_experts, kept_mask_TxK)
  load_E = _psum(jax.lax.stop_gradient(local_load_E), axis_name).astype(jnp.float32)
  rerouted = _psum(rerouted, axis_name).astype(jnp.float32)
  tokens = _psum(jnp.asarray(num_tokens, jnp.float32) if mask_T is None
                 else jnp.sum(mask_T, dtype=jnp.float32), axis_name)
  devices = _psum(jnp.asarray(1.0, jnp.float32), axis_name)
  slots = tokens * k
  per_token, per_slot = jnp.maximum(tokens, 1.0), jnp.maximum(slots, 1.0)   # padding alone: 0

  kept = jnp.sum(load_E)
  load_max = jnp.max(load_E)
  load_mean = kept / num_experts
  load_std = jnp.sqrt(jnp.mean((load_E - load_mean) ** 2))
  safe_kept = jnp.maximum(kept, 1.0)
  p_E = load_E / safe_kept
  nats = -jnp.sum(jnp.where(p_E > 0, p_E * jnp.log(jnp.where(p_E > 0, p_E, 1.0)), 0.0))
  stats = dict(
      load_max=load_max,
      load_mean=load_mean,
      load_std=load_std,
      top1_share=load_max / safe_kept,
      load_entropy=nats / math.log(num_experts) if num_experts > 1 else jnp.zeros_like(nats),
      experts_per_token=kept / per_token,
      dropped_frac=(slots - kept) / per_slot,
      rerouted_frac=rerouted / per_slot,
  )
  return {key: (stats[key] / devices).astype(jnp.float32) for key in STAT_KEYS}
