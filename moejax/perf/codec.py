"""What a compressed gather sends and what its kernels cost: CIERA's exponent reuse, ZeRO++'s
quantization, moejax's codec modes (byte ratios measured by moejax), read from data or a run.

Byte ratios are bytes sent / bytes of the plain 16-bit gather, per parameter group (attention,
router, norms, experts, shared, dense, embeddings).

CIERA (Sec. 3.1-3.2): a shard sends its sign+mantissa bits, a bitmap of one bit per block of B
values, and the exponents of the blocks that changed (block change rate q), ANS-compressed:
  ratio = sm_bits/16 + 1/(16 B) + q * exp_bits/16 * ANS_RATIO
(bf16: 8 exponent and 8 sign+mantissa bits, so at most 2x; fp16: 5 and 11, at most 1.45x).

Kernel times are memory-bound passes at the HBM bandwidth (no GPU timing of these kernels is
available: CIERA gives none for its hash / ANS kernels and moejax's Triton kernels were not timed
on a GPU; see README):
  encode   reads the shard (2 B per value) and writes the payload (2 r B per value of the shard)
  decode   reads the payload and the cached exponents, writes the bf16 value: (2 r + 3) B per
           value of the gathered tensor.
"""
from __future__ import annotations

import dataclasses

import numpy as np

ANS_RATIO = 3.0 / 8.0
"""ANS-coded size of a block of bf16 exponents over its raw size: trained weights' exponents
carry about 2.6-3 bits of entropy in their 8 (DFloat11 and ZipCCL report this; CIERA gives no
figure); 3 bits assumed."""

BLOCK = 512
"""CIERA's block size B (Sec. 4.1)."""

EXP_CHANGE_RATE = 0.004
"""CIERA Obs. 2 / Fig. 2b: at lr 1e-4 the per-value exponent change rate averages 0.30-0.51%
after warm-up (0.4% taken). Used where Fig. 4 gives no block change rate: blocks of B values
change with probability 1 - (1 - c)^B (the uniform model of Sec. 2.3)."""


def uniform_block_rate(c: float = EXP_CHANGE_RATE, block: int = BLOCK) -> float:
  return 1.0 - (1.0 - c) ** block


BLOCK_CHANGE_RATES: dict[str, dict[str, float]] = {
    # CIERA Fig. 4 (block size 512, median per shard category). OLMoE from Sec. 2.4's text;
    # DeepSeek and MiniCPM read from the figure's labels in the text conversion (the text gives
    # layer norm 0.00 and 0.13 and attention / router / experts in 0.66-0.84).
    "OLMoE-1B-7B": {"experts": 0.22, "attention": 0.96, "router": 0.94, "norms": 0.64,
                    "embeddings": 0.65},
    "DeepSeek-MoE-16B": {"experts": 0.66, "shared_experts": 0.66, "dense": 0.66,
                         "attention": 0.81,
                         "router": 0.84, "norms": 0.00, "embeddings": 0.48},
    "MiniCPM-MoE-8x2B": {"experts": 0.80, "attention": 0.88, "router": 0.80, "norms": 0.13,
                         "embeddings": 0.66},
}
"""Models without a figure (Qwen2, Mixtral, Scout, ...) get `uniform_block_rate()` (0.87) for
every group: CIERA Sec. 4.4 says Mixtral's and Scout's rates are high."""


def block_rate(model: str, group: str) -> float:
  return BLOCK_CHANGE_RATES.get(model, {}).get(group, uniform_block_rate())


def ciera_ratio(q: float, dtype: str = "bf16", block: int = BLOCK) -> float:
  exp_bits, sm_bits = {"bf16": (8, 8), "fp16": (5, 11)}[dtype]
  return sm_bits / 16 + 1.0 / (16 * block) + q * exp_bits / 16 * ANS_RATIO


ZEROPP_INT8 = (1.0 + 4.0 / 256) / 2.0
"""ZeRO++ qwZ: int8 weights with one fp32 scale per block of 256, over 2 B per value."""
ZEROPP_INT4 = (0.5 + 4.0 / 256) / 2.0
"""ZeRO++ qgZ: int4 gradients with one fp32 scale per block of 256, over 2 B per value."""

# ------------------------------------------------------------------ moejax's own figures
MEASURED_RATIOS: dict[str, dict[str, float]] = {
    # README "Compressed all-gather (codec)", bench/codec.py --quick at 313495c: bytes / plain
    # bf16 of a step's gathers, forward and backward (the backward rebuilds word / delta weights
    # from its caches, and gathers element / block ones as sign + mantissa only), over all
    # parameters, every dense refill and fallback included; tiny preset on 8 fake CPU devices,
    # auto under a budget of one bf16 copy. "high": the preset's peak lr 3e-3, steps 31-60;
    # "low": fine-tuning lr 1e-4. `block`'s saving is the backward's alone: at these change
    # rates no block stays unchanged.
    "high": {"element": 0.587, "block": 0.774, "word": 0.573, "delta": 0.258, "auto": 0.258},
    "low": {"element": 0.526, "block": 0.774, "word": 0.335, "delta": 0.138, "auto": 0.138},
}
CACHE_BYTES_PER_VALUE = {"element": 1.0, "block": 1.0, "word": 2.0, "delta": 2.0, "auto": 2.0}
"""Receiver state per gathered value and device (README codec table: W x 1 or 2 bytes)."""


@dataclasses.dataclass(frozen=True)
class Ratios:
  """Byte ratios per group; `default` for groups not listed."""
  default: float
  groups: tuple[tuple[str, float], ...] = ()
  source: str = ""

  def of(self, group: str) -> float:
    return dict(self.groups).get(group, self.default)


def measured(mode: str, regime: str = "high") -> Ratios:
  r = MEASURED_RATIOS[regime][mode]
  return Ratios(r, source=f"bench/codec.py --quick, {regime} lr, mode {mode} (README)")


def ratios_from_metrics(records: list[dict], skip_steps: int = 30) -> Ratios:
  """Byte ratios of a run's metrics.jsonl: sum of `gather_bytes` over sum of
  `gather_bytes_plain` for logged steps after `skip_steps` (the codec warm-up), and per group
  from `codec/<group>/bytes_sent` / `codec/<group>/bytes_plain`."""
  rows = [r for r in records if r.get("step", 0) > skip_steps and "gather_bytes_plain" in r]
  if not rows:
    raise ValueError(f"no logged step after {skip_steps} has gather_bytes_plain")
  sent = sum(float(r["gather_bytes"]) for r in rows)
  plain = sum(float(r["gather_bytes_plain"]) for r in rows)
  if plain <= 0:
    raise ValueError("gather_bytes_plain is 0 (nothing gathered: one device?)")
  groups = {}
  for key in rows[0]:
    if key.startswith("codec/") and key.endswith("/bytes_plain"):
      g = key.split("/")[1]
      p = sum(float(r.get(key, 0.0)) for r in rows)
      s = sum(float(r.get(f"codec/{g}/bytes_sent", 0.0)) for r in rows)
      if p > 0:
        groups[g] = s / p
  return Ratios(sent / plain, tuple(sorted(groups.items())),
                source=f"metrics.jsonl, {len(rows)} logged steps after step {skip_steps}")


def encode_seconds(shard_values: float, ratio: float, hbm: float) -> float:
  return shard_values * (2.0 + 2.0 * ratio) / hbm


def decode_seconds(full_values: float, ratio: float, hbm: float) -> float:
  return full_values * (2.0 * ratio + 3.0) / hbm


def quantize_seconds(values: float, in_bytes: float, out_bytes: float, hbm: float) -> float:
  return values * (in_bytes + out_bytes) / hbm


def weighted_ratio(ratios: dict[str, float], sizes: dict[str, float]) -> float:
  tot = sum(sizes.values())
  return float(np.sum([ratios[g] * sizes[g] for g in sizes]) / tot) if tot else 1.0
