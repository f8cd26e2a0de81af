#!/usr/bin/env bash
# Creates .venv311: Python 3.11 with a CPU torch, transformers, accelerate and compressed-tensors
# (transformers needs them to load FP8 checkpoints) and safetensors, the reference side of the
# Hugging Face tests (tests/convert/, which run it through subprocesses). torch has no quick CPU
# install for the Python 3.12 moejax env, hence a separate env. Idempotent: a complete env is left
# as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv311
TORCH_VERSION=2.13.0
PACKAGES=("torch==$TORCH_VERSION" transformers accelerate compressed-tensors safetensors numpy)

ready() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$TORCH_VERSION" <<'PY' >/dev/null 2>&1
import importlib.metadata as md, sys
assert md.version("torch").split("+")[0] == sys.argv[1]
for name in ("transformers", "accelerate", "compressed-tensors", "safetensors", "numpy"):
  md.version(name)
PY
}

source scripts/pip_install.sh   # pip_install ARGS...

if ready; then
  echo "torch env ready: $VENV"
  exit 0
fi
PY=""
for candidate in python3.11 python3; do
  if command -v "$candidate" >/dev/null 2>&1 && \
      "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
    PY="$candidate"; break
  fi
done
if [ -z "$PY" ]; then
  echo "error: the torch reference env needs Python 3.11 (python3.11 on PATH)" >&2
  exit 2
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
pip_install --upgrade pip
pip_install "${PACKAGES[@]}"
"$VENV/bin/python" -c "import torch, transformers; print('torch env ready: $VENV, torch', \
torch.__version__, 'transformers', transformers.__version__)"
