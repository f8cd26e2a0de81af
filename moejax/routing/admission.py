"""Capacity-limited affinity admission: which top-k assignments each expert accepts.

Letters: T tokens (on this device), D router input width, E experts, K experts chosen per token,
N = T*K assignments, G groups (E experts plus one "no group" bucket).

After top-k, an expert's candidates are the (token, slot) assignments that chose it. The
*affinity* of token t and expert e is the cosine similarity between the router input x_t and the
expert's router vector w_e (column e of the router weight). An expert admits the candidates whose
affinity is >= `threshold`, highest affinity first (ties: lower token index first), up to its
capacity. Rejection by one expert leaves the token's other assignments untouched.

Policies:
  none     identity: every valid assignment is kept, capacity and threshold are ignored.
  strict   rejected assignments are dropped (expert id E, weight 0, kept False).
  reroute  strict admission first (its decisions are final, nothing it accepted is ever evicted,
           so strict-kept is a subset of reroute-kept); then each rejected assignment moves to the
           most similar expert (by affinity) that clears the threshold, still has room, and is not
           already one of the token's experts (under group-limited routing, one of the token's
           allowed groups: `allowed_TxE`); if none qualifies it is dropped.

Reroute runs in rounds. In each round every token that has rejected assignments and at least one
qualifying expert proposes its lowest pending slot to its most similar qualifying expert (ties:
lower expert id); each expert accepts proposals in descending affinity (ties: lower token index)
up to its remaining room. Accepted placements are final. A proposal that loses leaves its expert
full, and one that wins makes the expert one of the token's own: either way every proposing token
loses its current best option each round, so the loop ends after at most E rounds. Consequence,
tested: every rerouted assignment sits on the most similar expert that, at the end, is above the
threshold, not full and not already one of the token's experts; every assignment dropped by
reroute had no such expert left.

Cost: the affinity matrix is one [T, D] x [D, E] matmul. Ranking candidates within an expert
(affinity descending, then token index) takes two stable sorts of one int32 key each (the fp32
affinity mapped to an order-preserving integer, then the expert id): XLA sorts a single integer
key several times faster than fp32 or multi-key comparisons, and the order is the same, exactly.
When no expert has more candidates than room, every candidate is accepted and the sorts are
skipped (`lax.cond`). Strict admission ranks the N assignments once. Reroute adds rounds of
O(T*E) masking plus, where some expert is oversubscribed, the two sorts over T proposals; the
loop stops as soon as no token can propose: with capacity factor 1.25 usually after one round,
with a tight 1.0 after about three (at most E).

Combine weights:
  * a slot kept by strict admission keeps its weight unchanged, so with ample capacity and
    threshold -1 the output is identical to plain top-k;
  * a dropped slot gets weight 0 and, by default, the token's other weights are NOT renormalized:
    the token's MoE output shrinks and the residual stream carries it, as with Switch/GShard token
    dropping. Renormalizing would scale up the surviving experts by an amount that depends on how
    many *other* tokens competed for the same experts, which the router never scored.
    `renormalize_kept=True` rescales the kept slots so each token's weights sum to what they
    summed to before admission (a token with nothing kept stays all zero);
  * a rerouted slot gets the router score of its NEW expert, in the normalization of the slot's
    original weight: scores[t, new] * weights[t, k] / scores[t, old]. The factor is exactly 1 for
    raw top-k weights and 1/sum(top-k scores) after `top_k_route(renormalize=True)`. The router
    thus receives gradient for the expert that actually processes the token.

Gradients flow to the router through `weights_TxK` and `scores_TxE`; the decisions themselves are
not differentiable (affinities are computed under `stop_gradient`).

Capacity is per call: inside `shard_map` each device admits its own tokens against `capacity_E`
(expert-side limits of the local batch). All functions use static shapes and work under plain
`jit` (also with sharding annotations) and inside `shard_map`.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

POLICIES = ("none", "strict", "reroute")


class Admission(NamedTuple):
  """Result of `admit` (a pytree)."""
  experts_TxK: jax.Array    # int32; the expert that processes the slot, E where dropped
  weights_TxK: jax.Array    # fp32 combine weights; 0 where dropped
  kept_TxK: jax.Array       # bool
  rerouted_TxK: jax.Array   # bool; kept, on an expert other than the one top-k chose
  affinity_TxK: jax.Array   # fp32, no gradient; with the final expert where kept, with the
                            # originally chosen expert where dropped, 0 for invalid input slots


def affinity(x_TxD: jax.Array, router_w_DxE: jax.Array) -> jax.Array:
  """Cosine similarity of each router input and each expert's router vector, [T, E] fp32.

  Computed under `stop_gradient` at full fp32 precision, clipped to [-1, 1]; a zero vector has
  affinity 0 with everything.
  """
  x_TxD = jax.lax.stop_gradient(x_TxD).astype(jnp.float32)
  w_DxE = jax.lax.stop_gradient(router_w_DxE).astype(jnp.float32)
  x_norm_Tx1 = jnp.sqrt(jnp.sum(x_TxD * x_TxD, axis=-1, keepdims=True))
  w_norm_1xE = jnp.sqrt(jnp.sum(w_DxE * w_DxE, axis=0, keepdims=True))
  dot_TxE = jnp.matmul(x_TxD, w_DxE, precision=jax.lax.Precision.HIGHEST)
  # Scaling the [T, E] product, not the [T, D] inputs, keeps this one pass over x.
  cos_TxE = dot_TxE / jnp.maximum(x_norm_Tx1, 1e-30) / jnp.maximum(w_norm_1xE, 1e-30)
  return jnp.clip(cos_TxE, -1.0, 1.0)


def _descending_key(v_N: jax.Array) -> jax.Array:
  """int32 sort key of fp32 values: ascending key order is descending value order, exactly.

  -0.0 and 0.0 get the same key. XLA sorts one int32 key far faster than fp32 or several keys.
  """
  v_N = jnp.where(v_N == 0, 0.0, v_N).astype(jnp.float32)
  bits_N = jax.lax.bitcast_convert_type(v_N, jnp.int32)
  ascending_N = bits_N ^ ((bits_N >> 31) & 0x7FFFFFFF)  # order-preserving for every sign
  return ~ascending_N


def _rank_within_group(group_N: jax.Array, key_N: jax.Array, counts_G: jax.Array) -> jax.Array:
  """Rank of each item among the items of its group: key descending, then index ascending.

  `group_N` holds ids in [0, G); `counts_G` is how many items each group has. Two stable sorts
  of one int32 key each (by key, then by group).
  """
  n = group_N.shape[0]
  index_N = jnp.arange(n, dtype=jnp.int32)
  _, by_key_N = jax.lax.sort((_descending_key(key_N), index_N), num_keys=1, is_stable=True)
  group_sorted_N, order_N = jax.lax.sort((group_N[by_key_N], by_key_N), num_keys=1,
                                         is_stable=True)
  starts_G = jnp.cumsum(counts_G) - counts_G
  rank_sorted_N = index_N - starts_G[group_sorted_N]
  return jnp.zeros(n, jnp.int32).at[order_N].set(rank_sorted_N)


def _within_room(group_N: jax.Array, key_N: jax.Array, room_E: jax.Array,
                 num_experts: int) -> tuple[jax.Array, jax.Array]:
  """Which items their expert accepts: the room_E[e] best of group e (key descending, then
  index ascending); group id E (no expert) is never accepted. Also returns the room left.

  When no expert has more items than room, that is every item with an expert, and the sorts are
  skipped (`lax.cond`).
  """
  counts_G = jnp.zeros(num_experts + 1, jnp.int32).at[group_N].add(1)
  room_G = jnp.concatenate([room_E, jnp.zeros(1, room_E.dtype)])
  has_expert_N = group_N < num_experts

  def ranked():
    return _rank_within_group(group_N, key_N, counts_G) < room_G[group_N]

  accepted_N = jax.lax.cond(jnp.all(counts_G[:num_experts] <= room_E),
                            lambda: has_expert_N, ranked)
  return accepted_N, jnp.maximum(room_E - counts_G[:num_experts], 0)


def _strict(experts_TxK, valid_TxK, affinity_TxK, capacity_E, threshold, num_experts):
  """Strict admission: (kept_TxK, room_E left on each expert)."""
  num_tokens, k = experts_TxK.shape
  eligible_TxK = valid_TxK & (affinity_TxK >= threshold)
  group_N = jnp.where(eligible_TxK, experts_TxK, num_experts).reshape(num_tokens * k)
  kept_N, room_E = _within_room(group_N, affinity_TxK.reshape(num_tokens * k), capacity_E,
                                num_experts)
  return kept_N.reshape(num_tokens, k), room_E


def _first_true(mask_TxK: jax.Array) -> jax.Array:
  """The first True of each row (an exclusive prefix-or over the few slots, unrolled)."""
  seen_T = jnp.zeros(mask_TxK.shape[:1], jnp.bool_)
  first = []
  for slot in range(mask_TxK.shape[1]):
    first.append(mask_TxK[:, slot] & ~seen_T)
    seen_T = seen_T | mask_TxK[:, slot]
  return jnp.stack(first, axis=1)


def _reroute(experts_TxK, valid_TxK, strict_kept_TxK, room_E, affinity_TxE, threshold,
             num_experts, allowed_TxE=None):
  """Final expert per slot after rerouting the strict rejects (E where dropped).

  `room_E` is what strict admission left on each expert; `allowed_TxE` (optional) the experts
  each token may go to (group-limited routing).
  """
  clears_TxE = affinity_TxE >= threshold
  if allowed_TxE is not None:
    clears_TxE = clears_TxE & allowed_TxE
  expert_ids_E = jnp.arange(num_experts, dtype=jnp.int32)
  member_TxE = jnp.any((experts_TxK[:, :, None] == expert_ids_E[None, None, :])
                       & valid_TxK[:, :, None], axis=1)
  pending_TxK = valid_TxK & ~strict_kept_TxK
  target_TxK = jnp.where(strict_kept_TxK, experts_TxK, num_experts)

  def proposals(room_E, member_TxE, pending_TxK):
    options_TxE = clears_TxE & (room_E > 0)[None, :] & ~member_TxE
    masked_TxE = jnp.where(options_TxE, affinity_TxE, -jnp.inf)
    best_T = jnp.argmax(masked_TxE, axis=1).astype(jnp.int32)  # ties: lower expert id
    has_option_T = jnp.take_along_axis(options_TxE, best_T[:, None], axis=1)[:, 0]
    return jnp.any(pending_TxK, axis=1) & has_option_T, best_T

  def cond(carry):
    round_, *_, proposing_T, _ = carry
    return (round_ < num_experts) & jnp.any(proposing_T)

  def body(carry):
    round_, room_E, member_TxE, pending_TxK, target_TxK, proposing_T, best_T = carry
    group_T = jnp.where(proposing_T, best_T, num_experts)
    key_T = jnp.take_along_axis(affinity_TxE, best_T[:, None], axis=1)[:, 0]
    accepted_T, room_E = _within_room(group_T, key_T, room_E, num_experts)
    placed_TxK = _first_true(pending_TxK) & accepted_T[:, None]
    target_TxK = jnp.where(placed_TxK, best_T[:, None], target_TxK)
    pending_TxK = pending_TxK & ~placed_TxK
    member_TxE = member_TxE | ((best_T[:, None] == expert_ids_E[None, :]) & accepted_T[:, None])
    return (round_ + 1, room_E, member_TxE, pending_TxK, target_TxK,
            *proposals(room_E, member_TxE, pending_TxK))

  carry = (jnp.int32(0), room_E, member_TxE, pending_TxK, target_TxK,
           *proposals(room_E, member_TxE, pending_TxK))
  return jax.lax.while_loop(cond, body, carry)[4]


def admit(x_TxD: jax.Array, router_w_DxE: jax.Array, experts_TxK: jax.Array,
          weights_TxK: jax.Array, scores_TxE: jax.Array, *, capacity_E: jax.Array,
          threshold: float | jax.Array, policy: str,
          renormalize_kept: bool = False, allowed_TxE: jax.Array | None = None) -> Admission:
  """Capacity-limited affinity admission of top-k assignments (see the module docstring).

  Args:
    x_TxD: the router input (the hidden state fed to the router).
    router_w_DxE: the router weight; column e is expert e's router vector.
    experts_TxK, weights_TxK, scores_TxE: `top_k_route` outputs. Expert ids outside [0, E) mark
      slots that are already empty; they are never kept.
    capacity_E: per-expert capacity for this call, [E] ints or one int for every expert (may be
      traced, may differ per expert).
    threshold: minimum affinity (cosine similarity, may be traced); -1 admits everything.
    policy: one of POLICIES (static).
    renormalize_kept: rescale kept weights so each token's total is what it was before admission.
    allowed_TxE: the experts each token may be rerouted to (`router.allowed_experts` under
      group-limited routing: a rerouted assignment stays in the token's groups); None: any.
  """
  if policy not in POLICIES:
    raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
  num_tokens, k = experts_TxK.shape
  num_experts = router_w_DxE.shape[-1]
  if scores_TxE.shape != (num_tokens, num_experts) or weights_TxK.shape != (num_tokens, k):
    raise ValueError(
        f"shapes disagree: experts_TxK {experts_TxK.shape}, weights_TxK {weights_TxK.shape}, "
        f"scores_TxE {scores_TxE.shape}, router_w_DxE {router_w_DxE.shape}")
  experts_TxK = experts_TxK.astype(jnp.int32)
  weights_TxK = weights_TxK.astype(jnp.float32)
  scores_TxE = scores_TxE.astype(jnp.float32)
  if jnp.ndim(capacity_E) == 0:       # one capacity for every expert
    capacity_E = jnp.full((num_experts,), capacity_E, jnp.int32)
  if jnp.shape(capacity_E) != (num_experts,):
    raise ValueError(f"capacity_E must be a scalar or [{num_experts}] (one per expert of "
                     f"router_w_DxE {router_w_DxE.shape}), got shape {jnp.shape(capacity_E)}")
  if isinstance(threshold, (int, float)) and not -1.0 <= threshold <= 1.0:
    raise ValueError(f"threshold={threshold}: a cosine similarity, in [-1, 1] (-1 admits "
                     "everything)")
  capacity_E = jnp.maximum(jnp.asarray(capacity_E, jnp.int32), 0)
  threshold = jnp.asarray(threshold, jnp.float32)

  valid_TxK = (experts_TxK >= 0) & (experts_TxK < num_experts)
  safe_experts_TxK = jnp.where(valid_TxK, experts_TxK, 0)
  affinity_TxE = affinity(x_TxD, router_w_DxE)
  chosen_affinity_TxK = jnp.where(
      valid_TxK, jnp.take_along_axis(affinity_TxE, safe_experts_TxK, axis=1), 0.0)

  if policy == "none":
    kept_TxK = valid_TxK
    final_TxK = jnp.where(valid_TxK, experts_TxK, num_experts)
  else:
    kept_TxK, room_E = _strict(experts_TxK, valid_TxK, chosen_affinity_TxK, capacity_E,
                               threshold, num_experts)
    if policy == "strict":
      final_TxK = jnp.where(kept_TxK, experts_TxK, num_experts)
    else:
      final_TxK = _reroute(experts_TxK, valid_TxK, kept_TxK, room_E, affinity_TxE, threshold,
                           num_experts, allowed_TxE)
  strict_kept_TxK = kept_TxK
  kept_TxK = final_TxK < num_experts
  rerouted_TxK = kept_TxK & ~strict_kept_TxK

  safe_final_TxK = jnp.where(kept_TxK, final_TxK, 0)
  new_score_TxK = jnp.take_along_axis(scores_TxE, safe_final_TxK, axis=1)
  old_score_TxK = jnp.take_along_axis(scores_TxE, safe_experts_TxK, axis=1)
  old_nonzero_TxK = old_score_TxK != 0
  scale_TxK = jnp.where(old_nonzero_TxK,
                        weights_TxK / jnp.where(old_nonzero_TxK, old_score_TxK, 1.0), 1.0)
  out_weights_TxK = jnp.where(strict_kept_TxK, weights_TxK,
                              jnp.where(rerouted_TxK, new_score_TxK * scale_TxK, 0.0))
  if renormalize_kept:
    before_Tx1 = jnp.sum(jnp.where(valid_TxK, weights_TxK, 0.0), axis=1, keepdims=True)
    after_Tx1 = jnp.sum(out_weights_TxK, axis=1, keepdims=True)
    has_Tx1 = after_Tx1 != 0
    out_weights_TxK = out_weights_TxK * jnp.where(
        has_Tx1, before_Tx1 / jnp.where(has_Tx1, after_Tx1, 1.0), 0.0)

  affinity_TxK = jnp.where(
      kept_TxK, jnp.take_along_axis(affinity_TxE, safe_final_TxK, axis=1), chosen_affinity_TxK)
  return Admission(experts_TxK=final_TxK.astype(jnp.int32), weights_TxK=out_weights_TxK,
                   kept_TxK=kept_TxK, rerouted_TxK=rerouted_TxK, affinity_TxK=affinity_TxK)


def _ceil(value: float, most: int) -> int:
  """ceil(value) in [1, most]: a positive factor admits at least one, and no expert takes more
  than every assignment (a huge factor means no limit, not an int32 overflow). Forgives float
  noise: 1.25 * 8 * 2 / 4 must give 5, not 6."""
  return most if value >= most else max(1, math.ceil(value - 1e-9))


def capacity_schedule(step: int | jax.Array, *, num_tokens: int, k: int, num_experts: int,
                      factor: float, factor_warmup: float | None = None, warmup_steps: int = 0,
                      layer: int | jax.Array | None = None,
                      layer_factors: Sequence[float | None] | None = None,
                      expert_share_E: jax.Array | None = None) -> jax.Array:
  """Per-expert capacity for one layer at one step, int32 [E].

  capacity_e = ceil(f * num_tokens * k * share_e), share_e = 1/E unless `expert_share_E` (a
  distribution over experts, e.g. from a load history) is given. The factor f is
  `factor_warmup` while step < warmup_steps, then `factor`; `layer_factors[layer]`, when given
  and not None, replaces `factor` (after warm-up) for that layer. `step` and `layer` may be
  traced (a scan over layers); the table of factors is static. Capacity is fixed for the whole
  micro-batch. With uniform shares the figures are computed exactly on the host.
  """
  if not 0 < factor < math.inf:
    raise ValueError(f"factor={factor}: must be positive and finite")
  if factor_warmup is None:
    factor_warmup = factor
  if not 0 < factor_warmup < math.inf:
    raise ValueError(f"factor_warmup={factor_warmup}: must be positive and finite")
  if warmup_steps < 0:
    raise ValueError(f"warmup_steps={warmup_steps}: must be >= 0")
  if layer_factors is not None:
    if layer is None:
      raise ValueError("layer_factors needs the layer index `layer`")
    bad = [f for f in layer_factors if f is not None and not 0 < f < math.inf]
    if bad:
      raise ValueError(f"layer_factors={list(layer_factors)}: factors must be positive and "
                       "finite")
    after_L = [factor if f is None else f for f in layer_factors]
  else:
    after_L = [factor]
    layer = 0
  assignments = num_tokens * k
  warming = jnp.asarray(step) < warmup_steps
  if expert_share_E is None:
    warm_cap = _ceil(factor_warmup * assignments / num_experts, assignments)
    cap_L = jnp.asarray([_ceil(f * assignments / num_experts, assignments) for f in after_L],
                        jnp.int32)
    cap = jnp.where(warming, warm_cap, cap_L[layer])
    return jnp.broadcast_to(cap, (num_experts,)).astype(jnp.int32)
  # A huge factor kept finite in float32: f * assignments * share stays a number (inf times a
  # zero share would be NaN, which casts to a capacity of 0); a no-op for any real factor.
  most = float(np.finfo(np.float32).max) / max(assignments, 1)
  f = jnp.where(warming, min(factor_warmup, most),
                jnp.asarray([min(x, most) for x in after_L], jnp.float32)[layer])
  share_E = jnp.asarray(expert_share_E, jnp.float32)
  # Forgives fp32 noise relative to the value (1.2 is stored a little above 1.2: 3 experts' equal
  # shares of 100 assignments must give 40, not 41).
  value_E = f * assignments * share_E
  cap_E = jnp.ceil(value_E - 4e-7 * jnp.maximum(value_E, 1.0))
  return jnp.clip(cap_E, 0, assignments).astype(jnp.int32)
