"""The Flax modules: ElasticLM takes BudgetMasks, scan == loop (logits and gradients, fp32),
layouts round-trip, init is deterministic and matches the modules' declared shapes, and the
elastic axis table agrees with the logical axis names the modules declare."""
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import model_config
from elastic_jax import apply, from_counts, init
from elastic_jax.elastic.axes import AXES
from elastic_jax.model import ElasticLM, layouts
from elastic_jax.model.model import logical_axes, param_shapes, scanned_logical_axes, stack_for
from elastic_jax.model.stack_plan import plan_stack

COUNTS = {"hidden": 24, "mamba_heads": (4, 6), "moe_experts": (6, 4), "moe_ffn": (12, 16)}


def test_elastic_lm_is_a_linen_module_taking_budget_masks(cfg, params, tokens):
  masks = from_counts(cfg, COUNTS)
  assert isinstance(ElasticLM(cfg), nn.Module)
  logits, aux = ElasticLM(cfg).apply({"params": params}, tokens, masks=masks)
  chex.assert_shape(logits, tokens.shape + (cfg.vocab_size,))
  assert aux == {"stats": None, "cache": None}
  # Eager module call vs one compiled program: fp32 rounding apart.
  np.testing.assert_allclose(logits, apply(params, tokens, masks, config=cfg), rtol=1e-5,
                             atol=1e-5)
  # A budget changes the function: masks are really read.
  assert np.abs(np.asarray(logits) - np.asarray(apply(params, tokens, config=cfg))).max() > 1e-2


def test_module_init_has_the_canonical_layout(cfg, params, tokens):
  flax_params = jax.eval_shape(ElasticLM(cfg).init, jax.random.PRNGKey(0), tokens)["params"]
  chex.assert_trees_all_equal_shapes_and_dtypes(nn.unbox(flax_params), param_shapes(cfg))
  chex.assert_trees_all_equal_shapes_and_dtypes(params, param_shapes(cfg))


def test_init_is_deterministic_per_key(cfg):
  a, b = init(cfg, jax.random.PRNGKey(3)), init(cfg, jax.random.PRNGKey(3))
  chex.assert_trees_all_equal(a, b)
  c = init(cfg, jax.random.PRNGKey(4))
  assert not np.allclose(a["layers"]["0"]["mixer"]["in_x"], c["layers"]["0"]["mixer"]["in_x"])
  # Layers of one kind draw different values (per-layer keys, not one reused key).
  assert not np.allclose(a["layers"]["0"]["mixer"]["in_x"], a["layers"]["4"]["mixer"]["in_x"])


@pytest.mark.parametrize("stack_cfg", ["conftest", "tiny"])
def test_scan_equals_loop_logits_and_grads(cfg, params, tokens, stack_cfg):
  if stack_cfg == "tiny":
    cfg = model_config("tiny")
    params = init(cfg, jax.random.PRNGKey(0))
    counts = {"hidden": 64, "mamba_heads": (4, 6, 8), "moe_experts": 4, "moe_ffn": (48, 64, 96)}
  else:
    counts = COUNTS
  plan = plan_stack(cfg.layer_pattern)
  assert plan is not None and plan.padded > 0   # exercises absent optional slots
  masks = from_counts(cfg, counts)

  def loss(p, stack, remat="none"):
    c = cfg.replace(remat=remat)
    return jnp.mean(apply(p, tokens, masks, config=c, stack=stack) ** 2)

  np.testing.assert_allclose(apply(params, tokens, masks, config=cfg, stack="scan"),
                             apply(params, tokens, masks, config=cfg, stack="loop"),
                             rtol=1e-5, atol=1e-5)
  g_loop = jax.grad(loss)(params, "loop")
  for remat in ("none", "full", "save_dots"):
    chex.assert_trees_all_close(jax.grad(loss)(params, "scan", remat), g_loop, rtol=1e-5,
                                atol=1e-6)


def test_scanned_stack_saves_one_residual_per_unit(cfg, params, tokens):
  """Under remat="full" the scanned stack's forward scan keeps one [units, B, T, D] residual (each
  unit's input) for the backward pass, not one per block: at nano_v3 stage 2 three such fp32
  stacks were 36 GiB per device (`elastic_jax.plan`). Per-block remat saved 4 here."""
  U = len(plan_stack(cfg.layer_pattern).units)
  c = cfg.replace(remat="full")
  jaxpr = jax.make_jaxpr(jax.grad(
      lambda p: jnp.mean(apply(p, tokens, config=c, stack="scan") ** 2)))(params).jaxpr

  def scans(j):
    for e in j.eqns:
      if e.primitive.name == "scan":
        yield e
      for v in e.params.values():
        for sub in v if isinstance(v, (list, tuple)) else [v]:
          inner = getattr(sub, "jaxpr", None)
          if inner is not None:
            yield from scans(getattr(inner, "jaxpr", inner))

  stream = (U,) + tokens.shape + (cfg.hidden_size,)
  saved = [sum(tuple(v.aval.shape) == stream for v in e.outvars) for e in scans(jaxpr)
           if e.params["length"] == U]
  assert max(saved) == 1, saved


def test_layouts_round_trip(cfg, params):
  plan = plan_stack(cfg.layer_pattern)
  scanned = layouts.to_scanned(params, plan)
  # The scanned layout is exactly what ElasticLM(stack="scan") declares.
  names = scanned_logical_axes(cfg)
  chex.assert_trees_all_equal_structs(jax.tree.map(lambda x: 0, scanned),
                                      jax.tree.map(lambda x: 0, names,
                                                   is_leaf=lambda x: isinstance(x, tuple)))
  for s, leaf in scanned["layers"]["units"]["0"]["mixer"].items():
    assert leaf.shape[0] == plan.num_units, s
  chex.assert_trees_all_equal(layouts.from_scanned(scanned, plan), params)
  chex.assert_trees_all_equal(layouts.from_legacy(layouts.to_legacy(params)), params)
  with pytest.raises(ValueError, match="pre-Flax layout.*from_legacy"):
    apply(layouts.to_legacy(params), jnp.zeros((1, 2), jnp.int32), config=cfg)


def test_stack_plan_nano_v3():
  nano = model_config("nano_v3")
  plan = plan_stack(nano.layer_pattern)
  assert (plan.slots, plan.optional, plan.num_units) == ("M*E", (False, True, False), 23)
  order = [i for i in plan.head + tuple(i for u in plan.units for i in u if i is not None)
           + plan.tail]
  assert order == list(range(nano.num_layers))   # every layer once, in order
  assert "".join(nano.layer_pattern[i] if i is not None else "." for u in plan.units
                 for i in u).count(".") == plan.padded == 17
  assert plan_stack("M*E") is None               # no repeat: runs as a loop


def test_stack_choice_and_errors(cfg, params, tokens):
  assert stack_for(cfg) == "loop" and stack_for(cfg.replace(scan_layers=True)) == "scan"
  het = cfg.replace(moe_ffn_per_layer=(16, 8))
  assert stack_for(het.replace(scan_layers=True)) == "loop"  # sliced sub-models loop
  with pytest.raises(ValueError, match="stack='scan' needs a homogeneous config"):
    ElasticLM(het, stack="scan").init(jax.random.PRNGKey(0), tokens)
  with pytest.raises(ValueError, match="stack must be one of"):
    apply(params, tokens, config=cfg, stack="unrolled")
  with pytest.raises(ValueError, match="ModelConfig.remat"):
    cfg.replace(remat="some")


def test_axis_table_matches_declared_logical_axes(cfg):
  """Every dim an axis touches carries that axis' logical name, and every dim the modules name
  with an elastic axis' logical name is in the table (so masking / slicing miss nothing)."""
  names = logical_axes(cfg)
  shapes = param_shapes(cfg)
  flat = {jax.tree_util.keystr(p): tuple(s) for p, s in
          jax.tree_util.tree_flatten_with_path(names, is_leaf=lambda x: isinstance(x, tuple))[0]}
  for path, spec in flat.items():
    leaf = shapes
    for key in path.strip("[]'").split("']['"):
      leaf = leaf[key]
    assert len(spec) == leaf.ndim, path
  listed = set()
  for axis in AXES.values():
    for use in axis.uses:
      kinds = ("global",) if use.kind == "global" else (
          tuple(cfg.layer_pattern) if use.kind == "all" else (use.kind,))
      for i, kind in enumerate(cfg.layer_pattern):
        if use.kind == "global" and i:
          break
        if use.kind != "global" and kind not in kinds:
          continue
        prefix = "" if use.kind == "global" else f"['layers']['{i}']"
        path = prefix + "".join(f"['{k}']" for k in use.path)
        assert path in flat, f"{axis.name}: {path} is not a parameter"
        assert flat[path][use.dim] == axis.logical, (axis.name, path, flat[path])
        listed.add((path, use.dim))
  logical = {a.logical for a in AXES.values()}
  named = {(p, d) for p, spec in flat.items() for d, n in enumerate(spec) if n in logical}
  assert named == listed, sorted(named ^ listed)[:5]


def test_scan_compile_experiment_quick(tmp_path):
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = tmp_path / "scan.md"
  proc = subprocess.run([sys.executable, os.path.join(root, "experiments", "scan_compile.py"),
                         "--quick", "--out", str(out)], capture_output=True, text=True,
                        timeout=900, cwd=root)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "loop / scan (native params): lower+compile" in proc.stdout
  table = out.read_text()
  assert table.count("| scan |") == 3 and table.count("| loop |") == 1
