"""Export of a quantized slice in NVIDIA ModelOpt's HF format: the tensors ModelOpt / vLLM
expect, a reload with the very codes and scales (equal logits), and the format's meaning checked
independently: the NVFP4 / FP8 tensors decoded with numpy + ml_dtypes and loaded into
transformers' PyTorch Nemotron-H give our quantized model's logits."""
import json
import math
import os

import chex
import jax
import ml_dtypes
import numpy as np
import pytest

from elastic_jax import apply, init
from elastic_jax.elastic.slicing import slice_params
from elastic_jax.io import hf, modelopt
from elastic_jax.io import safetensors_io as st
from elastic_jax.quant.calibrate import input_amax, leaf_path
from elastic_jax.quant.qtensor import quantize
from elastic_jax.quant.tree import QuantSpec, dequantize_params, quantize_params
from test_quant import MIXED, QCFG, _budgets

# transformers clamps dt at time_step_min (see test_hf.py): export with that limit.
CFG = QCFG.replace(time_step_limit=(QCFG.time_step_min, math.inf))


SPECS = {"nvfp4": QuantSpec("nvfp4"), "fp8": QuantSpec("fp8"), "mixed": MIXED}


@pytest.fixture(scope="module")
def small_q():
  """The all-axes-smallest slice of the quantized parent, per format."""
  params = init(CFG, jax.random.PRNGKey(0))
  return {name: slice_params(quantize_params(params, CFG, spec), CFG, _budgets()[-1])
          for name, spec in SPECS.items()}


def _bits(tree):
  return jax.tree.map(lambda x: np.asarray(x).reshape(-1).view(np.uint8), tree)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "mixed"])
def test_export_has_modelopt_tensors_and_reloads_exactly(small_q, fmt, tmp_path):
  q, cfg = small_q[fmt]
  # In_proj is five leaves reading one input: the largest of their amaxes is the module's.
  amax = {leaf_path(0, "in_x"): 3.0, leaf_path(0, "in_z"): 2.0}
  modelopt.save_pretrained(str(tmp_path), q, cfg, input_amax=amax)
  t = st.load_folder(str(tmp_path))
  D = cfg.hidden_size
  m = "backbone.layers.0.mixer.in_proj"
  out = t[f"{m}.weight"].shape[0]
  if fmt == "nvfp4":
    assert t[f"{m}.weight"].dtype == np.uint8 and t[f"{m}.weight"].shape == (out, D // 2)
    assert t[f"{m}.weight_scale"].dtype == ml_dtypes.float8_e4m3fn
    assert t[f"{m}.weight_scale"].shape == (out, D // 16)
    assert t[f"{m}.weight_scale_2"].shape == () and t[f"{m}.weight_scale_2"].dtype == np.float32
    assert float(t[f"{m}.input_scale"]) == pytest.approx(3.0 / (6 * 448))
  else:
    assert t[f"{m}.weight"].dtype == ml_dtypes.float8_e4m3fn and t[f"{m}.weight"].shape == (out, D)
    assert t[f"{m}.weight_scale"].shape == () and f"{m}.weight_scale_2" not in t
    assert float(t[f"{m}.input_scale"]) == pytest.approx(3.0 / 448)
  assert "backbone.layers.3.mixer.o_proj.input_scale" not in t   # not calibrated: none
  assert t["backbone.layers.1.mixer.gate.weight"].dtype == np.float32   # router kept
  written = json.load(open(tmp_path / "config.json"))["quantization_config"]
  side = json.load(open(tmp_path / "hf_quant_config.json"))["quantization"]
  algo = {"nvfp4": "NVFP4", "fp8": "FP8", "mixed": "MIXED_PRECISION"}[fmt]
  assert written["quant_method"] == "modelopt"
  assert written["quant_algo"] == side["quant_algo"] == algo
  assert "lm_head" in side["exclude_modules"] and (fmt == "fp8" or side["group_size"] == 16)
  if fmt == "mixed":   # each quantized Linear's format, as vLLM's modelopt_mixed reads them
    layers = written["quantized_layers"]
    assert layers == side["quantized_layers"]
    assert layers[f"{m}"] == {"quant_algo": "FP8"}
    assert layers["backbone.layers.1.mixer.experts.0.up_proj"] == {"quant_algo": "NVFP4",
                                                                   "group_size": 16}
    assert t["backbone.layers.1.mixer.experts.0.up_proj.weight"].dtype == np.uint8
    assert set(layers) == {k[: -len(".weight_scale")] for k in t if k.endswith(".weight_scale")}
  assert modelopt.is_modelopt(str(tmp_path))
  cfg2, back = modelopt.load_pretrained(str(tmp_path))
  assert cfg2.hidden_size == cfg.hidden_size
  chex.assert_trees_all_equal(_bits(back), _bits(q))
  tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 9))
  np.testing.assert_array_equal(apply(dequantize_params(back), tokens, config=cfg2),
                                apply(dequantize_params(q), tokens, config=cfg))


def _decode(t: dict) -> dict:
  """ModelOpt tensors -> float HF weights, from the format's definition alone."""
  out = {}
  for k, v in t.items():
    if k.endswith(("_scale", "_scale_2")):
      continue
    m = k[: -len(".weight")]
    if v.dtype == np.uint8:   # NVFP4: low nibble first; E2M1 x e4m3 block scale x global
      codes = np.stack([v & 0xF, v >> 4], -1).reshape(v.shape[0], -1)
      vals = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
      scale = np.repeat(t[f"{m}.weight_scale"].astype(np.float32), 16, axis=1)
      out[k] = vals * scale * np.float32(t[f"{m}.weight_scale_2"])
    elif v.dtype == ml_dtypes.float8_e4m3fn:
      out[k] = v.astype(np.float32) * np.float32(t[f"{m}.weight_scale"])
    else:
      out[k] = np.asarray(v, np.float32)
  return out


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "mixed"])
def test_exported_format_means_our_quantized_model(small_q, fmt, tmp_path):
  """...and the input scales calibrated on our side are what transformers' model feeds each
  of its Linears (forward pre-hooks record each one's input amax), per expert included."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  q, cfg = small_q[fmt]
  tokens = np.random.RandomState(1).randint(0, cfg.vocab_size, (2, 11))
  amax = input_amax(dequantize_params(q), cfg, [tokens[:1], tokens[1:]])
  modelopt.save_pretrained(str(tmp_path / "q"), q, cfg, input_amax=amax)
  dense = tmp_path / "dense"
  os.makedirs(dense)
  st.save_file(_decode(dict(st.load_folder(str(tmp_path / "q")))),
               str(dense / "model.safetensors"), metadata={"format": "pt"})
  written = json.load(open(tmp_path / "q" / "config.json"))
  del written["quantization_config"]
  json.dump(written, open(dense / "config.json", "w"))
  model = transformers.NemotronHForCausalLM.from_pretrained(str(dense)).eval()
  seen = {}
  def hook(name):
    def record(_, args):
      seen[name] = max(seen.get(name, 0.0), float(args[0].abs().max()))
    return record
  def experts_hook(name):
    def record(mod, args):   # transformers runs its experts as 3-D weights, not Linears
      x, idx = args[0], args[1]
      for e in range(mod.num_experts):
        rows = x[(idx == e).any(-1)]
        if len(rows):
          act = torch.relu(rows @ mod.up_proj[e].T) ** 2
          for proj, v in (("up_proj", rows), ("down_proj", act)):
            key = f"{name}.{e}.{proj}"
            seen[key] = max(seen.get(key, 0.0), float(v.abs().max()))
    return record
  for name, mod in model.named_modules():
    if isinstance(mod, torch.nn.Linear):
      mod.register_forward_pre_hook(hook(name))
    elif type(mod).__name__ == "NemotronHExperts":
      mod.register_forward_pre_hook(experts_hook(name))
  with torch.no_grad():
    ref = model(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(apply(dequantize_params(q), tokens, config=cfg), ref,
                             rtol=1e-4, atol=1e-4)
  t = st.load_folder(str(tmp_path / "q"))
  top = lambda m: 6 * 448 if t[f"{m}.weight"].dtype == np.uint8 else 448   # nvfp4 : fp8
  scales = {k[: -len(".input_scale")]: float(v) * top(k[: -len(".input_scale")])
            for k, v in t.items() if k.endswith(".input_scale")}
  quantized = {k[: -len(".weight")] for k, v in t.items()
               if k.endswith(".weight") and f"{k[:-len('.weight')]}.weight_scale" in t}
  assert set(scales) == quantized and any(".experts." in m for m in quantized)
  seen = {m.replace("model.", "backbone.", 1): a for m, a in seen.items()}   # its prefix
  assert set(seen) - {"lm_head"} == quantized   # every Linear and expert checked
  for m in quantized:
    assert scales[m] == pytest.approx(seen[m], rel=1e-4), m
  # Experts no token reached get their layer's largest (one token reaches 2 of 4 experts).
  one = input_amax(dequantize_params(q), cfg, [tokens[:1, :1]])
  for path, a in one.items():
    if a.ndim:
      assert np.sum(a == a.max()) >= a.size - cfg.num_experts_per_tok + 1, path


def test_export_refuses_what_modelopt_cannot_hold(small_q, tmp_path):
  """Half of Mamba's in_proj quantized, or two global scales in it, is no ModelOpt Linear;
  a float model is no quantized export."""
  params = init(CFG, jax.random.PRNGKey(0))
  half = quantize_params(params, CFG, QuantSpec("nvfp4", ("in_x", "out_proj")))
  with pytest.raises(modelopt.ModelOptError, match=r"in_proj.weight is one HF Linear made of "
                                                   r"\[.*in_B.*quantize all of them or none"):
    modelopt.to_modelopt(half, CFG)
  with pytest.raises(modelopt.ModelOptError, match="got no quantized leaf"):
    modelopt.to_modelopt(params, CFG)
  two = quantize_params(params, CFG, QuantSpec("nvfp4"))
  two["layers"]["0"]["mixer"]["in_x"] = quantize(params["layers"]["0"]["mixer"]["in_x"], "fp8")
  with pytest.raises(modelopt.ModelOptError, match=r"in_proj.weight is one HF Linear made of "
                                                   r".* in formats \['fp8', 'nvfp4'\]"):
    modelopt.to_modelopt(two, CFG)
  with pytest.raises(ValueError, match=r"fp8_leaves: \['in_B', 'in_C', 'in_dt', 'in_x', "
                                       r"'in_z'\] are one fused matmul \(in_proj\)"):
    QuantSpec("nvfp4", fp8_leaves=("in_x",))
  with pytest.raises(ValueError, match=r"fp8_leaves \['lm_head'\] are not among"):
    QuantSpec("nvfp4", fp8_leaves=("lm_head",))
  with pytest.raises(modelopt.ModelOptError, match="is not ModelOpt"):
    hf.save_pretrained(str(tmp_path), params, CFG)
    modelopt.load_pretrained(str(tmp_path))


def test_calibration_checks_batches_and_follows_expert_placement(small_q):
  """Bad calibration batches are refused naming the batch; with the experts in the balanced
  order the per-expert amaxes come in the params' (physical) order, the rest unchanged."""
  from elastic_jax.model import expert_placement
  from elastic_jax.model.model import place_experts
  q, cfg = small_q["fp8"]
  p = dequantize_params(q)
  with pytest.raises(ValueError, match=r"calibration batch 2: token ids must lie in \[0, 128\)"):
    input_amax(p, cfg, [np.ones((1, 3), np.int32), np.full((1, 3), 128)])
  with pytest.raises(ValueError, match="calibration batch 1: expected int tokens"):
    input_amax(p, cfg, [np.ones((3,), np.float32)])
  with pytest.raises(ValueError, match="no calibration batches"):
    input_amax(p, cfg, [])
  tokens = np.random.RandomState(2).randint(0, cfg.vocab_size, (2, 7))
  want = input_amax(p, cfg, [tokens])
  placed, pcfg = place_experts(p, cfg, "balanced")
  got = input_amax(placed, pcfg, [tokens])
  order = expert_placement.order(cfg.n_routed_experts, "balanced")
  assert any(a.ndim for a in want.values()) and not np.array_equal(order, np.sort(order))
  for path, a in want.items():
    np.testing.assert_allclose(got[path], a[order] if a.ndim else a, rtol=1e-5, err_msg=path)
