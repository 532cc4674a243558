"""Training phases: the budget schedule, a short elastic run (router and model both trained) and
fixed-student distillation."""
import collections
import dataclasses
import os

import chex

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from elastic_jax import count_params
from elastic_jax.training import data, phases
from elastic_jax.elastic import deploy
from elastic_jax.elastic import router as R
from elastic_jax.training.metrics import MetricsWriter
from elastic_jax.elastic.slicing import slice_params


def test_schedule_is_a_function_of_step():
  s = phases.ElasticSchedule(3, stage1_steps=1000, stage2_steps=1000, seed=5, micro_batches=3)
  assert [s.budgets(i) for i in range(1, 50)] == [s.budgets(i) for i in range(1, 50)]
  assert s.stage(1000) == 1 and s.stage(1001) == 2 and s.total == 2000
  assert all(len(s.budgets(i)) == 3 for i in (1, 1500))
  c1 = collections.Counter(b for i in range(1, 1001) for b in s.budgets(i))
  c2 = collections.Counter(b for i in range(1001, 2001) for b in s.budgets(i))
  # Stage 1: full with p 0.33, the rest uniform; stage 2: 0.5 / 0.3 / 0.2 (3000 draws each).
  assert c1[0] / 3000 == pytest.approx(0.33, abs=0.03)
  assert c1[1] / 3000 == pytest.approx(0.335, abs=0.03) and c1[2] / 3000 == pytest.approx(0.335, abs=0.03)
  assert [c2[i] / 3000 for i in range(3)] == pytest.approx([0.5, 0.3, 0.2], abs=0.03)
  # Micro-batches of one step draw budgets independently (steps mix sizes).
  assert sum(len(set(s.budgets(i))) > 1 for i in range(1, 101)) > 50
  # Four budgets: the stage-2 distribution is the one given, not a cycled default.
  four = phases.ElasticSchedule(4, 1, 4000, stage2_probs=(0.4, 0.3, 0.2, 0.1))
  c4 = collections.Counter(four.budgets(i)[0] for i in range(2, 4002))
  assert [c4[i] / 4000 for i in range(4)] == pytest.approx([0.4, 0.3, 0.2, 0.1], abs=0.025)


@pytest.mark.parametrize("n, p_full, probs", [(2, 0.33, (0.5, 0.3, 0.2)),
                                              (4, 0.33, (0.5, 0.3, 0.2)),
                                              (3, 0.33, (0.5, 0.3, 0.3)),
                                              (3, 0.33, (1.2, -0.1, -0.1)),
                                              (3, 1.5, (0.5, 0.3, 0.2))])
def test_schedule_probabilities_validated(n, p_full, probs):
  with pytest.raises(ValueError, match="elastic.p_full|elastic.stage2_probs must be"):
    phases.ElasticSchedule(n, 1, 1, p_full, probs)


def test_micro_batched_step_is_the_mean_of_micro_batch_steps():
  """M micro-batches in one step: loss, gradient and metrics are the means over micro-batches,
  row r in micro-batch r mod M, the per-micro args one per micro-batch, the rest shared."""
  def loss_fn(p, x, shared, own):
    loss = jnp.mean((x @ p["w"] - shared) ** 2) * own
    return loss, {"own": own}
  p = {"w": jnp.arange(3.0)}
  x = jax.random.normal(jax.random.PRNGKey(0), (6, 3))
  own = jnp.array([1.0, 2.0, 3.0])
  sgd = optax.sgd(1.0)
  state = {"params": p, "opt": sgd.init(p)}
  step = phases.train_step(loss_fn, sgd, donate=False, micro_batches=3, per_micro=(1,))
  new, metrics = step(state, x, 0.5, own)
  g = [jax.grad(lambda q: loss_fn(q, x[m::3], 0.5, own[m])[0])(p)["w"] for m in range(3)]
  np.testing.assert_allclose(new["params"]["w"], p["w"] - sum(g) / 3, rtol=1e-5)
  want = np.mean([loss_fn(p, x[m::3], 0.5, own[m])[0] for m in range(3)])
  np.testing.assert_allclose(metrics["loss"], want, rtol=1e-5)
  np.testing.assert_allclose(metrics["own"], 2.0)
  one = phases.train_step(loss_fn, sgd, donate=False, per_micro=(1,))(state, x, 0.5, own[:1])
  g1 = jax.grad(lambda q: loss_fn(q, x, 0.5, 1.0)[0])(p)["w"]
  np.testing.assert_allclose(one[0]["params"]["w"], p["w"] - g1, rtol=1e-5)
  with pytest.raises(ValueError, match="does not split into 4 micro-batches"):
    phases.train_step(loss_fn, sgd, donate=False, micro_batches=4, per_micro=(1,))(
        state, x, 0.5, jnp.ones(4))
  with pytest.raises(ValueError, match="micro_batches must be an int >= 1"):
    phases.train_step(loss_fn, sgd, micro_batches=0)


def test_kd_per_budget_averages_the_window():
  # Two steps of two micro-batches (metrics are micro-batch means): KD 2 and 4 on full, then
  # 1 on full and 3 on small. Per budget, the mean over its micro-batches; medium is absent.
  window = [{"kd_by_budget": np.array([2.0 + 4.0, 0.0, 0.0]) / 2,
             "n_by_budget": np.array([2.0, 0.0, 0.0]) / 2},
            {"kd_by_budget": np.array([1.0, 0.0, 3.0]) / 2,
             "n_by_budget": np.array([1.0, 0.0, 1.0]) / 2}]
  got = phases.kd_per_budget(window, ("full", "medium", "small"))
  assert got == pytest.approx({"kd_full": 7 / 3, "kd_small": 3.0})


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
                                 stage2_probs=(0.5, 0.5), micro_batches=2)
  rows = _rows(cfg)
  its = {k: iter(data.make_dataset(rows, 4, seed=k, shard_index=0, shard_count=1))
         for k in (1, 2)}
  router0 = R.init(cfg, rc, jax.random.PRNGKey(0))
  loop = _loop(tmp_path, "elastic")
  model, router = phases.elastic(params, params, cfg, router0, rc, sched, its, loop, lr=1e-3,
                                 router_lr=3e-2)
  # Each logged step carries the KD loss per budget over the micro-batches since the last log.
  logged = loop.writer.read("elastic")
  assert [r["step"] for r in logged] == [20, 40, 60]
  assert all({"kd_full", "kd_small"} <= set(r) for r in logged), logged
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


def test_elastic_step_trains_every_target_of_a_budget(cfg, params):
  """A budget with total, active and memory targets: the compiled step's budget loss has a
  term for each (it differs from the active-only budget's), finite, with router gradients."""
  rc = R.RouterConfig(hidden=8)
  rows = jnp.asarray(_rows(cfg, n=2))
  router = R.init(cfg, rc, jax.random.PRNGKey(0))
  out = {}
  for name, small in (("active", 0.6), ("multi", {"total": 0.45, "active": 0.6, "memory": 0.8})):
    c = cfg.replace(budgets=(("full", 1.0), ("small", small)))
    loss_fn = jax.jit(phases.elastic_step_loss(c, rc, 10))
    state = {"model": phases.to_stack_layout(params, c), "router": router}
    args = (rows, state["model"], jnp.int32(1), jnp.int32(0), jax.random.PRNGKey(0))
    (loss, m), g = jax.value_and_grad(loss_fn, has_aux=True)(state, *args)
    assert np.isfinite(float(loss)) and max(float(jnp.abs(x).max())
                                            for x in jax.tree.leaves(g["router"])) > 0
    out[name] = float(m["budget_loss"])
    # The router pays -log P(in band) of its budget at the step's logit scale, in the loss.
    combos, in_band = deploy.band_table(c, rc)
    lg = {n: R.logit_scale(0, 10, rc) * l
          for n, l in R.logits(router, R.budget_onehot(c, "small"), c, rc).items()}
    np.testing.assert_allclose(m["out_of_band"],
                               deploy.out_of_band_nll(lg, c, rc, combos, in_band[1]), rtol=1e-5)
    assert float(m["out_of_band"]) > 0
    np.testing.assert_allclose(loss, m["kd"] + m["budget_loss"] + m["out_of_band"], rtol=1e-6)
  assert out["multi"] > out["active"], out


QAD_COUNTS = {"full": {}, "small": {"hidden": 24, "mamba_heads": 4, "moe_experts": 6,
                                    "moe_ffn": 12}}


def test_qad_student_is_the_quantized_slice(cfg, params):
  """The QAD loss at a budget is the KL from the unquantized family's sub-model to the slice of
  the quantized parent (fake quant of the whole parent under the budget's hard masks), and its
  gradient reaches the quantized weights straight through."""
  from elastic_jax.quant.tree import QuantSpec, dequantize_params, quantize_params
  spec = QuantSpec("fp8")
  loss_fn = jax.jit(phases.qad_step_loss(cfg, spec, phases.budget_mask_table(cfg, QAD_COUNTS)))
  x = _rows(cfg, n=4)
  got, metrics = loss_fn(params, x, params, 1)
  small, small_cfg = slice_params(params, cfg, QAD_COUNTS["small"])
  qsmall, _ = slice_params(quantize_params(params, cfg, spec), cfg, QAD_COUNTS["small"])
  want = phases.forward_kl(phases.apply(small, x[:, :-1], config=small_cfg),
                           phases.apply(dequantize_params(qsmall), x[:, :-1], config=small_cfg))
  assert float(want) > 1e-7 and float(got) == pytest.approx(float(want), rel=1e-3)
  np.testing.assert_array_equal(np.asarray(metrics["n_by_budget"]), [0.0, 1.0])
  g = jax.grad(lambda p: loss_fn(p, x, params, 1)[0])(params)
  assert float(jnp.abs(g["layers"]["0"]["mixer"]["in_x"]).max()) > 0
  with pytest.raises(ValueError, match=r"budget_counts lack budgets \['small'\]"):
    phases.budget_mask_table(cfg, {"full": {}})


def test_qad_phase_resumes_exactly(cfg, params, tmp_path):
  """QAD is a resumable phase: stopped after 2 of 4 steps and run again, it ends where an
  uninterrupted run does, logging the KD per budget."""
  from elastic_jax.quant.tree import QuantSpec
  sched = phases.ElasticSchedule(len(cfg.budgets), 4, 0, p_full=0.5, stage2_probs=(0.5, 0.5),
                                 micro_batches=2)
  rows = _rows(cfg, n=16)
  run = lambda loop: phases.qad(params, cfg, QAD_COUNTS, QuantSpec("fp8"), sched,
                                iter(data.make_dataset(rows, 4, shard_index=0, shard_count=1)),
                                loop, lr=1e-2, warmup=1)
  stopped = dataclasses.replace(_loop(tmp_path, "qad"), stop_after=2, log_every=1)
  run(stopped)
  assert sorted(os.listdir(stopped.ckpt_dir)) == ["2"]
  resumed = run(dataclasses.replace(stopped, stop_after=None))
  whole = run(dataclasses.replace(_loop(tmp_path / "b", "qad"), log_every=1))
  chex.assert_trees_all_equal(resumed, whole)
  assert not np.array_equal(np.asarray(whole["layers"]["0"]["mixer"]["in_x"]),
                            np.asarray(params["layers"]["0"]["mixer"]["in_x"]))
  records = lambda d: [{k: v for k, v in r.items() if k not in ("tok_per_s", "time")}
                       for r in MetricsWriter(d, tensorboard=False).read("qad")]
  logged = records(str(tmp_path / "b"))
  assert [r["step"] for r in logged] == [1, 2, 3, 4] and records(str(tmp_path)) == logged
  assert all(r["kd"] > 0 and {f"kd_{n}" for n in cfg.budget_names} & set(r) for r in logged)
