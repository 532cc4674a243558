"""The tiny model on a reasoning-heavy mix, long enough that the family reasons (issue 16): the
data are `chain_arithmetic` traces (3-4 one-digit terms, the held-out evaluation questions left
out) with a few KJV verses, and the parent pretrains for 4,000 steps instead of 600.

  python -m elastic_jax.train --config=configs/reasoning.py --workdir=runs/reasoning
"""
from configs import tiny

MODEL = tiny.MODEL


def get_config():
  cfg = tiny.get_config()
  cfg.data.update(n_text=1000, n_reasoning=60000, reasoning_sources=("chain_arithmetic",),
                  reasoning_weights=(1.0,))
  cfg.pretrain.steps = 4000
  cfg.log_every = 250
  cfg.checkpoint.save_every = 500
  return cfg
