"""Host memory for XLA:CPU: freed blocks stay in the process, so a step reuses the last one's pages.

XLA:CPU mallocs each execution's temporary buffer and frees it afterwards (127 MB for the tiny
config's B4 x T256 train step, fp32). glibc serves a block that large with a fresh mmap (above its
mmap threshold, at most 32 MB, and larger than a worker thread's 64 MB arena) and unmaps it on
free, so every step the kernel zero-fills and maps about 31,000 new 4 KiB pages: measured on this
project's 2-core VM, 30,994 minor page faults per train step and 96-111 ms against 76-92 ms (0
faults) with the blocks kept (`experiments/page_faults.py`, four process pairs).

`keep_freed_memory()` has glibc serve every block from one heap (one arena, no mmap) that it never
trims. Peak memory is unchanged; memory freed after the peak stays with the process (as with
tcmalloc or jemalloc). The price: every thread now shares one malloc lock, so XLA's compiles run
slower (the tiny train step's 7-9 -> 9-11 s) and so does a compile-bound job (the README's main
job, cold: 198 -> 262 s); each call of the train step also spends 7-8 ms in malloc dispatching it
(2 ms without), and at the scaled nano_v3 shape (a 1.25 GB temporary buffer, 379,000 faults per
step without) the B4 x T256 train step took 12.7 s with it against 9.8 s without (one process
each). So it is opt-in: measure it for the run at hand (`experiments/page_faults.py` times the tiny
step both ways). It must run before jax starts its CPU client:
threads that have already allocated keep their own arenas. The CLIs call it first (`cli.run`) and
apply it with ELASTIC_JAX_KEEP_HOST_MEMORY=1. A no-op off Linux / glibc.
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


def keep_freed_memory(environ=os.environ, default: bool = False) -> bool:
  """Sets glibc's malloc to one never-trimmed heap without mmap (see the module docstring) when
  $ELASTIC_JAX_KEEP_HOST_MEMORY is "1", not when it is "0" or "", else when `default`. Returns
  True when applied (False also off glibc)."""
  value = environ.get(ENV)
  if value not in (None, "", "0", "1"):
    raise ValueError(f"${ENV} must be 1 or 0, got {value!r}")
  if not (value == "1" or (value is None and default)):
    return False
  if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
    return False
  libc = ctypes.CDLL(None)
  return all(libc.mallopt(param, value) == 1 for param, value in SETTINGS)
