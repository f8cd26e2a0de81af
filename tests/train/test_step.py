"""One golden train step; the sharded fsdp step equals the single-device step in bf16 compute
over a 12-step run (ep: tests/train/test_families.py, in float32 compute; fssdp equals ep across
a re-shard, tests/placement/test_fssdp_train.py).

The two trainers are the suite's shared canonical ones (tests/conftest.py `trainer_for`). The
gradients compared are those of the first step, read back from Adam's first moment after it
(`tests.helpers.run_steps`): no separately jitted gradient function."""
import chex
import jax
import numpy as np
import pytest

from moejax.train.loop import put_batch
from tests.helpers import canonical_config, random_batches, run_steps


@pytest.fixture(scope="module")
def single(trainer_for):
  return run_steps(trainer_for(canonical_config("fsdp"), 1))


@pytest.fixture(scope="module")
def fsdp8(trainer_for):
  return run_steps(trainer_for(canonical_config("fsdp"), 8))


def test_golden_first_step(single):
  # Recorded from this implementation (tiny preset, seed 0, the batches above). A change here
  # means the model, initialization, loss or optimizer changed: update only on purpose.
  np.testing.assert_allclose(single["losses"][0], GOLDEN_LOSS0, rtol=1e-5)
  np.testing.assert_allclose(single["grad_norms"][0], GOLDEN_GRAD_NORM0, rtol=1e-4)
  assert single["losses"][-1] < single["losses"][0] - 0.1


def test_sharded_equals_single_device(single, fsdp8):
  sharded = fsdp8
  # Gradients of the same parameters on the same batch: bf16 compute, fp32 reductions.
  for path, g1, g8 in zip(jax.tree_util.tree_leaves_with_path(single["grads"]),
                          jax.tree.leaves(single["grads"]), jax.tree.leaves(sharded["grads"])):
    scale = np.max(np.abs(g1)) + 1e-12
    err = np.max(np.abs(g1 - g8)) / scale
    assert err < 2e-2, (jax.tree_util.keystr(path[0]), err)
  # The whole run follows the single-device loss curve (1e-5 apart over its 12 steps).
  np.testing.assert_allclose(sharded["losses"], single["losses"], rtol=1e-4, atol=0)


def test_train_step_traces_once(trainer_for, fsdp8):
  """The shared trainers' steps are guarded by chex.assert_max_traces(n=1); a call that would
  retrace (here: a batch of another dtype) fails instead of compiling a second program."""
  trainer = trainer_for(canonical_config("fsdp"), 8)
  assert trainer.trace_guard is not None
  state = fsdp8["state"]           # the run's last state: the failing call donates nothing
  batch = random_batches(trainer.cfg, 1)[0]
  bad = put_batch({k: v.astype(np.int16) for k, v in batch.items()}, trainer.mesh)
  with pytest.raises(AssertionError, match=r"traced > 1 times"):
    trainer.train_step(state, bad)
  chex.assert_trees_all_equal(fsdp8["params"], jax.device_get(state.params))


GOLDEN_LOSS0 = 5.7756123542785645
# 0.473636 before the CPU expert and matmul kernels (fp32 sums in another order; loss unchanged
# within 1e-5).
GOLDEN_GRAD_NORM0 = 0.473704
