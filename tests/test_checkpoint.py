"""Nested checkpoint: atomic save, full and sub-model restore (prefix reads), clear errors."""
import json
import os
import shutil

import chex
import jax
import numpy as np
import pytest

from elastic_jax import apply, from_counts
from elastic_jax.io import checkpoint
from elastic_jax.io.checkpoint import CheckpointError
from elastic_jax.elastic.axes import AXES

SMALL = {"hidden": 16, "mamba_heads": (2, 8), "moe_experts": 4, "moe_ffn": 8}


@pytest.fixture(scope="module")
def ckpt(cfg, params, tmp_path_factory):
  d = tmp_path_factory.mktemp("ck")
  path, tok = str(d / "nested"), str(d / "tok.json")
  with open(tok, "w") as f:
    f.write('{"run": "this one"}')
  router = {"w": np.arange(6.0, dtype=np.float32).reshape(2, 3)}
  checkpoint.save(path, params, cfg, router=router, chunk_byte_size=1024, tokenizer=tok,
                  budget_counts={"full": {}, "small": SMALL})
  return path


def test_full_restore_roundtrip(cfg, params, ckpt):
  restored, rcfg = checkpoint.restore(ckpt, expected_config=cfg)
  assert rcfg == cfg
  chex.assert_trees_all_equal(jax.tree_util.tree_map(np.asarray, restored),
                              jax.tree_util.tree_map(np.asarray, params))
  np.testing.assert_array_equal(checkpoint.restore_router(ckpt)["w"], np.arange(6.0).reshape(2, 3))
  meta = checkpoint.load_metadata(ckpt)
  assert meta["tokenizer"] == "tokenizer.json" and meta["axes"]["hidden"] == [32, 24, 16]


def test_sub_model_restore_reads_prefix_only(cfg, params, tokens, ckpt):
  b0 = checkpoint.bytes_read()
  checkpoint.restore(ckpt)
  b1 = checkpoint.bytes_read()
  small, small_cfg = checkpoint.restore(ckpt, "small")
  b2 = checkpoint.bytes_read()
  assert small_cfg.hidden_size == 16 and small_cfg.mamba_heads_per_layer == (2, 8)
  masked = apply(params, tokens, from_counts(cfg, SMALL), config=cfg)
  np.testing.assert_allclose(apply(small, tokens, config=small_cfg), masked, rtol=1e-5, atol=1e-5)
  assert (b2 - b1) < 0.6 * (b1 - b0), (b2 - b1, b1 - b0)


def test_depth_restore_reads_only_the_kept_layers(cfg_x, params, tokens, tmp_path):
  """A depth budget restores the layers it keeps (stored under their parent indices), renamed
  in order, each checked against its recorded prefix-box fingerprint; = slicing the parent."""
  from elastic_jax.elastic.slicing import slice_params
  cfg = cfg_x.replace(depth_order=(0, 2, 1, 4, 5, 3))
  path = str(tmp_path / "deep")
  counts = {"depth": 4, "hidden": 24, "attention_heads": 2, "mamba_head_dim": (3, 4)}
  checkpoint.save(path, params, cfg, budget_counts={"small": counts})
  b0 = checkpoint.bytes_read()
  sub, sub_cfg = checkpoint.restore(path, "small")
  b1 = checkpoint.bytes_read()
  checkpoint.restore(path, {**counts, "depth": 6})
  b2 = checkpoint.bytes_read()
  want, want_cfg = slice_params(params, cfg, counts)
  assert sub_cfg == want_cfg and sub_cfg.layer_pattern == "M*EM"
  chex.assert_trees_all_equal(jax.tree_util.tree_map(np.asarray, sub),
                              jax.tree_util.tree_map(np.asarray, want))
  # The two dropped layers (the MLP and the last MoE layer) are not read.
  assert (b1 - b0) < 0.8 * (b2 - b1), (b1 - b0, b2 - b1)
  masked = apply(params, tokens, from_counts(cfg, counts), config=cfg)
  np.testing.assert_allclose(apply(sub, tokens, config=sub_cfg), masked, rtol=1e-5, atol=1e-5)


def test_save_is_atomic_and_refuses_overwrite(cfg, params, ckpt, tmp_path):
  with pytest.raises(CheckpointError, match="exists; pass overwrite=True"):
    checkpoint.save(ckpt, params, cfg)
  bad = dict(params, final_norm={"scale": np.zeros(3, np.float32)})
  target = str(tmp_path / "c")
  with pytest.raises(CheckpointError, match="final_norm.*shape \\(3,\\)"):
    checkpoint.save(target, bad, cfg)
  assert os.listdir(tmp_path) == []  # nothing half-written left behind
  checkpoint.save(target, params, cfg)
  checkpoint.save(target, params, cfg, overwrite=True)
  assert sorted(os.listdir(tmp_path)) == ["c"]
  # overwrite replaces only a checkpoint of ours, never another folder.
  user = tmp_path / "thesis"
  user.mkdir()
  (user / "chapter1.tex").write_text("precious")
  with pytest.raises(CheckpointError, match="refusing to replace .*thesis.*not a checkpoint"):
    checkpoint.save(str(user), params, cfg, overwrite=True)
  assert (user / "chapter1.tex").read_text() == "precious"


def test_corrupt_chunk_never_loads_silently(cfg_x, params, tmp_path):
  """A stored chunk replaced by another valid one (decodes fine, wrong values): the full restore
  and every sub-model restore (which reads only a prefix box of each leaf: a named budget,
  other counts, per-layer counts; every axis elastic, depth included) name the leaf instead of
  returning the wrong weights."""
  cfg = cfg_x
  name = cfg.budget_names[-1]
  counts = {n: a.choices(cfg)[-1] for n, a in AXES.items()}
  path = checkpoint.save(str(tmp_path / "c"), params, cfg, chunk_byte_size=1024,
                         budget_counts={name: counts})
  other = {n: a.choices(cfg)[1] for n, a in AXES.items()}   # counts of no named budget
  per_layer = dict(other, moe_experts=tuple(AXES["moe_experts"].choices(cfg)[:2]))
  for budget in (None, name, other, per_layer):   # intact: fingerprints match
    checkpoint.restore(path, budget)
  chunks = tmp_path / "c" / "state" / "params.embed"
  a, b = sorted(f for f in os.listdir(chunks) if not f.startswith("."))[:2]
  shutil.copyfile(chunks / b, chunks / a)
  for budget in (None, name, dict(counts), other, per_layer):
    with pytest.raises(CheckpointError, match=r"leaf \['params'\]\['embed'\] does not match "
                                              r"the fingerprint recorded when it was saved"):
      checkpoint.restore(path, budget)


def test_tokenizer_travels_inside_the_checkpoint(cfg, params, ckpt, tmp_path):
  """A moved checkpoint uses its own tokenizer, not whatever its old path now holds."""
  moved = str(tmp_path / "moved")
  shutil.copytree(ckpt, moved)
  with open(os.path.join(os.path.dirname(ckpt), "tok.json"), "w") as f:
    f.write('{"run": "another one"}')
  with open(checkpoint.tokenizer_file(moved)) as f:
    assert f.read() == '{"run": "this one"}'
  assert checkpoint.load_metadata(moved)["tokenizer"] == "tokenizer.json"
  with pytest.raises(CheckpointError, match="tokenizer file .*nope.json.* not found"):
    checkpoint.save(str(tmp_path / "x"), params, cfg, tokenizer=str(tmp_path / "nope.json"))


def test_slice_refuses_to_write_over_its_source(ckpt, tmp_path):
  """`slice --out` equal to the source (or a folder holding it) would replace the family by
  one slice: refused before anything is read."""
  from elastic_jax.slice import run
  for out in (ckpt, os.path.dirname(ckpt)):
    with pytest.raises(ValueError, match="is or contains the source checkpoint"):
      run(ckpt, "small", out, "orbax", overwrite=True)
  assert checkpoint.is_checkpoint(ckpt)


def test_bad_budget_and_counts(ckpt):
  with pytest.raises(CheckpointError, match="unknown budget 'tiny'.*\\['full', 'small'\\]"):
    checkpoint.restore(ckpt, "tiny")
  with pytest.raises(ValueError, match="axis 'moe_ffn': count 9 is not one of"):
    checkpoint.restore(ckpt, {"moe_ffn": 9})


def test_corrupt_and_mismatched(cfg, params, ckpt, tmp_path):
  with pytest.raises(CheckpointError, match="config mismatch in fields \\['hidden_choices'\\]"):
    checkpoint.restore(ckpt, expected_config=cfg.replace(hidden_choices=(32, 16)))
  with pytest.raises(CheckpointError, match="no checkpoint directory"):
    checkpoint.restore(str(tmp_path / "nope"))
  target = str(tmp_path / "c")
  checkpoint.save(target, params, cfg)
  meta_path = os.path.join(target, "metadata.json")
  meta = json.load(open(meta_path))
  wrong = dict(meta, leaf_shapes={k: v for k, v in meta["leaf_shapes"].items() if "lm_head" not in k})
  json.dump(wrong, open(meta_path, "w"))
  with pytest.raises(CheckpointError, match="lacks leaf \\['lm_head'\\]"):
    checkpoint.restore(target)
  json.dump(dict(meta, config={**meta["config"], "hidden_size": 48, "hidden_choices": [48]}),
            open(meta_path, "w"))
  with pytest.raises(CheckpointError, match="stored with shape"):
    checkpoint.restore(target)
  open(meta_path, "w").write("{not json")
  with pytest.raises(CheckpointError, match="corrupt JSON"):
    checkpoint.restore(target)
  os.remove(meta_path)
  with pytest.raises(CheckpointError, match="missing metadata.json"):
    checkpoint.restore(target)


def test_slice_cli_subprocess(ckpt, tmp_path):
  import subprocess
  import sys
  out = str(tmp_path / "small")
  r = subprocess.run([sys.executable, "-m", "elastic_jax.slice", f"--checkpoint={ckpt}",
                      "--budget=small", f"--out={out}"], capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "restored budget small" in r.stdout and "wrote orbax sub-model" in r.stdout
  assert r.stderr.strip() == "", r.stderr[-2000:]   # no third-party noise a user cannot act on
  assert checkpoint.load_config(out).hidden_size == 16
  r = subprocess.run([sys.executable, "-m", "elastic_jax.slice", f"--checkpoint={ckpt}",
                      "--budget=huge", f"--out={out}2"], capture_output=True, text=True, timeout=300)
  # A user error is one line on stderr, not a traceback.
  assert r.returncode == 1 and "unknown budget 'huge'" in r.stderr
  assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_v1_checkpoint_restores_through_legacy_layout(cfg, params, ckpt, tmp_path):
  """A checkpoint written by elastic-jax 0.1 (layers as a list, bare norm weights, format v1)
  restores into the canonical layout, also as a prefix sub-model."""
  import chex
  import orbax.checkpoint as ocp

  from elastic_jax.model import layouts
  legacy = layouts.to_legacy(params)
  assert isinstance(legacy["layers"], list) and legacy["final_norm"].ndim == 1
  old = tmp_path / "v1"
  ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)).save(
      str(old / "state"), {"params": legacy})
  meta = checkpoint.load_metadata(ckpt)
  flat, _ = jax.tree_util.tree_flatten_with_path(legacy)
  meta.update(format="elastic-jax-nested-v1", has_router=False,
              leaf_shapes={jax.tree_util.keystr(p): list(x.shape) for p, x in flat})
  (old / "metadata.json").write_text(json.dumps(meta))
  restored, _ = checkpoint.restore(str(old))
  chex.assert_trees_all_equal(restored, jax.tree_util.tree_map(np.asarray, params))
  small, small_cfg = checkpoint.restore(str(old), "small")
  ref, _ = checkpoint.restore(ckpt, "small")
  chex.assert_trees_all_equal(small, ref)
  meta["format"] = "elastic-jax-nested-v0"
  (old / "metadata.json").write_text(json.dumps(meta))
  with pytest.raises(CheckpointError, match="format 'elastic-jax-nested-v0', expected"):
    checkpoint.restore(str(old))
