"""MoE routing against a numpy reference; dense vs ragged vs gather dispatch (values, gradients)."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

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


@pytest.mark.parametrize("mesh_spec, batch_axes", [
    ("fsdp:2,tensor:2,expert:2", ("data", "fsdp")),      # tokens repeated on each expert shard
    ("data:2,expert:4", ("data", "expert")),             # tokens split over experts too
])
def test_expert_parallel_equals_one_device(cfg, params, mesh_spec, batch_axes):
  """impl "ep" on 8 host devices (experts split over `expert`, weights FSDP / tensor sharded):
  values and gradients equal the single-device dense MoE (fp32), experts and width masked."""
  from elastic_jax.parallel import mesh as mesh_lib
  from elastic_jax.parallel import sharding as shd
  from elastic_jax.parallel.rules import DEFAULT_RULES
  mesh = mesh_lib.make_mesh(mesh_spec)
  rules = tuple((n, batch_axes) if n == "batch" else (n, a) for n, a in DEFAULT_RULES)
  p = _moe_params(params, cfg)
  x = jax.random.normal(jax.random.PRNGKey(2), (8, 5, cfg.hidden_size))
  em = (jnp.arange(cfg.n_routed_experts) < 6).astype(jnp.float32)
  fm = (jnp.arange(cfg.moe_intermediate_size) < 12).astype(jnp.float32)

  def loss(impl):
    def f(p, x):
      out = moe_lib.moe(p, x, cfg, em, fm, impl=impl)[0]
      return jnp.sum(out * jnp.cos(out)), out
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))

  (want_l, want), want_g = loss("dense")(p, x)
  specs = {"router": P(), "router_bias": P(), "up": P("expert", "fsdp", "tensor"),
           "down": P("expert", "tensor", "fsdp"), "shared_up": P("fsdp", "tensor"),
           "shared_down": P("tensor", "fsdp")}
  put = lambda a, spec: jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))
  sp = {k: put(v, P(*(a if a in mesh.axis_names and mesh.shape[a] > 1 else None for a in specs[k])))
        for k, v in p.items()}
  sx = put(x, P(batch_axes))
  with shd.activation_context(mesh, rules):
    (got_l, got), got_g = loss("ep")(sp, sx)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
  # Within 1e-5 of each gradient's own scale (fp32 sums in another order).
  for g, w in zip(jax.tree.leaves(jax.device_get(got_g)), jax.tree.leaves(want_g)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()))
  # Outside a mesh with an expert axis, "ep" is the single-device ragged path.
  np.testing.assert_allclose(moe_lib.moe(p, x, cfg, em, fm, impl="ep")[0], want, rtol=1e-5,
                             atol=1e-5)
