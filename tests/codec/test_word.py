"""Word and delta patches: decode(cache, encode(new)) == new bit for bit within capacity, for every
bit pattern (NaN payloads, infinities, -0.0, subnormals); over capacity the count says so (the
caller falls back) and the patch holds the first C changes (escapes, in delta mode)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from moejax.codec import bits
from moejax.codec import gather
from moejax.codec import word

N = 700
ROWS = 2
FORMATS = {
    "bf16": (word.WordFormat.create(N, 16, 0.02), np.uint16),   # capacity 14
    "fp32": (word.WordFormat.create(N, 32, 0.05), np.uint32),   # capacity 35
}


@functools.partial(jax.jit, static_argnames="fmt")
def _roundtrip(old_RxN, new_RxN, fmt):
  changed = jax.vmap(word.changed)(new_RxN, old_RxN)
  patches, counts, _ = jax.vmap(lambda b, c: word.encode(b, c, fmt))(new_RxN, changed)
  return word.decode(old_RxN, patches, fmt), counts, patches


def _rows(changes, seed, uint):
  rng = np.random.default_rng(seed)
  info = np.iinfo(uint)
  old = rng.integers(0, info.max, size=(ROWS, N), dtype=uint, endpoint=True)
  new = old.copy()
  for r, positions in enumerate(changes):
    for i, flip in positions:
      new[r, i] ^= uint(flip % info.max + 1)      # a real change, any bits
  return old, new


_changes = st.lists(st.lists(st.tuples(st.integers(0, N - 1), st.integers(0, 2**32 - 1)),
                             max_size=50), min_size=ROWS, max_size=ROWS)


@pytest.mark.parametrize("name", FORMATS)
@settings(max_examples=15, deadline=None)
@given(changes=_changes, seed=st.integers(0, 2**16))
def test_encode_decode_random_changes(name, changes, seed):
  fmt, uint = FORMATS[name]
  old, new = _rows(changes, seed, uint)
  decoded, counts, patches = _roundtrip(jnp.asarray(old), jnp.asarray(new), fmt)
  decoded, counts = np.asarray(decoded), np.asarray(counts)
  assert patches.shape == (ROWS, fmt.words) and patches.dtype == jnp.uint32
  assert decoded.dtype == uint
  for r in range(ROWS):
    diff = np.flatnonzero(old[r] != new[r])
    assert counts[r] == diff.size
    event("over capacity" if counts[r] > fmt.capacity else "within capacity")
    expected = new[r].copy()
    if diff.size > fmt.capacity:                 # only the first C changes are in the patch
      expected[diff[fmt.capacity:]] = old[r][diff[fmt.capacity:]]
    np.testing.assert_array_equal(decoded[r], expected)


def test_special_bit_patterns():
  """Every class of float bit pattern, written over every other class."""
  specials = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF, 0x0001, 0x8001,
                       0x3F80, 0x007F, 0x7F7F], np.uint16)   # bf16: +-0, +-inf, NaNs, subnormals
  fmt = word.WordFormat.create(specials.size ** 2, 16, 1.0)
  old = np.repeat(specials, specials.size)[None]
  new = np.tile(specials, specials.size)[None]
  decoded, counts, _ = _roundtrip(jnp.asarray(old), jnp.asarray(new), fmt)
  np.testing.assert_array_equal(np.asarray(decoded), new)
  assert int(counts[0]) == int((old != new).sum())
  as_float = jax.lax.bitcast_convert_type(jnp.asarray(np.asarray(decoded)), jnp.bfloat16)
  assert np.isnan(np.asarray(as_float, np.float32)).any()


def test_capacity_edges():
  fmt, uint = FORMATS["bf16"]
  old = np.zeros((ROWS, N), uint)
  new = old.copy()
  new[0, -fmt.capacity:] = 7            # exactly at capacity, including the last position
  new[1, :fmt.capacity + 1] = 9         # one over: the count says so
  decoded, counts, _ = _roundtrip(jnp.asarray(old), jnp.asarray(new), fmt)
  assert list(np.asarray(counts)) == [fmt.capacity, fmt.capacity + 1]
  np.testing.assert_array_equal(np.asarray(decoded)[0], new[0])


def test_format_sizes_and_state():
  fmt, _ = FORMATS["bf16"]
  assert (fmt.capacity, fmt.cache_width) == (14, N)
  assert fmt.sections == (22, 16, 0)                     # 704 bitmap bits; 32 slots x 16 bits
  assert fmt.fill_bits(3) == N + 3 * 16
  assert word.WordFormat.create(10, 16, 1e-9).capacity == 1
  assert word.WordFormat.create(10, 32, 1.0).capacity == 10
  with pytest.raises(ValueError, match="value_bits"):
    word.WordFormat(10, 8, 1)
  spec = gather.CodecSpec("word", capacity_fraction=0.02)
  assert gather.patch_format((N,), jnp.bfloat16, spec) == fmt
  sizes = gather.wire_bytes((N,), jnp.bfloat16, spec)
  assert sizes == {"plain": 2 * N, "compressed": 4 * (fmt.words + gather.STATS_WORDS),
                   "dense": 2 * N + 4 * gather.STATS_WORDS,
                   "forward": 4 * (fmt.words + gather.STATS_WORDS), "rebuilt": 0}
  state = gather.init_state((N,), jnp.bfloat16, 8, spec)
  assert state["cache"].shape == (7, N) and state["cache"].dtype == jnp.uint16
  assert gather.state_bytes((N,), jnp.bfloat16, 8, spec) == sum(
      np.asarray(a).nbytes for a in jax.tree.leaves(state))
  assert bits.layout_of(jnp.bfloat16).total_bits == fmt.value_bits
  with pytest.raises(ValueError, match="needs mode='block'"):
    gather.CodecSpec("word", detect="hash")


# ----------------------------------------------------------------------------------------------
# Delta mode: codes of key differences, escapes for the rest.

DELTA_FORMATS = {f"{name}-k{k}": (word.WordFormat.create(N, vb, frac, k, frac / 2), uint)
                 for k in word.DELTA_BITS
                 for name, vb, frac, uint in (("bf16", 16, 0.02, np.uint16),
                                              ("fp32", 32, 0.05, np.uint32))}


def _np_key(x, value_bits):
  top, mask = np.uint64(1 << (value_bits - 1)), np.uint64((1 << value_bits) - 1)
  x = x.astype(np.uint64)
  return np.where(x & top, ~x & mask, x | top)


def _np_from_key(key, value_bits, uint):
  top, mask = np.uint64(1 << (value_bits - 1)), np.uint64((1 << value_bits) - 1)
  return np.where(key & top, key ^ top, ~key & mask).astype(uint)


@functools.partial(jax.jit, static_argnames="fmt")
def _delta_roundtrip(old_RxN, new_RxN, fmt):
  d = jax.vmap(lambda b, p: word.key_delta(b, p, fmt.value_bits))(new_RxN, old_RxN)
  codes = jax.vmap(lambda b, p: word.codes(b, p, fmt))(new_RxN, old_RxN)
  patches, counts, far = jax.vmap(lambda b, c, d: word.encode(b, c, fmt, d))(new_RxN, codes, d)
  return word.decode(old_RxN, patches, fmt), counts, far


_moves = st.lists(st.lists(st.tuples(st.integers(0, N - 1), st.integers(-200, 200),
                                     st.booleans()), max_size=60),
                  min_size=ROWS, max_size=ROWS)


@pytest.mark.parametrize("name", DELTA_FORMATS)
@settings(max_examples=12, deadline=None)
@given(moves=_moves, seed=st.integers(0, 2**16))
def test_delta_encode_decode_random_moves(name, moves, seed):
  """Values move by a few units in the last place (a code), up to 200 (an escape's byte, or the
  far list beyond 127) or anywhere (far), including across zero, the infinities and into NaN
  payloads (keys wrap around). Within both capacities the patch is exact; over either, the
  counts say so (the caller falls back before decoding)."""
  fmt, uint = DELTA_FORMATS[name]
  vb = fmt.value_bits
  rng = np.random.default_rng(seed)
  old = rng.integers(0, np.iinfo(uint).max, size=(ROWS, N), dtype=uint, endpoint=True)
  key = _np_key(old, vb)
  for r, row in enumerate(moves):
    for i, d, far in row:
      d = int(rng.integers(1, 1 << (vb - 1))) * (1 if d >= 0 else -1) if far else d
      key[r, i] = np.uint64((int(key[r, i]) + d) % (1 << vb))
  new = _np_from_key(key, vb, uint)
  decoded, counts, far = _delta_roundtrip(jnp.asarray(old), jnp.asarray(new), fmt)
  decoded, counts, far = np.asarray(decoded), np.asarray(counts), np.asarray(far)
  diff = ((key.astype(np.int64) - _np_key(old, vb).astype(np.int64) + (1 << (vb - 1)))
          % (1 << vb)) - (1 << (vb - 1))
  for r in range(ROWS):
    assert counts[r] == int((np.abs(diff[r]) > fmt.max_delta).sum())
    assert far[r] == int((np.abs(diff[r]) > word.NEAR_MAX).sum())
    fits = counts[r] <= fmt.capacity and far[r] <= fmt.far_capacity
    event("within capacity" if fits else "over capacity")
    if fits:
      np.testing.assert_array_equal(decoded[r], new[r])


@pytest.mark.parametrize("k", word.DELTA_BITS)
def test_delta_special_bit_patterns(k):
  specials = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF, 0x0001, 0x8001,
                       0x3F80, 0x007F, 0x7F7F, 0x7F7E, 0x8002], np.uint16)
  fmt = word.WordFormat.create(specials.size ** 2, 16, 1.0, k, 1.0)
  old = np.repeat(specials, specials.size)[None]
  new = np.tile(specials, specials.size)[None]
  decoded, counts, _ = _delta_roundtrip(jnp.asarray(old), jnp.asarray(new), fmt)
  np.testing.assert_array_equal(np.asarray(decoded), new)
  # +0.0 -> -0.0 and the largest finite -> +inf are one unit apart: codes, not escapes.
  assert int(counts[0]) < int((old != new).sum())


def test_order_key_is_a_monotone_bijection():
  every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
  keys = np.asarray(word.order_key(jnp.asarray(every), 16))
  assert np.unique(keys).size == every.size and keys.max() < (1 << 16)
  np.testing.assert_array_equal(np.asarray(word.from_key(jnp.asarray(keys), 16, jnp.uint16)),
                                every)
  values = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(every), jnp.bfloat16), np.float32)
  finite = ~np.isnan(values)
  order = np.argsort(keys[finite])
  assert (np.diff(values[finite][order]) >= 0).all()


def test_delta_format_and_spec():
  fmt = word.WordFormat.create(N, 16, 0.02, 3, 0.01)
  assert (fmt.mode, fmt.max_delta, fmt.escape, fmt.capacity, fmt.far_capacity) == (
      "delta", 3, 7, 14, 7)
  assert fmt.sections == (-(-N * 3 // 32), 8, 16)     # codes; slots packed 32 at a time
  assert fmt.fill_bits(2, 1) == 3 * N + 2 * 8 + 16
  spec = gather.CodecSpec("delta", delta_bits=3, capacity_fraction=0.02, far_fraction=0.01)
  assert gather.patch_format((N,), jnp.bfloat16, spec) == fmt and spec.rate_kind == "delta3"
  assert gather.same_state(gather.CodecSpec("word"), spec)   # the same cache of whole values
  assert gather.state_bytes((N,), jnp.bfloat16, 8, spec) == gather.state_bytes(
      (N,), jnp.bfloat16, 8, gather.CodecSpec("word"))
  with pytest.raises(ValueError, match="delta_bits"):
    gather.CodecSpec("delta", delta_bits=5)
  with pytest.raises(ValueError, match="needs mode='block'"):
    gather.CodecSpec("delta", detect="hash")
