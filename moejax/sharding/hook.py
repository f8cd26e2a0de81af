"""The one parameter-gather / gradient-scatter hook used by every layer.

Inside the `shard_map` body each parameter arrives as this device's slice (fp32 master copy).
`gather_param(shard, layout, state, spec) -> (full, new_state, stats)` returns the full
parameter in the compute dtype (bf16), and its VJP sends the gradient home in fp32:

  shard      forward all_gather (bf16) along `layout.dim`, plain or compressed by the codec
             (`moejax.codec`, when `spec` is a CodecSpec); backward psum_scatter (fp32)
  replicate  forward cast;                                  backward psum (fp32)
  expert     forward cast (the owner uses it in place);     backward none: already complete

`state` is the compressed gather's per-parameter state (None for the plain gather), carried from
step to step in the train state. `stats` are per-device byte and change counts (see
`STAT_KEYS`); for the plain gather they are static. Outside a mesh (a user's own model, plain
`jit`) use `cast_param`, the identity up to the cast.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from moejax.codec import gather as codec
from moejax.sharding.layout import Layout
from moejax.sharding.mesh import DEVICES

COMPUTE_DTYPE = jnp.bfloat16
GRAD_DTYPE = jnp.float32
# Per-gather figures, summed over parameters: bytes this device put into the gather
# collectives (static buffer capacity), bytes plain bf16 would have put in, values whose exponent
# changed, blocks with a change, dense fallbacks after overflow, gathers that ran compressed.
STAT_KEYS = ("bytes_sent", "bytes_plain", "exponent_changes", "block_changes", "fallback",
             "compressed")


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


def _plain_stats(shard, layout: Layout) -> dict:
  sent = float(math.prod(shard.shape) * jnp.dtype(COMPUTE_DTYPE).itemsize)
  if layout.kind != "shard":
    sent = 0.0
  return {"bytes_sent": jnp.float32(sent), "bytes_plain": jnp.float32(sent),
          "exponent_changes": jnp.float32(0), "block_changes": jnp.float32(0),
          "fallback": jnp.float32(0), "compressed": jnp.float32(0)}


def gather_param(shard, layout: Layout, state=None, spec: codec.CodecSpec | None = None,
                 axis_names=DEVICES):
  """Full parameter (bf16) from this device's shard: (full, new_state, stats)."""
  if layout.kind == "shard" and spec is not None:
    full, new_state, s = codec.compressed_all_gather(
        shard, state, axis_name=axis_names, axis=layout.dim, spec=spec,
        compute_dtype=COMPUTE_DTYPE)
    stats = {"bytes_sent": s["bytes_sent"], "bytes_plain": s["bytes_plain"],
             "exponent_changes": jnp.maximum(s["exponent_changes"], 0),
             "block_changes": s["block_changes"], "fallback": s["fallback"],
             "compressed": 1 - s["dense"]}
    return full, new_state, {k: jnp.asarray(v, jnp.float32) for k, v in stats.items()}
  if layout.kind == "shard":
    full = _all_gather(shard, layout.dim, axis_names)
  elif layout.kind == "replicate":
    full = _replicated(shard, axis_names)
  elif layout.kind == "expert":
    full = cast_param(shard)
  else:
    raise ValueError(f"unknown layout kind {layout.kind!r}")
  return full, state, _plain_stats(shard, layout)


def gather_tree(shards, layouts, states=None, specs=None, axis_names=DEVICES):
  """gather_param over a tree: (full tree, new state tree, stats summed over the tree)."""
  is_layout = lambda v: isinstance(v, Layout)   # noqa: E731
  leaves, treedef = jax.tree.flatten(shards)
  lays = treedef.flatten_up_to(layouts)
  sts = treedef.flatten_up_to(states) if states is not None else [None] * len(leaves)
  sps = treedef.flatten_up_to(specs) if specs is not None else [None] * len(leaves)
  fulls, new_states, total = [], [], None
  for x, lay, st, sp in zip(leaves, lays, sts, sps):
    assert is_layout(lay)
    full, new_state, stats = gather_param(x, lay, st, sp, axis_names)
    fulls.append(full)
    new_states.append(new_state)
    total = stats if total is None else {k: total[k] + stats[k] for k in STAT_KEYS}
  new_state_tree = treedef.unflatten(new_states) if states is not None else None
  return treedef.unflatten(fulls), new_state_tree, total


def comm_bytes(param_shapes, layouts, num_devices: int, *, remat: bool) -> dict[str, float]:
  """Bytes per device per step that the plain hook's collectives move, from static shapes.

  An all_gather or reduce-scatter of a tensor of S bytes moves (n-1)/n * S into (out of) each
  device. With remat the forward gathers of layer parameters are issued again in backward.
  """
  n = num_devices
  gather = scatter = 0.0
  frac = (n - 1) / n
  for x, lay in zip(jax.tree.leaves(param_shapes),
                    jax.tree.leaves(layouts, is_leaf=lambda v: isinstance(v, Layout))):
    size = math.prod(x.shape)
    if lay.kind == "shard":
      g = frac * size * jnp.dtype(COMPUTE_DTYPE).itemsize
      gather += g * (2 if remat else 1)
      scatter += frac * size * jnp.dtype(GRAD_DTYPE).itemsize
    elif lay.kind == "replicate" and n > 1:
      scatter += 2 * frac * size * jnp.dtype(GRAD_DTYPE).itemsize   # ring all-reduce
  return {"gather_bytes": gather, "scatter_bytes": scatter}
