"""RMSNorm, or LayerNorm without a bias (Cohere's; `kind="layer"`; with one for DeepSeek-V3.2's
indexer keys), or zero-centered RMSNorm (Qwen3-Next's; `kind="rms_zero_centered"`: the stored
weight w scales by 1 + w and starts at 0; moejax's norms take no weight decay, `axes.NO_DECAY`):
statistics in fp32, output in the input's dtype."""
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
# What the residual stream's norms compute (model.norm_kind): RMSNorm, LayerNorm (mean
# subtracted, no bias: Cohere's), or RMSNorm scaled by 1 + its weight (Qwen3-Next's, its QK-norm
# too).
NORM_KINDS = ("rms", "layer", "rms_zero_centered")


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
  if kind == "rms_zero_centered":     # 1 + w in fp32, as transformers' Qwen3NextRMSNorm
    return rms_norm(x, scale.astype(jnp.float32) + 1.0, eps)
  return (layer_norm if kind == "layer" else rms_norm)(x, scale, eps)


def initial_scale(dim: int, kind: str = "rms"):
  """A norm's stored weight that scales by 1: ones, zeros for the zero-centered kind."""
  return (jnp.zeros if kind == "rms_zero_centered" else jnp.ones)((dim,), jnp.float32)


class RMSNorm(nnx.Module):
  """A norm's scale, and `norm` of its kind (RMSNorm unless `kind="layer"`)."""

  def __init__(self, dim: int, *, eps: float = 1e-5, kind: str = "rms"):
    self.scale = param(initial_scale(dim, kind), (NORM,), NORMS)
    self.eps, self.kind = eps, kind

  def __call__(self, x):
    return norm(x, self.scale[...], self.eps, self.kind)
