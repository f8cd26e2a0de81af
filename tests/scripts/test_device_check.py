"""Pieces of scripts/device_check.py that a CPU dry run leaves unexercised: reading async
collective pairs out of a GPU-compiled program (XLA:CPU has none), and the references the GPU
steps compare against."""
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "device_check.py")
_spec = importlib.util.spec_from_file_location("device_check", _PATH)
device_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(device_check)

# The shape of XLA:GPU's scheduled HLO: async starts and dones with work between them.
_HLO = """\
ENTRY %main {
  %p0 = u32[8,64]{1,0} parameter(0)
  %ragged-all-to-all-start.1 = ((u32[64]{0}, u32[512]{0}), u32[512]{0}) ragged-all-to-all-start(%a, %b), replica_groups={}
  %fusion.1 = f32[64,64]{1,0} fusion(%p0), kind=kLoop
  %dot.2 = f32[64,64]{1,0} dot(%fusion.1, %fusion.1)
  %ragged-all-to-all-done.1 = u32[512]{0} ragged-all-to-all-done(%ragged-all-to-all-start.1)
  %all-gather-start = (u16[64]{0}, u16[512]{0}) all-gather-start(%c), dimensions={0}
  %all-gather-done = u16[512]{0} all-gather-done(%all-gather-start)
  %all-gather.3 = u16[512]{0} all-gather(%d), dimensions={0}
  %all-to-all.8 = (u16[64]{0}, u16[64]{0}) all-to-all(%d, %d), dimensions={0}
  %ragged-all-to-all.9 = u32[512]{0} ragged-all-to-all(%a, %b, %c, %d, %e, %f)
  %gemm_fusion_dot.4 = f32[64,64]{1,0} fusion(%p0, %p0), kind=kCustom, calls=%gemm
  %all-reduce-start.5 = f32[] all-reduce-start(%e), to_apply=%add
  %cublas-gemm.6 = (f32[64,64]{1,0}, s8[0]{0}) custom-call(%p0, %p0), custom_call_target="__cublas$gemm"
  %gemm_fusion_dot.7 = f32[64,64]{1,0} fusion(%p0, %p0), kind=kCustom, calls=%gemm
  %all-reduce-done.5 = f32[] all-reduce-done(%all-reduce-start.5)
}
"""


def test_async_pairs_name_the_whole_op_and_count_what_runs_between():
  got = device_check._async_pairs(_HLO)
  assert got["async_pairs"] == {"ragged-all-to-all": 1, "all-gather": 1, "all-reduce": 1}
  assert got["instructions_between"] == {"ragged-all-to-all": 2, "all-gather": 0,
                                         "all-reduce": 2}
  # the matmul kernels each pair hides behind: an unfused dot; none; a cuBLAS call and a GEMM
  # fusion (the fusion before the start is not between)
  assert got["matmuls_between"] == {"ragged-all-to-all": 1, "all-gather": 0, "all-reduce": 2}
  assert got["sync_collectives"] == {"all-gather": 1, "all-to-all": 1, "ragged-all-to-all": 1}
  assert got["loop_collectives_after_matmuls"] == {}        # no loop


def test_async_pairs_count_the_loop_collectives_that_wait_on_their_iteration_s_matmuls():
  body = """\
%body (p: (s32[], f32[64,64], f32[64,64])) -> (s32[], f32[64,64], f32[64,64]) {
  %p = (s32[], f32[64,64]{1,0}, f32[64,64]{1,0}) parameter(0)
  %w = f32[64,64]{1,0} get-tuple-element(%p), index=1
  %g = f32[64,64]{1,0} get-tuple-element(%p), index=2
  %reduce-scatter-start = (f32[64,64]{1,0}, f32[8,64]{1,0}) reduce-scatter-start(%g), dimensions={0}
  %gemm_fusion_dot.1 = f32[64,64]{1,0} fusion(%w, %w), kind=kCustom, calls=%gemm
  %reduce-scatter-done = f32[8,64]{1,0} reduce-scatter-done(%reduce-scatter-start)
  %all-reduce-start = (f32[64,64]{1,0}, f32[64,64]{1,0}) all-reduce-start(%gemm_fusion_dot.1), to_apply=%add
  %all-reduce-done = f32[64,64]{1,0} all-reduce-done(%all-reduce-start)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[64,64]{1,0}, f32[64,64]{1,0}) tuple(%i, %w, %all-reduce-done)
}

%gemm (a: f32[64,64], b: f32[64,64]) -> f32[64,64] {
  %a = f32[64,64]{1,0} parameter(0)
  %b = f32[64,64]{1,0} parameter(1)
  ROOT %dot = f32[64,64]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main {
  %init = (s32[], f32[64,64]{1,0}, f32[64,64]{1,0}) parameter(0)
  ROOT %while = (s32[], f32[64,64]{1,0}, f32[64,64]{1,0}) while(%init), condition=%cond, body=%body
}
"""
  got = device_check._async_pairs(body)
  # the reduce-scatter of the carried gradient can start with the iteration; the all-reduce of
  # the iteration's matmul waits for it
  assert got["loop_collectives_after_matmuls"] == {"all-reduce": 1}
  assert got["matmuls_between"]["reduce-scatter"] == 1


def test_dense_swiglu_is_each_expert_on_its_rows():
  keys = jax.random.split(jax.random.key(0), 4)
  sizes = jnp.array([3, 0, 5], jnp.int32)
  xs = jax.random.normal(keys[0], (10, 4), jnp.float32).astype(jnp.bfloat16)   # 2 rows unused
  w = [jax.random.normal(k, s, jnp.float32).astype(jnp.bfloat16)
       for k, s in zip(keys[1:], ((3, 4, 6), (3, 4, 6), (3, 6, 4)))]
  got = np.asarray(device_check._dense_swiglu(xs, sizes, w))
  expert = [0, 0, 0, 2, 2, 2, 2, 2]
  for row, g in enumerate(expert):
    x = xs[row].astype(jnp.float32)
    wg, wu, wd = (v[g].astype(jnp.float32) for v in w)
    h = (jax.nn.silu(x @ wg) * (x @ wu)).astype(jnp.bfloat16).astype(jnp.float32)
    np.testing.assert_allclose(got[row], np.asarray(h @ wd), rtol=1e-5, atol=1e-6)
  assert not got[8:].any()


def test_nvcomp_payloads_are_the_codec_planes():
  p = device_check._nvcomp_payloads(4096)
  assert p["exponents"].dtype == np.uint8 and p["exponents"].size == 4096
  assert p["sign_mantissa"].size == 4096
  assert 0 < p["delta_codes"].size < 2 * 4096 and p["delta_codes"].size % 2 == 0
  # weights ~N(0, 0.02): their exponents crowd a few values, which is what ANS codes
  assert len(np.unique(p["exponents"])) < 40

