"""python -m moejax.perf: project a preset's step time on a cluster over GPU counts.

  python -m moejax.perf --config configs/olmoe.py:1b7b --cluster ciera-a100 \\
      --gpus 8,16,32,64,128 [--metrics WORKDIR/metrics.jsonl] [--plot projection.png]

Prints a table of step time (compute, straggler wait, framework, codec kernels and exposed
communication by kind, in ms), the speedup over the first system and memory per GPU, for each
GPU count and system, and writes a PNG plot. Systems default by the config's placement: fsdp
-> zero3, ciera, fsdp, moejax-block, moejax-auto (or the codec mode the config sets); ep or
fssdp -> moejax-ep, moejax-fssdp, uniform. `--metrics` reads a run's codec byte ratios
(gather_bytes / gather_bytes_plain, per group) and routing skew (load_max / load_mean per
layer) instead of bench/codec.py's figures and synthetic traces. Calibration: the committed
figures of moejax/perf/data/calibration.json (bench/projection.py fits them).
Exit code 2 with one line `error: ...` on bad input.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys

from moejax.perf import calibrate as cb
from moejax.perf import codec as cd
from moejax.perf import loads as ld
from moejax.perf import report
from moejax.perf.hardware import CLUSTERS, get_cluster
from moejax.perf.model import Run
from moejax.perf.shapes import SHAPES, get_shape, shape_of
from moejax.perf.step import step_time
from moejax.perf.systems import get_system


def load_config(spec: str):
  """`path.py[:arg]` -> moejax Config (the file's get_config(arg), validated)."""
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise ValueError(f"--config {spec}: no such file {path}")
  from moejax.config import from_config_dict
  from moejax.errors import MoejaxError
  mod_spec = importlib.util.spec_from_file_location("_perf_config", path)
  module = importlib.util.module_from_spec(mod_spec)
  try:
    mod_spec.loader.exec_module(module)
  except Exception as e:  # noqa: BLE001  a config file can raise anything; the message is enough
    raise ValueError(f"--config {spec}: {path} failed to load ({type(e).__name__}: {e})") from None
  if not callable(getattr(module, "get_config", None)):
    raise ValueError(f"--config {spec}: {path} defines no get_config(), which moejax config "
                     "files provide")
  try:
    return from_config_dict(module.get_config(arg or None))
  except MoejaxError as e:
    raise ValueError(f"--config {spec}: {e}") from None


def _parser():
  p = argparse.ArgumentParser(prog="python -m moejax.perf", description=__doc__.split("\n")[0])
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--config", help="moejax config file[:preset], e.g. configs/olmoe.py:1b7b")
  src.add_argument("--model", help=f"a perf-only shape: {', '.join(SHAPES)}")
  p.add_argument("--layers", type=int, default=0, help="use only this many layers (0: all)")
  p.add_argument("--cluster", default="ciera-a100", help=f"one of {', '.join(CLUSTERS)}")
  p.add_argument("--gpus", default="8,16,32,64,128", help="comma-separated GPU counts")
  p.add_argument("--systems", default="", help="comma-separated systems (moejax.perf.systems)")
  p.add_argument("--seq-len", type=int, default=0,
                 help="0 (default): the config's seq_len, or 4096 with --model")
  p.add_argument("--tokens-per-gpu", type=float, default=0,
                 help="default: 2 sequences (weak scaling)")
  p.add_argument("--metrics", default="", help="a run's metrics.jsonl")
  p.add_argument("--codec-regime", default="high", choices=sorted(cd.MEASURED_RATIOS),
                 help="bench/codec.py's figures to use without --metrics")
  p.add_argument("--trace", default="synthetic", choices=("synthetic", "recorded"),
                 help="ep/fssdp loads: synthetic skew or bench/fssdp.py's recorded trace")
  p.add_argument("--steps", type=int, default=8, help="timed trace steps")
  p.add_argument("--no-remat", action="store_true")
  p.add_argument("--plot", default="projection.png", help="PNG path ('' for none)")
  return p


def _systems(args, cfg) -> list[str]:
  if args.systems:
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in names:
      get_system(s)
    return names
  placement = getattr(getattr(cfg, "moe", None), "placement", "fsdp")
  if placement in ("ep", "fssdp"):
    return ["moejax-ep", "moejax-fssdp", "uniform"]
  mode = getattr(getattr(cfg, "codec", None), "mode", "off")
  names = ["zero3", "ciera", "fsdp", "moejax-block", "moejax-auto"]
  if mode not in ("off", "block", "auto"):
    names.append(f"moejax-{mode}")
  return names


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  try:
    return _run(args)
  except (ValueError, OSError, KeyError) as e:
    msg = e.args[0] if isinstance(e, KeyError) and e.args else e
    print(f"error: {msg}", file=sys.stderr)
    return 2


def _check_numbers(args) -> None:
  """ValueError naming the flag of a number that is not finite or out of range (0 means the
  default where a flag has one)."""
  import math
  for flag, value, low in (("--layers", args.layers, 0), ("--seq-len", args.seq_len, 0),
                           ("--tokens-per-gpu", args.tokens_per_gpu, 0),
                           ("--steps", args.steps, 1)):
    if not (math.isfinite(value) and value >= low):
      raise ValueError(f"{flag}={value}: must be a finite number >= {low}"
                       + (" (0: the default)" if low == 0 else ""))


def _run(args) -> int:
  _check_numbers(args)
  cfg = None
  if args.config:
    cfg = load_config(args.config)
    shape = dataclasses.replace(shape_of(cfg), name=args.config.split("/")[-1])
    seq = args.seq_len or cfg.seq_len
  else:
    shape = get_shape(args.model)
    seq = args.seq_len or 4096
  if args.layers > shape.num_layers:
    raise ValueError(f"--layers={args.layers}: {shape.name} has {shape.num_layers} layers "
                     "(0: all of them)")
  if args.layers:
    shape = shape.with_layers(args.layers)
  if args.plot and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
    raise ValueError(f"--plot {args.plot}: no such directory "
                     f"{os.path.dirname(os.path.abspath(args.plot))}")
  cluster = get_cluster(args.cluster)
  try:
    gpus = [int(g) for g in args.gpus.split(",")]
  except ValueError:
    raise ValueError(f"--gpus {args.gpus!r}: expected comma-separated integers") from None
  if not gpus or min(gpus) < 1:
    raise ValueError(f"--gpus {args.gpus!r}: expected positive integers")
  if 0 < args.tokens_per_gpu < 1:
    raise ValueError(f"--tokens-per-gpu={args.tokens_per_gpu}: must be at least 1 (0: the "
                     "default)")
  tokens = args.tokens_per_gpu or 2 * seq
  calib = cb.load_fitted()
  systems = _systems(args, cfg)
  ratios = skew = None
  if args.metrics:
    records = ld.read_metrics(args.metrics)
    warm = getattr(getattr(cfg, "codec", None), "warmup_steps", 30) if cfg else 30
    try:
      ratios = cd.ratios_from_metrics(records, skip_steps=warm)
      print(f"codec byte ratio {ratios.default:.3f} of plain ({ratios.source})")
    except ValueError as e:
      print(f"metrics: no codec figures ({e}); using bench/codec.py's")
    try:
      skew = ld.skew_from_metrics(records)
      print(f"routing skew load_max/load_mean: mean {skew.mean():.2f} over {skew.shape[0]} "
            f"logged steps and {skew.shape[1]} layers")
      run_experts = ld.experts_in_metrics(records)
      if run_experts is not None and run_experts != shape.num_experts:
        print(f"note: the metrics' run routed {run_experts} experts per layer and "
              f"{shape.name} has {shape.num_experts}: its skew (the hottest expert's load over "
              "the mean) is applied as measured")
    except ValueError:
      skew = None
  rows = []
  for n in gpus:
    run = Run(n, tokens, seq, remat=not args.no_remat)
    trace = None
    for name in systems:
      system = get_system(name)
      kw = {}
      if system.family == "ep":
        if shape.num_experts % n and n % shape.num_experts:
          raise ValueError(f"{shape.num_experts} experts do not divide over {n} GPUs")
        if trace is None:
          trace = _trace(args, shape, n, int(tokens), skew)
        kw["trace"] = trace
      elif ratios is not None and system.codec in cd.CACHE_BYTES_PER_VALUE:
        kw["ratios"] = ratios
      elif system.codec in cd.CACHE_BYTES_PER_VALUE:
        kw["ratios"] = cd.measured(system.codec, args.codec_regime)
      rows.append({"gpus": n, "system": name, "result": step_time(shape, cluster, run, system,
                                                                 calib, **kw)})
  total = shape.total_params()
  size = f"{total / 1e9:.2f}B" if total >= 1e9 else f"{total / 1e6:.2f}M"
  print(f"{shape.name}: {size} parameters, {shape.num_layers} layers; "
        f"{cluster.name}; {tokens:.0f} tokens per GPU, seq {seq}; ms per step")
  hbm_gb = cluster.gpu.hbm_bytes / 1e9
  print(report.table(rows, baseline=systems[0], hbm_gb=hbm_gb))
  if report.over_memory(rows, hbm_gb):
    print(f"note: * the state alone needs more memory per GPU than the {cluster.gpu.kind}'s "
          f"{hbm_gb:.0f} GB")
  # Activations and exchange buffers come from moejax.train.memory, which plans moejax's own
  # step from a config (train imports perf: perf does not import it back).
  full = ("python train.py --config FILE:PRESET --memory_on_devices=N" if cfg is None
          else f"python train.py --config {args.config} --memory_on_devices=N")
  print("note: GB/GPU is the state: parameters, optimizer state, gradients, gathered weights, "
        f"replicas and codec caches; activations and exchange buffers come on top ({full} "
        "gives moejax's step whole, by component)")
  if not calib.calibrated_gpu(cluster.gpu.kind):
    print(f"note: no measured point on {cluster.gpu.kind}: its efficiency is the A100's "
          f"({calib.gpu('a100'):.2f})")
  if args.plot:
    report.plot([{"title": f"{shape.name} on {cluster.name}", "rows": rows}], args.plot)
    print(f"wrote {args.plot}")
  return 0


def _trace(args, shape, n, tokens, skew):
  layers = shape.moe_layers
  steps = args.steps + 5
  if skew is not None:
    reps = -(-steps // skew.shape[0])
    import numpy as np
    s = np.tile(skew, (reps, 1))[:steps]
    if s.shape[1] != layers:
      s = np.resize(s.mean(1, keepdims=True), (steps, layers))
    return ld.trace_from_skew(s, shape.num_experts, shape.top_k, n, tokens)
  if args.trace == "recorded":
    counts, _ = ld.load_recorded()
    import numpy as np
    reps = -(-layers // counts.shape[1])
    counts = np.concatenate([counts] * reps, axis=1)[:, :layers]
    return ld.retarget(counts[:steps], shape.num_experts, shape.top_k, n, tokens)
  return ld.synthetic_trace(shape.num_experts, shape.top_k, n, tokens, steps=steps,
                            layers=layers)
