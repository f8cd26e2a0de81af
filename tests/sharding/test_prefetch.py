"""Prefetching the next layer's gather changes nothing numerically, on 8 devices: one train
step of the canonical config (prefetch and remat on: the suite's shared fsdp trainer) gives
bit-identical loss, gradients (Adam's moments) and parameters without prefetch. Every remat mode,
with and without prefetch, is checked on a small scanned layer (bit for bit per mode)."""
import jax
import numpy as np
import optax

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


def test_prefetch_matches_plain_scan(trainer_for):
  (loss_plain, adam_plain, params_plain) = _one_step(trainer_for, False, "full")
  (loss_pre, adam_pre, params_pre) = _one_step(trainer_for, True, "full")
  assert loss_pre == loss_plain
  for a, b in zip(jax.tree.leaves((adam_plain, params_plain)),
                  jax.tree.leaves((adam_pre, params_pre))):
    np.testing.assert_array_equal(a, b)


def test_remat_modes_and_prefetch_give_the_same_gradients():
  """scan_layers on a small two-matmul layer (the plain local gather): every remat mode, with and
  without prefetch, gives the gradients of the plain scan (one compile for all six); prefetch
  changes no bit within a mode."""
  from moejax.sharding import prefetch as prefetch_lib
  from moejax.sharding.hook import local_gather

  def layer_fn(h, full, consts, i):
    return h + jax.numpy.tanh(h @ full["a"]) @ full["b"], {"i": i}

  def gather(shards, state):
    return local_gather("layers", shards, state, dtype=jax.numpy.float32)

  key = jax.random.key(0)
  shards = {"a": jax.random.normal(key, (3, 8, 8)) * 0.3,
            "b": jax.random.normal(jax.random.fold_in(key, 1), (3, 8, 8)) * 0.3}
  h = jax.random.normal(jax.random.fold_in(key, 2), (4, 8))

  def grads(h, shards):
    def loss(h, shards, remat, prefetch):
      out = prefetch_lib.scan_layers(layer_fn, h, shards, gather, None, (), remat=remat,
                                     prefetch=prefetch)[0]
      return jax.numpy.sum(out ** 2)
    return [jax.grad(loss, argnums=(0, 1))(h, shards, r, p)
            for r in prefetch_lib.REMAT_MODES for p in (False, True)]

  results = jax.jit(grads)(h, shards)
  for plain, prefetched in zip(results[0::2], results[1::2]):
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(prefetched)):
      np.testing.assert_array_equal(a, b)
  for got in results[1:]:
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(results[0])):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
