"""Mamba-2 (`moejax.layers.state_space`): the chunked recurrence against the recurrence one token
at a time, and their gradients. (Against transformers' Granite-4.0-H model:
tests/convert/test_hf_parity.py; its state carried from a prompt by chunks to each new token:
tests/models/test_decode.py.)"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.layers import state_space as ss

# batch, tokens, groups, state width, heads (two per group), head width, model width
B, S, G, N, H, P, D = 2, 150, 2, 8, 4, 6, 32


def _net():
  return ss.Mamba2(D, groups=G, heads=H, state_dim=N, head_dim=P, init_std=0.2,
                   rngs=nnx.Rngs(0))


def test_chunks_compute_the_recurrence():
  """By chunks of 64 (150 tokens: the last chunk partial) and of 16, from a memory of random
  values, the outputs and final memory are the token-by-token recurrence's; each group's B and
  C serve its own heads only."""
  r = np.random.default_rng(0)
  f32 = lambda *shape: jnp.asarray(r.normal(size=shape), jnp.float32)   # noqa: E731
  ops = (f32(B, S, G, N), f32(B, S, G, N), f32(B, S, H, P),
         -jnp.asarray(r.uniform(0, 0.5, (B, S, H)), jnp.float32), f32(B, H, N, P))
  want_o, want_m = jax.jit(ss.ssd_by_token)(*ops)
  scale = float(jnp.abs(want_o).max())
  for chunk in (64, 16):
    o, m = jax.jit(functools.partial(ss.ssd, chunk=chunk))(*ops)
    np.testing.assert_allclose(o, want_o, atol=2e-6 * scale)
    np.testing.assert_allclose(m, want_m, atol=2e-6 * float(jnp.abs(want_m).max()))
  other_c = ops[0].at[:, :, 1].set(0.0)     # group 1's C: heads 2 and 3 only
  o, _ = jax.jit(ss.ssd_by_token)(other_c, *ops[1:])
  np.testing.assert_array_equal(o[:, :, :2], want_o[:, :, :2])
  assert np.abs(o[:, :, 2:] - want_o[:, :, 2:]).max() > 0.1


def test_gradients_by_chunks_are_the_recurrences():
  """Gradients of a loss on the layer's output, to its input and every parameter, by chunks
  equal token by token's; the decay rates, skips and time-step biases learn."""
  graphdef, state = nnx.split(_net())
  x = jax.random.normal(jax.random.key(2), (B, 70, D))

  def loss(state, x, by_token):
    y, _ = nnx.merge(graphdef, state).with_state(x, by_token=by_token)
    return jnp.sum(jnp.sin(y))

  grads = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
  chunked, by_token = grads(state, x, False), grads(state, x, True)
  for a, b in zip(jax.tree.leaves(chunked), jax.tree.leaves(by_token)):
    assert np.all(np.isfinite(a))
    np.testing.assert_allclose(a, b, atol=1e-4 * float(jnp.abs(b).max()) + 1e-6)
  for name in ("a_log", "d_skip", "dt_bias", "conv_b_bias"):
    assert float(jnp.abs(chunked[0][name][...]).max()) > 0, name
