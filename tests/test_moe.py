"""MoE routing against a numpy reference; dense vs ragged vs gather dispatch (values, gradients)."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from elastic_jax.model import moe as moe_lib


def _moe_params(params, cfg):
  return params["layers"][str(cfg.layer_pattern.index("E"))]["mixer"]


def _prefix_masks(cfg):
  """Expert and expert-width masks keeping prefixes (6 experts, 12 columns)."""
  return ((jnp.arange(cfg.n_routed_experts) < 6).astype(jnp.float32),
          (jnp.arange(cfg.moe_intermediate_size) < 12).astype(jnp.float32))


def test_route_reference(cfg, params):
  p = jax.tree_util.tree_map(np.asarray, _moe_params(params, cfg))
  x = np.random.RandomState(0).randn(9, cfg.hidden_size).astype(np.float32)
  gates, idx = moe_lib.route(p, jnp.asarray(x), cfg)
  s = 1 / (1 + np.exp(-(x @ p["router"])))
  for t in range(9):
    top = np.argsort(-(s[t] + p["router_bias"]))[:cfg.num_experts_per_tok]
    assert set(np.asarray(idx[t])) == set(top)
    g = s[t, np.asarray(idx[t])]
    np.testing.assert_allclose(gates[t], g / g.sum() * cfg.routed_scaling_factor, rtol=1e-5)


def test_masked_experts_never_selected(cfg, params):
  p = _moe_params(params, cfg)
  x = jax.random.normal(jax.random.PRNGKey(0), (64, cfg.hidden_size))
  mask = (jnp.arange(cfg.n_routed_experts) < 4).astype(jnp.float32)
  _, idx = moe_lib.route(p, x, cfg, mask)
  assert int(idx.max()) < 4


def test_mask_gradient_is_finite_and_reaches_kept_experts(cfg, params):
  """A mask scaled by a router probability: finite gradients (no log(0) NaN from the selection),
  the mask's gradient on kept experts only."""
  p = _moe_params(params, cfg)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 7, cfg.hidden_size))
  em = 0.7 * (jnp.arange(cfg.n_routed_experts) < 6).astype(jnp.float32)
  g = jax.grad(lambda p, m: jnp.sum(moe_lib.moe(p, x, cfg, m)[0] ** 2), argnums=(0, 1))(p, em)
  assert all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree_util.tree_leaves(g))
  assert np.all(np.asarray(g[1][6:]) == 0) and np.any(np.asarray(g[1][:6]) != 0)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("impl", ["ragged", "gather"])
def test_dense_equals_sparse_dispatch(cfg, params, masked, impl):
  p = _moe_params(params, cfg)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 7, cfg.hidden_size))
  em = (jnp.arange(8) < 6).astype(jnp.float32) if masked else None
  fm = (jnp.arange(16) < 12).astype(jnp.float32) if masked else None

  def f(impl):
    return lambda p, x: jnp.sum(moe_lib.moe(p, x, cfg, em, fm, impl=impl)[0] ** 2)

  np.testing.assert_allclose(moe_lib.moe(p, x, cfg, em, fm, impl="dense")[0],
                             moe_lib.moe(p, x, cfg, em, fm, impl=impl)[0], rtol=1e-5, atol=1e-5)
  gd = jax.grad(f("dense"), argnums=(0, 1))(p, x)
  gr = jax.grad(f(impl), argnums=(0, 1))(p, x)
  chex.assert_trees_all_close(gd, gr, rtol=1e-4, atol=1e-5)


def test_auto_dispatch_follows_the_measured_rule(cfg, params):
  """"auto": on CPU gather for one token, else ragged (the tiled grouped matmul); for GPU / TPU
  gather while tokens * k <= experts (8 experts, top-2 here: up to 4 tokens), then ragged; ep
  inside a mesh with an expert axis; its output is the chosen path's."""
  from pallas_kernels import platform as platform_lib
  assert [moe_lib.choose_impl(t, cfg) for t in (1, 2, 4, 5, 64)] == [
      "gather", "ragged", "ragged", "ragged", "ragged"]
  for accelerator in ("gpu", "tpu"):
    with platform_lib.target(accelerator):
      assert [moe_lib.choose_impl(t, cfg) for t in (1, 4, 5, 64)] == [
          "gather", "gather", "ragged", "ragged"]
  from elastic_jax.parallel import mesh as mesh_lib
  with jax.set_mesh(mesh_lib.make_mesh("fsdp:2,expert:4")):
    assert moe_lib.choose_impl(1, cfg) == "ep"
  p = _moe_params(params, cfg)
  for B, T, plat, chosen in ((2, 2, "gpu", "gather"), (1, 1, "cpu", "gather"),
                             (2, 2, "cpu", "ragged"), (2, 7, "cpu", "ragged")):
    x = jax.random.normal(jax.random.PRNGKey(1), (B, T, cfg.hidden_size))
    with platform_lib.target(plat):
      np.testing.assert_array_equal(moe_lib.moe(p, x, cfg, impl="auto")[0],
                                    moe_lib.moe(p, x, cfg, impl=chosen)[0])


def test_bad_impl(cfg, params):
  with pytest.raises(ValueError, match="moe impl must be one of"):
    moe_lib.moe(_moe_params(params, cfg), jnp.zeros((1, 2, cfg.hidden_size)), cfg, impl="sparse")


def test_ragged_dispatch_sorts_each_token_shard_alone(cfg, params):
  """impl "ragged" in a mesh that splits the tokens over data x fsdp (no expert axis): values
  and gradients equal the one-device dense MoE, so do the calibration statistics (`collect`),
  and the compiled programs sort only each shard's own T*k assignments. Sorting the global
  batch made XLA gather every shard's rows to every device (nano_v3 stage 1 on fsdp:64: 168
  GiB per device against 38 per shard)."""
  import re
  from elastic_jax.parallel import mesh as mesh_lib
  from elastic_jax.parallel import sharding as shd
  from elastic_jax.parallel.rules import DEFAULT_RULES
  mesh = mesh_lib.make_mesh("data:2,fsdp:4")
  p = _moe_params(params, cfg)
  x = jax.random.normal(jax.random.PRNGKey(3), (8, 5, cfg.hidden_size))
  em, fm = _prefix_masks(cfg)

  def loss(impl):
    def f(p, x):
      out = moe_lib.moe(p, x, cfg, em, fm, impl=impl)[0]
      return jnp.sum(out * jnp.cos(out)), out
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))

  (_, want), want_g = loss("dense")(p, x)
  put = lambda a, spec: jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))
  sp = {k: put(v, P("fsdp") if v.ndim > 1 else P()) for k, v in p.items()}
  sx = put(x, P(("data", "fsdp")))
  stats = lambda impl: jax.jit(
      lambda p, x: moe_lib.moe(p, x, cfg, em, fm, impl=impl, collect=True)[1]["stats"])
  want_stats = stats("dense")(p, x)
  with shd.activation_context(mesh, DEFAULT_RULES):
    f, s = loss("ragged"), stats("ragged")
    (_, got), got_g = f(sp, sx)
    got_stats = s(sp, sx)
    hlos = [g.lower(sp, sx).compile().as_text() for g in (f, s)]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()))
  # The calibration statistics (importance) too: sums and maxes over the shards.
  chex.assert_trees_all_close(got_stats, want_stats, rtol=1e-5, atol=1e-6)
  # 3 sequences do not split over 8 shards: computed as they are, same values.
  with shd.activation_context(mesh, DEFAULT_RULES):
    got3 = jax.jit(lambda p, x: moe_lib.moe(p, x, cfg, em, fm, impl="ragged")[0])(sp, x[:3])
  np.testing.assert_allclose(got3, want[:3], rtol=1e-5, atol=1e-5)
  k = cfg.num_experts_per_tok
  for hlo in hlos:
    lengths = {int(n) for n in re.findall(r"= \(?\w+\[(\d+)\][^\n]*? sort\(", hlo)}
    assert lengths and lengths <= {x.shape[0] // 8 * x.shape[1] * k}, lengths


def test_shipped_grouped_matmul_kernels_run_inside_the_islands(cfg, params):
  """kernels="pallas" (megablox, interpreted on CPU) inside every shard_map island: the token
  shards of impl "ragged" and the three "ep" layouts give the one-device dense MoE's values and
  gradients. Megablox declares its outputs without shard_map's varying-axes types and refused
  to trace in a typed island, so those islands run untyped (`moe_parallel.typed_island`)."""
  from elastic_jax.parallel import mesh as mesh_lib
  from elastic_jax.parallel import sharding as shd
  from elastic_jax.parallel.rules import DEFAULT_RULES, with_batch_axes
  p = _moe_params(params, cfg)
  x = jax.random.normal(jax.random.PRNGKey(4), (8, 5, cfg.hidden_size))

  def loss(c, impl):
    def f(p, x):
      out = moe_lib.moe(p, x, c, impl=impl)[0]
      return jnp.sum(out * jnp.cos(out))
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))

  want = loss(cfg, "dense")(p, x)
  for spec, batch, impl, dispatch in [
      ("data:2,fsdp:4", ("data", "fsdp"), "ragged", "auto"),
      ("fsdp:2,tensor:2,expert:2", ("data", "fsdp"), "ep", "auto"),
      ("data:2,expert:4", ("data", "expert"), "ep", "gather"),
      ("data:2,expert:4", ("data", "expert"), "ep", "ragged")]:
    mesh = mesh_lib.make_mesh(spec)
    rules = with_batch_axes(DEFAULT_RULES, batch)
    put = lambda a, s: jax.device_put(a, jax.sharding.NamedSharding(mesh, s))
    sp = {k: put(v, P("expert") if k in ("up", "down") and impl == "ep" else P())
          for k, v in p.items()}
    with shd.activation_context(mesh, rules):
      got = loss(cfg.replace(kernels="pallas", ep_dispatch=dispatch), impl)(sp, put(x, P(batch)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()),
                                 err_msg=f"{spec} {impl} {dispatch}")


@pytest.mark.parametrize("mesh_spec, batch_axes, placement, dispatch", [
    # tokens repeated on each expert shard
    ("fsdp:2,tensor:2,expert:2", ("data", "fsdp"), "contiguous", "auto"),
    # tokens split over experts too; experts in the balanced order; all_gather + psum_scatter
    ("data:2,expert:4", ("data", "expert"), "balanced", "gather"),
    # ... each assignment sent to its expert's shard and back (ragged all-to-all, emulated)
    ("data:2,expert:4", ("data", "expert"), "contiguous", "ragged"),
])
def test_expert_parallel_equals_one_device(cfg, params, mesh_spec, batch_axes, placement,
                                           dispatch):
  """impl "ep" on 8 host devices (experts split over `expert`, weights FSDP / tensor sharded):
  values and gradients equal the single-device dense MoE (fp32), experts and width masked,
  with the experts placed contiguously or balanced (masks in logical order either way), and
  tokens split over `expert` reaching their experts by all_gather or ragged all-to-all."""
  from elastic_jax.model import expert_placement
  from elastic_jax.model import model as M
  from elastic_jax.parallel import mesh as mesh_lib
  from elastic_jax.parallel import sharding as shd
  from elastic_jax.parallel.rules import DEFAULT_RULES, with_batch_axes
  mesh = mesh_lib.make_mesh(mesh_spec)
  rules = with_batch_axes(DEFAULT_RULES, batch_axes)
  p = _moe_params(params, cfg)
  x = jax.random.normal(jax.random.PRNGKey(2), (8, 5, cfg.hidden_size))
  em, fm = _prefix_masks(cfg)

  def loss(impl):
    def f(p, x):
      out = moe_lib.moe(p, x, pcfg if impl == "ep" else cfg, em, fm, impl=impl)[0]
      return jnp.sum(out * jnp.cos(out)), out
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))

  (want_l, want), want_g = loss("dense")(p, x)
  placed, pcfg = M.place_experts(params, cfg, placement)
  pcfg = pcfg.replace(ep_dispatch=dispatch)
  p = _moe_params(placed, pcfg)
  specs = {"router": P(), "router_bias": P(), "up": P("expert", "fsdp", "tensor"),
           "down": P("expert", "tensor", "fsdp"), "shared_up": P("fsdp", "tensor"),
           "shared_down": P("tensor", "fsdp")}
  put = lambda a, spec: jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))
  sp = {k: put(v, P(*(a if a in mesh.axis_names and mesh.shape[a] > 1 else None for a in specs[k])))
        for k, v in p.items()}
  sx = put(x, P(batch_axes))
  with shd.activation_context(mesh, rules):
    (got_l, got), got_g = loss("ep")(sp, sx)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
  # Within 1e-5 of each gradient's own scale (fp32 sums in another order), experts back in
  # logical order.
  inv = np.argsort(expert_placement.order(cfg.n_routed_experts, placement))
  got_g = jax.device_get(got_g)
  got_g[0].update(router=got_g[0]["router"][:, inv], router_bias=got_g[0]["router_bias"][inv],
                  up=got_g[0]["up"][inv], down=got_g[0]["down"][inv])
  for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()))
  # Outside a mesh with an expert axis, "ep" is the single-device ragged path.
  np.testing.assert_allclose(moe_lib.moe(p, x, pcfg, em, fm, impl="ep")[0], want, rtol=1e-5,
                             atol=1e-5)


def test_balanced_placement_is_the_same_model(cfg, params, tokens):
  """Experts moved into the balanced order (`model.place_experts`) give the same logits under
  soft expert masks (given in logical order) and the same calibration statistics, in both
  layouts; moving back restores the params exactly."""
  from elastic_jax.elastic import router as R
  from elastic_jax.elastic.axes import AXES
  from elastic_jax.model import model as M
  pi = {n: jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(i), (1, len(a.choices(cfg)))))
        for i, (n, a) in enumerate(AXES.items())}
  masks = R.masks_from_probs(pi, cfg, "soft")
  want, want_stats = M.apply(params, tokens, masks, config=cfg, collect=True)
  for stack in ("loop", "scan"):
    laid = M.to_stack_layout(params, cfg, stack)
    placed, pcfg = M.place_experts(laid, cfg, "balanced")
    assert pcfg.expert_placement == "balanced"
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(placed),
                                                      jax.tree.leaves(laid))]
    assert sum(moved) >= 4, "router, its bias, up and down must move"
    got = M.apply(placed, tokens, masks, config=pcfg, stack=stack)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    back, bcfg = M.place_experts(placed, pcfg, "contiguous")
    chex.assert_trees_all_equal(back, laid)
    assert bcfg == cfg
  _, got_stats = M.apply(M.place_experts(params, cfg, "balanced")[0], tokens, masks,
                         config=cfg.replace(expert_placement="balanced"), collect=True)
  for w, g in zip(jax.tree.leaves(want_stats), jax.tree.leaves(got_stats)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_balanced_order_spreads_every_prefix():
  """Every prefix of k experts puts floor(k/S) or ceil(k/S) on each of S shards, for every S
  the order serves; contiguous placement does not."""
  from elastic_jax.model import expert_placement as ep
  for E in (8, 12, 128):
    order = ep.balanced_order(E)
    assert sorted(order) == list(range(E))
    for S in ep.balanced_shard_counts(E)[1:]:
      for k in range(1, E + 1):
        loads = ep.shard_loads(np.arange(E) < k, S, "balanced")
        assert loads.max() - loads.min() <= 1, (E, S, k, loads)
  assert ep.balanced_shard_counts(128) == [2 ** i for i in range(8)]
  assert ep.balanced_shard_counts(12) == [1, 2, 4, 12]
  np.testing.assert_array_equal(ep.shard_loads(np.arange(128) < 64, 8, "contiguous"),
                                [16] * 4 + [0] * 4)
  with pytest.raises(ValueError, match="do not divide"):
    ep.shard_loads(np.ones(12), 8, "balanced")


def test_expert_balance_benchmark_quick():
  """experiments/expert_balance.py --quick: at 64 of nano_v3's 128 experts on 8 shards,
  contiguous placement idles 4 shards and the balanced one none."""
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  r = subprocess.run([sys.executable, os.path.join(root, "experiments", "expert_balance.py"),
                      "--quick"], capture_output=True, text=True, timeout=600, cwd=root)
  assert r.returncode == 0, r.stderr[-2000:]
  rows = {tuple(c.strip() for c in line.split("|")[1:3]): line.split("|")[4:6]
          for line in r.stdout.splitlines() if line.startswith("| 64 |")}
  assert int(rows[("64", "contiguous")][0]) == 4 and int(rows[("64", "balanced")][0]) == 0
  assert float(rows[("64", "balanced")][1]) < 1.2 < 2.0 < float(rows[("64", "contiguous")][1])


def test_ragged_dispatch_lowers_for_gpu_and_tpu(cfg, params, monkeypatch):
  """The ragged dispatch is the real `ragged_all_to_all` where the backend compiles it: the
  MoE's forward and backward lowered for CUDA and TPU on an expert-split mesh hold the
  collective (rows and expert ids out, outputs back; two more in the backward), not the CPU
  emulation's all_gathers."""
  from elastic_jax.model import moe_parallel
  from elastic_jax.parallel import mesh as mesh_lib
  from elastic_jax.parallel import sharding as shd
  from elastic_jax.parallel.rules import DEFAULT_RULES, with_batch_axes
  monkeypatch.setattr(moe_parallel, "emulate_ragged", lambda: False)
  rcfg = cfg.replace(ep_dispatch="ragged")
  rules = with_batch_axes(DEFAULT_RULES, ("data", "expert"))
  x = jnp.ones((8, 5, cfg.hidden_size))
  loss = lambda p, x: jnp.sum(moe_lib.moe(p, x, rcfg, impl="ep")[0])
  for platform in ("cuda", "tpu"):
    with shd.activation_context(mesh_lib.make_mesh("data:2,expert:4"), rules):
      hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(_moe_params(params, cfg), x).lower(
          lowering_platforms=(platform,)).as_text()
    assert hlo.count("ragged_all_to_all") == 5, platform
