"""One golden train step; the sharded step equals the single-device step (fsdp and ep).

The three trainers are the suite's shared canonical ones (tests/conftest.py `trainer_for`). The
gradients compared are those of the first step, read back from Adam's first moment after it
(mu = (1 - b1) * g; the first step's gradient norm is below optim.clip_norm, so g is unclipped):
no separately jitted gradient function."""
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


@pytest.fixture(scope="module")
def ep8(trainer_for):
  return run_steps(trainer_for(canonical_config("ep"), 8))


def test_golden_first_step(single):
  # Recorded from this implementation (tiny preset, seed 0, the batches above). A change here
  # means the model, initialization, loss or optimizer changed: update only on purpose.
  np.testing.assert_allclose(single["losses"][0], GOLDEN_LOSS0, rtol=1e-5)
  np.testing.assert_allclose(single["grad_norms"][0], GOLDEN_GRAD_NORM0, rtol=1e-4)
  assert single["losses"][-1] < single["losses"][0] - 0.1


@pytest.mark.parametrize("name", ["fsdp8", "ep8"])
def test_sharded_equals_single_device(name, single, request):
  sharded = request.getfixturevalue(name)
  # Gradients of the same parameters on the same batch: bf16 compute, fp32 reductions.
  for path, g1, g8 in zip(jax.tree_util.tree_leaves_with_path(single["grads"]),
                          jax.tree.leaves(single["grads"]), jax.tree.leaves(sharded["grads"])):
    scale = np.max(np.abs(g1)) + 1e-12
    err = np.max(np.abs(g1 - g8)) / scale
    assert err < 2e-2, (jax.tree_util.keystr(path[0]), err)
  # The whole run follows the single-device loss curve.
  np.testing.assert_allclose(sharded["losses"], single["losses"], rtol=2e-3, atol=2e-3)


def test_fsdp_and_ep_give_the_same_loss(fsdp8, ep8):
  np.testing.assert_allclose(ep8["losses"][0], fsdp8["losses"][0], rtol=1e-6)
  np.testing.assert_allclose(ep8["losses"], fsdp8["losses"], rtol=2e-3)
  assert ep8["metrics"]["ep_dropped_frac"] == 0.0     # dropless by default
  assert np.all(ep8["metrics"]["dropped_frac"] == 0.0)


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
