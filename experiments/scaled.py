"""Shared shapes for the experiments: a scaled Nemotron 3 Nano (all 52 layers, widths / 8,
experts / 4) or a small reduced shape, and 30B / 23B / 12B-like budgets on their choices."""
from __future__ import annotations


def scaled_config(reduced: bool):
  """The scaled nano_v3 `ModelConfig` (bf16), or a 10-layer fp32 shape for quick runs."""
  from configs.nano_v3 import MODEL
  if reduced:
    return MODEL.replace(
        layer_pattern="MEM*EMEM*E", hidden_size=128, vocab_size=2048, num_attention_heads=8,
        head_dim=16, mamba_num_heads=16, mamba_head_dim=8, ssm_state_size=16,
        n_routed_experts=16, moe_intermediate_size=128, moe_shared_expert_intermediate_size=256,
        hidden_choices=(128, 96), mamba_head_choices=(16, 8), expert_choices=(16, 8),
        moe_ffn_choices=(128, 96, 64), param_dtype="float32", compute_dtype="float32")
  return MODEL.replace(
      hidden_size=336, vocab_size=16384, num_attention_heads=32, head_dim=16,
      mamba_head_dim=8, ssm_state_size=16, n_routed_experts=32, moe_intermediate_size=232,
      moe_shared_expert_intermediate_size=464,
      hidden_choices=(336, 288, 256), mamba_head_choices=(64, 56, 48), expert_choices=(32, 24, 16),
      moe_ffn_choices=(232, 200, 160))


def paper_like_budgets(cfg) -> dict:
  """{"30B-like": full, "23B-like": every axis at its second choice, "12B-like": at its last}."""
  axes = {"hidden": cfg.hidden_choices, "mamba_heads": cfg.mamba_head_choices,
          "moe_experts": cfg.expert_choices, "moe_ffn": cfg.moe_ffn_choices}
  return {"30B-like": {}, "23B-like": {n: c[min(1, len(c) - 1)] for n, c in axes.items()},
          "12B-like": {n: c[-1] for n, c in axes.items()}}


def random_params(cfg, seed: int = 0):
  """Random weights of `cfg` drawn with numpy (seconds, where `init` compiles a random op per
  leaf shape): normal(0, 0.02) matrices, unit norms and D, `init`'s A_log; for speed runs."""
  import jax
  import numpy as np
  from elastic_jax import param_shapes
  rs = np.random.RandomState(seed)

  def leaf(path, s):
    name = jax.tree_util.keystr(path)
    if "norm" in name or "'D'" in name:
      x = np.ones(s.shape)
    elif "A_log" in name:
      x = np.log(np.arange(1, np.prod(s.shape) + 1)).reshape(s.shape)
    elif "bias" in name:
      x = np.zeros(s.shape)
    else:
      x = rs.normal(0, 0.02, s.shape)
    return jax.numpy.asarray(x, s.dtype)

  return jax.tree_util.tree_map_with_path(leaf, param_shapes(cfg))
