"""FP8 (E4M3, one per-tensor scale) and NVFP4 (E2M1 in blocks of 16) numerics, as ModelOpt does.

NVFP4 (METHOD.md section 6): along the block axis, every 16 consecutive values share an E4M3
block scale `block_amax / (6 * global)`, where the FP32 `global = amax / (6 * 448)` is one per
tensor; values are `x / (block_scale * global)` rounded to nearest-even on the E2M1 grid
(0, .5, 1, 1.5, 2, 3, 4, 6; saturating) and two 4-bit codes share a uint8 (the even element in
the low nibble, sign in bit 3). Everything is plain jnp (no float4 dtype needed on the backend);
ml_dtypes' `float4_e2m1fn` is the independent reference in the tests.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 16                    # NVFP4 values per block scale
E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)   # magnitude of codes 0..7


def _amax(x):
  return jnp.max(jnp.abs(x.astype(jnp.float32)))


def fp8_quantize(w, amax=None):
  """(codes float8_e4m3fn [w.shape], scale f32 []): w ~= codes * scale, scale = amax / 448.
  `amax`: the tensor's own by default; a larger one shared with other weights (one scale for
  the projections a serving engine fuses) is allowed."""
  amax = _amax(w) if amax is None else jnp.asarray(amax, jnp.float32)
  scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0).astype(jnp.float32)
  codes = jnp.clip(w.astype(jnp.float32) / scale, -E4M3_MAX, E4M3_MAX)
  return codes.astype(jnp.float8_e4m3fn), scale


def fp8_dequantize(codes, scale, dtype=jnp.float32):
  return (codes.astype(jnp.float32) * scale).astype(dtype)


def fp8_einsum(spec: str, x, codes, w_scale):
  """`jnp.einsum(spec, x, w)` in f32 for the FP8 weight w = codes * w_scale, as an FP8 matmul:
  x is quantized too, one E4M3 scale per row (amax over its contracted dims / 448, computed on
  the fly), both operands enter the dot as float8_e4m3fn with f32 accumulation
  (`preferred_element_type`), and the product is rescaled by x's row scale times w_scale. The
  backend runs it natively where it has FP8 matmuls (Hopper / Ada GPUs); elsewhere XLA
  converts. `spec`: explicit subscripts, no ellipsis."""
  ins, out = spec.replace(" ", "").split("->")
  xs, _ = ins.split(",")
  if "." in spec or len(xs) != x.ndim:
    raise ValueError(f"fp8_einsum takes explicit subscripts for x of rank {x.ndim}, got {spec!r}")
  x32 = x.astype(jnp.float32)
  contracted = tuple(i for i, c in enumerate(xs) if c not in out)
  amax = jnp.max(jnp.abs(x32), axis=contracted, keepdims=True)
  scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
  xq = jnp.clip(x32 / scale, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
  y = jnp.einsum(spec, xq, codes, preferred_element_type=jnp.float32)
  # The row scale, laid out along `out` (size 1 on the weight's own dims).
  kept = "".join(c for c in xs if c in out)
  order = "".join(c for c in out if c in kept)
  s = jnp.einsum(f"{kept}->{order}", jnp.squeeze(scale, contracted))
  s = s.reshape([s.shape[order.index(c)] if c in order else 1 for c in out])
  return y * (s * w_scale)


def e2m1_encode(y):
  """4-bit E2M1 codes (uint8 0..15) of f32 `y`: round to nearest, ties to the even code, |y|
  saturating at 6. The grid's spacing is 0.5 below 2, 1 below 4 and 2 up to 6, so each range
  is a scaled round-half-even (jnp.round) whose even integers are the even codes."""
  m = jnp.minimum(jnp.abs(y), E2M1_MAX)
  mag = jnp.where(m < 2, jnp.round(2 * m), jnp.where(m < 4, jnp.round(m) + 2, jnp.round(m / 2) + 4))
  sign = (y < 0) & (mag > 0)
  return (mag.astype(jnp.uint8) | (sign.astype(jnp.uint8) << 3)).astype(jnp.uint8)


def e2m1_decode(codes):
  """f32 values of 4-bit E2M1 codes."""
  mag = jnp.asarray(E2M1_VALUES, jnp.float32)[(codes & 7).astype(jnp.int32)]
  return jnp.where(codes & 8, -mag, mag)


def pack_nibbles(codes):
  """[..., n] 4-bit codes (n even) -> [..., n / 2] uint8, element 2i in the low nibble."""
  return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(jnp.uint8)


def unpack_nibbles(packed):
  """Inverse of `pack_nibbles`."""
  lo, hi = packed & 0xF, packed >> 4
  return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def nvfp4_quantize(w, axis: int, amax=None):
  """(packed uint8, block_scale float8_e4m3fn, global f32 []) of `w`, blocks of 16 along `axis`.

  `packed` is `w`'s shape with `axis` halved, `block_scale` with `axis` divided by 16, so a
  prefix of `axis` (a multiple of 16) is a prefix of both. `amax` (default: `w`'s) sets the
  global scale; weights fused at serving time share one (`quant.tree.SHARED_SCALE`)."""
  n = w.shape[axis]
  if n % BLOCK:
    raise ValueError(f"nvfp4: block axis {axis} of shape {tuple(w.shape)} is not a multiple of "
                     f"{BLOCK}")
  x = jnp.moveaxis(w.astype(jnp.float32), axis, -1)
  amax = _amax(x) if amax is None else jnp.asarray(amax, jnp.float32)
  global_scale = jnp.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), 1.0).astype(jnp.float32)
  xb = x.reshape(*x.shape[:-1], n // BLOCK, BLOCK)
  block_amax = jnp.max(jnp.abs(xb), axis=-1)
  block_scale = jnp.clip(block_amax / (E2M1_MAX * global_scale), 0, E4M3_MAX)
  block_scale = block_scale.astype(jnp.float8_e4m3fn)
  step = block_scale.astype(jnp.float32)[..., None] * global_scale
  y = jnp.where(step > 0, xb / jnp.where(step > 0, step, 1.0), 0.0)
  codes = e2m1_encode(y).reshape(x.shape)
  return (jnp.moveaxis(pack_nibbles(codes), -1, axis), jnp.moveaxis(block_scale, -1, axis),
          global_scale)


def nvfp4_dequantize(packed, block_scale, global_scale, axis: int, dtype=jnp.float32):
  """The values `nvfp4_quantize` encodes: code * (block_scale * global), in `dtype`."""
  codes = unpack_nibbles(jnp.moveaxis(packed, axis, -1))
  vals = e2m1_decode(codes)
  vals = vals.reshape(*vals.shape[:-1], vals.shape[-1] // BLOCK, BLOCK)
  step = jnp.moveaxis(block_scale, axis, -1).astype(jnp.float32)[..., None] * global_scale
  out = (vals * step).reshape(*codes.shape)
  return jnp.moveaxis(out, -1, axis).astype(dtype)


@jax.custom_vjp
def _identity_grad(w, wq):
  return wq


def _fwd(w, wq):
  return wq, None


def _bwd(_, g):
  return g, None


_identity_grad.defvjp(_fwd, _bwd)


def fake_quant(w, fmt: str, axis: int = 0, amax=None):
  """The dequantized value of `w` in `fmt` ("fp8" | "nvfp4"), with the straight-through
  gradient: d/dw is the identity (the value is exactly `dequantize(quantize(w, amax))`)."""
  if fmt == "fp8":
    wq = fp8_dequantize(*fp8_quantize(w, amax), dtype=w.dtype)
  elif fmt == "nvfp4":
    wq = nvfp4_dequantize(*nvfp4_quantize(w, axis, amax), axis=axis, dtype=w.dtype)
  else:
    raise ValueError(f"quant format {fmt!r}: expected one of fp8, nvfp4")
  return _identity_grad(w, jax.lax.stop_gradient(wq))
