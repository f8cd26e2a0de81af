"""The one parameter gather / gradient scatter: the only place a parameter is gathered.

Inside the `shard_map` body each parameter arrives as this device's slice (fp32 master copy).
`gather_leaf(shard, layout, spec, state) -> (full, new_state, stats)` returns the full parameter
in the compute dtype (bf16; fp32 with `dtype=jnp.float32`, config.compute_dtype, codec off), and
its VJP sends the gradient home in fp32:

  shard      forward all_gather of the bf16 bit patterns along `layout.dim`, plain (`spec` None)
             or compressed by the codec (`spec` a `CodecSpec`, `moejax.codec`);
             backward psum_scatter (fp32)
  replicate  forward cast;                                    backward psum (fp32)
  expert     forward cast (the owner uses it in place);       backward none: already complete

The plain gather moves integer views, so it is bit-exact like the codec: XLA:CPU's float
all-gather rewrites bf16 NaN payloads (0x7fbf arrives as 0x7fc0).

`state` is the compressed gather's per-parameter state (None for the plain gather), carried from
step to step in the train state. `stats` are per-device figures of one gather, `STAT_KEYS`, as
float32 scalars identical on every device: static for the plain gather, the codec's own
(`moejax.codec.gather`) for a compressed one. `local_gather` is the hook outside a mesh (a
user's own model, plain `jit`): parameters are already whole, only cast.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from moejax.codec import gather as codec
from moejax.sharding import axes, prefetch as prefetch_lib
from moejax.sharding.layout import Layout
from moejax.sharding.mesh import DEVICES

COMPUTE_DTYPE = jnp.bfloat16
COMPUTE_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}   # config.compute_dtype
GRAD_DTYPE = jnp.float32
_BITS_DTYPES = {2: jnp.uint16, 4: jnp.uint32}   # a compute dtype's bit patterns, by item size
# Per-gather figures: bytes this device put into the gather collectives (static buffer capacity),
# bytes the plain bf16 gather would have put in, values whose exponent changed, blocks with a
# change, values with any bit changed, fullest patch / its capacity, overflow fallbacks, gathers
# that ran dense. Counts are summed over the devices of the gather.
STAT_KEYS = ("bytes_sent", "bytes_plain", "exponent_changes", "block_changes", "word_changes",
             "capacity_fill", "fallback", "dense")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _all_gather(shard, dim: int, axis_names, dtype):
  bits = lax.bitcast_convert_type(shard.astype(dtype), _BITS_DTYPES[jnp.dtype(dtype).itemsize])
  full = lax.all_gather(bits, axis_names, axis=dim, tiled=True)
  return lax.bitcast_convert_type(full, dtype)


def _all_gather_fwd(shard, dim, axis_names, dtype):
  return _all_gather(shard, dim, axis_names, dtype), None


def _all_gather_bwd(dim, axis_names, dtype, _, g):
  return (lax.psum_scatter(g.astype(GRAD_DTYPE), axis_names, scatter_dimension=dim, tiled=True),)


_all_gather.defvjp(_all_gather_fwd, _all_gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _replicated(x, axis_names, dtype):
  return x.astype(dtype)


def _replicated_fwd(x, axis_names, dtype):
  return _replicated(x, axis_names, dtype), None


def _replicated_bwd(axis_names, dtype, _, g):
  return (lax.psum(g.astype(GRAD_DTYPE), axis_names),)


_replicated.defvjp(_replicated_fwd, _replicated_bwd)


def gather_bytes(shard_shape, layout: Layout, dtype=COMPUTE_DTYPE) -> float:
  """Bytes one device puts into the plain gather of one parameter (0 unless sharded)."""
  if layout.kind != "shard":
    return 0.0
  return float(math.prod(shard_shape) * jnp.dtype(dtype).itemsize)


def scatter_bytes(shard_shape, layout: Layout, num_devices: int) -> float:
  """Bytes one device receives in the backward collective of one parameter: the fp32 shards of
  the reduce-scatter, or a ring all-reduce of a replicated parameter."""
  n, size = num_devices, math.prod(shard_shape) * jnp.dtype(GRAD_DTYPE).itemsize
  if layout.kind == "shard":
    return float((n - 1) * size)
  if layout.kind == "replicate" and n > 1:
    return float(2 * (n - 1) / n * size)
  return 0.0


def run_gathers(num_layers: int, *, remat: str, prefetch: bool) -> int:
  """Gathers of each parameter of one scanned run of `num_layers` layers per step
  (`moejax.sharding.prefetch.scan_layers`). Without prefetch every layer is gathered once, and
  again in backward when it recomputes the layer (remat full or minimal: a gather is no matmul,
  so minimal does not keep it). Prefetching gathers one layer ahead with no condition around the
  collective, so the forward's last iteration gathers layer L-1 again; under remat full backward
  uses that one and gathers ahead too, its last iteration layer 0 again; minimal and none keep
  the weights for backward and gather nothing there."""
  if prefetch and num_layers > 1:
    return 2 * num_layers + 1 if remat == "full" else num_layers + 1
  return num_layers * (2 if prefetch_lib.recomputes(remat) else 1)


def gathers_per_layer(run_lengths, *, remat: str, prefetch: bool) -> float:
  """Gathers per step of each layer's slice of a parameter stacked over the layers of
  `run_lengths` (the scanned runs that hold them), on average."""
  return (sum(run_gathers(n, remat=remat, prefetch=prefetch) for n in run_lengths)
          / sum(run_lengths))


def _plain_stats(shard, layout: Layout, dtype) -> dict:
  sent = gather_bytes(shard.shape, layout, dtype)
  stats = dict.fromkeys(STAT_KEYS, 0.0)
  stats.update(bytes_sent=sent, bytes_plain=sent, dense=1.0 if layout.kind == "shard" else 0.0)
  return {k: jnp.float32(v) for k, v in stats.items()}


def _codec_stats(raw: dict) -> dict:
  """The codec's figures as STAT_KEYS (unknown counts, -1 with hash detection, as 0)."""
  stats = {k: raw[k] for k in STAT_KEYS}
  for k in ("exponent_changes", "word_changes"):
    stats[k] = jnp.maximum(stats[k], 0)
  return {k: jnp.asarray(v, jnp.float32) for k, v in stats.items()}


def gather_leaf(shard, layout: Layout, spec: codec.CodecSpec | None = None, state=None,
                axis_names=DEVICES, dtype=COMPUTE_DTYPE):
  """Full parameter (in `dtype`) from this device's shard: (full, new_state, stats). The codec
  gathers bf16 only (its caches hold bf16 bit patterns)."""
  if layout.kind == "shard" and spec is not None:
    if jnp.dtype(dtype) != jnp.dtype(COMPUTE_DTYPE):
      raise ValueError(f"the codec gathers {jnp.dtype(COMPUTE_DTYPE).name} only, not "
                       f"{jnp.dtype(dtype).name}")
    full, new_state, raw = codec.compressed_all_gather(
        shard, state, axis_name=axis_names, axis=layout.dim, spec=spec,
        compute_dtype=COMPUTE_DTYPE)
    return full, new_state, _codec_stats(raw)
  if layout.kind == "shard":
    full = _all_gather(shard, layout.dim, axis_names, dtype)
  elif layout.kind == "replicate":
    full = _replicated(shard, axis_names, dtype)
  elif layout.kind == "expert":
    full = shard.astype(dtype)
  else:
    raise ValueError(f"unknown layout kind {layout.kind!r}")
  return full, state, _plain_stats(shard, layout, dtype)


def local_gather(group: str, tree, states=None, dtype=COMPUTE_DTYPE, param_meta=None):
  """The hook outside a mesh, with the Gatherer's signature: parameters are already whole, only
  cast (with the model's `param_meta`, `axes.FLOAT32_GROUPS` stay float32 as in the Gatherer)."""
  if param_meta is None:
    return jax.tree.map(lambda x: x.astype(dtype), tree), states, {}
  return jax.tree.map(
      lambda x, meta: x.astype(jnp.float32 if meta.group in axes.FLOAT32_GROUPS else dtype),
      tree, param_meta[group]), states, {}
