"""The codec's Triton kernels compile for CUDA (sm_90) as the GPU path launches them, on a machine
without a GPU: Triton's full pipeline (TTIR, TTGIR, LLVM IR, PTX, cubin) with the argument types
and constants of `encode_plan` / `decode_plan`. The interpreter tests check what the kernels
compute; this checks what only the compiler enforces (types that agree across branches and loop
iterations, shapes, supported ops).

Runs in the Python 3.11 side environment WITHOUT TRITON_INTERPRET:

    .venv311/bin/python -m pytest --noconftest tests/codec/kernels_triton_compile.py

and from the main suite through tests/codec/test_kernels.py::test_triton_kernels.
"""
import os

import pytest

from tests.codec.jax_free import import_jax_free

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
  pytest.fail("compile checks need the real compiler: unset TRITON_INTERPRET", pytrace=False)
try:
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.compiler import ASTSource
except ImportError as e:
  pytest.fail(f"needs triton ({e}): run scripts/setup_triton_env.sh", pytrace=False)


geometry = import_jax_free("geometry")
triton_src = import_jax_free("triton_src")

TARGET = GPUTarget("cuda", 90, 32)
POINTER = {"uint8": "*u8", "uint16": "*u16", "uint32": "*u32", "int32": "*i32"}
CASES = [  # (mode, dtype, n, block_size, capacity)
    ("element", "bfloat16", 100_000, 512, 6250),
    ("element", "float32", 4096, 512, 256),
    ("block", "float16", 100_000, 100, 250),
    ("block", "bfloat16", 50_000, 4096, 4),
]


def _launches(case):
  g = geometry.Geometry.for_dtype(*case)
  dtypes = {"bits": triton_src.bits_dtype(g), "prev": "uint8", "cache": "uint8",
            "wire": "uint32", "own": "uint8", "me": "int32"}
  for plan in (triton_src.encode_plan(g), triton_src.decode_plan(g, 8)):
    for launch in plan:
      dtypes.update({name: dtype for name, _, dtype in launch.outputs})
    for launch in plan:
      buffers = list(launch.inputs) + [name for name, _, _ in launch.outputs]
      yield launch, {name: dtypes[name] for name in buffers}


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernels_compile_for_cuda(case):
  for launch, dtypes in _launches(case):
    names = launch.kernel.arg_names
    pointers = [n for n in names if n not in launch.params]
    assert len(pointers) == len(dtypes), (launch.kernel.__name__, pointers, list(dtypes))
    signature = {p: POINTER[dtypes[b]] for p, b in zip(pointers, dtypes)}
    signature.update({k: "constexpr" for k in launch.params})
    constexprs = {(names.index(k),): v for k, v in launch.params.items()}
    compiled = triton.compile(ASTSource(launch.kernel, signature, constexprs=constexprs),
                              target=TARGET)
    assert compiled.asm.get("cubin"), launch.kernel.__name__
