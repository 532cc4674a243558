"""Standalone sliced sub-models equal the masked parent (1e-5, fp32)."""
import chex
import jax
import numpy as np
import pytest

from elastic_jax import apply, count_params, from_counts
from elastic_jax.elastic.params_count import count_leaves
from elastic_jax.elastic.slicing import slice_params
from test_masks import hand_slice

COUNTS = [
    {"hidden": 24, "mamba_heads": 6, "moe_experts": 6, "moe_ffn": 12},
    {"hidden": 16, "mamba_heads": (2, 8), "moe_experts": (4, 8), "moe_ffn": (16, 8)},
]


def _sliced_equals_masked(config, params, tokens, counts):
  """The slice's counts agree with the counter and its logits with the masked parent's."""
  small, small_cfg = slice_params(params, config, counts)
  assert count_leaves(small) == count_params(config, counts).total == count_params(small_cfg).total
  assert count_params(small_cfg).active == count_params(config, counts).active
  masked = apply(params, tokens, from_counts(config, counts), config=config)
  np.testing.assert_allclose(apply(small, tokens, config=small_cfg), masked, rtol=1e-5, atol=1e-5)
  return small, small_cfg


@pytest.mark.parametrize("counts", COUNTS, ids=["homogeneous", "per_layer"])
def test_sliced_equals_masked(cfg, params, tokens, counts):
  _sliced_equals_masked(cfg, params, tokens, counts)


@pytest.mark.parametrize("counts", [{"attention_heads": 2, "mamba_head_dim": 3, "hidden": 24},
                                    {"attention_heads": (2,), "mamba_head_dim": (4, 2),
                                     "mamba_heads": (6, 8)}], ids=["homogeneous", "per_layer"])
def test_query_heads_and_head_dim_slices(cfg_x, params, tokens, counts):
  """The axes beyond the paper slice, count and re-slice like the others."""
  small, small_cfg = _sliced_equals_masked(cfg_x, params, tokens, counts)
  if isinstance(counts["mamba_head_dim"], tuple):
    assert small_cfg.mamba_head_dim_per_layer == (4, 2) and small_cfg.mamba_head_dim == 4
    assert small["layers"]["4"]["mixer"]["out_proj"].shape == (2, 4, 2, 32)
  else:
    assert small_cfg.num_attention_heads == 2 and small_cfg.attention_head_choices == ()
    assert small["layers"]["1"]["mixer"]["q"].shape == (24, 2, 8)


@pytest.mark.parametrize("depth_order", [(), (0, 2, 1, 4, 5, 3)])
def test_depth_slices_keep_the_highest_ranked_layers(cfg_x, params, tokens, depth_order):
  """Depth keeps the layers ranked first (`depth_order`), in pattern order; the masked parent
  (dropped layers' residual branches at 0) equals the sub-model with those layers removed,
  together with per-layer counts of other axes, and the sub-model re-slices like the parent."""
  cfg = cfg_x.replace(depth_order=depth_order)
  counts = {"depth": 4, "hidden": 24, "moe_experts": (6, 4), "mamba_head_dim": (3, 4)}
  small, small_cfg = slice_params(params, cfg, counts)
  kept = (0, 1, 2, 3) if not depth_order else (0, 1, 2, 4)
  assert small_cfg.layer_pattern == "".join(cfg.layer_pattern[i] for i in kept)
  assert small_cfg.num_layers == 4 and small_cfg.depth_choices == ()   # () = all layers
  np.testing.assert_array_equal(small["layers"]["3"]["norm"]["scale"],
                                params["layers"][str(kept[3])]["norm"]["scale"][:24])
  assert count_leaves(small) == count_params(cfg, counts).total == count_params(small_cfg).total
  assert count_params(small_cfg).active == count_params(cfg, counts).active
  masked = apply(params, tokens, from_counts(cfg, counts), config=cfg)
  np.testing.assert_allclose(apply(small, tokens, config=small_cfg), masked, rtol=1e-5, atol=1e-5)
  if depth_order:
    # Ranks survive slicing: layer 4 (rank 3) is now index 3; rank order (0, 2, 1, 3).
    assert small_cfg.depth_order == (0, 2, 1, 3)
    mid, mid_cfg = slice_params(params, cfg, {"depth": 5})
    again, again_cfg = slice_params(mid, mid_cfg, {"depth": 4})
    direct, direct_cfg = slice_params(params, cfg, {"depth": 4})
    assert again_cfg == direct_cfg
    chex.assert_trees_all_equal(again, direct)


def test_matches_hand_slice(cfg, params):
  small, small_cfg = slice_params(params, cfg, COUNTS[0])
  ref, ref_cfg = hand_slice(params, cfg, 24, 6, 6, 12)
  assert small_cfg.replace(hidden_choices=(), mamba_head_choices=(), expert_choices=(),
                           moe_ffn_choices=()) == ref_cfg
  chex.assert_trees_all_equal(jax.tree_util.tree_map(np.asarray, small),
                              jax.tree_util.tree_map(np.asarray, ref))


def test_per_layer_config_and_reslice(cfg, params, tokens):
  small, small_cfg = slice_params(params, cfg, COUNTS[1])
  assert small_cfg.mamba_heads_per_layer == (2, 8) and small_cfg.experts_per_layer == (4, 8)
  assert small_cfg.hidden_choices == (16,)
  # A sliced model can be sliced again, and that equals slicing the parent directly.
  again, again_cfg = slice_params(small, small_cfg, {"mamba_heads": (2, 4)})
  direct, direct_cfg = slice_params(params, cfg, {**COUNTS[1], "mamba_heads": (2, 4)})
  np.testing.assert_allclose(apply(again, tokens, config=again_cfg),
                             apply(direct, tokens, config=direct_cfg), rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="count 6 exceeds the parent's 2"):
    slice_params(small, small_cfg, {"mamba_heads": (6, 8)})


@pytest.mark.parametrize("counts,match", [
    ({"experts": 4}, "unknown axis names \\['experts'\\]; allowed: \\['hidden'"),
    ({"moe_ffn": 10}, "axis 'moe_ffn': count 10 is not one of.*\\[16, 12, 8\\]"),
    ({"mamba_heads": 3}, "axis 'mamba_heads': count 3 is not a multiple"),
    ({"attention_heads": 3}, "axis 'attention_heads': count 3 is not a multiple of num_kv_heads"),
    ({"attention_heads": 2}, "axis 'attention_heads': count 2 is not one of.*\\[4\\]"),
    ({"depth": 5}, "axis 'depth': count 5 is not one of.*\\[6\\]"),
    ({"moe_experts": 16}, "axis 'moe_experts': count 16 exceeds"),
])
def test_bad_counts(cfg, params, counts, match):
  with pytest.raises(ValueError, match=match):
    slice_params(params, cfg, counts)
