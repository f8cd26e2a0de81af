"""Scan over layers with just-in-time parameter gathers, optionally prefetched one layer ahead.

`scan_layers(layer_fn, h, shards_L, gather, states_L, consts, remat=..., prefetch=...)` runs
`h, aux = layer_fn(h, full_params, consts, i)` for each layer i, where
`full_params, new_state, stats = gather(layer_shards, layer_state)` is the sharding hook
(`state` is the compressed gather's per-layer state, or None for the plain gather).
`consts` carries traced values the layer needs (e.g. the step): pass them here, never by
closure, since a custom_vjp may not close over tracers. They get no gradient.
Returns (h, aux_L, new_states_L, stats_L), everything but h stacked over layers.
`scan_period` is the same over a period of different layers repeated (`Sublayer`s, each its own
function, hook and stacked weights: gpt-oss's [sliding, full] x 18 is one scan, its pair traced
once); `scan_layers` is its period of one layer.

prefetch=False   `lax.scan` of each layer under `jax.checkpoint`: each layer gathers its own
                 weights, then computes. Under remat the gather is recomputed in backward from
                 the same state.
prefetch=True    (more than one layer) the gather of the next layer (across a period's end too)
                 is issued *before* the current layer's compute and with no condition around it
                 (a collective in a conditional's branch starts and finishes there, so nothing
                 could overlap it).
                 The scan runs periods 0..R-2; period R-1 runs after it, its first layer on the
                 weights the scan's last iteration gathered (inside the scan its last layer would
                 gather a period that does not exist: one more gather, encode and decode a step,
                 a quarter of the codec delta step at the peer dims of bench/step.py). The whole
                 scan has its own VJP
                 (`_prefetched_period`): under remat full the forward keeps each layer's input,
                 and the backward scan gathers the layer before each layer's
                 recomputation and backward (starting from the forward's last gather; its own
                 last iteration gathers period 0's last layer again; `gather(shards, states,
                 new_states)` rebuilds from the
                 new states the forward's gather left what it can: the codec's word and delta
                 parameters from their caches with no collective, element and block ones from
                 their cached exponents and one all-gather of sign+mantissa), then
                 reduce-scatters the layer's weight gradient through
                 the gather's VJP (which needs no residual, so no gather runs for it): on GPU
                 and TPU under the next layer's backward, on XLA:CPU at once
                 (`scatter_ahead`). The
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
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

REMAT_MODES = ("full", "minimal", "none")
# `scatter_ahead`: where the prefetched backward reduce-scatters a layer's weight gradient:
# "always" while the next layer processed (the one before it) runs its backward, so the
# collective can overlap that layer's matmuls; "never" at the end of its own backward (nothing
# left to overlap); "auto" ahead on GPU and TPU, in place on XLA:CPU, whose collectives never
# overlap compute (ahead measured 1.08x / 1.04x the fsdp step there, tiny / peer dims against
# the floor in one run: one more reduce-scatter a step, bench/step.py).
SCATTER_AHEAD_MODES = ("auto", "always", "never")


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


class Sublayer(NamedTuple):
  """One layer of a scanned period (`scan_period`): `fn(h, full, consts, r) -> (h, aux)` runs it
  in period r on its gathered weights; `gather(shards, state[, rebuild_from]) -> (full,
  new_state, stats)` is its hook; its weights are entry `source` of the scan's stacked shards
  and states, at row r * n + `offset` (n: the period's layers of that source)."""
  fn: Callable
  gather: Callable
  source: int = 0
  offset: int = 0


def _period_layout(sublayers) -> list[int]:
  """Each source's layers a period (its sublayers' offsets must be 0..n-1)."""
  sources = sorted({sl.source for sl in sublayers})
  if sources != list(range(len(sources))):
    raise ValueError(f"scan_period: sources must be 0..{len(sources) - 1}, got {sources}")
  per_source = []
  for s in sources:
    offsets = sorted(sl.offset for sl in sublayers if sl.source == s)
    if offsets != list(range(len(offsets))):
      raise ValueError(f"scan_period: source {s}'s offsets must be 0..{len(offsets) - 1}, "
                       f"got {offsets}")
    per_source.append(len(offsets))
  return per_source


def interleave_rows(trees):
  """The [R, ...] outputs of a period's n layers, in their order -> one [R * n, ...] tree, row
  r * n + i from layer i of period r."""
  if len(trees) == 1:
    return trees[0]
  return jax.tree.map(lambda *xs: jnp.stack(xs, axis=1).reshape(
      (xs[0].shape[0] * len(xs),) + xs[0].shape[1:]), *trees)


def _interleave(sublayers, per_source, trees_P):
  """Per source, its sublayers' [R, ...] outputs back in the source's row order [R * n, ...]."""
  return tuple(interleave_rows([trees_P[j] for _, j in sorted(
      (sl.offset, j) for j, sl in enumerate(sublayers) if sl.source == s)])
      for s in range(len(per_source)))


def _prefetched_period(sublayers, per_source, remat: str, repeats: int,
                       scatter_ahead: str = "auto"):
  """run(h, shards_S, states_S, consts) -> (h, aux_P, new_states_P, stats_P) (per sublayer,
  stacked over the R periods), with its own VJP: both passes issue the next layer's gather
  before the current layer's compute, with no condition around it. The scan runs periods
  0..R-2; period R-1 runs after it (its last layer would gather the next period's first layer,
  which does not exist), on the weights the scan gathered last; backward starts from its last
  layer's weights, and its last iteration gathers the period's last layer of period 0 again: the
  one wasted gather a step (peeled out too, the step measured slower on fake CPU devices,
  README)."""
  num = len(sublayers)
  index_R = jnp.arange(repeats, dtype=jnp.int32)

  def take(j, r, tree_S):
    sl = sublayers[j]
    return _take(tree_S[sl.source], r * per_source[sl.source] + sl.offset)

  def gather(j, r, shards_S, states_S):
    return sublayers[j].gather(take(j, r, shards_S), take(j, r, states_S))

  def regather(j, r, shards_S, states_S, new_states_P):
    """Layer j of period r's weights again; the codec's parameters rebuilt from the caches the
    forward's gather left (`rebuild_from`: word / delta with no collective, element / block from
    their cached exponents and an all-gather of sign+mantissa)."""
    if not jax.tree.leaves(new_states_P):
      return gather(j, r, shards_S, states_S)[0]
    return sublayers[j].gather(take(j, r, shards_S), take(j, r, states_S),
                               _take(new_states_P[j], r))[0]

  def forward(h, shards_S, states_S, consts, keep: str):
    """keep: "none" (no backward), "inputs" (each layer's input) or "vjp" (each layer's
    backward residuals under the remat policy, its weights among them)."""
    full_0, state_0, stats_0 = gather(0, 0, shards_S, states_S)
    vjp_defs = [None] * num

    def compute(j, h, full, r):
      fn = lambda h, full: sublayers[j].fn(h, full, consts, r)   # noqa: E731
      if keep == "vjp":
        (h_out, aux), vjp = jax.vjp(checkpointed(fn, remat), h, full)
        leaves, vjp_defs[j] = jax.tree.flatten(vjp)
        return h_out, aux, leaves
      if keep != "inputs":
        return (*fn(h, full), None)
      with _keeping("record") as kept:
        h_out, aux = fn(h, full)
      return h_out, aux, (h, kept)

    def period(h, full, r, last: bool):
      """Period r from its first layer's weights -> (h, the weights gathered last: the next
      period's first layer's, or this one's last layer's if `last`; per layer (aux, saved); the
      (state, stats) of each gather: layers 1.. of this period, then the next period's first)."""
      outs, gathered = [], []
      for j in range(num):
        # The next layer's gather first (read in place: a rolled copy of the shards as scan
        # input would copy every layer's shards each step), then this layer's compute.
        nxt = (gather(j + 1, r, shards_S, states_S) if j + 1 < num else
               None if last else gather(0, r + 1, shards_S, states_S))
        h, aux, saved = compute(j, h, full, r)
        outs.append((aux, saved))
        if nxt is not None:
          full = nxt[0]
          gathered.append(nxt[1:])
      return h, full, outs, gathered

    def body(carry, r):
      h, full, _ = carry
      h, full_next, outs, gathered = period(h, full, r, last=False)
      return (h, full_next, r + 1), (outs, gathered)

    # Periods 0..R-2 in the scan, period R-1 after it. Its index comes out of the loop, traced
    # like the body's, so its layers' residuals have the body's pytrees.
    carry = (h, full_0, index_R[0])
    outs_s = gathered_s = [None] * num       # nothing scanned: one period
    if repeats > 1:
      carry, (outs_s, gathered_s) = lax.scan(body, carry, index_R[:-1])
    h, full_last, outs_last, gathered_last = period(*carry, last=True)

    def append(rest, last):       # the scan's [R-1, ...] and the last period's -> [R, ...]
      if repeats == 1:
        return jax.tree.map(lambda b: b[None], last)
      return jax.tree.map(lambda a, b: jnp.concatenate([a, b[None]], axis=0), rest, last)

    def prepend(first, rest):     # the first gather's and the scan's -> [R, ...]
      if repeats == 1:
        return jax.tree.map(lambda a: a[None], first)
      return jax.tree.map(lambda a, b: jnp.concatenate([a[None], b], axis=0), first, rest)

    aux_P, saved_P, states_P, stats_P = [], [], [], []
    for j in range(num):
      rest = outs_s[j] if repeats > 1 else (None, None)
      aux, saved = append(rest[0], outs_last[j][0]), append(rest[1], outs_last[j][1])
      if keep == "vjp":   # the layer's stacked residuals as one pytree (a VJP of [R, ...] leaves)
        saved = vjp_defs[j].unflatten(saved)
      if j == 0:          # gathered first, then by the previous period's last layer
        state, stats = prepend((state_0, stats_0), gathered_s[num - 1])
      else:
        state, stats = append(gathered_s[j - 1], gathered_last[j - 1])
      aux_P.append(aux)
      saved_P.append(saved)
      states_P.append(state)
      stats_P.append(stats)
    out = (h, tuple(aux_P), tuple(states_P), tuple(stats_P))
    return out, (tuple(saved_P), full_last)

  @jax.custom_vjp
  def run(h, shards_S, states_S, consts):
    return forward(h, shards_S, states_S, consts, "none")[0]

  def run_fwd(h, shards_S, states_S, consts):
    keep = "inputs" if remat == "full" else "vjp"
    out, (saved_P, full_last) = forward(h, shards_S, states_S, consts, keep)
    # The gathers' new states (outputs of the step anyway) let backward rebuild what it can.
    new_states_P = out[2] if keep == "inputs" else None
    return out, (saved_P, full_last if keep == "inputs" else None, shards_S, states_S,
                 new_states_P, consts)

  def run_bwd(res, cotangents):
    saved_P, full_last, shards_S, states_S, new_states_P, consts = res
    saved_split = [jax.tree.flatten(saved) for saved in saved_P]
    dh, daux_P = cotangents[0], cotangents[1]
    daux_split = [_float0_split(daux) for daux in daux_P]

    def scatter(j, r, dfull):
      """The gather's transpose (the weight gradient's reduce-scatter; it needs no residual)."""
      state = take(j, r, states_S)
      return jax.vjp(lambda s: sublayers[j].gather(s, state)[0], take(j, r, shards_S))[1](dfull)[0]

    def period_bwd(dh, full, pending, xs, ahead: bool):
      """Period r's layers backward, last first -> (dh, the weights of the layer before, the
      period's reduce-scattered weight gradients, the gradient left pending). `ahead`: each
      layer's gradient is reduce-scattered while the layer processed next (the one before it)
      runs its backward, its operand ready when that layer starts (`pending`: period r + 1's
      first layer's, scattered under this period's last; its slot in the output); else at the
      end of its own backward, waiting on all of it."""
      r, saved_leaves_P, daux_kept_P = xs
      dshards_P = [None] * num
      for j in reversed(range(num)):
        saved = saved_split[j][1].unflatten(saved_leaves_P[j])  # its input, or its residuals
        if full_last is not None:   # remat full: recompute the layer from its input
          # The previous layer's gather first, then this layer's backward.
          full_prev = (regather(j - 1, r, shards_S, states_S, new_states_P) if j > 0 else
                       regather(num - 1, jnp.maximum(r - 1, 0), shards_S, states_S,
                                new_states_P))
          h_in, kept = saved
          with _keeping("replay", kept):
            vjp = jax.vjp(lambda h, full, j=j: sublayers[j].fn(h, full, consts, r),
                          h_in, full)[1]
        else:
          full_prev, vjp = full, saved
        if ahead:
          # (period R's, for the first period processed: zeros, row R - 1's state)
          dshards_P[(j + 1) % num] = scatter((j + 1) % num,
                                             jnp.minimum(r + (j + 1) // num, repeats - 1),
                                             pending)
        dh, dfull = vjp((dh, daux_split[j][1](daux_kept_P[j])))
        if ahead:
          pending = dfull
        else:
          dshards_P[j] = scatter(j, r, dfull)
        full = full_prev
      return dh, full, tuple(dshards_P), pending

    xs = (index_R, tuple(leaves for leaves, _ in saved_split),
          tuple(kept for kept, _ in daux_split))
    full = full_last if full_last is not None else jnp.zeros((), jnp.float32)

    def backward(ahead: bool, dh):
      # Ahead, the first period processed (R - 1) scatters a pending gradient of zeros (the one
      # extra reduce-scatter a step; peeling that period out of the loop instead kept its
      # working set live beside the forward's: 1.47x XLA:CPU's temporaries at the tiny preset,
      # and on GPU at 1b7b with 4096 tokens fssdp's 122 -> 170 GB); period 0's first layer's
      # is scattered after the loop.
      pending = (jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(
          lambda: regather(0, 0, shards_S, states_S, new_states_P))) if ahead else None)

      def body(carry, xs):
        dh, full, pending = carry
        dh, full, dshards_P, pending = period_bwd(dh, full, pending, xs, ahead)
        return (dh, full, pending), dshards_P

      (dh, _, pending), dshards_P = lax.scan(body, (dh, full, pending), xs, reverse=True)
      if ahead:     # row r of layer 0's holds period r + 1's; row R - 1 the zeros'
        first = scatter(0, index_R[0], pending)
        dshards_P = (jax.tree.map(lambda a, b: jnp.concatenate([a[None], b[:-1]], axis=0),
                                  first, dshards_P[0]),) + tuple(dshards_P[1:])
      return dh, dshards_P

    if scatter_ahead == "auto":   # on XLA:CPU no collective overlaps compute: in place
      dh, dshards_P = lax.platform_dependent(dh, cpu=functools.partial(backward, False),
                                             default=functools.partial(backward, True))
    else:
      dh, dshards_P = backward(scatter_ahead == "always", dh)
    nothing = lambda t: jax.tree.map(lambda _: None, t)   # noqa: E731
    return dh, _interleave(sublayers, per_source, dshards_P), nothing(states_S), nothing(consts)

  run.defvjp(run_fwd, run_bwd)
  return run


def scan_period(sublayers, h, shards_S, states_S=None, consts=(), *, remat: str = "full",
                prefetch: bool = False, scatter_ahead: str = "auto"):
  """`scan_layers` over a period of different layers (`Sublayer`s: their own function, hook and
  stacked weights, e.g. gpt-oss's sliding and full attention layers) repeated R times: one scan,
  each iteration running the period's layers in order; the prefetch gathers each layer ahead of
  the one before it, across the periods' boundaries too. `shards_S` / `states_S`: per source,
  its layers stacked [R * n, ...] in model order. Returns (h, aux_P, new_states_S, stats_S):
  aux per sublayer [R, ...], states and stats per source [R * n, ...]."""
  sublayers = tuple(sublayers)
  per_source = _period_layout(sublayers)
  states_S = (None,) * len(per_source) if states_S is None else tuple(states_S)
  shards_S = tuple(shards_S)
  repeats = jax.tree.leaves(shards_S[0])[0].shape[0] // per_source[0]
  for s, (shards, n) in enumerate(zip(shards_S, per_source)):
    if jax.tree.leaves(shards)[0].shape[0] != repeats * n:
      raise ValueError(f"scan_period: source {s} stacks {jax.tree.leaves(shards)[0].shape[0]} "
                       f"layers, its {n} a period x {repeats} periods expected")
  if prefetch and repeats * len(sublayers) > 1:
    if scatter_ahead not in SCATTER_AHEAD_MODES:
      raise ValueError(f"scatter_ahead must be one of {SCATTER_AHEAD_MODES}, got "
                       f"{scatter_ahead!r}")
    h, aux_P, states_P, stats_P = _prefetched_period(sublayers, per_source, remat, repeats,
                                                     scatter_ahead)(h, shards_S, states_S,
                                                                    consts)
    return (h, aux_P, *(_interleave(sublayers, per_source, t) for t in (states_P, stats_P)))

  # One layer, or no prefetch: each layer gathers its own weights, then computes; under remat
  # the gather is recomputed in backward from the same state. Each layer is checkpointed apart
  # (one layer's activations live at a time in backward). The stacked weights enter as the
  # scan's input, [R, n, ...] per source (a free reshape).
  def layer(j):
    def run(h, shards, state, r):
      full, new_state, stats = sublayers[j].gather(shards, state)
      h, aux = sublayers[j].fn(h, full, consts, r)
      return h, (aux, new_state, stats)
    return checkpointed(run, remat)

  layers = [layer(j) for j in range(len(sublayers))]
  periods = lambda tree_S: tuple(jax.tree.map(   # noqa: E731
      lambda x, n=n: x.reshape((repeats, n) + x.shape[1:]), tree) for tree, n in
      zip(tree_S, per_source))

  def body(h, xs):
    shards_S, states_S, r = xs
    outs = []
    for j, sl in enumerate(sublayers):
      h, out = layers[j](h, _take(shards_S[sl.source], sl.offset),
                         _take(states_S[sl.source], sl.offset), r)
      outs.append(out)
    return h, tuple(outs)

  h, outs = lax.scan(body, h, (periods(shards_S), periods(states_S),
                               jnp.arange(repeats, dtype=jnp.int32)))
  aux_P = tuple(out[0] for out in outs)
  return (h, aux_P, *(_interleave(sublayers, per_source, tuple(out[k] for out in outs))
                      for k in (1, 2)))


def scan_layers(layer_fn, h, shards_L, gather, states_L=None, consts=(), *, remat: str = "full",
                prefetch: bool = False, scatter_ahead: str = "auto"):
  """`scan_period` of one layer: (h, aux_L, new_states_L, stats_L)."""
  h, (aux_L,), (states_L,), (stats_L,) = scan_period(
      [Sublayer(layer_fn, gather)], h, [shards_L], [states_L], consts, remat=remat,
      prefetch=prefetch, scatter_ahead=scatter_ahead)
  return h, aux_L, states_L, stats_L
