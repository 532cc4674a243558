"""Function-preserving permutation so every budget is a prefix (most important first).

`permute_params` applies one permutation per axis (per layer for per-layer axes) to every leaf
that `axes.AXES` lists for it; Mamba head and attention query head permutations act within each
group (Mamba heads stored [G, H]; query heads stored [rep, Hkv] flattened, see attention.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from elastic_jax.elastic.axes import AXES, uses_for, map_param_leaves
from elastic_jax.config import ModelConfig
from elastic_jax.elastic.importance import Importance


def orderings(scores: Importance) -> dict:
  """Descending-importance permutations: hidden [D], mamba_heads [L,G,H] (within group),
  moe_experts [L,E], moe_ffn [L,F], attention_heads [L,Hkv,rep] (within KV group),
  mamba_head_dim [L,P] (the same channel order in every head of a layer)."""
  desc = lambda s: None if s is None else jnp.argsort(-s, axis=-1, stable=True)
  return {"hidden": desc(scores.hidden), "mamba_heads": desc(scores.mamba_heads),
          "moe_experts": desc(scores.moe_experts), "moe_ffn": desc(scores.moe_ffn),
          "attention_heads": desc(scores.attention_heads),
          "mamba_head_dim": desc(scores.mamba_channels)}


def _within_groups(leaf, perm, group_dim, head_dim):
  """perm [G, H] permutes dim `head_dim` separately for each index of dim `group_dim`."""
  moved = jnp.moveaxis(leaf, (group_dim, head_dim), (0, 1))
  out = moved[jnp.arange(perm.shape[0])[:, None], perm]
  return jnp.moveaxis(out, (0, 1), (group_dim, head_dim))


def _take(leaf, perm, dim, grouping):
  if grouping is None:
    return jnp.take(leaf, perm, axis=dim)
  if grouping == "grouped":   # heads at `dim`, their groups at dim - 1
    return _within_groups(leaf, perm, dim - 1, dim)
  # "interleaved": a flat dim stored as [H, G] (KV-group-minor), perm [G, H].
  G, H = perm.shape
  split = leaf.reshape(leaf.shape[:dim] + (H, G) + leaf.shape[dim + 1:])
  return _within_groups(split, perm, dim + 1, dim).reshape(leaf.shape)


# How each axis' permutation acts on its leaf dim (None: a plain permutation of that dim).
_GROUPING = {"mamba_heads": "grouped", "attention_heads": "interleaved"}


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
      leaf = _take(leaf, perm, use.dim, _GROUPING.get(axis.name))
    return leaf

  return map_param_leaves(config, params, fn)


def nested_config(config: ModelConfig, scores: Importance) -> ModelConfig:
  """The config of the nested parent: with elastic depth, `depth_order` ranks the layers by
  `scores.depth` (most important first); layers are never moved, so this is depth's nesting."""
  if len(config.depth_choices) < 2 or scores.depth is None:
    return config
  order = np.argsort(-np.asarray(scores.depth), kind="stable")
  return config.replace(depth_order=tuple(int(i) for i in order))


def nest(params, config: ModelConfig, scores: Importance):
  """Params reordered by `scores` so that each budget's sub-model is a prefix. Axes with one
  choice (the full size) keep their order: nothing to nest, and the parent stays bit-identical."""
  perms = {name: perm for name, perm in orderings(scores).items()
           if len(AXES[name].choices(config)) > 1}
  return jax.jit(permute_params, static_argnums=1)(params, config, perms)
