"""The optimizer: parameter groups, the weight-decay mask by kind, fp32 masters / fp32 moments,
donated train state; and the named random streams."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic_jax import rng
from elastic_jax.elastic import router as R
from elastic_jax.model.model import to_stack_layout
from elastic_jax.training import optim, phases

NO_DECAY = {"A_log", "D", "dt_bias", "conv_x_bias", "conv_B_bias", "conv_C_bias", "norm",
            "router_bias", "scale"}


def _names(tree, pred):
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {optim._leaf_name(p) for p, v in flat if pred(v)}


@pytest.mark.parametrize("scan", [False, True])
def test_decay_mask_by_parameter_kind(cfg, params, scan):
  """Mamba's A_log / D / dt_bias, norm scales, biases and the MoE correction bias never decay;
  every projection, expert, embedding and the lm_head does (canonical and scanned layouts)."""
  tree = to_stack_layout(params, cfg.replace(scan_layers=scan))
  mask = optim.decay_mask(tree)
  assert _names(mask, lambda m: not m) == NO_DECAY
  assert _names(mask, bool) >= {"embed", "lm_head", "in_x", "in_z", "out_proj", "conv_x", "up",
                                "down", "shared_up", "router"}


def test_weight_decay_skips_exempt_leaves(cfg, params):
  """With zero gradients AdamW moves only the decaying leaves (and shrinks them)."""
  tree = {"model": params, "router": R.init(cfg, R.RouterConfig(hidden=8), jax.random.PRNGKey(0))}
  opt = optim.elastic_adamw(10, model_lr=0.1, router_lr=0.1, weight_decay=0.5, warmup_steps=0)
  zeros = jax.tree.map(jnp.zeros_like, tree)
  update = jax.jit(opt.update)
  _, state = update(zeros, opt.init(tree), tree)    # step 0 of the warmup has LR 0
  updates, _ = update(zeros, state, tree)
  moved = jax.tree_util.tree_map_with_path(lambda p, u: optim.decays(p) and "router']" not in
                                           jax.tree_util.keystr(p[:1]), updates)
  for (path, u), m in zip(jax.tree_util.tree_flatten_with_path(updates)[0],
                          jax.tree.leaves(moved)):
    assert bool(jnp.any(u != 0)) == m, jax.tree_util.keystr(path)


def test_param_groups_have_their_learning_rates(cfg, params):
  tree = {"model": {"w": jnp.ones(3)}, "router": {"w": jnp.ones(3)}}
  opt = optim.elastic_adamw(100, model_lr=1e-4, router_lr=1e-2, warmup_steps=0)
  state = opt.init(tree)
  grads = jax.tree_util.tree_map(jnp.ones_like, tree)
  for _ in range(3):
    updates, state = opt.update(grads, state, tree)
  # Adam's first steps move each group by about its learning rate: router 100x the model's.
  ratio = float(jnp.abs(updates["router"]["w"][0]) / jnp.abs(updates["model"]["w"][0]))
  assert ratio == pytest.approx(100.0, rel=1e-3)


def _train(master, steps=20, lr=5e-5):
  """bf16 weights near 0.02 trained with a constant gradient at a small LR."""
  stored = {"w": jnp.full((4,), 0.02, jnp.bfloat16)}
  opt = optim.adamw(lr, steps, 0, weight_decay=0.0)
  w = optim.master_weights(stored, master)
  state = opt.init(w)
  for _ in range(steps):
    updates, state = opt.update({"w": jnp.ones((4,), w["w"].dtype)}, state, w)
    w = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), w, updates)
  return w, state


def test_fp32_masters_keep_small_updates_that_bf16_rounds_away():
  """An LR of 5e-5 is under half the bf16 ulp at 0.02 (1.2e-4): bf16 weights never move, fp32
  masters do, and AdamW's moments are fp32 in both modes."""
  w32, s32 = _train("float32")
  w16, s16 = _train("param")
  assert w32["w"].dtype == jnp.float32 and w16["w"].dtype == jnp.bfloat16
  assert float(w16["w"][0]) == float(jnp.bfloat16(0.02))
  assert float(w32["w"][0]) < 0.02 - 4e-4
  for s in (s32, s16):
    assert {x.dtype for x in jax.tree.leaves(s) if x.ndim} == {jnp.dtype(jnp.float32)}
  with pytest.raises(ValueError, match="optim.master must be one of"):
    optim.master_weights({}, "fp16")


def test_step_casts_masters_to_stored_dtypes():
  stored = jax.eval_shape(lambda: {"w": jnp.zeros(2, jnp.bfloat16), "n": jnp.zeros(2, jnp.int32)})
  seen = {}

  def loss(p):
    seen.update(jax.tree.map(lambda x: x.dtype, p))
    return jnp.sum(p["w"].astype(jnp.float32))
  jax.grad(optim.cast_for_step(loss, stored), allow_int=True)(
      {"w": jnp.ones(2), "n": jnp.zeros(2, jnp.int32)})
  assert seen == {"w": jnp.bfloat16, "n": jnp.int32}


def test_train_step_donates_its_state():
  """The old state's buffers are given to the new one; params and moments live once."""
  opt = optim.adamw(1e-2, 10, 0)
  p = {"w": jnp.ones((8,))}
  state = {"params": p, "opt": opt.init(p)}
  step = phases.train_step(lambda q, x: (jnp.sum(q["w"] * x), {}), opt)
  new, _ = step(state, jnp.ones((8,)))
  assert state["params"]["w"].is_deleted() and not new["params"]["w"].is_deleted()
  p = {"w": jnp.ones((8,))}
  kept = {"params": p, "opt": opt.init(p)}
  phases.train_step(lambda q, x: (jnp.sum(q["w"] * x), {}), opt, donate=False)(kept, jnp.ones(8))
  assert not kept["params"]["w"].is_deleted()


def test_streams_are_independent_and_stable():
  """Init and Gumbel keys differ, also per step / per leaf (fold_in j of each); host seeds
  differ per stream and are deterministic."""
  init, gumbel = rng.key(0, "init"), rng.key(0, "gumbel")
  data = lambda k: np.asarray(jax.random.key_data(k)).tolist()
  of_init = {str(data(jax.random.fold_in(init, j))) for j in range(16)}
  of_init |= {str(data(k)) for k in jax.random.split(init, 16)}   # per-leaf init keys
  of_gumbel = {str(data(jax.random.fold_in(gumbel, j))) for j in range(16)}  # per-step keys
  assert len(of_gumbel) == 16 and not of_init & of_gumbel and data(init) != data(gumbel)
  seeds = {s: rng.seed_for(0, s) for s in rng.STREAMS}
  assert len(set(seeds.values())) == len(rng.STREAMS)
  assert seeds == {s: rng.seed_for(0, s) for s in rng.STREAMS}
  assert rng.seed_for(1, "corpus") != seeds["corpus"]
  assert all(0 <= v < 2 ** 31 for v in seeds.values())
  with pytest.raises(ValueError, match="unknown random stream 'noise'"):
    rng.key(0, "noise")
