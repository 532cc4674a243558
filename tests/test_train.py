"""The main job on the tiny default: every phase, the checkpoint, the table, and exact resume
after SIGKILL (mid-pretraining and mid-elastic), compared step by step with an uninterrupted run.
"""
import json
import importlib.util
import os
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from elastic_jax import ModelConfig, count_params
from elastic_jax.io import checkpoint
from elastic_jax.training.metrics import MetricsWriter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Small corpus and few steps; log every step so the loss curves can be compared exactly. The
# steps and data match experiments/elastic_vs_separate.py --quick (its test reuses this run).
FLAGS = ["--config.pretrain.steps=8", "--config.elastic.stage1_steps=30",
         "--config.elastic.stage2_steps=10", "--config.log_every=1",
         "--config.checkpoint.save_every=3", "--config.data.batch=4", "--config.data.n_text=300",
         "--config.data.n_reasoning=300", "--config.eval.n_reasoning=4",
         "--config.eval.max_think_tokens=8", "--config.eval.max_answer_tokens=4"]


def _cmd(workdir):
  return [sys.executable, "-m", "elastic_jax.train", f"--workdir={workdir}", *FLAGS]


def _curve(workdir):
  """{(phase, step): loss} of the training phases."""
  out = {}
  for r in MetricsWriter(workdir, tensorboard=False).read():
    if r["phase"] in ("pretrain", "elastic"):
      assert (r["phase"], r["step"]) not in out, f"duplicate record {r}"
      out[(r["phase"], r["step"])] = r["loss"]
  return out


def _run_until(workdir, marker):
  """Starts the job and SIGKILLs it as soon as it prints a line starting with `marker`."""
  p = subprocess.Popen(_cmd(workdir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  seen = []
  for line in p.stdout:
    seen.append(line)
    if line.startswith(marker):
      p.send_signal(signal.SIGKILL)
      break
  p.wait(timeout=600)
  assert p.returncode == -signal.SIGKILL, "".join(seen[-30:])
  return "".join(seen)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("ref"))
  r = subprocess.run(_cmd(workdir), capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  return workdir, r.stdout


def test_pipeline_end_to_end(reference):
  workdir, out = reference
  assert "| budget | target |" in out and "| small | 0.56 |" in out
  assert "tok/s" in out and "eta" in out
  records = MetricsWriter(workdir, tensorboard=False).read()
  assert {r["phase"] for r in records} == {"pretrain", "elastic", "report"}
  report = [r for r in records if r["phase"] == "report"]
  assert [r["budget"] for r in report] == ["full", "medium", "small"]
  # The router's chosen sub-models meet their active-parameter targets within the 5% band.
  for r in report:
    assert abs(r["active_ratio"] / r["target"] - 1) <= 0.05, r
  for phase in ("pretrain", "elastic"):  # TensorBoard event files
    assert any(f.startswith("events.out.tfevents") for f in
               os.listdir(os.path.join(workdir, "tb", phase)))
  meta = checkpoint.load_metadata(os.path.join(workdir, "nested"))
  assert set(meta["budget_counts"]) == {"full", "medium", "small"} and meta["has_router"]
  # Per budget: each target with the deployed architecture's ratio (in band) and the argmax's.
  budget_report = meta["extra"]["budget_report"]
  for r in report:
    got = budget_report[r["budget"]]
    assert got["deployed"]["active"]["target"] == r["target"]
    assert got["deployed"]["active"]["ratio"] == pytest.approx(r["active_ratio"], rel=1e-6)
    assert abs(got["deployed"]["active"]["error"]) <= 0.05
    assert set(got["argmax"]) == {"active"} and set(r["counts"]) <= set(got["argmax_counts"])
  small, small_cfg = checkpoint.restore(os.path.join(workdir, "nested"), "small")
  counts = meta["budget_counts"]["small"]
  # The restored sub-model has the router's chosen sizes (per the stored table), not the parent's.
  assert small_cfg.hidden_size == counts["hidden"] and small["embed"].shape[1] == counts["hidden"]
  assert count_params(small_cfg).active == pytest.approx(
      report[-1]["active_ratio"] * count_params(ModelConfig.from_dict(meta["config"])).active,
      rel=1e-6)


def test_resume_after_kill_is_exact(reference, tmp_path):
  ref_dir, _ = reference
  workdir = str(tmp_path / "killed")
  # Killed as soon as a checkpoint is committed (the run has gone on meanwhile), first while
  # pretraining, then, after pretraining resumed and finished, while distilling.
  _run_until(workdir, "pretrain: checkpoint ")
  _run_until(workdir, "elastic: checkpoint ")
  r = subprocess.run(_cmd(workdir), capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  assert "elastic: resumed from step" in r.stdout
  ref, got = _curve(ref_dir), _curve(workdir)
  assert len(ref) == 8 + 40 and got == ref
  # Reproducibility (issue 20 item 4): the two runs are separate processes (here three, the
  # first two killed), and every metric, the per-budget report included, is bit-identical.
  rows = lambda d: [{k: v for k, v in r.items() if k != "tok_per_s"}
                    for r in MetricsWriter(d, tensorboard=False).read()]
  report = lambda d: [r for r in rows(d) if r["phase"] == "report"]
  assert len(report(ref_dir)) == 3 and report(workdir) == report(ref_dir)
  by_step = lambda d: {(r["phase"], r["step"]): r for r in rows(d) if "step" in r}
  assert by_step(workdir) == by_step(ref_dir)


def test_elastic_vs_separate_quick_mode(reference, tmp_path):
  ref_dir, _ = reference
  workdir = tmp_path / "evs"
  shutil.copytree(ref_dir, workdir / "seed_0")   # the config's seed: one run directory per seed
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "elastic_vs_separate.py"), "--quick",
         f"--workdir={workdir}"]
  r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=str(tmp_path))
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  # The main job's parent and family, reused as they are (a finished phase resumes at its end).
  assert "parent: loaded the nested parent" in r.stdout
  assert "elastic: resumed from step 40/40" in r.stdout
  assert _curve(workdir / "seed_0") == _curve(ref_dir)
  table = (workdir / "elastic_vs_separate.md").read_text()
  for approach in ("parent", "elastic", "scratch", "minitron"):
    assert f"| 0 | {approach} |" in table and f"| {approach} |" in table
  # Every small row saw the parent's 8 x 4 x 64 tokens and the elastic run's 30 x 4 x 64 +
  # 10 x 4 x 128 (scratch as 58 steps of 4 x 64 from random init).
  rows = [l for l in table.splitlines() if "| small |" in l]
  assert len(rows) == 6 and all("| 14,848 |" in l for l in rows), rows
  summary = [l for l in rows if l.startswith("| elastic | small |")]
  assert len(summary) == 1 and "| 1 | " in summary[0] and summary[0].count("± 0.000 [") == 2
  # A rerun reads the finished comparison from the run's records: the same table, no training.
  r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=str(tmp_path))
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  assert "comparison recorded in metrics.jsonl" in r.stdout and "scratch_small" not in r.stdout
  assert (workdir / "elastic_vs_separate.md").read_text() == table
  assert (workdir / "elastic_vs_separate.png").stat().st_size > 10_000
  # Some approaches only: the parent's and the elastic rows of the same records.
  r = subprocess.run(cmd + ["--approaches=elastic"], capture_output=True, text=True,
                     timeout=900, cwd=str(tmp_path))
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  rows = [l for l in (workdir / "elastic_vs_separate.md").read_text().splitlines()
          if l.startswith("| 0 |")]
  assert [l.split(" | ")[1] for l in rows] == ["parent", "elastic"], rows
  assert [l for l in table.splitlines() if l.startswith("| 0 |")][:2] == rows


def _evs():
  spec = importlib.util.spec_from_file_location(
      "evs", os.path.join(ROOT, "experiments", "elastic_vs_separate.py"))
  evs = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(evs)
  return evs


def test_elastic_vs_separate_reuses_a_parent(tmp_path):
  """`--parent_from`: the nested parent of a run with the same seed, model, data and
  pretraining is copied (once); other pretraining settings or no parent are refused by name."""
  from configs import reasoning
  from elastic_jax.training import pipeline
  evs = _evs()
  config = reasoning.get_config()
  src = tmp_path / "src"
  (src / "parent").mkdir(parents=True)
  (src / "parent" / "weights").write_text("w")
  (src / "tokenizer.json").write_text("t")
  c = config.to_dict()
  record = {"config": {k: c[k] for k in pipeline.RESULT_SECTIONS},
            "held_out": {"n_reasoning": c["eval"]["n_reasoning"],
                         "sources": list(c["eval"]["sources"])}}
  (src / pipeline.RUN_RECORD).write_text(json.dumps(record))
  other = config.copy_and_resolve_references()
  other.elastic.stage1_steps *= 4   # elastic settings may differ
  assert evs.reuse_parent(str(src), str(tmp_path / "a"), other)
  assert (tmp_path / "a" / "parent" / "weights").read_text() == "w"
  assert (tmp_path / "a" / "tokenizer.json").read_text() == "t"
  assert not evs.reuse_parent(str(src), str(tmp_path / "a"), other)   # has its own parent
  other.pretrain.steps += 1
  with pytest.raises(ValueError, match="other 'pretrain' settings"):
    evs.reuse_parent(str(src), str(tmp_path / "b"), other)
  with pytest.raises(ValueError, match="holds no finished parent"):
    evs.reuse_parent(str(tmp_path / "none"), str(tmp_path / "b"), config)
  assert not (tmp_path / "b").exists()


def test_elastic_vs_separate_settings_table(tmp_path):
  """`--settings`: every setting's finished seeds, summarised from their "compare" records."""
  evs = _evs()
  for setting, shift in (("a", 0.0), ("b", 1.0)):
    for seed in (0, 1):
      w = MetricsWriter(str(tmp_path / setting / f"seed_{seed}"), tensorboard=False)
      w.write("compare", approach="parent", budget="full", active_params=10, tokens=100,
              val_loss=2.0 + seed, answer_acc=1.0)
      w.write("compare", approach="elastic", budget="small", active_params=5, tokens=120,
              val_loss=3.0 + shift + seed, answer_acc=0.5 * seed)
      w.close()
  w = MetricsWriter(str(tmp_path / "a" / "seed_1"), tensorboard=False)   # recorded again
  w.write("compare", approach="parent", budget="full", active_params=10, tokens=100,
          val_loss=4.0, answer_acc=1.0)
  w.close()
  (tmp_path / "a" / "seed_x").mkdir()   # not a seed directory
  settings = {"A": evs.recorded_rows(str(tmp_path / "a")),
              "B": evs.recorded_rows(str(tmp_path / "b"))}
  table = evs.settings_table(settings)
  rows = [l for l in table.splitlines() if l.startswith("| A |") or l.startswith("| B |")]
  assert len(rows) == 4, table
  sd = f"{0.5 ** 0.5:.3f}"
  assert rows[0].startswith(f"| A | parent | full | 100 | 2 | 3.000 ± {2 ** 0.5:.3f} [2.000, "
                            "4.000] |")
  assert rows[1] == (f"| A | elastic | small | 120 | 2 | 3.500 ± {sd} [3.000, 4.000] | "
                     f"0.250 ± {0.5 ** 0.5 / 2:.3f} [0.000, 0.500] |")
  assert rows[3].startswith(f"| B | elastic | small | 120 | 2 | 4.500 ± {sd} [4.000, 5.000] |")
  with pytest.raises(ValueError, match="holds no finished comparison"):
    evs.recorded_rows(str(tmp_path / "c"))
  evs._settings_plot(settings, str(tmp_path / "s.png"))
  assert (tmp_path / "s.png").stat().st_size > 10_000


def test_elastic_vs_separate_summary_over_seeds():
  evs = _evs()
  rows = [(0, "parent", "full", 10, 100, 2.0, 0.5), (0, "elastic", "small", 5, 120, 3.0, 0.25),
          (1, "parent", "full", 10, 100, 2.5, 0.75), (1, "elastic", "small", 4, 120, 4.0, 0.0),
          (2, "elastic", "small", 6, 120, 3.5, 0.5)]   # seeds' routers: 5, 4, 6 active params
  (p, e) = evs.summarize(rows)
  assert p == ("parent", "full", 10, 100, 2, 2.25, pytest.approx(0.5 ** 0.5 / 2), 2.0, 2.5,
               0.625, pytest.approx(0.25 / 2 ** 0.5), 0.5, 0.75, 10, 10)
  assert e[:5] == ("elastic", "small", 5, 120, 3) and e[5:9] == (3.5, 0.5, 3.0, 4.0)
  assert e[9:] == (0.25, 0.25, 0.0, 0.5, 4, 6)
  # The paper's accounting counts the approaches that ran.
  seed = [("parent", "full", 10, 100, 2.0, 1.0), ("elastic", "medium", 8, 120, 2.1, 1.0),
          ("scratch", "medium", 8, 120, 2.2, 1.0), ("minitron", "medium", 8, 120, 2.3, 1.0),
          ("elastic", "small", 5, 120, 2.5, 1.0), ("scratch", "small", 5, 120, 2.6, 1.0),
          ("minitron", "small", 5, 120, 2.7, 1.0)]
  assert evs.token_totals(seed) == {"elastic": 120, "scratch": 240, "minitron": 140}
  assert evs.token_totals([r for r in seed if r[0] in ("parent", "elastic")]) == {
      "elastic": 120}


def test_quantized_family_from_the_main_job(reference, tmp_path):
  """`--config.quant.format=nvfp4` on a finished run: the family resumes at its end, QAD runs
  (budgets drawn per micro-batch, the router's counts fixed), one quantized nested checkpoint
  is written and each budget reported from it, the slice CLI exports a budget of it in
  ModelOpt's format; the quantization experiment on the run loads it instead of training
  again."""
  from elastic_jax.quant.qtensor import QTensor
  ref_dir, _ = reference
  workdir = tmp_path / "q"
  shutil.copytree(ref_dir, workdir)
  cmd = _cmd(str(workdir)) + ["--config.quant.format=nvfp4", "--config.quant.qad_steps=3"]
  r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  assert "elastic: resumed from step 40/40" in r.stdout and "qad 3/3 budget " in r.stdout
  assert "quant: nvfp4 family (QAD 3 steps) saved to" in r.stdout
  assert "nested_nvfp4 checkpoint: " in r.stdout
  rows = [x for x in MetricsWriter(str(workdir), tensorboard=False).read()
          if x["phase"] == "report"]
  fp, q = rows[:3], rows[3:]
  assert [x.get("format") for x in rows] == [None] * 3 + ["nvfp4"] * 3
  for a, b in zip(fp, q):   # same sub-models; 4-bit weights cost a little loss
    assert (a["budget"], a["counts"]) == (b["budget"], b["counts"])
    assert abs(b["val_loss"] - a["val_loss"]) < 0.1, (a, b)
  path = os.path.join(workdir, "nested_nvfp4")
  meta = checkpoint.load_metadata(path)
  nested = checkpoint.load_metadata(os.path.join(workdir, "nested"))
  assert meta["budget_counts"] == nested["budget_counts"] and meta["has_router"]
  assert meta["extra"]["quant"]["qad_steps"] == 3 and len(meta["quantized"]) > 10
  small, small_cfg = checkpoint.restore(path, "small")
  assert isinstance(small["layers"]["1"]["mixer"]["up"], QTensor)
  assert small_cfg.hidden_size == nested["budget_counts"]["small"]["hidden"]
  # The slice CLI writes a budget of it in ModelOpt's format, which reads back to the same
  # codes, with input scales calibrated on the embedded corpus.
  hf_dir = str(tmp_path / "small_nvfp4")
  s = subprocess.run([sys.executable, "-m", "elastic_jax.slice", f"--checkpoint={path}",
                      "--budget=small", "--format=hf", f"--out={hf_dir}",
                      "--calibration_data=default", "--calibration_batches=2"],
                     capture_output=True, text=True, timeout=300)
  assert s.returncode == 0 and "wrote hf sub-model" in s.stdout, s.stderr[-2000:]
  assert "calibrated input scales on 2,048 tokens" in s.stdout
  from elastic_jax.io import modelopt
  from elastic_jax.io import safetensors_io as st
  t = st.load_folder(hf_dir)
  scales = [k for k in t if k.endswith(".input_scale")]
  assert len(scales) == sum(k.endswith(".weight_scale_2") for k in t) > 10
  assert all(0 < float(t[k]) < 1 for k in scales)
  _, back = modelopt.load_pretrained(hf_dir)
  bits = lambda t: [bytes(np.asarray(x).reshape(-1).view(np.uint8)) for x in jax.tree.leaves(t)]
  assert bits(back) == bits(small)
  # experiments/quantization.py on this run (its quick settings are this run's): the family and
  # the NVFP4 QAD checkpoint are loaded, not trained again; every format per budget, the exact
  # nano_v3 bytes (one nested NVFP4 30B ~ the paper's 18.7 GB) and the 16 GB fit.
  r = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "quantization.py"),
                      "--quick", f"--workdir={workdir}", "--context=8192"],
                     capture_output=True, text=True, timeout=900, cwd=str(tmp_path))
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  assert "elastic: resumed from step 40/40" in r.stdout
  assert "quant: loaded the nvfp4 family" in r.stdout and "qad 1/3" not in r.stdout
  table = (workdir / "quantization.md").read_text()
  for fmt in ("bf16", "fp8 PTQ", "mixed PTQ", "nvfp4 PTQ", "nvfp4 QAD"):
    cells = [l.split("|")[1:3] for l in table.splitlines() if l.startswith("| ")]
    assert [b.strip() for b, f in cells if f == f" {fmt} " and b.strip() != "nano_v3"] == [
        "full", "medium", "small"], fmt
  nano = [l for l in table.splitlines() if l.startswith("| nano_v3 | nvfp4 |")]
  assert len(nano) == 1 and nano[0].split("|")[3].strip().startswith("18.")
  assert "| nvfp4 | 8,192 | 4.21 | 0.08 | 4.29 | yes |" in table   # 12B-like: each axis' last
  mixed = [l for l in table.splitlines() if l.startswith("| nano_v3 | mixed |")]
  assert len(mixed) == 1 and float(nano[0].split("|")[3].split()[0]) < float(
      mixed[0].split("|")[3].split()[0]) < 0.5 * float(table.split("| nano_v3 | bf16 |")[1]
                                                     .split("|")[1].split()[0])
  assert (workdir / "quantization.png").stat().st_size > 10_000


def test_train_cli_hf_parent_and_local_files(tmp_path):
  """--hf_dir: no pretraining, and the nested parent is that model (nesting keeps its function,
  so the saved parent's logits equal the HF model's); --data_files: the corpus and tokenizer come
  from those files only. (The CLI's config.parallel.mesh: test_parallel's two-process job.)"""
  import jax
  import numpy as np
  from configs.tiny import MODEL
  from elastic_jax import apply, init
  from elastic_jax.io import hf
  from elastic_jax.training.data import load_tokenizer
  hf_dir, workdir = str(tmp_path / "hf"), str(tmp_path / "run")
  hf.save_pretrained(hf_dir, init(MODEL, jax.random.PRNGKey(7)), MODEL)
  words = ["walrus", "harbour", "choir", "lantern", "meadow"]
  (tmp_path / "a.txt").write_text("".join(
      f"the {words[i % 5]} sings verse {i} with the {words[(i + 2) % 5]}. " * 3 + "\n\n"
      for i in range(150)))
  (tmp_path / "b.jsonl").write_text("".join(
      json.dumps({"text": f"a {words[i % 5]} and a {words[(i + 1) % 5]} met {i} times. " * 3}) + "\n"
      for i in range(120)))
  steps = ["--config.elastic.stage1_steps=2", "--config.elastic.stage2_steps=1"]
  r = subprocess.run(_cmd(workdir) + steps + [f"--hf_dir={hf_dir}",
                     f"--data_files={tmp_path / 'a.txt'},{tmp_path / 'b.jsonl'}"],
                     capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  assert "data: 270 docs" in r.stdout
  assert {x["phase"] for x in MetricsWriter(workdir, tensorboard=False).read()} == {
      "elastic", "report"}
  tok = load_tokenizer(os.path.join(workdir, "tokenizer.json"))
  assert all(tok.token_to_id(f"\u0120{w}") is not None for w in words)  # whole words: our corpus
  cfg, hf_params = hf.load_pretrained(hf_dir)
  teacher, _ = checkpoint.restore(os.path.join(workdir, "parent"))
  tokens = np.random.RandomState(0).randint(0, MODEL.vocab_size, (2, 24)).astype(np.int32)
  np.testing.assert_allclose(apply(teacher, tokens, config=MODEL),
                             apply(hf_params, tokens, config=cfg), rtol=1e-4, atol=1e-4)


def test_train_cli_user_error_is_one_line(tmp_path):
  bad = tmp_path / "corpus.csv"
  bad.write_text("a,b\n")
  r = subprocess.run(_cmd(str(tmp_path / "run")) + [f"--data_files={bad}"],
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 1 and r.stderr.strip() == (
      f"error: data file {str(bad)!r}: expected .txt or .jsonl"), r.stderr[-2000:]
  r = subprocess.run(_cmd(str(tmp_path / "run2")) + ["--config.data.foo=1"],
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 1 and r.stderr.strip() == (
      "error: --config.data.foo: unknown config field (see configs/training.py for the fields)"
  ), r.stderr[-2000:]
  assert not (tmp_path / "run2").exists()
  r = subprocess.run([sys.executable, "-m", "elastic_jax.train", "--config=/nonexistent/run.py",
                      f"--workdir={tmp_path / 'run3'}"],
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 1 and r.stderr.strip() == (
      "error: --config: [Errno 2] No such file or directory: '/nonexistent/run.py'"
  ), r.stderr[-2000:]
  assert not (tmp_path / "run3").exists()


@pytest.mark.parametrize("field, value, match", [
    ("checkpoint.keep", 0, "checkpoint.keep must be an int >= 1, got 0"),
    ("checkpoint.save_every", -5, "checkpoint.save_every must be an int >= 1, got -5"),
    ("optim.master", "fp16", "optim.master must be one of"),
    ("elastic.kd_chunk", -1, "elastic.kd_chunk must be an int >= 0"),
    ("elastic.stage2_probs", (0.6, 0.4), r"elastic.stage2_probs must be 3 probabilities"),
    ("data.seq_len", 0, "data.seq_len must be an int >= 2, got 0"),
    ("elastic.stage2_len_mult", 0, "elastic.stage2_len_mult must be an int >= 1, got 0"),
    ("router.tau_min", 0.0, "router.tau_min must be a number > 0 and <= 1, got 0.0"),
    ("pretrain.lr", -1e-3, "pretrain.lr must be a number > 0, got -0.001"),
    ("data.n_text", -5, "data.n_text must be an int >= 0, got -5"),
    ("elastic.hard_prob", 2.0, "elastic.hard_prob must be a number >= 0 and <= 1, got 2.0"),
    ("elastic.expert_placement", "strided", "elastic.expert_placement must be one of"),
    ("router.band_weight", -1.0, "router.band_weight must be a number >= 0, got -1.0"),
    ("quant.format", "int4", "quant.format must be one of '', 'fp8', 'nvfp4'; got 'int4'"),
    ("quant.leaves", ("up", "A_log"), r"quant leaves \['A_log'\] are not matmul weights"),
    ("quant.qad_steps", -1, "quant.qad_steps must be an int >= 0, got -1"),
    ("quant.fp8_leaves", ("q",), r"fp8_leaves: \['k', 'q', 'v'\] are one fused matmul"),
])
def test_bad_run_config_is_refused_before_anything_is_written(tmp_path, field, value, match):
  from configs import tiny
  from elastic_jax.training import pipeline
  c = tiny.get_config()
  section, name = field.split(".")
  c[section][name] = value
  if section == "quant" and name != "format":
    c.quant.format = "nvfp4"
  with pytest.raises(ValueError, match=match):
    pipeline.Run(c, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()
  pipeline.check_run_config(tiny.get_config())


def test_one_run_per_workdir(tmp_path):
  """A second run on a workdir in use fails at once naming the holder; the lock goes with the
  process that held it (a killed run leaves none behind), and the next run cleans the
  unfinished saves it left."""
  from configs import tiny
  from elastic_jax.io.lock import WorkdirBusy
  from elastic_jax.training import pipeline
  first = pipeline.Run(tiny.get_config(), str(tmp_path / "run"))
  with pytest.raises(WorkdirBusy, match=f"in use by another run \\(pid {os.getpid()}\\)"):
    pipeline.Run(tiny.get_config(), str(tmp_path / "run"))
  first._lock.close()
  holder = subprocess.Popen([sys.executable, "-c", (
      "import sys, time; from elastic_jax.io.lock import lock_workdir; "
      f"l = lock_workdir({str(tmp_path / 'run')!r}); print('locked', flush=True); time.sleep(60)")],
      stdout=subprocess.PIPE, text=True, cwd=ROOT)
  assert holder.stdout.readline().strip() == "locked"
  with pytest.raises(WorkdirBusy, match=f"pid {holder.pid}"):
    pipeline.Run(tiny.get_config(), str(tmp_path / "run"))
  holder.kill()
  holder.wait()
  # The next run removes unfinished saves a killed run left (only ours: <name>.tmp-<pid>-<ns>).
  for name in ("nested.tmp-123-456", "parent.tmp-9-10", "notes.tmp-x"):
    os.makedirs(tmp_path / "run" / name / "params")
  pipeline.Run(tiny.get_config(), str(tmp_path / "run"))._lock.close()
  assert sorted(p.name for p in (tmp_path / "run").iterdir() if ".tmp-" in p.name) == [
      "notes.tmp-x"]


def test_rerun_with_other_settings_is_refused(tmp_path):
  """A workdir remembers the settings that decide its result: a rerun that changes one is
  refused naming it (logging and checkpoint cadence may change); `restart` clears the run's
  outputs (only those) and starts over."""
  from configs import tiny
  from elastic_jax.training import pipeline
  work = str(tmp_path / "run")
  pipeline.Run(tiny.get_config(), work, {"data_files": ["/a.txt"]})._lock.close()
  pipeline.Run(tiny.get_config(), work, {"data_files": ["/a.txt"], "hf_dir": None})._lock.close()
  same = tiny.get_config()
  same.log_every, same.checkpoint.save_every, same.eval.max_think_tokens = 1, 7, 16
  pipeline.Run(same, work, {"data_files": ["/a.txt"]})._lock.close()
  # The held-out items decide the corpus (it leaves their questions out): recorded and compared.
  held = tiny.get_config()
  held.eval.n_reasoning = 32
  with pytest.raises(ValueError, match=r"other settings \(held_out.n_reasoning\)"):
    pipeline.Run(held, work, {"data_files": ["/a.txt"]})
  # A record from before held_out was recorded is taken to match, and completed.
  record = os.path.join(work, "run_config.json")
  with open(record) as f:
    full = json.load(f)
  with open(record, "w") as f:
    json.dump({k: v for k, v in full.items() if k != "held_out"}, f)
  pipeline.Run(tiny.get_config(), work, {"data_files": ["/a.txt"]})._lock.close()
  with open(record) as f:
    assert json.load(f) == full
  other = tiny.get_config()
  other.elastic.lr = 5e-4
  other.model.hidden_choices = (96, 64)
  with pytest.raises(ValueError, match=r"other settings \(config.elastic.lr, "
                                       r"config.model.hidden_choices\).*--restart"):
    pipeline.Run(other, work, {"data_files": ["/a.txt"]})
  with pytest.raises(ValueError, match=r"other settings \(inputs.data_files\)"):
    pipeline.Run(tiny.get_config(), work, {"data_files": ["/b.txt"]})
  os.makedirs(os.path.join(work, "parent"))
  (tmp_path / "run" / "notes.txt").write_text("mine")
  pipeline.Run(other, work, {"data_files": ["/a.txt"]}, restart=True)._lock.close()
  assert sorted(os.listdir(work)) == [".lock", "notes.txt", "run_config.json"]
  pipeline.Run(other, work, {"data_files": ["/a.txt"]})._lock.close()   # the new settings stick
  # Quantizing a run's family adds to it; each format keeps the settings it was made with.
  nvfp4 = other.copy_and_resolve_references()
  nvfp4.quant.format = "nvfp4"
  pipeline.Run(nvfp4, work, {"data_files": ["/a.txt"]})._lock.close()
  pipeline.Run(other, work, {"data_files": ["/a.txt"]})._lock.close()
  fp8 = nvfp4.copy_and_resolve_references()
  fp8.quant.format, fp8.quant.lr = "fp8", 1e-3
  pipeline.Run(fp8, work, {"data_files": ["/a.txt"]})._lock.close()
  nvfp4.quant.lr = 1e-3
  with pytest.raises(ValueError, match=r"other settings \(quant.nvfp4.lr\)"):
    pipeline.Run(nvfp4, work, {"data_files": ["/a.txt"]})
