"""Where each routed expert sits in the params' expert axis, so expert parallelism stays
balanced at every budget.

Budgets keep a prefix of the (importance-sorted) experts. With contiguous placement an
expert-parallel shard holds a contiguous block, so a budget that keeps 64 of 128 experts leaves
half the shards idle. The balanced order puts logical expert e on shard (e mod S) for every shard
count S that `balanced_order` serves: written in mixed radix over E's prime factors (ascending),
the expert's digits are reversed, so the most significant digits of its physical slot (which
pick the shard of a contiguous block split) are the least significant digits of e, i.e. e mod S
for S = r_1 r_2 ... r_j. For E a power of two that is every power-of-two S; any prefix of k
experts then puts floor(k/S) or ceil(k/S) of them on each shard. One order per E, independent
of the mesh: params trained in it resume on any mesh.
"""
from __future__ import annotations

import numpy as np


def _prime_factors(n: int) -> list[int]:
  out, p = [], 2
  while p * p <= n:
    while n % p == 0:
      out.append(p)
      n //= p
    p += 1
  return out + ([n] if n > 1 else [])


def balanced_order(num_experts: int) -> np.ndarray:
  """[E] physical slot -> logical expert: mixed-radix digit reversal over E's ascending prime
  factors (see the module docstring)."""
  radices = _prime_factors(num_experts) or [1]
  # Logical e in mixed radix, least significant digit (radix r_1) last; reversing the axes
  # makes that digit the physical slot's most significant one.
  digits = np.arange(num_experts).reshape(radices[::-1])
  return digits.transpose(tuple(range(len(radices)))[::-1]).reshape(-1)


def balanced_shard_counts(num_experts: int) -> list[int]:
  """The shard counts S the balanced order serves: the products r_1 ... r_j of E's ascending
  prime factors (every power of two dividing E when E is a power of two)."""
  out, s = [1], 1
  for r in _prime_factors(num_experts):
    s *= r
    out.append(s)
  return out


def order(num_experts: int, placement: str) -> np.ndarray:
  """[E] physical slot -> logical expert of `placement` ("contiguous": the identity)."""
  if placement == "contiguous":
    return np.arange(num_experts)
  if placement == "balanced":
    return balanced_order(num_experts)
  raise ValueError(f"expert placement must be 'contiguous' or 'balanced', got {placement!r}")


def shard_loads(counts_E, shards: int, placement: str) -> np.ndarray:
  """[S] summed per-expert `counts_E` (logical order: tokens routed to each expert) on each of
  `shards` contiguous blocks of the physical expert axis under `placement`."""
  counts_E = np.asarray(counts_E)
  E = counts_E.shape[-1]
  if E % shards:
    raise ValueError(f"{shards} expert shards do not divide {E} experts")
  return counts_E[..., order(E, placement)].reshape(*counts_E.shape[:-1], shards, E // shards).sum(-1)
