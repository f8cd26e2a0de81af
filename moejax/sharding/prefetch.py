"""Scan over layers with just-in-time parameter gathers, optionally prefetched one layer ahead.

`scan_layers(layer_fn, h, shards_L, gather, remat=..., prefetch=...)` runs
`h, aux = layer_fn(h, full_params)` for each layer, where `full_params = gather(layer_shards)`.

prefetch=False   `lax.scan(jax.checkpoint(body))`: each iteration gathers its own layer, then
                 computes. Under remat the gather is recomputed in backward.
prefetch=True    the gather of layer i+1 is issued in iteration i, *before* layer i's compute,
                 so the collective has a whole layer of compute to hide behind. The prefetched
                 weights travel in the scan carry but are never saved for backward: each layer
                 is wrapped in a `custom_vjp` whose residuals are the layer's input and its
                 *shards*; backward re-gathers from the shards (the same hook, so its VJP
                 reduce-scatters the weight gradient exactly as without prefetch) and recomputes
                 the layer. The prefetched copy gets no gradient (`stop_gradient`).
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
from jax import lax


def _prefetched_layer(layer_fn, gather, remat: bool):
  """layer(h, full, shards) -> layer_fn(h, full), with the VJP described above."""

  @jax.custom_vjp
  def layer(h, full, shards):
    return layer_fn(h, full)

  def fwd(h, full, shards):
    if remat:
      return layer_fn(h, full), (h, shards, None)
    out, vjp = jax.vjp(layer_fn, h, full)    # keep the activations and weights it needs
    return out, (h, shards, vjp)

  def bwd(res, g):
    h, shards, saved_vjp = res
    full, gather_vjp = jax.vjp(gather, shards)
    if saved_vjp is None:
      _, layer_vjp = jax.vjp(layer_fn, h, full)
    else:
      layer_vjp = saved_vjp
    dh, dfull = layer_vjp(g)
    (dshards,) = gather_vjp(dfull)
    return dh, jax.tree.map(jnp.zeros_like, full), dshards

  layer.defvjp(fwd, bwd)
  return layer


def scan_layers(layer_fn, h, shards_L, gather, *, remat: bool = True, prefetch: bool = False):
  """Returns (h, aux_L): aux stacked over layers."""
  if not prefetch:
    def body(h, layer_shards):
      return layer_fn(h, gather(layer_shards))

    if remat:
      body = jax.checkpoint(body)
    return lax.scan(body, h, shards_L)

  num_layers = jax.tree.leaves(shards_L)[0].shape[0]
  layer = _prefetched_layer(layer_fn, gather, remat)
  take = lambda tree, i: jax.tree.map(lambda x: x[i], tree)   # noqa: E731
  full_0 = lax.stop_gradient(gather(take(shards_L, 0)))
  shards_next_L = jax.tree.map(lambda x: jnp.roll(x, -1, axis=0), shards_L)

  def body(carry, xs):
    h, full = carry
    i, layer_shards, next_shards = xs
    # Issue the next layer's gather first; the last layer has nothing to prefetch.
    full_next = lax.cond(i + 1 < num_layers,
                         lambda s: lax.stop_gradient(gather(s)),
                         lambda s: jax.tree.map(jnp.zeros_like, full), next_shards)
    h, aux = layer(h, full, layer_shards)
    return (h, full_next), aux

  (h, _), aux_L = lax.scan(body, (h, full_0), (jnp.arange(num_layers), shards_L, shards_next_L))
  return h, aux_L


