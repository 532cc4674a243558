"""The architecture each budget deploys: the router's highest-scoring choice inside every one
of the budget's target bands (METHOD.md section 6), not its unconstrained argmax.

Exact enumeration: every combination of the per-axis choices (one choice per router row; a
per-layer axis has one row per layer) is sized with the budget measures, vectorised over the
combinations (`jax.vmap` of the differentiable counter), and scored by the sum of the router's
log-probabilities of its choices. Combinations outside any band are discarded; the best of
the rest is deployed. With no combination in band, the budget is infeasible for this config's
choices, whatever the router learns: `check_feasible` refuses it before training, naming the
targets and the closest achievable sizes. Enumeration is capped at `MAX_COMBINATIONS` (a
per-layer router over many layers needs a search this module does not have yet).

Training uses the same table (`band_table`) so that the router's own argmax lands in band:
`out_of_band_nll` is -log of the probability the router's distribution puts on in-band
architectures, which vanishes once its mass (and so its mode) is inside every band.
"""
from __future__ import annotations

import itertools
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from elastic_jax.config import ModelConfig
from elastic_jax.elastic import measures
from elastic_jax.elastic import router as router_lib
from elastic_jax.elastic.axes import AXES

MAX_COMBINATIONS = 200_000


def _rows(config: ModelConfig, rc: router_lib.RouterConfig) -> list[tuple[str, int]]:
  """(axis, row) of every router row: one per axis, one per layer for per-layer axes."""
  return [(name, r) for name in AXES for r in range(router_lib._rows(config, rc, name))]


def combinations(config: ModelConfig, rc: router_lib.RouterConfig) -> np.ndarray:
  """[n, rows] choice indices of every architecture the router can express."""
  sizes = [len(AXES[name].choices(config)) for name, _ in _rows(config, rc)]
  n = int(np.prod(sizes))
  if n > MAX_COMBINATIONS:
    raise ValueError(f"{n:,} architectures to enumerate (> {MAX_COMBINATIONS:,}); a per-layer "
                     f"router over {config.num_layers} layers needs a search, not enumeration")
  return np.asarray(list(itertools.product(*(range(s) for s in sizes))), np.int32)


def _counts(config: ModelConfig, rc: router_lib.RouterConfig, idx) -> dict:
  """Counts (traced floats) of one combination of choice indices."""
  out, col = {}, 0
  for name in AXES:
    rows = router_lib._rows(config, rc, name)
    ch = jnp.asarray(AXES[name].choices(config), jnp.float32)
    vals = ch[idx[col:col + rows]]
    col += rows
    out[name] = vals[0] if rows == 1 else tuple(vals[i] for i in range(rows))
  return out


def relative_errors(config: ModelConfig, rc: router_lib.RouterConfig, combos: np.ndarray,
                    targets: Mapping[str, float]) -> np.ndarray:
  """[n, measures] |M(combination) / (f M_full) - 1| for each target measure."""
  full = {m: float(measures.measure(config, None, m, rc.cost)) for m in targets}

  def one(idx):
    counts = _counts(config, rc, idx)
    return jnp.stack([measures.measure(config, counts, m, rc.cost, validate=False)
                      / (f * full[m]) - 1.0 for m, f in targets.items()])

  return np.abs(np.asarray(jax.jit(jax.vmap(one))(jnp.asarray(combos)), np.float64))


def _to_counts(config: ModelConfig, rc: router_lib.RouterConfig, idx) -> dict:
  out, col = {}, 0
  for name in AXES:
    rows = router_lib._rows(config, rc, name)
    ch = AXES[name].choices(config)
    vals = tuple(ch[int(i)] for i in idx[col:col + rows])
    col += rows
    out[name] = vals if rows > 1 else vals[0]
  return out


def _infeasible(budget: str, targets, errs: np.ndarray, config, rc, combos) -> ValueError:
  best = int(np.argmin(errs.max(1)))
  got = ", ".join(f"{m} off by {e:.1%}" for m, e in zip(targets, errs[best]))
  return ValueError(
      f"budget {budget!r} (targets {dict(targets)}) has no architecture within the "
      f"{rc.band:.0%} band of every target among the config's choices; the closest, "
      f"{_to_counts(config, rc, combos[best])}, is {got}")


def achieved(config: ModelConfig, rc: router_lib.RouterConfig, counts: Mapping,
             budget: str) -> dict[str, dict[str, float]]:
  """{measure: {"target": f, "ratio": M(counts) / M_full, "error": ratio / f - 1}} for each
  target of `budget` (what the nested checkpoint records per budget)."""
  out = {}
  for m, f in config.budget_targets(budget).items():
    ratio = (float(measures.measure(config, counts, m, rc.cost))
             / float(measures.measure(config, None, m, rc.cost)))
    out[m] = {"target": float(f), "ratio": ratio, "error": ratio / f - 1.0}
  return out


def errors(config: ModelConfig, rc: router_lib.RouterConfig, counts: Mapping,
           budget: str) -> dict[str, float]:
  """{measure: M(counts) / (f M_full) - 1} for each target of `budget` (signed)."""
  return {m: a["error"] for m, a in achieved(config, rc, counts, budget).items()}


def violation(config: ModelConfig, rc: router_lib.RouterConfig, counts: Mapping,
              budget: str) -> str | None:
  """Why stored `counts` do not satisfy `budget` (a target outside its band), or None."""
  err = errors(config, rc, counts, budget)
  if all(abs(e) <= rc.band + 1e-9 for e in err.values()):
    return None
  off = ", ".join(f"{m} {e:+.1%}" for m, e in err.items())
  return (f"budget {budget!r}: its stored counts {dict(counts)} are off its targets by {off} "
          f"(band {rc.band:.0%}); use explicit per-axis counts, or re-derive the budget's "
          "counts (deploy.deployed_counts)")


def stored_router_config(meta: Mapping) -> router_lib.RouterConfig | None:
  """The band and cost model a nested checkpoint's budget counts were deployed under (its
  metadata's router_config, which the training pipeline writes); None if it has none (counts
  stored by hand, not by a router)."""
  saved = (meta.get("extra") or {}).get("router_config")
  if not isinstance(saved, Mapping):
    return None
  kw = {}
  if "band" in saved:
    kw["band"] = float(saved["band"])
  if isinstance(saved.get("cost"), Mapping):
    kw["cost"] = measures.CostModel(**saved["cost"])
  return router_lib.RouterConfig(**kw)


def check_feasible(config: ModelConfig, rc: router_lib.RouterConfig) -> None:
  """ValueError naming the first budget no architecture can satisfy (before any training)."""
  band_table(config, rc)


def band_table(config: ModelConfig, rc: router_lib.RouterConfig) -> tuple[np.ndarray, np.ndarray]:
  """(combinations [n, rows], in_band [n_budgets, n]): which architectures satisfy every target
  band of each budget (the full budget: all of them, its anchor keeps it the parent). Static:
  computed once per run, a constant of the compiled step. A budget with no architecture in
  band is refused (as `check_feasible`)."""
  combos = combinations(config, rc)
  return combos, np.stack([_in_band(config, rc, combos, name) for name in config.budget_names])


def _is_full(config: ModelConfig, budget: str) -> bool:
  return all(f >= 1.0 for f in config.budget_targets(budget).values())


def _in_band(config: ModelConfig, rc: router_lib.RouterConfig, combos: np.ndarray,
             budget: str) -> np.ndarray:
  """[n] bools: the combinations inside every target band of `budget` (all for the full
  budget); ValueError naming the closest when there is none."""
  if _is_full(config, budget):
    return np.ones(len(combos), bool)
  targets = config.budget_targets(budget)
  errs = relative_errors(config, rc, combos, targets)
  ok = np.all(errs <= rc.band + 1e-9, axis=1)
  if not ok.any():
    raise _infeasible(budget, targets, errs, config, rc, combos)
  return ok


def log_probs(logits: Mapping, config: ModelConfig, rc: router_lib.RouterConfig,
              combos) -> jax.Array:
  """[n] log-probability of each architecture under the router's per-row distributions
  (softmax of `logits`, {axis: [rows, choices]}; rows are independent)."""
  out = 0.0
  for j, (name, r) in enumerate(_rows(config, rc)):
    out = out + jax.nn.log_softmax(logits[name], -1)[r][combos[:, j]]
  return out


def out_of_band_nll(logits: Mapping, config: ModelConfig, rc: router_lib.RouterConfig, combos,
                    in_band) -> jax.Array:
  """-log P(architecture inside every band) under the router's distribution (`log_probs`);
  `in_band`: [n] bools, one row of `band_table` (may be selected by a traced budget index).
  0 when all mass is in band; its gradient moves mass onto the in-band architectures the
  router already prefers (the ones `deployed_counts` would pick)."""
  lp = log_probs(logits, config, rc, jnp.asarray(combos))
  return -jax.nn.logsumexp(jnp.where(in_band, lp, -jnp.inf))


def deployed_counts(router_params: dict, config: ModelConfig, rc: router_lib.RouterConfig,
                    budget: str) -> dict:
  """Counts of the router's highest-scoring architecture inside every target band of `budget`
  (the full budget, every target 1: the parent itself)."""
  if _is_full(config, budget):
    return {name: AXES[name].full(config) for name in AXES}
  combos = combinations(config, rc)
  ok = _in_band(config, rc, combos, budget)
  lg = router_lib.logits(router_params, router_lib.budget_onehot(config, budget), config, rc)
  score = np.where(ok, np.asarray(log_probs(lg, config, rc, jnp.asarray(combos))), -np.inf)
  return _to_counts(config, rc, combos[int(np.argmax(score))])
