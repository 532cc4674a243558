"""Exact parameter counter: Nemotron 3 Nano numbers, leaf counts, sliced models, gradients."""
import jax
import jax.numpy as jnp
import pytest

from configs import model_config
from elastic_jax import count_params, init, param_shapes
from elastic_jax.elastic.params_count import count_leaves
from test_masks import hand_slice


def test_nano_v3_reproduces_published_sizes():
  c = model_config("nano_v3")
  pc = count_params(c)
  assert round(pc.total / 1e9, 2) == 31.58
  assert round(pc.active / 1e9, 2) == 3.58
  assert round(pc.active_without_embedding / 1e9, 2) == 3.23
  assert pc.total == count_leaves(jax.eval_shape(lambda k: init(c, k), jax.random.PRNGKey(0)))


def test_nano_v3_closed_form():
  """Per-block formulas written out by hand from METHOD.md section 1."""
  D, V = 2688, 131072
  mamba = D * (2 * 4096 + 2 * 8 * 128 + 64) + (4096 + 2048) * 5 + 3 * 64 + 4096 + 4096 * D + D
  attn = D * 4096 * 2 + 2 * D * 256 + D
  expert = 2 * D * 1856
  moe_fixed = D * 128 + 128 + 2 * D * 3712 + D
  total = 2 * V * D + D + 23 * mamba + 6 * attn + 23 * (moe_fixed + 128 * expert)
  active = 2 * V * D + D + 23 * mamba + 6 * attn + 23 * (moe_fixed + 6 * expert)
  pc = count_params(model_config("nano_v3"))
  assert (pc.total, pc.active) == (total, active)


def test_tiny_under_2m():
  c = model_config("tiny")
  assert count_params(c).total == count_leaves(param_shapes(c)) < 2_000_000


@pytest.mark.parametrize("d,heads,experts,ffn", [(24, 6, 6, 12), (16, 2, 4, 8)])
def test_counter_matches_sliced_leaves(cfg, params, d, heads, experts, ffn):
  counts = {"hidden": d, "mamba_heads": heads, "moe_experts": experts, "moe_ffn": ffn}
  small, small_cfg = hand_slice(params, cfg, d, heads, experts, ffn)
  pc = count_params(cfg, counts)
  assert pc.total == count_leaves(small) == count_params(small_cfg).total
  assert pc.active == count_params(small_cfg).active


def test_per_layer_counts(cfg):
  base = count_params(cfg)
  one = count_params(cfg, {"moe_experts": (4, 8)})
  per_expert = 2 * cfg.hidden_size * cfg.moe_intermediate_size
  router_per_expert = cfg.hidden_size + 1
  assert base.total - one.total == 4 * (per_expert + router_per_expert)
  assert base.active - one.active == 4 * router_per_expert  # top-k experts stay active


def test_differentiable_in_expected_sizes(cfg):
  def active(d):
    return count_params(cfg, {"hidden": d, "moe_ffn": 12.0}, validate=False).active

  g = jax.grad(active)(jnp.float32(24.0))
  assert g > 0
  eps = 1.0
  fd = (active(24.0 + eps) - active(24.0 - eps)) / (2 * eps)
  assert float(g) == pytest.approx(float(fd), rel=1e-4)


def test_memory_counter(cfg):
  from elastic_jax.elastic.params_count import count_memory
  w = count_params(cfg).total
  assert count_memory(cfg, weight_format="nvfp4", seq_len=0, batch=0) == w * 0.5625
  # One attention layer, 2 KV heads x 8; two Mamba layers of 8 heads x 4, state 8, 2 groups.
  kv = 2 * 3 * 10 * 2 * 8 * 2.0
  ssm = 2 * 3 * (32 * 8 * 4.0 + (32 + 32) * 3 * 2.0)
  assert count_memory(cfg, batch=3, seq_len=10) == pytest.approx(w * 2 + kv + ssm)
  smaller = count_memory(cfg, {"mamba_heads": 4}, batch=3, seq_len=10)
  assert smaller < count_memory(cfg, batch=3, seq_len=10)
  g = jax.grad(lambda h: count_memory(cfg, {"mamba_heads": h}, batch=3, seq_len=10,
                                      validate=False))(jnp.float32(6.0))
  assert g > 0
  with pytest.raises(ValueError, match="weight_format"):
    count_memory(cfg, weight_format="int3")
