"""Compile cost of the layer stack: loop vs scanned unit, and init, on nano_v3's layer pattern.

  python experiments/scan_compile.py            # all 52 layers of nano_v3 at tiny widths
  python experiments/scan_compile.py --quick    # its first 7 layers, no monolithic init

For each stack ("loop": one block per layer unrolled; "scan": one scanned unit, see
`model.stack_plan`) it lowers and compiles a forward+backward (mean-square of the logits, with
budget masks) and prints trace+lower seconds, compile seconds, the optimized HLO size and XLA's
temp-memory estimate. Scan runs with params in its own stacked layout (as training holds them)
and, for comparison, with canonical params stacked inside the step. Then `init` (one small program per layer shape) vs one jitted
`ElasticLM.init` of the whole model (what init was before: one program for every layer). Compile
caches are off, so every figure is a cold compile. Prints measured ratios; writes a markdown
table to --out.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tiny_width_nano(layers: int):
  from configs import model_config
  nano = model_config("nano_v3")
  tiny = model_config("tiny")
  pattern = nano.layer_pattern[:layers]
  return tiny.replace(layer_pattern=pattern, param_dtype="float32", compute_dtype="float32")


def measure_step(cfg, stack: str, remat: str, native: bool, tokens):
  """`native`: params held in the stack's own layout (what training does, `to_stack_layout`);
  else canonical params, stacked inside the step."""
  import jax
  import jax.numpy as jnp

  from elastic_jax import apply, from_counts, param_shapes
  from elastic_jax.model.model import to_stack_layout
  c = cfg.replace(remat=remat)
  masks = from_counts(c, {"hidden": c.hidden_choices[-1]})
  shapes = param_shapes(c)
  if native:
    shapes = jax.eval_shape(lambda p: to_stack_layout(p, c, stack), shapes)

  def loss(p):
    return jnp.mean(apply(p, tokens, masks, config=c, stack=stack) ** 2)

  t0 = time.perf_counter()
  lowered = jax.jit(jax.value_and_grad(loss)).trace(shapes).lower()
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  mem = compiled.memory_analysis()
  temp = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None
  return {"lower_s": t1 - t0, "compile_s": t2 - t1, "hlo_kb": len(compiled.as_text()) / 1024,
          "temp_mb": None if temp is None else temp / 2**20}


def measure_init(cfg, monolithic: bool):
  import jax
  import jax.numpy as jnp

  from elastic_jax import init
  from elastic_jax.model import ElasticLM
  key = jax.random.PRNGKey(0)
  t0 = time.perf_counter()
  if monolithic:
    tokens = jnp.zeros((1, 1), jnp.int32)
    out = jax.jit(ElasticLM(cfg).init)(key, tokens)
  else:
    out = init(cfg, key)
  jax.block_until_ready(out)
  return time.perf_counter() - t0


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="7 layers, skip the monolithic init")
  ap.add_argument("--layers", type=int, default=None, help="first N layers of nano_v3's pattern")
  ap.add_argument("--out", default=None, help="markdown table path")
  args = ap.parse_args()

  import jax
  import jax.numpy as jnp
  jax.config.update("jax_enable_compilation_cache", False)
  from elastic_jax.model.stack_plan import plan_stack

  layers = args.layers or (7 if args.quick else 52)
  cfg = tiny_width_nano(layers)
  plan = plan_stack(cfg.layer_pattern)
  print(f"pattern {cfg.layer_pattern} ({layers} layers, hidden {cfg.hidden_size}); scan plan: "
        f"{plan.describe()}", flush=True)
  tokens = jnp.zeros((2, 64), jnp.int32)
  rows = []
  for stack, remat, native in (("loop", "none", True), ("scan", "none", False),
                               ("scan", "none", True), ("scan", "full", True)):
    r = measure_step(cfg, stack, remat, native, tokens)
    layout = "stacked in step" if stack == "scan" and not native else "native"
    rows.append((stack, remat, layout, r))
    temp = "n/a" if r["temp_mb"] is None else f"{r['temp_mb']:.0f}"
    print(f"fwd+bwd {stack} remat={remat:5s} params {layout:15s}: lower {r['lower_s']:5.1f}s "
          f"compile {r['compile_s']:5.1f}s HLO {r['hlo_kb']:6.0f} KiB temp {temp} MiB", flush=True)
  loop, scan = rows[0][3], rows[2][3]
  ratio_compile = (loop["lower_s"] + loop["compile_s"]) / (scan["lower_s"] + scan["compile_s"])
  ratio_hlo = loop["hlo_kb"] / scan["hlo_kb"]
  print(f"loop / scan (native params): lower+compile {ratio_compile:.1f}x, HLO size "
        f"{ratio_hlo:.1f}x")
  t_fast = measure_init(cfg, monolithic=False)
  print(f"init (per layer shape): {t_fast:.1f}s", flush=True)
  t_mono = None
  if not args.quick:
    t_mono = measure_init(cfg, monolithic=True)
    print(f"init (one jitted ElasticLM.init): {t_mono:.1f}s; ratio {t_mono / t_fast:.1f}x")
  if args.out:
    with open(args.out, "w") as f:
      f.write(f"# Layer-stack compile cost ({layers} layers of nano_v3's pattern, tiny widths)\n\n"
              f"Scan plan: {plan.describe()}. Forward+backward of a [2, 64] batch with budget "
              "masks, cold compile (caches off), 2 CPU cores.\n\n"
              "| stack | remat | params | trace+lower s | compile s | optimized HLO KiB | "
              "temp MiB |\n|---|---|---|---|---|---|---|\n")
      for stack, remat, layout, r in rows:
        temp = "n/a" if r["temp_mb"] is None else f"{r['temp_mb']:.1f}"
        f.write(f"| {stack} | {remat} | {layout} | {r['lower_s']:.1f} | {r['compile_s']:.1f} | "
                f"{r['hlo_kb']:.0f} | {temp} |\n")
      f.write(f"\nloop / scan (native params): lower+compile {ratio_compile:.1f}x, HLO size "
              f"{ratio_hlo:.1f}x.\n\n"
              f"init: {t_fast:.1f} s per-layer-shape programs")
      f.write(f"; {t_mono:.1f} s one jitted `ElasticLM.init` ({t_mono / t_fast:.1f}x).\n"
              if t_mono is not None else ".\n")


if __name__ == "__main__":
  main()
