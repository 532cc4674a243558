"""What a budget measures, for any per-axis counts: parameters, inference memory, latency.

`measure(config, counts, name, cost)` gives one of `config.BUDGET_MEASURES`:
- "active" / "total": parameters (`params_count.count_params`);
- "memory": inference bytes, all stored weights at `cost.weight_format` plus the KV cache for
  `cost.batch` x `cost.prompt_len + cost.decode_len` tokens and the Mamba states
  (`params_count.count_memory`);
- "latency": seconds for one batch of requests (`count_latency`).
Counts may be traced floats (expected sizes under the router's distribution), so every measure
is differentiable for the budget loss.

The latency model is a roofline: each phase takes max(FLOPs / peak_flops, bytes / bandwidth).
- Prefill of `batch` x `prompt_len` tokens, one pass: FLOPs = 2 N per token (N: the matmul
  weights a token uses, the active parameters less the input embedding, a lookup) plus causal
  attention, 4 H d_h (P / 2) per token per attention layer; bytes = the weights read once (the
  dense ones and the routed experts these tokens touch) plus the KV cache written.
- Decode of `decode_len` steps of `batch` tokens, at the mean context P + G / 2: FLOPs as
  prefill per token; bytes per step = the dense weights, the routed experts the step's tokens
  touch, the KV cache read and the Mamba states read and written.
Tokens spread over E experts as uniform routing would: n tokens with top-k touch
E (1 - (1 - k / E)^n) experts per layer. So at batch 1 decode reads the active weights, and at
large batches nearly all of them: the expert count then matters, as it does on real hardware.
Ignored: the embedding lookup, norms, the SSD scan's own FLOPs, kernel launch and
communication. Defaults: one H100 SXM (989 TFLOP/s dense bf16, 3.35 TB/s HBM).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

from elastic_jax.config import BUDGET_MEASURES, ModelConfig
from elastic_jax.elastic.axes import layer_keep, normalize_counts
from elastic_jax.elastic.params_count import BYTES_PER_ELEMENT, count_memory, count_params


@dataclasses.dataclass(frozen=True)
class CostModel:
  """The serving point the memory and latency measures describe (see the module docstring)."""
  weight_format: str = "bfloat16"
  batch: int = 1
  prompt_len: int = 1024
  decode_len: int = 1024
  kv_bytes: float = 2.0
  peak_flops: float = 989e12
  hbm_bandwidth: float = 3.35e12

  def __post_init__(self):
    if self.weight_format not in BYTES_PER_ELEMENT:
      raise ValueError(f"CostModel.weight_format {self.weight_format!r} not in "
                       f"{sorted(BYTES_PER_ELEMENT)}")
    for f in ("batch", "prompt_len", "decode_len", "kv_bytes", "peak_flops", "hbm_bandwidth"):
      if not getattr(self, f) > 0:
        raise ValueError(f"CostModel.{f} must be > 0, got {getattr(self, f)!r}")


def _touched(experts, k: int, tokens: float):
  """Expected distinct experts of `experts` that `tokens` tokens with top-k routing touch."""
  return experts * (1.0 - (1.0 - k / experts) ** tokens)


def count_latency(config: ModelConfig, counts: Mapping[str, Any] | None = None,
                  cost: CostModel = CostModel(), validate: bool = True):
  """Seconds to prefill and decode one batch of requests (module docstring)."""
  c, norm = config, normalize_counts(config, counts, validate)
  pc = count_params(config, counts, validate)
  bpe = BYTES_PER_ELEMENT[cost.weight_format]
  n_matmul = pc.active - pc.embedding
  # One more expert in every MoE layer adds one expert's weights per layer to the total, and a
  # router column to both total and active: the difference is one routed expert per layer.
  n_moe = len(norm["moe_experts"])
  expert = 0.0
  if n_moe:
    plus = count_params(config, dict(counts or {}, moe_experts=tuple(
        e + 1 for e in norm["moe_experts"])), validate=False)
    expert = (plus.total - pc.total) - (plus.active - pc.active)
  experts = sum(norm["moe_experts"]) / max(n_moe, 1)   # mean over layers (exact if homogeneous)
  dense = pc.total - pc.embedding - experts * expert     # read every step (router included)
  k = c.num_experts_per_tok
  keep = layer_keep(config, norm)
  n_attn = sum(keep[i] for i in c.layers_of("*"))
  attn_flops = 4 * c.head_dim * sum(keep[i] * h for i, h in zip(c.layers_of("*"),
                                                                norm["attention_heads"]))
  kv_token = 2 * c.num_kv_heads * c.head_dim * cost.kv_bytes * n_attn   # bytes per token
  states = count_memory(config, counts, weight_format=cost.weight_format, batch=1, seq_len=0,
                        validate=validate) - pc.total * bpe               # Mamba states, 1 seq
  B, P, G = cost.batch, cost.prompt_len, cost.decode_len

  def roofline(flops, bytes_):
    a, b = flops / cost.peak_flops, bytes_ / cost.hbm_bandwidth
    # Python numbers stay Python (exact sizes are needed as constants inside a jitted loss).
    return max(a, b) if isinstance(a, float) and isinstance(b, float) else jnp.maximum(a, b)

  weights = lambda tokens: (dense + (_touched(experts, k, tokens) * expert if n_moe else 0)) * bpe
  prefill = roofline(B * P * (2 * n_matmul + attn_flops * P / 2),
                     weights(B * P) + B * P * kv_token)
  ctx = P + G / 2
  step = roofline(B * (2 * n_matmul + attn_flops * ctx),
                  weights(B) + B * ctx * kv_token + 2 * B * states)
  return prefill + G * step


def measure(config: ModelConfig, counts: Mapping[str, Any] | None, name: str,
            cost: CostModel = CostModel(), validate: bool = True):
  """The budget measure `name` (one of BUDGET_MEASURES) of the sub-model with `counts`."""
  if name == "active":
    return count_params(config, counts, validate).active
  if name == "total":
    return count_params(config, counts, validate).total
  if name == "memory":
    return count_memory(config, counts, weight_format=cost.weight_format, batch=cost.batch,
                        seq_len=cost.prompt_len + cost.decode_len, kv_bytes=cost.kv_bytes,
                        validate=validate)
  if name == "latency":
    return count_latency(config, counts, cost, validate)
  raise ValueError(f"budget measure must be one of {list(BUDGET_MEASURES)}, got {name!r}")


def serving_memory(config: ModelConfig, counts: Mapping[str, Any] | None, weight_format: str,
                   context: int, device_bytes: float = 80e9, kv_bytes: float = 2.0) -> dict:
  """One device serving the sub-model with `counts`: {"weights": bytes of every stored weight
  at `weight_format`, "per_sequence": bytes of the KV cache of `context` tokens plus the Mamba
  conv and SSM states of one sequence, "max_batch": the most sequences whose caches fit beside
  the weights in `device_bytes` (0 if the weights alone do not fit)}. Activations and framework
  workspace are not counted."""
  weights = float(count_params(config, counts).total * BYTES_PER_ELEMENT[weight_format])
  per_seq = float(count_memory(config, counts, weight_format=weight_format, batch=1,
                               seq_len=context, kv_bytes=kv_bytes)) - weights
  return {"weights": weights, "per_sequence": per_seq,
          "max_batch": max(0, int((device_bytes - weights) // per_seq))}
