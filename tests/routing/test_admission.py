"""Capacity-limited affinity admission against a slow numpy reference, plus its invariants."""
import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moejax.routing import admission, router, stats

T, D, E, K = 48, 8, 6, 2


# ----------------------------------------------------------------------------- reference
def ref_admit(aff_TxE, experts_TxK, capacity_E, threshold, policy, allowed_TxE=None):
  """Slow loop reference: returns the final expert per slot (E where dropped)."""
  aff = np.asarray(aff_TxE)
  n_tok, k = experts_TxK.shape
  n_exp = aff.shape[1]
  thr = np.float32(threshold)
  final = np.full((n_tok, k), n_exp, np.int64)
  if policy == "none":
    return np.where(experts_TxK < n_exp, experts_TxK, n_exp)
  room = [int(max(c, 0)) for c in capacity_E]
  for e in range(n_exp):
    cands = [(t, s) for t in range(n_tok) for s in range(k)
             if experts_TxK[t, s] == e and aff[t, e] >= thr]
    cands.sort(key=lambda ts: (-aff[ts[0], e], ts[0], ts[1]))
    for t, s in cands[:room[e]]:
      final[t, s] = e
    room[e] -= min(len(cands), room[e])
  if policy == "strict":
    return final
  members = [set(int(e) for e in experts_TxK[t] if e < n_exp) for t in range(n_tok)]
  pending = [[s for s in range(k) if experts_TxK[t, s] < n_exp and final[t, s] == n_exp]
             for t in range(n_tok)]
  while True:
    proposals = {}
    for t in range(n_tok):
      if not pending[t]:
        continue
      options = [e for e in range(n_exp)
                 if aff[t, e] >= thr and room[e] > 0 and e not in members[t]
                 and (allowed_TxE is None or allowed_TxE[t, e])]
      if options:
        best = max(options, key=lambda e: (aff[t, e], -e))
        proposals.setdefault(best, []).append(t)
    if not proposals:
      return final
    for e, tokens in proposals.items():
      tokens.sort(key=lambda t: (-aff[t, e], t))
      for t in tokens[:room[e]]:
        final[t, pending[t].pop(0)] = e
        members[t].add(e)
      room[e] -= min(len(tokens), room[e])


# ----------------------------------------------------------------------------- inputs
def _orthogonal_router(rng, d, e, scale=2.0):
  q, _ = np.linalg.qr(rng.normal(size=(d, d)))
  return jnp.asarray(scale * q[:, :e], jnp.float32)


def _inputs(seed, scenario, n_tok=T):
  rng = np.random.default_rng(seed)
  w = (_orthogonal_router(rng, D, E) if scenario != "random"
       else jnp.asarray(rng.normal(size=(D, E)), jnp.float32))
  x = rng.normal(size=(n_tok, D))
  if scenario == "hotspot":  # ~70% of tokens lean hard towards expert 0
    hot = rng.random(n_tok) < 0.7
    x[hot] += 3.0 * np.asarray(w[:, 0])
  elif scenario == "ties":  # groups of identical tokens: exact affinity ties
    x = x[rng.integers(0, 4, size=n_tok)]
  return jnp.asarray(x, jnp.float32), w


@functools.cache
def _top_k():
  return jax.jit(lambda x, w: router.top_k_route(x @ w, K))


TRACES = {}


@functools.cache
def _admit(policy):
  """One compiled admission per policy; every test reuses it (guarded against re-tracing)."""
  def run(x, w, experts, weights, scores, capacity, threshold):
    TRACES[policy] = TRACES.get(policy, 0) + 1
    assert TRACES[policy] == 1, f"admit({policy!r}) traced again"
    return admission.admit(x, w, experts, weights, scores, capacity_E=capacity,
                           threshold=threshold, policy=policy)
  return jax.jit(run)


def _route_and_admit(x, w, capacity, threshold, policy):
  weights, experts, scores = _top_k()(x, w)
  adm = _admit(policy)(x, w, experts, weights, scores, jnp.asarray(capacity, jnp.int32),
                       jnp.float32(threshold))
  return (weights, experts, scores), jax.tree.map(np.asarray, adm)


def _loads(experts_TxK, n_exp=E):
  return np.bincount(np.asarray(experts_TxK).ravel(), minlength=n_exp + 1)[:n_exp]


# ----------------------------------------------------------------------------- tests
def test_affinity_is_cosine():
  x, w = _inputs(0, "random")
  x = x.at[3].set(0.0)
  xn, wn = np.asarray(x, np.float64), np.asarray(w, np.float64)
  want = xn @ wn / np.maximum(np.linalg.norm(xn, axis=1, keepdims=True), 1e-30)
  want = want / np.linalg.norm(wn, axis=0, keepdims=True)
  got = jax.jit(admission.affinity)(x, w)
  np.testing.assert_allclose(got, want, atol=1e-6)
  assert np.all(np.asarray(got[3]) == 0)


@pytest.mark.parametrize("policy", admission.POLICIES)
def test_ample_capacity_and_open_threshold_change_nothing(policy):
  for scenario in ("random", "hotspot"):
    x, w = _inputs(1, scenario)
    (weights, experts, _), adm = _route_and_admit(x, w, np.full(E, T), -1.0, policy)
    np.testing.assert_array_equal(adm.experts_TxK, experts)
    np.testing.assert_array_equal(adm.weights_TxK, weights)
    assert adm.kept_TxK.all() and not adm.rerouted_TxK.any()
    assert adm.experts_TxK.dtype == np.int32 and adm.weights_TxK.dtype == np.float32


def test_one_capacity_for_every_expert_and_bad_shapes_by_name():
  """`capacity_E` as one int (which the docstring allowed) was a concatenate error, a wrong
  length a broadcasting TypeError; a Python threshold outside [-1, 1] dropped everything."""
  x, w = _inputs(3, "hotspot")
  weights, experts, scores = _top_k()(x, w)
  one = admission.admit(x, w, experts, weights, scores, capacity_E=3, threshold=-1.0,
                        policy="strict")
  each = admission.admit(x, w, experts, weights, scores, capacity_E=np.full(E, 3),
                         threshold=-1.0, policy="strict")
  np.testing.assert_array_equal(one.experts_TxK, each.experts_TxK)
  with pytest.raises(ValueError, match=rf"capacity_E must be a scalar or \[{E}\]"):
    admission.admit(x, w, experts, weights, scores, capacity_E=np.ones(E - 1), threshold=-1.0,
                    policy="strict")
  for bad in (2.0, math.nan):
    with pytest.raises(ValueError, match="cosine similarity"):
      admission.admit(x, w, experts, weights, scores, capacity_E=3, threshold=bad,
                      policy="strict")


def test_policy_none_ignores_capacity():
  x, w = _inputs(2, "hotspot")
  (weights, experts, _), adm = _route_and_admit(x, w, np.zeros(E), 0.9, "none")
  np.testing.assert_array_equal(adm.experts_TxK, experts)
  np.testing.assert_array_equal(adm.weights_TxK, weights)
  with pytest.raises(ValueError, match="policy must be one of"):
    admission.admit(x, w, experts, weights, weights, capacity_E=np.ones(E), threshold=0.0,
                    policy="greedy")


def _check(x, w, capacity, threshold):
  """Runs strict and reroute and checks them against the reference and the invariants."""
  (weights, experts, scores), strict = _route_and_admit(x, w, capacity, threshold, "strict")
  _, reroute = _route_and_admit(x, w, capacity, threshold, "reroute")
  weights, experts, scores = map(np.asarray, (weights, experts, scores))
  aff = np.asarray(jax.jit(admission.affinity)(x, w))
  thr = np.float32(threshold)
  rows = np.arange(T)[:, None]

  for adm, policy in ((strict, "strict"), (reroute, "reroute")):
    np.testing.assert_array_equal(
        adm.experts_TxK, ref_admit(aff, experts, capacity, threshold, policy), err_msg=policy)
    kept = adm.kept_TxK
    np.testing.assert_array_equal(kept, adm.experts_TxK < E)
    assert np.all(_loads(adm.experts_TxK) <= capacity), "capacity exceeded"
    final_aff = aff[rows, np.minimum(adm.experts_TxK, E - 1)]
    assert np.all(final_aff[kept] >= thr), "threshold violated"
    np.testing.assert_array_equal(adm.affinity_TxK[kept], final_aff[kept])
    np.testing.assert_array_equal(adm.affinity_TxK[~kept], aff[rows, experts][~kept])
    assert np.all(adm.weights_TxK[~kept] == 0)
    for t in range(T):  # no token holds one expert twice
      mine = adm.experts_TxK[t][kept[t]]
      assert len(set(mine.tolist())) == len(mine)

  # Strict: only the token's own choices, highest affinity first.
  assert not strict.rerouted_TxK.any()
  np.testing.assert_array_equal(strict.experts_TxK[strict.kept_TxK],
                                experts[strict.kept_TxK])
  np.testing.assert_array_equal(strict.weights_TxK[strict.kept_TxK],
                                weights[strict.kept_TxK])
  chosen_aff = aff[rows, experts]
  for e in range(E):
    cands = (experts == e) & (chosen_aff >= thr)
    won, lost = cands & strict.kept_TxK, cands & ~strict.kept_TxK
    if lost.any():
      assert won.sum() == capacity[e]
      if won.any():
        assert chosen_aff[won].min() >= chosen_aff[lost].max()

  # Reroute: never evicts what strict accepted; moves only strict rejects.
  assert np.all(reroute.kept_TxK[strict.kept_TxK])
  np.testing.assert_array_equal(reroute.experts_TxK[strict.kept_TxK],
                                experts[strict.kept_TxK])
  np.testing.assert_array_equal(reroute.rerouted_TxK, reroute.kept_TxK & ~strict.kept_TxK)
  full = _loads(reroute.experts_TxK) >= capacity
  for t in range(T):
    members = set(experts[t].tolist()) | set(reroute.experts_TxK[t][reroute.kept_TxK[t]].tolist())
    open_experts = [e for e in range(E) if aff[t, e] >= thr and not full[e] and e not in members]
    for s in range(K):
      e_new = reroute.experts_TxK[t, s]
      if reroute.rerouted_TxK[t, s]:
        assert e_new not in experts[t], "rerouted onto one of the token's own choices"
        np.testing.assert_allclose(reroute.weights_TxK[t, s], scores[t, e_new], rtol=1e-6)
        # Every more similar expert is below threshold, full, or already the token's.
        assert all(aff[t, e] <= aff[t, e_new] for e in open_experts)
      elif not reroute.kept_TxK[t, s]:
        assert not open_experts, "dropped although an expert qualified"
  return strict, reroute


@settings(max_examples=30, deadline=None, database=None)
@given(seed=st.integers(0, 2**31 - 1),
       scenario=st.sampled_from(["random", "hotspot", "ties"]),
       factor=st.sampled_from([0.25, 0.5, 1.0, 1.5]),
       threshold=st.sampled_from([-1.0, -0.2, 0.0, 0.3]),
       ragged=st.booleans())
def test_matches_reference_and_invariants(seed, scenario, factor, threshold, ragged):
  x, w = _inputs(seed, scenario)
  capacity = np.full(E, int(np.ceil(factor * T * K / E)))
  if ragged:
    capacity = np.random.default_rng(seed).integers(0, 2 * capacity[0] + 1, size=E)
  _check(x, w, capacity, threshold)


def test_hotspot_reroutes_and_drops():
  x, w = _inputs(3, "hotspot")
  strict, reroute = _check(x, w, np.full(E, 10), 0.0)
  assert reroute.rerouted_TxK.sum() > 0
  assert reroute.kept_TxK.sum() > strict.kept_TxK.sum()
  assert (~reroute.kept_TxK).sum() > 0  # the threshold leaves some without a home


def test_ties_go_to_lower_token_index():
  x = jnp.ones((T, D), jnp.float32)  # identical tokens: every affinity ties
  w = _orthogonal_router(np.random.default_rng(4), D, E)
  (_, experts, _), strict = _route_and_admit(x, w, np.full(E, 5), -1.0, "strict")
  assert np.all(np.asarray(experts) == np.asarray(experts[0]))
  kept_tokens = np.nonzero(strict.kept_TxK.all(axis=1))[0]
  np.testing.assert_array_equal(kept_tokens, np.arange(5))
  assert not strict.kept_TxK[5:].any()
  _, reroute = _route_and_admit(x, w, np.full(E, 5), -1.0, "reroute")
  # Four other experts with 5 slots each take the next tokens in order, two per token.
  np.testing.assert_array_equal(np.nonzero(reroute.kept_TxK.all(axis=1))[0], np.arange(15))
  assert not reroute.kept_TxK[15:].any()


def test_empty_input_slots_stay_empty():
  x, w = _inputs(5, "random")
  weights, experts, scores = _top_k()(x, w)
  experts = experts.at[::3, 1].set(E)  # already dropped upstream
  for policy in admission.POLICIES:
    adm = _admit(policy)(x, w, experts, weights, scores, jnp.full(E, T, jnp.int32),
                         jnp.float32(-1.0))
    assert not np.asarray(adm.kept_TxK[::3, 1]).any()
    np.testing.assert_array_equal(adm.experts_TxK, experts)


def test_gradients_flow_to_router_and_inputs():
  x, w = _inputs(6, "hotspot")
  capacity = jnp.full(E, 12, jnp.int32)
  v = jnp.asarray(np.random.default_rng(6).normal(size=(E, D)), jnp.float32)

  def moe_out(x, w, delta_TxE):
    # delta_TxE (zero) is added to the scores, so its gradient shows which scores the
    # combine weights depend on.
    _, experts, scores = router.top_k_route(x @ w, K)
    scores = scores + delta_TxE
    weights = jnp.take_along_axis(scores, experts, axis=1)
    adm = admission.admit(x, w, experts, weights, scores, capacity_E=capacity,
                          threshold=0.0, policy="reroute")
    out_TxK = jnp.sum(jnp.tanh(v[jnp.minimum(adm.experts_TxK, E - 1)] * x[:, None, :]), -1)
    return jnp.sum(adm.weights_TxK * out_TxK), (adm, out_TxK)

  grad_fn = jax.jit(jax.grad(moe_out, argnums=(0, 1, 2), has_aux=True))
  (g_x, g_w, g_delta), (adm, out_TxK) = grad_fn(x, w, jnp.zeros((T, E), jnp.float32))
  assert np.abs(np.asarray(g_w)).sum() > 0 and np.abs(np.asarray(g_x)).sum() > 0
  adm = jax.tree.map(np.asarray, adm)
  assert adm.rerouted_TxK.any() and not adm.kept_TxK.all()
  # Each kept slot's weight depends on exactly one score: that of its final expert (for a
  # rerouted slot the new one); dropped slots depend on nothing.
  want = np.zeros((T, E), np.float32)
  t_idx, s_idx = np.nonzero(adm.kept_TxK)
  want[t_idx, adm.experts_TxK[t_idx, s_idx]] = np.asarray(out_TxK)[t_idx, s_idx]
  np.testing.assert_allclose(g_delta, want, rtol=1e-5, atol=1e-6)


def test_weights_with_renormalized_top_k():
  x, w = _inputs(6, "hotspot")
  capacity = jnp.full(E, 12, jnp.int32)
  weights, experts, scores = jax.jit(
      lambda x, w: router.top_k_route(x @ w, K, renormalize=True))(x, w)
  total_T = np.asarray(jnp.sum(jnp.take_along_axis(scores, experts, axis=1), axis=1))
  # A rerouted slot keeps its slot's normalization: score of the new expert / top-k total.
  adm = _admit("reroute")(x, w, experts, weights, scores, capacity, jnp.float32(0.0))
  moved = np.asarray(adm.rerouted_TxK)
  assert moved.any()
  t_idx = np.nonzero(moved)[0]
  np.testing.assert_allclose(
      np.asarray(adm.weights_TxK)[moved],
      np.asarray(scores)[t_idx, np.asarray(adm.experts_TxK)[moved]] / total_T[t_idx],
      rtol=1e-5)
  # renormalize_kept: every token with something kept sums to 1 again; others stay at 0.
  renorm = jax.jit(lambda *a: admission.admit(*a, capacity_E=capacity, threshold=0.0,
                                             policy="strict", renormalize_kept=True))(
                                                 x, w, experts, weights, scores)
  kept = np.asarray(renorm.kept_TxK)
  some = kept.any(axis=1)
  assert (~kept).any() and some.any()
  np.testing.assert_allclose(np.asarray(renorm.weights_TxK).sum(axis=1)[some], 1.0, rtol=1e-5)
  assert np.all(np.asarray(renorm.weights_TxK)[~some] == 0)


def test_capacity_schedule():
  kw = dict(num_tokens=8, k=2, num_experts=4)
  np.testing.assert_array_equal(admission.capacity_schedule(0, factor=1.25, **kw), [5] * 4)
  np.testing.assert_array_equal(admission.capacity_schedule(0, factor=0.1, **kw), [1] * 4)
  sched = jax.jit(chex.assert_max_traces(lambda step, layer: admission.capacity_schedule(
      step, factor=1.0, factor_warmup=2.0, warmup_steps=10, layer=layer,
      layer_factors=[None, 1.5, 0.5], **kw), n=1))
  assert sched(0, 0).tolist() == [8] * 4  # warm-up: 2.0 * 16 / 4
  assert sched(9, 1).tolist() == [8] * 4
  assert sched(10, 0).tolist() == [4] * 4
  assert sched(10, 1).tolist() == [6] * 4
  assert sched(11, 2).tolist() == [2] * 4
  share = jnp.asarray([0.5, 0.25, 0.125, 0.125])
  got = admission.capacity_schedule(jnp.int32(20), factor=1.0, expert_share_E=share, **kw)
  assert got.dtype == jnp.int32 and got.tolist() == [8, 4, 2, 2]
  # Equal shares give the uniform capacities: fp32 noise is forgiven relative to the value (1.2
  # x 100 / 3 is 40, not 41), a true fraction is not (1.2 x 65536 x 8 / 5 = 125829.12 -> 125830).
  for e, t, k, f in [(3, 100, 1, 1.2), (5, 65536, 8, 1.2), (7, 4096, 2, 1.1), (12, 1000, 6, 1.25),
                     (160, 16384, 8, 1.5), (10, 384, 2, 2.0)]:
    uniform = admission.capacity_schedule(0, num_tokens=t, k=k, num_experts=e, factor=f)
    shared = admission.capacity_schedule(0, num_tokens=t, k=k, num_experts=e, factor=f,
                                         expert_share_E=jnp.full(e, 1.0 / e))
    assert shared.tolist() == uniform.tolist() == [math.ceil(round(f * t * k / e, 9))] * e
  with pytest.raises(ValueError, match="factor"):
    admission.capacity_schedule(0, factor=0.0, **kw)
  # A huge factor means no limit: every assignment (was an int32 OverflowError at the first
  # step); a tiny positive one still admits one (was 0: the float-noise allowance ate it).
  for huge in (1e7, 1e30, 1e38, 1e300):
    assert admission.capacity_schedule(0, factor=huge, **kw).tolist() == [16] * 4
    assert admission.capacity_schedule(0, factor=huge, expert_share_E=jnp.asarray(
        [0.5, 0.5, 0.0, 0.0]), **kw).tolist() == [16, 16, 0, 0]
  assert admission.capacity_schedule(0, factor=1e-12, **kw).tolist() == [1] * 4
  for bad in (math.inf, math.nan):
    with pytest.raises(ValueError, match="finite"):
      admission.capacity_schedule(0, factor=bad, **kw)
  with pytest.raises(ValueError, match="layer"):
    admission.capacity_schedule(0, factor=1.0, layer_factors=[1.0], **kw)


def test_forced_hotspot_is_capped():
  n_tok, n_exp = 256, 8
  rng = np.random.default_rng(7)
  w = _orthogonal_router(rng, 16, n_exp)
  x = rng.normal(size=(n_tok, 16))
  hot = np.arange(n_tok) < int(0.7 * n_tok)
  x[hot] += 4.0 * np.asarray(w[:, 0])
  x = jnp.asarray(x, jnp.float32)
  capacity = admission.capacity_schedule(0, num_tokens=n_tok, k=K, num_experts=n_exp,
                                         factor=1.0)

  @jax.jit
  def shares(x):
    weights, experts, scores = router.top_k_route(x @ w, K)
    adm = admission.admit(x, w, experts, weights, scores, capacity_E=capacity,
                          threshold=-1.0, policy="strict")
    before = stats.routing_stats(experts, n_exp)
    after = stats.routing_stats(adm.experts_TxK, n_exp, kept_TxK=adm.kept_TxK)
    return experts, before, after

  experts, before, after = shares(x)
  assert np.mean(np.any(np.asarray(experts) == 0, axis=1)) >= 0.7
  assert float(after["top1_share"]) <= 0.5 * float(before["top1_share"])
  assert float(after["load_max"]) <= int(capacity[0])


def test_under_shard_map_and_sharded_jit():
  mesh = Mesh(np.array(jax.devices()), ("d",))
  n_dev = len(jax.devices())
  x, w = _inputs(8, "hotspot", n_tok=T * n_dev // 2)  # T/2 tokens per device
  capacity = jnp.full(E, 4, jnp.int32)

  def body(x):
    weights, experts, scores = router.top_k_route(x @ w, K)
    adm = admission.admit(x, w, experts, weights, scores, capacity_E=capacity,
                          threshold=0.0, policy="reroute")
    return adm.experts_TxK, experts

  sharded = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                                  check_vma=False))
  final, experts = map(np.asarray, sharded(x))
  aff = np.asarray(admission.affinity(x, w))
  per = x.shape[0] // n_dev
  for d in range(n_dev):  # each device admits its own tokens against its own capacity
    rows = slice(d * per, (d + 1) * per)
    np.testing.assert_array_equal(
        final[rows], ref_admit(aff[rows], experts[rows], np.full(E, 4), 0.0, "reroute"))

  # Plain jit with the batch sharded over devices: same answer as the whole batch unsharded.
  x_sharded = jax.device_put(x, NamedSharding(mesh, P("d")))
  global_final, global_experts = map(np.asarray, jax.jit(body)(x_sharded))
  np.testing.assert_array_equal(
      global_final, ref_admit(aff, global_experts, np.full(E, 4), 0.0, "reroute"))


def test_rank_within_group_matches_lexsort():
  """The int32 sort keys order fp32 affinities exactly: signs, signed zeros, ties, tiny values."""
  rng = np.random.default_rng(9)
  n, groups = 512, 5
  pool = np.array([-1.0, -0.5, -1e-30, -0.0, 0.0, 1e-30, 1e-7, 0.25, 0.5, 1.0], np.float32)
  key = np.where(rng.random(n) < 0.5, rng.choice(pool, n), rng.uniform(-1, 1, n)).astype(np.float32)
  group = rng.integers(0, groups + 1, n).astype(np.int32)
  counts = np.bincount(group, minlength=groups + 1).astype(np.int32)
  got = np.asarray(jax.jit(admission._rank_within_group)(group, key, counts))
  order = np.lexsort((np.arange(n), -key.astype(np.float64), group))  # -0.0 == 0.0 here too
  want = np.empty(n, np.int64)
  starts = np.cumsum(counts) - counts
  want[order] = np.arange(n) - starts[group[order]]
  np.testing.assert_array_equal(got, want)
  # _within_room: the ranked path and the all-fit shortcut.
  within = jax.jit(admission._within_room, static_argnums=3)
  for room in (np.array([3, 0, 200, 7, 1]), np.full(groups, n)):
    accepted, left = map(np.asarray, within(group, key, jnp.asarray(room, jnp.int32), groups))
    np.testing.assert_array_equal(accepted, (group < groups) & (want < np.append(room, 0)[group]))
    np.testing.assert_array_equal(left, np.maximum(room - counts[:groups], 0))


def test_many_experts_and_rounds_match_reference():
  """More experts and slots than the main fixtures, with tight ragged capacity: many rounds."""
  n_tok, n_dim, n_exp, k = 64, 16, 16, 4
  run = jax.jit(lambda x, w, e, wt, sc, cap, thr: admission.admit(
      x, w, e, wt, sc, capacity_E=cap, threshold=thr, policy="reroute"))
  for seed in range(3):
    rng = np.random.default_rng(100 + seed)
    w = jnp.asarray(rng.normal(size=(n_dim, n_exp)), jnp.float32)
    x = rng.normal(size=(n_tok, n_dim))
    x[: n_tok // 2] += 2.0 * np.asarray(w[:, seed])
    x = jnp.asarray(x, jnp.float32)
    weights, experts, scores = router.top_k_route(x @ w, k)
    capacity = rng.integers(0, 2 * n_tok * k // n_exp, size=n_exp)
    for threshold in (-1.0, 0.0):
      adm = run(x, w, experts, weights, scores, jnp.asarray(capacity, jnp.int32),
                jnp.float32(threshold))
      aff = np.asarray(jax.jit(admission.affinity)(x, w))
      want = ref_admit(aff, np.asarray(experts), capacity, threshold, "reroute")
      np.testing.assert_array_equal(np.asarray(adm.experts_TxK), want)
      assert np.all(_loads(want, n_exp) <= capacity)


def test_reroute_stays_in_the_tokens_groups_under_group_limited_routing():
  """With group-limited top-k (DeepSeek's expert groups) a rerouted assignment goes only to an
  expert of the token's `top_groups` groups (`router.allowed_experts`), as the reference does;
  without the mask some leave them."""
  n_exp, groups, top_groups, k = 8, 4, 2, 2
  rng = np.random.default_rng(3)
  w = jnp.asarray(rng.normal(size=(D, n_exp)), jnp.float32)
  x = rng.normal(size=(64, D))
  x[rng.random(64) < 0.7] += 3.0 * np.asarray(w[:, 0])       # a hot expert in group 0
  x = jnp.asarray(x, jnp.float32)
  weights, experts, scores = router.top_k_route(x @ w, k, groups=groups, top_groups=top_groups)
  allowed = router.allowed_experts(scores, groups=groups, top_groups=top_groups)
  assert all(np.asarray(allowed)[t, e] for t in range(64) for e in np.asarray(experts)[t])
  assert router.allowed_experts(scores) is None
  capacity = admission.capacity_schedule(0, num_tokens=64, k=k, num_experts=n_exp, factor=1.0)
  got = admission.admit(x, w, experts, weights, scores, capacity_E=capacity, threshold=-1.0,
                        policy="reroute", allowed_TxE=allowed)
  final = np.asarray(got.experts_TxK)
  aff = admission.affinity(x, w)
  np.testing.assert_array_equal(final, ref_admit(aff, np.asarray(experts), capacity, -1.0,
                                                 "reroute", np.asarray(allowed)))
  rerouted = np.asarray(got.rerouted_TxK)
  assert rerouted.sum() > 0
  allowed_np = np.asarray(allowed)
  assert all(allowed_np[t, final[t, s]] for t, s in zip(*np.nonzero(rerouted)))
  unmasked = admission.admit(x, w, experts, weights, scores, capacity_E=capacity, threshold=-1.0,
                             policy="reroute")
  moved = np.asarray(unmasked.rerouted_TxK)
  assert any(not allowed_np[t, np.asarray(unmasked.experts_TxK)[t, s]]
             for t, s in zip(*np.nonzero(moved)))
