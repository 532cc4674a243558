"""Shared tiny shapes so the suite compiles few programs; 8 host devices for mesh tests."""
import os
import re
import subprocess
import sys

# Compile time dominates the suite on CPU (tiny shapes), so XLA compiles with LLVM's optimizer off
# and the older CPU fusion emitters: the test-sized main job's XLA compile time 82 -> 47 s, its
# run 125 -> 97 s cold (2 cores), and no slower warm. Checked once (a child process) so a jax
# that no longer knows a flag runs the suite with the device count alone.
DEVICES_FLAG = "--xla_force_host_platform_device_count=8"
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def _flags_work(flags: str) -> bool:
  env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
  r = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                     capture_output=True, timeout=120)
  return r.returncode == 0


if "XLA_FLAGS" not in os.environ:   # set once (the xdist controller); workers inherit it
  fast = f"{DEVICES_FLAG} {FAST_COMPILE_FLAGS}"
  os.environ["XLA_FLAGS"] = fast if _flags_work(fast) else DEVICES_FLAG


def xla_flags(devices: int) -> str:
  """This session's XLA_FLAGS with `devices` host devices instead (for child processes)."""
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ["XLA_FLAGS"])
  return f"--xla_force_host_platform_device_count={devices} {flags.strip()}".strip()

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Programs compiled by one test (or its subprocesses: the train / experiment CLIs) are reused by
# the next ones with the same shapes.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "xla"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # tracing dominates on CPU
# The xdist workers and the CLIs' child processes start with glibc's malloc on huge pages, as
# the CLIs restart themselves to run (`host_memory`); so the children need no restart.
from elastic_jax import host_memory  # noqa: E402

_huge = host_memory.huge_pages_environ(os.environ)
if _huge is not None:
  os.environ["GLIBC_TUNABLES"] = _huge["GLIBC_TUNABLES"]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from elastic_jax import ModelConfig, init  # noqa: E402

# All four block kinds; chunk 4 so sequences of 13 tokens span several SSD chunks.
CFG = ModelConfig(
    layer_pattern="M*E-ME", hidden_size=32, vocab_size=64,
    num_attention_heads=4, num_kv_heads=2, head_dim=8,
    mamba_num_heads=8, mamba_head_dim=4, ssm_state_size=8, mamba_n_groups=2, conv_kernel=4,
    chunk_size=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=24, routed_scaling_factor=2.5, intermediate_size=24,
    initializer_range=0.2,
    hidden_choices=(32, 24, 16), mamba_head_choices=(8, 6, 4, 2), expert_choices=(8, 6, 4),
    moe_ffn_choices=(16, 12, 8), budgets=(("full", 1.0), ("small", 0.5)),
)


@jax.jit
def perturb(params, key):
  """Random non-default values for norms, A_log, D, dt_bias and the router correction bias."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  keys = jax.random.split(key, len(leaves))
  out = []
  for (path, x), k in zip(leaves, keys):
    name = jax.tree_util.keystr(path)
    noise = jax.random.normal(k, x.shape, jnp.float32)
    if "norm" in name or "'D'" in name:
      x = (1.0 + 0.5 * noise).astype(x.dtype)
    elif "A_log" in name:
      x = (x + 0.3 * noise).astype(x.dtype)
    elif "router_bias" in name:
      x = (0.3 * noise).astype(x.dtype)
    out.append(x)
  return jax.tree_util.tree_unflatten(treedef, out)


# The same shapes with the axes beyond the paper elastic too (query heads per KV group, Mamba
# head-dim channels, depth): `params` serve both.
CFG_X = CFG.replace(attention_head_choices=(4, 2), mamba_head_dim_choices=(4, 3, 2),
                    depth_choices=(6, 5, 4))


@pytest.fixture(scope="session")
def cfg():
  return CFG


@pytest.fixture(scope="session")
def cfg_x():
  return CFG_X


@pytest.fixture(scope="session")
def params():
  return perturb(init(CFG, jax.random.PRNGKey(0)), jax.random.PRNGKey(1))


@pytest.fixture(scope="session")
def tokens():
  return jnp.asarray(np.random.RandomState(0).randint(0, CFG.vocab_size, (2, 13)), jnp.int32)


# `pytest` runs on 2 workers (pytest-xdist, `--dist loadfile`: a file's tests share one
# worker, its module fixtures and compiled programs). Files are handed out in collection
# order, so the longest go first (measured serially at 03b8ce4, cold XLA cache: test_parallel
# and test_train about 12 minutes each, the rest under 4) and the short ones fill the gaps.
_LONGEST_FIRST = ("test_parallel", "test_train", "test_quant", "test_phases", "test_modules",
                  "test_router", "test_plan", "test_distill", "test_budget_control",
                  "test_modelopt")


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))   # stable: file order kept


@pytest.fixture(scope="module", autouse=True)
def _drop_compiled_programs():
  """Each file's compiled programs leave with it (a worker's memory grew past 11 GB over the
  whole suite otherwise); the persistent compilation cache still serves later compiles."""
  yield
  jax.clear_caches()
