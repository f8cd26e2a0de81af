"""The iteration-time model: one training step of a model on a cluster, from shapes, link
tiers, the schedule's overlap and measured loads; calibrated on the papers' measured points.

  from moejax.perf import Run, get_cluster, get_shape, shape_of, step_time, load_fitted
  t = step_time(shape_of(cfg), get_cluster("ciera-a100"), Run(16, 2048, 1024), "fsdp",
                load_fitted())
  t.seconds, t.exposed      # step time and its critical path by kind

Modules: hardware (clusters as data), shapes (model shapes; `shape_of(Config)`), compute
(FLOPs), collectives (alpha-beta per link tier), codec (byte ratios and kernel costs), loads
(traces and placements), schedule (streams and overlap), model (Run, Calibration, StepTime),
sharded / expert_parallel (the step programs), step (`step_time`), systems (the techniques),
calibrate (fit and validation on data/points.json), report (tables, plot), cli
(`python -m moejax.perf`), latencies (a compiled program's instructions priced for XLA:GPU's
scheduler: config `schedule_latencies`). Pure numpy and text: nothing is compiled.
"""
from moejax.perf.calibrate import load_fitted
from moejax.perf.hardware import CLUSTERS, get_cluster
from moejax.perf.model import Calibration, Run, StepTime
from moejax.perf.shapes import SHAPES, ModelShape, get_shape, shape_of
from moejax.perf.step import step_time
from moejax.perf.systems import SYSTEMS, System, get_system

__all__ = ["CLUSTERS", "SHAPES", "SYSTEMS", "Calibration", "ModelShape", "Run", "StepTime",
           "System", "get_cluster", "get_shape", "get_system", "load_fitted", "shape_of",
           "step_time"]
