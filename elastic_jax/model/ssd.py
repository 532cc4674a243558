"""Mamba-2 state-space duality (SSD) scan: chunked (pure jnp) and a sequential reference.

Shapes: x [B,T,G,H,P] (heads stored per group), dt [B,T,G,H] (after softplus), A [G,H] (negative),
Bm/Cm [B,T,G,N] shared by the heads of a group, state [B,G,H,P,N]. All math in fp32.
Recurrence: h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,  y_t = h_t C_t  (D skip added by caller).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def ssd_sequential(x, dt, A, Bm, Cm, initial_state=None):
  """Reference: one step per token with `lax.scan`. Returns (y [B,T,G,H,P], final state)."""
  b, _, g, h, p = x.shape
  n = Bm.shape[-1]
  f32 = jnp.float32
  state0 = (jnp.zeros((b, g, h, p, n), f32) if initial_state is None
            else initial_state.astype(f32))

  def step(state, inp):
    x_t, dt_t, b_t, c_t = inp
    decay = jnp.exp(dt_t * A)[..., None, None]
    state = decay * state + jnp.einsum("bghp,bgn->bghpn", x_t * dt_t[..., None], b_t)
    return state, jnp.einsum("bghpn,bgn->bghp", state, c_t)

  xs = tuple(jnp.moveaxis(a.astype(f32), 1, 0) for a in (x, dt, Bm, Cm))
  final, y = jax.lax.scan(step, state0, xs)
  return jnp.moveaxis(y, 0, 1), final


def ssd_chunked(x, dt, A, Bm, Cm, chunk_size: int, initial_state=None):
  """Chunked SSD: quadratic attention-like form inside chunks, a scan over chunk states.

  Pads T to a multiple of `chunk_size` with dt = 0 (identity steps), so the final state is exact.
  Returns (y [B,T,G,H,P] fp32, final state [B,G,H,P,N] fp32).
  """
  b, t, g, h, p = x.shape
  n = Bm.shape[-1]
  f32 = jnp.float32
  L = chunk_size
  pad = (-t) % L
  x, dt, Bm, Cm = (jnp.pad(a.astype(f32), [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
                   for a in (x, dt, Bm, Cm))
  c = (t + pad) // L
  x = x.reshape(b, c, L, g, h, p)
  dt = dt.reshape(b, c, L, g, h)
  Bm = Bm.reshape(b, c, L, g, n)
  Cm = Cm.reshape(b, c, L, g, n)

  dA_cs = jnp.cumsum(dt * A, axis=2)                      # [b,c,L,g,h]
  xdt = x * dt[..., None]
  # Intra-chunk: decay from source s to target l is exp(cs[l] - cs[s]) for s <= l.
  causal = jnp.tril(jnp.ones((L, L), bool))[None, None, :, :, None, None]
  seg = dA_cs[:, :, :, None] - dA_cs[:, :, None, :]       # [b,c,l,s,g,h]
  decay = jnp.exp(jnp.where(causal, seg, -jnp.inf))
  CB = jnp.einsum("bclgn,bcsgn->bclsg", Cm, Bm)
  y_diag = jnp.einsum("bclsg,bclsgh,bcsghp->bclghp", CB, decay, xdt)

  # Each chunk's contribution to the state at its end.
  decay_to_end = jnp.exp(dA_cs[:, :, -1:] - dA_cs)        # [b,c,L,g,h]
  chunk_states = jnp.einsum("bclgn,bclgh,bclghp->bcghpn", Bm, decay_to_end, xdt)
  chunk_decay = jnp.exp(dA_cs[:, :, -1])                  # [b,c,g,h]

  state0 = (jnp.zeros((b, g, h, p, n), f32) if initial_state is None
            else initial_state.astype(f32))

  def step(state, inp):
    cd, cs = inp
    return cd[..., None, None] * state + cs, state        # carry end state, emit start state

  final, start_states = jax.lax.scan(
      step, state0, (jnp.moveaxis(chunk_decay, 1, 0), jnp.moveaxis(chunk_states, 1, 0)))
  start_states = jnp.moveaxis(start_states, 0, 1)         # [b,c,g,h,p,n]
  y_off = jnp.einsum("bclgn,bcghpn,bclgh->bclghp", Cm, start_states, jnp.exp(dA_cs))
  y = (y_diag + y_off).reshape(b, c * L, g, h, p)[:, :t]
  return y, final
