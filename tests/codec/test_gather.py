"""compressed_all_gather on 8 fake CPU devices: bit-identical to the plain tiled all-gather on every
step of a scripted run (warm-up, patches, forced overflow, invalidate), honest byte counts,
gradients equal to the plain gather's, inside lax.scan over stacked layers with jax.checkpoint."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from moejax.codec import bits
from moejax.codec import detect
from moejax.codec import gather
from moejax.codec import select
from tests.helpers import emulated_ragged_all_to_all

W = 8
AXIS = "d"
MESH = jax.make_mesh((W,), (AXIS,), axis_types=(AxisType.Auto,))
UINT = {jnp.bfloat16: np.uint16, np.float16: np.uint16, np.float32: np.uint32}


def _stack_states(state):
  """One state per device, stacked on a leading axis that shard_map splits."""
  sharding = jax.sharding.NamedSharding(MESH, P(AXIS))
  return jax.tree.map(lambda a: jax.device_put(jnp.broadcast_to(a, (W,) + a.shape), sharding),
                      state)


def _unstack(tree):
  return jax.tree.map(lambda a: a[0], tree)


def _restack(tree):
  return jax.tree.map(lambda a: a[None], tree)


def _spec_along(ndim, axis):
  return P(*[AXIS if i == axis else None for i in range(ndim)])


def _make_gather(spec, ndim, axis):
  @functools.partial(chex.assert_max_traces, n=1)
  def body(x, states):
    full, new_states, stats = gather.compressed_all_gather(
        x, _unstack(states), axis_name=AXIS, axis=axis, spec=spec)
    return full[None], _restack(new_states), _restack(stats)

  return jax.jit(jax.shard_map(body, mesh=MESH, in_specs=(_spec_along(ndim, axis), P(AXIS)),
                               out_specs=P(AXIS), check_vma=False))


class Script:
  """Bit patterns of W shards ([W, *shard_shape]) and scripted exponent changes per step."""

  def __init__(self, dtype, shard_shape, axis, spec, seed):
    self.layout = bits.layout_of(dtype)
    self.dtype, self.shape, self.axis, self.spec = dtype, shard_shape, axis, spec
    self.n = int(np.prod(shard_shape))
    self.rng = np.random.default_rng(seed)
    u = self.layout.uint_dtype
    # Every bit pattern is fair game: NaNs with payloads, infinities, subnormals, -0.0.
    info = np.iinfo(u)
    self.local = self.rng.integers(0, info.max, size=(W, self.n), dtype=u, endpoint=True)
    self.fmt = gather.patch_format(shard_shape, dtype, spec)

  def _exp(self, words):
    return (words >> self.layout.mant_bits) & ((1 << self.layout.exp_bits) - 1)

  def step(self, changed_units_per_device):
    """New mantissas and signs everywhere; new exponents for the given number of units (values
    in element mode, blocks with a few values each in block mode) per device. Word mode: new bit
    patterns for the given number of values per device, nothing else changes."""
    lay, u = self.layout, self.layout.uint_dtype
    old_exp = self._exp(self.local)
    old_local = self.local.copy()
    if self.spec.mode == "delta":
      self._move_keys(changed_units_per_device)
      return self._counts(old_exp, old_local)
    if self.spec.mode == "word":
      for d, k in enumerate(changed_units_per_device):
        pos = self.rng.choice(self.n, size=k, replace=False)
        flip = self.rng.integers(1, np.iinfo(u).max, size=k, dtype=u, endpoint=True)
        self.local[d, pos] ^= flip
      return self._counts(old_exp, old_local)
    keep = np.asarray(((1 << lay.exp_bits) - 1) << lay.mant_bits, u)
    noise = self.rng.integers(0, np.iinfo(u).max, size=self.local.shape, dtype=u, endpoint=True)
    self.local = (self.local & keep) | (noise & ~keep)
    for d, k in enumerate(changed_units_per_device):
      if self.spec.mode == "block":
        b = detect.shard_block_size(self.n, self.spec.block_size)   # the shard's blocks
        blocks = self.rng.choice(-(-self.n // b), size=k, replace=False)
        pos = np.concatenate([blk * b + self.rng.choice(min(b, self.n - blk * b), size=2)
                              for blk in blocks]) if k else np.zeros(0, int)
      else:
        pos = self.rng.choice(self.n, size=k, replace=False)
      flip = self.rng.integers(1, 1 << lay.exp_bits, size=pos.size).astype(u)
      self.local[d, pos] ^= flip << np.asarray(lay.mant_bits, u)
    return self._counts(old_exp, old_local)

  def _move_keys(self, escapes_per_device):
    """Delta mode: per device, that many values move too far for a code (escapes, all beyond a
    byte: far) and as many others move by a code's worth (1..D units in the last place)."""
    bits_, u = self.layout.total_bits, self.layout.uint_dtype
    top, mask = np.uint64(1 << (bits_ - 1)), np.uint64((1 << bits_) - 1)
    reach = self.fmt.max_delta
    for d, k in enumerate(escapes_per_device):
      x = self.local[d].astype(np.uint64)
      key = np.where(x & top, ~x & mask, x | top)
      pos = self.rng.choice(self.n, size=2 * k, replace=False)
      far = self.rng.integers(128, 1 << (bits_ - 1), size=k)
      near = self.rng.integers(1, reach + 1, size=k)
      step = np.concatenate([far, near]) * self.rng.choice([-1, 1], size=2 * k)
      key[pos] = (key[pos].astype(np.int64) + step).astype(np.uint64) & mask
      x = np.where(key & top, key ^ top, ~key & mask)
      self.local[d] = x.astype(u)

  def _counts(self, old_exp, old_local):
    """(exponent changes, blocks with one, whole-word changes), summed over devices."""
    new_exp = self._exp(self.local)
    changed = new_exp != old_exp
    b = detect.shard_block_size(self.n, self.spec.block_size)
    pad = -(-self.n // b) * b - self.n
    blocks = np.pad(changed, ((0, 0), (0, pad))).reshape(W, -1, b).any(-1)
    return int(changed.sum()), int(blocks.sum()), int((self.local != old_local).sum())

  def global_bits(self):
    pieces = self.local.reshape((W,) + self.shape)
    return np.concatenate(list(pieces), axis=self.axis)

  def global_array(self):
    return jnp.asarray(lax.bitcast_convert_type(jnp.asarray(self.global_bits()), self.dtype))


CASES = [
    # dtype, shard shape, axis, spec
    (jnp.bfloat16, (8, 48), 1, gather.CodecSpec("element", block_size=32, warmup_steps=2)),
    (jnp.bfloat16, (8, 48), 1, gather.CodecSpec("block", block_size=32, warmup_steps=2)),
    (np.float16, (2, 3, 64), 0, gather.CodecSpec("element", warmup_steps=2,
                                                  capacity_fraction=0.05)),
    (np.float32, (4, 96), 1, gather.CodecSpec("block", block_size=64, detect="hash",
                                               warmup_steps=2, capacity_fraction=0.5)),
    (jnp.bfloat16, (8, 48), 0, gather.CodecSpec("word", block_size=32, warmup_steps=2,
                                                 capacity_fraction=0.1)),
    (np.float32, (2, 40), 1, gather.CodecSpec("word", warmup_steps=2, capacity_fraction=0.2)),
    # Every escape goes far in the script: the two capacities overflow together.
    (jnp.bfloat16, (8, 48), 0, gather.CodecSpec("delta", delta_bits=3, warmup_steps=2,
                                                 capacity_fraction=0.05, far_fraction=0.05)),
    (np.float32, (2, 40), 1, gather.CodecSpec("delta", delta_bits=2, warmup_steps=2,
                                               capacity_fraction=0.1, far_fraction=0.1)),
]


def _case_id(case):
  dtype, _, axis, spec = case
  return f"{np.dtype(dtype).name}-{spec.mode}{spec.delta_bits if spec.mode == 'delta' else ''}-{spec.detect}-axis{axis}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_multi_step_bit_identical(case):
  dtype, shape, axis, spec = case
  chex.clear_trace_counter()
  script = Script(dtype, shape, axis, spec, seed=len(shape) + axis)
  cap = script.fmt.capacity
  small = [max(1, cap // 2)] * W
  quiet = [0, 1] + [0] * (W - 2)
  overflow = list(small)
  overflow[3] = cap + 1        # one device over capacity: everyone falls back
  full = list(small)
  full[5] = cap                # exactly at capacity: still a patch
  # (exponent changes per device, devices to invalidate first, expected dense, fallback)
  everyone, device_2 = list(range(W)), [2]
  plan = [(small, [], 1, 0),          # first gather: caches empty
          (small, [], 1, 0),          # warm-up
          (small, [], 0, 0),
          (quiet, [], 0, 0),
          (full, [], 0, 0),
          (overflow, [], 1, 1),
          (small, [], 0, 0),          # caches are right after a fallback
          (small, everyone, 1, 0),    # invalidate: dense again
          (small, [], 0, 0),
          (small, device_2, 1, 0),    # one stale device is enough to send everything
          (small, [], 0, 0)]
  f = _make_gather(spec, len(shape), axis)
  states = _stack_states(gather.init_state(shape, dtype, W, spec))
  sizes = gather.wire_bytes(shape, dtype, spec)
  for t, (changes, invalidate, dense, fallback) in enumerate(plan):
    exp_changes, block_changes, word_changes = script.step(changes)
    if invalidate == everyone:
      states = gather.invalidate(states)
    elif invalidate:
      states = {**states, "valid": states["valid"].at[np.array(invalidate)].set(False)}
    full, states, stats = f(script.global_array(), states)
    full_bits = np.asarray(lax.bitcast_convert_type(full, UINT[dtype]))
    for d in range(W):
      np.testing.assert_array_equal(full_bits[d], script.global_bits(), err_msg=f"step {t}")
    stats = {k: np.asarray(v) for k, v in stats.items()}
    assert (stats["dense"] == dense).all(), (t, stats)
    assert (stats["fallback"] == fallback).all(), (t, stats)
    valid = t != 0 and not invalidate
    expected_exp = -1 if spec.detect == "hash" else exp_changes if valid else 0
    assert (stats["exponent_changes"] == expected_exp).all(), (t, stats)
    assert (stats["block_changes"] == (block_changes if valid else 0)).all(), (t, stats)
    expected_words = -1 if spec.mode not in gather.WORD_MODES else word_changes if valid else 0
    assert (stats["word_changes"] == expected_words).all(), (t, stats)
    sent = sizes["dense"] if dense else sizes["compressed"]
    assert (stats["bytes_sent"] == sent).all() and (stats["bytes_plain"] == sizes["plain"]).all()
    if valid:
      assert (stats["bytes_needed"] <= stats["bytes_sent"]).all() or fallback
  assert sizes["compressed"] < sizes["dense"]


def _group_gather(cases, transport="auto"):
  """(jitted compressed_all_gather_group over `cases` under shard_map, initial states)."""
  def body(xs, states):
    fulls, new_states, stats = gather.compressed_all_gather_group(
        xs, [_unstack(st) for st in states], axis_name=AXIS, axes=[c[2] for c in cases],
        specs=[c[3] for c in cases], transport=transport)
    return ([f[None] for f in fulls], [_restack(st) for st in new_states],
            [_restack(st) for st in stats])

  in_specs = ([_spec_along(len(c[1]), c[2]) for c in cases], [P(AXIS)] * len(cases))
  f = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=in_specs, out_specs=P(AXIS),
                            check_vma=False))
  states = [_stack_states(gather.init_state(c[1], c[0], W, c[3])) for c in cases]
  return f, states


def _group_step(f, scripts, states, stale, t):
  """One group gather of the scripts' values (`stale`: the shard whose state turns stale on
  device 6 first, or None); checks every device got every shard bit for bit."""
  if stale is not None:
    states[stale] = {**states[stale],
                     "valid": states[stale]["valid"].at[np.array([6])].set(False)}
  fulls, states, stats = f([sc.global_array() for sc in scripts], states)
  for sc, full in zip(scripts, fulls):
    full_bits = np.asarray(lax.bitcast_convert_type(full, UINT[sc.dtype]))
    for d in range(W):
      np.testing.assert_array_equal(full_bits[d], sc.global_bits(), err_msg=f"step {t}")
  return states, stats


@pytest.mark.parametrize("transport", ["auto", "single"])
def test_a_group_shares_one_agreement_and_falls_back_shard_by_shard(transport):
  """compressed_all_gather_group over three shards (element, word and delta; bf16 and float32;
  gathered along different axes; no two of them pool): one agreement all-gather for the group,
  then one payload all-gather for the three when none falls back, else each shard its own
  conditional and payload (transport "auto" on CPU); with transport "single" (GPU's), one payload
  all-gather for the three in no conditional, each segment a patch or, falling back, the shard's
  bit patterns. Bit-identical to each shard's plain gather on every step; one shard's
  overflow, or one stale device in one shard's state, sends that shard alone dense."""
  cases = [CASES[0], CASES[4], CASES[7]]
  scripts = [Script(dtype, shape, axis, spec, seed=10 + k)
             for k, (dtype, shape, axis, spec) in enumerate(cases)]

  f, states = _group_gather(cases, transport)
  lowered = f.lower([sc.global_array() for sc in scripts], states)
  k, compiled = len(cases), lowered.compile().as_text()
  if transport == "single":
    assert lowered.as_text().count("stablehlo.all_gather") == 1 + 1
    assert compiled.count(" conditional(") == 0
  else:
    assert lowered.as_text().count("stablehlo.all_gather") == 1 + 1 + 2 * k
    assert compiled.count(" conditional(") == 1 + k

  def small(sc):
    return [max(1, sc.fmt.capacity // 2)] * W

  # (shard that overflows on device 3, or None; shard whose state is stale on device 6, or
  # None; expected dense per shard: the first two gathers are warm-up)
  plan = [(None, None, (1, 1, 1)), (None, None, (1, 1, 1)), (None, None, (0, 0, 0)),
          (1, None, (0, 1, 0)), (None, None, (0, 0, 0)), (0, 2, (1, 0, 1)),
          (None, None, (0, 0, 0))]
  for t, (over, stale, dense) in enumerate(plan):
    for j, sc in enumerate(scripts):
      changes = small(sc)
      if j == over:
        changes[3] = sc.fmt.capacity + 1
      sc.step(changes)
    states, stats = _group_step(f, scripts, states, stale, t)
    for j in range(len(scripts)):
      assert (np.asarray(stats[j]["dense"]) == dense[j]).all(), (t, j)
      assert (np.asarray(stats[j]["fallback"]) == (1 if j == over else 0)).all(), (t, j)


@pytest.mark.parametrize("exchange", ["all_gather", "ragged chunks"])
def test_single_transport_packs_odd_and_32_bit_shards(exchange, monkeypatch):
  """The single payload packs 16-bit values two to a word and 32-bit ones as they are: an odd
  bf16 shard, float32 shards in block (hash) and word mode, and an element shard beside them,
  bit for bit through warm-up, patches, one shard's overflow and a stale device. "ragged
  chunks": the payload travels as on GPU (`ragged_payload_all_gather`: the used words in chunks
  of `bits.CHUNK_WORDS`, here 7 to 10 of them, the last part full), the exchange emulated."""
  ran = []
  if exchange == "ragged chunks":
    monkeypatch.setattr(gather, "payload_all_gather", gather.ragged_payload_all_gather)
    monkeypatch.setattr(lax, "ragged_all_to_all",
                        lambda *a, **k: ran.append(1) or emulated_ragged_all_to_all(*a, **k))
    # A jit of its own: `_forward_jit` may hold this group's program, traced unpatched.
    monkeypatch.setattr(gather, "_forward_jit", jax.jit(lambda *a: gather._forward(*a),
                                                        static_argnums=(2, 3, 4, 5)))
  cases = [(jnp.bfloat16, (31, 33), 0, gather.CodecSpec("element", warmup_steps=2,
                                                       capacity_fraction=0.1)),
           CASES[3], CASES[5], CASES[0]]
  scripts = [Script(dtype, shape, axis, spec, seed=40 + k)
             for k, (dtype, shape, axis, spec) in enumerate(cases)]
  f, states = _group_gather(cases, "single")
  plan = [(None, None), (None, None), (None, None), (0, None), (None, 2), (3, None),
          (None, None)]
  for t, (over, stale) in enumerate(plan):
    for j, sc in enumerate(scripts):
      changes = [max(1, sc.fmt.capacity // 2)] * W
      if j == over:
        changes[5] = sc.fmt.capacity + 1
      sc.step(changes)
    states, stats = _group_step(f, scripts, states, stale, t)
    for j in range(len(scripts)):
      dense = t < 2 or j == over or j == stale
      assert (np.asarray(stats[j]["dense"]) == int(dense)).all(), (t, j)
  assert bool(ran) == (exchange == "ragged chunks")      # traced through the emulated exchange


@pytest.mark.parametrize("transport", ["auto", "single"])
def test_delta_shards_of_a_group_travel_as_one_pool_and_fall_back_together(transport):
  """Three bf16 delta3 shards of a group (different shapes and axes) beside an element shard:
  the delta shards travel as one pool (one conditional and one payload all-gather for the
  three, capacities summed), the element shard alone, both payloads in one all-gather when
  neither falls back. A shard over its own capacity rides on
  the pool's room (still compressed, exact); the pool falls back together when one device's
  escapes exceed the pooled capacity, or when one shard's state is stale on one device."""
  delta = gather.CodecSpec("delta", delta_bits=3, warmup_steps=2, capacity_fraction=0.05,
                           far_fraction=0.05)
  cases = [CASES[0], (jnp.bfloat16, (8, 48), 0, delta), (jnp.bfloat16, (4, 32), 1, delta),
           (jnp.bfloat16, (16, 24), 1, delta)]
  assert gather.pools_of([(c[1], c[0]) for c in cases], [c[3] for c in cases]) == [[0], [1, 2, 3]]
  scripts = [Script(dtype, shape, axis, spec, seed=20 + k)
             for k, (dtype, shape, axis, spec) in enumerate(cases)]

  f, states = _group_gather(cases, transport)
  lowered = f.lower([sc.global_array() for sc in scripts], states)
  single = transport == "single"   # one payload all-gather in no conditional
  assert lowered.as_text().count("stablehlo.all_gather") == (2 if single else 1 + 1 + 2 * 2)
  assert lowered.compile().as_text().count(" conditional(") == (0 if single else 1 + 2)
  caps = [sc.fmt.capacity for sc in scripts]
  assert caps[1:] == [20, 7, 20]              # the pool holds 47 escapes per device

  # (escapes of each shard on device 3, delta shard stale on device 6 or None, expected dense
  # of (element, pool), fallback of the pool); elsewhere half of each shard's own capacity.
  plan = [(None, None, (1, 1), 0), (None, None, (1, 1), 0), (None, None, (0, 0), 0),
          ((1, 10, 20, 10), None, (0, 0), 0),      # shard 2 at 20 > 7, pool at 40 <= 47
          ((1, 40, 3, 10), None, (0, 1), 1),       # pool at 53 > 47
          (None, None, (0, 0), 0),
          (None, 2, (0, 1), 0),
          (None, None, (0, 0), 0)]
  for t, (on_3, stale, dense, fallback) in enumerate(plan):
    for j, sc in enumerate(scripts):
      changes = [max(1, caps[j] // 2)] * W
      if on_3 is not None:
        changes[3] = on_3[j]
      sc.step(changes)
    states, stats = _group_step(f, scripts, states, stale, t)
    for j in range(len(scripts)):
      assert (np.asarray(stats[j]["dense"]) == dense[min(j, 1)]).all(), (t, j)
      assert (np.asarray(stats[j]["fallback"]) == (fallback if j else 0)).all(), (t, j)
      sizes = gather.wire_bytes(cases[j][1], cases[j][0], cases[j][3])
      want = sizes["dense"] if dense[min(j, 1)] else sizes["compressed"]
      assert (np.asarray(stats[j]["bytes_sent"]) == want).all(), (t, j)


def test_a_patch_no_smaller_than_the_dense_payload_always_goes_dense():
  """Word mode at capacity 1.0 (sized for values that nearly all change, which the selector
  picks when the backward rebuilds from the caches): its patch (8728 B here) would outweigh the
  dense payload (8216 B), so every gather goes dense, leaving the same caches, bit-exact, never
  above plain plus the agreement; the selector prices it so."""
  shape, spec = (4096,), gather.CodecSpec("word", capacity_fraction=1.0, warmup_steps=0)
  sizes = gather.wire_bytes(shape, jnp.bfloat16, spec)
  assert sizes["compressed"] > sizes["dense"] == sizes["forward"] == sizes["plain"] + 24
  script = Script(jnp.bfloat16, shape, 0, spec, seed=5)
  f = _make_gather(spec, 1, 0)
  states = _stack_states(gather.init_state(shape, jnp.bfloat16, W, spec))
  for t in range(3):
    script.step([int(0.9 * 4096)] * W)
    full, states, stats = f(script.global_array(), states)
    full_bits = np.asarray(lax.bitcast_convert_type(full, jnp.uint16))
    for d in range(W):
      np.testing.assert_array_equal(full_bits[d], script.global_bits(), err_msg=f"step {t}")
    assert (np.asarray(stats["dense"]) == 1).all() and (np.asarray(stats["fallback"]) == 0).all()
    assert (np.asarray(stats["bytes_sent"]) == sizes["dense"]).all()
  stats = select.ParamStats("w", shape, jnp.bfloat16, q_element=0.9, q_block=1.0, q_word=0.9,
                            q_delta={2: 0.9, 3: 0.9, 4: 0.9}, q_far=0.9, rebuilt_share=0.5)
  (chosen,) = select.select([stats], select.CommModel.bytes_only(), axis_size=W,
                            cache_budget_bytes=None, modes=("word",))
  assert chosen.spec.mode == "word" and chosen.spec.capacity_fraction == 1.0
  assert chosen.bytes_sent == sizes["dense"] <= chosen.bytes_plain + 24


def test_compressed_path_sends_fewer_bytes_at_realistic_sizes():
  """bf16, element mode, default capacity (1/16): about 0.6x the plain bytes per device."""
  spec = gather.CodecSpec("element")
  sizes = gather.wire_bytes((1024, 1024), jnp.bfloat16, spec)
  assert sizes["dense"] == sizes["plain"] + 4 * gather.STATS_WORDS
  # 1 byte sign+mantissa, and 1/16 of (20 position bits + 8 exponent bits) per value.
  assert sizes["compressed"] == 2**20 + 2**16 * 28 // 8 + 4 * gather.STATS_WORDS
  assert 0.6 < sizes["compressed"] / sizes["plain"] < 0.62


def test_ragged_payload_offsets_count_chunks_and_fit_int32():
  """The GPU payload exchange (`payload_all_gather`'s ragged branch) of a layer group whose
  gathered payload passes 2^31 words (DeepSeek-V3's experts on 64 devices, element mode: about
  88M words a device): offsets in words wrapped from device 25 on; in chunks of
  `bits.CHUNK_WORDS` every device's is exact, and the sizes cover the used words."""
  r, w = 88_080_384, 64
  assert w * r > 2 ** 31
  rows = bits.chunks(r)
  for me in (0, 25, 63):
    got_rows, size_W, offset_W = gather.ragged_payload_plan(r, jnp.int32(r - 5), jnp.int32(me), w)
    assert got_rows == rows and rows * bits.CHUNK_WORDS >= r
    np.testing.assert_array_equal(np.asarray(offset_W), np.full(w, me * rows))
    np.testing.assert_array_equal(np.asarray(size_W), np.full(w, rows))
  _, size_W, _ = gather.ragged_payload_plan(r, jnp.int32(bits.CHUNK_WORDS + 1), jnp.int32(0), w)
  assert int(size_W[0]) == 2


def test_spec_validation():
  with pytest.raises(ValueError, match="CodecSpec.mode"):
    gather.CodecSpec("zstd")
  with pytest.raises(ValueError, match="needs mode='block'"):
    gather.CodecSpec("element", detect="hash")
  with pytest.raises(ValueError, match="capacity_fraction"):
    gather.CodecSpec("block", capacity_fraction=0.0)
  assert gather.CodecSpec("element").capacity == gather.DEFAULT_CAPACITY_FRACTION["element"]
  assert gather.init_state((4, 4), jnp.bfloat16, W, gather.CodecSpec("off")) == {}


# ---------------------------------------------------------------------------------------------
# Gradients, lax.scan over stacked layers, jax.checkpoint.

LAYERS, D = 3, 32     # shards of 128 values: large enough for a patch to pay


@functools.lru_cache(maxsize=None)
def _make_train_step(spec):
  """Per device: h [2, D] -> L x tanh(h @ W_l), W_l gathered as bf16 from fp32 [D/W, D] shards
  (axis 0). spec None: the reference, an fp32 all_gather then a cast, differentiated by JAX
  (its transpose reduce-scatters in fp32)."""
  def gather_one(shard, state):
    if spec is None:
      return lax.all_gather(shard, AXIS, axis=0, tiled=True).astype(jnp.bfloat16), state, {}
    return gather.compressed_all_gather(shard, state, axis_name=AXIS, axis=0, spec=spec,
                                        compute_dtype=jnp.bfloat16)

  def loss_fn(shards_LxSxD, states, h_BxD):
    def layer(h, xs):
      full, new_state, stats = gather_one(*xs)
      assert full.dtype == jnp.bfloat16
      return jnp.tanh(h @ full.astype(jnp.float32)), (new_state, stats)

    h, (new_states, stats) = lax.scan(jax.checkpoint(layer), h_BxD, (shards_LxSxD, states))
    return jnp.sum(h * h), (new_states, stats)

  def body(shards, states, h):
    (loss, (new_states, stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        shards, _unstack(states), h)
    return loss[None], grads, _restack(new_states), _restack(stats)

  return jax.jit(jax.shard_map(body, mesh=MESH, in_specs=(P(None, AXIS), P(AXIS), P(AXIS)),
                               out_specs=(P(AXIS), P(None, AXIS), P(AXIS), P(AXIS)),
                               check_vma=False))


def _layer_states(spec, shard_shape):
  state = gather.init_state(shard_shape, jnp.bfloat16, W, spec)
  return _stack_states(jax.tree.map(lambda a: jnp.broadcast_to(a, (LAYERS,) + a.shape), state))


@pytest.mark.parametrize("spec", [
    gather.CodecSpec("element", warmup_steps=0, capacity_fraction=0.25),
    gather.CodecSpec("block", block_size=8, detect="hash", warmup_steps=0, capacity_fraction=0.5),
], ids=lambda s: f"{s.mode}-{s.detect}")
def test_grads_through_scan_and_checkpoint_match_plain_gather(spec):
  reference = _make_train_step(None)
  codec = _make_train_step(spec)
  states = _layer_states(spec, (D // W, D))
  rng = np.random.default_rng(0)
  w = rng.normal(size=(LAYERS, D, D)).astype(np.float32) * 0.3
  h = jnp.asarray(rng.normal(size=(2 * W, D)).astype(np.float32))
  for step in range(2):
    loss_r, grads_r, _, _ = reference(jnp.asarray(w), {}, h)
    loss_c, grads_c, states, stats = codec(jnp.asarray(w), states, h)
    np.testing.assert_array_equal(np.asarray(loss_c), np.asarray(loss_r))
    assert grads_c.dtype == jnp.float32 and grads_c.shape == w.shape
    np.testing.assert_array_equal(np.asarray(grads_c).view(np.uint32),
                                  np.asarray(grads_r).view(np.uint32))
    assert np.asarray(stats["dense"]).shape == (W, LAYERS)
    assert (np.asarray(stats["dense"]) == (1 if step == 0 else 0)).all(), stats
    # A small update: a few exponents change, most stay.
    w = w * (1 + 0.01 * rng.normal(size=w.shape).astype(np.float32))


def test_two_mesh_axes_and_fp32_master():
  """Gathering over a tuple of mesh axes (2 x 4), fp32 master shards sent as bf16."""
  mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
  axes = ("a", "b")
  spec = gather.CodecSpec("element", warmup_steps=0, capacity_fraction=0.05)

  def body(x, states):
    full, new_states, stats = gather.compressed_all_gather(
        x, _unstack(states), axis_name=axes, axis=0, spec=spec, compute_dtype=jnp.bfloat16)
    return full[None], _restack(new_states), stats["dense"][None]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(axes), P(axes)), out_specs=P(axes),
                            check_vma=False))
  states = _stack_states(gather.init_state((2, 512), jnp.bfloat16, W, spec))  # a patch pays
  x = np.random.default_rng(3).normal(size=(2 * W, 512)).astype(np.float32)
  for step in range(3):
    full, states, dense = f(jnp.asarray(x), states)
    expected = np.asarray(jnp.asarray(x).astype(jnp.bfloat16)).view(np.uint16)
    for d in range(W):
      np.testing.assert_array_equal(np.asarray(full[d]).view(np.uint16), expected)
    assert (np.asarray(dense) == (step == 0)).all()
    x = x * np.float32(1.01)
