"""`attend` with key and value widths that differ either way (latent attention) against plain
causal softmax attention written out."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.layers.attention import attend


@pytest.mark.parametrize("dk,dv", [(6, 4), (4, 6), (5, 5)])
def test_attend_any_widths(dk, dv):
  q, k, v = (jax.random.normal(jax.random.key(i), (2, 5, 3, w)) for i, w in
             enumerate((dk, dk, dv)))
  logits = jnp.einsum("bshd,bthd->bhst", q, k) / np.sqrt(dk)
  logits = jnp.where(jnp.tril(jnp.ones((5, 5), bool)), logits, -jnp.inf)
  want = jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(logits, axis=-1), v)
  np.testing.assert_allclose(attend(q, k, v, is_causal=True), want, rtol=1e-5, atol=1e-6)
