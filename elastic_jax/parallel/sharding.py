"""Shardings from logical axis names: params (canonical or scanned layout), optimizer state (as
its params), token batches (over data and fsdp), and replicated small state (router, metrics).

A logical dim maps to the mesh axes its rule names, keeping only those whose size divides the
dim (a dim of 96 on an fsdp axis of 64 stays replicated) and never one mesh axis twice in a
leaf. `replicated_leaves` lists the large leaves that ended up fully replicated anyway, so tests
and the plan can refuse silent replication.
"""
from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from elastic_jax.config import ModelConfig
from elastic_jax.model import model as model_lib
from elastic_jax.parallel.rules import DEFAULT_RULES, Rules, mesh_axes_of, validate


def spec_for(shape, logical, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> P:
  """The PartitionSpec of one array of `shape` whose dims carry the names in `logical`."""
  if len(logical) != len(shape):
    raise ValueError(f"logical names {tuple(logical)} do not match shape {tuple(shape)}")
  wanted = nn.logical_to_mesh_axes(tuple(logical), validate(rules, mesh.axis_names))
  used, out = set(), []
  for dim, axes in zip(shape, wanted):
    keep, size = [], 1
    for a in mesh_axes_of(axes):
      n = mesh.shape[a]
      if n > 1 and a not in used and dim % (size * n) == 0:
        keep.append(a)
        size *= n
    used.update(keep)
    out.append(None if not keep else keep[0] if len(keep) == 1 else tuple(keep))
  return P(*out)


def tree_shardings(shapes, logical, mesh: Mesh, rules: Rules = DEFAULT_RULES):
  """NamedShardings for a tree of arrays (or ShapeDtypeStructs) and a matching tree of names."""
  is_spec = lambda x: isinstance(x, P)
  return jax.tree.map(lambda names, x: NamedSharding(mesh, spec_for(x.shape, names, mesh, rules)),
                      logical, shapes, is_leaf=is_spec)


def param_shardings(params, config: ModelConfig, mesh: Mesh, rules: Rules = DEFAULT_RULES):
  """Shardings of model params in either layout (canonical or scanned, see `model.layouts`)."""
  logical = (model_lib.scanned_logical_axes(config) if model_lib.is_scanned(params)
             else model_lib.logical_axes(config))
  return tree_shardings(params, logical, mesh, rules)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def replicate_tree(tree, mesh: Mesh):
  return jax.tree.map(lambda _: replicated(mesh), tree)


def batch_sharding(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> NamedSharding:
  """Token batches [B, T] split over the mesh axes the "batch" rule names."""
  return NamedSharding(mesh, P(_batch_axes(mesh, rules) or None))


def _batch_axes(mesh: Mesh, rules: Rules) -> tuple:
  wanted = nn.logical_to_mesh_axes(("batch",), validate(rules, mesh.axis_names))[0]
  return tuple(a for a in mesh_axes_of(wanted) if mesh.shape[a] > 1)


def shard_batch(x, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> jax.Array:
  """Places a host batch on the mesh, split over its batch axes; the batch must divide. In a
  multi-process run `x` is this process's part: the global batch is every process's rows in
  process order."""
  s = batch_sharding(mesh, rules)
  axes = mesh_axes_of(s.spec[0])
  n = int(np.prod([mesh.shape[a] for a in axes]))
  rows = np.shape(x)[0] * jax.process_count()
  if rows % n:
    raise ValueError(f"batch of {rows} rows does not split over {n} devices "
                     f"(mesh axes {axes}); use a multiple of {n}")
  if jax.process_count() > 1:
    return jax.make_array_from_process_local_data(s, np.asarray(x))
  return jax.device_put(x, s)


def opt_state_shardings(opt_state, params, params_shardings, mesh: Mesh):
  """Shardings for `opt_state` (arrays or ShapeDtypeStructs): a leaf whose tree path ends with
  a param's path and has its shape (AdamW moments, also inside `optax.multi_transform`) is
  sharded as that param; the rest (counts, scalars) is replicated."""
  by_path = {tuple(p): (x.shape, s) for (p, x), s in zip(
      jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(params_shardings))}

  def pick(path, x):
    for k in range(len(path)):
      shape, sharding = by_path.get(tuple(path[k:]), (None, None))
      if sharding is not None and shape == x.shape:
        return sharding
    return replicated(mesh)
  return jax.tree_util.tree_map_with_path(pick, opt_state)


@contextlib.contextmanager
def activation_context(mesh: Mesh | None, rules: Rules = DEFAULT_RULES):
  """Trace under this to apply the model's activation constraints (block boundaries) on `mesh`
  with `rules`; without a mesh, nothing is constrained."""
  if mesh is None:
    yield
    return
  with jax.set_mesh(mesh), nn.logical_axis_rules(validate(rules, mesh.axis_names)):
    yield


# Logical names of the decode cache's leaves (`model.init_cache`), by leaf name: streams over
# the batch axes, attention KV heads and Mamba heads over tensor, like the params they meet.
CACHE_AXES = {"k": ("batch", "length", "kv_heads", None),
              "v": ("batch", "length", "kv_heads", None),
              "conv_x": ("batch", None, None, "mamba_heads", None),
              "conv_B": ("batch", None, None, None), "conv_C": ("batch", None, None, None),
              "ssm": ("batch", None, "mamba_heads", None, None),
              "key_valid": ("batch", None), "pos": ()}


def cache_shardings(cache, mesh: Mesh, rules: Rules = DEFAULT_RULES):
  """NamedShardings of a decode cache (arrays or ShapeDtypeStructs) on `mesh` (`CACHE_AXES`;
  a dim its axes do not divide stays replicated)."""
  def one(path, x):
    name = path[-1].key if isinstance(path[-1], jax.tree_util.DictKey) else None
    if name not in CACHE_AXES:
      raise ValueError(f"decode cache leaf {jax.tree_util.keystr(path)} has no logical axes")
    return NamedSharding(mesh, spec_for(x.shape, CACHE_AXES[name], mesh, rules))
  return jax.tree_util.tree_map_with_path(one, cache)


def replicated_leaves(tree, min_size: int = 1024) -> list[str]:
  """Paths of leaves with at least `min_size` elements that are not split across devices."""
  out = []
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    sharding = getattr(x, "sharding", None)
    if np.size(x) >= min_size and (sharding is None or
                                   sharding.shard_shape(x.shape) == tuple(x.shape)):
      out.append(jax.tree_util.keystr(path))
  return out


def place_by_path(shardings):
  """place(path, array) for streaming loaders (`io.hf.params_from_hf`): the array put on the
  sharding found at `path` (a `jax.tree_util.keystr`) of the `shardings` tree."""
  by_path = {jax.tree_util.keystr(p): s
             for p, s in jax.tree_util.tree_flatten_with_path(shardings)[0]}
  return lambda path, x: jax.device_put(x, by_path[path])
