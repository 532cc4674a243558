"""The quantized family (issue 14): per budget and format, quality, bytes, and whether the
12B-like NVFP4 slice fits a 16 GB GPU.

1. Quality on the tiny family: per budget, bf16 (the trained weights rounded to bf16), FP8 PTQ,
   mixed PTQ (NVIDIA's Nemotron-H recipe: routed experts NVFP4, other projections FP8), NVFP4
   PTQ and NVFP4 QAD (the main job's `--config.quant.format=nvfp4`): validation loss, answer
   accuracy, and recovery vs bf16 (accuracy ratio; loss difference).
2. Checkpoint bytes of the family per format, one nested checkpoint vs three separate ones:
   exact for nano_v3 (every leaf's stored bytes, codes and scales included, from shapes alone),
   and measured on disk for a saved scaled family.
3. The 12B slice of nano_v3, NVFP4 and mixed, (the counts a router fitted to the budgets' targets deploys;
   `--quick`: every axis at its last choice) on a 16 GB GPU: its exact weight bytes plus the KV cache
   and Mamba states of one sequence at each stated context (activations and workspace not
   counted).

  python experiments/quantization.py --workdir=runs/tiny          # the main job's run dir
  python experiments/quantization.py --quick --workdir=/tmp/q     # CI: the test suite's shapes

The run directory is the main job's (trained here if absent; its phases resume); the table and
plot are written there (or --out).
"""
from __future__ import annotations

import os
import tempfile
import time

from absl import app, flags
from ml_collections import config_flags

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CONFIG = config_flags.DEFINE_config_file("config", os.path.join(_ROOT, "configs", "tiny.py"),
                                          "run config of the main job")
flags.DEFINE_string("workdir", "runs/tiny", "the main job's run directory")
flags.DEFINE_string("out", None, "where to write quantization.md / .png (default: workdir)")
flags.DEFINE_bool("quick", False, "the test suite's main-job shapes, a few QAD steps, the "
                  "reduced scaled shape (CI)")
flags.DEFINE_integer("qad_steps", 100, "NVFP4 QAD steps")
flags.DEFINE_multi_integer("context", [8192, 32768, 131072], "contexts for the 16 GB fit")
flags.DEFINE_float("device_gb", 16.0, "the consumer GPU's memory, GB (1e9 bytes)")
FLAGS = flags.FLAGS

FORMATS = ("bf16", "fp8 PTQ", "mixed PTQ", "nvfp4 PTQ", "nvfp4 QAD")
# "mixed": NVIDIA's Nemotron-H recipe, routed experts NVFP4 and every other projection FP8.
BYTE_FORMATS = ("bf16", "fp8", "mixed", "nvfp4")


def nesting_spec(config, fmt: str):
  """QuantSpec of `fmt` ("fp8" | "nvfp4" | "mixed") over the default leaves whose dims and
  choices let it nest (nvfp4: a leaf whose block dim is not a multiple of 16 stays in bf16)."""
  from elastic_jax.quant.tree import DEFAULT_LEAVES, QuantSpec, check, mixed_spec

  def spec(leaves):
    return mixed_spec(tuple(leaves)) if fmt == "mixed" else QuantSpec(fmt, tuple(leaves))

  def nests(leaves):
    try:
      check(config, spec(leaves))
      return True
    except ValueError:
      return False
  if nests(DEFAULT_LEAVES):   # one check where every leaf nests (nano_v3)
    return spec(DEFAULT_LEAVES)
  return spec(l for l in DEFAULT_LEAVES if nests((l,)))


def tree_bytes(config, fmt: str) -> int:
  """Stored bytes of a model of `config` in `fmt` (`BYTE_FORMATS`): quantized leaves
  as codes + block scales + global scale, the rest in bf16; from shapes alone."""
  import jax
  import numpy as np
  from elastic_jax.model.model import param_shapes
  from elastic_jax.quant.tree import quantize_params
  shapes = param_shapes(config)
  if fmt != "bf16":
    spec = nesting_spec(config, fmt)
    shapes = jax.eval_shape(lambda p: quantize_params(p, config, spec), shapes)
  def size(x):
    # High-precision weights stored in bf16; codes, block scales and global scales as they are.
    item = np.dtype(x.dtype).itemsize
    return int(np.prod(x.shape)) * (2 if item >= 2 and x.shape else item)
  return sum(size(x) for x in jax.tree.leaves(shapes))


def family_bytes(config, counts: dict, fmt: str) -> dict:
  """{"nested": one checkpoint of the parent, "separate": one per budget, budget: its slice}."""
  from elastic_jax.elastic.slicing import sliced_config
  per = {n: tree_bytes(sliced_config(config, c), fmt) for n, c in counts.items()}
  return {"nested": tree_bytes(config, fmt), "separate": sum(per.values()), **per}


def _disk(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main(argv):
  del argv
  from absl import logging
  logging.set_verbosity(logging.ERROR)
  import jax
  import jax.numpy as jnp
  from configs import nano_v3
  from elastic_jax.elastic import measures
  from elastic_jax.io import checkpoint
  from elastic_jax.quant.tree import QuantSpec, dequantize_params, quantize_params
  from elastic_jax.training import evaluate, pipeline
  from elastic_jax.elastic import deploy
  from elastic_jax.elastic import router as router_lib
  from main_job import apply_quick
  from scaled import paper_like_budgets, random_params, scaled_config

  config = _CONFIG.value
  qad_steps = FLAGS.qad_steps
  if FLAGS.quick:
    apply_quick(config)
    qad_steps = min(qad_steps, 3)
  config.quant.update(format="nvfp4", qad_steps=qad_steps)
  t0 = time.perf_counter()
  run = pipeline.Run(config, FLAGS.workdir)
  cfg, td, _, family = pipeline.train_family(run)
  ev = config.eval
  bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype), family.params)
  families = {"bf16": bf16,
              "fp8 PTQ": quantize_params(family.params, cfg, QuantSpec("fp8")),
              "mixed PTQ": quantize_params(family.params, cfg, nesting_spec(cfg, "mixed")),
              "nvfp4 PTQ": quantize_params(family.params, cfg, QuantSpec("nvfp4")),
              "nvfp4 QAD": pipeline.quantized_family(run, cfg, family, td)}
  rows = []
  for fmt, params in families.items():
    # Evaluated dequantized: the same values as from the packed weights (the step dequantizes
    # them), and every format shares one compiled program per budget.
    params = dequantize_params(params)
    for r in evaluate.report(params, cfg, family.budget_counts, td.val, td.tokenizer,
                             pipeline.held_out(run), max_think_tokens=ev.max_think_tokens,
                             max_answer_tokens=ev.max_answer_tokens):
      rows.append({**r, "format": fmt})
  quality = _quality_table(rows)

  # Bytes: exact for nano_v3 (the router fitted to its budgets' targets picks the counts).
  nano_cfg = nano_v3.MODEL
  if FLAGS.quick:   # fitting the router to nano_v3's targets takes ~90 s on 2 cores
    nano_counts = paper_like_budgets(nano_cfg)
  else:
    rc = pipeline.router_config(nano_v3.get_config(), 1)
    router = router_lib.fit_to_budgets(nano_cfg, rc)   # as `elastic_jax.plan` picks counts
    nano_counts = {n: deploy.deployed_counts(router, nano_cfg, rc, n)
                   for n in nano_cfg.budget_names}
  exact = {f: family_bytes(nano_cfg, nano_counts, f) for f in BYTE_FORMATS}
  # Measured: a scaled family saved in each format.
  scfg = scaled_config(FLAGS.quick)
  scounts = paper_like_budgets(scfg)
  scfg = scfg.replace(param_dtype="bfloat16")
  sparams = random_params(scfg)
  measured = {}
  with tempfile.TemporaryDirectory() as tmp:
    for f in BYTE_FORMATS:
      p = sparams if f == "bf16" else quantize_params(sparams, scfg, nesting_spec(scfg, f))
      path = checkpoint.save(os.path.join(tmp, f), p, scfg)
      measured[f] = (_disk(os.path.join(path, "state")), tree_bytes(scfg, f))
  sizes = _bytes_table(exact, nano_counts, measured, scfg)

  # The 12B-like slice on a 16 GB GPU, all-NVFP4 and mixed.
  small = list(nano_counts)[-1]
  fit = [f"| format | context | weights GB | caches / seq GB | total GB | "
         f"fits {FLAGS.device_gb:g} GB |", "|---|---:|---:|---:|---:|---|"]
  for f in ("nvfp4", "mixed"):
    weights = exact[f][small]
    for t in FLAGS.context:
      per_seq = measures.serving_memory(nano_cfg, nano_counts[small], "nvfp4",
                                        t)["per_sequence"]   # caches: the weights' format aside
      total = weights + per_seq
      fit.append(f"| {f} | {t:,} | {weights / 1e9:.2f} | {per_seq / 1e9:.2f} | "
                 f"{total / 1e9:.2f} | {'yes' if total <= FLAGS.device_gb * 1e9 else 'no'} |")
  fit_table = "\n".join(fit)

  text = (f"## Quality per budget and format (tiny family, QAD {qad_steps} steps)\n\n{quality}\n\n"
          f"## Checkpoint bytes of the family\n\n{sizes}\n\n"
          f"## nano_v3 {small} slice on a {FLAGS.device_gb:g} GB GPU (batch 1; KV bf16; "
          f"activations and workspace not counted)\n\n{fit_table}\n")
  out = os.path.abspath(FLAGS.out or run.workdir)
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "quantization.md"), "w") as f:
    f.write(text)
  _plot(rows, os.path.join(out, "quantization.png"))
  for r in rows:
    run.writer.write("quantization", format=r["format"], budget=r["budget"],
                     val_loss=r["val_loss"], answer_acc=r["answer_acc"])
  run.writer.close()
  print(text)
  print(f"wrote {out}/quantization.md and .png ({time.perf_counter() - t0:.0f}s)")


def _quality_table(rows) -> str:
  base = {r["budget"]: r for r in rows if r["format"] == "bf16"}
  lines = ["| budget | format | val loss | Δ loss vs bf16 | answer acc | recovery (acc vs bf16) |",
           "|---|---|---:|---:|---:|---:|"]
  for r in rows:
    b = base[r["budget"]]
    rec = (f"{r['answer_acc'] / b['answer_acc']:.0%}" if b["answer_acc"] > 0 else "n/a")
    lines.append(f"| {r['budget']} | {r['format']} | {r['val_loss']:.3f} | "
                 f"{r['val_loss'] - b['val_loss']:+.3f} | {r['answer_acc']:.3f} | {rec} |")
  return "\n".join(lines)


def _bytes_table(exact, counts, measured, scfg) -> str:
  from elastic_jax import count_params
  from elastic_jax.quant.tree import DEFAULT_LEAVES
  names = list(counts)
  gib = lambda n: f"{n / 1e9:.2f} ({n / 2**30:.1f})"
  lines = ["Exact bytes, GB (GiB in brackets):", "",
           "| model | format | one nested | separate | " +
           " | ".join(f"{n} slice" for n in names) + " |",
           "|---|---|---:|---:|" + "---:|" * len(names)]
  for f, b in exact.items():
    lines.append(f"| nano_v3 | {f} | {gib(b['nested'])} | {gib(b['separate'])} | " +
                 " | ".join(gib(b[n]) for n in names) + " |")
  kept = sorted(set(DEFAULT_LEAVES) - set(nesting_spec(scfg, "nvfp4").leaves))
  lines += ["", f"Measured: the scaled family ({count_params(scfg).total:,} params) saved as one "
            "nested Orbax checkpoint" + (f" (nvfp4 keeps {', '.join(kept)} in bf16: its block "
                                         "dim is not a multiple of 16)" if kept else "") + ":", "",
            "| format | on disk MB | counted MB | disk / counted |", "|---|---:|---:|---:|"]
  for f, (disk, counted) in measured.items():
    lines.append(f"| {f} | {disk / 1e6:.1f} | {counted / 1e6:.1f} | {disk / counted:.3f} |")
  return "\n".join(lines)


def _plot(rows, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  budgets = list(dict.fromkeys(r["budget"] for r in rows))
  fig, ax = plt.subplots(figsize=(6, 3.5))
  width = 0.8 / len(FORMATS)
  for i, fmt in enumerate(FORMATS):
    ys = [next(r["val_loss"] for r in rows if r["format"] == fmt and r["budget"] == b)
          for b in budgets]
    ax.bar([j + i * width for j in range(len(budgets))], ys, width, label=fmt)
  ax.set_xticks([j + 0.4 - width / 2 for j in range(len(budgets))], budgets)
  lo = min(r["val_loss"] for r in rows)
  ax.set_ylim(lo * 0.98, max(r["val_loss"] for r in rows) * 1.01)
  ax.set_ylabel("validation loss")
  ax.set_title("Quantized family per budget")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


if __name__ == "__main__":
  app.run(main)
