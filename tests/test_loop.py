"""Resumable loop and metrics: resume picks up state and iterators, NaN guard, mismatch errors,
JSONL / TensorBoard records (event files parsed back)."""
import glob
import struct

import jax.numpy as jnp
import numpy as np
import pytest

from elastic_jax.training import data
from elastic_jax.training.loop import check_finite, run_phase
from elastic_jax.training.metrics import MetricsWriter


def _events(logdir):
  """(tag, step, value) of every scalar in the TFRecord event files under `logdir`."""
  from tensorboardX.proto import event_pb2
  out = []
  for path in sorted(glob.glob(f"{logdir}/events.out.tfevents*")):
    raw = open(path, "rb").read()
    i = 0
    while i < len(raw):
      (n,) = struct.unpack("<Q", raw[i:i + 8])
      ev = event_pb2.Event.FromString(raw[i + 12:i + 12 + n])
      i += 12 + n + 4
      out += [(v.tag, ev.step, v.simple_value) for v in ev.summary.value]
  return out


def _counter_phase(workdir, total, fail_at=None, nan_at=None, **kw):
  """A phase whose state counts steps and sums the batches it saw (exact resume check)."""
  rows = np.arange(12 * 3, dtype=np.int32).reshape(12, 3)
  it = iter(data.make_dataset(rows, 2, seed=1, shard_index=0, shard_count=1))
  seen = []

  def step_fn(state, step):
    if step == fail_at:
      raise KeyboardInterrupt  # the process dies here
    x = next(it)
    seen.append(int(x.sum()))
    loss = jnp.nan if step == nan_at else jnp.float32(step)
    return {"n": state["n"] + 1, "sum": state["sum"] + int(x.sum())}, {"loss": loss}, x.size

  writer = MetricsWriter(str(workdir))
  state = run_phase("count", step_fn, {"n": jnp.int32(0), "sum": jnp.int32(0)}, total,
                    ckpt_dir=str(workdir / "ckpt"), writer=writer, iterators={"train": it},
                    log_every=1, save_every=2, **kw)
  writer.close()
  return state, seen


def test_resume_continues_state_and_data(tmp_path):
  ref, ref_seen = _counter_phase(tmp_path / "ref", 7)
  with pytest.raises(KeyboardInterrupt):
    _counter_phase(tmp_path / "run", 7, fail_at=6)   # saved at 2 and 4; step 5 is lost
  state, seen = _counter_phase(tmp_path / "run", 7)
  assert seen == ref_seen[4:]                        # resumed after step 4, same batches
  assert int(state["n"]) == 7 and int(state["sum"]) == int(ref["sum"])
  w = MetricsWriter(str(tmp_path / "run"))
  assert [r["step"] for r in w.read("count")] == list(range(1, 8))  # step 5 written once
  tb = [(s, v) for tag, s, v in _events(tmp_path / "run" / "tb" / "count") if tag == "count/loss"]
  assert sorted(set(tb)) == [(s, float(s)) for s in range(1, 8)]


def test_nan_guard_stops_before_saving(tmp_path):
  with pytest.raises(FloatingPointError, match="count loss is nan at step 3"):
    _counter_phase(tmp_path, 6, nan_at=3)
  with pytest.raises(FloatingPointError, match="at step 9"):
    check_finite(float("inf"), "x", 9)
  # Resuming starts after the last good checkpoint (step 2), not from the NaN state.
  _, seen = _counter_phase(tmp_path, 6)
  assert len(seen) == 4


def test_restore_mismatch_is_a_clear_error(tmp_path):
  writer = MetricsWriter(str(tmp_path))
  step_fn = lambda s, i: (s, {"loss": jnp.float32(0)}, 1)
  run_phase("p", step_fn, {"w": jnp.zeros(3)}, 2, ckpt_dir=str(tmp_path / "c"), writer=writer)
  with pytest.raises(ValueError, match="no usable checkpoint \\(step 2: "):
    run_phase("p", step_fn, {"w": jnp.zeros(4)}, 3, ckpt_dir=str(tmp_path / "c"), writer=writer)


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path, capsys):
  """The newest checkpoint's state no longer matches the fingerprints recorded at its save:
  the phase says so and resumes from the previous committed step, repeating the rest."""
  import json
  _counter_phase(tmp_path / "run", 7)                # saved at 6 and 7 (keep 2)
  meta = tmp_path / "run" / "ckpt" / "7" / "data" / "metadata"
  record = json.loads(meta.read_text())
  record["_fingerprints"]["['sum']"][0] += 1        # what a flipped stored byte looks like
  meta.write_text(json.dumps(record))
  state, seen = _counter_phase(tmp_path / "run", 9)
  out = capsys.readouterr().out
  assert "cannot resume from step 7: ['sum'] does not match its saved fingerprint" in out
  assert "falling back to step 6" in out
  assert int(state["n"]) == 9 and len(seen) == 3     # steps 7, 8, 9 run again from step 6


def test_metrics_writer_forget(tmp_path):
  w = MetricsWriter(str(tmp_path), tensorboard=False)
  for s in (1, 2, 3):
    w.write("a", s, loss=float(s))
  w.write("b", 1, loss=0.5)
  w.write("report", budget="x", acc=0.25)
  w.forget("a", after_step=1)
  w.forget("report")
  assert [(r["phase"], r.get("step")) for r in w.read()] == [("a", 1), ("b", 1)]
