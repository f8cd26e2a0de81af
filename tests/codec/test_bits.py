"""Bit layout: split/merge exact on every bit pattern; dense bit packing against a bit-string
reference."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moejax.codec import bits

N = 64
# dtype, unsigned view, exponent bits, mantissa bits
FORMATS = [(jnp.bfloat16, np.uint16, 8, 7), (np.float16, np.uint16, 5, 10),
           (np.float32, np.uint32, 8, 23)]
# -0.0, smallest subnormals (both signs), bf16 +-Inf, quiet and signalling NaNs with payloads,
# all-ones, fp16 +-Inf and NaN, largest finite values, 1.0; the 32-bit ones for float32.
SPECIALS = {
    16: [0x0000, 0x8000, 0x0001, 0x8001, 0x7F80, 0xFF80, 0x7FC1, 0xFFFF, 0x7F81, 0x7C00, 0xFC00,
         0x7E01, 0x03FF, 0x7BFF, 0x007F, 0x3F80],
    32: [0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x7F800000, 0xFF800000, 0x7FC00001,
         0x7F800001, 0xFFFFFFFF, 0x7F7FFFFF, 0x3F800000, 0x00400000],
}


@functools.partial(jax.jit, static_argnames="dtype")
def _roundtrip(u, dtype):
  x = jax.lax.bitcast_convert_type(u, dtype)
  exp, rest = bits.split(x)
  y = bits.merge(exp, rest, dtype)
  return exp, rest, jax.lax.bitcast_convert_type(y, u.dtype)


def _check_patterns(u, fmt):
  dtype, udt, eb, mb = fmt
  u = np.asarray(u, udt)
  exp, rest, back = _roundtrip(jnp.asarray(u), dtype)
  total = 1 + eb + mb
  u64 = u.astype(np.uint64)
  np.testing.assert_array_equal(np.asarray(back), u)
  np.testing.assert_array_equal(np.asarray(exp), (u64 >> mb) % (1 << eb))
  np.testing.assert_array_equal(np.asarray(rest), ((u64 >> (total - 1)) << mb) | (u64 % (1 << mb)))
  assert exp.dtype == jnp.uint8
  assert np.iinfo(rest.dtype).bits >= 1 + mb


def _patterns(total_bits):
  return st.lists(st.integers(0, 2**total_bits - 1), min_size=N, max_size=N)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: np.dtype(f[0]).name)
def test_split_merge_special_values(fmt):
  total = 1 + fmt[2] + fmt[3]
  u = np.resize(np.array(SPECIALS[total], np.uint64), N)
  _check_patterns(u, fmt)


@settings(max_examples=25, deadline=None)
@given(_patterns(16))
def test_split_merge_bfloat16_any_pattern(u):
  _check_patterns(u, FORMATS[0])


@settings(max_examples=25, deadline=None)
@given(_patterns(16))
def test_split_merge_float16_any_pattern(u):
  _check_patterns(u, FORMATS[1])


@settings(max_examples=25, deadline=None)
@given(_patterns(32))
def test_split_merge_float32_any_pattern(u):
  _check_patterns(u, FORMATS[2])


def test_layout_rejects_other_dtypes():
  with pytest.raises(ValueError, match="dtype must be one of"):
    bits.layout_of(np.int32)


def _bitstring_pack(v, width):
  """Reference: value i's bit k at bit i*width + k of a little-endian string of 32-bit words."""
  v = np.asarray(v, np.uint64)
  n = v.shape[-1]
  s = np.zeros(v.shape[:-1] + (bits.packed_words(n, width) * 32,), np.uint64)
  for k in range(width):
    s[..., np.arange(n) * width + k] = (v >> np.uint64(k)) & np.uint64(1)
  s = s.reshape(v.shape[:-1] + (-1, 32))
  return (s << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32)


@jax.jit
def _pack_all_widths(v_WxN):
  """Row w-1 of v holds values of w bits; packs and unpacks each row at its width."""
  words = [bits.pack_bits(v_WxN[w - 1], w) for w in range(1, 33)]
  return words, [bits.unpack_bits(x, w, v_WxN.shape[1]) for w, x in zip(range(1, 33), words)]


def test_pack_bits_every_width():
  rng = np.random.default_rng(0)
  n = 70
  v = np.stack([rng.integers(0, 2**w, size=n, dtype=np.uint64) for w in range(1, 33)])
  v = v.astype(np.uint32)
  words, back = _pack_all_widths(jnp.asarray(v))
  for w in range(1, 33):
    np.testing.assert_array_equal(np.asarray(words[w - 1]), _bitstring_pack(v[w - 1], w))
    np.testing.assert_array_equal(np.asarray(back[w - 1]), v[w - 1])


@functools.partial(jax.jit, static_argnames="width")
def _pack_roundtrip(v, width):
  words = bits.pack_bits(v, width)
  return words, bits.unpack_bits(words, width, v.shape[-1])


@settings(max_examples=20, deadline=None)
@given(st.sampled_from([1, 5, 8, 11, 20, 24]), st.lists(st.integers(0, 2**32 - 1), min_size=45,
                                                        max_size=45))
def test_pack_bits_codec_widths(width, values):
  v = np.asarray(values, np.uint32)
  words, back = _pack_roundtrip(jnp.asarray(v), width)
  assert words.shape == (bits.packed_words(45, width),)
  low = v & np.uint32((1 << width) - 1)
  np.testing.assert_array_equal(np.asarray(words), _bitstring_pack(low, width))
  np.testing.assert_array_equal(np.asarray(back), low)


def test_packed_sizes_have_no_padding_per_value():
  assert bits.packed_words(32, 11) == 11      # 32 float16 sign+mantissa fields in 44 bytes
  assert bits.packed_words(64, 24) == 48      # 64 float32 sign+mantissa fields in 192 bytes
  assert bits.packed_words(33, 11) == 22      # whole groups of 32 values


@pytest.mark.parametrize("shape", [(1,), (31,), (32,), (33,), (3, 1000), (2, 2, 97)])
@pytest.mark.parametrize("density", [0.0, 0.07, 0.5, 1.0])
def test_running_count_is_an_inclusive_cumsum(shape, density):
  mask = np.random.default_rng(sum(shape)).random(shape) < density
  got = jax.jit(bits.running_count)(jnp.asarray(mask))
  assert got.dtype == jnp.int32 and got.shape == shape
  np.testing.assert_array_equal(np.asarray(got), np.cumsum(mask, axis=-1))
