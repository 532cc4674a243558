"""Slice one sub-model out of a nested checkpoint and write it as Orbax or HF safetensors.

  python -m elastic_jax.slice --checkpoint=runs/tiny/nested --budget=small --out=/tmp/small
  python -m elastic_jax.slice --checkpoint=... --budget=hidden=64,moe_experts=4 --format=hf --out=...
  python -m elastic_jax.slice --checkpoint=runs/tiny/nested_nvfp4 --budget=small --format=hf ...

From a quantized checkpoint (`nested_<format>/` of the main job), `--format=hf` writes NVIDIA
ModelOpt's format (packed codes and scales, `quantization_config`; io/modelopt.py).

--budget is a budget name stored in the checkpoint, or comma-separated per-axis counts
(axis=count, or axis=c1:c2:... with one count per layer of that axis' kind).
"""
from __future__ import annotations

import os
import time

from absl import flags

from elastic_jax import cli

flags.DEFINE_string("checkpoint", None, "nested checkpoint directory", required=True)
flags.DEFINE_string("budget", None, "budget name or axis=count,... (default: full model)")
flags.DEFINE_string("out", None, "output directory", required=True)
flags.DEFINE_enum("format", "orbax", ["orbax", "hf"], "output format")
flags.DEFINE_bool("overwrite", False, "replace an existing output")
FLAGS = flags.FLAGS


def parse_budget(text: str | None):
  """'name' -> 'name'; 'a=1,b=2:3' -> {'a': 1, 'b': (2, 3)}; None -> None."""
  if not text or "=" not in text:
    return text
  counts = {}
  for item in text.split(","):
    name, sep, value = item.partition("=")
    if not sep or not value:
      raise ValueError(f"bad budget item {item!r}: expected axis=count or axis=c1:c2:...")
    try:
      parts = [int(v) for v in value.split(":")]
    except ValueError:
      raise ValueError(f"bad count in {item!r}: counts are integers") from None
    counts[name.strip()] = parts[0] if len(parts) == 1 else tuple(parts)
  return counts


def run(checkpoint_dir: str, budget, out: str, fmt: str, overwrite: bool = False) -> str:
  from elastic_jax import count_params
  from elastic_jax.elastic import deploy
  import jax
  from elastic_jax.io import checkpoint, hf, modelopt
  from elastic_jax.quant.qtensor import is_qtensor

  src, dst = os.path.realpath(checkpoint_dir), os.path.realpath(out)
  if src == dst or src.startswith(dst + os.sep):
    raise ValueError(f"--out {out} is or contains the source checkpoint {checkpoint_dir}; "
                     "write the slice elsewhere")
  rc = deploy.stored_router_config(checkpoint.load_metadata(checkpoint_dir))
  if isinstance(budget, str) and rc is not None:   # deployed counts must meet the targets
    cfg = checkpoint.load_config(checkpoint_dir)
    if budget in cfg.budget_names:
      why = deploy.violation(cfg, rc, checkpoint.resolve_counts(checkpoint_dir, budget), budget)
      if why:
        raise ValueError(f"{checkpoint_dir}: {why}")
  t0 = time.perf_counter()
  before = checkpoint.bytes_read()
  params, cfg = checkpoint.restore(checkpoint_dir, budget)
  read = checkpoint.bytes_read() - before
  pc = count_params(cfg)
  print(f"restored budget {budget or 'full'}: {pc.total:,} total / {pc.active:,} active params, "
        f"{read / 1e6:.1f} MB read in {time.perf_counter() - t0:.1f}s", flush=True)
  if fmt == "hf" and any(is_qtensor(x) for x in jax.tree.leaves(params, is_leaf=is_qtensor)):
    modelopt.save_pretrained(out, params, cfg, overwrite=overwrite)   # a quantized family
  elif fmt == "hf":
    hf.save_pretrained(out, params, cfg, overwrite=overwrite)
  else:
    checkpoint.save(out, params, cfg, tokenizer=checkpoint.tokenizer_file(checkpoint_dir),
                    overwrite=overwrite,
                    extra={"sliced_from": checkpoint_dir, "budget": budget})
  print(f"wrote {fmt} sub-model to {out}")
  return out


def main(argv):
  del argv
  from absl import logging
  logging.set_verbosity(logging.ERROR)  # Orbax logs every file at INFO, chunking hints at WARNING
  run(FLAGS.checkpoint, parse_budget(FLAGS.budget), FLAGS.out, FLAGS.format, FLAGS.overwrite)


if __name__ == "__main__":
  cli.run(main)
