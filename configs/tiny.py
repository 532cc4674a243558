"""Tiny CPU default (< 2M params) with the parent's structure: all three block types."""
from configs import training
from elastic_jax.config import ModelConfig

MODEL = ModelConfig(
    layer_pattern="MEM*EM*E",
    hidden_size=96,
    vocab_size=1024,
    num_attention_heads=4, num_kv_heads=2, head_dim=16,
    mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, mamba_n_groups=2, conv_kernel=4,
    chunk_size=16,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=96,
    moe_shared_expert_intermediate_size=192, routed_scaling_factor=2.5,
    hidden_choices=(96, 80, 64, 48),
    mamba_head_choices=(8, 6, 4),
    expert_choices=(8, 6, 4),
    moe_ffn_choices=(96, 80, 64, 48),
    budgets=(("full", 1.0), ("medium", 0.78), ("small", 0.56)),
)


def get_config():
  """The whole run: `model` (ModelConfig fields) plus the training sections."""
  cfg = training.defaults()
  cfg.model = MODEL.to_dict()
  return cfg
