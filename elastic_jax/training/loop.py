"""A resumable training loop: Orbax CheckpointManager, exact resume, progress, NaN guard.

`run_phase` drives `step_fn(state, step) -> (state, metrics, n_tokens)` from the last saved step
to `total_steps`. A checkpoint holds the state pytree (params, optimizer, ...) and the JSON
state of every data iterator; anything random must derive from `step` (not from host RNG
state) so that a resumed run repeats the uninterrupted one exactly. Saves are Orbax's: written
to a temporary directory and renamed when complete, so a run killed mid-save resumes from the
previous checkpoint.
"""
from __future__ import annotations

import math
import os
import time
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from elastic_jax.io import fingerprint
from elastic_jax.parallel import distributed
from elastic_jax.training.metrics import MetricsWriter


# Key of the data item that holds the state's fingerprints (`io.fingerprint`), beside the
# iterator states.
FINGERPRINTS = "_fingerprints"


def check_finite(value: float, what: str, step: int) -> float:
  """`value`, or FloatingPointError naming `what` and `step` if it is NaN / Inf."""
  value = float(value)
  if not math.isfinite(value):
    raise FloatingPointError(f"{what} is {value} at step {step}; lower the learning rate or check "
                             "the data (no checkpoint was written from this state)")
  return value


def commit(tree):
  """Every array of `tree` committed to the sharding it already has. Restored checkpoints are
  committed and fresh arrays are not; jit compiles (and caches) a different program for each,
  so a resumed run would otherwise compile everything again."""
  return jax.tree_util.tree_map(
      lambda x: jax.device_put(x, x.sharding) if isinstance(x, jax.Array) else x, tree)


def manager(directory: str, keep: int = 2) -> ocp.CheckpointManager:
  """A CheckpointManager for one phase: {"state": pytree, "data": iterator states (JSON)}."""
  opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                      cleanup_tmp_directories=True)
  return ocp.CheckpointManager(os.path.abspath(directory), options=opts,
                               item_names=("state", "data"))


def restore_latest(mngr: ocp.CheckpointManager, state, iterators: Mapping[str, Any]):
  """(step, state) from the newest complete checkpoint whose contents match the fingerprints
  recorded when it was saved (iterators set in place); an older one, saying so, when the newest
  is unreadable or corrupt; (0, state) if there is none. The saved tree must match `state`'s
  structure, shapes and dtypes."""
  steps = sorted(mngr.all_steps(), reverse=True)
  if not steps:
    return 0, state
  abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, state)
  problems = []
  for step in steps:
    try:
      got = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                       data=ocp.args.JsonRestore()))
    except Exception as e:  # orbax raises many types for damaged or mismatched directories
      problems.append(f"step {step}: {type(e).__name__}: {e}")
    else:
      recorded = got.data.get(FINGERPRINTS)
      if isinstance(recorded, list):   # multi-process saves: one (equal) copy per process
        recorded = recorded[0]
      bad = fingerprint.mismatches(got.state, recorded) if recorded else []
      if not bad:
        break
      problems.append(f"step {step}: {bad[0]} does not match its saved fingerprint (corrupt)")
    print(f"{mngr.directory}: cannot resume from {problems[-1]}", flush=True)
  else:
    raise ValueError(f"{mngr.directory}: no usable checkpoint ({'; '.join(problems)}); delete "
                     "the directory to start this phase over")
  if problems:
    print(f"{mngr.directory}: falling back to step {step}", flush=True)
  missing = sorted(set(iterators) - set(got.data))
  if missing:
    raise ValueError(f"{mngr.directory}: step {step} has no state for data iterators {missing}")
  for name, it in iterators.items():
    saved = got.data[name]
    # Multi-process runs save one state per process (in process order).
    it.set_state(saved[jax.process_index()] if isinstance(saved, list) else saved)
  return step, got.state


def _saveable(state):
  """What Orbax may read while the next (donating) step runs. Orbax copies device arrays to
  host before `save` returns, but on CPU that "copy" is a view of the very buffer the next step
  donates and overwrites, so there the save gets buffers of its own."""
  on_cpu = lambda x: (isinstance(x, jax.Array) and
                     next(iter(x.sharding.device_set)).platform == "cpu")
  return jax.tree.map(lambda x: jnp.array(x, copy=True) if on_cpu(x) else x, state)


def _committed(phase: str, step: int) -> None:
  print(f"{phase}: checkpoint {step} committed", flush=True)


def run_phase(phase: str, step_fn: Callable, state, total_steps: int, *, ckpt_dir: str,
              writer: MetricsWriter, iterators: Mapping[str, Any] | None = None,
              log_every: int = 25, save_every: int = 50, keep: int = 2,
              describe: Callable[[int], str] | None = None, loss_key: str = "loss",
              stop_after: int | None = None,
              window: Callable[[list], Mapping[str, float]] | None = None):
  """Runs `phase` to `total_steps`, resuming from `ckpt_dir` if it holds a checkpoint.

  `step_fn(state, step)` (1-based step) returns (state, metrics: dict of scalars, tokens in the
  step). Every `log_every` steps (and the last) prints loss, tokens/s and ETA and writes the
  metrics; every `save_every` steps (and the last) saves, after checking that the loss is
  finite. `describe(step)` adds a host-side note to the progress line (e.g. the budget).
  `window(metrics of every step since the last log)` adds scalars computed over that window
  (e.g. the KD loss per budget); the step metrics stay on device until then (no sync per step).
  `stop_after` ends this attempt at that step, saved (a time-limited job; re-run to go on).
  """
  iterators = dict(iterators or {})
  mngr = manager(ckpt_dir, keep)
  start, state = restore_latest(mngr, state, iterators)
  writer.resume(phase, start)  # drops records an interrupted attempt wrote after `start`
  if start:
    print(f"{phase}: resumed from step {start}/{total_steps} ({mngr.directory})", flush=True)
  t0, tokens, pending, seen = time.perf_counter(), 0, None, []
  try:
    end = total_steps if stop_after is None else min(stop_after, total_steps)
    for step in range(start + 1, end + 1):
      state, metrics, n_tok = step_fn(state, step)
      tokens += n_tok
      last = step == end
      if window is not None:
        seen.append(metrics)
      if step % log_every == 0 or last:
        values = {k: check_finite(v, f"{phase} {k}", step) for k, v in metrics.items()
                  if np.ndim(v) == 0}
        if window is not None:
          values.update(window(seen))
          seen = []
        dt = time.perf_counter() - t0
        tps = tokens / dt
        eta = (total_steps - step) * dt / (step - start)
        note = f" {describe(step)}" if describe else ""
        extras = " ".join(f"{k} {v:.3f}" for k, v in values.items() if k != loss_key)
        print(f"{phase} {step}/{total_steps}{note} loss {values[loss_key]:.4f} {extras} "
              f"{tps:,.0f} tok/s eta {eta:.0f}s", flush=True)
        writer.write(phase, step, **values, tok_per_s=tps)
      if pending and not mngr.is_saving_in_progress():
        pending = _committed(phase, pending)
      if step % save_every == 0 or last:
        if pending:  # the previous save must finish first (Orbax would wait for it too)
          mngr.wait_until_finished()
          _committed(phase, pending)
        check_finite(metrics[loss_key], f"{phase} {loss_key}", step)
        data_state = {name: it.get_state() for name, it in iterators.items()}
        data_state[FINGERPRINTS] = fingerprint.fingerprints(state)
        if jax.process_count() > 1:
          data_state = {k: distributed.allgather_json(v) for k, v in data_state.items()}
        # Async: written in the background, visible to a restart only once committed.
        mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_saveable(state)),
                                                data=ocp.args.JsonSave(data_state)))
        pending = step
    mngr.wait_until_finished()
    if pending:
      _committed(phase, pending)
  finally:
    mngr.close()
  return state
