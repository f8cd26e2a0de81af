"""Token-side routers and their auxiliary losses: pure functions on arrays.

Letters: T tokens (on this device), E experts, K experts chosen per token.

Every loss takes an optional `axis_name`. With it, the statistics that define the loss are
summed over that mesh axis (inside `shard_map`) and the function returns *this device's share*,
so that summing the shares over devices gives the loss of the whole global batch, exactly as a
single device holding the whole batch would compute it. Without it (plain `jit`, including with
sharding annotations), it returns the loss of the tokens it is given. Gradients never flow through
a collective: only non-differentiable counts are summed.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

SCORE_FUNCTIONS = ("softmax", "sigmoid")
# How group-limited top-k scores a group: the sum of its two best experts (DeepSeek-V3's
# noaux_tc) or its best (DeepSeek-V2's group_limited_greedy).
GROUP_SCORES = ("top2", "max")


def _psum(x, axis_name):
  return x if axis_name is None else jax.lax.psum(x, axis_name)


def router_scores(logits_TxE: jax.Array, score: str = "softmax") -> jax.Array:
  """Per-expert scores in fp32: softmax over experts, or independent sigmoids."""
  logits_TxE = logits_TxE.astype(jnp.float32)
  if score == "softmax":
    return jax.nn.softmax(logits_TxE, axis=-1)
  if score == "sigmoid":
    return jax.nn.sigmoid(logits_TxE)
  raise ValueError(f"score must be one of {SCORE_FUNCTIONS}, got {score!r}")


def top_k_route(logits_TxE: jax.Array, k: int, *, score: str = "softmax",
                renormalize: bool = False, bias_E: jax.Array | None = None, groups: int = 1,
                top_groups: int = 1, scale: float = 1.0, group_score: str = "top2",
                bias_on_logits: bool = False):
  """Token-side top-k.

  `bias_E` (DeepSeek-V3's auxiliary-loss-free balancing) is added to the scores for the choice
  only: the weights are the unbiased scores of the chosen experts, and no gradient reaches it;
  `bias_on_logits`: added to the logits instead (Kolibri's; the same choice unless biased, the
  score functions being monotone per token).
  `groups` > 1 (group-limited top-k): the experts split into `groups` equal groups, each scored by
  the sum of its two best (biased) scores (`group_score="top2"`) or its best ("max"); a token
  chooses among the experts of its `top_groups` best groups. After the optional renormalization the weights are multiplied by `scale`
  (routed_scaling_factor).

  Returns (weights_TxK fp32, experts_TxK int32, scores_TxE fp32). Ties go to the lower expert id
  (`lax.top_k` order), so the choice is deterministic.
  """
  scores_TxE = router_scores(logits_TxE, score)
  choice_TxE = _choice(logits_TxE if bias_on_logits and bias_E is not None else scores_TxE,
                       bias_E)
  if groups > 1:
    allowed_TxE = _allowed(choice_TxE, groups, top_groups, group_score)
    choice_TxE = jnp.where(allowed_TxE, choice_TxE, -jnp.inf)
  if choice_TxE is scores_TxE:
    weights_TxK, experts_TxK = jax.lax.top_k(scores_TxE, k)
  else:
    _, experts_TxK = jax.lax.top_k(jax.lax.stop_gradient(choice_TxE), k)
    weights_TxK = jnp.take_along_axis(scores_TxE, experts_TxK, axis=-1)
  if renormalize:
    weights_TxK = _renormalized(weights_TxK)
  if scale != 1.0:
    weights_TxK = weights_TxK * scale
  return weights_TxK, experts_TxK.astype(jnp.int32), scores_TxE


def _renormalized(weights_TxK):
  """Each row divided by its sum. Sigmoid scores of very negative logits are tiny or 0, where
  the plain quotient fails: its gradient divides by the sum squared, which underflows below
  ~1e-19 (0 / 0 = NaN), and an all-zero row is 0 / 0 itself. Such rows are first scaled by their
  largest weight (a constant to the gradient: the quotient does not depend on it), and an
  all-zero row stays 0. Rows summing to 1e-18 or more divide exactly as the plain quotient."""
  sum_Tx1 = jnp.sum(weights_TxK, axis=-1, keepdims=True)
  plain = sum_Tx1 >= 1e-18
  direct_TxK = weights_TxK / jnp.where(plain, sum_Tx1, 1.0)
  top_Tx1 = jax.lax.stop_gradient(jnp.max(weights_TxK, axis=-1, keepdims=True))
  scaled_TxK = weights_TxK / jnp.where(top_Tx1 > 0, top_Tx1, 1.0)
  scaled_Tx1 = jnp.sum(scaled_TxK, axis=-1, keepdims=True)      # >= 1 unless the row is 0
  small_TxK = scaled_TxK / jnp.where(scaled_Tx1 > 0, scaled_Tx1, 1.0)
  return jnp.where(plain, direct_TxK, small_TxK)


def _choice(scores_TxE, bias_E):
  if bias_E is None:
    return scores_TxE
  return scores_TxE + jax.lax.stop_gradient(bias_E.astype(jnp.float32))[None, :]


def _allowed(choice_TxE, groups: int, top_groups: int, group_score: str = "top2"):
  if group_score not in GROUP_SCORES:
    raise ValueError(f"group_score must be one of {GROUP_SCORES}, got {group_score!r}")
  t, e = choice_TxE.shape
  choice_TxGxM = jax.lax.stop_gradient(choice_TxE).reshape(t, groups, e // groups)
  if group_score == "max":
    group_TxG = jnp.max(choice_TxGxM, axis=-1)
  else:
    best2_TxGx2, _ = jax.lax.top_k(choice_TxGxM, 2)
    group_TxG = jnp.sum(best2_TxGx2, axis=-1)
  _, top_TxGk = jax.lax.top_k(group_TxG, top_groups)
  allowed_TxG = jnp.any(jax.nn.one_hot(top_TxGk, groups, dtype=bool), axis=1)
  return jnp.repeat(allowed_TxG, e // groups, axis=1)


def allowed_experts(scores_TxE: jax.Array, *, bias_E: jax.Array | None = None, groups: int = 1,
                    top_groups: int = 1, group_score: str = "top2") -> jax.Array | None:
  """[T, E] bool: the experts of each token's `top_groups` best groups, the ones `top_k_route`
  chose among (None when routing is not group-limited). Admission's reroute keeps to them."""
  if groups <= 1:
    return None
  return _allowed(_choice(scores_TxE, bias_E), groups, top_groups, group_score)


def expert_counts(experts_TxK: jax.Array, num_experts: int,
                  valid_TxK: jax.Array | None = None) -> jax.Array:
  """Assignments per expert, [E] int32 (only those marked valid, if a mask is given)."""
  one_hot_TxKxE = jax.nn.one_hot(experts_TxK, num_experts, dtype=jnp.int32)
  if valid_TxK is not None:
    one_hot_TxKxE = one_hot_TxKxE * valid_TxK[..., None].astype(jnp.int32)
  return jnp.sum(one_hot_TxKxE, axis=(0, 1))


def local_tokens(num_tokens: int, mask_T) -> jax.Array:
  """This device's tokens as an fp32 scalar: all `num_tokens`, or those `mask_T` marks."""
  if mask_T is None:
    return jnp.asarray(num_tokens, jnp.float32)
  return jnp.sum(mask_T, dtype=jnp.float32)


def total_tokens(tokens, axis_name) -> jax.Array:
  """`local_tokens` summed over the axis, at least 1 (any leading shape)."""
  return jnp.maximum(_psum(tokens, axis_name), 1.0)


def _real(x_T, mask_T):
  """x_T [T, ...] with the rows `mask_T` leaves out (padding) zeroed; as it is without a mask."""
  if mask_T is None:
    return x_T
  return jnp.where(mask_T.reshape(mask_T.shape + (1,) * (x_T.ndim - 1)), x_T, 0.0)


# Each loss is this device's terms (`*_terms`: sums over its tokens, the differentiable ones
# carrying the gradient) and a finish over the axis (`*_from_terms`). The finish sums only the
# counts, and works on terms stacked over any leading axes (layers): a model scanning its layers
# returns the terms and sums every layer's counts in one collective after the scan, so no
# collective sits in a layer's body (`moejax.layers.moe.finish_aux`).


def balance_terms(scores_TxE: jax.Array, mask_T: jax.Array | None = None) -> jax.Array:
  """`load_balancing_loss`'s differentiable term: the router's scores summed per expert over
  this device's tokens (those `mask_T` marks), [E] fp32."""
  return jnp.sum(_real(scores_TxE.astype(jnp.float32), mask_T), axis=0)


def balance_from_terms(score_sum_E, counts_E, total, k: int, axis_name=None) -> jax.Array:
  """`load_balancing_loss` from this device's score sums [..., E] and assignment counts
  [..., E], and the tokens over the axis [...] (`total_tokens`); -> [...]."""
  counts_E = _psum(counts_E, axis_name)
  frac_E = jax.lax.stop_gradient(counts_E.astype(jnp.float32) / (total[..., None] * k))
  num_experts = score_sum_E.shape[-1]
  return num_experts * jnp.sum(frac_E * score_sum_E, axis=-1) / total


def load_balancing_loss(scores_TxE: jax.Array, experts_TxK: jax.Array, *,
                        axis_name=None, mask_T: jax.Array | None = None) -> jax.Array:
  """Switch/OLMoE load-balancing loss: E * sum_e f_e * P_e.

  f_e is the fraction of all T*K assignments that went to expert e (no gradient), P_e the mean
  router score of expert e over all tokens; with `mask_T` [T] bool, over the tokens it marks
  (padding left out).
  """
  num_tokens, k = experts_TxK.shape
  valid_TxK = None if mask_T is None else jnp.broadcast_to(mask_T[:, None], experts_TxK.shape)
  counts_E = expert_counts(experts_TxK, scores_TxE.shape[-1], valid_TxK)
  return balance_from_terms(balance_terms(scores_TxE, mask_T), counts_E,
                            total_tokens(local_tokens(num_tokens, mask_T), axis_name), k,
                            axis_name)


def z_terms(logits_TxE: jax.Array, mask_T: jax.Array | None = None) -> jax.Array:
  """`router_z_loss`'s term: logsumexp(logits)^2 summed over this device's tokens, fp32 []."""
  lse_T = jax.nn.logsumexp(logits_TxE.astype(jnp.float32), axis=-1)
  return jnp.sum(_real(lse_T**2, mask_T))


def from_token_terms(term_sum, total) -> jax.Array:
  """A per-token mean (z-loss, locality loss): this device's sum [...] over the tokens of the
  axis [...] (`total_tokens`)."""
  return term_sum / total


def router_z_loss(logits_TxE: jax.Array, *, axis_name=None,
                  mask_T: jax.Array | None = None) -> jax.Array:
  """ST-MoE z-loss: mean over tokens (those `mask_T` marks) of logsumexp(logits)^2."""
  return from_token_terms(z_terms(logits_TxE, mask_T),
                          total_tokens(local_tokens(logits_TxE.shape[0], mask_T), axis_name))


def locality_terms(scores_TxE: jax.Array, local_E: jax.Array,
                   mask_T: jax.Array | None = None) -> jax.Array:
  """`locality_loss`'s term: each token's fraction of score mass outside this device's group,
  summed over its tokens, fp32 []."""
  scores_TxE = scores_TxE.astype(jnp.float32)
  remote_1xE = 1.0 - jnp.asarray(local_E, jnp.float32)[None, :]
  remote_T = jnp.sum(scores_TxE * remote_1xE, axis=-1)
  total_T = jnp.sum(scores_TxE, axis=-1)
  frac_T = remote_T / jnp.maximum(total_T, jnp.finfo(jnp.float32).tiny)
  return jnp.sum(_real(frac_T, mask_T))


def locality_loss(scores_TxE: jax.Array, local_E: jax.Array, *, axis_name=None,
                  mask_T: jax.Array | None = None) -> jax.Array:
  """Mean over tokens of the fraction of router score mass on experts outside this device's group.

  `local_E` is a 0/1 (or bool) mask of the experts held by this device's expert-parallel group or
  node, e.g. `owner_group_E == my_group`. Each token's non-local mass is divided by its total
  score mass, so the loss lies in [0, 1] for softmax and sigmoid scores alike (for softmax the
  total is 1). The caller applies the weight.
  """
  return from_token_terms(locality_terms(scores_TxE, local_E, mask_T),
                          total_tokens(local_tokens(scores_TxE.shape[0], mask_T), axis_name))
