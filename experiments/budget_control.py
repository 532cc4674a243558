"""Standard vs elastic budget control on the tiny reasoning family: accuracy against latency.

Held-out reasoning items (`data.reasoning_examples(n, seed=10_000)`, a seed training does not
use; chain_arithmetic by default) are prompted as `<bos>question\\n<think>`. For every thinking cap and (think, answer) slice
pair: standard = one slice thinks (</think> forced at the cap) and answers; elastic = the think
slice writes the trace, the answer slice re-prefills prompt + trace and answers; transplant =
elastic with the answer slice continuing the think slice's cache (approximate; we also report
the cosine similarity and top-1 agreement of its first answer logits with the re-prefill's).
Accuracy is the exact match of the stripped answer text; latency is the wall-clock time per item
(batch 1, sliced standalone models, every program compiled before timing, configurations
interleaved per item so machine noise hits all alike). Prints the table and the accuracy-latency
frontiers of standard vs elastic; writes budget_control.md and budget_control.png to --out.

  python experiments/budget_control.py --checkpoint=runs/tiny/nested --out=runs/budget_control
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


def run(checkpoint: str, out: str, quick: bool = False, n: int | None = None, seed: int = 10_000,
        caps: Sequence[int] | None = None, pairs: Sequence[str] | None = None,
        max_answer_tokens: int | None = None, transplant: bool = True, chunk: int = 32,
        sources: Sequence[str] = ("chain_arithmetic",), max_len: int | None = None) -> list[dict]:
  """Runs the sweep, prints the table and frontiers, writes the markdown and plot; returns one
  row per configuration."""
  import numpy as np

  from elastic_jax.inference import budget_control as bc
  from elastic_jax.training import data

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
  examples = data.reasoning_examples(n, seed=seed, sources=tuple(sources))
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
    rows.append({"kind": kind, "think": think, "answer": answer, "cap": cap,
                 "accuracy": float(np.mean(s["hit"])), "latency_s": float(np.mean(s["lat"])),
                 "think_tokens": float(np.mean(s["think"])),
                 "capped": float(np.mean(s["capped"])),
                 "cosine": float(np.mean(s["cos"])) if s["cos"] else None,
                 "top1_agree": float(np.mean(s["top1"])) if s["top1"] else None})
  _report(rows, out, checkpoint, len(examples), max_answer_tokens)
  return rows


def _report(rows, out, checkpoint, n_items, max_answer_tokens):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fronts = {k: frontier([(r["latency_s"], r["accuracy"]) for r in rows if r["kind"] == k])
            for k in ("standard", "elastic", "transplant")}
  lines = [f"Budget control on {checkpoint}: {n_items} held-out items, answer cap "
           f"{max_answer_tokens} tokens, batch 1, sliced models, latency = mean wall-clock "
           "milliseconds per item on this machine.", "",
           "| control | think -> answer | think cap | accuracy | latency (ms) | think tokens | "
           "capped | first-logit cosine vs re-prefill | top-1 agree |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    cos = "" if r["cosine"] is None else f"{r['cosine']:.3f}"
    top1 = "" if r["top1_agree"] is None else f"{r['top1_agree']:.2f}"
    lines.append(f"| {r['kind']} | {r['think']} -> {r['answer']} | {r['cap']} | "
                 f"{r['accuracy']:.3f} | {1000 * r['latency_s']:.1f} | {r['think_tokens']:.1f} | "
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
    ax.scatter([1000 * r["latency_s"] for r in pts], [r["accuracy"] for r in pts], c=color,
               alpha=0.5, s=18, label=f"{k} (all)")
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
  flags.DEFINE_integer("seed", 10_000, "reasoning_examples seed (not one training uses)")
  flags.DEFINE_list("caps", None, "thinking caps (default 0,4,8,16,32,64)")
  flags.DEFINE_list("pairs", None, "think:answer budget pairs; equal names = standard")
  flags.DEFINE_integer("max_answer_tokens", None, "answer cap (default 12)")
  flags.DEFINE_bool("transplant", True, "also run elastic pairs with cache transplant")
  flags.DEFINE_integer("chunk", 32, "prefill chunk (tokens)")
  flags.DEFINE_list("sources", ["chain_arithmetic"], "reasoning sources (data.REASONING_SOURCES;"
                    " the default is the task the tiny family learns)")
  flags.DEFINE_integer("max_len", None, "cache size (default: what the items and caps need)")
  app.run(main)
