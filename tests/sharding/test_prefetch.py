"""Prefetching the next layer's gather changes nothing numerically, on 8 devices, with and
without remat: one train step of the canonical config (prefetch and remat on: the suite's shared
fsdp trainer) gives bit-identical loss, gradients (Adam's moments) and parameters."""
import jax
import numpy as np
import optax
import pytest

from moejax.train.loop import put_batch
from tests.helpers import canonical_config


def _one_step(trainer_for, prefetch, remat):
  trainer = trainer_for(canonical_config("fsdp", prefetch=prefetch, remat=remat), 8)
  cfg = trainer.cfg
  toks = np.random.default_rng(0).integers(0, 256, (cfg.batch_size, cfg.seq_len + 1))
  batch = put_batch({"inputs": toks[:, :-1].astype(np.int32),
                     "targets": toks[:, 1:].astype(np.int32)}, trainer.mesh)
  state, metrics = trainer.train_step(trainer.init_state(), batch)
  adam = {k: optax.tree_utils.tree_get(state.opt_state, k) for k in ("mu", "nu")}
  return jax.device_get((float(metrics["loss"]), adam, state.params))


@pytest.mark.parametrize("remat", [True, False])
def test_prefetch_matches_plain_scan(trainer_for, remat):
  (loss_plain, adam_plain, params_plain) = _one_step(trainer_for, False, remat)
  (loss_pre, adam_pre, params_pre) = _one_step(trainer_for, True, remat)
  assert loss_pre == loss_plain
  for a, b in zip(jax.tree.leaves((adam_plain, params_plain)),
                  jax.tree.leaves((adam_pre, params_pre))):
    np.testing.assert_array_equal(a, b)
