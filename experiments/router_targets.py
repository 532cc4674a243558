"""What the nano_v3 budgets select when a budget is one active fraction vs (total, active).

The router is trained on the budget loss alone (`router.fit_to_budgets`: no weights, no data)
against the exact nano_v3 counter, once with each budget's active target only and once with
its total and active targets (as `configs/nano_v3.py` names them: 30B/3.6A, 23B/2.8A,
12B/2.0A). Prints, per budget, the argmax counts, total and active parameters, their ratio to
the target, inference memory and latency at the cost model's defaults (bf16, batch 1, 1024 +
1024 tokens, one H100), plus the spread of total sizes inside the 23B active band.

  python experiments/router_targets.py           # 300 router steps, about a minute on CPU
  python experiments/router_targets.py --quick   # 60 steps (CI)
"""
from __future__ import annotations

import itertools

from absl import app, flags

flags.DEFINE_bool("quick", False, "fewer router steps")
flags.DEFINE_string("out", None, "also write the markdown table to this file")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  from configs import model_config
  from elastic_jax import count_params
  from elastic_jax.elastic import measures
  from elastic_jax.elastic import router as R
  from elastic_jax.elastic.axes import AXES

  nano = model_config("nano_v3")
  rc = R.RouterConfig(hidden=16)
  full = count_params(nano)
  steps = 60 if FLAGS.quick else 300
  both = R.budget_targets(nano)
  lines = ["| targets | budget | counts (" + ", ".join(AXES) + ") | total | active | "
           "total / target | active / target | memory GB | latency s |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|"]
  for label, targets in (("active only", {"active": both["active"]}), ("total + active", both)):
    rp = R.fit_to_budgets(nano, rc, steps=steps, targets=targets)
    for name in nano.budget_names:
      counts = R.chosen_counts(rp, nano, rc, name)
      pc = count_params(nano, counts)
      want = nano.budget_targets(name)
      mem = measures.measure(nano, counts, "memory", rc.cost) / 1e9
      lat = measures.measure(nano, counts, "latency", rc.cost)
      lines.append(
          f"| {label} | {name} | {', '.join(str(counts[a]) for a in AXES)} | "
          f"{pc.total / 1e9:.2f}B | {pc.active / 1e9:.3f}B | "
          f"{pc.total / (want['total'] * full.total):.3f} | "
          f"{pc.active / (want['active'] * full.active):.3f} | {mem:.1f} | {lat:.3f} |")
  # Every homogeneous choice within 5% of the 23B budget's active target: its total sizes.
  target = nano.budget_targets("23B")["active"] * full.active
  totals = []
  for combo in itertools.product(*(AXES[a].choices(nano) for a in AXES)):
    pc = count_params(nano, dict(zip(AXES, combo)))
    if abs(pc.active / target - 1) <= 0.05:
      totals.append(pc.total)
  table = "\n".join(lines)
  note = (f"\n\n{len(totals)} homogeneous choices lie within 5% of 2.8B active; their totals "
          f"span {min(totals) / 1e9:.1f}B to {max(totals) / 1e9:.1f}B.")
  print(table + note)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      f.write(f"Router trained on the budget loss alone, {steps} steps "
              f"(`experiments/router_targets.py`).\n\n{table}{note}\n")


if __name__ == "__main__":
  app.run(main)
