"""`QTensor`: one quantized weight that slices like the float weight it stands for.

A QTensor sits in a params tree where the float leaf was. It reports the float leaf's `shape`
and takes the same prefix slices (`q[:a, :b]`), applied to its packed codes and block scales
(the block axis in units of 2 and 16), so `slicing.slice_params` cuts a quantized parent into a
quantized sub-model with no code of its own, and dequant(slice(q)) == slice(dequant(q)) exactly:
a budget is a prefix of the parent's codes and scales, never a re-quantization.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from elastic_jax.quant import formats

FORMATS = ("fp8", "nvfp4")


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["codes", "block_scale", "global_scale"],
                   meta_fields=["fmt", "axis", "dtype"])
@dataclasses.dataclass(frozen=True)
class QTensor:
  """fp8: `codes` float8_e4m3fn (the float shape), `block_scale` None, `global_scale` the
  per-tensor scale. nvfp4: `codes` uint8 (two per byte along `axis`), `block_scale`
  float8_e4m3fn (one per 16 along `axis`), `global_scale` f32 []. `dtype`: the float leaf's."""
  codes: jax.Array
  block_scale: jax.Array | None
  global_scale: jax.Array
  fmt: str
  axis: int
  dtype: str

  @property
  def shape(self) -> tuple[int, ...]:
    s = list(self.codes.shape)
    if self.fmt == "nvfp4":
      s[self.axis] *= 2
    return tuple(s)

  @property
  def ndim(self) -> int:
    return len(self.codes.shape)

  def __getitem__(self, index) -> "QTensor":
    """Prefix slices only (`slice(0, n)` or `slice(None)` per dim), as nesting cuts."""
    index = index if isinstance(index, tuple) else (index,)
    stops = []
    for d, (s, size) in enumerate(zip(index + (slice(None),) * (self.ndim - len(index)),
                                      self.shape)):
      if not isinstance(s, slice) or s.start not in (None, 0) or s.step not in (None, 1):
        raise IndexError(f"QTensor takes prefix slices only, got {s!r} on dim {d}")
      stops.append(size if s.stop is None else min(s.stop, size))
    if self.fmt == "fp8":
      return dataclasses.replace(self, codes=self.codes[tuple(slice(0, n) for n in stops)])
    n = stops[self.axis]
    if n % formats.BLOCK:
      raise ValueError(f"nvfp4: a slice to {n} on the block axis (dim {self.axis} of "
                       f"{self.shape}) is not a multiple of {formats.BLOCK}")
    cut = lambda div: tuple(slice(0, m // div if d == self.axis else m)
                            for d, m in enumerate(stops))
    return dataclasses.replace(self, codes=self.codes[cut(2)],
                               block_scale=self.block_scale[cut(formats.BLOCK)])

  def einsum(self, spec: str, x, dtype) -> jax.Array:
    """`jnp.einsum(spec, x, weight)` in `dtype`: an FP8 matmul for fp8 (`formats.fp8_einsum`:
    x quantized per row on the fly, f32 accumulation); nvfp4 dequantizes first."""
    if self.fmt == "fp8":
      return formats.fp8_einsum(spec, x, self.codes, self.global_scale).astype(dtype)
    return jnp.einsum(spec, x.astype(dtype), self.dequantize(dtype))

  def dequantize(self, dtype=None) -> jax.Array:
    dtype = dtype or self.dtype
    if self.fmt == "fp8":
      return formats.fp8_dequantize(self.codes, self.global_scale, dtype)
    return formats.nvfp4_dequantize(self.codes, self.block_scale, self.global_scale, self.axis,
                                    dtype)


def quantize(w, fmt: str, axis: int = 0, amax=None) -> QTensor:
  """`w` as a QTensor in `fmt` ("fp8" | "nvfp4"; nvfp4 blocks of 16 along `axis`); `amax`
  (default: `w`'s) sets the global scale."""
  dtype = jnp.dtype(w.dtype).name
  if fmt == "fp8":
    codes, scale = formats.fp8_quantize(w, amax)
    return QTensor(codes, None, scale, "fp8", axis, dtype)
  if fmt == "nvfp4":
    return QTensor(*formats.nvfp4_quantize(w, axis, amax), "nvfp4", axis % w.ndim, dtype)
  raise ValueError(f"quant format {fmt!r}: expected one of {', '.join(FORMATS)}")


def is_qtensor(x) -> bool:
  return isinstance(x, QTensor)


def abstract(shape, fmt: str, axis: int, dtype: str) -> QTensor:
  """The QTensor of ShapeDtypeStructs that `quantize` gives a float weight of `shape` (what a
  checkpoint restore asks Orbax for)."""
  shape = tuple(int(n) for n in shape)
  sds = jax.ShapeDtypeStruct
  scale = sds((), jnp.float32)
  if fmt == "fp8":
    return QTensor(sds(shape, jnp.float8_e4m3fn), None, scale, fmt, axis, dtype)
  if fmt != "nvfp4":
    raise ValueError(f"quant format {fmt!r}: expected one of {', '.join(FORMATS)}")
  if shape[axis] % formats.BLOCK:
    raise ValueError(f"nvfp4: block axis {axis} of shape {shape} is not a multiple of "
                     f"{formats.BLOCK}")
  div = lambda k: tuple(n // k if d == axis else n for d, n in enumerate(shape))
  return QTensor(sds(div(2), jnp.uint8), sds(div(formats.BLOCK), jnp.float8_e4m3fn), scale,
                 fmt, axis, dtype)


def describe(q: QTensor) -> dict:
  """What a checkpoint records of a quantized leaf to restore any prefix of it (`abstract`)."""
  return {"fmt": q.fmt, "axis": q.axis, "dtype": q.dtype}


def component_shapes(q: QTensor, float_shape) -> dict[str, tuple]:
  """{component: its shape} of the prefix of `q` that stands for a float prefix `float_shape`."""
  a = abstract(float_shape, q.fmt, q.axis, q.dtype)
  return {k: tuple(getattr(a, k).shape) for k in ("codes", "block_scale", "global_scale")
          if getattr(a, k) is not None}
