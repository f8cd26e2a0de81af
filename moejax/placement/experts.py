"""SwiGLU experts as grouped matmuls, the implementation chosen per platform.

Letters: A rows (token-expert assignments), D model width, F expert hidden width, G experts held
here, Tl row tiles, M rows per tile. Rows must be sorted by expert; `group_sizes_G` says how many
rows each expert takes; rows past the sum of the group sizes come out as zeros.

  Hopper   jax's Pallas Mosaic GPU grouped matmuls (`hopper.py`): XLA:GPU rewrites
           `ragged_dot` into a dense dot over every expert (64 GiB for one OLMoE-1B-7B layer's
           operand at batch 8 x 4096 on an H200), so on compute capability 9.x, for 16-bit
           floats, the kernels jax ships for it run instead (D and F zero-padded to multiples
           of 128 where they are not).
  GPU/TPU  otherwise `lax.ragged_dot`: the backend's grouped matmul.
  CPU      row tiles: XLA:CPU lowers `ragged_dot` to a dense matmul over every expert, masked
           (G times the routed work, measured 7-10x slower at G=8 and growing with G). Here
           each expert's rows are padded to whole tiles of M rows, every tile belongs to one
           expert; one batched matmul over the tiles (each tile's weights taken) or a loop
           over the tiles that hold rows (a dynamic trip count; weights read in place; gate
           and up as one product; a hand-written backward of the same loop) runs each against
           its expert's weights. Static shapes: at most A/M + G tiles, so the padding costs at
           most G*M rows. The batched matmul runs over every tile, so rows that are an exchange
           buffer's empty slots (`packed=False`) always take the loop, which skips them.

What an expert computes is an `ExpertFn`: SwiGLU, or gpt-oss's clamped SwiGLU, with or without
per-expert biases. The weights travel as one tuple with the expert axis first,
(w_gate, w_up, w_down) or, with biases, (w_gate, w_up, w_down, b_gate, b_up, b_down): every
placement moves, gathers and reduces them alike; every kernel takes every function (Hopper's
with widths zero-padded to its tiles where they are not multiples, as gpt-oss's 2880).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# ACTIVATIONS, SWIGLU and ExpertFn are part of this module's interface too
from moejax.placement.expert_fn import (ACTIVATIONS, SWIGLU, ExpertFn, act_grads,  # noqa: F401
                                        check_weights, row_groups)

# Which CPU kernel for packed rows (every row routed), by the mean rows per expert (measured in
# the train step, bench/step.py): from BATCHED_FROM rows up, one batched matmul over all tiles
# with each tile's weights taken first (tiles of 128 rows: the copy is 1/128 of the work; peer
# dims on one device 0.377 vs 0.432 s a step for the loop); below it, the loop over tiles
# reading weights in place (1.36 vs 1.61 s at 512 rows).
BATCHED_FROM = 256


def _batched_kernel(num_rows: int, num_groups: int, packed: bool) -> bool:
  return packed and num_rows // max(1, num_groups) >= BATCHED_FROM


def tile_rows(num_rows: int, num_groups: int, packed: bool = True) -> int:
  """M for the CPU kernel: 128 for the batched one; for the loop the largest power of two at
  most the mean rows per expert, 16 to 128 (the loop's cost is per operation more than per flop,
  so larger tiles run faster until their padding outweighs it). Measured, fwd+bwd CPU ms per
  call (`python bench/step.py --tiles`): peer dims on 8 devices (512 rows, 8 experts) M=32 38.5,
  64 32.0, 128 36.9; tiny dims at 2048 rows over 128 experts M=16 6.4, 32 6.9; an exchange
  buffer of 4096 rows holding 512 for one expert M=32 24.8, 128 15.9 (the batched kernel over
  the whole buffer: 128)."""
  if _batched_kernel(num_rows, num_groups, packed):
    return 128
  mean = max(1, num_rows // max(1, num_groups))
  return int(min(128, max(16, 1 << (mean.bit_length() - 1))))


def _ragged_swiglu(x_AxD, group_sizes_G, ws, fn: ExpertFn = SWIGLU):
  dtype = x_AxD.dtype
  w_gate_GxDxF, w_up_GxDxF, w_down_GxFxD = ws[:3]
  gate_AxF = lax.ragged_dot(x_AxD, w_gate_GxDxF, group_sizes_G, preferred_element_type=jnp.float32)
  up_AxF = lax.ragged_dot(x_AxD, w_up_GxDxF, group_sizes_G, preferred_element_type=jnp.float32)
  if fn.bias:      # cast, then gathered: their gradients scatter-add over the rows in fp32
    group_A = row_groups(group_sizes_G, x_AxD.shape[0])
    gate_AxF = gate_AxF + ws[3].astype(jnp.float32)[group_A]
    up_AxF = up_AxF + ws[4].astype(jnp.float32)[group_A]
  h_AxF = fn.act(gate_AxF, up_AxF).astype(dtype)
  y_AxD = lax.ragged_dot(h_AxF, w_down_GxFxD, group_sizes_G, preferred_element_type=jnp.float32)
  if fn.bias:
    y_AxD = y_AxD + ws[5].astype(jnp.float32)[group_A]
  rows_used = jnp.sum(group_sizes_G)
  return jnp.where(jnp.arange(x_AxD.shape[0])[:, None] < rows_used, y_AxD, 0.0).astype(dtype)


def _tile_plan(group_sizes_G, num_rows: int, m: int):
  """(tiles Tl, expert of each tile [Tl], sorted row of each padded row [Tl*M] (num_rows: the
  zero row), padded row of each sorted row [A] (Tl*M: rows past the groups, zeros))."""
  g = group_sizes_G.shape[0]
  num_tiles = -(-num_rows // m) + g
  tiles_G = (group_sizes_G + m - 1) // m
  tile_end_G = jnp.cumsum(tiles_G)
  tile_start_G = tile_end_G - tiles_G
  row_end_G = jnp.cumsum(group_sizes_G)
  row_start_G = row_end_G - group_sizes_G
  # Tiles past the used ones take the last expert; their rows are all padding.
  group_T = jnp.minimum(jnp.searchsorted(tile_end_G, jnp.arange(num_tiles), side="right"), g - 1)
  p = jnp.arange(num_tiles * m)
  group_P = group_T[p // m]
  within_P = p - tile_start_G[group_P] * m
  src_P = jnp.where(within_P < group_sizes_G[group_P], row_start_G[group_P] + within_P, num_rows)
  r = jnp.arange(num_rows)
  group_A = jnp.minimum(jnp.searchsorted(row_end_G, r, side="right"), g - 1)
  slot_A = jnp.where(r < row_end_G[-1], tile_start_G[group_A] * m + (r - row_start_G[group_A]),
                     num_tiles * m)
  return num_tiles, group_T, src_P, slot_A


def _rows_to_tiles(x_AxD, src_P, num_tiles: int, m: int):
  x_ext = jnp.concatenate([x_AxD, jnp.zeros((1, x_AxD.shape[1]), x_AxD.dtype)])
  return x_ext[src_P].reshape(num_tiles, m, -1)


def _tiles_to_rows(y_TlxMxD, slot_A):
  num_tiles, m, d = y_TlxMxD.shape
  flat = jnp.concatenate([y_TlxMxD.reshape(num_tiles * m, d), jnp.zeros((1, d), y_TlxMxD.dtype)])
  return flat[slot_A]


# The CPU loop kernel. A loop over tiles reads each tile's expert weights in place (a batched
# matmul over all tiles first copies every tile's weights: 1.5x slower alone at 512 rows, 8
# experts). Arithmetic in fp32 (XLA:CPU's fp32 matmuls run 1.4-1.5x its bf16 ones on AVX2;
# products of bf16 values are exact in fp32, so only the summation order differs), rounding
# where the bf16 computation rounds: h, and its cotangent.
_F32 = jnp.float32


def _w(w_GxIxO, e):
  return lax.dynamic_index_in_dim(w_GxIxO, e, keepdims=False).astype(_F32)


def _used_tiles(group_sizes_G, m: int):
  """How many tiles hold rows: the loops run over these only. The plan's static count, A/M + G,
  covers the worst case; 2048 rows drawn uniformly over 128 experts fill 183 of its 256 tiles of
  16 rows."""
  return jnp.sum((group_sizes_G + m - 1) // m)


# Under a caller's `shard_map(check_vma=True)` (moejax's own run with check_vma=False, where no
# array is typed varying and these do nothing): a loop's carry must type as its body's output,
# and a custom VJP's cotangent as its primal.
def _varying(*arrays) -> set:
  """The mesh axes any of `arrays` varies over."""
  axes = set()
  for x in arrays:
    t = jax.typeof(x)
    manual = getattr(t, "manual_axis_type", None)
    axes |= set(manual.varying if manual is not None else getattr(t, "vma", ()))
  return axes


def _loop_zeros(shape, dtype, *inputs):
  """Zeros that vary over the axes any of `inputs` varies over (a loop carry's start)."""
  zeros, axes = jnp.zeros(shape, dtype), _varying(*inputs)
  return lax.pcast(zeros, tuple(sorted(axes)), to="varying") if axes else zeros


def _cotangent_of(primal, ct):
  """`ct` summed over the axes it varies over and `primal` does not (a replicated weight's
  gradient is the sum of every device's)."""
  axes = _varying(ct) - _varying(primal)
  return lax.psum(ct, tuple(sorted(axes))) if axes else ct


def _looped(x_AxD, group_sizes_G, ws, m: int, fn: ExpertFn = SWIGLU):
  """The loop kernel: `ws` the expert arrays (`ExpertFn.num_weights` of them), M rows a tile."""
  return _looped_op(x_AxD, group_sizes_G, tuple(ws), m, fn)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _looped_op(x_AxD, group_sizes_G, ws, m: int, fn: ExpertFn):
  return _looped_fwd(x_AxD, group_sizes_G, ws, m, fn)[0]


def _looped_fwd(x_AxD, group_sizes_G, ws, m, fn):
  dtype = x_AxD.dtype
  w_gate, w_up, w_down = ws[:3]
  f = w_gate.shape[-1]
  num_tiles, group_T, src_P, slot_A = _tile_plan(group_sizes_G, x_AxD.shape[0], m)
  x_TlxMxD = _rows_to_tiles(x_AxD, src_P, num_tiles, m)
  # Gate and up as one [D, 2F] product per tile (half the small matmuls; the loop's cost here
  # is per operation, not per flop).
  w_gu_GxDx2F = jnp.concatenate([w_gate, w_up], axis=-1)
  b_gu_Gx2F = jnp.concatenate([ws[3], ws[4]], axis=-1) if fn.bias else None

  def tile(t, y_TlxMxD):
    e = group_T[t]
    x32 = lax.dynamic_index_in_dim(x_TlxMxD, t, keepdims=False).astype(_F32)
    gu_Mx2F = x32 @ _w(w_gu_GxDx2F, e)
    if fn.bias:
      gu_Mx2F = gu_Mx2F + _w(b_gu_Gx2F, e)[None]
    h_MxF = fn.act(gu_Mx2F[:, :f], gu_Mx2F[:, f:]).astype(dtype).astype(_F32)
    y_MxD = h_MxF @ _w(w_down, e)
    if fn.bias:     # padding rows get the bias too: `_tiles_to_rows` leaves them out
      y_MxD = y_MxD + _w(ws[5], e)[None]
    return lax.dynamic_update_index_in_dim(y_TlxMxD, y_MxD.astype(dtype), t, 0)

  # The backward recomputes each tile's gate and up (one product) rather than keep them: a
  # [tiles, M, 2F] fp32 buffer, written in full (zeros) whatever the rows used.
  y_TlxMxD = lax.fori_loop(0, _used_tiles(group_sizes_G, m), tile,
                           _loop_zeros(x_TlxMxD.shape, dtype, x_TlxMxD, w_gu_GxDx2F, w_down))
  residuals = (x_TlxMxD, group_T, src_P, slot_A, group_sizes_G, w_gu_GxDx2F, w_down, b_gu_Gx2F,
               ws[5] if fn.bias else None)
  return _tiles_to_rows(y_TlxMxD, slot_A), residuals


def _looped_bwd(m, fn, residuals, dy_AxD):
  (x_TlxMxD, group_T, src_P, slot_A, group_sizes_G, w_gu_GxDx2F, w_down, b_gu_Gx2F,
   b_down) = residuals
  dtype = x_TlxMxD.dtype
  f = w_down.shape[1]
  dy_TlxMxD = _rows_to_tiles(dy_AxD, src_P, x_TlxMxD.shape[0], m)

  def tile(t, carry):
    dw_gu, dw_down, dx_TlxMxD, db_gu, db_down = carry
    e = group_T[t]
    x32 = lax.dynamic_index_in_dim(x_TlxMxD, t, keepdims=False).astype(_F32)
    dy32 = lax.dynamic_index_in_dim(dy_TlxMxD, t, keepdims=False).astype(_F32)
    w_gu_Dx2F = _w(w_gu_GxDx2F, e)
    gu_Mx2F = x32 @ w_gu_Dx2F
    if fn.bias:
      gu_Mx2F = gu_Mx2F + _w(b_gu_Gx2F, e)[None]
    dh_MxF = (dy32 @ _w(w_down, e).T).astype(dtype).astype(_F32)
    h_MxF, dgate_MxF, dup_MxF = act_grads(fn, gu_Mx2F[:, :f], gu_Mx2F[:, f:], dh_MxF)
    h_MxF = h_MxF.astype(dtype).astype(_F32)
    dgu_Mx2F = jnp.concatenate([dgate_MxF, dup_MxF], axis=-1)
    dx_MxD = (dgu_Mx2F @ w_gu_Dx2F.T).astype(dtype)
    if fn.bias:     # padding rows: dy 0, so dh and the gate/up cotangents 0
      db_gu = db_gu.at[e].add(jnp.sum(dgu_Mx2F, axis=0))
      db_down = db_down.at[e].add(jnp.sum(dy32, axis=0))
    return (dw_gu.at[e].add(x32.T @ dgu_Mx2F), dw_down.at[e].add(h_MxF.T @ dy32),
            lax.dynamic_update_index_in_dim(dx_TlxMxD, dx_MxD, t, 0), db_gu, db_down)

  inputs = (x_TlxMxD, dy_TlxMxD, w_gu_GxDx2F, w_down)
  zeros = lambda a: None if a is None else _loop_zeros(a.shape, _F32, *inputs)   # noqa: E731
  init = (zeros(w_gu_GxDx2F), zeros(w_down), _loop_zeros(x_TlxMxD.shape, dtype, *inputs),
          zeros(b_gu_Gx2F), zeros(b_down))
  dw_gu, dw_down, dx_TlxMxD, db_gu, db_down = lax.fori_loop(
      0, _used_tiles(group_sizes_G, m), tile, init)
  no_grad = np.zeros(group_sizes_G.shape, jax.dtypes.float0)
  wdtype = w_down.dtype
  d_ws = [_cotangent_of(w_gu_GxDx2F, dw_gu[..., :f].astype(wdtype)),
          _cotangent_of(w_gu_GxDx2F, dw_gu[..., f:].astype(wdtype)),
          _cotangent_of(w_down, dw_down.astype(wdtype))]
  if fn.bias:
    d_ws += [_cotangent_of(b_gu_Gx2F, db_gu[..., :f].astype(b_gu_Gx2F.dtype)),
             _cotangent_of(b_gu_Gx2F, db_gu[..., f:].astype(b_gu_Gx2F.dtype)),
             _cotangent_of(b_down, db_down.astype(b_down.dtype))]
  return _tiles_to_rows(dx_TlxMxD, slot_A), no_grad, tuple(d_ws)


_looped_op.defvjp(_looped_fwd, _looped_bwd)


def _batched(x_AxD, group_sizes_G, ws, m: int, fn: ExpertFn = SWIGLU):
  """All tiles in one batched matmul per projection, weights taken per tile (autodiff)."""
  dtype = x_AxD.dtype
  num_tiles, group_T, src_P, slot_A = _tile_plan(group_sizes_G, x_AxD.shape[0], m)
  x_TlxMxD = _rows_to_tiles(x_AxD, src_P, num_tiles, m).astype(_F32)
  per_tile = lambda w: jnp.take(w, group_T, axis=0).astype(_F32)   # noqa: E731
  # the biases cast first: their gradients sum over the tiles in fp32
  bias_per_tile = lambda b: jnp.take(b.astype(_F32), group_T, axis=0)[:, None]  # noqa: E731
  gate = jnp.einsum("tmd,tdf->tmf", x_TlxMxD, per_tile(ws[0]))
  up = jnp.einsum("tmd,tdf->tmf", x_TlxMxD, per_tile(ws[1]))
  if fn.bias:
    gate, up = gate + bias_per_tile(ws[3]), up + bias_per_tile(ws[4])
  h_TlxMxF = fn.act(gate, up).astype(dtype).astype(_F32)
  y_TlxMxD = jnp.einsum("tmf,tfd->tmd", h_TlxMxF, per_tile(ws[2]))
  if fn.bias:
    y_TlxMxD = y_TlxMxD + bias_per_tile(ws[5])
  return _tiles_to_rows(y_TlxMxD.astype(dtype), slot_A)


def _tiled_swiglu(x_AxD, group_sizes_G, ws, fn: ExpertFn = SWIGLU, packed=True,
                  tiled_as: int | None = None):
  (a, _), g = x_AxD.shape, group_sizes_G.shape[0]
  kernel = _batched if _batched_kernel(a, g, packed) else _looped
  return kernel(x_AxD, group_sizes_G, ws, tile_rows(tiled_as or a, g, packed), fn)


def _gpu_swiglu(x_AxD, group_sizes_G, ws, fn: ExpertFn = SWIGLU):
  from moejax.placement import hopper
  if hopper.usable(x_AxD, *ws):
    return hopper.padded_call(lambda d, f: hopper.kernel_swiglu(d, f, fn), x_AxD, group_sizes_G,
                              ws)
  return _ragged_swiglu(x_AxD, group_sizes_G, ws, fn)


def grouped_swiglu(x_AxD, group_sizes_G, *ws, packed: bool = True, fn: ExpertFn = SWIGLU,
                   tiled_as: int | None = None):
  """`ws`: the expert arrays (`ExpertFn`), G experts each. `packed`: the rows are the routed
  assignments; False: a static exchange buffer whose empty slots (rows past the groups) may be
  most of it. `tiled_as`: the row count the CPU kernel sizes its tiles for, if not these rows'
  (a row's result depends on its tile's size in the last bits)."""
  check_weights(ws, fn)
  return lax.platform_dependent(
      x_AxD, group_sizes_G, tuple(ws),
      cpu=functools.partial(_tiled_swiglu, fn=fn, packed=packed, tiled_as=tiled_as),
      cuda=functools.partial(_gpu_swiglu, fn=fn),
      default=functools.partial(_ragged_swiglu, fn=fn))


def run_sorted(x_AxD, expert_A, num_local_experts: int, *ws, packed: bool = True,
               fn: ExpertFn = SWIGLU, rows: int | None = None, tiled_as: int | None = None):
  """Runs each row through expert `expert_A[a]` (ids >= num_local_experts: no expert, zeros;
  `packed=False` where most rows may be such, as in an exchange buffer). `ws`: the expert
  arrays, as `grouped_swiglu`. `rows` (R < A): only the first R rows in expert order run (the
  grouped matmuls are R rows long; the CPU kernel's tiles stay those of A rows, so the rows that
  run give the same bits whatever R); any past them come out as zeros (the caller counts them:
  `dispatch.exchange`). `tiled_as`: the rows the CPU kernel sizes its tiles for, if not A (a
  packed exchange buffer runs as the block buffer it replaces would)."""
  a = x_AxD.shape[0]
  order_A = jnp.argsort(expert_A, stable=True)
  group_sizes_G = jnp.bincount(expert_A, length=num_local_experts).astype(jnp.int32)
  if rows is not None and rows < a:
    order_R = order_A[:rows]
    ends_G = jnp.minimum(jnp.cumsum(group_sizes_G), rows)   # the groups cut at R rows
    sizes_G = jnp.diff(ends_G, prepend=0).astype(jnp.int32)
    y_sorted_RxD = grouped_swiglu(x_AxD[order_R], sizes_G, *ws, packed=packed, fn=fn,
                                  tiled_as=tiled_as or a)
    return jnp.zeros((a,) + y_sorted_RxD.shape[1:], y_sorted_RxD.dtype).at[order_R].set(
        y_sorted_RxD)
  y_sorted_AxD = grouped_swiglu(x_AxD[order_A], group_sizes_G, *ws, packed=packed, fn=fn,
                                tiled_as=tiled_as)
  return jnp.zeros_like(y_sorted_AxD).at[order_A].set(y_sorted_AxD)
