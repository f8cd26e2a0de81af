"""Trace and lower time of the 8-device train step at a preset's full size, with the repeating
patterns of layers scanned over their period (`olmoe.layer_scans`, the default) and as one scan
per run of equal layers (gpt-oss: 36 one-layer scans), side by side in one process.

  python bench/trace.py                       # the patterned presets below, both ways
  python bench/trace.py --only gpt_oss:120b:fssdp --compile

Per case: trace (`Trainer.train_step.trace` on abstract inputs: nothing is allocated), lower,
and with `--compile` XLA:CPU's compile of the lowered step, for both structures, and the ratios.
Batch 8 x 64 on a (2, 4) mesh: the layers' count and widths are the preset's. Ends with one
JSON line.
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
import time  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from moejax.config import from_config_dict  # noqa: E402
from moejax.families import FAMILIES, config_file  # noqa: E402
from moejax.models import olmoe  # noqa: E402
from moejax.train.loop import Trainer  # noqa: E402

SIZE = {"batch_size": 8, "seq_len": 64, "mesh.shape": (2, 4),
        "moe.dispatch_capacity_factor": 0.0}
VARIANTS = {"fsdp_codec": {"codec.mode": "element", "codec.select": False,
                           "codec.warmup_steps": 2},
            "fsdp": {}, "ep": {"moe.placement": "ep"}, "fssdp": {"moe.placement": "fssdp"}}
CASES = ("gpt_oss:120b:fsdp_codec", "gpt_oss:120b:fssdp", "llama4:maverick:fsdp_codec",
         "qwen3_next:80b_a3b:fssdp", "qwen3_5_moe:35b_a3b:fssdp")


def case(text: str) -> tuple[str, str, str]:
  parts = text.split(":")
  if len(parts) != 3 or parts[2] not in VARIANTS:
    raise argparse.ArgumentTypeError(
        f"expected FAMILY:PRESET:VARIANT with VARIANT one of {sorted(VARIANTS)}, got {text!r}")
  if parts[0] not in FAMILIES:
    raise argparse.ArgumentTypeError(f"no family {parts[0]!r}; one of {', '.join(FAMILIES)}")
  presets = getattr(_module(parts[0]), "PRESETS", ("tiny",))
  if parts[1] not in presets:
    raise argparse.ArgumentTypeError(f"{parts[0]} has no preset {parts[1]!r}; one of "
                                     f"{', '.join(presets)}")
  return tuple(parts)


def _module(family: str):
  return importlib.import_module(config_file(family)[:-len(".py")].replace("/", "."))


def config(family: str, preset: str, variant: str):
  cd = _module(family).get_config(preset)
  cd.update_from_flattened_dict({**SIZE, **VARIANTS[variant]})
  return from_config_dict(cd)


def measure(cfg, compile_too: bool) -> dict:
  trainer = Trainer(cfg)
  start = time.perf_counter()
  traced = trainer.train_step.trace(*trainer.abstract_inputs())
  traced_at = time.perf_counter()
  lowered = traced.lower()
  out = {"trace_s": traced_at - start, "lower_s": time.perf_counter() - traced_at,
         "scans": len(olmoe.layer_scans(cfg))}
  if compile_too:
    start = time.perf_counter()
    lowered.compile()
    out["compile_s"] = time.perf_counter() - start
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--only", type=case, action="append",
                      help="FAMILY:PRESET:VARIANT (repeatable); default: " + ", ".join(CASES))
  parser.add_argument("--compile", action="store_true", help="compile the lowered steps too")
  args = parser.parse_args()
  results = []
  for family, preset, variant in args.only or [case(c) for c in CASES]:
    cfg = config(family, preset, variant)
    row = {"case": f"{family}:{preset}:{variant}"}
    for name, period in (("runs", 1), ("periods", olmoe.MAX_PERIOD)):
      saved, olmoe.MAX_PERIOD = olmoe.MAX_PERIOD, period
      try:
        row[name] = measure(cfg, args.compile)
      finally:
        olmoe.MAX_PERIOD = saved
    keys = [k for k in ("trace_s", "lower_s", "compile_s") if k in row["runs"]]
    row["ratio"] = {k: row["runs"][k] / row["periods"][k] for k in keys}
    print(f"{row['case']:34s} " + "  ".join(
        f"{k[:-2]} {row['runs'][k]:6.1f} -> {row['periods'][k]:5.1f} s ({row['ratio'][k]:.1f}x)"
        for k in keys) + f"  scans {row['runs']['scans']} -> {row['periods']['scans']}",
        flush=True)
    results.append(row)
  print(json.dumps({"bench": "trace", "cases": results}))


if __name__ == "__main__":
  main()
