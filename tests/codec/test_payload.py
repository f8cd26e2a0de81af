"""Patch formats: decode(cache, encode(new)) == new bit for bit within capacity; over capacity the
count says so (the caller falls back) and the first C changes are what the patch holds."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from moejax.codec import detect
from moejax.codec import payload

N = 1000
ROWS = 2
FORMATS = {
    "block8": payload.Format.create("block", N, 8, 64, 0.25),       # 16 blocks, capacity 4
    "element5": payload.Format.create("element", N, 5, 64, 0.01),   # capacity 10
    "element8": payload.Format.create("element", N, 8, 64, 0.01),
}


@functools.partial(jax.jit, static_argnames="fmt")
def _roundtrip(old_RxN, new_RxN, fmt):
  if fmt.mode == "block":
    changed = jax.vmap(lambda e, p: detect.changed_blocks(e, p, fmt.block_size))(new_RxN, old_RxN)
  else:
    changed = new_RxN != old_RxN
  patches, counts = jax.vmap(lambda e, c: payload.encode(e, c, fmt))(new_RxN, changed)
  return payload.decode(old_RxN, patches, fmt), counts, patches


def _rows(fmt, changes, seed):
  rng = np.random.default_rng(seed)
  old = rng.integers(0, 2**fmt.exp_bits, size=(ROWS, fmt.cache_width), dtype=np.uint8)
  old[:, fmt.n:] = 0
  new = old.copy()
  for r, positions in enumerate(changes):
    for i, flip in positions:
      new[r, i] ^= np.uint8(flip % (2**fmt.exp_bits - 1) + 1)   # a real change, within the field
  return old, new


def _first_units(fmt, old, new, limit):
  """Expected decode when a patch holds only the first `limit` changed units of a row."""
  out = old.copy()
  if fmt.mode == "element":
    idx = np.flatnonzero(old != new)[:limit]
    out[idx] = new[idx]
    return out
  b = fmt.block_size
  blocks = np.flatnonzero((old != new).reshape(-1, b).any(axis=1))[:limit]
  for k in blocks:
    out[k * b:(k + 1) * b] = new[k * b:(k + 1) * b]
  return out


_changes = st.lists(st.lists(st.tuples(st.integers(0, N - 1), st.integers(0, 254)), max_size=60),
                    min_size=ROWS, max_size=ROWS)


@pytest.mark.parametrize("name", FORMATS)
@settings(max_examples=20, deadline=None)
@given(changes=_changes, seed=st.integers(0, 2**16))
def test_encode_decode_random_changes(name, changes, seed):
  fmt = FORMATS[name]
  old, new = _rows(fmt, changes, seed)
  decoded, counts, patches = _roundtrip(jnp.asarray(old), jnp.asarray(new), fmt)
  decoded, counts = np.asarray(decoded), np.asarray(counts)
  assert patches.shape == (ROWS, fmt.words) and patches.dtype == jnp.uint32
  for r in range(ROWS):
    diff = old[r] != new[r]
    units = diff.reshape(-1, fmt.block_size).any(axis=1) if fmt.mode == "block" else diff
    assert counts[r] == units.sum()
    event("over capacity" if counts[r] > fmt.capacity else "within capacity")
    if counts[r] <= fmt.capacity:
      np.testing.assert_array_equal(decoded[r], new[r])
    else:
      np.testing.assert_array_equal(decoded[r], _first_units(fmt, old[r], new[r], fmt.capacity))


def test_capacity_edges():
  fmt = FORMATS["element8"]
  old = np.zeros((ROWS, N), np.uint8)
  new = old.copy()
  new[0, -fmt.capacity:] = 7          # exactly at capacity, including the last position
  new[1, :fmt.capacity + 1] = 9       # one over
  decoded, counts, _ = _roundtrip(jnp.asarray(old), jnp.asarray(new), fmt)
  assert list(np.asarray(counts)) == [fmt.capacity, fmt.capacity + 1]
  np.testing.assert_array_equal(np.asarray(decoded)[0], new[0])


def test_format_sizes():
  block = FORMATS["block8"]   # 1000 values in blocks of 64 -> 16 blocks of 63
  assert (block.num_blocks, block.block_size, block.capacity, block.cache_width) == (16, 63, 4,
                                                                                    1008)
  assert block.words == 1 + 256 * 8 // 32     # bitmap + 4 blocks of bytes (252, packed by 32)
  elem = FORMATS["element5"]
  assert (elem.capacity, elem.pos_bits, elem.cache_width) == (10, 10, 1000)
  assert elem.words == 10 + 5                                  # 32 slots x 10 bits, x 5 bits
  assert elem.fill_bits(3) == 3 * 15
  assert payload.Format.create("element", 10, 8, 4, 1e-9).capacity == 1
  assert payload.Format.create("block", 10, 8, 4, 1.0).capacity == 3
  with pytest.raises(ValueError, match="mode must be one of"):
    payload.Format.create("dense", 10, 8, 4, 0.5)


def test_shard_blocks_pad_less_than_one_value_per_block():
  """A shard's blocks: the configured block size's count, evened out, so a shard smaller than a
  block is not padded to it (a 64-value norm's changed block cost 512 exponents)."""
  for n in range(1, 700):
    for block_size in (1, 3, 64, 512):
      b = detect.shard_block_size(n, block_size)
      nb = detect.num_blocks(n, block_size)
      assert b <= block_size and detect.num_blocks(n, b) == nb and nb * b - n < nb, (n, block_size)
  small = payload.Format.create("block", 64, 8, 512, 0.25)
  assert (small.num_blocks, small.block_size, small.cache_width) == (1, 64, 64)
  assert small.words == 1 + 64 * 8 // 32


@pytest.mark.parametrize("n, form", [(37, None), (payload.SORT_MAX + 5, None),
                                     (payload.SORT_MAX + 5, "scattered")])
def test_first_true_matches_nonzero(n, form, monkeypatch):
  """Every way of ranking (a sort up to SORT_MAX entries; above, a search of the running count
  on CPU, and the GPU's scatter to each entry's rank, run here in the CPU's place), rows of every
  fill: none, fewer than `size`, more."""
  if form == "scattered":
    monkeypatch.setattr(payload, "_searched_ranks", payload._scattered_ranks)
  rng = np.random.default_rng(n)
  mask = np.zeros((4, n), bool)
  mask[1, rng.choice(n, 3, replace=False)] = True
  mask[2] = rng.random(n) < 0.5
  mask[3, -1] = True
  size = 20
  got = np.asarray(jax.jit(lambda m: payload.first_true(m, size, -7))(jnp.asarray(mask)))
  for row, out in zip(mask, got):
    idx = np.flatnonzero(row)[:size]
    np.testing.assert_array_equal(out, np.concatenate([idx, np.full(size - idx.size, -7)]))
  one = np.asarray(payload.first_true(jnp.asarray(mask[2]), 5, 0))
  np.testing.assert_array_equal(one, np.flatnonzero(mask[2])[:5])
  # a mask of counts, not bools: entries other than 0 are True, whichever way it ranks
  counts = jnp.asarray(mask.astype(np.int32) * rng.integers(1, 4, mask.shape))
  np.testing.assert_array_equal(np.asarray(payload.first_true(counts, size, -7)), got)


def test_first_true_scatters_on_gpu_and_searches_on_cpu():
  mask = jax.ShapeDtypeStruct((3, payload.SORT_MAX + 5), jnp.bool_)
  for platform, searched in (("cpu", True), ("cuda", False)):
    text = jax.jit(lambda m: payload.first_true(m, 20, 0)).trace(mask).lower(
        lowering_platforms=(platform,)).as_text()
    assert ("stablehlo.while" in text) == searched and ("stablehlo.scatter" in text) != searched
