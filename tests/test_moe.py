"""MoE routing against a numpy reference; dense vs ragged vs gather dispatch (values, gradients)."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic_jax.model import moe as moe_lib


def _moe_params(params, cfg):
  return params["layers"][str(cfg.layer_pattern.index("E"))]["mixer"]


def test_route_reference(cfg, params):
  p = jax.tree_util.tree_map(np.asarray, _moe_params(params, cfg))
  x = np.random.RandomState(0).randn(9, cfg.hidden_size).astype(np.float32)
  gates, idx = moe_lib.route(p, jnp.asarray(x), cfg)
  s = 1 / (1 + np.exp(-(x @ p["router"])))
  for t in range(9):
    top = np.argsort(-(s[t] + p["router_bias"]))[:cfg.num_experts_per_tok]
    assert set(np.asarray(idx[t])) == set(top)
    g = s[t, np.asarray(idx[t])]
    np.testing.assert_allclose(gates[t], g / g.sum() * cfg.routed_scaling_factor, rtol=1e-5)


def test_masked_experts_never_selected(cfg, params):
  p = _moe_params(params, cfg)
  x = jax.random.normal(jax.random.PRNGKey(0), (64, cfg.hidden_size))
  mask = (jnp.arange(cfg.n_routed_experts) < 4).astype(jnp.float32)
  _, idx = moe_lib.route(p, x, cfg, mask)
  assert int(idx.max()) < 4


def test_mask_gradient_is_finite_and_reaches_kept_experts(cfg, params):
  """A mask scaled by a router probability: finite gradients (no log(0) NaN from the selection),
  the mask's gradient on kept experts only."""
  p = _moe_params(params, cfg)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 7, cfg.hidden_size))
  em = 0.7 * (jnp.arange(cfg.n_routed_experts) < 6).astype(jnp.float32)
  g = jax.grad(lambda p, m: jnp.sum(moe_lib.moe(p, x, cfg, m)[0] ** 2), argnums=(0, 1))(p, em)
  assert all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree_util.tree_leaves(g))
  assert np.all(np.asarray(g[1][6:]) == 0) and np.any(np.asarray(g[1][:6]) != 0)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("impl", ["ragged", "gather"])
def test_dense_equals_sparse_dispatch(cfg, params, masked, impl):
  p = _moe_params(params, cfg)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 7, cfg.hidden_size))
  em = (jnp.arange(8) < 6).astype(jnp.float32) if masked else None
  fm = (jnp.arange(16) < 12).astype(jnp.float32) if masked else None

  def f(impl):
    return lambda p, x: jnp.sum(moe_lib.moe(p, x, cfg, em, fm, impl=impl)[0] ** 2)

  np.testing.assert_allclose(moe_lib.moe(p, x, cfg, em, fm, impl="dense")[0],
                             moe_lib.moe(p, x, cfg, em, fm, impl=impl)[0], rtol=1e-5, atol=1e-5)
  gd = jax.grad(f("dense"), argnums=(0, 1))(p, x)
  gr = jax.grad(f(impl), argnums=(0, 1))(p, x)
  chex.assert_trees_all_close(gd, gr, rtol=1e-4, atol=1e-5)


def test_bad_impl(cfg, params):
  with pytest.raises(ValueError, match="moe impl must be one of"):
    moe_lib.moe(_moe_params(params, cfg), jnp.zeros((1, 2, cfg.hidden_size)), cfg, impl="sparse")
