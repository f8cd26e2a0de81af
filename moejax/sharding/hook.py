"""The one parameter gather / gradient scatter: the only place a parameter is gathered.

Inside the `shard_map` body each parameter arrives as this device's slice (fp32 master copy).
`gather_leaf(shard, layout, spec, state) -> (full, new_state, stats)` returns the full parameter
in the compute dtype (bf16; fp32 with `dtype=jnp.float32`, config.compute_dtype, codec off), and
its VJP sends the gradient home, summed in fp32 (or, with `reduce_dtype=jnp.bfloat16`,
config.reduce_dtype, the bf16 leaves' gradients summed in bf16: half the bytes, each hop of the
reduction rounding to 8 bits of mantissa; leaves gathered in fp32, `axes.FLOAT32_GROUPS`, keep
fp32):

  shard      forward all_gather of the bf16 bit patterns along `layout.dim`, plain (`spec` None)
             or compressed by the codec (`spec` a `CodecSpec`, `moejax.codec`);
             backward psum_scatter (fp32, or the reduce dtype)
  replicate  forward cast;                                    backward psum (likewise)
  expert     forward cast (the owner uses it in place);       backward none: already complete

The plain gather moves integer views, so it is bit-exact like the codec: XLA:CPU's float
all-gather rewrites bf16 NaN payloads (0x7fbf arrives as 0x7fc0). `gather_leaves` is the same for
one gather group's leaves (a layer's parameters): its sharded leaves of one dtype travel
together, the plain ones packed into one flat buffer and the compressed ones in one codec group
(one agreement collective, then one payload per pool of word / delta leaves and per
exponent-mode leaf), with one fp32 reduce-scatter back, instead of collectives per parameter (in
the tiny preset's 8-device fsdp step 39 all-gathers become 6 and 15 reduce-scatters 4; the step
is 13-20% faster on fake CPU devices, `bench/step.py`). The price is one copy of the gathered
layer, splitting the buffer into its parameters.

`state` is the compressed gather's per-parameter state (None for the plain gather), carried from
step to step in the train state. `stats` are per-device figures of one gather, `STAT_KEYS`, as
float32 scalars identical on every device: static for the plain gather, the codec's own
(`moejax.codec.gather`) for a compressed one. On a one-device mesh the plain leaves are only
cast (nothing to gather or reduce). `local_gather` is the hook outside a mesh (a user's own
model, plain `jit`): parameters are already whole, only cast.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from moejax import profiling
from moejax.codec import gather as codec
from moejax.sharding import axes, prefetch as prefetch_lib
from moejax.sharding.layout import Layout
from moejax.sharding.mesh import DEVICES

COMPUTE_DTYPE = jnp.bfloat16
COMPUTE_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}   # config.compute_dtype
GRAD_DTYPE = jnp.float32          # the gradients handed to the optimizer (fp32 masters)
REDUCE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}   # config.reduce_dtype
_BITS_DTYPES = {2: jnp.uint16, 4: jnp.uint32}   # a compute dtype's bit patterns, by item size
# Per-gather figures: bytes this device put into the gather collectives (static buffer capacity),
# bytes the plain bf16 gather would have put in, values whose exponent changed, blocks with a
# change, values with any bit changed, fullest patch / its capacity, overflow fallbacks, gathers
# that ran dense. Counts are summed over the devices of the gather.
STAT_KEYS = ("bytes_sent", "bytes_plain", "exponent_changes", "block_changes", "word_changes",
             "capacity_fill", "fallback", "dense")


def reduce_dtype_of(dtype, reduce_dtype=GRAD_DTYPE):
  """What a leaf computed in `dtype` sums its gradient in across devices: the wider of the two
  (bf16 leaves in `reduce_dtype`; those gathered in fp32, `axes.FLOAT32_GROUPS`, in fp32)."""
  return max(jnp.dtype(dtype), jnp.dtype(reduce_dtype), key=lambda d: d.itemsize)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _all_gather(shards: tuple, states: tuple, rebuild: tuple, dims: tuple, axis_names, dtype,
                specs: tuple, transport: str = "auto", reduce_dtype=GRAD_DTYPE):
  """The sharded leaves of one gather group and dtype -> (fulls, new states, codec figures).
  Plain leaves (spec None): their bit patterns in `dtype` packed into one flat buffer [N],
  gathered as [W, N], each split out and tiled along its own dim, exactly what a tiled gather of
  each would return. Compressed leaves: one `codec.compressed_all_gather_group`, but those with
  a `rebuild` state (the state this same gather left) are rebuilt from their caches
  (`codec.rebuilt_gather_group`: word / delta with no collective, element / block from one
  gather of sign+mantissa bits; they report those bytes). One reduce-scatter back for all of
  them."""
  n = len(shards)
  fulls, new_states, raws = [None] * n, list(states), [None] * n
  plain = [i for i in range(n) if specs[i] is None]
  again = [i for i in range(n) if specs[i] is not None and rebuild[i] is not None]
  if again:
    outs = codec.rebuilt_gather_group(
        [shards[i].astype(dtype) for i in again], [rebuild[i] for i in again],
        axis_name=axis_names, axes=[dims[i] for i in again], specs=[specs[i] for i in again])
    for i, full in zip(again, outs):
      sizes = codec.wire_bytes(shards[i].shape, dtype, specs[i])
      fulls[i], new_states[i] = full, rebuild[i]
      raws[i] = {k: jnp.zeros((), jnp.float32) for k in STAT_KEYS}
      raws[i].update(bytes_sent=jnp.float32(sizes["rebuilt"]),
                     bytes_plain=jnp.float32(sizes["plain"]))
  coded = [i for i in range(n) if specs[i] is not None and rebuild[i] is None]
  if plain:
    uint = _BITS_DTYPES[jnp.dtype(dtype).itemsize]
    flat_N = jnp.concatenate([lax.bitcast_convert_type(shards[i].astype(dtype), uint).reshape(-1)
                              for i in plain])
    flat_WxN = lax.all_gather(flat_N, axis_names)
    w, start = flat_WxN.shape[0], 0
    for i in plain:
      x = shards[i]
      piece_WxS = flat_WxN[:, start:start + x.size].reshape((w,) + x.shape)
      fulls[i] = lax.bitcast_convert_type(codec.tile(piece_WxS, dims[i]), dtype)
      start += x.size
  if coded:
    outs = codec.compressed_all_gather_group(
        [shards[i].astype(dtype) for i in coded], [states[i] for i in coded],
        axis_name=axis_names, axes=[dims[i] for i in coded], specs=[specs[i] for i in coded],
        transport=transport)
    for i, full, new_state, raw in zip(coded, *outs):
      fulls[i], new_states[i], raws[i] = full, new_state, raw
  return tuple(fulls), tuple(new_states), tuple(raws)


def _all_gather_fwd(shards, states, rebuild, dims, axis_names, dtype, specs, transport,
                    reduce_dtype):
  return _all_gather(shards, states, rebuild, dims, axis_names, dtype, specs, transport,
                     reduce_dtype), None


def _all_gather_bwd(dims, axis_names, dtype, specs, transport, reduce_dtype, _, cotangents):
  """One reduce-scatter (in `reduce_dtype`) of all the leaves' cotangents, packed like the
  forward's buffer, handed back in fp32; the states get none."""
  w = lax.axis_size(axis_names)
  pieces = [codec.untile(g.astype(reduce_dtype), dim, w) for g, dim in zip(cotangents[0], dims)]
  flat_WxN = jnp.concatenate([p.reshape(w, -1) for p in pieces], axis=1)
  flat_N = lax.psum_scatter(flat_WxN.reshape(-1), axis_names, scatter_dimension=0, tiled=True)
  grads, start = [], 0
  for p in pieces:
    size = p[0].size
    grads.append(flat_N[start:start + size].reshape(p.shape[1:]).astype(GRAD_DTYPE))
    start += size
  return tuple(grads), None, None


_all_gather.defvjp(_all_gather_fwd, _all_gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _replicated(x, axis_names, dtype, reduce_dtype=GRAD_DTYPE):
  return x.astype(dtype)


def _replicated_fwd(x, axis_names, dtype, reduce_dtype):
  return _replicated(x, axis_names, dtype, reduce_dtype), None


def _replicated_bwd(axis_names, dtype, reduce_dtype, _, g):
  return (lax.psum(g.astype(reduce_dtype), axis_names).astype(GRAD_DTYPE),)


_replicated.defvjp(_replicated_fwd, _replicated_bwd)


def gather_bytes(shard_shape, layout: Layout, dtype=COMPUTE_DTYPE) -> float:
  """Bytes one device puts into the plain gather of one parameter (0 unless sharded)."""
  if layout.kind != "shard":
    return 0.0
  return float(math.prod(shard_shape) * jnp.dtype(dtype).itemsize)


def scatter_bytes(shard_shape, layout: Layout, num_devices: int,
                  reduce_dtype=GRAD_DTYPE) -> float:
  """Bytes one device receives in the backward collective of one parameter: the shards of the
  reduce-scatter (in `reduce_dtype`, `reduce_dtype_of`), or a ring all-reduce of a replicated
  parameter."""
  n, size = num_devices, math.prod(shard_shape) * jnp.dtype(reduce_dtype).itemsize
  if layout.kind == "shard":
    return float((n - 1) * size)
  if layout.kind == "replicate" and n > 1:
    return float(2 * (n - 1) / n * size)
  return 0.0


def run_gathers(num_layers: int, *, remat: str, prefetch: bool, rebuilt: bool = False,
                scanned: int | None = None) -> int:
  """Gathers of each parameter of `num_layers` layers of one scan of `scanned` layers (default
  `num_layers`) per step (`moejax.sharding.prefetch.scan_period`). Without prefetch every layer is gathered once, and
  again in backward when it recomputes the layer (remat full or minimal: a gather is no matmul,
  so minimal does not keep it). Prefetching gathers one layer ahead with no condition around the
  collective: the forward gathers each layer once (its last layer runs after the scan, on the
  weights the scan's last iteration gathered); under remat full backward starts from those and
  gathers ahead too, its last iteration the period's last layer of period 0 again (each layer
  kind of a period: once in forward, once in backward); minimal and none keep the weights for
  backward and gather nothing there. `rebuilt`: the compressed gathers of a
  codec parameter, whose prefetched backward gathers are rebuilt from its cache instead
  (`codec.rebuilt_gather_group`: none moves in word / delta mode, sign+mantissa only in element /
  block mode)."""
  if prefetch and (num_layers if scanned is None else scanned) > 1:
    return 2 * num_layers if remat == "full" and not rebuilt else num_layers
  return num_layers * (2 if prefetch_lib.recomputes(remat) else 1)


def gathers_per_layer(scans, *, remat: str, prefetch: bool, rebuilt: bool = False) -> float:
  """Gathers per step of each layer's slice of a parameter stacked over the layers of `scans`
  ((its layers in the scan, the scan's layers) for each scan that holds them,
  `olmoe.scanned_layers`), on average."""
  return (sum(run_gathers(n, remat=remat, prefetch=prefetch, rebuilt=rebuilt, scanned=s)
              for n, s in scans) / sum(n for n, _ in scans))


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
  (full,), (new_state,), (stats,) = gather_leaves([shard], [layout], [spec], [state],
                                                  axis_names, [dtype])
  return full, new_state, stats


@profiling.scoped("gather")
def gather_leaves(shards, layouts, specs, states, axis_names=DEVICES, dtypes=None,
                  rebuild_states=None, transport: str = "auto", reduce_dtype=GRAD_DTYPE):
  """`gather_leaf` for a list of leaves (one gather group: a layer's parameters) -> (fulls,
  new_states, stats), lists in the same order. The sharded leaves of one dtype travel together:
  the plain ones as one all_gather of their packed bit patterns, the compressed ones as one
  `codec.compressed_all_gather_group` (one agreement collective; each leaf keeps its own spec
  and state; word / delta leaves of one code width share one pooled patch and path, the others
  each their own), and all their fp32 gradients in one reduce-scatter back. `dtypes`: each leaf's
  compute dtype (default all bf16). `rebuild_states`: for a gather run again on the same shards,
  the states the first one left; compressed leaves are rebuilt from their caches
  (`codec.rebuilt_gather_group`). `transport`: how the codec's payload travels
  (`codec.gather.TRANSPORTS`). `reduce_dtype`: what the bf16 leaves' gradients are summed in
  across devices (`reduce_dtype_of`)."""
  n = len(shards)
  dtypes = [COMPUTE_DTYPE] * n if dtypes is None else list(dtypes)
  rebuild = [None] * n if rebuild_states is None else [
      r if spec is not None else None for r, spec in zip(rebuild_states, specs)]
  fulls, new_states, stats = [None] * n, list(states), [None] * n
  packs: dict = {}     # dtype -> indices of its sharded leaves, gathered together
  # On one device a plain leaf is already whole and its gradient complete: a cast, whose
  # transpose returns the gradient in the shard's fp32 (the same values as the gather's pack,
  # collective and slice, which cost 1-2 copies of the parameters a step).
  # (Expert leaves need no axis: a group of only those may be gathered outside a mesh.)
  alone = (any(lay.kind != "expert" for lay in layouts)
           and lax.axis_size(axis_names) == 1)
  for i, (shard, layout, spec, dtype) in enumerate(zip(shards, layouts, specs, dtypes)):
    if layout.kind not in ("shard", "replicate", "expert"):
      raise ValueError(f"unknown layout kind {layout.kind!r}")
    if layout.kind == "expert" or (alone and spec is None):
      fulls[i] = shard.astype(dtype)
    elif layout.kind == "replicate":
      fulls[i] = _replicated(shard, axis_names, dtype, reduce_dtype_of(dtype, reduce_dtype))
    else:
      if spec is not None and jnp.dtype(dtype) != jnp.dtype(COMPUTE_DTYPE):
        raise ValueError(f"the codec gathers {jnp.dtype(COMPUTE_DTYPE).name} only, not "
                         f"{jnp.dtype(dtype).name}")
      packs.setdefault(jnp.dtype(dtype), []).append(i)
      continue
    stats[i] = _plain_stats(shard, layout, dtype)
  for dtype, indices in packs.items():
    outs = _all_gather(tuple(shards[i] for i in indices),
                       tuple(states[i] if specs[i] is not None else None for i in indices),
                       tuple(rebuild[i] for i in indices),
                       tuple(layouts[i].dim for i in indices), axis_names, dtype,
                       tuple(specs[i] for i in indices), transport,
                       reduce_dtype_of(dtype, reduce_dtype))
    for i, full, new_state, raw in zip(indices, *outs):
      fulls[i] = full
      if specs[i] is None:
        stats[i] = _plain_stats(shards[i], layouts[i], dtype)
      else:
        new_states[i], stats[i] = new_state, _codec_stats(raw)
  return fulls, new_states, stats


def local_gather(group: str, tree, states=None, dtype=COMPUTE_DTYPE, param_meta=None):
  """The hook outside a mesh, with the Gatherer's signature: parameters are already whole, only
  cast (with the model's `param_meta`, `axes.FLOAT32_GROUPS` stay float32 as in the Gatherer)."""
  if param_meta is None:
    return jax.tree.map(lambda x: x.astype(dtype), tree), states, {}
  return jax.tree.map(
      lambda x, meta: x.astype(jnp.float32 if meta.group in axes.FLOAT32_GROUPS else dtype),
      tree, param_meta[group]), states, {}
