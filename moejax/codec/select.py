"""Which parameters use the compressed gather: benefit against cost, under a cache-memory budget.

For parameter i (one shard per device, W devices on the gather axis), all figures per device:

  S_i         bytes contributed to the plain all-gather (shard bytes)
  P_i(m)      bytes contributed to the compressed one in mode m: the static buffer, whose
              capacity is sized from the measured change rate (q_i times a safety margin),
              since a static-shape collective moves its capacity, not its fill
  Comm(b)     alpha + beta * b, the time of one all-gather to which each device contributes b
              bytes, fit from (bytes, seconds) measurements
  T_i(m)      decode time per gather (an estimate the caller supplies)
  g_i(m)      = Comm(S_i) - Comm(P_i(m)) - Comm(16) - T_i(m)
              (the codec also issues the 16-byte agreement all-gather, which costs one alpha)
  M_i(m)      bytes of codec state per device: (W-1) x exponent bytes of cache, plus the sender's
              previous exponents ("exact") or block hashes ("hash")

Each parameter takes the mode with the largest gain (on ties, the smaller state). Parameters whose
best gain is positive are ranked by gain per byte of state, g_i / M_i, and taken greedily while
the budget lasts; one that does not fit is skipped and smaller ones after it may still fit.
Everything else is gathered plainly (mode "off"). The model leaves out warm-up steps and
overflow fallbacks (both send the plain bytes plus the agreement); the margin on the capacity is
what keeps the fallbacks rare.

Plain Python and numpy: no device work happens here.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from moejax.codec import gather

# (mode, detect) pairs considered; ("block", "hash") trades a 2^-128 chance of a missed change
# for a much smaller sender state and is only considered when asked for.
OPTIONS = (("element", "exact"), ("block", "exact"))
HASH_OPTION = ("block", "hash")


@dataclasses.dataclass(frozen=True)
class CommModel:
  """All-gather time as alpha + beta * bytes each device contributes."""
  alpha: float   # seconds
  beta: float    # seconds per byte

  def __call__(self, nbytes) -> float:
    return self.alpha + self.beta * float(nbytes)

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


@dataclasses.dataclass(frozen=True)
class Selection:
  name: str
  spec: gather.CodecSpec      # what to use: `best`, or mode "off" when not selected
  best: gather.CodecSpec      # the best compressed option, selected or not
  gain_s: float               # its gain per gather (seconds)
  state_bytes: int            # state bytes per device of the best mode
  reason: str                 # "selected" | "no gain" | "over budget"


def _decode_s(p: ParamStats, mode: str) -> float:
  return float(p.decode_s[mode] if isinstance(p.decode_s, Mapping) else p.decode_s)


def evaluate(p: ParamStats, mode: str, detect: str, comm: CommModel, axis_size: int, *,
             block_size: int = 512, margin: float = 1.5, warmup_steps: int = 30):
  """(spec, gain in seconds, state bytes) of one parameter in one mode."""
  q = p.q_element if mode == "element" else p.q_block
  fraction = float(min(1.0, max(q * margin, 1e-12)))
  spec = gather.CodecSpec(mode, block_size=block_size, detect=detect, capacity_fraction=fraction,
                          warmup_steps=warmup_steps)
  sizes = gather.wire_bytes(p.shard_shape, p.dtype, spec)
  agreement = 4 * gather.STATS_WORDS
  gain = (comm(sizes["plain"]) - comm(sizes["compressed"] - agreement) - comm(agreement)
          - _decode_s(p, mode))
  return spec, gain, gather.state_bytes(p.shard_shape, p.dtype, axis_size, spec)


def select(params: Sequence[ParamStats], comm: CommModel, *, axis_size: int,
           cache_budget_bytes: int, block_size: int = 512, margin: float = 1.5,
           allow_hash: bool = False, warmup_steps: int = 30) -> list[Selection]:
  """One Selection per parameter, in the order given (see the module docstring)."""
  options = OPTIONS + ((HASH_OPTION,) if allow_hash else ())
  best = []
  for p in params:
    candidates = [evaluate(p, mode, det, comm, axis_size, block_size=block_size, margin=margin,
                           warmup_steps=warmup_steps)
                  for mode, det in options if (p.q_block is not None or mode == "element")]
    best.append(max(candidates, key=lambda c: (c[1], -c[2])))

  order = sorted((i for i, (_, gain, _) in enumerate(best) if gain > 0),
                 key=lambda i: best[i][1] / best[i][2], reverse=True)
  chosen, left = set(), cache_budget_bytes
  for i in order:
    if best[i][2] <= left:
      chosen.add(i)
      left -= best[i][2]

  out = []
  for i, (p, (spec, gain, nbytes)) in enumerate(zip(params, best)):
    if i in chosen:
      out.append(Selection(p.name, spec, spec, gain, nbytes, "selected"))
    else:
      reason = "no gain" if gain <= 0 else "over budget"
      out.append(Selection(p.name, gather.CodecSpec("off"), spec, gain, nbytes, reason))
  return out
