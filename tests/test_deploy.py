"""The deployed architecture per budget: the router's best choice inside every target band,
against a plain enumeration with the exact counter; infeasible budgets refused up front."""
import itertools

import jax
import numpy as np
import pytest

from elastic_jax import count_params
from elastic_jax.elastic import deploy
from elastic_jax.elastic import router as R
from elastic_jax.elastic.axes import AXES


def _architectures(cfg, rows, budget, band):
  """(choice index per router row, counts, in band) of every architecture, by itertools and
  count_params (ints); `rows`: (axis, row) pairs; in band: active and total within `band`."""
  full, targets = count_params(cfg), cfg.budget_targets(budget)
  for combo in itertools.product(*(range(len(AXES[n].choices(cfg))) for n, _ in rows)):
    counts = {}
    for (n, r), i in zip(rows, combo):
      counts.setdefault(n, []).append(AXES[n].choices(cfg)[i])
    counts = {n: v[0] if len(v) == 1 else tuple(v) for n, v in counts.items()}
    pc = count_params(cfg, counts)
    size = {"active": pc.active / full.active, "total": pc.total / full.total}
    yield combo, counts, all(abs(size[m] / f - 1) <= band for m, f in targets.items())


def _reference(rp, cfg, rc, budget):
  """Every architecture scored by the router's log-probabilities; the best one in band."""
  lg = R.logits(rp, R.budget_onehot(cfg, budget), cfg, rc)
  logp = {n: np.asarray(jax.nn.log_softmax(l, -1)) for n, l in lg.items()}
  rows = [(n, r) for n in AXES for r in range(logp[n].shape[0])]
  best, best_score = None, -np.inf
  for combo, counts, ok in _architectures(cfg, rows, budget, rc.band):
    score = sum(logp[n][r][i] for (n, r), i in zip(rows, combo))
    if ok and score > best_score:
      best, best_score = counts, score
  return best


@pytest.mark.parametrize("per_layer", [(), ("moe_experts",)])
def test_deployed_is_the_best_choice_in_band(cfg, per_layer):
  c = cfg.replace(budgets=(("full", 1.0), ("mid", {"active": 0.7, "total": 0.6}),
                           ("small", 0.45)))
  rc = R.RouterConfig(hidden=8, per_layer=per_layer)
  deploy.check_feasible(c, rc)
  for seed in range(3):
    rp = R.init(c, rc, jax.random.PRNGKey(seed))
    for b in ("mid", "small"):
      assert deploy.deployed_counts(rp, c, rc, b) == _reference(rp, c, rc, b), (seed, b)
    assert deploy.deployed_counts(rp, c, rc, "full") == {n: a.full(c) for n, a in AXES.items()}
    err = deploy.errors(c, rc, deploy.deployed_counts(rp, c, rc, "mid"), "mid")
    assert set(err) == {"active", "total"} and max(map(abs, err.values())) <= rc.band


def test_deployed_with_the_axes_beyond_the_paper(cfg_x):
  """Query heads, head-dim channels and depth enumerate and measure like the other axes (the
  vectorised measures against itertools + the exact counter)."""
  c = cfg_x.replace(hidden_choices=(32,), mamba_head_choices=(8, 4), moe_ffn_choices=(16,),
                    depth_order=(0, 2, 1, 4, 5, 3),
                    budgets=(("full", 1.0), ("mid", {"active": 0.8, "total": 0.75}),
                             ("small", 0.55)))
  rc = R.RouterConfig(hidden=8)
  deploy.check_feasible(c, rc)
  for seed in range(2):
    rp = R.init(c, rc, jax.random.PRNGKey(seed))
    for b in ("mid", "small"):
      assert deploy.deployed_counts(rp, c, rc, b) == _reference(rp, c, rc, b), (seed, b)


def test_infeasible_budget_is_refused_naming_the_closest(cfg):
  c = cfg.replace(budgets=(("full", 1.0), ("tiny", {"active": 0.5, "total": 0.05})))
  rc = R.RouterConfig(hidden=8)
  with pytest.raises(ValueError, match=r"budget 'tiny' \(targets .*\) has no architecture within "
                                       r"the 5% band.*the closest, \{'hidden': 16.*total off by"):
    deploy.check_feasible(c, rc)


@pytest.mark.parametrize("per_layer", [(), ("moe_experts",)])
def test_out_of_band_nll_is_minus_log_of_the_in_band_mass(cfg, per_layer):
  """-log sum of prod_rows p(choice) over the in-band architectures, by itertools."""
  c = cfg.replace(budgets=(("full", 1.0), ("mid", {"active": 0.7, "total": 0.6}),
                           ("small", 0.45)))
  rc = R.RouterConfig(hidden=8, per_layer=per_layer)
  combos, in_band = deploy.band_table(c, rc)
  assert in_band[0].all() and 0 < in_band[1].sum() < len(combos)
  rp = R.init(c, rc, jax.random.PRNGKey(3))
  for b, name in enumerate(c.budget_names):
    lg = R.logits(rp, R.budget_onehot(c, name), c, rc)
    p = {n: np.asarray(jax.nn.softmax(l, -1), np.float64) for n, l in lg.items()}
    rows = [(n, r) for n in AXES for r in range(p[n].shape[0])]
    mass = sum(np.prod([p[n][r][i] for (n, r), i in zip(rows, combo)])
               for combo, _, ok in _architectures(c, rows, name, rc.band) if b == 0 or ok)
    got = float(deploy.out_of_band_nll(lg, c, rc, combos, in_band[b]))
    np.testing.assert_allclose(got, -np.log(mass), rtol=1e-5, atol=1e-6)


def _router_argmax_under_pressure(c, rc, seed, pull=0.2, steps=300):
  """The router's argmax for "small" after Adam on the elastic loss's router terms (budget
  loss on the sample and on the argmax, plus rc.band_weight * out_of_band_nll), against a pull
  toward the largest choices (what KD exerts)."""
  import optax
  combos, in_band = deploy.band_table(c, rc)
  t = {"active": c.budget_targets("small")["active"]}

  def loss(rp):
    lg = {n: 5.0 * l for n, l in R.logits(rp, R.budget_onehot(c, "small"), c, rc).items()}
    probs = {n: jax.nn.softmax(l, -1) for n, l in lg.items()}
    pull_loss = -pull * sum(jax.numpy.log(p[..., 0]).sum() for p in probs.values())
    deployed = {n: R.straight_through(p) for n, p in probs.items()}
    bl = R.budget_loss(probs, c, t, rc) + R.budget_loss(deployed, c, t, rc)
    return pull_loss + bl + rc.band_weight * deploy.out_of_band_nll(lg, c, rc, combos,
                                                                    in_band[1])

  opt = optax.adam(3e-2)

  @jax.jit
  def step(rp, state):
    u, state = opt.update(jax.grad(loss)(rp), state, rp)
    return optax.apply_updates(rp, u), state

  rp = R.init(c, rc, jax.random.PRNGKey(seed))
  state = opt.init(rp)
  for _ in range(steps):
    rp, state = step(rp, state)
  return R.chosen_counts(rp, c, rc, "small")


def test_band_term_keeps_the_routers_own_argmax_in_band(cfg):
  """Under a pull toward larger models, the budget losses alone leave the argmax outside the
  band; with -log P(in band) it lands inside (issue 20 item 2: deployment is then no repair)."""
  c = cfg.replace(budgets=(("full", 1.0), ("small", 0.45)))
  off = lambda rc, s: max(map(abs, deploy.errors(c, rc, _router_argmax_under_pressure(c, rc, s),
                                                  "small").values()))
  with_term = R.RouterConfig(hidden=8)
  assert with_term.band_weight > 0
  assert all(off(with_term, s) <= with_term.band for s in range(2))
  without = R.RouterConfig(hidden=8, band_weight=0.0)
  assert any(off(without, s) > without.band for s in range(2))
