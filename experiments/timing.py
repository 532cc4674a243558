"""Timing helpers the benchmarks share: the median time of a jitted call and this device's
measured matmul rate (the peak that utilization figures are fractions of)."""
from __future__ import annotations

import time


def median_time(fn, *args, iters: int) -> float:
  """Median seconds of `fn(*args)` after one compile-and-run."""
  import jax
  import numpy as np
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def matmul_peak(dtype, n: int, iters: int) -> float:
  """Measured TFLOP/s of one [n, n] x [n, n] matmul in `dtype`."""
  import jax
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n)).astype(dtype)
  f = jax.jit(lambda a: a @ a)
  return 2 * n ** 3 / median_time(f, a, iters=iters) / 1e12
