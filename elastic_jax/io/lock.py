"""An exclusive lock on a run directory, so two jobs never write one workdir at once.

`lock_workdir(path)` takes a non-blocking `fcntl.flock` on `<path>/.lock` and returns the open
file (the lock lives as long as it stays open, i.e. the process); the kernel drops it when the
process dies, so a killed run leaves no stale lock. The holder's pid is written in the file
for the error message.
"""
from __future__ import annotations

import fcntl
import os


class WorkdirBusy(ValueError):
  """Another live process holds the workdir's lock."""


def lock_workdir(path: str):
  """The open lock file of `path` (keep it open), or WorkdirBusy naming the other process."""
  f = open(os.path.join(path, ".lock"), "a+")
  try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    f.seek(0)
    holder = f.read().strip() or "unknown"
    f.close()
    raise WorkdirBusy(f"workdir {path} is in use by another run (pid {holder}); wait for it to "
                      "finish or pass another --workdir") from None
  f.seek(0)
  f.truncate()
  f.write(str(os.getpid()))
  f.flush()
  return f
