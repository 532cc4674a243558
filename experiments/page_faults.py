"""The tiny train step with freed host memory kept (`elastic_jax.host_memory`) and without, in one
run: the ratio of step times and the host's page faults per step.

glibc reads the setting when jax's CPU client starts, so each side runs in a fresh process: every
round starts one child with ELASTIC_JAX_KEEP_HOST_MEMORY=1 and one with =0 (alternating which goes
first), each timing `steps` steps of `speed.py`'s train cell (`speed.train_timer`: configs.tiny,
fp32, B x T tokens, next-token cross-entropy, AdamW, jitted with donated state) after 3 untimed
ones, and reporting the median step time and minor page faults per step. Prints and writes
`out/page_faults.md`: one row per round and the median over rounds of default / kept.

  python experiments/page_faults.py            # B4 x T256, 4 rounds of 30 steps (~4 min, 2 cores)
  python experiments/page_faults.py --quick    # 1 round of 3 steps (CI)
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

WARMUP = 3


def child(batch: int, seq: int, steps: int) -> dict:
  """In this process: {"ms": median step ms, "faults": median minor page faults per step,
  "kept": whether `keep_freed_memory` applied} (call before jax starts)."""
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
          "kept": kept}


def _spawn(keep: bool, batch: int, seq: int, steps: int) -> dict:
  env = {**os.environ, "ELASTIC_JAX_KEEP_HOST_MEMORY": "1" if keep else "0"}
  here = os.path.dirname(os.path.abspath(__file__))
  env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), env.get("PYTHONPATH", "")])
  r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", f"--batch={batch}",
                      f"--seq={seq}", f"--steps={steps}"], env=env, capture_output=True,
                     text=True, timeout=900)
  if r.returncode:
    raise RuntimeError(f"train-step child (keep={keep}) failed:\n{r.stderr[-2000:]}")
  out = json.loads(r.stdout.strip().splitlines()[-1])
  if out["kept"] != keep:
    raise RuntimeError(f"the child asked to keep={keep} reports kept={out['kept']} (not glibc?)")
  return out


def run(out: str, quick: bool = False, rounds: int | None = None, batch: int = 4,
        seq: int = 256) -> list[dict]:
  """Every round's {"round", "first", "kept", "default"} (child results); writes
  `out/page_faults.md`."""
  rounds = rounds or (1 if quick else 4)
  steps = 3 if quick else 30
  rows = []
  for r in range(rounds):
    first = r % 2 == 0   # kept first in even rounds
    order = (True, False) if first else (False, True)
    res = {k: _spawn(k, batch, seq, steps) for k in order}
    rows.append({"round": r, "first": "kept" if first else "default", "kept": res[True],
                 "default": res[False]})
    print(f"round {r}: kept {res[True]['ms']:.1f} ms ({res[True]['faults']:,.0f} faults), "
          f"default {res[False]['ms']:.1f} ms ({res[False]['faults']:,.0f} faults)", flush=True)
  ratio = statistics.median(r["default"]["ms"] / r["kept"]["ms"] for r in rows)
  lines = [f"The tiny train step (B{batch} x T{seq}, fp32, AdamW), freed host memory kept "
           "(`host_memory.keep_freed_memory`) against glibc's default, each side in a fresh "
           f"process per round, median of {steps} steps, {os.cpu_count()} CPU cores.", "",
           "| round | first | kept ms | kept faults / step | default ms | default faults / step "
           "| default / kept |", "|---:|---|---:|---:|---:|---:|---:|"]
  for r in rows:
    k, d = r["kept"], r["default"]
    lines.append(f"| {r['round']} | {r['first']} | {k['ms']:.1f} | {k['faults']:,.0f} | "
                 f"{d['ms']:.1f} | {d['faults']:,.0f} | {d['ms'] / k['ms']:.2f}x |")
  lines += ["", f"Median over rounds: the step takes {ratio:.2f}x as long with glibc's default."]
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
  flags.DEFINE_integer("rounds", None, "process pairs (default 4; quick 1)")
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
