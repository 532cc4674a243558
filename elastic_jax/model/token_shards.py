"""Per-token-shard islands: run a function on each shard's own tokens inside a `jax.shard_map`
over the mesh axes the batch is split over (data, fsdp), for the computations GSPMD cannot
split by itself: a sort over the tokens (the MoE's dispatch by expert), which it would gather
whole onto every device, and Pallas / Mosaic kernels, which it cannot partition at all.
Outside a mesh that splits the tokens, the function runs as it is.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
from jax.sharding import PartitionSpec as P


def token_axes(mesh) -> tuple[str, ...]:
  """The axes of `mesh` (larger than 1) that the token batch is split over, by the logical-axis
  rules in context."""
  if mesh.empty:
    return ()
  spec = nn.logical_to_mesh_axes(("batch",))
  axes = spec[0] if len(spec) else None
  axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
  return tuple(a for a in axes if a in mesh.axis_names and mesh.shape[a] > 1)


def run(fn, rows: tuple, whole: tuple, check_vma: bool = True, batch: int | None = None):
  """`fn(*rows, *whole)` -> (out, sums, maxes), per token shard: in the ambient mesh
  (`jax.set_mesh`) when it splits the tokens, a `jax.shard_map` island over those axes where
  each shard gets its own part of the `rows` arrays (leading dim the batch, or batch x length
  flattened: then pass `batch`) and the `whole` arrays entire (FSDP gathers a layer's weights
  anyway); `out` (a pytree of row arrays) comes back split the same way, `sums` / `maxes`
  (pytrees) summed / maxed over the shards. Outside such a mesh, or for a batch that does not
  split evenly over it (3 prompts on 2 shards), `fn` itself. `check_vma=False` for kernels
  that declare outputs without shard_map's varying-axes types (Pallas calls); shard_map then
  sums the cotangents of the `whole` inputs itself.

  Why: the MoE's sort by expert spans the rows it is given, which GSPMD cannot split; given the
  global batch, every device gathered every shard's T*k rows (nano_v3 stage 1 on fsdp:64: 168
  GiB per device against 38 per shard, `elastic_jax.plan`)."""
  mesh = jax.sharding.get_abstract_mesh()
  axes = token_axes(mesh)
  shards = math.prod(mesh.shape[a] for a in axes)
  sizes = [batch] if batch is not None else [x.shape[0] for x in jax.tree.leaves(rows)]
  if not axes or any(n % shards for n in sizes):
    return fn(*rows, *whole)

  def island(*args):
    out, sums, maxes = fn(*args)
    return (out, jax.tree.map(lambda v: jax.lax.psum(v, axes), sums),
            jax.tree.map(lambda v: jax.lax.pmax(v, axes), maxes))

  return jax.shard_map(island, mesh=mesh, in_specs=(P(axes),) * len(rows) + (P(),) * len(whole),
                       out_specs=(P(axes), P(), P()), check_vma=check_vma)(*rows, *whole)
