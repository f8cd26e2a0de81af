#!/usr/bin/env bash
# Every GPU check of moejax in one run (scripts/device_check.py; JSON format: docs/device_check.md).
#
# On a GPU machine with no network (jax, flax, optax, orbax, chex, triton installed): run
# `bash scripts/fetch_device_wheels.sh` here first, carry `.whl`, then there
#   bash scripts/device_check.sh            # installs .whl/ with pip --no-index, writes $OUT/device_check.json
# Anywhere, at tiny shapes on CPU (8 fake devices; CI runs this):
#   bash scripts/device_check.sh --dry-run
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ " $* " == *" --dry-run "* ]]; then
  export JAX_PLATFORMS=cpu
  # LLVM at -O0, as in the tests: this run checks the script, not speed.
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
  PYTHON="${PYTHON:-.venv/bin/python}"
  OUT="${OUT:-$(mktemp -d)}"
else
  PYTHON="${PYTHON:-python3}"
  if [ -d .whl ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/moejax_site .whl/*.whl
    export PYTHONPATH="/tmp/moejax_site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  OUT="${OUT:-.}"
  # No up-front grab of 75% of the GPU: the schedule8 child process and nvCOMP (cupy) allocate too.
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
fi
export OUT PYTHONUNBUFFERED=1
exec "$PYTHON" scripts/device_check.py "$@"
