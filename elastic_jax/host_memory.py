"""Host memory for XLA:CPU: the per-step temporary buffer without 31,000 page faults a step.

XLA:CPU mallocs each execution's temporary buffer and frees it afterwards (127 MB for the tiny
config's B4 x T256 train step, fp32). glibc serves a block that large with a fresh mmap (above its
mmap threshold, at most 32 MB, and larger than a worker thread's 64 MB arena) and unmaps it on
free, so every step the kernel zero-fills and maps about 31,000 new 4 KiB pages: 30,994 minor
page faults per train step on this project's 2-core VM (`experiments/page_faults.py`).

Two remedies, measured there against glibc's default (fresh processes, alternating):
- Huge pages (`restart_with_huge_pages`, on by default in the CLIs; $ELASTIC_JAX_HUGE_PAGES=0
  off): glibc's `glibc.malloc.hugetlb=1` tunable has malloc madvise its memory for the kernel's
  transparent huge pages, so the buffer maps in 2 MiB pages: about 350 faults per step, and no
  change to malloc's arenas or locks. glibc reads tunables only at startup, so a CLI re-executes
  itself once with the tunable in $GLIBC_TUNABLES. The tiny train step 84-102 -> 55-75 ms (six
  process rounds, median ratio 1.54x; steady at 54-58 ms between this VM's noisy bursts); the
  README's main job cold 171 -> 153 s, same results, peak RSS 2.26 -> 2.37 GB; compiles unchanged;
  the scaled nano_v3 step (1.25 GB buffer, 380,000 faults a step without) 7.74-7.75 against
  7.79-7.82 s, within noise.
- Kept memory (`keep_freed_memory`, opt-in with ELASTIC_JAX_KEEP_HOST_MEMORY=1; for kernels
  without transparent huge pages): one never-trimmed heap (one arena, no mmap), 0 faults, but every
  thread then shares one malloc lock: XLA's compiles run slower (the tiny train step's 7-9 ->
  9-11 s, the README's main job cold 198 -> 262 s), each step spends 7-8 ms more in malloc, the
  tiny step 63-68 ms and the scaled step 9.8 -> 12.7 s. It must run before jax starts its CPU
  client: threads that have already allocated keep their own arenas.
Both are no-ops off Linux / glibc.
"""
from __future__ import annotations

import ctypes
import os
import platform
import sys

ENV = "ELASTIC_JAX_KEEP_HOST_MEMORY"
HUGE_ENV = "ELASTIC_JAX_HUGE_PAGES"
TUNABLE = "glibc.malloc.hugetlb=1"   # madvise(MADV_HUGEPAGE) on malloc's memory
TUNABLE_SINCE = (2, 35)   # older glibc ignores the tunable
THP = "/sys/kernel/mm/transparent_hugepage/enabled"
# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1))


def _switch(environ, name: str, default: bool) -> bool:
  """$name as a switch: "1" on, "0" or "" off, unset `default`; anything else a ValueError."""
  value = environ.get(name)
  if value not in (None, "", "0", "1"):
    raise ValueError(f"${name} must be 1 or 0, got {value!r}")
  return value == "1" or (value is None and default)


def _glibc(at_least: tuple[int, ...] = ()) -> bool:
  """Linux with glibc, of at least version `at_least`."""
  name, version = platform.libc_ver()
  if not sys.platform.startswith("linux") or name != "glibc":
    return False
  try:
    return tuple(int(p) for p in version.split(".")[:2]) >= at_least
  except ValueError:
    return False


def keep_freed_memory(environ=os.environ, default: bool = False) -> bool:
  """Sets glibc's malloc to one never-trimmed heap without mmap (see the module docstring) when
  $ELASTIC_JAX_KEEP_HOST_MEMORY is "1", not when it is "0" or "", else when `default`. Returns
  True when applied (False also off glibc)."""
  if not _switch(environ, ENV, default) or not _glibc():
    return False
  libc = ctypes.CDLL(None)
  return all(libc.mallopt(param, value) == 1 for param, value in SETTINGS)


def huge_pages_active(environ=os.environ) -> bool:
  """Whether this process started with glibc's malloc on transparent huge pages (`TUNABLE` in
  $GLIBC_TUNABLES, which glibc reads only at startup)."""
  return TUNABLE in environ.get("GLIBC_TUNABLES", "").split(":")


def thp_mode(path: str = THP) -> str | None:
  """The kernel's transparent-huge-page mode ("always", "madvise" or "never"), None unknown."""
  try:
    with open(path) as f:
      text = f.read()
  except OSError:
    return None
  return text[text.index("[") + 1:text.index("]")] if "[" in text else None


def huge_pages_environ(environ=os.environ, default: bool = True,
                       thp_path: str = THP) -> dict | None:
  """The environment to restart this process with so that glibc's malloc uses transparent huge
  pages: `environ` plus `TUNABLE` in $GLIBC_TUNABLES. None when there is nothing to do: off
  ($ELASTIC_JAX_HUGE_PAGES "0" or "", or unset and not `default`), already active, not Linux
  with glibc 2.35 or later, or the kernel's transparent huge pages unknown or "never"."""
  if (not _switch(environ, HUGE_ENV, default) or huge_pages_active(environ)
      or not _glibc(TUNABLE_SINCE) or thp_mode(thp_path) in (None, "never")):
    return None
  return with_huge_pages(environ, True)


def with_huge_pages(environ, on: bool) -> dict:
  """A copy of `environ` whose $GLIBC_TUNABLES has `TUNABLE` (appended) or not (removed, and the
  variable with it when nothing else is left); the other tunables are kept in order."""
  tunables = [t for t in environ.get("GLIBC_TUNABLES", "").split(":") if t and t != TUNABLE]
  env = {k: v for k, v in environ.items() if k != "GLIBC_TUNABLES"}
  if on:
    tunables.append(TUNABLE)
  if tunables:
    env["GLIBC_TUNABLES"] = ":".join(tunables)
  return env


def restart_with_huge_pages(environ=os.environ, default: bool = True) -> None:
  """Replaces this process by the same command (`sys.orig_argv`, this interpreter) under
  `huge_pages_environ` when that is not None; else returns. Call it first thing in a script's
  entry point (never from a library or a test process: it exec()s)."""
  env = huge_pages_environ(environ, default)
  if env is None:
    return
  sys.stdout.flush()
  sys.stderr.flush()
  try:
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
  except OSError:   # cannot re-exec here: run on without huge pages
    return
