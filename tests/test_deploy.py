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


def _reference(rp, cfg, rc, budget):
  """Every architecture by itertools and count_params (ints), scored by the router's
  log-probabilities; the best one with active and total inside the band."""
  lg = R.logits(rp, R.budget_onehot(cfg, budget), cfg, rc)
  logp = {n: np.asarray(jax.nn.log_softmax(l, -1)) for n, l in lg.items()}
  rows = [(n, r) for n in AXES for r in range(logp[n].shape[0])]
  full, targets = count_params(cfg), cfg.budget_targets(budget)
  best, best_score = None, -np.inf
  for combo in itertools.product(*(range(len(AXES[n].choices(cfg))) for n, _ in rows)):
    counts = {}
    for (n, r), i in zip(rows, combo):
      counts.setdefault(n, []).append(AXES[n].choices(cfg)[i])
    counts = {n: v[0] if len(v) == 1 else tuple(v) for n, v in counts.items()}
    pc = count_params(cfg, counts)
    size = {"active": pc.active / full.active, "total": pc.total / full.total}
    if all(abs(size[m] / f - 1) <= rc.band for m, f in targets.items()):
      score = sum(logp[n][r][i] for (n, r), i in zip(rows, combo))
      if score > best_score:
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


def test_infeasible_budget_is_refused_naming_the_closest(cfg):
  c = cfg.replace(budgets=(("full", 1.0), ("tiny", {"active": 0.5, "total": 0.05})))
  rc = R.RouterConfig(hidden=8)
  with pytest.raises(ValueError, match=r"budget 'tiny' \(targets .*\) has no architecture within "
                                       r"the 5% band.*the closest, \{'hidden': 16.*total off by"):
    deploy.check_feasible(c, rc)
