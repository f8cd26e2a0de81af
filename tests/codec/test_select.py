"""Selection of compressed gathers: latency fit, gains, ranking by gain per state byte, budget,
word mode, cheaper modes under a budget, capacities from measured rates."""
import dataclasses

import numpy as np
import pytest

from moejax.codec import gather
from moejax.codec import select

W = 8
# 10 us per collective, 1 ns per byte each device contributes.
COMM = select.CommModel(alpha=1e-5, beta=1e-9)


def test_comm_model_fit():
  sizes = np.array([1e3, 1e5, 1e6, 1e7, 1e8])
  exact = select.CommModel.fit(list(zip(sizes, 2e-5 + 3e-10 * sizes)))
  assert exact.alpha == pytest.approx(2e-5, rel=1e-6) and exact.beta == pytest.approx(3e-10)
  noisy = 2e-5 + 3e-10 * sizes * (1 + 0.01 * np.array([1, -1, 1, -1, 1]))
  fit = select.CommModel.fit(list(zip(sizes, noisy)))
  assert fit.beta == pytest.approx(3e-10, rel=0.02)
  # Data whose line crosses zero below: no negative latency, slope through the origin.
  through = select.CommModel.fit([(1e6, 1e-3), (2e6, 2.5e-3)])
  assert through.alpha == 0.0 and through.beta > 0
  with pytest.raises(ValueError, match="distinct sizes"):
    select.CommModel.fit([(1e6, 1e-3), (1e6, 2e-3)])
  with pytest.raises(ValueError, match="does not grow"):
    select.CommModel.fit([(1e3, 1e-3), (1e6, 1e-4)])


def _param(name, shape, q_element, q_block, decode_s=0.0):
  return select.ParamStats(name, shape, "bfloat16", q_element, q_block, decode_s)


def test_gain_matches_hand_computation():
  p = _param("w", (1024, 1024), 0.02, 0.9, decode_s=1e-5)
  spec, gain, nbytes = select.evaluate(p, "element", "exact", COMM, W, margin=1.5)
  n = 2**20
  # 3 % of the values, rounded up to whole groups of 32 slots (the packed patch holds them anyway).
  assert spec.mode == "element" and spec.capacity_fraction == -(-round(0.03 * n) // 32) * 32 / n
  capacity = int(np.ceil(spec.capacity_fraction * n))
  payload = n + (-(-capacity // 32) * 32) * (20 + 8) // 8      # sign+mantissa, positions, exps
  expected = COMM(2 * n) - COMM(payload) - COMM(4 * gather.STATS_WORDS) - 1e-5
  assert gain == pytest.approx(expected, rel=1e-9)
  assert nbytes == (W - 1) * n + n + 5


def test_selection_ranks_by_gain_per_byte_and_respects_budget():
  params = [
      _param("mlp", (1024, 1024), 0.02, 0.95),             # element mode pays
      _param("embed", (4096, 256), 0.01, 0.01),             # changes bunched in few rows: blocks
      _param("norm", (64,), 0.0, 0.0),                      # too small: latency dominates
      _param("hot", (1024, 1024), 0.5, 1.0),                # too many changes: no gain
      _param("attn", (512, 512), 0.02, 0.95),               # like mlp, smaller
  ]
  one_mlp = gather.state_bytes((1024, 1024), "bfloat16", W, gather.CodecSpec("element"))
  budget = one_mlp + gather.state_bytes((512, 512), "bfloat16", W, gather.CodecSpec("element"))
  out = {s.name: s for s in select.select(params, COMM, axis_size=W, cache_budget_bytes=budget)}
  assert [s.name for s in select.select(params, COMM, axis_size=W, cache_budget_bytes=0)] == [
      p.name for p in params]
  assert out["norm"].reason == "no gain" and out["norm"].spec.mode == "off"
  assert out["hot"].reason == "no gain" and out["hot"].gain_s <= 0
  assert out["embed"].best.mode == "block"
  assert out["mlp"].best.mode == "element" and out["attn"].best.mode == "element"
  # Gain per state byte: embed (block, sparse) > mlp > attn; embed fits first, then mlp does not.
  density = {k: out[k].gain_s / out[k].state_bytes for k in ("embed", "mlp", "attn")}
  assert density["embed"] > density["mlp"] > density["attn"] > 0
  assert out["embed"].reason == "selected" and out["embed"].spec == out["embed"].best
  assert out["mlp"].reason == "over budget" and out["mlp"].spec.mode == "off"
  assert out["attn"].reason == "selected"
  used = sum(s.state_bytes for s in out.values() if s.reason == "selected")
  assert used <= budget


def test_decode_cost_and_hash_option():
  p = _param("w", (1024, 1024), 0.02, 0.02, decode_s={"element": 1.0, "block": 0.0})
  (only,) = select.select([p], COMM, axis_size=W, cache_budget_bytes=10**9)
  assert only.spec.mode == "block" and only.spec.detect == "exact"
  (hashed,) = select.select([p], COMM, axis_size=W, cache_budget_bytes=10**9, allow_hash=True)
  assert hashed.spec.detect == "hash" and hashed.state_bytes < only.state_bytes
  assert hashed.gain_s == pytest.approx(only.gain_s)
  slow = _param("w", (1024, 1024), 0.02, 0.02, decode_s=1.0)
  (off,) = select.select([slow], COMM, axis_size=W, cache_budget_bytes=10**9)
  assert off.reason == "no gain" and off.spec.mode == "off"


def _word_param(name, shape, q_element, q_word, copies=1):
  return select.ParamStats(name, shape, "bfloat16", q_element, 0.9, q_word=q_word, copies=copies)


def test_word_mode_wins_when_few_values_change():
  modes = ("element", "block", "word")
  quiet = _word_param("quiet", (1024, 1024), 0.002, 0.05)    # fine-tuning: few words change
  busy = _word_param("busy", (1024, 1024), 0.02, 0.9)        # most words change every step
  out = {s.name: s for s in select.select([quiet, busy], select.CommModel.bytes_only(),
                                          axis_size=W, cache_budget_bytes=None, modes=modes)}
  assert out["quiet"].spec.mode == "word" and out["busy"].spec.mode == "element"
  # Word: a bitmap (1 bit per value) and 1.5 x 5 % of the values at 16 bits each.
  assert out["quiet"].bytes_sent / out["quiet"].bytes_plain == pytest.approx(
      (2**20 / 8 + 0.075 * 2**20 * 2 + 16) / 2**21, rel=1e-3)
  assert out["quiet"].state_bytes == gather.state_bytes(
      (1024, 1024), "bfloat16", W, out["quiet"].spec) == W * 2**21 + 5
  # Without a word rate, word mode is not an option.
  (no_word,) = select.select([_param("w", (1024, 1024), 0.002, 0.9)], COMM, axis_size=W,
                             cache_budget_bytes=None, modes=modes)
  assert no_word.spec.mode == "element"


def test_rebuilt_gathers_count_what_they_save():
  """A parameter whose backward re-gathers are rebuilt from its cache saves on those the plain
  gather less what the rebuild moves (nothing in word / delta mode, sign+mantissa in element /
  block mode): per gather on average (1 - r) g + r (Comm(S) - Comm(R)). Here word mode loses a
  little on a moving gather (busy words), so it pays only once the rebuilt share counts."""
  modes = ("element", "block", "word")
  busy = _word_param("busy", (1024, 1024), 0.9, 0.65)           # exponents churn: no element
  rebuilt = dataclasses.replace(busy, rebuilt_share=3 / 7)      # 3 layers, remat full, prefetch
  bytes_only = select.CommModel.bytes_only()
  _, g, _ = select.evaluate(busy, "word", "exact", bytes_only, W)
  _, g_r, _ = select.evaluate(rebuilt, "word", "exact", bytes_only, W)
  assert g < 0 and g_r == pytest.approx(4 / 7 * g + 3 / 7 * 2 * 2**20, rel=1e-9) and g_r > 0
  for mode in ("element", "block"):          # a rebuilt gather moves sign+mantissa bytes only
    spec, g_m, _ = select.evaluate(busy, mode, "exact", bytes_only, W)
    again = gather.wire_bytes((1024, 1024), "bfloat16", spec)["rebuilt"]
    assert again == 2**20 and select.evaluate(rebuilt, mode, "exact", bytes_only, W)[1] == (
        pytest.approx(4 / 7 * g_m + 3 / 7 * (2 * 2**20 - again), rel=1e-9))
  (off,), (on,) = (select.select([p], bytes_only, axis_size=W, cache_budget_bytes=None,
                                 modes=modes) for p in (busy, rebuilt))
  assert off.spec.mode == "off" and on.spec.mode == "word"


def test_budget_takes_a_cheaper_mode_and_counts_copies():
  modes = ("element", "word")
  p = _word_param("w", (1024, 1024), 0.002, 0.02, copies=4)
  element = gather.state_bytes((1024, 1024), "bfloat16", W, gather.CodecSpec("element"))
  word = gather.state_bytes((1024, 1024), "bfloat16", W, gather.CodecSpec("word"))
  (best,) = select.select([p], COMM, axis_size=W, cache_budget_bytes=None, modes=modes)
  assert best.spec.mode == "word" and best.reason == "selected"
  assert best.state_bytes == 4 * word and best.bytes_plain == 4 * 2**21
  (cheaper,) = select.select([p], COMM, axis_size=W, cache_budget_bytes=4 * element + 10,
                             modes=modes)
  assert cheaper.spec.mode == "element" and cheaper.reason == "cheaper mode (budget)"
  assert cheaper.best.mode == "word" and cheaper.state_bytes == 4 * element
  (none,) = select.select([p], COMM, axis_size=W, cache_budget_bytes=4 * element - 1,
                          modes=modes)
  assert none.spec.mode == "off" and none.reason == "over budget"
  # Gains and state of a stacked parameter are per copy times the copies.
  one = select.evaluate(dataclasses.replace(p, copies=1), "word", "exact", COMM, W)
  four = select.evaluate(p, "word", "exact", COMM, W)
  assert four[1] == pytest.approx(4 * one[1]) and four[2] == 4 * one[2]


def test_capacity_from_peak_rate_quantized_and_kept():
  p = select.ParamStats("w", (4096,), "bfloat16", 0.01, 0.5, peak={"element": 0.03})
  spec, _, _ = select.evaluate(p, "element", "exact", COMM, W, margin=2.0)
  assert spec.capacity_fraction == 256 / 4096       # worst rate x margin: 246 slots, then 8 x 32
  spec, _, _ = select.evaluate(p, "block", "exact", COMM, W, margin=2.0)
  assert spec.capacity_fraction == pytest.approx(2 * 0.5)        # no rounding of whole blocks
  spec, _, _ = select.evaluate(p, "element", "exact", COMM, W, margin=2.0, quantize=True)
  assert spec.capacity_fraction == pytest.approx(2 ** -4)          # next power of 2^(1/4)
  assert select.capacity_fraction(0.0, 2.0) == select.MIN_CAPACITY_FRACTION
  assert select.capacity_fraction(0.7, 2.0, quantize=True) == 1.0
  for rate in (1e-3, 0.0123, 0.07, 0.2):
    q = select.capacity_fraction(rate, 1.5, quantize=True)
    assert rate * 1.5 <= q * (1 + 1e-9) and q < rate * 1.5 * 2 ** 0.25 * (1 + 1e-9)
  (kept,) = select.select([p], select.CommModel.bytes_only(), axis_size=W,
                          cache_budget_bytes=None, margin=2.0, capacities={("w", "element"): 0.1})
  assert kept.spec.capacity_fraction == 0.1
