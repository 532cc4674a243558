"""A masked forward at a budget equals the forward of the hand-sliced model (1e-5, fp32)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic_jax import BudgetMasks, apply, from_counts
from elastic_jax.elastic.masks import prefix_mask
from elastic_jax.model.norms import gated_group_rms_norm, rms_norm


def hand_slice(params, cfg, d, heads, experts, ffn):
  """Prefix-slices every tensor by name, written out independently of `elastic_jax.elastic.axes`."""
  p = jax.tree_util.tree_map(np.asarray, params)
  hg = heads // cfg.mamba_n_groups
  layers = {}
  for i, kind in enumerate(cfg.layer_pattern):
    layer = p["layers"][str(i)]
    m = layer["mixer"]
    if kind == "M":
      m = {"in_z": m["in_z"][:d, :, :hg], "in_x": m["in_x"][:d, :, :hg], "in_B": m["in_B"][:d],
           "in_C": m["in_C"][:d], "in_dt": m["in_dt"][:d, :, :hg], "conv_x": m["conv_x"][:, :, :hg],
           "conv_x_bias": m["conv_x_bias"][:, :hg], "conv_B": m["conv_B"], "conv_C": m["conv_C"],
           "conv_B_bias": m["conv_B_bias"], "conv_C_bias": m["conv_C_bias"],
           "dt_bias": m["dt_bias"][:, :hg], "A_log": m["A_log"][:, :hg], "D": m["D"][:, :hg],
           "norm": m["norm"][:, :hg], "out_proj": m["out_proj"][:, :hg, :, :d]}
    elif kind == "*":
      m = {"q": m["q"][:d], "k": m["k"][:d], "v": m["v"][:d], "o": m["o"][..., :d]}
    elif kind == "E":
      m = {"router": m["router"][:d, :experts], "router_bias": m["router_bias"][:experts],
           "up": m["up"][:experts, :d, :ffn], "down": m["down"][:experts, :ffn, :d],
           "shared_up": m["shared_up"][:d], "shared_down": m["shared_down"][:, :d]}
    else:
      m = {"up": m["up"][:d], "down": m["down"][:, :d]}
    layers[str(i)] = {"norm": {"scale": layer["norm"]["scale"][:d]}, "mixer": m}
  small = {"embed": p["embed"][:, :d], "layers": layers,
           "final_norm": {"scale": p["final_norm"]["scale"][:d]},
           "lm_head": p["lm_head"][:d]}
  small_cfg = cfg.replace(hidden_size=d, mamba_num_heads=heads, n_routed_experts=experts,
                          moe_intermediate_size=ffn, hidden_choices=(), mamba_head_choices=(),
                          expert_choices=(), moe_ffn_choices=())
  return small, small_cfg


@pytest.mark.parametrize("d,heads,experts,ffn", [(32, 8, 8, 16), (24, 6, 6, 12), (16, 2, 4, 8),
                                                 (32, 4, 8, 8)])
def test_masked_forward_equals_sliced_model(cfg, params, tokens, d, heads, experts, ffn):
  counts = {"hidden": d, "mamba_heads": heads, "moe_experts": experts, "moe_ffn": ffn}
  masked = jax.jit(lambda p, t, m: apply(p, t, m, config=cfg))(params, tokens, from_counts(cfg, counts))
  small, small_cfg = hand_slice(params, cfg, d, heads, experts, ffn)
  ref = apply(small, tokens, config=small_cfg)
  np.testing.assert_allclose(masked, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_heads,head_dim", [(2, 4), (4, 2), (2, 3)])
def test_query_heads_and_head_dim_masks_equal_sliced_model(cfg_x, params, tokens, q_heads,
                                                           head_dim):
  """Query heads per KV group and Mamba head-dim channels: the masked parent equals weights cut
  by hand (query heads stored KV-group-minor: r heads per group are the first r * Hkv)."""
  cfg = cfg_x
  counts = {"attention_heads": q_heads, "mamba_head_dim": head_dim, "mamba_heads": 6}
  masked = apply(params, tokens, from_counts(cfg, counts), config=cfg)
  small, _ = hand_slice(params, cfg, cfg.hidden_size, 6, 8, 16)
  P = head_dim
  for i, kind in enumerate(cfg.layer_pattern):
    m = small["layers"][str(i)]["mixer"]
    if kind == "*":
      m.update(q=m["q"][:, :q_heads], o=m["o"][:q_heads])
    elif kind == "M":
      m.update({k: m[k][..., :P] for k in ("in_z", "in_x", "conv_x", "conv_x_bias", "norm")})
      m["out_proj"] = m["out_proj"][:, :, :P]
  small_cfg = cfg.replace(mamba_num_heads=6, num_attention_heads=q_heads, mamba_head_dim=P,
                          mamba_head_choices=(), attention_head_choices=(),
                          mamba_head_dim_choices=())
  np.testing.assert_allclose(masked, apply(small, tokens, config=small_cfg), rtol=1e-5,
                             atol=1e-5)


def test_full_masks_equal_no_masks(cfg, params, tokens):
  # Two compiled programs (multiplying by ones changes the fusion order): fp32 rounding apart.
  np.testing.assert_allclose(apply(params, tokens, from_counts(cfg, None), config=cfg),
                             apply(params, tokens, config=cfg), atol=2e-5)


def test_per_layer_counts_match_weight_surgery(cfg, params, tokens):
  """Per-layer expert/FFN counts == parent with the dropped experts unselectable and the dropped
  FFN channels zeroed in that layer only (relu^2(0) = 0)."""
  moe_layers = cfg.layers_of("E")
  masks = from_counts(cfg, {"moe_experts": (4, 8), "moe_ffn": (16, 8)})
  p = jax.tree_util.tree_map(np.array, params)
  first, second = (p["layers"][str(i)]["mixer"] for i in moe_layers)
  first["router_bias"][4:] = -1e9
  second["up"][:, :, 8:] = 0.0
  np.testing.assert_allclose(apply(params, tokens, masks, config=cfg),
                             apply(p, tokens, config=cfg), rtol=1e-5, atol=1e-5)


def test_mask_shapes(cfg):
  m = from_counts(cfg, {"mamba_heads": (4, 6), "hidden": 24})
  assert m.hidden.shape == (32,) and float(m.hidden.sum()) == 24
  assert m.mamba_heads.shape == (2, 2, 4)
  np.testing.assert_array_equal(m.mamba_heads[0], [[1, 1, 0, 0]] * 2)
  np.testing.assert_array_equal(m.mamba_heads[1], [[1, 1, 1, 0]] * 2)
  assert m.moe_experts.shape == (2, 8) and m.moe_ffn.shape == (2, 16)
  assert m.attention_heads.shape == (1, 4) and m.mamba_head_dim.shape == (2, 4)
  assert m.depth.shape == (6,)
  leaves = jax.tree_util.tree_leaves(m)
  assert len(leaves) == 7  # a plain pytree of arrays, one per axis


def test_depth_mask_keeps_the_layers_ranked_first(cfg_x):
  cfg = cfg_x.replace(depth_order=(0, 2, 1, 4, 5, 3))
  np.testing.assert_array_equal(from_counts(cfg, {"depth": 4}).depth, [1, 1, 1, 0, 1, 0])
  np.testing.assert_array_equal(from_counts(cfg, {"depth": 5}).depth, [1, 1, 1, 0, 1, 1])
  np.testing.assert_array_equal(from_counts(cfg_x, {"depth": 4}).depth, [1, 1, 1, 1, 0, 0])
  with pytest.raises(ValueError, match="depth_order: must list every layer index 0..5 once"):
    cfg_x.replace(depth_order=(0, 1, 2, 3, 4, 4))


@pytest.mark.parametrize("counts,match", [
    ({"width": 3}, "unknown axis names \\['width'\\]"),
    ({"hidden": 20}, "axis 'hidden': count 20 is not one of.*\\[32, 24, 16\\]"),
    ({"hidden": 64}, "axis 'hidden': count 64 exceeds the parent's 32"),
    ({"mamba_heads": 5}, "axis 'mamba_heads': count 5 is not a multiple of mamba_n_groups=2"),
    ({"moe_experts": (8,)}, "per-layer counts need 2 values"),
    ({"hidden": (32, 24)}, "takes one count for the whole model"),
    ({"moe_ffn": 12.5}, "count must be an int"),
])
def test_bad_counts(cfg, counts, match):
  with pytest.raises(ValueError, match=match):
    from_counts(cfg, counts)


def test_masked_rms_norm_equals_norm_over_kept():
  x = jax.random.normal(jax.random.PRNGKey(0), (3, 10))
  w = jax.random.normal(jax.random.PRNGKey(1), (10,))
  m = prefix_mask(6, 10)
  out = rms_norm(x * m, w, 1e-5, m)
  np.testing.assert_allclose(out[:, :6], rms_norm(x[:, :6], w[:6], 1e-5), rtol=1e-6)
  np.testing.assert_array_equal(out[:, 6:], 0.0)
  # Scaling a hard mask (router probability) scales the output, not the statistic.
  np.testing.assert_allclose(rms_norm(x * m, w, 1e-5, 0.3 * m), 0.3 * out, rtol=1e-5)


def test_masked_gated_norm_equals_norm_over_kept_heads():
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  y, z = jax.random.normal(k[0], (2, 3, 2, 4, 5)), jax.random.normal(k[1], (2, 3, 2, 4, 5))
  w = jax.random.normal(k[2], (2, 4, 5))
  hm = jnp.broadcast_to(prefix_mask(3, 4), (2, 4))
  out = gated_group_rms_norm(y, z, w, 1e-5, hm)
  ref = gated_group_rms_norm(y[:, :, :, :3], z[:, :, :, :3], w[:, :3], 1e-5)
  np.testing.assert_allclose(out[:, :, :, :3], ref, rtol=1e-5, atol=2e-5)  # two compiled programs: fusion order differs
  np.testing.assert_array_equal(out[:, :, :, 3:], 0.0)


def test_budget_masks_is_pytree():
  m = BudgetMasks(hidden=jnp.ones(4))
  assert jax.tree_util.tree_map(lambda a: a * 2, m).hidden.sum() == 8
