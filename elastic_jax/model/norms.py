"""RMSNorm variants, computed in fp32, with optional prefix (budget) masks, and the `RMSNorm` module.

A mask weights the mean square, so a hard k-of-d prefix mask gives exactly the RMSNorm over the
k kept channels, and the output is zero outside the prefix. A mask scaled by a constant (a hard
mask times its router probability) leaves the statistic unchanged and scales the output.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from elastic_jax.model.initializers import ones, param


def rms_norm(x, weight, eps: float, mask=None):
  """RMSNorm over the last dim; `mask` broadcasts against the last dim (or None)."""
  x32 = x.astype(jnp.float32)
  if mask is None:
    ms = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(ms + eps) * weight.astype(jnp.float32)
  else:
    m = mask.astype(jnp.float32)
    ms = jnp.sum(jnp.square(x32) * m, axis=-1, keepdims=True) / jnp.sum(m, axis=-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(ms + eps) * weight.astype(jnp.float32) * m
  return y.astype(x.dtype)


def gated_group_rms_norm(y_BTGHP, z_BTGHP, weight_GHP, eps: float, head_mask_GH=None):
  """Mamba-2 output norm: RMSNorm(y * silu(z)) per group (over that group's heads x head_dim).

  `head_mask_GH` masks heads within each group ([G, H], or [G, H, P] to mask channels too); the
  statistic then covers the kept heads (channels) only.
  """
  g = y_BTGHP.astype(jnp.float32) * jax.nn.silu(z_BTGHP.astype(jnp.float32))
  w = weight_GHP.astype(jnp.float32)
  if head_mask_GH is None:
    ms = jnp.mean(jnp.square(g), axis=(-2, -1), keepdims=True)
    out = g * jax.lax.rsqrt(ms + eps) * w
  else:
    m = head_mask_GH.astype(jnp.float32)
    m = jnp.broadcast_to(m if m.ndim == w.ndim else m[..., None], w.shape)
    ms = (jnp.sum(jnp.square(g) * m, axis=(-2, -1), keepdims=True)
          / jnp.sum(m, axis=(-2, -1), keepdims=True))
    out = g * jax.lax.rsqrt(ms + eps) * w * m
  return out.astype(y_BTGHP.dtype)


def channel_score(a_BT_):
  """Minitron activation statistic per channel: sum_b (mean_t |a[b, t, ...]|)^2 (fp32)."""
  return jnp.sum(jnp.square(jnp.mean(jnp.abs(a_BT_.astype(jnp.float32)), axis=1)), axis=0)


class RMSNorm(nn.Module):
  """RMSNorm over the last dim with a learned `scale` [D] (logical axis "embed")."""
  size: int
  eps: float
  param_dtype: str = "float32"

  @nn.compact
  def __call__(self, x, mask=None):
    scale = param(self, "scale", ones, (self.size,), ("embed",), self.param_dtype)
    return rms_norm(x, scale, self.eps, mask)
