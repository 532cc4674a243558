"""Logical axis name -> mesh axes (MaxText style). The model declares logical names on every
parameter (`model.logical_axes`); these rules alone decide how each is laid out on a mesh.

A logical name maps to a mesh axis, a tuple of mesh axes, or None (replicated). Names absent
from the rules are replicated. Configs carry the rules (`config.parallel.rules`) so a run can
change them by flag.
"""
from __future__ import annotations

from typing import Sequence

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]

DEFAULT_RULES: tuple = (
    ("batch", ("data", "fsdp")),   # activations and token batches
    ("vocab", "tensor"),
    ("embed", "fsdp"),             # FSDP: every matrix is cut along the model width
    ("mlp", "tensor"),
    ("expert_mlp", "tensor"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mamba_heads", "tensor"),
    ("experts", "expert"),
    ("layers", None),              # the scanned stack's leading axis
    # Activations between blocks are [batch, length, activation_embed]: split over the batch
    # axes above, replicated along length and width unless a rule says otherwise.
    ("length", None),
    ("activation_embed", None),
)


def mesh_axes_of(axes) -> tuple[str, ...]:
  """A rule's right-hand side (None, one mesh axis or several) as a tuple of mesh axes."""
  return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def validate(rules: Rules, mesh_axes: Sequence[str]) -> tuple:
  """The rules as a tuple of pairs, each mesh axis known; clear errors otherwise."""
  out = []
  for i, rule in enumerate(rules):
    if len(rule) != 2 or not isinstance(rule[0], str):
      raise ValueError(f"sharding rule {i} {rule!r}: expected (logical_name, mesh_axes)")
    name, axes = rule
    unknown = [a for a in mesh_axes_of(axes) if a not in mesh_axes]
    if unknown:
      raise ValueError(f"sharding rule for {name!r}: unknown mesh axes {unknown}; the mesh has "
                       f"{list(mesh_axes)}")
    out.append((name, axes if isinstance(axes, str) or axes is None else tuple(axes)))
  return tuple(out)


def with_batch_axes(rules: Rules, axes: Sequence[str]) -> tuple:
  """`rules` with the "batch" rule mapped to mesh `axes` (e.g. data, fsdp, expert: tokens split
  over `expert` too, so the expert-parallel MoE sends them to their experts' shards)."""
  return tuple((n, tuple(axes)) if n == "batch" else (n, a) for n, a in map(tuple, rules))
