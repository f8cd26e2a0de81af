"""The replica codec's pieces on one device: patches rebuild an expert exactly (every bit
pattern), a patch that does not fit says so, and a slot hits only when its device held the
expert last step (in any slot), the state is valid and the patch fits."""
import jax.numpy as jnp
import numpy as np

from moejax.codec import replicas

CODEC = replicas.ReplicaCodec(96, "bfloat16")


def _experts(rng, k):
  bits = rng.standard_normal((k, CODEC.values)).astype(jnp.bfloat16).view(np.uint16)
  bits[0, :4] = [0x7fbf, 0x8000, 0x7f80, 0x0001]    # NaN payload, -0.0, +inf, a subnormal
  return bits


def test_patches_rebuild_experts_exactly_and_report_overflow():
  rng = np.random.default_rng(0)
  prev = _experts(rng, 3)
  now = prev.astype(np.int32) + rng.integers(-3, 4, prev.shape)
  now[:, :4] = prev[:, :4]
  now[0, 4], now[0, 5] = 0x7fc1, 0x8000             # a new NaN payload, a sign flip to -0.0
  now[2] = rng.integers(0, 2 ** 16, CODEC.values)     # moved wholesale: over capacity
  now = now.astype(np.uint16)
  patches, fits = replicas.encode(jnp.asarray(now), jnp.asarray(prev), CODEC)
  np.testing.assert_array_equal(np.asarray(fits), [True, True, False])
  plain, patch_rows = replicas.rows(jnp.asarray(now), patches, CODEC)
  assert patch_rows.shape == plain.shape == (3, CODEC.row_words)
  got = replicas.decode(patch_rows[:2], jnp.array([True, True]), jnp.asarray(prev[:2]), CODEC)
  np.testing.assert_array_equal(np.asarray(got), now[:2])
  got = replicas.decode(plain, jnp.zeros((3,), bool), jnp.zeros_like(jnp.asarray(prev)), CODEC)
  np.testing.assert_array_equal(np.asarray(got), now)
  tiny = replicas.ReplicaCodec(3 * 64 * 128)           # the tiny preset's expert
  assert tiny.patch_bytes < 0.3 * tiny.plain_bytes


def test_bits_round_trip_three_matrices():
  rng = np.random.default_rng(1)
  ws = (jnp.asarray(rng.standard_normal((2, 4, 8)), jnp.bfloat16),
        jnp.asarray(rng.standard_normal((2, 4, 8)), jnp.bfloat16),
        jnp.asarray(rng.standard_normal((2, 8, 4)), jnp.bfloat16))
  bits = replicas.to_bits(ws, CODEC.layout)
  assert bits.shape == (2, CODEC.values)
  for a, b in zip(replicas.from_bits(bits, ws, CODEC.layout), ws):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


def test_a_slot_hits_when_its_device_held_the_expert_and_the_patch_fits():
  e = 6
  state = replicas.init_state(3, 2, 2, CODEC)
  state = {**state, "held": jnp.array([[0, 1], [2, e], [3, 4]]), "valid": jnp.ones((), bool)}
  now = jnp.array([[1, 0], [2, 5], [e, 4]])           # swapped; kept + new; empty + kept
  fits = jnp.array([True, True, True, True, False, True])
  hit, source = replicas.hits(state, now, fits)
  np.testing.assert_array_equal(np.asarray(hit), [[True, True], [True, False], [False, False]])
  np.testing.assert_array_equal(np.asarray(source)[:2], [[1, 0], [0, 0]])
  hit, _ = replicas.hits(replicas.invalidate(state), now, fits)
  assert not np.any(np.asarray(hit))
