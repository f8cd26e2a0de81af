"""The one gather (`moejax.sharding.hook.gather_leaf`) on 8 fake CPU devices: bit-exact plain
gathers (NaN payloads included), the VJP of every layout kind, the codec through the same entry,
and the byte figures the step reports."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from moejax.codec import gather as codec
from moejax.sharding import hook
from moejax.sharding.layout import Layout

W = 8
AXIS = "d"
MESH = jax.make_mesh((W,), (AXIS,), axis_types=(AxisType.Auto,))


def _gather_fn(layout: Layout, ndim: int):
  spec_in = P(*[AXIS if i == layout.dim else None for i in range(ndim)]) \
      if layout.kind == "shard" else P()

  def body(x):
    full, _, stats = hook.gather_leaf(x, layout, None, None, axis_names=AXIS)
    return full[None], jax.tree.map(lambda v: v[None], stats)

  return jax.jit(jax.shard_map(body, mesh=MESH, in_specs=spec_in, out_specs=P(AXIS),
                               check_vma=False))


def test_plain_gather_moves_bit_patterns_nan_payloads_included():
  rng = np.random.default_rng(0)
  x_bits = rng.integers(0, 2**16, size=(W * 4, 8), dtype=np.uint16)
  x_bits[::3, 1] = 0x7fbf              # a NaN payload XLA:CPU's float gather would rewrite
  x_bits[1::5, 2] = 0xffc1             # a negative NaN with payload
  x_bits[2, 3] = 0x8000                # -0.0
  x = jnp.asarray(x_bits).view(jnp.bfloat16)
  full, stats = _gather_fn(Layout("shard", 0), 2)(x)
  full_bits = np.asarray(full).view(np.uint16)   # on the host: a device op would rewrite NaNs
  for d in range(W):
    np.testing.assert_array_equal(full_bits[d], x_bits)
  assert full.dtype == jnp.bfloat16
  assert float(stats["bytes_sent"][0]) == 4 * 8 * 2 == float(stats["bytes_plain"][0])
  assert float(stats["dense"][0]) == 1 and float(stats["fallback"][0]) == 0


def test_plain_gather_along_a_later_axis_casts_fp32_to_bf16():
  x = np.random.default_rng(1).normal(size=(3, W * 2)).astype(np.float32)
  full, _ = _gather_fn(Layout("shard", 1), 2)(jnp.asarray(x))
  expected = np.asarray(jnp.asarray(x).astype(jnp.bfloat16)).view(np.uint16)
  np.testing.assert_array_equal(np.asarray(full).view(np.uint16)[5], expected)


@functools.lru_cache(maxsize=None)
def _grad_fn(kind: str, spec):
  layout = Layout(kind, 0) if kind != "replicate" else Layout("replicate")
  spec_in = P() if kind == "replicate" else P(AXIS)

  def body(x, state, h_BxD):
    state = jax.tree.map(lambda a: a[0], state)   # this device's [1, ...] slice

    def loss(x):
      full, new_state, _ = hook.gather_leaf(x, layout, spec, state, axis_names=AXIS)
      return jnp.sum(jnp.tanh(h_BxD @ full.astype(jnp.float32).T)), new_state

    (value, new_state), g = jax.value_and_grad(loss, has_aux=True)(x)
    return value[None], g, jax.tree.map(lambda a: a[None], new_state)

  return jax.jit(jax.shard_map(body, mesh=MESH, in_specs=(spec_in, P(AXIS), P(AXIS)),
                               out_specs=(P(AXIS), spec_in, P(AXIS)), check_vma=False))


def _reference_grad(kind: str, w, h):
  """JAX's own transpose of an fp32 gather / broadcast, then a cast: the fp32 gradient sums."""
  def one(h_d):
    return jax.grad(lambda w: jnp.sum(jnp.tanh(
        h_d @ w.astype(jnp.bfloat16).astype(jnp.float32).T)))(w)

  per_device = jax.vmap(one)(h.reshape(W, -1, h.shape[-1]))
  return per_device.sum(axis=0)


@pytest.mark.parametrize("kind,spec", [
    ("shard", None), ("replicate", None),
    ("shard", codec.CodecSpec("element", warmup_steps=0, capacity_fraction=0.5)),
], ids=["shard-plain", "replicate", "shard-codec"])
def test_vjp_returns_the_fp32_gradient_of_the_owned_part(kind, spec):
  rng = np.random.default_rng(2)
  w = rng.normal(size=(W * 2, 16)).astype(np.float32)
  h = rng.normal(size=(W * 2, 16)).astype(np.float32)
  state = {}
  if spec is not None:
    one = codec.init_state((2, 16), jnp.bfloat16, W, spec)
    state = jax.tree.map(lambda a: jnp.broadcast_to(a, (W,) + a.shape), one)
  _, g, _ = _grad_fn(kind, spec)(jnp.asarray(w), jax.tree.map(lambda a: a, state),
                                 jnp.asarray(h))
  assert g.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(g), np.asarray(_reference_grad(kind, w, h)),
                             rtol=1e-5, atol=1e-6)


def test_expert_layout_is_a_cast_without_collective():
  x = jnp.arange(W * 4, dtype=jnp.float32).reshape(W, 4)
  full, state, stats = hook.gather_leaf(x, Layout("expert", 0), None, None)
  assert full.dtype == jnp.bfloat16 and full.shape == x.shape and state is None
  assert float(stats["bytes_sent"]) == 0
  hlo = jax.jit(lambda x: hook.gather_leaf(x, Layout("expert", 0))[0]).lower(x).as_text()
  assert "all_gather" not in hlo and "all-gather" not in hlo


def test_local_gather_casts_and_passes_states_through():
  tree = {"a": jnp.ones((2, 3)), "b": jnp.zeros((4,))}
  full, states, stats = hook.local_gather("layers", tree, states={"s": 1})
  assert all(v.dtype == jnp.bfloat16 for v in jax.tree.leaves(full))
  assert states == {"s": 1} and stats == {}


def test_byte_figures_and_regather_rule():
  shard, rep, exp = Layout("shard", 0), Layout("replicate"), Layout("expert", 0)
  assert hook.gather_bytes((4, 8), shard) == 64
  assert hook.gather_bytes((4, 8), rep) == hook.gather_bytes((4, 8), exp) == 0
  assert hook.scatter_bytes((4, 8), shard, W) == (W - 1) * 32 * 4       # fp32 shards
  assert hook.scatter_bytes((4, 8), rep, W) == 2 * (W - 1) / W * 32 * 4   # ring all-reduce
  assert hook.scatter_bytes((4, 8), rep, 1) == hook.scatter_bytes((4, 8), exp, W) == 0
  # Without prefetch: once, again in backward when it recomputes the layer.
  assert hook.run_gathers(3, remat="full", prefetch=False) == 6
  assert hook.run_gathers(3, remat="minimal", prefetch=False) == 6
  assert hook.run_gathers(3, remat="none", prefetch=False) == 3
  # Prefetch: one gather ahead in each pass that gathers; the forward gathers each layer once,
  # backward under remat full gathers layer 0 twice; one layer: no prefetch.
  assert hook.run_gathers(3, remat="full", prefetch=True) == 6
  assert hook.run_gathers(3, remat="minimal", prefetch=True) == 3
  assert hook.run_gathers(3, remat="none", prefetch=True) == 3
  assert hook.run_gathers(1, remat="full", prefetch=True) == 2
  assert hook.gathers_per_layer([(3, 3), (1, 1)], remat="full", prefetch=True) == (6 + 2) / 4
  # One layer of a group in a scanned period of two (gpt-oss's [sliding, full]) is prefetched.
  assert hook.run_gathers(1, remat="full", prefetch=True, scanned=2) == 2
  assert hook.run_gathers(1, remat="full", prefetch=True, rebuilt=True, scanned=2) == 1
  # A word / delta parameter's prefetched backward gathers are rebuilt from its cache.
  assert hook.run_gathers(3, remat="full", prefetch=True, rebuilt=True) == 3
  assert hook.run_gathers(3, remat="full", prefetch=False, rebuilt=True) == 6
  assert hook.run_gathers(1, remat="full", prefetch=True, rebuilt=True) == 2


def test_codec_refuses_mode_off_and_points_at_the_hook():
  with pytest.raises(ValueError, match="gather_leaf"):
    jax.eval_shape(lambda x: codec.compressed_all_gather(
        x, {}, axis_name=AXIS, axis=0, spec=codec.CodecSpec("off")), jnp.ones((2, 2)))


def test_plain_stats_match_lax_all_gather_volume():
  """The plain gather's bytes_sent is what the all-gather operand holds (bf16 shard)."""
  x = jnp.ones((W * 3, 5), jnp.float32)
  lowered = _gather_fn(Layout("shard", 0), 2).lower(x).as_text()
  assert "(tensor<1x15xui16>) -> tensor<8x15xui16>" in lowered   # integer view, not bf16
  _, stats = _gather_fn(Layout("shard", 0), 2)(x)
  assert float(stats["bytes_sent"][0]) == 3 * 5 * 2


def _collective_count(text: str, op: str) -> int:
  return text.count(f"stablehlo.{op}")


def test_a_groups_plain_gathers_travel_in_one_collective_each_way():
  """gather_leaves of a layer-like group (sharded leaves along different dims, a float32 one, a
  replicated and an expert leaf): one all_gather of the bf16 leaves' packed bit patterns, one of
  the float32 leaf, and one reduce-scatter back per dtype; each full leaf equals its own tiled
  gather bit for bit, and each gradient its own reduce-scatter (the fp32 sum over devices)."""
  rng = np.random.default_rng(3)
  shapes = [(W * 2, 3), (4, W), (W * 5,), (2, W * 3), (3, 4), (W, 2)]
  layouts = [Layout("shard", 0), Layout("shard", 1), Layout("shard", 0), Layout("shard", 1),
             Layout("replicate"), Layout("expert", 0)]
  dtypes = [jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.bfloat16, jnp.bfloat16]
  xs = [jnp.asarray(rng.normal(size=s).astype(np.float32)) for s in shapes]
  in_specs = tuple(P(*[AXIS if i == lay.dim else None for i in range(len(s))])
                   if lay.kind != "replicate" else P() for s, lay in zip(shapes, layouts))
  # one weight per device-side full leaf (an expert leaf stays this device's rows: [1, 2])
  weights = [jnp.asarray(rng.normal(size=(1, 2) if lay.kind == "expert" else s)
                         .astype(np.float32)) for s, lay in zip(shapes, layouts)]

  def body(xs, weights):
    def loss(xs):
      fulls, _, _ = hook.gather_leaves(list(xs), layouts, [None] * len(xs), [None] * len(xs),
                                       axis_names=AXIS, dtypes=dtypes)
      value = sum(jnp.sum(jnp.sin(f.astype(jnp.float32)) * w) for f, w in zip(fulls, weights))
      return value, fulls

    grads, fulls = jax.grad(loss, has_aux=True)(xs)
    return tuple(f[None] for f in fulls), grads

  fn = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=(in_specs, tuple(P() for _ in shapes)),
                             out_specs=(tuple(P(AXIS) for _ in shapes), in_specs),
                             check_vma=False))
  text = fn.lower(tuple(xs), tuple(weights)).as_text()
  assert _collective_count(text, "all_gather") == 2        # the bf16 pack and the float32 pack
  assert _collective_count(text, "reduce_scatter") == 2
  fulls, grads = fn(tuple(xs), tuple(weights))
  for x, full, g, w, lay, dtype in zip(xs, fulls, grads, weights, layouts, dtypes):
    # every device's copy is the whole parameter in its dtype (sharded, replicated alike)
    want = np.asarray(x.astype(dtype))
    if lay.kind == "expert":     # used where it lives: each device keeps its own rows
      want = want.reshape((W, -1) + want.shape[1:])
      np.testing.assert_array_equal(np.asarray(full).reshape(want.shape), want)
    else:
      for d in range(W):
        np.testing.assert_array_equal(np.asarray(full[d]).view(np.uint8), want.view(np.uint8))
    # each device's cotangent is cos(full) * w, in the leaf's dtype; the owned part sums it
    # over the devices in fp32
    ct = np.cos(np.asarray(x.astype(dtype).astype(jnp.float32))) * np.asarray(w)
    ct = np.asarray(jnp.asarray(ct).astype(dtype).astype(jnp.float32))
    expected = ct if lay.kind == "expert" else W * ct   # the owner's gradient is complete
    np.testing.assert_allclose(np.asarray(g), expected, rtol=1e-6)


def test_bf16_reduce_sums_the_bf16_leaves_in_bf16_and_the_fp32_leaves_in_fp32():
  """reduce_dtype=bf16 (config.reduce_dtype): the bf16 leaves' reduce-scatter and the
  replicated leaf's all-reduce are written in bf16 (half the bytes), the fp32-computed leaf's
  stays fp32. The gradients come back fp32: the bf16 leaves' are bf16 values within bf16
  rounding of the fp32 sums, the fp32 leaf's equal the fp32 reduction's."""
  from tests.sharding import hlo
  rng = np.random.default_rng(4)
  shapes = [(W * 2, 3), (W, 4), (3, 4)]
  layouts = [Layout("shard", 0), Layout("shard", 0), Layout("replicate")]
  dtypes = [jnp.bfloat16, jnp.float32, jnp.bfloat16]
  xs = tuple(jnp.asarray(rng.normal(size=s).astype(np.float32)) for s in shapes)
  # each device its own weights, so each device's cotangent differs
  weights = tuple(jnp.asarray(rng.normal(size=(W,) + s).astype(np.float32)) for s in shapes)
  in_specs = tuple(P(AXIS) if lay.kind == "shard" else P() for lay in layouts)

  def program(reduce_dtype):
    def body(xs, weights):
      def loss(xs):
        fulls, _, _ = hook.gather_leaves(list(xs), layouts, [None] * 3, [None] * 3,
                                         axis_names=AXIS, dtypes=dtypes,
                                         reduce_dtype=reduce_dtype)
        return sum(jnp.sum(jnp.sin(f.astype(jnp.float32)) * w[0]) for f, w in zip(fulls, weights))
      return jax.grad(loss)(xs)

    return jax.jit(jax.shard_map(body, mesh=MESH, in_specs=(in_specs, (P(AXIS),) * 3),
                                 out_specs=in_specs, check_vma=False))

  written = {}
  for name, reduce_dtype in (("f32", jnp.float32), ("bf16", jnp.bfloat16)):
    text = program(reduce_dtype).lower(xs, weights).as_text()
    written[name] = sorted((c.op, c.dtype) for c in hlo.stablehlo_reductions(text))
  assert written["f32"] == [("all-reduce", "f32"), ("reduce-scatter", "f32"),
                            ("reduce-scatter", "f32")]
  assert written["bf16"] == [("all-reduce", "bf16"), ("reduce-scatter", "bf16"),
                             ("reduce-scatter", "f32")]
  g32 = [np.asarray(g) for g in program(jnp.float32)(xs, weights)]
  g16 = [np.asarray(g) for g in program(jnp.bfloat16)(xs, weights)]
  assert all(g.dtype == np.float32 for g in g16)
  np.testing.assert_array_equal(g16[1], g32[1])                 # the fp32 leaf: fp32 sums
  for i in (0, 2):
    as_bf16 = np.asarray(jnp.asarray(g16[i]).astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(g16[i], as_bf16)             # summed (or rounded) in bf16
    # within bf16 rounding of the fp32 sum: at most one rounding per hop, on partial sums no
    # larger than the sum of the devices' |cotangent| (here |w|)
    bound = W * 2.0 ** -8 * np.abs(np.asarray(weights[i])).sum(axis=0)
    assert np.all(np.abs(g16[i] - g32[i]) <= bound)
    assert np.any(g16[i] != g32[i])                            # the premise: it did round


def test_one_device_group_is_casts_without_collectives():
  """On a one-device mesh a plain group has nothing to gather or reduce: no collective in the
  program, each full leaf the cast of its shard, each gradient the cotangent in fp32 (what the
  pack, the collectives and the slice returned)."""
  rng = np.random.default_rng(4)
  mesh = jax.make_mesh((1,), (AXIS,), axis_types=(AxisType.Auto,))
  shapes = [(2, 3), (4, 5), (6,), (3, 4), (2, 2)]
  layouts = [Layout("shard", 0), Layout("shard", 1), Layout("shard", 0), Layout("replicate"),
             Layout("expert", 0)]
  dtypes = [jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.bfloat16, jnp.bfloat16]
  xs = tuple(jnp.asarray(rng.normal(size=s).astype(np.float32)) for s in shapes)
  weights = tuple(jnp.asarray(rng.normal(size=s).astype(np.float32)) for s in shapes)

  def body(xs):
    def loss(xs):
      fulls, _, _ = hook.gather_leaves(list(xs), layouts, [None] * len(xs), [None] * len(xs),
                                       axis_names=AXIS, dtypes=dtypes)
      return sum(jnp.sum(jnp.sin(f.astype(jnp.float32)) * w)
                 for f, w in zip(fulls, weights)), fulls
    return jax.grad(loss, has_aux=True)(xs)

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(tuple(P() for _ in shapes),),
                             out_specs=P(), check_vma=False))
  text = fn.lower(xs).as_text()
  for op in ("all_gather", "reduce_scatter", "all_reduce"):
    assert _collective_count(text, op) == 0, op
  grads, fulls = fn(xs)
  for x, full, g, w, dtype in zip(xs, fulls, grads, weights, dtypes):
    want = np.asarray(x.astype(dtype))
    np.testing.assert_array_equal(np.asarray(full).view(np.uint8), want.view(np.uint8))
    ct = jnp.cos(x.astype(dtype).astype(jnp.float32)) * w
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(g), np.asarray(ct.astype(dtype).astype(jnp.float32)),
                               rtol=1e-6)


def test_rebuilt_gathers_equal_plain_gathers_in_every_mode_and_edge_case():
  """`gather_leaves(rebuild_states=)` (the backward's re-gather under remat full + prefetch)
  against the forward's gather and a plain all-gather of the bit patterns, over four steps:
  fresh caches (dense), then changed values, then a few values moved again, then none. Every
  mode and detector in one group, an element pool over its capacity, a parameter in its codec
  warm-up and a plain one; odd shard sizes, gather dims 0 and 1; NaN, -0.0, subnormals and
  infinities among the values."""
  specs = [codec.CodecSpec("element", warmup_steps=0),
           codec.CodecSpec("element", warmup_steps=0, capacity_fraction=0.01),   # over capacity
           codec.CodecSpec("block", warmup_steps=0, block_size=16),
           codec.CodecSpec("block", warmup_steps=0, block_size=16, detect="hash"),
           codec.CodecSpec("word", warmup_steps=0), codec.CodecSpec("word", warmup_steps=0),
           codec.CodecSpec("delta", warmup_steps=0, delta_bits=3),
           codec.CodecSpec("element", warmup_steps=5), None]
  shapes = [(3, 13), (5, 7), (2, 37), (4, 9), (3, 11), (1, 17), (6, 5), (3, 3), (2, 6)]
  dims = [1, 0, 1, 1, 0, 1, 1, 0, 1]
  layouts = [Layout("shard", d) for d in dims]
  as_bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16)  # noqa: E731

  def body(*steps):
    states = [codec.init_state(x.shape, jnp.bfloat16, W, s) if s else None
              for x, s in zip(steps[0], specs)]
    out = []
    for xs in steps:
      fulls, new, _ = hook.gather_leaves(list(xs), layouts, specs, states, axis_names=AXIS)
      rebuilt, _, _ = hook.gather_leaves(list(xs), layouts, specs, states, axis_names=AXIS,
                                         rebuild_states=new)
      plain = [jax.lax.all_gather(as_bits(x.astype(jnp.bfloat16)), AXIS, axis=d, tiled=True)
               for x, d in zip(xs, dims)]
      out.append(([as_bits(f) for f in fulls], [as_bits(f) for f in rebuilt], plain))
      states = new
    return out

  rng = np.random.default_rng(0)
  first = []
  for shape, d in zip(shapes, dims):
    full_shape = list(shape)
    full_shape[d] *= W
    x = (rng.normal(size=full_shape) * 0.3).astype(np.float32)
    x.reshape(-1)[:6] = [np.nan, -0.0, 1e-40, -1e-39, np.inf, -np.inf]
    first.append(x)
  second = [x * np.float32(1.01) + np.float32(1e-3) for x in first]
  for x in second:
    x[0, :2] = [np.nan, -0.0]
  third = [np.where(rng.random(x.shape) < 0.03, x * np.float32(2.5),
                    np.where(rng.random(x.shape) < 0.03, x * np.float32(1.001), x))
           .astype(np.float32) for x in second]
  in_specs = [P(None, AXIS) if d == 1 else P(AXIS, None) for d in dims]
  run = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=(in_specs,) * 4, out_specs=P(),
                              check_vma=False))
  for step, (fwd, rebuilt, plain) in enumerate(run(first, second, third, third)):
    for i, spec in enumerate(specs):
      want = np.asarray(plain[i])        # bit patterns on the host (NaN payloads kept)
      np.testing.assert_array_equal(np.asarray(fwd[i]), want, err_msg=f"step {step} {spec}")
      np.testing.assert_array_equal(np.asarray(rebuilt[i]), want, err_msg=f"step {step} {spec}")
