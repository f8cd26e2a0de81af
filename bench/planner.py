"""FSSDP's per-layer planning at growing scale: the planner against its own definition, side by
side in one process.

  python bench/planner.py            # about 1.5 minutes on 2 CPU cores
  python bench/planner.py --quick    # without the largest definition runs (seconds)

What a train step plans for each MoE layer on every device (`moejax.placement.fssdp`): the
replicas from the predicted loads, preferring last step's holders (`planner.materialize_plan`,
two plans: with and without the preference), the re-plan from the actual per-source counts
(`planner.calibrate`, two more) and the balanced sends (`planner.balanced_send`), one jitted
function on one CPU device. Two ways, timed interleaved:
  planner      the default: each candidate holder weighed in O(N) from per-node sums
               (`candidate_loads`), and once `overlap_degree` experts have replicas only their
               chains grown (`TWO_PHASE_WORK`)
  definition   each candidate's N device loads through `expert_device_load`
               (`candidate_loads_direct`, O(N^2)) and every expert's chain grown every round:
               the same rounds as the planner before its O(N) weighing and two phases
Both must give the same replicas (the script fails otherwise). Scales: the tiny preset on 2
nodes x 4, OLMoE-1B-7B's 64 experts on one and four 8-GPU nodes, DeepSeek-V3's 256 experts on
eight (the config's defaults M=2, t=4, and the projection's M=4, t=16). Loads: Gamma (CV 1.0)
per expert, Poisson per source device. Ends with one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.cli_args import at_least  # noqa: E402
from moejax.placement import planner  # noqa: E402

# (name, experts, devices, devices per node, replica slots M, overlap degree t)
SCALES = [("tiny, 2 x 4", 8, 8, 4, 2, 4), ("OLMoE, 1 x 8", 64, 8, 8, 2, 4),
          ("OLMoE, 4 x 8", 64, 32, 8, 2, 4), ("DeepSeek-V3, 8 x 8", 256, 64, 8, 2, 4),
          ("DeepSeek-V3, 8 x 8, M=4 t=16", 256, 64, 8, 4, 16)]
TOKENS = 4096 * 8            # assignments per device and layer (DeepSeek-V3: 4096 tokens, top-8)


def layer_planning(e: int, n: int, dpn: int, m: int, t: int, definition: bool):
  """The jitted per-layer planning of one device, the definition's or the planner's."""
  kw = dict(num_devices=n, devices_per_node=dpn, replica_slots=m, overlap_degree=t)
  candidates = planner.candidate_loads_direct if definition else None
  owner_E = jnp.arange(e, dtype=jnp.int32) // (e // n)

  def plan(predicted_E, counts_NxE, held_ExN):
    first = planner.materialize_plan(predicted_E, owner_E, prefer_ExN=held_ExN,
                                     candidates=candidates, **kw)
    fresh = planner.materialize_plan(jnp.sum(counts_NxE, axis=0), owner_E,
                                     source_load_NxE=counts_NxE, prefer_ExN=first.holders_ExN,
                                     candidates=candidates, **kw)
    chosen, _ = planner.calibrate(first, jnp.sum(counts_NxE, axis=0), owner_E,
                                  actual_source_load_NxE=counts_NxE, fresh=fresh, **kw)
    send = planner.balanced_send(chosen.holders_ExN, counts_NxE, devices_per_node=dpn,
                                 max_shared=t)
    return first.replica_expert_NxM, chosen.replica_expert_NxM, send

  return jax.jit(plan)


def inputs(e: int, n: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  share_E = rng.gamma(1.0, 1.0, e)
  share_E /= share_E.sum()
  counts_NxE = rng.poisson(share_E[None, :] * TOKENS, (n, e)).astype(np.int32)
  predicted_E = (share_E * TOKENS * n * rng.uniform(0.8, 1.2, e)).astype(np.float32)
  return jnp.asarray(predicted_E), jnp.asarray(counts_NxE), jnp.zeros((e, n), bool)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="the definition only where it takes under a second a layer")
  parser.add_argument("--rounds", type=at_least(1), default=3,
                      help="rounds over the two ways (each times both in turn)")
  parser.add_argument("--calls", type=at_least(1), default=3, help="timed calls per round")
  args = parser.parse_args()
  rows = []
  for name, e, n, dpn, m, t in SCALES:
    args_in = inputs(e, n)
    ways = {"planner": layer_planning(e, n, dpn, m, t, definition=False)}
    if not (args.quick and e * n > 64 * 32):
      ways["definition"] = layer_planning(e, n, dpn, m, t, definition=True)
    saved = planner.TWO_PHASE_WORK
    outs, times = {}, {w: [] for w in ways}
    for way, fn in ways.items():
      # the definition plans every round over every expert (the planner before its two phases)
      planner.TWO_PHASE_WORK = saved if way == "planner" else 1 << 62
      try:
        outs[way] = jax.device_get(fn(*args_in))       # traced and compiled here
      finally:
        planner.TWO_PHASE_WORK = saved
    for _ in range(args.rounds):
      for way, fn in ways.items():
        for _ in range(args.calls):
          start = time.perf_counter()
          jax.block_until_ready(fn(*args_in))
          times[way].append(time.perf_counter() - start)
    same = all(np.array_equal(a, b) for a, b in zip(outs["planner"], outs.get("definition",
                                                                             outs["planner"])))
    if not same:
      raise SystemExit(f"{name}: the planner's replicas differ from the definition's")
    ms = {w: statistics.median(ts) * 1e3 for w, ts in times.items()}
    row = {"scale": name, "experts": e, "devices": n, "replica_slots": m, "overlap_degree": t,
           "replicas": int(np.sum(outs["planner"][0] < e)),
           "planner_ms": ms["planner"], "definition_ms": ms.get("definition"),
           "speedup": ms["definition"] / ms["planner"] if "definition" in ms else None,
           "same_replicas": "definition" in ms}
    rows.append(row)
    print(f"{name:30s} planner {ms['planner']:9.2f} ms  definition "
          + (f"{ms['definition']:9.2f} ms  {row['speedup']:5.1f}x" if "definition" in ms
             else "        -") + f"  ({row['replicas']} replicas)", flush=True)
  print(json.dumps({"bench": "planner", "rows": rows}))


if __name__ == "__main__":
  main()
