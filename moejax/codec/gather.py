"""Lossless compressed all-gather that reuses what the receivers already hold.

`compressed_all_gather(shard, state, ...)` returns exactly (bit for bit) what
`lax.all_gather(shard, axis_name, axis=axis, tiled=True)` returns. Every device keeps a cache of
the other W-1 shards, and a sender ships only a patch of what changed since the previous gather.
Four modes:

* "element" / "block": exponent reuse. Each device splits its shard into exponents and
  sign+mantissa (`bits`). The sign+mantissa bits always travel, densely packed; exponents change
  rarely between steps, so the cache holds the other shards' exponents and the patch carries the
  changed ones (`detect`, `payload`): changed values with their positions ("element") or whole
  changed blocks behind a block bitmap ("block"). Encode (split, detect, patch; exact detection)
  and decode (patch, merge) are the ops of `kernels`: Triton kernels on GPU, jnp elsewhere.
* "word": whole-word deltas (`word`). The cache holds the other shards' full bit patterns and
  the patch carries a bitmap of changed values and the changed values. Nothing else travels, so
  a shard whose values rarely change as a whole (small learning rates) costs N bits plus its
  changes, against 8 bits per value for the exponent modes.
* "delta": the word cache, and a `delta_bits`-bit code per value instead of the bitmap: a value
  that moved by at most 2^(delta_bits-1) - 1 units in the last place (most of them, from one
  optimizer step to the next) costs only its code; the others ("escapes") carry their move in a
  byte, or travel whole when it exceeds 127 units (a second list with its own capacity).

Everything travels as uint32 words (see the payload below).

Dense path. The gather sends the plain bit patterns instead (one `all_gather`, as many bytes as
the uncompressed gather) and refills every cache when

* the state is not valid (the first gather after `init_state` or `invalidate`),
* fewer than `warmup_steps` gathers have run since `init_state` (early training changes too
  many exponents for patches to pay), or
* any device's changes exceed the patch capacity. This fallback is counted (`fallback`).

Devices agree on the path with one tiny `all_gather` of six int32 per device (flags for the
first two conditions above, and change counts: every device compares each device's counts with
the capacities, and they serve the stats too), issued before the payload; a condition on any
device sends everyone down the dense path. `compressed_all_gather_group` does
the same for several shards with one agreement collective for all of them, and sends its word
and delta shards of one code width and dtype as one pool: one patch of their concatenated
values with their capacities summed, one choice of path.

How the payload travels (`transport`, `TRANSPORTS`):
* "single" (GPU/TPU under "auto"): one collective for the whole group, on either path, in no
  conditional (a collective inside a conditional's branch could not overlap the layer compute
  outside it). Each pool's segment holds its patch or, on the dense path, its bit patterns,
  packed one after the other in a uint32 buffer sized for the larger of the two. The agreed
  flags are the same on every device, so every device sends the same number of words; on GPU
  one `ragged_all_to_all` moves just those words, rounded up to rows of `bits.CHUNK_WORDS` so
  that its int32 offsets count rows (`payload_all_gather`), on XLA:CPU an `all_gather` moves
  the whole buffer. Receivers decode each pool both ways and keep the agreed one.
* "cond" (XLA:CPU under "auto", whose collectives never overlap compute): a conditional per pool
  runs only the agreed path, its own collective inside; when no pool falls back, every pool's
  patch travels in one payload all-gather. Less work and fewer bytes on fake CPU devices.

Both paths are exact, so the output never depends on which one ran.

State (one per shard and device; a pytree of arrays, rebuilt rather than checkpointed):
  prev   the sender's previous exponents [N'] uint8 ("exact"), block hashes [NB, 4] uint32
         ("hash"), or bit patterns [N] (word/delta mode; uint16 for 16-bit floats)
  cache  [W-1, N'] the other shards' exponents (uint8), or bit patterns (word/delta), in device
         order, this device skipped
  step   int32 gathers since `init_state`, saturating at `warmup_steps`
  valid  bool, False until a dense gather has filled the caches
N' is N rounded up to whole blocks in block mode (of `detect.shard_block_size`: less than NB
values of padding) and N otherwise. Memory per device: (W-1) N'
bytes of cache plus N' ("exact") or 16 NB ("hash") bytes of sender state; word/delta W N times
the float's size. Each device holds its own state: under `shard_map` stack the states of the
devices along the gathered axis.

Gradients: `custom_vjp` whose backward reduce-scatters the cotangent of `full`
(`lax.psum_scatter(..., scatter_dimension=axis, tiled=True)`, the transpose of the plain gather),
in the dtype of the shard passed in (the fp32 master when `compute_dtype` casts it to bf16);
the state gets no cotangent. Under `jax.checkpoint` the forward is recomputed from the same
state, which gives the same result.

Byte accounting (stats, all float32/int32 scalars, identical on every device of the axis):
  bytes_plain      bytes each device contributes to the plain all-gather (N * itemsize)
  bytes_sent       bytes each device contributed to this call's collectives: the static buffer
                   capacity (not its fill), plus 24 bytes of the agreement collective
  bytes_needed     mean over devices of the bytes the data needed: packed sign+mantissa (not in
                   word/delta) plus the patch's content (bitmap or codes, changed blocks,
                   entries or values), or bytes_plain when the caches were not valid; can exceed the
                   capacity, which then falls back
  exponent_changes values whose exponent changed, summed over the axis (-1 with "hash": unknown)
  block_changes    blocks with a changed exponent, summed over the axis
  word_changes     values with any bit changed, summed over the axis (word/delta; -1 otherwise)
  capacity_fill    max over devices of changed units (escapes in delta mode) / capacity (> 1
                   means overflow)
  fallback         1 when an overflow forced the dense path (outside warm-up), else 0
  dense            1 when the dense path ran (for any reason), else 0
Counts are 0 when a state was not valid (there is nothing to compare against). A device's
traffic on a ring all-gather is (W-1) times its contribution; ratios are what the figures are for.

Letters: N values in a shard, W devices on the axis, NB blocks, B values per block, L wire words.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from moejax import profiling
from moejax.codec import bits
from moejax.codec import detect
from moejax.codec import kernels
from moejax.codec import payload
from moejax.codec import word

MODES = ("off", "block", "element", "word", "delta")
COMPRESSED_MODES = ("block", "element", "word", "delta")
WORD_MODES = ("word", "delta")   # receivers cache whole values (`moejax.codec.word`)
DETECTORS = ("exact", "hash")

# Patch capacity as a fraction of the shard's units (values in element mode, blocks in block
# mode), from measured change rates of bf16 copies of fp32 weights under AdamW (2-layer MLP and
# an embedding table, weights ~N(0, 0.02), 20-step linear warm-up then cosine decay, measured
# from gather 30 on). Fraction of values whose exponent changed per step: peak lr 3e-4: mean
# 1-2.4 %, max 4.8 %; peak lr 3e-5: about 0.7 %; lr 1e-3: max 11 % (falls back until the rate
# decays). Exponent changes are spread out, so whole blocks rarely stay unchanged: at lr 3e-4
# 85-100 % of 512-value blocks changed per step, and fewer than 25 % only near the end of the
# decay or at lr <= 3e-5 late in training. Element mode is the one that pays at usual learning
# rates; block mode pays for rarely updated parameters or late in training. Word mode pays only
# where whole values rarely change (fine-tuning learning rates, rarely used rows).
DEFAULT_CAPACITY_FRACTION = {"element": 1 / 16, "block": 1 / 4, "word": 1 / 4, "delta": 1 / 8}
DEFAULT_FAR_FRACTION = 1 / 64   # delta mode: whole values (moves beyond 127 units) a patch holds
STATS_WORDS = 6   # int32 per device in the agreement collective
# How a group's payload travels: one collective in no conditional ("single"), a conditional per
# pool ("cond"), or by platform ("auto": cond on XLA:CPU, single elsewhere).
TRANSPORTS = ("auto", "single", "cond")
_INVALID, _WARM = 1, 2   # bits of the agreed flags word


@dataclasses.dataclass(frozen=True)
class CodecSpec:
  """Static codec configuration (hashable: it is a static argument of the gather)."""
  mode: str                                # "off" | "block" | "element" | "word" | "delta"
  block_size: int = 512
  detect: str = "exact"                    # "exact" | "hash" (block mode only)
  capacity_fraction: float | None = None   # None: DEFAULT_CAPACITY_FRACTION[mode]
  warmup_steps: int = 30
  delta_bits: int = 3                      # delta mode: bits of each value's code
  far_fraction: float | None = None        # delta mode's far list; None: DEFAULT_FAR_FRACTION

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"CodecSpec.mode must be one of {MODES}, got {self.mode!r}")
    if self.detect not in DETECTORS:
      raise ValueError(f"CodecSpec.detect must be one of {DETECTORS}, got {self.detect!r}")
    if self.mode == "delta" and self.delta_bits not in word.DELTA_BITS:
      raise ValueError(f"CodecSpec.delta_bits must be one of {word.DELTA_BITS}, got "
                       f"{self.delta_bits!r}")
    if self.mode != "block" and self.detect == "hash":
      raise ValueError("CodecSpec.detect='hash' needs mode='block': block hashes tell which "
                       f"blocks changed, not which values, so mode={self.mode!r} needs 'exact'")
    if not isinstance(self.block_size, int) or self.block_size < 1:
      raise ValueError(f"CodecSpec.block_size must be an int >= 1, got {self.block_size!r}")
    if self.far_fraction is not None and not 0 < self.far_fraction <= 1:
      raise ValueError(f"CodecSpec.far_fraction must be in (0, 1] or None, got "
                       f"{self.far_fraction!r}")
    if self.capacity_fraction is not None and not 0 < self.capacity_fraction <= 1:
      raise ValueError("CodecSpec.capacity_fraction must be in (0, 1] or None, got "
                       f"{self.capacity_fraction!r}")
    if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
      raise ValueError(f"CodecSpec.warmup_steps must be an int >= 0, got {self.warmup_steps!r}")

  @property
  def rate_kind(self) -> str:
    """The change rate that sizes this spec's capacity: "element" (exponent changes), "block",
    "word" (any change) or "delta2".."delta4" (escapes at that code width)."""
    return f"delta{self.delta_bits}" if self.mode == "delta" else self.mode

  @property
  def capacity(self) -> float:
    """The capacity fraction in use."""
    if self.capacity_fraction is not None:
      return self.capacity_fraction
    return DEFAULT_CAPACITY_FRACTION.get(self.mode, 1.0)


def patch_format(shard_shape, dtype, spec: CodecSpec):
  """The static patch format of a shard: `payload.Format` for the exponent modes,
  `word.WordFormat` for word mode (none for mode 'off')."""
  if spec.mode == "off":
    raise ValueError("CodecSpec.mode='off' has no patch format")
  n = math.prod(shard_shape)
  layout = bits.layout_of(dtype)
  if spec.mode in WORD_MODES:
    if spec.mode == "word":
      return word.WordFormat.create(n, layout.total_bits, spec.capacity)
    return word.WordFormat.create(n, layout.total_bits, spec.capacity, spec.delta_bits,
                                  spec.far_fraction or DEFAULT_FAR_FRACTION)
  return payload.Format.create(spec.mode, n, layout.exp_bits, spec.block_size, spec.capacity)


def wire_bytes(shard_shape, dtype, spec: CodecSpec) -> dict:
  """Static per-device bytes of one gather: plain, compressed path, dense path, a forward gather
  whose patch fits (the compressed path, or the dense one where the patch would be no smaller:
  `_patch_is_no_smaller`), and a gather rebuilt from the state the same gather left
  (`rebuilt_gather_group`)."""
  n = math.prod(shard_shape)
  plain = n * np.dtype(dtype).itemsize
  if spec.mode == "off":
    return {"plain": plain, "compressed": plain, "dense": plain, "forward": plain,
            "rebuilt": plain}
  layout = bits.layout_of(dtype)
  words = patch_format(shard_shape, dtype, spec).words
  rest = 0 if spec.mode in WORD_MODES else bits.packed_words(n, layout.rest_bits)
  compressed, dense = 4 * (words + rest + STATS_WORDS), plain + 4 * STATS_WORDS
  dense_words = -(-n * np.dtype(dtype).itemsize // 4)
  return {"plain": plain, "compressed": compressed, "dense": dense,
          "forward": dense if words + rest >= dense_words else compressed, "rebuilt": 4 * rest}


def state_bytes(shard_shape, dtype, axis_size: int, spec: CodecSpec) -> int:
  """Bytes of one device's state for one shard (the arrays of `init_state`)."""
  if spec.mode == "off":
    return 0
  fmt = patch_format(shard_shape, dtype, spec)
  if spec.mode in WORD_MODES:
    return axis_size * fmt.n * np.dtype(dtype).itemsize + 4 + 1
  prev = fmt.cache_width if spec.detect == "exact" else 4 * detect.HASH_WORDS * fmt.num_blocks
  return (axis_size - 1) * fmt.cache_width + prev + 4 + 1


def init_state(shard_shape, dtype, axis_size: int, spec: CodecSpec) -> dict:
  """The state of one device for one shard, before the first gather ({} for mode 'off').
  `dtype` is the dtype that travels (the gather's compute_dtype)."""
  if spec.mode == "off":
    return {}
  if axis_size < 1:
    raise ValueError(f"axis_size must be >= 1, got {axis_size}")
  fmt = patch_format(shard_shape, dtype, spec)
  cached = bits.layout_of(dtype).uint_dtype if spec.mode in WORD_MODES else jnp.uint8
  if spec.detect == "exact":
    prev = jnp.zeros((fmt.cache_width,), cached)
  else:
    prev = jnp.zeros((fmt.num_blocks, detect.HASH_WORDS), jnp.uint32)
  return {"prev": prev,
          "cache": jnp.zeros((axis_size - 1, fmt.cache_width), cached),
          "step": jnp.zeros((), jnp.int32),
          "valid": jnp.zeros((), bool)}


def same_state(a: CodecSpec, b: CodecSpec) -> bool:
  """Whether a state built for spec `a` holds exactly what spec `b` needs (so a switch from `a`
  to `b` keeps the caches valid): the same mode and detector and, in block mode, block size; word
  and delta mode hold the same (whole values). The capacity and the warm-up count do not change
  what a state holds."""
  if a.mode in WORD_MODES and b.mode in WORD_MODES:
    return True
  return (a.mode == b.mode and a.detect == b.detect and a.mode != "off"
          and (a.mode != "block" or a.block_size == b.block_size))


def invalidate(state: dict) -> dict:
  """Mark caches stale (after a restore): the next gather sends everything. Works on stacked
  states too."""
  if not state:
    return state
  return {**state, "valid": jnp.zeros_like(state["valid"])}


def compressed_all_gather(shard: jax.Array, state: dict, *, axis_name, axis: int,
                          spec: CodecSpec, compute_dtype=None):
  """-> (full, new_state, stats).

  full == lax.all_gather(shard.astype(compute_dtype), axis_name, axis=axis, tiled=True), bit for
  bit; compute_dtype defaults to shard.dtype and is the dtype that travels (pass it to
  `init_state`). The backward reduce-scatters the cotangent in shard.dtype, so an fp32 master
  shard gathered as bf16 gets its gradient summed in fp32. Mode "off" has no compressed gather:
  the plain one is `moejax.sharding.hook.gather_leaf`. Call inside `shard_map` (or anything
  else that binds `axis_name`).
  """
  axis = _check_axis(shard, axis)
  if spec.mode == "off":
    raise ValueError("CodecSpec.mode='off' is the plain gather: use "
                     "moejax.sharding.hook.gather_leaf(shard, layout, None)")
  dtypes = (np.dtype(compute_dtype or shard.dtype), np.dtype(shard.dtype))
  return _codec_gather(shard, state, axis_name, axis, spec, dtypes)


def _check_axis(shard, axis: int) -> int:
  if shard.ndim == 0:
    raise ValueError("shard must have at least one dimension to gather along")
  if not -shard.ndim <= axis < shard.ndim:
    raise ValueError(f"axis must be in [{-shard.ndim}, {shard.ndim}), got {axis}")
  return axis % shard.ndim


def _stats(**kw) -> dict:
  # Change counts are float32: summed over devices they pass 2^31 (DeepSeek-V3's expert leaf
  # holds 3.8e9 values a layer), where int32 wrapped.
  ints = ("fallback", "dense")
  return {k: jnp.asarray(v, jnp.int32 if k in ints else jnp.float32) for k, v in kw.items()}


def _scatter_grad(ct_full, axis_name, axis, dtypes):
  """The VJP of the gather: reduce-scatter in the shard's own dtype."""
  ct = ct_full.astype(dtypes[1])
  return lax.psum_scatter(ct, axis_name, scatter_dimension=axis, tiled=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _codec_gather(shard, state, axis_name, axis, spec, dtypes):
  (full,), (new_state,), (stats,) = _forward_jit((shard.astype(dtypes[0]),), (state,), axis_name,
                                                 (axis,), (spec,), "auto")
  return full, new_state, stats


def _codec_gather_fwd(shard, state, axis_name, axis, spec, dtypes):
  return _codec_gather(shard, state, axis_name, axis, spec, dtypes), None


def _codec_gather_bwd(axis_name, axis, spec, dtypes, _, cotangents):
  del spec
  return _scatter_grad(cotangents[0], axis_name, axis, dtypes), None


_codec_gather.defvjp(_codec_gather_fwd, _codec_gather_bwd)


def tile(x_WxS: jax.Array, axis: int) -> jax.Array:
  """[W, *shard_shape] -> the W pieces concatenated along `axis` (what a tiled gather returns)."""
  shape = x_WxS.shape[1:]
  x = jnp.moveaxis(x_WxS, 0, axis)
  return x.reshape(shape[:axis] + (x_WxS.shape[0] * shape[axis],) + shape[axis + 1:])


def untile(full: jax.Array, axis: int, w: int) -> jax.Array:
  """The inverse of `tile`: [..., W * s, ...] along `axis` -> [W, *shard_shape]."""
  shape = full.shape
  return jnp.moveaxis(full.reshape(shape[:axis] + (w, shape[axis] // w) + shape[axis + 1:]),
                      axis, 0)


def _segment_sums(mask_N, bounds) -> jax.Array:
  """[K] int32: True entries of `mask_N` in each static [start, end) segment."""
  return jnp.stack([jnp.sum(mask_N[a:b], dtype=jnp.int32) for a, b in bounds])


def _send_exponents(bits_N, prev, spec: CodecSpec, fmt: payload.Format, layout: bits.Layout):
  """Exponent modes (one shard), sender side -> (new prev, own cache row, [1] exponent/block/
  word changes, [1] changed units, [1] far escapes (delta mode; 0 here), make_wire)."""
  one = lambda x: jnp.reshape(x, (1,)).astype(jnp.int32)   # noqa: E731
  n, width = fmt.n, fmt.cache_width
  if spec.detect == "exact":   # split + detect + patch in one op (Triton kernels on GPU)
    enc = kernels.encode(bits_N, prev, fmt, layout)
    return (enc.exp, enc.exp, one(enc.value_changes), one(enc.block_changes), one(-1),
            one(enc.count(fmt)), one(0), lambda: enc.wire)
  # block hashes (block mode only), in jnp
  exp_N, rest_N = bits.split_bits(bits_N, layout)
  exp_Np = jnp.pad(exp_N, (0, width - n))
  new_prev = detect.block_hashes(exp_N, fmt.block_size)
  blocks_changed_NB = detect.changed_blocks_hashed(new_prev, prev)
  block_changes = jnp.sum(blocks_changed_NB, dtype=jnp.int32)

  def make_wire():
    patch_P, _ = payload.encode(exp_Np, blocks_changed_NB, fmt)
    return jnp.concatenate([bits.pack_bits(rest_N, layout.rest_bits), patch_P])

  return (new_prev, exp_Np, one(-1), one(block_changes), one(-1), one(block_changes), one(0),
          make_wire)


def _send_words(bits_N, prev_N, specs, fmt: word.WordFormat, layout: bits.Layout, bounds):
  """Word and delta mode, sender side of a pool of K shards whose bit patterns are concatenated
  (shard k at bounds[k]): same results as `_send_exponents`, the counts per shard (the changed
  units are the escaped values)."""
  changed_N = word.changed(bits_N, prev_N)
  # Computed once here; the compressed branch builds its patch from them.
  d_N = word.key_delta(bits_N, prev_N, fmt.value_bits) if fmt.code_bits > 1 else None
  codes_N = word.codes(bits_N, prev_N, fmt, d_N)
  exp_N, _ = bits.split_bits(bits_N, layout)
  prev_exp_N, _ = bits.split_bits(prev_N, layout)
  exp_changed_N = detect.changed_values(exp_N, prev_exp_N)
  block_changes_K = jnp.stack([
      jnp.sum(jnp.any(detect.block_view(exp_changed_N[a:b],
                                        detect.shard_block_size(b - a, spec.block_size)), axis=1),
              dtype=jnp.int32) for (a, b), spec in zip(bounds, specs)])
  escaped = [word.escapes(codes_N[a:b], fmt, None if d_N is None else d_N[a:b])
             for a, b in bounds]
  return (bits_N, bits_N, _segment_sums(exp_changed_N, bounds), block_changes_K,
          _segment_sums(changed_N, bounds), jnp.stack([e for e, _ in escaped]),
          jnp.stack([f for _, f in escaped]),
          lambda: word.encode(bits_N, codes_N, fmt, d_N)[0])


def compressed_all_gather_group(shards, states, *, axis_name, axes, specs, transport="auto"):
  """The forward of `compressed_all_gather` for several shards at once (one gather group: a
  layer's compressed parameters), without a VJP, for a caller that owns the gradient
  (`moejax.sharding.hook.gather_leaves`). -> (fulls, new_states, stats), tuples in order.

  Shards arrive in the dtype that travels. The group shares one agreement collective (six int32
  per shard and device). Shards in word or delta mode of one code width and dtype travel as one
  pool: their bit patterns concatenated into one patch whose capacities are the sum of theirs
  (so a shard over its own capacity rides on the others' room), one encode, one payload
  collective and one decode for all of them, and one dense / compressed choice (the pool falls
  back together when its escapes exceed the pooled capacity on some device). The patch is padded
  to the sum of the shards' own patch sizes, so every shard's byte figures are those of
  `wire_bytes`. Exponent-mode shards (their positions would need more bits in a pool) each keep
  their own patch and choice. `transport`: how the pools' payloads travel (`TRANSPORTS`)."""
  if transport not in TRANSPORTS:
    raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
  return _forward_jit(tuple(shards), tuple(states), axis_name, tuple(axes), tuple(specs),
                      transport)


def pools_of(shapes_dtypes, specs) -> list[list[int]]:
  """The static pools of a group: indices of shards that travel as one patch (word or delta
  mode of one code width and dtype), every other shard alone; in order of first member."""
  pools = {}
  for k, ((_, dtype), spec) in enumerate(zip(shapes_dtypes, specs)):
    key = ((spec.mode, spec.delta_bits if spec.mode == "delta" else 1, np.dtype(dtype).name)
           if spec.mode in WORD_MODES else k)
    pools.setdefault(key, []).append(k)
  return list(pools.values())


def _pool_format(fmts):
  """One word/delta format for the concatenation of shards of these formats."""
  if len(fmts) == 1:
    return fmts[0]
  return word.WordFormat(sum(f.n for f in fmts), fmts[0].value_bits,
                         sum(f.capacity for f in fmts), fmts[0].code_bits,
                         sum(f.far_capacity for f in fmts))


@profiling.scoped("codec_encode")
def _sender(shards, states, axis_name, specs):
  """One pool's sender side and static formats -> dict (see `_send_exponents`)."""
  layout = bits.layout_of(shards[0].dtype)
  fmts = [patch_format(x.shape, x.dtype, spec) for x, spec in zip(shards, specs)]
  w = lax.axis_size(axis_name)
  for x, state, fmt in zip(shards, states, fmts):
    if state["cache"].shape != (w - 1, fmt.cache_width):
      raise ValueError(f"state cache has shape {state['cache'].shape}, expected "
                       f"{(w - 1, fmt.cache_width)} for a shard of {x.shape} on an axis of "
                       f"{w} devices")
  words = specs[0].mode in WORD_MODES
  concat = lambda xs, axis=0: xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=axis)  # noqa
  bits_N = concat([lax.bitcast_convert_type(x, layout.uint_dtype).reshape(f.n)
                   for x, f in zip(shards, fmts)])
  offsets = np.cumsum([0] + [f.n for f in fmts]).tolist()
  bounds = list(zip(offsets[:-1], offsets[1:]))
  fmt = _pool_format(fmts)
  if words:
    sent = _send_words(bits_N, concat([st["prev"] for st in states]), specs, fmt, layout, bounds)
  else:
    sent = _send_exponents(bits_N, states[0]["prev"], specs[0], fmt, layout)
  new_prev, own, exponent_changes, block_changes, word_changes, count, far, make_wire = sent
  flags = jnp.stack([jnp.logical_not(st["valid"]).astype(jnp.int32) * _INVALID
                     + (st["step"] < spec.warmup_steps).astype(jnp.int32) * _WARM
                     for st, spec in zip(states, specs)])
  local_Kx6 = jnp.stack([flags, exponent_changes, block_changes, word_changes, count, far], axis=1)
  wire_words = sum(f.words for f in fmts) if words else fmt.words

  def wire():
    return _pad_to(make_wire(), wire_words)

  return dict(layout=layout, fmt=fmt, fmts=fmts, words=words, bits_N=bits_N, new_prev=new_prev,
              own=own, make_wire=wire, local_Kx6=local_Kx6, bounds=bounds,
              caches=[st["cache"] for st in states])


def _forward(shards, states, axis_name, axes, specs, transport="auto"):
  w = lax.axis_size(axis_name)
  me = lax.axis_index(axis_name)
  pools = pools_of([(x.shape, x.dtype) for x in shards], specs)
  send = [_sender([shards[k] for k in pool], [states[k] for k in pool], axis_name,
                  [specs[k] for k in pool]) for pool in pools]

  # Agreement: one tiny collective of every shard's flags and counts. Every device decides from
  # the same gathered flags, so all take the same path for a pool even if their states
  # disagreed. A pool overflows when some device's escapes (changed units) exceed its capacity.
  order = [k for pool in pools for k in pool]
  all_WxKx6 = lax.all_gather(jnp.concatenate([s["local_Kx6"] for s in send]), axis_name)
  if order != sorted(order):
    all_WxKx6 = jnp.take(all_WxKx6, np.argsort(order), axis=1)    # back in shard order
  invalid_K, warm_K = (jnp.any((all_WxKx6[:, :, 0] & f) != 0, axis=0) for f in (_INVALID, _WARM))
  pool_fill, pool_overflow = [], []
  for pool, s in zip(pools, send):
    count_W, far_W = (jnp.sum(all_WxKx6[:, pool, i], axis=1) for i in (4, 5))
    fill = jnp.max(count_W) / np.float32(s["fmt"].capacity)
    over = jnp.any(count_W > s["fmt"].capacity)
    if s["words"] and s["fmt"].far_capacity:
      fill = jnp.maximum(fill, jnp.max(far_W) / np.float32(s["fmt"].far_capacity))
      over = over | jnp.any(far_W > s["fmt"].far_capacity)
    pool_fill.append(fill)
    pool_overflow.append(over)
  dense_P = [pool_overflow[p] | jnp.any(jnp.stack([invalid_K[k] | warm_K[k] for k in pool]))
             | _patch_is_no_smaller(s) for p, (pool, s) in enumerate(zip(pools, send))]

  # Receivers: row r of the cache is device r + (r >= me). Rows are picked by selects, not by
  # gathers of rows: XLA:CPU gathers element by element.
  def others(x_WxN):
    """[W, ...] -> [W-1, ...]: every device's row but this one's, in device order."""
    r = lax.broadcasted_iota(jnp.int32, (w - 1,) + x_WxN.shape[1:], 0)
    return jnp.where(r < me, x_WxN[:-1], x_WxN[1:])

  def with_own(cache_RxN, own_N):
    return _with_own(cache_RxN, own_N, me)

  def dense_from(s, bits_WxN):
    """The dense path's result from every device's bit patterns [W, N] of the pool -> [(bits
    [W, N_k], new cache [R, N'_k]) per shard of the pool]."""
    out = []
    for (a, b), fmt in zip(s["bounds"], s["fmts"]):
      bits_k = bits_WxN if len(s["fmts"]) == 1 else bits_WxN[:, a:b]
      others_RxN = others(bits_k)
      if not s["words"]:
        exp_RxN, _ = bits.split_bits(others_RxN, s["layout"])
        others_RxN = jnp.pad(exp_RxN, ((0, 0), (0, fmt.cache_width - fmt.n)))
      out.append((bits_k, others_RxN))
    return out

  @profiling.scoped("codec_decode")
  def compressed_from(s, wire_WxL):
    if not s["words"]:   # patch + merge in one op (Triton kernel on GPU)
      return [kernels.decode(s["caches"][0], wire_WxL, s["own"], me, s["fmt"], s["layout"])]
    patches_RxP = others(wire_WxL[:, :s["fmt"].words])
    caches = word.decode_pool(s["caches"], patches_RxP, s["fmt"], s["bounds"])
    return [(with_own(cache_RxN, s["bits_N"][a:b]), cache_RxN)
            for cache_RxN, (a, b) in zip(caches, s["bounds"])]

  def by_payload():
    """GPU/TPU: one payload collective for the group, in no conditional (a collective inside a
    branch could not overlap the compute outside it): each pool sends its patch or, where the
    agreed flag says dense, its bit patterns (two per uint32 word), packed one after the other.
    The flags are the same on every device, so every device sends the same number of words, and
    `payload_all_gather` moves just those. Receivers decode each pool both ways and keep the
    agreed one."""
    wires = [s["make_wire"]() for s in send]
    dense_words = [_to_words(s["bits_N"]) for s in send]
    seg = [max(x.shape[0], d.shape[0]) for x, d in zip(wires, dense_words)]
    sizes = [jnp.where(dense_P[p], d.shape[0], x.shape[0]).astype(jnp.int32)
             for p, (x, d) in enumerate(zip(wires, dense_words))]
    starts = [jnp.int32(0)]
    for size in sizes[:-1]:
      starts.append(starts[-1] + size)
    send_R = jnp.zeros((sum(seg),), jnp.uint32)
    for p in range(len(send)):   # in order: each pool overwrites the unused tail of the last
      piece = jnp.where(dense_P[p], _pad_to(dense_words[p], seg[p]), _pad_to(wires[p], seg[p]))
      send_R = lax.dynamic_update_slice(send_R, piece, (starts[p],))
    recv_WxR = payload_all_gather(send_R, starts[-1] + sizes[-1], axis_name)
    gathered = []
    for p, s in enumerate(send):
      seg_WxM = lax.dynamic_slice_in_dim(recv_WxR, starts[p], seg[p], axis=1)
      n = s["bits_N"].shape[0]
      dense = dense_from(s, _from_words(seg_WxM[:, :dense_words[p].shape[0]], n,
                                        s["bits_N"].dtype))
      # a dense pool's words are no patch: the decoder sees an empty one instead
      wire_WxL = jnp.where(dense_P[p], jnp.uint32(0), seg_WxM[:, :wires[p].shape[0]])
      # Materialized once each: fused into both selects (bits and cache), a decode would run
      # twice.
      dense, coded = lax.optimization_barrier((dense, compressed_from(s, wire_WxL)))
      gathered.append([tuple(jnp.where(dense_P[p], d, c) for d, c in zip(dk, ck))
                       for dk, ck in zip(dense, coded)])
    return gathered

  def by_cond():
    """XLA:CPU, where no collective overlaps compute (its collectives are synchronous): a
    conditional per pool runs only the agreed path, its own collective inside; when no pool
    falls back, every pool's patch travels in one payload all_gather."""
    def dense_path(s):
      return dense_from(s, lax.all_gather(s["bits_N"], axis_name))

    def per_pool():
      return [lax.cond(dense_P[p], lambda s=s: dense_path(s),
                       lambda s=s: compressed_from(s, lax.all_gather(s["make_wire"](),
                                                                     axis_name)))
              for p, s in enumerate(send)]

    def all_compressed():
      wires = [s["make_wire"]() for s in send]
      wire_WxL = lax.all_gather(jnp.concatenate(wires), axis_name)
      ends = np.cumsum([x.shape[0] for x in wires]).tolist()
      return [compressed_from(s, wire_WxL[:, a:b])
              for s, a, b in zip(send, [0] + ends[:-1], ends)]

    if len(send) > 1:
      return lax.cond(jnp.any(jnp.stack(dense_P)), per_pool, all_compressed)
    return per_pool()

  if transport == "single":
    gathered = by_payload()
  elif transport == "cond":
    gathered = by_cond()
  else:
    gathered = lax.platform_dependent(cpu=by_cond, default=by_payload)

  fulls, new_states, stats = [None] * len(shards), [None] * len(shards), [None] * len(shards)
  for p, (pool, s) in enumerate(zip(pools, send)):
    layout, words = s["layout"], s["words"]
    for k, (a, b), fmt, (bits_k, cache_k) in zip(pool, s["bounds"], s["fmts"], gathered[p]):
      shard, state, spec = shards[k], states[k], specs[k]
      prev_k = s["new_prev"][a:b] if len(pool) > 1 else s["new_prev"]
      fulls[k] = tile(lax.bitcast_convert_type(bits_k, layout.dtype).reshape((w,) + shard.shape),
                      axes[k])
      new_states[k] = {"prev": prev_k, "cache": cache_k,
                       "step": jnp.minimum(state["step"] + 1, spec.warmup_steps).astype(jnp.int32),
                       "valid": jnp.ones_like(state["valid"])}
      # Summed over devices in float32: int32 sums wrapped past 2^31 (DeepSeek-V3's expert leaf).
      total_6 = jnp.sum(all_WxKx6[:, k].astype(jnp.float32), axis=0)
      valid = jnp.logical_not(invalid_K[k])
      sizes = {k: np.float32(v) for k, v in wire_bytes(shard.shape, shard.dtype, spec).items()}
      mean_count, mean_far = total_6[4] / w, total_6[5] / w
      # the shard's bit counts as Python floats: past 2^31 at DeepSeek-V3's expert shards
      needed = ((0.0 if words else float(fmt.n * layout.rest_bits))
                + (fmt.fill_bits(mean_count, mean_far) if words else fmt.fill_bits(mean_count))) / 8
      stats[k] = _stats(
          bytes_sent=jnp.where(dense_P[p], sizes["dense"], sizes["compressed"]),
          bytes_plain=sizes["plain"],
          bytes_needed=jnp.where(valid, needed, sizes["plain"]),
          exponent_changes=(jnp.where(valid, total_6[1], 0) if spec.detect == "exact" else -1),
          block_changes=jnp.where(valid, total_6[2], 0),
          word_changes=jnp.where(valid, total_6[3], 0) if words else -1,
          capacity_fill=jnp.where(valid, pool_fill[p], 0.0),
          fallback=pool_overflow[p] & valid & jnp.logical_not(warm_K[k]),
          dense=dense_P[p])
  return tuple(fulls), tuple(new_states), tuple(stats)


def _patch_is_no_smaller(s) -> bool:
  """Whether a pool's patch (static size) is at least its dense payload: then it always goes
  dense, which leaves the same caches (so the backward's rebuild still holds) for fewer bytes.
  Specs sized for change rates near 1 get there (word mode at capacity 1.0 sends 4 B per value's
  slot against 2 B plain), and shards of a few values in any mode."""
  return jax.eval_shape(s["make_wire"]).shape[0] >= _to_words(s["bits_N"]).shape[0]


def _to_words(bits_N: jax.Array) -> jax.Array:
  """uint16 [N] -> uint32 [ceil(N / 2)] (two per word, the last padded with zeros); uint32
  passes through."""
  if bits_N.dtype == jnp.uint32:
    return bits_N
  n = bits_N.shape[0]
  pairs = jnp.pad(bits_N, (0, n % 2)).reshape(-1, 2)
  return lax.bitcast_convert_type(pairs, jnp.uint32)


def _from_words(words_WxL: jax.Array, n: int, dtype) -> jax.Array:
  """The inverse of `_to_words` on every row: uint32 [W, L] -> `dtype` [W, n]."""
  if jnp.dtype(dtype) == jnp.uint32:
    return words_WxL[:, :n]
  w = words_WxL.shape[0]
  halves = lax.bitcast_convert_type(words_WxL, jnp.uint16).reshape(w, -1)
  return halves[:, :n]


def _pad_to(x_L: jax.Array, size: int) -> jax.Array:
  return x_L if x_L.shape[0] >= size else jnp.pad(x_L, (0, size - x_L.shape[0]))


def payload_all_gather(send_R: jax.Array, used: jax.Array, axis_name) -> jax.Array:
  """Every device's uint32 [R] payload -> [W, R], of which only the first `used` words of each
  row are defined (`used` is the same on every device). XLA:CPU: an all_gather of the whole
  buffer. GPU/TPU: one `ragged_all_to_all` that sends the `used` words (rounded up to whole
  `bits.CHUNK_WORDS` rows) to every device, so the bytes moved are the payload's, not the
  buffer's."""
  def static(send_R, used):
    del used
    return lax.all_gather(send_R, axis_name)

  return lax.platform_dependent(send_R, used, cpu=static,
                                default=functools.partial(ragged_payload_all_gather,
                                                          axis_name=axis_name))


def ragged_payload_all_gather(send_R: jax.Array, used: jax.Array, axis_name) -> jax.Array:
  """`payload_all_gather` on GPU/TPU: one `ragged_all_to_all` of the used words' chunks."""
  r = send_R.shape[0]
  w, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
  rows, size_W, offset_W = ragged_payload_plan(r, used, me, w)
  chunks = jnp.pad(send_R, (0, rows * bits.CHUNK_WORDS - r)).reshape(rows, bits.CHUNK_WORDS)
  out = lax.ragged_all_to_all(chunks, jnp.zeros((w * rows, bits.CHUNK_WORDS), jnp.uint32),
                              jnp.zeros((w,), jnp.int32), size_W, offset_W, size_W,
                              axis_name=axis_name)
  return out.reshape(w, rows * bits.CHUNK_WORDS)[:, :r]


def ragged_payload_plan(r: int, used, me, w: int):
  """(rows of one device's [R]-word payload, int32 [W] rows sent to each device, int32 [W]
  row where this device's payload lands on each): `payload_all_gather`'s ragged exchange, in
  rows of `bits.CHUNK_WORDS` words."""
  rows = bits.chunks(r)
  size_W = jnp.full((w,), bits.chunks(jnp.asarray(used, jnp.int32)), jnp.int32)
  return rows, size_W, jnp.full((w,), me * rows, jnp.int32)


def _with_own(cache_RxN, own_N, me):
  """The W-1 cached rows of the other devices and this device's own -> [W, N] in device
  order (row r of the cache is device r + (r >= me)); selects, not gathers of rows."""
  w = cache_RxN.shape[0] + 1
  d = lax.broadcasted_iota(jnp.int32, (w,) + own_N.shape, 0)
  own = jnp.broadcast_to(own_N[None], (1,) + own_N.shape)
  return jnp.where(d < me, jnp.concatenate([cache_RxN, own]),
                   jnp.where(d == me, own, jnp.concatenate([own, cache_RxN])))


def rebuilt_gather_group(shards, states, *, axis_name, axes, specs) -> tuple:
  """What the compressed gathers of `shards` that left `states` returned, again, for a gather
  run a second time on the same shards (the backward's re-gather under remat,
  `moejax.sharding.prefetch`), whose new states are at hand. Word and delta caches hold every
  other device's bit patterns: rebuilt locally, no collective. Element and block caches hold
  the others' exponents: only the sign+mantissa bits travel, one all_gather for all those shards
  (`wire_bytes(...)["rebuilt"]` each), then merged; no encode, no patch."""
  w, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
  fulls, rests = [None] * len(shards), []
  for k, (shard, state, spec) in enumerate(zip(shards, states, specs)):
    layout = bits.layout_of(shard.dtype)
    fmt = patch_format(shard.shape, shard.dtype, spec)
    bits_N = lax.bitcast_convert_type(shard, layout.uint_dtype).reshape(fmt.n)
    if spec.mode in WORD_MODES:
      fulls[k] = _with_own(state["cache"], bits_N, me)
    else:
      exp_N, rest_N = bits.split_bits(bits_N, layout)
      rests.append((k, exp_N, bits.pack_bits(rest_N, layout.rest_bits)))
  if rests:
    words_WxL = lax.all_gather(jnp.concatenate([packed for _, _, packed in rests]), axis_name)
    start = 0
    for k, exp_N, packed in rests:
      layout, n = bits.layout_of(shards[k].dtype), exp_N.shape[0]
      rest_WxN = bits.unpack_bits(words_WxL[:, start:start + packed.shape[0]],
                                  layout.rest_bits, n)
      exp_WxN = _with_own(states[k]["cache"][:, :n], exp_N, me)
      fulls[k] = bits.merge_bits(exp_WxN, rest_WxN, layout)
      start += packed.shape[0]
  return tuple(
      tile(lax.bitcast_convert_type(bits_WxN, bits.layout_of(x.dtype).dtype).reshape(
          (w,) + x.shape), axis) for bits_WxN, x, axis in zip(fulls, shards, axes))


def codec_work(shard, state, *, axis_size: int, spec: CodecSpec):
  """What one compressed gather computes on one device, without its collectives: the sender's
  encode of `shard` (bf16) and the receiver's decode of W-1 patches (this device's own wire in
  every row) into the cache. For timing the codec's work (`train.codec_control.profile_codec`);
  the output is not a gather's."""
  layout = bits.layout_of(shard.dtype)
  fmt = patch_format(shard.shape, shard.dtype, spec)
  bits_N = lax.bitcast_convert_type(shard, layout.uint_dtype).reshape(fmt.n)
  words = spec.mode in WORD_MODES
  if words:
    _, own, *_, make_wire = _send_words(bits_N, state["prev"], [spec], fmt, layout,
                                        [(0, fmt.n)])
  else:
    _, own, *_, make_wire = _send_exponents(bits_N, state["prev"], spec, fmt, layout)
  wire_L = make_wire()
  wire_WxL = jnp.broadcast_to(wire_L[None], (axis_size,) + wire_L.shape)
  if words:
    return word.decode(state["cache"], wire_WxL[1:], fmt)
  return kernels.decode(state["cache"], wire_WxL, own, jnp.int32(0), fmt, layout)


# A nested jit: a model gathers the same group of shards several times (each layer's gather
# traced again for prefetch and for the backward re-gather), and a jit is traced and lowered
# once per signature, which keeps tracing time flat.
_forward_jit = jax.jit(_forward, static_argnums=(2, 3, 4, 5))
