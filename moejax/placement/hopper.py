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

`swiglu_with(ops, fn)` builds the op over any pair of grouped products, so the VJP is tested on
CPU with `lax.ragged_dot` in their place (tests/placement/test_hopper.py); the kernels themselves
run only on a GPU of compute capability 9.x (the device check times them against the
alternatives). `fn` (`expert_fn.ExpertFn`): SwiGLU, or gpt-oss's clamped SwiGLU with biases (the
biases added in fp32 between the kernels, their gradients summed per expert). Widths the tiles
do not take (gpt-oss's 2880) are zero-padded to them (`padded_call`), which is exact.

A compile for a GPU that is not here (`scripts/gpu_schedule.py`: XLA:GPU's deviceless compile)
names the GPU with `lowering_for(Target(...))`, so its program holds these kernels as the GPU's
would, not `ragged_dot`'s dense rewrite.

Letters: A rows, D model width, F expert hidden width, G experts.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from moejax.placement import expert_fn as expert_fn_lib

ENABLED = True   # the device check turns the kernels off for its later steps if they are wrong


@dataclasses.dataclass(frozen=True)
class Target:
  """The GPU a program is lowered for when it is not the local device: its compute capability
  ("9.0") and its number of SMs (the transposed kernel's grid)."""
  compute_capability: str
  core_count: int


_TARGET: Target | None = None


@contextlib.contextmanager
def lowering_for(target: Target):
  """Within it, kernel choice and tracing take `target` for the local device (a deviceless
  compile's; on a machine with a GPU the local device is the target and this is not needed).
  Enter it before tracing what it is for: a trace jax keeps (a scan's body traced earlier by
  the same function) chose its kernels by the device assumed when it was made, which is not
  part of jax's cache keys (`scripts/gpu_schedule.py` enters it before any trace).
  `jax.clear_caches()` on entry would make that safe at the price of every compiled program of
  the process."""
  global _TARGET
  previous, _TARGET = _TARGET, target
  try:
    yield
  finally:
    _TARGET = previous


class _JaxOnTarget:
  """`jax` as jax's transposed kernel sees it while tracing for `_TARGET`: it sizes its grid
  from `jax.devices()[0].core_count`, which off the GPU is a CPU device without one."""

  def __init__(self, target: Target):
    self._device = type("TargetDevice", (), {"core_count": target.core_count,
                                             "platform": "gpu"})()

  def devices(self, *args, **kwargs):
    return [self._device]

  def __getattr__(self, name):
    return getattr(jax, name)


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
    if _TARGET is None:
      return transposed_ragged_dot_mgpu.transposed_ragged_dot(a, b, group_sizes=gs,
                                                              **transposed_tiles)
    module_jax, transposed_ragged_dot_mgpu.jax = transposed_ragged_dot_mgpu.jax, \
        _JaxOnTarget(_TARGET)
    try:
      return transposed_ragged_dot_mgpu.transposed_ragged_dot(a, b, group_sizes=gs,
                                                              **transposed_tiles)
    finally:
      transposed_ragged_dot_mgpu.jax = module_jax

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


def swiglu_with(ops: GroupedOps, fn: expert_fn_lib.ExpertFn = expert_fn_lib.SWIGLU):
  """y_AxD = act(x Wg [+ bg], x Wu [+ bu]) Wd [+ bd] per row's expert (`fn`: SwiGLU or gpt-oss's
  clamped one, biases or not), as a custom_vjp over `ops`: `swiglu(x, group_sizes, *ws)`."""

  def swiglu(x_AxD, group_sizes_G, *ws):
    expert_fn_lib.check_weights(ws, fn)
    return op(x_AxD, group_sizes_G, tuple(ws))

  @jax.custom_vjp
  def op(x_AxD, group_sizes_G, ws):
    return fwd(x_AxD, group_sizes_G, ws)[0]

  def pre_activation(gate_AxF, up_AxF, group_A, ws):
    """gate and up in fp32, each expert's bias added."""
    gate, up = gate_AxF.astype(jnp.float32), up_AxF.astype(jnp.float32)
    if fn.bias:
      gate = gate + ws[3][group_A].astype(jnp.float32)
      up = up + ws[4][group_A].astype(jnp.float32)
    return gate, up

  def fwd(x_AxD, group_sizes_G, ws):
    w_gate_GxDxF, w_up_GxDxF, w_down_GxFxD = ws[:3]
    used_Ax1 = _rows_in_groups(x_AxD.shape[0], group_sizes_G)
    group_A = expert_fn_lib.row_groups(group_sizes_G, x_AxD.shape[0]) if fn.bias else None
    gate_AxF = ops.ragged(x_AxD, w_gate_GxDxF, group_sizes_G)
    up_AxF = ops.ragged(x_AxD, w_up_GxDxF, group_sizes_G)
    h_AxF = fn.act(*pre_activation(gate_AxF, up_AxF, group_A, ws))
    h_AxF = jnp.where(used_Ax1, h_AxF, 0.0).astype(x_AxD.dtype)
    y_AxD = ops.ragged(h_AxF, w_down_GxFxD, group_sizes_G)
    if fn.bias:
      y_AxD = y_AxD.astype(jnp.float32) + ws[5][group_A].astype(jnp.float32)
    y_AxD = jnp.where(used_Ax1, y_AxD, 0)
    return y_AxD.astype(x_AxD.dtype), (x_AxD, group_sizes_G, ws, gate_AxF, up_AxF, h_AxF)

  def bwd(residuals, dy_AxD):
    x_AxD, group_sizes_G, ws, gate_AxF, up_AxF, h_AxF = residuals
    w_gate, w_up, w_down = ws[:3]
    dtype = x_AxD.dtype
    used_Ax1 = _rows_in_groups(x_AxD.shape[0], group_sizes_G)
    group_A = expert_fn_lib.row_groups(group_sizes_G, x_AxD.shape[0]) if fn.bias else None
    dy_AxD = jnp.where(used_Ax1, dy_AxD, 0).astype(dtype)
    dh_AxF = ops.ragged(dy_AxD, w_down, group_sizes_G, transpose=True).astype(jnp.float32)
    gate, up = pre_activation(gate_AxF, up_AxF, group_A, ws)
    if fn == expert_fn_lib.SWIGLU:     # by hand, as the kernels were first measured
      sig = jax.nn.sigmoid(gate)
      dgate_AxF, dup_AxF = dh_AxF * up * sig * (1 + gate * (1 - sig)), dh_AxF * gate * sig
    else:
      _, dgate_AxF, dup_AxF = expert_fn_lib.act_grads(fn, gate, up, dh_AxF)
    dgate32_AxF = jnp.where(used_Ax1, dgate_AxF, 0)
    dup32_AxF = jnp.where(used_Ax1, dup_AxF, 0)
    dgate_AxF, dup_AxF = dgate32_AxF.astype(dtype), dup32_AxF.astype(dtype)
    dx_AxD = (ops.ragged(dgate_AxF, w_gate, group_sizes_G, transpose=True).astype(jnp.float32)
              + ops.ragged(dup_AxF, w_up, group_sizes_G, transpose=True).astype(jnp.float32))
    dx_AxD = jnp.where(used_Ax1, dx_AxD, 0).astype(dtype)
    d_ws = [ops.transposed(x_AxD, dgate_AxF, group_sizes_G).astype(w_gate.dtype),
            ops.transposed(x_AxD, dup_AxF, group_sizes_G).astype(w_up.dtype),
            ops.transposed(h_AxF, dy_AxD, group_sizes_G).astype(w_down.dtype)]
    if fn.bias:      # each expert's rows summed in fp32, before the kernels' bf16 rounding
      g = group_sizes_G.shape[0]     # (rows past the groups are zeros)
      d_ws += [jax.ops.segment_sum(t.astype(jnp.float32), group_A, g).astype(b.dtype)
               for t, b in ((dgate32_AxF, ws[3]), (dup32_AxF, ws[4]), (dy_AxD, ws[5]))]
    return dx_AxD, None, tuple(d_ws)

  op.defvjp(fwd, bwd)
  return swiglu


def _compute_capability() -> str | None:
  if _TARGET is not None:
    return _TARGET.compute_capability
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


def usable(x_AxD, *ws) -> bool:
  """The kernels apply: a Hopper GPU (compute capability 9.x), one 16-bit float dtype for rows
  and expert arrays. Widths that are not multiples of the base tiles' are padded to them
  (`padded_call`)."""
  if not ENABLED:
    return False
  cc = _compute_capability()
  if cc is None or not str(cc).startswith("9"):
    return False
  dtypes = {jnp.dtype(v.dtype) for v in (x_AxD, *ws)}
  return len(dtypes) == 1 and dtypes <= {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)}


def padded_width(n: int) -> int:
  """`n` rounded up to what the base tiles take."""
  m = width_multiple(BASE_RAGGED_TILES, BASE_TRANSPOSED_TILES)
  return -(-n // m) * m


def padded_call(swiglu_at, x_AxD, group_sizes_G, ws):
  """`swiglu_at(d, f)(x, group_sizes, *ws)` with D and F zero-padded to `padded_width` (gpt-oss's
  2880 to 2944): padded input columns are zeros, padded hidden units have zero weights and
  biases, so their gate and up are 0 and so is their activation (silu(0) * up, and the clamped
  SwiGLU's 0 * sigmoid(0) * (up + 1)); the output's padded columns are cut. Exact, and the
  padding's gradients are cut with it."""
  d, f = ws[0].shape[1:]
  dp, fp = padded_width(d), padded_width(f)
  if (dp, fp) == (d, f):
    return swiglu_at(d, f)(x_AxD, group_sizes_G, *ws)
  pad = lambda a, widths: jnp.pad(a, [(0, 0)] + [(0, w - n) for n, w in  # noqa: E731
                                                   zip(a.shape[1:], widths)])
  widths = ((dp, fp), (dp, fp), (fp, dp), (fp,), (fp,), (dp,))
  padded = tuple(pad(w, wd) for w, wd in zip(ws, widths))
  y_AxDp = swiglu_at(dp, fp)(jnp.pad(x_AxD, [(0, 0), (0, dp - d)]), group_sizes_G, *padded)
  return y_AxDp[:, :d]


def kernel_swiglu(d: int, f: int, fn: expert_fn_lib.ExpertFn = expert_fn_lib.SWIGLU):
  """The expert op (`fn`) over the kernels at `tiles_for(d, f)`."""
  ragged, transposed = tiles_for(d, f)
  return _kernel_swiglu_at(tuple(ragged.items()), tuple(transposed.items()), fn)


@functools.cache
def _kernel_swiglu_at(ragged_items: tuple, transposed_items: tuple,
                      fn: expert_fn_lib.ExpertFn = expert_fn_lib.SWIGLU):
  return swiglu_with(kernel_ops(dict(ragged_items), dict(transposed_items)), fn)
