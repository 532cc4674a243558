import math

import pytest

from configs import model_config
from elastic_jax import ModelConfig
from conftest import CFG


def test_presets_load():
  tiny = model_config("tiny")
  assert set(tiny.layer_pattern) == {"M", "*", "E"}
  nano = model_config("nano_v3")
  assert nano.num_layers == 52
  assert [nano.layer_pattern.count(k) for k in "ME*"] == [23, 23, 6]
  with pytest.raises(ValueError, match="unknown config 'huge'"):
    model_config("huge")
  # The reasoning preset: the tiny model, chain-arithmetic data, a longer parent; a valid run.
  from configs import reasoning
  from elastic_jax.training.pipeline import check_run_config
  assert model_config("reasoning") == tiny
  run = reasoning.get_config()
  assert tuple(run.data.reasoning_sources) == ("chain_arithmetic",) and run.pretrain.steps == 4000
  check_run_config(run)


def test_dict_roundtrip():
  c = CFG.replace(time_step_limit=(0.0, math.inf))
  assert ModelConfig.from_dict(c.to_dict()) == c
  with pytest.raises(ValueError, match="unknown ModelConfig fields.*bogus"):
    ModelConfig.from_dict({**c.to_dict(), "bogus": 1})


def test_hashable_for_jit():
  assert hash(CFG) == hash(CFG.replace())


@pytest.mark.parametrize("kwargs,match", [
    ({"layer_pattern": "MXE"}, "layer_pattern.*bad chars \\['X'\\]"),
    ({"layer_pattern": ""}, "layer_pattern"),
    ({"hidden_size": 0}, "hidden_size: must be a positive int"),
    ({"num_kv_heads": 3}, "num_kv_heads: 3 must divide"),
    ({"mamba_n_groups": 3, "mamba_head_choices": ()}, "mamba_n_groups: 3 must divide"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"compute_dtype": "int8"}, "compute_dtype"),
    ({"expert_placement": "strided"}, "expert_placement: 'strided' not in"),
    ({"time_step_limit": (0.1, 0.01)}, "time_step_limit"),
    ({"hidden_choices": (24, 16)}, "hidden_choices: first choice must be the full size 32"),
    ({"hidden_choices": (32, 16, 24)}, "hidden_choices: choices must be positive, unique"),
    ({"mamba_head_choices": (8, 5)}, "mamba_head_choices: \\[5\\] are not multiples"),
    ({"expert_choices": (8, 1)}, "expert_choices: \\[1\\] are below num_experts_per_tok"),
    ({"budgets": (("a", 1.0), ("a", 0.5))}, "budgets: need unique"),
    ({"budgets": (("a", 0.9),)}, "budgets: target fractions must lie in"),
    ({"budgets": (("a", {"active": 1.0, "total": 0.9}),)}, "the first budget's all 1.0"),
    ({"budgets": (("a", 1.0), ("b", {"total": 0.0}))}, "target fractions must lie in"),
    ({"budgets": (("a", 1.0), ("b", {"flops": 0.5}))}, "budget 'b' targets \\['flops'\\]"),
    ({"budgets": (("a", 1.0), ("b", 0.5), ("c", {"total": 0.3, "active": 0.7}))},
     "budgets must descend in size"),
])
def test_bad_config_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    CFG.replace(**kwargs)


def test_budget_lookup():
  tiny = model_config("tiny")
  assert tiny.budget_fraction("medium") == pytest.approx(0.78)
  assert tiny.budget_targets("medium") == {"active": pytest.approx(0.78)}
  with pytest.raises(ValueError, match="unknown budget 'huge'.*full"):
    tiny.budget_fraction("huge")


def test_budgets_by_total_and_active():
  """nano_v3 names its budgets as the paper does: (total, active) parameters, both targets."""
  from elastic_jax import count_params
  from configs import nano_v3
  nano = model_config("nano_v3")
  full = count_params(nano)
  assert (full.total, full.active) == (nano_v3.PARENT_TOTAL, nano_v3.PARENT_ACTIVE)
  assert nano.budget_names == ("30B", "23B", "12B") and nano.budget_measures == ("active", "total")
  for name, total, active in (("23B", 23e9, 2.8e9), ("12B", 12e9, 2.0e9)):
    t = nano.budget_targets(name)
    assert t["total"] * full.total == pytest.approx(total)
    assert t["active"] * full.active == pytest.approx(active)
    assert nano.budget_fraction(name) == t["active"]   # orders budgets, places off-grid ones
  assert ModelConfig.from_dict(nano.to_dict()) == nano and hash(nano)
  # The old form, one number per budget, is an active-parameter fraction.
  old = ModelConfig.from_dict({**CFG.to_dict(), "budgets": [["full", 1.0], ["small", 0.5]]})
  assert old == CFG and old.budget_targets("small") == {"active": 0.5}
