"""Smoke run of the main job on the tiny default: every phase, the checkpoint and the table."""
import json
import os
import subprocess
import sys

from elastic_jax import checkpoint


def test_train_pipeline_smoke(tmp_path):
  workdir = str(tmp_path / "run")
  r = subprocess.run([sys.executable, "-m", "elastic_jax.train", f"--workdir={workdir}",
                      "--pretrain_steps=10", "--stage1_steps=6", "--stage2_steps=4",
                      "--log_every=5", "--batch=4"], capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "| budget | target |" in r.stdout and "| small | 0.56 |" in r.stdout
  assert "tok/s" in r.stdout and "eta" in r.stdout
  records = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  assert {r["phase"] for r in records} == {"pretrain", "elastic", "report"}
  meta = checkpoint.load_metadata(os.path.join(workdir, "nested"))
  assert set(meta["budget_counts"]) == {"full", "medium", "small"} and meta["has_router"]
  small, small_cfg = checkpoint.restore(os.path.join(workdir, "nested"), "small")
  assert small_cfg.hidden_size <= 96
