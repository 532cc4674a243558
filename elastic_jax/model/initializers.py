"""Parameter initializers (Flax signature `init(key, shape, dtype)`, drawn in fp32) and `param`,
the one way modules declare a parameter: with its logical axis names."""
from __future__ import annotations

import math
from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

Initializer = Callable[..., jax.Array]


def normal(std: float) -> Initializer:
  return lambda key, shape, dtype=jnp.float32: (std * jax.random.normal(key, shape)).astype(dtype)


def uniform(bound: float) -> Initializer:
  return lambda key, shape, dtype=jnp.float32: jax.random.uniform(
      key, shape, jnp.float32, -bound, bound).astype(dtype)


def ones(key, shape, dtype=jnp.float32):
  del key
  return jnp.ones(shape, dtype)


def zeros(key, shape, dtype=jnp.float32):
  del key
  return jnp.zeros(shape, dtype)


def a_log(key, shape, dtype=jnp.float32):
  """A = -(1..H) over the layer's heads (groups x heads per group), as in the Mamba-2 init."""
  del key
  n = math.prod(shape)
  return jnp.log(jnp.arange(1, n + 1, dtype=jnp.float32)).reshape(shape).astype(dtype)


def dt_bias(dt_min: float, dt_max: float, floor: float) -> Initializer:
  """inverse-softplus of dt ~ log-uniform[dt_min, dt_max] (clamped at floor)."""
  def init(key, shape, dtype=jnp.float32):
    u = jax.random.uniform(key, shape, jnp.float32)
    dt = jnp.maximum(jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)), floor)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)
  return init


def param(module: nn.Module, name: str, init: Initializer, shape: Sequence[int],
          names: Sequence[str], dtype) -> jax.Array:
  """Declares `module`'s parameter `name` with one logical axis name per dim (for sharding)."""
  if len(names) != len(shape):
    raise ValueError(f"{name}: {len(names)} logical names {tuple(names)} for shape {tuple(shape)}")
  return module.param(name, nn.with_logical_partitioning(init, tuple(names)), tuple(shape),
                      jnp.dtype(dtype))


def declare(module: nn.Module, table: dict) -> dict:
  """Declares every parameter of `table` ({name: (shape, logical names, init, dtype)}) on
  `module`; returns {name: array}."""
  return {name: param(module, name, fn, shape, names, dtype)
          for name, (shape, names, fn, dtype) in table.items()}
