"""Tokens per expert-parallel shard at each expert budget: contiguous vs balanced placement.

A budget keeps a prefix of the importance-sorted routed experts. Each shard of an
expert-parallel mesh holds E / S experts; the busiest shard sets the step time, so the figure
of merit is max / mean tokens per shard (1.0 = perfectly balanced). Routing is measured with
`model.moe.route` (the model's top-k with the budget's hard expert mask) at nano_v3's MoE
shape (D 2688, 128 experts, top-6) on synthetic inputs: Gaussian tokens, a random router and
a per-expert popularity offset (`--skew`), experts sorted by their full-model load first
(importance follows usage), then the budget's prefix kept. Placement is
`model.expert_placement` ("balanced": expert e on shard e mod S).

  python experiments/expert_balance.py              # 16384 tokens, 8 shards; ~10 s on CPU
  python experiments/expert_balance.py --quick      # 2048 tokens (CI)
"""
from __future__ import annotations

from absl import app, flags

flags.DEFINE_bool("quick", False, "fewer tokens")
flags.DEFINE_integer("shards", 8, "expert-parallel shards (the mesh's expert axis)")
flags.DEFINE_float("skew", 0.02, "std of the per-expert selection offset (popularity spread)")
flags.DEFINE_string("out", None, "also write the markdown table to this file")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  import numpy as np

  from configs import model_config
  from elastic_jax.elastic import masks
  from elastic_jax.model import expert_placement as ep
  from elastic_jax.model import moe

  c = model_config("nano_v3")
  D, E, S = c.hidden_size, c.n_routed_experts, FLAGS.shards
  T = 2048 if FLAGS.quick else 16384
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(k1, (T, D))
  p = {"router": jax.random.normal(k2, (D, E)) / np.sqrt(D),
       "router_bias": FLAGS.skew * jax.random.normal(k3, (E,))}
  route = jax.jit(lambda p, m: moe.route(p, x, c, m)[1])

  def load(p, mask):
    return np.bincount(np.asarray(route(p, mask)).ravel(), minlength=E)

  # Importance-sorted experts (the nesting step's order): most used first.
  order = np.argsort(-load(p, jnp.ones(E)), kind="stable")
  p = {"router": p["router"][:, order], "router_bias": p["router_bias"][order]}
  lines = [f"| experts kept | placement | tokens per shard (of {S}) | idle shards | max / mean |",
           "|---:|---|---|---:|---:|"]
  for kept in c.expert_choices:
    counts = load(p, masks.prefix_mask(kept, E))
    for placement in ("contiguous", "balanced"):
      loads = ep.shard_loads(counts, S, placement)
      lines.append(f"| {kept} | {placement} | {', '.join(map(str, loads))} | "
                   f"{int((loads == 0).sum())} | {loads.max() / loads.mean():.2f} |")
  table = "\n".join(lines)
  print(f"nano_v3 MoE routing, {T} tokens x top-{c.num_experts_per_tok}, {S} expert shards, "
        f"skew {FLAGS.skew}")
  print(table)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      f.write(table + "\n")


if __name__ == "__main__":
  app.run(main)
