"""Prefetching the next layer's gather changes nothing numerically: a scanned two-matmul layer on
8 devices whose weights go through the real hook (`gather_leaf`: all-gather forward,
reduce-scatter backward, under `shard_map`) gives, in every remat mode, bit-identical gradients
with and without prefetch, and the plain scan's gradients up to rounding across modes. One
compile for all six. (The train step's prefetch is this `scan_layers`; the golden run,
scripts/golden.py, pins the canonical step's numbers with prefetch on.)"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from moejax.codec import bits, gather as codec
from moejax.sharding import hook, prefetch as prefetch_lib
from moejax.sharding.layout import Layout

AXIS = "d"
MESH = jax.make_mesh((8,), (AXIS,), axis_types=(AxisType.Auto,))
LAYERS, WIDTH = 3, 16


def _layer_fn(h, full, consts, i):
  return h + jnp.tanh(h @ full["a"]) @ full["b"].T, {"i": i}


def _gather(shards, state):
  """The hook's plain gather of each stacked weight's shard (layer dim 1, fp32)."""
  full = jax.tree.map(lambda x: hook.gather_leaf(x, Layout("shard", 1), None, None,
                                                 axis_names=AXIS, dtype=jnp.float32)[0], shards)
  return full, state, {}


def _all_grads(h, shards):
  def loss(h, shards, remat, prefetch):
    out = prefetch_lib.scan_layers(_layer_fn, h, shards, _gather, None, (), remat=remat,
                                   prefetch=prefetch)[0]
    return jnp.sum(out ** 2)
  return [jax.grad(loss, argnums=(0, 1))(h, shards, r, p)
          for r in prefetch_lib.REMAT_MODES for p in (False, True)]


def test_remat_modes_and_prefetch_give_the_same_gradients_through_the_hook():
  key = jax.random.key(0)
  shards = {"a": jax.random.normal(key, (LAYERS, 8, WIDTH)) * 0.3,
            "b": jax.random.normal(jax.random.fold_in(key, 1), (LAYERS, 8, WIDTH)) * 0.3}
  h = jax.random.normal(jax.random.fold_in(key, 2), (4, 8))
  stacked = P(None, None, AXIS)            # each device holds WIDTH / 8 columns of every layer
  grads = jax.jit(jax.shard_map(_all_grads, mesh=MESH, in_specs=(P(), stacked),
                                out_specs=[(P(), stacked)] * 2 * len(prefetch_lib.REMAT_MODES),
                                check_vma=False))
  results = grads(h, shards)
  assert len(results) == 2 * len(prefetch_lib.REMAT_MODES)
  for plain, prefetched in zip(results[0::2], results[1::2]):
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(prefetched)):
      np.testing.assert_array_equal(a, b)
  for got in results[1:]:
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(results[0])):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # The weights' gradients came home through the reduce-scatter: the 8 devices' identical
  # cotangents summed, 8 x the gradient of the same scan on whole weights.
  def whole(h, shards):
    local = lambda shards, state: (shards, state, {})  # noqa: E731
    out = prefetch_lib.scan_layers(_layer_fn, h, shards, local, None, (), remat="none",
                                   prefetch=False)[0]
    return jnp.sum(out ** 2)
  reference = jax.jit(jax.grad(whole, argnums=1))(h, shards)
  for a, b in zip(jax.tree.leaves(results[0][1]), jax.tree.leaves(reference)):
    np.testing.assert_allclose(a, 8 * b, rtol=1e-5, atol=1e-6)


def test_a_value_kept_for_backward_is_computed_in_the_forward_alone():
  """`kept_for_backward` (fssdp's plans): under remat full with prefetch the backward, which
  recomputes each layer from its input, replays what the forward recorded rather than computing
  it again; the gradients equal those of no prefetch, where `jax.checkpoint` keeps it."""
  traced = []

  def layer_fn(h, full, consts, i):
    def plan():
      traced.append(i)
      return jnp.round(jnp.sum(h * h))          # of the layer's input; no gradient through it
    k = prefetch_lib.kept_for_backward("plan", plan)
    return h + (1.0 + 0.01 * k) * jnp.tanh(h @ full["a"]) @ full["b"].T, {"k": k}

  def local(shards, state):
    return shards, state, {}

  def loss(h, shards, prefetch):
    out = prefetch_lib.scan_layers(layer_fn, h, shards, local, None, (), remat="full",
                                   prefetch=prefetch)
    return jnp.sum(out[0] ** 2), out[1]["k"]

  key = jax.random.key(3)
  shards = {"a": jax.random.normal(key, (LAYERS, 8, WIDTH)) * 0.3,
            "b": jax.random.normal(jax.random.fold_in(key, 1), (LAYERS, 8, WIDTH)) * 0.3}
  h = jax.random.normal(jax.random.fold_in(key, 2), (4, 8))
  jax.jit(lambda h, shards: loss(h, shards, True)).lower(h, shards)
  forward = len(traced)
  grad = jax.grad(loss, argnums=(0, 1), has_aux=True)
  got, k_L = jax.jit(lambda h, shards: grad(h, shards, True))(h, shards)
  assert len(traced) == 2 * forward        # the backward traced no plan of its own
  want, k_ref_L = jax.jit(lambda h, shards: grad(h, shards, False))(h, shards)
  np.testing.assert_array_equal(k_L, k_ref_L)
  assert len(set(np.asarray(k_L).tolist())) == LAYERS    # each layer its own recorded value
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # A layer under `jax.checkpoint` (no prefetch) keeps it by its policy: the gradient's program
  # rounds once, in the forward (twice when the backward computes the value again).
  for remat in ("full", "minimal"):
    def loss_checkpointed(h, shards, remat=remat):
      out = prefetch_lib.scan_layers(layer_fn, h, shards, local, None, (), remat=remat)
      return jnp.sum(out[0] ** 2)
    jaxpr = str(jax.make_jaxpr(jax.grad(loss_checkpointed, argnums=(0, 1)))(h, shards))
    assert jaxpr.count(" round[") == 1, remat


SPECS = {"delta": codec.CodecSpec("delta", delta_bits=4, warmup_steps=0, capacity_fraction=1.0,
                                  far_fraction=1.0),
         "element": codec.CodecSpec("element", warmup_steps=0, capacity_fraction=1.0)}


def _coded_gather(spec):
  def gather(shards, states, rebuild_from=None):
    """The hook's compressed gather of both weights, bf16."""
    names = sorted(shards)
    fulls, new, _ = hook.gather_leaves(
        [shards[k] for k in names], [Layout("shard", 1)] * len(names), [spec] * len(names),
        [states[k] for k in names], axis_names=AXIS,
        rebuild_states=None if rebuild_from is None else [rebuild_from[k] for k in names])
    return dict(zip(names, fulls)), dict(zip(names, new)), {}
  return gather


@pytest.mark.parametrize("mode", sorted(SPECS))
def test_backward_rebuilds_coded_weights_from_the_forward_caches(mode):
  """Under remat full the prefetched backward needs each layer's weights again. After the
  forward's gather a delta cache holds every device's values: rebuilt with no collective. An
  element cache holds the others' exponents: only the sign+mantissa bits travel (one all-gather
  of both weights' packed bits a layer, no patch). Gradients bit-identical to the plain scan's,
  which gathers again through the codec (the forward's gathers take the compressed path)."""
  spec, gather = SPECS[mode], _coded_gather(SPECS[mode])
  key = jax.random.key(1)
  shards = {"a": jax.random.normal(key, (LAYERS, 8, WIDTH)) * 0.3,
            "b": jax.random.normal(jax.random.fold_in(key, 1), (LAYERS, 8, WIDTH)) * 0.3}
  h = jax.random.normal(jax.random.fold_in(key, 2), (4, 8))

  def grads(h, shards, prefetch):
    def fresh(x):        # this device's state of one weight, every layer
      one = codec.init_state(x.shape[1:], jnp.bfloat16, 8, spec)
      return jax.tree.map(lambda s: jnp.broadcast_to(s, (LAYERS,) + s.shape), one)

    states = {k: fresh(x) for k, x in shards.items()}
    # A first forward fills the caches (dense); the weights then move a little, so the gathers
    # under test take the compressed path.
    states = prefetch_lib.scan_layers(_layer_fn, h, shards, gather, states, (), remat="full",
                                      prefetch=False)[2]
    moved = jax.tree.map(lambda x: x * 1.001, shards)

    def loss(shards):
      out = prefetch_lib.scan_layers(_layer_fn, h, shards, gather, states, (), remat="full",
                                     prefetch=prefetch)[0]
      return jnp.sum(out ** 2)
    return jax.grad(loss)(moved)

  stacked = P(None, None, AXIS)
  run = {p: jax.jit(jax.shard_map(lambda h, s, p=p: grads(h, s, p), mesh=MESH,
                                  in_specs=(P(), stacked), out_specs=stacked, check_vma=False))
         for p in (False, True)}
  for a, b in zip(jax.tree.leaves(run[False](h, shards)), jax.tree.leaves(run[True](h, shards))):
    np.testing.assert_array_equal(a, b)
  text = run[True].lower(h, shards).compile().as_text()
  backward = [line for line in text.splitlines()
              if re.search(r" all-gather(-start)?\(", line) and "transpose(" in line]
  if mode == "delta":
    assert backward == []
  else:   # both weights' sign+mantissa bits (a byte a value, 8 x 2 values a shard), packed
    words = 2 * bits.packed_words(8 * WIDTH // 8, 8)
    assert backward and all(f"u32[8,{words}]" in line for line in backward)


@pytest.mark.parametrize("remat", prefetch_lib.REMAT_MODES)
def test_prefetched_forward_gathers_each_layer_once(remat):
  """Counted as they run (a host callback in the gather): the prefetched forward gathers each of
  the L layers once (its last layer runs after the scan, on the weights the scan gathered last),
  with and without residuals for backward, and a step's gathers are what `hook.run_gathers`
  prices the codec by. (The backward also traces each layer's gather once for its transpose,
  the reduce-scatter; without the callback nothing of that gather's forward survives.)"""
  calls = []

  def counting_gather(shards, state):
    jax.debug.callback(lambda: calls.append(1))
    return shards, state, {}

  def loss(h, shards):
    out = prefetch_lib.scan_layers(_layer_fn, h, shards, counting_gather, None, (), remat=remat,
                                   prefetch=True)[0]
    return jnp.sum(out ** 2)

  def count(fn):
    calls.clear()
    jax.block_until_ready(jax.jit(fn)(h, shards))
    jax.effects_barrier()
    return len(calls)

  key = jax.random.key(3)
  shards = {"a": jax.random.normal(key, (LAYERS, WIDTH, WIDTH)) * 0.3,
            "b": jax.random.normal(jax.random.fold_in(key, 1), (LAYERS, WIDTH, WIDTH)) * 0.3}
  h = jnp.ones((4, WIDTH))
  assert count(loss) == LAYERS
  assert count(lambda h, s: jax.vjp(loss, h, s)[0]) == LAYERS
  assert (count(jax.grad(loss, argnums=1))
          == hook.run_gathers(LAYERS, remat=remat, prefetch=True) + LAYERS)


# A period of different layers (gpt-oss's [sliding, full], Llama 4's four): two "a"/"b" layers
# around a "c" layer, each kind its own function and stacked weights, repeated PERIODS times.
PERIODS = 3


def _c_layer_fn(h, full, consts, r):
  return h + jnp.sin(h @ full["c"]) * 0.5, {"r": r * 10}


def _sublayers(gather_ab, gather_c):
  return [prefetch_lib.Sublayer(_layer_fn, gather_ab, source=0, offset=0),
          prefetch_lib.Sublayer(_c_layer_fn, gather_c, source=1, offset=0),
          prefetch_lib.Sublayer(_layer_fn, gather_ab, source=0, offset=1)]


def _sequential(h, ab, c):
  """The same layers in model order, one after another, on whole weights."""
  for r in range(PERIODS):
    h = _layer_fn(h, jax.tree.map(lambda x: x[2 * r], ab), (), r)[0]
    h = _c_layer_fn(h, jax.tree.map(lambda x: x[r], c), (), r)[0]
    h = _layer_fn(h, jax.tree.map(lambda x: x[2 * r + 1], ab), (), r)[0]
  return h


def _weights(key, width=8):
  ab = {"a": jax.random.normal(key, (2 * PERIODS, 8, width)) * 0.3,
        "b": jax.random.normal(jax.random.fold_in(key, 1), (2 * PERIODS, 8, width)) * 0.3}
  c = {"c": jax.random.normal(jax.random.fold_in(key, 2), (PERIODS, 8, width)) * 0.3}
  return ab, c


def test_a_scanned_period_of_different_layers_equals_them_in_model_order():
  """`scan_period` through the real hook on 8 devices: in every remat mode, with and without
  prefetch (bit-identical), gradients of the sequential layers (8 x, the devices' cotangents
  summed by the reduce-scatter); each layer's aux stacked per sublayer, its gather's stats back
  in its source's row order."""
  def gather_stats(shards, state):
    full = jax.tree.map(lambda x: hook.gather_leaf(x, Layout("shard", 1), None, None,
                                                   axis_names=AXIS, dtype=jnp.float32)[0],
                        shards)
    return full, state, {"sum": sum(jnp.sum(x) for x in jax.tree.leaves(full))}

  def all_grads(h, ab, c):
    def loss(h, ab, c, remat, prefetch):
      h, aux_P, _, stats_S = prefetch_lib.scan_period(
          _sublayers(gather_stats, gather_stats), h, [ab, c], None, (), remat=remat,
          prefetch=prefetch)
      return jnp.sum(h ** 2), (aux_P, stats_S)
    out = []
    for remat in prefetch_lib.REMAT_MODES:
      for prefetch in (False, True):
        grads, (aux_P, stats_S) = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(
            h, ab, c, remat, prefetch)
        out.append((grads, aux_P, stats_S))
    return out

  ab, c = _weights(jax.random.key(4))
  h = jax.random.normal(jax.random.key(5), (4, 8))
  stacked = P(None, None, AXIS)
  out_specs = [((P(), stacked, stacked), P(), P())] * 2 * len(prefetch_lib.REMAT_MODES)
  results = jax.jit(jax.shard_map(all_grads, mesh=MESH, in_specs=(P(), stacked, stacked),
                                  out_specs=out_specs, check_vma=False))(h, ab, c)
  for plain, prefetched in zip(results[0::2], results[1::2]):
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(prefetched)):
      np.testing.assert_array_equal(a, b)
  reference = jax.jit(jax.grad(lambda h, ab, c: jnp.sum(_sequential(h, ab, c) ** 2),
                               argnums=(0, 1, 2)))(h, ab, c)
  for grads, aux_P, stats_S in results:
    np.testing.assert_allclose(grads[0], reference[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(grads[1:]), jax.tree.leaves(reference[1:])):
      np.testing.assert_allclose(a, 8 * b, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(aux_P[0]["i"], np.arange(PERIODS))
    np.testing.assert_array_equal(aux_P[1]["r"], 10 * np.arange(PERIODS))
    np.testing.assert_allclose(stats_S[0]["sum"], [ab["a"][i].sum() + ab["b"][i].sum()
                                                    for i in range(2 * PERIODS)], rtol=1e-5)
    np.testing.assert_allclose(stats_S[1]["sum"], c["c"].sum(axis=(1, 2)), rtol=1e-5)


def test_gradients_scattered_ahead_equal_them_scattered_in_place():
  """`scatter_ahead`: weight gradients reduce-scattered while the layer processed next runs its
  backward equal them reduce-scattered at the end of their own (bit for bit, remat full and
  none, a period of three layers through the real hook on 8 devices). Ahead, no collective of
  a one-layer scan's backward iteration waits on its matmuls (the next layer's regather, the
  gradient of the layer before); in place the reduce-scatter waits on all of its layer's."""
  from tests.sharding import hlo
  stacked = P(None, None, AXIS)

  def compiled(loss, args):
    specs = (P(),) + (stacked,) * (len(args) - 1)
    return jax.jit(jax.shard_map(jax.grad(loss, argnums=tuple(range(len(args)))), mesh=MESH,
                                 in_specs=specs, out_specs=specs, check_vma=False)
                   ).lower(*args).compile()

  ab, c = _weights(jax.random.key(6))
  h = jax.random.normal(jax.random.key(7), (4, 8))
  for remat in ("full", "none"):
    got = {}
    for mode in ("never", "always"):
      period = compiled(lambda h, ab, c: jnp.sum(prefetch_lib.scan_period(
          _sublayers(_gather, _gather), h, [ab, c], None, (), remat=remat,
          prefetch=True, scatter_ahead=mode)[0] ** 2), (h, ab, c))
      got[mode] = period(h, ab, c)
      one = compiled(lambda h, ab: jnp.sum(prefetch_lib.scan_layers(
          _layer_fn, h, ab, _gather, None, (), remat=remat, prefetch=True,
          scatter_ahead=mode)[0] ** 2), (h, ab))
      waiting = [c.op for c in hlo.loop_collectives_after_matmuls(one.as_text())]
      assert (waiting == []) if mode == "always" else ("reduce-scatter" in waiting), (
          remat, mode, waiting)
    for a, b in zip(jax.tree.leaves(got["never"]), jax.tree.leaves(got["always"]), strict=True):
      np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match=r"scatter_ahead must be one of \('auto', 'always', "
                                       r"'never'\), got 'soon'"):
    prefetch_lib.scan_layers(_layer_fn, h, ab, _gather, None, (), prefetch=True,
                             scatter_ahead="soon")


@pytest.mark.parametrize("remat", ["full", "none"])
def test_a_prefetched_period_gathers_as_run_gathers_prices(remat):
  """Counted as they run: the prefetched forward of a period gathers each layer once; a step
  gathers what `hook.run_gathers` prices for each source's layers of the scan."""
  calls = {"ab": [], "c": []}

  def counting(name):
    def gather(shards, state):
      jax.debug.callback(lambda: calls[name].append(1))
      return shards, state, {}
    return gather

  def loss(h, ab, c):
    return jnp.sum(prefetch_lib.scan_period(_sublayers(counting("ab"), counting("c")), h,
                                            [ab, c], None, (), remat=remat,
                                            prefetch=True)[0] ** 2)

  def count(fn):
    for v in calls.values():
      v.clear()
    jax.block_until_ready(jax.jit(fn)(h, ab, c))
    jax.effects_barrier()
    return len(calls["ab"]), len(calls["c"])

  ab, c = _weights(jax.random.key(6), width=8)
  ab = jax.tree.map(lambda x: x.reshape(x.shape[0], 8, 8), ab)
  h = jnp.ones((4, 8))
  assert count(loss) == (2 * PERIODS, PERIODS)
  priced = [hook.run_gathers(n, remat=remat, prefetch=True, scanned=3 * PERIODS)
            for n in (2 * PERIODS, PERIODS)]
  # (the backward also traces each layer's gather once for its transpose)
  assert count(jax.grad(loss, argnums=(1, 2))) == (priced[0] + 2 * PERIODS, priced[1] + PERIODS)
