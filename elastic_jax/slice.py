"""Slice one sub-model out of a nested checkpoint and write it as Orbax or HF safetensors.

  python -m elastic_jax.slice --checkpoint=runs/tiny/nested --budget=small --out=/tmp/small
  python -m elastic_jax.slice --checkpoint=... --budget=hidden=64,moe_experts=4 --format=hf --out=...
  python -m elastic_jax.slice --checkpoint=runs/tiny/nested_nvfp4 --budget=small --format=hf ...

From a quantized checkpoint (`nested_<format>/` of the main job), `--format=hf` writes NVIDIA
ModelOpt's format (packed codes and scales, `quantization_config`; io/modelopt.py); with
`--calibration_data=default` (or local .txt / .jsonl files) each quantized Linear also gets the
`input_scale` that W4A4 / W8A8 serving needs, from the slice's activations on that data.

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
flags.DEFINE_list("calibration_data", [],
                  "quantized --format=hf: local .txt / .jsonl files (or 'default', the embedded "
                  "corpus) whose activations set each Linear's input_scale")
flags.DEFINE_integer("calibration_batches", 16, "calibration batches of 4 x 256 tokens")
FLAGS = flags.FLAGS
CALIBRATION_BATCH, CALIBRATION_LEN = 4, 256


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


def calibration_batches(checkpoint_dir: str, sources, n_batches: int,
                        batch: int = CALIBRATION_BATCH, seq_len: int = CALIBRATION_LEN):
  """`n_batches` token batches [batch, seq_len] of `sources` (local .txt / .jsonl files, or
  ["default"]: the embedded corpus), in the checkpoint's own tokenizer, documents packed in
  order."""
  from elastic_jax.io import checkpoint
  from elastic_jax.training import data
  if n_batches < 1:
    raise ValueError(f"--calibration_batches must be >= 1, got {n_batches}")
  tok = checkpoint.tokenizer_file(checkpoint_dir)
  if tok is None:
    raise ValueError(f"{checkpoint_dir} stores no tokenizer: calibration needs the one the "
                     "model was trained with")
  docs = data.default_corpus() if list(sources) == ["default"] else data.local_corpus(sources)
  ids = (e.ids for e in data.load_tokenizer(tok).encode_batch(docs))
  rows = data.pack(ids, seq_len)[:, :seq_len]
  n = min(n_batches, len(rows) // batch)
  if n < 1:
    raise ValueError(f"calibration data {list(sources)} holds {len(rows)} rows of {seq_len} "
                     f"tokens, fewer than one batch of {batch}")
  return [rows[i * batch:(i + 1) * batch] for i in range(n)]


def run(checkpoint_dir: str, budget, out: str, fmt: str, overwrite: bool = False,
        calibration=None) -> str:
  """Writes the slice; `calibration` (token batches [B, T]) sets a quantized HF export's
  input scales from the slice's own activations (`quant.calibrate`)."""
  from elastic_jax import count_params
  from elastic_jax.elastic import deploy
  import jax
  from elastic_jax.io import checkpoint, hf, modelopt
  from elastic_jax.quant import calibrate
  from elastic_jax.quant.qtensor import is_qtensor
  from elastic_jax.quant.tree import dequantize_params

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
  quantized = any(is_qtensor(x) for x in jax.tree.leaves(params, is_leaf=is_qtensor))
  if calibration and not (quantized and fmt == "hf"):
    raise ValueError("--calibration_data sets the input scales of a quantized --format=hf "
                     f"export; {checkpoint_dir} is {'' if quantized else 'not '}quantized and "
                     f"--format is {fmt}")
  if fmt == "hf" and quantized:   # a quantized family: ModelOpt's format
    amax = None
    if calibration:
      t1 = time.perf_counter()
      amax = calibrate.input_amax(dequantize_params(params), cfg, calibration)
      n = sum(int(b.size) for b in calibration)
      print(f"calibrated input scales on {n:,} tokens in {time.perf_counter() - t1:.1f}s",
            flush=True)
    else:
      print("no --calibration_data: the export carries no input_scale (weight-only serving; "
            "W4A4 / W8A8 engines need one)", flush=True)
    modelopt.save_pretrained(out, params, cfg, input_amax=amax, overwrite=overwrite)
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
  calibration = (calibration_batches(FLAGS.checkpoint, FLAGS.calibration_data,
                                     FLAGS.calibration_batches)
                 if FLAGS.calibration_data else None)
  run(FLAGS.checkpoint, parse_budget(FLAGS.budget), FLAGS.out, FLAGS.format, FLAGS.overwrite,
      calibration)


if __name__ == "__main__":
  cli.run(main)
