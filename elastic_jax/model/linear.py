"""The projections of the residual stream, through one function so that a weight may compute
its own product: a quantized weight (`quant.qtensor.QTensor`, duck-typed: anything with an
`einsum(spec, x, dtype)` method) runs its low-precision matmul where a float weight is cast
to the compute dtype and multiplied.

`FP8_MATMUL_LEAVES` are the weights whose every use goes through `einsum` here (attention,
Mamba and shared-expert projections); generation keeps those packed when it runs FP8 matmuls
(`inference.generate`). Routed experts (gathered or grouped per expert) and the dense MLP are
not among them: their quantized weights are dequantized first.
"""
from __future__ import annotations

import jax.numpy as jnp

FP8_MATMUL_LEAVES = ("q", "k", "v", "o", "in_z", "in_x", "in_B", "in_C", "in_dt", "out_proj",
                     "shared_up", "shared_down")


def einsum(spec: str, x, w, dtype):
  """`jnp.einsum(spec, x, w)` in `dtype`, or the weight's own product if it has one."""
  own = getattr(w, "einsum", None)
  if own is not None:
    return own(spec, x, dtype)
  return rows_einsum(spec, x.astype(dtype), w.astype(dtype))


def rows_einsum(spec: str, x, w, **kwargs):
  """`jnp.einsum(spec, x, w, **kwargs)` with x's leading batch dims (those that lead x and the
  output alike and that w lacks: [B, T] of "btd,...") merged into one row dim around it.

  The same product, but its weight gradient contracts one dim instead of two: XLA:CPU runs a
  dot_general contracting [B, T] 2-2.4x slower than the 2-D matmul (measured at [4, 256, 96]
  by [96, K]: K 1024 10.3 against 4.3 ms, K 328 2.8 against 1.3, forward equal). Only major
  dims merge, so a batch sharding carries over to the rows."""
  ins, out = spec.replace(" ", "").split("->")
  xs, ws = ins.split(",")
  n = 0
  while n < min(len(xs), len(out)) and xs[n] == out[n] and xs[n] not in ws and xs[n] != ".":
    n += 1
  if n < 2:
    return jnp.einsum(spec, x, w, **kwargs)
  row = next(c for c in "ZYXWVUTSRQPONMLKJIHGFEDCBA" if c not in spec)
  y = jnp.einsum(f"{row}{xs[n:]},{ws}->{row}{out[n:]}", x.reshape((-1,) + x.shape[n:]), w,
                 **kwargs)
  return y.reshape(x.shape[:n] + y.shape[1:])
