"""Joining a multi-process JAX job (`jax.distributed`).

On CPU, collectives between processes need a cross-process implementation; we ask for gloo
(TCP, no extra dependencies) unless JAX_CPU_COLLECTIVES_IMPLEMENTATION names another ("mpi").
The choice must be made before the first backend is created, i.e. before `initialize`.
"""
from __future__ import annotations

import os

import jax

from moejax.errors import ConfigError

CPU_COLLECTIVES_ENV = "JAX_CPU_COLLECTIVES_IMPLEMENTATION"


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  if value is None:
    return None
  try:
    return int(value)
  except ValueError:
    raise ConfigError(f"{name}={value!r}: expected an integer") from None


def maybe_initialize(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> bool:
  """Initializes jax.distributed if a coordinator is given by flag or environment."""
  coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
  if not coordinator:
    return False
  if num_processes is None:
    num_processes = _env_int("JAX_NUM_PROCESSES")
  if process_id is None:
    process_id = _env_int("JAX_PROCESS_ID")
  if num_processes is None or process_id is None:
    raise ConfigError("a coordinator address was given but not both --num_processes and "
                      "--process_id (or JAX_NUM_PROCESSES and JAX_PROCESS_ID)")
  if not 0 <= process_id < num_processes:
    raise ConfigError(f"--process_id={process_id} must be in [0, num_processes={num_processes})")
  if not os.environ.get(CPU_COLLECTIVES_ENV):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                             process_id=process_id)
  return True
