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

from moejax.routing.router import _psum, expert_counts, local_tokens

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
  if local_load_E is None:
    local_load_E = expert_counts(experts_TxK, num_experts,
                                 kept_mask(experts_TxK, num_experts, kept_TxK, mask_T))
  return stats_from_counts(local_load_E,
                           rerouted_count(experts_TxK, num_experts, kept_TxK, rerouted_TxK,
                                          mask_T),
                           local_tokens(num_tokens, mask_T), k, axis_name)


def kept_mask(experts_TxK, num_experts: int, kept_TxK=None, mask_T=None) -> jax.Array:
  """[T, K] bool: the kept assignments (an expert id in [0, E), kept, of a real token)."""
  kept_mask_TxK = (experts_TxK >= 0) & (experts_TxK < num_experts)
  if kept_TxK is not None:
    kept_mask_TxK = kept_mask_TxK & kept_TxK
  if mask_T is not None:
    kept_mask_TxK = kept_mask_TxK & mask_T[:, None]
  return kept_mask_TxK


def rerouted_count(experts_TxK, num_experts: int, kept_TxK=None, rerouted_TxK=None,
                   mask_T=None) -> jax.Array:
  """This device's kept assignments on a rerouted expert, int32 []."""
  if rerouted_TxK is None:
    return jnp.zeros((), jnp.int32)
  kept_mask_TxK = kept_mask(jax.lax.stop_gradient(experts_TxK), num_experts, kept_TxK, mask_T)
  return jnp.sum(rerouted_TxK & kept_mask_TxK, dtype=jnp.int32)


def stats_from_counts(local_load_E, rerouted, tokens, k: int,
                      axis_name=None) -> dict[str, jax.Array]:
  """STAT_KEYS from this device's counts: kept assignments per expert [..., E], rerouted
  assignments [...] and tokens [...] (`router.local_tokens`), K slots a token; each figure
  [...]. Works on counts stacked over layers (one collective for all of them)."""
  num_experts = local_load_E.shape[-1]
  load_E = _psum(jax.lax.stop_gradient(local_load_E), axis_name).astype(jnp.float32)
  rerouted = _psum(rerouted, axis_name).astype(jnp.float32)
  tokens = _psum(tokens, axis_name)
  devices = _psum(jnp.asarray(1.0, jnp.float32), axis_name)
  slots = tokens * k
  per_token, per_slot = jnp.maximum(tokens, 1.0), jnp.maximum(slots, 1.0)   # padding alone: 0

  kept = jnp.sum(load_E, axis=-1)
  load_max = jnp.max(load_E, axis=-1)
  load_mean = kept / num_experts
  load_std = jnp.sqrt(jnp.mean((load_E - load_mean[..., None]) ** 2, axis=-1))
  safe_kept = jnp.maximum(kept, 1.0)
  p_E = load_E / safe_kept[..., None]
  nats = -jnp.sum(jnp.where(p_E > 0, p_E * jnp.log(jnp.where(p_E > 0, p_E, 1.0)), 0.0),
                  axis=-1)
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
