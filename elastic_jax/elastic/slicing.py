"""Prefix-slice a (nested) parent into a standalone sub-model: `slice_params(params, config, counts)`.

Every leaf an axis touches (per `axes.AXES`) keeps the first `count` entries of that dim, so the
small model computes exactly what the masked parent computes. Per-layer counts give a
heterogeneous small config (`ModelConfig.*_per_layer`). Slicing is jitted once per counts.
"""
from __future__ import annotations

import functools
from typing import Any, Mapping

import jax

from elastic_jax.elastic.axes import AXES, leaf_sizes, map_param_leaves, normalize_counts
from elastic_jax.config import CHOICE_FIELDS, PER_LAYER_FIELDS, ModelConfig


def _freeze(norm: dict[str, tuple]) -> tuple:
  return tuple(sorted((k, tuple(int(x) for x in v)) for k, v in norm.items()))


def sliced_config(config: ModelConfig, counts: Mapping[str, Any] | None) -> ModelConfig:
  """The sub-model's own config: sizes from `counts`, choices capped at the new sizes; with a
  depth count, only the kept layers (`ModelConfig.kept_layers`), their ranks kept in order."""
  norm = normalize_counts(config, counts)
  kept = config.kept_layers(norm["depth"][0])
  kw = {}
  for name, axis in AXES.items():
    values = norm[name]
    if axis.layer_kind is not None:   # the kept layers' own counts
      of_kind = config.layers_of(axis.layer_kind)
      values = tuple(v for i, v in zip(of_kind, values) if i in kept)
    top = max(values) if values else axis.full(config)
    if name != "depth":
      kw[CHOICE_FIELDS[name][1]] = top
    kw[axis.choices_field] = tuple(c for c in axis.choices(config) if c <= top) or (top,)
    if name in PER_LAYER_FIELDS:
      kw[PER_LAYER_FIELDS[name]] = values if len(set(values)) > 1 else ()
  if len(kept) < config.num_layers:
    ranks = [config.layer_ranks[i] for i in kept]
    order = tuple(sorted(range(len(kept)), key=lambda j: ranks[j]))
    kw.update(layer_pattern="".join(config.layer_pattern[i] for i in kept),
              depth_order=() if order == tuple(range(len(kept))) else order)
  return config.replace(**kw)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _slice(params, config: ModelConfig, frozen_counts: tuple):
  norm = dict(frozen_counts)

  def cut(kind, layer, path, leaf):
    dims = leaf_sizes(config, norm, kind, layer, path, leaf.shape)
    if list(dims) == list(leaf.shape):
      return leaf
    return leaf[tuple(slice(0, d) for d in dims)]

  out = map_param_leaves(config, params, cut)
  kept = config.kept_layers(norm["depth"][0])
  out["layers"] = {str(j): out["layers"][str(i)] for j, i in enumerate(kept)}
  return out


def slice_params(params, config: ModelConfig, counts: Mapping[str, Any] | None):
  """(small_params, small_config) for per-axis `counts` (int or one value per layer).

  Raises ValueError naming the axis and its allowed values for bad counts.
  """
  norm = normalize_counts(config, counts)
  return _slice(params, config, _freeze(norm)), sliced_config(config, counts)
