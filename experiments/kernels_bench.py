"""Kernels vs XLA at nano_v3's layer shapes: the SSD scan and the MoE grouped matmul.

For each op, the XLA path (`elastic_jax.model.ssd.ssd_chunked`, `jax.lax.ragged_dot`) and the
kernel path (`pallas_kernels.ssd`, `pallas_kernels.gmm`: megablox on TPU, tokamax on GPU) at
each budget level of nano_v3's choices, as the masked parent (full shapes, the budget's heads /
experts masked; the kernel path skips masked heads and narrows a masked expert width) and as
the sliced sub-model (the budget's shapes): median wall time, TFLOP/s
of the budget's useful work and its fraction of this device's measured matmul peak (a square
matmul timed here, bf16 on accelerators, fp32 on CPU).

On CPU the Pallas rows run in Pallas' interpreter: they show the code runs, not its speed.
  python experiments/kernels_bench.py            # CPU: T 1024 SSD; 512 tokens, 16 experts MoE
  python experiments/kernels_bench.py --quick    # CI: T 256, 2 groups of 2 heads; 64 tokens, 8
                                                 # experts, D and F / 4
"""
from __future__ import annotations

from absl import app, flags

from timing import matmul_peak, median_time

flags.DEFINE_bool("quick", False, "small shapes (CI)")
flags.DEFINE_integer("seq", 0, "SSD sequence length (0: 8192 on an accelerator, else 1024)")
flags.DEFINE_integer("tokens", 0, "MoE tokens (0: 8192 on an accelerator, else 512)")
flags.DEFINE_integer("iters", 3, "timed repetitions (the median is reported)")
flags.DEFINE_string("out", None, "also write the markdown table to this file")
FLAGS = flags.FLAGS


def ssd_flops(T: int, heads: int, P: int, N: int, L: int) -> float:
  """Useful FLOPs of the chunked forward: per chunk and head C B^T and its product with x dt
  (2 L^2 (N + P)), the state's read-out and update (4 L P N)."""
  return T / L * heads * (2 * L * L * (N + P) + 4 * L * P * N)


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  import numpy as np

  from configs import model_config
  from elastic_jax.model import moe as moe_lib
  from elastic_jax.model.ssd import ssd_chunked
  from pallas_kernels import gmm as gmm_lib
  from pallas_kernels import ssd as ssd_lib

  c = model_config("nano_v3")
  on_cpu = jax.default_backend() == "cpu"
  it = FLAGS.iters
  peak_dtype = jnp.float32 if on_cpu else jnp.bfloat16
  peak = matmul_peak(peak_dtype, 1024 if on_cpu else 8192, it)
  rows = ["| op | budget | path | shape | ms | TFLOP/s | of peak |", "|---|---|---|---|---:|---:|---:|"]

  def row(op, budget, path, shape, sec, flops):
    # Three significant figures: interpreted Pallas rows on CPU are 1e-4 TFLOP/s and less.
    rows.append(f"| {op} | {budget} | {path} | {shape} | {sec * 1e3:.1f} | {flops / sec / 1e12:.3g}"
                f" | {100 * flops / sec / 1e12 / peak:.3g}% |")

  # SSD: one Mamba layer's scan. Budgets keep a prefix of heads in every group.
  G, H, P, N, L = (c.mamba_n_groups, c.mamba_heads_per_group, c.mamba_head_dim, c.ssm_state_size,
                   c.chunk_size)
  T = FLAGS.seq or (256 if FLAGS.quick else 1024 if on_cpu else 8192)
  levels = [h // G for h in c.mamba_head_choices]
  if FLAGS.quick:
    G, H, levels = 2, 2, [2, 1]
  ks = jax.random.split(jax.random.PRNGKey(1), 5)
  x = jax.random.normal(ks[0], (1, T, G, H, P))
  dt = jax.nn.softplus(jax.random.normal(ks[1], (1, T, G, H)) - 2)
  A = -jnp.exp(0.5 * jax.random.normal(ks[2], (G, H)))
  Bm, Cm = (jax.random.normal(k, (1, T, G, N)) for k in ks[3:])
  xla_ssd = jax.jit(lambda *a: ssd_chunked(*a, L)[0])
  kern_ssd = jax.jit(lambda keep, *a: ssd_lib.ssd(*a, L, head_keep_GH=keep)[0])
  shape = lambda heads: f"T{T} {G}x{heads} P{P} N{N} L{L}"
  for h in levels:
    keep = (jnp.arange(H) < h).astype(jnp.float32)[None].repeat(G, 0)
    sub = (x[:, :, :, :h], dt[:, :, :, :h], A[:, :h], Bm, Cm)
    flops = ssd_flops(T, G * h, P, N, L)
    budget = f"{G * h} heads"
    row("SSD fwd", budget, "xla masked", shape(H),
        median_time(xla_ssd, x, dt, A, Bm, Cm, iters=it), flops)
    row("SSD fwd", budget, "xla sliced", shape(h), median_time(xla_ssd, *sub, iters=it), flops)
    row("SSD fwd", budget, "pallas masked (skips heads)", shape(H),
        median_time(kern_ssd, keep, x, dt, A, Bm, Cm, iters=it), flops)
    row("SSD fwd", budget, "pallas sliced", shape(h),
        median_time(kern_ssd, None, *sub, iters=it), flops)
  # One backward at the full budget: fwd + bwd of a weighted sum.
  loss = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 3, 4)))
  flops = 3 * ssd_flops(T, G * H, P, N, L)
  row("SSD fwd+bwd", f"{G * H} heads", "xla", shape(H),
      median_time(loss(xla_ssd), x, dt, A, Bm, Cm, iters=it), flops)
  row("SSD fwd+bwd", f"{G * H} heads", "pallas", shape(H),
      median_time(loss(lambda *a: kern_ssd(None, *a)), x, dt, A, Bm, Cm, iters=it), flops)

  # MoE up projection as a grouped matmul: tokens routed top-k among the budget's experts.
  # On CPU fewer experts (128 fp32 experts are 2.5 GB), the budgets' expert share kept;
  # --quick also quarters D and F (the interpreted megablox walks every tile).
  D, E, F, k = c.hidden_size, c.n_routed_experts, c.moe_intermediate_size, c.num_experts_per_tok
  tokens = FLAGS.tokens or (64 if FLAGS.quick else 512 if on_cpu else 8192)
  budgets = list(zip(c.expert_choices, c.moe_ffn_choices))[::4]   # 128 x 1856, 96 x 1344
  if on_cpu:
    scale = 8 if FLAGS.quick else 16
    shrink = 4 if FLAGS.quick else 1
    budgets = [(e * scale // E, f // shrink) for e, f in budgets]
    E, D, F = scale, D // shrink, F // shrink
  dtype = jnp.float32 if on_cpu else jnp.bfloat16
  lhs = jax.random.normal(ks[0], (tokens * k, D)).astype(dtype)
  rhs = (jax.random.normal(ks[1], (E, D, F)) / np.sqrt(D)).astype(dtype)
  backend = gmm_lib.pallas_backend()
  gmm = lambda b: jax.jit(lambda l, r, s: gmm_lib.gmm(l, r, s, backend=b))
  rng = np.random.default_rng(0)
  # The masked parent with kernels=pallas runs the branch of `moe.narrow_width` that the width
  # mask picks: every expert's weights sliced to the budget's width (dropped experts: empty
  # groups); with kernels=xla the whole width, the mask applied after. (The product is summed
  # over its columns here, so that every width's branch has one output shape.)
  widths = tuple(sorted({f for _, f in budgets} | {F}))
  mask_of = lambda f: (jnp.arange(F) < f).astype(dtype)
  narrowed = lambda b: jax.jit(lambda l, r, s, m: moe_lib.narrow_width(
      lambda up, down, x, g, i, mm: jnp.sum(gmm_lib.gmm(x, up, i, backend=b) * mm, -1),
      widths)(r, r[..., :1].swapaxes(1, 2), l, None, s, m))
  for e, f in budgets:
    sizes = np.bincount(rng.integers(0, e, tokens * k), minlength=E).astype(np.int32)
    flops = 2 * tokens * k * D * f
    budget = f"{e} experts x {f}"
    for path, b in (("xla", "xla"), (backend, backend)):
      if path == "xla":
        row("MoE gmm", budget, "xla masked (whole width)", f"[{tokens * k},{D}]x[{E},{D},{F}]",
            median_time(gmm(b), lhs, rhs, jnp.asarray(sizes), iters=it), flops)
      else:
        row("MoE gmm", budget, f"{path} masked (width narrowed)",
            f"[{tokens * k},{D}]x[{E},{D},{f}]", median_time(
                narrowed(b), lhs, rhs, jnp.asarray(sizes), mask_of(f), iters=it), flops)
      row("MoE gmm", budget, f"{path} sliced", f"[{tokens * k},{D}]x[{e},{D},{f}]",
          median_time(gmm(b), lhs, rhs[:e, :, :f], jnp.asarray(sizes[:e]), iters=it), flops)
  table = "\n".join(rows)
  header = (f"{jax.devices()[0].device_kind} ({jax.default_backend()}): measured matmul peak "
            f"{peak:.3f} TFLOP/s ({jnp.dtype(peak_dtype).name}); pallas rows "
            f"{'interpreted (not a speed figure)' if on_cpu else 'compiled'}")
  print(header)
  print(table)
  if FLAGS.out:
    with open(FLAGS.out, "w") as fh:
      fh.write(f"{header}\n\n{table}\n")


if __name__ == "__main__":
  app.run(main)
