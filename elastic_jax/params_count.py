"""Exact parameter counter: total and active parameters for any per-axis counts.

Driven by the same leaf table as `init` (`model.param_specs`) and the axis description
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

from elastic_jax.axes import ROUTED_EXPERT_LEAVES, leaf_sizes, map_param_leaves, normalize_counts
from elastic_jax.config import ModelConfig
from elastic_jax.model.model import param_specs


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

  def visit(kind, layer, path, spec):
    dims = leaf_sizes(config, norm, kind, layer, path, spec.shape)
    size = math.prod(dims)
    totals["total"] = totals["total"] + size
    if path == ("embed",):
      totals["embedding"] = size
    if kind == "E" and path in ROUTED_EXPERT_LEAVES:
      dims[0] = config.num_experts_per_tok
      size = math.prod(dims)
    totals["active"] = totals["active"] + size

  map_param_leaves(config, param_specs(config), visit)
  return ParamCount(**totals)


def count_leaves(params) -> int:
  """Number of scalars in a params pytree (arrays or ShapeDtypeStructs)."""
  return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(params))
