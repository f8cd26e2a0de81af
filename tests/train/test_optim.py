"""The optimizer's learning-rate schedule and gradient clipping, against hand-computed values
(weight decay's mask: tests/sharding/test_layout.py)."""
import math

import jax
import numpy as np
import optax
import pytest

from moejax.models import olmoe
from moejax.train import optim
from tests.helpers import tiny_config


def test_warm_up_then_cosine_to_the_floor():
  cfg = tiny_config(**{"steps": 110, "optim.lr": 1e-3, "optim.warmup_steps": 10,
                       "optim.min_lr_ratio": 0.1})
  lr = optim.lr_schedule(cfg)
  assert float(lr(0)) == 0.0
  assert float(lr(5)) == pytest.approx(5e-4, rel=1e-6)               # linear from 0
  assert float(lr(10)) == pytest.approx(1e-3, rel=1e-6)              # the peak
  # cosine over the 100 steps after warm-up, from the peak to lr x min_lr_ratio
  half = 1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + math.cos(math.pi * 0.5))
  assert float(lr(60)) == pytest.approx(half, rel=1e-6)
  assert float(lr(110)) == pytest.approx(1e-4, rel=1e-6)


def test_a_run_shorter_than_its_warm_up_stays_in_it():
  lr = optim.lr_schedule(tiny_config(**{"steps": 4, "optim.lr": 1e-3, "optim.warmup_steps": 8}))
  assert [float(lr(s)) for s in (0, 2, 4)] == pytest.approx([0.0, 2.5e-4, 5e-4], rel=1e-6)


@pytest.mark.parametrize("clip_norm", [0.5, 0.0])
def test_gradients_are_clipped_to_the_global_norm(clip_norm):
  """Adam's first moment after one step is (1 - b1) x the gradient it was given: the clipped
  one, of global norm `clip_norm`; with clipping off (0), the gradient as it came."""
  cfg = tiny_config(**{"optim.clip_norm": clip_norm})
  params = jax.tree.map(lambda m: np.ones(m.shape, np.float32), olmoe.param_meta(cfg))
  grads = jax.tree.map(lambda p: np.full(p.shape, 3.0, np.float32), params)
  norm = float(optax.tree.norm(grads))
  assert norm > 10 * 0.5
  tx = optim.make_optimizer(cfg)
  _, state = jax.jit(tx.update)(grads, jax.jit(tx.init)(params), params)   # one compile each
  mu = optax.tree_utils.tree_get(state, "mu")
  want = (1 - cfg.optim.b1) * (clip_norm if clip_norm else norm)
  np.testing.assert_allclose(float(optax.tree.norm(mu)), want, rtol=1e-5)


def test_the_indexer_is_clipped_apart_and_frozen_without_its_loss():
  """DeepSeek-V3.2's indexer (axes.OWN_LOSS) and the rest are clipped to the global norm each
  on its own, so neither's gradients scale the other's; with model.train_indexer False the
  optimizer leaves it as it is (no weight decay either)."""
  from moejax.sharding import axes
  for train in (True, False):
    cfg = tiny_config("deepseek_v32", **{"optim.clip_norm": 0.5, "model.train_indexer": train,
                                         "optim.weight_decay": 0.1, "optim.warmup_steps": 0})
    meta = olmoe.param_meta(cfg)
    own = jax.tree.map(lambda m: m.group in axes.OWN_LOSS, meta)
    params = jax.tree.map(lambda m: np.ones(m.shape, np.float32), meta)
    tx = optim.make_optimizer(cfg)
    for scale in (3.0, 300.0):       # the indexer's gradients grow; the rest's stay
      grads = jax.tree.map(lambda p, o: np.full(p.shape, scale if o else 3.0, np.float32),
                           params, own)
      updates, state = jax.jit(tx.update)(grads, jax.jit(tx.init)(params), params)
      mu = optax.tree_utils.tree_get(state, "mu")
      rest = [m for m, o in zip(jax.tree.leaves(mu), jax.tree.leaves(own)) if not o]
      indexer = [m for m, o in zip(jax.tree.leaves(mu), jax.tree.leaves(own)) if o]
      want = (1 - cfg.optim.b1) * 0.5
      np.testing.assert_allclose(float(optax.tree.norm(rest)), want, rtol=1e-5)
      np.testing.assert_allclose(float(optax.tree.norm(indexer)), want, rtol=1e-5)
      moved = [np.any(np.asarray(u) != 0) for u, o in zip(jax.tree.leaves(updates),
                                                          jax.tree.leaves(own)) if o]
      assert all(moved) if train else not any(moved)
