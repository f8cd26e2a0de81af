"""Compressed all-gather: every codec mode side by side on the tiny preset, at a pretraining and at
a fine-tuning learning rate.

  python bench/codec.py --quick

Two regimes on 8 fake CPU devices: "high" trains the tiny preset from scratch (peak lr 3e-3, its
warm-up and cosine decay); "low" continues from that model at a constant fine-tuning lr of 1e-4.
Each regime is trained once with plain gathers: the codec never changes the numbers
(tests/codec/test_training.py), so every mode sees this very sequence of weights. After each step
the controller's probe (`moejax.train.codec_control.Probe`) counts, per device and per shard,
exactly what each mode's encoder counts (exponent changes, blocks of the config block size with
one, whole-word changes; tests/codec/test_training.py checks the two agree), and each mode's bytes
follow from the codec's own rule: a patch (its static buffer) when every device's changes fit the
capacity, the dense path (plain + agreement) otherwise. Without --quick, training runs again with
`codec.mode=auto` in the train step itself and its measured bytes are printed beside these.

Modes compared, per parameter group (attention, router, norms, experts, embeddings) and in total:
  element/block/word/delta (all)  the mode on every sharded parameter, default capacity
                                  (`codec.mode=X`; delta with `codec.delta_bits`=3)
  element/block/word/delta        the mode where it pays, capacity sized from the rates measured
                                  at the decision (`codec.mode=X, codec.select=True`)
  auto                            a mode per parameter (delta at 2, 3 or 4 bits) under a cache
                                  budget (`codec.mode=auto`)
Decisions are taken from the PROBE_STEPS steps before step `codec.warmup_steps` (high) or the
first steps (low); bytes are the steady state after the decision (the one dense refill of the
caches right after it is left out). Gains are priced in bytes (`codec.comm_model=bytes`): on fake
CPU devices the profiled per-collective latency dwarfs every tiny shard, so the profile picks
nothing, which the bench also prints. Also: encode/decode throughput on this CPU against a plain
copy of the same bytes, and the composed run (`composed`, alone with --composed): codec auto +
fssdp + reroute admission, replica bytes with and without the codec. Ends with one JSON line of
figures.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import configs.olmoe as olmoe_configs  # noqa: E402
from bench.cli_args import at_least  # noqa: E402
from moejax.codec import bits, gather as codec, kernels, select, word  # noqa: E402
from moejax.config import from_config_dict  # noqa: E402
from moejax.data import DataSpec, make_data  # noqa: E402
from moejax.sharding import axes, hook  # noqa: E402
from moejax.models import olmoe  # noqa: E402
from moejax.train import codec_control, step as step_lib  # noqa: E402
from moejax.train.loop import Trainer, put_batch  # noqa: E402

GROUPS = axes.GROUPS       # the report groups parameters declare
FIXED = ("element", "block", "word", "delta")
HALF = "auto 1/2 bgt"     # auto under half the cache budget
FULL_BLOCK = 512
LOW_LR = 1e-4


def config(steps: int, **overrides):
  cd = olmoe_configs.get_config("tiny")
  cd.steps = steps
  for path, value in overrides.items():
    node = cd
    *parents, leaf = path.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return from_config_dict(cd)


@dataclasses.dataclass
class Trajectory:
  """Per update u (the change from the weights after step u-1 to those after step u, which the
  gather of step u+1 sees): per-device probe counts [U, W, R, 3], full-tensor block rates."""
  counts: np.ndarray
  full_block: dict          # report group -> fraction of 512-value blocks (whole tensors) changed
  state: object


def param_group(group: str, path: str) -> str:
  """The report group a parameter of the tiny model declares (every regime trains that model)."""
  meta = olmoe.param_meta(config(1))[group]
  return {jax.tree_util.keystr(p): m for p, m in jax.tree_util.tree_leaves_with_path(meta)}[
      path].group


def train(trainer, state, data, steps: int, probe, measure_from: int) -> Trajectory:
  """Trains `steps` steps with plain gathers; probes every update from step `measure_from - 1`."""
  counts, snap, prev_exp, full = [], None, None, {}
  for step in range(1, steps + 1):
    state, _ = trainer.train_step(state, put_batch(next(data.train), trainer.mesh))
    if snap is not None:
      counts.append(probe.counts(snap, state.params))
    snap = probe.snapshot(state.params)
    if step >= measure_from:
      exp = _full_exponents(jax.device_get(state.params), probe.names)
      if prev_exp is not None:
        for key, (e, p) in _pairs(exp, prev_exp):
          full.setdefault(key, []).append((e, p))
      prev_exp = exp
  counts = np.asarray(jax.device_get(counts))
  rates = {}
  for (g, p), pairs in full.items():
    changed = sum(_blocks_changed(e, q) for e, q in pairs)
    total = sum(_num_blocks(e) for e, _ in pairs)
    for report in (param_group(g, p), "total"):
      c, t = rates.get(report, (0, 0))
      rates[report] = (c + changed, t + total)
  return Trajectory(counts, {k: c / t for k, (c, t) in rates.items()}, state)


def _full_exponents(params, names):
  out = {}
  for g, p in names:
    x = codec_control._leaf(params, g, p)
    x = np.asarray(jnp.asarray(x, jnp.bfloat16)).view(np.uint16)
    layers = x.reshape(x.shape[0], -1) if g in olmoe.LAYER_GROUPS else x.reshape(1, -1)
    out[(g, p)] = (layers >> 7) & 0xFF
  return out


def _pairs(now, before):
  return [(k, (now[k], before[k])) for k in now]


def _num_blocks(e):
  return e.shape[0] * math.ceil(e.shape[1] / FULL_BLOCK)


def _blocks_changed(e, q):
  pad = _num_blocks(e) // e.shape[0] * FULL_BLOCK - e.shape[1]
  d = np.pad(e != q, ((0, 0), (0, pad))).reshape(e.shape[0], -1, FULL_BLOCK)
  return int(d.any(axis=2).sum())


# ----------------------------------------------------------------------------------------------
# Bytes of every mode on a trajectory.


@dataclasses.dataclass
class Rows:
  """Static facts of the probe's rows (one per parameter and layer)."""
  names: list               # (group, path) per row
  shard: list               # shard shape per row
  repeat: np.ndarray        # gathers per step (step.gathers_per_copy)
  plain: np.ndarray         # bytes per device per gather, plain
  moving: np.ndarray        # of those, the share a compressed parameter sends as such (the
                            # backward's re-gathers are rebuilt from the cache)

  @classmethod
  def of(cls, gatherer, probe, cfg):
    names, shard, repeat, moving = [], [], [], []
    for (g, p), rows in zip(probe.names, probe.rows):
      for _ in range(rows):
        names.append((g, p))
        shard.append(gatherer.shard_shape(g, p))
        repeat.append(step_lib.gathers_per_copy(cfg, gatherer, g))
        moving.append(1.0 - gatherer.rebuilt_share.get(g, 0.0))
    plain = np.array([2 * math.prod(s) for s in shard], np.float64)
    return cls(names, shard, np.asarray(repeat, np.float64), plain,
               np.asarray(moving, np.float64))


@dataclasses.dataclass
class Run:
  """One mode over the measured steps: bytes per device per gather [S, R], fallbacks, the most
  codec state held at once, and each decision's selections."""
  sent: np.ndarray
  fallbacks: int
  cache: dict               # mode -> the most state bytes that mode held at once
  decisions: list
  peak_cache: float = 0.0   # the most state bytes held at once, all modes together


def simulate(rows: Rows, counts: np.ndarray, steps: range, plan, refill: bool = True) -> Run:
  """What the codec sends at `steps` (gather t sees update t - 1, i.e. counts[t - 3]) under
  `plan(step) -> None | {(group, path): CodecSpec}`, called after each step (None: keep the
  choice). With `refill`, a parameter that needs a new state (newly compressed, or another mode)
  sends its next gather dense (its caches fill); without, caches are taken as already warm (a
  fixed mode after its warm-up)."""
  sent = np.zeros((len(steps), len(rows.names)))
  specs, fallbacks, cache, decisions, refill, refill_on = {}, 0, {}, [], set(), refill
  peak = 0.0
  for i, t in enumerate(steps):
    for r, key in enumerate(rows.names):
      spec = specs.get(key)
      if spec is None:
        sent[i, r] = rows.plain[r]
        continue
      sizes = codec.wire_bytes(rows.shard[r], hook.COMPUTE_DTYPE, spec)
      capacity = codec.patch_format(rows.shard[r], hook.COMPUTE_DTYPE, spec).capacity
      worst = counts[t - 3, :, r, codec_control.RATE_KINDS.index(spec.rate_kind)].max()
      over = worst > capacity
      if spec.mode == "delta":     # the far list overflows on its own
        fmt = codec.patch_format(rows.shard[r], hook.COMPUTE_DTYPE, spec)
        over |= counts[t - 3, :, r, codec_control.RATE_KINDS.index("far")].max() > fmt.far_capacity
      dense = key in refill or over
      fallbacks += int(over and key not in refill)
      sent[i, r] = sizes["dense"] if dense else sizes["forward"]
      # per gather on average over the step, the rebuilt ones at what they move
      sent[i, r] = rows.moving[r] * sent[i, r] + (1 - rows.moving[r]) * sizes["rebuilt"]
    refill = set()
    new = plan(t)
    if new is not None:
      decisions.append((t, new))
      refill = ({k for k, v in new.items() if k not in specs or not codec.same_state(specs[k], v)}
                if refill_on else set())
      specs = new
      held = _state_bytes(rows, specs)
      for mode in codec.COMPRESSED_MODES:
        cache[mode] = max(cache.get(mode, 0), held.get(mode, 0))
      peak = max(peak, sum(held.values()))
  return Run(sent, fallbacks, cache, decisions, peak)


def _state_bytes(rows: Rows, specs) -> dict:
  out = {}
  for r, key in enumerate(rows.names):
    if key in specs:
      out[specs[key].mode] = out.get(specs[key].mode, 0) + codec.state_bytes(
          rows.shard[r], hook.COMPUTE_DTYPE, jax.device_count(), specs[key])
  return out


def summarize(rows: Rows, run: Run, last: int | None = None) -> dict:
  """Ratio to plain per report group and in total (over the last `last` steps, or all), and the
  worst single parameter's ratio."""
  sent = run.sent if last is None else run.sent[-last:]
  total_sent = (sent * rows.repeat).sum(axis=0)
  total_plain = rows.plain * rows.repeat * sent.shape[0]
  out = {}
  for report in GROUPS + ("total",):
    mask = np.array([report == "total" or param_group(*k) == report for k in rows.names])
    if mask.any():
      out[report] = float(total_sent[mask].sum() / total_plain[mask].sum())
  per_param = {}
  for r, key in enumerate(rows.names):
    s, p = per_param.get(key, (0.0, 0.0))
    per_param[key] = (s + total_sent[r], p + total_plain[r])
  out["worst_param"] = float(max(s / p for s, p in per_param.values()))
  return out


def controller_plan(probe, counts, gatherer, cfg, first: int, every: int):
  """The controller's schedule as a plan for `simulate`: decisions after step `first` and every
  `every` steps, each from the PROBE_STEPS updates before it, capacities with hysteresis."""
  current = {}

  def plan(t):
    nonlocal current
    if t < first or (t - first) % every:
      return None
    rates = probe.rates_of(counts[t - codec_control.PROBE_STEPS - 1:t - 1])   # updates t-2..t
    sels = codec_control.choose(gatherer, rates, cfg, select.CommModel.bytes_only(), current)
    current = codec_control.specs_of(rates.names, sels)
    plan.last = (rates, sels)
    return {(g, p): s for g, ps in current.items() for p, s in ps.items()}

  return plan


# ----------------------------------------------------------------------------------------------
# Encode / decode throughput on this CPU.


def throughput(n: int = 1 << 20, w: int = 8, repeats: int = 5) -> dict:
  """GB/s of encode (one shard) and decode (W-1 patched rows + merge), against a plain copy of the
  same bytes, per mode. bf16, about 1 % of exponents and 5 % of words changed."""
  rng = np.random.default_rng(0)
  layout = bits.layout_of(jnp.bfloat16)
  x = rng.normal(0, 0.02, n).astype(np.float32)
  prev = jnp.asarray(np.asarray(jnp.asarray(x, jnp.bfloat16)).view(np.uint16))
  y = x.copy()
  y[rng.random(n) < 0.05] *= 1.004
  y[rng.random(n) < 0.01] *= 2.5
  now = jnp.asarray(np.asarray(jnp.asarray(y, jnp.bfloat16)).view(np.uint16))

  def timed(f, *args):
    return codec_control.best_seconds(jax.jit(f), *args, repeats=repeats)

  shard_bytes = 2 * n
  out = {"copy_encode_gbs": shard_bytes / timed(lambda a: jnp.roll(a, 1), now) / 1e9}
  full = jnp.tile(now, w)
  out["copy_decode_gbs"] = w * shard_bytes / timed(lambda a: jnp.roll(a, 1), full) / 1e9
  me = jnp.int32(0)
  prev_exp = bits.split_bits(prev, layout)[0]
  for mode, fraction in (("element", 1 / 16), ("block", 1 / 4), ("word", 1 / 8),
                         ("delta", 1 / 16)):
    fmt = codec.patch_format((n,), jnp.bfloat16, codec.CodecSpec(mode, capacity_fraction=fraction))
    if mode in codec.WORD_MODES:
      def enc(b, p, fmt=fmt):
        d = word.key_delta(b, p, fmt.value_bits) if fmt.mode == "delta" else None
        return word.encode(b, word.codes(b, p, fmt, d), fmt, d)[0]

      def dec(c, wire, own, fmt=fmt):
        del own
        return word.decode(c, wire[1:], fmt)
      own = prev
    else:
      own = jnp.pad(prev_exp, (0, fmt.cache_width - n))

      def enc(b, p, fmt=fmt):
        return kernels.encode(b, p, fmt, layout).wire

      def dec(c, wire, own, fmt=fmt):
        return kernels.decode(c, wire, own, me, fmt, layout)
    wire = jnp.tile(enc(now, own)[None], (w, 1))
    cache = jnp.tile(own[None], (w - 1, 1))
    out[f"{mode}_encode_gbs"] = shard_bytes / timed(enc, now, own) / 1e9
    out[f"{mode}_decode_gbs"] = w * shard_bytes / timed(dec, cache, wire, own) / 1e9
  return out


# ----------------------------------------------------------------------------------------------


def model_bf16_bytes(gatherer) -> int:
  """bf16 bytes of every parameter the codec may compress (whole tensors, all layers)."""
  return int(sum(2 * math.prod(gatherer.shard_shape(g, p)) * gatherer.copies(g)
                 * gatherer.num_devices for g, p in gatherer.candidates()))


def run_regime(name, trainer, state, data, steps, first, every, budget, block_size):
  probe = codec_control.Probe(trainer.layout.gatherer, trainer.mesh, block_size)
  rows = Rows.of(trainer.layout.gatherer, probe, trainer.cfg)
  gatherer, base = trainer.layout.gatherer, trainer.cfg.codec
  traj = train(trainer, state, data, steps, probe, measure_from=first)
  measured = range(first + 1, steps + 1)
  runs, last_choice = {}, {}
  for mode in FIXED:   # every sharded parameter in one mode, default capacity, warm
    spec = codec.CodecSpec(mode, block_size=block_size, warmup_steps=base.warmup_steps,
                           delta_bits=base.delta_bits)
    fixed = {k: spec for k in probe.names}
    runs[f"{mode} (all)"] = simulate(rows, traj.counts, range(first, steps + 1),
                                     lambda t, fixed=fixed: fixed if t == first else None,
                                     refill=False)
    runs[f"{mode} (all)"].sent = runs[f"{mode} (all)"].sent[1:]
  for mode in FIXED + ("auto", HALF):
    auto = mode in ("auto", HALF)
    cfg = dataclasses.replace(base, mode="auto" if auto else mode, select=not auto,
                              cache_budget_bytes=(budget // 2 if mode == HALF else budget)
                              if auto else 0)
    plan = controller_plan(probe, traj.counts, gatherer, cfg, first, every)
    runs[mode] = simulate(rows, traj.counts, range(first, steps + 1), plan)
    runs[mode].sent = runs[mode].sent[1:]          # step `first` itself is before the decision
    last_choice[mode] = plan.last
  late = max(1, len(measured) // 3)
  results = {k: summarize(rows, r) for k, r in runs.items()}
  late_results = {k: summarize(rows, r, late) for k, r in runs.items()}
  steady = traj.counts[first - 1:]          # the updates the measured gathers see
  units, offsets = probe.units(), np.cumsum([0] + probe.rows)
  group_rates = {}
  for report in GROUPS + ("total",):
    num, den = np.zeros(len(codec_control.RATE_KINDS)), np.zeros(len(codec_control.RATE_KINDS))
    for i, k in enumerate(probe.names):
      if report == "total" or param_group(*k) == report:
        num += steady[:, :, offsets[i]:offsets[i + 1]].sum(axis=(0, 1, 2))
        den += units[i] * steady.shape[0] * steady.shape[1] * probe.rows[i]
    if den.any():                            # a group the model has none of prints "-"
      group_rates[report] = num / den
  return {"name": name, "rows": rows, "runs": runs, "results": results, "late": late_results,
          "late_steps": late, "rates": group_rates, "full_block": traj.full_block,
          "last_choice": last_choice, "names": probe.names, "state": traj.state,
          "gatherer": gatherer, "base": base, "measured": measured, "first": first,
          "every": every}


def check_auto(cfg, state, data, steps: int, first: int, every: int, budget: int):
  """Trains again with `codec.mode=auto` in the train step (the controller deciding as in the
  simulation). Returns the gather bytes it measured over steps first + 1 .. steps against plain,
  and the final state."""
  cfg = dataclasses.replace(cfg, codec=dataclasses.replace(
      cfg.codec, mode="auto", warmup_steps=first, reselect_every=every, comm_model="bytes",
      cache_budget_bytes=budget))
  trainer = Trainer(cfg)
  policy = codec_control.CodecPolicy(trainer.layout.gatherer, trainer.mesh, cfg.codec,
                                     log=lambda _: None)
  if state is None:
    state = trainer.init_state()
  else:   # fresh (plain) codec state for this trainer
    state = state.replace(gather_state=trainer.layout.gatherer.init_states(trainer.mesh))
  sent = plain = 0.0
  for step, state, metrics in controlled_steps(trainer, policy, state, data, steps):
    if step > first:
      sent += metrics["gather_bytes"]
      plain += metrics["gather_bytes_plain"]
  return float(sent / plain), state


def controlled_steps(trainer, policy, state, data, steps: int):
  """Yields (step, state, metrics) of `steps` train steps, the codec controller (`policy`;
  None: the config's fixed codec) deciding and the trainer adopting its choices, as the loop
  does."""
  compiled = trainer.compiled(trainer.layout.gatherer.specs)
  choice = policy.start(0, state.params) if policy is not None else None
  for step in range(1, steps + 1):
    if choice is not None:
      state, compiled = trainer.adopt(state, compiled, choice)
    state, metrics = compiled.train_step(state, put_batch(next(data.train), trainer.mesh))
    if policy is not None:
      metrics, choice = policy.after_step(step, state.params, metrics)
    yield step, state, metrics


def composed(steps: int = 60, warmup: int = 10, transport: str = "auto") -> dict:
  """The composed run: codec auto (warm-up `warmup`) + fssdp (2 nodes x 4 fake devices, its
  replicas then delta-coded: `fssdp.replica_codec` follows the codec) + reroute admission,
  beside the same run with the codec off, batch for batch. Per step: parameter gather bytes
  over plain (plus the 24-byte agreement of each gather) and replica bytes over plain (plus the
  replica agreement); over the last 10 steps the replicas' bytes over plain; and whether the
  losses agree bit for bit. `transport`: `codec.transport` of the codec's run ("single": the
  payload GPUs send, in no conditional)."""
  over = {"moe.placement": "fssdp", "mesh.shape": (2, 4), "routing.admission": "reroute",
          "moe.dispatch_capacity_factor": 0.0}
  runs = {}
  for name, mode in (("off", "off"), ("auto", "auto")):
    cfg = config(steps, **over)
    cfg = dataclasses.replace(cfg, codec=dataclasses.replace(
        cfg.codec, mode=mode, warmup_steps=warmup, comm_model="bytes", transport=transport))
    trainer = Trainer(cfg)
    policy = (codec_control.CodecPolicy(trainer.layout.gatherer, trainer.mesh, cfg.codec,
                                        log=lambda _: None) if mode == "auto" else None)
    data = make_data(DataSpec(seed=cfg.seed), batch_size=cfg.batch_size, seq_len=cfg.seq_len)
    rows = []
    t0 = time.perf_counter()
    for _, _, metrics in controlled_steps(trainer, policy, trainer.init_state(), data, steps):
      rows.append({k: float(np.sum(metrics[k])) for k in (
          "loss", "gather_bytes", "gather_bytes_plain", "spag_bytes", "spag_bytes_plain")})
      rows[-1]["straggler"] = float(np.mean(metrics["straggler"]))   # mean over layers
    data.train.close()
    runs[name] = {"rows": rows, "seconds": time.perf_counter() - t0,
                  "replica_codec": trainer.layout.placement.replica_codec is not None}
  off, auto = runs["off"]["rows"], runs["auto"]["rows"]
  last = auto[-10:]
  settled = slice(max(0, min(2 * warmup, steps - 10)), None)   # past the warm-up and first picks
  spag_plain = sum(r["spag_bytes_plain"] for r in last)
  return {
      "steps": steps, "warmup": warmup, "transport": transport,
      "losses_equal": [r["loss"] for r in off] == [r["loss"] for r in auto],
      "replica_codec": runs["auto"]["replica_codec"],
      "max_gather_excess_bytes": max(r["gather_bytes"] - r["gather_bytes_plain"] for r in auto),
      "max_replica_excess_bytes": max(r["spag_bytes"] - r["spag_bytes_plain"] for r in auto),
      # None (JSON null, not NaN) when no replica moved in those steps
      "replica_ratio_last10": (sum(r["spag_bytes"] for r in last) / spag_plain
                               if spag_plain else None),
      "gather_ratio_last10": (sum(r["gather_bytes"] for r in last)
                              / sum(r["gather_bytes_plain"] for r in last)),
      "replica_bytes_last10": sum(r["spag_bytes"] for r in last) / len(last),
      "replica_bytes_off_last10": sum(r["spag_bytes"] for r in off[-10:]) / len(off[-10:]),
      "replica_ratio_off_last10": (sum(r["spag_bytes"] for r in off[-10:])
                                   / max(sum(r["spag_bytes_plain"] for r in off[-10:]), 1.0)),
      "settled_from": settled.start + 1,
      "replica_ratio_settled": (sum(r["spag_bytes"] for r in auto[settled])
                                / max(sum(r["spag_bytes_plain"] for r in auto[settled]), 1.0)),
      "replica_bytes_settled": float(np.mean([r["spag_bytes"] for r in auto[settled]])),
      "replica_bytes_off_settled": float(np.mean([r["spag_bytes"] for r in off[settled]])),
      # the balance the replicas buy: the busiest device's expert rows over the mean
      "straggler_last10": sum(r["straggler"] for r in last) / len(last),
      "straggler_off_last10": sum(r["straggler"] for r in off[-10:]) / len(off[-10:]),
      # each run's wall time, compiles included (auto's recompiles at its decisions too):
      # not a step-time comparison (bench/step.py's codec rows are)
      "seconds_off": runs["off"]["seconds"], "seconds_auto": runs["auto"]["seconds"]}


def print_composed(c: dict):
  print(f"\n== composed: codec auto (warm-up {c['warmup']}, transport {c['transport']}) + "
        f"fssdp 2 x 4 + reroute, {c['steps']} steps, against codec off ==")
  print(f"  losses equal bit for bit: {c['losses_equal']}; replicas delta-coded: "
        f"{c['replica_codec']}")
  print(f"  parameter gathers, last 10 steps: {c['gather_ratio_last10']:.3f} of plain; most "
        f"over plain in a step: {c['max_gather_excess_bytes']:.0f} B (the agreements)")
  print(f"  replicas (SparseAllGather), last 10 steps: {c['replica_ratio_last10']:.3f} of plain "
        f"(codec off: {c['replica_ratio_off_last10']:.3f}); most over plain in a step: "
        f"{c['max_replica_excess_bytes']:.0f} B (the agreement); per step "
        f"{c['replica_bytes_last10']:.0f} B ({c['replica_bytes_off_last10']:.0f} B with the "
        f"codec off)")
  print(f"  replicas over steps {c['settled_from']}-{c['steps']}: {c['replica_ratio_settled']:.3f} "
        f"of plain; per step {c['replica_bytes_settled']:.0f} B "
        f"({c['replica_bytes_off_settled']:.0f} B with the codec off)")
  print(f"  straggler (busiest device's expert rows / mean), last 10 steps: "
        f"{c['straggler_last10']:.3f} ({c['straggler_off_last10']:.3f} with the codec off)")
  print(f"  wall, compiles included (no step-time comparison): {c['seconds_off']:.1f} s off, "
        f"{c['seconds_auto']:.1f} s auto")


def print_regime(reg, block_size):
  rows, names = reg["rows"], list(reg["results"])
  first, measured = reg["first"], reg["measured"]
  print(f"\n== {reg['name']}: steps {measured.start}-{measured.stop - 1}, decisions after step "
        f"{first} and every {reg['every']} steps ==")
  print(f"change rates per gather (exponent; blocks of at most {block_size} per shard (its "
        "blocks made even), what the codec "
        f"sees; block of {FULL_BLOCK} over whole tensors; whole word; values too far for a delta "
        "code of 2, 3, 4 bits; values moving more than 127 units in the last place):")
  head = ("group", "values", "exp", f"blk{block_size}", f"blk{FULL_BLOCK} full", "word",
          "esc delta2", "esc delta3", "esc delta4", "far >127")
  print(" | ".join(f"{h:>12}" for h in head))
  for report in GROUPS + ("total",):
    mask = [report == "total" or param_group(*k) == report for k in rows.names]
    values = int(sum(rows.plain[mask] / 2) * 8)
    if report not in reg["rates"]:
      print(" | ".join(f"{c:>12}" for c in (report,) + ("-",) * (len(head) - 1)))
      continue
    r = reg["rates"][report]
    print(" | ".join(f"{c:>12}" for c in (
        report, values, f"{100 * r[0]:.2f}%", f"{100 * r[1]:.1f}%",
        f"{100 * reg['full_block'].get(report, float('nan')):.1f}%", f"{100 * r[2]:.1f}%",
        *(f"{100 * q:.1f}%" for q in r[3:]))))
  for title, res in (("all measured steps", reg["results"]),
                     (f"last {reg['late_steps']} steps", reg["late"])):
    print(f"\nbytes sent / plain bf16, {title} (B/param = bytes per parameter value):")
    print(" | ".join(f"{h:>13}" for h in ("group",) + tuple(names)))
    for report in GROUPS + ("total",):
      print(" | ".join(f"{c:>13}" for c in (report,) + tuple(
          f"{res[n][report]:.3f}" if report in res[n] else "-" for n in names)))
    print(" | ".join(f"{c:>13}" for c in ("B/param",) + tuple(
        f"{2 * res[n]['total']:.2f}" for n in names)))
    print(" | ".join(f"{c:>13}" for c in ("worst param",) + tuple(
        f"{res[n]['worst_param']:.3f}" for n in names)))
  runs = reg["runs"]
  print(" | ".join(f"{c:>13}" for c in ("fallbacks",) + tuple(
      str(runs[n].fallbacks) for n in names)))
  print(" | ".join(f"{c:>13}" for c in ("cache KB",) + tuple(
      f"{runs[n].peak_cache / 1e3:.0f}" for n in names)))
  for mode in codec.COMPRESSED_MODES:
    print(" | ".join(f"{c:>13}" for c in (f"  {mode} KB",) + tuple(
        f"{runs[n].cache.get(mode, 0) / 1e3:.0f}" for n in names)))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="fewer steps (about three minutes with the composed run)")
  parser.add_argument("--steps_high", type=at_least(1), default=None,
                      help="steps at the preset's lr (default 200, 60 with --quick); more than "
                      "the codec's warm-up + 1, so that a decision is made")
  parser.add_argument("--steps_low", type=at_least(1), default=None,
                      help="steps at the fine-tuning lr (default 100, 40 with --quick)")
  parser.add_argument("--reselect_every", type=at_least(1), default=10,
                      help="codec.reselect_every of the controlled modes")
  parser.add_argument("--budget_kb", type=float, default=None,
                      help="auto's codec.cache_budget_bytes, in KB per device (default: the bf16 "
                      "bytes of the gathered parameters, one whole-value cache of all of them)")
  parser.add_argument("--capacity_margin", type=float, default=None,
                      help="codec.capacity_margin (default: the preset's)")
  parser.add_argument("--low_lr", type=float, default=LOW_LR, help="the fine-tuning lr")
  parser.add_argument("--check", action="store_true",
                      help="also with --quick: train again with auto in the train step")
  parser.add_argument("--composed_steps", type=at_least(10), default=60,
                      help="steps of the composed run (its figures are over the last 10)")
  parser.add_argument("--transport", default="auto", choices=codec.TRANSPORTS,
                      help="codec.transport of --composed")
  parser.add_argument("--composed", action="store_true",
                      help="only the composed run (codec auto + fssdp + reroute, "
                      "--composed_steps steps)")
  args = parser.parse_args()
  if args.composed:
    c = composed(steps=args.composed_steps, transport=args.transport)
    print_composed(c)
    print(json.dumps({f"composed_{k}": v for k, v in c.items()}))
    return
  overrides = {} if args.capacity_margin is None else {
      "codec.capacity_margin": args.capacity_margin}
  steps_high = args.steps_high if args.steps_high is not None else (60 if args.quick else 200)
  steps_low = args.steps_low if args.steps_low is not None else (40 if args.quick else 100)
  every = args.reselect_every
  t_start = time.perf_counter()

  cfg_high = config(steps_high, **overrides)
  if steps_high <= cfg_high.codec.warmup_steps + 1:
    parser.error(f"argument --steps_high: must be more than the codec's warm-up + 1 "
                 f"({cfg_high.codec.warmup_steps + 1}) for a decision, got {steps_high}")
  if steps_low <= codec_control.PROBE_STEPS + 2:
    parser.error(f"argument --steps_low: must be more than {codec_control.PROBE_STEPS + 2} "
                 f"(the probe's steps + 2) for a decision, got {steps_low}")
  block_size = cfg_high.codec.block_size
  data = make_data(DataSpec(seed=cfg_high.seed), batch_size=cfg_high.batch_size,
                   seq_len=cfg_high.seq_len)
  high_trainer = Trainer(cfg_high)
  budget = (int(args.budget_kb * 1000) if args.budget_kb is not None
            else model_bf16_bytes(high_trainer.layout.gatherer))
  print(f"high lr: {steps_high} steps, the codec's change counts every step ...", flush=True)
  high = run_regime("high: peak lr 3e-3 from scratch", high_trainer, high_trainer.init_state(),
                    data, steps_high, cfg_high.codec.warmup_steps, every, budget, block_size)
  cfg_low = config(steps_low, **overrides, **{"optim.lr": args.low_lr,
                                              "optim.warmup_steps": 0, "optim.min_lr_ratio": 1.0})
  low_trainer = Trainer(cfg_low)
  state = high["state"].replace(step=jnp.zeros_like(high["state"].step))
  print(f"low lr: {steps_low} steps ...", flush=True)
  low = run_regime(f"low: constant lr {args.low_lr:g}, continuing from it", low_trainer, state,
                   data,
                   steps_low, codec_control.PROBE_STEPS + 2, every, budget, block_size)
  data.train.close()

  print(f"\nTiny preset, {jax.device_count()} fake {jax.default_backend()} devices, block size "
        f"{block_size}, capacity margin {cfg_high.codec.capacity_margin:g}; gains priced in bytes; "
        f"auto under a {budget / 1e3:.0f} KB cache budget per device (and half that: "
        f"'{HALF}'); bytes include every "
        "dense gather (refills after a change of mode, fallbacks)")
  for reg in (high, low):
    print_regime(reg, block_size)
  print("\nauto's last choice per parameter (high / low), with the capacity in % of its units:")
  for i, (g, p) in enumerate(high["names"]):
    describe = lambda s: (f"{s.spec.rate_kind} {100 * s.spec.capacity_fraction:.1f}%"  # noqa: E731
                          if s.selected else f"plain ({s.reason})")
    print(f"  {g + p:<30} {describe(high['last_choice']['auto'][1][i]):<24} "
          f"{describe(low['last_choice']['auto'][1][i])}")

  profiled = codec_control.profile_comm(high_trainer.mesh)
  print(f"\nThis mesh's all-gather, profiled: {profiled.alpha * 1e6:.0f} us + "
        f"{profiled.beta * 1e9:.2f} ns/B per collective. Priced in seconds with it, auto would "
        f"compress {_count_profiled(high, profiled)} of {len(high['names'])} parameters of the "
        "tiny model (its shards are a few KB; one collective's latency is worth tens of KB).")

  tp = throughput()
  print("\nEncode / decode on this CPU, jnp reference path (2^20 bf16 values per shard, 8 "
        "devices; GB/s of shard bytes in, of gathered bytes out):")
  print(f"  plain copy  {tp['copy_encode_gbs']:.2f} (shard)  {tp['copy_decode_gbs']:.2f} "
        "(gathered)")
  for mode in FIXED:
    enc, dec = tp[f"{mode}_encode_gbs"], tp[f"{mode}_decode_gbs"]
    print(f"  {mode:<8}    encode {enc:.3f} ({enc / tp['copy_encode_gbs']:.3f}x copy)  decode "
          f"{dec:.3f} ({dec / tp['copy_decode_gbs']:.2f}x copy)")

  checks = {}
  if args.check or not args.quick:   # the high run again, with the codec in the train step
    data = make_data(DataSpec(seed=cfg_high.seed), batch_size=cfg_high.batch_size,
                     seq_len=cfg_high.seq_len)
    checks["high"], state = check_auto(cfg_high, None, data, steps_high,
                                       cfg_high.codec.warmup_steps, every, budget)
    if not args.quick:
      state = state.replace(step=jnp.zeros_like(state.step))
      checks["low"], _ = check_auto(cfg_low, state, data, steps_low,
                                    codec_control.PROBE_STEPS + 2, every, budget)
    data.train.close()
    for name, reg in (("high", high), ("low", low)):
      if name in checks:
        print(f"\nauto in the train step, {name}: {checks[name]:.4f} of plain measured, "
              f"{reg['results']['auto']['total']:.4f} from the probe counts")

  print(f"composed run ({args.composed_steps} steps, codec off then auto) ...", flush=True)
  comp = composed(steps=args.composed_steps, transport=args.transport)
  print_composed(comp)

  h, lo = high["results"], low["results"]
  figures = {
      **{f"composed_{k}": v for k, v in comp.items()},
      **{f"bytes_ratio_auto_{k}lr_trained": v for k, v in checks.items()},
      "steps_high": steps_high, "steps_low": steps_low, "reselect_every": every,
      "bytes_ratio_block": h["block"]["total"], "bytes_ratio_element": h["element"]["total"],
      "bytes_ratio_word": h["word"]["total"], "bytes_ratio_delta": h["delta"]["total"],
      "bytes_ratio_auto_highlr": h["auto"]["total"],
      "bytes_ratio_delta_experts": h["delta"]["experts"],
      "bytes_ratio_auto_highlr_late": high["late"]["auto"]["total"],
      "bytes_ratio_block_experts": h["block"]["experts"],
      "bytes_ratio_element_experts": h["element"]["experts"],
      "bytes_ratio_element_experts_late": high["late"]["element"]["experts"],
      "bytes_ratio_element_all": h["element (all)"]["total"],
      "bytes_ratio_block_all": h["block (all)"]["total"],
      "bytes_ratio_word_lowlr": lo["word"]["total"], "bytes_ratio_auto_lowlr": lo["auto"]["total"],
      "bytes_ratio_element_lowlr": lo["element"]["total"],
      "bytes_ratio_delta_lowlr": lo["delta"]["total"],
      "worst_param_auto_highlr": h["auto"]["worst_param"],
      "worst_param_auto_lowlr": lo["auto"]["worst_param"],
      "cache_bytes_auto_highlr": high["runs"]["auto"].peak_cache,
      "cache_bytes_auto_lowlr": low["runs"]["auto"].peak_cache,
      "bytes_ratio_auto_half_budget_highlr": h[HALF]["total"],
      "bytes_ratio_auto_half_budget_lowlr": lo[HALF]["total"],
      "cache_budget_bytes": budget,
      "exp_change_rate_highlr": float(high["rates"]["total"][0]),
      "exp_change_rate_lowlr": float(low["rates"]["total"][0]),
      "word_change_rate_highlr": float(high["rates"]["total"][2]),
      "word_change_rate_lowlr": float(low["rates"]["total"][2]),
      "profiled_alpha_s": profiled.alpha, "profiled_beta_s_per_byte": profiled.beta,
      **{k: float(v) for k, v in tp.items()},
      "wall_s": time.perf_counter() - t_start,
  }
  print(json.dumps(figures))


def _count_profiled(reg, comm):
  """Parameters auto would compress at its last decision with gains priced in seconds by
  `comm`."""
  cfg = dataclasses.replace(reg["base"], mode="auto")
  rates = reg["last_choice"]["auto"][0]
  return sum(s.selected for s in codec_control.choose(reg["gatherer"], rates, cfg, comm))


if __name__ == "__main__":
  main()
