"""The training phases of an elastic run, each resumable (`loop.run_phase`):

- `pretrain`: next-token cross-entropy (the tiny parent, or a small model from scratch);
- `distill`: one fixed student against a frozen teacher (forward KL), e.g. a pruned slice
  (Minitron-style baseline);
- `elastic`: the whole family in one run: budget router + masked student vs the frozen parent
  (forward KL + budget loss), one budget per step, two stages (METHOD.md section 5);
- `qad`: quantization-aware distillation of the trained family: each budget's fake-quantized
  sub-model against the same budget of the frozen unquantized family, the router frozen at its
  deployed counts (METHOD.md section 6).

Batches come from grain iterators (their state is checkpointed); everything random derives from
(seed, step), so a resumed phase repeats the uninterrupted one exactly.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from elastic_jax import rng
from elastic_jax.config import ModelConfig
from elastic_jax.elastic import deploy
from elastic_jax.elastic import masks as masks_lib
from elastic_jax.elastic import router as router_lib
from elastic_jax.parallel import sharding as shd
from elastic_jax.parallel.rules import DEFAULT_RULES
from elastic_jax.training import optim
from elastic_jax.quant.tree import QuantSpec, fake_quant_params
from elastic_jax.training.distill import (chunked_cross_entropy, chunked_forward_kl, elastic_loss,
                                          forward_kl)
from elastic_jax.training.loop import commit, run_phase
from elastic_jax.model.model import (apply, apply_hidden, place_experts, to_canonical,
                                     to_stack_layout)


@dataclasses.dataclass(frozen=True)
class LoopOptions:
  """Where and how often a phase logs and checkpoints (`ckpt_dir` is per phase), the device
  mesh it runs on (None: one device) with the logical-axis rules that shard it, and how the
  trained weights are held (`master`: fp32 masters or the stored dtype, `training.optim`)."""
  ckpt_dir: str
  writer: Any                      # metrics.MetricsWriter
  log_every: int = 25
  save_every: int = 50
  keep: int = 2
  mesh: Any = None                 # jax.sharding.Mesh
  rules: tuple = DEFAULT_RULES
  stop_after: int | None = None    # end this attempt at that step (saved); re-run to go on
  master: str = "float32"          # optim.MASTERS

  def model_sharding(self, params, config: ModelConfig):
    """Shardings of `params` (either layout) by their logical axes; None without a mesh."""
    return None if self.mesh is None else shd.param_shardings(params, config, self.mesh,
                                                              self.rules)

  def place_model(self, params, config: ModelConfig):
    """`params` sharded on the mesh; as they are without one."""
    return params if self.mesh is None else jax.device_put(params,
                                                           self.model_sharding(params, config))


def lm_loss(params, tokens_BT, config: ModelConfig, masks=None, lm_chunk: int = 0,
            moe_impl: str = "dense"):
  """Mean next-token cross-entropy of `tokens[:, 1:]` given `tokens[:, :-1]`; `lm_chunk` > 0
  computes it that many tokens at a time from hidden states (no [B, T, V] logits); `moe_impl`
  the MoE dispatch (`model.moe.MOE_IMPLS`)."""
  if lm_chunk:
    hidden = apply_hidden(params, tokens_BT[:, :-1], masks, config=config, moe_impl=moe_impl)
    return chunked_cross_entropy(hidden, params["lm_head"], tokens_BT[:, 1:], config, lm_chunk)
  logits = apply(params, tokens_BT[:, :-1], masks, config=config, moe_impl=moe_impl)
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, tokens_BT[:, 1:, None], -1))


def check_chunk(name: str, chunk) -> None:
  """ValueError unless `chunk` (the config field `name`) is an int >= 0 (0: unchunked)."""
  if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0:
    raise ValueError(f"{name} must be an int >= 0 (0: unchunked), got {chunk!r}")


def train_step(loss_fn: Callable, opt, out_shardings=None, donate: bool = True,
               micro_batches: int = 1, per_micro: Sequence[int] = ()):
  """jitted (state, x, *args) -> (state, metrics); loss_fn(params, x, *args) -> (loss, metrics).
  On a mesh, `out_shardings` keeps the new state where the old one was. `donate`: the old
  state's buffers are reused for the new one (params and optimizer state live once).

  `micro_batches` M > 1 accumulates gradients over M micro-batches in one step: row r of `x`
  goes to micro-batch r mod M (each device's rows feed every micro-batch, no resharding), the
  args at positions `per_micro` carry a leading [M] axis (one value per micro-batch), the rest
  are shared; loss, gradient and metrics are the means over micro-batches. A lax.scan runs them
  one after another, so activations are held for one micro-batch at a time."""
  M = micro_batches
  if not isinstance(M, int) or isinstance(M, bool) or M < 1:
    raise ValueError(f"micro_batches must be an int >= 1, got {M!r}")
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def loss_and_grad(params, x, *args):
    if M == 1:
      args = [a[0] if i in per_micro else a for i, a in enumerate(args)]
      return grad_fn(params, x, *args)
    if x.shape[0] % M:
      raise ValueError(f"batch of {x.shape[0]} rows does not split into {M} micro-batches")
    xs = jnp.swapaxes(x.reshape(x.shape[0] // M, M, *x.shape[1:]), 0, 1)
    mine = tuple(args[i] for i in per_micro)

    def one(grads, inp):
      xm, own = inp
      full = list(args)
      for i, a in zip(per_micro, own):
        full[i] = a
      (loss, metrics), g = grad_fn(params, xm, *full)
      return jax.tree.map(jnp.add, grads, g), (loss, metrics)

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, (loss, metrics) = jax.lax.scan(one, zeros, (xs, mine))
    mean = lambda t: jax.tree.map(lambda v: jnp.mean(v, 0), t)
    return (mean(loss), mean(metrics)), jax.tree.map(lambda g: g / M, grads)

  def step(state, *args):
    (loss, metrics), g = loss_and_grad(state["params"], *args)
    updates, opt_state = opt.update(g, state["opt"], state["params"])
    return ({"params": optax.apply_updates(state["params"], updates), "opt": opt_state},
            {"loss": loss, **metrics})
  kw = {} if out_shardings is None else {"out_shardings": out_shardings}
  return jax.jit(step, donate_argnums=(0,) if donate else (), **kw)


def state_shardings(opt, params, params_sharding, mesh) -> dict:
  """Shardings of a train state {"params", "opt"}: the params' own, and the optimizer state
  sharded as the params it mirrors (`params` may be arrays or ShapeDtypeStructs)."""
  return {"params": params_sharding,
          "opt": shd.opt_state_shardings(jax.eval_shape(opt.init, params), params,
                                         params_sharding, mesh)}


def elastic_params_sharding(model, router, config: ModelConfig, mesh, rules=DEFAULT_RULES):
  """Shardings of the elastic phase's {"model", "router"}: the model by its logical axes, the
  small router replicated."""
  return {"model": shd.param_shardings(model, config, mesh, rules),
          "router": shd.replicate_tree(router, mesh)}


def _own_copy(tree):
  """Fresh buffers for every array of `tree`: the train step donates its state, and the
  caller's arrays (e.g. the parent that is also the teacher) must survive it."""
  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _init_state(params, opt, loop: LoopOptions, params_sharding):
  """{"params", "opt"}: the master weights of `params` (`loop.master`) in buffers of their
  own, on one device or placed by `params_sharding`, with the optimizer state created in
  place, sharded as the params it mirrors."""
  params = optim.master_weights(params, loop.master)
  if loop.mesh is None:
    params = _own_copy(params)
    return commit({"params": params, "opt": opt.init(params)}), None
  sh = state_shardings(opt, params, params_sharding, loop.mesh)
  params = _own_copy(jax.device_put(params, params_sharding))
  state = {"params": params, "opt": jax.jit(opt.init, out_shardings=sh["opt"])(params)}
  return state, (sh, shd.replicated(loop.mesh))


def _run(name, loss_fn, params, opt, total, it, loop: LoopOptions, args_for_step=None,
         describe=None, iterators=None, params_sharding=None, micro_batches: int = 1,
         per_micro: Sequence[int] = (), window=None):
  """Trains `params` (returned in their own dtypes) with `loss_fn` and `opt` for `total`
  steps of batches from `it` (an iterator, or step -> iterator); `micro_batches` and
  `per_micro` as `train_step`, `window` as `loop.run_phase`."""
  stored = jax.eval_shape(lambda p: p, params)   # dtypes the model keeps; no buffers held
  state, out_shardings = _init_state(params, opt, loop, params_sharding)
  del params
  step = train_step(optim.cast_for_step(loss_fn, stored), opt, out_shardings,
                    micro_batches=micro_batches, per_micro=per_micro)
  put = ((lambda x: jnp.asarray(x)) if loop.mesh is None else
         (lambda x: shd.shard_batch(x, loop.mesh, loop.rules)))

  def step_fn(state, i):
    x = put(next(it(i)) if callable(it) else next(it))
    extra = args_for_step(i, x) if args_for_step else ()
    with shd.activation_context(loop.mesh, loop.rules):
      state, metrics = step(state, x, *extra)
    return state, metrics, int(x[:, :-1].size)

  state = run_phase(name, step_fn, state, total, ckpt_dir=loop.ckpt_dir, writer=loop.writer,
                    iterators=iterators or {"train": it}, log_every=loop.log_every,
                    save_every=loop.save_every, keep=loop.keep, describe=describe,
                    stop_after=loop.stop_after, window=window)
  return optim.like(state["params"], stored)


def pretrain(params, config: ModelConfig, batches, steps: int, loop: LoopOptions, *,
             lr: float = 3e-3, warmup: int = 20, weight_decay: float = 1e-4,
             lm_chunk: int = 0, moe_impl: str = "dense", name: str = "pretrain"):
  """Trains `params` for `steps` steps of next-token loss on `batches` ([B, L+1] rows);
  `lm_chunk` > 0 runs the loss that many tokens at a time, `moe_impl` is the MoE dispatch
  (`lm_loss`)."""
  check_chunk("pretrain.lm_chunk", lm_chunk)
  loss_fn = lambda p, x: (lm_loss(p, x, config, lm_chunk=lm_chunk, moe_impl=moe_impl), {})
  # Params (and the teacher) are held in the layout the stack runs (scanned when it scans).
  params = to_stack_layout(params, config)
  out = _run(name, loss_fn, params, optim.adamw(lr, steps, warmup, weight_decay), steps,
             batches, loop, params_sharding=loop.model_sharding(params, config))
  return to_canonical(out, config)


def distill(student, student_config: ModelConfig, teacher, teacher_config: ModelConfig,
            batches, steps: int, loop: LoopOptions, *, lr: float = 1e-3, warmup: int = 10,
            weight_decay: float = 1e-4, moe_impl: str = "dense", name: str = "distill"):
  """Trains a fixed `student` to match the frozen `teacher` (forward KL at T = 1); `moe_impl`
  is the MoE dispatch of both."""
  def loss_fn(p, x, teacher):
    t = jax.lax.stop_gradient(apply(teacher, x[:, :-1], config=teacher_config,
                                    moe_impl=moe_impl))
    return forward_kl(t, apply(p, x[:, :-1], config=student_config, moe_impl=moe_impl)), {}
  teacher = commit(loop.place_model(to_stack_layout(teacher, teacher_config), teacher_config))
  student = to_stack_layout(student, student_config)
  out = _run(name, loss_fn, student, optim.adamw(lr, steps, warmup, weight_decay), steps,
             batches, loop, lambda i, x: (teacher,),
             params_sharding=loop.model_sharding(student, student_config))
  return to_canonical(out, student_config)


def check_budget_probs(n_budgets: int, p_full: float, stage2_probs: Sequence[float]) -> None:
  """ValueError unless `p_full` is a probability and `stage2_probs` is a distribution with one
  entry per budget (large to small)."""
  if not 0.0 <= p_full <= 1.0:
    raise ValueError(f"elastic.p_full must be in [0, 1], got {p_full!r}")
  p = np.asarray(stage2_probs, float)
  if p.ndim != 1 or len(p) != n_budgets or np.any(p < 0) or abs(p.sum() - 1.0) > 1e-6:
    raise ValueError(f"elastic.stage2_probs must be {n_budgets} probabilities (one per budget, "
                     f"large to small) summing to 1, got {tuple(stage2_probs)!r}")


@dataclasses.dataclass(frozen=True)
class ElasticSchedule:
  """Which budget each micro-batch of each step trains (METHOD.md section 5), a pure function
  of (seed, step). `micro_batches` > 1: a budget per micro-batch, so every optimizer step
  averages gradients over budgets (as Megatron); 1: one budget per step."""
  n_budgets: int
  stage1_steps: int
  stage2_steps: int
  p_full: float = 0.33
  stage2_probs: Sequence[float] = (0.5, 0.3, 0.2)
  seed: int = 0
  micro_batches: int = 1

  def __post_init__(self):
    check_budget_probs(self.n_budgets, self.p_full, self.stage2_probs)
    if (not isinstance(self.micro_batches, int) or isinstance(self.micro_batches, bool)
        or self.micro_batches < 1):
      raise ValueError(f"elastic.micro_batches must be an int >= 1, got {self.micro_batches!r}")

  @property
  def total(self) -> int:
    return self.stage1_steps + self.stage2_steps

  def stage(self, step: int) -> int:
    return 1 if step <= self.stage1_steps else 2

  def budgets(self, step: int) -> tuple[int, ...]:
    """One index into the config's budgets per micro-batch: stage 1 full with p_full else
    uniform over the rest; stage 2 with `stage2_probs` (one per budget, large to small)."""
    rng = np.random.default_rng([self.seed, step])
    n, M = self.n_budgets, self.micro_batches
    if n == 1:
      return (0,) * M
    if self.stage(step) == 1:
      return tuple(0 if rng.random() < self.p_full else int(rng.integers(1, n))
                   for _ in range(M))
    return tuple(int(b) for b in rng.choice(n, size=M, p=np.asarray(self.stage2_probs, float)))


def elastic_step_loss(config: ModelConfig, rc: router_lib.RouterConfig, total_steps: int,
                      budget_weight: float = 1.0, hard_prob: float = 0.004,
                      moe_impl: str = "dense", kd_chunk: int = 0):
  """loss_fn({"model", "router"}, rows, teacher, budget index, step, key) -> (loss, metrics):
  the elastic phase's objective on one micro-batch (also what `elastic_jax.plan` compiles).
  `moe_impl` is the MoE dispatch of student and teacher (`model.moe.MOE_IMPLS`); `kd_chunk` > 0
  runs the KD term that many tokens at a time from hidden states (`distill.chunked_forward_kl`).
  Metrics "kd_by_budget" / "n_by_budget" ([n_budgets]: the KD loss and a 1 at the budget
  trained) give per-budget KD once averaged (`kd_per_budget`). With `rc.band_weight` > 0 the
  router also pays -log P(in band) of its budget (`deploy.out_of_band_nll`)."""
  check_chunk("elastic.kd_chunk", kd_chunk)
  targets = router_lib.budget_targets(config)
  n = len(config.budgets)
  table = deploy.band_table(config, rc) if rc.band_weight > 0 else None

  def loss_fn(state, x, teacher, b, step, key):
    x = x[:, :-1]  # KD needs no shifted targets; the row's inputs, as in the other phases
    fwd = apply_hidden if kd_chunk else apply
    t = jax.lax.stop_gradient(fwd(teacher, x, config=config, moe_impl=moe_impl))
    onehot = jax.nn.one_hot(b, n)
    loss, metrics = elastic_loss(
        state["model"], state["router"], t, x, onehot, {m: v[b] for m, v in targets.items()},
        step, total_steps, key, config=config, rc=rc, budget_weight=budget_weight,
        hard_prob=hard_prob, moe_impl=moe_impl,
        teacher_lm_head=jax.lax.stop_gradient(teacher["lm_head"]), kd_chunk=kd_chunk,
        band=None if table is None else (table[0], jnp.asarray(table[1])[b]))
    return loss, {**metrics, "kd_by_budget": onehot * metrics["kd"], "n_by_budget": onehot}
  return loss_fn


def kd_per_budget(window: Sequence[dict], names: Sequence[str]) -> dict:
  """{"kd_<budget>": mean KD loss} over the micro-batches of the logged steps in `window` that
  trained that budget (budgets not trained in the window are left out)."""
  kd = sum(np.asarray(m["kd_by_budget"], np.float64) for m in window)
  n = sum(np.asarray(m["n_by_budget"], np.float64) for m in window)
  return {f"kd_{name}": float(kd[i] / n[i]) for i, name in enumerate(names) if n[i] > 0}


# Positions of the elastic step's args (teacher, budgets, step, keys) that hold one value per
# micro-batch.
ELASTIC_PER_MICRO = (1, 3)


def micro_keys(base_key, step, micro_batches: int):
  """[M] Gumbel keys of `step`'s micro-batches, a function of (base_key, step) only."""
  k = jax.random.fold_in(base_key, step)
  return jax.vmap(lambda m: jax.random.fold_in(k, m))(jnp.arange(micro_batches))


def elastic(params, teacher, config: ModelConfig, router_params, rc: router_lib.RouterConfig,
            schedule: ElasticSchedule, stage_batches: dict, loop: LoopOptions, *,
            lr: float = 1e-3, router_lr: float = 1e-2, warmup: int = 10,
            budget_weight: float = 1.0, hard_prob: float = 0.004, seed: int = 0,
            moe_impl: str = "dense", kd_chunk: int = 0, weight_decay: float = 0.0,
            expert_placement: str = "contiguous"):
  """Elastic KD of the nested `params` (student, initialised from the parent) against the frozen
  `teacher`, a budget per micro-batch as `schedule` draws them. `stage_batches` = {1: stage-1
  iterator, 2: stage-2 iterator}. Logs the KD loss per budget. Returns (params, router).

  `expert_placement`: the routed experts' order while training ("balanced" spreads every
  budget's experts over an expert-parallel mesh, `model.place_experts`); the phase's
  checkpoints hold that order, the returned params `config`'s."""
  total = schedule.total
  given = config
  placed = lambda p: place_experts(to_stack_layout(p, given), given, expert_placement)
  teacher, config = placed(teacher)
  loss_fn = elastic_step_loss(config, rc, total, budget_weight, hard_prob, moe_impl, kd_chunk)
  base_key = rng.key(seed, "gumbel")
  teacher = commit(loop.place_model(teacher, config))
  M = schedule.micro_batches
  args = lambda i, x: (teacher, jnp.asarray(schedule.budgets(i), jnp.int32), jnp.int32(i),
                       micro_keys(base_key, i, M))
  opt = optim.elastic_adamw(total, lr, router_lr, weight_decay, warmup_steps=warmup)
  names = config.budget_names
  params = placed(params)[0]
  sharding = None if loop.mesh is None else elastic_params_sharding(
      params, router_params, config, loop.mesh, loop.rules)
  state = _run("elastic", loss_fn, {"model": params, "router": router_params}, opt, total,
               lambda i: stage_batches[schedule.stage(i)], loop, args,
               describe=lambda i: (f"stage {schedule.stage(i)} budget "
                                   f"{','.join(names[b] for b in schedule.budgets(i))}"),
               iterators={f"stage{k}": v for k, v in stage_batches.items()},
               params_sharding=sharding, micro_batches=M, per_micro=ELASTIC_PER_MICRO,
               window=lambda ms: kd_per_budget(ms, names))
  params = place_experts(to_canonical(state["model"], config), config,
                         given.expert_placement)[0]
  return params, state["router"]


def budget_mask_table(config: ModelConfig, budget_counts: dict):
  """The hard `BudgetMasks` of every budget in `config.budget_names` order, stacked on a leading
  [n_budgets] axis (index it with a traced budget index inside a step)."""
  missing = [n for n in config.budget_names if n not in budget_counts]
  if missing:
    raise ValueError(f"budget_counts lack budgets {missing}; have {sorted(budget_counts)}")
  table = [masks_lib.from_counts(config, budget_counts[n]) for n in config.budget_names]
  return jax.tree.map(lambda *m: jnp.stack(m), *table)


def qad_step_loss(config: ModelConfig, spec: QuantSpec, mask_table, moe_impl: str = "dense",
                  kd_chunk: int = 0):
  """loss_fn(params, rows, teacher, budget index) -> (loss, metrics): forward KL of the budget's
  sub-model of `teacher` (unquantized, frozen) to the same sub-model of `params` fake-quantized
  by `spec` (straight-through gradient). Both run under the budget's hard masks (a row of
  `mask_table`), so the student is exactly the quantized parent's slice. Metrics as
  `elastic_step_loss`'s ("kd", "kd_by_budget", "n_by_budget")."""
  check_chunk("elastic.kd_chunk", kd_chunk)
  n = len(config.budget_names)

  def loss_fn(params, x, teacher, b):
    x = x[:, :-1]
    masks = jax.tree.map(lambda m: m[b], mask_table)
    student = fake_quant_params(params, config, spec)
    if kd_chunk:
      t = apply_hidden(teacher, x, masks, config=config, moe_impl=moe_impl)
      s = apply_hidden(student, x, masks, config=config, moe_impl=moe_impl)
      kd = chunked_forward_kl(jax.lax.stop_gradient(t), s,
                              jax.lax.stop_gradient(teacher["lm_head"]), student["lm_head"],
                              config, kd_chunk)
    else:
      t = apply(teacher, x, masks, config=config, moe_impl=moe_impl)
      kd = forward_kl(jax.lax.stop_gradient(t),
                      apply(student, x, masks, config=config, moe_impl=moe_impl))
    onehot = jax.nn.one_hot(b, n)
    return kd, {"kd": kd, "kd_by_budget": onehot * kd, "n_by_budget": onehot}
  return loss_fn


# Positions of the QAD step's args (teacher, budgets) that hold one value per micro-batch.
QAD_PER_MICRO = (1,)


def qad(params, config: ModelConfig, budget_counts: dict, spec: QuantSpec,
        schedule: ElasticSchedule, batches, loop: LoopOptions, *, lr: float = 1e-4,
        warmup: int = 10, moe_impl: str = "dense", kd_chunk: int = 0, name: str = "qad"):
  """Quantization-aware distillation of the trained nested family `params`: for the budget each
  micro-batch draws from `schedule` (as in elastic training), the fake-quantized sub-model at its
  deployed `budget_counts` (the router frozen) learns the unquantized family's same budget, a
  frozen copy of `params`. Returns the float weights; `quant.tree.quantize_params` of them is
  the deployable quantized family (the parent quantized once; every budget its prefix)."""
  table = budget_mask_table(config, budget_counts)
  loss_fn = qad_step_loss(config, spec, table, moe_impl, kd_chunk)
  params = to_stack_layout(params, config)
  teacher = commit(loop.place_model(params, config))
  M = schedule.micro_batches
  names = config.budget_names
  args = lambda i, x: (teacher, jnp.asarray(schedule.budgets(i), jnp.int32))
  out = _run(name, loss_fn, params, optim.adamw(lr, schedule.total, warmup, 0.0),
             schedule.total, batches, loop, args,
             describe=lambda i: f"budget {','.join(names[b] for b in schedule.budgets(i))}",
             params_sharding=loop.model_sharding(params, config), micro_batches=M,
             per_micro=QAD_PER_MICRO, window=lambda ms: kd_per_budget(ms, names))
  return to_canonical(out, config)
