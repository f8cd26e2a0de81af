"""Compiles moejax's train step for GPUs on a machine without one, and reads its schedule.

XLA:GPU compiles for a described device (`scripts/gpu_targets/NAME.txtpb`) once jax's CUDA
plugin is installed (`bash scripts/setup_gpu_compile.sh`, about 140 MB, not part of the test
set-up); nothing runs. Per variant it prints what the GPU program does with its collectives:
how many are async, how many matmul kernels lie between each async start and done (the compute
it can hide behind), which run synchronously (XLA:GPU makes a pair with nothing between it
synchronous), each schedule priced by moejax's cost model (`moejax.perf.latencies`: the step,
its compute by part of the model (moejax's named scopes, `profiling.scope_of`) and, with
`--lines N`, by the N dearest moejax source lines (each instruction's innermost moejax frame,
`profiling.hlo_sources`, times its loops' trip counts and a conditional's branch by one over
the branches, as everything is priced: the forward's lines; the backward of the
prefetched layers carries the frame that differentiates them, `sharding/prefetch.py`'s scan),
its collectives, what of them no compute covers and the most exposed by name), and XLA's memory per
device. The GPU check (`scripts/device_check.sh`, step `schedule8`) reads the same figures from
a compile on a real GPU.

  python scripts/gpu_schedule.py                          # tiny preset, 8 H200s, the GPU
                                                          # check's three variants
  python scripts/gpu_schedule.py --preset 1b7b --set batch_size=8 --set seq_len=1024
  python scripts/gpu_schedule.py --variant fsdp --xla-flags=--xla_gpu_enable_foo=true
  python scripts/gpu_schedule.py --latencies both         # XLA's own estimate beside moejax's
                                                          # (config schedule_latencies=model)
  python scripts/gpu_schedule.py --variant fssdp_coded_replicas --lines 15   # where it goes

The experts are jax's Hopper grouped-matmul kernels, as on the GPU itself: moejax chooses them
from the local device's compute capability, here the target's (`placement.hopper.lowering_for`;
`--experts ragged_dot` compiles XLA's `ragged_dot` instead, whose dense rewrite over every expert
is many times the routed work and its memory). Attention takes XLA's form, not cuDNN's (chosen
from the default backend; cuDNN's graphs are built at compile time from the library, which is
not here). The GPU check times the kernels. Without a device XLA cannot autotune, and a GEMM fusion
with no default configuration stops that variant's compile (the tiny preset on 16 GPUs does;
1b7b's shapes on 8 and 16 compile).
"""
from __future__ import annotations

import argparse
import ast
import gzip
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN_DIR = os.path.join(REPO, ".gpu_compile")
TARGETS = os.path.join(REPO, "scripts", "gpu_targets")


def _parse_set(text: str):
  key, sep, value = text.partition("=")
  if not sep or not key:
    raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, e.g. batch_size=8")
  try:
    return key, ast.literal_eval(value)
  except (ValueError, SyntaxError):
    return key, value          # a bare string, e.g. moe.placement=ep


def parse_args(argv=None, variants=()):
  targets = sorted(f[:-len(".txtpb")] for f in os.listdir(TARGETS) if f.endswith(".txtpb"))
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--preset", default="tiny",
                 help="configs/olmoe.py preset, or FAMILY:PRESET of another family's config "
                      "(gpt_oss:20b) (default: tiny)")
  p.add_argument("--max-period", type=int, default=None,
                 help="the longest repeating pattern of layers scanned as one period "
                      "(olmoe.MAX_PERIOD; 1: one scan per run of equal layers, for comparison)")
  p.add_argument("--gpus", type=int, default=8, help="GPUs, 8 per node (default: 8)")
  p.add_argument("--target", default="h200", choices=targets, help="the GPU (default: h200)")
  p.add_argument("--variant", action="append", choices=list(variants), default=[],
                 help="repeatable (default: all): the GPU check's schedule8 variants")
  p.add_argument("--set", action="append", type=_parse_set, default=[], metavar="KEY=VALUE",
                 help="a config override for every variant, e.g. --set seq_len=1024")
  p.add_argument("--experts", choices=("hopper", "ragged_dot"), default="hopper",
                 help="the experts' grouped matmuls: jax's Hopper kernels, as on the target GPU, or "
                      "XLA's ragged_dot (dense over every expert on XLA:GPU) (default: hopper)")
  p.add_argument("--latencies", default="xla", choices=["xla", "model", "both"],
                 help="what XLA's scheduler places collectives by: its own estimate, moejax's "
                      "cost model (config schedule_latencies=model), or both side by side "
                      "(default: xla)")
  p.add_argument("--xla-flags", default="", help="XLA flags added for the compile")
  p.add_argument("--out", help="write each variant's compiled HLO here (VARIANT.hlo.gz)")
  p.add_argument("--lines", type=int, default=0, metavar="N",
                 help="also print the N moejax source lines of the dearest priced compute "
                      "(default: 0)")
  args = p.parse_args(argv)
  if args.lines < 0:
    p.error(f"argument --lines: must be >= 0, got {args.lines}")
  if args.max_period is not None and args.max_period < 1:
    p.error(f"argument --max-period: must be >= 1, got {args.max_period}")
  if ":" in args.preset:
    sys.path.insert(0, REPO)
    from moejax.families import FAMILIES
    family = args.preset.split(":", 1)[0]
    if family not in FAMILIES:
      p.error(f"argument --preset: no family {family!r}; one of {', '.join(FAMILIES)}")
  if args.gpus < 1 or (args.gpus > 8 and args.gpus % 8):
    p.error(f"argument --gpus: {args.gpus}: 1 to 8, or a multiple of 8 (8 GPUs a node)")
  return args


def _topology(args):
  import jax  # noqa: F401  (after the plugin's path and the flags are set)
  from jax.experimental import topologies
  shape = f"1x1x{args.gpus}" if args.gpus <= 8 else f"1x{args.gpus // 8}x8"
  with open(os.path.join(TARGETS, f"{args.target}.txtpb")) as f:
    target = f.read()
  return topologies.get_topology_desc(shape, "cuda", topology=shape, target_config=target)


def _target_gpu(name: str):
  """`placement.hopper.Target` from the target description's compute capability and SMs."""
  import re
  from moejax.placement import hopper
  with open(os.path.join(TARGETS, f"{name}.txtpb")) as f:
    text = f.read()
  cc = re.search(r"cuda_compute_capability\s*{([^}]*)}", text)
  major, minor = (re.search(rf"{k}:\s*(\d+)", cc[1]) if cc else None for k in ("major", "minor"))
  cores = re.search(r"core_count:\s*(\d+)", text)
  if major is None or cores is None:
    raise ValueError(f"{name}.txtpb: no cuda_compute_capability major or core_count")
  return hopper.Target(f"{major[1]}.{minor[1] if minor else 0}", int(cores[1]))


def _config(preset: str, **overrides):
  """configs/olmoe.py's `preset`, or FAMILY:PRESET's, with dotted overrides."""
  import device_check
  if ":" not in preset:
    return device_check._config(preset, **overrides)
  import importlib
  from moejax.config import from_config_dict
  from moejax.families import config_file
  family, name = preset.split(":", 1)
  cd = importlib.import_module(config_file(family)[:-len(".py")].replace("/", ".")).get_config(
      name)
  cd.update_from_flattened_dict(overrides)
  return from_config_dict(cd)


def compile_variant(overrides: dict, args, devices, latencies: str = "xla") -> tuple[dict, str]:
  """One variant compiled with `latencies` ("xla" or "model": config schedule_latencies)."""
  import device_check
  from moejax.perf import latencies as _latencies
  from moejax.sharding.mesh import make_mesh
  from moejax.train.latency_profile import ModelScheduledStep, cluster_for
  from moejax.train.loop import Trainer
  from tests.sharding import hlo
  sets = dict(args.set)
  cfg = _config(args.preset, **{"mesh.shape": (1, args.gpus), **overrides, **sets,
                                "schedule_latencies": latencies})
  start = time.perf_counter()
  trainer = Trainer(cfg, mesh=make_mesh(tuple(cfg.mesh.shape), devices))
  # an ep/fssdp step with bounded buffers: the jitted step at its current capacity
  step = trainer.train_step.jitted() if hasattr(trainer.train_step, "jitted") else \
      trainer.train_step
  found = None
  if isinstance(step, ModelScheduledStep):
    scheduled = step.compile(*trainer.abstract_inputs())
    compiled, found = scheduled.compiled, round(scheduled.names_found, 4)
    pricer = step
  else:
    compiled = step.lower(*trainer.abstract_inputs()).compile()
    pricer = ModelScheduledStep(step, cluster_for("auto", devices[0]), len(devices))
  text = compiled.as_text()
  from moejax.profiling import hlo_sources, scope_of
  line_of = ({name: line for name, (_, line) in hlo_sources(text).items()} if args.lines
             else None)
  priced = _latencies.schedule_time(text, pricer.price(text), scope_of, line_of)
  memory = compiled.memory_analysis()
  branches = [b for b in hlo.conditional_branches(text) if b.collectives]
  return {**device_check._async_pairs(text),
          "collectives_in_conditional_branches": sum(len(b.collectives) for b in branches),
          "priced_ms": {**priced.as_ms(), "cluster": pricer.cluster.name},
          "most_exposed": priced.most_exposed(),
          "compute_ms_by_part": {part: round(seconds * 1e3, 2)
                                 for part, seconds in priced.compute_by_part.items()},
          **({"compute_ms_by_line": {line: round(seconds * 1e3, 2) for line, seconds
                                     in list(priced.compute_by_line.items())[:args.lines]}}
             if args.lines else {}),
          **({"profile_names_found": found} if found is not None else {}),
          "memory_gb": {k: round(getattr(memory, f"{k}_size_in_bytes") / 1e9, 2)
                        for k in ("temp", "argument", "output", "alias")},
          "compile_s": round(time.perf_counter() - start, 1)}, text


def _print(name: str, figures: dict) -> None:
  print(f"{name} (compiled in {figures['compile_s']} s)")
  ops = sorted(set(figures["async_pairs"]) | set(figures["sync_collectives"]))
  print(f"  {'op':20s} {'async':>6s} {'sync':>5s}  matmuls between start and done "
        "(median / max)")
  for op in ops:
    n = figures["async_pairs"].get(op, 0)
    between = (f"{figures['matmuls_between'][op]:g} / {figures['matmuls_between_max'][op]}"
               if n else "-")
    kind = "  (async copies, not collectives)" if op == "fusion" else ""
    print(f"  {op:20s} {n:6d} {figures['sync_collectives'].get(op, 0):5d}  {between}{kind}")
  print(f"  collectives in a conditional's branch: "
        f"{figures['collectives_in_conditional_branches']}")
  waiting = figures["loop_collectives_after_matmuls"]
  print("  in a loop body, waiting on its iteration's matmuls: "
        + (", ".join(f"{op} {n}" for op, n in waiting.items()) or "none"))
  priced = figures["priced_ms"]
  print(f"  priced by moejax's model ({priced['cluster']}): step {priced['step']} ms, compute "
        f"{priced['compute']} ms, collectives {priced['collectives']} ms of which exposed "
        f"{priced['exposed']} ms" + (f"; {figures['profile_names_found']:.1%} of the profile's "
                                     "names found after" if "profile_names_found" in figures
                                     else ""))
  parts = figures["compute_ms_by_part"]
  print("  compute by part (moejax's scopes): " + ", ".join(
      f"{part} {ms}" for part, ms in list(parts.items())[:8]) + " ms")
  if figures.get("compute_ms_by_line"):
    print("  compute by moejax source line:")
  for line, ms in figures.get("compute_ms_by_line", {}).items():
    print(f"    {ms:8.2f} ms  {line}")
  for e in figures["most_exposed"]:
    print(f"    exposed {e['exposed_ms']} of {e['ms']} ms: {e['name']}"
          + (f" ({e['op_name']})" if e["op_name"] else ""))
  mem = figures["memory_gb"]
  print(f"  XLA's memory per device: temp {mem['temp']} GB, arguments {mem['argument']} GB, "
        f"outputs {mem['output']} GB ({mem['alias']} GB of them aliased)", flush=True)


def main(argv=None) -> int:
  sys.path[:0] = [REPO, os.path.join(REPO, "scripts")]
  import device_check
  args = parse_args(argv, device_check.SCHEDULE8)
  if not os.path.isdir(os.path.join(PLUGIN_DIR, "jax_plugins")):
    print(f"gpu_schedule: jax's CUDA plugin is not in {PLUGIN_DIR}: run "
          "bash scripts/setup_gpu_compile.sh", file=sys.stderr)
    return 2
  # Before jax starts: the plugin on the path, the host platform for everything but the compile
  # (no GPU here), the flags, and no autotuning (it would need the device).
  sys.path.insert(0, PLUGIN_DIR)
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = " ".join(
      [os.environ.get("XLA_FLAGS", ""), "--xla_gpu_autotune_level=0", args.xla_flags]).strip()
  devices = list(_topology(args).devices)
  if args.max_period is not None:
    from moejax.models import olmoe
    olmoe.MAX_PERIOD = args.max_period
  print(f"gpu_schedule: {args.preset} preset on {len(devices)} x {devices[0].device_kind} "
        f"(compiled, not run), overrides {dict(args.set) or 'none'}, experts {args.experts}",
        flush=True)
  import contextlib
  from moejax.placement import hopper
  out = {}
  modes = ["xla", "model"] if args.latencies == "both" else [args.latencies]
  with contextlib.ExitStack() as stack:
    if args.experts == "hopper":
      stack.enter_context(hopper.lowering_for(_target_gpu(args.target)))
    _compile_all(args, devices, modes, device_check.SCHEDULE8, out)
  print(json.dumps({"bench": "gpu_schedule", "preset": args.preset, "gpus": args.gpus,
                    "target": args.target, "experts": args.experts, "latencies": args.latencies,
                    "overrides": dict(args.set), "xla_flags": os.environ["XLA_FLAGS"],
                    "variants": out}))
  return 1 if any("error" in v for v in out.values()) else 0


def _compile_all(args, devices, modes, variants, out) -> None:
  for variant in args.variant or list(variants):
    for mode in modes:
      name = variant if mode == "xla" else f"{variant}+model_latencies"
      try:
        out[name], text = compile_variant(variants[variant], args, devices, mode)
      except Exception as e:   # one variant's failure does not hide the others'
        out[name] = {"error": f"{type(e).__name__}: {e}"[:1500]}
        print(f"{name}: {out[name]['error']}", flush=True)
        continue
      _print(name, out[name])
      if args.out:
        os.makedirs(args.out, exist_ok=True)
        with gzip.open(os.path.join(args.out, f"{name}.hlo.gz"), "wt") as f:
          f.write(text)


if __name__ == "__main__":
  sys.exit(main())
