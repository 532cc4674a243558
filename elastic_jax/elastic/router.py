"""Budget router: per-axis MLPs from a budget one-hot to a distribution over that axis' choices.

Per METHOD.md section 4: Linear(n_budgets -> hidden, no bias) -> LeakyReLU(0.1) ->
Linear(-> n_choices, or n_layers x n_choices for per-layer axes); init normal(0.1);
token-independent. Logits are scaled by a factor rising 1 -> 10 over training and sampled with
Gumbel-softmax at temperature tau = decay^step (floored at 0.05); occasionally a hard
straight-through sample. Masks: soft staircase sum_i pi_i prefix(k_i), or the argmax prefix
(scaled by its probability in training, exactly 1 at inference). Budget loss uses the exact
differentiable measures (`measures.py`) on expected sizes, one term per budget target.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from elastic_jax.elastic.axes import AXES
from elastic_jax.config import ModelConfig
from elastic_jax.elastic import measures
from elastic_jax.elastic.masks import BudgetMasks, arrange, axis_mask_shape


@dataclasses.dataclass(frozen=True)
class RouterConfig:
  hidden: int = 256
  per_layer: tuple[str, ...] = ()     # axes routed per layer (others: one choice for all layers)
  init_std: float = 0.1
  scale_start: float = 1.0
  scale_end: float = 10.0
  tau_start: float = 1.0
  tau_min: float = 0.05
  tau_decay: float = 0.999
  band: float = 0.05
  anchor_weight: float = 10.0
  # Weight of -log P(in band) (`deploy.out_of_band_nll`), which keeps the router's own argmax
  # inside every band in training; 0 turns it off.
  band_weight: float = 1.0
  cost: measures.CostModel = measures.CostModel()   # the memory / latency measures' setting

  def __post_init__(self):
    bad = sorted(set(self.per_layer) - {n for n, a in AXES.items() if a.layer_kind})
    if bad:
      raise ValueError(f"RouterConfig.per_layer: {bad} cannot be per-layer; allowed: "
                       f"{[n for n, a in AXES.items() if a.layer_kind]}")


def _rows(config: ModelConfig, rc: RouterConfig, name: str) -> int:
  return AXES[name].num_layers(config) if name in rc.per_layer else 1


def init(config: ModelConfig, rc: RouterConfig, key) -> dict:
  """Router params {axis: {"w1": [n_budgets, hidden], "w2": [hidden, rows*choices]}}.

  Both layers are bias-free: a shared output bias would carry the full budget's anchor (the
  strongest router gradient) into every other budget's logits."""
  nb = len(config.budgets)
  out = {}
  for name, key in zip(AXES, jax.random.split(key, len(AXES))):
    n_out = _rows(config, rc, name) * len(AXES[name].choices(config))
    k1, k2 = jax.random.split(key)
    out[name] = {"w1": rc.init_std * jax.random.normal(k1, (nb, rc.hidden)),
                 "w2": rc.init_std * jax.random.normal(k2, (rc.hidden, n_out))}
  return out


def budget_onehot(config: ModelConfig, budget) -> jax.Array:
  """One-hot of a budget name, or an off-grid fraction interpolated between its neighbours."""
  names = config.budget_names
  fracs = [config.budget_fraction(n) for n in names]
  if isinstance(budget, str):
    return jax.nn.one_hot(names.index(config.budget_name_check(budget)), len(names))
  b = float(budget)
  if not fracs[-1] <= b <= fracs[0]:
    raise ValueError(f"budget fraction {b} outside [{fracs[-1]}, {fracs[0]}] of budgets {names}")
  v = jnp.zeros(len(names))
  for i in range(len(fracs) - 1):
    hi, lo = fracs[i], fracs[i + 1]
    if lo <= b <= hi:
      w = (b - lo) / (hi - lo)
      return v.at[i].set(w).at[i + 1].set(1.0 - w)
  return v.at[0].set(1.0)


def logits(router_params: dict, onehot, config: ModelConfig, rc: RouterConfig) -> dict:
  """{axis: [rows, n_choices]} unscaled router logits, in `AXES` order (not the sorted order
  a jit argument's dict comes back in), so per-axis random keys follow the axis, not its name."""
  out = {}
  for name in (n for n in AXES if n in router_params):
    p = router_params[name]
    h = jax.nn.leaky_relu(onehot @ p["w1"], 0.1)
    out[name] = (h @ p["w2"]).reshape(_rows(config, rc, name), -1)
  return out


def logit_scale(step, total_steps, rc: RouterConfig):
  frac = jnp.clip(step / jnp.maximum(total_steps, 1), 0.0, 1.0)
  return rc.scale_start + (rc.scale_end - rc.scale_start) * frac


def temperature(step, rc: RouterConfig):
  return jnp.maximum(rc.tau_start * rc.tau_decay ** step, rc.tau_min)


def gumbel_softmax(logits_, tau, key, hard: bool = False):
  """Gumbel-softmax over the last dim; `hard` gives a straight-through one-hot."""
  g = -jnp.log(-jnp.log(jax.random.uniform(key, logits_.shape, minval=1e-10, maxval=1.0)))
  soft = jax.nn.softmax((logits_ + g) / tau, axis=-1)
  return straight_through(soft) if hard else soft


def straight_through(probs):
  """One-hot of the argmax in the forward pass, the gradient of `probs` in the backward."""
  one = jax.nn.one_hot(jnp.argmax(probs, -1), probs.shape[-1])
  return one + probs - jax.lax.stop_gradient(probs)


def _prefixes(config: ModelConfig, name: str):
  """[n_choices, size] 0/1 prefix masks of the axis' choices (sizes of the mask's last dim)."""
  axis = AXES[name]
  size = axis_mask_shape(config, name)[-1]
  ks = jnp.asarray([axis.dim_size(c, config) for c in axis.choices(config)])
  return (jnp.arange(size)[None, :] < ks[:, None]).astype(jnp.float32)


def masks_from_probs(probs: Mapping[str, Any], config: ModelConfig, mode: str = "soft") -> BudgetMasks:
  """BudgetMasks from per-axis choice probabilities [rows, n_choices].

  mode "soft": staircase sum_i pi_i prefix(k_i); "hard": argmax prefix times its probability
  (training); "inference": argmax prefix, exactly 0/1.
  """
  if mode not in ("soft", "hard", "inference"):
    raise ValueError(f"mode must be 'soft', 'hard' or 'inference', got {mode!r}")
  fields = {}
  for name, pi in probs.items():
    pre = _prefixes(config, name)
    if mode == "soft":
      m = pi @ pre
    else:
      idx = jnp.argmax(pi, -1)
      m = pre[idx]
      if mode == "hard":
        m = m * jnp.take_along_axis(pi, idx[:, None], -1)
    shape = axis_mask_shape(config, name)
    if AXES[name].layer_kind is None:
      m = m[0]
    else:
      m = jnp.broadcast_to(m, (shape[0], shape[-1]))
    fields[name] = arrange(config, name, m)
  return BudgetMasks(**fields)


def chosen_counts(router_params: dict, config: ModelConfig, rc: RouterConfig, budget) -> dict:
  """The sub-model the trained router picks for `budget` (a name or an off-grid fraction):
  the per-axis argmax (what inference masks keep), as integer counts."""
  return argmax_counts(logits(router_params, budget_onehot(config, budget), config, rc), config)


def expected_counts(probs: Mapping[str, Any], config: ModelConfig) -> dict:
  """Per-axis expected counts sum_i pi_i k_i (one per layer for per-layer axes)."""
  out = {}
  for name, pi in probs.items():
    axis = AXES[name]
    e = pi @ jnp.asarray(axis.choices(config), jnp.float32)
    if axis.layer_kind is None:
      out[name] = e[0]
    else:
      e = jnp.broadcast_to(e, (axis.num_layers(config),))
      out[name] = tuple(e[i] for i in range(axis.num_layers(config)))
  return out


def argmax_counts(probs: Mapping[str, Any], config: ModelConfig) -> dict:
  """The router's chosen integer counts (homogeneous int or per-layer tuple)."""
  out = {}
  for name, pi in probs.items():
    ch = AXES[name].choices(config)
    idx = [int(i) for i in jnp.argmax(pi, -1)]
    vals = tuple(ch[i] for i in idx)
    out[name] = vals if len(vals) > 1 else vals[0]
  return out


def budget_targets(config: ModelConfig) -> dict:
  """{measure: [n_budgets] fractions} of every measure some budget targets, 0 where a budget
  leaves that measure free: index it with a traced budget index for `budget_loss`."""
  return {m: jnp.asarray([config.budget_targets(n).get(m, 0.0) for n in config.budget_names],
                         jnp.float32) for m in config.budget_measures}


def budget_loss(probs: Mapping[str, Any], config: ModelConfig, targets, rc: RouterConfig):
  """Sum over the budget's targets of |M(expected) / (f M_full) - 1|, zero inside the band,
  for each measure M (`measures.measure`: active / total parameters, memory, latency) at its
  target fraction f; for the full budget (every target 1) no band and add anchor_weight *
  MSE(pi, one-hot of the largest choice).

  `targets`: {measure: fraction} (values may be traced: one compiled step serves every budget;
  a fraction of 0 leaves that measure free), or one number, an active-parameter fraction.
  """
  if not isinstance(targets, Mapping):
    targets = {"active": targets}
  expected = expected_counts(probs, config)
  fracs = {m: jnp.asarray(f, jnp.float32) for m, f in targets.items()}
  is_full = jnp.all(jnp.stack([(f >= 1.0) | (f <= 0.0) for f in fracs.values()]))
  loss = 0.0
  for m, f in fracs.items():
    # As a Python float: a 30B-scale int overflows jax's int32 when it meets a traced value.
    full = float(measures.measure(config, None, m, rc.cost))
    value = measures.measure(config, expected, m, rc.cost, validate=False)
    rel = jnp.abs(value / (jnp.where(f > 0, f, 1.0) * full) - 1.0)
    # The full budget has no dead zone (as the reference): it must stay exactly the parent.
    loss = loss + jnp.where((f > 0) & ((rel > rc.band) | is_full), rel, 0.0)
  anchor = 0.0
  for pi in probs.values():
    target = jax.nn.one_hot(jnp.zeros(pi.shape[0], jnp.int32), pi.shape[-1])
    anchor = anchor + jnp.mean(jnp.square(pi - target))
  return loss + jnp.where(is_full, rc.anchor_weight * anchor, 0.0)


def fit_to_budgets(config: ModelConfig, rc: RouterConfig, steps: int = 150, lr: float = 3e-2,
                   seed: int = 0, targets: Mapping[str, Any] | None = None) -> dict:
  """Router params trained on the budget loss alone, for every budget (no weights, no data):
  the architectures the budgets' targets select before any distillation, e.g. to preview a
  family. Deterministic softmax (no Gumbel noise), the logit scale rising 1 -> 10 over the
  first two thirds of the steps, Adam at `lr`. `targets` ({measure: [n_budgets] fractions})
  replaces the config's (`budget_targets`)."""
  import optax
  targets = budget_targets(config) if targets is None else targets
  n = len(config.budgets)
  opt = optax.adam(lr)

  def one_budget(rp, scale, onehot, t):
    lg = logits(rp, onehot, config, rc)
    probs = {name: jax.nn.softmax(l * scale, -1) for name, l in lg.items()}
    deployed = {name: straight_through(p) for name, p in probs.items()}
    return budget_loss(probs, config, t, rc) + budget_loss(deployed, config, t, rc)

  def loss(rp, scale):
    # Mapped over the budgets (targets traced): the counter is traced once, not once per
    # budget (at nano_v3's 52 layers the compile took ~100 s with a Python loop).
    t = {m: jnp.asarray(v, jnp.float32) for m, v in targets.items()}
    return jnp.sum(jax.vmap(one_budget, (None, None, 0, 0))(rp, scale, jnp.eye(n), t))

  @jax.jit
  def step(rp, state, i):
    scale = rc.scale_start + (rc.scale_end - rc.scale_start) * jnp.minimum(
        i / max(1, 2 * steps // 3), 1.0)
    g = jax.grad(loss)(rp, scale)
    updates, state = opt.update(g, state, rp)
    return optax.apply_updates(rp, updates), state

  rp = init(config, rc, jax.random.PRNGKey(seed))
  state = opt.init(rp)
  for i in range(steps):
    rp, state = step(rp, state, i)
  return rp
