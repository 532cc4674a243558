"""Parity with the transformers PyTorch Nemotron-H (all four block kinds), fp32, 1e-4.

transformers 5.x clamps dt from below at `time_step_min` (its mixer uses
`(time_step_min, inf)` instead of the config's `time_step_limit`); we load with that override so
the comparison is exact, and keep the config's own limit as our default.
"""
import json
import math
import os

import chex
import jax
import numpy as np
import pytest

if os.environ.get("CI") == "true":
  # CI installs the test extras: a missing reference must fail the run, not skip parity.
  import torch  # noqa: E402
  import transformers  # noqa: E402
else:
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")

from elastic_jax import apply, count_params  # noqa: E402
from elastic_jax.io import hf  # noqa: E402
from elastic_jax.io import safetensors_io as st  # noqa: E402


def _hf_model(cfg, seed=0):
  torch.manual_seed(seed)
  hf_cfg = transformers.NemotronHConfig(**hf.config_to_hf(cfg))
  model = transformers.NemotronHForCausalLM(hf_cfg).eval()
  with torch.no_grad():  # move every parameter and buffer off its default init
    for name, p in model.named_parameters():
      if "A_log" in name:
        p.copy_(torch.rand_like(p) * 2)
      elif name.endswith(".D") or "norm" in name:
        p.copy_(1 + 0.5 * torch.randn_like(p))
      elif "dt_bias" in name:
        p.copy_(torch.randn_like(p))
      else:
        p.copy_(p + 0.1 * torch.randn_like(p))
    for name, b in model.named_buffers():
      if "e_score_correction_bias" in name:
        b.copy_(0.3 * torch.randn_like(b))
  return model


@pytest.fixture(scope="module")
def hf_folder(cfg, tmp_path_factory):
  folder = str(tmp_path_factory.mktemp("hf"))
  model = _hf_model(cfg)
  model.save_pretrained(folder)
  return folder, model


def _overrides(cfg):
  return {"time_step_limit": (cfg.time_step_min, math.inf)}


def test_logit_parity(cfg, hf_folder):
  folder, model = hf_folder
  our_cfg, params = hf.load_pretrained(folder, **_overrides(cfg))
  assert our_cfg.layer_pattern == cfg.layer_pattern
  fwd = {impl: jax.jit(lambda p, t, impl=impl: apply(p, t, config=our_cfg, moe_impl=impl))
         for impl in ("dense", "ragged")}
  rs = np.random.RandomState(0)
  for T in (1, 6, 13, 17):  # 17 spans five SSD chunks of 4
    tok = rs.randint(0, cfg.vocab_size, (2, T))
    with torch.no_grad():
      ref = model(torch.tensor(tok)).logits.numpy()
    for impl, f in fwd.items():
      np.testing.assert_allclose(np.asarray(f(params, tok)), ref, rtol=1e-4, atol=1e-4,
                                 err_msg=f"T={T} impl={impl}")


def test_export_loads_in_transformers(cfg, params, tokens, tmp_path):
  c = cfg.replace(**_overrides(cfg))
  hf.save_pretrained(str(tmp_path), params, c)
  model = transformers.NemotronHForCausalLM.from_pretrained(str(tmp_path)).eval()
  with torch.no_grad():
    ref = model(torch.tensor(np.asarray(tokens))).logits.numpy()
  np.testing.assert_allclose(apply(params, tokens, config=c), ref, rtol=1e-4, atol=1e-4)
  c2, p2 = hf.load_pretrained(str(tmp_path), **_overrides(cfg))
  chex.assert_trees_all_equal(jax.tree_util.tree_map(np.asarray, p2),
                              jax.tree_util.tree_map(np.asarray, params))


def test_sliced_query_heads_and_head_dim_export(cfg_x, params, tokens, tmp_path):
  """A slice with fewer query heads per KV group, fewer Mamba head-dim channels and fewer layers
  is a Nemotron-H (num_attention_heads, mamba_head_dim, a shorter hybrid_override_pattern):
  transformers computes the masked parent's logits. Per-layer sizes are not expressible in HF's
  config: a clear error."""
  from elastic_jax import from_counts
  from elastic_jax.elastic.slicing import slice_params

  c = cfg_x.replace(**_overrides(cfg_x))
  c = c.replace(depth_order=(0, 1, 2, 4, 5, 3))
  counts = {"attention_heads": 2, "mamba_head_dim": 3, "mamba_heads": 6, "depth": 5}
  small, small_cfg = slice_params(params, c, counts)
  hf.save_pretrained(str(tmp_path / "hf"), small, small_cfg)
  written = json.load(open(tmp_path / "hf" / "config.json"))
  assert (written["num_attention_heads"], written["mamba_head_dim"]) == (2, 3)
  assert written["hybrid_override_pattern"] == "M*EME"   # the '-' layer ranked last, dropped
  model = transformers.NemotronHForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
  with torch.no_grad():
    ref = model(torch.tensor(np.asarray(tokens))).logits.numpy()
  np.testing.assert_allclose(ref, apply(params, tokens, from_counts(c, counts), config=c),
                             rtol=1e-4, atol=1e-4)
  uneven, uneven_cfg = slice_params(params, c, {"mamba_head_dim": (4, 2)})
  with pytest.raises(hf.HFFormatError, match="per-layer sizes"):
    hf.save_pretrained(str(tmp_path / "hf2"), uneven, uneven_cfg)


def test_overwrite_removes_the_old_weight_files(cfg, params, tmp_path):
  """Exporting over a folder that held a sharded model: the old shards and index go (loading
  must never see old tensors); other files (a tokenizer) stay; no overwrite, no write."""
  c = cfg.replace(**_overrides(cfg))
  hf.save_pretrained(str(tmp_path), params, c)
  old = dict(st.load_file(str(tmp_path / "model.safetensors")))
  stale = {k: np.full_like(v, 7) for k, v in old.items()}
  os.remove(tmp_path / "model.safetensors")
  st.save_file(stale, str(tmp_path / "model-00001-of-00001.safetensors"))
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
      {"weight_map": {k: "model-00001-of-00001.safetensors" for k in stale}}))
  (tmp_path / "tokenizer.json").write_text("{}")
  with pytest.raises(hf.HFFormatError, match="already holds a model"):
    hf.save_pretrained(str(tmp_path), params, c)
  hf.save_pretrained(str(tmp_path), params, c, overwrite=True)
  assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors", "tokenizer.json"]
  _, back = hf.load_pretrained(str(tmp_path), **_overrides(cfg))
  chex.assert_trees_all_equal(jax.tree_util.tree_map(np.asarray, back),
                              jax.tree_util.tree_map(np.asarray, params))


def test_config_roundtrip(cfg):
  back = hf.config_from_hf(json.loads(json.dumps(hf.config_to_hf(cfg))))
  assert back == cfg.replace(hidden_choices=(), mamba_head_choices=(), expert_choices=(),
                             moe_ffn_choices=(), budgets=(("full", 1.0),))


@pytest.mark.parametrize("change,match", [
    ({"model_type": "llama"}, "expected model_type 'nemotron_h'"),
    ({"tie_word_embeddings": True}, "unsupported Nemotron-H option tie_word_embeddings"),
    ({"moe_latent_size": 8}, "moe_latent_size"),
    ({"n_group": 2}, "group-limited"),
])
def test_bad_hf_config(cfg, change, match):
  with pytest.raises(ValueError, match=match):
    hf.config_from_hf({**hf.config_to_hf(cfg), **change})


def test_bad_checkpoints(cfg, hf_folder, tmp_path):
  folder, _ = hf_folder
  tensors = dict(st.load_folder(folder))
  c = hf.config_from_hf(json.load(open(os.path.join(folder, "config.json"))))
  missing = {k: v for k, v in tensors.items() if "layers.0.mixer.D" not in k}
  with pytest.raises(ValueError, match="missing tensor 'backbone.layers.0.mixer.D'"):
    hf.params_from_hf(missing, c)
  wrong = dict(tensors)
  wrong["backbone.layers.1.mixer.q_proj.weight"] = np.zeros((3, 3), np.float32)
  with pytest.raises(ValueError, match="layers.1.mixer \\('\\*' layer\\): tensor shapes"):
    hf.params_from_hf(wrong, c)
  wrong["backbone.layers.1.mixer.q_proj.weight"] = np.zeros((64, 32), np.float32)
  with pytest.raises(ValueError, match="\\['mixer'\\]\\['q'\\]: shape \\(32, 8, 8\\)"):
    hf.params_from_hf(wrong, c)
  ints = dict(tensors)   # an I32 header on what should be float data
  ints["backbone.layers.0.mixer.D"] = tensors["backbone.layers.0.mixer.D"].view(np.int32)
  with pytest.raises(ValueError, match=r"\['mixer'\]\['D'\]: stored as int32, a float "
                                       "parameter needs a floating dtype"):
    hf.params_from_hf(ints, c)
  extra = {**tensors, "backbone.layers.9.norm.weight": np.zeros(3, np.float32)}
  with pytest.raises(ValueError, match="tensors this config does not use"):
    hf.params_from_hf(extra, c)
  bad = tmp_path / "model.safetensors"
  bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
  with pytest.raises(ValueError, match="model.safetensors: unreadable.*corrupt header"):
    st.load_file(str(bad))
  bad.write_bytes(b"\x01")
  with pytest.raises(ValueError, match="unreadable safetensors file, truncated"):
    st.load_file(str(bad))


def test_safetensors_files(tmp_path):
  """Round trip (bf16 and fp8 e4m3 too), lazy reads, and our checks on top of the library: a
  tensor in two shards, an unsupported dtype, a missing name."""
  import ml_dtypes
  a = np.arange(6, dtype=np.float32).reshape(2, 3)
  b = np.arange(4).astype(ml_dtypes.bfloat16)
  st.save_file({"a": a, "b": b}, str(tmp_path / "one.safetensors"), metadata={"format": "pt"})
  got = st.load_file(str(tmp_path / "one.safetensors"))
  assert sorted(got) == ["a", "b"] and len(got) == 2
  np.testing.assert_array_equal(got["a"], a)
  assert got["b"].dtype == b.dtype and np.array_equal(got["b"].astype(np.float32), [0, 1, 2, 3])
  st.save_file({"a": a}, str(tmp_path / "two.safetensors"))
  with pytest.raises(ValueError, match="tensor 'a' is in both .*one.safetensors and .*two"):
    st.load_folder(str(tmp_path))
  with pytest.raises(KeyError):
    got["c"]
  import safetensors.numpy
  fp8 = tmp_path / "fp8" / "model.safetensors"
  fp8.parent.mkdir()
  e4m3 = np.arange(4, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn)   # ModelOpt scales
  safetensors.numpy.save_file({"w": e4m3}, str(fp8))
  back = st.load_folder(str(fp8.parent))["w"]
  assert back.dtype == e4m3.dtype and np.array_equal(back.astype(np.float32), [0, 1, 2, 3])
  safetensors.numpy.save_file({"w": np.ones(2, ml_dtypes.float8_e5m2)}, str(fp8))
  with pytest.raises(ValueError, match="tensor 'w' has unsupported dtype F8_E5M2"):
    st.load_folder(str(fp8.parent))


def test_sliced_export_via_cli(cfg, params, tokens, tmp_path):
  """Nested checkpoint -> `python -m elastic_jax.slice` (hf and orbax) -> same logits."""
  from elastic_jax import from_counts
  from elastic_jax.io import checkpoint
  from elastic_jax.slice import parse_budget, run

  c = cfg.replace(**_overrides(cfg))
  ck = str(tmp_path / "nested")
  checkpoint.save(ck, params, c, budget_counts={"small": {"hidden": 24, "mamba_heads": 4,
                                                         "moe_experts": 6, "moe_ffn": 12}})
  masked = apply(params, tokens, from_counts(c, parse_budget("hidden=24,mamba_heads=4,"
                                                             "moe_experts=6,moe_ffn=12")), config=c)
  run(ck, "small", str(tmp_path / "hf"), "hf")
  model = transformers.NemotronHForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
  with torch.no_grad():
    ref = model(torch.tensor(np.asarray(tokens))).logits.numpy()
  np.testing.assert_allclose(ref, masked, rtol=1e-4, atol=1e-4)
  run(ck, parse_budget("moe_experts=4:8"), str(tmp_path / "orbax"), "orbax")
  sub, sub_cfg = checkpoint.restore(str(tmp_path / "orbax"))
  assert sub_cfg.experts_per_layer == (4, 8)
  with pytest.raises(ValueError, match="per-layer sizes"):
    run(ck, parse_budget("moe_experts=4:8"), str(tmp_path / "hf2"), "hf")
  with pytest.raises(ValueError, match="bad count"):
    parse_budget("hidden=big")


def test_import_streams_without_upcasting(cfg, tmp_path):
  """bf16 on disk -> bf16 params: no tensor is upcast, each leaf is placed as soon as its layer
  is read (layers in order), and the peak of traced memory stays under 1.5x the params (an
  fp32 copy of the model first peaks near 3x; the rest is a fixed ~0.7 MB of tracing)."""
  import tracemalloc
  from elastic_jax import init
  from elastic_jax.model.model import param_shapes
  big = cfg.replace(layer_pattern="MEMEM*EM-EME", param_dtype="bfloat16",
                    compute_dtype="bfloat16", hidden_size=1024, hidden_choices=())
  hf.save_pretrained(str(tmp_path), init(big, jax.random.PRNGKey(0)), big)
  placed = []
  tracemalloc.start()
  c, params = hf.load_pretrained(str(tmp_path), place=lambda path, x: placed.append(
      (path, x.dtype)) or x)
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  assert [jax.tree_util.keystr(p) for p, _ in leaves] == sorted(p for p, _ in placed)
  want = {jax.tree_util.keystr(p): s.dtype
          for p, s in jax.tree_util.tree_flatten_with_path(param_shapes(big))[0]}
  assert dict(placed) == want and np.dtype(jax.numpy.bfloat16) in want.values()
  layer_of = [int(p.split("']['")[1]) for p, _ in placed if p.startswith("['layers']")]
  assert layer_of == sorted(layer_of)
  nbytes = sum(x.nbytes for _, x in leaves)
  per_layer = [sum(x.nbytes for x in jax.tree.leaves(l)) for l in params["layers"].values()]
  assert peak < 1.5 * nbytes, (peak, nbytes, max(per_layer))


def test_hf_import_memory_experiment_reduced(tmp_path):
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  r = subprocess.run([sys.executable, os.path.join(root, "experiments", "hf_import_memory.py"),
                      "--reduced", f"--workdir={tmp_path}"], capture_output=True, text=True,
                     timeout=300, cwd=root)
  assert r.returncode == 0, r.stderr[-2000:]
  row = r.stdout.strip().splitlines()[-1].split("|")
  assert len(row) == 8 and float(row[2]) > 0 and float(row[5]) > 0, r.stdout


def test_speed_experiment_quick(tmp_path):
  """experiments/speed.py --quick: every cell timed on both sides (the ratio is transformers'
  time over ours), the budget rows, the table; its logit check refuses weights that differ."""
  import importlib.util
  import sys
  exp_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "experiments")
  sys.path.insert(0, exp_dir)
  spec = importlib.util.spec_from_file_location("speed", os.path.join(exp_dir, "speed.py"))
  speed = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(speed)
  rows, budget_rows = speed.run(str(tmp_path), quick=True)
  cells = speed.CELLS[True]
  assert [(r["cell"], r["B"], r["T"]) for r in rows] == (
      [("prefill", *c) for c in cells["prefill"]] + [("decode", *c) for c in cells["decode"]] +
      [("train", *c) for c in cells["train"]])
  for r in rows:
    assert r["ours_s"] > 0 and r["hf_s"] > 0 and r["ratio"] == r["hf_s"] / r["ours_s"]
  assert [(r["budget"], r["mode"]) for r in budget_rows] == [
      ("30B-like", "sliced"), ("23B-like", "masked"), ("23B-like", "sliced"),
      ("12B-like", "masked"), ("12B-like", "sliced")]
  assert budget_rows[0]["speedup"] == 1 and budget_rows[-1]["active_ratio"] < 1
  md = (tmp_path / "speed.md").read_text()
  train = [l for l in md.splitlines() if l.startswith("| tiny | 2 | 16 |")]   # vs matmul peak
  decode = [r for r in rows if r["cell"] == "decode"]   # also timed on the plain-jnp port
  assert decode and all(r["port_s"] > 0 for r in decode)
  assert all(r["port_s"] is None for r in rows if r["cell"] != "decode")
  assert md.count("\n| tiny |") == len(rows) + 1 + len(decode)
  assert len(train) == 1 and "%" in train[0]
  assert "host memory: glibc's default (`host_memory`)" in md   # run's default setting
  from elastic_jax import host_memory
  huge = "transparent huge pages (`glibc.malloc.hugetlb=1`)"
  assert speed.malloc_setting(False) == (huge if host_memory.huge_pages_active()
                                         else "glibc's default")
  assert speed.malloc_setting(True).endswith("freed memory kept")
  cfg = speed.configs(True)["tiny"]
  n_attn = cfg.layer_pattern.count("*")   # PaLM's count: 6N per token + attention
  assert speed.train_flops(cfg, 2, 16) - speed.train_flops(cfg, 1, 16) == pytest.approx(
      16 * (6 * count_params(cfg).active_without_embedding + 12 * n_attn * 16 * 4 * 16))
  from scaled import random_params
  params = random_params(cfg)
  model = speed.hf_model(params, cfg, str(tmp_path / "hf"))
  with pytest.raises(RuntimeError, match="not the same model"):
    speed.check_logits(random_params(cfg, seed=1), cfg, model)
