"""Content fingerprints of arrays, recorded at save time and checked at restore, so corrupt
stored bytes never load silently.

A leaf's fingerprint is two uint32 sums over its bit patterns (each element's bits as an
unsigned int): one weighted by position (i mod 65521 + 1), one by a multiplicative hash of the
position. Sums of uint32 wrap, so they are exact and independent of reduction order, sharding
or device count; a changed element changes them unless the change is an exact multiple of
2^32 on both, which flipped bytes are not in practice. Computed on device, jitted.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}


def _leaf(x):
  x = jnp.asarray(x)
  size = x.dtype.itemsize
  if size == 8:   # 64-bit: two uint32 words per element
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  else:
    bits = jax.lax.bitcast_convert_type(x, _UINT[size]).astype(jnp.uint32)
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
