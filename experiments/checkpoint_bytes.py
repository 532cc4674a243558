"""Bytes read restoring each budget from one nested checkpoint vs the full restore.

A scaled Nemotron 3 Nano shape (all 52 layers, widths / 8, experts / 4, bf16) is saved once;
each budget is then restored with prefix reads. Prints bytes read, their ratio to the full
restore, and the sub-model's share of parameters (what an ideal reader would read).

  python experiments/checkpoint_bytes.py            # scaled nano_v3 (~230 MB on disk)
  python experiments/checkpoint_bytes.py --reduced  # small shape, seconds (CI)
"""
from __future__ import annotations

import os
import tempfile
import time

from absl import app, flags

flags.DEFINE_bool("reduced", False, "small shape for a quick run")
flags.DEFINE_integer("chunk_bytes", None, "fixed bytes per stored chunk (default: checkpoint.save's per-leaf rule)")
flags.DEFINE_string("workdir", None, "where to write the checkpoint (default: a temp dir)")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  import jax
  from absl import logging
  logging.set_verbosity(logging.WARNING)

  from elastic_jax import count_params, init
  from elastic_jax.io import checkpoint
  from scaled import paper_like_budgets, scaled_config

  cfg = scaled_config(FLAGS.reduced)
  budgets = paper_like_budgets(cfg)
  workdir = FLAGS.workdir or tempfile.mkdtemp()
  path = os.path.join(workdir, "nested")
  params = jax.jit(init, static_argnums=0)(cfg, jax.random.PRNGKey(0))
  t0 = time.perf_counter()
  checkpoint.save(path, params, cfg, overwrite=True, chunk_byte_size=FLAGS.chunk_bytes,
                  budget_counts={k: v for k, v in zip(cfg.budget_names, budgets.values())})
  size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
  print(f"saved {count_params(cfg).total:,} params ({size / 1e6:.1f} MB on disk) in "
        f"{time.perf_counter() - t0:.1f}s to {path}")
  del params
  full_total = count_params(cfg).total
  rows, full_bytes = [], None
  for name, counts in budgets.items():
    before, t0 = checkpoint.bytes_read(), time.perf_counter()
    sub, sub_cfg = checkpoint.restore(path, counts)
    jax.block_until_ready(sub)
    read, secs = checkpoint.bytes_read() - before, time.perf_counter() - t0
    full_bytes = full_bytes or read
    share = count_params(sub_cfg).total / full_total
    rows.append((name, counts, read, read / full_bytes, share, secs))
  print(f"| budget | counts | bytes read | ratio to full restore | param share | seconds |")
  print(f"|---|---|---:|---:|---:|---:|")
  for name, counts, read, ratio, share, secs in rows:
    print(f"| {name} | {counts or 'full'} | {read:,} | {ratio:.3f} | {share:.3f} | {secs:.2f} |")


if __name__ == "__main__":
  app.run(main)
