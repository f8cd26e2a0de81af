"""The MoE block against a naive per-token loop, and as a drop-in layer (NNX and Linen)."""
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx

from moejax.layers.moe import MoEBlock, MoESpec


def naive_moe(block: MoEBlock, x_TxD):
  """Loop over tokens and their chosen experts, all in fp32 numpy."""
  router = np.asarray(block.router[...])
  wg, wu, wd = (np.asarray(block.w_gate[...]), np.asarray(block.w_up[...]),
                np.asarray(block.w_down[...]))
  out = np.zeros_like(x_TxD)
  for t, x in enumerate(x_TxD):
    logits = x @ router
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    chosen = np.argsort(-probs, kind="stable")[:block.spec.top_k]
    for e in chosen:
      g, u = x @ wg[e], x @ wu[e]
      h = g / (1 + np.exp(-g)) * u
      out[t] += probs[e] * (h @ wd[e])
  return out


def test_block_equals_per_token_loop():
  block = MoEBlock(16, 24, MoESpec(num_experts=6, top_k=2), init_std=0.3, rngs=nnx.Rngs(0))
  x = np.random.default_rng(1).normal(size=(2, 10, 16)).astype(np.float32)
  y, aux = nnx.jit(lambda block, x: block(x))(block, jnp.asarray(x))   # one compile, not eager
  expected = naive_moe(block, x.reshape(20, 16)).reshape(2, 10, 16)
  np.testing.assert_allclose(np.asarray(y), expected, rtol=2e-5, atol=2e-5)
  assert int(aux["load_E"].sum()) == 20 * 2


def test_weights_on_the_inputs_equal_a_per_token_loop_and_ep_on_8_devices():
  """Llama 4's routing: sigmoid top-2, each weight scaling the token going into its expert,
  plus a shared expert: the block equals a per-token loop of expert(w x); on 8 devices under ep
  the same values and gradients (the router's through the inputs' scaling), as one device."""
  from jax.sharding import PartitionSpec as P

  from moejax.placement.dispatch import Dispatch
  spec = MoESpec(num_experts=8, top_k=2, score="sigmoid", weights_on_input=True,
                 shared_hidden=12)
  block = MoEBlock(16, 24, spec, init_std=0.3, rngs=nnx.Rngs(0))
  x = np.random.default_rng(1).normal(size=(8, 4, 16)).astype(np.float32)
  graphdef, state = nnx.split(block)
  router = np.asarray(block.router[...])
  wg, wu, wd = (np.asarray(getattr(block, n)[...]) for n in ("w_gate", "w_up", "w_down"))
  sg, su, sd = (np.asarray(getattr(block, f"shared_{n}")[...]) for n in ("w_gate", "w_up",
                                                                          "w_down"))
  silu = lambda g: g / (1 + np.exp(-g))     # noqa: E731
  want = np.zeros((32, 16), np.float32)
  for t, xt in enumerate(x.reshape(32, 16)):
    scores = 1 / (1 + np.exp(-(xt @ router)))
    for e in np.argsort(-scores, kind="stable")[:2]:
      xe = scores[e] * xt
      want[t] += (silu(xe @ wg[e]) * (xe @ wu[e])) @ wd[e]
    want[t] += (silu(xt @ sg) * (xt @ su)) @ sd

  def loss(state, x, run):
    y = run(state, x)
    return jnp.sum(y ** 2), y

  local = lambda state, x: nnx.merge(graphdef, state)(x)[0]   # noqa: E731
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  dispatch = Dispatch(kind="ep", axis_names=("data",), num_devices=8)
  specs = jax.tree.map(lambda v: P("data") if v.ndim == 3 else P(), state)
  ep = jax.shard_map(lambda state, x: nnx.merge(graphdef, state)(
      x, axis_name="data", dispatch=dispatch)[0], mesh=mesh, in_specs=(specs, P("data")),
      out_specs=P("data"), check_vma=False)
  (got_loss, y), grads = jax.jit(jax.value_and_grad(
      lambda s, x: loss(s, x, ep), has_aux=True))(state, jnp.asarray(x))
  (want_loss, y_local), want_grads = jax.jit(jax.value_and_grad(
      lambda s, x: loss(s, x, local), has_aux=True))(state, jnp.asarray(x))
  np.testing.assert_allclose(np.asarray(y_local).reshape(32, 16), want, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_local), rtol=1e-5, atol=1e-5)
  assert np.any(np.asarray(want_grads["router"][...]))
  for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * float(jnp.abs(ref).max()))


def test_drop_into_an_nnx_model():
  class Model(nnx.Module):
    def __init__(self, rngs):
      self.inp = nnx.Linear(8, 16, rngs=rngs)
      self.moe = MoEBlock(16, 32, MoESpec(4, 2), rngs=rngs)

    def __call__(self, x):
      y, aux = self.moe(self.inp(x))
      return y, aux["aux_loss"]

  model = Model(nnx.Rngs(0))
  x = jnp.ones((2, 5, 8))

  def loss(model):
    y, aux_loss = model(x)
    return jnp.mean(y**2) + 0.01 * aux_loss

  grads = nnx.jit(nnx.grad(loss))(model)
  assert float(jnp.abs(grads.moe.w_gate[...]).sum()) > 0
  assert float(jnp.abs(grads.moe.router[...]).sum()) > 0
  assert float(jnp.abs(grads.inp.kernel[...]).sum()) > 0


def test_drop_into_a_linen_model():
  class Model(linen.Module):
    @linen.compact
    def __call__(self, x):
      h = linen.Dense(16)(x)
      y, _ = nnx.bridge.to_linen(MoEBlock, 16, 32, MoESpec(4, 2))(h)
      return y

  model = Model()
  x = jnp.ones((2, 5, 8))
  variables = jax.jit(model.init)(jax.random.key(0), x)
  y = jax.jit(model.apply)(variables, x)
  assert y.shape == (2, 5, 16)
  grads = jax.jit(jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2)))(variables)
  leaves = jax.tree.leaves(grads)
  assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
  assert sum(float(jnp.abs(g).sum()) for g in leaves) > 0


@pytest.mark.parametrize("changes, field", [
    (dict(top_k=0), "top_k=0"), (dict(top_k=9), "top_k=9"), (dict(num_experts=0, top_k=0),
                                                             "num_experts=0"),
    (dict(groups=3), "groups=3"), (dict(groups=4, top_groups=1, top_k=3), "top_groups=1"),
    (dict(score="relu"), "score='relu'"), (dict(admission="drop"), "admission='drop'"),
    (dict(capacity_factor=0.0), "capacity_factor=0.0"), (dict(shared_gate=True), "shared_gate"),
    (dict(threshold=2.0), "threshold=2.0"), (dict(num_experts=8.0), "num_experts=8.0: must be "
                                                                     "an int"),
    # groups of one expert (top_k failed at the first call), non-finite factors (an overflow
    # there, or non-finite outputs)
    (dict(groups=8, top_groups=2), "groups=8"), (dict(capacity_factor=math.inf),
                                                 "capacity_factor=inf"),
    (dict(capacity_factor_warmup=math.inf), "capacity_factor_warmup=inf"),
    (dict(routed_scale=math.inf), "routed_scale=inf")])
def test_spec_refuses_bad_fields_by_name(changes, field):
  """Refused when the spec is made, naming the field (a block built from it failed only at its
  first call: top_k=0 a ZeroDivisionError, groups=3 a reshape TypeError)."""
  with pytest.raises(ValueError, match=f"^MoESpec.{re.escape(field)}"):
    MoESpec(**{"num_experts": 8, "top_k": 2, **changes})


@functools.lru_cache(maxsize=1)
def _block_and_reference():
  """A block, its input, and its one-device loss and gradients (computed once for the file's
  tests, jitted: op by op its autodiff compiled some 150 small programs)."""
  block = MoEBlock(32, 48, MoESpec(8, 2), rngs=nnx.Rngs(0), init_std=0.2)
  x_BxSxD = jax.random.normal(jax.random.key(1), (8, 5, 32))
  graphdef, state = nnx.split(block)

  def loss(state, x):
    y, aux = nnx.merge(graphdef, state)(x)
    return jnp.sum(y ** 2) + aux["aux_loss"]

  return block, x_BxSxD, graphdef, state, jax.jit(jax.value_and_grad(loss))(state, x_BxSxD)


@pytest.mark.parametrize("kind", ["local", "ep"])
def test_block_under_a_callers_shard_map_with_its_type_checks(kind):
  """jax.shard_map's default check_vma=True (moejax's own steps run without it): the CPU expert
  loop's carry and its custom VJP's weight cotangents are typed as varying where their inputs
  are (a TypeError before), and match one device."""
  from jax.sharding import PartitionSpec as P

  from moejax.placement.dispatch import LOCAL, Dispatch
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  block, x_BxSxD, graphdef, state, (want_loss, want_grads) = _block_and_reference()
  if kind == "ep":
    dispatch = Dispatch(kind="ep", axis_names=("data",), num_devices=8)
    specs = jax.tree.map(lambda v: P("data") if v.ndim == 3 else P(), state)   # experts split
  else:
    dispatch, specs = LOCAL, jax.tree.map(lambda v: P(), state)

  def per_device(state, x):
    # ep names its axis once: the losses' shares default to the dispatch's axes (each device
    # summed its own full loss before, 8x the one-device loss in all).
    y, aux = nnx.merge(graphdef, state)(x, axis_name=None if kind == "ep" else "data",
                                        dispatch=dispatch)
    return y, aux["aux_loss"][None]       # each device's share of the loss

  sharded = jax.shard_map(per_device, mesh=mesh, in_specs=(specs, P("data")),
                          out_specs=(P("data"), P("data")))

  def loss(state, x):
    y, aux = sharded(state, x)
    return jnp.sum(y ** 2) + jnp.sum(aux)

  got_loss, got_grads = jax.jit(jax.value_and_grad(loss))(state, x_BxSxD)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(jnp.abs(want).max()))


def test_block_refuses_bad_calls_by_name():
  from moejax.placement.dispatch import Dispatch
  block, x_BxSxD, *_ = _block_and_reference()
  for x, message in ((x_BxSxD[0], r"x_BxSxD must be a float array \[batch, seq, d_model=32\], "
                                  r"got float32\[5, 32\]"),
                     (x_BxSxD[..., :16], r"got float32\[8, 5, 16\]"),
                     (x_BxSxD.astype(jnp.int32), r"got int32\[8, 5, 32\]"),
                     (x_BxSxD[:, :0], r"x_BxSxD \[8, 0, 32\] holds no token")):
    with pytest.raises(ValueError, match=message):
      block(x)
  with pytest.raises(ValueError, match="^MoEBlock: dispatch kind 'fssdp' needs materialized="):
    block(x_BxSxD, dispatch=Dispatch(kind="fssdp", axis_names=("data",)))
  # ep over 16 devices with 8 experts, one per device: destinations past the axis were dropped
  # uncounted (output 4.0 off, aux["dropped"] 0).
  with pytest.raises(ValueError, match="^MoEBlock: ep dispatch over num_devices=16 with 8 "
                                       "experts here makes 128, not the spec's 8"):
    block(x_BxSxD, dispatch=Dispatch(kind="ep", axis_names=("data",), num_devices=16))
  # An exchange outside shard_map (its axis unbound) was a NameError from deep in the trace; a
  # kind that does not exist failed at the call, without the valid ones.
  with pytest.raises(ValueError, match="^MoEBlock: dispatch kind 'ep' exchanges over mesh axis "
                                       "'data', which is not bound here: call the block inside "
                                       "jax.shard_map"):
    block(x_BxSxD, dispatch=Dispatch(kind="ep", axis_names=("data",), num_devices=1))
  with pytest.raises(ValueError, match="^Dispatch.kind='EP': must be one of local, ep, fssdp"):
    Dispatch(kind="EP", axis_names=("data",))
  from flax import nnx
  from moejax.layers.moe import MoEBlock, finish_aux
  with pytest.raises(ValueError, match=r"^finish_aux: this aux holds no per-device terms"):
    finish_aux(block(x_BxSxD)[1], 2)
  for args, message in (((0, 16, block.spec), "MoEBlock: d_model=0: must be a positive int"),
                        ((16, 16.0, block.spec), "MoEBlock: expert_hidden=16.0: must be a "),
                        ((16, 16, {"num_experts": 4}), "MoEBlock: spec must be a moejax.layers")):
    with pytest.raises(ValueError, match=f"^{message}"):
      MoEBlock(*args, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("sharded", ["tokens", "experts"])
def test_block_on_a_mesh_with_explicit_axes_equals_one_device(sharded):
  """jax.make_mesh's default axes are Explicit, whose types refuse the router's sort over
  sharded tokens, or a slice of sharded experts (ShardingTypeErrors before): the block runs them
  Auto and keeps y's sharding."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  block, x_BxSxD, _, _, (want_loss, want_grads) = _block_and_reference()
  explicit = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  x_spec = P("data") if sharded == "tokens" else P()
  x_sharded = jax.device_put(x_BxSxD, NamedSharding(explicit, x_spec))
  if sharded == "experts":
    state = nnx.state(block)
    nnx.update(block, jax.tree.map(lambda v: jax.device_put(
        v, NamedSharding(explicit, P("data") if v.ndim == 3 else P())), state))

  def loss(block, x):
    y, aux = block(x)
    return jnp.sum(y ** 2) + aux["aux_loss"], y

  (got_loss, y), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(block, x_sharded)
  assert y.sharding.spec == (P("data", None, None) if sharded == "tokens" else P(None, None, None))
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  for got, want in zip(jax.tree.leaves(nnx.state(grads)), jax.tree.leaves(want_grads), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(jnp.abs(want).max()))


def test_padding_marked_by_token_mask_changes_no_real_token():
  """`token_mask` False marks padding: it routes to no expert, takes no admission capacity, is
  left out of the losses and statistics, and its y is 0. So whatever the padding holds, the real
  tokens' outputs and every figure are the same, under strict admission with tight capacity
  (padding competed for capacity before: no mask reached the block)."""
  spec = MoESpec(num_experts=4, top_k=2, admission="strict", capacity_factor=0.5)
  block = MoEBlock(16, 24, spec, init_std=0.3, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(5)
  x = rng.normal(size=(2, 8, 16)).astype(np.float32)
  mask = np.ones((2, 8), bool)
  mask[1, 4:] = False
  other = x.copy()
  other[1, 4:] = x[0, 0] * 3.0               # padding that would crowd one expert
  call = nnx.jit(lambda block, x, m: block(x, token_mask=m))
  (y1, aux1), (y2, aux2) = call(block, jnp.asarray(x), mask), call(block, jnp.asarray(other), mask)
  np.testing.assert_array_equal(np.asarray(y1)[mask], np.asarray(y2)[mask])
  assert np.all(np.asarray(y1)[~mask] == 0)
  for key in ("aux_loss", "z_loss", "load_E", "admitted_load_E"):
    np.testing.assert_array_equal(aux1[key], aux2[key], err_msg=key)
  for key, value in aux1["routing"].items():
    np.testing.assert_array_equal(value, aux2["routing"][key], err_msg=key)
  assert int(aux1["load_E"].sum()) == 12 * 2                   # the 12 real tokens' choices
  # The premise: unmasked, the same padding takes capacity from real tokens.
  plain = nnx.jit(lambda block, x: block(x)[0])
  assert not np.array_equal(np.asarray(plain(block, jnp.asarray(x)))[mask],
                            np.asarray(plain(block, jnp.asarray(other)))[mask])
  # Without admission each token is its own: the real tokens' losses are those of the real
  # tokens alone.
  free = MoEBlock(16, 24, MoESpec(num_experts=4, top_k=2), init_std=0.3, rngs=nnx.Rngs(0))
  (_, aux_masked), (_, aux_real) = (call(free, jnp.asarray(x), mask),
                                    nnx.jit(lambda b, x: b(x))(free, jnp.asarray(x[mask][None])))
  for key in ("aux_loss", "z_loss"):
    np.testing.assert_allclose(aux_masked[key], aux_real[key], rtol=1e-6, err_msg=key)
  with pytest.raises(ValueError, match=r"token_mask must be bool \[batch, seq\] = \[2, 8\], got "
                                       r"int32\[2, 8\]"):
    block(jnp.asarray(x), token_mask=jnp.ones((2, 8), jnp.int32))


def test_padding_holding_nan_or_inf_leaves_every_gradient_as_zero_padding_does():
  """The outputs at padding are masked, but the router and the shared expert read the padded
  rows too: a NaN or inf there reached their gradients through 0 x inf (a fully masked
  attention row gives one). The block zeroes the padding first."""
  spec = MoESpec(num_experts=4, top_k=2, shared_hidden=8, shared_gate=True)
  block = MoEBlock(16, 24, spec, init_std=0.3, rngs=nnx.Rngs(0))
  x = np.random.default_rng(5).normal(size=(2, 8, 16)).astype(np.float32)
  mask = np.ones((2, 8), bool)
  mask[1, 4:] = False

  def loss(block, x):
    y, aux = block(x, token_mask=jnp.asarray(mask))
    return jnp.sum(y ** 2) + aux["aux_loss"] + aux["z_loss"]

  grad = nnx.jit(nnx.grad(loss))
  want = nnx.to_flat_state(nnx.state(grad(block, jnp.asarray(np.where(mask[..., None], x, 0)))))
  for pad in (np.nan, np.inf):
    got = nnx.to_flat_state(nnx.state(grad(block, jnp.asarray(np.where(mask[..., None], x, pad)))))
    for (path, g), (_, w) in zip(got, want):
      np.testing.assert_array_equal(g[...], w[...], err_msg=f"{pad} {path}")


@pytest.mark.parametrize("kind", ["local", "ep"])
def test_deferred_reductions_finished_after_the_layers_equal_the_blocks_own(kind):
  """`defer_reductions=True`: the block issues no collective of its own (ep: but its exchange);
  `finish_aux` on two layers' terms stacked (one collective for both, as after a scan) gives
  each layer's losses, routing statistics (ep: the straggler and dispatch rows needed too) and
  the losses' gradients as the block's own reductions do, under reroute admission and padding,
  on 8 devices."""
  from jax.sharding import PartitionSpec as P

  from moejax.layers.moe import finish_aux
  from moejax.placement.dispatch import LOCAL, Dispatch
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  spec = MoESpec(num_experts=8, top_k=2, admission="reroute", capacity_factor=0.75,
                 locality_weight=0.1)
  block = MoEBlock(16, 24, spec, init_std=0.3, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(block)
  x_LxBxSxD = jax.random.normal(jax.random.key(2), (2, 8, 6, 16))
  mask_BxS = jnp.arange(6)[None, :] < jnp.array([6, 6, 3, 6, 6, 6, 1, 6])[:, None]
  if kind == "ep":
    dispatch = Dispatch(kind="ep", axis_names=("data",), num_devices=8)
    specs = jax.tree.map(lambda v: P("data") if v.ndim == 3 else P(), state)   # experts split
  else:
    dispatch, specs = LOCAL, jax.tree.map(lambda v: P(), state)

  def per_device(state, x_LxBxSxD, mask, defer):
    run = lambda x: nnx.merge(graphdef, state)(                  # noqa: E731
        x, axis_name="data", token_mask=mask, dispatch=dispatch, defer_reductions=defer)[1]
    auxes = [run(x) for x in x_LxBxSxD]
    if defer:
      aux_L = finish_aux(jax.tree.map(lambda *a: jnp.stack(a), *auxes), 2, "data", dispatch)
    else:
      aux_L = jax.tree.map(lambda *a: jnp.stack(a), *auxes)
    return jax.tree.map(lambda a: a[None], aux_L)               # each device's shares

  def losses(state, defer):
    aux = jax.shard_map(functools.partial(per_device, defer=defer), mesh=mesh,
                        in_specs=(specs, P(None, "data"), P("data")), out_specs=P("data"),
                        check_vma=False)(state, x_LxBxSxD, mask_BxS)
    return (jnp.sum(aux["aux_loss"]) + 0.1 * jnp.sum(aux["z_loss"])
            + jnp.sum(aux["locality_loss"]), aux)

  (want, want_aux), want_grads = jax.jit(jax.value_and_grad(
      functools.partial(losses, defer=False), has_aux=True))(state)
  (got, got_aux), got_grads = jax.jit(jax.value_and_grad(
      functools.partial(losses, defer=True), has_aux=True))(state)
  assert "unreduced" not in got_aux and float(want_aux["routing"]["rerouted_frac"].sum()) > 0
  if kind == "ep":    # the premise: placement figures, a skew to see, a locality loss
    assert float(want_aux["placement"]["straggler"].sum(axis=0).min()) > 1.0
    assert float(want_aux["locality_loss"].sum(axis=0).min()) > 0
    assert set(got_aux["placement"]) == set(want_aux["placement"])
  np.testing.assert_allclose(got, want, rtol=1e-6)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_aux),
                          jax.tree.leaves(want_aux), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7, err_msg=jax.tree_util.keystr(path))
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * float(jnp.abs(w).max()))
  # The deferred block itself: no collective (the counts wait for `finish_aux`).
  jaxpr = str(jax.make_jaxpr(lambda s, x: jax.shard_map(
      lambda s, x: nnx.merge(graphdef, s)(x, axis_name="data", dispatch=dispatch,
                                          defer_reductions=True)[1],
      mesh=mesh, in_specs=(specs, P("data")), out_specs=P(), check_vma=False)(s, x))(
          state, x_LxBxSxD[0]))
  assert not re.search(r"\b(psum|pmax|all_gather)\b", jaxpr)
