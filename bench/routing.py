"""Routing policies side by side: none, strict and reroute admission on the tiny preset.

  python bench/routing.py --quick

Trains the tiny preset once per policy (same seed, same batches, same steps; the policies take
their steps in turn, so load from other work on the machine falls on all of them alike) and
prints, per policy: peak expert load and top-1 expert share, load entropy, drop and reroute
rates, median step time, admission overhead (median over steps of the step's time over the same
step's time under `none`, so load shared by both cancels), and validation loss. Then replays a
routing trace with a forced hotspot (one expert drawing most tokens) through the admission
functions to show the cap holding. Ends with one JSON line of figures.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import configs.olmoe as olmoe_configs  # noqa: E402
from bench.cli_args import at_least  # noqa: E402
from moejax.config import from_config_dict  # noqa: E402
from moejax.data import DataSpec, make_data  # noqa: E402
from moejax.routing import admission, router, stats  # noqa: E402
from moejax.train.loop import Trainer, put_batch  # noqa: E402

POLICIES = ("none", "strict", "reroute")


def train_policies(policies, steps: int, eval_batches: int, capacity_factor: float):
  runs = {}
  for policy in policies:
    print(f"admission {policy}: {steps} steps ...", flush=True)
    cd = olmoe_configs.get_config("tiny")
    cd.routing.admission = policy
    cd.routing.admission_capacity_factor = capacity_factor
    cd.steps = steps
    cfg = from_config_dict(cd)
    data = make_data(DataSpec(seed=cfg.seed), batch_size=cfg.batch_size, seq_len=cfg.seq_len)
    trainer = Trainer(cfg)
    val = [put_batch(b, trainer.mesh) for b in data.val_batches(eval_batches)]
    runs[policy] = {"data": data, "trainer": trainer, "state": trainer.init_state(), "val": val,
                    "times": [], "records": []}
  for step in range(steps):
    for i in range(len(policies)):  # round robin, starting with a different policy each step
      run = runs[policies[(step + i) % len(policies)]]
      batch = put_batch(next(run["data"].train), run["trainer"].mesh)
      t0 = time.perf_counter()
      run["state"], metrics = run["trainer"].train_step(run["state"], batch)
      jax.block_until_ready(metrics)
      if step >= 2:                        # skip compilation and the first warm step
        run["times"].append(time.perf_counter() - t0)
      if step >= steps // 2:
        run["records"].append(jax.device_get(metrics))
  results = {}
  for policy, run in runs.items():
    run["data"].train.close()

    def mean(key, records=run["records"]):
      return float(np.mean([np.mean(r[key]) for r in records]))

    results[policy] = {
        "val_loss": run["trainer"].evaluate(run["state"].params, run["val"]),
        "step_time_s": statistics.median(run["times"]),
        "times": run["times"],
        "load_max": mean("load_max"), "top1_share": mean("top1_share"),
        "load_entropy": mean("load_entropy"), "dropped_frac": mean("dropped_frac"),
        "rerouted_frac": mean("rerouted_frac"),
    }
  return results


def hotspot_trace(num_tokens=4096, num_experts=8, k=2, d=64, hot_fraction=0.7, seed=0):
  """Top-1 share of routed work under a forced hotspot, before and after admission."""
  rng = np.random.default_rng(seed)
  router_DxE = rng.normal(size=(d, num_experts)).astype(np.float32)
  x_TxD = rng.normal(size=(num_tokens, d)).astype(np.float32)
  hot = rng.random(num_tokens) < hot_fraction
  x_TxD[hot] += 3.0 * router_DxE[:, 0] / np.linalg.norm(router_DxE[:, 0])  # lean toward expert 0
  logits_TxE = jnp.asarray(x_TxD @ router_DxE)
  logits_TxE = logits_TxE.at[:, 0].add(jnp.where(jnp.asarray(hot), 20.0, 0.0))
  weights, experts, scores = router.top_k_route(logits_TxE, k)
  capacity_E = admission.capacity_schedule(0, num_tokens=num_tokens, k=k,
                                           num_experts=num_experts, factor=1.0)
  out = {}
  for policy in POLICIES:
    if policy == "none":
      kept, rerouted, chosen = None, None, experts
    else:
      adm = admission.admit(jnp.asarray(x_TxD), jnp.asarray(router_DxE), experts, weights, scores,
                            capacity_E=capacity_E, threshold=-1.0, policy=policy)
      kept, rerouted, chosen = adm.kept_TxK, adm.rerouted_TxK, adm.experts_TxK
    s = stats.routing_stats(chosen, num_experts, kept_TxK=kept, rerouted_TxK=rerouted)
    out[policy] = {key: float(v) for key, v in s.items()}
  out["capacity"] = int(capacity_E[0])
  # Time admission alone on this trace, against the router it follows.
  admit = jax.jit(lambda x, w, e, wt, sc: admission.admit(
      x, w, e, wt, sc, capacity_E=capacity_E, threshold=-1.0, policy="reroute"))
  args = (jnp.asarray(x_TxD), jnp.asarray(router_DxE), experts, weights, scores)
  jax.block_until_ready(admit(*args))
  t0 = time.perf_counter()
  for _ in range(10):
    jax.block_until_ready(admit(*args))
  out["reroute_admission_s"] = (time.perf_counter() - t0) / 10
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="fewer steps (under a minute)")
  parser.add_argument("--steps", type=at_least(3), default=None,
                      help="steps per policy (default 200, 30 with --quick; the first 2 warm up)")
  parser.add_argument("--capacity_factor", type=float, default=1.25,
                      help="admission's capacity factor")
  args = parser.parse_args()
  steps = args.steps if args.steps is not None else (30 if args.quick else 200)
  eval_batches = 2 if args.quick else 8
  results = train_policies(POLICIES, steps, eval_batches, args.capacity_factor)
  base = results["none"]
  times_none = base["times"]
  for r in results.values():
    r["overhead"] = statistics.median(
        t / t_none for t, t_none in zip(r.pop("times"), times_none)) - 1
  print(f"\nTiny preset, {steps} steps, capacity factor {args.capacity_factor} "
        f"({jax.device_count()} device(s), {jax.default_backend()})")
  header = ("policy", "top1 share", "load max", "entropy", "dropped", "rerouted", "step ms",
            "overhead", "val loss", "val/none")
  print(" | ".join(f"{h:>10}" for h in header))
  for p, r in results.items():
    overhead = r["overhead"]
    row = (p, f"{r['top1_share']:.3f}", f"{r['load_max']:.0f}", f"{r['load_entropy']:.3f}",
           f"{r['dropped_frac']:.3f}", f"{r['rerouted_frac']:.3f}",
           f"{1000 * r['step_time_s']:.1f}", f"{100 * overhead:+.1f}%", f"{r['val_loss']:.4f}",
           f"{r['val_loss'] / base['val_loss']:.4f}")
    print(" | ".join(f"{c:>10}" for c in row))
  trace = hotspot_trace()
  print(f"\nForced hotspot (70% of tokens pulled to expert 0), capacity {trace['capacity']} "
        "per expert:")
  for p in POLICIES:
    t = trace[p]
    cut = 1 - t["top1_share"] / trace["none"]["top1_share"]
    print(f"  {p:>8}: top-1 share {t['top1_share']:.3f} (cut {100 * cut:.0f}%), dropped "
          f"{t['dropped_frac']:.3f}, rerouted {t['rerouted_frac']:.3f}")
  print(f"  reroute admission alone: {1000 * trace['reroute_admission_s']:.2f} ms for 4096 tokens")
  figures = {
      "steps": steps,
      **{f"{k}_{p}": results[p][k] for p in POLICIES for k in results[p]},
      "overhead_strict": results["strict"]["overhead"],
      "overhead_reroute": results["reroute"]["overhead"],
      "val_ratio_strict": results["strict"]["val_loss"] / base["val_loss"],
      "val_ratio_reroute": results["reroute"]["val_loss"] / base["val_loss"],
      "hotspot_top1_none": trace["none"]["top1_share"],
      "hotspot_top1_strict": trace["strict"]["top1_share"],
      "hotspot_top1_reroute": trace["reroute"]["top1_share"],
  }
  print(json.dumps(figures))


if __name__ == "__main__":
  main()
