"""Dense squared-ReLU MLP ('-' layers): down(relu(up(x))^2). Leaves: up [D,F], down [F,D]."""
from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp

from elastic_jax.config import ModelConfig
from elastic_jax.model import initializers as init
from elastic_jax.model.moe import relu2


def mlp(p: dict, x_BTD, c: ModelConfig, collect: bool = False):
  """MLP forward on params `p`: (out [B,T,D], aux). aux["stats"]: with `collect`, {"amax":
  {"down": the largest |input| of the down projection}}, else None."""
  dt_ = jnp.dtype(c.compute_dtype)
  act = relu2(x_BTD.astype(dt_) @ p["up"].astype(dt_))
  stats = {"amax": {"down": jnp.max(jnp.abs(act.astype(jnp.float32)))}} if collect else None
  return act @ p["down"].astype(dt_), {"stats": stats, "state": None}


class MLP(nn.Module):
  """The dense MLP mixer as a module."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x_BTD, collect: bool = False):
    c = self.config
    D, F = c.hidden_size, c.intermediate_size
    p = init.declare(self, {
        "up": ((D, F), ("embed", "mlp"), init.normal(c.initializer_range), c.param_dtype),
        "down": ((F, D), ("mlp", "embed"),
                 init.normal(c.initializer_range / math.sqrt(c.num_layers)), c.param_dtype)})
    return mlp(p, x_BTD, c, collect)
