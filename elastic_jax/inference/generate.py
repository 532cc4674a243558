"""Cached generation: chunked prefill + jitted single-token decode with KV / conv / SSM caches,
batched prompts of different lengths, greedy / temperature / top-p sampling, stop tokens, any
budget, and cache transplant between budgets. A quantized family (`quant.tree.quantize_params`,
or restored from a quantized checkpoint) generates as is: the packed weights are dequantized
inside the compiled step, or (`SubModel.matmul`, on by default on GPUs) the FP8 projections
run FP8 matmuls.

A `SubModel` is what generates: a standalone sliced sub-model (small shapes, its own config) or the
parent at a budget (parent params + `BudgetMasks`; one compiled step serves every budget, so
switching budget mid-generation is passing other masks). Prompts are left-padded to a multiple of
the prefill chunk; padded columns are invisible (the model has no positional encoding and the
Mamba states skip padding, so this is exact). Every step has a static shape: prefill runs fixed
chunks of `chunk` tokens, decode one token, both into a cache of fixed `max_len`, so one program
per (slice, batch, max_len) serves every prompt length. Decoding under stop tokens alone runs
up to `DECODE_BLOCK` steps on device per host sync; a per-token rule (`choose`) or streaming
(`on_token`) has the host decide every token.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from elastic_jax.config import ModelConfig
from elastic_jax.elastic.masks import BudgetMasks, from_counts
from elastic_jax.model.model import apply_cached, init_cache
from elastic_jax.elastic.slicing import slice_params
from elastic_jax.parallel import sharding as shd
from elastic_jax.model.linear import FP8_MATMUL_LEAVES
from elastic_jax.quant.qtensor import is_qtensor
from pallas_kernels import platform


@dataclasses.dataclass(frozen=True, eq=False)
class SubModel:
  """A model that generates: params + config, and masks when it is the parent at a budget.

  Compared by identity: two slices are "the same model" only if they are one object.
  `moe_impl` "auto" picks the MoE dispatch per call shape and platform
  (`model.moe.choose_impl`)."""
  params: Any
  config: ModelConfig
  masks: BudgetMasks | None = None
  name: str = "full"
  moe_impl: str = "auto"
  # Quantized weights: "dequant" (to the compute dtype inside the step), "fp8" (FP8 weights of
  # the attention / Mamba / shared-expert projections run FP8 matmuls: `model.linear`), or
  # "auto": fp8 on GPUs (whose XLA lowers FP8 dots to FP8 GEMMs), dequant elsewhere.
  matmul: str = "auto"

  def __post_init__(self):
    check_matmul(self.matmul)


MATMULS = ("auto", "dequant", "fp8")


def check_matmul(matmul: str) -> None:
  """ValueError unless `matmul` is one of `MATMULS`."""
  if matmul not in MATMULS:
    raise ValueError(f"matmul must be one of {', '.join(MATMULS)}, got {matmul!r}")


def resolve_matmul(matmul: str) -> str:
  """"auto" -> "fp8" on a GPU backend, else "dequant"; other values as they are."""
  if matmul == "auto":
    return "fp8" if platform.current() == "gpu" else "dequant"
  return matmul


def step_weights(params, matmul: str):
  """The params a step computes with: QTensor leaves dequantized, except (`matmul` "fp8") FP8
  weights of the projections that run FP8 matmuls (`model.linear.FP8_MATMUL_LEAVES`)."""
  def one(path, x):
    if not is_qtensor(x):
      return x
    if matmul == "fp8" and x.fmt == "fp8" and path[-1].key in FP8_MATMUL_LEAVES:
      return x
    return x.dequantize()
  return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_qtensor)


def parent_at_budget(params, config: ModelConfig, counts: Mapping[str, Any] | None,
                     name: str = "budget", moe_impl: str = "auto",
                     matmul: str = "auto") -> SubModel:
  """The parent restricted to per-axis `counts` by masks (no copy of the weights)."""
  return SubModel(params, config, from_counts(config, counts), name, moe_impl, matmul)


def standalone(params, config: ModelConfig, counts: Mapping[str, Any] | None, name: str = "budget",
               moe_impl: str = "auto", matmul: str = "auto") -> SubModel:
  """A standalone sub-model: every tensor prefix-sliced to `counts` (small shapes)."""
  small, small_cfg = slice_params(params, config, counts)
  return SubModel(small, small_cfg, None, name, moe_impl, matmul)


@dataclasses.dataclass(frozen=True)
class Sampler:
  """temperature 0 = greedy; top_p < 1 keeps the smallest set of top tokens with mass >= top_p."""
  temperature: float = 0.0
  top_p: float = 1.0

  def __post_init__(self):
    if not (np.isfinite(self.temperature) and self.temperature >= 0):
      raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def sample(logits_BV, key, temperature, top_p):
  """One token per row; `temperature` and `top_p` may be traced (no recompile per value)."""
  logits = logits_BV.astype(jnp.float32)

  def sampled(logits):
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled, -1)
    sorted_l = jnp.take_along_axis(scaled, order, -1)
    probs = jax.nn.softmax(sorted_l, -1)
    # Drop a token once the mass before it already reaches top_p (the first always stays).
    drop = (jnp.cumsum(probs, -1) - probs) >= top_p
    pick = jax.random.categorical(key, jnp.where(drop, -jnp.inf, sorted_l), -1)
    return jnp.take_along_axis(order, pick[:, None], -1)[:, 0].astype(jnp.int32)

  # A branch, not a select: greedy decoding skips the sort over the vocabulary.
  return jax.lax.cond(temperature > 0, sampled,
                      lambda logits: jnp.argmax(logits, -1).astype(jnp.int32), logits)


def _advance(weights, tokens_BT, valid_BT, cache, masks, key, temperature, top_p, config,
             moe_impl):
  """Feeds `tokens_BT` into the cache: (new cache, last logits [B,V], sampled next [B])."""
  # The sampling key of this step is `key` folded with the cache's position (on device: a
  # host-side fold_in would cost a dispatch per token).
  key = jax.random.fold_in(key, cache["pos"])
  logits, cache = apply_cached(weights, tokens_BT, cache, masks, config=config,
                               valid_BT=valid_BT, moe_impl=moe_impl, last_only=True)
  return cache, logits[:, -1], sample(logits[:, -1], key, temperature, top_p)


@functools.partial(jax.jit, static_argnames=("config", "moe_impl", "matmul"),
                   donate_argnames=("cache",))
def _step(params, tokens_BT, valid_BT, cache, masks, key, temperature, top_p, *, config,
          moe_impl, matmul="dequant"):
  # Quantized params (QTensor leaves) stay packed in memory; the step dequantizes them, or
  # runs FP8 matmuls on them.
  return _advance(step_weights(params, matmul), tokens_BT, valid_BT, cache, masks, key,
                  temperature, top_p, config, moe_impl)


@dataclasses.dataclass(frozen=True)
class DecodeState:
  """Where a batch of streams stands: the cache (holding every token fed so far), the next
  token sampled after them per row (`pending`, not yet fed), its logits, and the live rows.

  Stepping consumes a state (its cache buffers are donated to the step); branch from one
  state with `transplant` (which copies) or by prefilling again."""
  cache: dict
  pending: np.ndarray   # [B] int32
  logits: jax.Array     # [B, V] fp32, the distribution `pending` was drawn from
  active: np.ndarray    # [B] bool

  @property
  def pos(self) -> int:
    return int(self.cache["pos"])

  @property
  def max_len(self) -> int:
    return int(self.cache["key_valid"].shape[1])


def round_up(n: int, multiple: int) -> int:
  """The smallest positive multiple of `multiple` that is >= n."""
  return max(multiple, -(-n // multiple) * multiple)


def left_pad(prompts: Sequence[Sequence[int]], width: int):
  """(tokens [B,width] int32, valid [B,width] bool): each prompt right-aligned."""
  toks = np.zeros((len(prompts), width), np.int32)
  valid = np.zeros((len(prompts), width), bool)
  for i, p in enumerate(prompts):
    if len(p) > width:
      raise ValueError(f"prompt {i} has {len(p)} tokens, more than the width {width}")
    if len(p):
      toks[i, width - len(p):], valid[i, width - len(p):] = p, True
  return toks, valid


def check_prompts(prompts: Sequence[Sequence[int]], config: ModelConfig):
  """ValueError for no prompts, an empty prompt or token ids outside the vocab."""
  if not len(prompts):
    raise ValueError("no prompts")
  for i, p in enumerate(prompts):
    if not len(p):
      raise ValueError(f"prompt {i} is empty (start it with <bos>)")
    bad = [int(t) for t in p if not 0 <= int(t) < config.vocab_size]
    if bad:
      raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocab [0, "
                       f"{config.vocab_size})")


def extend(slc: SubModel, state: DecodeState, tokens_BT, valid_BT=None, *,
           sampler: Sampler = Sampler(), key=None, chunk: int | None = None) -> DecodeState:
  """Feeds T tokens per row (left padding marked False in `valid_BT`) in chunks of `chunk`
  (default: all T at once) and samples each row's next token after them.

  Rows with no valid token keep their cache, pending token and logits. With a `state` from
  another slice of the same parent this continues that slice's cache (see `transplant`)."""
  tokens_BT = np.asarray(tokens_BT, np.int32)
  B, T = tokens_BT.shape
  valid_BT = np.ones((B, T), bool) if valid_BT is None else np.asarray(valid_BT, bool)
  if B != len(state.pending) or valid_BT.shape != (B, T):
    raise ValueError(f"tokens {tokens_BT.shape} / valid {valid_BT.shape} do not fit a state of "
                     f"batch {len(state.pending)}")
  if np.any(valid_BT[:, :-1] & ~valid_BT[:, 1:]):
    raise ValueError("valid_BT must mark left padding only (False entries before True ones)")
  if np.any((tokens_BT < 0) | (tokens_BT >= slc.config.vocab_size)):
    raise ValueError(f"token ids outside the vocab [0, {slc.config.vocab_size})")
  chunk = chunk or T
  if T % chunk:
    raise ValueError(f"{T} tokens are not a whole number of chunks of {chunk}")
  pos = state.pos
  if pos + T > state.max_len:
    raise ValueError(f"cache overflow: {pos} + {T} tokens > max_len {state.max_len}")
  key = jax.random.PRNGKey(0) if key is None else key
  cache, pending, logits = state.cache, state.pending, state.logits
  for s in range(0, T, chunk):
    toks, valid = tokens_BT[:, s:s + chunk], valid_BT[:, s:s + chunk]
    cache, new_logits, nxt = _step(slc.params, toks, valid, cache, slc.masks, key,
                                   sampler.temperature, sampler.top_p, config=slc.config,
                                   moe_impl=slc.moe_impl, matmul=resolve_matmul(slc.matmul))
    fed = valid.any(1)
    pending = np.where(fed, np.asarray(nxt), pending)
    # Every row fed (a decode step of live rows): no select to dispatch.
    logits = (new_logits if logits is None or fed.all() else
              jnp.where(jnp.asarray(fed)[:, None], new_logits, logits))
  return dataclasses.replace(state, cache=cache, pending=pending, logits=logits)


def _cache_placement(params, cache):
  """Where a fresh cache is committed: the params' device, or sharded over their mesh when they
  are sharded (streams over the batch axes, heads over tensor: `sharding.cache_shardings`).
  (Step outputs are committed, and a committed argument where the first call had an
  uncommitted one would compile the step again.)"""
  leaf = jax.tree_util.tree_leaves(params)[0]
  if not isinstance(leaf, jax.Array):
    return jax.devices()[0]
  if len(leaf.devices()) == 1:
    return next(iter(leaf.devices()))
  if isinstance(leaf.sharding, NamedSharding):
    return shd.cache_shardings(cache, leaf.sharding.mesh)
  raise ValueError(f"params sharded with {type(leaf.sharding).__name__}; decoding needs them on "
                   "one device or as NamedShardings over a mesh")


def prefill(slc: SubModel, prompts: Sequence[Sequence[int]], *, max_len: int,
            sampler: Sampler = Sampler(), key=None, chunk: int = 32) -> DecodeState:
  """Runs the prompts (different lengths allowed) through `slc` into a fresh cache of `max_len`
  columns, `chunk` tokens at a time; samples each row's first new token."""
  check_prompts(prompts, slc.config)
  width = round_up(max(len(p) for p in prompts), chunk)
  if width >= max_len:
    raise ValueError(f"cache overflow: prompts padded to {width} tokens leave no room in "
                     f"max_len {max_len}")
  toks, valid = left_pad(prompts, width)
  B = len(prompts)
  cache = init_cache(slc.config, B, max_len)
  cache = jax.device_put(cache, _cache_placement(slc.params, cache))
  state = DecodeState(cache, np.zeros(B, np.int32), None, np.ones(B, bool))
  return extend(slc, state, toks, valid, sampler=sampler, key=key, chunk=chunk)


def feed(slc: SubModel, state: DecodeState, tokens_B, *, sampler: Sampler = Sampler(), key=None,
         rows=None) -> DecodeState:
  """Feeds one token per row in `rows` (default: the active rows; others are left untouched)
  and samples the next one (the jitted decode step)."""
  rows = state.active if rows is None else np.asarray(rows, bool)
  return extend(slc, state, np.asarray(tokens_B, np.int32)[:, None], rows[:, None],
                sampler=sampler, key=key)


# choose(row, sampled token, tokens emitted so far) -> token to emit and feed, or None to stop.
Choose = Callable[[int, int, list], "int | None"]


@dataclasses.dataclass(frozen=True)
class StopRule:
  """Emit what is sampled; a row stops after emitting one of `stop_tokens`. (A `Choose` the
  decode loop also runs on device, several tokens per dispatch.)"""
  stop_tokens: tuple[int, ...] = ()

  def __call__(self, i: int, tok: int, out: list) -> int | None:
    return None if out and out[-1] in self.stop_tokens else tok


def stop_rule(stop_tokens: Sequence[int] = ()) -> StopRule:
  """Emit what is sampled; a row stops after emitting one of `stop_tokens`."""
  return StopRule(tuple(sorted({int(t) for t in stop_tokens})))


# Decode steps per dispatch of the on-device loop (`_decode_block`): the host syncs once per
# block instead of once per token; the loop ends early once every row has stopped.
DECODE_BLOCK = 16


@functools.partial(jax.jit, static_argnames=("config", "moe_impl", "matmul"),
                   donate_argnames=("cache",))
def _decode_block(params, pending_B, active_B, logits_BV, cache, masks, key, temperature, top_p,
                  stops, n_steps, *, config, moe_impl, matmul="dequant"):
  """Up to `n_steps` (<= DECODE_BLOCK, traced) decode steps on device under a stop rule: each
  live row emits its pending token and feeds it (`_advance`, as `_step` does), and stops
  after emitting one of `stops`. Returns (cache, pending, logits, active, tokens
  [DECODE_BLOCK, B], emitted [DECODE_BLOCK, B] bool)."""
  weights = step_weights(params, matmul)
  B = pending_B.shape[0]

  def cond(c):
    k, _, _, active, _, _, _ = c
    return (k < n_steps) & jnp.any(active)

  def body(c):
    k, pending, logits, active, cache, toks, emitted = c
    # A stopped row feeds token 0 as `feed` does (its cache column is never valid).
    fed = jnp.where(active, pending, 0)
    cache, new_logits, nxt = _advance(weights, fed[:, None], active[:, None], cache, masks,
                                      key, temperature, top_p, config, moe_impl)
    toks = toks.at[k].set(pending)
    emitted = emitted.at[k].set(active)
    stopped = jnp.any(pending[:, None] == stops[None, :], axis=-1)
    return (k + 1, jnp.where(active, nxt, pending),
            jnp.where(active[:, None], new_logits, logits), active & ~stopped, cache, toks,
            emitted)

  init = (jnp.int32(0), pending_B, logits_BV, active_B, cache,
          jnp.zeros((DECODE_BLOCK, B), jnp.int32), jnp.zeros((DECODE_BLOCK, B), bool))
  _, pending, logits, active, cache, toks, emitted = jax.lax.while_loop(cond, body, init)
  return cache, pending, logits, active, toks, emitted


def _decode_on_device(slc: SubModel, state: DecodeState, max_new_tokens: int, rule: StopRule,
                      sampler: Sampler, key):
  """`decode` under a stop rule with no per-token callback: blocks of steps on device (the
  same tokens, cache and state as the per-token loop)."""
  B = len(state.pending)
  out = [[] for _ in range(B)]
  stops = jnp.asarray(rule.stop_tokens or (-1,), jnp.int32)
  cache, pending, logits = state.cache, jnp.asarray(state.pending), state.logits
  active, done = jnp.asarray(state.active), 0
  live = bool(state.active.any())
  while done < max_new_tokens and live:
    room = state.max_len - int(cache["pos"])
    if room < 1:
      raise ValueError(f"cache overflow: {int(cache['pos'])} + 1 tokens > max_len "
                       f"{state.max_len}")
    n = min(DECODE_BLOCK, max_new_tokens - done, room)
    cache, pending, logits, active, toks, emitted = _decode_block(
        slc.params, pending, active, logits, cache, slc.masks, key, sampler.temperature,
        sampler.top_p, stops, n, config=slc.config, moe_impl=slc.moe_impl,
        matmul=resolve_matmul(slc.matmul))
    toks, emitted = np.asarray(toks), np.asarray(emitted)
    for i in range(B):
      out[i].extend(int(t) for t in toks[emitted[:, i], i])
    done += n
    live = bool(np.asarray(active).any())
  final = dataclasses.replace(state, cache=cache, pending=np.asarray(pending), logits=logits,
                              active=np.asarray(active))
  return out, final


def decode(slc: SubModel, state: DecodeState, max_new_tokens: int, *, choose: Choose | None = None,
           sampler: Sampler = Sampler(), key=None,
           on_token: Callable[[int, int], None] | None = None):
  """Generates up to `max_new_tokens` per active row. Returns (tokens per row, final state).

  `choose` decides per row and step what is emitted (forcing a token, stopping; default: emit
  the sample); an emitted token is fed to the model, so the final cache holds every emitted
  token and `pending` is the sample after the last one. A stopped row's cache stays exactly as
  after its last token; the returned state marks it inactive. Under a `stop_rule` with no
  `on_token` the steps run on device, `DECODE_BLOCK` per host sync (the same tokens and
  state); otherwise the host decides every token."""
  if max_new_tokens < 0:
    raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
  choose = choose or stop_rule()
  key = jax.random.PRNGKey(0) if key is None else key
  if isinstance(choose, StopRule) and on_token is None and state.logits is not None:
    return _decode_on_device(slc, state, max_new_tokens, choose, sampler, key)
  B = len(state.pending)
  out = [[] for _ in range(B)]
  active = state.active.copy()
  for _ in range(max_new_tokens):
    feed_B = np.zeros(B, np.int32)
    for i in np.flatnonzero(active):
      t = choose(int(i), int(state.pending[i]), out[i])
      if t is None:
        active[i] = False
        continue
      feed_B[i] = t
      out[i].append(int(t))
      if on_token is not None:
        on_token(int(i), int(t))
    if not active.any():
      break
    state = feed(slc, state, feed_B, sampler=sampler, key=key, rows=active)
  return out, dataclasses.replace(state, active=active)


def generate(slc: SubModel, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             stop_tokens: Sequence[int] = (), sampler: Sampler = Sampler(), key=None,
             on_token=None, max_len: int | None = None, chunk: int = 32):
  """Prefill + decode; returns the new tokens per row (a stop token, if hit, included).

  `max_len` (default: padded prompt + `max_new_tokens`, rounded up to `chunk`) fixes the cache
  size; keep it constant across calls to reuse one compiled decode step."""
  check_prompts(prompts, slc.config)
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  need = round_up(max(len(p) for p in prompts), chunk) + max_new_tokens
  max_len = max_len or round_up(need, chunk)
  if max_len < need:
    raise ValueError(f"cache overflow: max_len {max_len} < padded prompt + {max_new_tokens} "
                     f"new tokens = {need}")
  key = jax.random.PRNGKey(0) if key is None else key
  k1, k2 = jax.random.split(key)
  state = prefill(slc, prompts, max_len=max_len, sampler=sampler, key=k1, chunk=chunk)
  out, _ = decode(slc, state, max_new_tokens, choose=stop_rule(stop_tokens), sampler=sampler,
                  key=k2, on_token=on_token)
  return out


# ------------------------------------------------------------------------------ cache transplant
# Axis of the per-group Mamba head dim in each cache leaf; the only cache dim a budget changes
# (attention heads are not elastic and the hidden dim never appears in a cache).
_HEAD_AXIS = {"conv_x": 3, "ssm": 2}


def _fit(x, axis: int, size: int):
  """Zero-pad or truncate dim `axis` of `x` to `size`."""
  n = x.shape[axis]
  if n >= size:
    return jax.lax.slice_in_dim(x, 0, size, axis=axis)
  return jnp.pad(x, [(0, size - n if a == axis else 0) for a in range(x.ndim)])


def transplant_cache(cache: dict, config: ModelConfig) -> dict:
  """A cache written by one slice of a parent, fitted to `config` (another slice): Mamba conv
  and SSM states zero-padded or truncated per group along the head dim; the rest as is.

  Approximate: the new slice's states would differ had it read the tokens itself (re-prefill is
  the exact baseline). Same shapes (masked slices) is the identity."""
  B, max_len = cache["key_valid"].shape
  want = jax.eval_shape(functools.partial(init_cache, config, B, max_len))
  if len(want["layers"]) != len(cache["layers"]):
    raise ValueError(f"mismatched slices: cache has {len(cache['layers'])} layers, "
                     f"{config.layer_pattern!r} has {len(want['layers'])}")
  layers = []
  for i, (have, spec) in enumerate(zip(cache["layers"], want["layers"])):
    if set(have) != set(spec):
      raise ValueError(f"mismatched slices: layer {i} cache has {sorted(have)}, "
                       f"{config.layer_pattern[i]!r} needs {sorted(spec)}")
    new = {}
    for name, x in have.items():
      shape, axis = spec[name].shape, _HEAD_AXIS.get(name)
      same_but_heads = axis is not None and all(
          a == b for d, (a, b) in enumerate(zip(x.shape, shape)) if d != axis)
      if x.shape != shape and not (same_but_heads and x.ndim == len(shape)):
        raise ValueError(f"mismatched slices: layer {i} {name} cache {x.shape} cannot become "
                         f"{shape} (only Mamba heads may differ)")
      new[name] = (x if x.shape == shape else _fit(x, axis, shape[axis])).astype(spec[name].dtype)
    layers.append(new)
  # Fresh buffers throughout: the next step donates the cache it is given.
  return jax.tree_util.tree_map(jnp.copy, {**cache, "layers": layers})


def transplant(state: DecodeState, to: SubModel) -> DecodeState:
  """`state` with its cache fitted to slice `to` (see `transplant_cache`); feed `to` next."""
  return dataclasses.replace(state, cache=transplant_cache(state.cache, to.config))
