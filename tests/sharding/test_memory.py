"""Parameter and optimizer memory per device scales as 1/devices (fsdp, tiny preset).

Read from XLA's memory analysis of the compiled train step on 1, 4 and 8 devices: its
argument bytes (parameters, optimizer state, the batch slice) are exactly this device's shards,
the donated state is updated in place, and the bytes per device fall as 1/n, up to the few
leaves that stay replicated (the step counters).
"""
import math

import jax
import numpy as np
import pytest

DEVICE_COUNTS = (1, 4, 8)


def _bytes(tree, replicated_only=False) -> int:
  """Bytes one device holds of a tree of ShapeDtypeStructs with shardings."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree)
             if not replicated_only or x.sharding.is_fully_replicated)


# 1 and 8 devices are the canonical trainers' own steps (tests/train/test_step.py runs them and
# test_collectives.py reads the 8-device one): only 4 compiles here.
@pytest.fixture(scope="module")
def steps(compiled_steps):
  return dict(zip(DEVICE_COUNTS, compiled_steps([("fsdp", n) for n in DEVICE_COUNTS])))


@pytest.mark.parametrize("n", DEVICE_COUNTS)
def test_arguments_are_this_devices_shards(steps, n):
  state, batch = steps[n].inputs
  memory = steps[n].compiled.memory_analysis()
  assert memory.argument_size_in_bytes == _bytes(state) + _bytes(batch)
  assert memory.alias_size_in_bytes == _bytes(state)      # donated: updated in place


def test_state_bytes_per_device_fall_as_one_over_devices(steps):
  whole = steps[1].compiled.memory_analysis().argument_size_in_bytes
  for n in DEVICE_COUNTS[1:]:
    per_device = steps[n].compiled.memory_analysis().argument_size_in_bytes
    replicated = _bytes(steps[n].inputs, replicated_only=True)
    assert replicated < 0.01 * whole / n, (n, replicated)
    # Everything else is split n ways: per_device = replicated + (whole - replicated) / n.
    assert whole / n <= per_device <= whole / n + replicated, (n, per_device, whole)
    assert per_device * n / whole < 1.01
