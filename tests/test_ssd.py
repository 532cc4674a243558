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
