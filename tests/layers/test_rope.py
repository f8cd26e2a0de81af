"""RoPE scaling (moejax.layers.rope) against hand computations; the logits of imported YaRN
models against transformers' are in tests/convert/test_hf_parity.py."""
import math

import numpy as np
import pytest

from moejax.layers import rope

# DeepSeek-V3's published rope_scaling.
V3 = rope.RopeScaling(kind="yarn", factor=40.0, original_max_len=4096, mscale=1.0,
                      mscale_all_dim=1.0)


def test_deepseek_v3_correction_range_and_scales_by_hand():
  # pair(r) = 64 ln(4096 / (2 pi r)) / (2 ln 1e4): 10.47 at r = 32 (floored), 22.51 at r = 1
  # (ceiled)
  assert V3.correction_range(64, 1e4) == (10, 23)
  assert V3.table_scale == 1.0                 # mscale == mscale_all_dim
  assert V3.latent_softmax_scale == pytest.approx((0.1 * math.log(40) + 1) ** 2)
  untruncated = rope.RopeScaling(**{**V3.__dict__, "truncate": False})
  low, high = untruncated.correction_range(64, 1e4)
  assert low == pytest.approx(64 * math.log(4096 / (64 * math.pi)) / (2 * math.log(1e4)))
  assert high == pytest.approx(64 * math.log(4096 / (2 * math.pi)) / (2 * math.log(1e4)))


def test_yarn_keeps_fast_pairs_interpolates_slow_ones_and_blends_between():
  plain = np.asarray(rope.inv_frequencies(64, 1e4))
  yarn = np.asarray(rope.inv_frequencies(64, 1e4, V3))
  np.testing.assert_array_equal(yarn[:11], plain[:11])              # below low = 10: kept
  np.testing.assert_allclose(yarn[23:], plain[23:] / 40, rtol=1e-6)  # from high = 23: / factor
  ramp = (np.arange(11, 23) - 10) / 13                              # between: linear blend
  np.testing.assert_allclose(yarn[11:23], plain[11:23] * (1 - ramp) + plain[11:23] / 40 * ramp,
                             rtol=1e-5)


def test_attention_factor_rules():
  yarn = dict(kind="yarn", factor=4.0, original_max_len=64)
  assert rope.RopeScaling(**yarn).table_scale == pytest.approx(0.1 * math.log(4) + 1)
  assert rope.RopeScaling(**yarn, attention_factor=1.5).table_scale == 1.5
  two = rope.RopeScaling(**yarn, mscale=0.9, mscale_all_dim=0.7)
  assert two.table_scale == pytest.approx((0.09 * math.log(4) + 1) / (0.07 * math.log(4) + 1))
  assert two.latent_softmax_scale == pytest.approx((0.07 * math.log(4) + 1) ** 2)
  assert rope.RopeScaling().table_scale == rope.RopeScaling().latent_softmax_scale == 1.0
  cos, sin = rope.rotary_at(np.arange(5), 8, 1e4, rope.RopeScaling(**yarn, attention_factor=2.0))
  np.testing.assert_allclose(np.asarray(cos) ** 2 + np.asarray(sin) ** 2, 4.0, rtol=1e-6)
  with pytest.raises(ValueError, match="rope scaling 'ntk': must be one of none, yarn, llama3"):
    rope.RopeScaling(kind="ntk")


def test_llama3_keeps_short_wavelengths_slows_long_ones_and_blends_between():
  """Llama 3's scaling (Scout's: x8, frequency factors 1 and 4, 8192 positions) by hand: a
  wavelength under 8192 / 4 keeps its frequency, one over 8192 is slowed 8x, one between blends
  by how many times it turns over the 8192 positions; cos and sin are not scaled."""
  scout = rope.RopeScaling(kind="llama3", factor=8.0, original_max_len=8192,
                           low_freq_factor=1.0, high_freq_factor=4.0)
  plain = np.asarray(rope.inv_frequencies(128, 5e5), np.float64)
  got = np.asarray(rope.inv_frequencies(128, 5e5, scout), np.float64)
  wavelength = 2 * np.pi / plain
  short, long = wavelength < 2048, wavelength > 8192
  assert short.any() and long.any() and (~short & ~long).any()
  np.testing.assert_array_equal(got[short], plain[short])
  np.testing.assert_allclose(got[long], plain[long] / 8, rtol=1e-6)
  smooth = (8192 / wavelength[~short & ~long] - 1) / 3
  between = plain[~short & ~long]
  np.testing.assert_allclose(got[~short & ~long], (1 - smooth) * between / 8 + smooth * between,
                             rtol=1e-5)
  assert scout.table_scale == scout.latent_softmax_scale == 1.0
