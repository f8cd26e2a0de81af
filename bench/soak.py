"""Soak: a long tiny run, checking that host memory and step time stay flat.

  python bench/soak.py --quick          # 200 steps, about two minutes on 2 busy CPU cores
  python bench/soak.py                  # 2,000 steps (the load run)

Trains the tiny preset with `moejax.train.loop.run` as train.py does, on 8 fake CPU devices with
`codec.mode=auto` (priced in bytes, so the codec is really chosen: `codec.comm_model=bytes`),
a checkpoint every 50 steps (keep 3: every save after the third also prunes) and the default
evaluation every 50 steps, logging every 10 steps (5 with --quick). At every logged step it
samples the process's resident memory (VmRSS, /proc/self/status) beside the step time the loop
logged (the mean over the steps since the last log) and the process's CPU seconds per step since
the last log (user + system: on a machine shared with other work it moves less than wall time).

Compared: the 50 steps after the half-way point ("start") and the last 50 ("end"), each holding
one checkpoint and one evaluation: the medians of the logged steps in each. Memory may grow by
at most 5% and step time by at most 10% (issue 18). The first logged step and the first
half (the codec's decision and its compile, the first checkpoints, allocator warm-up) are
reported but not judged. Prints a table and ends with one JSON line of figures.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import configs.olmoe as olmoe_configs  # noqa: E402
from bench.cli_args import at_least  # noqa: E402
from moejax.config import from_config_dict  # noqa: E402
from moejax.train import loop, metrics  # noqa: E402

RSS_LIMIT, TIME_LIMIT = 1.05, 1.10       # end / start, issue 18


def rss_bytes() -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) * 1024
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024     # not Linux: the peak


class SamplingWriter(metrics.MetricsWriter):
  """The loop's metrics writer, also keeping (step, step time, RSS, wall time) per logged step."""
  samples: list[dict] = []

  def write(self, record: dict) -> None:
    super().write(record)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu, step = usage.ru_utime + usage.ru_stime, int(record["step"])
    last = SamplingWriter.samples[-1] if SamplingWriter.samples else None
    SamplingWriter.samples.append({
        "step": step, "step_time_s": float(record["step_time_s"]), "rss": rss_bytes(),
        "cpu": cpu, "cpu_s_per_step": (cpu - last["cpu"]) / (step - last["step"]) if last else cpu})


def soak_config(steps: int, log_every: int):
  cd = olmoe_configs.get_config("tiny")
  cd.steps = steps
  cd.log_every = log_every
  cd.codec.mode = "auto"
  cd.codec.comm_model = "bytes"
  cd.checkpoint.every = 50
  return from_config_dict(cd)


def window(samples: list[dict], lo: int, hi: int) -> dict:
  """Medians of the logged steps in (lo, hi]."""
  inside = [s for s in samples if lo < s["step"] <= hi]
  return {"steps": f"{lo + 1}-{hi}", "n": len(inside),
          "rss": statistics.median(s["rss"] for s in inside),
          "step_time_s": statistics.median(s["step_time_s"] for s in inside),
          "cpu_s_per_step": statistics.median(s["cpu_s_per_step"] for s in inside)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="200 steps (about two minutes)")
  parser.add_argument("--steps", type=at_least(200), default=None,
                      help="a multiple of 100; default 2000 (200 with --quick)")
  parser.add_argument("--workdir", default=None,
                      help="a new folder for the run (default: a temporary directory)")
  args = parser.parse_args()
  steps = args.steps if args.steps is not None else (200 if args.quick else 2000)
  if steps % 100:
    parser.error(f"argument --steps: must be a multiple of 100, got {steps}")
  if args.workdir and os.path.exists(os.path.join(args.workdir, "checkpoints")):
    parser.error(f"argument --workdir: {args.workdir!r} holds a run already (its checkpoints/ "
                 "would be resumed, not soaked from the start); give a new folder")
  cfg = soak_config(steps, log_every=5 if args.quick else 10)
  load_before = os.getloadavg()[0]

  loop.MetricsWriter = SamplingWriter          # the loop's own writer, sampling as it writes
  rss_before = rss_bytes()
  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory() as tmp:
    workdir = args.workdir or os.path.join(tmp, "soak")
    loop.run(cfg, workdir)
    checkpoints = sorted(int(n) for n in os.listdir(os.path.join(workdir, "checkpoints"))
                         if n.isdigit())
  wall = time.perf_counter() - t0
  samples = SamplingWriter.samples
  first = samples[0]
  start = window(samples, steps // 2, steps // 2 + 50)
  end = window(samples, steps - 50, steps)
  rss_ratio = end["rss"] / start["rss"]
  time_ratio = end["step_time_s"] / start["step_time_s"]
  cpu_ratio = end["cpu_s_per_step"] / start["cpu_s_per_step"]
  rss_ok, time_ok = rss_ratio <= RSS_LIMIT, time_ratio <= TIME_LIMIT
  load_after = os.getloadavg()[0]

  mib = 2 ** 20
  print(f"\nsoak: tiny preset, 8 fake CPU devices, codec.mode=auto, {steps} steps, checkpoint "
        f"every 50 (kept: {checkpoints}), {wall:.0f} s, load average {load_before:.1f} -> "
        f"{load_after:.1f}")
  print(f"{'':9} {'steps':>9} {'logged':>6} {'RSS MiB':>9} {'step s':>8} {'CPU s/step':>10}")
  print(f"{'before':9} {'-':>9} {'-':>6} {rss_before / mib:9.1f} {'-':>8} {'-':>10}")
  print(f"{'first log':9} {first['step']:>9} {1:6d} {first['rss'] / mib:9.1f} "
        f"{first['step_time_s']:8.4f} {'-':>10}   (after the compiling step)")
  for name, w in (("start", start), ("end", end)):
    print(f"{name:9} {w['steps']:>9} {w['n']:6d} {w['rss'] / mib:9.1f} {w['step_time_s']:8.4f} "
          f"{w['cpu_s_per_step']:10.4f}")
  print(f"{'end/start':9} {'':>9} {'':>6} {rss_ratio:9.3f} {time_ratio:8.3f} {cpu_ratio:10.3f}"
        f"   (limits {RSS_LIMIT:.2f} memory, {TIME_LIMIT:.2f} time: "
        f"{'ok' if rss_ok else 'MEMORY GREW'}, {'ok' if time_ok else 'STEP TIME GREW'})")
  print(json.dumps({
      "bench": "soak", "steps": steps, "devices": 8, "codec": "auto", "checkpoint_every": 50,
      "rss_mib_before": rss_before / mib, "rss_mib_first_log": first["rss"] / mib,
      "rss_mib_start": start["rss"] / mib, "rss_mib_end": end["rss"] / mib,
      "rss_ratio": rss_ratio, "step_time_s_start": start["step_time_s"],
      "step_time_s_end": end["step_time_s"], "step_time_ratio": time_ratio,
      "cpu_s_per_step_start": start["cpu_s_per_step"], "cpu_s_per_step_end": end["cpu_s_per_step"],
      "cpu_per_step_ratio": cpu_ratio, "load_avg_before": load_before, "load_avg_after": load_after,
      "rss_ok": rss_ok, "step_time_ok": time_ok,
      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
      "checkpoints_kept": checkpoints, "wall_s": wall}))
  return 0 if rss_ok and time_ok else 1


if __name__ == "__main__":
  sys.exit(main())
