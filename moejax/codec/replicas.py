"""Compressed replicas for SparseAllGather: a device that held an expert last step gets a patch.

FSSDP (`moejax.placement.fssdp`) fills each device's M replica slots with whole experts from
their owners every step. A hot expert tends to stay on the same device from one step to the next,
and one optimizer step moves most of its values by a few units in the last place, so the
receiver's copy from last step plus a delta patch (`moejax.codec.word`, delta mode) rebuilds this
step's expert exactly, for about a quarter of its bytes.

The state of one layer on one device (`init_state`; rebuilt, never checkpointed, but `held`):
  held   int32 [N, M]  the expert each slot of every device held after last step (E for an
                       empty slot, -1 before the first step); the same on every device, as the
                       plan it comes from. Every fssdp run keeps it, coded or not: the planner
                       prefers these devices for the same experts (`init_held`)
  cache  uint  [M, R]  this device's replicas after last step, as bit patterns
  prev   uint  [C, R]  this device's owned experts of last step (by rank), as bit patterns
  valid  bool          False until a step filled them, and after re-sharding (owners moved)
An expert's R values are its three matrices, flattened and concatenated.

Each step an owner encodes each of its C experts once against `prev` (`encode`) in each of a few
delta formats (`FORMATS`: 3-bit codes for small moves, 4-bit ones, a byte per value for the
large moves of a peak learning rate) and picks for each expert the smallest patch that fits its
capacities and is smaller than the plain expert, or none: no replica costs more than plain.
The owners agree on their choices with one all_gather of 2 bits per expert (`agree`: 4 bytes per
device per 16 owned experts). Slot (d, m) then travels as a patch when it
`hits`: the state is valid, device d held this expert last step (in any of its slots) and the
expert has a patch; otherwise plain (a miss, every patch over capacity, or the first step). Every
device knows every slot's form from replicated data, so the ragged (GPU) exchange sizes its
transfers in words without asking. The replicas are bit-exact either way.

Letters: N devices, M replica slots, C owned experts per layer, E experts, R values of an expert,
P patch words, W row words (the larger of P and the plain row).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from moejax.codec import bits
from moejax.codec import word

REPLICA_CODECS = ("off", "delta")
"""fssdp.replica_codec: plain replicas, or delta patches where a device keeps its expert."""

FORMATS = ((3, 1 / 8, 1 / 64), (4, 1 / 4, 1 / 32), (8, 1 / 16, 1 / 16))
"""(code bits, escape capacity, far capacity) of the patch formats, smallest first: about 0.27,
0.41 and 0.59 of a bf16 expert's bytes. A 4-bit code carries moves of up to 7 units in the last
place, a byte up to 127 (its escapes are all whole values)."""
_CHOICE_BITS = 2    # per expert in the agreement: 0 = plain, k = FORMATS[k - 1]


@dataclasses.dataclass(frozen=True)
class ReplicaCodec:
  """Static description of one layer's replica patches (hashable: part of `Dispatch`)."""
  values: int                       # R: values of one expert's three matrices
  dtype: str = "bfloat16"           # the dtype replicas travel in (the compute dtype)
  formats: tuple = FORMATS

  def __post_init__(self):
    if not 1 <= len(self.formats) < 2 ** _CHOICE_BITS:
      raise ValueError(f"1 to {2 ** _CHOICE_BITS - 1} formats, got {self.formats}")

  @property
  def layout(self) -> bits.Layout:
    return bits.layout_of(np.dtype(self.dtype))

  @property
  def fmts(self) -> tuple[word.WordFormat, ...]:
    return tuple(word.WordFormat.create(self.values, self.layout.total_bits, cap, k, far)
                 for k, cap, far in self.formats)

  @property
  def plain_words(self) -> int:
    return bits.packed_words(self.values, self.layout.total_bits)

  @property
  def row_words(self) -> int:
    """W: words of one slot in a static buffer (a patch or a plain expert)."""
    return max([self.plain_words] + [f.words for f in self.fmts])

  @property
  def plain_bytes(self) -> int:
    return self.values * self.layout.itemsize

  @property
  def words_by_choice(self) -> tuple[int, ...]:
    """Words of a row by choice: plain, then each format's patch."""
    return (self.plain_words,) + tuple(f.words for f in self.fmts)

  @staticmethod
  def agree_bytes(owned: int) -> int:
    """Bytes each device contributes to the agreement all_gather."""
    return 4 * bits.packed_words(owned, _CHOICE_BITS)


def init_held(num_devices: int, slots: int) -> jax.Array:
  """`held` before the first step (every fssdp run keeps it: the planner reads it too)."""
  return jnp.full((num_devices, slots), -1, jnp.int32)


def init_state(num_devices: int, slots: int, owned: int, codec: ReplicaCodec) -> dict:
  """One layer's state on one device, before the first step (see the module docstring)."""
  uint = codec.layout.uint_dtype
  return {"held": init_held(num_devices, slots),
          "cache": jnp.zeros((slots, codec.values), uint),
          "prev": jnp.zeros((owned, codec.values), uint),
          "valid": jnp.zeros((), bool)}


def invalidate(state: dict) -> dict:
  """Marks the states stale (owners moved): the next step sends every replica plain."""
  return {**state, "valid": jnp.zeros_like(state["valid"])}


def to_bits(ws, layout: bits.Layout) -> jax.Array:
  """Matrices [K, ...] (one row per expert) -> their bit patterns [K, R], concatenated."""
  return jnp.concatenate([lax.bitcast_convert_type(w, layout.uint_dtype).reshape(w.shape[0], -1)
                          for w in ws], axis=1)


def from_bits(bits_KxR: jax.Array, like, layout: bits.Layout):
  """Inverse of `to_bits`: the matrices [K, ...] shaped like `like`'s rows."""
  out, start = [], 0
  for w in like:
    size = math.prod(w.shape[1:])
    part = bits_KxR[:, start:start + size].reshape((bits_KxR.shape[0],) + w.shape[1:])
    out.append(lax.bitcast_convert_type(part, layout.dtype))
    start += size
  return tuple(out)


def encode(bits_CxR: jax.Array, prev_CxR: jax.Array, codec: ReplicaCodec):
  """Each owned expert's patch against its value last step, in its smallest format that fits ->
  (patch rows [C, W] uint32, zero-padded; choice [C] int32: 0 none fits, k FORMATS[k - 1]).
  The fit is read off the moves' sizes. XLA:CPU then encodes only the chosen format (one
  `lax.switch` per expert, in a loop), GPU/TPU every format at once and selects: a conditional
  there waits for the host."""
  return lax.platform_dependent(bits_CxR, prev_CxR, cpu=functools.partial(encode_each, codec=codec),
                                default=functools.partial(encode_all, codec=codec))


def _choice(d_R, codec: ReplicaCodec):
  """The smallest format whose capacities hold this expert's escapes and whose patch is smaller
  than the plain expert (0: none). A small expert's patch can be larger: its sections round up
  to whole words and its capacities to at least one value (96 bf16 values: 48 words plain, the
  byte format's patch 48)."""
  fmts = codec.fmts
  far = jnp.sum((d_R > word.NEAR_MAX) | (d_R < -word.NEAR_MAX), dtype=jnp.int32)
  choice = jnp.int32(0)
  for k in reversed(range(len(fmts))):
    if fmts[k].words >= codec.plain_words:
      continue
    escapes = jnp.sum((d_R > fmts[k].max_delta) | (d_R < -fmts[k].max_delta), dtype=jnp.int32)
    choice = jnp.where((escapes <= fmts[k].capacity) & (far <= fmts[k].far_capacity), k + 1,
                       choice)
  return choice


def _patch_fn(fmt: word.WordFormat, w: int):
  def run(bits_R, prev_R, d_R):
    out = word.encode(bits_R, word.codes(bits_R, prev_R, fmt, d_R), fmt, d_R)[0]
    return jnp.pad(out, (0, w - fmt.words))
  return run


def encode_each(bits_CxR, prev_CxR, codec: ReplicaCodec):
  """`encode`, the chosen format only (XLA:CPU)."""
  w, value_bits = codec.row_words, codec.layout.total_bits
  branches = [lambda *_: jnp.zeros((w,), jnp.uint32)] + [_patch_fn(f, w) for f in codec.fmts]

  def one(args):
    bits_R, prev_R = args
    d_R = word.key_delta(bits_R, prev_R, value_bits)
    choice = _choice(d_R, codec)
    return lax.switch(choice, branches, bits_R, prev_R, d_R), choice

  return lax.map(one, (bits_CxR, prev_CxR))


def encode_all(bits_CxR, prev_CxR, codec: ReplicaCodec):
  """`encode`, every format then a select (no conditional)."""
  w, value_bits = codec.row_words, codec.layout.total_bits

  def one(bits_R, prev_R):
    d_R = word.key_delta(bits_R, prev_R, value_bits)
    choice = _choice(d_R, codec)
    patches = jnp.stack([jnp.zeros((w,), jnp.uint32)]
                        + [_patch_fn(f, w)(bits_R, prev_R, d_R) for f in codec.fmts])
    return patches[choice], choice

  return jax.vmap(one)(bits_CxR, prev_CxR)


def agree(choice_C: jax.Array, axis_names) -> jax.Array:
  """[N, C] int32: every device's choices for its owned experts (one all_gather of 2 bits per
  expert, in integers: XLA:CPU's float collectives rewrite NaN payloads)."""
  c = choice_C.shape[0]
  packed = bits.pack_bits(choice_C.astype(jnp.uint32), _CHOICE_BITS)
  gathered = lax.all_gather(packed, axis_names, axis=0, tiled=False)
  return bits.unpack_bits(gathered, _CHOICE_BITS, c).astype(jnp.int32)


def hits(state: dict, replica_expert_NxM, choice_E):
  """(choice [N, M] int32: 0 where a slot travels plain, else its patch format as in `encode`;
  source [N, M] int32: the slot of the same device that held the expert last step, whose cached
  copy the patch applies to). The same on every device. A device's slots may trade experts
  between steps: the planner orders them by load, not by what they held."""
  e = choice_E.shape[0]
  filled_NxM = replica_expert_NxM < e
  chosen_NxM = choice_E[jnp.minimum(replica_expert_NxM, e - 1)]
  held_NxMxM = state["held"][:, None, :] == replica_expert_NxM[:, :, None]   # [d, now, before]
  source_NxM = jnp.argmax(held_NxMxM, axis=2).astype(jnp.int32)
  hit_NxM = state["valid"] & filled_NxM & jnp.any(held_NxMxM, axis=2)
  return jnp.where(hit_NxM, chosen_NxM, 0), source_NxM


def plain_rows(bits_CxR: jax.Array, codec: ReplicaCodec) -> jax.Array:
  """The owned experts' plain rows [C, W] uint32 (their packed bit patterns, zero-padded)."""
  plain = bits.pack_bits(bits_CxR, codec.layout.total_bits)
  return jnp.pad(plain, ((0, 0), (0, codec.row_words - plain.shape[1])))


def decode(rows_MxW: jax.Array, choice_M: jax.Array, cache_MxR: jax.Array, codec: ReplicaCodec):
  """The replicas' bit patterns [M, R] from the received rows: where `choice_M` > 0, its
  format's patch applied to slot m's cached copy (`cache_MxR[m]`: last step's replica of the
  same expert, from the slot `hits` names); plain rows unpacked elsewhere. XLA:CPU runs only
  each slot's own decoder (`lax.switch`), GPU/TPU all of them and selects, as in `encode`."""
  return lax.platform_dependent(rows_MxW, choice_M, cache_MxR,
                                cpu=functools.partial(decode_each, codec=codec),
                                default=functools.partial(decode_all, codec=codec))


def _decoders(codec: ReplicaCodec, uint):
  value_bits = codec.layout.total_bits

  def plain(row_W, cache_R):
    del cache_R
    return bits.unpack_bits(row_W[:codec.plain_words], value_bits, codec.values).astype(uint)

  def patched(fmt):
    return lambda row_W, cache_R: word.decode(cache_R[None], row_W[None, :fmt.words], fmt)[0]

  return [plain] + [patched(f) for f in codec.fmts]


def decode_each(rows_MxW, choice_M, cache_MxR, codec: ReplicaCodec):
  """`decode`, each slot's own decoder only (XLA:CPU)."""
  branches = _decoders(codec, cache_MxR.dtype)
  return lax.map(lambda a: lax.switch(a[0], branches, a[1], a[2]),
                 (choice_M, rows_MxW, cache_MxR))


def decode_all(rows_MxW, choice_M, cache_MxR, codec: ReplicaCodec):
  """`decode`, every decoder then a select (no conditional)."""
  branches = _decoders(codec, cache_MxR.dtype)
  outs = jnp.stack([jax.vmap(f)(rows_MxW, cache_MxR) for f in branches])   # [K + 1, M, R]
  return jnp.take_along_axis(outs, choice_M[None, :, None], axis=0)[0]


def slot_words(holder_NxM, choice_NxM, codec: ReplicaCodec):
  """[N, M] int32: words each slot's row takes on the ragged path (0 for an empty slot)."""
  n = holder_NxM.shape[0]
  words = jnp.asarray(codec.words_by_choice, jnp.int32)[choice_NxM]
  return jnp.where(holder_NxM < n, words, 0).astype(jnp.int32)


def slot_bytes(replica_expert_NxM, choice_NxM, num_experts: int, codec: ReplicaCodec):
  """[N, M] float32: bytes each slot's row carries on the ragged path (a patch, a plain expert,
  or nothing for an empty slot)."""
  filled = replica_expert_NxM < num_experts
  sizes = jnp.asarray((float(codec.plain_bytes),)
                      + tuple(4.0 * f.words for f in codec.fmts), jnp.float32)
  return jnp.where(filled, sizes[choice_NxM], 0.0).astype(jnp.float32)
