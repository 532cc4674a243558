"""Budget measures: the latency cost model against a hand count on a sliced model's own
weights, memory, differentiability and errors."""
import jax
import numpy as np
import pytest

from elastic_jax import count_params
from elastic_jax.elastic import measures as M
from elastic_jax.elastic.params_count import count_memory
from elastic_jax.elastic.slicing import slice_params

COUNTS = {"hidden": 24, "mamba_heads": 6, "moe_experts": 6, "moe_ffn": 12}


def _hand_latency(params, cfg, cost):
  """The module docstring's roofline, with every size read off the sliced weights themselves."""
  moe = [str(i) for i in cfg.layers_of("E")]
  routed = sum(params["layers"][i]["mixer"][n].size for i in moe for n in ("up", "down"))
  total = sum(x.size for x in jax.tree_util.tree_leaves(params))
  dense = total - params["embed"].size - routed
  E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
  expert = routed / E                                  # one expert in every MoE layer
  n_matmul = dense + k * expert
  bpe = 2.0                                            # bfloat16
  n_attn = len(cfg.layers_of("*"))
  attn = 4 * cfg.num_attention_heads * cfg.head_dim * n_attn
  kv = 2 * cfg.num_kv_heads * cfg.head_dim * cost.kv_bytes * n_attn
  hp = cfg.mamba_num_heads * cfg.mamba_head_dim       # Mamba states of one sequence
  states = len(cfg.layers_of("M")) * (hp * cfg.ssm_state_size * 4 + (
      hp + 2 * cfg.mamba_n_groups * cfg.ssm_state_size) * (cfg.conv_kernel - 1) * 2)
  touched = lambda n: E * (1 - (1 - k / E) ** n)
  B, P, G = cost.batch, cost.prompt_len, cost.decode_len
  t = lambda flops, bytes_: max(flops / cost.peak_flops, bytes_ / cost.hbm_bandwidth)
  prefill = t(B * P * (2 * n_matmul + attn * P / 2),
              (dense + touched(B * P) * expert) * bpe + B * P * kv)
  ctx = P + G / 2
  step = t(B * (2 * n_matmul + attn * ctx),
           (dense + touched(B) * expert) * bpe + B * ctx * kv + 2 * B * states)
  return prefill + G * step


@pytest.mark.parametrize("batch, prompt, decode", [(1, 64, 32), (8, 16, 8), (64, 4096, 512)])
def test_latency_matches_hand_count_on_sliced_weights(cfg, params, batch, prompt, decode):
  cost = M.CostModel(batch=batch, prompt_len=prompt, decode_len=decode)
  small, small_cfg = slice_params(params, cfg, COUNTS)
  want = _hand_latency(small, small_cfg, cost)
  assert M.count_latency(cfg, COUNTS, cost) == pytest.approx(want, rel=1e-9)
  assert M.measure(small_cfg, None, "latency", cost) == pytest.approx(want, rel=1e-9)
  assert M.count_latency(cfg, None, cost) > want      # the parent is slower


def test_query_heads_and_head_dim_in_latency_and_memory(cfg_x, params):
  """Fewer query heads cut attention FLOPs, fewer head-dim channels the Mamba states: both
  against the hand count on the sliced weights (which reads the sliced config's sizes)."""
  counts = {**COUNTS, "attention_heads": 2, "mamba_head_dim": 2}
  small, small_cfg = slice_params(params, cfg_x, counts)
  for batch, prompt, decode in [(1, 64, 32), (64, 4096, 512)]:
    cost = M.CostModel(batch=batch, prompt_len=prompt, decode_len=decode)
    assert M.count_latency(cfg_x, counts, cost) == pytest.approx(
        _hand_latency(small, small_cfg, cost), rel=1e-9)
  # Depth: the dropped layers' weights, states and attention leave every measure.
  for order in [(), (0, 3, 2, 4, 5, 1)]:   # drops layers 4, 5 / the attention layer and 5
    cfg = cfg_x.replace(depth_order=order)
    deep = {**counts, "depth": 4}
    small, small_cfg = slice_params(params, cfg, deep)
    cost = M.CostModel(batch=8, prompt_len=256, decode_len=64)
    assert M.count_latency(cfg, deep, cost) == pytest.approx(
        _hand_latency(small, small_cfg, cost), rel=1e-9)
    assert count_memory(cfg, deep, batch=2, seq_len=9) == pytest.approx(
        count_memory(small_cfg, None, batch=2, seq_len=9))
  hp, N, K, G = 6 * 2, cfg_x.ssm_state_size, cfg_x.conv_kernel, cfg_x.mamba_n_groups
  states = 2 * (hp * N * 4.0 + (hp + 2 * G * N) * (K - 1) * 2.0)     # two Mamba layers, 1 seq
  weights = count_params(cfg_x, counts).total * 2.0
  assert count_memory(cfg_x, counts, batch=1, seq_len=0) == pytest.approx(weights + states)


def test_decode_reads_active_weights_at_batch_one_and_all_at_large_batch(cfg):
  """Bandwidth-bound decode: batch 1 reads the k routed experts (active weights), so dropping
  experts saves only their router columns; a large batch reads nearly all experts, so there
  the expert count matters for latency as much as for memory."""
  slow = dict(peak_flops=1e30, prompt_len=1, decode_len=1, kv_bytes=1e-9)
  D, F = cfg.hidden_size, cfg.moe_intermediate_size
  router_share = (D + 1) / (D + 1 + 2 * D * F)     # of the bytes 4 experts hold per layer
  for batch, want in ((1, router_share), (4096, 1.0)):
    cost = M.CostModel(batch=batch, **slow)
    few, many = (M.count_latency(cfg, {"moe_experts": e}, cost) for e in (4, 8))
    pc4, pc8 = count_params(cfg, {"moe_experts": 4}), count_params(cfg)
    # Two passes (prefill of 1 token, 1 decode step), bf16.
    share = (many - few) / (2 * (pc8.total - pc4.total) * 2.0 / cost.hbm_bandwidth)
    assert share == pytest.approx(want, abs=1e-3), batch


def test_measures_differentiable_and_dispatch(cfg):
  cost = M.CostModel(batch=16)
  grads = {name: float(jax.grad(lambda e: M.measure(cfg, dict(COUNTS, moe_experts=e), name, cost,
                                                    validate=False))(6.0))
           for name in ("active", "total", "memory", "latency")}
  # An expert adds only its router column (hidden + 1 per MoE layer) to the active count.
  assert grads["active"] == 2 * (COUNTS["hidden"] + 1)
  assert grads["total"] > 10 * grads["active"] and grads["memory"] > 0 and grads["latency"] > 0
  assert M.measure(cfg, COUNTS, "memory", cost) == count_memory(
      cfg, COUNTS, batch=16, seq_len=2048)
  with pytest.raises(ValueError, match="budget measure must be one of"):
    M.measure(cfg, None, "flops")
  with pytest.raises(ValueError, match="CostModel.batch must be > 0"):
    M.CostModel(batch=0)
  with pytest.raises(ValueError, match="CostModel.weight_format 'int3'"):
    M.CostModel(weight_format="int3")


def test_serving_memory_weights_caches_and_largest_batch(cfg):
  """Weights at the format, one sequence's caches (count_memory less the weights, linear in
  the context for the KV part), and the largest batch whose caches fit beside the weights."""
  for fmt in ("bfloat16", "fp8", "nvfp4"):
    m = M.serving_memory(cfg, COUNTS, fmt, 1000, device_bytes=5e6)
    w = count_params(cfg, COUNTS).total * {"bfloat16": 2, "fp8": 1, "nvfp4": 0.5625}[fmt]
    assert m["weights"] == pytest.approx(w)
    assert 3 * m["per_sequence"] == pytest.approx(
        count_memory(cfg, COUNTS, weight_format=fmt, batch=3, seq_len=1000) - w)
    b = m["max_batch"]
    assert b > 0 and w + b * m["per_sequence"] <= 5e6 < w + (b + 1) * m["per_sequence"]
  longer = M.serving_memory(cfg, COUNTS, "bfloat16", 2000)["per_sequence"]
  kv_per_token = (longer - M.serving_memory(cfg, COUNTS, "bfloat16", 1000)["per_sequence"]) / 1000
  n_attn = len(cfg.layers_of("*"))
  assert kv_per_token == pytest.approx(n_attn * 2 * cfg.num_kv_heads * cfg.head_dim * 2.0)
  assert M.serving_memory(cfg, COUNTS, "bfloat16", 1000, device_bytes=1.0)["max_batch"] == 0
