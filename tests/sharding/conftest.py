"""Compiled train steps shared by the sharding tests (compiling is the slow part on CPU): the
canonical trainers of the session (tests/conftest.py `trainer_for`), lowered ahead of time. With
default compiler options the executable is the one their jitted train step runs (XLA compiles it
once, whichever comes first)."""
import concurrent.futures

import pytest

from moejax.train.loop import Trainer
from tests.helpers import canonical_config


def abstract_inputs(trainer: Trainer):
  return trainer.abstract_inputs()


class CompiledStep:
  """The canonical train step for one placement on the first `num_devices` devices."""

  def __init__(self, trainer: Trainer, compiler_options=None):
    self.trainer = trainer
    num_devices = trainer.mesh.devices.size
    self.num_devices = num_devices
    self.inputs = abstract_inputs(self.trainer)
    self.lowered = self.trainer.train_step.lower(*self.inputs)
    self.compiler_options = compiler_options
    self.compiled = None

  def compile(self) -> "CompiledStep":
    if self.compiled is None:
      self.compiled = self.lowered.compile(self.compiler_options)
    return self


@pytest.fixture(scope="session")
def compiled_steps(trainer_for):
  """compiled_steps([(placement, num_devices), ...], compiler_options=None) -> [CompiledStep],
  each compiled once per session; the missing ones compile side by side (XLA releases the GIL).
  """
  cache = {}

  def get(keys, compiler_options=None):
    options_key = tuple(sorted((compiler_options or {}).items()))
    for placement, n in keys:
      if (placement, n, options_key) not in cache:
        cache[placement, n, options_key] = CompiledStep(
            trainer_for(canonical_config(placement), n), compiler_options)
    steps = [cache[placement, n, options_key] for placement, n in keys]
    with concurrent.futures.ThreadPoolExecutor(len(steps)) as pool:
      return list(pool.map(CompiledStep.compile, steps))

  return get


@pytest.fixture(scope="session")
def compiled_step(compiled_steps):
  """compiled_step(placement, num_devices) -> CompiledStep (default compiler options)."""
  return lambda placement, num_devices: compiled_steps([(placement, num_devices)])[0]
