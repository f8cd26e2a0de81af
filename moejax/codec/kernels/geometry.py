"""Static sizes of one shard's codec wire, from plain ints (no jax: the Triton interpreter tests
import this module in an environment without jax).

One shard's wire is `[rest words][patch words]`: the packed sign+mantissa of its N values
(`bits.pack_bits`, `rest_bits` each) followed by its exponent patch (`payload.Format`: a head
section of `head_words` and a tail section of `tail_words`). `Geometry.of(fmt, layout)` takes the
numbers from the jax-side `payload.Format` and `bits.Layout`; the tests check that every derived
size equals the one of `payload.Format`.

Letters: N values, NP cached exponents (N rounded up to whole blocks in block mode), NB blocks,
B values per block, C capacity (units: blocks or values), L wire words.
"""
from __future__ import annotations

import dataclasses

# (exponent bits, mantissa bits) of the formats the codec handles; see bits.LAYOUTS.
DTYPE_BITS = {"bfloat16": (8, 7), "float16": (5, 10), "float32": (8, 23)}
MODES = ("block", "element")


def packed_words(n: int, width: int) -> int:
  """uint32 words holding n values of `width` bits (whole groups of 32 values)."""
  return -(-n // 32) * width


@dataclasses.dataclass(frozen=True)
class Geometry:
  mode: str          # "block" | "element"
  n: int
  block_size: int
  capacity: int      # units a patch holds: blocks (block mode) or values (element mode)
  exp_bits: int
  mant_bits: int

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
    if min(self.n, self.block_size, self.capacity) < 1:
      raise ValueError(f"n, block_size and capacity must be >= 1, got {self}")
    if self.cache_width >= 2**31:   # positions and slots are int32
      raise ValueError(f"a shard must hold fewer than 2**31 values, got {self.n}")

  @classmethod
  def of(cls, fmt, layout) -> "Geometry":
    """From a payload.Format and a bits.Layout."""
    if fmt.exp_bits != layout.exp_bits:
      raise ValueError(f"format has {fmt.exp_bits} exponent bits, layout {layout.name} has "
                       f"{layout.exp_bits}")
    return cls(fmt.mode, fmt.n, fmt.block_size, fmt.capacity, layout.exp_bits, layout.mant_bits)

  @classmethod
  def for_dtype(cls, mode: str, dtype: str, n: int, block_size: int, capacity: int):
    exp_bits, mant_bits = DTYPE_BITS[dtype]
    return cls(mode, n, block_size, capacity, exp_bits, mant_bits)

  @property
  def total_bits(self) -> int:
    return 1 + self.exp_bits + self.mant_bits

  @property
  def rest_bits(self) -> int:
    return 1 + self.mant_bits

  @property
  def num_blocks(self) -> int:
    return -(-self.n // self.block_size)

  @property
  def cache_width(self) -> int:
    return self.num_blocks * self.block_size if self.mode == "block" else self.n

  @property
  def units(self) -> int:
    return self.num_blocks if self.mode == "block" else self.n

  @property
  def pos_bits(self) -> int:
    return max(1, (self.cache_width - 1).bit_length())

  @property
  def head_bits(self) -> int:
    """Bits per value of the patch's first section: bitmap (1) or positions."""
    return 1 if self.mode == "block" else self.pos_bits

  @property
  def head_values(self) -> int:
    return self.num_blocks if self.mode == "block" else self.capacity

  @property
  def tail_values(self) -> int:
    return self.capacity * self.block_size if self.mode == "block" else self.capacity

  @property
  def rest_words(self) -> int:
    return packed_words(self.n, self.rest_bits)

  @property
  def head_words(self) -> int:
    return packed_words(self.head_values, self.head_bits)

  @property
  def tail_words(self) -> int:
    return packed_words(self.tail_values, self.exp_bits)

  @property
  def patch_words(self) -> int:
    return self.head_words + self.tail_words

  @property
  def wire_words(self) -> int:
    """L: rest words then patch words."""
    return self.rest_words + self.patch_words
