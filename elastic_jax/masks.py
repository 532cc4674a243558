"""`BudgetMasks`: per-axis prefix masks, a plain pytree consumed by `model.apply`.

Masks are data, not structure: one compiled forward serves every budget. Per-layer axes carry a
leading layer dim (the layers of that axis' kind, in order). A field left as None means full size.
Hard masks are 0/1 prefixes; the router (training) produces soft staircase or probability-scaled
masks of the same shapes.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp
from flax import struct

from elastic_jax.axes import AXES, normalize_counts
from elastic_jax.config import ModelConfig


@struct.dataclass
class BudgetMasks:
  hidden: Any = None        # [D]
  mamba_heads: Any = None   # [L_mamba, G, H_per_group]
  moe_experts: Any = None   # [L_moe, E]
  moe_ffn: Any = None       # [L_moe, F]

  def layer(self, name: str, j: int):
    """Mask of axis `name` for the j-th layer of its kind (None if unmasked)."""
    m = getattr(self, name)
    return None if m is None else m[j]


def prefix_mask(count, size: int, dtype=jnp.float32):
  """[size] mask with ones on the first `count` entries."""
  return (jnp.arange(size) < count).astype(dtype)


def axis_mask_shape(config: ModelConfig, name: str) -> tuple[int, ...]:
  """Shape of the `BudgetMasks` field for axis `name`."""
  axis = AXES[name]
  per = {"hidden": (config.hidden_size,),
         "mamba_heads": (config.mamba_n_groups, config.mamba_heads_per_group),
         "moe_experts": (config.n_routed_experts,),
         "moe_ffn": (config.moe_intermediate_size,)}[name]
  return per if axis.layer_kind is None else (axis.num_layers(config),) + per


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
    if name == "mamba_heads":
      m = jnp.broadcast_to(m[:, None, :], shape)
    fields[name] = m
  return BudgetMasks(**fields)
