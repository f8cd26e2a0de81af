"""The codec's Triton kernels under Triton's interpreter, bit for bit against the numpy oracle.

Runs in the Python 3.11 side environment (torch CPU + triton, no jax; made by
`scripts/setup_triton_env.sh`), with TRITON_INTERPRET=1 set before triton is imported:

  TRITON_INTERPRET=1 .venv311/bin/python -m pytest --noconftest tests/codec/kernels_triton_interp.py

The main suite runs exactly this through `tests/codec/test_kernels.py::test_triton_kernels`
(marker `triton_interpret`). The kernels launch through the same plans as on GPU
(`triton_src.encode_plan` / `decode_plan`); outputs are pre-filled with a junk pattern, so a word
the kernels forget to write shows up. Bit patterns are random over the whole range (NaN payloads,
+-Inf, subnormals, -0.0 included) and the change patterns run from none to every unit, over the
patch capacity included; the oracle (`host_reference`) is checked against the pure-jnp reference
by tests/codec/test_kernels.py.
"""
import os
import zlib

import numpy as np
import pytest

from tests.codec.jax_free import import_jax_free

if os.environ.get("TRITON_INTERPRET") != "1":
  pytest.fail("run with TRITON_INTERPRET=1 in the 3.11 side environment (scripts/"
              "setup_triton_env.sh), e.g. TRITON_INTERPRET=1 .venv311/bin/python -m pytest "
              "--noconftest tests/codec/kernels_triton_interp.py", pytrace=False)

try:
  import torch
  import triton  # noqa: F401  (the kernels need it; imported here for a clear message)
except ImportError as e:
  pytest.fail(f"needs torch and triton ({e}): run scripts/setup_triton_env.sh", pytrace=False)
geometry = import_jax_free("geometry")
oracle = import_jax_free("host_reference")
triton_src = import_jax_free("triton_src")

JUNK = {"uint8": 0xA5, "int32": -0x5A5A5A5B, "uint32": -0x5A5A5A5B, "uint16": -0x5A5B}
VIEW = {"uint32": torch.int32, "uint16": torch.int16}


def _tensor(a: np.ndarray):
  return torch.from_numpy(np.ascontiguousarray(a))


def run_plan(plan, buffers):
  """Launch a plan on torch CPU tensors; outputs start as junk."""
  buffers = dict(buffers)
  for launch in plan:
    args = [buffers[name] for name in launch.inputs]
    for name, shape, dtype in launch.outputs:
      buffers[name] = torch.full(shape, JUNK[dtype], dtype=VIEW.get(dtype, getattr(torch, dtype)))
      if dtype in VIEW:
        buffers[name] = buffers[name].view(getattr(torch, dtype))
      args.append(buffers[name])
    launch.kernel[launch.grid](*args, **launch.params)
  return {k: v.numpy() for k, v in buffers.items()}


SPECIALS = {  # NaN payloads, +-Inf, +-0, smallest/largest subnormals, +-max finite
    16: [0x7FC1, 0xFF81, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x807F, 0x7F7F, 0xFC01, 0x7E00,
         0x03FF, 0x7C00],
    32: [0x7FC00001, 0xFF800001, 0x7F800000, 0xFF800000, 0x0, 0x80000000, 0x1, 0x807FFFFF,
         0x7F7FFFFF],
}


def _bits(g, rng):
  width = g.total_bits
  dtype = np.uint16 if width == 16 else np.uint32
  x = rng.integers(0, 2**width, size=g.n, dtype=np.uint64).astype(dtype)
  specials = np.array(SPECIALS[width], dtype=np.uint64).astype(dtype)
  k = min(g.n, 2 * specials.size)
  x[rng.choice(g.n, size=k, replace=False)] = np.resize(specials, k)
  return x


def _prev(g, exp_np, rng, changes):
  """Previous exponents differing from `exp_np` in `changes` random units (all if -1)."""
  prev = exp_np.copy()
  mask = (1 << g.exp_bits) - 1
  if changes == -1:
    idx = np.arange(g.n)
  elif g.mode == "block":
    blocks = rng.choice(g.num_blocks, size=min(changes, g.num_blocks), replace=False)
    idx = np.minimum(blocks * g.block_size + rng.integers(0, g.block_size, size=blocks.size),
                     g.n - 1)
  else:
    idx = rng.choice(g.n, size=min(changes, g.n), replace=False)
  flips = rng.integers(1, mask + 1, size=idx.size).astype(np.uint8)
  prev[idx] ^= flips
  return prev


CASES = [  # (mode, dtype, n, block_size, capacity): one tile and several, partial last words
    ("element", "bfloat16", 1100, 64, 12),
    ("element", "float16", 777, 32, 50),
    ("element", "float32", 300, 16, 300),
    ("element", "bfloat16", 1500, 512, 1),
    ("block", "bfloat16", 1000, 64, 4),
    ("block", "float16", 2000, 100, 3),     # 20 blocks, 16 per decode tile: partial bitmap words
    ("block", "float32", 333, 32, 11),
    ("block", "bfloat16", 5000, 3000, 1),   # a block wider than one tile
    ("block", "bfloat16", 12001, 2, 1500),  # 6001 blocks: the bitmap prefix count loops
]


def _change_counts(g):
  return [0, 1, g.capacity, g.capacity + 1, -1]


# (changed units, me): in sync, at capacity, over capacity with caches out of sync, everything
DECODE_SCENARIOS = [(0, 0), ("C", 2), ("C+1", 1), (-1, 0)]


def _encode(g, bits, prev):
  out = run_plan(triton_src.encode_plan(g), {"bits": _tensor(bits), "prev": _tensor(prev)})
  return out["exp"], out["wire"], tuple(int(v) for v in out["total"])


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_encode(case):
  g = geometry.Geometry.for_dtype(*case)
  rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
  for changes in _change_counts(g):
    bits = _bits(g, rng)
    exp_np, _, _, _ = oracle.encode(bits, np.zeros(g.cache_width, np.uint8), g)
    prev = _prev(g, exp_np, rng, changes)
    want_exp, want_wire, want_values, want_blocks = oracle.encode(bits, prev, g)
    exp, wire, totals = _encode(g, bits, prev)
    np.testing.assert_array_equal(exp, want_exp)
    assert totals == (want_values, want_blocks)
    assert wire.shape == (g.wire_words,)
    np.testing.assert_array_equal(wire, want_wire, err_msg=f"changes={changes}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_decode(case):
  g = geometry.Geometry.for_dtype(*case)
  rng = np.random.default_rng(zlib.crc32(repr(case).encode()) + 1)
  w = 3
  for changes, me in DECODE_SCENARIOS:
    changes = {"C": g.capacity, "C+1": g.capacity + 1}.get(changes, changes)
    bits_W = [_bits(g, rng) for _ in range(w)]
    prevs, wires, exps = [], [], []
    for d in range(w):
      exp_np, _, _, _ = oracle.encode(bits_W[d], np.zeros(g.cache_width, np.uint8), g)
      prevs.append(_prev(g, exp_np, rng, changes if d != me else 0))
      exp_np, wire, _, _ = oracle.encode(bits_W[d], prevs[-1], g)
      exps.append(exp_np)
      wires.append(wire)
    cache = np.stack([prevs[d] for d in range(w) if d != me])
    in_sync = me != 1
    if not in_sync:   # caches that disagree with the senders' previous exponents
      cache = rng.integers(0, 256, size=cache.shape, dtype=np.uint8)
    want_bits, want_cache = oracle.decode(cache, np.stack(wires), exps[me], me, g)
    out = run_plan(triton_src.decode_plan(g, w), {
        "cache": _tensor(cache), "wire": _tensor(np.stack(wires)), "own": _tensor(exps[me]),
        "me": _tensor(np.array([me], np.int32))})
    np.testing.assert_array_equal(out["new_cache"], want_cache, err_msg=f"{changes=} {me=}")
    np.testing.assert_array_equal(out["bits"], want_bits, err_msg=f"{changes=} {me=}")
    if in_sync and 0 <= changes <= g.capacity:   # the round trip is exact
      np.testing.assert_array_equal(out["bits"], np.stack(bits_W))


def test_single_device():
  g = geometry.Geometry.for_dtype("element", "bfloat16", 100, 32, 5)
  bits = _bits(g, np.random.default_rng(0))
  exp, wire, _ = _encode(g, bits, np.zeros(g.cache_width, np.uint8))
  out = run_plan(triton_src.decode_plan(g, 1), {
      "cache": _tensor(np.zeros((0, g.cache_width), np.uint8)), "wire": _tensor(wire[None]),
      "own": _tensor(exp), "me": _tensor(np.zeros(1, np.int32))})
  np.testing.assert_array_equal(out["bits"][0], bits)
