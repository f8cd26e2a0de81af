"""Host memory under XLA:CPU: freed heap memory stays mapped, so each step reuses its pages.

XLA:CPU mallocs a step's temporaries and outputs on every execution. glibc serves a large request
(past its mmap threshold: 128 KiB, adapting up to 32 MiB) with a fresh mmap and unmaps it on
free, and gives the top of its heaps back to the OS past a trim threshold, so every step faults
pages in again, each zeroed by the kernel. Measured on the tiny preset with 128 experts (1 CPU
device): 9776 minor page faults a step and 68 ms; with glibc's mmap off and its heap never
trimmed, 255 faults and 45 ms (8 experts: 24.2 -> 23.3 ms).

The cost: the process keeps its peak heap until it exits. Only CPU devices gain (accelerator
buffers are not malloc'd); `MOEJAX_KEEP_HOST_MEMORY=0` leaves malloc as it is.
"""
from __future__ import annotations

import ctypes
import functools
import os

ENV = "MOEJAX_KEEP_HOST_MEMORY"
# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_INT_MAX = 2**31 - 1


@functools.cache
def keep_freed_memory_mapped() -> bool:
  """Turns glibc's mmap for large blocks and its heap trimming off, once per process. Returns
  whether it is in effect: False off glibc (macOS, musl) or when the environment opts out."""
  return os.environ.get(ENV, "1") != "0" and _mallopt_glibc()


def _mallopt_glibc() -> bool:
  libc = ctypes.CDLL(None)
  if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
    return False
  # mallopt returns 1 on success. The order matters little: both only steer later allocations.
  return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _INT_MAX))
