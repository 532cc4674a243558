"""Calibration statistics and importance scores (Minitron activations + REAP expert saliency).

Per batch, for a channel c: a_c += sum_b (mean_t |act[b, t, c]|)^2; importance = sqrt(a_c).
- hidden: on every pre-mixer RMSNorm output, importance summed over layers;
- Mamba: on the x part of in_proj ([groups, heads, head_dim]); head channels ranked by the L2
  over heads, a head scored by the L2 of its top `mamba_top_channels` channels (all by default);
  heads are ranked within their group by the nesting step;
- expert FFN width: the down-projection input g * relu^2(h) on routed tokens (gate-weighted, as
  ModelOpt reads it), one score per layer shared by its experts;
- attention query heads: on each head's output (before the output projection) [Hq, hd], a head
  scored by the L2 over its channels; ranked within its KV group ([Hkv, rep]);
- Mamba head-dim channels: the `mamba_channels` score above, one order per layer for all heads;
- depth: a layer scored by the increase of the next-token loss on the calibration batches when
  that layer alone is dropped (its residual branch masked to 0), only when depth is elastic;
- experts: REAP S_j = mean over tokens routed to j of g_j(x) ||E_j(x)||_2 with the model's own
  normalised sigmoid gate (ModelOpt's expert L2, of the gated output, is this same score), or
  the ungated mean ||E_j(x)||_2 (`expert_score="output_norm"`).
Only forward passes; batches stream through one jitted step, any number of them.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Iterable

import jax
import jax.numpy as jnp

from elastic_jax.config import ModelConfig
from elastic_jax.model.budget_masks import BudgetMasks
from elastic_jax.model.model import apply

EXPERT_SCORES = ("reap", "output_norm")


@dataclasses.dataclass
class Importance:
  """Importance per elastic axis; per-layer axes carry a leading layer dim (layers of that kind)."""
  hidden: Any          # [D]
  mamba_heads: Any     # [L_mamba, G, H]
  mamba_channels: Any  # [L_mamba, P]
  moe_ffn: Any         # [L_moe, F]
  moe_experts: Any     # [L_moe, E]
  attention_heads: Any = None  # [L_attn, Hkv, rep]
  depth: Any = None            # [L] (None unless depth has several choices)
  num_tokens: int = 0


@functools.partial(jax.jit, static_argnums=(2, 3))
def _batch_stats(params, tokens, config: ModelConfig, moe_impl: str):
  _, stats = apply(params, tokens, config=config, collect=True, moe_impl=moe_impl)
  return stats


def _combine(path, total, new):
  """Sums are added over batches; the input amaxes ("amax" statistics) are maxed."""
  is_amax = any(getattr(k, "key", None) == "amax" for k in path)
  return jnp.maximum(total, new) if is_amax else total + new


def accumulate(params, config: ModelConfig, batches: Iterable, log_every: int = 0,
               moe_impl: str = "dense"):
  """Sums per-layer statistics (maxes the input amaxes) over int token batches [B, T].
  `moe_impl`: the MoE dispatch; any but "dense" collects the expert statistics from the routed
  assignments alone (no [tokens, experts, FFN] activations: the way at scale)."""
  total, n_tokens, t0 = None, 0, time.perf_counter()
  for i, tokens in enumerate(batches):
    tokens = jnp.asarray(tokens)
    stats = _batch_stats(params, tokens, config, moe_impl)
    total = stats if total is None else jax.tree_util.tree_map_with_path(_combine, total, stats)
    n_tokens += int(tokens.size)
    if log_every and (i + 1) % log_every == 0:
      dt = time.perf_counter() - t0
      print(f"importance: {i + 1} batches, {n_tokens:,} tokens, {n_tokens / dt:,.0f} tok/s",
            flush=True)
  if total is None:
    raise ValueError("importance.accumulate got no calibration batches")
  return total, n_tokens


def scores_from_stats(stats, config: ModelConfig, n_tokens: int = 0, expert_score: str = "reap",
                      mamba_top_channels: int | None = None) -> Importance:
  if expert_score not in EXPERT_SCORES:
    raise ValueError(f"expert_score must be one of {EXPERT_SCORES}, got {expert_score!r}")
  hidden = sum(jnp.sqrt(s["hidden"]) for s in stats)
  heads, channels, ffn, experts, q_heads = [], [], [], [], []
  Hkv = config.num_kv_heads
  for kind, s in zip(config.layer_pattern, stats):
    if kind == "M":
      x = jnp.sqrt(s["x"])                                   # [G, H, P]
      ch = jnp.sqrt(jnp.sum(jnp.square(x), axis=(0, 1)))     # [P]
      k = mamba_top_channels or x.shape[-1]
      top = jnp.argsort(-ch)[:k]
      heads.append(jnp.sqrt(jnp.sum(jnp.square(x[..., top]), axis=-1)))
      channels.append(ch)
    elif kind == "E":
      ffn.append(jnp.sqrt(s["ffn"]))
      num = s["reap_sum"] if expert_score == "reap" else s["norm_sum"]
      experts.append(jnp.where(s["count"] > 0, num / jnp.maximum(s["count"], 1.0), 0.0))
    elif kind == "*":
      h = jnp.sqrt(jnp.sum(s["heads"], axis=-1))            # [Hq], stored [rep, Hkv]
      q_heads.append(h.reshape(-1, Hkv).T)
  stack = lambda xs: jnp.stack(xs) if xs else None
  return Importance(hidden=hidden, mamba_heads=stack(heads), mamba_channels=stack(channels),
                    moe_ffn=stack(ffn), moe_experts=stack(experts),
                    attention_heads=stack(q_heads), num_tokens=n_tokens)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _drop_losses(params, tokens, config: ModelConfig, moe_impl: str):
  """(mean next-token NLL of `tokens` with each layer dropped in turn [L], with none)."""
  def nll(keep_L):
    logits = apply(params, tokens[:, :-1], BudgetMasks(depth=keep_L), config=config,
                   moe_impl=moe_impl)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))
  L = config.num_layers
  return jax.lax.map(nll, 1.0 - jnp.eye(L)), nll(jnp.ones(L))


def layer_scores(params, config: ModelConfig, batches: Iterable, moe_impl: str = "dense"):
  """[L] mean increase of the next-token loss when each layer alone is dropped (the depth
  ranking: a larger increase, a more important layer)."""
  total, n = 0.0, 0
  for tokens in batches:
    drops, full = _drop_losses(params, jnp.asarray(tokens), config, moe_impl)
    total, n = total + (drops - full), n + 1
  if not n:
    raise ValueError("importance.layer_scores got no calibration batches")
  return total / n


def compute_importance(params, config: ModelConfig, batches: Iterable, expert_score: str = "reap",
                       mamba_top_channels: int | None = None, log_every: int = 0,
                       moe_impl: str = "dense") -> Importance:
  """Runs calibration batches and returns `Importance` scores for every elastic axis
  (`moe_impl` as in `accumulate`)."""
  if not config.is_homogeneous:
    raise ValueError("importance is computed on a homogeneous parent, not a per-layer slice")
  elastic_depth = len(config.depth_choices) > 1
  batches = list(batches) if elastic_depth else batches
  stats, n = accumulate(params, config, batches, log_every, moe_impl)
  scores = scores_from_stats(stats, config, n, expert_score, mamba_top_channels)
  if elastic_depth:
    scores.depth = layer_scores(params, config, batches, moe_impl)
  return scores
