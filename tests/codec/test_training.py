"""Training with the compressed all-gather is bit-identical to training without it."""
import jax
import numpy as np
import pytest

from moejax.sharding.mesh import make_mesh
from moejax.train.loop import Trainer, put_batch
from tests.helpers import tiny_config

STEPS = 60


def _train(mode):
  cfg = tiny_config(**{"codec.mode": mode, "codec.warmup_steps": 5, "codec.block_size": 64,
                       "batch_size": 8, "seq_len": 32, "steps": STEPS})
  trainer = Trainer(cfg, mesh=make_mesh((2, 4), jax.devices()[:8]))
  state = trainer.init_state()
  rng = np.random.default_rng(7)
  losses, records = [], []
  for _ in range(STEPS):
    toks = rng.integers(0, 256, (cfg.batch_size, cfg.seq_len + 1)).astype(np.int32)
    batch = put_batch({"inputs": toks[:, :-1], "targets": toks[:, 1:]}, trainer.mesh)
    state, metrics = trainer.train_step(state, batch)
    records.append(metrics)
  records = jax.device_get(records)
  return np.array([r["loss"] for r in records]), jax.device_get(state.params), records


@pytest.fixture(scope="module")
def runs():
  return {mode: _train(mode) for mode in ("off", "block", "element")}


@pytest.mark.parametrize("mode", ["block", "element"])
def test_bitwise_identical_training(runs, mode):
  losses_off, params_off, _ = runs["off"]
  losses, params, records = runs[mode]
  np.testing.assert_array_equal(losses, losses_off)
  for a, b in zip(jax.tree.leaves(params_off), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)
  late = records[-1]
  assert late["codec_params"] > 0
  assert 0 <= late["exp_change_rate"] < 0.1
  if mode == "element":
    # After warm-up the element patches fit, and the experts' gathers shrink to about
    # sign+mantissa plus a small patch.
    assert late["codec_fallbacks"] == 0
    assert late["codec/experts/bytes_sent"] < 0.65 * late["codec/experts/bytes_plain"]
    assert late["gather_bytes"] < 0.7 * late["gather_bytes_plain"]
  else:
    # At the tiny preset's high learning rate most 64-value blocks still change every step:
    # block patches overflow and fall back to the dense (lossless) path, which is counted.
    assert late["codec_fallbacks"] > 0


def test_codec_metrics_when_off(runs):
  _, _, records = runs["off"]
  assert records[-1]["gather_bytes"] == records[-1]["gather_bytes_plain"] > 0
  assert "codec_params" not in records[-1]
