"""The one parameter-gather / gradient-scatter hook used by every layer.

Inside the `shard_map` body each parameter arrives as this device's slice (fp32 master copy).
`gather_param(shard, layout)` returns the full parameter in the compute dtype (bf16), and its
VJP sends the gradient home in fp32:

  shard      forward all_gather (bf16) along `layout.dim`;  backward psum_scatter (fp32)
  replicate  forward cast;                                  backward psum (fp32)
  expert     forward cast (the owner uses it in place);     backward none: already complete

Outside a mesh (a user's own model, plain `jit`) use `cast_param`, the identity up to the cast.
The codec plugs in here: `Gatherer` holds the choice between the plain and the compressed
all-gather, and the per-parameter state the compressed one carries from step to step.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from moejax.sharding.layout import Layout
from moejax.sharding.mesh import DEVICES

COMPUTE_DTYPE = jnp.bfloat16
GRAD_DTYPE = jnp.float32


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _all_gather(shard, dim: int, axis_names):
  return lax.all_gather(shard.astype(COMPUTE_DTYPE), axis_names, axis=dim, tiled=True)


def _all_gather_fwd(shard, dim, axis_names):
  return _all_gather(shard, dim, axis_names), None


def _all_gather_bwd(dim, axis_names, _, g):
  return (lax.psum_scatter(g.astype(GRAD_DTYPE), axis_names, scatter_dimension=dim, tiled=True),)


_all_gather.defvjp(_all_gather_fwd, _all_gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _replicated(x, axis_names):
  return x.astype(COMPUTE_DTYPE)


def _replicated_fwd(x, axis_names):
  return _replicated(x, axis_names), None


def _replicated_bwd(axis_names, _, g):
  return (lax.psum(g.astype(GRAD_DTYPE), axis_names),)


_replicated.defvjp(_replicated_fwd, _replicated_bwd)


def cast_param(x):
  return x.astype(COMPUTE_DTYPE)


def gather_param(shard, layout: Layout, axis_names=DEVICES):
  """Full parameter (bf16) from this device's shard; see the module docstring for the VJP."""
  if layout.kind == "shard":
    return _all_gather(shard, layout.dim, axis_names)
  if layout.kind == "replicate":
    return _replicated(shard, axis_names)
  if layout.kind == "expert":
    return cast_param(shard)
  raise ValueError(f"unknown layout kind {layout.kind!r}")


def gather_tree(shards, layouts, axis_names=DEVICES):
  return jax.tree.map(lambda x, lay: gather_param(x, lay, axis_names), shards, layouts)


def comm_bytes(param_shapes, layouts, num_devices: int, *, remat: bool) -> dict[str, float]:
  """Bytes per device per step that the hook's collectives move, from static shapes.

  An all_gather or reduce-scatter of a tensor of S bytes moves (n-1)/n * S into (out of) each
  device. With remat the forward gathers of layer parameters are issued again in backward.
  """
  n = num_devices
  gather = scatter = 0.0
  frac = (n - 1) / n
  for x, lay in zip(jax.tree.leaves(param_shapes),
                    jax.tree.leaves(layouts, is_leaf=lambda v: isinstance(v, Layout))):
    size = 1
    for s in x.shape:
      size *= s
    if lay.kind == "shard":
      g = frac * size * jnp.dtype(COMPUTE_DTYPE).itemsize
      gather += g * (2 if remat else 1)
      scatter += frac * size * jnp.dtype(GRAD_DTYPE).itemsize
    elif lay.kind == "replicate" and n > 1:
      scatter += 2 * frac * size * jnp.dtype(GRAD_DTYPE).itemsize   # ring all-reduce
  return {"gather_bytes": gather, "scatter_bytes": scatter}
