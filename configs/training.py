"""Training-run defaults shared by every preset (ml_collections; override with
`--config.<section>.<field>=value` on the `elastic_jax.train` command line)."""
import ml_collections

from elastic_jax.parallel.rules import DEFAULT_RULES
from elastic_jax.quant.tree import DEFAULT_LEAVES


def defaults() -> ml_collections.ConfigDict:
  """Sections: data, pretrain (the parent), elastic (KD + router), router, quant (quantized
  family), eval, checkpoint, parallel (device mesh and logical-axis sharding rules)."""
  return ml_collections.ConfigDict({
      "seed": 0,
      "log_every": 25,
      "data": {
          "n_text": 4000,          # KJV verses in the embedded corpus
          "n_reasoning": 4000,     # reasoning traces from these sources, in these proportions
          "reasoning_sources": ("chain_arithmetic", "basic_arithmetic", "gsm_symbolic"),
          "reasoning_weights": (0.7, 0.15, 0.15),
          "seq_len": 64,           # pretraining / stage-1 length; stage 2 uses seq_len x stage2_len_mult
          "batch": 16,
      },
      # lm_chunk > 0: the next-token loss runs that many tokens at a time from hidden states.
      "pretrain": {"steps": 600, "lr": 3e-3, "warmup": 20, "weight_decay": 1e-4, "lm_chunk": 0},
      "elastic": {
          "stage1_steps": 150, "stage2_steps": 50,
          "stage2_len_mult": 2,
          "lr": 1e-3, "router_lr": 1e-2, "warmup": 10,
          "weight_decay": 0.0,                # model only, masked by kind (training/optim.py)
          "p_full": 0.33,                     # stage 1: full budget, else uniform over the rest
          "stage2_probs": (0.5, 0.3, 0.2),    # stage 2: large -> small, one per budget
          # A budget per micro-batch (gradients accumulated in one step, so every update averages
          # budgets, as Megatron); 1: one budget per step. Must divide data.batch.
          "micro_batches": 4,
          "budget_weight": 1.0, "hard_prob": 0.004,
          "calib_batches": 8,                 # importance ranking before nesting
          # MoE dispatch of every phase (pretraining, importance, student and teacher, QAD):
          # "auto" (picked per call shape and mesh:
          # `elastic_jax.model.moe.choose_impl`), "dense" (every expert on every token),
          # "ragged" (grouped matmul of the routed tokens), "gather", "ep" (experts split over
          # the mesh's expert axis, ragged on each shard).
          "moe_impl": "auto",
          # Routed experts' order while distilling: "contiguous", or "balanced" (every budget's
          # expert prefix spread evenly over the expert-parallel shards; function unchanged,
          # checkpoints of the phase hold that order, the nested checkpoint the logical one).
          "expert_placement": "contiguous",
          # > 0: the KD loss runs this many tokens at a time from hidden states, never holding
          # [batch, seq, vocab] logits (long contexts, large vocabularies); 0: one shot.
          "kd_chunk": 0,
      },
      "router": {
          "hidden": 256, "per_layer": (), "scale_end": 10.0,
          "tau_min": 0.05,
          # Temperature reaches tau_min at this fraction of the elastic steps (tau = decay^step).
          "tau_anneal_frac": 0.8,
          "band": 0.05, "anchor_weight": 10.0,
          # Weight of -log P(router's architecture inside every band): keeps its own argmax in
          # band while training (0: only the budget loss; deployment still picks in band).
          "band_weight": 1.0,
          # The serving point of "memory" and "latency" budget targets (elastic/measures.py).
          "cost": {"weight_format": "bfloat16", "batch": 1, "prompt_len": 1024,
                   "decode_len": 1024},
      },
      # Quantized family after elastic training: "" (none), "fp8" or "nvfp4". The trained family
      # is quantized once (every budget a prefix of its codes and scales) after `qad_steps` of
      # quantization-aware distillation (0: post-training quantization only), saved to
      # nested_<format>/ and evaluated per budget. Leaves by name (elastic_jax/quant/tree.py);
      # `fp8_leaves` of them stay FP8 under nvfp4 (mixed precision, e.g. attention and Mamba
      # projections FP8, experts NVFP4: ModelOpt's MIXED_PRECISION export).
      "quant": {"format": "", "leaves": DEFAULT_LEAVES, "fp8_leaves": (), "qad_steps": 100,
                "lr": 1e-4, "warmup": 10},
      "eval": {"n_reasoning": 64, "sources": ("chain_arithmetic",), "max_think_tokens": 48,
               "max_answer_tokens": 8},
      "checkpoint": {"save_every": 50, "keep": 2},
      # Weights a phase trains: "float32" masters (AdamW state fp32 too), cast to the model's
      # param_dtype each step; "param": weights as stored (bf16 at scale), moments still fp32.
      "optim": {"master": "float32"},
      "parallel": {
          # "" runs on one device; else e.g. "data:1,fsdp:-1,tensor:1,expert:1" (-1 fills the
          # rest). Training phases shard params, optimizer state, teacher and batches over it.
          "mesh": "",
          "rules": DEFAULT_RULES,   # logical axis name -> mesh axes (elastic_jax/parallel/rules.py)
      },
  })
