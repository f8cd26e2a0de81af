"""Routing telemetry: hand-computed figures and the axis_name share convention."""
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from moejax.routing import stats

E = 4


def test_stats_by_hand():
  # 4 tokens, k=2. Slot (3,1) dropped (sentinel E), slot (2,1) kept but masked out,
  # slot (1,1) rerouted.
  experts = jnp.asarray([[0, 1], [0, 2], [0, 1], [0, E]], jnp.int32)
  kept = jnp.asarray([[1, 1], [1, 1], [1, 0], [1, 1]], bool)
  rerouted = jnp.asarray([[0, 0], [0, 1], [0, 0], [0, 1]], bool)  # (3,1) is not kept
  got = jax.jit(lambda e, k, r: stats.routing_stats(e, E, kept_TxK=k, rerouted_TxK=r))(
      experts, kept, rerouted)
  assert set(got) == set(stats.STAT_KEYS)
  assert all(v.dtype == jnp.float32 and v.shape == () for v in got.values())
  load = np.array([4, 1, 1, 0], np.float64)  # 6 kept of 8 slots
  p = load / 6
  want = dict(
      load_max=4.0, load_mean=1.5, load_std=np.sqrt(np.mean((load - 1.5) ** 2)),
      top1_share=4 / 6,
      load_entropy=-np.sum(p[p > 0] * np.log(p[p > 0])) / math.log(E),
      experts_per_token=6 / 4, dropped_frac=2 / 8, rerouted_frac=1 / 8)
  for key, value in want.items():
    np.testing.assert_allclose(got[key], value, rtol=1e-6, err_msg=key)


def test_balanced_and_empty_extremes():
  run = jax.jit(lambda e: stats.routing_stats(e, E))
  balanced = run(jnp.asarray([[0, 1], [2, 3]], jnp.int32))
  np.testing.assert_allclose(balanced["load_entropy"], 1.0, rtol=1e-6)
  assert float(balanced["load_std"]) == 0.0 and float(balanced["dropped_frac"]) == 0.0
  empty = run(jnp.full((2, 2), E, jnp.int32))
  assert all(np.isfinite(float(v)) for v in empty.values())
  assert float(empty["dropped_frac"]) == 1.0 and float(empty["top1_share"]) == 0.0
  one = stats.routing_stats(jnp.zeros((4, 1), jnp.int32), 1)   # one expert: 0, not -0.0
  assert float(one["load_entropy"]) == 0.0 and not np.signbit(one["load_entropy"])


def test_share_convention_under_shard_map():
  mesh = Mesh(np.array(jax.devices()), ("d",))
  rng = np.random.default_rng(0)
  n_tok = 8 * 16
  experts = rng.integers(0, E, size=(n_tok, 2))
  experts[:16, 0] = 0  # the first shard leans on expert 0, the others do not
  experts[:, 1] = (experts[:, 0] + 1 + rng.integers(0, E - 1, size=n_tok)) % E
  experts = jnp.asarray(experts, jnp.int32)
  kept = jnp.asarray(rng.random((n_tok, 2)) < 0.8)
  rerouted = jnp.asarray(rng.random((n_tok, 2)) < 0.2) & kept

  def body(e, k, r):
    out = stats.routing_stats(e, E, kept_TxK=k, rerouted_TxK=r, axis_name="d")
    return {key: v[None] for key, v in out.items()}

  shares = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                                 check_vma=False))(experts, kept, rerouted)
  run = jax.jit(lambda e, k, r: stats.routing_stats(e, E, kept_TxK=k, rerouted_TxK=r))
  whole = run(experts, kept, rerouted)
  first_shard = run(experts[:16], kept[:16], rerouted[:16])
  assert abs(float(first_shard["top1_share"]) - float(whole["top1_share"])) > 0.05
  for key in stats.STAT_KEYS:
    assert shares[key].shape == (8,)
    np.testing.assert_allclose(jnp.sum(shares[key]), whole[key], rtol=1e-5, err_msg=key)
