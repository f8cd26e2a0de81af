"""SwiGLU experts on Hopper GPUs: jax's own Pallas Mosaic GPU grouped matmuls, with their VJP.

Why not `lax.ragged_dot` there: XLA:GPU (jaxlib 0.11.2) rewrites it into a dense dot over every
expert (the rows' operand widened to [A, G*D]); on an H200 one OLMoE-1B-7B layer at batch 8 x 4096
asked for 64 GiB for that operand alone and stopped (scripts/device_check.py, `layer`). jax ships
Hopper (wgmma) kernels for the two grouped products a grouped matmul and its gradients need:

  ragged_dot(lhs [A, K], rhs [G, K, N])          rows of group g times rhs[g]  (forward, dgrad
                                                 with `transpose_rhs`: rhs given as [G, N, K])
  transposed_ragged_dot(lhs [A, M], rhs [A, N])  per group g, lhs[rows of g].T @ rhs[rows of g]
                                                 -> [G, M, N]                  (wgrad)

Both accumulate in fp32 and write the inputs' dtype (bf16): gate/up and the weight gradients are
rounded to bf16 once, where `_ragged_swiglu` keeps gate/up in fp32. Rows past the groups' sum
are not written by the kernel: they are masked to zero here, in the output and the gradients.

`swiglu_with(ops)` builds the op over any pair of grouped products, so the VJP is tested on CPU
with `lax.ragged_dot` in their place (tests/placement/test_hopper.py); the kernels themselves run
only on a GPU of compute capability 9.x (the device check times them against the alternatives).

Letters: A rows, D model width, F expert hidden width, G experts.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

ENABLED = True   # the device check turns the kernels off for its later steps if they are wrong


@dataclasses.dataclass(frozen=True)
class GroupedOps:
  """ragged(x_AxK, w_GxKxN, gs, transpose=False) -> [A, N] (with transpose, w is given as
  [G, N, K]);  transposed(a_AxM, b_AxN, gs) -> [G, M, N]."""
  ragged: Callable
  transposed: Callable


# The kernels' tile configurations (jax's ragged_dot_mgpu / transposed_ragged_dot_mgpu
# arguments). 128 x 128 output tiles over 64-wide K steps take any D and F multiple of 128:
BASE_RAGGED_TILES = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4,
                         grid_block_n=1)
BASE_TRANSPOSED_TILES = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=2,
                             grid_block_n=1)
# The fastest of 9 and 7 tried on an H200 at OLMoE-1B-7B's expert shapes (scripts/device_check.py,
# `tiles`: 1.18x and 1.27x the base tiles over one SwiGLU forward+backward), for D and F
# multiples of 512 (4 output tiles per grid block).
RAGGED_TILES = dict(BASE_RAGGED_TILES, grid_block_n=4)
TRANSPOSED_TILES = dict(BASE_TRANSPOSED_TILES, max_concurrent_steps=5, grid_block_n=4)


def kernel_ops(ragged_tiles: dict | None = None,
               transposed_tiles: dict | None = None) -> GroupedOps:
  """jax's Pallas Mosaic GPU kernels (Hopper), at the given tiles (default: the tuned ones)."""
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
  ragged_tiles = RAGGED_TILES if ragged_tiles is None else ragged_tiles
  transposed_tiles = TRANSPOSED_TILES if transposed_tiles is None else transposed_tiles

  def ragged(x, w, gs, transpose=False):
    return ragged_dot_mgpu.ragged_dot(x, w, group_sizes=gs, transpose_rhs=transpose,
                                      **ragged_tiles)

  def transposed(a, b, gs):
    return transposed_ragged_dot_mgpu.transposed_ragged_dot(a, b, group_sizes=gs,
                                                            **transposed_tiles)

  return GroupedOps(ragged, transposed)


def reference_ops() -> GroupedOps:
  """The same products by `lax.ragged_dot(_general)`, fp32 accumulation, the inputs' dtype out."""
  def ragged(x, w, gs, transpose=False):
    if transpose:
      w = jnp.swapaxes(w, 1, 2)
    return lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32).astype(x.dtype)

  def transposed(a, b, gs):
    dims = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                         lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    return lax.ragged_dot_general(a, b, gs, dims,
                                  preferred_element_type=jnp.float32).astype(a.dtype)

  return GroupedOps(ragged, transposed)


def _rows_in_groups(a: int, group_sizes_G) -> jax.Array:
  return (jnp.arange(a) < jnp.sum(group_sizes_G))[:, None]


def swiglu_with(ops: GroupedOps):
  """y_AxD = (silu(x Wg) * (x Wu)) Wd per row's expert, as a custom_vjp over `ops`."""

  @jax.custom_vjp
  def swiglu(x_AxD, group_sizes_G, w_gate_GxDxF, w_up_GxDxF, w_down_GxFxD):
    return fwd(x_AxD, group_sizes_G, w_gate_GxDxF, w_up_GxDxF, w_down_GxFxD)[0]

  def fwd(x_AxD, group_sizes_G, w_gate_GxDxF, w_up_GxDxF, w_down_GxFxD):
    used_Ax1 = _rows_in_groups(x_AxD.shape[0], group_sizes_G)
    gate_AxF = ops.ragged(x_AxD, w_gate_GxDxF, group_sizes_G)
    up_AxF = ops.ragged(x_AxD, w_up_GxDxF, group_sizes_G)
    h_AxF = (jax.nn.silu(gate_AxF.astype(jnp.float32)) * up_AxF.astype(jnp.float32))
    h_AxF = jnp.where(used_Ax1, h_AxF, 0.0).astype(x_AxD.dtype)
    y_AxD = jnp.where(used_Ax1, ops.ragged(h_AxF, w_down_GxFxD, group_sizes_G), 0)
    return y_AxD.astype(x_AxD.dtype), (x_AxD, group_sizes_G, w_gate_GxDxF, w_up_GxDxF,
                                       w_down_GxFxD, gate_AxF, up_AxF, h_AxF)

  def bwd(residuals, dy_AxD):
    x_AxD, group_sizes_G, w_gate, w_up, w_down, gate_AxF, up_AxF, h_AxF = residuals
    dtype = x_AxD.dtype
    used_Ax1 = _rows_in_groups(x_AxD.shape[0], group_sizes_G)
    dy_AxD = jnp.where(used_Ax1, dy_AxD, 0).astype(dtype)
    dh_AxF = ops.ragged(dy_AxD, w_down, group_sizes_G, transpose=True).astype(jnp.float32)
    gate, up = gate_AxF.astype(jnp.float32), up_AxF.astype(jnp.float32)
    sig = jax.nn.sigmoid(gate)
    dgate_AxF = jnp.where(used_Ax1, dh_AxF * up * sig * (1 + gate * (1 - sig)), 0).astype(dtype)
    dup_AxF = jnp.where(used_Ax1, dh_AxF * gate * sig, 0).astype(dtype)
    dx_AxD = (ops.ragged(dgate_AxF, w_gate, group_sizes_G, transpose=True).astype(jnp.float32)
              + ops.ragged(dup_AxF, w_up, group_sizes_G, transpose=True).astype(jnp.float32))
    dx_AxD = jnp.where(used_Ax1, dx_AxD, 0).astype(dtype)
    dw_gate = ops.transposed(x_AxD, dgate_AxF, group_sizes_G).astype(w_gate.dtype)
    dw_up = ops.transposed(x_AxD, dup_AxF, group_sizes_G).astype(w_up.dtype)
    dw_down = ops.transposed(h_AxF, dy_AxD, group_sizes_G).astype(w_down.dtype)
    return dx_AxD, None, dw_gate, dw_up, dw_down

  swiglu.defvjp(fwd, bwd)
  return swiglu


def _compute_capability() -> str | None:
  try:
    device = jax.devices()[0]
  except RuntimeError:
    return None
  return getattr(device, "compute_capability", None) if device.platform == "gpu" else None


def width_multiple(ragged_tiles: dict, transposed_tiles: dict) -> int:
  """What D and F must be multiples of for the kernels at these tiles: every block size, and the
  output tiles of a grid block (D and F are each a K and an N somewhere)."""
  r, t = ragged_tiles, transposed_tiles
  return math.lcm(r["block_k"], r["block_n"] * r["grid_block_n"], t["block_m"],
                  t["block_n"] * t["grid_block_n"])


def tiles_for(d: int, f: int) -> tuple[dict, dict]:
  """(ragged, transposed) tiles for widths D and F: the tuned ones where they fit, else the
  base ones."""
  if all(n % width_multiple(RAGGED_TILES, TRANSPOSED_TILES) == 0 for n in (d, f)):
    return RAGGED_TILES, TRANSPOSED_TILES
  return BASE_RAGGED_TILES, BASE_TRANSPOSED_TILES


def usable(x_AxD, w_gate_GxDxF, w_up_GxDxF, w_down_GxFxD) -> bool:
  """The kernels apply: a Hopper GPU (compute capability 9.x), one 16-bit float dtype for rows
  and weights, D and F multiples of the base tiles' width; other shapes take the fallback path."""
  if not ENABLED:
    return False
  cc = _compute_capability()
  if cc is None or not str(cc).startswith("9"):
    return False
  dtypes = {jnp.dtype(v.dtype) for v in (x_AxD, w_gate_GxDxF, w_up_GxDxF, w_down_GxFxD)}
  d, f = w_gate_GxDxF.shape[1:]
  m = width_multiple(BASE_RAGGED_TILES, BASE_TRANSPOSED_TILES)
  return (len(dtypes) == 1 and dtypes <= {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)}
          and d % m == 0 and f % m == 0)


def kernel_swiglu(d: int, f: int):
  """The SwiGLU op over the kernels at `tiles_for(d, f)`."""
  ragged, transposed = tiles_for(d, f)
  return _kernel_swiglu_at(tuple(ragged.items()), tuple(transposed.items()))


@functools.cache
def _kernel_swiglu_at(ragged_items: tuple, transposed_items: tuple):
  return swiglu_with(kernel_ops(dict(ragged_items), dict(transposed_items)))
