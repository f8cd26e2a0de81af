"""Run-time choice of the compressed gather: which parameters, in which mode, with what capacity.

A `CodecPolicy` drives `codec.mode=auto` and `codec.select=True` (a fixed mode, only where it
pays). Every sharded parameter is gathered plainly until the first decision, after
`codec.warmup_steps` steps. A decision

1. measures each parameter's change rates over the last `PROBE_STEPS` steps (`Probe`): the bf16
   bit patterns of every sharded parameter are compared with the previous step's (a transient
   copy, 2 bytes per local value, held only during those steps), counting per shard, as the codec
   sees it, values whose exponent changed (element mode's rate), blocks of `codec.block_size`
   with such a value (block mode's) and values with any bit changed (word mode's): the mean over
   devices, layers and steps, and the worst device's rate (a typical step, the worst layer),
   which sizes the capacity (`codec.capacity_margin` x worst, rounded up on a 2^(1/4) grid);
2. prices every option with `moejax.codec.select` (gain = Comm(plain) - Comm(compressed) -
   Comm(agreement) - encode and decode seconds, with Comm profiled on this mesh at start-up
   (`profile_comm`) and the codec's own work on one device (`profile_codec`), or bytes saved
   with `codec.comm_model='bytes'`) and picks under `codec.cache_budget_bytes` a mode per
   parameter (auto: plain, element, block or word; a fixed mode: that mode or plain);
3. logs one line per parameter (mode, capacity, rates, bytes against plain, gain, cache, why) and
   appends the decision to WORKDIR/codec_selection.json;
4. if the choice changed, returns it. The policy compiles and installs nothing: the Trainer owns
   the compiled steps, one per choice, memoized (`Trainer.compiled`), and the loop swaps to the
   new one (`Trainer.adopt`), with codec state for newly compressed parameters, warm, so that
   only their first gather is dense (it refills the caches). Parameters whose spec did not
   change keep their caches. Modes change only between steps.

With `codec.reselect_every > 0` decisions repeat every that many steps, on the rates of the steps
just before. Between decisions the train step's per-parameter figures (`Gatherer.codec_metrics`)
are summed on the device; they go into the next decision's log and JSON (bytes sent, fallbacks),
and a parameter that falls back in more than `FALLBACK_LIMIT` of its gathers brings the next
decision forward. The decision in force is part of every checkpoint (item "codec",
`CodecDecisionItem`), and a resumed run (`start` after a restore) reinstalls it;
WORKDIR/codec_selection.json keeps every decision for people to read.

In the training loop:

    policy = CodecPolicy(trainer.layout.gatherer, trainer.mesh, cfg.codec, workdir=workdir)
    compiled = trainer.compiled(trainer.layout.gatherer.specs)
    choice = policy.start(step, state.params)                      # before the first step
    for step in ...:
      if choice is not None:
        state, compiled = trainer.adopt(state, compiled, choice)
      state, metrics = compiled.train_step(state, batch)
      metrics, choice = policy.after_step(step, state.params, metrics)

`after_step` also takes the per-parameter array out of the metrics (it is not for
metrics.jsonl). With the codec off, or a fixed mode without `select`, it does nothing else.

Letters: W devices, R rows (one per parameter and layer), K per-parameter figures.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax.codec import bits, detect, gather as codec, rates as rates_lib, select, word
from moejax.config import CodecConfig
from moejax.sharding import hook
from moejax.sharding.gatherer import PARAM_METRIC, Gatherer
from moejax.sharding.mesh import DEVICES, num_devices
from moejax.train.metrics import log as default_log

PROBE_STEPS = 3           # consecutive step pairs measured before each decision
FALLBACK_LIMIT = 0.1      # share of a parameter's gathers that may fall back between decisions
CHECK_EVERY = 10          # steps between looks at the live fallback counts
FIXED_NOTE_LIMIT = 0.5    # share of a fixed mode's gathers falling back that is said (once)
SELECTION_FILE = "codec_selection.json"
RATE_KINDS = rates_lib.RATE_KINDS   # columns of the probe's counts
PROFILE_BYTES = (4 << 10, 64 << 10, 1 << 20)
# codec.* fields that price a decision: a checkpoint's choice made under other values is
# decided afresh on resume (it would otherwise stay for good with reselect_every=0).
PRICING_FIELDS = ("comm_model", "capacity_margin", "block_size", "delta_bits")
KEEP_RATIO = 1.5          # a capacity in use stays until the sized one is this much smaller


# ----------------------------------------------------------------------------------------------
# Measurements.


def best_seconds(f, *args, repeats: int) -> float:
  """Fastest of `repeats` timed calls of `f(*args)`, after one untimed call (the compile)."""
  jax.block_until_ready(f(*args))
  best = math.inf
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    best = min(best, time.perf_counter() - t0)
  return best


def profile_comm(mesh, sizes=PROFILE_BYTES, reps: int = 8, repeats: int = 5) -> select.CommModel:
  """Fit Comm(bytes) = alpha + beta * bytes of this mesh's all-gather over all devices: for each
  size (bytes each device contributes), `reps` dependent all-gathers in one jitted `shard_map`,
  timed `repeats` times (best), divided by `reps`."""
  n = num_devices(mesh)
  points = []
  for nbytes in sizes:
    words = max(1, nbytes // 4)

    def body(x):
      def one(_, x):
        full = lax.all_gather(x, DEVICES, tiled=True)
        return lax.dynamic_slice_in_dim(full, words, words) + jnp.uint32(1)
      return lax.fori_loop(0, reps, one, x)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(DEVICES), out_specs=P(DEVICES),
                              check_vma=False))
    x = jax.device_put(jnp.zeros((n * words,), jnp.uint32), NamedSharding(mesh, P(DEVICES)))
    points.append((4 * words, best_seconds(f, x, repeats=repeats) / reps))
  if jax.process_count() > 1:   # every process must take the same decisions: use process 0's
    points = multihost_utils.broadcast_one_to_all(np.asarray(points, np.float64))
  return select.CommModel.fit(np.asarray(points).tolist())


# Shard sizes (values) at which the codec's per-device work is timed (delta at its default
# code width stands for every width: they cost about the same).
PROFILE_VALUES = (1 << 14, 1 << 18)


def profile_codec(modes, axis_size: int, sizes=PROFILE_VALUES, repeats: int = 5) -> dict:
  """{mode: (alpha s, beta s per value)}: the codec's encode + decode time per gather on this
  process's first device (`codec.gather.codec_work`, at each mode's default capacity), fitted
  as alpha + beta * shard values. The gain (`select.evaluate`) subtracts it, as the all-gather
  profile prices the bytes."""
  out = {}
  for mode in modes:
    spec = codec.CodecSpec(mode, warmup_steps=0)
    points = []
    for n in sizes:
      state = codec.init_state((n,), hook.COMPUTE_DTYPE, axis_size, spec)
      shard = jnp.zeros((n,), hook.COMPUTE_DTYPE)
      f = jax.jit(functools.partial(codec.codec_work, axis_size=axis_size, spec=spec))
      points.append((n, best_seconds(f, shard, state, repeats=repeats)))
    model = select.CommModel.fit(points)
    out[mode] = (model.alpha, model.beta)
  if jax.process_count() > 1:   # every process must take the same decisions: use process 0's
    values = multihost_utils.broadcast_one_to_all(np.asarray(list(out.values()), np.float64))
    out = dict(zip(out, map(tuple, np.asarray(values).tolist())))
  return out


@dataclasses.dataclass(frozen=True)
class Rates:
  """Measured change rates of the candidate parameters (`Gatherer.candidates()` order):
  [P, K] mean and worst fractions of units (values, blocks, values, ...) changed per gather,
  columns `RATE_KINDS`."""
  names: tuple[tuple[str, str], ...]
  mean: np.ndarray
  peak: np.ndarray
  steps: int

  def of(self, group: str, path: str) -> tuple[np.ndarray, np.ndarray]:
    i = self.names.index((group, path))
    return self.mean[i], self.peak[i]


class Probe:
  """Per-shard change counts of every candidate parameter between two steps (see the module
  docstring). `snapshot(params)` keeps the bf16 bit patterns; `counts(snapshot, params)` gives
  int32 [W, R, K] per device (rows: parameters in candidate order, one per layer for layer
  parameters; columns `RATE_KINDS`);
  `add` accumulates sums and maxima on the device and `rates` turns them into `Rates`."""

  def __init__(self, gatherer: Gatherer, mesh, block_size: int):
    self.gatherer, self.mesh, self.block_size = gatherer, mesh, block_size
    self.names = tuple(gatherer.candidates())
    self.rows = [gatherer.copies(g) for g, _ in self.names]
    layout = bits.layout_of(hook.COMPUTE_DTYPE)
    specs = {}
    for g, p in self.names:
      ndim = len(_leaf(gatherer.param_meta, g, p).shape)
      specs.setdefault(g, {})[p] = gatherer.layout(g, p).spec(ndim)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                             is_leaf=lambda s: isinstance(s, P))

    def snapshot(params):
      return {g: {p: lax.bitcast_convert_type(_leaf(params, g, p).astype(hook.COMPUTE_DTYPE),
                                              layout.uint_dtype) for p in ps}
              for g, ps in specs.items()}

    def body(prev, now):
      out = []
      for g, p in self.names:
        rows = self.gatherer.copies(g)
        a = now[g][p].reshape(rows, -1)
        b = prev[g][p].reshape(rows, -1)
        out.append(jax.vmap(lambda x, y: rates_lib.change_counts(x, y, layout, block_size))(a, b))
      # Every device gets every device's counts: the host reads a replicated array, which a
      # process can do in a multi-process run (a sharded one it could only read in part).
      return lax.all_gather(jnp.concatenate(out, axis=0), DEVICES)

    compare = jax.shard_map(body, mesh=mesh, in_specs=(specs, specs), out_specs=P(),
                            check_vma=False)
    self._snapshot = jax.jit(snapshot, out_shardings=shardings)
    self._compare = jax.jit(compare)
    self._counts = jax.jit(lambda prev, params: compare(prev, snapshot(params)))
    self._add = jax.jit(lambda acc, c: (acc[0] + c, jnp.maximum(acc[1], c),
                                        acc[2] + c.max(axis=0)))

  def snapshot(self, params):
    return self._snapshot(params)

  def counts(self, snap, params):
    """Changes from a snapshot to the parameters: int32 [W, R, K]."""
    return self._counts(snap, params)

  def compare(self, snap_before, snap_after):
    """Changes between two snapshots: int32 [W, R, K]."""
    return self._compare(snap_before, snap_after)

  def add(self, acc, counts):
    """Running (sum, max, sum of the worst device) of `counts` over steps, on the device."""
    if acc is None:
      return counts, counts, counts.max(axis=0)
    return self._add(acc, counts)

  def units(self) -> np.ndarray:
    """[P, K] units per shard of each rate: values, except blocks for block mode's."""
    out = []
    for g, p in self.names:
      n = math.prod(self.gatherer.shard_shape(g, p))
      out.append([detect.num_blocks(n, self.block_size) if kind == "block" else n
                  for kind in RATE_KINDS])
    return np.asarray(out, np.float64)

  def rates(self, acc, steps: int) -> Rates:
    """Mean rates over devices, layers and steps; worst = the worst device's rate, averaged over
    steps, in the worst layer (what a static capacity shared by the devices and layers must
    hold on a typical step)."""
    total, _, worst = (np.asarray(jax.device_get(a), np.float64) for a in acc)
    w = total.shape[0]
    mean, peak, r = [], [], 0
    for rows, units in zip(self.rows, self.units()):
      mean.append(total[:, r:r + rows].sum(axis=(0, 1)) / (w * rows * steps * units))
      peak.append(worst[r:r + rows].max(axis=0) / (steps * units))
      r += rows
    return Rates(self.names, np.asarray(mean), np.asarray(peak), steps)

  def rates_of(self, counts: np.ndarray) -> Rates:
    """`rates` from host counts [S, W, R, K] of S steps."""
    return self.rates((counts.sum(axis=0), counts.max(axis=0), counts.max(axis=1).sum(axis=0)),
                      counts.shape[0])


def _leaf(tree, group: str, path: str):
  for p, x in jax.tree_util.tree_leaves_with_path(tree[group]):
    if jax.tree_util.keystr(p) == path:
      return x
  raise KeyError(f"{group}{path}")


# ----------------------------------------------------------------------------------------------
# Decisions.


def modes_of(codec_cfg: CodecConfig) -> tuple[str, ...]:
  return ("element", "block", "word", "delta") if codec_cfg.mode == "auto" else (codec_cfg.mode,)


def _bytes_a_step(sel: select.Selection, rebuilt_share: float, shard_shape, copies: int) -> float:
  """A selection's bytes per gather averaged over a step's gathers, the backward's rebuilt ones
  (`codec.rebuilt_gather_group`) at what they move."""
  if not sel.selected or not rebuilt_share:
    return float(sel.bytes_sent)
  rebuilt = copies * codec.wire_bytes(shard_shape, hook.COMPUTE_DTYPE, sel.spec)["rebuilt"]
  return float((1.0 - rebuilt_share) * sel.bytes_sent + rebuilt_share * rebuilt)


def choose(gatherer: Gatherer, rates: Rates, codec_cfg: CodecConfig, comm: select.CommModel,
           current: dict | None = None, codec_seconds: dict | None = None
           ) -> list[select.Selection]:
  """One Selection per candidate parameter (`rates.names` order). `current` ({group: {path:
  CodecSpec}}) keeps a parameter's capacity in its mode while the newly sized one is between
  1 / KEEP_RATIO of it and it (fewer recompiles for about the same traffic). `codec_seconds`
  (`profile_codec`) prices each mode's encode + decode per gather; None: free."""
  params, keep = [], {}
  for (g, p), mean, peak in zip(rates.names, rates.mean, rates.peak):
    name = f"{g}{p}"
    shard = gatherer.shard_shape(g, p)
    work = {mode: alpha + beta * math.prod(shard)
            for mode, (alpha, beta) in (codec_seconds or {}).items()}
    params.append(select.ParamStats(
        name, shard, hook.COMPUTE_DTYPE, decode_s=work or 0.0, q_element=float(mean[0]),
        q_block=float(mean[1]), q_word=float(mean[2]),
        q_delta={k: float(mean[RATE_KINDS.index(f"delta{k}")]) for k in word.DELTA_BITS},
        q_far=float(mean[RATE_KINDS.index("far")]),
        copies=gatherer.copies(g), rebuilt_share=gatherer.rebuilt_share.get(g, 0.0),
        peak=dict(zip(RATE_KINDS, map(float, peak)))))
    old = (current or {}).get(g, {}).get(p)
    if old is not None and old.capacity_fraction is not None:
      kind = RATE_KINDS.index(old.rate_kind)
      need = select.capacity_fraction(float(peak[kind]), codec_cfg.capacity_margin,
                                      quantize=True)
      if old.capacity_fraction / KEEP_RATIO <= need <= old.capacity_fraction:
        keep[(name, old.rate_kind)] = old.capacity_fraction
  return select.select(
      params, comm, axis_size=gatherer.num_devices,
      cache_budget_bytes=codec_cfg.cache_budget_bytes or None, block_size=codec_cfg.block_size,
      margin=codec_cfg.capacity_margin, allow_hash=codec_cfg.detect == "hash",
      warmup_steps=codec_cfg.warmup_steps, modes=modes_of(codec_cfg), quantize=True,
      capacities=keep)


def specs_of(names, selections) -> dict:
  """{group: {path: CodecSpec}} of the selected parameters."""
  out: dict = {}
  for (g, p), s in zip(names, selections):
    if s.selected:
      out.setdefault(g, {})[p] = s.spec
  return out


def specs_key(specs: dict):
  """A hashable key of a codec choice {group: {path: CodecSpec}} (mode 'off' entries dropped)."""
  return tuple(sorted((g, p, s) for g, ps in specs.items() for p, s in ps.items()
                      if s.mode != "off"))


def _spec_entry(group: str, path: str, spec: codec.CodecSpec) -> dict:
  return {"group": group, "path": path, **dataclasses.asdict(spec)}


def _spec_of(entry: dict) -> codec.CodecSpec:
  fields = {f.name for f in dataclasses.fields(codec.CodecSpec)}
  return codec.CodecSpec(**{k: v for k, v in entry.items() if k in fields})


# ----------------------------------------------------------------------------------------------
# The policy.


class CodecPolicy:
  """See the module docstring. `gatherer` is the run's Gatherer (its candidates and shapes; the
  choice it holds is where the policy starts)."""

  def __init__(self, gatherer: Gatherer, mesh, codec_cfg: CodecConfig, *,
               workdir: str | None = None, comm: select.CommModel | None = None,
               codec_seconds: dict | None = None, log=default_log):
    self.cfg, self.mesh = codec_cfg, mesh
    self.base = gatherer
    self.specs: dict = {g: dict(ps) for g, ps in gatherer.specs.items()}   # in force
    self.decided_at: int | None = None      # step of the decision in force (None: none yet)
    self.restored: dict | None = None       # the checkpoint's decision item, set by its restore
    self.workdir, self.log = workdir, log
    self.active = self.cfg.controlled and bool(gatherer.candidates())
    self.decisions: list[dict] = []
    self._next = None            # step after which the next decision is taken
    self._snap = self._acc = None
    self._probe_steps = 0
    self._live = self._live_prev = None
    self._live_steps = 0
    self._live_since = 0
    self.comm = comm
    self.codec_seconds = codec_seconds   # {mode: (alpha, beta per value)}; None: free
    # A fixed mode (no select): nothing is decided, but a parameter that keeps falling back is
    # said once (its patches save nothing; the metrics only sum fallbacks over parameters).
    self._watch = (not self.cfg.controlled and self.cfg.mode != "off"
                   and any(gatherer.specs.values()))
    if self.cfg.mode != "off" and not gatherer.candidates():
      log(f"codec: codec.mode={self.cfg.mode!r} has nothing to compress: no parameter is "
          f"gathered on this mesh of {gatherer.num_devices} device(s)")
    if not self.active:
      return
    if self.comm is None and self.cfg.comm_model == "profile":
      try:
        self.comm = profile_comm(mesh)
      except ValueError as e:
        self.log(f"codec: the all-gather profile of this mesh is unusable ({e}); pricing the "
                 "codec in bytes saved instead")
      else:   # priced in seconds: the codec's own work counts against its gain
        if self.codec_seconds is None:
          self.codec_seconds = profile_codec(modes_of(self.cfg), gatherer.num_devices)
        self.log("codec: encode + decode per gather of 1M values: " + ", ".join(
            f"{m} {1e3 * (a + b * (1 << 20)):.2f} ms" for m, (a, b) in
            self.codec_seconds.items()))
    if self.comm is None:
      self.comm = select.CommModel.bytes_only()
    self.probe = Probe(gatherer, mesh, self.cfg.block_size)

  @property
  def gatherer(self) -> Gatherer:
    """The Gatherer of the choice in force (whose rows the step's per-parameter figures hold)."""
    return self.base.with_specs(self.specs)

  @property
  def checkpoint_items(self) -> tuple:
    """The decision in force as a checkpoint item of its own (`CodecDecisionItem`); a fixed mode
    saves one too (no decision), so that a run resumed under another mode says what it leaves."""
    fixed = self.cfg.mode != "off" and bool(self.base.candidates())
    return (CodecDecisionItem(self),) if self.active or fixed else ()

  # -- the loop's two calls ----------------------------------------------------------------------
  def start(self, step: int, params) -> dict | None:
    """Call once before the first step, with the step and parameters the run starts from.
    Returns the choice to install now, or None (keep the run's own). A restored run reinstalls
    the decision its checkpoint holds."""
    if not self.active:
      item, self.restored = self.restored, None
      if item and item.get("step") is not None:   # an auto / select run's decision
        n = len(item["specs"])
        self.log(f"codec: the checkpoint's codec choice (step {int(item['step'])}, {n} "
                 f"parameter{'s' * (n != 1)} compressed) is set aside: codec.mode="
                 f"{self.cfg.mode!r} without codec.select compresses every parameter it gathers")
      return None
    self._live_since = step
    self._continue_log(step)       # a resumed run keeps the decisions logged up to its step
    schedule = (self.restored or {}).get("schedule")
    decided = (self.restored or {}).get("step") is not None
    last = self._restored_choice()
    if decided and last is None:
      schedule = None      # the schedule continued a decision this run does not take up
    if last is not None:
      specs, decided_at = last
      self.log(f"codec: step {step}: reinstalled the codec choice of step {decided_at} "
               f"({sum(len(v) for v in specs.values())} parameters compressed)")
      self.decided_at = decided_at
      next_step = decided_at + self.cfg.reselect_every if self.cfg.reselect_every else None
      choice = self._adopt(specs)
    else:
      next_step = max(self.cfg.warmup_steps, step + PROBE_STEPS)
      choice = self._adopt({}) if any(self.specs.values()) else None
    if schedule is None or not self._resume_schedule(schedule, step, params):
      self._schedule(next_step, step, params)
    return choice

  def after_step(self, step: int, params, metrics: dict) -> tuple[dict, dict | None]:
    """Call right after the train step that produced `step`, with its new parameters and
    metrics. Returns (metrics without the per-parameter array, a new choice to install from the
    next step on, or None)."""
    metrics = dict(metrics)
    figures = metrics.pop(PARAM_METRIC, None)
    if figures is not None and (self.active or self._watch):
      self._live_prev = self._live
      self._live = figures if self._live is None else self._live + figures
      self._live_steps += 1
      if self._live_steps % CHECK_EVERY == 0:
        (self._check_fallbacks if self.active else self._watch_fixed)(step)
    if not self.active:
      return metrics, None
    choice = None
    if self._next is not None:
      if self._snap is not None:
        self._acc = self.probe.add(self._acc, self.probe.counts(self._snap, params))
        self._probe_steps += 1
      self._snap = (self.probe.snapshot(params)
                    if self._next - PROBE_STEPS <= step < self._next else None)
      if step >= self._next:
        choice = self.decide(step, params)
    return metrics, choice

  # -- decisions -------------------------------------------------------------------------------
  def force(self, step: int, specs: dict, *, keep_deciding: bool = True) -> dict:
    """A given choice ({group: {path: CodecSpec}}) to install from the next step on; with
    `keep_deciding=False` it stays (no more decisions). Returns it, checked."""
    self.base.with_specs(specs)               # raises for a parameter the codec cannot gather
    self.decided_at = step
    if not keep_deciding:
      self._schedule(None, step)
    return self._adopt(specs)

  def decide(self, step: int, params) -> dict | None:
    """Decide now from the rates measured so far: the new choice, or None if it is unchanged."""
    if self._acc is None:
      raise RuntimeError("no change rates measured yet: a decision needs probed steps")
    rates = self.probe.rates(self._acc, self._probe_steps)
    current = self.gatherer.specs
    selections = choose(self.gatherer, rates, self.cfg, self.comm, current,
                        codec_seconds=self.codec_seconds)
    specs = specs_of(rates.names, selections)
    changed = specs_key(specs) != specs_key(current)
    record = self._record(step, rates, selections, changed)
    self.decisions.append(record)
    self._report(record)
    self.decided_at = step
    self._live = self._live_prev = None
    self._live_steps, self._live_since = 0, step
    self._schedule(step + self.cfg.reselect_every if self.cfg.reselect_every else None, step,
                   params)
    return self._adopt(specs) if changed else None

  def _adopt(self, specs: dict) -> dict:
    self.specs = {g: dict(ps) for g, ps in self.base.with_specs(specs).specs.items()}
    self._live = self._live_prev = None
    self._live_steps = 0
    return self.specs

  def _schedule(self, next_step, now: int, params=None):
    """Next decision after step `next_step` (None: no more), measured over the steps before it;
    `params` (those after step `now`) start the measurement at once if it is due."""
    self._next = None if next_step is None else max(next_step, now + 1)
    self._acc, self._snap, self._probe_steps = None, None, 0
    if self._next is not None and params is not None and self._next - PROBE_STEPS <= now:
      self._snap = self.probe.snapshot(params)

  def _check_fallbacks(self, step: int):
    """Looks at the live figures of the step before (already computed: no stall)."""
    if self._live_prev is None or (self._next is not None and self._next <= step + PROBE_STEPS):
      return
    live = np.asarray(jax.device_get(self._live_prev))
    steps = self._live_steps - 1
    fallback = live[:, hook.STAT_KEYS.index("fallback")]
    worst = int(np.argmax(fallback))
    if steps >= CHECK_EVERY - 1 and fallback[worst] > FALLBACK_LIMIT * steps:
      g, p, layer = self.gatherer.param_rows()[worst]
      self.log(f"codec: step {step}: {g}{p} (layer {layer}) fell back in "
               f"{int(fallback[worst])} of {steps} gathers: deciding again at step "
               f"{step + PROBE_STEPS}")
      self._schedule(step + PROBE_STEPS, step)

  def _watch_fixed(self, step: int):
    """A fixed mode's live figures (of the step before: no stall): once a parameter has fallen
    back in more than `FIXED_NOTE_LIMIT` of its gathers over `CHECK_EVERY` steps, one line names
    it and the remedies, then the watch ends."""
    if self._live_prev is None:
      return
    live = np.asarray(jax.device_get(self._live_prev))
    steps = self._live_steps - 1
    fallback = live[:, hook.STAT_KEYS.index("fallback")]
    over = fallback > FIXED_NOTE_LIMIT * steps
    if not over.any():
      self._live = self._live_prev = None                     # the next window starts afresh
      self._live_steps = 0
      return
    self._watch = False
    worst = int(np.argmax(fallback))
    g, p, layer = self.gatherer.param_rows()[worst]
    fraction = self.cfg.capacity_fraction
    self.log(f"codec: step {step}: {g}{p} (layer {layer}) fell back to a plain gather "
             f"{int(fallback[worst])} times in {steps} steps under codec.mode={self.cfg.mode!r} "
             f"({int(over.sum())} of {len(over)} parameter rows fell back in more than "
             f"{FIXED_NOTE_LIMIT:.0%} of their gathers, saving little): raise "
             f"codec.capacity_fraction (now {fraction or 'the mode default'}), or let "
             "codec.select=True size each capacity from measured rates and keep plain what "
             "does not pay; metrics.jsonl's codec_fallbacks counts them every step")

  # -- the checkpoint item -----------------------------------------------------------------------
  def saved_decision(self) -> dict:
    """The decision in force as JSON: its step and the spec of every compressed parameter, and
    where the next decision stands (`schedule`: its step, the change counts probed for it so
    far, the live figures behind the fallback check), so a resumed run decides when and as the
    uninterrupted one does."""
    plain = lambda a: None if a is None else np.asarray(jax.device_get(a)).tolist()  # noqa: E731
    if not self.active:     # a fixed mode: nothing decided, nothing scheduled
      return {"step": None, "mode": self.cfg.mode, "specs": [], "schedule": None}
    return {"step": self.decided_at,
            "priced_by": {f: getattr(self.cfg, f) for f in PRICING_FIELDS},
            "specs": [_spec_entry(g, p, s) for g, ps in self.specs.items()
                      for p, s in sorted(ps.items())],
            "schedule": {"next": self._next, "probe_steps": self._probe_steps,
                         "acc": None if self._acc is None else [plain(a) for a in self._acc],
                         "live": plain(self._live), "live_prev": plain(self._live_prev),
                         "live_steps": self._live_steps, "live_since": self._live_since}}

  def _resume_schedule(self, saved: dict, step: int, params):
    """Continues the saved schedule (`saved_decision`) from `step`, the step it was saved at:
    the same next decision, over the same probed counts, with the same live figures. False (and
    nothing changed) when its counts do not fit this run's parameters and mesh."""
    w, r, k = num_devices(self.mesh), sum(self.probe.rows), len(RATE_KINDS)
    # Replicated over the mesh, like the figures they continue (every process holds them all).
    put = lambda a, dtype: jax.device_put(np.asarray(a, dtype),   # noqa: E731
                                          NamedSharding(self.mesh, P()))
    acc = saved.get("acc")
    shapes = [(w, r, k), (w, r, k), (r, k)]
    if acc is not None and [np.shape(a) for a in acc] != shapes:
      self.log(f"codec: the checkpoint's probe counts have shapes {[np.shape(a) for a in acc]}, "
               f"this run's {shapes}: probing afresh for the next decision")
      return False
    live_shape = (len(self.gatherer.param_rows()), len(hook.STAT_KEYS))
    if any(saved.get(key) is not None and np.shape(saved[key]) != live_shape
           for key in ("live", "live_prev")):
      saved = {**saved, "live": None, "live_prev": None, "live_steps": 0}
    self._next = saved["next"]
    self._probe_steps = int(saved["probe_steps"])
    self._acc = None if acc is None else tuple(put(a, np.int32) for a in acc)
    self._snap = (self.probe.snapshot(params)
                  if self._next is not None and self._next - PROBE_STEPS <= step < self._next
                  else None)
    live = lambda key: None if saved.get(key) is None else put(saved[key], np.float32)  # noqa: E731
    self._live, self._live_prev = live("live"), live("live_prev")
    self._live_steps = int(saved.get("live_steps", 0))
    self._live_since = int(saved.get("live_since", step))
    return True

  def _restored_choice(self):
    """(specs, decision step) from the restored checkpoint item, if it fits these parameters."""
    item, self.restored = self.restored, None
    if not item or item.get("step") is None:
      return None
    priced = item.get("priced_by") or {}       # absent in checkpoints of older versions
    for field in PRICING_FIELDS:
      if field in priced and priced[field] != getattr(self.cfg, field):
        self.log(f"codec: the checkpoint's codec choice (step {int(item['step'])}) was made "
                 f"with codec.{field}={priced[field]!r}, this run's is "
                 f"{getattr(self.cfg, field)!r}: deciding afresh")
        return None
    candidates = set(self.base.candidates())
    specs: dict = {}
    for e in item["specs"]:
      if (e["group"], e["path"]) not in candidates:
        self.log(f"codec: the checkpoint's codec choice names {e['group']}{e['path']}, which "
                 "this run does not gather: deciding afresh")
        return None
      specs.setdefault(e["group"], {})[e["path"]] = _spec_of(e)
    why = self._outside_config(specs)
    if why:
      self.log(f"codec: the checkpoint's codec choice (step {int(item['step'])}) {why}: deciding "
               "afresh")
      return None
    return specs, int(item["step"])

  def _outside_config(self, specs: dict) -> str | None:
    """Why a restored choice does not fit this run's codec.* (a resume may change them), or
    None: a mode `codec.mode` does not allow, hash detection without `codec.detect='hash'`, or
    caches over `codec.cache_budget_bytes`."""
    allowed = modes_of(self.cfg)
    used = 0
    for g, ps in specs.items():
      for p, spec in ps.items():
        if spec.mode not in allowed:
          return (f"compresses {g}{p} with {spec.mode!r}, which codec.mode={self.cfg.mode!r} "
                  f"does not allow (it allows {', '.join(allowed)})")
        if spec.detect == "hash" and self.cfg.detect != "hash":
          return (f"detects {g}{p}'s changes by hashes, which codec.detect="
                  f"{self.cfg.detect!r} does not allow")
        used += self.base.copies(g) * codec.state_bytes(
            self.base.shard_shape(g, p), hook.COMPUTE_DTYPE, self.base.num_devices, spec)
    budget = self.cfg.cache_budget_bytes
    if budget and used > budget:
      return (f"keeps {_size(used)} of caches per device, over codec.cache_budget_bytes="
              f"{budget} ({_size(budget)})")
    return None

  # -- records (the JSON log, for people) --------------------------------------------------------
  def _live_figures(self) -> dict:
    """{(group, path): figures since the last decision} of the compressed parameters (their
    first gather after a change of choice was dense and is included)."""
    if self._live is None:
      return {}
    live = np.asarray(jax.device_get(self._live), np.float64)
    out: dict = {}
    for row, (g, p, _) in zip(live, self.gatherer.param_rows()):
      acc = out.setdefault((g, p), np.zeros_like(row))
      acc += row
    steps = self._live_steps
    return {k: {"steps": steps,
                "sent_over_plain": float(v[0] / max(v[1], 1)),
                "fallbacks": int(v[hook.STAT_KEYS.index("fallback")]),
                "dense": int(v[hook.STAT_KEYS.index("dense")])} for k, v in out.items()}

  def _record(self, step, rates, selections, changed) -> dict:
    live = self._live_figures()
    params = []
    for (g, p), sel, mean, peak in zip(rates.names, selections, rates.mean, rates.peak):
      entry = {"group": g, "path": p, "report": self.base.report_group(g, p), "mode": sel.spec.mode,
               "reason": sel.reason, "best_mode": sel.best.mode,
               **{f"q_{kind}": float(m) for kind, m in zip(RATE_KINDS, mean)},
               **{f"peak_{kind}": float(m) for kind, m in zip(RATE_KINDS, peak)},
               "bytes_plain": sel.bytes_plain,
               "bytes_sent": sel.bytes_sent, "gain": sel.gain_s, "state_bytes": sel.state_bytes
               if sel.selected else 0, "best_state_bytes": sel.state_bytes,
               # per gather on average over a step: the backward's are rebuilt from the cache
               "bytes_sent_step": _bytes_a_step(sel, self.base.rebuilt_share.get(g, 0.0),
                                                self.gatherer.shard_shape(g, p),
                                                self.base.copies(g))}
      if sel.selected:
        fmt = codec.patch_format(self.gatherer.shard_shape(g, p), hook.COMPUTE_DTYPE, sel.spec)
        entry.update(detect=sel.spec.detect, capacity_fraction=sel.spec.capacity_fraction,
                     capacity=fmt.capacity, block_size=sel.spec.block_size,
                     delta_bits=sel.spec.delta_bits, far_fraction=sel.spec.far_fraction)
      if (g, p) in live:
        entry["live"] = live[(g, p)]
      params.append(entry)
    used = sum(e["state_bytes"] for e in params)
    return {"step": step, "mode": self.cfg.mode, "changed": changed, "probe_steps": rates.steps,
            "comm": {"model": ("bytes" if self.comm == select.CommModel.bytes_only()
                               else "profile"), "alpha_s": self.comm.alpha,
                     "beta_s_per_byte": self.comm.beta,
                     "codec_seconds": {m: list(ab)
                                       for m, ab in (self.codec_seconds or {}).items()}},
            "cache_budget_bytes": self.cfg.cache_budget_bytes, "cache_bytes": used,
            "live_since": self._live_since, "params": params}

  def _report(self, record: dict) -> None:
    params, comm = record["params"], record["comm"]
    chosen = [e for e in params if e["mode"] != "off"]
    budget = record["cache_budget_bytes"]
    in_bytes = comm["model"] == "bytes"
    cost = ("bytes saved" if in_bytes else
            f"{comm['alpha_s'] * 1e6:.0f} us + {comm['beta_s_per_byte'] * 1e9:.2f} ns/B per "
            "all-gather, profiled")
    plain = sum(e["bytes_plain"] for e in params)
    sent = sum(e["bytes_sent"] for e in params)
    self.log(f"codec: step {record['step']}: {len(chosen)} of {len(params)} parameters "
             f"compressed ({record['mode']}; gain = {cost}; cache {_size(record['cache_bytes'])}"
             f" per device, budget {_size(budget) if budget else 'none'}; a gather of all of "
             f"them {sent / max(plain, 1):.2f}x plain)"
             f"{'' if record['changed'] else '; choice unchanged'}")
    for e in params:
      rates = (f"q_e {100 * e['q_element']:5.2f}% q_b {100 * e['q_block']:5.1f}% "
               f"q_w {100 * e['q_word']:5.1f}% q_d3 {100 * e['q_delta3']:5.1f}%")
      if e["mode"] != "off":
        mode = e["mode"] + (str(e["delta_bits"]) if e["mode"] == "delta" else "")
        what = f"{mode:<7} cap {100 * e['capacity_fraction']:6.2f}%"
        why = e["reason"]
      else:
        what = f"{'plain':<19}"
        gain = f"{e['gain']:.0f} B" if in_bytes else f"{e['gain'] * 1e6:.2f} us"
        why = f"{e['reason']} (best {e['best_mode']}: gain {gain})"
      live = e.get("live")
      since = (f"; since step {record['live_since']}: {live['sent_over_plain']:.2f}x plain, "
               f"{live['fallbacks']} fallbacks" if live else "")
      ratio = e["bytes_sent"] / max(e["bytes_plain"], 1)
      step_ratio = e.get("bytes_sent_step", e["bytes_sent"]) / max(e["bytes_plain"], 1)
      per_step = f" ({step_ratio:.2f}x a step)" if step_ratio != ratio else ""
      self.log(f"codec:   {e['group'] + e['path']:<34} {what}  {rates}  "
               f"{ratio:.2f}x plain{per_step}  "
               f"cache {_size(e['state_bytes'])}  {why}{since}")
    self._write()

  def _write(self) -> None:
    if self.workdir is None or jax.process_index() != 0:
      return
    path = os.path.join(self.workdir, SELECTION_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump({"decisions": self.decisions}, f, indent=1)
    os.replace(tmp, path)

  def _continue_log(self, step: int) -> None:
    """A resumed run continues the JSON log with the decisions up to its step."""
    if self.workdir is None:
      return
    try:
      with open(os.path.join(self.workdir, SELECTION_FILE), encoding="utf-8") as f:
        self.decisions = [d for d in json.load(f)["decisions"] if d["step"] <= step]
    except (OSError, ValueError, KeyError, TypeError):
      self.decisions = []


@dataclasses.dataclass(frozen=True)
class CodecDecisionItem:
  """The checkpoint item "codec" (JSON): the decision in force, so a resumed run gathers as the
  uninterrupted one would. Registered with the Checkpointer like any feature state."""
  policy: CodecPolicy
  name: str = "codec"
  json: bool = True

  def item(self, state):
    return self.policy.saved_decision(), state

  def target(self, saved_keys):
    del saved_keys
    return None

  def restore(self, state, item, where: str, log):
    if item is None and self.policy.active:     # a fixed mode has nothing to take up
      log(f"codec: {where} holds no codec decision (its run gathered plain, or an older "
          "version wrote it): the codec decides afresh after its warm-up")
    self.policy.restored = item
    return state


def _size(nbytes: float) -> str:
  for unit in ("B", "KB", "MB", "GB"):
    if abs(nbytes) < 1000 or unit == "GB":
      return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
    nbytes /= 1000
  return f"{nbytes:.1f} GB"
