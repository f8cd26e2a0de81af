"""bench/reference.py, the floor bench/step.py times moejax against: its data-parallel form on 8
devices is the same math as its one-device form (sharded == single-device)."""
import os
import re
import sys

import jax
import numpy as np
import optax
import pytest

from moejax.models import olmoe
from moejax.sharding.mesh import make_mesh
from moejax.train.loop import put_batch
from tests.helpers import REPO, tiny_config

sys.path.insert(0, os.path.join(REPO, "bench"))
import reference  # noqa: E402


def _batches(cfg, count):
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.model.vocab_size, (count, cfg.batch_size, cfg.seq_len + 1),
                        dtype=np.int32)
  return [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]


def test_the_floor_on_8_devices_trains_as_on_one():
  cfg = tiny_config()
  batches = _batches(cfg, 3)
  params = jax.tree.map(np.asarray, olmoe.init_params(cfg, jax.random.key(0)))  # steps donate

  step1, tx = reference.make_train_step(cfg, remat=cfg.remat)
  p1 = jax.tree.map(jax.numpy.asarray, params)
  o1 = tx.init(p1)
  ce1 = []
  for b in batches:
    p1, o1, ce = step1(p1, o1, b)
    ce1.append(float(ce))

  mesh = make_mesh((1, -1), jax.devices()[:8])
  step8, init8 = reference.make_sharded_train_step(cfg, mesh, remat=cfg.remat)
  p8, o8 = init8(params)
  ce8 = []
  for b in batches:
    b = put_batch(b, mesh)
    p8, o8, ce = step8(p8, o8, b["inputs"], b["targets"])
    ce8.append(float(ce))

  # The same math in another summation order (bf16 compute): equal to float rounding.
  np.testing.assert_allclose(ce8, ce1, rtol=2e-5)
  # The gradients, through Adam's first moment (linear in them: a gradient off by a factor
  # would show here, not in the parameters, as Adam's steps do not depend on the gradient's
  # scale). Per-device bf16 products round differently: 0.3-0.5% apart after one step.
  mu1 = optax.tree_utils.tree_get(o1, "mu")
  mu8 = optax.tree_utils.tree_get(o8, "mu")
  for a, b in zip(jax.tree.leaves(mu8), jax.tree.leaves(mu1)):
    a, b = np.asarray(a), np.asarray(b)
    assert abs(np.linalg.norm(a) / np.linalg.norm(b) - 1) < 0.01
    # Near-tie routings flip between the two as their parameters part: the expert leaves are
    # 4-5% apart after 3 steps, the others under 1%.
    assert np.linalg.norm(a - b) < 0.1 * np.linalg.norm(b)
  # The parameters: Adam steps of about lr wherever the gradient is nonzero, so an element
  # whose gradient is near 0 may step either way; compare the updates as a whole.
  update1, update8 = (np.concatenate([(np.asarray(a) - b).ravel() for a, b in zip(
      jax.tree.leaves(p), jax.tree.leaves(params))]) for p in (p1, p8))
  assert np.linalg.norm(update8 - update1) < 0.1 * np.linalg.norm(update1)
  # Every device holds the same parameters after the all-gather.
  w = p8["layers"]["moe"]["w_gate"]
  shards = [np.asarray(s.data) for s in w.addressable_shards]
  assert all(np.array_equal(shards[0], s) for s in shards[1:])


def test_the_floor_refuses_options_it_does_not_write():
  """The floor is OLMoE's step: another family's options would be timed against other math."""
  reference.check_modelled(tiny_config())
  for family, field in (("glm4_moe", "config.model.qk_norm='head'"),
                        ("ernie4_5_moe", "config.model.qk_norm='none'"),
                        ("deepseek_v3", "config.model.qk_norm='none'")):
    with pytest.raises(ValueError, match=re.escape(field)):
      reference.check_modelled(tiny_config(family))
  with pytest.raises(ValueError, match="config.model.rotary_interleaved=True"):
    reference.check_modelled(tiny_config(**{"model.rotary_interleaved": True}))
