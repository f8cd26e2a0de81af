#!/usr/bin/env bash
# Downloads, into the git-ignored .whl/, the wheels that scripts/device_check.sh needs and the
# GPU machine lacks (it has jax, flax, optax, orbax, chex, triton, tensorboard, matplotlib and
# no network): Python 3.12, x86-64, the versions of .venv, and nvCOMP for CUDA 13 (the plugin
# there; ~34 MB of the ~38). Then carry `.whl` to that machine.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(jax-triton==0.4.1 ml_collections==1.1.0 grain==0.2.18 array_record==0.8.6
        portpicker==1.6.0 tensorboardX==2.6.5
        nvidia-nvcomp-cu13==6.0.0.12 nvidia-libnvcomp-cu13==6.0.0.12)
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
du -sh .whl
