"""Canonical (per-layer) <-> scanned (stacked per unit slot) parameter layouts.

The canonical layout keeps one dict per layer under params["layers"][str(i)]; the scanned one
(what `ElasticLM(stack="scan")` reads) stacks each slot of the plan's unit over its repeats, with
zeros where an optional slot is absent (see `stack_plan`). Both are plain nested dicts; the
conversion is a stack / unstack, done inside the jitted forward when canonical params are used.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from elastic_jax.model.stack_plan import StackPlan


def to_scanned(params: dict, plan: StackPlan) -> dict:
  """Canonical params -> the scanned layout of `plan`."""
  layers = params["layers"]
  out = {str(i): layers[str(i)] for i in plan.head + plan.tail}
  units = {}
  for s, col in enumerate(zip(*plan.units)):
    template = layers[str(next(i for i in col if i is not None))]
    rows = [layers[str(i)] if i is not None else jax.tree.map(jnp.zeros_like, template)
            for i in col]
    units[str(s)] = jax.tree.map(lambda *a: jnp.stack(a), *rows)
  out["units"] = units
  return {**params, "layers": out}


def from_scanned(params: dict, plan: StackPlan) -> dict:
  """The scanned layout of `plan` -> canonical params (padding of absent slots dropped)."""
  layers = params["layers"]
  out = {str(i): layers[str(i)] for i in plan.head + plan.tail}
  for s, col in enumerate(zip(*plan.units)):
    for u, i in enumerate(col):
      if i is not None:
        out[str(i)] = jax.tree.map(lambda a, u=u: a[u], layers["units"][str(s)])
  return {**params, "layers": {str(i): out[str(i)] for i in range(len(plan.pattern))}}


def from_legacy(params: dict) -> dict:
  """Params of elastic-jax 0.1 (layers as a list, norms as bare [D] leaves) -> canonical."""
  if not isinstance(params.get("layers"), (list, tuple)):
    raise ValueError("not a legacy params tree: params['layers'] is not a list")
  scale = lambda w: w if isinstance(w, dict) else {"scale": w}
  return {**params, "final_norm": scale(params["final_norm"]),
          "layers": {str(i): {**layer, "norm": scale(layer["norm"])}
                     for i, layer in enumerate(params["layers"])}}


def to_legacy(params: dict) -> dict:
  """Canonical params -> the elastic-jax 0.1 layout (to read checkpoints written by 0.1)."""
  return {**params, "final_norm": params["final_norm"]["scale"],
          "layers": [{**params["layers"][str(i)], "norm": params["layers"][str(i)]["norm"]["scale"]}
                     for i in range(len(params["layers"]))]}
