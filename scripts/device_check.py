"""Every GPU check of moejax in one run, for a short-lived GPU machine (scripts/device_check.sh).

Each step is timed and recorded in one JSON file (format: docs/device_check.md); a failing step
records its error and the others still run. Steps:

  env        jax and device versions; whether the Triton kernels' jax-triton imports
  kernels    codec encode/decode (`moejax.codec.kernels`: Triton on CUDA) against the jnp
             reference, bit for bit, and the round trip exact; their times beside a
             device-to-device copy of the same bytes
  ragged     the ep exchange on the local devices (`ragged_all_to_all` on GPU) against the
             local experts, SparseAllGather (ragged on GPU) against the owners' rows, and the
             grouped expert matmuls (`ragged_dot` on GPU) against a dense per-expert product
  planner    fssdp's per-layer planning (bench/planner.py) at OLMoE's and DeepSeek-V3's expert
             counts on 32 and 64 devices: seconds a layer on this device
  train      20 steps of the tiny preset: losses, s/step
  one_layer  5 train steps of a one-layer model at the 1b7b shapes: s/step, tokens/s, peak bytes
  layer      forward and forward+backward time of one layer at the 1b7b shapes (a two-layer
             model's time minus a one-layer model's)
  profile    where one layer's forward+backward at the 1b7b shapes spends its device time: a
             jax.profiler trace, each op's time summed per moejax source line (the compiled
             HLO's stack frames)
  schedule   the compiled tiny train step's async collectives: start/done pairs and the
             instructions scheduled between each pair (0 pairs on one device, or on XLA:CPU)
  attention  causal attention at OLMoE-1B-7B's shapes: moejax's (XLA's materialized path) beside
             cuDNN's flash attention (GPU only), forward and forward+backward; and Llama 4's
             chunked attention (chunks of a quarter of the sequence run as a batch: cuDNN's on
             GPU) against the same chunks masked in XLA's path
  grouped    the experts' grouped matmuls at OLMoE-1B-7B's expert shapes, forward and
             forward+backward: jax's Hopper kernels (the GPU default where they apply), XLA's
             ragged_dot, and XLA:CPU's row tiles, each against a dense per-expert product
  tiles      (only with --only) jax's Hopper grouped-matmul kernels at other tile configurations,
             each grouped product of a SwiGLU forward+backward timed and checked against
             hopper.py's own tiles; the steps after it run at the fastest
  schedule8  the same for the tiny preset's 8-device train step (fsdp; fsdp + codec element;
             fssdp + coded replicas), compiled by this GPU's compiler for 8 GPUs in a child
             process (jax's mock GPU topology: nothing runs), and the collectives that sit
             inside a conditional's branch
  nvcomp     nvCOMP's ANS (GPU) on the codec's payloads (a bf16 shard's exponent bytes, the
             delta codes of an update): ratio, encode/decode seconds beside a device copy, and
             the link speed under which it pays

--dry-run runs every step at tiny shapes on CPU (8 fake devices), through the reference paths:
it checks the script itself, in CI. Exit status 1 if any step failed.
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _timed(fn, *args, repeats: int = 10) -> float:
  """Median seconds of `fn(*args)` after one warm-up call, each run waited for."""
  import jax
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _jax_triton_on_older_triton() -> bool:
  """jax-triton 0.4.1 wants triton >= 3.7; a GPU image may carry 3.6, whose nvidia driver module
  lacks one constant (`TMA_TF32`, used only for TMA descriptors, which moejax's kernels do not
  use). Without it jax-triton's import silently drops its CUDA backend. Define it (3.7's value),
  before jax-triton is imported; True if it was missing. Checked on CPU: with it, jax-triton
  0.4.1 on triton 3.6.0 compiles every codec kernel to sm_90 PTX."""
  try:
    import triton.backends.nvidia.driver as driver
  except Exception:   # no triton, or no CUDA backend: nothing to mend
    return False
  if hasattr(driver, "TMA_TF32"):
    return False
  driver.TMA_TF32 = 11
  return True


_SHIMMED = []   # set by main(), before any step imports jax-triton


def step_env(dims: dict) -> dict:
  import jax
  shim = bool(_SHIMMED and _SHIMMED[0])
  from moejax.codec.kernels import ops
  try:
    import triton
    triton_version = triton.__version__
  except Exception:
    triton_version = None
  return {"jax": jax.__version__, "backend": jax.default_backend(),
          "devices": [str(d) for d in jax.devices()], "device_kind": jax.devices()[0].device_kind,
          "triton": triton_version, "jax_triton_tma_tf32_defined": shim,
          "triton_kernels": jax.default_backend() == "gpu" and ops._triton_backend() is not None}


def step_kernels(dims: dict) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from moejax.codec import bits, gather as codec
  from moejax.codec.kernels import ops, reference

  n = dims["codec_values"]
  layout = bits.layout_of(jnp.bfloat16)
  rng = np.random.default_rng(0)
  out = {"values": n}
  # Two devices' shards before and after an update that doubles one value in 4096 (its
  # exponent moves): the patch fits both modes' capacity.
  before_2xN = jnp.asarray(rng.standard_normal((2, n)) * 0.02, jnp.bfloat16)
  moved_2xN = jnp.asarray(rng.random((2, n)) < 1 / 4096)
  after_2xN = jnp.where(moved_2xN, before_2xN * 2, before_2xN).astype(jnp.bfloat16)
  to_bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16)   # noqa: E731
  for mode in ("element", "block"):
    spec = codec.CodecSpec(mode, capacity_fraction=0.5)
    fmt = codec.patch_format((n,), jnp.bfloat16, spec)
    width = fmt.cache_width

    def exps(bits_N):
      return jnp.pad(bits.split_bits(bits_N, layout)[0], (0, width - n))

    prev_2xNP = jax.vmap(exps)(to_bits(before_2xN))
    now_2xN = to_bits(after_2xN)
    enc = jax.jit(lambda b, p: ops.encode(b, p, fmt, layout))
    enc_ref = jax.jit(lambda b, p: reference.encode(b, p, fmt, layout))
    got = [enc(now_2xN[d], prev_2xNP[d]) for d in range(2)]
    want = [enc_ref(now_2xN[d], prev_2xNP[d]) for d in range(2)]
    encode_exact = all(bool(jnp.all(a == b)) for g, w in zip(got, want)
                       for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w)))
    wire_2xL = jnp.stack([g.wire for g in got])
    me = jnp.int32(0)   # device 0 decodes: its cache row holds device 1's previous exponents
    dec = jax.jit(lambda c, w, o, m: ops.decode(c, w, o, m, fmt, layout))
    dec_ref = jax.jit(lambda c, w, o, m: reference.decode(c, w, o, m, fmt, layout))
    args = (prev_2xNP[1:], wire_2xL, got[0].exp, me)
    bits_2xN, cache = dec(*args)
    ref_bits, ref_cache = dec_ref(*args)
    fits = int(max(g.count(fmt) for g in got)) <= fmt.capacity
    copy = jax.jit(lambda x: x[::-1])
    out[mode] = {
        "encode_equals_reference": encode_exact,
        "decode_equals_reference": bool(jnp.all(bits_2xN == ref_bits))
        and bool(jnp.all(cache == ref_cache)),
        "patch_fits": fits,
        "round_trip_exact": fits and bool(jnp.all(bits_2xN == now_2xN)),
        "encode_s": _timed(enc, now_2xN[0], prev_2xNP[0]),
        "decode_s": _timed(dec, *args),
        "copy_s": _timed(copy, now_2xN[0]),
        "copy_bytes": 2 * n}
    if not (out[mode]["encode_equals_reference"] and out[mode]["decode_equals_reference"]
            and out[mode]["round_trip_exact"]):
      raise AssertionError(f"{mode}: kernels differ from the reference: {out[mode]}")
  return out


def step_ragged(dims: dict) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, PartitionSpec as P
  from moejax.placement import dispatch as dispatch_lib, experts

  n = len(jax.devices())
  t, k, d, f, e = dims["ragged_tokens"], 2, dims["ragged_d"], dims["ragged_f"], 2 * n
  keys = jax.random.split(jax.random.key(0), 6)
  x = jax.random.normal(keys[0], (n * t, d), jnp.bfloat16)
  ids = jax.random.randint(keys[1], (n * t, k), 0, e)
  weights = jnp.full((n * t, k), 0.5, jnp.float32)
  w = [jax.random.normal(keys[2 + i], s, jnp.bfloat16) * 0.05
       for i, s in enumerate(((e, d, f), (e, d, f), (e, f, d)))]
  mesh = Mesh(np.array(jax.devices()), ("devices",))
  dispatch = dispatch_lib.Dispatch(kind="ep", axis_names=("devices",), num_devices=n,
                                   devices_per_node=n)

  def body(*args):
    return dispatch_lib.ep_experts(*args, dispatch=dispatch)[0]

  ep = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("devices"),) * 6,
                             out_specs=P("devices"), check_vma=False))
  local = jax.jit(dispatch_lib.local_experts)
  y_ep, (y_local, _) = ep(x, ids, weights, *w), local(x, ids, weights, *w)
  ep_err = float(jnp.max(jnp.abs(y_ep - y_local)))
  packed = {}
  if jax.devices()[0].platform != "cpu":    # packed buffers: ragged_all_to_all, not on XLA:CPU
    packed_dispatch = dataclasses.replace(dispatch, packed=True)
    packed_ep = jax.jit(jax.shard_map(
        lambda *a: dispatch_lib.ep_experts(*a, dispatch=packed_dispatch)[0], mesh=mesh,
        in_specs=(P("devices"),) * 6, out_specs=P("devices"), check_vma=False))
    packed = {"ep_packed_max_abs_diff": float(jnp.max(jnp.abs(
                  packed_ep(x, ids, weights, *w) - y_local))),
              "ep_packed_s": _timed(packed_ep, x, ids, weights, *w)}

  # Grouped matmuls against a dense product of every row with its own expert (fp32).
  a = n * t * k
  group_sizes = jnp.bincount(jnp.sort(ids.reshape(-1)), length=e).astype(jnp.int32)
  xs = jnp.repeat(x, k, axis=0)[:a]
  grouped = jax.jit(experts.grouped_swiglu)
  y_grouped = grouped(xs, group_sizes, *w)
  y_dense = _dense_swiglu(xs, group_sizes, w)
  scale = float(jnp.max(jnp.abs(y_dense)))
  grouped_err = float(jnp.max(jnp.abs(y_grouped.astype(jnp.float32) - y_dense))) / scale
  # The static-capacity path (XLA:CPU's branch) on this platform: both timed (step-speed issue).
  static = jax.jit(experts._tiled_swiglu)
  y_static = static(xs, group_sizes, tuple(w))
  static_err = float(jnp.max(jnp.abs(y_static.astype(jnp.float32) - y_dense))) / scale
  # SparseAllGather (ragged on GPU): every device's one slot holds the next device's expert 0,
  # so each owner fills one slot: the send and gradient rows sized by that bound (owner_sends).
  from moejax.placement import fssdp
  fdispatch = dispatch_lib.Dispatch(kind="fssdp", axis_names=("devices",), num_devices=n,
                                    devices_per_node=n, replica_slots=1, owner_sends=1)
  replica_NxM = (2 * (jnp.arange(n) + 1) % e)[:, None].astype(jnp.int32)

  def spag_body(w_1xCxR):
    return fssdp.sparse_all_gather(w_1xCxR[0], replica_NxM, dispatch=fdispatch)[None]

  spag = jax.jit(jax.shard_map(spag_body, mesh=mesh, in_specs=P("devices"),
                               out_specs=P("devices"), check_vma=False))
  local_NxCxR = w[0].reshape(n, 2, d * f)          # device i owns experts 2i, 2i+1
  want = local_NxCxR[(jnp.arange(n) + 1) % n, 0][:, None]
  spag_exact = bool(jnp.all(spag(local_NxCxR) == want))
  coded = _coded_spag(mesh, fdispatch, replica_NxM, w, n, e)
  out = {"devices": n, "ep_max_abs_diff": ep_err, "spag_exact": spag_exact,
         "ep_s": _timed(ep, x, ids, weights, *w),
         "local_s": _timed(local, x, ids, weights, *w), "grouped_rel_err": grouped_err,
         "grouped_s": _timed(grouped, xs, group_sizes, *w), "grouped_static_rel_err": static_err,
         "grouped_static_s": _timed(static, xs, group_sizes, tuple(w)), **coded, **packed}
  if (ep_err > 1e-2 or packed.get("ep_packed_max_abs_diff", 0.0) > 1e-2
      or grouped_err > 2e-2 or static_err > 2e-2 or not spag_exact
      or not coded["coded_spag_exact"]
      or coded["coded_spag_patched_slots"] == 0):
    raise AssertionError(f"ragged paths differ from their references: {out}")
  return out


def _dense_swiglu(xs, group_sizes, w):
  """Each expert's rows (contiguous: sorted) through its weights, fp32, one expert at a time."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  ends = np.cumsum(np.asarray(group_sizes))
  parts = []
  for g, end in enumerate(ends):
    x32 = xs[end - int(np.asarray(group_sizes)[g]):end].astype(jnp.float32)
    wg, wu, wd = (v[g].astype(jnp.float32) for v in w)
    h = (jax.nn.silu(x32 @ wg) * (x32 @ wu)).astype(jnp.bfloat16).astype(jnp.float32)
    parts.append(h @ wd)
  rest = xs.shape[0] - int(ends[-1])
  return jnp.concatenate(parts + [jnp.zeros((rest, xs.shape[1]), jnp.float32)])


def _forward_backward(fn, args, dy, flops: float):
  """(output, gradients, figures) of `fn(*args)` and its VJP on `dy`, each jitted and timed;
  the backward counts twice the forward's `flops`."""
  import jax
  fwd = jax.jit(fn)
  bwd = jax.jit(lambda *a: jax.vjp(fn, *a)[1](dy))
  y, grads = fwd(*args), bwd(*args)
  fs, bs = _timed(fwd, *args, repeats=5), _timed(bwd, *args, repeats=5)
  return y, grads, {"forward_s": fs, "forward_backward_s": bs, "forward_tflops": flops / fs / 1e12,
                    "forward_backward_tflops": 3 * flops / bs / 1e12}


def step_grouped(dims: dict) -> dict:
  """The experts' grouped matmuls at OLMoE-1B-7B's expert shapes, forward and forward+backward,
  by each implementation on this platform: jax's Hopper kernels (`placement/hopper.py`; the GPU
  default where they apply), XLA's `ragged_dot` (rewritten by XLA:GPU into a dense dot over every
  expert), and the row tiles of XLA:CPU's path. Each against a dense per-expert product."""
  import jax
  import jax.numpy as jnp
  from moejax.placement import experts, hopper

  a, g, d, f = dims["grouped_rows"], dims["grouped_experts"], dims["grouped_d"], dims["grouped_f"]
  keys = jax.random.split(jax.random.key(1), 6)
  ids = jnp.sort(jax.random.randint(keys[0], (a,), 0, g))
  sizes = jnp.bincount(ids, length=g).astype(jnp.int32)
  x = jax.random.normal(keys[1], (a, d), jnp.float32).astype(jnp.bfloat16)
  w = [(jax.random.normal(k, s, jnp.float32) * 0.02).astype(jnp.bfloat16)
       for k, s in zip(keys[2:5], ((g, d, f), (g, d, f), (g, f, d)))]
  dy = jax.random.normal(keys[5], (a, d), jnp.float32).astype(jnp.bfloat16)
  want = _dense_swiglu(x, sizes, w)
  scale = float(jnp.max(jnp.abs(want)))
  flops = 6 * a * d * f
  out = {"rows": a, "experts": g, "d": d, "f": f, "forward_flops": flops,
         "hopper_usable": hopper.usable(x, *w)}
  impls = {"ragged_dot": lambda x, s, *w: experts._ragged_swiglu(x, s, w),
           "tiles": lambda x, s, *w: experts._tiled_swiglu(x, s, w)}
  if out["hopper_usable"]:
    impls = {"hopper": hopper.kernel_swiglu(d, f), **impls}
  grads = {}
  for name, fn in impls.items():
    try:
      y, grads[name], figures = _forward_backward(
          lambda x, *w, fn=fn: fn(x, sizes, *w), (x, *w), dy, flops)
      out[name] = {"rel_err": float(jnp.max(jnp.abs(y.astype(jnp.float32) - want))) / scale,
                   **figures}
    except Exception as e:   # one implementation failing (say out of memory) is a figure too
      out[name] = {"error": f"{type(e).__name__}: {e}"[:600]}
  if "hopper" in grads and "ragged_dot" in grads:
    out["hopper_grad_rel_err_vs_ragged_dot"] = max(
        float(jnp.max(jnp.abs(p.astype(jnp.float32) - q.astype(jnp.float32))))
        / max(float(jnp.max(jnp.abs(q.astype(jnp.float32)))), 1e-30)
        for p, q in zip(grads["hopper"], grads["ragged_dot"]))
  grad_err = out.get("hopper_grad_rel_err_vs_ragged_dot", 0.0)
  if out["hopper_usable"] and ("error" in out["hopper"] or out["hopper"]["rel_err"] > 2e-2
                               or grad_err > 2e-2):
    hopper.ENABLED = False   # the later steps train on the fallback; this step records why
    out["hopper_disabled_for_later_steps"] = True
  for name in impls:
    if "error" not in out[name] and out[name]["rel_err"] > 2e-2:
      raise AssertionError(f"grouped {name} differs from the dense product: {out[name]}")
  if grad_err > 2e-2:   # the kernels' backward (transpose_rhs, transposed_ragged_dot)
    raise AssertionError(f"Hopper gradients differ from ragged_dot's by {grad_err:.3g}")
  out["gpt_oss"] = _grouped_gpt_oss(dims)
  return out


def _grouped_gpt_oss(dims: dict) -> dict:
  """gpt-oss's experts (biases, the clamped SwiGLU, widths 2880: not multiples of the kernels'
  128, so zero-padded to 2944) by the Hopper op where it applies, against `ragged_dot`'s path of
  the same function: forward and gradients, and their times."""
  import jax
  import jax.numpy as jnp
  from moejax.placement import experts, hopper

  a, g, d = dims["gpt_oss_rows"], dims["gpt_oss_experts"], dims["gpt_oss_width"]
  fn = experts.ExpertFn("swiglu_clamped", bias=True)
  keys = jax.random.split(jax.random.key(2), 9)
  sizes = jnp.bincount(jnp.sort(jax.random.randint(keys[0], (a,), 0, g)), length=g)
  sizes = sizes.astype(jnp.int32)
  x = jax.random.normal(keys[1], (a, d), jnp.float32).astype(jnp.bfloat16)
  shapes = ((g, d, d), (g, d, d), (g, d, d), (g, d), (g, d), (g, d))
  ws = [(jax.random.normal(k, s, jnp.float32) * 0.02).astype(jnp.bfloat16)
        for k, s in zip(keys[2:8], shapes)]
  dy = jax.random.normal(keys[8], (a, d), jnp.float32).astype(jnp.bfloat16)
  flops = 6 * a * d * d
  out = {"rows": a, "experts": g, "width": d, "padded_width": hopper.padded_width(d),
         "hopper_usable": hopper.usable(x, *ws)}
  impls = {"ragged_dot": lambda x, *w: experts._ragged_swiglu(x, sizes, w, fn)}
  if out["hopper_usable"]:
    impls["hopper_padded"] = lambda x, *w: hopper.padded_call(
        lambda dd, ff: hopper.kernel_swiglu(dd, ff, fn), x, sizes, w)
  results = {}
  for name, impl in impls.items():
    try:
      y, grads, figures = _forward_backward(impl, (x, *ws), dy, flops)
      results[name] = (y, grads)
      out[name] = figures
    except Exception as e:   # a failure is a figure too
      out[name] = {"error": f"{type(e).__name__}: {e}"[:600]}
  if len(results) == 2:
    (y_h, g_h), (y_r, g_r) = results["hopper_padded"], results["ragged_dot"]
    rel = lambda p, q: float(jnp.max(jnp.abs(p.astype(jnp.float32) - q.astype(jnp.float32)))  # noqa: E731
                             / max(float(jnp.max(jnp.abs(q.astype(jnp.float32)))), 1e-30))
    out["hopper_rel_err_vs_ragged_dot"] = rel(y_h, y_r)
    out["hopper_grad_rel_err_vs_ragged_dot"] = max(rel(p, q) for p, q in zip(g_h, g_r))
    if max(out["hopper_rel_err_vs_ragged_dot"], out["hopper_grad_rel_err_vs_ragged_dot"]) > 2e-2:
      raise AssertionError(f"gpt-oss experts on the padded Hopper op differ from ragged_dot: "
                           f"{out}")
  return out


# Tile configurations the `tiles` step tries for jax's Hopper grouped-matmul kernels (block_m,
# block_n, block_k, max_concurrent_steps, grid_block_n); hopper.py's own are tried first.
_TILE_NAMES = ("block_m", "block_n", "block_k", "max_concurrent_steps", "grid_block_n")
RAGGED_TILE_TRIES = ((128, 128, 64, 4, 2), (128, 128, 64, 4, 4), (128, 128, 64, 6, 1),
                     (128, 256, 64, 3, 1), (64, 128, 64, 4, 1), (64, 256, 64, 4, 1),
                     (128, 128, 128, 3, 1), (192, 128, 64, 4, 1))
TRANSPOSED_TILE_TRIES = ((128, 128, 64, 4, 1), (128, 128, 128, 2, 1), (64, 128, 64, 4, 1),
                         (128, 128, 64, 4, 2), (128, 128, 64, 5, 4), (128, 64, 64, 4, 1))


def _tile_products(x, h, dy, gs, w_gate, w_down):
  """The grouped products of one SwiGLU forward and backward, each once, with how many times the
  VJP runs it: name -> (count, fn(ops) -> array). Letters as in placement/hopper.py."""
  return {
      "ragged_KD_NF": (2, lambda ops: ops.ragged(x, w_gate, gs)),             # gate, up
      "ragged_KF_ND": (1, lambda ops: ops.ragged(h, w_down, gs)),             # down
      "ragged_T_KD_NF": (1, lambda ops: ops.ragged(dy, w_down, gs, transpose=True)),   # dh
      "ragged_T_KF_ND": (2, lambda ops: ops.ragged(h, w_gate, gs, transpose=True)),    # dx
      "transposed_MD_NF": (2, lambda ops: ops.transposed(x, h, gs)),          # dw_gate, dw_up
      "transposed_MF_ND": (1, lambda ops: ops.transposed(h, dy, gs)),         # dw_down
  }


def step_tiles(dims: dict) -> dict:
  """jax's Hopper grouped-matmul kernels (`placement/hopper.py`) at other tile configurations, at
  OLMoE-1B-7B's expert shapes: each grouped product of the SwiGLU forward and backward timed per
  configuration, checked against hopper.py's own tiles' output, and the configuration with the
  least time over one forward+backward per kernel, which the later steps then use. Off a Hopper
  GPU the ragged kernel's configurations are only lowered for CUDA (what catches a bad argument
  before a GPU is spent on it)."""
  import jax
  import jax.numpy as jnp
  from moejax.placement import hopper

  a, g, d, f = dims["tiles_rows"], dims["tiles_experts"], dims["tiles_d"], dims["tiles_f"]
  keys = jax.random.split(jax.random.key(3), 6)
  gs = jnp.bincount(jax.random.randint(keys[0], (a,), 0, g), length=g).astype(jnp.int32)
  x, dy = (jax.random.normal(k, (a, d), jnp.float32).astype(jnp.bfloat16) for k in keys[1:3])
  h = jax.random.normal(keys[3], (a, f), jnp.float32).astype(jnp.bfloat16)
  w_gate, w_down = ((jax.random.normal(k, s, jnp.float32) * 0.02).astype(jnp.bfloat16)
                    for k, s in zip(keys[4:6], ((g, d, f), (g, f, d))))
  products = _tile_products(x, h, dy, gs, w_gate, w_down)
  run = hopper.usable(x, w_gate, w_gate, w_down)
  out = {"rows": a, "experts": g, "d": d, "f": f, "timed": run,
         "flops": {name: 2 * a * d * f for name in products}}
  own_ragged, own_transposed = hopper.tiles_for(d, f)
  for kind, own, tries in (("ragged", own_ragged, RAGGED_TILE_TRIES),
                           ("transposed", own_transposed, TRANSPOSED_TILE_TRIES)):
    if kind == "transposed" and not run:
      out[kind] = "not lowered off a GPU: the kernel reads the GPU's SM count while tracing"
      continue
    configs = [own] + [dict(zip(_TILE_NAMES, t)) for t in tries]
    names = [n for n in products if n.startswith(kind)]
    want = {}
    rows = []
    for config in configs:
      ops = (hopper.kernel_ops(ragged_tiles=config) if kind == "ragged"
             else hopper.kernel_ops(transposed_tiles=config))
      row = {"config": config}
      try:
        tiles = (config, own_transposed) if kind == "ragged" else (own_ragged, config)
        multiple = hopper.width_multiple(*tiles)
        if d % multiple or f % multiple:
          raise ValueError(f"d={d} and f={f} must be multiples of {multiple} at these tiles")
        for name in names:
          fn = jax.jit(lambda ops=ops, name=name: products[name][1](ops))
          if not run:
            text = fn.trace().lower(lowering_platforms=("cuda",)).as_text()
            assert "mosaic_gpu" in text, name
            continue
          y = fn().astype(jnp.float32)
          want.setdefault(name, y)     # the first configuration is hopper.py's own
          scale = max(float(jnp.max(jnp.abs(want[name]))), 1e-30)
          row[name] = {"s": _timed(fn, repeats=5),
                       "rel_err": float(jnp.max(jnp.abs(y - want[name]))) / scale}
        if run:
          row["fwd_bwd_s"] = sum(products[n][0] * row[n]["s"] for n in names)
          row["max_rel_err"] = max(row[n]["rel_err"] for n in names)
      except Exception as e:   # shared memory exceeded, say: that configuration's figure
        row["error"] = f"{type(e).__name__}: {e}"[:300]
      rows.append(row)
    out[kind] = rows
    good = [r for r in rows if "fwd_bwd_s" in r and r["max_rel_err"] < 1e-2]
    if good:
      best = min(good, key=lambda r: r["fwd_bwd_s"])
      out[f"{kind}_best"] = best["config"]
      if "fwd_bwd_s" in rows[0]:
        out[f"{kind}_best_speedup"] = rows[0]["fwd_bwd_s"] / best["fwd_bwd_s"]
      if best is not rows[0]:   # the later steps (layer, one_layer) run at the best tiles
        setattr(hopper, "RAGGED_TILES" if kind == "ragged" else "TRANSPOSED_TILES",
                best["config"])
        out[f"{kind}_best_applied_for_later_steps"] = True
    elif not run and any("error" in r for r in rows):
      raise AssertionError(f"{kind} tiles did not lower: {[r for r in rows if 'error' in r]}")
  return out


def step_attention(dims: dict) -> dict:
  """Causal attention at OLMoE-1B-7B's shapes (moejax's `layers.attention.attend`: XLA's
  materialized path) beside `jax.nn.dot_product_attention(implementation="cudnn")` (flash
  attention; GPU only), forward and forward+backward; and moejax's chunked attention (Llama 4's:
  chunks of a quarter of the sequence folded into the batch, so cuDNN's on GPU) beside XLA's
  path under the chunks' mask, whose outputs it must equal."""
  import jax
  import jax.numpy as jnp
  from moejax.layers import attention

  b, t, h, d = dims["attn_batch"], dims["attn_seq"], dims["attn_heads"], dims["attn_head_dim"]
  keys = jax.random.split(jax.random.key(2), 4)
  q, k, v, dy = (jax.random.normal(key, (b, t, h, d), jnp.float32).astype(jnp.bfloat16)
                 for key in keys)
  flops = 4 * b * h * t * t * d / 2      # causal: half the scores
  impls = {"xla": lambda q, k, v: attention.attend(q, k, v, is_causal=True)}
  if jax.default_backend() == "gpu":
    impls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, scale=d ** -0.5, implementation="cudnn")
  chunk = max(1, t // 4)
  positions = jnp.arange(t)
  in_chunk = ((positions[None, :] <= positions[:, None])
              & (positions[None, :] // chunk == positions[:, None] // chunk))[None, None]
  impls["chunked"] = lambda q, k, v: attention.attend(q, k, v, is_causal=True, chunk=chunk)
  impls["chunked_masked_xla"] = lambda q, k, v: attention.attend(q, k, v, mask=in_chunk)
  out = {"batch": b, "seq": t, "heads": h, "head_dim": d, "forward_flops": flops,
         "chunk": chunk}
  ys = {}
  for name, fn in impls.items():
    try:
      ys[name], _, out[name] = _forward_backward(
          fn, (q, k, v), dy, flops * chunk / t if name.startswith("chunked") else flops)
    except Exception as e:
      out[name] = {"error": f"{type(e).__name__}: {e}"[:600]}
  for name, (a, c) in (("cudnn", ("xla", "cudnn")),
                       ("chunked", ("chunked_masked_xla", "chunked"))):
    if a in ys and c in ys:
      out[f"{name}_max_abs_diff"] = float(jnp.max(jnp.abs(
          ys[a].astype(jnp.float32) - ys[c].astype(jnp.float32))))
  if "error" in out["chunked"]:     # moejax's own path: a failure is the step's
    raise RuntimeError(f"chunked attention: {out['chunked']['error']}")
  return out


def step_linear(dims: dict) -> dict:
  """Gated DeltaNet's rule (`layers.linear_attention`) at Qwen3-Next's linear-layer shapes (32
  value heads over 16 key heads of 128), fp32 operands: by chunks of 64 (the training path: one
  batched triangular solve, a scan across chunks) and token by token (the decoding path), forward
  and forward+backward, their outputs and gradients compared. At jax's default matmul precision
  (TF32 on Ampere and later GPUs: about 5e-4 apart, emulated on CPU at these shapes; under 1e-6
  in fp32), so the bound is 3e-3."""
  import jax
  import jax.numpy as jnp
  from moejax.layers import linear_attention as la

  b, t, (hk, hv), w = (dims["linear_batch"], dims["linear_seq"], dims["linear_heads"],
                       dims["linear_dim"])
  keys = jax.random.split(jax.random.key(3), 6)
  q, k = (jax.random.normal(key, (b, t, hk, w), jnp.float32) for key in keys[:2])
  v, dy = (jax.random.normal(key, (b, t, hv, w), jnp.float32) for key in keys[2:4])
  g = -jax.random.uniform(keys[4], (b, t, hv), jnp.float32, 0.0, 0.2)
  beta = jax.random.uniform(keys[5], (b, t, hv), jnp.float32)
  out = {"batch": b, "seq": t, "key_heads": hk, "value_heads": hv, "head_dim": w,
         "chunk": la.CHUNK}
  ys = {}
  for name, rule in (("chunks", la.gated_delta_rule), ("token", la.gated_delta_rule_by_token)):
    fn = lambda q, k, v, g, beta, rule=rule: rule(q, k, v, g, beta)[0]   # noqa: E731
    ys[name], grads, out[name] = _forward_backward(fn, (q, k, v, g, beta), dy, 0.0)
    ys[name] = (ys[name], grads)
    for key in ("forward_tflops", "forward_backward_tflops"):
      out[name].pop(key)
  scale = lambda x: float(jnp.max(jnp.abs(x)))    # noqa: E731
  out["max_rel_diff"] = max(
      float(jnp.max(jnp.abs(a - c))) / max(scale(c), 1e-30)
      for a, c in zip(jax.tree.leaves(ys["chunks"]), jax.tree.leaves(ys["token"])))
  out["token_over_chunks_forward_backward"] = (out["token"]["forward_backward_s"]
                                               / out["chunks"]["forward_backward_s"])
  out["matmul_precision"] = str(jax.config.jax_default_matmul_precision)
  if not out["max_rel_diff"] < 3e-3:
    raise AssertionError(f"chunked and token-by-token rules differ: {out['max_rel_diff']:.3g}")
  return out


def _coded_spag(mesh, fdispatch, replica_NxM, w, n: int, e: int) -> dict:
  """The replica codec's SparseAllGather (`fssdp.coded_sparse_all_gather`; ragged chunks on GPU):
  a first step sends plain, a second whose slots kept their experts (every value moved a unit
  in the last place) sends patches; both bit for bit the plain SparseAllGather's. Timed against
  it."""
  import dataclasses

  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P
  from moejax.codec import replicas
  from moejax.placement import fssdp

  codec = replicas.ReplicaCodec(sum(v[0].size for v in w), "bfloat16")
  dispatch = dataclasses.replace(fdispatch, replica_codec=codec)
  owners = fssdp.even_owners(e, n)
  state_specs = {"held": P(), "cache": P("devices"), "prev": P("devices"), "valid": P()}

  def body(ws, state):
    ws = tuple(v[0] for v in ws)
    state = {**state, "cache": state["cache"][0], "prev": state["prev"][0]}
    coding = fssdp.prepare_coding(ws, state, owners, codec, ("devices",))
    reps, choice = fssdp.coded_sparse_all_gather(ws, replica_NxM, coding, dispatch=dispatch,
                                                 owners=owners, codec=codec)
    return (replicas.to_bits(reps, codec.layout)[None], choice, coding.bits_CxR[None])

  def plain_body(ws):
    reps = tuple(fssdp.sparse_all_gather(v[0], replica_NxM, dispatch=dispatch, owners=owners)
                 for v in ws)
    return replicas.to_bits(reps, codec.layout)[None]

  coded = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("devices"), state_specs),
                                out_specs=(P("devices"), P(), P("devices")), check_vma=False))
  plain = jax.jit(jax.shard_map(plain_body, mesh=mesh, in_specs=P("devices"),
                                out_specs=P("devices"), check_vma=False))
  stored = lambda ws: tuple(v.reshape((n, 2) + v.shape[1:]) for v in ws)   # noqa: E731
  ws0 = stored(w)
  m = replica_NxM.shape[1]
  state = {"held": jnp.full((n, m), -1, jnp.int32),
           "cache": jnp.zeros((n, m, codec.values), jnp.uint16),
           "prev": jnp.zeros((n, 2, codec.values), jnp.uint16), "valid": jnp.zeros((), bool)}
  got0, choice0, prev = coded(ws0, state)
  nudge = lambda v: jax.lax.bitcast_convert_type(                           # noqa: E731
      jax.lax.bitcast_convert_type(v, jnp.uint16) + jnp.uint16(1), jnp.bfloat16)
  ws1 = tuple(nudge(v) for v in ws0)
  state = {"held": replica_NxM, "cache": got0, "prev": prev, "valid": jnp.ones((), bool)}
  got1, choice1, _ = coded(ws1, state)
  exact = bool(jnp.all(got0 == plain(ws0)) & jnp.all(got1 == plain(ws1)))
  return {"coded_spag_exact": exact, "coded_spag_patched_slots": int(jnp.sum(choice1 > 0)),
          "coded_spag_plain_first_step": int(jnp.sum(choice0 > 0)) == 0,
          "coded_spag_s": _timed(coded, ws1, state), "plain_spag_s": _timed(plain, ws1)}


def _config(preset: str, **overrides):
  sys.path.insert(0, REPO)
  from configs import olmoe
  from moejax.config import from_config_dict
  cd = olmoe.get_config(preset)
  cd.update_from_flattened_dict(overrides)
  return from_config_dict(cd)


_TRAINERS = {}   # config -> Trainer: the schedule step reads the train step's own compile


def _train(cfg) -> dict:
  from moejax.train import loop
  if cfg not in _TRAINERS:
    _TRAINERS[cfg] = loop.Trainer(cfg)
  trainer = _TRAINERS[cfg]
  with tempfile.TemporaryDirectory() as workdir:
    loop.run(cfg, workdir, trainer=trainer)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      records = [json.loads(line) for line in f if '"loss"' in line]
  times = [r["step_time_s"] for r in records if "step_time_s" in r][1:]   # the first compiles
  return {"steps": cfg.steps, "loss": [r["loss"] for r in records],
          "s_per_step": statistics.median(times) if times else None}


def _tiny_train_config(dims: dict):
  return _config("tiny", steps=dims["train_steps"], log_every=1, eval_every=dims["train_steps"],
                 **{"checkpoint.every": 0})


def step_train(dims: dict) -> dict:
  cfg = _tiny_train_config(dims)
  out = _train(cfg)
  if not out["loss"] or not out["loss"][-1] < out["loss"][0]:
    raise AssertionError(f"the tiny preset's loss did not fall: {out['loss']}")
  return out


def _one_layer_overrides(dims: dict) -> dict:
  return {"model.num_layers": 1, "batch_size": dims["layer_batch"], "seq_len": dims["layer_seq"],
          **dims["layer_model"]}


def step_one_layer(dims: dict) -> dict:
  import jax
  from moejax.placement import hopper
  cfg = _config(dims["layer_preset"], steps=5, log_every=1, eval_every=5,
                **{"checkpoint.every": 0, "data.tokenizer": "bytes", "data.val_fraction": 0.1},
                **_one_layer_overrides(dims))
  out = _train(cfg)
  if out["s_per_step"]:
    out["tokens_per_s"] = cfg.batch_size * cfg.seq_len / out["s_per_step"]
  stats = jax.devices()[0].memory_stats() or {}
  out["peak_bytes"] = stats.get("peak_bytes_in_use")
  out["hopper_kernels"] = hopper.ENABLED and str(hopper._compute_capability()).startswith("9")
  return out


def step_layer(dims: dict) -> dict:
  import jax
  import jax.numpy as jnp
  from moejax.models import olmoe
  out = {}
  for layers in (1, 2):
    over = dict(_one_layer_overrides(dims), **{"model.num_layers": layers,
                                              "data.tokenizer": "bytes"})
    cfg = _config(dims["layer_preset"], **over)
    params = jax.jit(lambda key: olmoe.init_params(cfg, key))(jax.random.key(0))
    tokens = jnp.zeros((cfg.batch_size, cfg.seq_len), jnp.int32)

    def loss(params, tokens):
      logits, _ = olmoe.forward(cfg, params, tokens, remat=cfg.remat)
      return jnp.mean(logits[..., 0])

    out[f"forward_s_{layers}"] = _timed(jax.jit(loss), params, tokens, repeats=5)
    out[f"backward_s_{layers}"] = _timed(jax.jit(jax.grad(loss)), params, tokens, repeats=5)
  out["layer_forward_s"] = out["forward_s_2"] - out["forward_s_1"]
  out["layer_forward_backward_s"] = out["backward_s_2"] - out["backward_s_1"]
  return out


def step_profile(dims: dict) -> dict:
  """Where one layer's forward+backward spends its device time: a one-layer model at the 1b7b
  shapes (random tokens) run under `jax.profiler.trace` (`moejax.profiling.profile`): each op's
  time from the trace, named by the compiled HLO's source lines, summed per source line."""
  import jax
  import jax.numpy as jnp
  from moejax import profiling
  from moejax.models import olmoe

  cfg = _config(dims["layer_preset"], **dict(_one_layer_overrides(dims),
                                             **{"data.tokenizer": "bytes"}))
  params = jax.jit(lambda key: olmoe.init_params(cfg, key))(jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (cfg.batch_size, cfg.seq_len), 0,
                              cfg.model.vocab_size)

  def loss(params, tokens):
    logits, _ = olmoe.forward(cfg, params, tokens, remat=cfg.remat)
    return jnp.mean(logits[..., 0])

  compiled = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
  return profiling.profile(compiled, (params, tokens), calls=dims["profile_calls"],
                           top=dims["profile_top"])


_ASYNC = re.compile(r"%([\w.\-]+) = .* ([a-z][a-z\-]*)-start\(")


def step_schedule(dims: dict) -> dict:
  from moejax.train.loop import Trainer
  cfg = _tiny_train_config(dims)
  if cfg not in _TRAINERS:
    _TRAINERS[cfg] = Trainer(cfg)
  trainer = _TRAINERS[cfg]
  text = trainer.train_step.lower(*trainer.abstract_inputs()).compile().as_text()
  return _async_pairs(text)


# A matmul kernel in XLA:GPU's compiled HLO: a GEMM fusion (cuBLAS or Triton), a library call
# (cuBLAS, cuDNN, a Pallas / Triton kernel), or an unfused dot. What an async collective can hide
# behind is these; the other instructions between its start and done are mostly small.
_MATMUL = re.compile(r"^\s*(ROOT )?%(gemm_fusion|cublas|cudnn|triton|custom-call|dot|convolution)"
                     r"|= \S+ (dot|convolution|custom-call)\(")


def _async_pairs(text: str) -> dict:
  """Async collectives' start/done pairs in compiled HLO text, what is scheduled between them
  (instructions; matmul kernels: the compute a collective actually hides behind), and the
  collectives that run synchronously (XLA:GPU turns a pair with nothing between into one)."""
  pairs, kernels = {}, {}
  for comp in text.split("\n\n"):
    lines = comp.splitlines()
    starts = {}
    for i, line in enumerate(lines):
      m = _ASYNC.search(line)
      if m:
        starts[m[1]] = (m[2], i)
      for name, (op, at) in list(starts.items()):
        if f"-done(%{name})" in line or f"-done({name})" in line:
          pairs.setdefault(op, []).append(i - at - 1)
          kernels.setdefault(op, []).append(sum(1 for b in lines[at + 1:i] if _MATMUL.search(b)))
          del starts[name]
  if REPO not in sys.path:
    sys.path.insert(0, REPO)
  from tests.sharding import hlo
  # a collective not split into start and done (its shape may be a tuple, with spaces)
  ops = sorted(hlo.COLLECTIVE_OPS, key=len, reverse=True)   # ragged-all-to-all before all-to-all
  sync = [m[1] for m in re.finditer(r"=\s.*?\s(" + "|".join(ops) + r")\(", text)]
  waiting = [c.op for c in hlo.loop_collectives_after_matmuls(text)]
  return {"async_pairs": {op: len(v) for op, v in pairs.items()},
          "instructions_between": {op: statistics.median(v) for op, v in pairs.items()},
          "matmuls_between": {op: statistics.median(v) for op, v in kernels.items()},
          "matmuls_between_max": {op: max(v) for op, v in kernels.items()},
          "sync_collectives": {op: sync.count(op) for op in sorted(set(sync))},
          "loop_collectives_after_matmuls": {op: waiting.count(op)
                                             for op in sorted(set(waiting))}}



# The 8-device variants of schedule8 (as tests/train/test_cuda_lowering.py lowers them).
SCHEDULE8 = {
    "fsdp": {},
    "fsdp_codec_element": {"codec.mode": "element", "codec.warmup_steps": 2},
    "fssdp_coded_replicas": {"moe.placement": "fssdp", "fssdp.replica_codec": "delta",
                             "moe.dispatch_capacity_factor": 0.0},
}
# Compiled again scheduled by moejax's latencies (config schedule_latencies="model"), as
# VARIANT+model_latencies: the codec step, whose collectives XLA's own estimate leaves
# synchronous.
SCHEDULE8_MODEL_LATENCIES = ("fsdp_codec_element",)


def step_schedule8(dims: dict) -> dict:
  """Runs `_schedule8_child` in a child process: on a GPU with jax's mock topology of 8 GPUs
  (one real, seven mocked: compile only), on CPU with this process's 8 fake devices. The child
  prints its figures after each variant, so a child stopped at the time limit still reports the
  variants it compiled (`incomplete`)."""
  import subprocess
  tries = {}
  deadline = time.monotonic() + dims["child_timeout_s"]
  env = _schedule8_env(dims)
  for mock in ((None,) if dims.get("dry") else ("topology", "processes")):
    left = deadline - time.monotonic()
    if left < 10:
      tries[str(mock)] = "not tried: no time left"
      continue
    # a dry run started its child with the run (main), to compile beside the other steps
    proc = _EARLY_CHILD.pop(str(mock), None) or _start_schedule8_child(mock, env)
    try:
      stdout, stderr = proc.communicate(timeout=left)
      code = proc.returncode
    except subprocess.TimeoutExpired:
      proc.kill()
      stdout, stderr = proc.communicate()
      code = f"stopped after {left:.0f} s"
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    result = json.loads(lines[-1]) if lines else None
    if result and result["devices"] == 8 and result.get("variants"):
      return {**result, "mock": mock, "other_tries": tries, "xla_flags": env.get("XLA_FLAGS", ""),
              "incomplete": code != 0 or len(result["variants"]) < len(SCHEDULE8) + len(
                  SCHEDULE8_MODEL_LATENCIES)}
    tries[str(mock)] = (f"child {code}: " + (f"{result['devices']} device(s); " if result else "")
                        + stderr[-1500:])
  raise RuntimeError(f"no 8-device compile: {tries}")


def _schedule8_env(dims: dict) -> dict:
  env = dict(os.environ)
  if not dims.get("dry"):   # the schedule is the figure, not the kernels: no autotuning
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
  return env


def _die_with_parent() -> None:
  """In the child: the kernel kills it when this process ends, however it ends (SIGTERM from a
  time limit runs no atexit), so a child started early never outlives the run."""
  import ctypes
  try:
    ctypes.CDLL(None, use_errno=True).prctl(1, 9)    # PR_SET_PDEATHSIG, SIGKILL (Linux)
  except (OSError, AttributeError):
    pass


def _start_schedule8_child(mock, env: dict):
  import subprocess
  return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--schedule8-child",
                           str(mock)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=env, preexec_fn=_die_with_parent)


# mock -> the schedule8 child a dry run started at its beginning (main)
_EARLY_CHILD: dict = {}


def _schedule8_child(mock: str) -> int:
  sys.path.insert(0, REPO)
  import jax
  if mock == "topology":       # 1 slice x 8 hosts x 1 GPU: the local GPU and 7 mocked ones
    jax.config.update("jax_mock_gpu_topology", "1x8x1")
  elif mock == "processes":
    jax.config.update("mock_num_gpu_processes", 8)
  out = {"devices": len(jax.devices()), "platform": jax.devices()[0].platform, "variants": {}}
  print(json.dumps(out), flush=True)
  if out["devices"] != 8:
    return 0
  from moejax.train.loop import Trainer
  from tests.sharding import hlo
  # (the dry run: fsdp's, a third of the codec step's compile on XLA:CPU: the path, not the figure)
  again = SCHEDULE8_MODEL_LATENCIES if out["platform"] == "gpu" else ("fsdp",)
  runs = [(name, overrides, "xla") for name, overrides in SCHEDULE8.items()] + [
      (f"{name}+model_latencies", SCHEDULE8[name], "model") for name in again]
  for name, overrides, latencies in runs:
    start = time.perf_counter()
    try:
      trainer = Trainer(_config("tiny", **overrides, schedule_latencies=latencies))
      priced = {}
      if latencies == "model":    # lowered once, compiled twice (moejax.train.latency_profile)
        lower_s = 0.0
        scheduled = trainer.train_step.compile(*trainer.abstract_inputs())
        text = scheduled.compiled.as_text()
        priced = {"priced_ms": {"xla": scheduled.xla.as_ms(3),
                                "model": scheduled.model.as_ms(3)},
                  "most_exposed": {"xla": scheduled.xla.most_exposed(),
                                   "model": scheduled.model.most_exposed()},
                  "profile_names_found": round(scheduled.names_found, 4)}
      else:
        lowered = trainer.train_step.trace(*trainer.abstract_inputs()).lower()
        lower_s = time.perf_counter() - start
        print(f"schedule8 child: {name} lowered in {lower_s:.1f} s", file=sys.stderr,
              flush=True)
        text = lowered.compile().as_text()
      if os.environ.get("OUT"):   # the compiled program itself, to read what the counts mean
        with gzip.open(os.path.join(os.environ["OUT"], f"schedule8_{name}.hlo.gz"), "wt") as f:
          f.write(text)
      branches = [b for b in hlo.conditional_branches(text) if b.collectives]
      ops = [m[1] for m in re.finditer(hlo._COLLECTIVE, text)]
      out["variants"][name] = {
          **_async_pairs(text), "collectives": {op: ops.count(op) for op in sorted(set(ops))},
          "collectives_in_conditional_branches": sum(len(b.collectives) for b in branches),
          "branches_with_collectives_and_dots": sum(1 for b in branches if b.dots), **priced,
          "lower_s": round(lower_s, 2), "compile_s": round(time.perf_counter() - start, 2)}
    except Exception as e:
      out["variants"][name] = {"error": f"{type(e).__name__}: {e}"[:1500]}
    print(json.dumps(out), flush=True)   # after each variant: a child stopped later keeps these
  return 0


def _nvcomp_payloads(n: int) -> dict:
  """Host byte buffers of the codec's payloads, from a bf16 shard (std 0.02, as initialized) and
  an update that moves about one value in eight by one or two units in the last place."""
  import numpy as np
  rng = np.random.default_rng(0)
  x = (rng.standard_normal(n) * 0.02).astype(np.float32)
  bits_N = (x.view(np.uint32) >> 16).astype(np.uint16)          # bf16 by truncation
  moved = rng.random(n) < 1 / 8
  step = rng.choice(np.array([-2, -1, 1, 2], np.int16), n)
  delta = np.where(moved, step, 0).astype(np.int16)
  return {"exponents": ((bits_N >> 7) & 0xFF).astype(np.uint8),
          "sign_mantissa": (((bits_N >> 8) & 0x80) | (bits_N & 0x7F)).astype(np.uint8),
          "delta_codes": delta[moved].view(np.uint8)}


def step_nvcomp(dims: dict) -> dict:
  import jax
  payloads = _nvcomp_payloads(dims["codec_values"])
  out = {"payload_bytes": {k: int(v.nbytes) for k, v in payloads.items()}}
  if jax.default_backend() != "gpu":
    out["skipped"] = "no GPU: the payload stays uncoded (nvCOMP runs on CUDA only)"
    return out
  try:
    import cupy as cp   # the GPU image carries it; the 'gpu' extra does not
    from nvidia import nvcomp
  except ImportError as e:
    out["skipped"] = f"{e} (nvCOMP's check needs cupy and nvidia-nvcomp)"
    return out

  def timed(fn, repeats=10):
    fn()
    cp.cuda.runtime.deviceSynchronize()
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      fn()
      cp.cuda.runtime.deviceSynchronize()
      times.append(time.perf_counter() - start)
    return statistics.median(times)

  out["nvcomp"] = getattr(nvcomp, "__version__", None)
  codec = nvcomp.Codec(algorithm="ANS")
  for name, host in payloads.items():
    x = cp.asarray(host)
    src = nvcomp.as_array(x)
    enc = codec.encode(src)
    dec = codec.decode(enc)
    back = cp.asarray(dec).reshape(-1).view(cp.uint8)
    exact = back.size == x.size and bool(cp.all(back == x))
    enc_s, dec_s = timed(lambda: codec.encode(src)), timed(lambda: codec.decode(enc))
    copy_s = timed(lambda: x.copy())
    saved = host.nbytes - int(enc.buffer_size)
    out[name] = {"round_trip_exact": exact, "raw_bytes": int(host.nbytes),
                 "coded_bytes": int(enc.buffer_size),
                 "ratio": host.nbytes / max(int(enc.buffer_size), 1),
                 "encode_s": enc_s, "decode_s": dec_s, "copy_s": copy_s,
                 # ANS saves time only on a link slower than this (bytes saved per second spent)
                 "pays_below_GBps": saved / (enc_s + dec_s) / 1e9 if saved > 0 else 0.0}
    if not exact:
      raise AssertionError(f"nvCOMP ANS round trip of {name} is not exact")
  return out


def step_planner(dims: dict) -> dict:
  """FSSDP's per-layer planning as a train step runs it on every device (`bench/planner.py`'s
  `layer_planning`: the replicas with and without last step's holders preferred, the re-plan
  from the actual counts, the balanced sends; sequential rounds of small kernels), at OLMoE's
  and DeepSeek-V3's expert counts: what it costs a layer on this device."""
  import jax
  import numpy as np
  from bench import planner as bench_planner

  out = {}
  for name, e, n, dpn, m, t in dims["planner_scales"]:
    args = bench_planner.inputs(e, n)
    fn = bench_planner.layer_planning(e, n, dpn, m, t, definition=False)
    first = jax.device_get(fn(*args))[0]
    out[name] = {"experts": e, "devices": n, "replica_slots": m, "overlap_degree": t,
                 "replicas": int(np.sum(first < e)),
                 "layer_s": _timed(fn, *args, repeats=dims["planner_repeats"])}
  return out


STEPS = {"env": step_env, "kernels": step_kernels, "ragged": step_ragged, "train": step_train,
         "one_layer": step_one_layer, "layer": step_layer, "schedule": step_schedule,
         "schedule8": step_schedule8, "nvcomp": step_nvcomp, "grouped": step_grouped,
         "attention": step_attention, "tiles": step_tiles, "profile": step_profile,
         "linear": step_linear, "planner": step_planner}
# The order of a full run: what only a GPU can tell first; `grouped` before the training steps
# (it checks the Hopper kernels' forward and backward, and turns them off for the later steps if
# they are wrong; XLA's ragged_dot there took about 2 minutes on an H200); the 8-GPU compile
# (its mock topology had not answered within 2 minutes there) last.
ORDER = ("env", "kernels", "ragged", "planner", "nvcomp", "grouped", "train", "one_layer", "layer",
         "profile", "attention", "linear", "schedule", "schedule8")
# Not in a full run (7.5 minutes of Mosaic GPU compiles on an H200): `--only tiles` (first, so the
# steps after it run at the best tiles).
FULL = {"codec_values": 1 << 24, "ragged_tokens": 4096, "ragged_d": 2048, "ragged_f": 1024,
        "train_steps": 20, "layer_preset": "1b7b", "layer_batch": 8, "layer_seq": 4096,
        "layer_model": {}, "child_timeout_s": 130, "grouped_rows": 16384, "grouped_experts": 64,
        "grouped_d": 2048, "grouped_f": 1024, "attn_batch": 8, "attn_seq": 4096, "attn_heads": 16,
        "attn_head_dim": 128, "tiles_rows": 16384, "tiles_experts": 64, "tiles_d": 2048,
        "tiles_f": 1024, "profile_calls": 3, "profile_top": 30, "gpt_oss_rows": 4096,
        "gpt_oss_experts": 8, "gpt_oss_width": 2880, "linear_batch": 1, "linear_seq": 4096,
        "linear_heads": (16, 32), "linear_dim": 128,
        "planner_scales": (("OLMoE, 4 x 8", 64, 32, 8, 2, 4),
                           ("DeepSeek-V3, 8 x 8", 256, 64, 8, 2, 4),
                           ("DeepSeek-V3, 8 x 8, M=4 t=16", 256, 64, 8, 4, 16)),
        "planner_repeats": 5}
# Tiny shapes (the tiny preset's width for the "1b7b" steps), on CPU.
DRY = {"codec_values": 1 << 14, "ragged_tokens": 32, "ragged_d": 64, "ragged_f": 64,
       "train_steps": 5, "layer_preset": "tiny", "layer_batch": 8, "layer_seq": 64,
       "layer_model": {}, "child_timeout_s": 240, "dry": True, "grouped_rows": 512,
       "grouped_experts": 8, "grouped_d": 128, "grouped_f": 128, "attn_batch": 2, "attn_seq": 64,
       "attn_heads": 4, "attn_head_dim": 32, "tiles_rows": 512, "tiles_experts": 8,
       "tiles_d": 512, "tiles_f": 512, "profile_calls": 2, "profile_top": 10, "gpt_oss_rows": 256,
       "gpt_oss_experts": 4, "gpt_oss_width": 96, "linear_batch": 1, "linear_seq": 130,
       "linear_heads": (2, 4), "linear_dim": 16,
       "planner_scales": (("tiny, 2 x 4", 8, 8, 4, 2, 4),), "planner_repeats": 2}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dry-run", action="store_true",
                      help="every step at tiny shapes on CPU (8 fake devices)")
  parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                    "device_check.json"))
  parser.add_argument("--only", nargs="*", choices=list(STEPS), default=None,
                      help=f"steps, in this order (default: {' '.join(ORDER)}; --dry-run adds "
                           "tiles, which a GPU run takes only when named)")
  parser.add_argument("--schedule8-child", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  sys.path.insert(0, REPO)
  _SHIMMED.append(_jax_triton_on_older_triton())
  if args.schedule8_child is not None:
    return _schedule8_child(args.schedule8_child)
  dims = DRY if args.dry_run else FULL
  report = {"dry_run": args.dry_run, "steps": {}}
  failed = []
  names = args.only or (ORDER + ("tiles",) if args.dry_run else ORDER)
  if args.dry_run and "schedule8" in names:
    # On CPU its compiles (about 50 s) run on the second core while the other steps run: the
    # dry run's time is CI's. (On a GPU the steps before it time kernels: it waits its turn.)
    _EARLY_CHILD["None"] = _start_schedule8_child(None, _schedule8_env(dims))
    atexit.register(lambda: [p.kill() for p in _EARLY_CHILD.values()])   # if never collected
  for name in names:
    start = time.perf_counter()
    print(f"device_check: {name} ...", flush=True)
    try:
      result = {"ok": True, **STEPS[name](dims)}
    except Exception as e:   # record it and go on: one broken step must not cost the others
      result = {"ok": False, "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(limit=8)}
      failed.append(name)
    result["seconds"] = round(time.perf_counter() - start, 2)
    report["steps"][name] = result
    print(f"device_check: {name} {'ok' if result['ok'] else 'FAILED: ' + result['error']} "
          f"({result['seconds']} s)", flush=True)
    with open(args.out, "w") as f:     # after every step: a run cut short keeps what it did
      json.dump(report, f, indent=1)
  print(f"device_check: wrote {args.out}; "
        + (f"failed: {', '.join(failed)}" if failed else "every step passed"))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
