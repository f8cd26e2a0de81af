"""Triton kernels of the codec's encode and decode, and the launch plans that chain them.

No jax here: `ops` launches the plans through jax-triton on GPU, and the interpreter tests
(`TRITON_INTERPRET=1`, torch CPU tensors, an environment without jax) launch the very same plans
and compare with `host_reference`. Every size is a `tl.constexpr` (shapes are static anyway), so
a kernel's arguments are its buffers, in plan order, and keyword constants.

Encode, one shard (`encode_plan`), five launches:
  detect       value tiles  bits [N], prev [NP] -> exp [NP] u8, value flags [NP] u8,
                            changed values per tile [TV] i32
  block_flags  block tiles  value flags -> block flags [NB] u8, changed blocks per tile [TK] i32
  scan         1 program    tile counts -> exclusive offsets of the unit tiles [TU] i32,
                            totals [2] i32 (changed values, changed blocks)
  compact      unit tiles   unit flags, offsets -> slots [C] i32: slot k holds the index of the
                            k-th changed unit, for k < min(total, C) (the rest is never read)
  wire         word ranges  bits, block flags, slots, exp, totals -> wire [L] u32
Decode, W shards (`decode_plan`), one launch: `decode_element` or `decode_block` over
(tiles, W): each program patches a tile of one cached row (device d != me) or takes this
device's own exponents (d == me), then merges them with the unpacked sign+mantissa.

Packing follows `bits.pack_bits` (bit k of value i at bit i * width + k of the little-endian bit
string, 32 values per `width` words). Writers are word-centric: output word j of a group of 32
values ORs the (at most ceil(32 / width) + 1) values overlapping it. Readers unpack value i from
word (i * width) // 32 and, when it spills, the next word.

Element-mode patches hold strictly increasing positions followed by unused slots (position 0,
the sender's exponent 0), so key(k) = pos(k) if k == 0 or pos(k) > 0, else infinity, is
non-decreasing and a binary search finds the entries of a tile; the last slot, when unused,
supplies the value of position 0, as the reference's scatter of every slot does.

Letters: N values, NP cached exponents, NB blocks, B values per block, C capacity, W devices,
R = W - 1 cached rows, L wire words, TV/TK/TU tiles of values/blocks/units.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import triton
import triton.language as tl

from moejax.codec.kernels.geometry import Geometry

VALUE_TILE = 1024     # values per program in detect and in element-mode compact
BLOCK_ELEMS = 2048    # elements per program of a 2-D block tile
WORD_ELEMS = 2048     # (word, source) pairs per program of the wire writer
SCAN_CHUNK = 1024
DECODE_TILE = 256     # values per program in decode_element
ENTRY_CHUNK = 32      # patch entries matched against a tile at a time
POPC_CHUNK = 128      # bitmap words counted at a time


def next_pow2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


# ----------------------------------------------------------------------------------------------
# Device helpers.


@triton.jit
def _unpack_at(words_ptr, idx, mask, WIDTH: tl.constexpr):
  """Values number `idx` (any int shape) of a packed word array, as uint32; 0 where ~mask."""
  start = idx.to(tl.int64) * WIDTH
  off = (start & 31).to(tl.uint32)
  word = start >> 5
  lo = tl.load(words_ptr + word, mask=mask, other=0) >> off
  spill = mask & ((off + WIDTH) > 32)
  hsh = tl.where(spill, 32 - off, 0).to(tl.uint32)
  hi = tl.load(words_ptr + word + 1, mask=spill, other=0) << hsh
  v = lo | tl.where(spill, hi, 0)
  if WIDTH < 32:
    v = v & ((1 << WIDTH) - 1)
  return v


@triton.jit
def _word_sources(w, WIDTH: tl.constexpr, SP: tl.constexpr):
  """Output words `w` [M] (int64) -> for each, the values overlapping it [M, SP]: their indices,
  whether the pair is real, and the shifts (value >> rsh) << lsh that place them."""
  S: tl.constexpr = (32 + WIDTH - 1) // WIDTH + 1
  g = w // WIDTH
  j = w % WIDTH
  first = (32 * j) // WIDTH
  s = tl.arange(0, SP)
  val = first[:, None] + s[None, :]
  off = WIDTH * val - 32 * j[:, None]
  used = (s[None, :] < S) & (val < 32) & (off < 32)
  lsh = tl.where(used & (off > 0), off, 0).to(tl.uint32)
  rsh = tl.where(used & (off < 0), -off, 0).to(tl.uint32)
  return g[:, None] * 32 + val, used, lsh, rsh


@triton.jit
def _combine(v, used, lsh, rsh):
  """[M, SP] uint32 values (low WIDTH bits) -> [M] words. The placed bits are disjoint, so their
  sum is their OR (tl.sum: Triton's interpreter runs it natively, a custom OR value by value)."""
  part = tl.where(used, (v >> rsh) << lsh, 0)
  return tl.sum(part, axis=1)


@triton.jit
def _rest_of(x, MANT_BITS: tl.constexpr, TOTAL_BITS: tl.constexpr):
  """uint32 bit patterns -> sign and mantissa, sign bit just above the mantissa."""
  sign = x >> (TOTAL_BITS - 1)
  return (sign << MANT_BITS) | (x & ((1 << MANT_BITS) - 1))


@triton.jit
def _merge(exp, rest, EXP_BITS: tl.constexpr, MANT_BITS: tl.constexpr,
           TOTAL_BITS: tl.constexpr):
  e = exp.to(tl.uint32) & ((1 << EXP_BITS) - 1)
  sign = (rest >> MANT_BITS) & 1
  mant = rest & ((1 << MANT_BITS) - 1)
  return (sign << (TOTAL_BITS - 1)) | (e << MANT_BITS) | mant


@triton.jit
def _popc(x):
  """Set bits of each uint32, as int32."""
  x = x - ((x >> 1) & 0x55555555)
  x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
  x = (x + (x >> 4)) & 0x0F0F0F0F
  return ((x * 0x01010101) >> 24).to(tl.int32)


# ----------------------------------------------------------------------------------------------
# Encode.


@triton.jit
def detect_kernel(bits_ptr, prev_ptr, exp_ptr, vflag_ptr, vcount_ptr,
                  N: tl.constexpr, NP: tl.constexpr, EXP_BITS: tl.constexpr,
                  MANT_BITS: tl.constexpr, TILE: tl.constexpr):
  pid = tl.program_id(0)
  i = pid.to(tl.int64) * TILE + tl.arange(0, TILE)
  x = tl.load(bits_ptr + i, mask=i < N, other=0).to(tl.uint32)
  exp = ((x >> MANT_BITS) & ((1 << EXP_BITS) - 1)).to(tl.uint8)
  in_np = i < NP
  prev = tl.load(prev_ptr + i, mask=in_np, other=0)
  changed = (exp != prev) & in_np
  tl.store(exp_ptr + i, exp, mask=in_np)
  tl.store(vflag_ptr + i, changed.to(tl.uint8), mask=in_np)
  tl.store(vcount_ptr + pid, tl.sum(changed.to(tl.int32), axis=0))


@triton.jit
def block_flags_kernel(vflag_ptr, bflag_ptr, bcount_ptr,
                       NP: tl.constexpr, NB: tl.constexpr, B: tl.constexpr,
                       TB: tl.constexpr, BC: tl.constexpr):
  pid = tl.program_id(0)
  blk = pid * TB + tl.arange(0, TB)
  b = tl.arange(0, BC)
  any_TB = tl.zeros([TB], tl.int32)
  for c in tl.static_range(0, B, BC):
    i = blk[:, None].to(tl.int64) * B + c + b[None, :]
    m = (blk[:, None] < NB) & ((c + b[None, :]) < B) & (i < NP)
    f = tl.load(vflag_ptr + i, mask=m, other=0).to(tl.int32)
    any_TB = tl.maximum(any_TB, tl.max(f, axis=1))
  tl.store(bflag_ptr + blk, any_TB.to(tl.uint8), mask=blk < NB)
  tl.store(bcount_ptr + pid, tl.sum(any_TB, axis=0))


@triton.jit
def _exclusive_scan(count_ptr, offset_ptr, T: tl.constexpr, CHUNK: tl.constexpr,
                    WRITE: tl.constexpr):
  carry = tl.zeros([CHUNK], tl.int32)   # every lane holds the running total
  for start in range(0, T, CHUNK):
    t = start + tl.arange(0, CHUNK)
    c = tl.load(count_ptr + t, mask=t < T, other=0)
    if WRITE:
      tl.store(offset_ptr + t, carry + tl.cumsum(c, axis=0) - c, mask=t < T)
    carry = carry + tl.sum(c, axis=0)
  return tl.max(carry, axis=0)


@triton.jit
def scan_kernel(vcount_ptr, bcount_ptr, offset_ptr, total_ptr,
                TV: tl.constexpr, TK: tl.constexpr, BLOCK_UNITS: tl.constexpr,
                CHUNK: tl.constexpr):
  values = _exclusive_scan(vcount_ptr, offset_ptr, TV, CHUNK, not BLOCK_UNITS)
  blocks = _exclusive_scan(bcount_ptr, offset_ptr, TK, CHUNK, BLOCK_UNITS)
  tl.store(total_ptr, values)
  tl.store(total_ptr + 1, blocks)


@triton.jit
def compact_kernel(flag_ptr, offset_ptr, slot_ptr,
                   NU: tl.constexpr, C: tl.constexpr, TILE: tl.constexpr):
  pid = tl.program_id(0)
  base = tl.load(offset_ptr + pid)
  if base < C:   # tiles past the capacity have nothing to place
    u = pid * TILE + tl.arange(0, TILE)
    f = tl.load(flag_ptr + u, mask=u < NU, other=0).to(tl.int32)
    rank = base + tl.cumsum(f, axis=0) - f
    tl.store(slot_ptr + rank, u, mask=(f != 0) & (rank < C))


@triton.jit
def _write_rest(bits_ptr, wire_ptr, p, N: tl.constexpr, MANT_BITS: tl.constexpr,
                TOTAL_BITS: tl.constexpr, REST_BITS: tl.constexpr, REST_WORDS: tl.constexpr,
                SP: tl.constexpr, M: tl.constexpr):
  """Words [p * M, (p + 1) * M) of the packed sign+mantissa."""
  w = p.to(tl.int64) * M + tl.arange(0, M)
  idx, used, lsh, rsh = _word_sources(w, REST_BITS, SP)
  m = used & (idx < N)
  x = tl.load(bits_ptr + idx, mask=m, other=0).to(tl.uint32)
  word = _combine(_rest_of(x, MANT_BITS, TOTAL_BITS), m, lsh, rsh)
  tl.store(wire_ptr + w, word, mask=w < REST_WORDS)


@triton.jit
def _write_head(bflag_ptr, slot_ptr, head_ptr, p, used_units, NB: tl.constexpr,
                BLOCK_MODE: tl.constexpr, HEAD_BITS: tl.constexpr, HEAD_WORDS: tl.constexpr,
                SP: tl.constexpr, M: tl.constexpr):
  """Block mode: the bitmap of changed blocks. Element mode: the positions (unused slots 0)."""
  w = p.to(tl.int64) * M + tl.arange(0, M)
  idx, used, lsh, rsh = _word_sources(w, HEAD_BITS, SP)
  if BLOCK_MODE:
    m = used & (idx < NB)
    v = tl.load(bflag_ptr + idx, mask=m, other=0).to(tl.uint32)
  else:
    m = used & (idx < used_units)
    v = tl.load(slot_ptr + idx, mask=m, other=0).to(tl.uint32)
  tl.store(head_ptr + w, _combine(v, m, lsh, rsh), mask=w < HEAD_WORDS)


@triton.jit
def _write_tail(slot_ptr, exp_ptr, tail_ptr, p, used_units, B: tl.constexpr, C: tl.constexpr,
                BLOCK_MODE: tl.constexpr, EXP_BITS: tl.constexpr, TAIL_WORDS: tl.constexpr,
                SP: tl.constexpr, M: tl.constexpr):
  """Block mode: exponents of the first C changed blocks (unused slots zero). Element mode: the
  exponents at the positions (unused slots: the exponent at position 0)."""
  w = p.to(tl.int64) * M + tl.arange(0, M)
  idx, used, lsh, rsh = _word_sources(w, EXP_BITS, SP)
  if BLOCK_MODE:
    k = idx // B
    m = used & (idx < C * B) & (k < used_units)
    blk = tl.load(slot_ptr + k, mask=m, other=0).to(tl.int64)
    v = tl.load(exp_ptr + blk * B + idx % B, mask=m, other=0).to(tl.uint32)
  else:
    pos = tl.load(slot_ptr + idx, mask=used & (idx < used_units), other=0)
    m = used & (idx < C)
    v = tl.load(exp_ptr + pos, mask=m, other=0).to(tl.uint32)
  tl.store(tail_ptr + w, _combine(v, m, lsh, rsh), mask=w < TAIL_WORDS)


@triton.jit
def wire_kernel(bits_ptr, bflag_ptr, slot_ptr, exp_ptr, total_ptr, wire_ptr,
                N: tl.constexpr, NB: tl.constexpr, B: tl.constexpr, C: tl.constexpr,
                BLOCK_MODE: tl.constexpr, UNIT_INDEX: tl.constexpr, EXP_BITS: tl.constexpr,
                MANT_BITS: tl.constexpr, TOTAL_BITS: tl.constexpr, REST_BITS: tl.constexpr,
                HEAD_BITS: tl.constexpr, REST_WORDS: tl.constexpr, HEAD_WORDS: tl.constexpr,
                TAIL_WORDS: tl.constexpr, SP_REST: tl.constexpr, SP_HEAD: tl.constexpr,
                SP_TAIL: tl.constexpr, M_REST: tl.constexpr, M_HEAD: tl.constexpr,
                M_TAIL: tl.constexpr, P_REST: tl.constexpr, P_HEAD: tl.constexpr):
  """Programs [0, P_REST) write the rest words, the next P_HEAD the head, the others the tail."""
  pid = tl.program_id(0)
  used_units = tl.minimum(tl.load(total_ptr + UNIT_INDEX), C)
  if pid < P_REST:
    _write_rest(bits_ptr, wire_ptr, pid, N, MANT_BITS, TOTAL_BITS, REST_BITS, REST_WORDS,
                SP_REST, M_REST)
  elif pid < P_REST + P_HEAD:
    _write_head(bflag_ptr, slot_ptr, wire_ptr + REST_WORDS, pid - P_REST, used_units, NB,
                BLOCK_MODE, HEAD_BITS, HEAD_WORDS, SP_HEAD, M_HEAD)
  else:
    _write_tail(slot_ptr, exp_ptr, wire_ptr + REST_WORDS + HEAD_WORDS, pid - P_REST - P_HEAD,
                used_units, B, C, BLOCK_MODE, EXP_BITS, TAIL_WORDS, SP_TAIL, M_TAIL)


# ----------------------------------------------------------------------------------------------
# Decode.


@triton.jit
def _lower_bound(head_ptr, target, C: tl.constexpr, POS_BITS: tl.constexpr,
                 INF: tl.constexpr, STEPS: tl.constexpr):
  """For each target (int64 vector): the first slot k in [0, C] whose key is >= target (INF, the
  key of unused slots, exceeds every target)."""
  lo = tl.zeros_like(target)
  hi = tl.zeros_like(target) + C
  for _ in tl.static_range(STEPS):
    active = lo < hi
    mid = (lo + hi) // 2
    p = _unpack_at(head_ptr, mid, active, POS_BITS).to(tl.int64)
    key = tl.where((mid == 0) | (p > 0), p, INF)
    less = key < target
    lo = tl.where(active & less, mid + 1, lo)
    hi = tl.where(active & (~less), mid, hi)
  return lo


@triton.jit
def decode_element_kernel(cache_ptr, wire_ptr, own_ptr, me_ptr, bits_ptr, new_cache_ptr,
                          N: tl.constexpr, L: tl.constexpr, C: tl.constexpr,
                          REST_WORDS: tl.constexpr, HEAD_WORDS: tl.constexpr,
                          POS_BITS: tl.constexpr, EXP_BITS: tl.constexpr,
                          MANT_BITS: tl.constexpr, TOTAL_BITS: tl.constexpr,
                          REST_BITS: tl.constexpr, TILE: tl.constexpr, E: tl.constexpr,
                          STEPS: tl.constexpr):
  t = tl.program_id(0)
  d = tl.program_id(1)
  me = tl.load(me_ptr)
  t0 = t.to(tl.int64) * TILE
  i = t0 + tl.arange(0, TILE)
  m = i < N
  wire_d = wire_ptr + d.to(tl.int64) * L
  rest = _unpack_at(wire_d, i, m, REST_BITS)
  if d == me:
    exp = tl.load(own_ptr + i, mask=m, other=0)
  else:
    row = (d - (d > me).to(tl.int32)).to(tl.int64) * N
    exp = tl.load(cache_ptr + row + i, mask=m, other=0)
    head_ptr = wire_d + REST_WORDS
    tail_ptr = head_ptr + HEAD_WORDS
    bounds = _lower_bound(head_ptr, t0 + tl.arange(0, 2) * TILE, C, POS_BITS, N + TILE, STEPS)
    lo = tl.min(bounds, axis=0)
    hi = tl.max(bounds, axis=0)
    for e0 in range(lo, hi, E):   # the (at most TILE) entries inside the tile, E at a time
      k = e0 + tl.arange(0, E)
      km = k < hi
      pos = _unpack_at(head_ptr, k, km, POS_BITS).to(tl.int64)
      val = _unpack_at(tail_ptr, k, km, EXP_BITS).to(tl.uint8)
      hit = (i[:, None] == pos[None, :]) & km[None, :]
      new = tl.max(tl.where(hit, val[None, :], 0), axis=1).to(tl.uint8)
      exp = tl.where(tl.max(hit.to(tl.int32), axis=1) > 0, new, exp)
    if t == 0:   # an unused last slot writes the sender's exponent of position 0
      last = tl.zeros([1], tl.int64) + (C - 1)
      last_pos = _unpack_at(head_ptr, last, last >= 0, POS_BITS)
      last_val = _unpack_at(tail_ptr, last, last >= 0, EXP_BITS).to(tl.uint8)
      exp = tl.where((i == 0) & (last_pos == 0), last_val, exp)
    tl.store(new_cache_ptr + row + i, exp, mask=m)
  bits = _merge(exp, rest, EXP_BITS, MANT_BITS, TOTAL_BITS)
  tl.store(bits_ptr + d.to(tl.int64) * N + i, bits.to(bits_ptr.dtype.element_ty), mask=m)


@triton.jit
def _bits_before(words_ptr, nbits, CHUNK: tl.constexpr):
  """Set bits among the first `nbits` bits of a bitmap."""
  full = nbits // 32
  acc = tl.zeros([CHUNK], tl.int32)
  for s in range(0, full, CHUNK):
    j = s + tl.arange(0, CHUNK)
    acc += _popc(tl.load(words_ptr + j, mask=j < full, other=0))
  rem = (nbits % 32).to(tl.uint32)
  last = tl.load(words_ptr + full, mask=rem > 0, other=0)
  return tl.sum(acc, axis=0) + _popc(last & ((tl.full([], 1, tl.uint32) << rem) - 1))


@triton.jit
def decode_block_kernel(cache_ptr, wire_ptr, own_ptr, me_ptr, bits_ptr, new_cache_ptr,
                        N: tl.constexpr, NB: tl.constexpr, B: tl.constexpr, L: tl.constexpr,
                        C: tl.constexpr, REST_WORDS: tl.constexpr, HEAD_WORDS: tl.constexpr,
                        EXP_BITS: tl.constexpr, MANT_BITS: tl.constexpr,
                        TOTAL_BITS: tl.constexpr, REST_BITS: tl.constexpr,
                        TB: tl.constexpr, BC: tl.constexpr, POPC: tl.constexpr):
  """Grid (block tiles, W, chunks of a block): a [TB, BC] tile of (block, value in block)."""
  t = tl.program_id(0)
  d = tl.program_id(1)
  c = tl.program_id(2).to(tl.int64) * BC
  me = tl.load(me_ptr)
  NP: tl.constexpr = NB * B
  blk = t * TB + tl.arange(0, TB)
  b = c + tl.arange(0, BC)
  i = blk[:, None].to(tl.int64) * B + b[None, :]
  in_cache = (blk[:, None] < NB) & (b[None, :] < B)
  m = in_cache & (i < N)
  wire_d = wire_ptr + d.to(tl.int64) * L
  rest = _unpack_at(wire_d, i, m, REST_BITS)
  if d == me:
    exp = tl.load(own_ptr + i, mask=in_cache, other=0)
  else:
    row = (d - (d > me).to(tl.int32)).to(tl.int64) * NP
    exp = tl.load(cache_ptr + row + i, mask=in_cache, other=0)
    head_ptr = wire_d + REST_WORDS
    flag = _unpack_at(head_ptr, blk, blk < NB, 1).to(tl.int32)
    rank = _bits_before(head_ptr, t * TB, POPC) + tl.cumsum(flag, axis=0) - flag
    take = (flag != 0) & (rank < C)
    src = rank[:, None].to(tl.int64) * B + b[None, :]
    new = _unpack_at(head_ptr + HEAD_WORDS, src, take[:, None] & in_cache, EXP_BITS)
    exp = tl.where(take[:, None], new.to(tl.uint8), exp)
    tl.store(new_cache_ptr + row + i, exp, mask=in_cache)
  bits = _merge(exp, rest, EXP_BITS, MANT_BITS, TOTAL_BITS)
  tl.store(bits_ptr + d.to(tl.int64) * N + i, bits.to(bits_ptr.dtype.element_ty), mask=m)


# ----------------------------------------------------------------------------------------------
# Launch plans.


@dataclasses.dataclass(frozen=True)
class Launch:
  """One kernel launch: buffers by name (inputs, then outputs), grid and constants."""
  kernel: Any
  inputs: tuple[str, ...]
  outputs: tuple[tuple[str, tuple[int, ...], str], ...]   # (name, shape, dtype name)
  grid: tuple[int, ...]
  params: dict


def bits_dtype(g: Geometry) -> str:
  return "uint16" if g.total_bits == 16 else "uint32"


def _words_per_program(width: int) -> tuple[int, int]:
  """(SP, M): source slots per word and words per program of the wire writer."""
  sp = next_pow2((32 + width - 1) // width + 1)
  return sp, max(1, WORD_ELEMS // sp)


def _block_tile(b: int) -> tuple[int, int]:
  """(TB, BC): blocks per program and values of a block per step, TB * BC ~ BLOCK_ELEMS."""
  bc = min(next_pow2(b), BLOCK_ELEMS)
  return max(1, BLOCK_ELEMS // bc), bc


def encode_plan(g: Geometry) -> list[Launch]:
  """bits [N], prev [NP] -> exp [NP] u8, wire [L] u32, total [2] i32 (values, blocks)."""
  np_, nb, c = g.cache_width, g.num_blocks, g.capacity
  block_mode = g.mode == "block"
  tv = cdiv(np_, VALUE_TILE)
  tb, bc = _block_tile(g.block_size)
  tk = cdiv(nb, tb)
  unit_tile, tu = (tb, tk) if block_mode else (VALUE_TILE, tv)
  sp_rest, m_rest = _words_per_program(g.rest_bits)
  sp_head, m_head = _words_per_program(g.head_bits)
  sp_tail, m_tail = _words_per_program(g.exp_bits)
  p_rest, p_head = cdiv(g.rest_words, m_rest), cdiv(g.head_words, m_head)
  p_tail = cdiv(g.tail_words, m_tail)
  return [
      Launch(detect_kernel, ("bits", "prev"),
             (("exp", (np_,), "uint8"), ("vflag", (np_,), "uint8"), ("vcount", (tv,), "int32")),
             (tv,), dict(N=g.n, NP=np_, EXP_BITS=g.exp_bits, MANT_BITS=g.mant_bits,
                         TILE=VALUE_TILE)),
      Launch(block_flags_kernel, ("vflag",),
             (("bflag", (nb,), "uint8"), ("bcount", (tk,), "int32")),
             (tk,), dict(NP=np_, NB=nb, B=g.block_size, TB=tb, BC=bc)),
      Launch(scan_kernel, ("vcount", "bcount"),
             (("offset", (tu,), "int32"), ("total", (2,), "int32")),
             (1,), dict(TV=tv, TK=tk, BLOCK_UNITS=block_mode, CHUNK=SCAN_CHUNK)),
      Launch(compact_kernel, ("bflag" if block_mode else "vflag", "offset"),
             (("slots", (c,), "int32"),),
             (tu,), dict(NU=g.units, C=c, TILE=unit_tile)),
      Launch(wire_kernel, ("bits", "bflag", "slots", "exp", "total"),
             (("wire", (g.wire_words,), "uint32"),),
             (p_rest + p_head + p_tail,),
             dict(N=g.n, NB=nb, B=g.block_size, C=c, BLOCK_MODE=block_mode,
                  UNIT_INDEX=int(block_mode),
                  EXP_BITS=g.exp_bits, MANT_BITS=g.mant_bits, TOTAL_BITS=g.total_bits,
                  REST_BITS=g.rest_bits, HEAD_BITS=g.head_bits, REST_WORDS=g.rest_words,
                  HEAD_WORDS=g.head_words, TAIL_WORDS=g.tail_words, SP_REST=sp_rest,
                  SP_HEAD=sp_head, SP_TAIL=sp_tail, M_REST=m_rest, M_HEAD=m_head,
                  M_TAIL=m_tail, P_REST=p_rest, P_HEAD=p_head)),
  ]


def decode_plan(g: Geometry, w: int) -> list[Launch]:
  """cache [W-1, NP] u8, wire [W, L] u32, own [NP] u8, me [1] i32 -> bits [W, N],
  new_cache [W-1, NP] u8."""
  outputs = (("bits", (w, g.n), bits_dtype(g)), ("new_cache", (w - 1, g.cache_width), "uint8"))
  inputs = ("cache", "wire", "own", "me")
  common = dict(N=g.n, L=g.wire_words, C=g.capacity, REST_WORDS=g.rest_words,
                HEAD_WORDS=g.head_words, EXP_BITS=g.exp_bits, MANT_BITS=g.mant_bits,
                TOTAL_BITS=g.total_bits, REST_BITS=g.rest_bits)
  if g.mode == "element":
    return [Launch(decode_element_kernel, inputs, outputs, (cdiv(g.n, DECODE_TILE), w),
                   dict(common, POS_BITS=g.pos_bits, TILE=DECODE_TILE, E=ENTRY_CHUNK,
                        STEPS=g.capacity.bit_length() + 1))]
  tb, bc = _block_tile(g.block_size)
  return [Launch(decode_block_kernel, inputs, outputs,
                 (cdiv(g.num_blocks, tb), w, cdiv(g.block_size, bc)),
                 dict(common, NB=g.num_blocks, B=g.block_size, TB=tb, BC=bc, POPC=POPC_CHUNK))]
