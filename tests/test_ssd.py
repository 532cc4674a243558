"""Chunked SSD vs the sequential scan: values, final state, initial state and gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic_jax.model.ssd import ssd_chunked, ssd_sequential

B, G, H, P, N = 2, 2, 3, 4, 5


def _inputs(T, key=0):
  ks = jax.random.split(jax.random.PRNGKey(key), 6)
  x = jax.random.normal(ks[0], (B, T, G, H, P))
  dt = jax.nn.softplus(jax.random.normal(ks[1], (B, T, G, H)) - 1.0)
  A = -jnp.exp(jax.random.normal(ks[2], (G, H)))
  Bm = jax.random.normal(ks[3], (B, T, G, N))
  Cm = jax.random.normal(ks[4], (B, T, G, N))
  s0 = jax.random.normal(ks[5], (B, G, H, P, N))
  return x, dt, A, Bm, Cm, s0


@pytest.mark.parametrize("T,chunk", [(1, 4), (8, 4), (13, 4), (13, 16)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_matches_sequential(T, chunk, with_state):
  x, dt, A, Bm, Cm, s0 = _inputs(T)
  s0 = s0 if with_state else None
  y_ref, f_ref = ssd_sequential(x, dt, A, Bm, Cm, s0)
  y, f = ssd_chunked(x, dt, A, Bm, Cm, chunk, s0)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(f, f_ref, rtol=1e-5, atol=1e-5)


def test_gradients_match():
  x, dt, A, Bm, Cm, s0 = _inputs(11, key=3)
  w = jax.random.normal(jax.random.PRNGKey(9), (B, 11, G, H, P))

  def loss(fn, *args):
    y, f = fn(*args)
    return jnp.sum(y * w) + jnp.sum(f)

  g_ref = jax.grad(lambda *a: loss(ssd_sequential, *a), argnums=(0, 1, 2, 3, 4, 5))(
      x, dt, A, Bm, Cm, s0)
  g = jax.grad(lambda *a: loss(lambda *b: ssd_chunked(*b[:5], 4, b[5]), *a),
               argnums=(0, 1, 2, 3, 4, 5))(x, dt, A, Bm, Cm, s0)
  for a, b in zip(g, g_ref):
    assert np.all(np.isfinite(a))
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_document_starts_reset_the_state():
  """With document starts, chunked == sequential (values, final state, gradients), and both
  equal each document scanned alone from a zero state (the first keeps the initial state)."""
  T = 13
  x, dt, A, Bm, Cm, s0 = _inputs(T, key=5)
  starts = np.zeros((B, T), bool)
  starts[0, [0, 5, 6, 11]] = True    # a one-token document, one across a chunk edge
  starts[1, [3, 8]] = True
  starts = jnp.asarray(starts)
  y_ref, f_ref = ssd_sequential(x, dt, A, Bm, Cm, s0, starts_BT=starts)
  y, f = ssd_chunked(x, dt, A, Bm, Cm, 4, s0, starts_BT=starts)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(f, f_ref, rtol=1e-5, atol=1e-5)
  for b in range(B):
    edges = [0] + [int(t) for t in np.flatnonzero(starts[b]) if t] + [T]
    for lo, hi in zip(edges[:-1], edges[1:]):
      init = s0[b:b + 1] if lo == 0 and not starts[b, 0] else None
      part = lambda a: a[b:b + 1, lo:hi]
      y_doc, f_doc = ssd_sequential(part(x), part(dt), A, part(Bm), part(Cm), init)
      np.testing.assert_allclose(y[b:b + 1, lo:hi], y_doc, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f[b:b + 1], f_doc, rtol=1e-5, atol=1e-5)
  w = jax.random.normal(jax.random.PRNGKey(9), y.shape)
  loss = lambda fn: lambda *a: jnp.sum(fn(*a)[0] * w) + jnp.sum(fn(*a)[1])
  g_ref = jax.grad(loss(lambda *a: ssd_sequential(*a, starts_BT=starts)), argnums=(0, 1, 2))(
      x, dt, A, Bm, Cm, s0)
  g = jax.grad(loss(lambda *a: ssd_chunked(*a[:5], 4, a[5], starts_BT=starts)),
               argnums=(0, 1, 2))(x, dt, A, Bm, Cm, s0)
  for a, b in zip(g, g_ref):
    assert np.all(np.isfinite(a))
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
