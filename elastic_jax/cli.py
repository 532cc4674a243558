"""absl's app.run for our CLIs, with user errors as one line on stderr instead of a traceback.

A bad flag value, file, budget or config makes our code raise ValueError (CheckpointError,
HFFormatError and SafetensorsError among them) or FileNotFoundError: the CLIs print
`error: <message>` and exit 1. The same exception types raised inside a library (jax, orbax, ...)
are bugs or environment problems and keep their traceback; ELASTIC_JAX_TRACEBACK=1 keeps it for
ours too.

Before anything else the process re-executes itself once with glibc's malloc on transparent huge
pages (`host_memory.restart_with_huge_pages`; ELASTIC_JAX_HUGE_PAGES=0 off), so XLA:CPU's per-step
temporary buffer maps in 2 MiB pages, not 31,000 fresh 4 KiB ones a step (the tiny train step
about 1.5x faster); with ELASTIC_JAX_KEEP_HOST_MEMORY=1, `host_memory.keep_freed_memory` keeps
freed host memory in the process instead (it slows compiles). Compiled programs persist between
runs (`compilation_cache_dir`): a second run of the same shapes skips XLA's compile (the
test-sized main job: 147 s cold, 61 s warm on 2 CPU cores).
"""
from __future__ import annotations

import os
import sys
import traceback
from typing import Callable

from absl import app

from elastic_jax import host_memory

_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def is_user_error(e: BaseException) -> bool:
  """Raised by our own validation: a ValueError / FileNotFoundError whose innermost frame is in
  this package."""
  frames = traceback.extract_tb(e.__traceback__)
  return (isinstance(e, (ValueError, FileNotFoundError)) and bool(frames)
          and os.path.abspath(frames[-1].filename).startswith(_PACKAGE + os.sep))


CACHE_ENV = "ELASTIC_JAX_COMPILATION_CACHE"


def compilation_cache_dir(environ=os.environ) -> str | None:
  """Where the CLIs keep XLA's compiled programs: None when $JAX_COMPILATION_CACHE_DIR is set
  (jax reads it itself) or $ELASTIC_JAX_COMPILATION_CACHE is "" / "0" (off); else that
  variable's folder, else $XDG_CACHE_HOME/elastic_jax/xla (~/.cache by default)."""
  if environ.get("JAX_COMPILATION_CACHE_DIR"):
    return None
  if CACHE_ENV in environ:
    value = environ[CACHE_ENV]
    return None if value in ("", "0") else os.path.abspath(os.path.expanduser(value))
  base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "elastic_jax", "xla")


def enable_compilation_cache(environ=os.environ) -> str | None:
  """Points jax's persistent compilation cache at `compilation_cache_dir` (before anything
  compiles); jax's own minimum compile time decides which programs are kept. Returns the
  folder, or None when left to jax's settings."""
  path = compilation_cache_dir(environ)
  if path:
    import jax
    jax.config.update("jax_compilation_cache_dir", path)
  return path


def run(main: Callable[[list[str]], object]) -> None:
  """absl's `app.run(main)` for a CLI's entry point: after parsing the flags, the huge-page
  restart (an exec of the same command, once), the opt-in kept heap, the compilation cache,
  then `main`, with our user errors as one line."""
  def guarded(argv):
    try:
      host_memory.restart_with_huge_pages()   # glibc reads its tunables only at startup
      host_memory.keep_freed_memory()   # opt-in; before jax's CPU client starts its threads
      enable_compilation_cache()
      return main(argv)
    except (ValueError, FileNotFoundError) as e:
      if os.environ.get("ELASTIC_JAX_TRACEBACK") or not is_user_error(e):
        raise
      print(f"error: {e}", file=sys.stderr, flush=True)
      sys.exit(1)
  try:
    app.run(guarded)
  except AttributeError as e:   # ml_collections on `--config.<unknown>=...`, while parsing flags
    _unknown_override_exit(e)


def define_config_file(name: str, default: str, help_: str):
  """`config_flags.DEFINE_config_file`, with an unknown `--config.<field>` override (which
  ml_collections reports as a bare AttributeError while defining the flag) as one line."""
  from ml_collections import config_flags
  try:
    return config_flags.DEFINE_config_file(name, default, help_)
  except AttributeError as e:
    _unknown_override_exit(e)


def config_value(holder):
  """The config of a `define_config_file` flag; a file that cannot be loaded is a user error
  (ValueError naming the flag and the OS's reason), not ml_collections' traceback."""
  try:
    value = holder.value
    value.keys()   # a failed load leaves a placeholder that raises on any attribute
    return value
  except OSError as e:
    raise ValueError(f"--{holder.name}: {str(e).strip().splitlines()[-1].strip()}") from None


def _unknown_override_exit(e: AttributeError):
  bad = unknown_config_override(str(e), sys.argv[1:])
  if bad is None or os.environ.get("ELASTIC_JAX_TRACEBACK"):
    raise e
  print(f"error: {bad}: unknown config field (see configs/training.py for the fields)",
        file=sys.stderr, flush=True)
  sys.exit(1)


def unknown_config_override(message: str, argv: list[str]) -> str | None:
  """The `--config.a.b` flag whose last name is the attribute ml_collections reported missing
  (`message` is its AttributeError text, e.g. "'foo'"), or None."""
  name = message.strip("\"'")
  for arg in argv:
    flag = arg.split("=", 1)[0]
    if flag.startswith("--config.") and flag.rsplit(".", 1)[-1] == name:
      return flag
  return None
