"""The model as functions over plain params: `init`, `apply`, `apply_cached`, `init_cache`,
`param_shapes`, `logical_axes` (thin wrappers over the `ElasticLM` Flax module).

Params use the canonical layout (see `lm`): {"embed", "layers": {"0": ..., "L-1": ...},
"final_norm", "lm_head"}. `apply` runs the stack the config asks for (`scan_layers`, `remat`);
with a scanned stack the canonical params are stacked per unit slot inside the compiled forward.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from elastic_jax.config import ModelConfig
from elastic_jax.model import attention as attn_lib
from elastic_jax.model import expert_placement
from elastic_jax.model import layouts
from elastic_jax.model import mamba2 as mamba_lib
from elastic_jax.model.block import Block
from elastic_jax.model.budget_masks import BudgetMasks
from elastic_jax.model.lm import ElasticLM, declare_globals
from elastic_jax.model.norms import RMSNorm
from elastic_jax.model.stack_plan import plan_stack


class _Globals(nn.Module):
  """The parameters outside the layer stack, declared exactly as `ElasticLM` declares them."""
  config: ModelConfig

  @nn.compact
  def __call__(self):
    c = self.config
    p = declare_globals(self, c)
    RMSNorm(c.hidden_size, c.norm_eps, c.param_dtype, name="final_norm")(
        jnp.zeros((1, c.hidden_size), jnp.float32))
    return p


def _block_init(lc: ModelConfig, kind: str, key):
  return Block(lc, kind).init(key, jnp.zeros((1, 1, lc.hidden_size), jnp.float32), {})["params"]


def _globals_init(config: ModelConfig, key):
  return _Globals(config).init(key)["params"]


# One small program per distinct layer shape (and one for the globals), whatever the depth.
_block_init_jit = jax.jit(lambda lc, kind, key: nn.unbox(_block_init(lc, kind, key)),
                          static_argnums=(0, 1))
_globals_init_jit = jax.jit(lambda config, key: nn.unbox(_globals_init(config, key)),
                            static_argnums=0)


def _assemble(config: ModelConfig, layer_fn, globals_fn) -> dict:
  g = globals_fn()
  return {"embed": g["embed"],
          "layers": {str(i): layer_fn(i, kind) for i, kind in enumerate(config.layer_pattern)},
          "final_norm": g["final_norm"], "lm_head": g["lm_head"]}


def init(config: ModelConfig, key) -> dict:
  """Random parameters for `config` (canonical layout, Nemotron-H style initialisation).

  Deterministic in (config, key): layer i draws from fold_in(key, i), the globals from
  fold_in(key, num_layers). Each distinct layer shape compiles one small program, so a 52-layer
  stack initialises as fast as a 3-layer one. (`ElasticLM(config).init` also works; it draws
  other values and compiles the whole forward.)
  """
  return _assemble(
      config,
      lambda i, kind: _block_init_jit(config.layer_config(i), kind, jax.random.fold_in(key, i)),
      lambda: _globals_init_jit(config, jax.random.fold_in(key, config.num_layers)))


@functools.lru_cache(maxsize=32)
def _abstract(config: ModelConfig) -> dict:
  """Boxed ShapeDtypeStructs (with logical names) of the canonical params; nothing compiled."""
  key = jax.random.PRNGKey(0)
  return _assemble(config,
                   lambda i, kind: jax.eval_shape(
                       functools.partial(_block_init, config.layer_config(i), kind), key),
                   lambda: jax.eval_shape(functools.partial(_globals_init, config), key))


def param_shapes(config: ModelConfig) -> dict:
  """The canonical params pytree as `jax.ShapeDtypeStruct`s, without allocating."""
  return nn.unbox(_abstract(config))


def logical_axes(config: ModelConfig) -> dict:
  """The canonical params pytree with each leaf's logical axis names (a `PartitionSpec`)."""
  return nn.get_partition_spec(_abstract(config))


def scanned_logical_axes(config: ModelConfig) -> dict:
  """`logical_axes` of the scanned layout: stacked unit leaves lead with the "layers" axis."""
  tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
  boxed = jax.eval_shape(ElasticLM(config, stack="scan").init, jax.random.PRNGKey(0), tokens)
  return nn.get_partition_spec(boxed["params"])


def stack_for(config: ModelConfig, stack: str | None = None) -> str:
  """The stack `apply` runs: `stack` if given, else "scan" when `config.scan_layers` and the
  model can scan (homogeneous, a repeating pattern), else "loop"."""
  if stack is not None:
    return stack
  can_scan = config.is_homogeneous and plan_stack(config.layer_pattern) is not None
  return "scan" if config.scan_layers and can_scan else "loop"


def is_scanned(params) -> bool:
  """Whether `params` use the scanned layout (see `layouts`)."""
  return isinstance(params.get("layers"), dict) and "units" in params["layers"]


def to_stack_layout(params: dict, config: ModelConfig, stack: str | None = None) -> dict:
  """`params` in the layout the config's stack runs without a per-step conversion: scanned when
  `stack_for(config, stack)` is "scan", else canonical. Training holds params this way."""
  if stack_for(config, stack) == "scan" and not is_scanned(params):
    return layouts.to_scanned(params, plan_stack(config.layer_pattern))
  return params


def to_canonical(params: dict, config: ModelConfig) -> dict:
  """`params` in the canonical layout (what checkpoints, slicing and HF export read)."""
  if is_scanned(params):
    return layouts.from_scanned(params, plan_stack(config.layer_pattern))
  return params


def place_experts(params: dict, config: ModelConfig, placement: str) -> tuple[dict, ModelConfig]:
  """(params, config) with the routed experts moved from `config.expert_placement`'s order into
  `placement`'s (`expert_placement.order`): every leaf with an "experts" logical axis (router
  columns, its bias, expert weights) is permuted along it, in either layout; the returned config
  names the new placement, so the model permutes its (logical) expert masks to match. The same
  function, with the expert axis laid out for balanced expert parallelism."""
  if placement == config.expert_placement:
    return params, config
  E = config.n_routed_experts
  old = expert_placement.order(E, config.expert_placement)
  new = expert_placement.order(E, placement)
  take = np.argsort(old)[new]  # physical slot in the new order -> slot in the old
  logical = scanned_logical_axes(config) if is_scanned(params) else logical_axes(config)

  def move(names, x):
    names = tuple(names)
    return jnp.take(x, take, axis=names.index("experts")) if "experts" in names else x

  moved = jax.tree.map(move, logical, params, is_leaf=lambda x: isinstance(x, P))
  return moved, config.replace(expert_placement=placement)


def apply(params: dict, tokens_BT, masks: BudgetMasks | None = None, *, config: ModelConfig,
          moe_impl: str = "dense", ssd: str = "chunked", collect: bool = False,
          stack: str | None = None):
  """Logits [B,T,V] (fp32) for int tokens [B,T], optionally at a budget given by `masks`.

  The residual stream is kept in fp32; matmuls run in `config.compute_dtype`. With `collect`,
  returns (logits, stats): one dict per layer of calibration statistics (see `importance`).
  `params` may be canonical or scanned (`to_stack_layout`); the stack is `stack` if given,
  else "scan" for scanned params, else the config's choice (`stack_for`).
  """
  if collect:
    stack = "loop"
  elif stack is None:
    stack = "scan" if is_scanned(params) else stack_for(config)
  logits, aux = _forward_jit(params, jnp.asarray(tokens_BT), masks, config, moe_impl, ssd,
                             collect, stack)
  return (logits, aux["stats"]) if collect else logits


def apply_hidden(params: dict, tokens_BT, masks: BudgetMasks | None = None, *,
                 config: ModelConfig, moe_impl: str = "dense", stack: str | None = None):
  """The final normed hidden states [B,T,D] (fp32) that `apply` multiplies by the lm_head
  (`lm.lm_head`): for losses that apply the head chunk by chunk."""
  if stack is None:
    stack = "scan" if is_scanned(params) else stack_for(config)
  hidden, _ = _forward_jit(params, jnp.asarray(tokens_BT), masks, config, moe_impl, "chunked",
                           False, stack, head=False)
  return hidden


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
                 config: ModelConfig, valid_BT=None, moe_impl: str = "dense",
                 last_only: bool = False):
  """(logits [B,T,V], new cache): the T tokens continue every stream after `cache["pos"]`;
  with `last_only` the last position's logits only, [B,1,V] (what decoding samples from: a
  prefill chunk then skips T-1 rows of the vocabulary projection).

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
  logits, aux = _forward_jit(params, tokens_BT, masks, config, moe_impl, "chunked", False, "loop",
                             cache, valid_BT, head="last" if last_only else True)
  return logits, {**aux["cache"], "pos": cache["pos"] + T}


def check_params(params, config: ModelConfig) -> None:
  """Raises ValueError when `params` is not a canonical params tree with the config's depth."""
  if not isinstance(params, dict) or not {"embed", "layers", "final_norm", "lm_head"} <= set(params):
    raise ValueError("params must be a dict with embed / layers / final_norm / lm_head")
  layers = params["layers"]
  if isinstance(layers, (list, tuple)):
    raise ValueError("params use the pre-Flax layout (layers as a list); convert them with "
                     "elastic_jax.model.layouts.from_legacy")
  if set(layers) != {str(i) for i in range(config.num_layers)}:
    raise ValueError(f"params have {len(layers)} layers, config.layer_pattern has "
                     f"{config.num_layers}")


def _forward(params, tokens_BT, masks, c: ModelConfig, moe_impl, ssd, collect, stack,
             cache=None, valid_BT=None, head=True):
  if tokens_BT.ndim != 2 or not jnp.issubdtype(tokens_BT.dtype, jnp.integer):
    raise ValueError(f"tokens must be an int array [batch, time], got {tokens_BT.dtype} "
                     f"{tokens_BT.shape}")
  plan = plan_stack(c.layer_pattern)
  if is_scanned(params):
    if stack != "scan":
      params = layouts.from_scanned(params, plan)
  else:
    check_params(params, c)
    if stack == "scan" and plan is not None and c.is_homogeneous:  # else ElasticLM says why not
      params = layouts.to_scanned(params, plan)
  module = ElasticLM(c, stack=stack, remat=c.remat, moe_impl=moe_impl, ssd=ssd, collect=collect,
                     head=head)
  return module.apply({"params": params}, tokens_BT, masks, cache=cache, valid_BT=valid_BT)


# Eager callers (tests, evaluation, notebooks) get one compiled program per shape instead of one
# per op; under an outer jit or grad this is an ordinary nested call.
_forward_jit = jax.jit(_forward, static_argnums=(3, 4, 5, 6, 7), static_argnames=("head",))
