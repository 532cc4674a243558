"""`BudgetMasks`: per-axis prefix masks, a plain pytree the model's forward takes as input.

Masks are data, not structure: one compiled forward serves every budget. Per-layer axes carry a
leading layer dim (the layers of that axis' kind, in order). A field left as None means full size.
Hard masks are 0/1 prefixes; the router (training) produces soft staircase or probability-scaled
masks of the same shapes. Built from counts by `elastic_jax.elastic.masks.from_counts`.
"""
from __future__ import annotations

from typing import Any

from flax import struct


@struct.dataclass
class BudgetMasks:
  hidden: Any = None        # [D]
  mamba_heads: Any = None   # [L_mamba, G, H_per_group]
  moe_experts: Any = None   # [L_moe, E]
  moe_ffn: Any = None       # [L_moe, F]
  attention_heads: Any = None  # [L_attn, Hq] (query heads KV-group-minor, see attention.py)
  mamba_head_dim: Any = None   # [L_mamba, P]
  depth: Any = None            # [L]: each layer's residual branch scaled (0 = layer dropped)

  def layer(self, name: str, j: int):
    """Mask of axis `name` for the j-th layer of its kind (None if unmasked)."""
    m = getattr(self, name)
    return None if m is None else m[j]
