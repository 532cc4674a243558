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


@pytest.mark.parametrize("counts", COUNTS, ids=["homogeneous", "per_layer"])
def test_sliced_equals_masked(cfg, params, tokens, counts):
  small, small_cfg = slice_params(params, cfg, counts)
  assert count_leaves(small) == count_params(cfg, counts).total == count_params(small_cfg).total
  assert count_params(small_cfg).active == count_params(cfg, counts).active
  masked = apply(params, tokens, from_counts(cfg, counts), config=cfg)
  np.testing.assert_allclose(apply(small, tokens, config=small_cfg), masked, rtol=1e-5, atol=1e-5)


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
    ({"moe_experts": 16}, "axis 'moe_experts': count 16 exceeds"),
])
def test_bad_counts(cfg, params, counts, match):
  with pytest.raises(ValueError, match=match):
    slice_params(params, cfg, counts)
