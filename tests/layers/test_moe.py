"""The MoE block against a naive per-token loop, and as a drop-in layer (NNX and Linen)."""
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
    (dict(threshold=2.0), "threshold=2.0")])
def test_spec_refuses_bad_fields_by_name(changes, field):
  """Refused when the spec is made, naming the field (a block built from it failed only at its
  first call: top_k=0 a ZeroDivisionError, groups=3 a reshape TypeError)."""
  with pytest.raises(ValueError, match=f"^MoESpec.{re.escape(field)}"):
    MoESpec(**{"num_experts": 8, "top_k": 2, **changes})
