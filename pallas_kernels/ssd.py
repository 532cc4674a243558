"""Mamba-2 SSD (state-space duality) scan as Pallas kernels: the chunked forward and its backward.

Same contract as `elastic_jax.model.ssd.ssd_chunked` (its pure-jnp reference, with
`ssd_sequential` as the step-by-step one): x [B,T,G,H,P], dt [B,T,G,H] (after softplus),
A [G,H] (negative), Bm / Cm [B,T,G,N] shared by a group's heads, state [B,G,H,P,N]; all math
in fp32; returns (y [B,T,G,H,P], final state [B,G,H,P,N]).

Kernels. One program per (batch row, head), grid (B, G*H). Inside, the chunks run in order
(`fori_loop`) with the [P, N] state carried in registers: per chunk of L steps,
  y     = (C B^T * decay) (x dt) + exp(cs) * (C S^T)        (intra-chunk, then the carried state)
  S_end = exp(cs_L) S + (exp(cs_L - cs) * x dt)^T B          (cs = cumsum of dt * A in the chunk)
The backward kernel walks the chunks in reverse, carrying dL/dS, and recomputes each chunk's
decays from the chunk-start states the forward saved ([B, G*H, T/L, P, N], as the chunked
reference materialises too). Both use only 2-D dots (`dot_general` with transposed operands),
elementwise math and row / column reductions: cumulative sums are masked reductions, so there
is no transpose, scan or cumsum primitive inside a kernel.

Backends: `backend="gpu"` lowers through Triton (P, N and L powers of two, at least 16),
`"tpu"` through Mosaic (the whole sequence of one head is one VMEM block: T*P*4 bytes per
operand, fine at 8K context, too large at 49K where a chunk-tiled grid would be needed);
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

BACKENDS = ("gpu", "tpu")
_NEG = -1e30  # exp(_NEG) == 0: the decay from a later step, masked without inf arithmetic


def default_backend() -> str:
  """"tpu" on a TPU host, else "gpu" (CPU runs use interpret mode, where either works)."""
  return "tpu" if jax.default_backend() == "tpu" else "gpu"


def _compiler_params(backend: str):
  if backend == "tpu":
    from jax.experimental.pallas import tpu as pltpu
    # Batch and heads are independent programs; chunks are sequential inside each.
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))
  from jax.experimental.pallas import triton as pltriton
  return pltriton.CompilerParams(num_warps=4, num_stages=1)


def _keep_spec(backend: str, gh: int):
  if backend == "tpu":
    from jax.experimental.pallas import tpu as pltpu
    return pl.BlockSpec(memory_space=pltpu.SMEM)
  return pl.BlockSpec((gh,), lambda b, h: (0,))


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


def _fwd_kernel(keep_ref, xdt_ref, acol_ref, arow_ref, b_ref, c_ref, h0_ref,
                y_ref, final_ref, starts_ref, *, L: int, n_chunks: int):
  head = pl.program_id(1)
  keep = keep_ref[head] != 0

  @pl.when(keep)
  def _():
    def chunk(i, S):
      rows = pl.ds(i * L, L)
      xdt = xdt_ref[rows, :]                       # [L,P]
      Bm, Cm = b_ref[rows, :], c_ref[rows, :]      # [L,N]
      cs, decay, total, _ = _chunk_decays(acol_ref[rows, :], arow_ref[:, rows], L)
      starts_ref[i] = S
      W = _dot(Cm, Bm, 1, 1) * decay               # [L,L]
      y = _dot(W, xdt, 1, 0) + jnp.exp(cs) * _dot(Cm, S, 1, 1)
      y_ref[rows, :] = y
      to_end = jnp.exp(total - cs)                 # [L,1]
      return jnp.exp(total) * S + _dot(to_end * xdt, Bm, 0, 0)

    final_ref[...] = jax.lax.fori_loop(0, n_chunks, chunk, h0_ref[...].astype(jnp.float32))

  @pl.when(jnp.logical_not(keep))
  def _():
    y_ref[...] = jnp.zeros(y_ref.shape, y_ref.dtype)
    final_ref[...] = h0_ref[...]
    starts_ref[...] = jnp.zeros(starts_ref.shape, starts_ref.dtype)


def _bwd_kernel(xdt_ref, acol_ref, arow_ref, b_ref, c_ref, starts_ref, dy_ref, dfinal_ref,
                dxdt_ref, da_ref, db_ref, dc_ref, dh0_ref, *, L: int, n_chunks: int):
  def chunk(j, dS):                                # dS = dL/d(state at this chunk's end)
    i = n_chunks - 1 - j
    rows = pl.ds(i * L, L)
    xdt, dy = xdt_ref[rows, :], dy_ref[rows, :]
    Bm, Cm = b_ref[rows, :], c_ref[rows, :]
    S = starts_ref[i]
    cs, decay, total, causal = _chunk_decays(acol_ref[rows, :], arow_ref[:, rows], L)
    e, to_end, e_total = jnp.exp(cs), jnp.exp(total - cs), jnp.exp(total)
    CB = _dot(Cm, Bm, 1, 1)
    W = CB * decay
    BdS = _dot(Bm, dS, 1, 1)                       # [L,P]
    dxdt_ref[rows, :] = _dot(W, dy, 0, 0) + to_end * BdS
    dW = _dot(dy, xdt, 1, 1)                       # [L,L]
    dCB = dW * decay
    dc_ref[rows, :] = _dot(dCB, Bm, 1, 0) + e * _dot(dy, S, 1, 0)
    db_ref[rows, :] = _dot(dCB, Cm, 0, 0) + _dot(to_end * xdt, dS, 1, 0)
    # d/d(cs) through the decay matrix (cs_l - cs_s), exp(cs), exp(cs_L) and exp(cs_L - cs),
    # then da_j = sum_{l >= j} dcs_l; the decay matrix's share is sum_{l >= j > s} dM_ls.
    dM = dW * CB * decay
    iota = lambda d: jax.lax.broadcasted_iota(jnp.int32, (L, L), d)
    before = _dot(dM, (iota(0) < iota(1)).astype(jnp.float32), 1, 0)  # [l,j]: sum_{s<j} dM_ls
    da_decay = jnp.sum(jnp.where(causal, before, 0.0), axis=0, keepdims=True)  # l >= j
    d_e = jnp.sum(dy * _dot(Cm, S, 1, 1), axis=1, keepdims=True) * e
    d_to_end = jnp.sum(xdt * BdS, axis=1, keepdims=True) * to_end
    d_total = jnp.sum(dS * S) * e_total + jnp.sum(d_to_end)
    da_ref[:, rows] = (da_decay + jnp.sum(jnp.where(causal, d_e - d_to_end, 0.0), axis=0,
                                          keepdims=True) + d_total)
    return e_total * dS + _dot(e * dy, Cm, 0, 0)

  dh0_ref[...] = jax.lax.fori_loop(0, n_chunks, chunk, dfinal_ref[...].astype(jnp.float32))


def _call(kernel, operands, out_shapes, group_operands, H: int, L: int, n_chunks: int,
          backend: str, interpret: bool):
  """One pallas_call over (batch, head) with each operand's block picked by its layout;
  operands at `group_operands` are per group ([B, G, ...]), the others per head."""
  B, GH = out_shapes[0].shape[:2]

  def spec(shape, per_group=False):
    if len(shape) == 1:                           # the keep flags
      return _keep_spec(backend, GH)
    block = (None, None) + tuple(shape[2:])
    tail = (0,) * (len(shape) - 2)
    if per_group:  # lax.div: `//` lowers with a sign fix-up Mosaic's index maps reject
      return pl.BlockSpec(block, lambda b, h: (b, jax.lax.div(h, H)) + tail)
    return pl.BlockSpec(block, lambda b, h: (b, h) + tail)

  return pl.pallas_call(
      functools.partial(kernel, L=L, n_chunks=n_chunks),
      grid=(B, GH),
      in_specs=[spec(o.shape, i in group_operands) for i, o in enumerate(operands)],
      out_specs=[spec(s.shape) for s in out_shapes],
      out_shape=out_shapes,
      compiler_params=None if interpret else _compiler_params(backend),
      interpret=interpret,
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
  y, final, starts = _call(_fwd_kernel, (keep, xdt, *_views(a), Bg, Cg, h0), out_shapes, (4, 5),
                           H, L, n_chunks, backend, interpret)
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
      _bwd_kernel, (xdt, *_views(a), Bg, Cg, starts, dy.astype(f32), dfinal.astype(f32)),
      out_shapes, (3, 4), H, L, n_chunks, backend, interpret)
  G = GH // H
  per_group = lambda d: d.reshape(B, G, H, T, N).sum(2)   # B and C are shared by a group's heads
  return (jnp.zeros((GH,), f32), dxdt, da[:, :, 0], per_group(dB_h), per_group(dC_h), dh0)


_ssd_core.defvjp(_ssd_fwd, _ssd_bwd)


def ssd(x, dt, A, Bm, Cm, chunk_size: int, initial_state=None, D=None, head_keep_GH=None, *,
        valid_BT=None, backend: str | None = None, interpret: bool = False):
  """Chunked SSD through the Pallas kernels: (y [B,T,G,H,P] fp32, final state [B,G,H,P,N] fp32).

  `D` [G,H]: the skip y += D x. `head_keep_GH`: heads whose entry is 0 are not computed (a
  hard budget mask; nonzero entries, soft or hard, are computed). `valid_BT` False marks padded
  steps (dt = 0 there: the state passes through unchanged). Differentiable in x, dt, A, Bm, Cm,
  D and the initial state (custom VJP: the backward kernel)."""
  backend = backend or default_backend()
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
