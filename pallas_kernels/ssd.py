"""Mamba-2 SSD (state-space duality) scan as Pallas kernels: the chunked forward and its backward.

Same contract as `elastic_jax.model.ssd.ssd_chunked` (its pure-jnp reference, with
`ssd_sequential` as the step-by-step one): x [B,T,G,H,P], dt [B,T,G,H] (after softplus),
A [G,H] (negative), Bm / Cm [B,T,G,N] shared by a group's heads, state [B,G,H,P,N]; all math
in fp32; returns (y [B,T,G,H,P], final state [B,G,H,P,N]).

Kernels. Per chunk of L steps, with S the state at the chunk's start,
  y     = (C B^T * decay) (x dt) + exp(cs) * (C S^T)        (intra-chunk, then the carried state)
  S_end = exp(cs_L) S + (exp(cs_L - cs) * x dt)^T B          (cs = cumsum of dt * A in the chunk)
and the backward walks the chunks in reverse, carrying dL/dS and recomputing each chunk's decays
from the chunk-start states the forward saved ([B, G*H, T/L, P, N], as the chunked reference
materialises too). The per-chunk math (`_fwd_chunk`, `_bwd_chunk`) uses only 2-D dots
(`dot_general` with transposed operands), elementwise math and row / column reductions:
cumulative sums are masked reductions, so no transpose, scan or cumsum runs inside a kernel.
Two layouts of the same chunk math:
- `backend="gpu"` (Triton; P, N and L powers of two, at least 16): grid (B, G*H), each program
  walks its head's chunks with a fori_loop, the state in registers;
- `backend="tpu"` (Mosaic): grid (B, G*H, T/L), chunks the sequential last dimension, one
  chunk's blocks in VMEM per step (any context length), the state in a VMEM scratch.
`interpret=True` runs anywhere (CPU tests). Budget-aware: a head whose keep flag is 0 (a hard
budget mask dropped it) is not computed in the undifferentiated forward (inference,
evaluation): its y is the D skip alone and its final state its initial state (the model's mask
zeroes that head's output, so nothing downstream reads them). Under differentiation every head
is computed, because a straight-through mask is 0 where its gradient is not.
The D skip (y += D x) and the padding of T to whole chunks (dt = 0 steps are identities) are
plain jnp in `ssd`, fused by XLA with the layout changes around the kernel.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import platform as platform_lib

BACKENDS = ("gpu", "tpu")
_NEG = -1e30  # exp(_NEG) == 0: the decay from a later step, masked without inf arithmetic


def default_backend() -> str:
  """"tpu" when building for a TPU (`platform.current()`), else "gpu" (CPU runs use interpret
  mode, where either works)."""
  return "tpu" if platform_lib.current() == "tpu" else "gpu"


def _compiler_params(backend: str):
  if backend == "tpu":
    from jax.experimental.pallas import tpu as pltpu
    # Batch and heads are independent programs; a head's chunks run in order.
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))
  from jax.experimental.pallas import triton as pltriton
  return pltriton.CompilerParams(num_warps=4, num_stages=1)


def _dot(a, b, ca: int, cb: int):
  """2-D matmul contracting a's dim `ca` with b's dim `cb`, in fp32."""
  return jax.lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), preferred_element_type=jnp.float32)


def _chunk_decays(a_col, a_row, L: int):
  """From one chunk's dt*A as a column [L,1] and a row [1,L]: (cs column [L,1], the masked
  decay matrix exp(cs_l - cs_s) for s <= l [L,L], the cumulative total cs_L (scalar))."""
  l_ = jax.lax.broadcasted_iota(jnp.int32, (L, L), 0)
  s_ = jax.lax.broadcasted_iota(jnp.int32, (L, L), 1)
  causal = s_ <= l_
  cs_col = jnp.sum(jnp.where(causal, a_row, 0.0), axis=1, keepdims=True)   # sum_{j<=l} a_j
  cs_row = jnp.sum(jnp.where(l_ <= s_, a_col, 0.0), axis=0, keepdims=True)  # sum_{j<=s} a_j
  decay = jnp.exp(jnp.where(causal, cs_col - cs_row, _NEG))
  return cs_col, decay, jnp.sum(a_row), causal


def _fwd_chunk(xdt, a_col, a_row, Bm, Cm, S, L: int):
  """One chunk forward: (y [L,P], the state at the chunk's end [P,N])."""
  cs, decay, total, _ = _chunk_decays(a_col, a_row, L)
  W = _dot(Cm, Bm, 1, 1) * decay                   # [L,L]
  y = _dot(W, xdt, 1, 0) + jnp.exp(cs) * _dot(Cm, S, 1, 1)
  to_end = jnp.exp(total - cs)                     # [L,1]
  return y, jnp.exp(total) * S + _dot(to_end * xdt, Bm, 0, 0)


def _bwd_chunk(xdt, a_col, a_row, Bm, Cm, S, dy, dS, L: int):
  """One chunk backward from dS = dL/d(state at its end): (d xdt [L,P], d(dt A) [1,L],
  dB [L,N], dC [L,N], dL/d(state at its start))."""
  cs, decay, total, causal = _chunk_decays(a_col, a_row, L)
  e, to_end, e_total = jnp.exp(cs), jnp.exp(total - cs), jnp.exp(total)
  CB = _dot(Cm, Bm, 1, 1)
  W = CB * decay
  BdS = _dot(Bm, dS, 1, 1)                         # [L,P]
  dxdt = _dot(W, dy, 0, 0) + to_end * BdS
  dW = _dot(dy, xdt, 1, 1)                         # [L,L]
  dCB = dW * decay
  dC = _dot(dCB, Bm, 1, 0) + e * _dot(dy, S, 1, 0)
  dB = _dot(dCB, Cm, 0, 0) + _dot(to_end * xdt, dS, 1, 0)
  # d/d(cs) through the decay matrix (cs_l - cs_s), exp(cs), exp(cs_L) and exp(cs_L - cs),
  # then da_j = sum_{l >= j} dcs_l; the decay matrix's share is sum_{l >= j > s} dM_ls.
  dM = dW * CB * decay
  iota = lambda d: jax.lax.broadcasted_iota(jnp.int32, (L, L), d)
  before = _dot(dM, (iota(0) < iota(1)).astype(jnp.float32), 1, 0)  # [l,j]: sum_{s<j} dM_ls
  da_decay = jnp.sum(jnp.where(causal, before, 0.0), axis=0, keepdims=True)  # l >= j
  d_e = jnp.sum(dy * _dot(Cm, S, 1, 1), axis=1, keepdims=True) * e
  d_to_end = jnp.sum(xdt * BdS, axis=1, keepdims=True) * to_end
  d_total = jnp.sum(dS * S) * e_total + jnp.sum(d_to_end)
  da = da_decay + jnp.sum(jnp.where(causal, d_e - d_to_end, 0.0), axis=0, keepdims=True) + d_total
  return dxdt, da, dB, dC, e_total * dS + _dot(e * dy, Cm, 0, 0)


# GPU (Triton): one program per (batch row, head) holds its whole sequence (refs are pointers
# into global memory) and walks the chunks with a fori_loop, the state in registers.

def _fwd_kernel_seq(keep_ref, xdt_ref, acol_ref, arow_ref, b_ref, c_ref, h0_ref,
                    y_ref, final_ref, starts_ref, *, L: int, n_chunks: int):
  keep = keep_ref[pl.program_id(1)] != 0

  @pl.when(keep)
  def _():
    def chunk(i, S):
      rows = pl.ds(i * L, L)
      starts_ref[i] = S
      y, S = _fwd_chunk(xdt_ref[rows, :], acol_ref[rows, :], arow_ref[:, rows], b_ref[rows, :],
                        c_ref[rows, :], S, L)
      y_ref[rows, :] = y
      return S

    final_ref[...] = jax.lax.fori_loop(0, n_chunks, chunk, h0_ref[...].astype(jnp.float32))

  @pl.when(jnp.logical_not(keep))
  def _():
    y_ref[...] = jnp.zeros(y_ref.shape, y_ref.dtype)
    final_ref[...] = h0_ref[...]
    starts_ref[...] = jnp.zeros(starts_ref.shape, starts_ref.dtype)


def _bwd_kernel_seq(xdt_ref, acol_ref, arow_ref, b_ref, c_ref, starts_ref, dy_ref, dfinal_ref,
                    dxdt_ref, da_ref, db_ref, dc_ref, dh0_ref, *, L: int, n_chunks: int):
  def chunk(j, dS):
    i = n_chunks - 1 - j
    rows = pl.ds(i * L, L)
    dxdt_ref[rows, :], da_ref[:, rows], db_ref[rows, :], dc_ref[rows, :], dS = _bwd_chunk(
        xdt_ref[rows, :], acol_ref[rows, :], arow_ref[:, rows], b_ref[rows, :], c_ref[rows, :],
        starts_ref[i], dy_ref[rows, :], dS, L)
    return dS

  dh0_ref[...] = jax.lax.fori_loop(0, n_chunks, chunk, dfinal_ref[...].astype(jnp.float32))


# TPU (Mosaic): the chunks are the grid's last, sequential ("arbitrary") dimension, so VMEM
# holds one chunk's blocks at a time (any context length); the state lives in a VMEM scratch
# that persists across a head's chunk steps. The backward's index maps walk chunks in reverse.

def _fwd_kernel_tiled(keep_ref, xdt_ref, acol_ref, arow_ref, b_ref, c_ref, h0_ref,
                      y_ref, final_ref, starts_ref, state_ref, *, L: int, n_chunks: int):
  keep = keep_ref[pl.program_id(1)] != 0
  c = pl.program_id(2)

  @pl.when(c == 0)
  def _():
    state_ref[...] = h0_ref[...].astype(jnp.float32)

  @pl.when(keep)
  def _():
    S = state_ref[...]
    starts_ref[...] = S
    y_ref[...], state_ref[...] = _fwd_chunk(xdt_ref[...], acol_ref[...], arow_ref[...],
                                            b_ref[...], c_ref[...], S, L)

  @pl.when(jnp.logical_not(keep))
  def _():
    y_ref[...] = jnp.zeros(y_ref.shape, y_ref.dtype)
    starts_ref[...] = jnp.zeros(starts_ref.shape, starts_ref.dtype)

  @pl.when(c == n_chunks - 1)
  def _():
    final_ref[...] = state_ref[...]


def _bwd_kernel_tiled(xdt_ref, acol_ref, arow_ref, b_ref, c_ref, starts_ref, dy_ref, dfinal_ref,
                      dxdt_ref, da_ref, db_ref, dc_ref, dh0_ref, dstate_ref, *, L: int,
                      n_chunks: int):
  c = pl.program_id(2)

  @pl.when(c == 0)
  def _():
    dstate_ref[...] = dfinal_ref[...].astype(jnp.float32)

  dxdt_ref[...], da_ref[...], db_ref[...], dc_ref[...], dstate_ref[...] = _bwd_chunk(
      xdt_ref[...], acol_ref[...], arow_ref[...], b_ref[...], c_ref[...], starts_ref[...],
      dy_ref[...], dstate_ref[...], L)

  @pl.when(c == n_chunks - 1)
  def _():
    dh0_ref[...] = dstate_ref[...]


# Each operand's layout: which of its dims is time ("t": [.., T, X], "t_row": [.., 1, T],
# "chunks": [.., C, P, N]) or none ("whole": one block per head), and whether it is per
# group ([B, G, ...]: B and C, shared by a group's heads) rather than per head.
_FWD_LAYOUT = (("keep", False), ("t", False), ("t", False), ("t_row", False), ("t", True),
               ("t", True), ("whole", False))
_FWD_OUT = (("t", False), ("whole", False), ("chunks", False))
_BWD_LAYOUT = (("t", False), ("t", False), ("t_row", False), ("t", True), ("t", True),
               ("chunks", False), ("t", False), ("whole", False))
_BWD_OUT = (("t", False), ("t_row", False), ("t", False), ("t", False), ("whole", False))


def _spec(shape, layout: str, per_group: bool, H: int, L: int, backend: str, tiled: bool,
          reverse: bool, n_chunks: int):
  """The BlockSpec of one operand: the whole sequence per (batch row, head), or with `tiled`
  one chunk per grid step (chunk n_chunks - 1 - c on step c with `reverse`)."""
  if layout == "keep":
    if backend == "tpu":
      from jax.experimental.pallas import tpu as pltpu
      return pl.BlockSpec(memory_space=pltpu.SMEM)
    return pl.BlockSpec(shape, lambda *_: (0,))
  # lax.div: `//` lowers with a sign fix-up Mosaic's index maps reject.
  owner = (lambda h: jax.lax.div(h, H)) if per_group else (lambda h: h)
  step = (lambda c: n_chunks - 1 - c) if reverse else (lambda c: c)
  block = [None, None] + list(shape[2:])
  if tiled and layout == "t":
    block[2] = L
    return pl.BlockSpec(tuple(block), lambda b, h, c: (b, owner(h), step(c), 0))
  if tiled and layout == "t_row":
    block[3] = L
    return pl.BlockSpec(tuple(block), lambda b, h, c: (b, owner(h), 0, step(c)))
  if tiled and layout == "chunks":
    block[2] = None
    return pl.BlockSpec(tuple(block), lambda b, h, c: (b, owner(h), step(c), 0, 0))
  tail = (0,) * (len(shape) - 2)
  if tiled:
    return pl.BlockSpec(tuple(block), lambda b, h, c: (b, owner(h)) + tail)
  return pl.BlockSpec(tuple(block), lambda b, h: (b, owner(h)) + tail)


def _call(backward: bool, operands, out_shapes, H: int, L: int, backend: str, interpret: bool):
  """One pallas_call of the forward or backward kernel for `backend`'s layout."""
  B, GH, T = out_shapes[0].shape[:3]
  n_chunks = T // L
  tiled = backend == "tpu"
  layout_in, layout_out = (_BWD_LAYOUT, _BWD_OUT) if backward else (_FWD_LAYOUT, _FWD_OUT)
  spec = lambda shape, lay: _spec(shape, *lay, H, L, backend, tiled, backward, n_chunks)
  if tiled:
    from jax.experimental.pallas import tpu as pltpu
    kernel = _bwd_kernel_tiled if backward else _fwd_kernel_tiled
    P, N = out_shapes[-1].shape[-2:] if backward else out_shapes[1].shape[-2:]
    extra = dict(grid=(B, GH, n_chunks), scratch_shapes=[pltpu.VMEM((P, N), jnp.float32)])
  else:
    kernel = _bwd_kernel_seq if backward else _fwd_kernel_seq
    extra = dict(grid=(B, GH))
  return pl.pallas_call(
      functools.partial(kernel, L=L, n_chunks=n_chunks),
      in_specs=[spec(o.shape, lay) for o, lay in zip(operands, layout_in)],
      out_specs=[spec(s.shape, lay) for s, lay in zip(out_shapes, layout_out)],
      out_shape=out_shapes,
      compiler_params=None if interpret else _compiler_params(backend),
      interpret=interpret, **extra,
  )(*operands)


def _views(a):
  """dt*A [B,GH,T] as the column and row blocks the kernels read."""
  return a[..., None], a[..., None, :]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _ssd_core(keep, xdt, a, Bg, Cg, h0, H, L, backend, interpret):
  return _forward(keep, xdt, a, Bg, Cg, h0, H, L, backend, interpret)[0]


def _ssd_fwd(keep, xdt, a, Bg, Cg, h0, H, L, backend, interpret):
  # Differentiated: every head is computed. A head mask of 0 can still carry gradient (a
  # straight-through mask's value is 0 where its gradient is not), and d/d(mask) needs that
  # head's output; only the undifferentiated forward (inference, evaluation) skips heads.
  return _forward(jnp.ones_like(keep), xdt, a, Bg, Cg, h0, H, L, backend, interpret)


def _forward(keep, xdt, a, Bg, Cg, h0, H, L, backend, interpret):
  B, GH, T, P = xdt.shape
  N, n_chunks = Bg.shape[-1], T // L
  f32 = jnp.float32
  out_shapes = [jax.ShapeDtypeStruct((B, GH, T, P), f32), jax.ShapeDtypeStruct((B, GH, P, N), f32),
                jax.ShapeDtypeStruct((B, GH, n_chunks, P, N), f32)]
  y, final, starts = _call(False, (keep, xdt, *_views(a), Bg, Cg, h0), out_shapes, H, L,
                           backend, interpret)
  return (y, final), (xdt, a, Bg, Cg, starts)


def _ssd_bwd(H, L, backend, interpret, res, cotangents):
  xdt, a, Bg, Cg, starts = res                   # every head computed: see _ssd_fwd
  dy, dfinal = cotangents
  B, GH, T, P = xdt.shape
  N, n_chunks = Bg.shape[-1], T // L
  f32 = jnp.float32
  out_shapes = [jax.ShapeDtypeStruct((B, GH, T, P), f32), jax.ShapeDtypeStruct((B, GH, 1, T), f32),
                jax.ShapeDtypeStruct((B, GH, T, N), f32), jax.ShapeDtypeStruct((B, GH, T, N), f32),
                jax.ShapeDtypeStruct((B, GH, P, N), f32)]
  dxdt, da, dB_h, dC_h, dh0 = _call(
      True, (xdt, *_views(a), Bg, Cg, starts, dy.astype(f32), dfinal.astype(f32)),
      out_shapes, H, L, backend, interpret)
  G = GH // H
  per_group = lambda d: d.reshape(B, G, H, T, N).sum(2)   # B and C are shared by a group's heads
  return (jnp.zeros((GH,), f32), dxdt, da[:, :, 0], per_group(dB_h), per_group(dC_h), dh0)


_ssd_core.defvjp(_ssd_fwd, _ssd_bwd)


def ssd(x, dt, A, Bm, Cm, chunk_size: int, initial_state=None, D=None, head_keep_GH=None, *,
        valid_BT=None, backend: str | None = None, interpret: bool | None = None):
  """Chunked SSD through the Pallas kernels: (y [B,T,G,H,P] fp32, final state [B,G,H,P,N] fp32).

  `D` [G,H]: the skip y += D x. `head_keep_GH`: heads whose entry is 0 are not computed (a
  hard budget mask; nonzero entries, soft or hard, are computed). `valid_BT` False marks padded
  steps (dt = 0 there: the state passes through unchanged). Differentiable in x, dt, A, Bm, Cm,
  D and the initial state (custom VJP: the backward kernel). `interpret`: default True on a
  CPU host (Pallas' interpreter), else compiled for `backend` (default: this host's)."""
  backend = backend or default_backend()
  if interpret is None:
    interpret = platform_lib.current() == "cpu"
  if backend not in BACKENDS:
    raise ValueError(f"ssd backend must be one of {BACKENDS}, got {backend!r}")
  b, t, g, h, p = x.shape
  n = Bm.shape[-1]
  L = chunk_size
  f32 = jnp.float32
  x, dt, Bm, Cm = (v.astype(f32) for v in (x, dt, Bm, Cm))
  if valid_BT is not None:
    dt = jnp.where(valid_BT[..., None, None], dt, 0.0)
  pad = (-t) % L
  padt = lambda v: jnp.pad(v, [(0, 0), (0, pad)] + [(0, 0)] * (v.ndim - 2))
  # [B,T,G,H,...] -> [B, G*H, T, ...]
  xdt = jnp.moveaxis(padt(x * dt[..., None]), 1, 3).reshape(b, g * h, t + pad, p)
  a = jnp.moveaxis(padt(dt * A.astype(f32)), 1, 3).reshape(b, g * h, t + pad)
  Bg, Cg = (jnp.moveaxis(padt(v), 1, 2) for v in (Bm, Cm))     # [B, G, T, N]
  h0 = (jnp.zeros((b, g * h, p, n), f32) if initial_state is None
        else initial_state.astype(f32).reshape(b, g * h, p, n))
  keep = (jnp.ones((g * h,), f32) if head_keep_GH is None
          else (jax.lax.stop_gradient(head_keep_GH) != 0).astype(f32).reshape(g * h))
  y, final = _ssd_core(keep, xdt, a, Bg, Cg, h0, h, L, backend, interpret)
  y = jnp.moveaxis(y.reshape(b, g, h, t + pad, p)[:, :, :, :t], 3, 1)
  if D is not None:
    y = y + D.astype(f32)[..., None] * x
  return y, final.reshape(b, g, h, p, n)
