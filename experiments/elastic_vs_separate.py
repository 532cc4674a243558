"""The paper's central claim at small scale: one elastic run gives every size at once, for fewer
tokens than deriving each smaller size on its own.

For each smaller budget (sub-model counts chosen by the elastic run's router), three ways to get
a model of exactly that shape, all from the same corpus, each having seen the same tokens:
  (i)   elastic: slice it out of the one elastic KD run that trained the whole family (it saw the
        parent's pretraining, then the elastic run);
  (ii)  scratch: random init, next-token training for as many tokens as (i);
  (iii) minitron: prune the nested parent to that shape, then distill it alone (forward KL) for as
        many tokens as the whole elastic run.
The paper's accounting (student tokens to obtain all smaller sizes, the parent's pretraining
counted once where it is used): elastic = parent + one elastic run for all sizes; scratch = one
run per size; minitron = parent + one elastic-run-sized distillation per size.

  python experiments/elastic_vs_separate.py --config=configs/reasoning.py --seeds=0,1,2 \
      --workdir=runs/evs_reasoning --out=experiments/results     # the README's table (~25 min/seed)
  python experiments/elastic_vs_separate.py                  # tiny default, one seed
  python experiments/elastic_vs_separate.py --quick          # reduced mode (smallest size only)
  python experiments/elastic_vs_separate.py --config=configs/reasoning.py --seeds=0,1,2 \
      --config.elastic.stage1_steps=600 --config.elastic.stage2_steps=200 \
      --approaches=elastic --parent_from=runs/evs_reasoning --workdir=runs/evs_kd4x
                         # another elastic setting on the same parents, elastic rows only
  python experiments/elastic_vs_separate.py --out=experiments/results \
      --settings=default=runs/evs_reasoning,kd4x=runs/evs_kd4x
                         # one table over finished comparisons (elastic_settings.md), no training

Every seed runs in <workdir>/seed_<seed> (its own init, corpus draw, data order and held-out
items). `--parent_from` starts each seed from the nested parent of another comparison's run
directory (same seed, model, data and pretraining settings, checked), so several elastic
settings share one pretraining; `--approaches` picks the rows besides the parent. Writes
<out>/elastic_vs_separate.md (per-seed rows, then mean and spread over seeds) and .png (quality
vs active params, bars = min..max over seeds) and prints both. Re-running resumes:
every phase checkpoints in its seed's run directory.
"""
from __future__ import annotations

import math
import os
import sys
import time

from absl import app, flags
from ml_collections import config_flags

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)  # `configs` when run as a script from anywhere

FLAGS = flags.FLAGS

def main(argv):
  del argv
  from absl import logging
  logging.set_verbosity(logging.ERROR)
  from main_job import apply_quick

  if FLAGS.settings:
    try:
      settings = {name: recorded_rows(w) for name, w in map(_setting, FLAGS.settings)}
    except ValueError as e:
      sys.exit(f"--settings: {e}")
    _write("elastic_settings", settings_table(settings),
           lambda path: _settings_plot(settings, path))
    return
  config = _CONFIG.value
  if FLAGS.quick:
    apply_quick(config)
  try:
    seeds = [int(s) for s in FLAGS.seeds] if FLAGS.seeds else [config.seed]
  except ValueError:
    sys.exit(f"--seeds: expected comma-separated integers, got {','.join(FLAGS.seeds)!r}")
  t0 = time.perf_counter()
  rows, totals = [], None
  for seed in seeds:
    c = config.copy_and_resolve_references()
    c.seed = seed
    workdir = os.path.join(FLAGS.workdir, f"seed_{seed}")
    if FLAGS.parent_from:
      try:
        reuse_parent(os.path.join(FLAGS.parent_from, f"seed_{seed}"), workdir, c)
      except ValueError as e:
        sys.exit(f"--parent_from: {e}")
    seed_rows, totals = compare_one_seed(c, workdir, FLAGS.quick, tuple(FLAGS.approaches))
    rows += [(seed, *r) for r in seed_rows]
  _write("elastic_vs_separate", _table(rows, totals), lambda path: _plot(rows, path),
         f" ({time.perf_counter() - t0:.0f}s)")


def _write(stem: str, table: str, plot, took: str = "") -> None:
  """`table` to <--out>/<stem>.md and `plot(path)` to <stem>.png; prints the table."""
  out = os.path.abspath(FLAGS.out or FLAGS.workdir)
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, f"{stem}.md"), "w") as f:
    f.write(table + "\n")
  plot(os.path.join(out, f"{stem}.png"))
  print(table)
  print(f"\nwrote {out}/{stem}.md and .png{took}")


APPROACHES = ("elastic", "scratch", "minitron")
# What a parent depends on: a run directory whose record agrees here made the same parent.
PARENT_SECTIONS = ("seed", "model", "data", "pretrain")


def reuse_parent(source: str, workdir: str, config) -> bool:
  """Copies `source`'s nested parent (and tokenizer) into `workdir` unless it has one; the
  source's run record must hold this config's seed, model, data and pretraining settings and its
  held-out items (a ValueError names the first section that differs). True when copied."""
  import json
  import shutil

  from elastic_jax.training import pipeline
  if os.path.isdir(os.path.join(workdir, "parent")):
    return False
  record = os.path.join(source, pipeline.RUN_RECORD)
  if not os.path.isdir(os.path.join(source, "parent")) or not os.path.exists(record):
    raise ValueError(f"{source} holds no finished parent ({pipeline.RUN_RECORD} and parent/)")
  with open(record) as f:
    old = json.load(f)
  c = json.loads(json.dumps(config.to_dict()))
  for k in PARENT_SECTIONS:
    if old["config"].get(k) != c[k]:
      raise ValueError(f"{source} was made with other '{k}' settings than this run")
  held = {"n_reasoning": c["eval"]["n_reasoning"], "sources": list(c["eval"]["sources"])}
  if old.get("held_out", held) != held:
    raise ValueError(f"{source} was made with other held-out items (the 'eval' settings)")
  os.makedirs(workdir, exist_ok=True)
  shutil.copytree(os.path.join(source, "parent"), os.path.join(workdir, "parent"))
  tok = os.path.join(source, "tokenizer.json")
  if os.path.exists(tok):
    shutil.copy(tok, os.path.join(workdir, "tokenizer.json"))
  return True


def compare_one_seed(config, workdir: str, quick: bool, approaches=APPROACHES):
  """The parent, then `approaches` (elastic / scratch / minitron) for every smaller size, in one
  run directory: rows (approach, size, active params, tokens for this size, val loss, answer
  accuracy) and the paper's token totals."""
  from elastic_jax import count_params, init, rng
  from elastic_jax.elastic.slicing import slice_params
  from elastic_jax.training import evaluate, phases, pipeline

  run = pipeline.Run(config, workdir)   # refuses a run directory with other settings
  names = [n for n, _ in config.model.budgets]
  sizes = names[1:][-1:] if quick else names[1:]
  want = [("parent", names[0])] + [(a, n) for n in sizes for a in APPROACHES
                                   if a in approaches]
  done = {(r["approach"], r["budget"]): (r["approach"], r["budget"], r["active_params"],
                                         r["tokens"], r["val_loss"], r["answer_acc"])
          for r in run.writer.read("compare")}
  if all(k in done for k in want):   # this run's comparison finished before: its records
    run.writer.close()
    print(f"{workdir}: the comparison recorded in metrics.jsonl", flush=True)
    rows = [done[k] for k in want]
    return rows, token_totals(rows)
  cfg, td, teacher, family = pipeline.train_family(run)
  examples = pipeline.held_out(run)
  ev, L1, B = config.eval, run.seq_lens[0], config.data.batch
  parent_tokens = config.pretrain.steps * B * L1
  elastic_tokens = family.tokens(run)
  distill_steps = max(1, elastic_tokens // (B * L1))
  scratch_steps = config.pretrain.steps + distill_steps   # the tokens (i) saw, parent included

  def evaluate_model(p, c):
    acc = evaluate.answer_accuracy(p, c, td.tokenizer, examples, ev.max_think_tokens,
                                   ev.max_answer_tokens)
    return evaluate.val_loss(p, c, td.val), acc

  rows = [("parent", cfg.budget_names[0], count_params(cfg).active, parent_tokens,
           *evaluate_model(teacher, cfg))]
  for name in sizes:
    counts = family.budget_counts[name]
    elastic_p, small_cfg = slice_params(family.params, cfg, counts)
    active = count_params(small_cfg).active
    if "elastic" in approaches:
      rows.append(("elastic", name, active, parent_tokens + elastic_tokens,
                   *evaluate_model(elastic_p, small_cfg)))
    if "scratch" in approaches:
      scratch = phases.pretrain(init(small_cfg, rng.key(config.seed, "init")), small_cfg,
                                td.iterator(L1, B, rng.seed_for(config.seed, "pretrain_data")),
                                scratch_steps, run.loop(f"scratch_{name}"),
                                lr=config.pretrain.lr, warmup=config.pretrain.warmup,
                                weight_decay=config.pretrain.weight_decay, name=f"scratch_{name}")
      rows.append(("scratch", name, active, scratch_steps * B * L1,
                   *evaluate_model(scratch, small_cfg)))
    if "minitron" in approaches:
      pruned, _ = slice_params(teacher, cfg, counts)
      minitron = phases.distill(pruned, small_cfg, teacher, cfg,
                                td.iterator(L1, B, rng.seed_for(config.seed, "stage1_data")),
                                distill_steps, run.loop(f"minitron_{name}"),
                                lr=config.elastic.lr, warmup=config.elastic.warmup,
                                weight_decay=config.elastic.weight_decay, name=f"minitron_{name}")
      rows.append(("minitron", name, active, parent_tokens + distill_steps * B * L1,
                   *evaluate_model(minitron, small_cfg)))
  for r in rows:
    run.writer.write("compare", approach=r[0], budget=r[1], active_params=r[2], tokens=r[3],
                     val_loss=r[4], answer_acc=r[5])
  run.writer.close()
  return rows, token_totals(rows)


def _setting(arg: str) -> tuple[str, str]:
  name, sep, workdir = arg.partition("=")
  if not sep or not name or not workdir:
    raise ValueError(f"expected name=workdir, got {arg!r}")
  return name, workdir


def recorded_rows(workdir: str) -> list[tuple]:
  """(seed, approach, size, active, tokens, val loss, accuracy) of every finished seed_<seed>
  comparison under `workdir` (its "compare" records; a row recorded again, by a later run with
  other `--approaches`, counts once, as last recorded), seeds in order."""
  from elastic_jax.training.metrics import MetricsWriter
  seeds = sorted(int(d[5:]) for d in os.listdir(workdir) if d.startswith("seed_")
                 and d[5:].isdigit()) if os.path.isdir(workdir) else []
  rows = []
  for seed in seeds:
    last = {}
    for r in MetricsWriter(os.path.join(workdir, f"seed_{seed}"), tensorboard=False).read(
        "compare"):
      last[(r["approach"], r["budget"])] = (seed, r["approach"], r["budget"], r["active_params"],
                                            r["tokens"], r["val_loss"], r["answer_acc"])
    rows += list(last.values())
  if not rows:
    raise ValueError(f"{workdir} holds no finished comparison (seed_<seed>/metrics.jsonl)")
  return rows


def settings_table(settings: dict[str, list]) -> str:
  """One table over several comparisons ({setting name: its `recorded_rows`}): per setting,
  approach and size, the tokens, seeds and mean ± sd [min, max] of val loss and answer accuracy
  (`summarize`)."""
  lines = ["Per setting (each a comparison's run directory), approach and size: mean ± sample sd "
           "[min, max] over seeds.", "",
           "| setting | approach | size | tokens for this size | seeds | val loss | answer acc |",
           "|---|---|---|---:|---:|---:|---:|"]
  for name, rows in settings.items():
    for (approach, size, _, tokens, n, lm, ls, lmin, lmax, am, asd, amin, amax, _,
         _) in summarize(rows):
      lines.append(f"| {name} | {approach} | {size} | {tokens:,} | {n} | "
                   f"{lm:.3f} ± {ls:.3f} [{lmin:.3f}, {lmax:.3f}] | "
                   f"{am:.3f} ± {asd:.3f} [{amin:.3f}, {amax:.3f}] |")
  return "\n".join(lines)


def token_totals(rows) -> dict:
  """The paper's accounting from one seed's rows: student tokens to obtain every smaller size,
  the parent's pretraining counted once where it is used."""
  parent = next(r[3] for r in rows if r[0] == "parent")
  tokens = lambda a: [r[3] for r in rows if r[0] == a]
  totals = {"elastic": lambda t: t[0], "scratch": sum,
            "minitron": lambda t: parent + sum(x - parent for x in t)}
  return {a: f(tokens(a)) for a, f in totals.items() if tokens(a)}   # the approaches run


def summarize(rows) -> list[tuple]:
  """Per (approach, size) over seeds, in first-seen order: (approach, size, mean active params,
  tokens, seeds, val loss mean, sd, min, max, accuracy mean, sd, min, max, active params min,
  max); sd is the sample standard deviation (0 for one seed). Each seed's router picks its own
  architecture per budget, so the active params of a size differ slightly between seeds."""
  import numpy as np
  groups: dict = {}
  for seed, approach, name, active, tokens, loss, acc in rows:
    groups.setdefault((approach, name, tokens), []).append((loss, acc, active))
  out = []
  for (approach, name, tokens), vals in groups.items():
    vals = np.asarray(vals, float)
    stats = []
    for col in vals[:, :2].T:
      sd = float(col.std(ddof=1)) if len(col) > 1 else 0.0
      stats += [float(col.mean()), sd, float(col.min()), float(col.max())]
    active = vals[:, 2]
    out.append((approach, name, float(active.mean()), tokens, len(vals), *stats,
                int(active.min()), int(active.max())))
  return out


def _table(rows, totals) -> str:
  full_active = next(r[3] for r in rows if r[1] == "parent")
  seeds = sorted({r[0] for r in rows})
  lines = [f"Mean and spread over {len(seeds)} seed(s) ({', '.join(map(str, seeds))}): mean ± "
           "sample sd [min, max]; every row of a size saw the same tokens; active ratio: mean "
           "[min, max] where the seeds' routers chose different architectures.", "",
           "| approach | size | active ratio | tokens for this size | seeds | val loss "
           "| answer acc |", "|---|---|---:|---:|---:|---:|---:|"]
  for (approach, name, active, tokens, n, lm, ls, lmin, lmax, am, asd, amin, amax, a0,
       a1) in summarize(rows):
    ratio = f"{active / full_active:.3f}" + (
        f" [{a0 / full_active:.3f}, {a1 / full_active:.3f}]" if a0 != a1 else "")
    lines.append(f"| {approach} | {name} | {ratio} | {tokens:,} | {n} | "
                 f"{lm:.3f} ± {ls:.3f} [{lmin:.3f}, {lmax:.3f}] | "
                 f"{am:.3f} ± {asd:.3f} [{amin:.3f}, {amax:.3f}] |")
  lines += ["", "Per seed:", "", "| seed | approach | size | active params | active ratio | "
            "tokens for this size | val loss | val ppl | answer acc |",
            "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
  for seed, approach, name, active, tokens, loss, acc in rows:
    lines.append(f"| {seed} | {approach} | {name} | {active:,} | {active / full_active:.3f} | "
                 f"{tokens:,} | {loss:.3f} | {math.exp(loss):.1f} | {acc:.3f} |")
  lines += ["", "The paper's accounting, one seed:", "",
            "| approach | tokens for all smaller sizes (parent pretraining included where used) |",
            "|---|---:|"]
  lines += [f"| {k} | {v:,} |" for k, v in totals.items()]
  return "\n".join(lines)


def _panels(path: str, title: str, figsize, draw, legend: dict) -> None:
  """Val loss (left) and answer accuracy (right) panels saved to `path`; `draw(ax, col)` plots
  one panel from `summarize` rows, whose column `col` is the mean over seeds and col + 2 /
  col + 3 its min / max (`_errorbar`)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=figsize)
  for ax, col, label in ((axes[0], 5, "validation loss (lower is better)"),
                         (axes[1], 9, "answer accuracy")):
    draw(ax, col)
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  axes[0].legend(**legend)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _errorbar(ax, x, summary_rows, col: int, **kwargs) -> None:
  """The means of `summary_rows` at `x`, bars min..max over seeds."""
  y = [r[col] for r in summary_rows]
  ax.errorbar(x, y, yerr=[[m - r[col + 2] for m, r in zip(y, summary_rows)],
                          [r[col + 3] - m for m, r in zip(y, summary_rows)]],
              capsize=3, **kwargs)


def _settings_plot(settings: dict[str, list], path: str):
  """Val loss and answer accuracy per setting (x) of every (approach, size) but the parent's:
  the mean over seeds, bars min..max."""
  names = list(settings)
  series: dict = {}
  for i, name in enumerate(names):
    for r in summarize(settings[name]):
      if r[0] != "parent":
        series.setdefault(f"{r[0]} {r[1]}", []).append((i, r))

  def draw(ax, col):
    for k, (key, pts) in enumerate(series.items()):
      _errorbar(ax, [i + 0.08 * (k - len(series) / 2) for i, _ in pts], [r for _, r in pts],
                col, marker="o", linestyle="", label=key)
    ax.set_xticks(range(len(names)), names, rotation=20)

  _panels(path, "elastic settings on the same parents (mean over seeds, bars: min..max)",
          (11, 4), draw, {"fontsize": 8})


def _plot(rows, path):
  summary = summarize(rows)

  def draw(ax, col):
    for approach, marker in (("parent", "*"), ("elastic", "o"), ("scratch", "s"),
                             ("minitron", "^")):
      pts = sorted((r for r in summary if r[0] == approach), key=lambda r: (r[2], r[col]))
      if pts:
        _errorbar(ax, [r[2] for r in pts], pts, col, marker=marker, label=approach)
    ax.set_xlabel("active parameters")

  n = len({r[0] for r in rows})
  _panels(path, f"elastic (one run, all sizes) vs each size trained separately; {n} seed(s), "
          "bars: min..max", (10, 4), draw, {})


if __name__ == "__main__":
  # Flags only when run as a script: the tests import this module's helpers next to the CLIs'.
  _CONFIG = config_flags.DEFINE_config_file("config", os.path.join(_ROOT, "configs", "tiny.py"),
                                            "run config (configs/*.py) with --config.* "
                                            "overrides")
  flags.DEFINE_string("workdir", "runs/elastic_vs_separate", "run directory (re-run to resume)")
  flags.DEFINE_string("out", None, "where to write the table and plot (default: --workdir)")
  flags.DEFINE_bool("quick", False, "reduced mode: few steps, the smallest budget only")
  flags.DEFINE_list("seeds", None, "run seeds (default: the config's seed)")
  flags.DEFINE_multi_enum("approaches", list(APPROACHES), list(APPROACHES),
                          "rows besides the parent (repeat the flag for several)")
  flags.DEFINE_list("settings", None, "name=workdir,...: no training; one table "
                    "(elastic_settings.md in --out) over these comparisons' recorded rows")
  flags.DEFINE_string("parent_from", None, "a comparison's --workdir whose seed_<seed>/parent "
                      "each seed starts from (same seed, model, data and pretraining settings)")
  app.run(main)
