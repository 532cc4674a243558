"""The AOT plan: the real elastic step compiled from ShapeDtypeStructs on a mesh; sharding
shows in XLA's per-device memory; the CLI prints the table on 64 fake devices."""
import importlib.util
import os
import re
import subprocess
import sys

import jax
import pytest

from configs import tiny
from conftest import xla_flags
from elastic_jax import plan as plan_cli
from elastic_jax.parallel import mesh as M


@pytest.fixture(scope="module")
def run_config():
  c = tiny.get_config()
  c.elastic.stage1_steps, c.elastic.stage2_steps = 10, 5
  return c


def test_sharding_divides_per_device_memory(run_config):
  one, _, flops = plan_cli.plan_elastic_step(run_config, M.make_mesh("fsdp:1", jax.devices()[:1]),
                                             32, 8)
  eight, seconds, _ = plan_cli.plan_elastic_step(run_config, M.make_mesh("fsdp:2,tensor:2,expert:2"),
                                                 32, 8)
  # State (params, teacher, AdamW moments) is nearly all sharded 8 ways; the small router and
  # the optimizer's step counts stay replicated.
  assert eight.arguments < 0.25 * one.arguments, (eight, one)   # 0.20 measured, 1/8 ideal
  assert eight.peak < 0.4 * one.peak and seconds > 0
  assert flops > 8 * 256 * 1e5      # 8 x active params (> 1e5 for tiny) x 256 tokens


def test_plan_cli_on_64_devices(tmp_path):
  r = subprocess.run([sys.executable, "-m", "elastic_jax.plan", "--config=configs/tiny.py",
                      "--devices=64", "--mesh=fsdp:4,tensor:4,expert:4", "--mesh=fsdp:8",
                      "--batch=64", "--stages=1"], capture_output=True, text=True, timeout=600,
                     env={**os.environ, "XLA_FLAGS": xla_flags(64)})
  assert r.returncode == 0, r.stderr[-3000:]
  rows = [[x.strip() for x in l.split("|")[1:-1]] for l in r.stdout.splitlines()
          if re.match(r"\| \d+ \|", l)]
  assert [row[:3] for row in rows] == [["64", "data:1,fsdp:4,tensor:4,expert:4", "1"],
                                       ["8", "data:1,fsdp:8,tensor:1,expert:1", "1"]]
  peak = [float(row[7]) for row in rows]
  assert 0 < peak[0] < peak[1] < 0.2, rows   # tiny: under 200 MiB; 64 devices hold less than 8


def test_plan_compiles_the_configured_moe_dispatch(run_config):
  """config.elastic.moe_impl reaches the compiled step: the gather dispatch (per-token expert
  weights) needs more temporaries than the dense one at the same shapes."""
  mesh = M.make_mesh("fsdp:1", jax.devices()[:1])
  dense, _, _ = plan_cli.plan_elastic_step(run_config, mesh, 32, 8)
  c = run_config.copy_and_resolve_references()
  c.elastic.moe_impl = "gather"
  gather, _, _ = plan_cli.plan_elastic_step(c, mesh, 32, 8)
  assert gather.temporaries > 1.5 * dense.temporaries, (gather, dense)


def test_plan_inference_table(tmp_path):
  """--inference: per budget and weight format, the serving memory (`measures.serving_memory`)
  of the counts a router fitted to the budgets' targets deploys, and of a checkpoint's counts."""
  from elastic_jax import count_params
  from elastic_jax.config import ModelConfig
  from elastic_jax.elastic import measures
  r = subprocess.run([sys.executable, "-m", "elastic_jax.plan", "--config=configs/tiny.py",
                      "--inference", "--context=512", "--device_gb=0.01"],
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  rows = [[x.strip() for x in l.split("|")[1:-1]] for l in r.stdout.splitlines()
          if re.match(r"\| (full|medium|small) \|", l)]
  c = tiny.get_config()
  cfg = ModelConfig.from_dict(c.model.to_dict())
  assert [(row[0], row[3]) for row in rows] == [
      (b, f) for b in ("full", "medium", "small") for f in ("bfloat16", "fp8", "nvfp4")]
  for row in rows:
    counts = dict(zip(("hidden", "mamba_heads", "moe_experts", "moe_ffn"),
                      map(int, row[1].split(", "))))
    ratio = count_params(cfg, counts).active / count_params(cfg).active
    assert abs(ratio / cfg.budget_fraction(row[0]) - 1) <= 0.05, row   # deployed in band
    m = measures.serving_memory(cfg, counts, row[3], 512, 0.01e9)
    assert row[6] == f"{m['max_batch']:,}" and m["max_batch"] > 0
  table = plan_cli.inference_table(c, {"full": {"hidden": 96, "mamba_heads": 8, "moe_experts": 8,
                                                "moe_ffn": 96}}, [512], ["fp8"], 0.01)
  assert table.splitlines()[-1].startswith("| full | 96, 8, 8, 96 | 924,288 | fp8 |")


@pytest.mark.parametrize("flags, message", [
    (["--devices=0"], "--devices must be >= 1, got 0"),
    (["--inference", "--context=-5"], "--context must be >= 1 tokens, got [-5]"),
    (["--inference", "--formats=int3"], "--formats: ['int3'] not in "),
    (["--inference", "--device_gb=0"], "--device_gb must be > 0, got 0.0"),
    (["--config=/nonexistent.py"], "--config: [Errno 2] No such file or directory"),
    (["--mesh=fsdp:128"], "--mesh=fsdp:128 needs 128 devices; there are "),
    (["--batch_axes=data,pipe"],
     "--batch_axes: ['pipe'] not in ['data', 'fsdp', 'tensor', 'expert']"),
    pytest.param(["--topology=v5p:2x2x1"], "--topology needs libtpu: pip install 'jax[tpu]'",
                 marks=pytest.mark.skipif(importlib.util.find_spec("libtpu") is not None,
                                          reason="libtpu is installed here")),
])
def test_plan_cli_bad_flags_are_one_line(flags, message):
  r = subprocess.run([sys.executable, "-m", "elastic_jax.plan", "--config=configs/tiny.py",
                      *flags], capture_output=True, text=True, timeout=300)
  lines = [l for l in r.stderr.splitlines() if not l.startswith(("W", "I"))]
  assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith(f"error: {message}"), \
      r.stderr[-2000:]


def test_a_plan_for_another_platform_compiles_that_platforms_paths(cfg, params):
  """Under `platform.target` (what `plan --topology` sets) every choice by platform follows the
  target, not this CPU host: the MoE's grouped matmul lowered for TPU is XLA's ragged_dot there
  (the CPU's tiled loop otherwise), and the ragged all-to-all is not emulated."""
  import jax.numpy as jnp
  from elastic_jax.inference import generate
  from elastic_jax.model import moe as moe_lib
  from elastic_jax.model import moe_parallel
  from pallas_kernels import gmm, platform, ssd
  assert platform.current() == "cpu" and moe_parallel.emulate_ragged()
  assert (gmm.xla_backend(), generate.resolve_matmul("auto")) == ("tiled", "dequant")
  with platform.target("tpu"):
    assert platform.current() == "tpu" and not moe_parallel.emulate_ragged()
    assert (gmm.xla_backend(), gmm.pallas_backend(), ssd.default_backend()) == (
        "xla", "megablox", "tpu")
  with platform.target("gpu"):
    assert (gmm.xla_backend(), generate.resolve_matmul("auto")) == ("xla", "fp8")
  assert platform.current() == "cpu"
  with pytest.raises(ValueError, match="platform must be one of"):
    with platform.target("cuda"):
      pass
  p = params["layers"][str(cfg.layer_pattern.index("E"))]["mixer"]
  x = jnp.ones((2, 8, cfg.hidden_size))

  def lowered():
    f = lambda p, x: jnp.sum(moe_lib.moe(p, x, cfg, impl="ragged")[0])
    return jax.jit(jax.grad(f)).trace(p, x).lower(lowering_platforms=("tpu",)).as_text()

  with platform.target("tpu"):
    assert "ragged_dot" in lowered()
  assert "ragged_dot" not in lowered()


def test_batch_axes_replace_only_the_batch_rule():
  from elastic_jax.parallel.rules import DEFAULT_RULES, with_batch_axes
  rules = with_batch_axes(DEFAULT_RULES, ["data", "fsdp", "expert"])
  assert rules[0] == ("batch", ("data", "fsdp", "expert"))
  assert rules[1:] == tuple(map(tuple, DEFAULT_RULES))[1:]


def test_a_step_the_compiler_refuses_is_a_row_saying_why(run_config, monkeypatch):
  """XLA:TPU refuses to compile a step whose temporaries exceed the chip's HBM: the plan prints
  that as the mesh's row (what the compiler said) and goes on; other errors still raise."""
  mesh = M.make_mesh("fsdp:1", jax.devices()[:1])
  refuse = jax.errors.JaxRuntimeError(
      "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
      "temporaries (116.86G) exceeds available HBM (95.74G).")

  def raises(e):
    def f(*a, **k):
      raise e
    return f

  monkeypatch.setattr(plan_cli, "plan_elastic_step", raises(refuse))
  assert plan_cli.plan_row(run_config, mesh, "2", 64, 8, True) == (
      "| 1 | data:1,fsdp:1,tensor:1,expert:1 | 2 | 64 | - | - | - | does not fit "
      "(temporaries 116.86G > HBM 95.74G) | - | - |")
  monkeypatch.setattr(plan_cli, "plan_elastic_step",
                      raises(jax.errors.JaxRuntimeError("INTERNAL: something else")))
  with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):
    plan_cli.plan_row(run_config, mesh, "2", 64, 8, True)
