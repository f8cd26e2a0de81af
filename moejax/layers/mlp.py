"""The dense SwiGLU MLP of the layers without experts (DeepSeek's first_k_dense_replace layers).

Letters: T tokens (any leading shape), D width, F hidden width.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.layers.matmul import dense
from moejax.sharding.axes import DENSE_MLP, EMBED, MLP as MLP_AXIS, param


def swiglu(x, w_gate_DxF, w_up_DxF, w_down_FxD):
  """down(silu(x gate) * (x up)) in x's dtype (the weights are cast to it)."""
  dt = x.dtype
  h = jax.nn.silu(dense(x, w_gate_DxF.astype(dt))) * dense(x, w_up_DxF.astype(dt))
  return dense(h, w_down_FxD.astype(dt))


def swiglu_weights(d_model: int, hidden: int, group: str, init, rngs: nnx.Rngs):
  """(gate [D, F], up [D, F], down [F, D]) params of one SwiGLU in `group` (a dense layer's MLP,
  the shared expert)."""
  return (param(init(rngs.params(), (d_model, hidden), jnp.float32), (EMBED, MLP_AXIS), group),
          param(init(rngs.params(), (d_model, hidden), jnp.float32), (EMBED, MLP_AXIS), group),
          param(init(rngs.params(), (hidden, d_model), jnp.float32), (MLP_AXIS, EMBED), group))


class MLP(nnx.Module):
  def __init__(self, d_model: int, hidden: int, *, init_std: float, rngs: nnx.Rngs):
    init = jax.nn.initializers.normal(init_std)
    self.w_gate, self.w_up, self.w_down = swiglu_weights(d_model, hidden, DENSE_MLP, init, rngs)

  def __call__(self, x):
    return swiglu(x, self.w_gate[...], self.w_up[...], self.w_down[...])
