"""The entry point: seconds of one training step and where they go.

  step_time(shape, cluster, run, system, calib, trace=None) -> StepTime

`system` is a `moejax.perf.systems.System` or its name. The sharded family is built by
`moejax.perf.sharded` (keyword `ratios`: codec byte ratios), the expert-parallel family by
`moejax.perf.expert_parallel` (it needs `trace`, counts [steps, layers, devices, experts]; the
step time is the mean over the trace's steps after the load predictor's warm-up).
"""
from __future__ import annotations

from moejax.perf import expert_parallel, sharded
from moejax.perf.hardware import Cluster
from moejax.perf.model import Calibration, Run, StepTime
from moejax.perf.shapes import ModelShape
from moejax.perf.systems import get_system


def step_time(shape: ModelShape, cluster: Cluster, run: Run, system, calib: Calibration,
              trace=None, **kw) -> StepTime:
  """Seconds of one training step and its critical path by kind (see the module docstring)."""
  system = get_system(system) if isinstance(system, str) else system
  if system.family == "sharded":
    return sharded.step(shape, cluster, run, system, calib, **kw)
  if system.family == "ep":
    return expert_parallel.step(shape, cluster, run, system, calib, trace, **kw)
  raise ValueError(f"unknown system family {system.family!r}")
