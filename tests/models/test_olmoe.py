import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import config as config_lib
from moejax.models import olmoe
from tests.helpers import tiny_config
import configs.olmoe as olmoe_configs


@pytest.fixture(scope="module")
def tiny():
  cfg = tiny_config()
  params = jax.jit(lambda k: olmoe.init_params(cfg, k))(jax.random.key(0))
  fwd = jax.jit(lambda p, t: olmoe.forward(cfg, p, t, remat="none"))
  return cfg, params, fwd


def test_shapes(tiny):
  cfg, params, fwd = tiny
  tokens = jnp.zeros((3, 16), jnp.int32)
  logits, aux = fwd(params, tokens)
  L, E = cfg.model.num_layers, cfg.moe.num_experts
  assert logits.shape == (3, 16, cfg.model.vocab_size) and logits.dtype == jnp.float32
  assert aux["load_E"].shape == (L, E)
  assert aux["aux_loss"].shape == (L,)
  # every token makes exactly top_k assignments in every layer
  np.testing.assert_array_equal(np.sum(aux["load_E"], axis=-1), 3 * 16 * cfg.moe.top_k)
  assert params["layers"]["moe"]["w_gate"].shape == (L, E, cfg.model.d_model,
                                                    cfg.moe.expert_hidden)


def test_causal(tiny):
  """Changing a future token cannot change an earlier logit."""
  cfg, params, fwd = tiny
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.model.vocab_size, (2, 16)).astype(np.int32)
  changed = tokens.copy()
  changed[:, 10:] = (changed[:, 10:] + 7) % cfg.model.vocab_size
  a, _ = fwd(params, tokens)
  b, _ = fwd(params, changed)
  np.testing.assert_array_equal(np.asarray(a[:, :10]), np.asarray(b[:, :10]))
  assert not np.allclose(np.asarray(a[:, 10:]), np.asarray(b[:, 10:]))


def test_token_ids_outside_the_vocabulary_are_refused(tiny):
  """An id past the vocabulary gathered a NaN row that reached every logit; ids held as values
  are checked before any work (traced ids under jit are not read back)."""
  cfg, params, _ = tiny
  v = cfg.model.vocab_size
  for bad in (np.full((1, 4), v, np.int32), np.full((1, 4), -1, np.int32)):
    with pytest.raises(ValueError, match=r"model.vocab_size"):
      olmoe.forward(cfg, params, bad)
  with pytest.raises(ValueError, match=r"integer ids"):
    olmoe.forward(cfg, params, np.zeros((1, 4), np.float32))
  with pytest.raises(ValueError, match=r"\[batch, seq\]"):
    olmoe.forward(cfg, params, np.zeros((4,), np.int32))


def test_param_count_matches_init():
  cfg = tiny_config()
  shapes = jax.eval_shape(lambda k: olmoe.init_params(cfg, k), jax.random.key(0))
  total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
  assert total == config_lib.num_params(cfg)["total"]


def test_1b7b_builds_abstractly_with_published_counts():
  cfg = config_lib.from_config_dict(olmoe_configs.get_config("1b7b"))
  shapes = jax.eval_shape(lambda k: olmoe.init_params(cfg, k), jax.random.key(0))
  total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
  counts = config_lib.num_params(cfg)
  assert total == counts["total"]
  # OLMoE paper and model card: 6.9B total, 1.3B active parameters (two digits, rounded).
  assert abs(total - 6.9e9) / 6.9e9 < 0.01
  assert round(counts["active"] / 1e8) == 13
