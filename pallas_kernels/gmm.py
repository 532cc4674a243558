"""Grouped matmul for the MoE experts: one entry point, the shipped kernel of each platform.

out[rows of group g] = lhs[rows of group g] @ rhs[g], rows sorted by group; rows past the last
group are 0 (`jax.lax.ragged_dot`'s contract, which the expert-parallel path relies on: the
other shards' assignments are parked there). No kernel here is hand-written:
- "xla": `jax.lax.ragged_dot`, the reference (and XLA's GPU / TPU path);
- "tiled": one-group row tiles in a loop of plain matmuls (`gmm_tiled.py`), the CPU path: XLA:CPU
  rewrites `ragged_dot` into a dense matmul against every group;
- "megablox": `jax.experimental.pallas.ops.tpu.megablox` (Mosaic TPU; its custom VJP computes
  the weight gradient with `tgmm`); on CPU it runs in interpret mode (tests);
- "tokamax": `tokamax.ragged_dot(implementation="triton")` on GPU (`pip install tokamax`, the
  `gpu` extra; it refuses to trace off a GPU, so the CPU tests lower it for CUDA only).
Budget-aware: an expert a budget drops is never routed to, so its group is empty and megablox
visits no tile of it; with kernels="pallas" a hard expert-width mask runs the matmuls on the
weights sliced to the narrowest configured width that holds its kept columns
(`model.moe.narrow_width`, a branch per width: the kernels take static shapes).
"""
from __future__ import annotations

import functools
import importlib.util
import logging

import jax
import jax.numpy as jnp

from pallas_kernels import platform as platform_lib
from pallas_kernels.gmm_tiled import gmm_tiled

GMM_BACKENDS = ("xla", "tiled", "megablox", "tokamax")


def xla_backend(platform: str | None = None) -> str:
  """The grouped matmul of `kernels="xla"` on `platform` (default: `platform.current()`):
  "tiled" on CPU, whose `ragged_dot` computes every group for every row, else `ragged_dot`."""
  return "tiled" if (platform or platform_lib.current()) == "cpu" else "xla"


def pallas_backend(platform: str | None = None) -> str:
  """The shipped kernel for `platform` (default: `platform.current()`): megablox on TPU and,
  run interpreted, on CPU; tokamax on GPU when installed, else XLA's ragged_dot (logged)."""
  platform = platform or platform_lib.current()
  if platform in ("gpu", "cuda", "rocm"):
    if importlib.util.find_spec("tokamax") is not None:
      return "tokamax"
    _warn_no_tokamax()
    return "xla"
  return "megablox"


@functools.cache
def _warn_no_tokamax():
  logging.warning("kernels=pallas on GPU needs tokamax (pip install 'elastic-jax[gpu]'); "
                  "the grouped matmul falls back to jax.lax.ragged_dot")


LANES = 128   # Mosaic blocks' last two dims: multiples of (8, 128) or the whole dim


def _megablox(lhs, rhs, group_sizes, out_dtype, interpret: bool):
  from jax.experimental.pallas.ops.tpu.megablox import ops
  m, k = lhs.shape
  n = rhs.shape[-1]
  tm = 128 if m >= 128 else -(-m // 8) * 8
  pad = (-m) % tm
  # K and N padded with zeros to whole 128-lane tiles: the backward runs the transposed
  # problem with the same tiling, so a whole-dim tile for one (nano_v3's expert width 1856 =
  # 14.5 x 128) would be a partial tile of the other (hidden 2688), which Mosaic refuses.
  pk, pn = (-k) % LANES, (-n) % LANES
  # Megablox leaves rows past the last group unwritten, in the forward output and in the
  # backward's d(lhs); the contract is zeros there, so both sides are selected (a select's
  # VJP drops the unwritten cotangent rows; a multiply would carry their NaNs).
  filled = jnp.arange(m) < jnp.sum(group_sizes)
  lhs = jnp.where(filled[:, None], lhs, 0)
  out = ops.gmm(jnp.pad(lhs, ((0, pad), (0, pk))), jnp.pad(rhs, ((0, 0), (0, pk), (0, pn))),
                group_sizes.astype(jnp.int32), out_dtype, (tm, LANES, LANES), None, None, False,
                interpret)[:m, :n]
  return jnp.where(filled[:, None], out, 0).astype(out_dtype)


def gmm(lhs_MK, rhs_GKN, group_sizes_G, *, backend: str = "xla",
        preferred_element_type=None, interpret: bool | None = None):
  """Grouped matmul [M,K] x [G,K,N] -> [M,N] with `group_sizes_G` consecutive rows per group.

  `backend` in GMM_BACKENDS (see `pallas_backend` for the platform's kernel). `interpret`
  (megablox): default True off TPU, so CPU runs the kernel's own code in Pallas' interpreter.
  Differentiable in lhs and rhs on every backend."""
  if backend not in GMM_BACKENDS:
    raise ValueError(f"gmm backend must be one of {GMM_BACKENDS}, got {backend!r}")
  out_dtype = preferred_element_type or lhs_MK.dtype
  if backend == "xla":
    return jax.lax.ragged_dot(lhs_MK, rhs_GKN, group_sizes_G, preferred_element_type=out_dtype)
  if backend == "tiled":
    return gmm_tiled(lhs_MK, rhs_GKN, group_sizes_G, preferred_element_type=out_dtype)
  if backend == "megablox":
    if interpret is None:
      interpret = platform_lib.current() != "tpu"
    return _megablox(lhs_MK, rhs_GKN, group_sizes_G, out_dtype, interpret)
  import tokamax
  from absl import flags
  if not flags.FLAGS.is_parsed():
    # tokamax reads its options from absl flags and would parse sys.argv itself, failing on a
    # host program's own arguments (a notebook's, pytest's): take every flag's default instead.
    flags.FLAGS.mark_as_parsed()
  return tokamax.ragged_dot(lhs_MK, rhs_GKN, group_sizes_G, preferred_element_type=out_dtype,
                            implementation="triton")
