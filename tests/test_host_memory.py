"""host_memory.keep_freed_memory: a large freed block is reused, not page-faulted in anew (counted
in child processes; `experiments/speed.py` counts the train step's faults)."""
import os
import subprocess
import sys

from elastic_jax import host_memory

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


def _pages_and_faults(keep: str):
  env = {**os.environ, host_memory.ENV: keep}
  r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                     timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  pages, faults = r.stdout.split()
  return int(pages), float(faults)


def test_freed_block_is_reused_not_faulted_in_again():
  pages, kept = _pages_and_faults("1")
  _, default = _pages_and_faults("0")
  assert default > 0.9 * pages, (default, pages)   # glibc's default: mapped anew each round
  assert kept < 0.01 * pages, (kept, pages)


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
  """experiments/page_faults.py --quick: one process pair of the tiny train step; glibc's default
  faults in the step's temporary buffer every step, the kept heap does not."""
  import importlib.util
  exp_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "experiments")
  spec = importlib.util.spec_from_file_location("page_faults",
                                                os.path.join(exp_dir, "page_faults.py"))
  page_faults = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(page_faults)
  rows = page_faults.run(str(tmp_path), quick=True)
  assert len(rows) == 1 and rows[0]["kept"]["kept"] and not rows[0]["default"]["kept"]
  kept, default = rows[0]["kept"]["faults"], rows[0]["default"]["faults"]
  assert default > 10_000 and kept < default / 10, (kept, default)
  md = (tmp_path / "page_faults.md").read_text()
  assert md.count("\n| 0 | kept |") == 1 and "Median over rounds" in md
