"""Compressed replicas for SparseAllGather: a slot that held the same expert last step gets a patch.

FSSDP (`moejax.placement.fssdp`) fills each device's M replica slots with whole experts from
their owners every step. A hot expert tends to stay on the same device from one step to the next,
and one optimizer step moves most of its values by a few units in the last place, so the
receiver's copy from last step plus a delta patch (`moejax.codec.word`, delta mode) rebuilds this
step's expert exactly, for about a quarter of its bytes.

The state of one layer on one device (`init_state`; rebuilt, never checkpointed):
  held   int32 [N, M]  the expert each slot of every device held after last step (-1: none);
                       the same on every device, as the plan it comes from
  cache  uint  [M, R]  this device's replicas after last step, as bit patterns
  prev   uint  [C, R]  this device's owned experts of last step (by rank), as bit patterns
  valid  bool          False until a step filled them, and after re-sharding (owners moved)
An expert's R values are its three matrices, flattened and concatenated.

Each step an owner encodes each of its C experts once against `prev` (`encode`), whatever the
number of slots it fills. The owners agree on which patches fit their capacity with one
all_gather of a bitmask (`agree`: 4 bytes per device per 32 owned experts). Slot (d, m) then
travels as a patch when it `hits`: the state is valid, device d held this expert last step (in
any of its slots) and the expert's patch fits; otherwise plain (a miss, a patch over capacity, or
the first step). Every
device knows every slot's form from replicated data, so the ragged (GPU) exchange sizes its
transfers in words without asking. The replicas are bit-exact either way.

Letters: N devices, M replica slots, C owned experts per layer, E experts, R values of an expert,
P patch words, W row words (the larger of P and the plain row).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from moejax.codec import bits
from moejax.codec import word

REPLICA_CODECS = ("off", "delta")
"""fssdp.replica_codec: plain replicas, or delta patches where a slot keeps its expert."""


@dataclasses.dataclass(frozen=True)
class ReplicaCodec:
  """Static description of one layer's replica patches (hashable: part of `Dispatch`)."""
  values: int                       # R: values of one expert's three matrices
  dtype: str = "bfloat16"           # the dtype replicas travel in (the compute dtype)
  delta_bits: int = 3
  capacity_fraction: float = 1 / 8  # escapes (moves beyond the code's range) a patch holds
  far_fraction: float = 1 / 64      # ... of which whole values (moves beyond 127 units)

  @property
  def layout(self) -> bits.Layout:
    return bits.layout_of(np.dtype(self.dtype))

  @property
  def fmt(self) -> word.WordFormat:
    return word.WordFormat.create(self.values, self.layout.total_bits, self.capacity_fraction,
                                  self.delta_bits, self.far_fraction)

  @property
  def plain_words(self) -> int:
    return bits.packed_words(self.values, self.layout.total_bits)

  @property
  def row_words(self) -> int:
    """W: words of one slot in a static buffer (a patch or a plain expert)."""
    return max(self.plain_words, self.fmt.words)

  @property
  def plain_bytes(self) -> int:
    return self.values * self.layout.itemsize

  @property
  def patch_bytes(self) -> int:
    return 4 * self.fmt.words

  @staticmethod
  def agree_bytes(owned: int) -> int:
    """Bytes each device contributes to the agreement all_gather."""
    return 4 * bits.packed_words(owned, 1)


def init_state(num_devices: int, slots: int, owned: int, codec: ReplicaCodec) -> dict:
  """One layer's state on one device, before the first step (see the module docstring)."""
  uint = codec.layout.uint_dtype
  return {"held": jnp.full((num_devices, slots), -1, jnp.int32),
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
  """Each owned expert's patch against its value last step -> (patches [C, P] uint32, fits [C]
  bool: escapes and far escapes within the capacities)."""
  fmt = codec.fmt

  def one(bits_R, prev_R):
    d_R = word.key_delta(bits_R, prev_R, fmt.value_bits)
    patch, count, far = word.encode(bits_R, word.codes(bits_R, prev_R, fmt, d_R), fmt, d_R)
    return patch, (count <= fmt.capacity) & (far <= fmt.far_capacity)

  return jax.vmap(one)(bits_CxR, prev_CxR)


def agree(fits_C: jax.Array, axis_names) -> jax.Array:
  """[N, C] bool: which of every device's owned experts have a patch that fits (one all_gather
  of a bitmask, in integers: XLA:CPU's float collectives rewrite NaN payloads)."""
  c = fits_C.shape[0]
  mask = bits.pack_bits(fits_C.astype(jnp.uint32), 1)
  return bits.unpack_bits(lax.all_gather(mask, axis_names, axis=0, tiled=False), 1, c) > 0


def hits(state: dict, replica_expert_NxM, patch_fits_E):
  """(hit [N, M] bool: slots that travel as a patch; source [N, M] int32: the slot of the same
  device that held the expert last step, whose cached copy the patch applies to). The same on
  every device. A device's slots may trade experts between steps: the planner orders them by
  load, not by what they held."""
  e = patch_fits_E.shape[0]
  filled_NxM = replica_expert_NxM < e
  fits_NxM = patch_fits_E[jnp.minimum(replica_expert_NxM, e - 1)]
  held_NxMxM = state["held"][:, None, :] == replica_expert_NxM[:, :, None]   # [d, now, before]
  source_NxM = jnp.argmax(held_NxMxM, axis=2).astype(jnp.int32)
  return state["valid"] & filled_NxM & fits_NxM & jnp.any(held_NxMxM, axis=2), source_NxM


def rows(bits_CxR: jax.Array, patches_CxP: jax.Array, codec: ReplicaCodec):
  """(plain rows [C, W], patch rows [C, W]) uint32 of the owned experts, zero-padded to W."""
  w = codec.row_words
  plain = bits.pack_bits(bits_CxR, codec.layout.total_bits)
  pad = lambda x: jnp.pad(x, ((0, 0), (0, w - x.shape[1])))   # noqa: E731
  return pad(plain), pad(patches_CxP)


def decode(rows_MxW: jax.Array, hit_M: jax.Array, cache_MxR: jax.Array, codec: ReplicaCodec):
  """The replicas' bit patterns [M, R] from the received rows: where `hit_M`, the patch applied
  to slot m's cached copy (`cache_MxR[m]`: last step's replica of the same expert, taken from
  the slot `hits` names); plain rows unpacked elsewhere."""
  fmt = codec.fmt
  plain = bits.unpack_bits(rows_MxW[:, :codec.plain_words], fmt.value_bits, codec.values)
  patched = word.decode(cache_MxR, rows_MxW[:, :fmt.words], fmt)
  return jnp.where(hit_M[:, None], patched, plain.astype(cache_MxR.dtype))


def slot_bytes(replica_expert_NxM, hit_NxM, num_experts: int, codec: ReplicaCodec):
  """[N, M] float32: bytes each slot's row carries on the ragged path (a patch, a plain expert,
  or nothing for an empty slot)."""
  filled = replica_expert_NxM < num_experts
  return jnp.where(hit_NxM, float(codec.patch_bytes),
                   jnp.where(filled, float(codec.plain_bytes), 0.0)).astype(jnp.float32)
