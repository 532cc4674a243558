"""Summarise a model: sizes per elastic choice and a jitted masked forward at each.

  python -m elastic_jax.summary --config=tiny
  python -m elastic_jax.summary --hf_dir=/path/to/nemotron_h_folder
"""
from __future__ import annotations

import time

from absl import flags

from elastic_jax import cli

flags.DEFINE_string("config", "tiny", "preset in configs/ (tiny, nano_v3)")
flags.DEFINE_string("hf_dir", None, "local Nemotron-H folder (config.json + safetensors) to load")
flags.DEFINE_integer("seq_len", 32, "tokens per sequence for the forward check")
flags.DEFINE_integer("batch", 2, "sequences for the forward check")
flags.DEFINE_integer("seed", 0, "init / token seed")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp

  from configs import model_config
  from elastic_jax import apply, count_params, from_counts, init, rng
  from elastic_jax.io import hf
  from elastic_jax.elastic.axes import AXES

  if FLAGS.hf_dir:
    cfg, params = hf.load_pretrained(FLAGS.hf_dir)
  else:
    cfg = model_config(FLAGS.config)
    params = init(cfg, rng.key(FLAGS.seed, "init"))
  full = count_params(cfg)
  print(f"pattern {cfg.layer_pattern} ({cfg.num_layers} layers), hidden {cfg.hidden_size}, "
        f"vocab {cfg.vocab_size}")
  print(f"full model: {full.total:,} total / {full.active:,} active params "
        f"({full.active_without_embedding:,} without input embedding)")
  tokens = jax.random.randint(rng.key(FLAGS.seed, "tokens"), (FLAGS.batch, FLAGS.seq_len), 0,
                              cfg.vocab_size)
  fwd = jax.jit(lambda p, t, m: apply(p, t, m, config=cfg))
  header = f"{'level':>5} | " + " | ".join(f"{n:>11}" for n in AXES) + \
      " | total params | active params | active ratio | mean logit entropy | ms/forward"
  print(header)
  print("-" * len(header))
  n_levels = max(len(a.choices(cfg)) for a in AXES.values())
  for level in range(n_levels):
    counts = {n: a.choices(cfg)[min(level, len(a.choices(cfg)) - 1)] for n, a in AXES.items()}
    pc = count_params(cfg, counts)
    masks = from_counts(cfg, counts)
    logits = fwd(params, tokens, masks).block_until_ready()
    t0 = time.perf_counter()
    logits = fwd(params, tokens, masks).block_until_ready()
    ms = 1e3 * (time.perf_counter() - t0)
    logp = jax.nn.log_softmax(logits, -1)
    entropy = float(-jnp.mean(jnp.sum(jnp.exp(logp) * logp, -1)))
    print(f"{level:>5} | " + " | ".join(f"{counts[n]:>11}" for n in AXES) +
          f" | {pc.total:>12,} | {pc.active:>13,} | {pc.active / full.active:>12.3f} | "
          f"{entropy:>18.3f} | {ms:>10.1f}")


if __name__ == "__main__":
  cli.run(main)
