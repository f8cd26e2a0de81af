"""moejax.host_memory: with it, a large block freed and allocated again reuses its pages (no page
faults); without it (`MOEJAX_KEEP_HOST_MEMORY=0`, glibc's default) the block is mapped afresh.
Each case in a fresh process: the setting is process-wide."""
import os
import subprocess
import sys

import pytest

from moejax.host_memory import ENV
from tests.helpers import REPO

# 64 MiB, past glibc's largest mmap threshold (32 MiB): 16384 pages of 4 KiB.
PROBE = """
import ctypes, resource, sys
import numpy as np
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: 4 KiB pages, one fault each
from moejax import host_memory
on = host_memory.keep_freed_memory_mapped()
def touch():
  block = np.empty(64 << 20, np.uint8)
  block[::4096] = 1
  del block
touch()                                  # the first time always faults the pages in
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()
print(on, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _probe(env_value):
  env = {k: v for k, v in os.environ.items() if k != ENV}
  if env_value is not None:
    env[ENV] = env_value
  out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True,
                       text=True, check=True).stdout.split()
  return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_blocks_keep_their_pages_unless_the_environment_opts_out():
  on, faults = _probe(None)
  assert on and faults < 1000, faults
  off, faults = _probe("0")
  assert not off and faults > 16000, faults
