"""Iteration-time model against the papers' measurements, then projections of moejax's modes.

  python bench/projection.py --quick        # under a minute on 2 CPU cores
  python bench/projection.py --write        # also rewrite moejax/perf/data/calibration.json

1. Fits the calibration (`moejax.perf.calibrate.fit`) on the points of
   moejax/perf/data/points.json marked fit (at most a third), compares it with the committed
   calibration.json, and prints every measured point beside the model's value and the error,
   held-out points marked.
2. Sanity ranges the papers give without a point (EP against Uniform).
3. Projections: OLMoE-1B-7B on CIERA's testbed (8-128 A100s, S=1024, CIERA's calibrated
   tokens per GPU) for ZeRO-3, CIERA, moejax fsdp plain / block / auto (bench/codec.py's byte
   ratios, high and low lr); DeepSeek-V3 shapes (4 MoE layers as one pipeline stage, seq 4096,
   4096 tokens per GPU, 256 experts top-8) on 16-64 H200s for ep and fssdp, on synthetic traces
   (Gamma skew of CV 0.69, a heavier CV 1.5) and bench/fssdp.py's recorded trace moved to 256
   experts. Writes the plot (default docs/projection.png).
Ends with one JSON line: points, fitted, max_rel_error_heldout, median_rel_error_heldout and the
projections.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np

from moejax.perf import calibrate as cb
from moejax.perf import codec as cd
from moejax.perf import loads as ld
from moejax.perf import report
from moejax.perf.hardware import get_cluster
from moejax.perf.model import Run
from moejax.perf.shapes import get_shape
from moejax.perf.step import step_time
from moejax.perf.systems import get_system

TARGET = 0.15


def points_table(checked) -> str:
  lines = [["point", "source", "quantity", "measured", "model", "error", "set"]]
  for c in checked:
    p = c.point
    unit = "s" if p["quantity"] == "time" else "x"
    lines.append([p["id"], p["source"].split(":")[0].split(" (")[0], p["quantity"],
                  f"{p['value']:.3f}{unit}", f"{c.predicted:.3f}{unit}", f"{c.error:+.1%}",
                  "fit" if p.get("fit") else ("held out" if abs(c.error) <= TARGET
                                              else "held out, MISS")])
  return report._format(lines)


def sanity(calib) -> list[dict]:
  out = []
  for n in (16, 64):
    pt = {"model": "DeepSeek-V3", "layers": 2, "dense_layers": 0, "experts_per_gpu": 4,
          "cluster": "themis-a", "gpus": n, "seq_len": 4096, "tokens_per_gpu": 4096,
          "remat": False, "quantity": "speedup", "system": "uniform", "baseline": "ep"}
    out.append({"what": f"EP slower than Uniform, DeepSeek-V3 on cluster A, {n} GPUs",
                "model": cb.predict(pt, calib), "paper": "1.48-2.87 (Themis Sec. 5.2)"})
  return out


def olmoe_projection(calib, gpus) -> list[dict]:
  shape = get_shape("OLMoE-1B-7B")
  cluster = get_cluster("ciera-a100")
  tokens = calib.tokens("ciera")
  rows = []
  variants = [("zero3", None), ("ciera", None), ("fsdp", None),
              ("moejax-block", cd.measured("block")),
              ("moejax-auto", cd.measured("auto", "high")),
              ("moejax-auto (low lr)", cd.measured("auto", "low")),
              ("moejax-auto-bf16rs", cd.measured("auto", "high"))]
  for n in gpus:
    run = Run(n, tokens, 1024)
    for label, ratios in variants:
      system = get_system(label.split(" ")[0])
      kw = {"ratios": ratios} if ratios is not None else {}
      rows.append({"gpus": n, "system": label,
                   "result": step_time(shape, cluster, run, system, calib, **kw)})
  return rows


def scatter_projection(calib) -> list[dict]:
  """OLMoE-1B-7B under moejax fsdp (plain, and codec auto with bf16 reduction) with each layer's
  gradient reduce-scattered in place against under the next layer's backward
  (config `scatter_ahead`), on H200 nodes: what the overlap buys, and where the one extra
  reduce-scatter of zeros costs more than it hides."""
  shape, cluster = get_shape("OLMoE-1B-7B"), get_cluster("h200")
  rows = []
  for label, ratios in (("fsdp", None), ("moejax-auto-bf16rs", cd.measured("auto", "high"))):
    kw = {"ratios": ratios} if ratios is not None else {}
    ahead = get_system(label)
    in_place = dataclasses.replace(ahead, scatter_ahead=False)
    for n in (8, 16):
      for tokens in (4096, 16384):
        run = Run(n, tokens, 4096)
        a = step_time(shape, cluster, run, ahead, calib, **kw)
        b = step_time(shape, cluster, run, in_place, calib, **kw)
        rows.append({"system": label, "gpus": n, "tokens": tokens, "in_place_s": b.seconds,
                     "ahead_s": a.seconds, "rs_exposed_in_place_s": b.exposed.get("rs", 0.0),
                     "rs_exposed_ahead_s": a.exposed.get("rs", 0.0)})
  return rows


def chunks_projection(calib, steps) -> list[dict]:
  """DeepSeek-V3 shapes under moejax ep and fssdp on H200 nodes with the token exchange in
  1, 2 and 4 pieces (config `moe.dispatch_chunks`): how much of the expert matmuls hides under
  the other pieces' exchanges, against the fixed cost each piece pays."""
  base = get_shape("DeepSeek-V3").with_layers(4, dense_layers=0)
  cluster, tokens, rows = get_cluster("h200"), 4096, []
  for n in (16, 64):
    run = Run(n, tokens, 4096, remat=True)
    trace = ld.synthetic_trace(base.num_experts, base.top_k, n, tokens, steps=5 + steps,
                               layers=base.moe_layers, cv=0.69, seed=1)
    for name in ("moejax-ep", "moejax-fssdp"):
      times = {k: step_time(base, cluster, run,
                            dataclasses.replace(get_system(name), dispatch_chunks=k), calib,
                            trace).seconds for k in (1, 2, 4)}
      rows.append({"system": name, "gpus": n, **{f"chunks{k}_s": t for k, t in times.items()}})
  return rows


def deepseek_projection(calib, gpus, steps) -> dict[str, list[dict]]:
  base = get_shape("DeepSeek-V3").with_layers(4, dense_layers=0)
  cluster = get_cluster("h200")
  tokens = 4096
  systems = ("moejax-ep", "moejax-ep+admit", "moejax-fssdp", "moejax-fssdp-t16",
             "moejax-fssdp-t16+codec",
             "moejax-fssdp+admit", "themis", "uniform")
  recorded, _ = ld.load_recorded()
  recorded = np.concatenate([recorded, recorded], axis=1)          # 2 -> 4 layers
  out = {}
  for trace_name in ("synthetic, Gamma CV 0.69", "synthetic, Gamma CV 1.5",
                     "recorded (bench/fssdp.py, E8 -> 256)"):
    rows = []
    for n in gpus:
      run = Run(n, tokens, 4096, remat=True)
      total = 5 + steps
      if trace_name.startswith("recorded"):
        trace = ld.retarget(recorded[:total], base.num_experts, base.top_k, n, tokens)
      else:
        cv = 0.69 if "0.69" in trace_name else 1.5
        trace = ld.synthetic_trace(base.num_experts, base.top_k, n, tokens, steps=total,
                                   layers=base.moe_layers, cv=cv, seed=1)
      for name in systems:
        system = get_system(name)
        if name in ("themis", "uniform"):
          system = dataclasses.replace(system, dense="fsdp")
        rows.append({"gpus": n, "system": name,
                     "result": step_time(base, cluster, run, system, calib, trace)})
    out[trace_name] = rows
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--quick", action="store_true", help="fewer trace steps in the projections")
  ap.add_argument("--write", action="store_true", help="rewrite data/calibration.json")
  ap.add_argument("--plot", default=None,
                  help="where to write the plot (default: docs/projection.png, the README's, "
                  "on a full run; none with --quick, whose projections are shorter; '' for none)")
  args = ap.parse_args()
  if args.plot is None:
    args.plot = "" if args.quick else os.path.join(REPO, "docs", "projection.png")
  if args.plot and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
    ap.error(f"argument --plot: no folder {os.path.dirname(os.path.abspath(args.plot))!r}")
  t0 = time.perf_counter()
  points = cb.load_points()
  fitted = cb.fit(points)
  flat = {k: v for k, v in fitted.flat().items() if k in cb.PARAMS}
  committed = {k: v for k, v in cb.load_fitted().flat().items() if k in cb.PARAMS}
  same = all(abs(flat[k] / committed[k] - 1) < 1e-3 for k in cb.PARAMS)
  print(f"calibration: fitted on {sum(p.get('fit', False) for p in points)} of {len(points)} "
        f"points in {time.perf_counter() - t0:.1f} s "
        f"({'equals' if same else 'DIFFERS FROM'} moejax/perf/data/calibration.json)")
  for k in cb.PARAMS:
    print(f"  {k:22s} {flat[k]:.6g}")
  ib = get_cluster("ciera-a100").inter
  print(f"  -> inter-node bus bandwidth on CIERA's testbed: "
        f"{ib.bandwidth * flat['link_eff.inter'] / 1e9:.1f} GB/s "
        f"(the paper measured about {ib.measured_bus_bandwidth / 1e9:.0f} GB/s)")
  if args.write:
    with open(cb.FITTED, "w", encoding="utf-8") as f:
      json.dump({"about": "written by bench/projection.py --write: the fit on the points marked "
                          "fit in points.json", "fitted": flat}, f, indent=2)
      f.write("\n")
    print(f"wrote {cb.FITTED}")
  checked = cb.validate(fitted, points)
  print("\nMeasured points (model at the fitted calibration):")
  print(points_table(checked))
  summ = cb.summary(checked)
  print(f"held out: {summ['heldout_within_15pct']} of {summ['heldout_points']} within 15%; "
        f"max error {summ['max_rel_error_heldout']:.1%}, median "
        f"{summ['median_rel_error_heldout']:.1%}")
  print("\nSanity ranges (no point):")
  san = sanity(fitted)
  for s in san:
    print(f"  {s['what']}: model {s['model']:.2f}x, paper {s['paper']}")

  gpus = (8, 16, 32, 64, 128)
  olmoe = olmoe_projection(fitted, gpus)
  print("\nOLMoE-1B-7B on CIERA's testbed (A100, 8 per node, 200 Gb/s HDR IB), S=1024, "
        f"{fitted.tokens('ciera'):.0f} tokens per GPU, ms per step:")
  print(report.table(olmoe, baseline="zero3"))
  scatter = scatter_projection(fitted)
  print("\nOLMoE-1B-7B on H200 nodes (8 x 400 Gb/s IB), seq 4096: each layer's gradient "
        "reduce-scattered in place (the next layer's backward waits) against ahead (under it; "
        "one layer's zeros more), ms per step:")
  print(f"  {'system':20s} {'GPUs':>4s} {'tokens/GPU':>10s} {'in place':>9s} {'ahead':>9s} "
        f"{'rs exposed':>17s} {'speedup':>8s}")
  for r in scatter:
    print(f"  {r['system']:20s} {r['gpus']:4d} {r['tokens']:10d} {1e3 * r['in_place_s']:9.1f} "
          f"{1e3 * r['ahead_s']:9.1f} {1e3 * r['rs_exposed_in_place_s']:8.1f} -> "
          f"{1e3 * r['rs_exposed_ahead_s']:6.1f} {r['in_place_s'] / r['ahead_s']:7.2f}x")
  chunks = chunks_projection(fitted, 3 if args.quick else 8)
  print("\nDeepSeek-V3 shapes (4 MoE layers, 256 experts top-8, seq 4096, 4096 tokens per GPU, "
        "trace Gamma CV 0.69) on H200 nodes: the token exchange in 1, 2 and 4 pieces "
        "(moe.dispatch_chunks), ms per step:")
  print(f"  {'system':14s} {'GPUs':>4s} {'1 piece':>9s} {'2 pieces':>9s} {'4 pieces':>9s} "
        f"{'best':>7s}")
  for r in chunks:
    best = min((1, 2, 4), key=lambda k: r[f"chunks{k}_s"])
    print(f"  {r['system']:14s} {r['gpus']:4d} " + " ".join(
        f"{1e3 * r[f'chunks{k}_s']:9.1f}" for k in (1, 2, 4))
        + f" {r['chunks1_s'] / r[f'chunks{best}_s']:6.2f}x")
  ds = deepseek_projection(fitted, (16, 32, 64), 3 if args.quick else 8)
  for name, rows in ds.items():
    print(f"\nDeepSeek-V3 shapes (4 MoE layers, 256 experts top-8, seq 4096, 4096 tokens per "
          f"GPU) on H200 nodes (8 x 400 Gb/s IB), trace {name}, ms per step:")
    print(report.table(rows, baseline="moejax-ep"))
    over = {f"{r['system']}@{r['gpus']}": r["result"].extra["over_capacity_fraction"]
            for r in rows if "over_capacity_fraction" in r["result"].extra}
    if over:
      print("  admission (reroute, factor 1.25): assignments over capacity, handed to other "
            "experts: " + ", ".join(f"{k} {v:.1%}" for k, v in over.items()))
  print("(no measured point on H200: its efficiency is the A100's fitted figure)")
  panels = [{"title": "OLMoE-1B-7B on CIERA's testbed (A100, HDR IB), S=1024", "rows": olmoe}]
  panels += [{"title": f"DeepSeek-V3 (4 MoE layers) on H200 nodes, {k}", "rows": v}
             for k, v in ds.items() if "1.5" not in k]
  if args.plot:
    report.plot(panels, args.plot, "moejax perf model (python bench/projection.py)")
    print(f"wrote {args.plot}")

  def proj(rows):
    return {f"{r['system']}@{r['gpus']}": round(r["result"].seconds, 4) for r in rows}

  out = {"points": [{"id": c.point["id"], "measured": c.point["value"],
                     "model": round(c.predicted, 4), "rel_error": round(c.error, 4),
                     "fit": bool(c.point.get("fit"))} for c in checked],
         "fitted": flat, "calibration_matches_committed": same,
         "max_rel_error_heldout": round(summ["max_rel_error_heldout"], 4),
         "median_rel_error_heldout": round(summ["median_rel_error_heldout"], 4),
         "heldout_within_15pct": summ["heldout_within_15pct"],
         "heldout_points": summ["heldout_points"],
         "projection_scatter_ahead": [
             {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
             for r in scatter],
         "projection_dispatch_chunks": [
             {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
             for r in chunks],
         "sanity": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()}
                    for s in san],
         "projection_olmoe_s": proj(olmoe),
         "projection_deepseek_v3_s": {k: proj(v) for k, v in ds.items()},
         "seconds": round(time.perf_counter() - t0, 1)}
  print(json.dumps(out))


if __name__ == "__main__":
  main()
