"""Nemotron-H (HF `model_type: nemotron_h`) interop: config.json + safetensors <-> ModelConfig + params.

Reads the hub layout (`backbone.layers.{i}.mixer...`, per-expert `experts.{j}.up_proj.weight`) and
the transformers-5 in-memory layout (`model.` prefix, stacked `experts.up_proj`). HF Linear weights
are [out, in]; ours are [in, out] with heads split out (see the block modules).
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Callable, Mapping

import jax
import numpy as np

from elastic_jax.config import ModelConfig
from elastic_jax.model.model import param_shapes
from elastic_jax.io import safetensors_io as st

_KIND_OF_TYPE = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*",
                 "moe": "E", "mlp": "-"}
_TYPE_OF_KIND = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}


class HFFormatError(ValueError):
  pass


def _float(v):
  if isinstance(v, dict) and "__float__" in v:
    return float(v["__float__"])
  return float(v)


def _get(d, *names, default=None):
  for n in names:
    if n in d and d[n] is not None:
      return d[n]
  return default


def config_from_hf(hf: Mapping[str, Any], **overrides) -> ModelConfig:
  """ModelConfig from a Nemotron-H config.json dict. `overrides` replace any ModelConfig field."""
  if hf.get("model_type") != "nemotron_h":
    raise HFFormatError(f"expected model_type 'nemotron_h', got {hf.get('model_type')!r}")
  if "hybrid_override_pattern" in hf:
    pattern = hf["hybrid_override_pattern"]
  elif "layers_block_type" in hf:
    try:
      pattern = "".join(_KIND_OF_TYPE[t] for t in hf["layers_block_type"])
    except KeyError as e:
      raise HFFormatError(f"unknown layer type {e}; allowed: {sorted(_KIND_OF_TYPE)}") from None
  else:
    raise HFFormatError("config has neither hybrid_override_pattern nor layers_block_type")
  unsupported = {
      "tie_word_embeddings": (hf.get("tie_word_embeddings", False), False),
      "attention_bias": (hf.get("attention_bias", False), False),
      "mlp_bias": (hf.get("mlp_bias", False), False),
      "mamba_proj_bias": (_get(hf, "mamba_proj_bias", "use_bias", default=False), False),
      "moe_latent_size": (hf.get("moe_latent_size"), None),
      "mamba_hidden_act": (hf.get("mamba_hidden_act", "silu"), "silu"),
      "mlp_hidden_act": (hf.get("mlp_hidden_act", "relu2"), "relu2"),
      "n_shared_experts": (hf.get("n_shared_experts", 1), 1),
  }
  for k, (got, want) in unsupported.items():
    if got != want:
      raise HFFormatError(f"unsupported Nemotron-H option {k}={got!r} (only {want!r} is supported)")
  if _get(hf, "n_group", default=1) != _get(hf, "topk_group", default=1):
    raise HFFormatError("group-limited expert routing (n_group != topk_group) is not supported")
  eos = hf.get("eos_token_id", 2)
  D = hf["hidden_size"]
  H = hf["num_attention_heads"]
  limit = _get(hf, "time_step_limit", "mamba_dt_limit", default=(0.0, math.inf))
  kw = dict(
      layer_pattern=pattern, hidden_size=D, vocab_size=hf["vocab_size"],
      num_attention_heads=H, num_kv_heads=_get(hf, "num_key_value_heads", default=H),
      head_dim=_get(hf, "head_dim", default=D // H),
      mamba_num_heads=hf["mamba_num_heads"], mamba_head_dim=hf["mamba_head_dim"],
      ssm_state_size=hf["ssm_state_size"], mamba_n_groups=_get(hf, "n_groups", "mamba_n_groups"),
      conv_kernel=_get(hf, "conv_kernel", "mamba_d_conv", default=4),
      chunk_size=_get(hf, "chunk_size", "mamba_chunk_size", default=128),
      use_conv_bias=_get(hf, "use_conv_bias", "mamba_conv_bias", default=True),
      time_step_limit=tuple(_float(v) for v in limit),
      time_step_min=_float(_get(hf, "time_step_min", "mamba_dt_min", default=0.001)),
      time_step_max=_float(_get(hf, "time_step_max", "mamba_dt_max", default=0.1)),
      time_step_floor=_float(_get(hf, "time_step_floor", "mamba_dt_init_floor", default=1e-4)),
      n_routed_experts=_get(hf, "n_routed_experts", default=1),
      num_experts_per_tok=_get(hf, "num_experts_per_tok", default=1),
      moe_intermediate_size=_get(hf, "moe_intermediate_size", default=1),
      moe_shared_expert_intermediate_size=_get(hf, "moe_shared_expert_intermediate_size", default=1),
      routed_scaling_factor=float(_get(hf, "routed_scaling_factor", default=1.0)),
      norm_topk_prob=bool(_get(hf, "norm_topk_prob", default=True)),
      intermediate_size=_get(hf, "intermediate_size", default=1),
      norm_eps=float(_get(hf, "layer_norm_epsilon", "rms_norm_eps", default=1e-5)),
      initializer_range=float(_get(hf, "initializer_range", default=0.02)),
      bos_token_id=_get(hf, "bos_token_id", default=1),
      eos_token_id=eos[0] if isinstance(eos, (list, tuple)) else eos,
      pad_token_id=_get(hf, "pad_token_id", default=0),
  )
  dtype = _get(hf, "dtype", "torch_dtype", default="float32")
  if dtype in ("float32", "bfloat16", "float16"):
    kw["param_dtype"] = kw["compute_dtype"] = dtype
  kw.update(overrides)
  return ModelConfig(**kw)


def config_to_hf(c: ModelConfig) -> dict:
  """A Nemotron-H config.json dict for `c` (elastic choices are not part of the HF format)."""
  if not c.is_homogeneous:
    raise HFFormatError("Nemotron-H has one size per axis for all layers; this model has "
                        "per-layer sizes (export a homogeneous budget, or use the orbax format)")
  return {
      "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
      "hybrid_override_pattern": c.layer_pattern, "hidden_size": c.hidden_size,
      "vocab_size": c.vocab_size, "num_attention_heads": c.num_attention_heads,
      "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
      "mamba_num_heads": c.mamba_num_heads, "mamba_head_dim": c.mamba_head_dim,
      "ssm_state_size": c.ssm_state_size, "n_groups": c.mamba_n_groups,
      "conv_kernel": c.conv_kernel, "chunk_size": c.chunk_size, "use_conv_bias": c.use_conv_bias,
      "time_step_limit": list(c.time_step_limit),
      "time_step_min": c.time_step_min, "time_step_max": c.time_step_max,
      "time_step_floor": c.time_step_floor,
      "n_routed_experts": c.n_routed_experts, "num_experts_per_tok": c.num_experts_per_tok,
      "moe_intermediate_size": c.moe_intermediate_size,
      "moe_shared_expert_intermediate_size": c.moe_shared_expert_intermediate_size,
      "routed_scaling_factor": c.routed_scaling_factor, "norm_topk_prob": c.norm_topk_prob,
      "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "moe_latent_size": None,
      "intermediate_size": c.intermediate_size, "mlp_hidden_act": "relu2",
      "mamba_hidden_act": "silu", "layer_norm_epsilon": c.norm_eps,
      "initializer_range": c.initializer_range, "tie_word_embeddings": False,
      "attention_bias": False, "mlp_bias": False, "mamba_proj_bias": False, "use_bias": False,
      "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id,
      "pad_token_id": c.pad_token_id, "dtype": c.param_dtype,
  }


# ---------------------------------------------------------------------------- tensors
def _mamba_from_hf(t, c: ModelConfig):
  D, G, H, P, N = (c.hidden_size, c.mamba_n_groups, c.mamba_heads_per_group, c.mamba_head_dim,
                   c.ssm_state_size)
  HP, GN = G * H * P, G * N
  w = t("in_proj.weight").T                          # [D, HP + HP + 2GN + G*H]
  expect = 2 * HP + 2 * GN + G * H
  if w.shape != (D, expect):
    raise HFFormatError(f"in_proj.weight has shape {w.shape[::-1]}, expected ({expect}, {D})")
  z, x, B, C, dt = np.split(w, np.cumsum([HP, HP, GN, GN])[:], axis=1)
  conv = t("conv1d.weight")[:, 0, :].T               # [K, HP + 2GN]
  cx, cB, cC = np.split(conv, [HP, HP + GN], axis=1)
  p = {"in_z": z.reshape(D, G, H, P), "in_x": x.reshape(D, G, H, P),
       "in_B": B.reshape(D, G, N), "in_C": C.reshape(D, G, N), "in_dt": dt.reshape(D, G, H),
       "conv_x": cx.reshape(-1, G, H, P), "conv_B": cB.reshape(-1, G, N),
       "conv_C": cC.reshape(-1, G, N),
       "dt_bias": t("dt_bias").reshape(G, H), "A_log": t("A_log").reshape(G, H),
       "D": t("D").reshape(G, H), "norm": t("norm.weight").reshape(G, H, P),
       "out_proj": t("out_proj.weight").T.reshape(G, H, P, D)}
  if c.use_conv_bias:
    b = t("conv1d.bias")
    p["conv_x_bias"], p["conv_B_bias"], p["conv_C_bias"] = (
        b[:HP].reshape(G, H, P), b[HP:HP + GN].reshape(G, N), b[HP + GN:].reshape(G, N))
  return p


# The *_to_hf converters only move entries (reshape, transpose, concatenate, permute heads) and
# read sizes off their inputs, so they also lay out a quantized weight's packed codes and block
# scales, whose block (input) dim is shorter (io/modelopt.py).
def _mamba_to_hf(p, c: ModelConfig):
  flat = lambda a: a.reshape(a.shape[0], -1)
  in_proj = np.concatenate([flat(p["in_z"]), flat(p["in_x"]), flat(p["in_B"]), flat(p["in_C"]),
                            flat(p["in_dt"])], axis=1).T
  K = p["conv_x"].shape[0]
  conv = np.concatenate([p["conv_x"].reshape(K, -1), p["conv_B"].reshape(K, -1),
                         p["conv_C"].reshape(K, -1)], axis=1).T[:, None, :]
  out = {"in_proj.weight": in_proj, "conv1d.weight": conv, "dt_bias": p["dt_bias"].reshape(-1),
         "A_log": p["A_log"].reshape(-1), "D": p["D"].reshape(-1),
         "norm.weight": p["norm"].reshape(-1),
         "out_proj.weight": p["out_proj"].reshape(-1, p["out_proj"].shape[-1]).T}
  if c.use_conv_bias:
    out["conv1d.bias"] = np.concatenate([p["conv_x_bias"].reshape(-1), p["conv_B_bias"].reshape(-1),
                                         p["conv_C_bias"].reshape(-1)])
  return out


def _group_minor(w, dim: int, groups: int, inverse: bool = False):
  """Query heads along `dim` from HF's group-major order (h = g * rep + r) to ours, KV-group-minor
  (h = r * Hkv + g; see model/attention.py), or back with `inverse`."""
  lead, heads = w.shape[:dim], w.shape[dim]
  split = (groups, heads // groups) if not inverse else (heads // groups, groups)
  w = w.reshape(lead + split + w.shape[dim + 1:])
  return np.swapaxes(w, dim, dim + 1).reshape(lead + (heads,) + w.shape[dim + 2:])


def _attn_from_hf(t, c: ModelConfig):
  D, hd, G = c.hidden_size, c.head_dim, c.num_kv_heads
  return {"q": _group_minor(t("q_proj.weight").T.reshape(D, -1, hd), 1, G),
          "k": t("k_proj.weight").T.reshape(D, -1, hd),
          "v": t("v_proj.weight").T.reshape(D, -1, hd),
          "o": _group_minor(t("o_proj.weight").T.reshape(-1, hd, D), 0, G)}


def _attn_to_hf(p, c: ModelConfig):
  G = c.num_kv_heads
  q = _group_minor(np.asarray(p["q"]), 1, G, inverse=True)
  o = _group_minor(np.asarray(p["o"]), 0, G, inverse=True)
  rows = lambda a: a.reshape(a.shape[0], -1).T
  return {"q_proj.weight": rows(q), "k_proj.weight": rows(p["k"]),
          "v_proj.weight": rows(p["v"]), "o_proj.weight": o.reshape(-1, o.shape[-1]).T}


def _stack(t, names):
  """np.stack of the tensors `names`, filled one at a time (never all of them and the stack)."""
  first = t(names[0])
  out = np.empty((len(names),) + first.shape, first.dtype)
  out[0] = first
  for j, name in enumerate(names[1:], 1):
    out[j] = t(name)
  return out


def _moe_from_hf(t, c: ModelConfig, has):
  E = c.n_routed_experts
  if has("experts.up_proj"):                         # transformers-5 stacked layout [E, F, D]
    up, down = t("experts.up_proj"), t("experts.down_proj")
  else:
    up = _stack(t, [f"experts.{j}.up_proj.weight" for j in range(E)])
    down = _stack(t, [f"experts.{j}.down_proj.weight" for j in range(E)])
  return {"router": t("gate.weight").T, "router_bias": t("gate.e_score_correction_bias"),
          "up": up.transpose(0, 2, 1), "down": down.transpose(0, 2, 1),
          "shared_up": t("shared_experts.up_proj.weight").T,
          "shared_down": t("shared_experts.down_proj.weight").T}


def _moe_to_hf(p, c: ModelConfig):
  out = {"gate.weight": p["router"].T, "gate.e_score_correction_bias": p["router_bias"],
         "shared_experts.up_proj.weight": p["shared_up"].T,
         "shared_experts.down_proj.weight": p["shared_down"].T}
  for j in range(p["up"].shape[0]):
    out[f"experts.{j}.up_proj.weight"] = p["up"][j].T
    out[f"experts.{j}.down_proj.weight"] = p["down"][j].T
  return out


def _mlp_from_hf(t, c):
  return {"up": t("up_proj.weight").T, "down": t("down_proj.weight").T}


def _mlp_to_hf(p, c):
  return {"up_proj.weight": p["up"].T, "down_proj.weight": p["down"].T}


def params_from_hf(tensors: Mapping[str, np.ndarray], c: ModelConfig,
                   place: Callable[[str, np.ndarray], Any] | None = None) -> dict:
  """Our params pytree (`c.param_dtype`) from a HF state dict, streamed: each layer's tensors are
  read in their stored dtype (never upcast), converted, checked against the config's shapes,
  cast and handed to `place(path, array)` (a `jax.tree_util.keystr` path; default: kept as
  numpy, e.g. `jax.device_put` onto the leaf's sharding) before the next layer is read. Host
  memory peaks near the final params plus one layer's tensors (`TensorFiles` reads lazily)."""
  prefix = next((p for p in ("backbone.", "model.") if f"{p}embeddings.weight" in tensors), None)
  if prefix is None:
    raise HFFormatError("no backbone.embeddings.weight / model.embeddings.weight in checkpoint")
  want = param_shapes(c)
  place = place or (lambda path, x: x)
  used = set()

  def getter(base):
    def t(name):
      key = base + name
      if key not in tensors:
        raise HFFormatError(f"missing tensor {key!r}")
      used.add(key)
      return np.asarray(tensors[key])
    return t

  def has(base):
    return lambda name: base + name in tensors

  def finish(keys, tree, spec):
    """`tree` (the subtree at `keys`) checked against `spec`, cast, contiguous and placed."""
    root = tuple(jax.tree_util.DictKey(k) for k in keys)
    paths, treedef = jax.tree_util.tree_flatten_with_path(spec)
    try:
      got = treedef.flatten_up_to(tree)
    except (ValueError, TypeError) as e:
      raise HFFormatError(f"{jax.tree_util.keystr(root)}: parameter tree does not match the "
                          f"config: {e}") from None
    out = []
    for (path, sd), arr in zip(paths, got):
      name = jax.tree_util.keystr(root + path)
      if tuple(arr.shape) != tuple(sd.shape):
        raise HFFormatError(f"{name}: shape {tuple(arr.shape)}, config expects "
                            f"{tuple(sd.shape)}")
      if not np.issubdtype(arr.dtype, np.floating) and arr.dtype.name != "bfloat16":
        raise HFFormatError(f"{name}: stored as {arr.dtype.name}, a float parameter needs a "
                            "floating dtype (F32 / BF16 / F16); the file's header is wrong")
      out.append(place(name, np.ascontiguousarray(arr.astype(sd.dtype, copy=False))))
    return jax.tree_util.tree_unflatten(treedef, out)

  layers = {}
  for i, kind in enumerate(c.layer_pattern):
    base = f"{prefix}layers.{i}."
    mt = getter(base + "mixer.")
    convert = {"M": lambda: _mamba_from_hf(mt, c), "*": lambda: _attn_from_hf(mt, c),
               "E": lambda: _moe_from_hf(mt, c, has(base + "mixer.")),
               "-": lambda: _mlp_from_hf(mt, c)}[kind]
    try:
      mixer = convert()
    except HFFormatError:
      raise
    except ValueError as e:  # a reshape that the config's sizes don't allow
      raise HFFormatError(f"{base}mixer ({kind!r} layer): tensor shapes do not match the "
                          f"config ({e})") from None
    layers[str(i)] = finish(("layers", str(i)), {"norm": {"scale": getter(base)("norm.weight")},
                                                 "mixer": mixer}, want["layers"][str(i)])
    del mixer
  g = getter(prefix)
  params = {"embed": finish(("embed",), g("embeddings.weight"), want["embed"]),
            "layers": layers,
            "final_norm": finish(("final_norm",), {"scale": g("norm_f.weight")},
                                 want["final_norm"]),
            "lm_head": finish(("lm_head",), getter("")("lm_head.weight").T, want["lm_head"])}
  leftover = sorted(k for k in tensors if k not in used and not k.startswith("mtp."))
  if leftover:
    raise HFFormatError(f"checkpoint has tensors this config does not use: {leftover[:8]}"
                        f"{' ...' if len(leftover) > 8 else ''}")
  if set(params) != set(want):
    raise HFFormatError("parameter tree does not match the config")
  return params


GLOBALS = ("embed", "final_norm", "lm_head")


def select(params, keys: tuple[str, ...]):
  """The subtree of `params` at `keys` (an `hf_parts` part); () is the non-layer leaves."""
  if not keys:
    return {k: params[k] for k in GLOBALS}
  for k in keys:
    params = params[k]
  return params


def hf_parts(c: ModelConfig) -> list:
  """The HF layout part by part: [(keys, convert)], `convert(select(params, keys))` giving
  that part's HF tensors; the non-layer tensors first, then each layer. `params_to_hf` is
  their union; the quantized export (`io.modelopt`) works through them one part at a time."""
  def globals_(p):
    return {"backbone.embeddings.weight": p["embed"],
            "backbone.norm_f.weight": p["final_norm"]["scale"], "lm_head.weight": p["lm_head"].T}

  def layer(i, kind):
    conv = {"M": _mamba_to_hf, "*": _attn_to_hf, "E": _moe_to_hf, "-": _mlp_to_hf}[kind]
    def convert(p):
      out = {f"backbone.layers.{i}.norm.weight": p["norm"]["scale"]}
      out.update({f"backbone.layers.{i}.mixer.{k}": v for k, v in conv(p["mixer"], c).items()})
      return out
    return convert
  return [((), globals_)] + [(("layers", str(i)), layer(i, kind))
                             for i, kind in enumerate(c.layer_pattern)]


def params_to_hf(params, c: ModelConfig) -> dict[str, np.ndarray]:
  """HF hub-layout state dict (numpy) for our params."""
  params = jax.tree_util.tree_map(np.asarray, params)
  out = {}
  for keys, convert in hf_parts(c):
    out.update(convert(select(params, keys)))
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def load_config(folder: str, **overrides) -> ModelConfig:
  """The ModelConfig of a local Nemotron-H folder's config.json (`overrides` replace fields)."""
  cfg_path = os.path.join(folder, "config.json")
  if not os.path.exists(cfg_path):
    raise HFFormatError(f"{folder}: no config.json")
  with open(cfg_path) as f:
    return config_from_hf(json.load(f), **overrides)


def load_params(folder: str, config: ModelConfig, place=None) -> dict:
  """The params of a local Nemotron-H folder's safetensors, streamed (`params_from_hf`)."""
  return params_from_hf(st.load_folder(folder), config, place)


def load_pretrained(folder: str, place=None, **overrides) -> tuple[ModelConfig, dict]:
  """(ModelConfig, params) from a local Nemotron-H folder (config.json + safetensors)."""
  config = load_config(folder, **overrides)
  return config, load_params(folder, config, place)


def prepare_folder(folder: str, overwrite: bool) -> None:
  """Refuses a folder holding a model unless `overwrite`; removes the old weight files (any
  `*.safetensors` and its index) so loading never mixes in old tensors; other files stay."""
  if os.path.exists(os.path.join(folder, "config.json")) and not overwrite:
    raise HFFormatError(f"{folder} already holds a model; pass overwrite=True to replace it")
  os.makedirs(folder, exist_ok=True)
  for name in os.listdir(folder):
    if name.endswith((".safetensors", ".safetensors.index.json")):
      os.remove(os.path.join(folder, name))


def stored_dtype(c: ModelConfig) -> np.dtype:
  """The numpy dtype of `c.param_dtype` (bf16 through ml_dtypes)."""
  if c.param_dtype == "bfloat16":
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)
  return np.dtype(c.param_dtype)


def write_json(path: str, obj) -> None:
  """`obj` as indented JSON at `path`, atomically (a temporary file renamed into place)."""
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2)
  os.replace(tmp, path)


def write_config(folder: str, cfg: dict) -> None:
  """config.json, atomically, with transformers' JSON encoding of non-finite floats."""
  write_json(os.path.join(folder, "config.json"),
             dict(cfg, time_step_limit=[v if math.isfinite(v) else {"__float__": "Infinity"}
                                        for v in cfg["time_step_limit"]]))


def save_pretrained(folder: str, params, c: ModelConfig, overwrite: bool = False) -> None:
  """Writes config.json + model.safetensors (hub layout) that transformers can load. With
  `overwrite`, the weight files of the model there before are removed first
  (`prepare_folder`)."""
  prepare_folder(folder, overwrite)
  dtype = stored_dtype(c)
  # Router stays fp32, as transformers keeps it.
  tensors = {k: v.astype(np.float32 if ".gate." in k else dtype)
             for k, v in params_to_hf(params, c).items()}
  st.save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
  write_config(folder, config_to_hf(c))
