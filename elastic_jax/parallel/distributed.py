"""Multi-process runs: `jax.distributed.initialize` from flags or the cluster's environment, and
the helpers that make process-local data global.

  python -m elastic_jax.train --coordinator_address=10.0.0.1:1234 --num_processes=4 \\
      --process_id=$RANK --config.parallel.mesh=fsdp:-1

On TPU pods and SLURM jobs `initialize(auto=True)` lets jax read the cluster's environment.
On CPU the cross-process collectives go through gloo.
"""
from __future__ import annotations

import json
import os

import jax
import numpy as np


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, auto: bool = False) -> bool:
  """Joins the job's processes; True when this is a multi-process run. With no address and
  `auto`, initializes only where jax can detect a cluster (SLURM, a TPU pod)."""
  given = [coordinator_address is not None, num_processes is not None, process_id is not None]
  if any(given) and not all(given):
    raise ValueError("multi-process: give all of --coordinator_address, --num_processes and "
                     "--process_id, or none of them")
  detected = auto and ("SLURM_JOB_ID" in os.environ or "TPU_WORKER_HOSTNAMES" in os.environ)
  if not all(given) and not detected:
    return False
  if all(given) and not 0 <= process_id < num_processes:
    raise ValueError(f"--process_id {process_id} not in [0, {num_processes})")
  if all(given) and _platform_is_cpu():
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address, num_processes, process_id)
  return jax.process_count() > 1


def _platform_is_cpu() -> bool:
  platforms = os.environ.get("JAX_PLATFORMS", "")
  return platforms == "cpu" or (not platforms and not _has_accelerator_plugin())


def _has_accelerator_plugin() -> bool:
  import importlib.util
  return any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin",
                                                   "libtpu"))


def allgather_json(value) -> list:
  """`value` (JSON-serialisable) from every process, in process order."""
  if jax.process_count() == 1:
    return [value]
  from jax.experimental import multihost_utils
  raw = np.frombuffer(json.dumps(value).encode(), np.uint8)
  sizes = multihost_utils.process_allgather(np.asarray([raw.size], np.int32)).reshape(-1)
  n = int(sizes.max())
  padded = np.zeros(n, np.uint8)
  padded[:raw.size] = raw
  rows = multihost_utils.process_allgather(padded).reshape(len(sizes), n)
  return [json.loads(bytes(r[:s]).decode()) for r, s in zip(rows, sizes)]
