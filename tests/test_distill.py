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


def test_elastic_loss_hard_straight_through_branch(cfg, params, tokens):
  """hard_prob = 1: the student runs the sampled architecture exactly (KD equals the sliced
  sub-model's, recomputed from the same Gumbel draw), and the router still gets KD gradients
  through the straight-through estimator (budget loss off)."""
  rc = R.RouterConfig(hidden=16)
  rp = R.init(cfg, rc, jax.random.PRNGKey(0))
  teacher = apply(params, tokens, config=cfg)
  key, step, total, onehot = jax.random.PRNGKey(0), 10, 100, R.budget_onehot(cfg, "small")

  def f(r, hard_prob):
    return elastic_loss(params, r, teacher, tokens, onehot, 0.5, step, total, key, config=cfg,
                        rc=rc, budget_weight=0.0, hard_prob=hard_prob)

  loss, metrics = jax.jit(f, static_argnums=1)(rp, 1.0)
  lg = R.logits(rp, onehot, cfg, rc)
  _, k_sample = jax.random.split(key)
  sample = {n: jax.nn.one_hot(jnp.argmax(R.gumbel_softmax(
      l * R.logit_scale(step, total, rc), R.temperature(step, rc), k), -1), l.shape[-1])
      for (n, l), k in zip(lg.items(), jax.random.split(k_sample, len(lg)))}
  small, small_cfg = slice_params(params, cfg, R.argmax_counts(sample, cfg))
  np.testing.assert_allclose(metrics["kd"], forward_kl(teacher, apply(small, tokens,
                                                                      config=small_cfg)),
                             rtol=1e-4, atol=1e-6)
  soft_kd = jax.jit(f, static_argnums=1)(rp, 0.0)[1]["kd"]
  assert abs(float(soft_kd) - float(metrics["kd"])) > 1e-4   # the branch changes the student
  g = jax.grad(lambda r: f(r, 1.0)[0])(rp)
  assert max(float(jnp.abs(x).max()) for x in jax.tree_util.tree_leaves(g)) > 0


def test_chunked_kd_equals_one_shot(cfg, params, tokens):
  """The KD term from hidden states, 4 tokens at a time (13 tokens: a padded last chunk), equals
  forward_kl of the full logits, in value and in the gradients of the student's params and
  router (fp32); the teacher differs from the student so the KL is not ~0."""
  import chex
  from elastic_jax.model.model import apply_hidden
  from elastic_jax.training.distill import chunked_forward_kl
  teacher = jax.tree_util.tree_map(lambda x: x * 1.1, params)
  hidden_t = apply_hidden(teacher, tokens, config=cfg)
  np.testing.assert_allclose(
      chunked_forward_kl(hidden_t, apply_hidden(params, tokens, config=cfg), teacher["lm_head"],
                         params["lm_head"], cfg, 4),
      forward_kl(apply(teacher, tokens, config=cfg), apply(params, tokens, config=cfg)),
      rtol=1e-5)
  rc = R.RouterConfig(hidden=16)
  rp = R.init(cfg, rc, jax.random.PRNGKey(0))
  onehot = R.budget_onehot(cfg, "small")

  def loss(p, r, chunk):
    t = hidden_t if chunk else apply(teacher, tokens, config=cfg)
    return elastic_loss(p, r, t, tokens, onehot, 0.5, 10, 100, jax.random.PRNGKey(1), config=cfg,
                        rc=rc, teacher_lm_head=teacher["lm_head"], kd_chunk=chunk)[0]

  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)
  (v4, g4), (v0, g0) = grad(params, rp, 4), grad(params, rp, 0)
  np.testing.assert_allclose(v4, v0, rtol=1e-6)
  chex.assert_trees_all_close(g4, g0, rtol=1e-5, atol=1e-6)
  assert float(v0) > 1e-3


def test_kd_chunk_must_be_a_count(cfg):
  import pytest
  from elastic_jax.training import phases
  with pytest.raises(ValueError, match="elastic.kd_chunk must be an int >= 0"):
    phases.elastic_step_loss(cfg, R.RouterConfig(hidden=4), 10, kd_chunk=-1)


def test_chunked_lm_loss_equals_one_shot(cfg, params, tokens):
  """Next-token cross-entropy from hidden states, 4 tokens at a time (12 targets, then 13: a
  padded last chunk), equals the one-shot loss in value and gradients (fp32)."""
  import chex
  from elastic_jax.training import phases
  for rows in (tokens, tokens[:, :-1]):
    grad = jax.jit(jax.value_and_grad(phases.lm_loss), static_argnums=(2, 4))
    (v4, g4), (v0, g0) = grad(params, rows, cfg, None, 4), grad(params, rows, cfg, None, 0)
    np.testing.assert_allclose(v4, v0, rtol=1e-6)
    chex.assert_trees_all_close(g4, g0, rtol=1e-5, atol=1e-6)


def test_chunked_losses_hold_no_full_logits(cfg):
  """Compiled temporaries of the loss + its gradient from hidden states (V = 8192): one-shot
  ones hold several [B, T, V] logits; chunked ones hold a few chunks' logits, whatever T."""
  from elastic_jax.training.distill import chunked_cross_entropy, chunked_forward_kl
  D, V, B = cfg.hidden_size, 8192, 2
  big = cfg.replace(vocab_size=V)
  head = jax.ShapeDtypeStruct((D, V), jnp.float32)

  def temp(f, T):
    h = jax.ShapeDtypeStruct((B, T, D), jnp.float32)
    y = jax.ShapeDtypeStruct((B, T), jnp.int32)
    return jax.jit(jax.grad(f, argnums=(0, 1))).trace(h, head, h, y).lower().compile(
        ).memory_analysis().temp_size_in_bytes

  ce = lambda chunk: lambda h, w, t, y: chunked_cross_entropy(h, w, y, big, chunk)
  kl = lambda chunk: lambda h, w, t, y: chunked_forward_kl(t, h, w, w, big, chunk)
  logits = B * 512 * V * 4
  for f in (ce, kl):
    one_shot = temp(f(512), 512)                           # one chunk = the whole sequence
    chunked = temp(f(64), 512)
    assert one_shot > logits and chunked < one_shot / 4
    assert temp(f(64), 1024) < 1.1 * chunked               # flat in T (inputs aside)
