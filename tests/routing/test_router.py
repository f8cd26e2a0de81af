"""Top-k router and its losses: hand-computed values, and the axis_name share convention."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from moejax.routing import router

# 4 tokens, 3 experts, k=2. Logits are logs of small integers, so softmax scores are the
# integers divided by their row sum: t0 1:2:3, t1 3:2:1, t2 2:3:1, t3 1:1:2.
ROWS = np.array([[1, 2, 3], [3, 2, 1], [2, 3, 1], [1, 1, 2]], np.float64)
LOGITS = jnp.asarray(np.log(ROWS), jnp.float32)


def _mesh():
  return Mesh(np.array(jax.devices()), ("d",))


def test_top_k_route_by_hand():
  weights, experts, scores = jax.jit(lambda l: router.top_k_route(l, 2))(LOGITS)
  np.testing.assert_allclose(scores, [[1/6, 2/6, 3/6], [3/6, 2/6, 1/6], [2/6, 3/6, 1/6],
                                      [1/4, 1/4, 2/4]], rtol=1e-6)
  # t3 ties experts 0 and 1 at 1/4: the lower id wins.
  np.testing.assert_array_equal(experts, [[2, 1], [0, 1], [1, 0], [2, 0]])
  assert experts.dtype == jnp.int32
  np.testing.assert_allclose(weights, [[3/6, 2/6], [3/6, 2/6], [3/6, 2/6], [2/4, 1/4]],
                             rtol=1e-6)
  renorm, _, _ = router.top_k_route(LOGITS, 2, renormalize=True)
  np.testing.assert_allclose(renorm, [[3/5, 2/5], [3/5, 2/5], [3/5, 2/5], [2/3, 1/3]],
                             rtol=1e-6)


def test_bias_groups_and_scale_by_hand():
  """The bias moves the choice, not the weights; groups keep a token to its best groups."""
  # 1 token, 4 experts in 2 groups: scores (softmax of logs) 0.1 0.2 | 0.4 0.3.
  logits = jnp.log(jnp.asarray([[0.1, 0.2, 0.4, 0.3]], jnp.float32))
  w, e, _ = router.top_k_route(logits, 2, bias_E=jnp.asarray([0.0, 0.25, 0.0, 0.0]))
  np.testing.assert_array_equal(e, [[1, 2]])             # biased 0.1 0.45 0.4 0.3
  np.testing.assert_allclose(w, [[0.2, 0.4]], rtol=1e-6)  # the unbiased scores
  # Groups scored by their two best: 0.3 vs 0.7; with one group allowed both picks are in it.
  w, e, _ = router.top_k_route(logits, 2, groups=2, top_groups=1, renormalize=True, scale=2.5)
  np.testing.assert_array_equal(e, [[2, 3]])
  np.testing.assert_allclose(w, [[2.5 * 4 / 7, 2.5 * 3 / 7]], rtol=1e-6)
  # The bias also ranks the groups: +0.5 on expert 0 makes group 0 (0.8) the best.
  _, e, _ = router.top_k_route(logits, 2, groups=2, top_groups=1,
                               bias_E=jnp.asarray([0.5, 0.0, 0.0, 0.0]))
  np.testing.assert_array_equal(e, [[0, 1]])
  # DeepSeek-V2 scores a group by its best expert: scores 0.35 0.05 | 0.3 0.3 rank group 0
  # first (0.35 > 0.3) where the two best rank group 1 (0.6 > 0.4).
  split = jnp.log(jnp.asarray([[0.35, 0.05, 0.3, 0.3]], jnp.float32))
  _, e, _ = router.top_k_route(split, 2, groups=2, top_groups=1)
  np.testing.assert_array_equal(e, [[2, 3]])
  w, e, _ = router.top_k_route(split, 2, groups=2, top_groups=1, group_score="max", scale=16.0)
  np.testing.assert_array_equal(e, [[0, 1]])
  np.testing.assert_allclose(w, [[16 * 0.35, 16 * 0.05]], rtol=1e-6)
  np.testing.assert_array_equal(
      router.allowed_experts(router.router_scores(split), groups=2, top_groups=1,
                             group_score="max"), [[True, True, False, False]])
  # No gradient reaches the bias.
  grad = jax.grad(lambda b: jnp.sum(router.top_k_route(logits, 2, bias_E=b)[0]))(
      jnp.zeros(4))
  np.testing.assert_array_equal(grad, np.zeros(4))


def test_a_bias_on_the_logits_ranks_by_logit_plus_bias():
  """Kolibri's choice: top-k of logits + bias, weighted by the unbiased sigmoid scores; with
  bias 2.5 on expert 0 and logits 0, 3, 3.2 it differs from top-k of scores + bias."""
  logits = jnp.asarray([[0.0, 3.0, 3.2]], jnp.float32)
  bias = jnp.asarray([2.5, 0.0, 0.0])
  w, e, _ = router.top_k_route(logits, 2, score="sigmoid", bias_E=bias, bias_on_logits=True)
  np.testing.assert_array_equal(e, [[2, 1]])                 # 2.5, 3, 3.2
  np.testing.assert_allclose(w, jax.nn.sigmoid(jnp.asarray([[3.2, 3.0]])), rtol=1e-6)
  _, e, _ = router.top_k_route(logits, 2, score="sigmoid", bias_E=bias)
  np.testing.assert_array_equal(e, [[0, 2]])                 # 3.0, 0.95, 0.96
  grad = jax.grad(lambda b: jnp.sum(router.top_k_route(
      logits, 2, score="sigmoid", bias_E=b, bias_on_logits=True)[0]))(jnp.zeros(3))
  np.testing.assert_array_equal(grad, np.zeros(3))


def test_balance_moves_the_bias_against_the_load():
  from moejax.routing import balance
  bias = balance.updated_bias(jnp.zeros((2, 4)), jnp.asarray([[5, 1, 1, 1], [2, 2, 2, 2]]), 1e-3)
  np.testing.assert_allclose(bias, [[-1e-3, 1e-3, 1e-3, 1e-3], [0, 0, 0, 0]])


def test_balance_moves_each_groups_bias_by_its_own_layers_loads():
  """A hybrid model's MoE layers in two groups (linear attention on layers 0-2, softmax on 3):
  each group's bias moves by the loads of its own layers, rows of the step's [L, E] load in
  model order (`olmoe.moe_rows`)."""
  from moejax.models import olmoe
  from moejax.routing import balance
  from tests.helpers import tiny_config
  cfg = tiny_config("qwen3_next", **{"moe.num_experts": 4, "moe.top_k": 2})
  rows = olmoe.moe_rows(cfg)
  assert rows == {"layers": (3,), "linear_layers": (0, 1, 2)}
  load_LxE = jnp.asarray([[5, 1, 1, 1], [1, 5, 1, 1], [1, 1, 5, 1], [1, 1, 1, 5]])
  params = {g: {"moe": {"score_bias": jnp.zeros((len(r), 4))}} for g, r in rows.items()}
  moved = balance.apply(params, load_LxE, 1.0, rows)
  np.testing.assert_array_equal(moved["layers"]["moe"]["score_bias"], [[1, 1, 1, -1]])
  np.testing.assert_array_equal(moved["linear_layers"]["moe"]["score_bias"],
                                [[-1, 1, 1, 1], [1, -1, 1, 1], [1, 1, -1, 1]])
  assert olmoe.moe_rows(tiny_config()) == {"layers": None}      # one group: every row


def test_sigmoid_scores_by_hand():
  scores = router.router_scores(jnp.asarray([[0.0, math.log(3.0)]]), "sigmoid")
  np.testing.assert_allclose(scores, [[0.5, 0.75]], rtol=1e-6)
  with pytest.raises(ValueError, match="score must be one of"):
    router.router_scores(LOGITS, "relu")


def test_renormalized_sigmoid_weights_of_tiny_or_zero_scores_sum_to_one_or_zero():
  """Sigmoid scores of very negative logits: at -120 every score is 0 in fp32, and renormalizing
  divided 0 by 0 (NaN weights and gradients); near -50 the scores are tiny normal floats
  (~1e-22) whose sum squared underflows in the gradient (NaN too). Now the tiny row normalizes
  as any other (3:1 stays 0.75, 0.25), the zero row stays 0, gradients are finite, and a
  normal row divides as before."""
  logits = jnp.asarray([[-120.0] * 4, [-50.0, -50.0 + math.log(3.0), -60.0, -61.0],
                        [0.0, math.log(3.0), -1.0, -2.0]])

  def weights(logits):
    return router.top_k_route(logits, 2, score="sigmoid", renormalize=True)[0]

  w = jax.jit(weights)(logits)
  np.testing.assert_array_equal(w[0], [0.0, 0.0])
  np.testing.assert_allclose(w[1], [0.75, 0.25], rtol=1e-5)
  scores = jax.nn.sigmoid(logits[2, :2])[::-1]
  np.testing.assert_array_equal(w[2], scores / jnp.sum(scores))        # 0.75 / 1.25, 0.5 / 1.25
  assert np.all(np.isfinite(jax.jit(jax.grad(lambda x: jnp.sum(weights(x) ** 2)))(logits)))


def test_losses_by_hand():
  _, experts, scores = router.top_k_route(LOGITS, 2)
  # Assignments per expert: e0 {t1,t2,t3}=3, e1 {t0,t1,t2}=3, e2 {t0,t3}=2 of 8.
  # Mean scores: e0 (1/6+3/6+2/6+1/4)/4 = 5/16, e1 (2/6+2/6+3/6+1/4)/4 = 17/48,
  # e2 (3/6+1/6+1/6+2/4)/4 = 1/3.  E * sum f*P = 3 * (3/8*15/48 + 3/8*17/48 + 2/8*16/48) = 1.
  lb = jax.jit(router.load_balancing_loss)(scores, experts)
  np.testing.assert_allclose(lb, 1.0, rtol=1e-6)
  # logsumexp of log(row) = log(row sum): 6, 6, 6, 4.
  z = jax.jit(router.router_z_loss)(LOGITS)
  np.testing.assert_allclose(z, (3 * math.log(6) ** 2 + math.log(4) ** 2) / 4, rtol=1e-6)


def test_locality_loss_by_hand():
  local = jnp.asarray([True, False, True])  # expert 1 is remote
  sig = jnp.asarray([[0.5, 0.25, 0.25], [0.2, 0.6, 0.2]])

  @jax.jit
  def losses(logits):
    scores = router.router_scores(logits)
    return (router.locality_loss(scores, local),
            router.locality_loss(scores, jnp.asarray([0, 1, 0]) == 0),  # owner ids vs group 0
            router.locality_loss(scores, jnp.asarray([1, 0, 1])),       # a 0/1 int mask
            router.locality_loss(sig, local),
            router.locality_loss(scores, jnp.ones(3, bool)),
            jax.grad(lambda l: router.locality_loss(router.router_scores(l), local))(logits))

  loss, by_owner, by_int, sigmoid, all_local, grad = losses(LOGITS)
  want = (2/6 + 2/6 + 3/6 + 1/4) / 4  # expert 1's softmax scores, averaged over tokens
  for value in (loss, by_owner, by_int):
    np.testing.assert_allclose(value, want, rtol=1e-6)
  # Sigmoid scores: the remote fraction of each token's score mass.
  np.testing.assert_allclose(sigmoid, (0.25 + 0.6) / 2, rtol=1e-6)
  assert float(all_local) == 0.0
  assert np.all(np.asarray(grad[:, 1]) > 0)  # pushing mass to the remote expert costs


def _shard_shares(loss_fn, *args):
  """Runs loss_fn(*per-device args, axis_name='d') on 8 devices; returns the 8 shares."""
  body = lambda *a: loss_fn(*a, axis_name="d")[None]
  specs = tuple(P("d") if a.ndim == 2 else P() for a in args)
  f = jax.shard_map(body, mesh=_mesh(), in_specs=specs, out_specs=P("d"), check_vma=False)
  return jax.jit(f)(*args)


def test_share_convention_under_shard_map():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(64, 6)) * 2, jnp.float32)
  _, experts, scores = router.top_k_route(logits, 2)
  local = jnp.asarray([1, 1, 0, 0, 1, 0], jnp.float32)
  cases = [
      (router.load_balancing_loss, (scores, experts)),
      (lambda l, axis_name: router.router_z_loss(l, axis_name=axis_name), (logits,)),
      (lambda s, m, axis_name: router.locality_loss(s, m, axis_name=axis_name), (scores, local)),
  ]
  for loss_fn, args in cases:
    whole = loss_fn(*args, axis_name=None)
    shares = _shard_shares(loss_fn, *args)
    assert shares.shape == (8,)
    assert not np.allclose(shares, shares[0])  # the shards really differ
    np.testing.assert_allclose(jnp.sum(shares), whole, rtol=1e-5)


def test_share_gradients_match_whole_batch_gradient():
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(size=(64, 6)), jnp.float32)

  def loss(l, axis_name=None):
    _, experts, scores = router.top_k_route(l, 2)
    return router.load_balancing_loss(scores, experts, axis_name=axis_name)

  whole_grad = jax.grad(loss)(logits)
  sharded = jax.shard_map(jax.grad(lambda l: loss(l, "d")), mesh=_mesh(), in_specs=P("d"),
                          out_specs=P("d"), check_vma=False)
  np.testing.assert_allclose(jax.jit(sharded)(logits), whole_grad, rtol=1e-5, atol=1e-7)
