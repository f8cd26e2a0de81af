"""Grouped SwiGLU experts and dense projections: the CPU implementations (row tiles, fp32
arithmetic) against the GPU/TPU ones (`lax.ragged_dot`, native bf16 matmuls), values and
gradients, and each platform's branch as lowered."""
import jax
import jax.numpy as jnp
import numpy as np
from jax import export

from moejax.layers import matmul
from moejax.placement import experts

BF16 = jnp.bfloat16


def _weights(key, g, d, f):
  k = jax.random.split(key, 3)
  w = lambda kk, shape: (0.2 * jax.random.normal(kk, shape)).astype(BF16)   # noqa: E731
  return w(k[0], (g, d, f)), w(k[1], (g, d, f)), w(k[2], (g, f, d))


def test_tiled_equals_ragged_values_and_grads():
  # Uneven groups, empty ones, many small ones (more groups than tiles of their rows), one
  # taking most rows, and rows left over past the groups' sum (dropped assignments: zeros).
  sizes = (7, 0, 13, 1, 0, 19) + (2,) * 60 + (90,)
  rows = sum(sizes) + 11
  g, d, f = len(sizes), 16, 24
  key = jax.random.key(rows)
  x = jax.random.normal(key, (rows, d)).astype(BF16)
  gs = jnp.asarray(sizes, jnp.int32)
  w = _weights(jax.random.fold_in(key, 1), g, d, f)
  cot = jax.random.normal(jax.random.fold_in(key, 2), (rows, d))

  def value_and_grads(fn):   # one compile per implementation
    def run(x, *w):
      y, vjp = jax.vjp(lambda x, *w: fn(x, gs, *w).astype(jnp.float32), x, *w)
      return y, vjp(cot)
    return jax.jit(run)(x, *w)

  y_ragged, g_ragged = value_and_grads(lambda x, gs, *w: experts._ragged_swiglu(x, gs, w))
  used = int(sum(sizes))
  # Both CPU kernels (the loop with its hand-written backward, the batched one by autodiff); the
  # loop also at a tile that pads most groups' rows several times over.
  for kernel, m in ((experts._looped, 16), (experts._looped, 64), (experts._batched, 16)):
    y_tiled, g_tiled = value_and_grads(lambda x, gs, *w, k=kernel, m=m: k(x, gs, w, m))
    assert not np.any(np.asarray(y_tiled[used:]))
    # Same products, fp32 sums in another order, one bf16 rounding: within a bf16 ulp or two.
    y_ragged_f32 = np.asarray(y_ragged, np.float32)
    np.testing.assert_allclose(np.asarray(y_tiled, np.float32), y_ragged_f32, rtol=8e-3,
                               atol=1e-3 * np.max(np.abs(y_ragged_f32)))
    for a, b in zip(g_tiled, g_ragged):
      a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
      np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2 * np.max(np.abs(b)))
  assert jax.eval_shape(experts._tiled_swiglu, x, gs, w).dtype == BF16


def test_run_sorted_is_per_row_expert():
  """run_sorted (CPU branch under jit) equals each row through its own expert, one by one."""
  rows, g, d, f = 37, 5, 8, 12
  key = jax.random.key(7)
  x = jax.random.normal(key, (rows, d)).astype(BF16)
  expert = np.random.default_rng(0).integers(0, g + 1, rows)   # g: no expert
  wg, wu, wd = _weights(jax.random.fold_in(key, 2), g, d, f)
  y = jax.jit(experts.run_sorted, static_argnums=2)(x, expert, g, wg, wu, wd)
  f32 = lambda a: np.asarray(a, np.float32)   # noqa: E731
  x, y, wg, wu, wd = map(f32, (x, y, wg, wu, wd))
  for r in range(rows):
    e = expert[r]
    if e == g:
      assert not np.any(f32(y[r]))
      continue
    gate, up = f32(x[r]) @ f32(wg[e]), f32(x[r]) @ f32(wu[e])
    h = (gate / (1 + np.exp(-gate)) * up).astype(jnp.bfloat16).astype(np.float32)
    want = h @ f32(wd[e])
    # one bf16 rounding of the output apart (an ulp is 2^-8 of the value)
    np.testing.assert_allclose(f32(y[r]), want, rtol=8e-3, atol=1e-3 * np.max(np.abs(want)))


CLAMPED = experts.ExpertFn("swiglu_clamped", alpha=1.702, limit=0.05, bias=True)


def test_clamped_swiglu_with_biases_every_kernel():
  """gpt-oss's experts (biases, a clamp the values cross: limit 0.05): each CPU kernel equals
  the ragged one, values and gradients (the biases' too), and run_sorted equals each row through
  its own expert, the torch formula written out in numpy."""
  sizes = (9, 0, 21, 3, 40)
  rows = sum(sizes) + 5
  g, d, f = len(sizes), 16, 24
  key = jax.random.key(3)
  x = jax.random.normal(key, (rows, d)).astype(BF16)
  gs = jnp.asarray(sizes, jnp.int32)
  b = [(0.05 * jax.random.normal(jax.random.fold_in(key, i), shape)).astype(BF16)
       for i, shape in enumerate(((g, f), (g, f), (g, d)))]
  w = (*_weights(jax.random.fold_in(key, 9), g, d, f), *b)
  cot = jax.random.normal(jax.random.fold_in(key, 10), (rows, d))

  def value_and_grads(fn):
    def run(x, w):
      y, vjp = jax.vjp(lambda x, w: fn(x, gs, w).astype(jnp.float32), x, w)
      return y, vjp(cot)
    return jax.jit(run)(x, w)

  y_ragged, (dx_ragged, dw_ragged) = value_and_grads(
      lambda x, gs, w: experts._ragged_swiglu(x, gs, w, CLAMPED))
  used = sum(sizes)
  assert not np.any(np.asarray(y_ragged[used:]))
  for kernel, m in ((experts._looped, 16), (experts._batched, 16)):
    y, (dx, dw) = value_and_grads(lambda x, gs, w, k=kernel, m=m: k(x, gs, w, m, CLAMPED))
    assert not np.any(np.asarray(y[used:]))
    for a, want in zip((y, dx, *dw), (y_ragged, dx_ragged, *dw_ragged)):
      a, want = np.asarray(a, np.float32), np.asarray(want, np.float32)
      assert np.any(want)
      np.testing.assert_allclose(a, want, rtol=1e-2, atol=1e-2 * np.max(np.abs(want)))

  expert = np.repeat(np.arange(g + 1), sizes + (5,))   # g: no expert
  perm = np.random.default_rng(1).permutation(rows)
  y = jax.jit(lambda x, e, *w: experts.run_sorted(x, e, g, *w, fn=CLAMPED))(
      x[perm], expert[perm], *w)
  f32 = lambda a: np.asarray(a, np.float32)   # noqa: E731
  xs, ws = f32(x[perm]), [f32(a) for a in w]
  for r in range(rows):
    e = expert[perm][r]
    if e == g:
      assert not np.any(f32(y[r]))
      continue
    gate = np.minimum(xs[r] @ ws[0][e] + ws[3][e], 0.05)
    up = np.clip(xs[r] @ ws[1][e] + ws[4][e], -0.05, 0.05)
    h = gate / (1 + np.exp(-1.702 * gate)) * (up + 1)
    want = h.astype(jnp.bfloat16).astype(np.float32) @ ws[2][e] + ws[5][e]
    np.testing.assert_allclose(f32(y[r]), want, rtol=8e-3, atol=1e-3 * np.max(np.abs(want)))
  gpu = _lowered(lambda x, gs, *w: experts.grouped_swiglu(x, gs, *w, fn=CLAMPED),
                 (x, gs, *w), "cuda")
  assert "ragged_dot" in gpu
  try:
    experts.grouped_swiglu(x, gs, *w[:3], fn=CLAMPED)
  except ValueError as e:
    assert "takes 6 expert arrays, got 3" in str(e)
  else:
    raise AssertionError("three arrays for a biased ExpertFn were taken")


def test_bf16_bias_gradients_sum_in_fp32_in_every_kernel():
  """Thousands of rows an expert in bf16: each kernel's bias gradients (the sum of an expert's
  rows) stay within bf16 rounding of an fp32 reference; gathered before their cast, they would
  be summed in bf16 (0.6 relative error measured for ragged_dot's, 0.03 for the batched tiles')."""
  sizes = (2048, 2048)
  rows, (g, d, f) = sum(sizes), (len(sizes), 16, 24)
  key = jax.random.key(11)
  x = jax.random.normal(key, (rows, d)).astype(BF16)
  gs = jnp.asarray(sizes, jnp.int32)
  b = [(0.05 * jax.random.normal(jax.random.fold_in(key, i), shape)).astype(BF16)
       for i, shape in enumerate(((g, f), (g, f), (g, d)))]
  w = (*_weights(jax.random.fold_in(key, 9), g, d, f), *b)
  cot = jax.random.normal(jax.random.fold_in(key, 10), (rows, d)).astype(BF16)
  fn = experts.ExpertFn("swiglu_clamped", bias=True)

  def bias_grads(kernel, x, w):
    _, vjp = jax.vjp(lambda w: kernel(x, gs, w), w)
    return [gr.astype(jnp.float32) for gr in vjp(cot.astype(x.dtype))[0][3:]]

  f32 = lambda a: a.astype(jnp.float32)   # noqa: E731
  want = jax.jit(lambda x, w: bias_grads(lambda x, gs, w: experts._ragged_swiglu(x, gs, w, fn),
                                         x, w))(f32(x), tuple(map(f32, w)))
  assert experts._batched_kernel(rows, g, packed=True)
  for kernel in (lambda x, gs, w: experts._ragged_swiglu(x, gs, w, fn),
                 lambda x, gs, w: experts._batched(x, gs, w, 128, fn),
                 lambda x, gs, w: experts._looped(x, gs, w, 128, fn)):
    got = jax.jit(lambda x, w, k=kernel: bias_grads(k, x, w))(x, w)
    for a, b_ in zip(got, want):
      a, b_ = np.asarray(a), np.asarray(b_)
      assert np.max(np.abs(a - b_)) <= 1e-2 * np.max(np.abs(b_))


def test_tile_rows_bounds():
  assert experts.tile_rows(4096, 8) == 128
  assert experts.tile_rows(2048, 128) == 16
  assert experts.tile_rows(10, 64) == 16
  assert experts.tile_rows(100, 3) == 32
  assert experts.tile_rows(512, 8) == 64
  # Packed rows from 256 a group take the batched kernel; an exchange buffer never does (it would
  # run over the buffer's empty slots), and its mean is only an upper bound.
  assert experts._batched_kernel(2048, 1, packed=True)
  assert not experts._batched_kernel(2048, 1, packed=False)
  assert experts.tile_rows(2048, 1, packed=False) == 128
  assert experts.tile_rows(192, 1, packed=False) == 128


def _lowered(fn, args, platform):
  return export.export(jax.jit(fn), platforms=[platform])(*args).mlir_module()


def test_each_platform_lowers_its_own_branch():
  """The GPU branch is the grouped matmul and native bf16 dots; the CPU branch tiles and widens.
  Lowered for CUDA here, on a machine without a GPU."""
  x = jnp.zeros((64, 16), BF16)
  gs = jnp.asarray([30, 0, 34], jnp.int32)
  w = _weights(jax.random.key(0), 3, 16, 24)
  gpu = _lowered(experts.grouped_swiglu, (x, gs, *w), "cuda")
  cpu = _lowered(experts.grouped_swiglu, (x, gs, *w), "cpu")
  assert "ragged_dot" in gpu and "ragged_dot" not in cpu
  dense_gpu = _lowered(lambda a, b: matmul.dense(a, b), (x, w[0][0]), "cuda")
  dense_cpu = _lowered(lambda a, b: matmul.dense(a, b), (x, w[0][0]), "cpu")
  dot = lambda text: [l for l in text.splitlines() if "stablehlo.dot_general" in l]   # noqa: E731
  assert all("bf16" in l for l in dot(dense_gpu)), dot(dense_gpu)
  assert dot(dense_cpu) and not any("bf16" in l.split("->")[0] for l in dot(dense_cpu))


def test_dense_matches_native_within_rounding():
  key = jax.random.key(3)
  x = jax.random.normal(key, (32, 48)).astype(BF16)
  w = jax.random.normal(jax.random.fold_in(key, 1), (48, 40)).astype(BF16)
  widened = jax.jit(lambda a, b: matmul.dense(a, b))(x, w)
  native = matmul._native(x, w, BF16)
  assert widened.dtype == BF16
  native = np.asarray(native, np.float32)
  np.testing.assert_allclose(np.asarray(widened, np.float32), native, rtol=4e-3,
                             atol=1e-3 * np.max(np.abs(native)))   # an ulp of bf16: 2^-8
  assert matmul.dense(x, w, jnp.float32).dtype == jnp.float32
