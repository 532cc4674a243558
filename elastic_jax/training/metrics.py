"""Run metrics: one JSONL file for the whole run plus TensorBoard event files per phase.

`metrics.jsonl` holds one record per line ({"phase", "step", ...}); TensorBoard scalars go to
`tb/<phase>/` as `<phase>/<key>` (tensorboardX writes the event files, no TensorFlow needed).
Resuming a phase from step s drops that phase's records after s from both, so a resumed run's
curves are the uninterrupted run's curves.
"""
from __future__ import annotations

import json
import math
import numbers
import os


class MetricsWriter:
  """Appends records for one run directory; see the module docstring. In a multi-process run
  only process 0 writes (every process computes the same global metrics)."""

  def __init__(self, workdir: str, tensorboard: bool = True):
    import jax
    self.enabled = jax.process_index() == 0
    self.workdir = workdir
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.tensorboard = tensorboard
    self._tb = {}
    os.makedirs(workdir, exist_ok=True)

  def _writer(self, phase: str, purge_step: int | None = None):
    if not self.tensorboard:
      return None
    if phase not in self._tb or purge_step is not None:
      from tensorboardX import SummaryWriter
      if phase in self._tb:
        self._tb[phase].close()
      self._tb[phase] = SummaryWriter(os.path.join(self.workdir, "tb", phase),
                                      purge_step=purge_step, flush_secs=10)
    return self._tb[phase]

  def resume(self, phase: str, step: int) -> None:
    """Forget `phase` records after `step` (they belong to the interrupted attempt)."""
    if not self.enabled:
      return
    self.forget(phase, step)
    self._writer(phase, purge_step=step + 1)

  def forget(self, phase: str, after_step: int | None = None) -> None:
    """Drops `phase` records from metrics.jsonl: those after `after_step`, or all if None."""
    if self.enabled and os.path.exists(self.path):
      with open(self.path) as f:
        lines = [l for l in f if l.strip()]
      keep = [l for l in lines if not _after(json.loads(l), phase, after_step)]
      if len(keep) != len(lines):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
          f.writelines(keep)
        os.replace(tmp, self.path)

  def write(self, phase: str, step: int | None = None, **values) -> dict:
    """Appends {"phase", "step", **values}; numeric scalars also go to TensorBoard."""
    record = {"phase": phase, **({} if step is None else {"step": int(step)}), **values}
    if not self.enabled:
      return record
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    tb = self._writer(phase) if step is not None else None
    if tb is not None:
      for k, v in values.items():
        if isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v):
          tb.add_scalar(f"{phase}/{k}", float(v), int(step))
      tb.flush()  # a crash loses nothing that was logged
    return record

  def read(self, phase: str | None = None) -> list[dict]:
    """The records so far (of one phase if given)."""
    if not os.path.exists(self.path):
      return []
    with open(self.path) as f:
      records = [json.loads(l) for l in f if l.strip()]
    return [r for r in records if phase is None or r["phase"] == phase]

  def close(self) -> None:
    for w in self._tb.values():
      w.close()
    self._tb = {}


def _after(record: dict, phase: str, step: int | None) -> bool:
  return record.get("phase") == phase and (step is None or record.get("step", -1) > step)
