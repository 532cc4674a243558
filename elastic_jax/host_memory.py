"""Host memory for XLA:CPU: freed blocks stay in the process, so a step reuses the last one's pages.

XLA:CPU mallocs each execution's temporary buffer and frees it afterwards (127 MB for the tiny
config's B4 x T256 train step, fp32). glibc serves a block that large with a fresh mmap (above its
mmap threshold, at most 32 MB, and larger than a worker thread's 64 MB arena) and unmaps it on
free, so every step the kernel zero-fills and maps about 31,000 new 4 KiB pages: measured on this
project's 2-core VM, 31,000 minor page faults per train step and 89-102 ms against 72-78 ms with
the blocks kept (`experiments/speed.py`; three process pairs).

`keep_freed_memory()` has glibc serve every block from one heap (one arena, no mmap) that it never
trims. Peak memory is unchanged; memory freed after the peak stays with the process (as with
tcmalloc or jemalloc). It must run before jax starts its CPU client: threads that have already
allocated keep their own arenas. The CLIs call it first (`cli.run`); set
ELASTIC_JAX_KEEP_HOST_MEMORY=0 to leave malloc as it is. A no-op off Linux / glibc.
"""
from __future__ import annotations

import ctypes
import os
import platform
import sys

ENV = "ELASTIC_JAX_KEEP_HOST_MEMORY"
# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1))


def keep_freed_memory(environ=os.environ) -> bool:
  """Sets glibc's malloc to one never-trimmed heap without mmap (see the module docstring).
  Returns True when applied; False with $ELASTIC_JAX_KEEP_HOST_MEMORY "0" / "" or off glibc."""
  if environ.get(ENV, "1") in ("", "0"):
    return False
  if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
    return False
  libc = ctypes.CDLL(None)
  return all(libc.mallopt(param, value) == 1 for param, value in SETTINGS)
