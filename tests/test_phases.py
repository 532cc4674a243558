"""Training phases: the budget schedule, a short elastic run (router and model both trained) and
fixed-student distillation."""
import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic_jax import count_params
from elastic_jax.training import data, phases
from elastic_jax.elastic import router as R
from elastic_jax.training.metrics import MetricsWriter
from elastic_jax.elastic.slicing import slice_params


def test_schedule_is_a_function_of_step():
  s = phases.ElasticSchedule(3, stage1_steps=3000, stage2_steps=3000, seed=5)
  assert [s.budget(i) for i in range(1, 50)] == [s.budget(i) for i in range(1, 50)]
  assert s.stage(3000) == 1 and s.stage(3001) == 2 and s.total == 6000
  c1 = collections.Counter(s.budget(i) for i in range(1, 3001))
  c2 = collections.Counter(s.budget(i) for i in range(3001, 6001))
  # Stage 1: full with p 0.33, the rest uniform; stage 2: 0.5 / 0.3 / 0.2 (3000 draws each).
  assert c1[0] / 3000 == pytest.approx(0.33, abs=0.03)
  assert c1[1] / 3000 == pytest.approx(0.335, abs=0.03) and c1[2] / 3000 == pytest.approx(0.335, abs=0.03)
  assert [c2[i] / 3000 for i in range(3)] == pytest.approx([0.5, 0.3, 0.2], abs=0.03)
  # Two budgets: stage-2 probabilities renormalised to (0.5, 0.3) / 0.8 = (0.625, 0.375).
  two = phases.ElasticSchedule(2, 1, 4000, stage2_probs=(0.5, 0.3, 0.2))
  share = sum(two.budget(i) == 0 for i in range(2, 4002)) / 4000
  assert share == pytest.approx(0.625, abs=0.025)


def _rows(cfg, n=64, seq=12, seed=0):
  return np.random.RandomState(seed).randint(0, cfg.vocab_size, (n, seq + 1)).astype(np.int32)


def _loop(tmp_path, name):
  return phases.LoopOptions(str(tmp_path / name), MetricsWriter(str(tmp_path), tensorboard=False),
                            log_every=20, save_every=1000)


def test_elastic_phase_trains_router_and_model(cfg, params, tmp_path):
  # That the chosen sub-models meet their targets within the 5% band is checked on the tiny
  # main job (tests/test_train.py); this random-weight model has ~20x its KD loss, so here the
  # router is only required to anchor the full budget and shrink the small one.
  rc = R.RouterConfig(hidden=32, tau_decay=0.05 ** (1 / 40))
  sched = phases.ElasticSchedule(len(cfg.budgets), stage1_steps=40, stage2_steps=20,
                                 stage2_probs=(0.5, 0.5))
  rows = _rows(cfg)
  its = {k: iter(data.make_dataset(rows, 4, seed=k, shard_index=0, shard_count=1))
         for k in (1, 2)}
  router0 = R.init(cfg, rc, jax.random.PRNGKey(0))
  model, router = phases.elastic(params, params, cfg, router0, rc, sched, its,
                                 _loop(tmp_path, "elastic"), lr=1e-3, router_lr=3e-2)
  full = count_params(cfg).active
  ratio = lambda rp, b: count_params(cfg, R.chosen_counts(rp, cfg, rc, b)).active / full
  # Training anchors the full budget and moves the small one's pick toward its 0.5 target.
  before, after = ratio(router0, "small"), ratio(router, "small")
  assert ratio(router, "full") == 1.0
  assert abs(after - 0.5) < abs(before - 0.5) - 0.1, (before, after)
  assert jax.tree_util.tree_structure(model) == jax.tree_util.tree_structure(params)
  moved = jax.tree_util.tree_map(lambda a, b: float(np.abs(a - b).max()), model, params)
  assert max(jax.tree_util.tree_leaves(moved)) > 0


def test_distill_fixed_student(cfg, params, tmp_path):
  counts = {"hidden": 24, "mamba_heads": 4, "moe_experts": 6, "moe_ffn": 12}
  student, small_cfg = slice_params(params, cfg, counts)
  rows = _rows(cfg, n=8)
  teacher_logits = phases.apply(params, rows[:, :-1], config=cfg)
  kl = lambda p: float(jax.jit(phases.forward_kl)(
      teacher_logits, phases.apply(p, rows[:, :-1], config=small_cfg)))
  it = iter(data.make_dataset(rows, 8, shard_index=0, shard_count=1))
  trained = phases.distill(student, small_cfg, params, cfg, it, 15, _loop(tmp_path, "distill"),
                           lr=1e-2)
  assert kl(trained) < 0.7 * kl(student)


def test_pretrain_scanned_stack_equals_loop(cfg, params, tmp_path):
  """A phase on a scanning config holds scanned params (no per-step conversion) and returns the
  canonical layout; three AdamW steps match the loop's to fp32 rounding."""
  import chex
  rows = _rows(cfg, n=12)
  out = {}
  for scan in (False, True):
    it = iter(data.make_dataset(rows, 4, shard_index=0, shard_count=1))
    out[scan] = phases.pretrain(params, cfg.replace(scan_layers=scan), it, 3,
                                _loop(tmp_path, f"pre{scan}"), lr=1e-2, warmup=1)
  assert phases.to_stack_layout(params, cfg.replace(scan_layers=True))["layers"].keys() >= {"units"}
  chex.assert_trees_all_close(out[True], out[False], rtol=1e-4, atol=1e-5)
  assert not np.allclose(out[True]["embed"], params["embed"])


def test_bf16_model_trains_fp32_masters(cfg, params, tmp_path):
  """A bf16 model: the phase checkpoints fp32 master weights (and fp32 moments), returns the
  params in bf16, and leaves the caller's arrays alive although every step donates its state."""
  import orbax.checkpoint as ocp
  from elastic_jax.training import optim
  bcfg = cfg.replace(param_dtype="bfloat16")
  bparams = optim.to_dtype(params, jnp.bfloat16)
  it = iter(data.make_dataset(_rows(cfg, n=8), 4, shard_index=0, shard_count=1))
  loop = _loop(tmp_path, "bf16")
  out = phases.pretrain(bparams, bcfg, it, 2, loop, lr=1e-2, warmup=1)
  assert {x.dtype for x in jax.tree.leaves(out)} == {jnp.dtype(jnp.bfloat16)}
  assert not any(x.is_deleted() for x in jax.tree.leaves(bparams))
  meta = ocp.StandardCheckpointer().metadata(f"{loop.ckpt_dir}/2/state").item_metadata.tree
  dtypes = lambda t: {m.dtype for m in jax.tree.leaves(t, is_leaf=lambda x: hasattr(x, "dtype"))
                      if len(m.shape)}
  assert dtypes(meta["params"]) == dtypes(meta["opt"]) == {jnp.dtype(jnp.float32)}
  assert not np.array_equal(np.asarray(out["embed"], np.float32),
                            np.asarray(bparams["embed"], np.float32))
