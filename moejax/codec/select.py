"""Which parameters use the compressed gather, and in which mode: benefit against cost, under a
cache-memory budget.

For parameter i (one shard per device, W devices on the gather axis), all figures per device:

  S_i         bytes contributed to the plain all-gather (shard bytes)
  P_i(m)      bytes contributed to the compressed one in mode m: the static buffer, whose
              capacity is sized from the measured change rate (the worst device's rate times a
              safety margin), since a static-shape collective moves its capacity, not its fill
  Comm(b)     alpha + beta * b, the time of one all-gather to which each device contributes b
              bytes, fit from (bytes, seconds) measurements (`CommModel.fit`), or
              `CommModel.bytes_only()` (alpha 0, beta 1: the gain is bytes saved)
  T_i(m)      encode + decode time per gather (the caller's estimate: the train loop profiles
              it at start-up, `train.codec_control.profile_codec`)
  g_i(m)      = Comm(S_i) - Comm(P_i(m)) - Comm(24) - T_i(m)
              (the codec also issues the 24-byte agreement all-gather, which costs one alpha;
              P_i(m) is the patch: where it is no smaller than the dense payload the gather
              sends that instead, `gather.wire_bytes`'s "forward", which `Selection.bytes_sent`
              reports; the choice prices the patch, an upper bound);
              averaged with r_i, the share of the parameter's gathers rebuilt from the cache
              (the backward's re-gathers under remat full, `moejax.sharding.prefetch`), which
              save Comm(S_i) - Comm(R_i(m)): R_i the sign+mantissa bytes in element / block
              mode, no collective at all in word / delta mode
  M_i(m)      bytes of codec state per device: (W-1) x exponent bytes of cache, plus the sender's
              previous exponents ("exact") or block hashes ("hash"); word mode W x shard bytes
A stacked parameter (one shard per layer, one choice for all) counts `copies` times in g and M.

Modes considered: element and block (exponent reuse), word (whole-word deltas) when a word change
rate is known, delta at each code width (2, 3, 4 bits per value) whose escape rate is known, block
with hashes when asked. A mode with g <= 0 is never used. Each parameter
picks at most one mode; across parameters this is a multiple-choice knapsack, solved greedily by
gain per byte of state: each parameter's options form an upper concave hull in (M, g) starting
at plain (0, 0), and the hull's segments (upgrades, e.g. plain -> block -> element) are taken in
order of decreasing dg / dM while the budget lasts. Without a budget every parameter gets its
highest-gain mode (on ties, the smaller state). With one, a parameter whose best mode does not fit
may take a cheaper one; one that does not fit at all is skipped, and smaller ones after it may
still fit. Everything else is gathered plainly (mode "off"). The model leaves out warm-up steps
and overflow fallbacks (both send the plain bytes plus the agreement); the margin on the capacity
is what keeps the fallbacks rare.

Plain Python and numpy: no device work happens here.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import numpy as np

from moejax.codec import word
from moejax.codec import gather

# (mode, detect, delta_bits) options considered; ("block", "hash") trades a 2^-128 chance of a
# missed change for a much smaller sender state and is only considered when asked for.
OPTIONS = (("element", "exact", 3), ("block", "exact", 3), ("word", "exact", 3)) + tuple(
    ("delta", "exact", k) for k in word.DELTA_BITS)
HASH_OPTION = ("block", "hash", 3)
# Smallest capacity a selected parameter gets, as a fraction of its units: a parameter measured
# as unchanging still gets room for a few changes before it falls back.
MIN_CAPACITY_FRACTION = 2.0 ** -10


@dataclasses.dataclass(frozen=True)
class CommModel:
  """All-gather time as alpha + beta * bytes each device contributes."""
  alpha: float   # seconds
  beta: float    # seconds per byte

  def __call__(self, nbytes) -> float:
    return self.alpha + self.beta * float(nbytes)

  @classmethod
  def bytes_only(cls) -> "CommModel":
    """Gain in bytes rather than seconds: no per-collective latency, one unit per byte."""
    return cls(0.0, 1.0)

  @classmethod
  def fit(cls, measurements: Sequence[tuple[float, float]]) -> "CommModel":
    """Least squares over (bytes, seconds) pairs. A negative intercept is clamped to 0 (and the
    slope refit through the origin); a non-positive slope means the data cannot be used."""
    data = np.asarray(measurements, np.float64)
    if data.ndim != 2 or data.shape[1] != 2 or len(np.unique(data[:, 0])) < 2:
      raise ValueError("measurements must be (bytes, seconds) pairs at >= 2 distinct sizes, got "
                       f"{measurements!r}")
    b, t = data[:, 0], data[:, 1]
    (alpha, beta), *_ = np.linalg.lstsq(np.stack([np.ones_like(b), b], axis=1), t, rcond=None)
    if alpha < 0:
      alpha, beta = 0.0, float(b @ t / (b @ b))
    if beta <= 0:
      raise ValueError(f"fitted seconds per byte is {beta:.3g} <= 0: time does not grow with size "
                       "in these measurements")
    return cls(float(alpha), float(beta))


@dataclasses.dataclass(frozen=True)
class ParamStats:
  """What selection needs to know about one parameter."""
  name: str
  shard_shape: tuple[int, ...]
  dtype: object
  q_element: float            # measured fraction of values whose exponent changes per gather
  q_block: float | None       # measured fraction of blocks (of block_size) with a change
  decode_s: float | Mapping[str, float] = 0.0   # decode time per gather, or per mode
  q_word: float | None = None  # measured fraction of values with any bit changed (word mode)
  # Delta mode: {code bits K: measured fraction of values that move too far for a K-bit code}.
  q_delta: Mapping[int, float] | None = None
  q_far: float | None = None   # measured fraction of values that move more than 127 units
  copies: int = 1              # shards sharing this choice (the layers of a stacked parameter)
  rebuilt_share: float = 0.0   # gathers rebuilt from the cache (r_i)
  # Worst rate per mode (max over devices, layers and measured steps), which sizes the
  # capacity; the mean rates above when absent.
  peak: Mapping[str, float] | None = None

  def rate(self, kind: str) -> float | None:
    """Mean rate of a `CodecSpec.rate_kind`."""
    if kind.startswith("delta"):
      return (self.q_delta or {}).get(int(kind[len("delta"):]))
    if kind == "far":
      return self.q_far
    return {"element": self.q_element, "block": self.q_block, "word": self.q_word}[kind]

  def peak_rate(self, kind: str) -> float | None:
    if self.peak is not None and self.peak.get(kind) is not None:
      return self.peak[kind]
    return self.rate(kind)


@dataclasses.dataclass(frozen=True)
class Selection:
  name: str
  spec: gather.CodecSpec      # what to use: a compressed mode, or mode "off"
  best: gather.CodecSpec      # the highest-gain compressed option, selected or not
  gain_s: float               # gain per gather (seconds) of `spec`, or of `best` when off
  state_bytes: int            # state bytes per device of `spec`, or of `best` when off
  reason: str                 # "selected" | "cheaper mode (budget)" | "no gain" | "over budget"
  bytes_plain: int = 0        # bytes per device per gather, plain (all copies)
  bytes_sent: int = 0         # the same in `spec` (compressed path; = bytes_plain when off)

  @property
  def selected(self) -> bool:
    return self.spec.mode != "off"


def _decode_s(p: ParamStats, mode: str) -> float:
  return float(p.decode_s[mode] if isinstance(p.decode_s, Mapping) else p.decode_s)


def capacity_fraction(peak_rate: float, margin: float, *, quantize: bool = False) -> float:
  """Capacity for a worst measured change rate: rate x margin, in [MIN_CAPACITY_FRACTION, 1].
  `quantize` rounds up to a power of 2^(1/4), so that small drifts of the measured rate keep the
  same static shape (a new capacity means a new compiled step)."""
  fraction = float(min(1.0, max(peak_rate * margin, MIN_CAPACITY_FRACTION)))
  if quantize:
    fraction = min(1.0, 2.0 ** (math.ceil(4 * math.log2(fraction) - 1e-9) / 4))
  return fraction


def evaluate(p: ParamStats, mode: str, detect: str, comm: CommModel, axis_size: int, *,
             block_size: int = 512, margin: float = 1.5, warmup_steps: int = 30,
             quantize: bool = False, capacity: float | None = None, delta_bits: int = 3):
  """(spec, gain in seconds, state bytes) of one parameter in one mode, all copies together.
  The capacity is sized from the worst measured rate (`capacity_fraction`), then, in element,
  word and delta mode, rounded up to whole groups of 32 slots (what the packed patch holds
  anyway); `capacity` overrides it."""
  kind = gather.CodecSpec(mode, delta_bits=delta_bits).rate_kind
  n = math.prod(p.shard_shape)

  def sized(rate):
    fraction = capacity_fraction(rate, margin, quantize=quantize)
    # slots are packed up to 32 at a time: fill the last group for free
    return fraction if mode == "block" else min(1.0, -(-math.ceil(fraction * n) // 32) * 32 / n)

  if capacity is None:
    capacity = sized(p.peak_rate(kind))
  far = None
  if mode == "delta":   # the far list: escapes that move more than 127 units
    far = sized(p.peak_rate("far") or 0.0)
  spec = gather.CodecSpec(mode, block_size=block_size, detect=detect, capacity_fraction=capacity,
                          warmup_steps=warmup_steps, delta_bits=delta_bits, far_fraction=far)
  sizes = gather.wire_bytes(p.shard_shape, p.dtype, spec)
  agreement = 4 * gather.STATS_WORDS
  gain = (comm(sizes["plain"]) - comm(sizes["compressed"] - agreement) - comm(agreement)
          - _decode_s(p, mode))
  if p.rebuilt_share:
    rebuilt = comm(sizes["plain"]) - (comm(sizes["rebuilt"]) if sizes["rebuilt"] else 0.0)
    gain = (1.0 - p.rebuilt_share) * gain + p.rebuilt_share * rebuilt
  return (spec, p.copies * gain,
          p.copies * gather.state_bytes(p.shard_shape, p.dtype, axis_size, spec))


def _hull(options):
  """Upper concave hull of (state bytes, gain) from plain (0, 0), over options with gain > 0:
  [(bytes, gain, spec)], bytes and gain strictly increasing, slopes decreasing."""
  hull = [(0, 0.0, None)]
  for nbytes, gain, spec in sorted(options, key=lambda o: (o[0], -o[1])):
    if gain <= hull[-1][1]:
      continue                       # dominated: as much state or more for no more gain
    while len(hull) >= 2 and ((hull[-1][1] - hull[-2][1]) * (nbytes - hull[-1][0])
                              <= (gain - hull[-1][1]) * (hull[-1][0] - hull[-2][0])):
      hull.pop()                     # hull[-1] lies under the segment hull[-2] -> new
    hull.append((nbytes, gain, spec))
  return hull


def select(params: Sequence[ParamStats], comm: CommModel, *, axis_size: int,
           cache_budget_bytes: int | None, block_size: int = 512, margin: float = 1.5,
           allow_hash: bool = False, warmup_steps: int = 30,
           modes: Sequence[str] = ("element", "block"), quantize: bool = False,
           capacities: Mapping[tuple[str, str], float] | None = None) -> list[Selection]:
  """One Selection per parameter, in the order given (see the module docstring).

  cache_budget_bytes: state bytes per device for all selected parameters (None: no limit).
  modes: the compressed modes to consider ("element", "block", "word", "delta"); word needs
  `q_word`, delta `q_delta` (each code width with a rate is an option).
  capacities: {(name, rate kind): capacity fraction} to keep instead of sizing from the rates
  (the caller's hysteresis).
  """
  options = [o for o in OPTIONS if o[0] in modes]
  if allow_hash and "block" in modes:
    options.append(HASH_OPTION)
  hulls, best = [], []
  for p in params:
    candidates = []
    for mode, det, k in options:
      kind = gather.CodecSpec(mode, delta_bits=k).rate_kind
      if p.rate(kind) is None:
        continue
      keep = (capacities or {}).get((p.name, kind))
      candidates.append(evaluate(p, mode, det, comm, axis_size, block_size=block_size,
                                 margin=margin, warmup_steps=warmup_steps, quantize=quantize,
                                 capacity=keep, delta_bits=k))
    if not candidates:
      raise ValueError(f"parameter {p.name!r} has no measured rate for any of the modes {modes}")
    best.append(max(candidates, key=lambda c: (c[1], -c[2])))
    hulls.append(_hull([(nbytes, gain, spec) for spec, gain, nbytes in candidates]))

  # Upgrades along each hull, best gain per state byte first.
  segments = sorted(((h[k][1] - h[k - 1][1]) / max(h[k][0] - h[k - 1][0], 1), i, k)
                    for i, h in enumerate(hulls) for k in range(1, len(h)))
  level, left = [0] * len(params), cache_budget_bytes
  for _, i, k in sorted(segments, key=lambda s: -s[0]):
    step_bytes = hulls[i][k][0] - hulls[i][k - 1][0]
    if level[i] == k - 1 and (left is None or step_bytes <= left):
      level[i] = k
      if left is not None:
        left -= step_bytes

  out = []
  for i, p in enumerate(params):
    hull, (best_spec, best_gain, best_bytes) = hulls[i], best[i]
    plain = p.copies * gather.wire_bytes(p.shard_shape, p.dtype, best_spec)["plain"]
    if level[i] == 0:
      reason = "no gain" if len(hull) == 1 else "over budget"
      out.append(Selection(p.name, gather.CodecSpec("off"), best_spec, best_gain, best_bytes,
                           reason, plain, plain))
      continue
    nbytes, gain, spec = hull[level[i]]
    reason = "selected" if level[i] == len(hull) - 1 else "cheaper mode (budget)"
    sent = p.copies * gather.wire_bytes(p.shard_shape, p.dtype, spec)["forward"]
    out.append(Selection(p.name, spec, hull[-1][2], gain, nbytes, reason, plain, sent))
  return out
