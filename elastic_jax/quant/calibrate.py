"""Input calibration: the largest |input| each matmul weight sees on calibration data.

A serving engine that quantizes activations too (ModelOpt's NVFP4 is W4A4, its FP8 W8A8 with a
static activation scale) needs each Linear's `input_scale` = input amax / (6 * 448) (NVFP4) or
/ 448 (FP8). The amaxes come from forward passes with the model's calibration statistics
(`collect`: each block's "amax"), maxed over batches, and are keyed by the params path of the
weight they feed, so `io.modelopt` finds each HF Linear's from the leaves it is made of.

An expert's input is the tokens routed to it: its amax is the largest over those. An expert no
calibration token reached gets the largest of its layer's experts (the conservative scale: a
smaller one would clip whatever reaches it at serving time).
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

from elastic_jax.config import ModelConfig
from elastic_jax.elastic import importance
from elastic_jax.model import expert_placement

# Per layer kind: {weight leaf: the statistic holding its input amax}. "in" is the block's
# normed input, which every projection reading the residual stream sees.
SOURCES = {
    "M": {"in_z": "in", "in_x": "in", "in_B": "in", "in_C": "in", "in_dt": "in",
          "out_proj": "out_proj"},
    "*": {"q": "in", "k": "in", "v": "in", "o": "o"},
    "E": {"router": "in", "up": "up", "down": "down", "shared_up": "in",
          "shared_down": "shared_down"},
    "-": {"up": "in", "down": "down"},
}


def leaf_path(layer: int, leaf: str) -> str:
  """The key (`jax.tree_util.keystr`) of a layer's mixer weight in canonical params."""
  return f"['layers']['{layer}']['mixer']['{leaf}']"


def input_amax(params, config: ModelConfig, batches: Iterable, moe_impl: str = "dense",
               log_every: int = 0) -> dict[str, np.ndarray]:
  """{params path of a mixer weight: the largest |input| it saw over `batches`} (int token
  batches [B, T]; float32, one per expert [E] for the routed experts' up / down, in the
  params' own expert order). `params`: canonical float params of `config` (a slice, or a
  dequantized quantized model: the activations it will serve)."""
  stats, _ = importance.accumulate(params, config, _checked(batches, config), log_every,
                                  moe_impl)
  out = {}
  for i, (kind, s) in enumerate(zip(config.layer_pattern, stats)):
    lc = config.layer_config(i)
    for leaf, stat in SOURCES[kind].items():
      a = np.asarray(s["amax"][stat], np.float32)
      if a.ndim == 1:   # per expert, logical order
        a = np.where(a > 0, a, a.max())
        if lc.expert_placement != "contiguous":   # params hold experts in physical order
          a = a[expert_placement.order(lc.n_routed_experts, lc.expert_placement)]
      out[leaf_path(i, leaf)] = a
  return out


def _checked(batches: Iterable, config: ModelConfig):
  """`batches` one by one, each refused (ValueError naming it) unless int tokens [B, T] with
  ids in [0, vocab)."""
  n = 0
  for n, b in enumerate(batches, 1):
    b = np.asarray(b)
    if b.ndim != 2 or not np.issubdtype(b.dtype, np.integer):
      raise ValueError(f"calibration batch {n}: expected int tokens [batch, time], got "
                       f"{b.dtype}{list(b.shape)}")
    if b.size and (b.max() >= config.vocab_size or b.min() < 0):
      raise ValueError(f"calibration batch {n}: token ids must lie in [0, {config.vocab_size})")
    yield b
  if not n:
    raise ValueError("no calibration batches")


__all__ = ["SOURCES", "input_amax", "leaf_path"]
