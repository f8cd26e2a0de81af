"""Calibration on the papers' measured points: fit on a declared subset, validate on the rest.

The points are data (`data/points.json`, each citing its table or figure). The fitted figures
are global, never per point:
  gpu_eff.a100         fraction of peak bf16 FLOP/s A100 matmuls reach
  link_eff.intra       fraction of NVLink's nominal bandwidth a collective reaches
  link_eff.inter       fraction of the inter-node network's nominal bandwidth
  tokens_per_gpu.ciera tokens per GPU per step of CIERA's runs (the paper states no batch size)
  host_s.deepspeed     DeepSpeed ZeRO-3's framework seconds per separately fetched or reduced
                       tensor: one figure beyond the issue's list, because CIERA Table 3's
                       times follow the number of expert tensors, not bytes or FLOPs (README)
The fit minimizes the squared log-ratios of model to measurement over the points marked
`fit` (at most a third of them), from a fixed start, with scipy's bounded least squares:
deterministic, so the same points give the same figures. `validate` reports every point.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os

import numpy as np

from moejax.perf import loads as ld
from moejax.perf.expert_parallel import WINDOW
from moejax.perf.hardware import get_cluster
from moejax.perf.model import Calibration, Run
from moejax.perf.shapes import get_shape
from moejax.perf.step import step_time

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
POINTS = os.path.join(DATA, "points.json")
FITTED = os.path.join(DATA, "calibration.json")

PARAMS = ("gpu_eff.a100", "link_eff.intra", "link_eff.inter", "tokens_per_gpu.ciera",
          "host_s.deepspeed")
START = {"gpu_eff.a100": 0.5, "link_eff.intra": 0.7, "link_eff.inter": 0.5,
         "tokens_per_gpu.ciera": 2048.0, "host_s.deepspeed": 5e-4}
BOUNDS = {"gpu_eff.a100": (0.05, 1.0), "link_eff.intra": (0.05, 1.0),
          "link_eff.inter": (0.05, 1.0), "tokens_per_gpu.ciera": (64.0, 1e6),
          "host_s.deepspeed": (1e-6, 1e-1)}
TRACE_STEPS = 8
"""Timed steps of a trace (after the predictor's warm-up); heterogeneous-sharding points time
two re-sharding intervals."""


def load_points(path: str = POINTS) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    pts = json.load(f)["points"]
  ids = [p["id"] for p in pts]
  if len(set(ids)) != len(ids):
    raise ValueError(f"{path}: duplicate point ids")
  return pts


def sanity_ranges(path: str = POINTS) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return json.load(f).get("sanity_ranges", [])


def base_calibration() -> Calibration:
  return Calibration().replace(**START)


def load_fitted(path: str = FITTED) -> Calibration:
  """The committed calibration (written by `bench/projection.py --write`)."""
  with open(path, encoding="utf-8") as f:
    values = json.load(f)["fitted"]
  return base_calibration().replace(**values)


# ------------------------------------------------------------------------- one point
def setup(pt: dict, calib: Calibration):
  """(shape, cluster, run, trace steps) of a point."""
  shape = get_shape(pt["model"])
  if pt.get("layers"):
    shape = shape.with_layers(pt["layers"], pt.get("dense_layers"))
  if pt.get("experts_per_gpu"):
    shape = dataclasses.replace(shape, num_experts=pt["experts_per_gpu"] * pt["gpus"])
  tokens = pt["tokens_per_gpu"]
  tokens = calib.tokens(tokens) if isinstance(tokens, str) else float(tokens)
  run = Run(pt["gpus"], tokens, pt["seq_len"], remat=pt.get("remat", True),
            dtype=pt.get("dtype", "bf16"))
  return shape, get_cluster(pt["cluster"]), run


@functools.lru_cache(maxsize=64)
def _trace(num_experts, top_k, gpus, tokens, steps, layers, seed=0):
  return ld.synthetic_trace(num_experts, top_k, gpus, int(tokens), steps=steps, layers=layers,
                            seed=seed)


def _system(name: str, pt: dict):
  from moejax.perf.systems import get_system
  s = get_system(name)
  if pt.get("reshard_every") and s.het_sharding:
    s = dataclasses.replace(s, reshard_every=int(pt["reshard_every"]))
  return s


def predict(pt: dict, calib: Calibration) -> float:
  shape, cluster, run = setup(pt, calib)
  systems = [_system(pt["system"], pt)]
  if pt["quantity"] == "speedup":
    systems.append(_system(pt["baseline"], pt))
  trace = None
  if any(s.family == "ep" for s in systems):
    timed = 2 * pt["reshard_every"] if pt.get("reshard_every") else TRACE_STEPS
    trace = _trace(shape.num_experts, shape.top_k, run.gpus, run.tokens_per_gpu,
                   WINDOW + timed, shape.moe_layers)
  times = [step_time(shape, cluster, run, s, calib, trace).seconds for s in systems]
  return times[0] if pt["quantity"] == "time" else times[1] / times[0]


# ---------------------------------------------------------------------------- the fit
def fit(points: list[dict] | None = None, start: Calibration | None = None) -> Calibration:
  from scipy.optimize import least_squares
  points = load_points() if points is None else points
  chosen = [p for p in points if p.get("fit")]
  if not chosen:
    raise ValueError("no point is marked fit")
  if 3 * len(chosen) > len(points):
    raise ValueError(f"{len(chosen)} of {len(points)} points in the fit: at most a third")
  base = base_calibration() if start is None else start
  x0 = np.log([dict(base.flat())[k] for k in PARAMS])
  lo = np.log([BOUNDS[k][0] for k in PARAMS])
  hi = np.log([BOUNDS[k][1] for k in PARAMS])

  def residuals(x):
    cal = base.replace(**dict(zip(PARAMS, np.exp(x))))
    return np.array([np.log(predict(p, cal) / p["value"]) for p in chosen])

  sol = least_squares(residuals, np.clip(x0, lo, hi), bounds=(lo, hi), x_scale=1.0,
                      diff_step=1e-3, xtol=1e-10, ftol=1e-10, max_nfev=400)
  return base.replace(**{k: float(f"{v:.6g}") for k, v in zip(PARAMS, np.exp(sol.x))})


@dataclasses.dataclass(frozen=True)
class Checked:
  point: dict
  predicted: float

  @property
  def error(self) -> float:
    """predicted / measured - 1."""
    return self.predicted / self.point["value"] - 1.0


def validate(calib: Calibration, points: list[dict] | None = None) -> list[Checked]:
  points = load_points() if points is None else points
  return [Checked(p, predict(p, calib)) for p in points]


def summary(checked: list[Checked]) -> dict:
  held = [abs(c.error) for c in checked if not c.point.get("fit")]
  fitted = [abs(c.error) for c in checked if c.point.get("fit")]
  return {"points": len(checked), "fit_points": len(fitted), "heldout_points": len(held),
          "max_rel_error_heldout": float(max(held)) if held else 0.0,
          "median_rel_error_heldout": float(np.median(held)) if held else 0.0,
          "heldout_within_15pct": int(sum(e <= 0.15 for e in held)),
          "max_rel_error_fit": float(max(fitted)) if fitted else 0.0}
