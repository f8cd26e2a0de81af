"""RMSNorm, or LayerNorm without a bias (Cohere's; `kind="layer"`; with one for DeepSeek-V3.2's
indexer keys): statistics in fp32, output in the input's dtype."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moejax import profiling
from moejax.sharding.axes import NORM, NORMS, param

# Where a decoder layer's norms sit (model.norm_position): on each sublayer's input, on its
# output before it joins the residual stream (OLMo 2's), both (AfMoE's sandwich), or one norm
# whose output both sublayers read side by side, their outputs summed into the residual stream
# (Cohere's parallel block).
NORM_POSITIONS = ("pre", "post", "sandwich", "parallel")
# What the residual stream's norms compute (model.norm_kind): RMSNorm, or LayerNorm (mean
# subtracted, no bias: Cohere's).
NORM_KINDS = ("rms", "layer")


@profiling.scoped("norm")
def rms_norm(x, scale, eps: float):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  scale = scale.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + scale.shape)
  return (y * scale).astype(x.dtype)


@profiling.scoped("norm")
def layer_norm(x, scale, eps: float, bias=None):
  """LayerNorm; `bias` (DeepSeek-V3.2's indexer keys) added after the scale, None for none."""
  x32 = x.astype(jnp.float32)
  centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
  y = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)
  lead = (1,) * (x.ndim - 1)
  y = y * scale.astype(jnp.float32).reshape(lead + scale.shape)
  if bias is not None:
    y = y + bias.astype(jnp.float32).reshape(lead + bias.shape)
  return y.astype(x.dtype)


def norm(x, scale, eps: float, kind: str = "rms"):
  """The residual stream's norm of `kind` (`NORM_KINDS`)."""
  return (layer_norm if kind == "layer" else rms_norm)(x, scale, eps)


class RMSNorm(nnx.Module):
  """A norm's scale, and `norm` of its kind (RMSNorm unless `kind="layer"`)."""

  def __init__(self, dim: int, *, eps: float = 1e-5, kind: str = "rms"):
    self.scale = param(jnp.ones((dim,), jnp.float32), (NORM,), NORMS)
    self.eps, self.kind = eps, kind

  def __call__(self, x):
    return norm(x, self.scale[...], self.eps, self.kind)
