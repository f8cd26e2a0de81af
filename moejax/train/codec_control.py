"""Run-time choice of the compressed gather: which parameters, in which mode, with what capacity.

A `CodecController` drives `codec.mode=auto` and `codec.select=True` (a fixed mode, only where it
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
   Comm(agreement), with Comm profiled on this mesh at start-up (`profile_comm`), or bytes saved
   with `codec.comm_model='bytes'`) and picks under `codec.cache_budget_bytes` a mode per
   parameter (auto: plain, element, block or word; a fixed mode: that mode or plain);
3. logs one line per parameter (mode, capacity, rates, bytes against plain, gain, cache, why) and
   appends the decision to WORKDIR/codec_selection.json;
4. if the choice changed, installs it (`install`): a new `Gatherer`, a new train step (compiled
   on its next call; compiled steps are kept per choice) and codec state for newly compressed
   parameters, warm, so that only their first gather is dense (it refills the caches).
   Parameters whose spec did not change keep their caches. Modes change only between steps.

With `codec.reselect_every > 0` decisions repeat every that many steps, on the rates of the steps
just before. Between decisions the train step's per-parameter figures (`Gatherer.codec_metrics`)
are summed on the device; they go into the next decision's log and JSON (bytes sent, fallbacks),
and a parameter that falls back in more than `FALLBACK_LIMIT` of its gathers brings the next
decision forward. A resumed run (`start` on a restored state) reinstalls the last decision of
codec_selection.json.

In the training loop:

    controller = CodecController(trainer, workdir=workdir)
    state = controller.start(state)                                # before the first step
    for step in ...:
      state, metrics = trainer.train_step(state, batch)
      state, metrics = controller.after_step(step, state, metrics)

`after_step` also takes the per-parameter array out of the metrics (it is not for
metrics.jsonl). With the codec off, or a fixed mode without `select`, it does nothing else.

Letters: W devices, R rows (one per parameter and layer), K per-parameter figures.
"""
from __future__ import annotations

import dataclasses
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
from moejax.sharding.gatherer import PARAM_METRIC, Gatherer, param_group
from moejax.sharding.mesh import DEVICES, num_devices
from moejax.train import step as step_lib
from moejax.train.metrics import log as default_log

PROBE_STEPS = 3           # consecutive step pairs measured before each decision
FALLBACK_LIMIT = 0.1      # share of a parameter's gathers that may fall back between decisions
CHECK_EVERY = 10          # steps between looks at the live fallback counts
SELECTION_FILE = "codec_selection.json"
RATE_KINDS = rates_lib.RATE_KINDS   # columns of the probe's counts
PROFILE_BYTES = (4 << 10, 64 << 10, 1 << 20)
KEEP_RATIO = 1.5          # a capacity in use stays until the sized one is this much smaller


# ----------------------------------------------------------------------------------------------
# Measurements.


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
    jax.block_until_ready(f(x))
    best = math.inf
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(f(x))
      best = min(best, time.perf_counter() - t0)
    points.append((4 * words, best / reps))
  if jax.process_count() > 1:   # every process must take the same decisions: use process 0's
    points = multihost_utils.broadcast_one_to_all(np.asarray(points, np.float64))
  return select.CommModel.fit(np.asarray(points).tolist())


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
      ndim = len(_leaf(gatherer.param_shapes, g, p).shape)
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


def choose(gatherer: Gatherer, rates: Rates, codec_cfg: CodecConfig, comm: select.CommModel,
           current: dict | None = None) -> list[select.Selection]:
  """One Selection per candidate parameter (`rates.names` order). `current` ({group: {path:
  CodecSpec}}) keeps a parameter's capacity in its mode while the newly sized one is between
  1 / KEEP_RATIO of it and it (fewer recompiles for about the same traffic)."""
  params, keep = [], {}
  for (g, p), mean, peak in zip(rates.names, rates.mean, rates.peak):
    name = f"{g}{p}"
    params.append(select.ParamStats(
        name, gatherer.shard_shape(g, p), hook.COMPUTE_DTYPE, q_element=float(mean[0]),
        q_block=float(mean[1]), q_word=float(mean[2]),
        q_delta={k: float(mean[RATE_KINDS.index(f"delta{k}")]) for k in word.DELTA_BITS},
        q_far=float(mean[RATE_KINDS.index("far")]),
        copies=gatherer.copies(g), peak=dict(zip(RATE_KINDS, map(float, peak)))))
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


def install(trainer, gatherer: Gatherer, state=None, *, steps_cache: dict | None = None):
  """Rebuilds `trainer`'s layout and train step around `gatherer` and, given a state, returns it
  with codec state for the new choice (unchanged parameters keep theirs; new ones warm)."""
  old = trainer.layout
  shardings = jax.tree.map(lambda s: NamedSharding(old.mesh, s), gatherer.state_specs(),
                           is_leaf=lambda s: isinstance(s, P))
  key = _specs_key(gatherer.specs)
  if steps_cache is not None and key in steps_cache:
    layout, train_step = steps_cache[key]
  else:
    layout = dataclasses.replace(old, gatherer=gatherer,
                                 shardings=old.shardings.replace(gather_state=shardings))
    train_step = step_lib.make_train_step(trainer.cfg, trainer.mesh, layout, trainer.tx,
                                          trainer.schedule)
    if steps_cache is not None:
      steps_cache[key] = (layout, train_step)
  trainer.layout, trainer.train_step = layout, train_step
  if getattr(trainer, "_relabel", None) is not None:
    trainer._relabel = None        # compiled against the previous layout's shardings
  if state is None:
    return None
  new_states = gatherer.init_states(old.mesh, warmed_up=True,
                                    reuse=(old.gatherer, state.gather_state))
  return state.replace(gather_state=new_states)


def _specs_key(specs: dict):
  return tuple(sorted((g, p, s) for g, ps in specs.items() for p, s in ps.items()))


# ----------------------------------------------------------------------------------------------
# The controller.


class CodecController:
  """See the module docstring."""

  def __init__(self, trainer, codec_cfg: CodecConfig | None = None, *, workdir: str | None = None,
               comm: select.CommModel | None = None, log=default_log):
    self.trainer = trainer
    self.cfg = codec_cfg if codec_cfg is not None else trainer.cfg.codec
    self.workdir, self.log = workdir, log
    self.active = self.cfg.controlled and bool(trainer.layout.gatherer.candidates())
    self.decisions: list[dict] = []
    # Compiled steps per codec choice, kept on the Trainer so that later runs reuse them.
    self._steps_cache: dict = trainer.__dict__.setdefault("codec_steps", {})
    self._next = None            # step after which the next decision is taken
    self._snap = self._acc = None
    self._probe_steps = 0
    self._live = self._live_prev = None
    self._live_steps = 0
    self._live_since = 0
    self._live_of = None         # the Gatherer whose rows the live sums hold
    self.comm = comm
    if self.cfg.mode != "off" and not trainer.layout.gatherer.candidates():
      log(f"codec: codec.mode={self.cfg.mode!r} has nothing to compress: no parameter is "
          f"gathered on this mesh of {trainer.layout.gatherer.num_devices} device(s)")
    if not self.active:
      return
    if self.comm is None and self.cfg.comm_model == "profile":
      try:
        self.comm = profile_comm(trainer.mesh)
      except ValueError as e:
        self.log(f"codec: the all-gather profile of this mesh is unusable ({e}); pricing the "
                 "codec in bytes saved instead")
    if self.comm is None:
      self.comm = select.CommModel.bytes_only()
    self.probe = Probe(trainer.layout.gatherer, trainer.mesh, self.cfg.block_size)
    self._steps_cache[_specs_key(trainer.layout.gatherer.specs)] = (trainer.layout,
                                                                    trainer.train_step)

  @property
  def gatherer(self) -> Gatherer:
    return self.trainer.layout.gatherer

  # -- the loop's two calls ----------------------------------------------------------------------
  def start(self, state):
    """Call once before the first step (fresh or restored state). A restored run reinstalls the
    last decision recorded in the workdir, if it fits these parameters."""
    if not self.active:
      return state
    step = int(state.step)
    self._live_since = step
    last = self._recorded(step)
    if last is not None:
      state = install(self.trainer, self.gatherer.with_specs(last[0]), state,
                      steps_cache=self._steps_cache)
      self.log(f"codec: step {step}: reinstalled the codec choice of step {last[1]} "
               f"({sum(len(v) for v in last[0].values())} parameters compressed)")
      self._schedule(last[1] + self.cfg.reselect_every if self.cfg.reselect_every else None,
                     step, state.params)
    else:
      if any(self.gatherer.specs.values()):   # a reused Trainer still holds an earlier choice
        state = install(self.trainer, self.gatherer.with_specs({}), state,
                        steps_cache=self._steps_cache)
      self._schedule(max(self.cfg.warmup_steps, step + PROBE_STEPS), step, state.params)
    return state

  def after_step(self, step: int, state, metrics: dict):
    """Call right after the train step that produced `step` (the new state's step)."""
    metrics = dict(metrics)
    figures = metrics.pop(PARAM_METRIC, None)
    if not self.active:
      return state, metrics
    if figures is not None:
      if self._live_of is not self.gatherer:      # the choice changed (here or by `install`)
        self._live = self._live_prev = None
        self._live_steps, self._live_of = 0, self.gatherer
      self._live_prev = self._live
      self._live = figures if self._live is None else self._live + figures
      self._live_steps += 1
      if self._live_steps % CHECK_EVERY == 0:
        self._check_fallbacks(step)
    if self._next is not None:
      if self._snap is not None:
        self._acc = self.probe.add(self._acc, self.probe.counts(self._snap, state.params))
        self._probe_steps += 1
      self._snap = (self.probe.snapshot(state.params)
                    if self._next - PROBE_STEPS <= step < self._next else None)
      if step >= self._next:
        state = self.decide(step, state)
    return state, metrics

  # -- decisions -------------------------------------------------------------------------------
  def install(self, state, specs: dict, *, keep_deciding: bool = True):
    """Use a given choice ({group: {path: CodecSpec}}) from the next step on; with
    `keep_deciding=False` it stays (no more decisions)."""
    state = install(self.trainer, self.gatherer.with_specs(specs), state,
                    steps_cache=self._steps_cache)
    if not keep_deciding:
      self._schedule(None, int(state.step))
    return state

  def decide(self, step: int, state):
    """Decide now from the rates measured so far, install the choice if it changed."""
    if self._acc is None:
      raise RuntimeError("no change rates measured yet: a decision needs probed steps")
    rates = self.probe.rates(self._acc, self._probe_steps)
    current = self.gatherer.specs
    selections = choose(self.gatherer, rates, self.cfg, self.comm, current)
    specs = specs_of(rates.names, selections)
    changed = _specs_key(specs) != _specs_key(current)
    record = self._record(step, rates, selections, changed)
    self.decisions.append(record)
    self._report(record)
    if changed:
      state = self.install(state, specs)
    self._acc, self._snap, self._probe_steps = None, None, 0
    self._live = self._live_prev = None
    self._live_steps, self._live_since = 0, step
    self._schedule(step + self.cfg.reselect_every if self.cfg.reselect_every else None, step,
                   state.params)
    return state

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

  # -- records ---------------------------------------------------------------------------------
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
      entry = {"group": g, "path": p, "report": param_group(g, p), "mode": sel.spec.mode,
               "reason": sel.reason, "best_mode": sel.best.mode,
               **{f"q_{kind}": float(m) for kind, m in zip(RATE_KINDS, mean)},
               **{f"peak_{kind}": float(m) for kind, m in zip(RATE_KINDS, peak)},
               "bytes_plain": sel.bytes_plain,
               "bytes_sent": sel.bytes_sent, "gain": sel.gain_s, "state_bytes": sel.state_bytes
               if sel.selected else 0, "best_state_bytes": sel.state_bytes}
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
                     "beta_s_per_byte": self.comm.beta},
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
      self.log(f"codec:   {e['group'] + e['path']:<34} {what}  {rates}  "
               f"{e['bytes_sent'] / max(e['bytes_plain'], 1):.2f}x plain  "
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

  def _recorded(self, step: int):
    """(specs, decision step) of the last recorded decision at or before `step`, if any."""
    if self.workdir is None or step == 0:
      return None
    path = os.path.join(self.workdir, SELECTION_FILE)
    try:
      with open(path, encoding="utf-8") as f:
        decisions = json.load(f)["decisions"]
    except (OSError, ValueError, KeyError):
      return None
    earlier = [d for d in decisions if d["step"] <= step]
    if not earlier:
      return None
    last = earlier[-1]
    candidates = set(self.gatherer.candidates())
    specs: dict = {}
    for e in last["params"]:
      if (e["group"], e["path"]) not in candidates:
        return None
      if e["mode"] != "off":
        specs.setdefault(e["group"], {})[e["path"]] = codec.CodecSpec(
            e["mode"], block_size=e["block_size"], detect=e["detect"],
            capacity_fraction=e["capacity_fraction"], warmup_steps=self.cfg.warmup_steps,
            delta_bits=e.get("delta_bits", 3), far_fraction=e.get("far_fraction"))
    self.decisions = earlier
    return specs, last["step"]


def _size(nbytes: float) -> str:
  for unit in ("B", "KB", "MB", "GB"):
    if abs(nbytes) < 1000 or unit == "GB":
      return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
    nbytes /= 1000
  return f"{nbytes:.1f} GB"
