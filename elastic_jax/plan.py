"""The scale plan: compile the real elastic KD train step (student, frozen teacher, router,
AdamW state) for a config and mesh ahead of time, on fake CPU devices, without allocating a
weight, and print XLA's per-device memory and the analytic FLOPs per step.

  python -m elastic_jax.plan --config=configs/nano_v3.py --devices=64 --mesh=fsdp:-1
  python -m elastic_jax.plan --devices=256 --mesh=fsdp:32 --mesh=fsdp:64 --mesh=fsdp:64,tensor:4

Each --mesh is planned in turn: one with -1 spans all --devices, one with fixed sizes the first
devices it needs.

  python -m elastic_jax.plan --topology=v5p:4x4x4 --mesh=fsdp:-1

compiles for a TPU topology's devices instead (XLA:TPU through libtpu, on this CPU host: no TPU
needed; `pip install 'jax[tpu]'` in its own environment), so the memory is what those chips
would need, with the TPU's own paths (the grouped matmul, the ragged all-to-all, bf16 dots),
not the CPU stand-ins.

Both stages are planned (stage 1 at data.seq_len, stage 2 at seq_len x stage2_len_mult) with the
config's global batch (data.batch); --seq_len / --batch override them.

  python -m elastic_jax.plan --inference --context=8192 --context=131072

prints instead, per budget and weight format, the serving memory of one device: weights, the KV
and Mamba caches of one sequence at each context, and the largest batch that fits
--device_gb. The budgets' counts come from --counts_from (a nested checkpoint's stored counts)
or else from a router fitted to the budgets' targets alone (`router.fit_to_budgets`, then the
best architecture in band, as deployment picks).
"""
from __future__ import annotations

import contextlib
import math
import os
import re

from absl import flags

from elastic_jax import cli

_CONFIG = cli.define_config_file(
    "config", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "configs", "nano_v3.py"), "run config (a configs/*.py file)")
flags.DEFINE_integer("devices", 64, "fake CPU devices to plan on (ignored on an accelerator)")
flags.DEFINE_string("topology", None, "plan on a TPU topology's devices, e.g. v5p:4x4x4 or "
                    "v6e:8x8 (needs libtpu: pip install 'jax[tpu]'; no TPU needed)")
flags.DEFINE_multi_string("mesh", ["fsdp:-1"],
                          "mesh spec(s), e.g. data:1,fsdp:-1,tensor:1,expert:1 (repeatable)")
flags.DEFINE_list("stages", ["1", "2"], "which elastic stages to plan")
flags.DEFINE_integer("batch", None, "global batch (default: config.data.batch)")
flags.DEFINE_integer("seq_len", None, "stage-1 sequence length (default: config.data.seq_len)")
flags.DEFINE_string("moe_impl", None, "MoE dispatch (default: config.elastic.moe_impl)")
flags.DEFINE_list("batch_axes", None, "mesh axes the token batch is split over (default: the "
                  "config's 'batch' rule, data,fsdp); e.g. data,fsdp,expert sends each token to "
                  "its experts' shards (ep_dispatch)")
flags.DEFINE_bool("donate", True, "the step donates its state (as training does); --nodonate "
                  "shows what donation saves")
flags.DEFINE_bool("inference", False, "print the serving memory table instead of the step")
flags.DEFINE_multi_integer("context", [8192, 131072], "serving context(s) in tokens")
flags.DEFINE_float("device_gb", 80.0, "device memory for the largest batch, GB (1e9 bytes)")
flags.DEFINE_list("formats", ["bfloat16", "fp8", "nvfp4"], "weight formats")
flags.DEFINE_string("counts_from", None, "a nested checkpoint whose stored counts to use")
FLAGS = flags.FLAGS


def budget_counts(run_config, counts_from: str | None = None) -> dict:
  """{budget: counts}: a nested checkpoint's stored table, or the architecture a router fitted
  to the budgets' targets alone deploys (no weights needed)."""
  from elastic_jax.config import ModelConfig
  from elastic_jax.elastic import deploy
  from elastic_jax.elastic import router as router_lib
  from elastic_jax.training import pipeline
  if counts_from:
    from elastic_jax.io import checkpoint
    return checkpoint.load_metadata(counts_from)["budget_counts"]
  cfg = ModelConfig.from_dict(run_config.model.to_dict())
  rc = pipeline.router_config(run_config, 1)
  router = router_lib.fit_to_budgets(cfg, rc)
  return {n: deploy.deployed_counts(router, cfg, rc, n) for n in cfg.budget_names}


def inference_table(run_config, counts: dict, contexts, formats, device_gb: float) -> str:
  """Markdown: per budget and weight format, weights, caches per sequence and the largest
  batch on one device, at each context (`measures.serving_memory`)."""
  from elastic_jax.config import ModelConfig
  from elastic_jax.elastic import measures
  from elastic_jax.elastic.params_count import count_params
  cfg = ModelConfig.from_dict(run_config.model.to_dict())
  head = " | ".join(f"cache / seq @ {t:,} GB | max batch @ {t:,}" for t in contexts)
  lines = [f"| budget | counts | total params | format | weights GB | {head} |",
           "|---|---|---:|---|---:|" + "---:|---:|" * len(contexts)]
  for name, c in counts.items():
    shown = ", ".join(str(v) for v in c.values())
    total = count_params(cfg, c).total
    for fmt in formats:
      ms = [measures.serving_memory(cfg, c, fmt, t, device_gb * 1e9) for t in contexts]
      cells = " | ".join(f"{m['per_sequence'] / 1e9:.3f} | {m['max_batch']:,}" for m in ms)
      lines.append(f"| {name} | {shown} | {total:,} | {fmt} | {ms[0]['weights'] / 1e9:.2f} | "
                   f"{cells} |")
  return "\n".join(lines)


def plan_elastic_step(run_config, mesh, seq_len: int, batch: int, donate: bool = True):
  """(Memory per device, compile seconds, FLOPs per step) of one elastic KD step, its state
  donated or not."""
  import jax
  import jax.numpy as jnp

  from elastic_jax.config import ModelConfig
  from elastic_jax.elastic import router as router_lib
  from elastic_jax.elastic.params_count import count_params
  from elastic_jax.model.model import param_shapes, to_stack_layout
  from elastic_jax.parallel import plan
  from elastic_jax.parallel import sharding as shd
  from elastic_jax.training import optim, phases, pipeline

  c = run_config
  # The step the elastic phase compiles: experts in its placement (masks permuted to match).
  cfg = ModelConfig.from_dict(c.model.to_dict()).replace(
      expert_placement=c.elastic.expert_placement)
  rules = tuple(map(tuple, c.parallel.rules))
  total = c.elastic.stage1_steps + c.elastic.stage2_steps
  rc = pipeline.router_config(c, total)
  model = jax.eval_shape(lambda p: to_stack_layout(p, cfg), param_shapes(cfg))
  router = jax.eval_shape(lambda k: router_lib.init(cfg, rc, k), jax.random.PRNGKey(0))
  params = {"model": model, "router": router}
  opt = optim.elastic_adamw(total, c.elastic.lr, c.elastic.router_lr, c.elastic.weight_decay,
                            warmup_steps=c.elastic.warmup)
  # The step trains the master weights (fp32 or as stored) and casts them to the stored dtypes.
  stored = params
  params = optim.master_weights(params, c.optim.master)
  psh = phases.elastic_params_sharding(model, router, cfg, mesh, rules)
  state_sh = phases.state_shardings(opt, params, psh, mesh)
  state = plan.abstract({"params": params, "opt": jax.eval_shape(opt.init, params)}, state_sh)
  teacher = plan.abstract(model, psh["model"])
  rows = jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32,
                              sharding=shd.batch_sharding(mesh, rules))
  scalar = lambda dt: jax.ShapeDtypeStruct((), dt, sharding=shd.replicated(mesh))
  loss_fn = phases.elastic_step_loss(cfg, rc, total, moe_impl=c.elastic.moe_impl,
                                     kd_chunk=c.elastic.kd_chunk)
  M = c.elastic.micro_batches
  step = phases.train_step(optim.cast_for_step(loss_fn, stored), opt,
                           (state_sh, shd.replicated(mesh)), donate=donate, micro_batches=M,
                           per_micro=phases.ELASTIC_PER_MICRO)
  budgets = jax.ShapeDtypeStruct((M,), jnp.int32, sharding=shd.replicated(mesh))
  keys = jax.eval_shape(lambda: phases.micro_keys(jax.random.PRNGKey(0), 0, M))
  with shd.activation_context(mesh, rules):
    compiled, seconds = plan.compile_aot(step, state, rows, teacher, budgets, scalar(jnp.int32),
                                         plan.abstract(keys, shd.replicated(mesh)))
  return plan.memory_of(compiled), seconds, step_flops(cfg, count_params(cfg).active, batch,
                                                       seq_len)


def step_flops(cfg, active_params: int, batch: int, seq_len: int) -> float:
  """Analytic FLOPs of one elastic step: student forward + backward (6 N per token) and
  teacher forward (2 N per token) over the active params, plus causal attention scores and
  values (4 T d per token per attention layer forward, x3 for the student's backward).
  The student at the full budget: masked budgets compute at full width."""
  tokens = batch * seq_len
  n_attn = cfg.layer_pattern.count("*")
  attn = 4 * seq_len * cfg.num_attention_heads * cfg.head_dim * n_attn / 2  # causal half
  return tokens * (8 * active_params + 4 * attn)


def topology_devices(name: str) -> list:
  """The devices of TPU topology `name` (e.g. "v5p:4x4x4"), compile-only, from libtpu; one-line
  errors without libtpu or for a name it does not know."""
  from jax.experimental import topologies
  try:
    return list(topologies.get_topology_desc(topology_name=name, platform="tpu").devices)
  except RuntimeError as e:
    if "not installed" in str(e):
      raise ValueError("--topology needs libtpu: pip install 'jax[tpu]' (in its own "
                       "environment; no TPU is needed)") from None
    raise ValueError(f"--topology={name}: {str(e).splitlines()[0]}") from None


def check_flags() -> None:
  """One-line errors for flag values the plan cannot use, before any work."""
  from elastic_jax.elastic.params_count import BYTES_PER_ELEMENT
  for name in ("devices", "batch", "seq_len"):
    v = getattr(FLAGS, name)
    if v is not None and v < 1:
      raise ValueError(f"--{name} must be >= 1, got {v}")
  bad = [t for t in FLAGS.context if t < 1]
  if bad:
    raise ValueError(f"--context must be >= 1 tokens, got {bad}")
  if not FLAGS.device_gb > 0:
    raise ValueError(f"--device_gb must be > 0, got {FLAGS.device_gb}")
  bad = [f for f in FLAGS.formats if f not in BYTES_PER_ELEMENT]
  if bad:
    raise ValueError(f"--formats: {bad} not in {sorted(BYTES_PER_ELEMENT)}")
  for stage in FLAGS.stages:
    if stage not in ("1", "2"):
      raise ValueError(f"--stages: {stage!r} not in ['1', '2']")
  from elastic_jax.parallel.mesh import MESH_AXES
  bad = [a for a in FLAGS.batch_axes or () if a not in MESH_AXES]
  if bad:
    raise ValueError(f"--batch_axes: {bad} not in {list(MESH_AXES)}")


def main(argv):
  del argv
  check_flags()
  if "XLA_FLAGS" not in os.environ or "device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={FLAGS.devices}")
  import jax
  from absl import logging
  logging.set_verbosity(logging.ERROR)   # jax's "no TPU backend" notices
  from elastic_jax.parallel import mesh as mesh_lib
  from elastic_jax.parallel import rules as rules_lib
  from pallas_kernels import platform

  c = cli.config_value(_CONFIG)
  if FLAGS.inference:
    print(f"plan: serving memory on one device of {FLAGS.device_gb:g} GB (weights + KV and "
          "Mamba caches; activations not counted)", flush=True)
    print(inference_table(c, budget_counts(c, FLAGS.counts_from), FLAGS.context,
                          FLAGS.formats, FLAGS.device_gb))
    return
  if FLAGS.moe_impl:
    c.elastic.moe_impl = FLAGS.moe_impl
  if FLAGS.batch_axes:
    c.parallel.rules = rules_lib.with_batch_axes(c.parallel.rules, FLAGS.batch_axes)
  L1 = FLAGS.seq_len or c.data.seq_len
  B = FLAGS.batch or c.data.batch
  devices, where = jax.devices(), f"{jax.devices()[0].platform} devices"
  target = contextlib.nullcontext
  if FLAGS.topology:
    devices = topology_devices(FLAGS.topology)
    where = f"TPU {FLAGS.topology} ({len(devices)} chips, {devices[0].device_kind})"
    target = lambda: platform.target("tpu")
  meshes = []
  for spec in FLAGS.mesh:
    sizes = mesh_lib.parse_mesh(spec)
    n = len(devices) if -1 in sizes.values() else math.prod(sizes.values())
    if n > len(devices):
      raise ValueError(f"--mesh={spec} needs {n} devices; there are {len(devices)}")
    meshes.append(mesh_lib.make_mesh(sizes, devices[:n]))
  print(f"plan: elastic KD step, global batch {B}, MoE {c.elastic.moe_impl}, kernels "
        f"{c.model.kernels}, master weights {c.optim.master}, state "
        f"{'donated' if FLAGS.donate else 'not donated'}, on {where}; per-device GiB",
        flush=True)
  print("| devices | mesh | stage | seq len | arguments | outputs | temporaries | peak | "
        "TFLOP / step | compile s |")
  print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")
  for mesh in meshes:
    for stage in FLAGS.stages:
      L = L1 if stage == "1" else L1 * c.elastic.stage2_len_mult
      with target():
        print(plan_row(c, mesh, stage, L, B, FLAGS.donate), flush=True)


def plan_row(run_config, mesh, stage: str, seq_len: int, batch: int, donate: bool) -> str:
  """One table row: the step's per-device memory, or, where the compiler itself refuses it
  (XLA:TPU stops when the temporaries exceed the chip's HBM), what it said."""
  import jax
  from elastic_jax.parallel import mesh as mesh_lib
  head = f"| {mesh.size} | {mesh_lib.describe(mesh)} | {stage} | {seq_len:,} |"
  try:
    mem, seconds, flops = plan_elastic_step(run_config, mesh, seq_len, batch, donate)
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    found = re.search(r"temporaries \(([\d.]+G)\) exceeds available HBM \(([\d.]+G)\)", str(e))
    why = (f"temporaries {found[1]} > HBM {found[2]}" if found else
           str(e).splitlines()[0][:120])
    return f"{head} - | - | - | does not fit ({why}) | - | - |"
  g = mem.gib()
  return (f"{head} {g['arguments']:.3f} | {g['outputs']:.3f} | {g['temporaries']:.3f} | "
          f"{g['peak']:.3f} | {flops / 1e12:,.1f} | {seconds:.0f} |")

if __name__ == "__main__":
  cli.run(main)
