"""Parameter specs (shape, dtype, initializer) shared by all blocks."""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Spec:
  shape: tuple[int, ...]
  dtype: str
  init: Callable  # (key, shape) -> fp32 array


def normal(std: float):
  return lambda key, shape: std * jax.random.normal(key, shape, jnp.float32)


def uniform(bound: float):
  return lambda key, shape: jax.random.uniform(key, shape, jnp.float32, -bound, bound)


def ones(key, shape):
  del key
  return jnp.ones(shape, jnp.float32)


def zeros(key, shape):
  del key
  return jnp.zeros(shape, jnp.float32)


def a_log(key, shape):
  """A = -(1..H) per group's heads, as in the Mamba-2 reference init."""
  del key
  n = math.prod(shape)
  return jnp.log(jnp.arange(1, n + 1, dtype=jnp.float32)).reshape(shape)


def dt_bias(dt_min: float, dt_max: float, floor: float):
  """inverse-softplus of dt ~ log-uniform[dt_min, dt_max] (clamped at floor)."""
  def init(key, shape):
    u = jax.random.uniform(key, shape, jnp.float32)
    dt = jnp.maximum(jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)), floor)
    return dt + jnp.log(-jnp.expm1(-dt))
  return init


def materialize(specs, key):
  """Creates arrays for a (nested) dict of Specs with independent keys."""
  leaves, treedef = jax.tree_util.tree_flatten(specs, is_leaf=lambda s: isinstance(s, Spec))
  keys = jax.random.split(key, len(leaves))
  arrays = [s.init(k, s.shape).astype(s.dtype) for s, k in zip(leaves, keys)]
  return jax.tree_util.tree_unflatten(treedef, arrays)


def shapes(specs):
  return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(s.dtype)), specs,
                                is_leaf=lambda s: isinstance(s, Spec))
