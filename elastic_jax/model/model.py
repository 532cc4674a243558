"""The full hybrid model as pure functions: `init(config, key)` and `apply(params, tokens, masks)`.

params = {"embed": [V,D], "layers": [{"norm": [D], "mixer": {...}}, ...], "final_norm": [D],
          "lm_head": [D,V]}; each layer's mixer follows its pattern char (M * E -).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from elastic_jax.config import ModelConfig
from elastic_jax.masks import BudgetMasks
from elastic_jax.model import attention as attn_lib
from elastic_jax.model import init_utils as iu
from elastic_jax.model import mamba2 as mamba_lib
from elastic_jax.model import moe as moe_lib
from elastic_jax.model.norms import channel_score, rms_norm

_MIXER_SPECS = {"M": mamba_lib.param_specs, "*": attn_lib.param_specs, "E": moe_lib.param_specs,
                "-": moe_lib.mlp_param_specs}


def param_specs(c: ModelConfig) -> dict:
  D, V = c.hidden_size, c.vocab_size
  return {
      "embed": iu.Spec((V, D), c.param_dtype, iu.normal(c.initializer_range)),
      "layers": [{"norm": iu.Spec((D,), c.param_dtype, iu.ones),
                  "mixer": _MIXER_SPECS[k](c.layer_config(i))}
                 for i, k in enumerate(c.layer_pattern)],
      "final_norm": iu.Spec((D,), c.param_dtype, iu.ones),
      "lm_head": iu.Spec((D, V), c.param_dtype, iu.normal(c.initializer_range)),
  }


def init(config: ModelConfig, key) -> dict:
  """Random parameters for `config` (Nemotron-H style initialisation)."""
  return iu.materialize(param_specs(config), key)


def param_shapes(config: ModelConfig) -> dict:
  """The params pytree as `jax.ShapeDtypeStruct`s, without allocating."""
  return iu.shapes(param_specs(config))


def apply(params: dict, tokens_BT, masks: BudgetMasks | None = None, *, config: ModelConfig,
          moe_impl: str = "dense", scan: str = "chunked", collect: bool = False):
  """Logits [B,T,V] (fp32) for int tokens [B,T], optionally at a budget given by `masks`.

  The residual stream is kept in fp32; matmuls run in `config.compute_dtype`. With `collect`,
  returns (logits, stats): one dict per layer of calibration statistics (see `importance`).
  """
  c = config
  tokens_BT = jnp.asarray(tokens_BT)
  if tokens_BT.ndim != 2 or not jnp.issubdtype(tokens_BT.dtype, jnp.integer):
    raise ValueError(f"tokens must be an int array [batch, time], got {tokens_BT.dtype} "
                     f"{tokens_BT.shape}")
  if len(params["layers"]) != c.num_layers:
    raise ValueError(f"params have {len(params['layers'])} layers, config.layer_pattern has "
                     f"{c.num_layers}")
  masks = masks if masks is not None else BudgetMasks()
  hm = masks.hidden
  x = params["embed"][tokens_BT].astype(jnp.float32)
  if hm is not None:
    x = x * hm
  counters = {"M": 0, "E": 0, "*": 0, "-": 0}
  stats = []
  for layer, kind in zip(params["layers"], c.layer_pattern):
    j = counters[kind]
    counters[kind] += 1
    h = rms_norm(x, layer["norm"], c.norm_eps, hm)
    p = layer["mixer"]
    aux = None
    if kind == "M":
      out = mamba_lib.mamba2(p, h, c, masks.layer("mamba_heads", j), scan=scan, collect=collect)
    elif kind == "*":
      out = attn_lib.attention(p, h, c)
    elif kind == "E":
      out = moe_lib.moe(p, h, c, masks.layer("moe_experts", j), masks.layer("moe_ffn", j),
                        impl=moe_impl, collect=collect)
    else:
      out = moe_lib.mlp(p, h, c)
    if collect:
      out, aux = out if kind in "ME" else (out, None)
      stats.append({"hidden": channel_score(h), **(aux or {})})
    out = out.astype(jnp.float32)
    x = x + (out if hm is None else out * hm)
  x = rms_norm(x, params["final_norm"], c.norm_eps, hm)
  dt_ = jnp.dtype(c.compute_dtype)
  logits = jnp.einsum("btd,dv->btv", x.astype(dt_), params["lm_head"].astype(dt_),
                      preferred_element_type=jnp.float32)
  return (logits, stats) if collect else logits
