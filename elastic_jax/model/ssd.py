"""Mamba-2 state-space duality (SSD) scan: chunked (pure jnp) and a sequential reference.

Shapes: x [B,T,G,H,P] (heads stored per group), dt [B,T,G,H] (after softplus), A [G,H] (negative),
Bm/Cm [B,T,G,N] shared by the heads of a group, state [B,G,H,P,N]. All math in fp32.
Recurrence: h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,  y_t = h_t C_t  (D skip added by caller).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def ssd_sequential(x, dt, A, Bm, Cm, initial_state=None, starts_BT=None):
  """Reference: one step per token with `lax.scan`. Returns (y [B,T,G,H,P], final state).
  `starts_BT`: True where a document begins; the state before it is dropped (decay 0)."""
  b, _, g, h, p = x.shape
  n = Bm.shape[-1]
  f32 = jnp.float32
  state0 = (jnp.zeros((b, g, h, p, n), f32) if initial_state is None
            else initial_state.astype(f32))

  def step(state, inp):
    x_t, dt_t, b_t, c_t, keep_t = inp
    decay = (jnp.exp(dt_t * A) * keep_t[:, None, None])[..., None, None]
    state = decay * state + jnp.einsum("bghp,bgn->bghpn", x_t * dt_t[..., None], b_t)
    return state, jnp.einsum("bghpn,bgn->bghp", state, c_t)

  keep = (jnp.ones(dt.shape[:2], f32) if starts_BT is None
          else 1.0 - starts_BT.astype(f32))
  xs = tuple(jnp.moveaxis(a.astype(f32), 1, 0) for a in (x, dt, Bm, Cm, keep))
  final, y = jax.lax.scan(step, state0, xs)
  return jnp.moveaxis(y, 0, 1), final


def ssd_chunked(x, dt, A, Bm, Cm, chunk_size: int, initial_state=None, starts_BT=None):
  """Chunked SSD: quadratic attention-like form inside chunks, a scan over chunk states.

  Pads T to a multiple of `chunk_size` with dt = 0 (identity steps), so the final state is exact.
  Returns (y [B,T,G,H,P] fp32, final state [B,G,H,P,N] fp32). `starts_BT`: True where a
  document begins: no decay path crosses it (within a chunk, source and target must lie after
  the same number of the chunk's starts; the chunk's state carries in only up to its first).
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
  if starts_BT is not None:
    # k[l]: document starts among the chunk's positions <= l; a path s -> l needs k[s] == k[l].
    k = jnp.cumsum(jnp.pad(starts_BT, [(0, 0), (0, pad)]).reshape(b, c, L), axis=2)
    causal = causal & (k[:, :, :, None] == k[:, :, None, :])[..., None, None]
  seg = dA_cs[:, :, :, None] - dA_cs[:, :, None, :]       # [b,c,l,s,g,h]
  decay = jnp.exp(jnp.where(causal, seg, -jnp.inf))
  CB = jnp.einsum("bclgn,bcsgn->bclsg", Cm, Bm)
  y_diag = jnp.einsum("bclsg,bclsgh,bcsghp->bclghp", CB, decay, xdt)

  # Each chunk's contribution to the state at its end.
  decay_to_end = jnp.exp(dA_cs[:, :, -1:] - dA_cs)        # [b,c,L,g,h]
  chunk_decay = jnp.exp(dA_cs[:, :, -1])                  # [b,c,g,h]
  decay_in = jnp.exp(dA_cs)                               # carried state -> position l
  if starts_BT is not None:
    decay_to_end = decay_to_end * (k == k[:, :, -1:])[..., None, None]
    chunk_decay = chunk_decay * (k[:, :, -1] == 0)[..., None, None]
    decay_in = decay_in * (k == 0)[..., None, None]
  chunk_states = jnp.einsum("bclgn,bclgh,bclghp->bcghpn", Bm, decay_to_end, xdt)

  state0 = (jnp.zeros((b, g, h, p, n), f32) if initial_state is None
            else initial_state.astype(f32))

  def step(state, inp):
    cd, cs = inp
    return cd[..., None, None] * state + cs, state        # carry end state, emit start state

  final, start_states = jax.lax.scan(
      step, state0, (jnp.moveaxis(chunk_decay, 1, 0), jnp.moveaxis(chunk_states, 1, 0)))
  start_states = jnp.moveaxis(start_states, 0, 1)         # [b,c,g,h,p,n]
  y_off = jnp.einsum("bclgn,bcghpn,bclgh->bclghp", Cm, start_states, decay_in)
  y = (y_diag + y_off).reshape(b, c * L, g, h, p)[:, :t]
  return y, final
