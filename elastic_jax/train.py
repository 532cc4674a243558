"""The main job: parent -> importance + nesting -> elastic KD with the budget router -> one nested
checkpoint -> per-budget report; with `--config.quant.format=nvfp4` (or fp8) also the quantized
family (QAD, one quantized nested checkpoint) and its report.

  python -m elastic_jax.train                                   # tiny default, embedded corpus
  python -m elastic_jax.train --config.elastic.stage1_steps=300 # any config field by flag
  python -m elastic_jax.train --config=configs/nano_v3.py --hf_dir=/local/nemotron_h

The run lives in --workdir (see `elastic_jax.training.pipeline`). Re-running the same command resumes
where it stopped: a finished phase is skipped, an interrupted one continues from its last
checkpoint and repeats the uninterrupted run exactly.
"""
from __future__ import annotations

import os
import time

from absl import flags

from elastic_jax import cli

_CONFIG = cli.define_config_file(
    "config", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "configs", "tiny.py"),
    "run config (a configs/*.py file); override fields with --config.<section>.<field>=...")
flags.DEFINE_string("workdir", "runs/tiny", "output directory (re-run to resume)")
flags.DEFINE_string("hf_dir", None, "start from this local Nemotron-H parent instead of pretraining")
flags.DEFINE_list("data_files", [], "local .txt/.jsonl files instead of the embedded corpus")
flags.DEFINE_bool("restart", False, "remove this workdir's run outputs (checkpoints, parent, "
                  "nested, metrics, tokenizer) and start over; needed to rerun it with other "
                  "settings")
flags.DEFINE_string("coordinator_address", None, "multi-process: host:port of process 0")
flags.DEFINE_integer("num_processes", None, "multi-process: how many processes")
flags.DEFINE_integer("process_id", None, "multi-process: this process's index")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  from absl import logging
  logging.set_verbosity(logging.ERROR)  # Orbax logs per chunk and per save

  from elastic_jax.parallel import distributed
  # Before any jax computation; auto-detects TPU pods and SLURM jobs when no flag is given.
  distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                         auto=True)
  from elastic_jax.training import evaluate, pipeline

  t_start = time.perf_counter()
  inputs = {"hf_dir": FLAGS.hf_dir and os.path.abspath(FLAGS.hf_dir),
            "data_files": [os.path.abspath(f) for f in FLAGS.data_files]}
  run = pipeline.Run(cli.config_value(_CONFIG), FLAGS.workdir, inputs, restart=FLAGS.restart)
  cfg, td, _, family = pipeline.train_family(run, FLAGS.hf_dir, FLAGS.data_files)
  ev = run.config.eval
  rows = evaluate.report(family.params, cfg, family.budget_counts, td.val, td.tokenizer,
                         pipeline.held_out(run), max_think_tokens=ev.max_think_tokens,
                         max_answer_tokens=ev.max_answer_tokens)
  tables = [("nested", rows)]
  qparams = pipeline.quantized_family(run, cfg, family, td)
  if qparams is not None:
    fmt = run.config.quant.format
    qrows = evaluate.report(qparams, cfg, family.budget_counts, td.val, td.tokenizer,
                            pipeline.held_out(run), max_think_tokens=ev.max_think_tokens,
                            max_answer_tokens=ev.max_answer_tokens)
    tables.append((f"nested_{fmt}", [{**r, "format": fmt} for r in qrows]))
  run.writer.forget("report")  # a re-run reports again
  for _, table in tables:
    for r in table:
      run.writer.write("report", **r)
  run.writer.close()
  for name, table in tables:
    print(f"\n{name} checkpoint: {os.path.join(run.workdir, name)}")
    print(evaluate.markdown_table(table))
  print(f"\n({time.perf_counter() - t_start:.0f}s total)")


if __name__ == "__main__":
  cli.run(main)
