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


def scaled_config(reduced: bool):
  from configs.nano_v3 import MODEL
  if reduced:
    return MODEL.replace(
        layer_pattern="MEM*EMEM*E", hidden_size=128, vocab_size=2048, num_attention_heads=8,
        head_dim=16, mamba_num_heads=16, mamba_head_dim=8, ssm_state_size=16,
        n_routed_experts=16, moe_intermediate_size=128, moe_shared_expert_intermediate_size=256,
        hidden_choices=(128, 96), mamba_head_choices=(16, 8), expert_choices=(16, 8),
        moe_ffn_choices=(128, 96, 64), param_dtype="float32", compute_dtype="float32")
  return MODEL.replace(
      hidden_size=336, vocab_size=16384, num_attention_heads=32, head_dim=16,
      mamba_head_dim=8, ssm_state_size=16, n_routed_experts=32, moe_intermediate_size=232,
      moe_shared_expert_intermediate_size=464,
      hidden_choices=(336, 288, 256), mamba_head_choices=(64, 56, 48), expert_choices=(32, 24, 16),
      moe_ffn_choices=(232, 200, 160))


def main(argv):
  del argv
  import jax
  from absl import logging
  logging.set_verbosity(logging.WARNING)

  from elastic_jax import checkpoint, count_params, init

  cfg = scaled_config(FLAGS.reduced)
  budgets = {"30B-like": {},
             "23B-like": {n: c[1] for n, c in (("hidden", cfg.hidden_choices),
                                                ("mamba_heads", cfg.mamba_head_choices),
                                                ("moe_experts", cfg.expert_choices),
                                                ("moe_ffn", cfg.moe_ffn_choices))},
             "12B-like": {"hidden": cfg.hidden_choices[-1], "mamba_heads": cfg.mamba_head_choices[-1],
                          "moe_experts": cfg.expert_choices[-1], "moe_ffn": cfg.moe_ffn_choices[-1]}}
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
