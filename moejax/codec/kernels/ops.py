"""Public encode/decode ops of the codec's wire: Triton kernels on CUDA, the pure-jnp reference
everywhere else, chosen per platform at lowering time by `lax.platform_dependent`.

encode(bits_N, prev_NP, fmt, layout) -> Encoded(exp [NP] u8, wire [L] u32, value_changes,
  block_changes): split exponent / sign+mantissa, detect changed values and blocks (exact
  comparison with the previous exponents), compact the first C changed units into the patch and
  count them (over `fmt.capacity` the caller falls back to the dense path).
decode(cache_RxNP, wire_WxL, own_NP, me, fmt, layout) -> (bits [W, N], cache [R, NP]): apply
  every other device's patch to its cache row (row r belongs to device r + (r >= me)) and merge
  the exponents with the sign+mantissa; device `me` uses `own_NP`.

Both equal `reference.encode` / `reference.decode` bit for bit on every platform. Under `jit`
both branches are traced, also on CPU; the CUDA branch imports jax-triton (the `gpu` extra) only
when it is traced, and falls back to the reference when jax-triton cannot be imported, with a
one-time warning if a GPU backend is present. Neither op has a derivative (they move bits).

Letters: N values, NP cached exponents, R = W - 1 cached rows, W devices, L wire words.
"""
from __future__ import annotations

import functools
import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from moejax.codec import bits
from moejax.codec import payload
from moejax.codec.kernels import reference
from moejax.codec.kernels.geometry import Geometry
from moejax.codec.kernels.reference import Encoded


def encode(bits_N: jax.Array, prev_NP: jax.Array, fmt: payload.Format,
           layout: bits.Layout) -> Encoded:
  """See the module docstring. `bits_N` holds the shard's bit patterns (layout.uint_dtype)."""
  g = Geometry.of(fmt, layout)
  _expect("bits_N", bits_N, (g.n,), layout.uint_dtype)
  _expect("prev_NP", prev_NP, (g.cache_width,), np.uint8)
  return lax.platform_dependent(
      bits_N, prev_NP,
      cuda=functools.partial(_encode_triton, fmt=fmt, layout=layout),
      default=functools.partial(reference.encode, fmt=fmt, layout=layout))


def decode(cache_RxNP: jax.Array, wire_WxL: jax.Array, own_NP: jax.Array, me: jax.Array,
           fmt: payload.Format, layout: bits.Layout) -> tuple[jax.Array, jax.Array]:
  """See the module docstring. `me` is this device's index on the gathered axis (int32)."""
  g = Geometry.of(fmt, layout)
  if wire_WxL.ndim != 2:
    raise ValueError(f"wire_WxL must be [W, L], got shape {wire_WxL.shape}")
  w = wire_WxL.shape[0]
  _expect("wire_WxL", wire_WxL, (w, g.wire_words), np.uint32)
  _expect("cache_RxNP", cache_RxNP, (w - 1, g.cache_width), np.uint8)
  _expect("own_NP", own_NP, (g.cache_width,), np.uint8)
  me = jnp.asarray(me, jnp.int32)
  _expect("me", me, (), np.int32)
  default = functools.partial(reference.decode, fmt=fmt, layout=layout)
  if w == 1:   # nothing to patch
    return default(cache_RxNP, wire_WxL, own_NP, me)
  return lax.platform_dependent(
      cache_RxNP, wire_WxL, own_NP, me,
      cuda=functools.partial(_decode_triton, fmt=fmt, layout=layout), default=default)


def _expect(name, x, shape, dtype):
  if tuple(x.shape) != tuple(shape) or np.dtype(x.dtype) != np.dtype(dtype):
    raise ValueError(f"{name} must be {np.dtype(dtype).name}{list(shape)}, got "
                     f"{np.dtype(x.dtype).name}{list(x.shape)}")


# ----------------------------------------------------------------------------------------------
# The CUDA branch.


@functools.cache
def _triton_backend():
  """(jax_triton, triton_src), or None when the GPU extra is not usable here."""
  try:
    import jax_triton  # the 'gpu' extra
    from moejax.codec.kernels import triton_src  # imports triton
  except Exception as e:  # ImportError, or jax-triton's error on a jaxlib without GPU support
    if jax.default_backend() == "gpu":
      warnings.warn(f"moejax.codec.kernels: jax-triton is not usable ({type(e).__name__}: {e}); "
                    "the codec runs its jnp reference on GPU. Install the 'gpu' extra for the "
                    "Triton kernels.", RuntimeWarning, stacklevel=3)
    return None
  return jax_triton, triton_src


def _run_plan(plan, buffers: dict) -> dict:
  jt, _ = _triton_backend()
  params = inspect.signature(jt.triton_call).parameters
  out_kw = "out_type" if "out_type" in params else "out_shape"
  buffers = dict(buffers)
  for launch in plan:
    out = [jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)) for _, shape, dtype in launch.outputs]
    results = jt.triton_call(*[buffers[name] for name in launch.inputs], kernel=launch.kernel,
                             grid=launch.grid, **{out_kw: out}, **launch.params)
    if not isinstance(results, (list, tuple)):
      results = [results]
    for (name, _, _), value in zip(launch.outputs, results, strict=True):
      buffers[name] = value
  return buffers


def _encode_triton(bits_N, prev_NP, *, fmt, layout) -> Encoded:
  if _triton_backend() is None:
    return reference.encode(bits_N, prev_NP, fmt, layout)
  _, triton_src = _triton_backend()
  out = _run_plan(triton_src.encode_plan(Geometry.of(fmt, layout)),
                  {"bits": bits_N, "prev": prev_NP})
  return Encoded(out["exp"], out["wire"], out["total"][0], out["total"][1])


def _decode_triton(cache_RxNP, wire_WxL, own_NP, me, *, fmt, layout):
  if _triton_backend() is None:
    return reference.decode(cache_RxNP, wire_WxL, own_NP, me, fmt, layout)
  _, triton_src = _triton_backend()
  plan = triton_src.decode_plan(Geometry.of(fmt, layout), wire_WxL.shape[0])
  out = _run_plan(plan, {"cache": cache_RxNP, "wire": wire_WxL, "own": own_NP,
                         "me": me.reshape(1)})
  return out["bits"], out["new_cache"]
