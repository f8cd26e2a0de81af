"""Change detection: exact block/value masks, emulated 64-bit SplitMix64, block hashes."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moejax.codec import detect

MASK64 = 2**64 - 1


def _mix_reference(z):
  z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
  z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
  return z ^ (z >> 31)


def _pairs(xs):
  xs = np.asarray(xs, np.uint64)
  return (jnp.asarray((xs >> np.uint64(32)).astype(np.uint32)),
          jnp.asarray((xs & np.uint64(0xFFFFFFFF)).astype(np.uint32)))


def _join(pair):
  hi, lo = (np.asarray(p).astype(np.uint64) for p in pair)
  return [int(v) for v in (hi << np.uint64(32)) | lo]


@jax.jit
def _mix(hi, lo):
  return detect.splitmix64_mix(detect._add64_const((hi, lo), detect.SEEDS[1]))


def test_splitmix64_known_output():
  # The first output of a SplitMix64 generator seeded with 0 is 0xE220A8397B1DCDAF.
  out = _mix(*_pairs([(detect.GOLDEN_GAMMA - detect.SEEDS[1]) % 2**64]))
  assert _join(out) == [0xE220A8397B1DCDAF]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, MASK64), min_size=16, max_size=16))
def test_splitmix64_emulation_matches_python_ints(xs):
  expected = [_mix_reference((x + detect.SEEDS[1]) & MASK64) for x in xs]
  assert _join(_mix(*_pairs(xs))) == expected


def test_wide_multiply_edge_cases():
  a = np.array([0, 1, 0xFFFFFFFF, 0xFFFFFFFF, 0x10000, 0xDEADBEEF], np.uint32)
  b = np.array([0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 1, 0x10000, 0x12345678], np.uint32)
  got = _join(detect._mul32_wide(jnp.asarray(a), jnp.asarray(b)))
  assert got == [int(x) * int(y) for x, y in zip(a, b)]


@functools.partial(jax.jit, static_argnames="block_size")
def _hashes(exp, block_size):
  return detect.block_hashes(exp, block_size)


@pytest.mark.parametrize("n,block_size", [(150, 40), (256, 64), (7, 4)])
def test_block_hashes_match_reference(n, block_size):
  exp = np.random.default_rng(n).integers(0, 256, size=n, dtype=np.uint8)
  got = np.asarray(_hashes(jnp.asarray(exp), block_size))
  assert got.shape == (detect.num_blocks(n, block_size), detect.HASH_WORDS)
  np.testing.assert_array_equal(got, detect.block_hashes_reference(exp, block_size))


def test_hash_sees_every_single_change():
  """Block i of the batch differs from the base block at position i only: both hashes move."""
  b = 64
  rng = np.random.default_rng(1)
  base = rng.integers(0, 256, size=b, dtype=np.uint8)
  variants = np.tile(base, (b, 1))
  variants[np.arange(b), np.arange(b)] ^= rng.integers(1, 256, size=b, dtype=np.uint8)
  h_base = np.asarray(_hashes(jnp.asarray(base), b))
  h_var = np.asarray(_hashes(jnp.asarray(variants.reshape(-1)), b))
  assert (h_var[:, 0:2] != h_base[:, 0:2]).any(axis=1).all()
  assert (h_var[:, 2:4] != h_base[:, 2:4]).any(axis=1).all()
  # Swapping two values is a change too (hashes depend on positions).
  swapped = base.copy()
  i, j = np.flatnonzero(base != base[0])[0], 0
  swapped[[i, j]] = swapped[[j, i]]
  h_swap = np.asarray(_hashes(jnp.asarray(swapped), b))
  assert (h_swap[:, 0:2] != h_base[:, 0:2]).any() and (h_swap[:, 2:4] != h_base[:, 2:4]).any()
  changed = detect.changed_blocks_hashed(jnp.asarray(h_var), jnp.asarray(np.tile(h_base, (b, 1))))
  assert np.asarray(changed).all()


def test_exact_detection_masks():
  rng = np.random.default_rng(2)
  prev = rng.integers(0, 256, size=100, dtype=np.uint8)
  exp = prev.copy()
  exp[[3, 4, 57, 99]] += 1
  vals = np.asarray(detect.changed_values(jnp.asarray(exp), jnp.asarray(prev)))
  np.testing.assert_array_equal(np.flatnonzero(vals), [3, 4, 57, 99])
  blocks = np.asarray(detect.changed_blocks(jnp.asarray(exp), jnp.asarray(prev), 16))
  np.testing.assert_array_equal(np.flatnonzero(blocks), [0, 3, 6])
  assert blocks.shape == (7,)
