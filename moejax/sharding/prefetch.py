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
prefetch=True    (more than one layer) the gather of layer i+1 is issued in iteration i,
                 *before* layer i's compute and with no condition around it (a collective in a
                 conditional's branch starts and finishes there, so nothing could overlap it).
                 The scan runs layers 0..L-2; layer L-1 runs after it on the weights its last
                 iteration gathered (inside the scan that iteration would gather layer L-1
                 again: one more gather, encode and decode a step, a quarter of the codec delta
                 step at the peer dims of bench/step.py). The whole scan has its own VJP
                 (`_prefetched_scan`): under remat full the forward keeps each layer's input,
                 and the backward scan gathers layer i-1 before layer i's recomputation and
                 backward (starting from the forward's last gather; its own last iteration
                 gathers layer 0 again; `gather(shards, states, new_states)` rebuilds from the
                 new states the forward's gather left what it can: the codec's word and delta
                 parameters from their caches with no collective, element and block ones from
                 their cached exponents and one all-gather of sign+mantissa), then
                 reduce-scatters layer i's weight gradient through
                 the gather's VJP (which needs no residual, so no gather runs for it). The
                 prefetched weights travel in the carries, never saved for backward.
                 `hook.run_gathers` counts the gathers.
Both give bit-identical results (tests/sharding/test_prefetch.py).

`remat` (REMAT_MODES) says what a layer keeps for its backward: "full" only its input (and its
shards) and what it marks `kept_for_backward` (fssdp's plans), recomputing the rest; "minimal"
also its matmul outputs (`jax.checkpoint_policies.dots_saveable`); "none" everything. With
prefetch, minimal and none also keep the layer's gathered weights until its backward (the saved
matmuls need them), so backward gathers nothing.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

REMAT_MODES = ("full", "minimal", "none")


KEPT_NAME = "kept_for_backward"     # the `checkpoint_name` of what `kept_for_backward` keeps
_KEEPING: list[tuple[str, dict]] = []     # ("record" | "replay", values), while a layer traces


@contextlib.contextmanager
def _keeping(mode: str, values: dict | None = None):
  values = {} if values is None else values
  _KEEPING.append((mode, values))
  try:
    yield values
  finally:
    _KEEPING.pop()


def kept_for_backward(name: str, compute):
  """`compute()`, run once per layer and step: the backward, which recomputes the layer, does
  not compute it again. A layer of the prefetched scan under remat "full" records the value in
  the forward (beside the layer's input) and its backward replays it; a layer under
  `jax.checkpoint` (remat "minimal", or no prefetch) keeps it by `checkpointed`'s policy (it is
  named `KEPT_NAME`). For values cheap to keep and costly to recompute (fssdp's plans:
  sequential rounds of small ops, a few int32 [N, M] / [E, N] arrays); `name` is unique within a
  layer; the value carries no gradient (a plan, not a parameter's function)."""
  if _KEEPING and _KEEPING[-1][0] == "replay":
    return _KEEPING[-1][1][name]
  # Named for `checkpointed`'s policies too: a `jax.checkpoint`ed layer keeps it as well.
  value = jax.tree.map(lambda x: checkpoint_name(lax.stop_gradient(x), KEPT_NAME), compute())
  if _KEEPING:
    values = _KEEPING[-1][1]
    if name in values:
      raise ValueError(f"kept_for_backward: {name!r} kept twice in one layer")
    values[name] = value
  return value


def recomputes(remat: str) -> bool:
  """Whether backward runs the layer's forward again (and so its gathers)."""
  return remat != "none"


def checkpointed(fn, remat: str):
  """`fn` wrapped for `remat` (REMAT_MODES); either recomputing mode keeps what the layer marks
  `kept_for_backward`."""
  kept = jax.checkpoint_policies.save_only_these_names(KEPT_NAME)
  if remat == "full":
    return jax.checkpoint(fn, policy=kept)
  if remat == "minimal":
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_saveable, kept))
  if remat == "none":
    return fn
  raise ValueError(f"remat must be one of {REMAT_MODES}, got {remat!r}")


def _take(tree, i):
  return jax.tree.map(lambda x: x[i], tree)


def _float0_split(tree):
  """(leaves that are not float0, a function rebuilding the tree from them with float0 zeros
  of the leaves' shapes, minus a leading axis, in place of the others)."""
  leaves, treedef = jax.tree.flatten(tree)
  is_zero = [leaf.dtype == jax.dtypes.float0 for leaf in leaves]
  shapes = [leaf.shape[1:] for leaf in leaves]

  def rebuild(kept):
    kept = iter(kept)
    return treedef.unflatten([np.zeros(s, jax.dtypes.float0) if z else next(kept)
                              for z, s in zip(is_zero, shapes)])

  return [leaf for leaf, z in zip(leaves, is_zero) if not z], rebuild


def _prefetched_scan(layer_fn, gather, remat: str, num_layers: int):
  """run(h, shards_L, states_L, consts) -> (h, aux_L, new_states_L, stats_L), with its own VJP:
  both passes issue the next layer's gather before the current layer's compute, with no
  condition around it (the forward's last layer runs after its scan, on the weights the scan
  gathered last, which backward's first layer uses; backward's last iteration gathers layer 0
  again, its one wasted gather per step: peeled out the same way, the step measured slower on
  fake CPU devices, README)."""
  index_L = jnp.arange(num_layers, dtype=jnp.int32)

  def regather(shards_L, states_L, new_states_L, i):
    """Layer i's weights again; the codec's parameters rebuilt from the caches the forward's
    gather left (`rebuild_from`: word / delta with no collective, element / block from their
    cached exponents and an all-gather of sign+mantissa)."""
    if not jax.tree.leaves(new_states_L):
      return gather(_take(shards_L, i), _take(states_L, i))[0]
    return gather(_take(shards_L, i), _take(states_L, i), _take(new_states_L, i))[0]

  def forward(h, shards_L, states_L, consts, keep: str):
    """keep: "none" (no backward), "inputs" (each layer's input) or "vjp" (each layer's
    backward residuals under the remat policy, its weights among them)."""
    full_0, state_0, stats_0 = gather(_take(shards_L, 0), _take(states_L, 0))
    vjp_def = []

    def compute(h, full, i):
      fn = lambda h, full: layer_fn(h, full, consts, i)   # noqa: E731
      if keep == "vjp":
        (h_out, aux), vjp = jax.vjp(checkpointed(fn, remat), h, full)
        leaves, treedef = jax.tree.flatten(vjp)
        vjp_def[:] = [treedef]
        return h_out, aux, leaves
      if keep != "inputs":
        return (*fn(h, full), None)
      with _keeping("record") as kept:
        h_out, aux = fn(h, full)
      return h_out, aux, (h, kept)

    def body(carry, i):
      h, full, _ = carry
      # Layer i+1's gather first (read in place: a rolled copy of the shards as scan input would
      # copy every layer's shards each step), then layer i's compute.
      full_next, state_next, stats_next = gather(*_take((shards_L, states_L), i + 1))
      h_out, aux, saved = compute(h, full, i)
      return (h_out, full_next, i + 1), (aux, state_next, stats_next, saved)

    # Layers 0..L-2 in the scan, each under the next one's gather; the last layer after it, on
    # the weights its last iteration gathered (in the scan it would gather layer L-1 again). Its
    # index comes out of the loop, traced like the body's, so its residuals have their pytree.
    (h, full_last, i_last), (aux_s, states_next_L, stats_next_L, saved_s) = lax.scan(
        body, (h, full_0, index_L[0]), index_L[:-1])
    h, aux_last, saved_last = compute(h, full_last, i_last)
    append = lambda rest, last: jax.tree.map(                # noqa: E731
        lambda a, b: jnp.concatenate([a, b[None]], axis=0), rest, last)
    prepend = lambda first, rest: jax.tree.map(              # noqa: E731
        lambda a, b: jnp.concatenate([a[None], b], axis=0), first, rest)
    saved_L = append(saved_s, saved_last)
    if keep == "vjp":   # the layers' stacked residuals as one pytree (a VJP of [L, ...] leaves)
      saved_L = vjp_def[0].unflatten(saved_L)
    out = (h, append(aux_s, aux_last), prepend(state_0, states_next_L),
           prepend(stats_0, stats_next_L))
    return out, (saved_L, full_last)

  @jax.custom_vjp
  def run(h, shards_L, states_L, consts):
    return forward(h, shards_L, states_L, consts, "none")[0]

  def run_fwd(h, shards_L, states_L, consts):
    keep = "inputs" if remat == "full" else "vjp"
    out, (saved_L, full_last) = forward(h, shards_L, states_L, consts, keep)
    # The gathers' new states (outputs of the step anyway) let backward rebuild what it can.
    new_states_L = out[2] if keep == "inputs" else None
    return out, (saved_L, full_last if keep == "inputs" else None, shards_L, states_L,
                 new_states_L, consts)

  def run_bwd(res, cotangents):
    saved_L, full_last, shards_L, states_L, new_states_L, consts = res
    saved_leaves_L, saved_def = jax.tree.flatten(saved_L)
    dh, daux_L = cotangents[0], cotangents[1]
    daux_kept_L, daux_of = _float0_split(daux_L)

    def scatter(i, dfull):
      """The gather's transpose (the weight gradient's reduce-scatter; it needs no residual)."""
      state = _take(states_L, i)
      return jax.vjp(lambda s: gather(s, state)[0], _take(shards_L, i))[1](dfull)[0]

    def body(carry, xs):
      i, saved, daux_kept = xs
      saved = saved_def.unflatten(saved)      # layer i's input, or its backward residuals
      dh, full = carry
      if full_last is not None:   # remat full: recompute the layer from its input
        # Layer i-1's gather first, then layer i's backward.
        full_prev = regather(shards_L, states_L, new_states_L, jnp.maximum(i - 1, 0))
        h_in, kept = saved
        with _keeping("replay", kept):
          vjp = jax.vjp(lambda h, full: layer_fn(h, full, consts, i), h_in, full)[1]
      else:
        full_prev, vjp = full, saved
      dh, dfull = vjp((dh, daux_of(daux_kept)))
      return (dh, full_prev), scatter(i, dfull)

    carry = (dh, full_last if full_last is not None else jnp.zeros((), jnp.float32))
    (dh, _), dshards_L = lax.scan(body, carry, (index_L, saved_leaves_L, daux_kept_L),
                               reverse=True)
    nothing = lambda t: jax.tree.map(lambda _: None, t)   # noqa: E731
    return dh, dshards_L, nothing(states_L), nothing(consts)

  run.defvjp(run_fwd, run_bwd)
  return run


def scan_layers(layer_fn, h, shards_L, gather, states_L=None, consts=(), *, remat: str = "full",
                prefetch: bool = False):
  num_layers = jax.tree.leaves(shards_L)[0].shape[0]
  index_L = jnp.arange(num_layers, dtype=jnp.int32)
  if not prefetch or num_layers == 1:   # one layer: no next layer to gather under its compute
    def body(h, xs):
      layer_shards, layer_state, i = xs
      full, new_state, stats = gather(layer_shards, layer_state)
      h, aux = layer_fn(h, full, consts, i)
      return h, (aux, new_state, stats)

    body = checkpointed(body, remat)
    h, (aux_L, new_states_L, stats_L) = lax.scan(body, h, (shards_L, states_L, index_L))
    return h, aux_L, new_states_L, stats_L

  return _prefetched_scan(layer_fn, gather, remat, num_layers)(h, shards_L, states_L, consts)
