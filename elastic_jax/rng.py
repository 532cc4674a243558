"""Named random streams: one root seed, split by name, so no two uses share randomness.

Each use draws from its own stream: `key(seed, "gumbel")` for JAX, `seed_for(seed, "corpus")`
for host-side RNGs (numpy, grain, reasoning_gym). A stream's id is the CRC-32 of its name, so a
stream never changes when another is added. Within a stream, per-step or per-layer keys are
`fold_in(stream key, i)`; different streams never coincide (before, the Gumbel key of step j
was the init key of parameter leaf j, and data seeds were seed+1, seed+2, ...).
"""
from __future__ import annotations

import zlib

import jax
import numpy as np

STREAMS = ("init", "router_init", "gumbel", "corpus", "pretrain_data", "calib_data",
           "stage1_data", "stage2_data", "budget", "eval", "sampling", "tokens", "qad_budget",
           "qad_data")


def _stream_id(stream: str) -> int:
  if stream not in STREAMS:
    raise ValueError(f"unknown random stream {stream!r}; allowed: {list(STREAMS)}")
  return zlib.crc32(stream.encode())


def key(seed: int, stream: str) -> jax.Array:
  """The JAX PRNG key of `stream` under the root `seed`."""
  return jax.random.fold_in(jax.random.PRNGKey(seed), _stream_id(stream))


def seed_for(seed: int, stream: str) -> int:
  """A 31-bit integer seed of `stream` under the root `seed`, for host-side RNGs."""
  return int(np.random.SeedSequence([int(seed), _stream_id(stream)]).generate_state(1)[0]
             & 0x7FFFFFFF)
