"""RMSNorm (statistics in fp32, output in the input's dtype)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moejax import profiling
from moejax.sharding.axes import NORM, NORMS, param

# Where a decoder layer's norms sit (model.norm_position): on each sublayer's input, on its
# output before it joins the residual stream (OLMo 2's), or both (AfMoE's sandwich).
NORM_POSITIONS = ("pre", "post", "sandwich")


@profiling.scoped("norm")
def rms_norm(x, scale, eps: float):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  scale = scale.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + scale.shape)
  return (y * scale).astype(x.dtype)


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, *, eps: float = 1e-5):
    self.scale = param(jnp.ones((dim,), jnp.float32), (NORM,), NORMS)
    self.eps = eps

  def __call__(self, x):
    return rms_norm(x, self.scale[...], self.eps)
