"""Exact parameter counter: total and active parameters for any per-axis counts.

Driven by the modules' declared shapes (`model.param_shapes`) and the axis description
(`axes.AXES`): each leaf's size is the product of its dims with every axis-touched dim replaced
by that axis' count. Routed-expert stacks count `num_experts_per_tok` experts as active; the
router, its bias and the shared expert are always active. Counts may be Python ints (exact) or
traced floats (differentiable expected sizes for the budget loss; pass `validate=False`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax

from elastic_jax.config import ModelConfig
from elastic_jax.elastic.axes import (ROUTED_EXPERT_LEAVES, layer_keep, leaf_sizes,
                                      map_param_leaves, normalize_counts)
from elastic_jax.model.model import param_shapes


@dataclasses.dataclass(frozen=True)
class ParamCount:
  total: Any
  active: Any       # includes the input embedding
  embedding: Any    # input embedding only (subtract for "active without embedding")

  @property
  def active_without_embedding(self):
    return self.active - self.embedding


def count_params(config: ModelConfig, counts: Mapping[str, Any] | None = None,
                 validate: bool = True) -> ParamCount:
  """Total / active parameter counts of the sub-model with per-axis `counts` (full if None)."""
  norm = normalize_counts(config, counts, validate)
  totals = {"total": 0, "active": 0, "embedding": 0}
  keep = layer_keep(config, norm)

  def visit(kind, layer, path, spec):
    dims = leaf_sizes(config, norm, kind, layer, path, spec.shape)
    k = 1 if layer is None else keep[layer]   # a layer the depth count drops has no parameters
    size = math.prod(dims)
    totals["total"] = totals["total"] + k * size
    if path == ("embed",):
      totals["embedding"] = size
    if kind == "E" and path in ROUTED_EXPERT_LEAVES:
      dims[0] = config.num_experts_per_tok
      size = math.prod(dims)
    totals["active"] = totals["active"] + k * size

  map_param_leaves(config, param_shapes(config), visit)
  return ParamCount(**totals)


def count_leaves(params) -> int:
  """Number of scalars in a params pytree (arrays or ShapeDtypeStructs)."""
  return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(params))


# Bytes per stored weight element (NVFP4: 4-bit values + one E4M3 scale per 16 = 4.5 bits).
BYTES_PER_ELEMENT = {"float32": 4.0, "bfloat16": 2.0, "fp8": 1.0, "nvfp4": 0.5625}


def count_memory(config: ModelConfig, counts: Mapping[str, Any] | None = None, *,
                 weight_format: str = "bfloat16", batch: int = 1, seq_len: int = 0,
                 kv_bytes: float = 2.0, conv_bytes: float = 2.0, validate: bool = True):
  """Inference memory in bytes: all stored weights at `weight_format`, plus the attention KV
  cache for `batch` x `seq_len` tokens and the Mamba conv / fp32 SSM states (differentiable in
  traced counts like `count_params`)."""
  if weight_format not in BYTES_PER_ELEMENT:
    raise ValueError(f"weight_format {weight_format!r} not in {sorted(BYTES_PER_ELEMENT)}")
  norm = normalize_counts(config, counts, validate)
  weights = count_params(config, counts, validate).total * BYTES_PER_ELEMENT[weight_format]
  c = config
  keep = layer_keep(config, norm)
  n_attn = sum(keep[i] for i in c.layers_of("*"))
  kv = n_attn * 2 * batch * seq_len * c.num_kv_heads * c.head_dim * kv_bytes
  gn = 2 * c.mamba_n_groups * c.ssm_state_size
  ssm = 0
  for i, heads, head_dim in zip(c.layers_of("M"), norm["mamba_heads"], norm["mamba_head_dim"]):
    hp = heads * head_dim
    ssm = ssm + keep[i] * batch * (hp * c.ssm_state_size * 4.0
                                   + (hp + gn) * (c.conv_kernel - 1) * conv_bytes)
  return weights + kv + ssm
