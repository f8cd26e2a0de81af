"""Every model family trains: each family's tiny preset side by side, and (full run) every
family under every placement on 8 fake devices against the same family on one device.

  python bench/families.py --quick     # each tiny preset, 200 steps on 1 device (~2 min on 2 cores)
  python bench/families.py             # plus the family x placement matrix on 8 devices

Quick: each family's `tiny` preset (configs/FAMILY.py) trains `--steps` steps on the built-in
corpus through `moejax.train.loop.run` on one device; printed per family: parameters (total,
active), first and last logged loss, their ratio (the target: below 0.6), median step time.
Full: the same for fsdp, ep and fssdp on 8 devices (`--matrix_steps` steps), with each run's
first-step loss against the family's one-device first-step loss (same data, same initial
weights: they differ by bf16 rounding only). Ends with one JSON line.
"""
from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.cli_args import at_least  # noqa: E402
from moejax.config import from_config_dict, num_params  # noqa: E402
from moejax.families import FAMILIES, config_file  # noqa: E402
from moejax.errors import ConfigError  # noqa: E402
from moejax.placement import PLACEMENTS  # noqa: E402
from moejax.sharding.mesh import make_mesh  # noqa: E402
from moejax.train.loop import Trainer, run  # noqa: E402

TARGET_RATIO = 0.6


def tiny(family: str, steps: int, placement: str = "fsdp"):
  module = config_file(family)[:-len(".py")].replace("/", ".")
  cd = importlib.import_module(module).get_config("tiny")
  cd.steps, cd.log_every, cd.eval_every = steps, 1, steps
  cd.checkpoint.every = 0
  cd.moe.placement = placement
  return from_config_dict(cd)


def train(cfg, devices: int) -> dict:
  trainer = Trainer(cfg, mesh=make_mesh((1, -1), jax.devices()[:devices]))
  with tempfile.TemporaryDirectory() as workdir:
    run(cfg, workdir, trainer=trainer)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      records = [r for r in map(json.loads, f) if "loss" in r]
  losses = [r["loss"] for r in records]
  # The first step includes the compile; a one-step run (a reference loss) has only that one.
  times = [r["step_time_s"] for r in records[1:]]   # the first step's compile left out
  counts = num_params(cfg)
  return {"total": counts["total"], "active": counts["active"], "first_loss": losses[0],
          "last_loss": losses[-1], "ratio": losses[-1] / losses[0],
          "s_per_step": float(np.median(times)) if times else None}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="the tiny presets on 1 device only")
  parser.add_argument("--steps", type=at_least(2), default=200,
                      help="training steps per family preset (the first, compiling, is not timed)")
  parser.add_argument("--matrix_steps", "--matrix-steps", type=at_least(2), default=30,
                      help="steps per family and placement of the 8-device matrix")
  parser.add_argument("--families", default=",".join(FAMILIES),
                      help="comma-separated subset of " + ", ".join(FAMILIES))
  args = parser.parse_args(argv)
  families = args.families.split(",")
  unknown = sorted(set(families) - set(FAMILIES))
  if unknown:
    parser.error(f"--families: unknown {unknown[0]!r} (valid: {', '.join(FAMILIES)})")
  out = {"quick": {}, "matrix": {}}
  print(f"{'family':<12} {'total':>9} {'active':>9} {'loss 1':>7} {'loss N':>7} {'ratio':>6} "
        f"{'s/step':>7}")
  for family in families:
    r = train(tiny(family, args.steps), 1)
    out["quick"][family] = r
    print(f"{family:<12} {r['total']:>9,} {r['active']:>9,} {r['first_loss']:>7.3f} "
          f"{r['last_loss']:>7.3f} {r['ratio']:>6.3f} {r['s_per_step']:>7.3f}", flush=True)
  failed = [f for f, r in out["quick"].items() if not r["ratio"] < TARGET_RATIO]
  print(f"target: last loss below {TARGET_RATIO} x first for every family: "
        f"{'met' if not failed else 'missed for ' + ', '.join(failed)}")
  if not args.quick:
    print(f"\n{'family':<12} {'placement':<9} {'loss 1 vs 1 device':>19} {'ratio':>6} "
          f"{'s/step':>7}")
    for family in families:
      reference = train(tiny(family, 1), 1)["first_loss"]
      for placement in PLACEMENTS:
        try:
          cfg = tiny(family, args.matrix_steps, placement)
        except ConfigError as e:     # a placement the family cannot take (fssdp with linear
          out["matrix"][f"{family}/{placement}"] = {"refused": str(e)}    # attention)
          print(f"{family:<12} {placement:<9} refused: {e}", flush=True)
          continue
        r = train(cfg, 8)
        r["first_loss_rel_diff"] = abs(r["first_loss"] - reference) / reference
        out["matrix"][f"{family}/{placement}"] = r
        print(f"{family:<12} {placement:<9} {r['first_loss_rel_diff']:>19.2e} "
              f"{r['ratio']:>6.3f} {r['s_per_step']:>7.3f}", flush=True)
  print(json.dumps(out))
  return 0 if not failed else 1


if __name__ == "__main__":
  sys.exit(main())
