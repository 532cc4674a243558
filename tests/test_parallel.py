"""Meshes and shardings on 8 host devices: every large leaf really sharded, sharded forward and
gradients equal to one device, training phases on a mesh equal to one device, and a phase that
resumes on a different mesh shape."""
import contextlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from elastic_jax import apply, from_counts
from elastic_jax.elastic import router as R
from elastic_jax.model.model import to_stack_layout
from elastic_jax.parallel import mesh as M
from elastic_jax.parallel import sharding as S
from elastic_jax.training import data, optim, phases
from elastic_jax.training.metrics import MetricsWriter

COUNTS = {"hidden": 24, "mamba_heads": 6, "moe_experts": 6, "moe_ffn": 12}


@pytest.fixture(scope="module")
def mesh():
  return M.make_mesh("fsdp:2,tensor:2,expert:2")


def test_parse_and_resolve():
  assert M.resolve(M.parse_mesh("data:2,fsdp:-1"), 8) == {
      "data": 2, "fsdp": 4, "tensor": 1, "expert": 1}
  m = M.make_mesh("data:1,fsdp:-1,tensor:2,expert:1")
  assert dict(m.shape) == {"data": 1, "fsdp": 4, "tensor": 2, "expert": 1}
  assert M.make_mesh("fsdp:4", jax.devices()[4:]).devices.flatten().tolist() == jax.devices()[4:]
  for bad, msg in (("fsdp:-1,data:-1", "at most one"), ("pipe:2", "expected axis:size"),
                   ("fsdp:x", "integer"), ("fsdp:0", "positive"), ("data:3,fsdp:-1", "divide"),
                   ("data:2", "needs 2 devices"), ("fsdp:2,fsdp:4", "twice")):
    with pytest.raises(ValueError, match=msg):
      M.make_mesh(bad)


def test_spec_for_rules_divisibility_and_reuse(mesh):
  assert S.spec_for((64, 32), ("vocab", "embed"), mesh) == P("tensor", "fsdp")
  assert S.spec_for((8, 32, 16), ("experts", "embed", "expert_mlp"), mesh) == P(
      "expert", "fsdp", "tensor")
  assert S.spec_for((63, 32), ("vocab", "embed"), mesh) == P(None, "fsdp")  # 63 % 2: replicated
  # One mesh axis at most once per leaf; size-1 axes are left out.
  assert S.spec_for((4, 4), ("mlp", "expert_mlp"), mesh) == P("tensor", None)
  assert S.spec_for((4,), ("embed",), M.make_mesh("data:-1")) == P(None)
  with pytest.raises(ValueError, match="unknown mesh axes"):
    S.spec_for((4,), ("embed",), mesh, (("embed", "pipe"),))


@pytest.mark.parametrize("scan", [False, True])
def test_every_large_leaf_is_sharded(cfg, params, mesh, scan):
  c = cfg.replace(scan_layers=scan)
  p = to_stack_layout(params, c)
  placed = jax.device_put(p, S.param_shardings(p, c, mesh))
  assert S.replicated_leaves(placed, min_size=256) == []
  assert S.replicated_leaves(p, min_size=256) != []      # the check can fail
  chex.assert_trees_all_equal(jax.device_get(placed), jax.device_get(p))


@pytest.mark.parametrize("scan, moe_impl", [(False, "dense"), (True, "dense"), (True, "ep")])
def test_sharded_forward_and_grads_equal_one_device(cfg, params, mesh, scan, moe_impl):
  """Also with the experts split over the mesh's expert axis (moe_impl "ep", a shard_map
  inside the scanned stack), against the single-device dense MoE."""
  c = cfg.replace(scan_layers=scan)
  p = to_stack_layout(params, c)
  toks = jnp.asarray(np.random.RandomState(1).randint(0, cfg.vocab_size, (8, 13)), jnp.int32)
  masks = from_counts(cfg, COUNTS)

  def f(impl):
    @jax.jit
    def g(p, x):
      loss = lambda p: (jnp.mean(apply(p, x, masks, config=c, moe_impl=impl) ** 2)
                        + phases.lm_loss(p, x, c))
      return jax.value_and_grad(loss)(p)
    return g

  want = f("dense")(p, toks)
  sp = jax.device_put(p, S.param_shardings(p, c, mesh))
  # "ep" finds its mesh in the context (the training phases trace every step under it).
  with S.activation_context(mesh) if moe_impl == "ep" else contextlib.nullcontext():
    got = f(moe_impl)(sp, S.shard_batch(toks, mesh))
  # fp32 sums split over devices in another order: 1e-6 absolute on gradients of order 0.1
  # was once exceeded by one element of 1024 (1.06e-6), hence 2e-6.
  chex.assert_trees_all_close(jax.device_get(got), jax.device_get(want), rtol=1e-5, atol=2e-6)
  if moe_impl != "ep":
    # Gradients stay sharded like params. (Under the activation context, with any MoE path, a
    # few gradient leaves come out replicated when nothing pins them; the training step pins
    # its outputs with out_shardings.)
    assert S.replicated_leaves(got[1], min_size=256) == []


def test_activation_constraints_at_block_boundaries(cfg, params, tokens, mesh):
  """Under `activation_context` every block's output is constrained (batch split over the
  batch axes); outside it, none is."""
  f = jax.jit(lambda p, x: apply(p, x, config=cfg))
  x = S.shard_batch(jnp.tile(tokens, (4, 1)), mesh)
  with S.activation_context(mesh):
    inside = f.trace(params, x).lower().as_text()
  outside = f.trace(params, x).lower().as_text()
  n = lambda text: text.count("sdy.sharding_constraint") + text.count("@Sharding")  # shardy / gspmd
  assert n(inside) >= cfg.num_layers and n(outside) == 0
  assert '[{"data", "fsdp"}, {}, {}]' in inside or "devices=[2,1,1,4]" in inside


def test_optimizer_state_is_sharded_as_its_params(cfg, params, mesh):
  """The elastic optimizer (optax.multi_transform over model and router): each AdamW moment of a
  model leaf is sharded as that leaf; step counts and the small router stay replicated."""
  tree = {"model": params, "router": R.init(cfg, R.RouterConfig(hidden=16), jax.random.PRNGKey(0))}
  opt = optim.elastic_adamw(10, 1e-3, 1e-2)
  psh = {"model": S.param_shardings(params, cfg, mesh),
         "router": S.replicate_tree(tree["router"], mesh)}
  state = jax.jit(opt.init, out_shardings=S.opt_state_shardings(
      jax.eval_shape(opt.init, tree), tree, psh, mesh))(tree)
  assert [p for p in S.replicated_leaves(state, 256) if "'model'" in p] == []
  specs = {str(x.sharding.spec) for x in jax.tree.leaves(state)}
  split = lambda xs, shs: sum(s.shard_shape(x.shape) != x.shape for x, s in zip(xs, shs))
  n_params = split(jax.tree.leaves(params), jax.tree.leaves(psh["model"]))
  state_leaves = jax.tree.leaves(state)
  # mu and nu per split param, nothing else split
  assert split(state_leaves, [x.sharding for x in state_leaves]) == 2 * n_params > 0
  assert "P()" in specs


def test_shard_batch_refuses_an_uneven_batch(mesh):
  with pytest.raises(ValueError, match="does not split over 2 devices"):
    S.shard_batch(np.zeros((3, 5), np.int32), mesh)


def _loop(tmp_path, name, mesh=None, save_every=1000):
  return phases.LoopOptions(str(tmp_path / name), MetricsWriter(str(tmp_path / name),
                                                                 tensorboard=False),
                            log_every=1, save_every=save_every, mesh=mesh)


def _losses(tmp_path, name):
  return [r["loss"] for r in MetricsWriter(str(tmp_path / name), tensorboard=False).read()]


def _batches(cfg, seed=0):
  rows = np.random.RandomState(seed).randint(0, cfg.vocab_size, (64, 13)).astype(np.int32)
  return iter(data.make_dataset(rows, 8, seed=seed, shard_index=0, shard_count=1))


def test_pretrain_on_a_mesh_equals_one_device_and_resumes_on_another(cfg, params, mesh, tmp_path):
  one = phases.pretrain(params, cfg, _batches(cfg), 4, _loop(tmp_path, "one"), lr=1e-2)
  many = phases.pretrain(params, cfg, _batches(cfg), 4, _loop(tmp_path, "mesh", mesh), lr=1e-2)
  np.testing.assert_allclose(_losses(tmp_path, "mesh"), _losses(tmp_path, "one"), rtol=1e-5)
  chex.assert_trees_all_close(jax.device_get(many), jax.device_get(one), rtol=1e-4, atol=1e-5)
  assert S.replicated_leaves(many, min_size=256) == []
  # Saved every step on 8 devices, stopped at 2, resumed to 4 on a 4-device mesh.
  batches = _batches(cfg)
  phases.pretrain(params, cfg, batches, 2, _loop(tmp_path, "moved", mesh, 1), lr=1e-2)
  four = M.make_mesh("fsdp:2,tensor:2", jax.devices()[:4])
  loop4 = _loop(tmp_path, "moved", four, 1)
  # A new iterator: the data position comes back from the checkpoint.
  moved = phases.pretrain(params, cfg, _batches(cfg), 4, loop4, lr=1e-2)
  np.testing.assert_allclose(_losses(tmp_path, "moved"), _losses(tmp_path, "one"), rtol=1e-5)
  chex.assert_trees_all_close(jax.device_get(moved), jax.device_get(one), rtol=1e-4, atol=1e-5)
  assert {d.id for x in jax.tree.leaves(moved) for d in x.devices()} == {0, 1, 2, 3}


def test_elastic_phase_on_a_mesh_equals_one_device(cfg, params, mesh, tmp_path):
  """On the mesh the experts run expert-parallel ("ep") in the balanced placement; losses and
  the returned (logical-order) params equal the one-device dense run."""
  rc = R.RouterConfig(hidden=16)
  sched = phases.ElasticSchedule(len(cfg.budgets), stage1_steps=2, stage2_steps=1,
                                 stage2_probs=(0.6, 0.4))
  router0 = R.init(cfg, rc, jax.random.PRNGKey(0))
  out = {}
  for name, m, kw in (("one", None, {}),
                      ("mesh", mesh, {"moe_impl": "ep", "expert_placement": "balanced"})):
    its = {k: _batches(cfg, k) for k in (1, 2)}
    out[name] = phases.elastic(params, params, cfg, router0, rc, sched, its,
                               _loop(tmp_path, name, m), lr=1e-3, router_lr=3e-2, **kw)
  np.testing.assert_allclose(_losses(tmp_path, "mesh"), _losses(tmp_path, "one"), rtol=1e-5)
  chex.assert_trees_all_close(jax.device_get(out["mesh"]), jax.device_get(out["one"]),
                              rtol=1e-4, atol=1e-5)
  assert S.replicated_leaves(out["mesh"][0], min_size=256) == []


# The multi-process run and its single-process reference share this setup.
MP_STEPS = (2, 2)   # elastic stage 1 and stage 2 steps


def elastic_run(workdir, process=None, stop_after=None):
  """The elastic phase on fsdp:2,tensor:2,expert:2 over 8 devices. With `process` = (index,
  count) this process reads its shard of the data; without it, one process reads every shard
  and concatenates them in process order (the same global batches)."""
  import conftest
  from elastic_jax import init
  cfg = conftest.CFG
  params = conftest.perturb(init(cfg, jax.random.PRNGKey(0)), jax.random.PRNGKey(1))
  rc = R.RouterConfig(hidden=16)
  sched = phases.ElasticSchedule(len(cfg.budgets), *MP_STEPS, stage2_probs=(0.6, 0.4))
  rows = np.random.RandomState(3).randint(0, cfg.vocab_size, (64, 13)).astype(np.int32)
  shard = lambda k, i: iter(data.make_dataset(rows, 4, seed=k, shard_index=i, shard_count=2))
  its = ({k: shard(k, process[0]) for k in (1, 2)} if process else
         {k: _Concat([shard(k, 0), shard(k, 1)]) for k in (1, 2)})
  loop = phases.LoopOptions(str(workdir / "ckpt"), MetricsWriter(str(workdir), tensorboard=False),
                            log_every=1, save_every=1, mesh=M.make_mesh("fsdp:2,tensor:2,expert:2"),
                            stop_after=stop_after)
  return phases.elastic(params, params, cfg, R.init(cfg, rc, jax.random.PRNGKey(0)), rc, sched,
                        its, loop, lr=1e-2, router_lr=3e-2)


class _Concat:
  """Batches of several iterators side by side (a resumable grain-like iterator)."""
  def __init__(self, its):
    self.its = its

  def __next__(self):
    return np.concatenate([next(it) for it in self.its])

  def get_state(self):
    return [it.get_state() for it in self.its]

  def set_state(self, state):
    for it, s in zip(self.its, state):
      it.set_state(s)


def test_two_processes_equal_one_step_for_step_and_resume(tmp_path):
  """2 processes x 4 CPU devices (jax.distributed over 127.0.0.1, gloo): a few elastic steps,
  stopped and saved at step 2 (each process's data state too), resumed to the end; the loss
  curve equals one process driving all 8 devices."""
  import os
  import socket
  import subprocess
  import sys
  one = tmp_path / "one"
  elastic_run(one)
  multi = tmp_path / "multi"
  worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiprocess_worker.py")
  from conftest import xla_flags
  env = {**os.environ, "XLA_FLAGS": xla_flags(4)}
  for stop in (2, sum(MP_STEPS)):
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      port = str(s.getsockname()[1])
    procs = [subprocess.Popen([sys.executable, worker, str(i), port, str(multi), str(stop)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for i in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
  assert "elastic: resumed from step 2/4" in outs[0]
  got, want = _losses(tmp_path, "multi"), _losses(tmp_path, "one")
  assert len(got) == len(want) == sum(MP_STEPS)
  np.testing.assert_allclose(got, want, rtol=1e-5)


def _free_port() -> str:
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return str(s.getsockname()[1])


def test_train_pipeline_across_two_processes(tmp_path):
  """The whole main job (pretraining, importance and nesting, the nested parent's save, elastic
  KD, the nested checkpoint, the report) as 2 processes x 4 CPU devices on one mesh: both
  exit 0, every checkpoint is written once into place (shards from both processes), process 0
  alone writes metrics, and the family restores in one process with every budget in band."""
  import os
  import subprocess
  import sys
  from elastic_jax.io import checkpoint
  from elastic_jax.training.metrics import MetricsWriter
  workdir = tmp_path / "run"
  flags = ["--config.pretrain.steps=2", "--config.elastic.stage1_steps=2",
           "--config.elastic.stage2_steps=1", "--config.log_every=1",
           "--config.checkpoint.save_every=2", "--config.data.batch=8",
           "--config.data.n_text=100", "--config.data.n_reasoning=100",
           "--config.elastic.calib_batches=1", "--config.eval.n_reasoning=0",
           "--config.elastic.stage2_len_mult=1",
           "--config.eval.max_think_tokens=2", "--config.eval.max_answer_tokens=1",
           "--config.parallel.mesh=fsdp:2,tensor:2,expert:2"]
  port = _free_port()
  from conftest import xla_flags
  env = {**os.environ, "XLA_FLAGS": xla_flags(4)}
  procs = [subprocess.Popen([sys.executable, "-m", "elastic_jax.train", f"--workdir={workdir}",
                             *flags, f"--coordinator_address=127.0.0.1:{port}",
                             "--num_processes=2", f"--process_id={i}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
           for i in range(2)]
  outs = [p.communicate(timeout=900)[0] for p in procs]
  assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
  assert "mesh: data:1,fsdp:2,tensor:2,expert:2 over 8 cpu devices" in outs[0]
  leftovers = [f for f in os.listdir(workdir) if ".tmp-" in f or ".old-" in f]
  assert leftovers == [], leftovers
  records = MetricsWriter(str(workdir), tensorboard=False).read()
  steps = [(r["phase"], r["step"]) for r in records if "step" in r]
  assert len(steps) == len(set(steps)) == 2 + 3, steps     # one writer, every step once
  report = [r for r in records if r["phase"] == "report"]
  assert [r["budget"] for r in report] == ["full", "medium", "small"]
  for r in report:
    assert abs(r["active_ratio"] / r["target"] - 1) <= 0.05, r
  small, small_cfg = checkpoint.restore(str(workdir / "nested"), "small")  # fingerprints checked
  assert small_cfg.hidden_size == report[-1]["counts"]["hidden"]
  checkpoint.restore(str(workdir / "parent"))


def test_distributed_initialize_arguments():
  from elastic_jax.parallel import distributed
  assert distributed.initialize() is False          # single process: nothing to join
  with pytest.raises(ValueError, match="give all of"):
    distributed.initialize("127.0.0.1:1234", 2)
  with pytest.raises(ValueError, match=r"--process_id 2 not in \[0, 2\)"):
    distributed.initialize("127.0.0.1:1234", 2, 2)
  assert distributed.allgather_json({"a": [1]}) == [{"a": [1]}]


def test_hf_import_places_each_tensor_on_its_shards(cfg, params, mesh, tmp_path):
  """The streaming HF import with `place_by_path`: every leaf arrives sharded as the model's
  logical axes say, with the values of a plain import."""
  from elastic_jax.io import hf
  from elastic_jax.model.model import param_shapes
  hf.save_pretrained(str(tmp_path), params, cfg)
  want = S.param_shardings(param_shapes(cfg), cfg, mesh)
  _, placed = hf.load_pretrained(str(tmp_path), place=S.place_by_path(want))
  _, plain = hf.load_pretrained(str(tmp_path))
  for x, s in zip(jax.tree.leaves(placed), jax.tree.leaves(want)):
    assert x.sharding == s
  assert S.replicated_leaves(placed, min_size=256) == []
  chex.assert_trees_all_equal(jax.device_get(placed), plain)


def test_prefix_restore_lands_on_its_target_shardings(cfg, params, mesh, tmp_path):
  """A named budget's sub-model restored with `sharding=mesh`: every leaf read straight into the
  logical-axis sharding of the sub-model's own shapes (nothing large replicated), values equal
  to the one-device restore, checked against the budget's fingerprints."""
  from elastic_jax.elastic.axes import AXES
  from elastic_jax.io import checkpoint
  name = cfg.budget_names[-1]
  counts = {n: a.choices(cfg)[min(1, len(a.choices(cfg)) - 1)] for n, a in AXES.items()}
  path = checkpoint.save(str(tmp_path / "nested"), params, cfg, budget_counts={name: counts})
  one, small = checkpoint.restore(path, name)
  many, small_many = checkpoint.restore(path, name, sharding=mesh)
  assert small_many == small
  want = S.param_shardings(one, small, mesh)
  got = jax.tree.map(lambda x: x.sharding, many)
  chex.assert_trees_all_equal_structs(got, want)
  for g, w, x in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(many)):
    assert g.is_equivalent_to(w, x.ndim), (g, w)
  assert S.replicated_leaves(many, min_size=256) == []
  chex.assert_trees_all_equal(jax.device_get(many), jax.device_get(one))
