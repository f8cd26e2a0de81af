"""Joining a multi-process JAX job (`jax.distributed`)."""
from __future__ import annotations

import os

import jax

from moejax.errors import ConfigError


def maybe_initialize(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> bool:
  """Initializes jax.distributed if a coordinator is given by flag or environment."""
  coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
  if not coordinator:
    return False
  if num_processes is None and "JAX_NUM_PROCESSES" in os.environ:
    num_processes = int(os.environ["JAX_NUM_PROCESSES"])
  if process_id is None and "JAX_PROCESS_ID" in os.environ:
    process_id = int(os.environ["JAX_PROCESS_ID"])
  if num_processes is None or process_id is None:
    raise ConfigError("a coordinator address was given but not both --num_processes and "
                      "--process_id (or JAX_NUM_PROCESSES and JAX_PROCESS_ID)")
  if not 0 <= process_id < num_processes:
    raise ConfigError(f"--process_id={process_id} must be in [0, num_processes={num_processes})")
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                             process_id=process_id)
  return True
