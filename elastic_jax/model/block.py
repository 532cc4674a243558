"""One residual block: `x + mixer(RMSNorm(x))`, the mixer chosen by the layer's pattern char."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from elastic_jax.config import ModelConfig
from elastic_jax.model.attention import Attention
from elastic_jax.model.mamba2 import Mamba2
from elastic_jax.model.mlp import MLP
from elastic_jax.model.moe import MoE
from elastic_jax.model.norms import RMSNorm, channel_score


ACTIVATION_AXES = ("batch", "length", "activation_embed")


class Block(nn.Module):
  """A residual block of kind `kind` ('M' Mamba-2, '*' attention, 'E' MoE, '-' MLP).

  `config` is the layer's own config (`ModelConfig.layer_config`). Call with the fp32 residual
  stream x [B,T,D] and this layer's masks ({axis name: mask or None} for the axes of its kind;
  "doc_starts" [B,T] bool with `segment_packing`: where packed documents begin); returns
  (x', aux): aux["stats"] holds calibration statistics when `collect` (the pre-mixer hidden
  score plus the mixer's own, and under "amax" each matmul input's largest magnitude),
  aux["state"] the new decode state when `state` is given.
  """
  config: ModelConfig
  kind: str
  moe_impl: str = "dense"
  ssd: str = "chunked"
  collect: bool = False

  @nn.compact
  def __call__(self, x_BTD, layer_masks: dict[str, Any], hidden_mask=None, state=None, pos=None,
               key_valid_BS=None, valid_BT=None):
    c = self.config
    h = RMSNorm(c.hidden_size, c.norm_eps, c.param_dtype, name="norm")(x_BTD, hidden_mask)
    if self.kind == "M":
      out, aux = Mamba2(c, name="mixer")(h, layer_masks.get("mamba_heads"), ssd=self.ssd,
                                         collect=self.collect, state=state, valid_BT=valid_BT,
                                         channel_mask_P=layer_masks.get("mamba_head_dim"),
                                         starts_BT=layer_masks.get("doc_starts"))
    elif self.kind == "*":
      out, aux = Attention(c, name="mixer")(h, layer_masks.get("attention_heads"), state=state,
                                            pos=pos, key_valid_BS=key_valid_BS,
                                            collect=self.collect,
                                            starts_BT=layer_masks.get("doc_starts"))
    elif self.kind == "E":
      out, aux = MoE(c, name="mixer")(h, layer_masks.get("moe_experts"), layer_masks.get("moe_ffn"),
                                      impl=self.moe_impl, collect=self.collect)
    elif self.kind == "-":
      out, aux = MLP(c, name="mixer")(h, collect=self.collect)
    else:
      raise ValueError(f"unknown layer kind {self.kind!r}; allowed: M * E -")
    out = out.astype(jnp.float32)
    if layer_masks.get("depth") is not None:   # 0 drops the layer: the block is the identity
      out = out * layer_masks["depth"]
    x_BTD = x_BTD + (out if hidden_mask is None else out * hidden_mask)
    # The residual stream's layout between blocks; a no-op unless traced under a mesh and
    # logical-axis rules (`parallel.sharding.activation_context`).
    x_BTD = nn.with_logical_constraint(x_BTD, ACTIVATION_AXES)
    stats = None
    if self.collect:
      # "amax": the largest |input| of each matmul (input scales of a quantized export); "in"
      # feeds every projection that reads the normed residual stream.
      mixer = dict(aux["stats"] or {})
      amax = {"in": jnp.max(jnp.abs(h)), **mixer.pop("amax", {})}
      stats = {"hidden": channel_score(h), **mixer, "amax": amax}
    return x_BTD, {"stats": stats, "state": aux["state"]}
