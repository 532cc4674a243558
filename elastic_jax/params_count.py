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

from elastic_jax.axes import ROUTED_EXPERT_LEAVES, layer_counts, normalize_counts, uses_for
from elastic_jax.config import ModelConfig
from elastic_jax.model import init_utils as iu
from elastic_jax.model.model import param_specs


@dataclasses.dataclass(frozen=True)
class ParamCount:
  total: Any
  active: Any       # includes the input embedding
  embedding: Any    # input embedding only (subtract for "active without embedding")

  @property
  def active_without_embedding(self):
    return self.active - self.embedding


def _leaf_items(tree, prefix=()):
  if isinstance(tree, iu.Spec):
    yield prefix, tree
  else:
    for k, v in tree.items():
      yield from _leaf_items(v, prefix + (k,))


def _sized(shape, kind, path, counts, config):
  dims = list(shape)
  for axis, use in uses_for(kind, path):
    dims[use.dim] = axis.dim_size(counts[axis.name], config)
  return dims


def count_params(config: ModelConfig, counts: Mapping[str, Any] | None = None,
                 validate: bool = True) -> ParamCount:
  """Total / active parameter counts of the sub-model with per-axis `counts` (full if None)."""
  norm = normalize_counts(config, counts, validate)
  specs = param_specs(config)
  glob = {a: v[0] for a, v in norm.items()}
  total = active = 0
  embedding = None
  for name in ("embed", "final_norm", "lm_head"):
    size = math.prod(_sized(specs[name].shape, "global", (name,), glob, config))
    total, active = total + size, active + size
    if name == "embed":
      embedding = size
  for i, (kind, layer) in enumerate(zip(config.layer_pattern, specs["layers"])):
    lc = layer_counts(config, norm, i)
    for path, spec in _leaf_items(layer):
      dims = _sized(spec.shape, kind, path, lc, config)
      size = math.prod(dims)
      total = total + size
      if kind == "E" and path in ROUTED_EXPERT_LEAVES:
        dims[0] = config.num_experts_per_tok
        size = math.prod(dims)
      active = active + size
  return ParamCount(total=total, active=active, embedding=embedding)


def count_leaves(params) -> int:
  """Number of scalars in a params pytree (arrays or ShapeDtypeStructs)."""
  return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(params))
