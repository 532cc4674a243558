"""Pallas kernels against their references: the SSD kernel (interpret mode) against the
sequential scan, values and gradients, ragged chunk counts, masked heads; the grouped matmul's
megablox path against `jax.lax.ragged_dot`; TPU (Mosaic) and GPU (Triton) lowering without the
hardware; and `kernels="pallas"` through a train step's loss and gradients and through
generation on the shared tiny model."""
import collections

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic_jax.elastic import router as R
from elastic_jax.inference import generate as G
from elastic_jax.model import moe as moe_lib
from elastic_jax.model.ssd import ssd_sequential
from elastic_jax.training import phases
from pallas_kernels import gmm as gmm_lib
from pallas_kernels import gmm_tiled
from pallas_kernels import ssd as ssd_lib

B, G_, H, P, N = 2, 2, 3, 4, 8


def _ssd_inputs(T, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 7)
  return dict(
      x=jax.random.normal(ks[0], (B, T, G_, H, P)),
      dt=jax.nn.softplus(jax.random.normal(ks[1], (B, T, G_, H))),
      A=-jnp.exp(0.5 * jax.random.normal(ks[2], (G_, H))),
      Bm=jax.random.normal(ks[3], (B, T, G_, N)), Cm=jax.random.normal(ks[4], (B, T, G_, N)),
      s0=jax.random.normal(ks[5], (B, G_, H, P, N)), D=jax.random.normal(ks[6], (G_, H)))


def _reference(x, dt, A, Bm, Cm, s0, D):
  y, final = ssd_sequential(x, dt, A, Bm, Cm, s0)
  return y + D[..., None] * x, final


def _kernel(chunk, keep=None, backend="gpu"):
  return lambda x, dt, A, Bm, Cm, s0, D: ssd_lib.ssd(x, dt, A, Bm, Cm, chunk, s0, D, keep,
                                                     backend=backend, interpret=True)


def _weighted(fn, wy, wf):
  return lambda *a: (lambda y, f: jnp.sum(y * wy) + jnp.sum(f * wf))(*fn(*a))


@pytest.mark.parametrize("T,chunk,backend", [(13, 4, "gpu"), (8, 8, "gpu"), (3, 4, "gpu"),
                                             (13, 4, "tpu"), (3, 4, "tpu")])
def test_ssd_kernel_matches_sequential_scan(T, chunk, backend):
  """fp32 values and gradients (x, dt, A, B, C, initial state, D) to 1e-5 of the largest
  entry, in both layouts (GPU: a program walks a head's chunks; TPU: chunks on the grid);
  T=13 pads a ragged last chunk, T=3 is shorter than one chunk."""
  inp = _ssd_inputs(T)
  args = tuple(inp.values())
  y, f = _kernel(chunk, backend=backend)(*args)
  y_ref, f_ref = _reference(*args)
  chex.assert_shape(y, (B, T, G_, H, P))
  chex.assert_shape(f, (B, G_, H, P, N))
  np.testing.assert_allclose(y, y_ref, atol=1e-5 * float(jnp.abs(y_ref).max()))
  np.testing.assert_allclose(f, f_ref, atol=1e-5 * float(jnp.abs(f_ref).max()))
  wy, wf = (jax.random.normal(jax.random.PRNGKey(9), v.shape) for v in (y_ref, f_ref))
  g = jax.grad(_weighted(_kernel(chunk, backend=backend), wy, wf), argnums=range(7))(*args)
  g_ref = jax.grad(_weighted(_reference, wy, wf), argnums=range(7))(*args)
  for name, a, b in zip(inp, g, g_ref):
    np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.abs(b).max()), err_msg=name)


def test_ssd_kernel_bf16_inputs():
  """bf16 inputs: the kernel computes in fp32 like the reference, so they agree to fp32
  rounding (1e-5 of the largest entry); the bf16 cast itself is the caller's error budget."""
  args = tuple(v.astype(jnp.bfloat16) for v in _ssd_inputs(13).values())
  y, f = _kernel(4)(*args)
  y_ref, f_ref = _reference(*(a.astype(jnp.float32) for a in args))
  assert y.dtype == jnp.float32
  np.testing.assert_allclose(y, y_ref, atol=1e-5 * float(jnp.abs(y_ref).max()))
  np.testing.assert_allclose(f, f_ref, atol=1e-5 * float(jnp.abs(f_ref).max()))


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_ssd_kernel_skips_dropped_heads(backend):
  """A hard head mask: kept heads equal the reference; in the undifferentiated forward a
  dropped head is not computed (NaN inputs on it reach nothing, its state stays the initial
  one, its output is the D skip alone). Differentiated, every head is computed: gradients equal
  the reference's with every head's output weighted, as a straight-through mask (0 in value,
  not in gradient) needs."""
  inp = _ssd_inputs(13)
  keep = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
  dropped = (keep == 0)[None, None]
  x, dt, A, Bm, Cm, s0, D = inp.values()
  dt_nan = jnp.where(dropped, jnp.nan, dt)
  y, f = _kernel(4, keep, backend)(x, dt_nan, A, Bm, Cm, s0, D)
  y_ref, f_ref = _reference(x, dt, A, Bm, Cm, s0, D)
  kept = ~dropped[..., None]
  np.testing.assert_allclose(jnp.where(kept, y, 0), jnp.where(kept, y_ref, 0), atol=1e-4)
  np.testing.assert_allclose(jnp.where(dropped[..., None], y, 0),
                             jnp.where(dropped[..., None], D[..., None] * x, 0), atol=1e-6)
  np.testing.assert_allclose(f, jnp.where((keep == 0)[None, ..., None, None], s0, f_ref),
                             atol=1e-4)
  wy, wf = (jax.random.normal(jax.random.PRNGKey(9), v.shape) for v in (y, f))
  args = (x, dt, A, Bm, Cm, s0, D)
  g = jax.grad(_weighted(_kernel(4, keep, backend), wy, wf), argnums=range(7))(*args)
  g_ref = jax.grad(_weighted(_reference, wy, wf), argnums=range(7))(*args)
  for name, a, b in zip(inp, g, g_ref):
    np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.abs(b).max()), err_msg=name)


def test_ssd_kernel_padding_mask():
  """`valid_BT` False on left padding: those steps leave the state alone (dt = 0), so the
  result equals the reference run with dt zeroed there."""
  x, dt, A, Bm, Cm, s0, D = _ssd_inputs(13).values()
  valid = jnp.arange(13)[None, :] >= jnp.array([[3], [0]])
  y, f = ssd_lib.ssd(x, dt, A, Bm, Cm, 4, s0, D, valid_BT=valid, interpret=True)
  y_ref, f_ref = _reference(x, jnp.where(valid[..., None, None], dt, 0.0), A, Bm, Cm, s0, D)
  np.testing.assert_allclose(y, y_ref, atol=1e-5 * float(jnp.abs(y_ref).max()))
  np.testing.assert_allclose(f, f_ref, atol=1e-5 * float(jnp.abs(f_ref).max()))
  assert not np.allclose(f, _reference(x, dt, A, Bm, Cm, s0, D)[1], atol=1e-3)


def test_ssd_kernel_bad_backend():
  with pytest.raises(ValueError, match="ssd backend must be one of"):
    ssd_lib.ssd(*list(_ssd_inputs(4).values())[:5], 4, backend="cuda")


@pytest.mark.parametrize("backend,tile", [("megablox", None), ("tiled", None), ("tiled", 4)])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_gmm_backend_matches_ragged_dot(backend, tile, dtype, tol):
  """Several groups, two of them empty, and rows past the last group (zeros in the output, no
  gradient); values and gradients of lhs and rhs. bf16: both accumulate in fp32 and round the
  output to bf16, so they agree to a bf16 ulp or two (2e-2 of the largest entry). The tiled
  loop with 4-row tiles: groups span several tiles, the last one partly padded."""
  m, k, n = 37, 16, 24
  lhs = jax.random.normal(jax.random.PRNGKey(0), (m, k)).astype(dtype)
  rhs = jax.random.normal(jax.random.PRNGKey(1), (5, k, n)).astype(dtype)
  sizes = jnp.array([10, 0, 12, 0, 5], jnp.int32)          # 27 rows grouped, 10 parked
  ref = gmm_lib.gmm(lhs, rhs, sizes)
  gmm = lambda l, r, b: (gmm_tiled.gmm_tiled(l, r, sizes, tile=tile) if b == "tiled" and tile
                         else gmm_lib.gmm(l, r, sizes, backend=b))
  out = gmm(lhs, rhs, backend)
  assert out.dtype == dtype
  scale = float(jnp.abs(ref.astype(jnp.float32)).max())
  np.testing.assert_allclose(out.astype(jnp.float32), ref.astype(jnp.float32), atol=tol * scale)
  assert not jnp.any(out[27:])
  w = jax.random.normal(jax.random.PRNGKey(2), (m, n)).astype(dtype)
  grads = lambda b: jax.grad(
      lambda l, r: jnp.sum((gmm(l, r, b) * w).astype(jnp.float32)),
      argnums=(0, 1))(lhs, rhs)
  for a, b in zip(grads(backend), grads("xla")):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    np.testing.assert_allclose(a, b, atol=tol * float(jnp.abs(b).max()))
  with pytest.raises(ValueError, match="gmm backend must be one of"):
    gmm_lib.gmm(lhs, rhs, sizes, backend="triton")


def test_gmm_backend_per_platform():
  assert gmm_lib.pallas_backend("tpu") == "megablox"
  assert gmm_lib.pallas_backend("cpu") == "megablox"   # interpreted: the kernel's own code
  # tokamax is the GPU kernel when installed; without it XLA's ragged_dot, never megablox.
  assert gmm_lib.pallas_backend("gpu") in ("tokamax", "xla")
  # kernels="xla": XLA:CPU's ragged_dot computes every group, so the CPU runs the tiled loop.
  assert [gmm_lib.xla_backend(p) for p in ("cpu", "gpu", "tpu")] == ["tiled", "xla", "xla"]


# nano_v3's Mamba layer shapes (P=64, N=128, chunk 128), fewer heads and two chunks.
NANO = dict(T=256, G=2, H=2, P=64, N=128, L=128)


@pytest.mark.parametrize("platform,backend", [("tpu", "tpu"), ("cuda", "gpu")])
def test_ssd_kernels_lower_for_tpu_and_gpu(platform, backend):
  """Forward and backward kernels lower through Mosaic (TPU) and Triton (GPU) on this CPU:
  an op either compiler lacks fails here, without the hardware."""
  s = jax.ShapeDtypeStruct
  T, G, H, P_, N_, L = NANO.values()
  args = (s((1, T, G, H, P_), jnp.float32), s((1, T, G, H), jnp.float32), s((G, H), jnp.float32),
          s((1, T, G, N_), jnp.float32), s((1, T, G, N_), jnp.float32))
  loss = lambda *a: jnp.sum(ssd_lib.ssd(*a, L, backend=backend, interpret=False)[0])
  text = jax.jit(jax.grad(loss, argnums=range(5))).trace(*args).lower(
      lowering_platforms=(platform,)).as_text()
  marker = "tpu_custom_call" if platform == "tpu" else "triton"
  assert text.count(marker) >= 2, "forward and backward kernels"


def test_gmm_megablox_lowers_for_tpu():
  """Forward and backward at nano_v3's expert shapes (hidden 2688 = 21 x 128, expert width 1856
  = 14.5 x 128): the backward's transposed problem reuses the tiling, so the widths are padded
  to whole 128-lane tiles (a whole-dim 1856 tile applied to 2688 failed Mosaic's lowering)."""
  s = jax.ShapeDtypeStruct
  f = lambda l, u, d, g: jnp.sum(jnp.square(gmm_lib.gmm(
      gmm_lib.gmm(l, u, g, backend="megablox", interpret=False), d, g, backend="megablox",
      interpret=False)))
  args = (s((512, 2688), jnp.bfloat16), s((8, 2688, 1856), jnp.bfloat16),
          s((8, 1856, 2688), jnp.bfloat16), s((8,), jnp.int32))
  text = jax.jit(jax.grad(f, argnums=(0, 1, 2))).trace(*args).lower(
      lowering_platforms=("tpu",)).as_text()
  assert text.count("tpu_custom_call") >= 6      # per projection: gmm, backward gmm and tgmm


def test_gmm_tokamax_lowers_for_gpu(monkeypatch):
  """tokamax's Triton ragged_dot, forward and backward at nano_v3's expert shapes, lowered for
  CUDA on this CPU. tokamax asks the local device whether Triton runs there (it refuses a CPU),
  so the test answers yes for it: the lowering itself is what a GPU would compile."""
  pytest.importorskip("tokamax")   # a test extra; skipped only where the extras are not installed
  from tokamax._src.ops.ragged_dot import pallas_triton
  monkeypatch.setattr(pallas_triton.PallasTritonRaggedDot, "supported_on", lambda self, d: True)
  assert gmm_lib.pallas_backend("gpu") == "tokamax"
  s = jax.ShapeDtypeStruct
  f = lambda l, u, d, g: jnp.sum(jnp.square(gmm_lib.gmm(
      gmm_lib.gmm(l, u, g, backend="tokamax"), d, g, backend="tokamax").astype(jnp.float32)))
  args = (s((512, 2688), jnp.bfloat16), s((8, 2688, 1856), jnp.bfloat16),
          s((8, 1856, 2688), jnp.bfloat16), s((8,), jnp.int32))
  text = jax.jit(jax.grad(f, argnums=(0, 1, 2))).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") >= 6, "per projection: forward, d(lhs), d(rhs)"


def _pallas_calls(jaxpr, inside: bool = False) -> tuple[int, int]:
  """(pallas_calls outside any shard_map, inside one) in `jaxpr` and its sub-jaxprs."""
  counts = [0, 0]
  for e in jaxpr.eqns:
    if e.primitive.name == "pallas_call":
      counts[inside] += 1
      continue
    for v in e.params.values():
      for sub in v if isinstance(v, (list, tuple)) else [v]:
        inner = sub if hasattr(sub, "eqns") else getattr(sub, "jaxpr", None)
        if inner is not None:
          c = _pallas_calls(getattr(inner, "jaxpr", inner),
                            inside or e.primitive.name == "shard_map")
          counts = [counts[0] + c[0], counts[1] + c[1]]
  return tuple(counts)


@pytest.mark.parametrize("mesh_spec", [None, "data:2"])
def test_train_step_with_pallas_kernels_equals_xla(cfg, params, tokens, mesh_spec):
  """The elastic phase's step loss at the small budget, SSD and ragged MoE through the
  kernels (interpreted): loss and every gradient, the router's included, equal the XLA path's,
  with straight-through hard masks (0 on dropped heads, not in gradient: the hard case; soft
  masks are nowhere 0, so every head is computed either way). Also with the batch split over
  a mesh, where both kernels run per token shard (GSPMD cannot partition a Pallas call)."""
  import contextlib
  from elastic_jax.parallel import mesh as mesh_lib
  from elastic_jax.parallel import sharding as shd
  from elastic_jax.parallel.rules import DEFAULT_RULES
  rc = R.RouterConfig(hidden=8)
  state = {"model": phases.to_stack_layout(params, cfg), "router": R.init(cfg, rc,
                                                                           jax.random.PRNGKey(0))}
  args = (tokens, state["model"], jnp.int32(1), jnp.int32(0), jax.random.PRNGKey(0))

  def run(kernels, mesh=None):   # with the Pallas kernels, splash attention too
    c = cfg.replace(kernels=kernels, attention_impl="splash" if kernels == "pallas" else "blocked")
    loss_fn = phases.elastic_step_loss(c, rc, 10, moe_impl="ragged", hard_prob=1.0)
    a = args
    if mesh is not None:
      rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
      a = (jax.device_put(tokens, rows),) + args[1:]
    with shd.activation_context(mesh, DEFAULT_RULES) if mesh else contextlib.nullcontext():
      f = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
      if mesh is not None:   # Mosaic / Triton calls only inside shard_map islands
        outside, inside = _pallas_calls(f.trace(state, *a).jaxpr.jaxpr)
        assert outside == 0 and inside > 0, (outside, inside)
      return f(state, *a)

  mesh = None if mesh_spec is None else mesh_lib.make_mesh(mesh_spec, jax.devices()[:2])
  (loss_p, _), g_p = run("pallas", mesh)
  (loss_x, _), g_x = run("xla")
  np.testing.assert_allclose(loss_p, loss_x, rtol=1e-5)
  chex.assert_trees_all_close(g_p, g_x, rtol=1e-4, atol=1e-6)


def test_kept_width():
  widths = (8, 12, 16)
  prefix = lambda n: (jnp.arange(16) < n).astype(jnp.float32)
  got = [int(moe_lib.kept_width(m, widths)) for m in (
      prefix(12), prefix(10), prefix(8), prefix(16), jnp.full((16,), 0.3), prefix(0))]
  assert got == [1, 1, 0, 2, 2, 0]   # a soft mask (nowhere 0) keeps every column


@pytest.mark.parametrize("impl", ["ragged", "dense", "gather"])
def test_masked_expert_width_is_not_computed(cfg, params, impl):
  """kernels="pallas" with a hard expert-width mask (10 of 16 columns): the forward and the
  backward multiply only the narrowest configured width holding the kept columns (12), so NaN
  weights past it reach nothing, and output and gradients (the mask's included) equal the XLA
  path's, which computes every column."""
  p = params["layers"][str(cfg.layer_pattern.index("E"))]["mixer"]
  x = jax.random.normal(jax.random.PRNGKey(3), (2, 5, cfg.hidden_size))
  em = (jnp.arange(cfg.n_routed_experts) < 6).astype(jnp.float32)
  fm = (jnp.arange(cfg.moe_intermediate_size) < 10).astype(jnp.float32)
  nan_past = lambda q: dict(q, up=q["up"].at[..., 12:].set(jnp.nan),
                            down=q["down"].at[:, 12:].set(jnp.nan))
  w = jax.random.normal(jax.random.PRNGKey(4), x.shape)

  def loss(c, q):
    return lambda up, down, x, m: jnp.sum(
        moe_lib.moe(dict(q, up=up, down=down), x, c, em, m, impl=impl)[0] * w)

  def value_and_grads(c, q):
    return jax.value_and_grad(loss(c, q), argnums=range(4))(q["up"], q["down"], x, fm)

  got = value_and_grads(cfg.replace(kernels="pallas"), nan_past(p))
  want = value_and_grads(cfg, p)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  chex.assert_trees_all_close(got[1], want[1], rtol=1e-4, atol=1e-6)


def test_generation_with_pallas_kernels_equals_xla(cfg, params, tokens):
  """Batched greedy generation (prefill through the SSD kernel from a cached state, then
  decode) gives the XLA path's tokens, the full parent and the parent masked to a budget."""
  prompts = [list(np.asarray(tokens[0, :9])), list(np.asarray(tokens[1, :5]))]
  out = {k: G.generate(G.SubModel(params, cfg.replace(kernels=k)), prompts, 5, max_len=24,
                       chunk=4) for k in ("pallas", "xla")}
  assert out["pallas"] == out["xla"]
  small = {"hidden": 24, "mamba_heads": 4, "moe_experts": 4, "moe_ffn": 8}   # widths narrowed
  out = {k: G.generate(G.parent_at_budget(params, cfg.replace(kernels=k), small), prompts, 5,
                       max_len=24, chunk=4) for k in ("pallas", "xla")}
  assert out["pallas"] == out["xla"]
  with pytest.raises(ValueError, match="kernels"):
    cfg.replace(kernels="triton")


def test_kernels_benchmark_quick(tmp_path):
  """experiments/kernels_bench.py --quick runs every row: SSD forward (XLA / Pallas, masked /
  sliced, per head budget), SSD forward + backward, MoE grouped matmul per expert budget (the
  kernel's masked row through `moe.narrow_width`); each row's throughput and fraction of the
  measured peak are positive numbers."""
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = tmp_path / "table.md"
  r = subprocess.run([sys.executable, os.path.join(root, "experiments", "kernels_bench.py"),
                      "--quick", "--iters", "1", "--out", str(out)],
                     capture_output=True, text=True, timeout=600, cwd=root)
  assert r.returncode == 0, r.stderr[-2000:]
  rows = [line.split("|")[1:-1] for line in out.read_text().splitlines()[4:]]
  paths = collections.Counter((op.strip(), path.strip()) for op, _, path, *_ in rows)
  assert paths == {("SSD fwd", "xla masked"): 2, ("SSD fwd", "xla sliced"): 2,
                   ("SSD fwd", "pallas masked (skips heads)"): 2, ("SSD fwd", "pallas sliced"): 2,
                   ("SSD fwd+bwd", "xla"): 1, ("SSD fwd+bwd", "pallas"): 1,
                   ("MoE gmm", "xla masked (whole width)"): 2, ("MoE gmm", "xla sliced"): 2,
                   ("MoE gmm", "megablox masked (width narrowed)"): 2,
                   ("MoE gmm", "megablox sliced"): 2}, paths
  for row in rows:
    assert float(row[5]) > 0 and float(row[6].strip(" %")) > 0, row


def test_splash_attention_lowers_for_tpu():
  """Forward and backward of the splash path at nano_v3's attention shapes (2 KV heads x 16
  query heads of 128) lower for TPU as Mosaic kernels when built for a TPU
  (`platform.target`: not interpreted)."""
  from elastic_jax.model import attention as attn_lib
  from pallas_kernels import platform
  s = jax.ShapeDtypeStruct
  args = (s((1, 1024, 2, 16, 128), jnp.bfloat16), s((1, 1024, 2, 128), jnp.bfloat16),
          s((1, 1024, 2, 128), jnp.bfloat16))
  f = lambda q, k, v: jnp.sum(jnp.square(attn_lib.attend_splash(q, k, v, 512).astype(
      jnp.float32)))
  with platform.target("tpu"):
    text = jax.jit(jax.grad(f, argnums=(0, 1, 2))).trace(*args).lower(
        lowering_platforms=("tpu",)).as_text()
  assert text.count("tpu_custom_call") >= 3      # forward, and the backward's dq and dkv
