"""Standard vs elastic budget control on the tiny reasoning family: accuracy against latency.

Held-out reasoning items are the first `n` evaluation items of the run that trained the family
(`pipeline.held_out`: its corpus holds none of their questions), found from run_config.json next
to the checkpoint; without a run record (or with --seed) `data.reasoning_examples(n, seed)`.
They are prompted as `<bos>question\\n<think>`. For every thinking cap and (think, answer) slice
pair: standard = one slice thinks (</think> forced at the cap) and answers; elastic = the think
slice writes the trace, the answer slice re-prefills prompt + trace and answers; transplant =
elastic with the answer slice continuing the think slice's cache (approximate; we also report
the cosine similarity and top-1 agreement of its first answer logits with the re-prefill's).
Accuracy is the exact match of the stripped answer text; latency is the wall-clock time per item
(batch 1, sliced standalone models, every program compiled before timing, configurations
interleaved per item so machine noise hits all alike). Prints the table (accuracy with a 95%
Wilson interval, latency with a 95% interval of the mean) and the accuracy-latency frontiers of
standard vs elastic, with the accuracy gain at equal latency and the latency ratio at equal
accuracy and their 95% bootstrap intervals (items resampled, frontiers and comparison redone in
each resample); writes budget_control.md and budget_control.png to --out.

  python experiments/budget_control.py --checkpoint=runs/tiny/nested --out=runs/budget_control
  python experiments/budget_control.py --checkpoint=runs/evs_reasoning/seed_0/nested \
      --out=experiments/results                 # the family that reasons (configs/reasoning.py)
  python experiments/budget_control.py --quick     # a few items, two caps, three pairs
"""
from __future__ import annotations

import os
import time
from typing import Sequence

FULL = dict(n=60, caps=(0, 4, 8, 16, 32, 64), max_answer_tokens=12,
            pairs=("full:full", "medium:medium", "small:small", "small:full", "medium:full",
                   "small:medium", "full:small"))
QUICK = dict(n=4, caps=(2, 8), max_answer_tokens=6, pairs=("full:full", "small:small",
                                                             "small:full"))


def frontier(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
  """Pareto frontier of (latency, accuracy) points: each kept point is more accurate than every
  faster one; sorted by latency."""
  out = []
  for lat, acc in sorted(points, key=lambda p: (p[0], -p[1])):
    if not out or acc > out[-1][1]:
      out.append((lat, acc))
  return out


def compare(standard, elastic) -> dict:
  """Best accuracy gain of the elastic frontier at no more latency than a standard frontier
  point, and best latency ratio (standard / elastic) at no less accuracy."""
  gain, speed = None, None
  for lat, acc in standard:
    cands = [a for l, a in elastic if l <= lat]
    if cands and (gain is None or max(cands) - acc > gain[0]):
      gain = (max(cands) - acc, lat, acc)
    cands = [l for l, a in elastic if a >= acc]
    if cands and (speed is None or lat / min(cands) > speed[0]):
      speed = (lat / min(cands), lat, acc)
  return {"acc_gain": gain, "speedup": speed}


def at_most_accurate(standard, elastic) -> dict:
  """At the standard frontier's most accurate point (lat*, acc*): the elastic frontier's accuracy
  gain at no more latency (best accuracy with latency <= lat*, minus acc*) and its latency
  ratio at no less accuracy (lat* / least latency with accuracy >= acc*); None where no elastic
  point is that fast / that accurate. The comparison the paper's claim is about (the low-cap
  points of a model that needs its whole trace answer nothing, whatever the control)."""
  lat, acc = standard[-1]
  fast = [a for l, a in elastic if l <= lat]
  good = [l for l, a in elastic if a >= acc]
  return {"point": (lat, acc), "acc_gain": max(fast) - acc if fast else None,
          "speedup": lat / min(good) if good else None}


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
  """95% Wilson score interval of a binomial proportion hits / n (it always holds hits / n: at
  0 or n hits the bound there is p itself, which rounding could otherwise leave 1e-16 short)."""
  import math
  p = hits / n
  centre = (p + z * z / (2 * n)) / (1 + z * z / n)
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
  return min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half))


def bootstrap_compare(configs, hits, lats, n_boot: int = 1000, seed: int = 0) -> dict:
  """95% percentile intervals of `compare`'s accuracy gain and latency ratio for elastic and
  transplant against standard, items resampled with replacement (hits, lats: [configs, items]);
  a resample where no elastic point qualifies counts as no gain (0) / no speedup (1)."""
  import numpy as np
  hits, lats = np.asarray(hits, float), np.asarray(lats, float)
  n = hits.shape[1]
  idx = np.random.default_rng(seed).integers(0, n, (n_boot, n))
  acc = hits[:, idx].mean(-1)   # [configs, n_boot]
  lat = lats[:, idx].mean(-1)
  kinds = np.array([c[0] for c in configs])
  out = {}
  for k in ("elastic", "transplant"):
    if not (kinds == k).any() or not (kinds == "standard").any():
      continue
    gains, speeds, top_gain, top_speed = [], [], [], []
    for b in range(n_boot):
      pts = lambda kind: frontier(list(zip(lat[kinds == kind, b], acc[kinds == kind, b])))
      std, other = pts("standard"), pts(k)
      cmp, top = compare(std, other), at_most_accurate(std, other)
      gains.append(cmp["acc_gain"][0] if cmp["acc_gain"] else 0.0)
      speeds.append(cmp["speedup"][0] if cmp["speedup"] else 1.0)
      top_gain.append(np.nan if top["acc_gain"] is None else top["acc_gain"])
      top_speed.append(np.nan if top["speedup"] is None else top["speedup"])
    ci = lambda v: (tuple(np.nanpercentile(v, [2.5, 97.5])) if not np.all(np.isnan(v))
                    else (np.nan, np.nan))
    out[k] = {"acc_gain": ci(gains), "speedup": ci(speeds),
              # at the most accurate standard point; "defined": resamples where it exists
              "top_acc_gain": ci(top_gain), "top_speedup": ci(top_speed),
              "top_defined": (float(np.mean(~np.isnan(top_gain))),
                              float(np.mean(~np.isnan(top_speed))))}
  return out


def held_out_items(checkpoint: str, n: int, seed: int | None, sources) -> tuple[list, str]:
  """(items, where they come from): the run's held-out evaluation items when run_config.json
  sits next to the checkpoint and no `seed` is given, else reasoning_examples(n, seed)."""
  import json

  from elastic_jax.training import data, pipeline
  record = os.path.join(os.path.dirname(os.path.abspath(checkpoint)), "run_config.json")
  if seed is None and os.path.exists(record):
    with open(record) as f:
      r = json.load(f)
    if "held_out" not in r:
      raise ValueError(f"{record} predates recording the held-out items; rerun the run's "
                       "command once (it resumes and completes the record), or pass --seed")
    ev, run_seed = r["held_out"], r["config"]["seed"]
    if n > ev["n_reasoning"]:
      raise ValueError(f"--n={n}: the run holds out only eval.n_reasoning={ev['n_reasoning']} "
                       "items; pass --n at most that, or --seed for items its corpus may hold")
    # the first n of the run's held-out draw, which its corpus excludes
    items = pipeline.held_out_for(run_seed, **ev)[:n]
    return items, f"the first {n} held-out items of the run (seed {run_seed})"
  seed = 10_000 if seed is None else seed
  return (data.reasoning_examples(n, seed=seed, sources=tuple(sources)),
          f"{n} items of reasoning_examples(seed={seed}) (not checked against any corpus)")


def run(checkpoint: str, out: str, quick: bool = False, n: int | None = None,
        seed: int | None = None,
        caps: Sequence[int] | None = None, pairs: Sequence[str] | None = None,
        max_answer_tokens: int | None = None, transplant: bool = True, chunk: int = 32,
        sources: Sequence[str] = ("chain_arithmetic",), max_len: int | None = None) -> list[dict]:
  """Runs the sweep, prints the table and frontiers, writes the markdown and plot; returns one
  row per configuration."""
  import numpy as np

  from elastic_jax.inference import budget_control as bc

  preset = QUICK if quick else FULL
  n = n or preset["n"]
  caps = tuple(caps or preset["caps"])
  pairs = [p.split(":") for p in (pairs or preset["pairs"])]
  max_answer_tokens = max_answer_tokens or preset["max_answer_tokens"]
  family = bc.load_family(checkpoint, mode="sliced")
  for p in pairs:
    if len(p) != 2:
      raise ValueError(f"pair {':'.join(p)!r}: expected think:answer")
    for name in p:
      family.get(name)
  examples, where = held_out_items(checkpoint, n, seed, sources)
  tok = family.tokenizer
  special = bc.special_ids(tok)
  prompts = [bc.prompt_ids(tok, ex["question"]) for ex in examples]
  # One cache size for all items: one compiled decode step per slice.
  max_len = max_len or max(bc.max_len_for([p], max(caps), max_answer_tokens, chunk)
                           for p in prompts)

  configs = []
  for think, answer in pairs:
    if think == answer:
      configs += [("standard", think, answer, c) for c in caps]
    else:
      configs += [("elastic", think, answer, c) for c in caps]
      if transplant:
        configs += [("transplant", think, answer, c) for c in caps]

  def once(kind, think, answer, cap, prompt):
    t0 = time.perf_counter()
    r = bc.think_then_answer(family.get(think), family.get(answer), [prompt], cap,
                             max_answer_tokens, continue_cache=kind == "transplant", max_len=max_len,
                             chunk=chunk, **special)[0]
    return r, time.perf_counter() - t0

  for kind, think, answer, _ in configs:   # compile every program before timing
    once(kind, think, answer, 1, prompts[0])
  stats = {c: {"lat": [], "hit": [], "think": [], "capped": [], "cos": [], "top1": []}
           for c in configs}
  for ex, prompt in zip(examples, prompts):
    firsts = {}
    for c in configs:
      r, dt = once(*c, prompt)
      s = stats[c]
      s["lat"].append(dt)
      s["hit"].append(bc.is_correct(tok, r.answer, ex["answer"]))
      s["think"].append(len(r.think))
      s["capped"].append(r.capped)
      firsts[c] = r.first_logits
    for c in configs:
      if c[0] == "transplant":
        a, b = firsts[c], firsts[("elastic",) + c[1:]]
        stats[c]["cos"].append(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))))
        stats[c]["top1"].append(int(a.argmax() == b.argmax()))
  rows = []
  for c, s in stats.items():
    kind, think, answer, cap = c
    lat = np.asarray(s["lat"])
    half = 1.96 * lat.std(ddof=1) / np.sqrt(len(lat)) if len(lat) > 1 else float("nan")
    rows.append({"kind": kind, "think": think, "answer": answer, "cap": cap,
                 "accuracy": float(np.mean(s["hit"])),
                 "accuracy_ci": wilson(int(np.sum(s["hit"])), len(s["hit"])),
                 "latency_s": float(lat.mean()), "latency_ci_s": float(half),
                 "think_tokens": float(np.mean(s["think"])),
                 "capped": float(np.mean(s["capped"])),
                 "cosine": float(np.mean(s["cos"])) if s["cos"] else None,
                 "top1_agree": float(np.mean(s["top1"])) if s["top1"] else None})
  boot = bootstrap_compare(configs, [stats[c]["hit"] for c in configs],
                           [stats[c]["lat"] for c in configs])
  _report(rows, boot, out, checkpoint, where, max_answer_tokens)
  return rows


def _report(rows, boot, out, checkpoint, where, max_answer_tokens):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fronts = {k: frontier([(r["latency_s"], r["accuracy"]) for r in rows if r["kind"] == k])
            for k in ("standard", "elastic", "transplant")}
  lines = [f"Budget control on {checkpoint}: {where}, answer cap {max_answer_tokens} tokens, "
           "batch 1, sliced models, latency = mean wall-clock milliseconds per item on this "
           "machine. Brackets: 95% intervals (accuracy: Wilson; latency: of the mean).", "",
           "| control | think -> answer | think cap | accuracy | latency (ms) | think tokens | "
           "capped | first-logit cosine vs re-prefill | top-1 agree |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    cos = "" if r["cosine"] is None else f"{r['cosine']:.3f}"
    top1 = "" if r["top1_agree"] is None else f"{r['top1_agree']:.2f}"
    lo, hi = r["accuracy_ci"]
    lines.append(f"| {r['kind']} | {r['think']} -> {r['answer']} | {r['cap']} | "
                 f"{r['accuracy']:.3f} [{lo:.2f}, {hi:.2f}] | {1000 * r['latency_s']:.1f} ± "
                 f"{1000 * r['latency_ci_s']:.1f} | {r['think_tokens']:.1f} | "
                 f"{r['capped']:.2f} | {cos} | {top1} |")
  lines += ["", "Accuracy-latency frontiers (latency ms, accuracy):"]
  for k, f in fronts.items():
    if f:
      lines.append(f"- {k}: " + ", ".join(f"({1000 * l:.1f}, {a:.3f})" for l, a in f))
  for k in ("elastic", "transplant"):
    if fronts[k] and fronts["standard"]:
      cmp = compare(fronts["standard"], fronts[k])
      g, s = cmp["acc_gain"], cmp["speedup"]
      lines.append(f"- {k} vs standard: " + (
          f"best accuracy gain at no more latency {g[0]:+.3f} (vs standard at "
          f"{1000 * g[1]:.1f} ms, acc {g[2]:.3f})" if g else f"no {k} point is that fast") +
          "; " + (f"best latency ratio at no less accuracy {s[0]:.2f}x (vs standard at "
                  f"{1000 * s[1]:.1f} ms, acc {s[2]:.3f})" if s else
                  f"no {k} point is that accurate"))
      if k in boot:
        (g0, g1), (s0, s1) = boot[k]["acc_gain"], boot[k]["speedup"]
        lines.append(f"  95% bootstrap intervals (items resampled, frontiers redone): accuracy "
                     f"gain [{g0:+.3f}, {g1:+.3f}], latency ratio [{s0:.2f}x, {s1:.2f}x]")
      top = at_most_accurate(fronts["standard"], fronts[k])
      (lat, acc), g, s = top["point"], top["acc_gain"], top["speedup"]
      line = (f"- {k} vs standard at standard's most accurate point ({1000 * lat:.1f} ms, acc "
              f"{acc:.3f}): accuracy gain at no more latency " +
              (f"{g:+.3f}" if g is not None else f"none (no {k} point that fast)") +
              "; latency ratio at no less accuracy " +
              (f"{s:.2f}x" if s is not None else f"none (no {k} point that accurate)"))
      if k in boot:
        b = boot[k]
        (g0, g1), (s0, s1), (dg, ds) = b["top_acc_gain"], b["top_speedup"], b["top_defined"]
        line += (f"; 95% bootstrap intervals: gain [{g0:+.3f}, {g1:+.3f}] (defined in {dg:.0%} "
                 f"of resamples), ratio [{s0:.2f}x, {s1:.2f}x] (defined in {ds:.0%})")
      lines.append(line)
  text = "\n".join(lines) + "\n"
  print(text)
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "budget_control.md"), "w") as f:
    f.write("# Budget control: standard vs elastic\n\n" + text)
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for k, color in (("standard", "tab:blue"), ("elastic", "tab:orange"),
                   ("transplant", "tab:green")):
    pts = [r for r in rows if r["kind"] == k]
    if not pts:
      continue
    acc = [r["accuracy"] for r in pts]
    ax.errorbar([1000 * r["latency_s"] for r in pts], acc,
                yerr=[[a - r["accuracy_ci"][0] for a, r in zip(acc, pts)],
                      [r["accuracy_ci"][1] - a for a, r in zip(acc, pts)]],
                xerr=[1000 * r["latency_ci_s"] for r in pts], fmt="o", c=color, alpha=0.35,
                ms=4, elinewidth=0.8, label=f"{k} (all, 95% intervals)")
    f = fronts[k]
    ax.step([1000 * l for l, _ in f], [a for _, a in f], where="post", c=color,
            label=f"{k} frontier")
  ax.set_xlabel("latency per item (ms)")
  ax.set_ylabel("answer exact match")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(os.path.join(out, "budget_control.png"), dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  from absl import flags, logging
  logging.set_verbosity(logging.WARNING)  # Orbax logs every file at INFO
  F = flags.FLAGS
  ints = lambda v: [int(x) for x in v] if v else None
  run(F.checkpoint, F.out, F.quick, F.n, F.seed, ints(F.caps), F.pairs, F.max_answer_tokens,
      F.transplant, F.chunk, F.sources, F.max_len)


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_string("checkpoint", "runs/tiny/nested", "nested checkpoint (python -m "
                      "elastic_jax.train)")
  flags.DEFINE_string("out", "runs/budget_control", "where to write the table and plot")
  flags.DEFINE_bool("quick", False, "a few items, two caps, three pairs (CI)")
  flags.DEFINE_integer("n", None, "held-out items (default 60; quick 4)")
  flags.DEFINE_integer("seed", None, "items from reasoning_examples(n, seed) instead of the "
                       "run's held-out items (default: those, else seed 10000)")
  flags.DEFINE_list("caps", None, "thinking caps (default 0,4,8,16,32,64)")
  flags.DEFINE_list("pairs", None, "think:answer budget pairs; equal names = standard")
  flags.DEFINE_integer("max_answer_tokens", None, "answer cap (default 12)")
  flags.DEFINE_bool("transplant", True, "also run elastic pairs with cache transplant")
  flags.DEFINE_integer("chunk", 32, "prefill chunk (tokens)")
  flags.DEFINE_list("sources", ["chain_arithmetic"], "reasoning sources (data.REASONING_SOURCES;"
                    " the default is the task the tiny family learns)")
  flags.DEFINE_integer("max_len", None, "cache size (default: what the items and caps need)")
  app.run(main)
