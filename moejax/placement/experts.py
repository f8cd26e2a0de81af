"""SwiGLU experts as grouped matmuls, the implementation chosen per platform.

Letters: A rows (token-expert assignments), D model width, F expert hidden width, G experts held
here, Tl row tiles, M rows per tile. Rows must be sorted by expert; `group_sizes_G` says how many
rows each expert takes; rows past the sum of the group sizes come out as zeros.

  GPU/TPU  `lax.ragged_dot`: the backends' grouped matmul does the routed rows' work.
  CPU      row tiles: XLA:CPU lowers `ragged_dot` to a dense matmul over every expert, masked
           (G times the routed work, measured 7-10x slower at G=8 and growing with G). Here
           each expert's rows are padded to whole tiles of M rows, every tile belongs to one
           expert, and one batched matmul runs the tiles against their experts' weights (taken
           per tile). Static shapes: at most A/M + G tiles, so the padding costs at most G*M rows.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def tile_rows(num_rows: int, num_groups: int) -> int:
  """M: a power of two near the mean group size, 16 to 128 (measured on XLA:CPU: smaller tiles
  waste less padding when groups are small, larger ones run the matmuls faster)."""
  mean = max(1, num_rows // max(1, num_groups))
  return int(min(128, max(16, 1 << (mean.bit_length() - 1))))


def _ragged_swiglu(x_AxD, group_sizes_G, w_gate_GxDxF, w_up_GxDxF, w_down_GxFxD):
  dtype = x_AxD.dtype
  gate_AxF = lax.ragged_dot(x_AxD, w_gate_GxDxF, group_sizes_G, preferred_element_type=jnp.float32)
  up_AxF = lax.ragged_dot(x_AxD, w_up_GxDxF, group_sizes_G, preferred_element_type=jnp.float32)
  h_AxF = (jax.nn.silu(gate_AxF) * up_AxF).astype(dtype)
  y_AxD = lax.ragged_dot(h_AxF, w_down_GxFxD, group_sizes_G, preferred_element_type=jnp.float32)
  rows_used = jnp.sum(group_sizes_G)
  return jnp.where(jnp.arange(x_AxD.shape[0])[:, None] < rows_used, y_AxD, 0.0).astype(dtype)


def _tiled_swiglu(x_AxD, group_sizes_G, w_gate_GxDxF, w_up_GxDxF, w_down_GxFxD):
  dtype = x_AxD.dtype
  (a, d), g = x_AxD.shape, group_sizes_G.shape[0]
  m = tile_rows(a, g)
  num_tiles = -(-a // m) + g
  tiles_G = (group_sizes_G + m - 1) // m
  tile_end_G = jnp.cumsum(tiles_G)
  tile_start_G = tile_end_G - tiles_G
  row_end_G = jnp.cumsum(group_sizes_G)
  row_start_G = row_end_G - group_sizes_G
  # Each tile's expert (tiles past the used ones take the last expert; their rows are empty).
  group_T = jnp.minimum(jnp.searchsorted(tile_end_G, jnp.arange(num_tiles), side="right"), g - 1)
  # Padded row p of tile p // M holds sorted row src_P[p], or the zero row A past the group.
  p = jnp.arange(num_tiles * m)
  group_P = group_T[p // m]
  within_P = p - tile_start_G[group_P] * m
  src_P = jnp.where(within_P < group_sizes_G[group_P], row_start_G[group_P] + within_P, a)
  # Sorted row r sits at padded row slot_A[r].
  r = jnp.arange(a)
  group_A = jnp.minimum(jnp.searchsorted(row_end_G, r, side="right"), g - 1)
  slot_A = tile_start_G[group_A] * m + (r - row_start_G[group_A])

  # In fp32: XLA:CPU's fp32 matmuls run 1.4-1.5x its bf16 ones (no bf16 arithmetic on AVX2), and
  # products of bf16 values are exact in fp32, so only the summation order can differ.
  f32 = jnp.float32
  x_TlxMxD = jnp.concatenate([x_AxD, jnp.zeros((1, d), dtype)])[src_P].reshape(num_tiles, m, d)
  x_TlxMxD = x_TlxMxD.astype(f32)
  per_tile = lambda w: jnp.take(w, group_T, axis=0).astype(f32)   # noqa: E731
  gate = jnp.einsum("tmd,tdf->tmf", x_TlxMxD, per_tile(w_gate_GxDxF),
                    preferred_element_type=jnp.float32)
  up = jnp.einsum("tmd,tdf->tmf", x_TlxMxD, per_tile(w_up_GxDxF),
                  preferred_element_type=jnp.float32)
  h_TlxMxF = (jax.nn.silu(gate) * up).astype(dtype).astype(f32)
  y_TlxMxD = jnp.einsum("tmf,tfd->tmd", h_TlxMxF, per_tile(w_down_GxFxD),
                        preferred_element_type=jnp.float32).astype(dtype)
  y_AxD = y_TlxMxD.reshape(num_tiles * m, d)[slot_A]
  return jnp.where(r[:, None] < row_end_G[-1], y_AxD, 0).astype(dtype)


def grouped_swiglu(x_AxD, group_sizes_G, w_gate_GxDxF, w_up_GxDxF, w_down_GxFxD):
  return lax.platform_dependent(x_AxD, group_sizes_G, w_gate_GxDxF, w_up_GxDxF, w_down_GxFxD,
                                cpu=_tiled_swiglu, default=_ragged_swiglu)


def run_sorted(x_AxD, expert_A, num_local_experts: int, w_gate, w_up, w_down):
  """Runs each row through expert `expert_A[a]` (ids >= num_local_experts: no expert, zeros)."""
  order_A = jnp.argsort(expert_A, stable=True)
  group_sizes_G = jnp.bincount(expert_A, length=num_local_experts).astype(jnp.int32)
  y_sorted_AxD = grouped_swiglu(x_AxD[order_A], group_sizes_G, w_gate, w_up, w_down)
  return jnp.zeros_like(y_sorted_AxD).at[order_A].set(y_sorted_AxD)
