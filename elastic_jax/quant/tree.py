"""Which params are quantized and how: a whole params tree to QTensors, back, or fake-quantized.

A leaf is chosen by its name (the last key: "up", "out_proj", "lm_head", ...; `DEFAULT_LEAVES`
are the expert, MLP, Mamba and attention projections, as ModelOpt's NVFP4 recipes quantize).
Embeddings, norms, the MoE router, convs and A_log / D / dt_bias stay in high precision unless
listed. NVFP4's block axis is the innermost input (contracted) dim, read off the leaf's logical
axis names: a leaf writing the residual stream ("embed" last: out_proj, o, down) contracts the
dims before it, the innermost being the one just before "embed"; every other projection reads
the residual stream on its "embed" dim. For nesting, that dim and each of its elastic choices
must be a multiple of 16 (`check`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from elastic_jax.config import ModelConfig
from elastic_jax.elastic.axes import map_param_leaves, uses_for
from elastic_jax.model.model import is_scanned, logical_axes, param_shapes, scanned_logical_axes
from elastic_jax.quant import formats
from elastic_jax.quant.qtensor import FORMATS, QTensor, is_qtensor, quantize

DEFAULT_LEAVES = ("q", "k", "v", "o", "in_x", "in_z", "in_B", "in_C", "in_dt", "out_proj",
                  "up", "down", "shared_up", "shared_down")
QUANTIZABLE = DEFAULT_LEAVES + ("router", "lm_head")


@dataclasses.dataclass(frozen=True)
class QuantSpec:
  """`fmt`: "fp8" | "nvfp4"; `leaves`: names of the leaves to quantize; `fp8_leaves`: those of
  them kept in FP8 under an "nvfp4" `fmt` (mixed precision, as NVIDIA ships Nemotron-H: NVFP4
  experts, FP8 attention / Mamba projections)."""
  fmt: str = "nvfp4"
  leaves: tuple[str, ...] = DEFAULT_LEAVES
  fp8_leaves: tuple[str, ...] = ()

  def __post_init__(self):
    if self.fmt not in FORMATS:
      raise ValueError(f"quant format {self.fmt!r}: expected one of {', '.join(FORMATS)}")
    bad = sorted(set(self.leaves) - set(QUANTIZABLE))
    if bad:
      raise ValueError(f"quant leaves {bad} are not matmul weights; quantizable: any of "
                       f"{', '.join(QUANTIZABLE)}")
    stray = sorted(set(self.fp8_leaves) - set(self.leaves))
    if stray:
      raise ValueError(f"quant fp8_leaves {stray} are not among the quantized leaves "
                       f"{list(self.leaves)}")
    # Leaves served as one fused matmul share a scale, so they need one format.
    for group in sorted(set(SHARED_SCALE.values())):
      members = sorted(k for k, g in SHARED_SCALE.items() if g == group and k in self.leaves)
      if len({self.fmt_of(k) for k in members}) > 1:
        raise ValueError(f"quant fp8_leaves: {members} are one fused matmul ({group}) at "
                         "serving time; list all of them or none")

  def fmt_of(self, leaf: str) -> str:
    """The format of the leaf named `leaf`."""
    return "fp8" if leaf in self.fp8_leaves else self.fmt


def mixed_spec(leaves: tuple[str, ...] = DEFAULT_LEAVES) -> QuantSpec:
  """NVIDIA's mixed recipe for Nemotron-H: the routed experts ("up", "down") in NVFP4, every
  other chosen leaf (attention, Mamba, shared-expert projections) in FP8."""
  return QuantSpec("nvfp4", tuple(leaves),
                   tuple(k for k in leaves if k not in ("up", "down")))


def block_axis(names: tuple) -> int:
  """The innermost contracted dim of a weight with logical axis `names` (see module doc)."""
  names = tuple(names)
  if "embed" not in names:
    raise ValueError(f"no 'embed' dim in logical axes {names}: not a projection of the "
                     "residual stream")
  return len(names) - 2 if names[-1] == "embed" and len(names) > 1 else names.index("embed")


def _chosen(spec: QuantSpec, path: tuple) -> bool:
  return path[-1] in spec.leaves


def plan(config: ModelConfig, spec: QuantSpec) -> dict:
  """{(layer or None, path): block axis} of every leaf `spec` quantizes."""
  out = {}
  logical = logical_axes(config)

  def visit(kind, layer, path, names):
    if _chosen(spec, path):
      out[(layer, path)] = block_axis(tuple(names))
    return names

  map_param_leaves(config, logical, visit)
  return out


def check(config: ModelConfig, spec: QuantSpec) -> None:
  """Raises ValueError (one line naming the leaf, dim and sizes) where nvfp4 nesting breaks: a
  block dim, or a size one of its elastic choices gives it, that is not a multiple of 16."""
  shapes = param_shapes(config)
  where = plan(config, spec)

  def visit(kind, layer, path, leaf):
    if (layer, path) not in where or spec.fmt_of(path[-1]) != "nvfp4":
      return leaf
    b = where[(layer, path)]
    sizes = {leaf.shape[b]}
    for axis, use in uses_for(kind, path):
      if use.dim == b:
        sizes |= {int(axis.dim_size(c, config)) for c in axis.choices(config)}
    bad = sorted(s for s in sizes if s % formats.BLOCK)
    if bad:
      name = ".".join(path) if layer is None else f"layers.{layer}.{'.'.join(path)}"
      raise ValueError(f"nvfp4: {name} dim {b} takes sizes {sorted(sizes)}; {bad} not a "
                       f"multiple of {formats.BLOCK} (change the choices or drop "
                       f"{path[-1]!r} from the quantized leaves)")
    return leaf

  map_param_leaves(config, shapes, visit)


# Leaves a serving engine runs as one fused matmul share one global scale (the max of their
# amaxes), as ModelOpt exports them: the Mamba in_proj (z, x, B, C, dt) is one HF Linear, and
# q / k / v are fused into one qkv GEMM by vLLM.
SHARED_SCALE = {"in_z": "in_proj", "in_x": "in_proj", "in_B": "in_proj", "in_C": "in_proj",
                "in_dt": "in_proj", "q": "qkv", "k": "qkv", "v": "qkv"}


def _map_chosen(params, config: ModelConfig, spec: QuantSpec, fn):
  """`params` (canonical or scanned) with fn(leaf, format, block axis, amax, stacked) at every
  leaf `spec` chooses. `amax` is the global amax of the leaf's scale group (`SHARED_SCALE`; its own
  otherwise), per stacked layer ([L]) for a stacked leaf (leading "layers" axis)."""
  check(config, spec)
  scanned = is_scanned(params)
  logical = scanned_logical_axes(config) if scanned else logical_axes(config)
  is_p = lambda x: isinstance(x, P)
  names_at = {jax.tree_util.keystr(path): names for path, names in
              jax.tree_util.tree_flatten_with_path(logical, is_leaf=is_p)[0]}
  flat_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
  missing = [jax.tree_util.keystr(p) for p, _ in flat_paths
             if jax.tree_util.keystr(p) not in names_at]
  if missing or len(flat_paths) != len(names_at):
    raise ValueError(f"params do not match the config's parameter tree (e.g. {missing[:3]})")
  out = [x for _, x in flat_paths]
  # Per chosen leaf: (index, scale group, block axis, stacked).
  chosen = []
  for i, (path, _) in enumerate(flat_paths):
    if path[-1].key in spec.leaves:
      names = tuple(names_at[jax.tree_util.keystr(path)])
      stacked = scanned and names[0] == "layers"
      group = (jax.tree_util.keystr(path[:-1]),
               SHARED_SCALE.get(path[-1].key, jax.tree_util.keystr(path)))
      chosen.append((i, group, block_axis(names[1:] if stacked else names), stacked,
                     spec.fmt_of(path[-1].key)))
  amax = {}
  for i, group, _, stacked, _ in chosen:
    a = jnp.abs(out[i].astype(jnp.float32))
    a = jnp.max(a, axis=tuple(range(1, a.ndim))) if stacked else jnp.max(a)
    amax[group] = a if group not in amax else jnp.maximum(amax[group], a)
  for i, group, b, stacked, fmt in chosen:
    out[i] = fn(out[i], fmt, b, jax.lax.stop_gradient(amax[group]), stacked)
  return jax.tree_util.tree_unflatten(treedef, out)


def quantize_params(params, config: ModelConfig, spec: QuantSpec):
  """The (canonical) params tree with a QTensor at every leaf `spec` chooses; leaves fused at
  serving time share their global scale (`SHARED_SCALE`)."""
  if is_scanned(params):
    raise ValueError("quantize_params takes canonical params (model.to_canonical)")
  return _map_chosen(params, config, spec,
                     lambda leaf, fmt, b, amax, _: quantize(leaf, fmt, b, amax))


def dequantize_params(qparams, dtype=None):
  """Every QTensor back to its float values (in its own dtype, or `dtype`)."""
  return jax.tree.map(lambda x: x.dequantize(dtype) if is_qtensor(x) else x, qparams,
                      is_leaf=is_qtensor)


def fake_quant_params(params, config: ModelConfig, spec: QuantSpec):
  """Float params whose chosen leaves carry the quantized values with a straight-through
  gradient (quantization-aware training); equal to dequantize_params(quantize_params(...)).
  `params` may be canonical or scanned: a stacked leaf (leading "layers" axis) is quantized
  layer by layer, each with its own scales, as its canonical layers would be."""
  def one(leaf, fmt, b, amax, stacked):
    if stacked:
      return jax.vmap(lambda w, a: formats.fake_quant(w, fmt, b, a))(leaf, amax)
    return formats.fake_quant(leaf, fmt, b, amax)
  return _map_chosen(params, config, spec, one)


__all__ = ["DEFAULT_LEAVES", "SHARED_SCALE", "QTensor", "QuantSpec", "block_axis", "check",
           "dequantize_params", "fake_quant_params", "mixed_spec", "plan", "quantize_params"]
