#!/usr/bin/env bash
# Installs, into the git-ignored .gpu_compile/, jax's CUDA 13 plugin for the jax of .venv (about
# 140 MB): with it scripts/gpu_schedule.py compiles moejax's train step for GPUs on a machine
# without one (XLA:GPU's deviceless compile: a target description instead of a device). Not
# part of the set-up the tests need.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
source scripts/pip_install.sh
JAX_VERSION=$("$VENV/bin/python" -c "import jax; print(jax.__version__)")
rm -rf .gpu_compile
pip_install --no-deps --target .gpu_compile "jax-cuda13-plugin==$JAX_VERSION" \
  "jax-cuda13-pjrt==$JAX_VERSION"
du -sh .gpu_compile
