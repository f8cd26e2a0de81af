"""One golden train step; the sharded step equals the single-device step (fsdp and ep)."""
import jax
import numpy as np
import pytest

from moejax.sharding.mesh import make_mesh
from moejax.train.loop import Trainer, put_batch
from moejax.train.step import make_grad_fn
from tests.helpers import tiny_config

STEPS = 20


def _batches(cfg, n):
  rng = np.random.default_rng(123)
  out = []
  for _ in range(n):
    toks = rng.integers(0, 256, (cfg.batch_size, cfg.seq_len + 1)).astype(np.int32)
    out.append({"inputs": toks[:, :-1], "targets": toks[:, 1:]})
  return out


def _run(placement, num_devices):
  cfg = tiny_config(**{"moe.placement": placement, "log_every": 1})
  trainer = Trainer(cfg, mesh=make_mesh((1, -1), jax.devices()[:num_devices]))
  state = trainer.init_state()
  batches = [put_batch(b, trainer.mesh) for b in _batches(cfg, STEPS)]
  grads, _, _, _ = jax.jit(make_grad_fn(cfg, trainer.mesh, trainer.layout))(
      state.params, batches[0], state.step, state.gather_state)
  grads = jax.device_get(grads)
  losses, grad_norms = [], []
  for b in batches:
    state, metrics = trainer.train_step(state, b)
    losses.append(float(metrics["loss"]))
    grad_norms.append(float(metrics["grad_norm"]))
  return {"grads": grads, "losses": np.array(losses), "grad_norms": np.array(grad_norms),
          "params": jax.device_get(state.params), "metrics": jax.device_get(metrics)}


@pytest.fixture(scope="module")
def single():
  return _run("fsdp", 1)


@pytest.fixture(scope="module")
def fsdp8():
  return _run("fsdp", 8)


@pytest.fixture(scope="module")
def ep8():
  return _run("ep", 8)


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
  # 20 steps follow the single-device loss curve.
  np.testing.assert_allclose(sharded["losses"], single["losses"], rtol=2e-3, atol=2e-3)


def test_fsdp_and_ep_give_the_same_loss(fsdp8, ep8):
  np.testing.assert_allclose(ep8["losses"][0], fsdp8["losses"][0], rtol=1e-6)
  np.testing.assert_allclose(ep8["losses"], fsdp8["losses"], rtol=2e-3)
  assert ep8["metrics"]["ep_dropped_frac"] == 0.0     # dropless by default
  assert np.all(ep8["metrics"]["dropped_frac"] == 0.0)


GOLDEN_LOSS0 = 5.7756123542785645
GOLDEN_GRAD_NORM0 = 0.47363582253456116
