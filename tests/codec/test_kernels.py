"""Codec kernels: the public encode/decode ops equal the payload format bit for bit, and the
Triton kernels equal them too.

On CPU the ops take the pure-jnp reference (`lax.platform_dependent`); they must produce exactly
`[pack_bits(sign+mantissa)] + payload.encode(...)` and undo it with `payload.decode` and
`bits.merge_bits`, and `decode(encode(x)) == x` for every bit pattern (NaN payloads, +-Inf,
subnormals, -0.0). The numpy oracle of the Triton tests (`host_reference`) must equal them as
well. The Triton kernels run in the Python 3.11 side environment, under Triton's interpreter
against that oracle and through Triton's CUDA compiler (`test_triton_kernels`, marker
`triton_interpret`; set up with `scripts/setup_triton_env.sh`).
"""
import functools
import importlib
import inspect
import os
import pathlib
import subprocess
import sys
import types
import warnings
import zlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import export

from moejax.codec import bits
from moejax.codec import detect
from moejax.codec import kernels
from moejax.codec import payload
from moejax.codec.kernels import geometry
from moejax.codec.kernels import host_reference
from moejax.codec.kernels import ops
from moejax.codec.kernels import reference

ROOT = pathlib.Path(__file__).resolve().parents[2]
W = 3
DTYPES = {"bfloat16": jnp.bfloat16, "float16": np.float16, "float32": np.float32}
CONFIGS = [  # (mode, dtype, n, block_size, capacity fraction)
    ("element", "bfloat16", 1000, 64, 0.02),
    ("element", "float16", 333, 32, 0.1),
    ("element", "float32", 70, 16, 1.0),
    ("block", "bfloat16", 1000, 64, 0.25),
    ("block", "float16", 650, 100, 0.3),
    ("block", "float32", 333, 32, 0.5),
]
SPECIALS = {  # NaN payloads, +-Inf, +-0, subnormals, +-max finite
    16: [0x7FC1, 0xFF81, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x807F, 0x7F7F, 0xFC01, 0x7E00,
         0x03FF, 0x7C00],
    32: [0x7FC00001, 0xFF800001, 0x7F800000, 0xFF800000, 0x0, 0x80000000, 0x1, 0x807FFFFF,
         0x7F7FFFFF],
}


def _format(config):
  mode, dtype, n, block_size, fraction = config
  layout = bits.layout_of(DTYPES[dtype])
  return payload.Format.create(mode, n, layout.exp_bits, block_size, fraction), layout


def _bits(fmt, layout, rng):
  width = layout.total_bits
  x = rng.integers(0, 2**width, size=fmt.n, dtype=np.uint64).astype(layout.uint_dtype)
  specials = np.array(SPECIALS[width], np.uint64).astype(layout.uint_dtype)
  k = min(fmt.n, 2 * specials.size)
  x[rng.choice(fmt.n, size=k, replace=False)] = np.resize(specials, k)
  return x


def _exponents(fmt, layout, bits_N):
  exp = np.zeros(fmt.cache_width, np.uint8)
  exp[:fmt.n] = np.asarray(bits.split_bits(jnp.asarray(bits_N), layout)[0])
  return exp


def _changed(fmt, layout, exp, rng, units):
  """A copy of `exp` whose exponents differ in `units` random units (blocks or values)."""
  out = exp.copy()
  if fmt.mode == "block":
    blocks = rng.choice(fmt.num_blocks, size=min(units, fmt.num_blocks), replace=False)
    idx = np.minimum(blocks * fmt.block_size + rng.integers(0, fmt.block_size, blocks.size),
                     fmt.n - 1)
  else:
    idx = rng.choice(fmt.n, size=min(units, fmt.n), replace=False)
  out[idx] ^= rng.integers(1, 2**layout.exp_bits, size=idx.size).astype(np.uint8)
  return out


@functools.partial(jax.jit, static_argnames=("fmt", "layout"))
def _payload_encode(bits_N, prev_NP, fmt, layout):
  """The wire from the codec's building blocks: packed sign+mantissa, then the payload patch."""
  exp_N, rest_N = bits.split_bits(bits_N, layout)
  exp_NP = jnp.pad(exp_N, (0, fmt.cache_width - fmt.n))
  changed_NP = exp_NP != prev_NP
  changed_NB = jnp.any(detect.block_view(changed_NP, fmt.block_size), axis=1)
  patch_P, count = payload.encode(exp_NP, changed_NB if fmt.mode == "block" else changed_NP, fmt)
  wire_L = jnp.concatenate([bits.pack_bits(rest_N, layout.rest_bits), patch_P])
  return exp_NP, wire_L, jnp.sum(changed_NP), jnp.sum(changed_NB), count


@functools.partial(jax.jit, static_argnames=("me", "fmt", "layout"))
def _payload_decode(cache_RxNP, wire_WxL, own_NP, me, fmt, layout):
  """Each other device's patch through payload.decode, then bits.merge_bits."""
  rest_words = bits.packed_words(fmt.n, layout.rest_bits)
  others = [d for d in range(wire_WxL.shape[0]) if d != me]
  cache_RxNP = payload.decode(cache_RxNP, wire_WxL[np.array(others), rest_words:], fmt)
  rows = [own_NP if d == me else cache_RxNP[others.index(d)] for d in range(wire_WxL.shape[0])]
  rest_WxN = bits.unpack_bits(wire_WxL[:, :rest_words], layout.rest_bits, fmt.n)
  return bits.merge_bits(jnp.stack(rows)[:, :fmt.n], rest_WxN, layout), cache_RxNP


@functools.partial(chex.assert_max_traces, n=len(CONFIGS))
def _ops_encode_impl(bits_N, prev_NP, fmt, layout):
  return kernels.encode(bits_N, prev_NP, fmt, layout)


@functools.partial(chex.assert_max_traces, n=len(CONFIGS))
def _ops_decode_impl(cache, wire, own, me, fmt, layout):
  return kernels.decode(cache, wire, own, me, fmt, layout)


_ops_encode = jax.jit(_ops_encode_impl, static_argnames=("fmt", "layout"))
_ops_decode = jax.jit(_ops_decode_impl, static_argnames=("fmt", "layout"))


def _units(fmt):
  return fmt.num_blocks if fmt.mode == "block" else fmt.n


def _scenarios(fmt):
  """(changed units per sender, me, caches in sync with the senders' previous exponents)."""
  return [(0, 0, True), (1, 1, True), (fmt.capacity, 2, True), (fmt.capacity + 1, 0, True),
          (fmt.capacity + 1, 1, False), (_units(fmt), 2, False)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_ops_equal_payload_format_and_oracle(config):
  fmt, layout = _format(config)
  g = geometry.Geometry.of(fmt, layout)
  rng = np.random.default_rng(zlib.crc32(repr(config).encode()))
  for units, me, in_sync in _scenarios(fmt):
    bits_W = [_bits(fmt, layout, rng) for _ in range(W)]
    prev_W = [_changed(fmt, layout, _exponents(fmt, layout, b), rng, units if d != me else 0)
              for d, b in enumerate(bits_W)]
    wires, exps = [], []
    for b, prev in zip(bits_W, prev_W):
      want = [np.asarray(a) for a in _payload_encode(b, prev, fmt, layout)]
      got = _ops_encode(jnp.asarray(b), jnp.asarray(prev), fmt, layout)
      oracle = host_reference.encode(b, prev, g)
      for value in (got.exp, got.wire, got.value_changes, got.block_changes, got.count(fmt)):
        assert value.dtype in (jnp.uint8, jnp.uint32, jnp.int32)
      for got_, oracle_, want_ in zip(got[:4], oracle, want):
        np.testing.assert_array_equal(np.asarray(got_), want_)
        np.testing.assert_array_equal(oracle_, want_)
      assert int(got.count(fmt)) == int(want[4])
      wires.append(want[1])
      exps.append(want[0])
    cache = np.stack([p for d, p in enumerate(prev_W) if d != me])
    if not in_sync:
      cache = rng.integers(0, 256, size=cache.shape, dtype=np.uint8)
    wire_WxL = np.stack(wires)
    want_bits, want_cache = _payload_decode(cache, wire_WxL, exps[me], me=me, fmt=fmt,
                                           layout=layout)
    got_bits, got_cache = _ops_decode(jnp.asarray(cache), jnp.asarray(wire_WxL),
                                      jnp.asarray(exps[me]), jnp.int32(me), fmt, layout)
    oracle_bits, oracle_cache = host_reference.decode(cache, wire_WxL, exps[me], me, g)
    for got_, oracle_, want_ in ((got_bits, oracle_bits, want_bits),
                                 (got_cache, oracle_cache, want_cache)):
      np.testing.assert_array_equal(np.asarray(got_), np.asarray(want_))
      np.testing.assert_array_equal(oracle_, np.asarray(want_))
    if in_sync and units <= fmt.capacity:
      np.testing.assert_array_equal(np.asarray(got_bits), np.stack(bits_W))


@settings(max_examples=25, deadline=None)
@given(config=st.sampled_from(CONFIGS), seed=st.integers(0, 2**32 - 1),
       fraction=st.floats(0, 1))
def test_round_trip_every_bit_pattern(config, seed, fraction):
  """decode(encode(x)) == x bit for bit while the changes fit the patch."""
  fmt, layout = _format(config)
  rng = np.random.default_rng(seed)
  x = _bits(fmt, layout, rng)
  units = min(fmt.capacity, int(fraction * _units(fmt)))
  prev = _changed(fmt, layout, _exponents(fmt, layout, x), rng, units)
  enc = _ops_encode(jnp.asarray(x), jnp.asarray(prev), fmt, layout)
  assert int(enc.count(fmt)) == units
  wire_WxL = jnp.stack([enc.wire] * W)   # every device sent the same shard
  cache_RxNP = jnp.stack([jnp.asarray(prev)] * (W - 1))
  out, cache = _ops_decode(cache_RxNP, wire_WxL, enc.exp, jnp.int32(1), fmt, layout)
  np.testing.assert_array_equal(np.asarray(out), np.stack([x] * W))
  np.testing.assert_array_equal(np.asarray(cache), np.stack([enc.exp] * (W - 1)))
  floats = jax.lax.bitcast_convert_type(out[0], layout.dtype)
  np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(floats, layout.uint_dtype)),
                                x)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_geometry_matches_payload(config):
  fmt, layout = _format(config)
  g = geometry.Geometry.of(fmt, layout)
  assert (g.cache_width, g.num_blocks, g.pos_bits, g.units) == (
      fmt.cache_width, fmt.num_blocks, fmt.pos_bits, _units(fmt))
  assert (g.head_words, g.tail_words) == fmt.sections
  assert g.patch_words == fmt.words
  assert g.rest_words == bits.packed_words(fmt.n, layout.rest_bits)
  assert g.wire_words == g.rest_words + fmt.words
  assert (g.total_bits, g.rest_bits) == (layout.total_bits, layout.rest_bits)


def test_dtype_table_matches_layouts():
  table = {l.name: (l.exp_bits, l.mant_bits) for l in bits.LAYOUTS.values()}
  assert geometry.DTYPE_BITS == table
  fmt, _ = _format(CONFIGS[1])   # float16: 5 exponent bits
  with pytest.raises(ValueError, match="exponent bits"):
    geometry.Geometry.of(fmt, bits.layout_of(jnp.bfloat16))


def test_ops_check_their_inputs():
  fmt, layout = _format(CONFIGS[0])
  good_bits = jnp.zeros(fmt.n, jnp.uint16)
  with pytest.raises(ValueError, match=r"bits_N must be uint16\[1000\]"):
    kernels.encode(jnp.zeros(fmt.n, jnp.uint32), jnp.zeros(fmt.n, jnp.uint8), fmt, layout)
  with pytest.raises(ValueError, match="prev_NP must be uint8"):
    kernels.encode(good_bits, jnp.zeros(fmt.n + 1, jnp.uint8), fmt, layout)
  wire = jnp.zeros((W, geometry.Geometry.of(fmt, layout).wire_words), jnp.uint32)
  own = jnp.zeros(fmt.cache_width, jnp.uint8)
  with pytest.raises(ValueError, match="cache_RxNP must be uint8"):
    kernels.decode(jnp.zeros((W, fmt.cache_width), jnp.uint8), wire, own, 0, fmt, layout)
  with pytest.raises(ValueError, match="wire_WxL must be uint32"):
    kernels.decode(jnp.zeros((W - 1, fmt.cache_width), jnp.uint8), wire[:, 1:], own, 0, fmt,
                   layout)


def test_cuda_branch_traces_and_lowers_without_a_gpu():
  """Under jit both platform branches are traced; without jax-triton the CUDA branch is the
  reference, silently on a machine without a GPU, and it lowers for CUDA."""
  fmt, layout = _format(CONFIGS[3])
  args = (jnp.zeros(fmt.n, jnp.uint16), jnp.zeros(fmt.cache_width, jnp.uint8))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    encoded = jax.jit(lambda b, p: kernels.encode(b, p, fmt, layout))(*args)
  assert encoded.wire.shape == (geometry.Geometry.of(fmt, layout).wire_words,)
  if ops._triton_backend() is not None:
    pytest.skip("jax-triton is installed here: the CUDA branch launches Triton kernels")
  exported = export.export(jax.jit(lambda b, p: kernels.encode(b, p, fmt, layout)),
                           platforms=["cuda", "cpu"])(*args)
  assert exported.platforms == ("cuda", "cpu")
  wire = jnp.zeros((W, encoded.wire.shape[0]), jnp.uint32)
  exported = export.export(
      jax.jit(lambda c, w, o, m: kernels.decode(c, w, o, m, fmt, layout)), platforms=["cuda"])(
          jnp.zeros((W - 1, fmt.cache_width), jnp.uint8), wire, args[1], jnp.int32(0))
  assert exported.platforms == ("cuda",)


def _triton_src_with_stub_triton(monkeypatch, request):
  """triton_src imported against a stand-in `triton` (jit = identity) when triton is not
  installed: its annotations are strings, so only the decorators touch triton at import."""
  name = "moejax.codec.kernels.triton_src"
  try:
    import triton  # noqa: F401
  except ImportError:
    stub = types.ModuleType("triton")
    stub.jit = lambda fn: fn
    stub.language = types.ModuleType("triton.language")
    monkeypatch.setitem(sys.modules, "triton", stub)
    monkeypatch.setitem(sys.modules, "triton.language", stub.language)
    sys.modules.pop(name, None)
    request.addfinalizer(lambda: sys.modules.pop(name, None))
  return importlib.import_module(name)


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[5]], ids=lambda c: c[0])
def test_cuda_branch_plumbing(monkeypatch, request, config):
  """The CUDA branch with a stand-in for jax_triton.triton_call: each launch hands a kernel its
  buffers (inputs, then outputs) and exactly its constants, and the branch's outputs have the
  reference's shapes and dtypes (which `lax.platform_dependent` requires)."""
  triton_src = _triton_src_with_stub_triton(monkeypatch, request)
  launched = []

  def triton_call(*args, kernel, grid, out_shape, **params):
    fn = getattr(kernel, "fn", kernel)
    signature = inspect.signature(fn).parameters
    constants = {n for n, p in signature.items() if "constexpr" in str(p.annotation)}
    assert len(args) + len(out_shape) == len(signature) - len(constants), fn.__name__
    assert set(params) == constants, fn.__name__
    assert all(isinstance(g, int) and g >= 1 for g in grid)
    launched.append(fn.__name__)
    return [jnp.zeros(s.shape, s.dtype) for s in out_shape]

  fake = types.SimpleNamespace(triton_call=triton_call)
  monkeypatch.setattr(ops, "_triton_backend", lambda: (fake, triton_src))
  fmt, layout = _format(config)
  bits_N = jax.ShapeDtypeStruct((fmt.n,), layout.uint_dtype)
  prev_NP = jax.ShapeDtypeStruct((fmt.cache_width,), np.uint8)
  encode = functools.partial(ops._encode_triton, fmt=fmt, layout=layout)
  want = functools.partial(reference.encode, fmt=fmt, layout=layout)
  assert jax.eval_shape(encode, bits_N, prev_NP) == jax.eval_shape(want, bits_N, prev_NP)
  args = (jax.ShapeDtypeStruct((W - 1, fmt.cache_width), np.uint8),
          jax.ShapeDtypeStruct((W, geometry.Geometry.of(fmt, layout).wire_words), np.uint32),
          prev_NP, jax.ShapeDtypeStruct((), np.int32))
  decode = functools.partial(ops._decode_triton, fmt=fmt, layout=layout)
  want = functools.partial(reference.decode, fmt=fmt, layout=layout)
  assert jax.eval_shape(decode, *args) == jax.eval_shape(want, *args)
  assert launched == ["detect_kernel", "block_flags_kernel", "scan_kernel", "compact_kernel",
                      "wire_kernel", f"decode_{fmt.mode}_kernel"]
  # Both branches in one program; on CPU the reference runs.
  x = _bits(fmt, layout, np.random.default_rng(3))
  prev = np.zeros(fmt.cache_width, np.uint8)
  got = jax.jit(lambda b, p: kernels.encode(b, p, fmt, layout))(x, prev)
  np.testing.assert_array_equal(np.asarray(got.wire),
                                np.asarray(_payload_encode(x, prev, fmt, layout)[1]))


@pytest.mark.triton_interpret
def test_triton_kernels():
  """The Triton kernels: bit for bit against the oracle under TRITON_INTERPRET=1, and compiled
  for sm_90, in the 3.11 side environment (torch, triton; no jax)."""
  python = ROOT / ".venv311" / "bin" / "python"
  fix = "run scripts/setup_triton_env.sh to create it"
  if not python.exists():
    pytest.fail(f"{python.relative_to(ROOT)} is missing: {fix}")
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "PYTEST_"))}
  for test_file, interpret in (("tests/codec/kernels_triton_interp.py", "1"),
                               ("tests/codec/kernels_triton_compile.py", "0")):
    result = subprocess.run(
        # -o addopts: not the main env's options (pyproject.toml's -n 2 needs pytest-xdist).
        [python, "-m", "pytest", "--noconftest", "-o", "addopts=", "-p", "no:cacheprovider",
         test_file],
        cwd=ROOT, env={**env, "TRITON_INTERPRET": interpret}, capture_output=True, text=True,
        timeout=1200, check=False)
    output = result.stdout + result.stderr
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    # (no import probe first: importing torch costs seconds; a missing package shows here)
    if "No module named" in output:
      pytest.fail(f".venv311 lacks a package ({output.strip().splitlines()[-1]}): {fix}")
    assert result.returncode == 0, f"{test_file} failed:\n{output[-6000:]}"
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, (
        f"{test_file}: {summary}")
    print(f"{test_file}: {summary}", file=sys.stderr)
