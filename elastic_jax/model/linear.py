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
  return jnp.einsum(spec, x.astype(dtype), w.astype(dtype))
