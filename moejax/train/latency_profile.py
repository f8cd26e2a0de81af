"""The train step scheduled by moejax's latencies (config `schedule_latencies="model"`).

`ModelScheduledStep(jitted, cfg, mesh)` behaves as the jitted step (its `lower`, `trace`, ...
are the jitted function's) but compiles each input signature twice at its first call: once as
XLA would, then, from that program's instructions priced by `moejax.perf.latencies` on the
config's cluster, again with the prices as XLA:GPU's profile-guided latency estimator's
profile (`xla_gpu_pgle_profile_file_or_directory_path`, a per-compile option). The lowering is
the same, so the math is (bit-identical results); only where XLA places each collective's
start and done, and so what it overlaps, can change. Each process of a job builds the same
profile from the same program (jax's measured PGLE would need every process to agree on its
measurements). The first call logs both schedules priced by the model.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import time
from typing import NamedTuple

import jax

from moejax.errors import ConfigError
from moejax.perf import calibrate, hardware, latencies
from moejax.perf.model import net_of
from moejax.train.metrics import log

PROFILE_OPTION = "xla_gpu_pgle_profile_file_or_directory_path"


def check_cluster(name: str) -> None:
  """ConfigError unless `name` is "auto" or a `moejax.perf` cluster (config `schedule_cluster`)."""
  if name != "auto" and name not in hardware.CLUSTERS:
    raise ConfigError(f"config.schedule_cluster={name!r}: must be one of auto, "
                      f"{', '.join(hardware.CLUSTERS)}")


def cluster_for(name: str, device) -> hardware.Cluster:
  """`schedule_cluster`'s cluster: a named one, or for "auto" the preset of `device`'s kind."""
  check_cluster(name)
  if name != "auto":
    return hardware.get_cluster(name)
  kind = str(getattr(device, "device_kind", "")).upper()
  if "H200" in kind:
    return hardware.H200_NODE
  if "A100" in kind:
    return hardware.THEMIS_A
  return hardware.H100_NODE


def write_profile(text: str, directory: str | None = None) -> str:
  """The profile's path: named by its content's hash, so the compile option (and with it a key
  of jax's persistent compilation cache) is the same for the same profile in every run, and
  written once per host by whichever process comes first (atomically: others may read it)."""
  # (per user: a shared folder would be its first user's)
  directory = directory or os.path.join(tempfile.gettempdir(), f"moejax_latencies_{os.getuid()}")
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, hashlib.sha256(text.encode()).hexdigest()[:24] + ".pbtxt")
  if not os.path.exists(path):
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
      f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
  return path


class Scheduled(NamedTuple):
  """One input signature's compiled step, and what the model says of both schedules."""
  compiled: object
  profile_path: str
  instructions: int
  xla: latencies.ScheduleTime
  model: latencies.ScheduleTime
  compile_s: float
  names_found: float
  """The fraction of the profile's instructions the second compile's program still names (the
  rest were renamed after scheduling: their names were matched before it, or XLA fell back to
  its own estimate for them)."""


class ModelScheduledStep:
  def __init__(self, jitted, cluster: hardware.Cluster, num_devices: int, *, quiet=False):
    self._jitted = jitted
    self.cluster = cluster
    self.num_devices = num_devices
    self._quiet = quiet
    self._calib = calibrate.load_fitted()
    self._net = net_of(cluster, num_devices, self._calib)
    self._compiled: dict = {}
    self._last = None

  def __getattr__(self, name):           # lower, trace, eval_shape, ...: the jitted step's
    return getattr(self._jitted, name)

  @property
  def scheduled(self) -> list[Scheduled]:
    """The input signatures compiled so far, in order."""
    return list(self._compiled.values())

  def price(self, hlo_text: str) -> dict[str, float]:
    return latencies.instruction_costs(hlo_text, self.cluster.gpu, self._net,
                                       self._calib.gpu(self.cluster.gpu.kind))

  def compile(self, *args) -> Scheduled:
    """Compiles the step for `args` (arrays or ShapeDtypeStructs with shardings) both ways."""
    start = time.perf_counter()
    lowered = self._jitted.lower(*args)
    first = lowered.compile()
    first_text = first.as_text()
    costs = self.price(first_text)
    path = write_profile(latencies.profile_text(costs))
    second = lowered.compile(compiler_options={PROFILE_OPTION: path})
    second_text = second.as_text()
    second_costs = self.price(second_text)
    return Scheduled(second, path, len(costs), latencies.schedule_time(first_text, costs),
                     latencies.schedule_time(second_text, second_costs),
                     time.perf_counter() - start,
                     len(set(costs) & set(second_costs)) / max(len(costs), 1))

  def __call__(self, *args):
    if self._last is not None:
      try:     # the signature of the last call (the executable checks types and shardings
        return self._last(*args)     # before it runs anything)
      except (TypeError, ValueError):
        pass
    leaves, treedef = jax.tree.flatten(args)
    key = (treedef, tuple((getattr(x, "shape", None), str(getattr(x, "dtype", type(x))),
                           getattr(x, "sharding", None)) for x in leaves))
    if key not in self._compiled:
      scheduled = self.compile(*args)
      self._compiled[key] = scheduled
      if not self._quiet:
        log(describe(scheduled, self.cluster, self.num_devices,
                     jax.devices()[0].platform))
    self._last = self._compiled[key].compiled
    return self._last(*args)


def describe(s: Scheduled, cluster: hardware.Cluster, num_devices: int, platform: str) -> str:
  ms = lambda t: f"{t * 1e3:.1f}"     # noqa: E731
  line = (f"moejax: train step scheduled by moejax's latencies ({s.instructions} instructions "
          f"priced on {num_devices} x {cluster.gpu.name}, cluster {cluster.name}, "
          f"{s.names_found:.0%} of them found after; compiled "
          f"twice in {s.compile_s:.1f} s): priced step {ms(s.xla.step)} ms with XLA's own "
          f"schedule, {ms(s.model.step)} ms with this one (collectives exposed "
          f"{ms(s.xla.exposed)} -> {ms(s.model.exposed)} of {ms(s.model.collectives)} ms)")
  if platform == "cpu":
    line += "; XLA:CPU overlaps no collective, so on CPU the schedule is unchanged"
  return line
