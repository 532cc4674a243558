"""host_memory: a large freed block is reused (kept heap) or mapped in huge pages, not
page-faulted in anew 4 KiB at a time (counted in child processes; `experiments/speed.py` and
`experiments/page_faults.py` count the train step's faults); the huge-page restart of the CLIs."""
import importlib.util
import os
import subprocess
import sys

import pytest

from elastic_jax import host_memory

EXPERIMENTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "experiments")


def _page_faults_module():
  spec = importlib.util.spec_from_file_location("page_faults",
                                                os.path.join(EXPERIMENTS, "page_faults.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module

# Allocate, touch and free a 128 MiB block (above glibc's largest mmap threshold, as XLA:CPU's
# temporary buffer of a train step is) four times; print the pages and the minor faults of the
# last three rounds per round.
CHILD = """
import ctypes, resource
from elastic_jax import host_memory
host_memory.keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 128 << 20
def touch_and_free():
  p = libc.malloc(size)
  ctypes.memset(p, 1, size)
  libc.free(p)
touch_and_free()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
  touch_and_free()
print(size // 4096, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 3)
"""


def _pages_and_faults(variant: str):
  env = _page_faults_module().variant_environ(variant)
  r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                     timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  pages, faults = r.stdout.split()
  return int(pages), float(faults)


def test_freed_block_is_reused_not_faulted_in_again():
  pages, kept = _pages_and_faults("kept")
  _, default = _pages_and_faults("default")
  assert default > 0.9 * pages, (default, pages)   # glibc's default: mapped anew each round
  assert kept < 0.01 * pages, (kept, pages)


@pytest.mark.skipif(host_memory.thp_mode() in (None, "never"),
                    reason="the kernel has no transparent huge pages")
def test_huge_pages_map_the_block_in_2mib_pages():
  """With glibc's huge-page tunable the block is still mapped anew each round, but in 2 MiB
  pages: 64 faults for 128 MiB, plus 4 KiB ones at the mapping's unaligned end (576 measured),
  where glibc's default takes 32,768."""
  pages, huge = _pages_and_faults("huge")
  assert huge < 0.05 * pages, (huge, pages)


def test_huge_pages_environ(tmp_path):
  """The restart's environment: the tunable appended to $GLIBC_TUNABLES; None when switched
  off, already active, or the kernel has no transparent huge pages; a bad switch is an error
  naming the variable."""
  thp = tmp_path / "enabled"
  thp.write_text("always [madvise] never\n")
  env = host_memory.huge_pages_environ({"A": "1"}, thp_path=str(thp))
  assert env == {"A": "1", "GLIBC_TUNABLES": host_memory.TUNABLE}
  assert host_memory.huge_pages_active(env)
  env = host_memory.huge_pages_environ({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=8"},
                                       thp_path=str(thp))
  assert env["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=8:" + host_memory.TUNABLE
  assert host_memory.huge_pages_environ(env, thp_path=str(thp)) is None   # already active
  assert host_memory.huge_pages_environ({host_memory.HUGE_ENV: "0"}, thp_path=str(thp)) is None
  assert host_memory.huge_pages_environ({}, default=False, thp_path=str(thp)) is None
  assert host_memory.huge_pages_environ({host_memory.HUGE_ENV: "1"}, default=False,
                                        thp_path=str(thp)) is not None
  assert host_memory.huge_pages_environ({}, thp_path=str(tmp_path / "missing")) is None
  assert host_memory.with_huge_pages(env, False) == {
      "GLIBC_TUNABLES": "glibc.malloc.tcache_count=8"}
  assert host_memory.with_huge_pages({"GLIBC_TUNABLES": host_memory.TUNABLE}, False) == {}
  thp.write_text("always madvise [never]\n")
  assert host_memory.thp_mode(str(thp)) == "never"
  assert host_memory.huge_pages_environ({}, thp_path=str(thp)) is None
  with pytest.raises(ValueError, match="ELASTIC_JAX_HUGE_PAGES must be 1 or 0"):
    host_memory.huge_pages_environ({host_memory.HUGE_ENV: "on"})


def test_huge_pages_need_glibc_2_35(tmp_path, monkeypatch):
  """Older glibc ignores the tunable, so there is nothing to restart for; neither off glibc."""
  import platform
  thp = tmp_path / "enabled"
  thp.write_text("always [madvise] never\n")
  monkeypatch.setattr(sys, "platform", "linux")
  cases = ((("glibc", "2.31"), False), (("glibc", "2.35"), True), (("glibc", "2.40.9000"), True),
           (("musl", "1.2"), False), (("", ""), False))
  for libc, restarts in cases:
    monkeypatch.setattr(platform, "libc_ver", lambda libc=libc: libc)
    assert (host_memory.huge_pages_environ({}, thp_path=str(thp)) is not None) == restarts, libc


RESTART = """
import os
from elastic_jax import host_memory
print("start", flush=True)
host_memory.restart_with_huge_pages()
print(os.environ.get("GLIBC_TUNABLES"))
"""


@pytest.mark.skipif(host_memory.thp_mode() in (None, "never"),
                    reason="the kernel has no transparent huge pages")
def test_restart_with_huge_pages_execs_once():
  """A script calling it first runs twice: once as started, once re-executed with the tunable
  (then it returns); switched off, once without."""
  env = _page_faults_module().variant_environ("default")
  for switch, starts, tunables in (("1", 2, host_memory.TUNABLE), ("0", 1, "None")):
    r = subprocess.run([sys.executable, "-c", RESTART], capture_output=True, text=True,
                       env={**env, host_memory.HUGE_ENV: switch}, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["start"] * starts + [tunables], r.stdout


def test_opt_in():
  """Off unless $ELASTIC_JAX_KEEP_HOST_MEMORY is 1 (or unset with default=True); a bad value is
  an error naming the variable. (Never applied in this process: the children above do.)"""
  import pytest
  assert host_memory.keep_freed_memory({}) is False
  assert host_memory.keep_freed_memory({host_memory.ENV: "0"}, default=True) is False
  assert host_memory.keep_freed_memory({host_memory.ENV: ""}) is False
  with pytest.raises(ValueError, match="ELASTIC_JAX_KEEP_HOST_MEMORY must be 1 or 0"):
    host_memory.keep_freed_memory({host_memory.ENV: "yes"})


def test_page_faults_experiment_quick(tmp_path):
  """experiments/page_faults.py --quick: one process per variant of the tiny train step; glibc's
  default faults in the step's temporary buffer every step, huge pages and the kept heap do not
  (or hardly)."""
  rows = _page_faults_module().run(str(tmp_path), quick=True)
  assert len(rows) == 1
  row = rows[0]
  assert row["kept"]["kept"] and not row["default"]["kept"] and not row["huge"]["kept"]
  assert row["huge"]["huge"] and not row["default"]["huge"] and not row["kept"]["huge"]
  default = row["default"]["faults"]
  assert default > 10_000 and row["kept"]["faults"] < default / 10, row
  if host_memory.thp_mode() not in (None, "never"):
    assert row["huge"]["faults"] < default / 10, row
  md = (tmp_path / "page_faults.md").read_text()
  assert md.count("\n| 0 | default, huge, kept |") == 1 and "Median over rounds" in md
