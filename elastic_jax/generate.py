"""Generate with a nested checkpoint: any budget thinks, any budget answers (elastic budget control).

  python -m elastic_jax.generate --checkpoint=runs/tiny/nested --prompt="Calculate 3 + 4 - 2." \\
      --think_budget=small --answer_budget=full --max_think_tokens=32
"""
from __future__ import annotations

import sys
import time

from absl import flags

from elastic_jax import cli
from elastic_jax.config import KERNELS

flags.DEFINE_string("checkpoint", None, "nested checkpoint directory (from elastic_jax.train)",
                    required=True)
flags.DEFINE_string("think_budget", "full", "budget that writes the think trace")
flags.DEFINE_string("answer_budget", None, "budget that writes the answer (default: "
                    "--think_budget; a different one = elastic budget control)")
flags.DEFINE_integer("max_think_tokens", 64, "thinking cap; </think> is forced at the cap")
flags.DEFINE_integer("max_answer_tokens", 32, "answer cap")
flags.DEFINE_multi_string("prompt", ["Calculate 3 + 4 - 2."], "question(s); repeat for a batch")
flags.DEFINE_float("temperature", 0.0, "0 = greedy")
flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass")
flags.DEFINE_integer("seed", 0, "sampling seed")
flags.DEFINE_enum("mode", "sliced", ["sliced", "masked"], "standalone sliced sub-models, or "
                  "the parent with budget masks")
flags.DEFINE_integer("max_len", None, "cache size in tokens (default: what the prompts and "
                     "caps need); a fixed size reuses compiled programs across runs")
flags.DEFINE_bool("transplant", False, "elastic: the answer slice continues the think slice's "
                  "cache instead of re-prefilling prompt + trace (approximate)")
flags.DEFINE_enum("kernels", None, list(KERNELS), "SSD scan and grouped-matmul kernels "
                  "(default: the checkpoint's; pallas runs interpreted on CPU)")
flags.DEFINE_enum("matmul", "auto", ["auto", "dequant", "fp8"], "quantized checkpoints: "
                  "dequantize weights in the step, or run the FP8 projections as FP8 matmuls "
                  "(auto: fp8 on GPUs)")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  from absl import logging
  logging.set_verbosity(logging.ERROR)  # Orbax logs every file at INFO, chunking hints at WARNING
  import jax

  from elastic_jax import rng
  from elastic_jax.inference import budget_control as bc
  from elastic_jax.inference.generate import Sampler
  family = bc.load_family(FLAGS.checkpoint, mode=FLAGS.mode, kernels=FLAGS.kernels,
                          matmul=FLAGS.matmul)
  think = family.get(FLAGS.think_budget)
  answer = family.get(FLAGS.answer_budget or FLAGS.think_budget)
  prompts = [bc.prompt_ids(family.tokenizer, q) for q in FLAGS.prompt]
  printer = bc.StreamPrinter(family.tokenizer, len(prompts), sys.stdout)
  t0 = time.perf_counter()
  res = bc.think_then_answer(think, answer, prompts, FLAGS.max_think_tokens,
                             FLAGS.max_answer_tokens, **bc.special_ids(family.tokenizer),
                             sampler=Sampler(FLAGS.temperature, FLAGS.top_p),
                             key=rng.key(FLAGS.seed, "sampling"), continue_cache=FLAGS.transplant,
                             on_token=printer, max_len=FLAGS.max_len)
  printer.finish()
  dt = time.perf_counter() - t0
  n = sum(len(r.think) + len(r.answer) + 1 for r in res)
  kind = "masked parent" if think.masks is not None else "sliced models"
  print(f"[{think.name} -> {answer.name}, {res[0].mode}, {kind}] {n} tokens in {dt:.2f}s "
        f"({n / dt:.1f} tok/s, compile included)", file=sys.stderr)
  for q, r in zip(FLAGS.prompt, res):
    answer_text = bc.answer_text(family.tokenizer, r.answer)
    print(f"Q: {q!r} A: {answer_text!r} (think {len(r.think)} tokens"
          f"{', capped' if r.capped else ''})", file=sys.stderr)


if __name__ == "__main__":
  cli.run(main)

