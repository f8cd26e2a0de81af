"""The replica codec's pieces on one device: patches rebuild an expert exactly (every bit
pattern) in the smallest format that fits, or say that none does, and a slot hits only when its
device held the expert last step (in any slot), the state is valid and a patch fits."""
import jax
import jax.numpy as jnp
import numpy as np

from moejax.codec import replicas

CODEC = replicas.ReplicaCodec(128, "bfloat16")   # every format's patch is smaller than plain


def _experts(rng, k):
  bits = rng.standard_normal((k, CODEC.values)).astype(jnp.bfloat16).view(np.uint16)
  bits[0, :4] = [0x7fbf, 0x8000, 0x7f80, 0x0001]    # NaN payload, -0.0, +inf, a subnormal
  return bits


def test_patches_rebuild_experts_exactly_in_the_smallest_format_that_fits():
  rng = np.random.default_rng(0)
  prev = _experts(rng, 4)
  now = prev.astype(np.int32) + rng.integers(-3, 4, prev.shape)       # 3-bit codes
  now[1] = prev[1].astype(np.int32) + rng.integers(-7, 8, prev.shape[1])   # 4-bit codes
  now[2] = prev[2].astype(np.int32) + rng.integers(-100, 101, prev.shape[1])   # a byte each
  now[:, :4] = prev[:, :4]
  now[0, 4], now[0, 5] = 0x7fc1, 0x8000             # a new NaN payload, a sign flip to -0.0
  now[3] = rng.integers(0, 2 ** 16, CODEC.values)     # moved wholesale: no format fits
  now = now.astype(np.uint16)
  patches, choice = replicas.encode(jnp.asarray(now), jnp.asarray(prev), CODEC)
  np.testing.assert_array_equal(np.asarray(choice), [1, 2, 3, 0])
  assert patches.shape == (4, CODEC.row_words)
  got = replicas.decode(patches, choice, jnp.asarray(prev), CODEC)
  np.testing.assert_array_equal(np.asarray(got)[:3], now[:3])
  plain = replicas.plain_rows(jnp.asarray(now), CODEC)
  got = replicas.decode(plain, jnp.zeros((4,), jnp.int32), jnp.zeros_like(jnp.asarray(prev)),
                        CODEC)
  np.testing.assert_array_equal(np.asarray(got), now)
  tiny = replicas.ReplicaCodec(3 * 64 * 128)           # the tiny preset's expert
  fractions = [w / tiny.plain_words for w in tiny.words_by_choice]
  np.testing.assert_allclose(fractions, [1.0, 0.27, 0.41, 0.59], atol=0.01)


def test_a_format_whose_patch_is_no_smaller_than_the_expert_is_never_chosen():
  """A small expert's patch can outweigh it (sections round up to whole words, capacities to a
  value): at 96 bf16 values the byte format's patch is 48 words, as large as the plain expert,
  so moves that only it holds send the expert plain; at 128 values (56 against 64) it is chosen.
  No replica costs more than plain."""
  rng = np.random.default_rng(4)
  for values, byte_choice in ((96, 0), (128, 3)):
    codec = replicas.ReplicaCodec(values)
    prev = rng.standard_normal((3, values)).astype(jnp.bfloat16).view(np.uint16)
    moves = np.stack([rng.integers(-3, 4, values), rng.integers(-7, 8, values),
                      rng.integers(-100, 101, values)])
    now = jnp.asarray((prev.astype(np.int32) + moves).astype(np.uint16))
    _, choice = replicas.encode(now, jnp.asarray(prev), codec)
    np.testing.assert_array_equal(np.asarray(choice), [1, 2, byte_choice])
    words = np.asarray(codec.words_by_choice)[np.asarray(choice)]
    assert np.all(words[np.asarray(choice) > 0] < codec.plain_words), (values, words)


def test_bits_round_trip_three_matrices():
  rng = np.random.default_rng(1)
  ws = (jnp.asarray(rng.standard_normal((2, 4, 8)), jnp.bfloat16),
        jnp.asarray(rng.standard_normal((2, 4, 8)), jnp.bfloat16),
        jnp.asarray(rng.standard_normal((2, 8, 4)), jnp.bfloat16))
  bits = replicas.to_bits(ws, CODEC.layout)
  assert bits.shape == (2, 96)
  for a, b in zip(replicas.from_bits(bits, ws, CODEC.layout), ws):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


def test_a_slot_hits_when_its_device_held_the_expert_and_a_patch_fits():
  e = 6
  state = replicas.init_state(3, 2, 2, CODEC)
  state = {**state, "held": jnp.array([[0, 1], [2, e], [3, 4]]), "valid": jnp.ones((), bool)}
  now = jnp.array([[1, 0], [2, 5], [e, 4]])           # swapped; kept + new; empty + kept
  choice_E = jnp.array([1, 3, 2, 1, 0, 1])
  choice, source = replicas.hits(state, now, choice_E)
  np.testing.assert_array_equal(np.asarray(choice), [[3, 1], [2, 0], [0, 0]])
  np.testing.assert_array_equal(np.asarray(source)[:2], [[1, 0], [0, 0]])
  choice, _ = replicas.hits(replicas.invalidate(state), now, choice_E)
  assert not np.any(np.asarray(choice))


def test_the_cpu_and_gpu_forms_of_encode_and_decode_agree():
  """XLA:CPU encodes and decodes only each expert's chosen format (`lax.switch`); GPU/TPU run
  every format and select (no conditional): both forms, run here, give the same words."""
  rng = np.random.default_rng(3)
  prev = _experts(rng, 4)
  now = prev.astype(np.int32) + rng.integers(-3, 4, prev.shape)
  now[1] += rng.integers(-4, 5, prev.shape[1])
  now[2] = prev[2].astype(np.int32) + rng.integers(-100, 101, prev.shape[1])
  now[3] = rng.integers(0, 2 ** 16, CODEC.values)
  now[:, :4] = prev[:, :4]
  now, prev = jnp.asarray(now.astype(np.uint16)), jnp.asarray(prev)

  @jax.jit      # one compile for the four (eagerly, each compiled apart: 11 s)
  def both_forms(now, prev):
    each = replicas.encode_each(now, prev, CODEC)
    every = replicas.encode_all(now, prev, CODEC)
    rows = jnp.where((each[1] > 0)[:, None], each[0], replicas.plain_rows(now, CODEC))
    return (each, every, replicas.decode_each(rows, each[1], prev, CODEC),
            replicas.decode_all(rows, each[1], prev, CODEC))

  each, every, got_each, got_all = both_forms(now, prev)
  for a, b in zip(each, every):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(got_each), np.asarray(now))
  np.testing.assert_array_equal(np.asarray(got_all), np.asarray(now))
  assert set(np.asarray(each[1]).tolist()) >= {0, 3}
