"""Grouped matmul as a loop over row tiles of one group each, in plain XLA ops: the CPU path.

XLA:CPU has no grouped-matmul kernel: `jax.lax.ragged_dot` is rewritten into a dense matmul
against every group, so a MoE on it costs all E experts per token, not k (measured at 3.8-4.5x
the dense dispatch's time, `model.moe.choose_impl`). Here the rows of each group are laid out in
tiles of `tile` rows that hold one group each (a group's last tile padded with zero rows), and
a loop multiplies each used tile by its group's matrix: the work is the routed rows plus at most
one partial tile per group, whatever the number of groups.

Contract as `jax.lax.ragged_dot`: rows sorted by group, `group_sizes_G` consecutive rows per
group, rows past the last group are 0 (and get a zero gradient). Differentiable in lhs and rhs
through a custom VJP: d(lhs) is the same loop against the transposed matrices, d(rhs) a loop that
adds each tile's x^T g into its group's slot.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def default_tile(m: int, groups: int) -> int:
  """Rows per tile: the power of two at or below the mean group size, within [8, 128] (small
  tiles waste less padding, large ones run faster matmuls)."""
  mean = max(m // max(groups, 1), 1)
  return int(min(128, max(8, 1 << (mean.bit_length() - 1))))


def _layout(group_sizes_G, m: int, tile: int):
  """Where each row goes among the padded tiles, and each tile's group.

  Returns (slot_src [S] source row of each padded slot, slot_ok [S], row_slot [M] padded slot of
  each row, row_ok [M], tile_group [n] (G for a tile past the used ones), used tile count)."""
  G = group_sizes_G.shape[0]
  n = -(-m // tile) + G   # every group's rows round up by under one tile
  sizes = group_sizes_G.astype(jnp.int32)
  tiles_of = (sizes + tile - 1) // tile
  tile_end = jnp.cumsum(tiles_of)
  tile_start = tile_end - tiles_of
  row_end = jnp.cumsum(sizes)
  row_start = row_end - sizes
  tile_group = jnp.searchsorted(tile_end, jnp.arange(n), side="right").astype(jnp.int32)
  # Slots: tile j, offset o within the group's tiles.
  slot = jnp.arange(n * tile)
  g_slot = jnp.minimum(tile_group[slot // tile], G - 1)
  off = slot - tile_start[g_slot] * tile
  slot_ok = (tile_group[slot // tile] < G) & (off < sizes[g_slot])
  slot_src = jnp.where(slot_ok, row_start[g_slot] + off, 0)
  # Rows: group g, offset within the group.
  row = jnp.arange(m)
  g_row = jnp.minimum(jnp.searchsorted(row_end, row, side="right"), G - 1)
  row_ok = row < row_end[-1]
  row_slot = jnp.where(row_ok, tile_start[g_row] * tile + row - row_start[g_row], 0)
  return slot_src, slot_ok, row_slot, row_ok, tile_group, tile_end[-1]


def _varying(a) -> frozenset:
  """The manual mesh axes `a` varies over inside `shard_map` (empty outside)."""
  t = jax.typeof(a)
  v = getattr(t, "vma", None)   # newer jax; jax 0.10: manual_axis_type.varying
  if v is None:
    v = getattr(getattr(t, "manual_axis_type", None), "varying", ())
  return frozenset(v)


def _vary_like(a, *others):
  """`a` cast to vary over every axis one of `others` varies over: done outside the custom VJP,
  so autodiff sums the cotangent over those axes (a pcast's transpose is a psum)."""
  extra = frozenset().union(*map(_varying, others)) - _varying(a)
  return jax.lax.pcast(a, tuple(sorted(extra)), to="varying") if extra else a


def _gather(x, idx, ok):
  return jnp.where(ok[:, None], x[idx], jnp.zeros((), x.dtype))


def _tiles_matmul(x_SK, w_GKN, tile_group, used, tile: int, out_dtype):
  """y[tile j] = x[tile j] @ w[group of j] for the `used` first tiles; 0 after them."""
  S, K = x_SK.shape
  x = x_SK.reshape(S // tile, tile, K)

  def body(j, y):
    w = jax.lax.dynamic_index_in_dim(w_GKN, tile_group[j], keepdims=False)
    yj = jnp.dot(x[j], w, preferred_element_type=out_dtype)
    return jax.lax.dynamic_update_index_in_dim(y, yj.astype(out_dtype), j, 0)

  y = _vary_like(jnp.zeros((S // tile, tile, w_GKN.shape[-1]), out_dtype), x_SK, w_GKN,
                 tile_group)
  return jax.lax.fori_loop(0, used, body, y).reshape(S, -1)


def _tiles_tgmm(x_SK, g_SN, tile_group, used, groups: int, tile: int, out_dtype):
  """dw[g] = sum over the tiles j of group g of x[tile j]^T g[tile j]."""
  S, K = x_SK.shape
  N = g_SN.shape[-1]
  x = x_SK.reshape(S // tile, tile, K)
  gr = g_SN.reshape(S // tile, tile, N)

  def body(j, dw):
    e = tile_group[j]
    upd = jnp.dot(x[j].T, gr[j], preferred_element_type=jnp.float32)
    cur = jax.lax.dynamic_index_in_dim(dw, e, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(dw, cur + upd, e, 0)

  dw = jax.lax.fori_loop(
      0, used, body, _vary_like(jnp.zeros((groups, K, N), jnp.float32), x_SK, g_SN, tile_group))
  return dw.astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm(lhs_MK, rhs_GKN, group_sizes_G, tile: int, out_dtype):
  return _fwd(lhs_MK, rhs_GKN, group_sizes_G, tile, out_dtype)[0]


def _fwd(lhs_MK, rhs_GKN, group_sizes_G, tile, out_dtype):
  layout = _layout(group_sizes_G, lhs_MK.shape[0], tile)
  slot_src, slot_ok, row_slot, row_ok, tile_group, used = layout
  x_pad = _gather(lhs_MK, slot_src, slot_ok)
  y_pad = _tiles_matmul(x_pad, rhs_GKN, tile_group, used, tile, out_dtype)
  out = _gather(y_pad, row_slot, row_ok)
  return out, (x_pad, rhs_GKN, layout)   # the backward reuses the layout


def _bwd(tile, out_dtype, res, g_MN):
  x_pad, rhs_GKN, (slot_src, slot_ok, row_slot, row_ok, tile_group, used) = res
  g_pad = _gather(g_MN, slot_src, slot_ok)
  d_pad = _tiles_matmul(g_pad, jnp.swapaxes(rhs_GKN, 1, 2), tile_group, used, tile,
                        x_pad.dtype)
  d_lhs = _gather(d_pad, row_slot, row_ok)
  d_rhs = _tiles_tgmm(x_pad, g_pad, tile_group, used, rhs_GKN.shape[0], tile, rhs_GKN.dtype)
  return d_lhs, d_rhs, None


_gmm.defvjp(_fwd, _bwd)


def gmm_tiled(lhs_MK, rhs_GKN, group_sizes_G, *, preferred_element_type=None,
              tile: int | None = None):
  """Grouped matmul [M,K] x [G,K,N] -> [M,N] (`jax.lax.ragged_dot`'s contract) as a loop over
  one-group row tiles; `tile` rows per tile (default `default_tile`)."""
  m, G = lhs_MK.shape[0], rhs_GKN.shape[0]
  tile = tile or default_tile(m, G)
  out_dtype = jnp.dtype(preferred_element_type or lhs_MK.dtype)
  group_sizes_G = group_sizes_G.astype(jnp.int32)
  lhs_MK = _vary_like(lhs_MK, rhs_GKN, group_sizes_G)
  rhs_GKN = _vary_like(rhs_GKN, lhs_MK, group_sizes_G)
  return _gmm(lhs_MK, rhs_GKN, group_sizes_G, tile, out_dtype)
