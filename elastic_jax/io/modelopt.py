"""A quantized (sub-)model as HF safetensors in NVIDIA ModelOpt's format, the one vLLM and
TensorRT-LLM serve, and back.

Per quantized HF Linear `<m>` (weight [out, in] in HF):
  NVFP4: `<m>.weight` uint8 [out, in/2] (two E2M1 codes per byte, the even input low),
         `<m>.weight_scale` float8_e4m3fn [out, in/16], `<m>.weight_scale_2` f32 (global),
  FP8:   `<m>.weight` float8_e4m3fn [out, in], `<m>.weight_scale` f32,
and `<m>.input_scale` f32 (activation amax / (6 * 448) for NVFP4, / 448 for FP8) where a
calibration gave one. `hf_quant_config.json` and config.json's `quantization_config` say
`quant_method: modelopt`, the algorithm (MIXED_PRECISION, with each quantized Linear's own
in `quantized_layers`, when FP8 and NVFP4 Linears mix), the group size and the Linear modules
left in high precision (`exclude_modules`).

The layout is exact: HF's tensors are our codes and scales with their entries moved (each HF
weight gathers from our leaves by the same index moves `hf.params_to_hf` makes of float
weights, our block axis being HF's input dim), so a reload holds the very codes and scales that
were exported and reproduces the quantized model's logits bit for bit.
"""
from __future__ import annotations

import json
import os
from typing import Mapping

import jax
import ml_dtypes
import numpy as np

from elastic_jax.config import ModelConfig
from elastic_jax.io import hf
from elastic_jax.io import safetensors_io as st
from elastic_jax.model.model import logical_axes, param_shapes
from elastic_jax.quant import formats
from elastic_jax.quant.qtensor import QTensor, is_qtensor
from elastic_jax.quant.tree import block_axis

QUANT_ALGO = {"nvfp4": "NVFP4", "fp8": "FP8"}
FMT_OF_ALGO = {v: k for k, v in QUANT_ALGO.items()}
HF_QUANT_CONFIG = "hf_quant_config.json"
MIXED = "MIXED_PRECISION"   # formats per layer, listed in `quantized_layers`


class ModelOptError(ValueError):
  pass


def _leaves(tree) -> dict[str, object]:
  """{leaf path (keystr): leaf}, a QTensor being one leaf."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_qtensor)
  return {jax.tree_util.keystr(p): x for p, x in flat}


def _part_sources(shapes, keys: tuple, convert):
  """(HF name -> float ids, [(leaf path, first id, shape)]) of one `hf.hf_parts` part: each of
  the part's HF tensors as the ids of the float entries of our leaves it holds (leaf k's
  entries are ids start_k ... in C order, counted within the part: int32 up to 2^31 entries,
  so a nano_v3 layer's ids take 5.2 GB where the whole model's took 253 GB in int64)."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(hf.select(shapes, keys))
  root = tuple(jax.tree_util.DictKey(k) for k in keys)
  total = sum(int(np.prod(s.shape)) for _, s in flat)
  dtype = np.int32 if total < 2 ** 31 else np.int64
  table, arrays, start = [], [], 0
  for path, s in flat:
    n = int(np.prod(s.shape))
    table.append((jax.tree_util.keystr(root + path), start, tuple(s.shape)))
    arrays.append(np.arange(start, start + n, dtype=dtype).reshape(s.shape))
    start += n
  return convert(jax.tree_util.tree_unflatten(treedef, arrays)), table


def _owners(ids: np.ndarray, table) -> list[int]:
  """Indices into `table` of the leaves whose entries `ids` holds."""
  starts = np.array([t[1] for t in table])
  return sorted(set(np.searchsorted(starts, np.unique(ids), side="right") - 1))


def _component_index(ids: np.ndarray, table, q_of: Mapping[int, QTensor], div: int):
  """(owner per entry, flat index into that owner's component) for HF ids whose input (last)
  dim is packed by `div` (2: nvfp4 codes, 16: block scales, 1: fp8 codes): entry [o, k] stands
  for the float entry [o, k * div], whose block-axis index is divided by `div`."""
  ids = ids[..., ::div]
  starts = np.array([t[1] for t in table])
  owner = np.searchsorted(starts, ids, side="right") - 1
  flat_index = np.empty(ids.shape, np.int64)
  for k in np.unique(owner):
    path, start, shape = table[k]
    q = q_of[k]
    sel = owner == k
    multi = list(np.unravel_index(ids[sel] - start, shape))
    comp = list(shape)
    if div > 1:
      multi[q.axis] = multi[q.axis] // div
      comp[q.axis] //= div
    flat_index[sel] = np.ravel_multi_index(multi, comp)
  return owner, flat_index


def _gather(ids, table, q_of, div, component: str):
  owner, index = _component_index(ids, table, q_of, div)
  ks = np.unique(owner)
  first = np.asarray(getattr(q_of[ks[0]], component))
  out = np.empty(owner.shape, first.dtype)
  for k in ks:
    sel = owner == k
    out[sel] = np.asarray(getattr(q_of[k], component)).reshape(-1)[index[sel]]
  return out


def _module_amax(ids: np.ndarray, owners, table, input_amax: Mapping) -> float | None:
  """The input amax of the HF Linear whose weight holds `ids`: the largest of its leaves' (they
  read the same input), an [E] per-expert amax taken at the expert the weight holds; None if
  no leaf of it was calibrated."""
  vals = []
  for k in owners:
    path, start, shape = table[k]
    if path not in input_amax:
      continue
    a = np.asarray(input_amax[path], np.float32)
    if a.ndim:   # per expert: the leaf's dim 0 is the expert
      a = a[np.unravel_index(int(ids.flat[0]) - start, shape)[0]]
    vals.append(float(a))
  return max(vals) if vals else None


def _module(name: str) -> str:
  return name[: -len(".weight")]


def to_modelopt(qparams, config: ModelConfig,
                input_amax: Mapping[str, float] | None = None) -> tuple[dict, dict]:
  """(HF tensors, quantization config) of quantized params (`quant.tree.quantize_params`, or a
  slice of them; FP8 and NVFP4 leaves together make a MIXED_PRECISION export, each HF Linear
  in its own format). `input_amax`: {params path of a weight leaf: the amax of its input over
  calibration data, [E] for routed experts} (`quant.calibrate.input_amax`); a quantized HF
  Linear none of whose leaves has one gets no input_scale. Raises
  ModelOptError where ModelOpt cannot hold the model: one HF Linear made of quantized and
  unquantized leaves (Mamba's in_proj is z, x, B, C, dt), of two global scales or of two
  formats, or a float model."""
  leaves = _leaves(qparams)
  if not any(is_qtensor(x) for x in leaves.values()):
    raise ModelOptError("export takes a quantized model, got no quantized leaf")
  shapes = param_shapes(config)
  out, excluded, layers = {}, [], {}
  for keys, convert in hf.hf_parts(config):   # one layer's index arrays at a time
    ids, table = _part_sources(shapes, keys, convert)
    q_of = {k: leaves[path] for k, (path, _, _) in enumerate(table) if is_qtensor(leaves[path])}
    # Float tensors: the unquantized leaves through the usual converter (placeholders elsewhere).
    floats = jax.tree_util.tree_map(
        lambda x: np.zeros(x.shape, np.int8) if is_qtensor(x) else np.asarray(x),
        hf.select(qparams, keys), is_leaf=is_qtensor)
    for name, hf_tensor in convert(floats).items():
      _export_tensor(name, hf_tensor, ids[name], table, q_of, input_amax or {}, out, excluded,
                     layers)
  algos = sorted({v["quant_algo"] for v in layers.values()})
  quant = {"quant_algo": algos[0] if len(algos) == 1 else MIXED,
           "kv_cache_quant_algo": None, "exclude_modules": sorted(excluded)}
  if QUANT_ALGO["nvfp4"] in algos:
    quant["group_size"] = formats.BLOCK
  if len(algos) > 1:   # each quantized Linear's own algorithm
    quant["quantized_layers"] = dict(sorted(layers.items()))
  return out, quant


def _export_tensor(name, hf_tensor, ids, table, q_of, input_amax, out, excluded, layers):
  """Writes HF tensor `name` into `out`: as is (and its module into `excluded`) when none of
  its leaves is quantized, else as ModelOpt codes and scales (its format into `layers`)."""
  owners = _owners(ids, table)
  kinds = {k in q_of for k in owners}
  if kinds == {False}:
    out[name] = np.ascontiguousarray(hf_tensor)
    if name.endswith(".weight") and hf_tensor.ndim == 2 and "embeddings" not in name:
      excluded.append(_module(name))
    return
  fmts = {q_of[k].fmt for k in owners if k in q_of}
  if len(fmts) > 1:
    raise ModelOptError(f"{name} is one HF Linear made of {[table[k][0] for k in owners]} "
                        f"in formats {sorted(fmts)}: give them one format")
  if kinds == {False, True} or len({float(q_of[k].global_scale) for k in owners}) != 1:
    parts = [table[k][0] for k in owners]
    raise ModelOptError(f"{name} is one HF Linear made of {parts}: quantize all of them or "
                        "none, with one global scale (quant.tree.SHARED_SCALE)")
  m = _module(name)
  fmt = fmts.pop()
  layers[m] = {"quant_algo": QUANT_ALGO[fmt], **({"group_size": formats.BLOCK}
                                                 if fmt == "nvfp4" else {})}
  scale = np.float32(q_of[owners[0]].global_scale)
  if fmt == "nvfp4":
    out[f"{m}.weight"] = _gather(ids, table, q_of, 2, "codes")
    out[f"{m}.weight_scale"] = _gather(ids, table, q_of, formats.BLOCK, "block_scale")
    out[f"{m}.weight_scale_2"] = np.asarray(scale)
  else:
    out[f"{m}.weight"] = _gather(ids, table, q_of, 1, "codes")
    out[f"{m}.weight_scale"] = np.asarray(scale)
  amax = _module_amax(ids, owners, table, input_amax)
  if amax is not None:
    top = formats.E2M1_MAX * formats.E4M3_MAX if fmt == "nvfp4" else formats.E4M3_MAX
    out[f"{m}.input_scale"] = np.asarray(np.float32(amax) / np.float32(top))


def save_pretrained(folder: str, qparams, config: ModelConfig, *,
                    input_amax: Mapping[str, float] | None = None,
                    overwrite: bool = False) -> None:
  """Writes config.json (with `quantization_config`), hf_quant_config.json and
  model.safetensors in ModelOpt's format (`to_modelopt`); what `hf.save_pretrained` does for a
  quantized model."""
  tensors, quant = to_modelopt(qparams, config, input_amax)
  hf.prepare_folder(folder, overwrite)
  e4m3 = np.dtype(ml_dtypes.float8_e4m3fn)
  # High-precision tensors as the model stores them (router fp32, as transformers keeps it);
  # codes and scales as they are.
  cast = lambda k, v: (v if v.dtype in (np.uint8, e4m3) or k.endswith(("_scale", "_scale_2"))
                       else v.astype(np.float32 if ".gate." in k else hf.stored_dtype(config)))
  st.save_file({k: cast(k, v) for k, v in tensors.items()},
               os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
  producer = {"name": "elastic-jax", "version": "0.2.0"}
  hf.write_json(os.path.join(folder, HF_QUANT_CONFIG), {"producer": producer,
                                                        "quantization": quant})
  hf.write_config(folder, {**hf.config_to_hf(config),
                           "quantization_config": {"quant_method": "modelopt", **quant}})


def is_modelopt(folder: str) -> bool:
  """Whether `folder`'s config.json declares a ModelOpt quantized model."""
  try:
    with open(os.path.join(folder, "config.json")) as f:
      q = json.load(f).get("quantization_config") or {}
  except (OSError, ValueError):
    return False
  return q.get("quant_method") == "modelopt"


class _FloatView(Mapping):
  """The HF tensors with every quantized weight as float zeros of its HF shape and the scales
  hidden: what `hf.params_from_hf` reads for the high-precision leaves."""

  def __init__(self, tensors: Mapping, float_shapes: Mapping[str, tuple]):
    self._t, self._q = tensors, float_shapes

  def __getitem__(self, name):
    if name in self._q:
      return np.zeros(self._q[name], np.float32)
    return self._t[name]

  def __iter__(self):
    return (k for k in self._t if not k.endswith(("_scale", "_scale_2")))

  def __len__(self):
    return sum(1 for _ in self)


def load_pretrained(folder: str, **overrides) -> tuple[ModelConfig, dict]:
  """(ModelConfig, params with QTensor leaves) of a ModelOpt NVFP4 / FP8 / MIXED_PRECISION
  export (each quantized Linear in its `quantized_layers` format): the codes and
  scales exactly as stored (each quantized HF Linear's entries moved back into our leaves), the
  rest as `hf.load_pretrained` reads it. `input_scale` is not read: our model keeps
  activations in high precision."""
  with open(os.path.join(folder, "config.json")) as f:
    q = json.load(f).get("quantization_config") or {}
  algo = q.get("quant_algo")
  if q.get("quant_method") != "modelopt" or algo not in (*FMT_OF_ALGO, MIXED):
    raise ModelOptError(f"{folder}: config.json quantization_config is not ModelOpt "
                        f"{sorted(FMT_OF_ALGO) + [MIXED]} (got {q.get('quant_method')!r}, "
                        f"{algo!r})")
  config = hf.load_config(folder, **overrides)
  tensors = st.load_folder(folder)
  per_layer = q.get("quantized_layers") or {}
  # The quantized leaves, each blocked along its input dim (read off its logical axes).
  names = {jax.tree_util.keystr(p): n for p, n in jax.tree_util.tree_flatten_with_path(
      logical_axes(config), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0]}
  shapes = param_shapes(config)
  float_shapes, by_path = {}, {}
  for keys, convert in hf.hf_parts(config):   # one layer's index arrays at a time
    ids, table = _part_sources(shapes, keys, convert)
    owners = {_module(n): _owners(a, table) for n, a in ids.items()
              if n.endswith(".weight") and f"{_module(n)}.weight_scale" in tensors}
    fmt_of = {}
    for m in owners:
      a = per_layer.get(m, {}).get("quant_algo") if algo == MIXED else algo
      if a not in FMT_OF_ALGO:
        raise ModelOptError(f"{folder}: {m} is quantized but its quant_algo is {a!r}; "
                            f"expected one of {sorted(FMT_OF_ALGO)}")
      fmt_of[m] = FMT_OF_ALGO[a]
      float_shapes[f"{m}.weight"] = ids[f"{m}.weight"].shape
    owned = {k: fmt_of[m] for m, ks in owners.items() for k in ks}
    shells = {k: QTensor(None, None, None, fmt, block_axis(tuple(names[table[k][0]])),
                         config.param_dtype) for k, fmt in owned.items()}
    comps = {k: {} for k in owned}
    for m in owners:
      name, fmt = f"{m}.weight", fmt_of[m]
      parts = ([("codes", 2, tensors[name]), ("block_scale", formats.BLOCK,
                                              tensors[f"{m}.weight_scale"])] if fmt == "nvfp4"
               else [("codes", 1, tensors[name])])
      for comp, div, value in parts:
        owner, index = _component_index(ids[name], table, shells, div)
        if value.shape != owner.shape:
          raise ModelOptError(f"{folder}: {name if comp == 'codes' else m + '.weight_scale'} "
                              f"has shape {value.shape}, the config expects {owner.shape}")
        for k in np.unique(owner):
          path, _, shape = table[k]
          full = list(shape)
          if div > 1:
            full[shells[k].axis] //= div
          arr = comps[k].setdefault(comp, np.zeros(full, value.dtype))
          arr.reshape(-1)[index[owner == k]] = value[owner == k]
      scale = tensors[f"{m}.weight_scale_2" if fmt == "nvfp4" else f"{m}.weight_scale"]
      for k in owners[m]:
        comps[k]["global_scale"] = np.float32(scale)
    by_path.update({table[k][0]: QTensor(jax.numpy.asarray(c["codes"]),
                                         None if owned[k] == "fp8" else
                                         jax.numpy.asarray(c["block_scale"]),
                                         jax.numpy.asarray(c["global_scale"]), owned[k],
                                         shells[k].axis, config.param_dtype)
                    for k, c in comps.items()})
  params = hf.params_from_hf(_FloatView(tensors, float_shapes), config)
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: by_path.get(jax.tree_util.keystr(p), x), params)
  return config, params
