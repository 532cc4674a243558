"""The platform a program is being built for: jax's default backend, or the one `target` names
while an ahead-of-time plan compiles for other hardware (a TPU topology's devices on a CPU
host, `elastic_jax.plan --topology`). Every choice of kernel or code path by platform asks
`current()`, so a plan compiles what that hardware would run, not the host's CPU paths."""
from __future__ import annotations

import contextlib
import contextvars

import jax

PLATFORMS = ("cpu", "gpu", "tpu")
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("target", default=None)


def current() -> str:
  """"cpu", "gpu" or "tpu": the target set by `target`, else jax's default backend."""
  return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def target(platform: str):
  """Within the block, code traced picks its paths for `platform` (one of PLATFORMS). Trace
  inside it: a function jitted and traced before keeps the paths of its first trace."""
  if platform not in PLATFORMS:
    raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
  token = _TARGET.set(platform)
  try:
    yield
  finally:
    _TARGET.reset(token)
