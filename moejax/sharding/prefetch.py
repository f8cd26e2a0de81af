"""Scan over layers with just-in-time parameter gathers, optionally prefetched one layer ahead.

`scan_layers(layer_fn, h, shards_L, gather, states_L, consts, remat=..., prefetch=...)` runs
`h, aux = layer_fn(h, full_params, consts, i)` for each layer i, where
`full_params, new_state, stats = gather(layer_shards, layer_state)` is the sharding hook
(`state` is the compressed gather's per-layer state, or None for the plain gather).
`consts` carries traced values the layer needs (e.g. the step): pass them here, never by
closure, since a custom_vjp may not close over tracers. They get no gradient.
Returns (h, aux_L, new_states_L, stats_L), everything but h stacked over layers.

prefetch=False   `lax.scan(jax.checkpoint(body))`: each iteration gathers its own layer, then
                 computes. Under remat the gather is recomputed in backward from the same state.
prefetch=True    the gather of layer i+1 is issued in iteration i, *before* layer i's compute,
                 so the collective has a whole layer of compute to hide behind. The prefetched
                 weights travel in the scan carry but are never saved for backward: each layer
                 is wrapped in a `custom_vjp` whose residuals are the layer's input, its shards
                 and its gather state; backward re-gathers through the same hook (whose VJP
                 reduce-scatters the weight gradient exactly as without prefetch) and recomputes
                 the layer. The prefetched copy gets no gradient (`stop_gradient`).
Both give bit-identical results (tests/sharding/test_prefetch.py).

`remat` (REMAT_MODES) says what a layer keeps for its backward: "full" only its input (and its
shards), recomputing the rest; "minimal" also its matmul outputs
(`jax.checkpoint_policies.dots_saveable`); "none" everything. With prefetch, minimal and none
also keep the layer's gathered weights until its backward (the saved matmuls need them).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

REMAT_MODES = ("full", "minimal", "none")


def recomputes(remat: str) -> bool:
  """Whether backward runs the layer's forward again (and so its gathers)."""
  return remat != "none"


def checkpointed(fn, remat: str):
  """`fn` wrapped for `remat` (REMAT_MODES)."""
  if remat == "full":
    return jax.checkpoint(fn)
  if remat == "minimal":
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_saveable)
  if remat == "none":
    return fn
  raise ValueError(f"remat must be one of {REMAT_MODES}, got {remat!r}")


def _take(tree, i):
  return jax.tree.map(lambda x: x[i], tree)


def _prefetched_layer(layer_fn, gather, remat: str):
  """layer(h, full, shards, state, consts) -> layer_fn(h, full, consts), with the VJP above
  (`consts` here includes the layer index)."""

  def regather(shards, state):
    return gather(shards, state)[0]

  @jax.custom_vjp
  def layer(h, full, shards, state, consts):
    return layer_fn(h, full, consts)

  def fwd(h, full, shards, state, consts):
    if remat == "full":
      return layer_fn(h, full, consts), (h, shards, state, consts, None)
    # Otherwise keep what the policy saves of the layer's backward (and its weights).
    out, vjp = jax.vjp(checkpointed(lambda h, full: layer_fn(h, full, consts), remat), h, full)
    return out, (h, shards, state, consts, vjp)

  def bwd(res, g):
    h, shards, state, consts, saved_vjp = res
    full, gather_vjp = jax.vjp(lambda s: regather(s, state), shards)
    if saved_vjp is None:
      saved_vjp = jax.vjp(lambda h, full: layer_fn(h, full, consts), h, full)[1]
    dh, dfull = saved_vjp(g)
    (dshards,) = gather_vjp(dfull)
    zeros = lambda t: jax.tree.map(jnp.zeros_like, t)   # noqa: E731
    return dh, zeros(full), dshards, zeros(state), jax.tree.map(lambda _: None, consts)

  layer.defvjp(fwd, bwd)
  return layer


def scan_layers(layer_fn, h, shards_L, gather, states_L=None, consts=(), *, remat: str = "full",
                prefetch: bool = False):
  num_layers = jax.tree.leaves(shards_L)[0].shape[0]
  index_L = jnp.arange(num_layers, dtype=jnp.int32)
  if not prefetch:
    def body(h, xs):
      layer_shards, layer_state, i = xs
      full, new_state, stats = gather(layer_shards, layer_state)
      h, aux = layer_fn(h, full, consts, i)
      return h, (aux, new_state, stats)

    body = checkpointed(body, remat)
    h, (aux_L, new_states_L, stats_L) = lax.scan(body, h, (shards_L, states_L, index_L))
    return h, aux_L, new_states_L, stats_L

  layer = _prefetched_layer(lambda h, full, c: layer_fn(h, full, *c), gather, remat)
  full_0, new_state_0, stats_0 = gather(_take(shards_L, 0), _take(states_L, 0))
  full_0 = lax.stop_gradient(full_0)

  def body(carry, xs):
    h, full = carry
    i, layer_shards, layer_state = xs
    # The next layer's shards are read in place (a rolled copy as scan input would copy every
    # layer's shards each step, and its zero cotangent would be materialized in backward).
    nxt = jnp.minimum(i + 1, num_layers - 1)
    next_shards, next_state = _take(lax.stop_gradient(shards_L), nxt), _take(states_L, nxt)

    def prefetch_next(args):
      full_next, state_next, stats_next = gather(*args)
      return lax.stop_gradient(full_next), state_next, stats_next

    def nothing(args):   # the last layer has nothing to prefetch; this output is discarded
      shapes = jax.eval_shape(prefetch_next, args)
      return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    # Issue the next layer's gather first, then compute this layer.
    full_next, state_next, stats_next = lax.cond(i + 1 < num_layers, prefetch_next, nothing,
                                                 (next_shards, next_state))
    h, aux = layer(h, full, layer_shards, layer_state, (consts, i))
    return (h, full_next), (aux, state_next, stats_next)

  xs = (index_L, shards_L, states_L)
  (h, _), (aux_L, next_states_L, next_stats_L) = lax.scan(body, (h, full_0), xs)
  # Iteration i produced layer i+1's gather: shift back and put layer 0's in front.
  unshift = lambda first, rest: jax.tree.map(          # noqa: E731
      lambda a, b: jnp.concatenate([a[None], b[:-1]], axis=0), first, rest)
  return h, aux_L, unshift(new_state_0, next_states_L), unshift(stats_0, next_stats_L)
