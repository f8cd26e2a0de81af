"""Golden figures of the tiny preset: per-step loss and gradient norm, and a digest of the final
parameters, for each placement and the codec, on 8 fake CPU devices.

A refactor that must not change numerics records them before and checks them after:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    .venv/bin/python scripts/golden.py --out /tmp/golden_before.json
  ... change ...
  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    .venv/bin/python scripts/golden.py --check /tmp/golden_before.json

`--check` prints each variant's verdict and exits 1 on any difference (bit for bit). A change
that may round differently (another summation order) checks with `--rtol R`: the per-step losses
within relative R (the parameters' digest is then not compared); it prints the largest relative
differences of loss and gradient norm.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile

VARIANTS = {
    "fsdp": {"moe.placement": "fsdp"},
    "ep": {"moe.placement": "ep"},
    "fssdp_2x4": {"moe.placement": "fssdp", "mesh.shape": (2, 4), "fssdp.reshard_every": 10},
    "codec_auto": {"moe.placement": "fsdp", "codec.mode": "auto", "codec.comm_model": "bytes",
                   "codec.warmup_steps": 4, "codec.reselect_every": 8},
}
STEPS = 20


def _config(overrides: dict):
  from configs import olmoe
  from moejax.config import from_config_dict
  cd = olmoe.get_config("tiny")
  cd.steps, cd.log_every, cd.eval_every = STEPS, 1, STEPS
  for key, value in overrides.items():
    group, _, field = key.rpartition(".")
    target = cd[group] if group else cd
    target[field] = value
  return from_config_dict(cd)


def figures(name: str) -> dict:
  import numpy as np
  from moejax.train import checkpoint, loop
  cfg = _config(VARIANTS[name])
  with tempfile.TemporaryDirectory() as workdir:
    loop.run(cfg, workdir)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      records = [json.loads(line) for line in f]
    params = checkpoint.load_params(workdir)
  import jax
  digest = hashlib.sha256()
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    digest.update(jax.tree_util.keystr(path).encode())
    digest.update(np.asarray(x).tobytes())
  return {"loss": [r["loss"] for r in records], "grad_norm": [r["grad_norm"] for r in records],
          "params_sha256": digest.hexdigest()}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", help="write the figures to this JSON file")
  parser.add_argument("--check", help="compare with figures recorded earlier")
  parser.add_argument("--rtol", type=float, default=0.0,
                      help="losses equal within this relative tolerance (0: bit for bit)")
  parser.add_argument("--only", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
  args = parser.parse_args()
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
  got = {name: figures(name) for name in args.only}
  if args.out:
    with open(args.out, "w") as f:
      json.dump(got, f, indent=1)
  if not args.check:
    return 0
  with open(args.check) as f:
    want = json.load(f)
  ok = True
  for name, fig in got.items():
    if args.rtol and name in want:
      rel = {key: max(abs(a - b) / abs(b) for a, b in zip(fig[key], want[name][key]))
             for key in ("loss", "grad_norm")}
      same = rel["loss"] <= args.rtol
      ok &= same
      print(f"{name}: {'within' if same else 'NOT within'} rtol {args.rtol}: largest relative "
            f"difference loss {rel['loss']:.2e}, grad norm {rel['grad_norm']:.2e}")
      continue
    same = fig == want.get(name)
    ok &= same
    print(f"{name}: {'bit-identical' if same else 'DIFFERENT'}")
    if not same and name in want:
      for key in fig:
        if fig[key] != want[name][key]:
          print(f"  {key}: {want[name][key]} -> {fig[key]}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
