"""Gated DeltaNet (`moejax.layers.linear_attention`): the chunked recurrence against the
recurrence one token at a time, state carried across calls, gradients, bf16."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.layers import linear_attention as la

B, S, HK, HV, DK, DV, D = 2, 150, 2, 4, 8, 6, 32


def _operands(seed=0):
  r = np.random.default_rng(seed)
  f32 = lambda *shape: jnp.asarray(r.normal(size=shape), jnp.float32)   # noqa: E731
  return dict(q_BxSxHkxDk=f32(B, S, HK, DK), k_BxSxHkxDk=f32(B, S, HK, DK),
              v_BxSxHvxDv=f32(B, S, HV, DV),
              g_BxSxHv=-jnp.asarray(r.uniform(0, 0.5, (B, S, HV)), jnp.float32),
              beta_BxSxHv=jnp.asarray(r.uniform(0, 1, (B, S, HV)), jnp.float32),
              memory_BxHxDkxDv=f32(B, HV, DK, DV))


def _net(seed=0):
  return la.GatedDeltaNet(D, key_heads=HK, value_heads=HV, key_dim=DK, value_dim=DV,
                          init_std=0.2, rngs=nnx.Rngs(seed))


@functools.cache
def _forward(by_token: bool):
  graphdef, _ = nnx.split(_net())

  @jax.jit
  def forward(state, x, conv, memory):
    net = nnx.merge(graphdef, state)
    return net.with_state(x, None if conv is None else la.LinearState(conv, memory),
                          by_token=by_token)
  return forward


def test_chunks_compute_the_recurrence():
  """By chunks of 64 (150 tokens: the last chunk partial) and of 16, from a memory of random
  values, the outputs and final memory are the token-by-token recurrence's."""
  ops = _operands()
  want_o, want_m = jax.jit(la.gated_delta_rule_by_token)(**ops)
  by_chunks = {chunk: jax.jit(functools.partial(la.gated_delta_rule, chunk=chunk))
               for chunk in (64, 16)}
  for rule in by_chunks.values():
    o, m = rule(**ops)
    np.testing.assert_allclose(o, want_o, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(m, want_m, atol=2e-6, rtol=1e-5)
  no_decay = dict(ops, g_BxSxHv=jnp.zeros_like(ops["g_BxSxHv"]))   # the decay matters
  assert np.abs(by_chunks[64](**no_decay)[0] - want_o).max() > 0.1


def test_the_state_carries_a_sequence_across_calls():
  """The layer over 150 tokens equals it over 100 then 50 from the state the first call left
  (the convolution's last inputs and the memory), by chunks and token by token."""
  state = nnx.state(_net(), nnx.Param)
  x = jax.random.normal(jax.random.key(1), (B, S, D))
  whole, final = _forward(False)(state, x, None, None)
  head, mid = _forward(False)(state, x[:, :100], None, None)
  tail, end = _forward(True)(state, x[:, 100:], *mid)
  np.testing.assert_allclose(jnp.concatenate([head, tail], axis=1), whole, atol=5e-5)
  np.testing.assert_allclose(end.memory_BxHxDkxDv, final.memory_BxHxDkxDv, atol=5e-5)
  np.testing.assert_array_equal(end.conv_BxKxC, final.conv_BxKxC)
  np.testing.assert_array_equal(final.conv_BxKxC[:, :, :HK * DK],
                                (x[:, -3:] @ state["wq"][...])[:, :, :])
  fresh, _ = _forward(True)(state, x[:, 100:], None, None)    # no state: another output
  assert np.abs(fresh - tail).max() > 1e-3


def test_gradients_by_chunks_are_the_recurrences():
  """Gradients of a loss on the layer's output, to its input and every parameter, by chunks
  equal token by token's; finite."""
  net = _net()
  graphdef, state = nnx.split(net)
  x = jax.random.normal(jax.random.key(2), (B, 70, D))

  def loss(state, x, by_token):
    y, _ = nnx.merge(graphdef, state).with_state(x, by_token=by_token)
    return jnp.sum(jnp.sin(y))

  grads = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
  chunked, by_token = grads(state, x, False), grads(state, x, True)
  for a, b in zip(jax.tree.leaves(chunked), jax.tree.leaves(by_token)):
    assert np.all(np.isfinite(a))
    np.testing.assert_allclose(a, b, atol=1e-4 * float(jnp.abs(b).max()) + 1e-6)
  assert float(jnp.abs(chunked[0]["a_log"][...]).max()) > 0   # the decay rates learn


def test_bf16_inputs_keep_the_recurrence_in_fp32():
  """bf16 inputs and parameters: output bf16, within bf16 rounding of the fp32 layer's (the
  recurrence runs in fp32 either way)."""
  state = nnx.state(_net(), nnx.Param)
  x = jax.random.normal(jax.random.key(3), (B, S, D))
  want, _ = _forward(False)(state, x, None, None)
  # as the gather casts them: the decay's parameters stay fp32 (axes.FLOAT32_GROUPS)
  half = {k: v if k in ("a_log", "dt_bias") else v.astype(jnp.bfloat16)
          for k, v in nnx.to_pure_dict(state).items()}
  nnx.replace_by_pure_dict(state, half)
  got, end = _forward(False)(state, x.astype(jnp.bfloat16), None, None)
  assert got.dtype == jnp.bfloat16 and end.memory_BxHxDkxDv.dtype == jnp.float32
  diff = got.astype(jnp.float32) - want
  err = float(jnp.sqrt(jnp.mean(diff * diff) / jnp.mean(want * want)))
  assert err < 2e-2, err


def test_the_layer_and_its_gradient_lower_for_cuda():
  """The layer's forward and backward lower for CUDA here (lowering only: the GPU check runs it),
  the chunks' solve as one batched triangular solve."""
  net = _net()
  graphdef, state = nnx.split(net)

  def loss(state, x):
    return jnp.sum(nnx.merge(graphdef, state)(x))

  x = jax.ShapeDtypeStruct((B, S, D), jnp.bfloat16)
  half = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.bfloat16), state)
  cuda = jax.jit(jax.grad(loss)).trace(half, x).lower(lowering_platforms=("cuda",)).as_text()
  assert "triangular_solve" in cuda
