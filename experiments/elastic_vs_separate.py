"""The paper's central claim at small scale: one elastic run gives every size at once, for fewer
tokens than deriving each smaller size on its own.

For each smaller budget (sub-model counts chosen by the elastic run's router), three ways to get
a model of exactly that shape, all from the same corpus:
  (i)   elastic: slice it out of the one elastic KD run that trained the whole family;
  (ii)  scratch: random init, next-token training for as many tokens as the parent's pretraining;
  (iii) minitron: prune the nested parent to that shape, then distill it alone (forward KL) for as
        many tokens as the whole elastic run.
Token accounting (student tokens, the parent's pretraining counted once where it is used):
elastic = parent + one elastic run for all sizes; scratch = one pretraining-sized run per size;
minitron = parent + one elastic-run-sized distillation per size.

  python experiments/elastic_vs_separate.py                  # tiny default (several minutes)
  python experiments/elastic_vs_separate.py --quick          # reduced mode (smallest size only)

Writes <out>/elastic_vs_separate.md (table) and .png (quality vs active params) and prints both
the table and the token totals. Re-running resumes: every phase checkpoints in --workdir.
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

_CONFIG = config_flags.DEFINE_config_file("config", os.path.join(_ROOT, "configs", "tiny.py"),
                                          "run config (configs/*.py) with --config.* overrides")
flags.DEFINE_string("workdir", "runs/elastic_vs_separate", "run directory (re-run to resume)")
flags.DEFINE_string("out", None, "where to write the table and plot (default: --workdir)")
flags.DEFINE_bool("quick", False, "reduced mode: few steps, the smallest budget only")
FLAGS = flags.FLAGS

def main(argv):
  del argv
  from absl import logging
  logging.set_verbosity(logging.ERROR)
  from elastic_jax import count_params, init, rng
  from elastic_jax.training import evaluate, phases, pipeline
  from elastic_jax.elastic.slicing import slice_params
  from main_job import apply_quick

  config = _CONFIG.value
  if FLAGS.quick:
    apply_quick(config)
  t0 = time.perf_counter()
  run = pipeline.Run(config, FLAGS.workdir)
  cfg, td, teacher, family = pipeline.train_family(run)
  examples = pipeline.held_out(run)
  ev, L1, B = config.eval, run.seq_lens[0], config.data.batch
  parent_tokens = config.pretrain.steps * B * L1
  elastic_tokens = family.tokens(run)
  distill_steps = max(1, elastic_tokens // (B * L1))

  def evaluate_model(p, c):
    acc = evaluate.answer_accuracy(p, c, td.tokenizer, examples, ev.max_think_tokens,
                                   ev.max_answer_tokens)
    return evaluate.val_loss(p, c, td.val), acc

  full_active = count_params(cfg).active
  rows = []
  loss, acc = evaluate_model(teacher, cfg)
  rows.append(("parent", cfg.budget_names[0], full_active, parent_tokens, loss, acc))
  sizes = cfg.budget_names[1:][-1:] if FLAGS.quick else cfg.budget_names[1:]
  for name in sizes:
    counts = family.budget_counts[name]
    elastic_p, small_cfg = slice_params(family.params, cfg, counts)
    active = count_params(small_cfg).active
    rows.append(("elastic", name, active, elastic_tokens, *evaluate_model(elastic_p, small_cfg)))
    scratch = phases.pretrain(init(small_cfg, rng.key(config.seed, "init")), small_cfg,
                              td.iterator(L1, B, rng.seed_for(config.seed, "pretrain_data")),
                              config.pretrain.steps, run.loop(f"scratch_{name}"),
                              lr=config.pretrain.lr, warmup=config.pretrain.warmup,
                              weight_decay=config.pretrain.weight_decay, name=f"scratch_{name}")
    rows.append(("scratch", name, active, parent_tokens, *evaluate_model(scratch, small_cfg)))
    pruned, _ = slice_params(teacher, cfg, counts)
    minitron = phases.distill(pruned, small_cfg, teacher, cfg,
                              td.iterator(L1, B, rng.seed_for(config.seed, "stage1_data")),
                              distill_steps, run.loop(f"minitron_{name}"), lr=config.elastic.lr,
                              warmup=config.elastic.warmup,
                              weight_decay=config.elastic.weight_decay, name=f"minitron_{name}")
    rows.append(("minitron", name, active, distill_steps * B * L1,
                 *evaluate_model(minitron, small_cfg)))

  totals = {"elastic": parent_tokens + elastic_tokens,
            "scratch": parent_tokens * len(sizes),
            "minitron": parent_tokens + len(sizes) * distill_steps * B * L1}
  table = _table(rows, full_active, totals)
  out = os.path.abspath(FLAGS.out or run.workdir)
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "elastic_vs_separate.md"), "w") as f:
    f.write(table + "\n")
  _plot(rows, os.path.join(out, "elastic_vs_separate.png"))
  for r in rows:
    run.writer.write("compare", approach=r[0], budget=r[1], active_params=r[2], tokens=r[3],
                     val_loss=r[4], answer_acc=r[5])
  run.writer.close()
  print(table)
  print(f"\nwrote {out}/elastic_vs_separate.md and .png ({time.perf_counter() - t0:.0f}s)")


def _table(rows, full_active, totals) -> str:
  lines = ["| approach | size | active params | active ratio | tokens for this size | val loss "
           "| val ppl | answer acc |", "|---|---|---:|---:|---:|---:|---:|---:|"]
  for approach, name, active, tokens, loss, acc in rows:
    lines.append(f"| {approach} | {name} | {active:,} | {active / full_active:.3f} | "
                 f"{tokens:,} | {loss:.3f} | {math.exp(loss):.1f} | {acc:.3f} |")
  lines += ["", "| approach | tokens for all smaller sizes (parent pretraining included where "
            "used) |", "|---|---:|"]
  lines += [f"| {k} | {v:,} |" for k, v in totals.items()]
  return "\n".join(lines)


def _plot(rows, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for ax, col, label in ((axes[0], 4, "validation loss (lower is better)"),
                         (axes[1], 5, "answer accuracy")):
    for approach, marker in (("parent", "*"), ("elastic", "o"), ("scratch", "s"),
                             ("minitron", "^")):
      pts = sorted((r[2], r[col]) for r in rows if r[0] == approach)
      if pts:
        ax.plot(*zip(*pts), marker=marker, label=approach)
    ax.set_xlabel("active parameters")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  axes[0].legend()
  fig.suptitle("elastic (one run, all sizes) vs each size trained separately")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  app.run(main)
