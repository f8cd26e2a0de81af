"""Prefetching the next layer's gather changes nothing numerically, on 8 devices, with and
without remat."""
import jax
import numpy as np
import pytest

from moejax.sharding.mesh import make_mesh
from moejax.train.loop import Trainer, put_batch
from moejax.train.step import make_grad_fn
from tests.helpers import tiny_config


def _grads(prefetch, remat, placement="fsdp"):
  cfg = tiny_config(**{"prefetch": prefetch, "remat": remat, "moe.placement": placement,
                       "batch_size": 8, "seq_len": 32, "model.num_layers": 3})
  trainer = Trainer(cfg, mesh=make_mesh((1, -1), jax.devices()[:8]))
  state = trainer.init_state()
  toks = np.random.default_rng(0).integers(0, 256, (8, 33)).astype(np.int32)
  batch = put_batch({"inputs": toks[:, :-1], "targets": toks[:, 1:]}, trainer.mesh)
  grads, parts, _, _ = jax.jit(make_grad_fn(cfg, trainer.mesh, trainer.layout))(
      state.params, batch, state.step, state.gather_state)
  return jax.device_get(grads), float(parts["loss"])


@pytest.mark.parametrize("remat", [True, False])
def test_prefetch_matches_plain_scan(remat):
  g_plain, loss_plain = _grads(False, remat)
  g_pre, loss_pre = _grads(True, remat)
  assert loss_pre == loss_plain
  for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_pre)):
    np.testing.assert_array_equal(a, b)
