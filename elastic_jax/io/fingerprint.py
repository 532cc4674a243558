"""Content fingerprints of arrays, recorded at save time and checked at restore, so corrupt
stored bytes never load silently.

A leaf's fingerprint is two uint32 sums over its bit patterns (each element's bits as an
unsigned int): one weighted by position (i mod 65521 + 1), one by a multiplicative hash of the
position. Sums of uint32 wrap, so they are exact and independent of reduction order, sharding
or device count; a changed element changes them unless the change is an exact multiple of
2^32 on both, which flipped bytes are not in practice. Computed on device, jitted.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}


def _leaf(x):
  bits = _bits(x, jnp)
  # The flat position mod 2^32, built from per-dim iotas (a leaf may hold > 2^32 elements;
  # no flat copy, so a sharded leaf stays sharded).
  i = jnp.zeros(bits.shape, jnp.uint32)
  for d, n in enumerate(bits.shape):
    i = i * jnp.uint32(n % 2 ** 32) + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, d)
  a = jnp.sum(bits * (i % jnp.uint32(65521) + jnp.uint32(1)), dtype=jnp.uint32)
  b = jnp.sum(bits * (i * jnp.uint32(2654435761) + jnp.uint32(97)), dtype=jnp.uint32)
  return jnp.stack([a, b])


_fingerprints = jax.jit(lambda tree: jax.tree.map(_leaf, tree))


def fingerprints(tree) -> dict[str, list[int]]:
  """{leaf path (keystr): [a, b]} of every array in `tree`."""
  flat, _ = jax.tree_util.tree_flatten_with_path(_fingerprints(tree))
  return {jax.tree_util.keystr(p): [int(v) for v in jax.device_get(x)] for p, x in flat}


def mismatches(tree, recorded: dict[str, list[int]]) -> list[str]:
  """Leaf paths of `tree` whose fingerprint differs from `recorded` (absent ones are skipped)."""
  got = fingerprints(tree)
  return sorted(k for k, v in got.items() if k in recorded and list(recorded[k]) != v)


# Prefix boxes: a sub-model restore reads the box [0:n_0, 0:n_1, ...] of each stored leaf. Box
# fingerprints weight each element by its coordinates in the stored leaf (not its flat index in
# the box), so every box's sums are read off one multi-dimensional prefix sum of the leaf.
_COORD = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1, 0xD3A2646C)


def _bits(x, xp):
  """Each element's bit pattern as uint32 (64-bit: two words, a trailing dim of 2)."""
  if xp is np:
    x = np.asarray(x)
    size = x.dtype.itemsize
    return (x.view(np.uint32).reshape(x.shape + (2,)) if size == 8 else
            x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[size]).astype(np.uint32))
  x = jnp.asarray(x)
  size = x.dtype.itemsize
  if size == 8:   # 64-bit: two uint32 words per element
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jax.lax.bitcast_convert_type(x, _UINT[size]).astype(jnp.uint32)


def _weighted(x, xp):
  """(bits * w_a, bits * w_b) as uint32 arrays (`xp`: numpy or jax.numpy, the same modular
  values), w from each element's coordinates."""
  bits = _bits(x, xp)
  if bits.ndim > len(_COORD):
    raise ValueError(f"box fingerprints take up to {len(_COORD)} dims, got {bits.ndim}")
  u = lambda v: xp.asarray(v, dtype=xp.uint32)
  i = xp.zeros(bits.shape, xp.uint32)
  for d in range(bits.ndim):
    shape = [1] * bits.ndim
    shape[d] = bits.shape[d]
    i = i + xp.arange(bits.shape[d], dtype=xp.uint32).reshape(shape) * u(_COORD[d])
  return bits * (i % u(65521) + u(1)), bits * (i * u(2654435761) + u(97))


def _box_corners(x, shapes, xp):
  a, b = _weighted(x, xp)
  extra = a.shape[np.ndim(x):]     # the 64-bit word dim is always read whole
  for d in range(a.ndim):
    a = xp.cumsum(a, axis=d, dtype=xp.uint32)
    b = xp.cumsum(b, axis=d, dtype=xp.uint32)
  corners = [tuple(n - 1 for n in s) + tuple(n - 1 for n in extra) for s in shapes]
  return xp.stack([xp.stack([a[c], b[c]]) for c in corners])


def _box_total(x, xp):
  a, b = _weighted(x, xp)
  return xp.stack([xp.sum(a, dtype=xp.uint32), xp.sum(b, dtype=xp.uint32)])


_box_corners_jit = jax.jit(functools.partial(_box_corners, xp=jnp), static_argnums=1)
_box_total_jit = jax.jit(functools.partial(_box_total, xp=jnp))
# Arrays up to this many elements, held whole by this process, are summed on the host in numpy
# (no compilation per leaf shape); larger or sharded ones on device.
HOST_MAX = 1 << 22


def _fetch(y) -> np.ndarray:
  """A small device result on the host, also when its shards live on several processes."""
  if getattr(y, "is_fully_addressable", True) or y.is_fully_replicated:
    return np.asarray(jax.device_get(y))
  return np.asarray(multihost_utils.process_allgather(y, tiled=True))


def _on_host(x) -> bool:
  return np.size(x) <= HOST_MAX and getattr(x, "is_fully_addressable", True)


def box_fingerprints(arrays: dict, boxes: dict) -> dict[str, dict[str, list[int]]]:
  """{name: {"n0,n1,...": [a, b]}} of each prefix box `boxes[name]` of `arrays[name]`, read off
  one prefix-sum pass per array."""
  out = {}
  for k, ss in boxes.items():
    shapes = tuple(tuple(int(n) for n in s) for s in ss)
    x = arrays[k]
    got = _box_corners(x, shapes, np) if _on_host(x) else _fetch(_box_corners_jit(x, shapes))
    out[k] = {",".join(map(str, s)): [int(v) for v in got[j]] for j, s in enumerate(shapes)}
  return out


def box_fingerprint(x) -> list[int]:
  """[a, b] of the whole of `x`, read as the prefix box of its own shape (compare with the
  `box_fingerprints` entry of the stored leaf it was restored from)."""
  got = _box_total(x, np) if _on_host(x) else _fetch(_box_total_jit(x))
  return [int(v) for v in got]
