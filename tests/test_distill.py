"""KD losses: KL reference, masked-at-hard-masks equals sliced, elastic loss gradients."""
import jax
import jax.numpy as jnp
import numpy as np

from elastic_jax import apply
from elastic_jax.elastic import router as R
from elastic_jax.training.distill import elastic_loss, forward_kl
from elastic_jax.elastic.slicing import slice_params


def test_forward_kl_reference():
  rs = np.random.RandomState(0)
  t, s = rs.randn(2, 3, 7).astype(np.float32), rs.randn(2, 3, 7).astype(np.float32)
  p = np.exp(t) / np.exp(t).sum(-1, keepdims=True)
  q = np.exp(s) / np.exp(s).sum(-1, keepdims=True)
  ref = np.mean(np.sum(p * (np.log(p) - np.log(q)), -1))
  np.testing.assert_allclose(forward_kl(t, s), ref, rtol=1e-5)
  assert float(forward_kl(t, t)) == 0.0
  w = np.array([[1, 0, 0], [0, 0, 0]], np.float32)
  np.testing.assert_allclose(forward_kl(t, s, w), np.sum(p[0, 0] * np.log(p[0, 0] / q[0, 0])), rtol=1e-5)


def test_masked_kd_at_hard_masks_equals_sliced(cfg, params, tokens):
  teacher = apply(params, tokens, config=cfg)
  pi = {"hidden": jnp.array([[0.0, 1.0, 0.0]]), "mamba_heads": jnp.array([[0.0, 0.0, 1.0, 0.0]]),
        "moe_experts": jnp.array([[0.0, 1.0, 0.0]] * 2), "moe_ffn": jnp.array([[0.0, 0.0, 1.0]])}
  masked = forward_kl(teacher, apply(params, tokens, R.masks_from_probs(pi, cfg, "inference"),
                                     config=cfg))
  small, small_cfg = slice_params(params, cfg, R.argmax_counts(pi, cfg))
  sliced = forward_kl(teacher, apply(small, tokens, config=small_cfg))
  assert float(masked) > 0
  np.testing.assert_allclose(masked, sliced, rtol=1e-5)


def test_elastic_loss_gradients(cfg, params, tokens):
  rc = R.RouterConfig(hidden=16)
  rp = R.init(cfg, rc, jax.random.PRNGKey(0))
  teacher = apply(params, tokens, config=cfg)
  f = jax.jit(lambda p, r, key: elastic_loss(p, r, teacher, tokens, R.budget_onehot(cfg, "small"),
                                             0.5, 10, 100, key, config=cfg, rc=rc))
  loss, metrics = f(params, rp, jax.random.PRNGKey(1))
  assert np.isfinite(float(loss)) and float(metrics["kd"]) >= 0
  g_model, g_router = jax.grad(lambda p, r: f(p, r, jax.random.PRNGKey(1))[0], argnums=(0, 1))(
      params, rp)
  for g in (g_model, g_router):
    leaves = jax.tree_util.tree_leaves(g)
    assert all(np.all(np.isfinite(x)) for x in leaves)
    assert any(np.any(x != 0) for x in leaves)
