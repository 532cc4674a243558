"""One description per elastic axis: which parameter leaves it touches and along which dim.

Masking, slicing, nesting and counting all read `AXES`, so adding an axis is one edit here (plus
the forward's use of its mask). A leaf is addressed by a `Use`: `kind` is ``"global"`` for
top-level leaves, ``"all"`` for a leaf present in every layer, or a layer pattern char
(``M * E -``); `path` is relative to the params root (global) or to one layer dict.

Counts are user-facing sizes: hidden channels, Mamba heads over the whole layer (the same number
kept in each group), routed experts, expert FFN width, query heads over the whole attention layer
(the same number kept per KV group), channels per Mamba head. `Axis.dim_size` converts a count
to the size of the leaf dimension (Mamba heads are stored as ``[groups, heads_per_group, ...]``;
query heads are stored KV-group-minor, head h reading KV head h % num_kv_heads, so keeping r
heads of every group is a prefix of r * num_kv_heads).
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Mapping, Sequence

import jax.numpy as jnp

from elastic_jax.config import CHOICE_FIELDS, PER_LAYER_FIELDS, ModelConfig


@dataclasses.dataclass(frozen=True)
class Use:
  kind: str
  path: tuple[str, ...]
  dim: int


@dataclasses.dataclass(frozen=True)
class Axis:
  name: str
  layer_kind: str | None  # None: one count for the whole model; else per layer of this kind
  logical: str            # the logical axis name the modules declare on the touched dims
  uses: tuple[Use, ...]

  @property
  def choices_field(self) -> str:
    """ModelConfig field listing the allowed counts."""
    return CHOICE_FIELDS[self.name][0]

  def choices(self, config: ModelConfig) -> tuple[int, ...]:
    return getattr(config, self.choices_field) or (getattr(config, CHOICE_FIELDS[self.name][1]),)

  def full(self, config: ModelConfig) -> int:
    return self.choices(config)[0]

  def full_sizes(self, config: ModelConfig) -> tuple[int, ...]:
    """The model's own size per layer of this axis (differs per layer in sliced models)."""
    per = getattr(config, PER_LAYER_FIELDS[self.name]) if self.layer_kind else ()
    return per or (self.full(config),) * self.num_layers(config)

  def dim_size(self, count, config: ModelConfig):
    """Size of the touched leaf dim for `count` (works on ints and traced floats)."""
    if self.name != "mamba_heads":
      return count
    if isinstance(count, numbers.Integral):
      return int(count) // config.mamba_n_groups
    return count / config.mamba_n_groups

  def num_layers(self, config: ModelConfig) -> int:
    return 1 if self.layer_kind is None else len(config.layers_of(self.layer_kind))


def _u(kind, path, dim):
  return Use(kind, tuple(path.split(".")), dim)


AXES: dict[str, Axis] = {a.name: a for a in (
    Axis("hidden", None, "embed", (
        _u("global", "embed", 1), _u("global", "final_norm.scale", 0), _u("global", "lm_head", 0),
        _u("all", "norm.scale", 0),
        _u("M", "mixer.in_z", 0), _u("M", "mixer.in_x", 0), _u("M", "mixer.in_B", 0),
        _u("M", "mixer.in_C", 0), _u("M", "mixer.in_dt", 0), _u("M", "mixer.out_proj", 3),
        _u("*", "mixer.q", 0), _u("*", "mixer.k", 0), _u("*", "mixer.v", 0), _u("*", "mixer.o", 2),
        _u("E", "mixer.router", 0), _u("E", "mixer.up", 1), _u("E", "mixer.down", 2),
        _u("E", "mixer.shared_up", 0), _u("E", "mixer.shared_down", 1),
        _u("-", "mixer.up", 0), _u("-", "mixer.down", 1),
    )),
    Axis("mamba_heads", "M", "mamba_heads", (
        _u("M", "mixer.in_z", 2), _u("M", "mixer.in_x", 2), _u("M", "mixer.in_dt", 2),
        _u("M", "mixer.conv_x", 2), _u("M", "mixer.conv_x_bias", 1), _u("M", "mixer.dt_bias", 1),
        _u("M", "mixer.A_log", 1), _u("M", "mixer.D", 1), _u("M", "mixer.norm", 1),
        _u("M", "mixer.out_proj", 1),
    )),
    Axis("moe_experts", "E", "experts", (
        _u("E", "mixer.router", 1), _u("E", "mixer.router_bias", 0),
        _u("E", "mixer.up", 0), _u("E", "mixer.down", 0),
    )),
    Axis("moe_ffn", "E", "expert_mlp", (
        _u("E", "mixer.up", 2), _u("E", "mixer.down", 1),
    )),
    # Axes beyond the paper (appended: the router's per-axis keys keep their order).
    Axis("attention_heads", "*", "q_heads", (
        _u("*", "mixer.q", 1), _u("*", "mixer.o", 0),
    )),
    Axis("mamba_head_dim", "M", "mamba_head_dim", (
        _u("M", "mixer.in_z", 3), _u("M", "mixer.in_x", 3), _u("M", "mixer.conv_x", 3),
        _u("M", "mixer.conv_x_bias", 2), _u("M", "mixer.norm", 2), _u("M", "mixer.out_proj", 2),
    )),
    # Depth cuts no leaf dim: it keeps whole layers (`ModelConfig.kept_layers`), so masking,
    # counting and slicing read it through `layer_keep` and `ModelConfig.depth_order`.
    Axis("depth", None, "layers", ()),
)}

# Leaves whose leading dim indexes routed experts: only top-k of them are active per token.
ROUTED_EXPERT_LEAVES = (("mixer", "up"), ("mixer", "down"))


def _err(axis: str, msg: str, allowed) -> ValueError:
  return ValueError(f"axis {axis!r}: {msg}; allowed values: {list(allowed)}")


def normalize_counts(config: ModelConfig, counts: Mapping[str, Any] | None,
                     validate: bool = True) -> dict[str, tuple]:
  """Returns {axis: per-layer tuple of counts} (one entry for global axes), full where omitted.

  Each count may be an int (homogeneous) or a sequence with one value per layer of the axis'
  kind. With `validate`, counts must be ints among the axis' choices; otherwise any numbers
  (e.g. traced expected sizes for the differentiable counter) pass through.
  """
  counts = dict(counts or {})
  unknown = sorted(set(counts) - set(AXES))
  if unknown:
    raise ValueError(f"unknown axis names {unknown}; allowed: {list(AXES)}")
  out = {}
  for name, axis in AXES.items():
    n = axis.num_layers(config)
    if name not in counts:
      out[name] = axis.full_sizes(config)
      continue
    value = counts[name]
    if isinstance(value, (Sequence,)) and not isinstance(value, str):
      value = tuple(value)
      if axis.layer_kind is None:
        raise _err(name, f"takes one count for the whole model, got a sequence {value}",
                   axis.choices(config))
      if len(value) != n:
        raise ValueError(f"axis {name!r}: per-layer counts need {n} values (one per "
                         f"{axis.layer_kind!r} layer), got {len(value)}")
    else:
      value = (value,) * n
    if validate:
      for v, full in zip(value, axis.full_sizes(config)):
        _validate_count(config, axis, v, full)
    out[name] = value
  return out


def _validate_count(config: ModelConfig, axis: Axis, v, full: int) -> None:
  choices = axis.choices(config)
  if isinstance(v, bool) or not isinstance(v, int):
    try:
      import numpy as np
      if np.ndim(v) == 0 and float(v) == int(v):
        v = int(v)
      else:
        raise TypeError
    except (TypeError, ValueError):
      raise _err(axis.name, f"count must be an int, got {v!r}", choices) from None
  if v > full:
    raise _err(axis.name, f"count {v} exceeds the parent's {full}", choices)
  if axis.name == "mamba_heads" and v % config.mamba_n_groups:
    raise _err(axis.name, f"count {v} is not a multiple of mamba_n_groups="
               f"{config.mamba_n_groups}", choices)
  if axis.name == "attention_heads" and v % config.num_kv_heads:
    raise _err(axis.name, f"count {v} is not a multiple of num_kv_heads="
               f"{config.num_kv_heads}", choices)
  if v not in choices:
    raise _err(axis.name, f"count {v} is not one of the axis' choices", choices)


def layer_counts(config: ModelConfig, counts: dict[str, tuple], layer: int) -> dict[str, Any]:
  """The per-axis counts that apply to `layer` (normalized counts in)."""
  kind = config.layer_pattern[layer]
  out = {}
  for name, axis in AXES.items():
    if axis.layer_kind is None:
      out[name] = counts[name][0]
    elif axis.layer_kind == kind:
      out[name] = counts[name][config.layers_of(kind).index(layer)]
  return out


def layer_keep(config: ModelConfig, counts: dict[str, tuple]) -> list:
  """Per layer, 1 where the depth count keeps it, else 0 (normalized counts in). A traced
  (expected) depth n gives clip(n - rank, 0, 1): exact at integers, differentiable between."""
  n = counts["depth"][0]
  if isinstance(n, numbers.Number):
    return [1 if r < n else 0 for r in config.layer_ranks]
  return [jnp.clip(n - r, 0.0, 1.0) for r in config.layer_ranks]


def uses_for(kind_of_leaf: str, path: tuple[str, ...]):
  """Yields (axis, use) for every axis use touching a leaf of a layer of `kind_of_leaf`."""
  for axis in AXES.values():
    for use in axis.uses:
      if use.path == path and (use.kind == kind_of_leaf or
                               (use.kind == "all" and kind_of_leaf != "global")):
        yield axis, use


def map_param_leaves(config: ModelConfig, tree, fn):
  """Rebuilds a (canonical) params-shaped tree with fn(kind, layer, path, leaf) on every leaf.

  `kind` is "global" (layer None) or the layer's pattern char; `path` is a tuple of dict keys
  relative to the root (global) or to the layer dict. Non-dict values are leaves.
  """
  def rec(node, kind, layer, prefix):
    if isinstance(node, dict):
      return {k: rec(v, kind, layer, prefix + (k,)) for k, v in node.items()}
    return fn(kind, layer, prefix, node)

  out = {k: rec(v, "global", None, (k,)) for k, v in tree.items() if k != "layers"}
  out["layers"] = {str(i): rec(tree["layers"][str(i)], kind, i, ())
                   for i, kind in enumerate(config.layer_pattern)}
  return out


def leaf_sizes(config: ModelConfig, counts: dict[str, tuple], kind: str, layer, path, shape):
  """`shape` with each axis-touched dim replaced by that axis' count (normalized counts)."""
  lc = ({a: v[0] for a, v in counts.items() if v} if layer is None
        else layer_counts(config, counts, layer))
  dims = list(shape)
  for axis, use in uses_for(kind, path):
    dims[use.dim] = axis.dim_size(lc[axis.name], config)
  return dims
