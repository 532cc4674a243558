"""The tiny train step under glibc's default malloc, with transparent huge pages and with freed
host memory kept (`elastic_jax.host_memory`), in one run: step times, their ratios and the host's
page faults per step.

glibc reads both settings at startup (its tunables) or before jax's CPU client starts (mallopt),
so each variant runs in a fresh process: every round starts one child per variant (the order
rotating between rounds), each timing `steps` steps of `speed.py`'s train cell
(`speed.train_timer`: configs.tiny, fp32, B x T tokens, next-token cross-entropy, AdamW, jitted
with donated state) after 3 untimed ones, and reporting the median step time and minor page
faults per step. Prints and writes `out/page_faults.md`: one row per round and the medians over
rounds of default / huge and default / kept.

  python experiments/page_faults.py            # B4 x T256, 6 rounds of 30 steps (~8 min, 2 cores)
  python experiments/page_faults.py --quick    # 1 round of 3 steps (CI)
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

WARMUP = 3


VARIANTS = ("default", "huge", "kept")


def variant_environ(variant: str, environ=os.environ) -> dict:
  """A child's environment: glibc's default malloc, its huge-page tunable, or the kept heap."""
  from elastic_jax import host_memory
  return {**host_memory.with_huge_pages(environ, variant == "huge"),
          host_memory.ENV: "1" if variant == "kept" else "0"}


def child(batch: int, seq: int, steps: int) -> dict:
  """In this process: {"ms": median step ms, "faults": median minor page faults per step,
  "kept": whether `keep_freed_memory` applied, "huge": whether glibc started with huge pages}
  (call before jax starts)."""
  from elastic_jax import host_memory
  kept = host_memory.keep_freed_memory()
  import jax
  from speed import configs, train_timer

  from elastic_jax import init
  cfg = configs(quick=True)["tiny"]
  timer = train_timer(init(cfg, jax.random.PRNGKey(0)), cfg, "auto", batch, seq)
  times = [timer() for _ in range(WARMUP + steps)][WARMUP:]
  faults = timer.faults[WARMUP:]
  return {"ms": statistics.median(times) * 1e3, "faults": statistics.median(faults),
          "kept": kept, "huge": host_memory.huge_pages_active()}


def _spawn(variant: str, batch: int, seq: int, steps: int) -> dict:
  env = variant_environ(variant)
  here = os.path.dirname(os.path.abspath(__file__))
  env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), env.get("PYTHONPATH", "")])
  r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", f"--batch={batch}",
                      f"--seq={seq}", f"--steps={steps}"], env=env, capture_output=True,
                     text=True, timeout=900)
  if r.returncode:
    raise RuntimeError(f"train-step child ({variant}) failed:\n{r.stderr[-2000:]}")
  out = json.loads(r.stdout.strip().splitlines()[-1])
  if (out["kept"], out["huge"]) != (variant == "kept", variant == "huge"):
    raise RuntimeError(f"the {variant} child reports kept={out['kept']}, huge={out['huge']} "
                       "(not glibc?)")
  return out


def run(out: str, quick: bool = False, rounds: int | None = None, batch: int = 4,
        seq: int = 256) -> list[dict]:
  """Every round's {"round", "order", and per variant its child's result}; writes
  `out/page_faults.md`."""
  rounds = rounds or (1 if quick else 6)
  steps = 3 if quick else 30
  rows = []
  for r in range(rounds):
    order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
    row = {"round": r, "order": order, **{v: _spawn(v, batch, seq, steps) for v in order}}
    rows.append(row)
    print(f"round {r}: " + ", ".join(f"{v} {row[v]['ms']:.1f} ms ({row[v]['faults']:,.0f} "
                                     "faults)" for v in VARIANTS), flush=True)
  ratio = {v: statistics.median(r["default"]["ms"] / r[v]["ms"] for r in rows)
           for v in ("huge", "kept")}
  lines = [f"The tiny train step (B{batch} x T{seq}, fp32, AdamW) under glibc's default malloc, "
           "with its transparent huge pages (`glibc.malloc.hugetlb=1`, what the CLIs run with) "
           "and with freed host memory kept (`host_memory.keep_freed_memory`), each in a fresh "
           f"process per round, median of {steps} steps, {os.cpu_count()} CPU cores; faults: "
           "minor page faults per step.", "",
           "| round | order | default ms | faults | huge pages ms | faults | kept ms | faults | "
           "default / huge | default / kept |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    cells = " | ".join(f"{r[v]['ms']:.1f} | {r[v]['faults']:,.0f}" for v in VARIANTS)
    lines.append(f"| {r['round']} | {', '.join(r['order'])} | {cells} | "
                 f"{r['default']['ms'] / r['huge']['ms']:.2f}x | "
                 f"{r['default']['ms'] / r['kept']['ms']:.2f}x |")
  lines += ["", f"Median over rounds: the step takes {ratio['huge']:.2f}x as long with glibc's "
            f"default as with huge pages, {ratio['kept']:.2f}x as long as with the kept heap."]
  text = "\n".join(lines) + "\n"
  print(text)
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "page_faults.md"), "w") as f:
    f.write("# Host page faults of the train step\n\n" + text)
  return rows


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_string("out", "runs/page_faults", "where to write page_faults.md")
  flags.DEFINE_bool("quick", False, "1 round of 3 steps (CI)")
  flags.DEFINE_integer("rounds", None, "rounds of one process per variant (default 6; quick 1)")
  flags.DEFINE_integer("batch", 4, "rows per step")
  flags.DEFINE_integer("seq", 256, "tokens per row")
  flags.DEFINE_bool("child", False, "internal: time the step in this process, print JSON")
  flags.DEFINE_integer("steps", 30, "internal (--child): timed steps")
  F = flags.FLAGS

  def main(argv):
    del argv
    if F.child:
      print(json.dumps(child(F.batch, F.seq, F.steps)))
    else:
      run(F.out, F.quick, F.rounds, F.batch, F.seq)
  app.run(main)
