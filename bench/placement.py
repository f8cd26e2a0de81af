"""Expert placement side by side: fsdp and ep on the tiny preset, 8 fake CPU devices.

  python bench/placement.py --quick

Trains the tiny preset once per placement (same seed, same batches, same steps) on a mesh of 8
fake CPU devices. The two train steps compile at once, then their steps alternate so both see
the same background load. Prints, per placement: median step time after warm-up, tokens/s, the
bytes each device moves per step by kind (parameter all-gathers, gradient reduce-scatters and
all-reduces, token all_to_alls: `Trainer.comm`), the loss at the last step (the placements
compute the same model: equal up to bf16 rounding), and the ep/fsdp ratio of each. Ends with
one JSON line of figures.

On fake CPU devices every "transfer" is a memory copy inside one process, so step times show
the compute and bookkeeping cost of each placement, not network time; the byte counts are what
a real interconnect would carry.
"""
from __future__ import annotations

import os

NUM_DEVICES = 8
# Before jax is imported: the fake devices exist from the first backend call on.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={NUM_DEVICES}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import concurrent.futures  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import configs.olmoe as olmoe_configs  # noqa: E402
from bench.cli_args import at_least  # noqa: E402
from moejax.config import from_config_dict  # noqa: E402
from moejax.data import DataSpec, make_data  # noqa: E402
from moejax.train.loop import Trainer, put_batch  # noqa: E402

PLACEMENTS = ("fsdp", "ep")
WARMUP_STEPS = 2          # untimed: first executions (buffer allocation, thread pools)
BYTE_KINDS = ("gather_bytes", "scatter_bytes", "a2a_bytes")


class PlacementRun:
  """One placement: trainer, state and batches set up, its train step lowered."""

  def __init__(self, placement: str, timed_steps: int):
    cd = olmoe_configs.get_config("tiny")
    cd.moe.placement = placement
    # Dropless ep/fssdp buffers: the compiled step runs here without the Trainer's regrowth
    # (moejax.train.loop.GrowingStep), so a bounded buffer could overflow unnoticed.
    cd.moe.dispatch_capacity_factor = 0.0
    cd.steps = WARMUP_STEPS + timed_steps
    self.cfg = cfg = from_config_dict(cd)
    data = make_data(DataSpec(seed=cfg.seed), batch_size=cfg.batch_size, seq_len=cfg.seq_len)
    self.trainer = Trainer(cfg)
    self.state = self.trainer.init_state()
    self.batches = [put_batch(next(data.train), self.trainer.mesh) for _ in range(cfg.steps)]
    data.train.close()
    self.lowered = self.trainer.train_step.lower(self.state, self.batches[0])

  def compile(self) -> None:
    start = time.perf_counter()
    self.step_fn = self.lowered.compile()
    self.compile_s = time.perf_counter() - start

  def run_step(self, i: int) -> None:
    if i == 0:
      self._state, self._times = self.state, []
    start = time.perf_counter()
    self._state, self._metrics = self.step_fn(self._state, self.batches[i])
    jax.block_until_ready(self._metrics)
    if i >= WARMUP_STEPS:
      self._times.append(time.perf_counter() - start)

  def figures(self) -> dict:
    cfg, comm = self.cfg, jax.device_get(self._metrics)
    step_time = statistics.median(self._times)
    return {"step_time_s": step_time,
            "tokens_per_s": cfg.batch_size * cfg.seq_len / step_time,
            **{k: float(comm[k]) for k in BYTE_KINDS},
            "total_bytes": float(sum(comm[k] for k in BYTE_KINDS)),
            "loss": float(jax.device_get(self._metrics["loss"])), "compile_s": self.compile_s}


def run_all(timed_steps: int) -> dict[str, dict]:
  runs = {p: PlacementRun(p, timed_steps) for p in PLACEMENTS}
  print(f"compiling {', '.join(runs)} (at once), then {WARMUP_STEPS} + {timed_steps} steps each, "
        "alternating ...", flush=True)
  # XLA compiles with the GIL released: both placements compile at once.
  with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
    list(pool.map(PlacementRun.compile, runs.values()))
  # Steps alternate between the placements, so both see the same background load.
  for i in range(WARMUP_STEPS + timed_steps):
    for run in runs.values():
      run.run_step(i)
  return {p: run.figures() for p, run in runs.items()}


def _kib(x: float) -> str:
  return f"{x / 1024:.1f}"


def _ratio(a: float, b: float) -> str:
  if b == 0:
    return "-" if a == 0 else "n/a"
  return f"{a / b:.2f}x"


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="fewer steps (under a minute)")
  parser.add_argument("--steps", type=at_least(1), default=None,
                      help="timed steps per placement (default 50, 10 with --quick)")
  args = parser.parse_args()
  steps = args.steps if args.steps is not None else (10 if args.quick else 50)
  results = run_all(steps)
  fsdp, ep = results["fsdp"], results["ep"]

  print(f"\nTiny preset, {jax.device_count()} fake {jax.default_backend()} devices: median of "
        f"{steps} steps after {WARMUP_STEPS} warm-up; bytes per device per step")
  columns = (("step ms", lambda r: f"{1000 * r['step_time_s']:.1f}", "step_time_s"),
             ("tokens/s", lambda r: f"{r['tokens_per_s']:.0f}", "tokens_per_s"),
             ("gather KiB", lambda r: _kib(r["gather_bytes"]), "gather_bytes"),
             ("scatter KiB", lambda r: _kib(r["scatter_bytes"]), "scatter_bytes"),
             ("a2a KiB", lambda r: _kib(r["a2a_bytes"]), "a2a_bytes"),
             ("total KiB", lambda r: _kib(r["total_bytes"]), "total_bytes"),
             ("loss", lambda r: f"{r['loss']:.4f}", "loss"))
  print(" | ".join(f"{h:>11}" for h in ("placement", *(c[0] for c in columns))))
  for p in PLACEMENTS:
    print(" | ".join(f"{c:>11}" for c in (p, *(fmt(results[p]) for _, fmt, _ in columns))))
  print(" | ".join(f"{c:>11}" for c in ("ep / fsdp", *(_ratio(ep[k], fsdp[k])
                                                       for _, _, k in columns))))
  figures = {"steps": steps, "num_devices": jax.device_count(),
             **{f"{k}_{p}": results[p][k] for p in PLACEMENTS for k in results[p]},
             **{f"{k}_ratio_ep_fsdp": (ep[k] / fsdp[k] if fsdp[k] else None)
                for k in ("step_time_s", "tokens_per_s", *BYTE_KINDS, "total_bytes")}}
  print(json.dumps(figures))


if __name__ == "__main__":
  main()
