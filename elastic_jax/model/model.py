"""The full hybrid model as pure functions: `init(config, key)` and `apply(params, tokens, masks)`.

params = {"embed": [V,D], "layers": [{"norm": [D], "mixer": {...}}, ...], "final_norm": [D],
          "lm_head": [D,V]}; each layer's mixer follows its pattern char (M * E -).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from elastic_jax.config import ModelConfig
from elastic_jax.model.budget_masks import BudgetMasks
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
  return _init(config, key)


# One compiled program (cacheable across processes) instead of one per op and leaf shape.
@functools.partial(jax.jit, static_argnums=0)
def _init(config: ModelConfig, key) -> dict:
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
  logits, stats, _ = _forward_jit(params, jnp.asarray(tokens_BT), masks, config, moe_impl, scan, collect)
  return (logits, stats) if collect else logits


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=None) -> dict:
  """Empty decode cache for `batch` streams of up to `max_len` tokens: per layer a KV cache
  ('*'), conv + SSM state ('M') or nothing; `pos` = columns used, `key_valid` [B,max_len]
  marks the columns that hold real (not padding) tokens."""
  layers = []
  for i, kind in enumerate(config.layer_pattern):
    lc = config.layer_config(i)
    layers.append(mamba_lib.init_state(lc, batch, dtype) if kind == "M" else
                  attn_lib.init_state(lc, batch, max_len, dtype) if kind == "*" else {})
  return {"layers": layers, "pos": jnp.zeros((), jnp.int32),
          "key_valid": jnp.zeros((batch, max_len), bool)}


def apply_cached(params: dict, tokens_BT, cache: dict, masks: BudgetMasks | None = None, *,
                 config: ModelConfig, valid_BT=None, moe_impl: str = "dense"):
  """(logits [B,T,V], new cache): the T tokens continue every stream after `cache["pos"]`.

  Equals `apply` on the whole sequence so far. `valid_BT` False marks left padding (in each row
  False entries precede True ones: prompts of different lengths, or a row that skips this
  step): padded tokens change no state and are invisible to later tokens. The caller keeps
  `pos + T <= max_len` (not checkable under jit; XLA would clamp the write position).
  """
  tokens_BT = jnp.asarray(tokens_BT)
  B, T = tokens_BT.shape
  if cache["key_valid"].shape[0] != B:
    raise ValueError(f"cache is for batch {cache['key_valid'].shape[0]}, tokens have batch {B}")
  valid_BT = jnp.ones((B, T), bool) if valid_BT is None else jnp.asarray(valid_BT, bool)
  key_valid = jax.lax.dynamic_update_slice(cache["key_valid"], valid_BT, (0, cache["pos"]))
  cache = {**cache, "key_valid": key_valid}
  logits, _, cache = _forward_jit(params, tokens_BT, masks, config, moe_impl, "chunked", False,
                                  cache, valid_BT)
  return logits, {**cache, "pos": cache["pos"] + T}


def _forward(params, tokens_BT, masks, c: ModelConfig, moe_impl, scan, collect, cache=None,
             valid_BT=None):
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
  stats, new_layers = [], []
  for i, (layer, kind) in enumerate(zip(params["layers"], c.layer_pattern)):
    j = counters[kind]
    counters[kind] += 1
    h = rms_norm(x, layer["norm"], c.norm_eps, hm)
    p = layer["mixer"]
    st = None if cache is None else cache["layers"][i]
    aux = None
    if kind == "M":
      out = mamba_lib.mamba2(p, h, c, masks.layer("mamba_heads", j), scan=scan, collect=collect,
                             state=st, valid_BT=valid_BT)
    elif kind == "*":
      out = (attn_lib.attention(p, h, c) if cache is None else
             attn_lib.attention(p, h, c, st, cache["pos"], cache["key_valid"]))
    elif kind == "E":
      out = moe_lib.moe(p, h, c, masks.layer("moe_experts", j), masks.layer("moe_ffn", j),
                        impl=moe_impl, collect=collect)
    else:
      out = moe_lib.mlp(p, h, c)
    if cache is not None and kind in "M*":
      out, st = out
    new_layers.append(st)
    if collect:
      out, aux = out if kind in "ME" else (out, None)
      stats.append({"hidden": channel_score(h), **(aux or {})})
    out = out.astype(jnp.float32)
    x = x + (out if hm is None else out * hm)
  x = rms_norm(x, params["final_norm"], c.norm_eps, hm)
  dt_ = jnp.dtype(c.compute_dtype)
  logits = jnp.einsum("btd,dv->btv", x.astype(dt_), params["lm_head"].astype(dt_),
                      preferred_element_type=jnp.float32)
  return logits, stats, (None if cache is None else {**cache, "layers": new_layers})


# Eager callers (tests, evaluation, notebooks) get one compiled program per shape instead of one
# per op; under an outer jit or grad this is an ordinary nested call.
_forward_jit = jax.jit(_forward, static_argnums=(3, 4, 5, 6))
