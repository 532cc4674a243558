"""A device mesh from a config string: `data:1,fsdp:-1,tensor:1,expert:1` (-1 fills the rest).

Mesh axes: `data` (pure data parallel), `fsdp` (data parallel with params sharded over it),
`tensor` (channels and heads), `expert` (routed experts). Axis types are set to Auto explicitly
(`jax.make_mesh` defaults to Explicit in newer jax): shardings come from our logical rules and
XLA's propagation, not from sharding-in-types.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

MESH_AXES = ("data", "fsdp", "tensor", "expert")


def parse_mesh(text: str) -> dict[str, int]:
  """'data:1,fsdp:-1' -> {'data': 1, 'fsdp': -1, 'tensor': 1, 'expert': 1} (missing axes are 1)."""
  sizes = dict.fromkeys(MESH_AXES, 1)
  seen = set()
  for item in filter(None, (s.strip() for s in text.split(","))):
    name, sep, value = item.partition(":")
    if not sep or name not in MESH_AXES:
      raise ValueError(f"mesh item {item!r}: expected axis:size with axis in {list(MESH_AXES)}")
    if name in seen:
      raise ValueError(f"mesh axis {name!r} given twice in {text!r}")
    try:
      size = int(value)
    except ValueError:
      raise ValueError(f"mesh item {item!r}: size must be an integer (or -1)") from None
    if size == 0 or size < -1:
      raise ValueError(f"mesh item {item!r}: size must be positive or -1")
    sizes[name] = size
    seen.add(name)
  if list(sizes.values()).count(-1) > 1:
    raise ValueError(f"mesh {text!r}: at most one axis may be -1")
  return sizes


def resolve(sizes: Mapping[str, int], n_devices: int) -> dict[str, int]:
  """Fills the -1 axis so that the product is `n_devices`; refuses sizes that do not fit."""
  fixed = math.prod(s for s in sizes.values() if s != -1)
  out = dict(sizes)
  if -1 in sizes.values():
    if n_devices % fixed:
      raise ValueError(f"mesh {_fmt(sizes)}: the fixed axes ({fixed} devices) do not divide "
                       f"the {n_devices} devices")
    out[next(k for k, v in sizes.items() if v == -1)] = n_devices // fixed
  elif fixed != n_devices:
    raise ValueError(f"mesh {_fmt(sizes)} needs {fixed} devices, there are {n_devices}")
  return out


def make_mesh(spec: str | Mapping[str, int], devices: Sequence | None = None) -> Mesh:
  """The mesh over `devices` (default: all) with axes `MESH_AXES` in that order."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = resolve(parse_mesh(spec) if isinstance(spec, str) else
                  {**dict.fromkeys(MESH_AXES, 1), **spec}, len(devices))
  shape = tuple(sizes[a] for a in MESH_AXES)
  if devices == list(jax.devices()):
    return jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 4)
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES,
              axis_types=(jax.sharding.AxisType.Auto,) * 4)


def describe(mesh: Mesh) -> str:
  return _fmt(dict(mesh.shape))


def _fmt(sizes: Mapping[str, int]) -> str:
  return ",".join(f"{k}:{v}" for k, v in sizes.items())
