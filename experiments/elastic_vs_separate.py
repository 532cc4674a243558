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

Every seed runs in <workdir>/seed_<seed> (its own init, corpus draw, data order and held-out
items). Writes <out>/elastic_vs_separate.md (per-seed rows, then mean and spread over seeds) and
.png (quality vs active params, bars = min..max over seeds) and prints both. Re-running resumes:
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
    seed_rows, totals = compare_one_seed(c, os.path.join(FLAGS.workdir, f"seed_{seed}"),
                                         FLAGS.quick)
    rows += [(seed, *r) for r in seed_rows]
  table = _table(rows, totals)
  out = os.path.abspath(FLAGS.out or FLAGS.workdir)
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "elastic_vs_separate.md"), "w") as f:
    f.write(table + "\n")
  _plot(rows, os.path.join(out, "elastic_vs_separate.png"))
  print(table)
  print(f"\nwrote {out}/elastic_vs_separate.md and .png ({time.perf_counter() - t0:.0f}s)")


def compare_one_seed(config, workdir: str, quick: bool):
  """The parent, then elastic / scratch / minitron for every smaller size, in one run directory:
  rows (approach, size, active params, tokens for this size, val loss, answer accuracy) and the
  paper's token totals."""
  from elastic_jax import count_params, init, rng
  from elastic_jax.elastic.slicing import slice_params
  from elastic_jax.training import evaluate, phases, pipeline

  run = pipeline.Run(config, workdir)   # refuses a run directory with other settings
  names = [n for n, _ in config.model.budgets]
  sizes = names[1:][-1:] if quick else names[1:]
  want = [("parent", names[0])] + [(a, n) for n in sizes for a in ("elastic", "scratch",
                                                                     "minitron")]
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
    rows.append(("elastic", name, active, parent_tokens + elastic_tokens,
                 *evaluate_model(elastic_p, small_cfg)))
    scratch = phases.pretrain(init(small_cfg, rng.key(config.seed, "init")), small_cfg,
                              td.iterator(L1, B, rng.seed_for(config.seed, "pretrain_data")),
                              scratch_steps, run.loop(f"scratch_{name}"),
                              lr=config.pretrain.lr, warmup=config.pretrain.warmup,
                              weight_decay=config.pretrain.weight_decay, name=f"scratch_{name}")
    rows.append(("scratch", name, active, scratch_steps * B * L1,
                 *evaluate_model(scratch, small_cfg)))
    pruned, _ = slice_params(teacher, cfg, counts)
    minitron = phases.distill(pruned, small_cfg, teacher, cfg,
                              td.iterator(L1, B, rng.seed_for(config.seed, "stage1_data")),
                              distill_steps, run.loop(f"minitron_{name}"), lr=config.elastic.lr,
                              warmup=config.elastic.warmup,
                              weight_decay=config.elastic.weight_decay, name=f"minitron_{name}")
    rows.append(("minitron", name, active, parent_tokens + distill_steps * B * L1,
                 *evaluate_model(minitron, small_cfg)))
  for r in rows:
    run.writer.write("compare", approach=r[0], budget=r[1], active_params=r[2], tokens=r[3],
                     val_loss=r[4], answer_acc=r[5])
  run.writer.close()
  return rows, token_totals(rows)


def token_totals(rows) -> dict:
  """The paper's accounting from one seed's rows: student tokens to obtain every smaller size,
  the parent's pretraining counted once where it is used."""
  parent = next(r[3] for r in rows if r[0] == "parent")
  tokens = lambda a: [r[3] for r in rows if r[0] == a]
  return {"elastic": tokens("elastic")[0], "scratch": sum(tokens("scratch")),
          "minitron": parent + sum(t - parent for t in tokens("minitron"))}


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


def _plot(rows, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  summary = summarize(rows)
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for ax, col, label in ((axes[0], 5, "validation loss (lower is better)"),
                         (axes[1], 9, "answer accuracy")):
    for approach, marker in (("parent", "*"), ("elastic", "o"), ("scratch", "s"),
                             ("minitron", "^")):
      pts = sorted((r[2], r[col], r[col + 2], r[col + 3]) for r in summary if r[0] == approach)
      if pts:
        x, y, lo, hi = (list(v) for v in zip(*pts))
        ax.errorbar(x, y, yerr=[[a - b for a, b in zip(y, lo)], [b - a for a, b in zip(y, hi)]],
                    marker=marker, capsize=3, label=approach)
    ax.set_xlabel("active parameters")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  axes[0].legend()
  n = len({r[0] for r in rows})
  fig.suptitle(f"elastic (one run, all sizes) vs each size trained separately; {n} seed(s), "
               "bars: min..max")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  # Flags only when run as a script: the tests import this module's helpers next to the CLIs'.
  _CONFIG = config_flags.DEFINE_config_file("config", os.path.join(_ROOT, "configs", "tiny.py"),
                                            "run config (configs/*.py) with --config.* "
                                            "overrides")
  flags.DEFINE_string("workdir", "runs/elastic_vs_separate", "run directory (re-run to resume)")
  flags.DEFINE_string("out", None, "where to write the table and plot (default: --workdir)")
  flags.DEFINE_bool("quick", False, "reduced mode: few steps, the smallest budget only")
  flags.DEFINE_list("seeds", None, "run seeds (default: the config's seed)")
  app.run(main)
