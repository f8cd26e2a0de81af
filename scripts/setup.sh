#!/usr/bin/env bash
# Creates .venv with Python >= 3.12 and installs moejax with its test dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=""
works() {   # a pyenv shim exists on PATH even where it cannot run: try it
  "$1" -c 'import sys; assert sys.version_info >= (3, 12)' >/dev/null 2>&1
}
for candidate in python3.12; do
  if works "$candidate"; then PY="$candidate"; break; fi
done
if [ -z "$PY" ] && command -v pyenv >/dev/null 2>&1; then
  # Prefer 3.12 (what jax 0.11 and jax-triton 0.4 are built for), then newer.
  for v in $(pyenv versions --bare | grep -E '^3\.1[2-9]' | sort -V); do
    if works "$(pyenv root)/versions/$v/bin/python"; then
      PY="$(pyenv root)/versions/$v/bin/python"; break
    fi
  done
fi
if [ -z "$PY" ]; then
  echo "error: moejax needs Python >= 3.12 (python3.12 on PATH, or a pyenv 3.12 install)" >&2
  exit 2
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -c "import jax, flax, optax, orbax.checkpoint, grain; print('moejax env ready: jax', jax.__version__)"
