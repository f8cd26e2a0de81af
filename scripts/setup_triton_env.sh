#!/usr/bin/env bash
# Makes .venv311 ready for the codec's Triton kernel tests (tests/codec/kernels_triton_*.py, run
# from the main suite by tests/codec/test_kernels.py::test_triton_kernels): the Python 3.11 side
# env with a CPU torch (scripts/setup_torch_env.sh), plus triton and pytest. Triton's interpreter
# (TRITON_INTERPRET=1) runs the kernels on torch CPU tensors; triton's compiler checks that they
# build for CUDA. torch has no quick CPU install for the Python 3.12 moejax env, hence 3.11.
# Idempotent: a complete env is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv311
TORCH_VERSION=2.13.0
TRITON_VERSION=3.7.1   # the triton that torch 2.13.0 pins on Linux (its CUDA wheels' Requires-Dist)

ready() {
  [ -x "$VENV/bin/python" ] &&
    "$VENV/bin/python" - "$TORCH_VERSION" "$TRITON_VERSION" <<'PY' >/dev/null 2>&1
import importlib.metadata as md, sys
assert md.version("torch").split("+")[0] == sys.argv[1]
assert md.version("triton") == sys.argv[2]
import numpy, pytest, torch, triton
PY
}

source scripts/pip_install.sh   # pip_install ARGS...

if [ -f scripts/setup_torch_env.sh ]; then
  bash scripts/setup_torch_env.sh     # idempotent; completes an older env (accelerate)
fi
if ready; then
  echo "triton env ready: $VENV"
  exit 0
fi
if [ ! -f scripts/setup_torch_env.sh ]; then
  if ! command -v python3.11 >/dev/null 2>&1; then
    echo "error: the Triton test env needs Python 3.11 (python3.11 on PATH)" >&2
    exit 2
  fi
  [ -x "$VENV/bin/python" ] || python3.11 -m venv "$VENV"
  pip_install --upgrade pip
  pip_install "torch==$TORCH_VERSION" numpy
fi
pip_install "triton==$TRITON_VERSION" "pytest>=8"
"$VENV/bin/python" -c "import torch, triton; print('triton env ready: $VENV, torch', \
torch.__version__, 'triton', triton.__version__)"
