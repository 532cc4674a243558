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
from elastic_jax.quant.tree import QuantSpec, dequantize_params, quantize_params
from test_quant import QCFG, _budgets

# transformers clamps dt at time_step_min (see test_hf.py): export with that limit.
CFG = QCFG.replace(time_step_limit=(QCFG.time_step_min, math.inf))


@pytest.fixture(scope="module")
def small_q():
  """The all-axes-smallest slice of the quantized parent, per format."""
  params = init(CFG, jax.random.PRNGKey(0))
  return {fmt: slice_params(quantize_params(params, CFG, QuantSpec(fmt)), CFG, _budgets()[-1])
          for fmt in ("nvfp4", "fp8")}


def _bits(tree):
  return jax.tree.map(lambda x: np.asarray(x).reshape(-1).view(np.uint8), tree)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_export_has_modelopt_tensors_and_reloads_exactly(small_q, fmt, tmp_path):
  q, cfg = small_q[fmt]
  amax = {"backbone.layers.0.mixer.in_proj": 3.0}
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
  algo = {"nvfp4": "NVFP4", "fp8": "FP8"}[fmt]
  assert written["quant_method"] == "modelopt"
  assert written["quant_algo"] == side["quant_algo"] == algo
  assert "lm_head" in side["exclude_modules"] and (fmt == "fp8" or side["group_size"] == 16)
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


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_exported_format_means_our_quantized_model(small_q, fmt, tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  q, cfg = small_q[fmt]
  modelopt.save_pretrained(str(tmp_path / "q"), q, cfg)
  dense = tmp_path / "dense"
  os.makedirs(dense)
  st.save_file(_decode(dict(st.load_folder(str(tmp_path / "q")))),
               str(dense / "model.safetensors"), metadata={"format": "pt"})
  written = json.load(open(tmp_path / "q" / "config.json"))
  del written["quantization_config"]
  json.dump(written, open(dense / "config.json", "w"))
  model = transformers.NemotronHForCausalLM.from_pretrained(str(dense)).eval()
  tokens = np.random.RandomState(1).randint(0, cfg.vocab_size, (2, 11))
  with torch.no_grad():
    ref = model(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(apply(dequantize_params(q), tokens, config=cfg), ref,
                             rtol=1e-4, atol=1e-4)


def test_export_refuses_what_modelopt_cannot_hold(small_q, tmp_path):
  """Half of Mamba's in_proj quantized, or two global scales in it, is no ModelOpt Linear;
  a float model is no quantized export."""
  params = init(CFG, jax.random.PRNGKey(0))
  half = quantize_params(params, CFG, QuantSpec("nvfp4", ("in_x", "out_proj")))
  with pytest.raises(modelopt.ModelOptError, match=r"in_proj.weight is one HF Linear made of "
                                                   r"\[.*in_B.*quantize all of them or none"):
    modelopt.to_modelopt(half, CFG)
  with pytest.raises(modelopt.ModelOptError, match="one quantized format, got none"):
    modelopt.to_modelopt(params, CFG)
  with pytest.raises(modelopt.ModelOptError, match="is not ModelOpt"):
    hf.save_pretrained(str(tmp_path), params, CFG)
    modelopt.load_pretrained(str(tmp_path))
