"""Function-preserving permutation so every budget is a prefix (most important first).

`permute_params` applies one permutation per axis (per layer for per-layer axes) to every leaf
that `axes.AXES` lists for it; Mamba head permutations act within each group.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from elastic_jax.elastic.axes import AXES, uses_for, map_param_leaves
from elastic_jax.config import ModelConfig
from elastic_jax.elastic.importance import Importance


def orderings(scores: Importance) -> dict:
  """Descending-importance permutations: hidden [D], mamba_heads [L,G,H] (within group),
  moe_experts [L,E], moe_ffn [L,F]."""
  desc = lambda s: None if s is None else jnp.argsort(-s, axis=-1, stable=True)
  return {"hidden": desc(scores.hidden), "mamba_heads": desc(scores.mamba_heads),
          "moe_experts": desc(scores.moe_experts), "moe_ffn": desc(scores.moe_ffn)}


def _take(leaf, perm, dim, grouped):
  if not grouped:
    return jnp.take(leaf, perm, axis=dim)
  # perm [G, H] permutes dim `dim` (heads) separately for each index of dim-1 (groups).
  moved = jnp.moveaxis(leaf, (dim - 1, dim), (0, 1))
  out = moved[jnp.arange(perm.shape[0])[:, None], perm]
  return jnp.moveaxis(out, (0, 1), (dim - 1, dim))


def permute_params(params, config: ModelConfig, perms: dict):
  """Applies `perms` ({axis: permutation}, missing/None = identity) to every touched leaf."""
  unknown = sorted(set(perms) - set(AXES))
  if unknown:
    raise ValueError(f"unknown axis names {unknown}; allowed: {list(AXES)}")
  if not config.is_homogeneous:
    raise ValueError("nesting permutes a homogeneous parent, not a per-layer slice")

  def fn(kind, layer, path, leaf):
    for axis, use in uses_for(kind, path):
      perm = perms.get(axis.name)
      if perm is None:
        continue
      if axis.layer_kind is not None:
        perm = perm[config.layers_of(kind).index(layer)]
      leaf = _take(leaf, perm, use.dim, grouped=axis.name == "mamba_heads")
    return leaf

  return map_param_leaves(config, params, fn)


def nest(params, config: ModelConfig, scores: Importance):
  """Params reordered by `scores` so that each budget's sub-model is a prefix."""
  return jax.jit(permute_params, static_argnums=1)(params, config, orderings(scores))
