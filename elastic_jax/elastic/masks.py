"""Budget masks from per-axis counts: `from_counts(config, counts) -> BudgetMasks`.

`BudgetMasks` itself (the pytree the model takes) lives in `elastic_jax.model.budget_masks`.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp

from elastic_jax.elastic.axes import AXES, normalize_counts
from elastic_jax.config import ModelConfig
from elastic_jax.model.budget_masks import BudgetMasks  # noqa: F401  (re-exported)


def prefix_mask(count, size: int, dtype=jnp.float32):
  """[size] mask with ones on the first `count` entries."""
  return (jnp.arange(size) < count).astype(dtype)


def axis_mask_shape(config: ModelConfig, name: str) -> tuple[int, ...]:
  """Shape of the `BudgetMasks` field for axis `name`."""
  axis = AXES[name]
  per = {"hidden": (config.hidden_size,),
         "mamba_heads": (config.mamba_n_groups, config.mamba_heads_per_group),
         "moe_experts": (config.n_routed_experts,),
         "moe_ffn": (config.moe_intermediate_size,),
         "attention_heads": (config.num_attention_heads,),
         "mamba_head_dim": (config.mamba_head_dim,),
         "depth": (config.num_layers,)}[name]
  return per if axis.layer_kind is None else (axis.num_layers(config),) + per


def arrange(config: ModelConfig, name: str, m):
  """Prefix masks [..., size] of axis `name` in the layout of its `BudgetMasks` field: Mamba
  heads repeated for every group; depth by layer, layer l kept when its rank is in the prefix."""
  if name == "mamba_heads":
    return jnp.broadcast_to(m[..., None, :], m.shape[:-1] + (config.mamba_n_groups, m.shape[-1]))
  if name == "depth":
    return m[..., jnp.asarray(config.layer_ranks)]
  return m


def from_counts(config: ModelConfig, counts: Mapping[str, Any] | None) -> BudgetMasks:
  """Hard prefix masks for per-axis counts (int or one per layer); validates the counts."""
  if not config.is_homogeneous:
    raise ValueError("budget masks apply to a homogeneous parent; this config has per-layer "
                     "sizes (a sliced model): slice it further with slicing.slice_params")
  norm = normalize_counts(config, counts)
  fields = {}
  for name, axis in AXES.items():
    shape = axis_mask_shape(config, name)
    size = shape[-1]
    rows = [prefix_mask(axis.dim_size(v, config), size) for v in norm[name]]
    m = jnp.stack(rows) if axis.layer_kind is not None else rows[0]
    fields[name] = arrange(config, name, m)
  return BudgetMasks(**fields)
