"""The Hopper experts' VJP (moejax/placement/hopper.py), on CPU with `lax.ragged_dot` standing in
for jax's Mosaic GPU kernels: value and gradients equal autodiff of the same products, rows past
the groups come out zero; the kernels' forward lowers for CUDA here, and forward and backward
through `experts.grouped_swiglu` for a named Hopper target (a deviceless compile's). The kernels
themselves run in scripts/device_check.py (`grouped`) on an H200."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.placement import expert_fn, experts, hopper

A, D, F, G = 96, 128, 128, 4


def _inputs(pad_rows: int = 0):
  keys = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(keys[0], (A, D), jnp.float32).astype(jnp.bfloat16)
  sizes = np.array([30, 0, 41, A - 71 - pad_rows], np.int32)
  w = [(jax.random.normal(k, s, jnp.float32) * 0.1).astype(jnp.bfloat16)
       for k, s in zip(keys[1:4], ((G, D, F), (G, D, F), (G, F, D)))]
  dy = jax.random.normal(keys[4], (A, D), jnp.float32).astype(jnp.bfloat16)
  return x, jnp.asarray(sizes), w, dy


def _autodiff_swiglu(x, gs, wg, wu, wd):
  ops = hopper.reference_ops()
  used = (jnp.arange(x.shape[0]) < jnp.sum(gs))[:, None]
  gate, up = ops.ragged(x, wg, gs), ops.ragged(x, wu, gs)
  h = jnp.where(used, jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32), 0)
  return jnp.where(used, ops.ragged(h.astype(x.dtype), wd, gs), 0).astype(x.dtype)


def _value_and_grads(fn, x, gs, w, dy):
  y, vjp = jax.vjp(lambda x, *w: fn(x, gs, *w), x, *w)
  return y, vjp(dy)


@pytest.mark.parametrize("pad_rows", [0, 25])
def test_vjp_equals_autodiff_of_the_same_products(pad_rows):
  x, gs, w, dy = _inputs(pad_rows)
  if pad_rows:   # an exchange buffer's empty slots: whatever they hold must not leak
    x = x.at[A - pad_rows:].set(1e4)
  swiglu = jax.jit(hopper.swiglu_with(hopper.reference_ops()))
  y, grads = _value_and_grads(swiglu, x, gs, w, dy)
  y_ref, grads_ref = _value_and_grads(jax.jit(_autodiff_swiglu), x, gs, w, dy)
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
  for name, g, g_ref in zip(("x", "w_gate", "w_up", "w_down"), grads, grads_ref):
    g, g_ref = np.asarray(g, np.float32), np.asarray(g_ref, np.float32)
    scale = np.max(np.abs(g_ref))
    assert scale > 0, name
    # bf16 rounding of dgate/dup before the products (autodiff rounds at the same casts)
    assert np.max(np.abs(g - g_ref)) <= 2e-3 * scale, name
  if pad_rows:
    assert not np.any(np.asarray(y[A - pad_rows:], np.float32))
    assert not np.any(np.asarray(grads[0][A - pad_rows:], np.float32))


def test_kernels_not_used_off_hopper():
  x, _, w, _ = _inputs()
  assert jax.devices()[0].platform == "cpu"
  assert not hopper.usable(x, *w)


def test_a_named_target_lowers_both_kernels_forward_and_backward():
  from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu
  x, gs, w, dy = _inputs()

  def loss(x, *w):
    y = experts.grouped_swiglu(x, gs, *w)
    return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

  def cuda_text():
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(x, *w).lower(
        lowering_platforms=("cuda",)).as_text()

  # no GPU here: CUDA's branch takes ragged_dot, whose XLA:GPU rewrite is dense over every expert
  assert "mosaic_gpu" not in cuda_text()
  with hopper.lowering_for(hopper.Target("9.0", 132)):
    assert hopper.usable(x, *w)
    text = cuda_text()
  calls = re.findall(r"custom_call @mosaic_gpu\w*\(.*-> (tensor<[^>]*>)", text)
  # the weight gradients: the transposed kernel, [G, D, F] / [G, F, D] out
  assert sum(t in (f"tensor<{G}x{D}x{F}xbf16>", f"tensor<{G}x{F}x{D}xbf16>") for t in calls) == 3
  assert len(calls) >= 8, calls   # with the forward's 3 and the rows' gradients
  assert "ragged_dot" not in text
  assert not hopper.usable(x, *w)                      # the target ends with the block
  assert transposed_ragged_dot_mgpu.jax is jax         # and jax is the kernel module's own again
  with hopper.lowering_for(hopper.Target("8.0", 108)):  # an A100 takes no Hopper kernels
    assert not hopper.usable(x, *w)


def test_kernel_forward_lowers_for_cuda():
  x, gs, w, _ = _inputs()
  text = jax.jit(hopper.kernel_swiglu(D, F)).trace(x, gs, *w).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("mosaic_gpu") >= 3   # gate, up, down: one kernel call each


def test_tuned_tiles_where_the_widths_take_them():
  assert hopper.tiles_for(2048, 1024) == (hopper.RAGGED_TILES, hopper.TRANSPOSED_TILES)
  assert hopper.tiles_for(2048, 1408) == (hopper.BASE_RAGGED_TILES, hopper.BASE_TRANSPOSED_TILES)
  x = jnp.zeros((256, 512), jnp.bfloat16)
  w = jnp.zeros((4, 512, 512), jnp.bfloat16)
  gs = jnp.array([64, 64, 64, 64], jnp.int32)
  text = jax.jit(hopper.kernel_swiglu(512, 512)).trace(x, gs, w, w, w).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("mosaic_gpu") >= 3


CLAMPED = experts.ExpertFn("swiglu_clamped", alpha=1.702, limit=0.2, bias=True)


def _biases(g, d, f, key=7):
  keys = jax.random.split(jax.random.key(key), 3)
  return [(jax.random.normal(k, s, jnp.float32) * 0.1).astype(jnp.bfloat16)
          for k, s in zip(keys, ((g, f), (g, f), (g, d)))]


def _autodiff_clamped(x, gs, wg, wu, wd, bg, bu, bd):
  """The same products as the Hopper op, biases added in fp32, by autodiff."""
  ops = hopper.reference_ops()
  used = (jnp.arange(x.shape[0]) < jnp.sum(gs))[:, None]
  group = expert_fn.row_groups(gs, x.shape[0])
  f32 = lambda a: a.astype(jnp.float32)   # noqa: E731
  gate = f32(ops.ragged(x, wg, gs)) + f32(bg[group])
  up = f32(ops.ragged(x, wu, gs)) + f32(bu[group])
  h = jnp.where(used, CLAMPED.act(gate, up), 0).astype(x.dtype)
  y = f32(ops.ragged(h, wd, gs)) + f32(bd[group])
  return jnp.where(used, y, 0).astype(x.dtype)


def test_clamped_biased_vjp_equals_autodiff_and_padding_is_exact():
  """gpt-oss's experts on the Hopper op: values equal autodiff of the same products, gradients
  (the biases' summed per expert) within bf16 rounding, rows past the groups zero; its widths
  (2880) are not multiples of the kernels' 128, so they are zero-padded (`padded_call`), which
  gives the unpadded op's values and gradients (here D = F = 100 padded to 128)."""
  pad_rows = 25
  x, gs, w, dy = _inputs(pad_rows)
  x = x.at[A - pad_rows:].set(1e4)
  ws = (*w, *_biases(G, D, F))
  swiglu = jax.jit(hopper.swiglu_with(hopper.reference_ops(), CLAMPED))
  y, grads = _value_and_grads(swiglu, x, gs, ws, dy)
  # (the reference's biases in fp32: autodiff would sum their gradients in bf16, the op in fp32)
  ws_ref = (*ws[:3], *(b.astype(jnp.float32) for b in ws[3:]))
  y_ref, grads_ref = _value_and_grads(jax.jit(_autodiff_clamped), x, gs, ws_ref, dy)
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
  assert not np.any(np.asarray(y[A - pad_rows:], np.float32))
  for name, g, g_ref in zip(("x", "w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down"),
                            grads, grads_ref):
    g, g_ref = np.asarray(g, np.float32), np.asarray(g_ref, np.float32)
    scale = np.max(np.abs(g_ref))
    assert scale > 0, name
    assert np.max(np.abs(g - g_ref)) <= 4e-3 * scale, name

  d, f = 100, 100
  xs, ws_small, dys = x[:, :d], tuple(a[..., :d] if i in (2, 5) else a for i, a in enumerate(
      (ws[0][:, :d, :f], ws[1][:, :d, :f], ws[2][:, :f, :d], ws[3][:, :f], ws[4][:, :f],
       ws[5][:, :d]))), dy[:, :d]
  op = hopper.swiglu_with(hopper.reference_ops(), CLAMPED)
  padded = jax.jit(lambda x, gs, *w: hopper.padded_call(lambda d, f: op, x, gs, w))
  assert hopper.padded_width(d) == 128
  y_p, grads_p = _value_and_grads(padded, xs, gs, ws_small, dys)
  y_u, grads_u = _value_and_grads(jax.jit(op), xs, gs, ws_small, dys)
  for a, b in zip((y_p, *grads_p), (y_u, *grads_u)):
    assert a.shape == b.shape
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, rtol=0, atol=8e-3 * np.max(np.abs(b)))


def test_clamped_kernel_forward_lowers_for_cuda():
  x, gs, w, _ = _inputs()
  ws = (*w, *_biases(G, D, F))
  text = jax.jit(hopper.kernel_swiglu(D, F, CLAMPED)).trace(x, gs, *ws).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("mosaic_gpu") >= 3
