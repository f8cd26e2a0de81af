"""The model's records: how a step is run, the calibrated figures, and what a step costs.

`moejax.perf.step.step_time(shape, cluster, run, system, calib, trace=None) -> StepTime` is the
entry point. `Run` says how the step is run (GPUs, tokens per GPU, sequence length, recomputation, dtype),
`System` which technique (`moejax.perf.systems.SYSTEMS`), `Calibration` the fitted
efficiencies (`moejax.perf.calibrate`). Systems that place experts by load (ep, fssdp, ...)
need a trace (`moejax.perf.loads`); the step time is then the mean over its steps.

The programs themselves are built in `moejax.perf.sharded` (ZeRO-3 / FSDP family: experts are
gathered like any weight) and `moejax.perf.expert_parallel` (ep family: experts stay on owners,
tokens travel) and simulated by `moejax.perf.schedule`.
"""
from __future__ import annotations

import collections
import dataclasses

from moejax.perf.collectives import Net
from moejax.perf.hardware import Cluster


@dataclasses.dataclass(frozen=True)
class Run:
  gpus: int
  tokens_per_gpu: float
  seq_len: int
  remat: bool = True
  """Activation checkpointing per layer (recompute the forward in the backward)."""
  dtype: str = "bf16"
  """Weights' 16-bit format on the wire: bf16 or fp16."""


@dataclasses.dataclass(frozen=True)
class Calibration:
  """The fitted figures (see moejax.perf.calibrate)."""
  gpu_eff: tuple[tuple[str, float], ...] = (("a100", 0.5),)
  """Fraction of peak bf16 FLOP/s per GPU kind; a kind without a figure (no measured point:
  h100, h200) uses the A100's."""
  link_eff: tuple[tuple[str, float], ...] = (("intra", 0.8), ("inter", 0.8))
  """Fraction of nominal bandwidth per link tier."""
  tokens_per_gpu: tuple[tuple[str, float], ...] = ()
  """Tokens per GPU per step of a paper that states no batch size (key: "ciera")."""
  host_s: tuple[tuple[str, float], ...] = (("deepspeed", 0.0),)
  """Framework seconds per separately fetched or reduced tensor (key: "deepspeed")."""

  def gpu(self, kind: str) -> float:
    d = dict(self.gpu_eff)
    return d.get(kind, d["a100"])

  def calibrated_gpu(self, kind: str) -> bool:
    return kind in dict(self.gpu_eff)

  def link(self, tier: str) -> float:
    return dict(self.link_eff)[tier]

  def tokens(self, key: str) -> float:
    return dict(self.tokens_per_gpu)[key]

  def host(self, framework: str) -> float:
    return dict(self.host_s).get(framework, 0.0)

  def replace(self, **values) -> Calibration:
    """A copy with flat keys changed: gpu_eff.a100=0.4, link_eff.inter=0.3, ..."""
    fields = {f: dict(getattr(self, f)) for f in ("gpu_eff", "link_eff", "tokens_per_gpu",
                                                  "host_s")}
    for key, v in values.items():
      f, _, k = key.partition(".")
      fields[f][k] = float(v)
    return Calibration(**{f: tuple(sorted(d.items())) for f, d in fields.items()})

  def flat(self) -> dict[str, float]:
    return {f"{f}.{k}": v for f in ("gpu_eff", "link_eff", "tokens_per_gpu", "host_s")
            for k, v in getattr(self, f)}


@dataclasses.dataclass(frozen=True)
class StepTime:
  seconds: float
  exposed: dict[str, float]
  """Critical-path seconds by kind (compute, straggler, host, codec, ag, rs, ar, a2a, spag,
  sprs, bcast, optimizer, reshard); sums to `seconds`."""
  busy: dict[str, float]
  extra: dict[str, float] = dataclasses.field(default_factory=dict)
  """Figures beside the time: memory_gb per GPU, straggler factor, selected fraction, ..."""

  @property
  def compute(self) -> float:
    return self.exposed.get("compute", 0.0)

  def comm(self) -> dict[str, float]:
    """Exposed communication by kind."""
    return {k: v for k, v in self.exposed.items()
            if k in ("ag", "rs", "ar", "a2a", "spag", "sprs", "bcast", "reshard")}


def net_of(cluster: Cluster, gpus: int, calib: Calibration) -> Net:
  return Net(cluster, gpus, calib.link("intra"), calib.link("inter"))


def mean_steps(results: list[StepTime]) -> StepTime:
  """The mean of per-step results (a trace's steps)."""
  n = len(results)
  if n == 1:
    return results[0]
  acc = {"exposed": collections.defaultdict(float), "busy": collections.defaultdict(float),
         "extra": collections.defaultdict(float)}
  for r in results:
    for f, total in acc.items():
      for k, v in getattr(r, f).items():
        total[k] += v / n
  return StepTime(sum(r.seconds for r in results) / n, dict(acc["exposed"]),
                  dict(acc["busy"]), dict(acc["extra"]))
