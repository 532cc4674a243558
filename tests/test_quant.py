"""FP8 / NVFP4 numerics against ml_dtypes, and quantized nesting: a budget is a prefix of the
quantized parent (dequant(slice(q)) == slice(dequant(q)) bit for bit, on every axis)."""
import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from configs.tiny import MODEL
from elastic_jax import init
from elastic_jax.elastic.axes import AXES
from elastic_jax.elastic.slicing import slice_params
from elastic_jax.quant import formats
from elastic_jax.quant.qtensor import QTensor, is_qtensor, quantize
from elastic_jax.quant.tree import (QuantSpec, block_axis, check, dequantize_params,
                                    fake_quant_params, mixed_spec, plan, quantize_params)

# The tiny config, every axis elastic, every nvfp4 block dim and choice a multiple of 16.
QCFG = MODEL.replace(hidden_size=64, hidden_choices=(64, 48, 32), moe_intermediate_size=48,
                     moe_ffn_choices=(48, 32, 16), moe_shared_expert_intermediate_size=32,
                     vocab_size=128, attention_head_choices=(4, 2), mamba_head_dim=32,
                     mamba_head_dim_choices=(32, 16), depth_choices=(8, 7, 6))


# Mixed precision as NVIDIA ships Nemotron-H: routed experts NVFP4, every other Linear FP8.
MIXED = mixed_spec()


@pytest.fixture(scope="module")
def qparams_f32():
  return init(QCFG, jax.random.PRNGKey(0))


def test_e2m1_encode_matches_ml_dtypes():
  """Every value on a 1/64 grid over [-8, 8] (all ties included): our code's value equals
  ml_dtypes' float4_e2m1fn cast (round to nearest even, saturating), and decode inverts."""
  y = np.arange(-8 * 64, 8 * 64 + 1, dtype=np.float32) / 64
  want = y.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
  got = np.asarray(formats.e2m1_decode(formats.e2m1_encode(jnp.asarray(y))))
  np.testing.assert_array_equal(got, want)
  codes = np.arange(16, dtype=np.uint8)
  vals = np.asarray(formats.e2m1_decode(jnp.asarray(codes)))
  np.testing.assert_array_equal(np.asarray(formats.e2m1_encode(jnp.asarray(vals)))[vals != 0],
                                codes[vals != 0])


def test_pack_even_element_low_nibble():
  codes = jnp.asarray([[1, 2, 15, 0]], jnp.uint8)
  packed = formats.pack_nibbles(codes)
  np.testing.assert_array_equal(np.asarray(packed), [[0x21, 0x0F]])
  np.testing.assert_array_equal(np.asarray(formats.unpack_nibbles(packed)), np.asarray(codes))


def test_nvfp4_scales_and_values():
  """global = amax / (6 * 448); block scale = e4m3(block_amax / (6 * global)); each value the
  nearest-even E2M1 code of x / (block scale * global); blocks along the chosen axis."""
  rng = np.random.RandomState(0)
  w = (rng.randn(32, 3) * np.exp(rng.randn(32, 1))).astype(np.float32)   # blocks along dim 0
  packed, bs, g = formats.nvfp4_quantize(jnp.asarray(w), 0)
  chex.assert_shape(packed, (16, 3))
  chex.assert_shape(bs, (2, 3))
  assert packed.dtype == jnp.uint8 and bs.dtype == jnp.float8_e4m3fn
  np.testing.assert_allclose(float(g), np.abs(w).max() / (6 * 448), rtol=1e-7)
  block_amax = np.abs(w.reshape(2, 16, 3)).max(1)
  want_bs = (block_amax / (6 * np.float32(g))).astype(ml_dtypes.float8_e4m3fn)
  np.testing.assert_array_equal(np.asarray(bs).astype(np.float32), want_bs.astype(np.float32))
  step = np.repeat(want_bs.astype(np.float32), 16, 0) * np.float32(g)
  want = (w / step).astype(ml_dtypes.float4_e2m1fn).astype(np.float32) * step
  np.testing.assert_array_equal(np.asarray(formats.nvfp4_dequantize(packed, bs, g, 0)), want)
  assert np.abs(np.asarray(formats.nvfp4_dequantize(packed, bs, g, 0)) - w).max() <= \
      np.abs(w).max() / 6       # the error stays within a step of the largest block
  with pytest.raises(ValueError, match="not a multiple of 16"):
    formats.nvfp4_quantize(jnp.zeros((24, 3)), 0)


def test_fp8_per_tensor():
  w = jnp.asarray(np.random.RandomState(1).randn(8, 5).astype(np.float32))
  codes, scale = formats.fp8_quantize(w)
  assert codes.dtype == jnp.float8_e4m3fn
  np.testing.assert_allclose(float(scale), float(jnp.abs(w).max()) / 448, rtol=1e-7)
  want = (np.asarray(w) / np.float32(scale)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(codes).astype(np.float32), want)
  np.testing.assert_allclose(np.asarray(formats.fp8_dequantize(codes, scale)), np.asarray(w),
                             rtol=2 ** -4, atol=float(scale) * 2 ** -9)


def test_fake_quant_value_and_straight_through_gradient():
  w = jnp.asarray(np.random.RandomState(2).randn(4, 32).astype(np.float32))
  for fmt in ("fp8", "nvfp4"):
    q = quantize(w, fmt, 1)
    np.testing.assert_array_equal(np.asarray(formats.fake_quant(w, fmt, 1)),
                                  np.asarray(q.dequantize()))
    c = jnp.arange(w.size, dtype=jnp.float32).reshape(w.shape)
    g = jax.grad(lambda x: jnp.sum(formats.fake_quant(x, fmt, 1) * c))(w)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(c))


def test_block_axis_from_logical_names():
  assert block_axis(("embed", "mamba_groups", "mamba_heads", "mamba_head_dim")) == 0   # in_x
  assert block_axis(("mamba_groups", "mamba_heads", "mamba_head_dim", "embed")) == 2   # out_proj
  assert block_axis(("q_heads", "head_dim", "embed")) == 1                              # o
  assert block_axis(("experts", "embed", "expert_mlp")) == 1                            # up
  assert block_axis(("experts", "expert_mlp", "embed")) == 1                            # down
  assert block_axis(("embed", "vocab")) == 0                                            # lm_head


def test_which_leaves_are_quantized(qparams_f32):
  q = quantize_params(qparams_f32, QCFG, QuantSpec("nvfp4"))
  flat = {jax.tree_util.keystr(p): x for p, x in
          jax.tree_util.tree_flatten_with_path(q, is_leaf=lambda x: isinstance(x, QTensor))[0]}
  quantized = {k.split("'")[-2] for k, x in flat.items() if isinstance(x, QTensor)}
  assert quantized == {"q", "k", "v", "o", "in_x", "in_z", "in_B", "in_C", "in_dt", "out_proj",
                       "up", "down", "shared_up", "shared_down"}
  for k, x in flat.items():      # embeddings, norms, router, convs, SSM params untouched
    if not isinstance(x, QTensor):
      assert x.dtype == jnp.float32, k
  assert len(plan(QCFG, QuantSpec("nvfp4", ("lm_head",)))) == 1
  # What a serving engine fuses shares one global scale: the max amax of its parts.
  scales = lambda i, names: {n: float(q["layers"][i]["mixer"][n].global_scale) for n in names}
  mamba = scales("0", ("in_z", "in_x", "in_B", "in_C", "in_dt"))
  amax = max(float(jnp.abs(qparams_f32["layers"]["0"]["mixer"][n]).max()) for n in mamba)
  assert set(mamba.values()) == {np.float32(amax) / np.float32(6 * 448)}
  assert len(set(scales("3", ("q", "k", "v")).values())) == 1
  assert len(set(scales("1", ("up", "down", "shared_up", "shared_down")).values())) == 4
  with pytest.raises(ValueError, match=r"\['A_log'\] are not matmul weights"):
    QuantSpec("nvfp4", ("up", "A_log"))
  with pytest.raises(ValueError, match=r"\['upp'\] are not matmul weights; quantizable: any of q, k"):
    QuantSpec("nvfp4", ("upp",))
  with pytest.raises(ValueError, match="quant format 'int4': expected one of fp8, nvfp4"):
    QuantSpec("int4")


def test_nvfp4_refuses_choices_off_the_block_grid():
  bad = QCFG.replace(moe_ffn_choices=(48, 40, 16))
  with pytest.raises(ValueError, match=r"layers\.1\.mixer\.down dim 1 takes sizes \[16, 40, 48\]"
                                       r"; \[40\] not a multiple of 16"):
    check(bad, QuantSpec("nvfp4"))
  check(bad, QuantSpec("fp8"))                 # per-tensor scales: any prefix nests
  check(bad, QuantSpec("nvfp4", ("q", "k")))   # those leaves never see moe_ffn


def _budgets():
  """Each elastic axis alone at its smallest choice, then all of them at once."""
  small = {n: a.choices(QCFG)[-1] for n, a in AXES.items() if len(a.choices(QCFG)) > 1}
  return [{n: c} for n, c in small.items()] + [small]


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_quantized_budget_is_a_prefix_of_the_parent(qparams_f32, fmt):
  """dequant(slice(quantized parent)) == slice(dequant(quantized parent)) bit for bit, per
  axis and for all at once; the sliced QTensors are prefixes of the parent's codes and scales."""
  q = quantize_params(qparams_f32, QCFG, QuantSpec(fmt))
  dq = dequantize_params(q)
  for counts in _budgets():
    small_q, cfg_q = slice_params(q, QCFG, counts)
    small_dq, cfg_dq = slice_params(dq, QCFG, counts)
    assert cfg_q == cfg_dq
    chex.assert_trees_all_equal(dequantize_params(small_q), small_dq)
  up = small_q["layers"]["1"]["mixer"]["up"]
  full_up = q["layers"]["1"]["mixer"]["up"]
  assert isinstance(up, QTensor) and up.shape == small_dq["layers"]["1"]["mixer"]["up"].shape
  np.testing.assert_array_equal(np.asarray(up.codes),
                                np.asarray(full_up.codes[tuple(slice(0, n) for n in
                                                               up.codes.shape)]))


def test_qtensor_refuses_non_prefix_slices(qparams_f32):
  q = quantize(qparams_f32["layers"]["1"]["mixer"]["up"], "nvfp4", 1)
  with pytest.raises(IndexError, match="prefix slices only"):
    q[1:]
  with pytest.raises(ValueError, match="not a multiple of 16"):
    q[:, :24]
  assert q[:, :32].shape == (q.shape[0], 32, q.shape[2])


def test_fake_quant_of_the_scanned_layout_quantizes_layer_by_layer(qparams_f32):
  """Training holds scanned params: each stacked layer gets its own scales, as the canonical
  layer would (one scale over the whole stack would differ), and the gradient passes straight
  through. (The vmapped program may round a product differently by an ulp: values agree to
  1e-6, but for the rare element within an ulp of a rounding midpoint, which takes the
  neighbouring code.)"""
  from elastic_jax.model.model import to_canonical, to_stack_layout
  cfg = QCFG.replace(scan_layers=True)
  stacked = to_stack_layout(qparams_f32, cfg)
  assert "units" in stacked["layers"]
  for fmt, spec in (("nvfp4", QuantSpec("nvfp4")), ("fp8", QuantSpec("fp8")), ("mixed", MIXED)):
    got = to_canonical(fake_quant_params(stacked, cfg, spec), cfg)
    q = quantize_params(qparams_f32, cfg, spec)
    want = dequantize_params(q)
    chex.assert_trees_all_equal_structs(got, want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      off = ~np.isclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=0)
      assert off.sum() <= max(1, off.size // 1000), (fmt, off.sum(), off.size)
  assert [q["layers"]["1"]["mixer"][k].fmt for k in ("up", "shared_up")] == ["nvfp4", "fp8"]
  g = jax.grad(lambda p: jnp.sum(fake_quant_params(p, cfg, QuantSpec("nvfp4"))["layers"]
                                 ["units"]["2"]["mixer"]["up"]))(stacked)
  np.testing.assert_array_equal(np.asarray(g["layers"]["units"]["2"]["mixer"]["up"]), 1.0)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_quantized_checkpoint_restores_any_budget_from_prefixes(qparams_f32, fmt, tmp_path):
  """One quantized nested checkpoint (uint8 codes, e4m3 block scales, f32 global scales): the
  full restore is bit-exact, a budget reads the prefixes of its codes and scales (fewer bytes)
  and equals the slice of the quantized parent, also restored straight onto a mesh, and a code
  chunk holding other (valid) codes is refused by the full and the budget restore."""
  import os
  import shutil
  from elastic_jax.io import checkpoint
  q = quantize_params(qparams_f32, QCFG, QuantSpec(fmt))
  small = _budgets()[-1]
  path = checkpoint.save(str(tmp_path / "q"), q, QCFG, budget_counts={"small": small})
  meta = checkpoint.load_metadata(path)
  assert meta["quantized"]["['layers']['1']['mixer']['up']"] == {
      "fmt": fmt, "axis": 1, "dtype": "float32"}
  bits = lambda t: jax.tree.map(lambda x: np.asarray(x).reshape(-1).view(np.uint8), t)
  before = checkpoint.bytes_read()
  full, _ = checkpoint.restore(path)
  full_bytes = checkpoint.bytes_read() - before
  chex.assert_trees_all_equal(bits(full), bits(q))
  before = checkpoint.bytes_read()
  got, cfg = checkpoint.restore(path, "small")
  small_bytes = checkpoint.bytes_read() - before
  want, want_cfg = slice_params(q, QCFG, small)
  assert cfg == want_cfg and small_bytes < 0.7 * full_bytes, (small_bytes, full_bytes)
  up = got["layers"]["1"]["mixer"]["up"]
  assert isinstance(up, QTensor) and up.codes.dtype == (jnp.uint8 if fmt == "nvfp4" else
                                                        jnp.float8_e4m3fn)
  chex.assert_trees_all_equal(bits(got), bits(want))
  # Straight into a mesh: codes and block scales split as their float leaf, except along a dim
  # the shorter component no longer divides.
  from elastic_jax.parallel import mesh as mesh_lib
  mesh = mesh_lib.make_mesh("fsdp:2,tensor:2,expert:2")
  sharded, _ = checkpoint.restore(path, "small", sharding=mesh)
  chex.assert_trees_all_equal(bits(sharded), bits(want))
  assert sharded["layers"]["1"]["mixer"]["up"].codes.sharding.spec[0] == "expert"
  bad = str(tmp_path / "bad")
  shutil.copytree(path, bad)
  codes = os.path.join(bad, "state", "params.layers.1.mixer.up.codes")
  first, other = sorted(f for f in os.listdir(codes) if not f.startswith("."))[:2]
  shutil.copyfile(os.path.join(codes, other), os.path.join(codes, first))  # valid, wrong values
  for budget in (None, "small"):
    with pytest.raises(checkpoint.CheckpointError, match="does not match the fingerprint"):
      checkpoint.restore(bad, budget)


def test_generation_runs_from_the_packed_weights(qparams_f32):
  """A quantized sub-model generates as is (packed codes in memory, dequantized inside the
  compiled step): the same tokens and logits as its dequantized copy."""
  from elastic_jax.inference.generate import SubModel, generate
  small = _budgets()[-1]
  q, cfg = slice_params(quantize_params(qparams_f32, QCFG, QuantSpec("nvfp4")), QCFG, small)
  prompts = [[1, 2, 3, 4, 5], [7, 8]]
  a = generate(SubModel(q, cfg), prompts, 6, chunk=8)
  b = generate(SubModel(dequantize_params(q), cfg), prompts, 6, chunk=8)
  assert a == b and len(a) == 2 and all(len(r) == 6 for r in a)


def test_fp8_einsum_is_an_fp8_matmul():
  """x quantized per row (amax over its contracted dims / 448) and the FP8 weight codes enter
  the dot as float8_e4m3fn with f32 accumulation, rescaled after: equal to the same steps in
  numpy + ml_dtypes, within FP8's error of the float product."""
  rs = np.random.RandomState(3)
  e4m3 = lambda a: a.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
  for spec, xs, ws, red in (("btd,dhk->bthk", (2, 3, 32), (32, 4, 8), (2,)),
                            ("btghp,ghpd->btd", (2, 3, 2, 2, 8), (2, 2, 8, 16), (2, 3, 4)),
                            ("td,df->tf", (5, 32), (32, 24), (1,))):
    x = rs.randn(*xs).astype(np.float32) * np.exp(rs.randn(*xs[:2], *[1] * (len(xs) - 2)))
    w = rs.randn(*ws).astype(np.float32)
    codes, w_scale = formats.fp8_quantize(jnp.asarray(w))
    got = np.asarray(formats.fp8_einsum(spec, jnp.asarray(x), codes, w_scale))
    s = np.abs(x).max(axis=red, keepdims=True) / 448
    want = np.einsum(spec, e4m3(x / s), np.asarray(codes).astype(np.float32))
    kept = "".join(c for c in spec.split(",")[0] if c in spec.split("->")[1])
    want = want * np.einsum(f"{kept}->{kept}", s.squeeze(red)).reshape(
        got.shape[:len(kept)] + (1,) * (got.ndim - len(kept))) * np.float32(w_scale)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    exact = np.einsum(spec, x, w)
    assert np.abs(got - exact).max() < 0.1 * np.abs(exact).max(), spec
  with pytest.raises(ValueError, match="explicit subscripts"):
    formats.fp8_einsum("...d,dv->...v", jnp.ones((2, 4)), codes, w_scale)


def test_generation_with_fp8_matmuls(qparams_f32):
  """matmul="fp8": the FP8 projections (attention, Mamba, shared experts) stay packed and run
  as FP8 dots (float8_e4m3fn operands in the program lowered for a GPU), the NVFP4 experts are
  dequantized; the logits stay near the dequantized model's (FP8 activations)."""
  from elastic_jax.inference import generate as G
  from elastic_jax.model.linear import FP8_MATMUL_LEAVES
  from elastic_jax.model.model import apply
  q = quantize_params(qparams_f32, QCFG, MIXED)
  kept = G.step_weights(q, "fp8")
  packed = [p for p, x in jax.tree_util.tree_flatten_with_path(kept, is_leaf=is_qtensor)[0]
            if is_qtensor(x)]
  assert packed and all(p[-1].key in FP8_MATMUL_LEAVES for p in packed)
  assert not any(is_qtensor(x) for x in jax.tree.leaves(G.step_weights(q, "dequant"),
                                                        is_leaf=is_qtensor))
  prompts = [[1, 2, 3, 4, 5], [7, 8]]
  fp8, deq = (G.prefill(G.SubModel(q, QCFG, matmul=m), prompts, max_len=16, chunk=8).logits
              for m in ("fp8", "dequant"))
  # E4M3 rounds each activation by up to 2^-4 relative, through 8 layers of a random model.
  assert 0 < float(jnp.abs(fp8 - deq).max()) < 0.15 * float(jnp.abs(deq).max())
  tokens = jnp.asarray([prompts[0]])
  for m, n in (("fp8", len(packed)), ("dequant", 0)):
    hlo = jax.jit(lambda p, t: apply(G.step_weights(p, m), t, config=QCFG)).trace(
        q, tokens).lower(lowering_platforms=("cuda",)).as_text()
    dots = [l for l in hlo.splitlines() if "stablehlo.dot_general" in l and "f8E4M3FN" in l]
    assert len(dots) == n, (m, len(dots))
  with pytest.raises(ValueError, match="matmul must be one of auto, dequant, fp8"):
    G.SubModel(q, QCFG, matmul="int8")
