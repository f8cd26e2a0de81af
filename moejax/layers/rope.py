"""Rotary position embeddings (RoPE): plain, or with YaRN's or Llama 3's context extension.

Letters: S sequence, Dh the rotated width (a head's, or latent attention's rotary part).

Plain RoPE rotates pair i of a head by position * theta^(-2i/Dh). YaRN (Peng et al., "YaRN:
Efficient Context Window Extension of Large Language Models", arXiv 2309.00071) extends a model
trained on `original_max_len` positions by `factor`: pairs that turn more than `beta_fast` times
over the original context keep their frequency, pairs that turn fewer than `beta_slow` times are
slowed by `factor` (position interpolation), the pairs between blend linearly; cos and sin are
multiplied by an attention factor (the paper's sqrt(1/t) = 0.1 ln(factor) + 1). DeepSeek-V3's
published weights and Qwen's long-context configs use it. The formulas are transformers'
(`_compute_yarn_parameters`, `yarn_get_mscale`, `yarn_apply_mscale`), so imported weights compute
what they compute there: the correction range in float64 on the host, the frequencies in
float32.

Llama 3's scaling (Llama 3.1's and Llama 4 Scout's published weights; transformers'
`_compute_llama3_parameters`) divides by `factor` the frequencies whose wavelength exceeds
`original_max_len / low_freq_factor`, keeps those shorter than `original_max_len /
high_freq_factor`, and blends the ones between by how many times they turn over the original
context; cos and sin are not scaled.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

ROPE_SCALINGS = ("none", "yarn", "llama3")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's attention temperature term, 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """How RoPE's frequencies are scaled: `kind` one of ROPE_SCALINGS; factor and original_max_len
  are read by both scalings, the beta and mscale fields by "yarn", the freq factors by "llama3"
  (the fields of transformers' rope_parameters of those names)."""
  kind: str = "none"
  factor: float = 1.0
  original_max_len: int = 0
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 0.0
  mscale_all_dim: float = 0.0
  attention_factor: float = 0.0      # 0: from factor and the mscales
  truncate: bool = True
  low_freq_factor: float = 1.0       # llama3: wavelengths above original_max_len / this: / factor
  high_freq_factor: float = 4.0      # ... below original_max_len / this: kept

  def __post_init__(self):
    if self.kind not in ROPE_SCALINGS:
      raise ValueError(f"rope scaling {self.kind!r}: must be one of {', '.join(ROPE_SCALINGS)}")

  @property
  def table_scale(self) -> float:
    """Multiplies cos and sin: YaRN's attention factor (1 without scaling)."""
    if self.kind != "yarn":
      return 1.0
    if self.attention_factor:
      return self.attention_factor
    if self.mscale and self.mscale_all_dim:
      return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
    return yarn_mscale(self.factor)

  @property
  def latent_softmax_scale(self) -> float:
    """Multiplies latent attention's softmax scale 1/sqrt(Dn + Dr): DeepSeek scales the whole
    q.k, the parts without rotary too, by mscale(factor, mscale_all_dim)^2."""
    if self.kind != "yarn" or not self.mscale_all_dim:
      return 1.0
    return yarn_mscale(self.factor, self.mscale_all_dim) ** 2

  def correction_range(self, dim: int, theta: float) -> tuple[float, float]:
    """YaRN's (low, high) pair indices: below low pairs keep their frequency, above high they
    are interpolated (frequency / factor)."""
    def pair(rotations):   # the pair index that turns `rotations` times over the context
      return dim * math.log(self.original_max_len / (rotations * 2 * math.pi)) / (
          2 * math.log(theta))
    low, high = pair(self.beta_fast), pair(self.beta_slow)
    if self.truncate:
      low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


NO_SCALING = RopeScaling()


def inv_frequencies(dim: int, theta: float, scaling: RopeScaling = NO_SCALING):
  """[Dh/2] float32 angle per position of each rotated pair."""
  base_freq = theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
  extrapolated = 1.0 / base_freq
  if scaling.kind == "none":
    return extrapolated
  if scaling.kind == "llama3":
    return _llama3_frequencies(extrapolated, scaling)
  interpolated = 1.0 / (scaling.factor * base_freq)
  low, high = scaling.correction_range(dim, theta)
  if low == high:
    high += 0.001     # transformers' guard against a zero-width ramp
  ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
  keep = 1.0 - ramp
  return interpolated * (1.0 - keep) + extrapolated * keep


def _llama3_frequencies(inv_freq, scaling: RopeScaling):
  """Llama 3's scaled frequencies (see the module docstring), in float32 as transformers'."""
  context = scaling.original_max_len
  wavelength = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelength > context / scaling.low_freq_factor, inv_freq / scaling.factor,
                     inv_freq)
  if scaling.high_freq_factor == scaling.low_freq_factor:   # no band between: nothing to blend
    return scaled
  smooth = (context / wavelength - scaling.low_freq_factor) / (
      scaling.high_freq_factor - scaling.low_freq_factor)
  blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  between = ((wavelength >= context / scaling.high_freq_factor)
             & (wavelength <= context / scaling.low_freq_factor))
  return jnp.where(between, blended, scaled)


def rotary_tables(seq_len: int, head_dim: int, theta: float,
                  scaling: RopeScaling = NO_SCALING):
  """(cos, sin) [S, Dh] for positions 0..seq_len-1."""
  return rotary_at(jnp.arange(seq_len, dtype=jnp.float32), head_dim, theta, scaling)


def rotary_at(positions_S, head_dim: int, theta: float, scaling: RopeScaling = NO_SCALING):
  """(cos, sin) [S, Dh] for the given token positions (a KV-cached step's are not 0..S-1)."""
  inv_freq = inv_frequencies(head_dim, theta, scaling)
  angles_SxHalf = positions_S.astype(jnp.float32)[:, None] * inv_freq[None, :]
  angles_SxDh = jnp.concatenate([angles_SxHalf, angles_SxHalf], axis=-1)
  cos, sin = jnp.cos(angles_SxDh), jnp.sin(angles_SxDh)
  if scaling.table_scale != 1.0:
    cos, sin = cos * scaling.table_scale, sin * scaling.table_scale
  return cos, sin


def apply_rotary(x_BxSxHxDh, cos_SxDh, sin_SxDh):
  """x rotated half-split (rotate_half): pair i is (x[i], x[i + Dh/2]). Tables narrower than x
  (partial rotary, GLM-4.5's half head) rotate its first Dh' dims the same way and pass the rest
  through."""
  rotated_width = cos_SxDh.shape[-1]
  if rotated_width < x_BxSxHxDh.shape[-1]:
    return jnp.concatenate([apply_rotary(x_BxSxHxDh[..., :rotated_width], cos_SxDh, sin_SxDh),
                            x_BxSxHxDh[..., rotated_width:]], axis=-1)
  x32 = x_BxSxHxDh.astype(jnp.float32)
  half = x32.shape[-1] // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  cos, sin = cos_SxDh[None, :, None, :], sin_SxDh[None, :, None, :]
  return (x32 * cos + rotated * sin).astype(x_BxSxHxDh.dtype)
