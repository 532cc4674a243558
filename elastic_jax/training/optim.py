"""The optimizer of every phase: AdamW with fp32 state, fp32 master weights, and weight decay
masked by parameter kind (as large-model trainers do).

Precision. Parameters are stored (checkpoints of a model, HF export) in `config.param_dtype`
and the model computes in `config.compute_dtype`. A training phase holds, per `master`:
- "float32" (default): fp32 master weights and fp32 AdamW moments; each step casts the masters
  to the stored dtype before the forward pass, so training sees the numerics inference will.
  At bf16 a weight near 0.02 has an ulp of 1.2e-4: updates of lr ~1e-4 would round away.
- "param": weights in the stored dtype (e.g. bf16: half the memory of fp32 masters) with the
  moments and the update still computed in fp32; the sum is rounded once per step. For when
  fp32 masters do not fit.
Decay. No weight decay on A_log, D, dt_bias (Mamba's convention), norm scales, biases, or the
MoE router's correction bias; every other matrix decays (`decays`).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

MASTERS = ("float32", "param")
# Leaf names that never decay; besides these, any leaf whose name ends in "_bias".
NO_DECAY = frozenset({"A_log", "D", "scale", "norm"})


def check_master(master: str) -> str:
  if master not in MASTERS:
    raise ValueError(f"optim.master must be one of {MASTERS}, got {master!r}")
  return master


def _leaf_name(path) -> str:
  key = path[-1]
  return str(getattr(key, "key", getattr(key, "name", key)))


def decays(path) -> bool:
  """Whether the leaf at `path` (a jax key path) gets weight decay."""
  name = _leaf_name(path)
  return name not in NO_DECAY and not name.endswith("_bias")


def decay_mask(tree):
  """Bool pytree like `tree`: True where the leaf decays (`decays`)."""
  return jax.tree_util.tree_map_with_path(lambda p, _: decays(p), tree)


def _is_float(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def to_dtype(tree, dtype):
  """`tree` with its floating leaves cast to `dtype` (arrays or ShapeDtypeStructs)."""
  def cast(x):
    if not _is_float(x):
      return x
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype), sharding=x.sharding)
    return x.astype(dtype)
  return jax.tree.map(cast, tree)


def like(tree, reference):
  """`tree` cast leaf by leaf to the dtypes of `reference` (same structure)."""
  return jax.tree.map(lambda x, r: x.astype(r.dtype) if _is_float(x) else x,
                      tree, reference)


def in_fp32(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """`inner` run on fp32 views of the gradients and params: its state (moments) is fp32 and so
  are the updates, whatever the params' dtype (`optax.apply_updates` rounds the sum once)."""
  up = lambda t: None if t is None else to_dtype(t, jnp.float32)

  def init(params):
    return inner.init(up(params))

  def update(grads, state, params=None):
    return inner.update(up(grads), state, up(params))
  return optax.GradientTransformation(init, update)


def schedule(lr: float, steps: int, warmup: int):
  """Linear warmup from 0 to `lr`, then cosine decay to 0 at `steps`."""
  warm = max(warmup, 1)
  return optax.warmup_cosine_decay_schedule(0.0, lr, warm, max(steps, warm + 1))


def adamw(lr: float, steps: int, warmup: int, weight_decay: float = 1e-4, clip: float = 1.0):
  """AdamW (fp32 state), warmup + cosine decay, global-norm clipping, decay masked by kind."""
  return in_fp32(optax.chain(optax.clip_by_global_norm(clip), optax.adamw(
      schedule(lr, steps, warmup), weight_decay=weight_decay, mask=decay_mask)))


def elastic_adamw(total_steps: int, model_lr: float = 1e-4, router_lr: float = 1e-2,
                  weight_decay: float = 0.0, clip: float = 1.0, warmup_steps: int = 0):
  """The elastic phase's AdamW over {"model": params, "router": budget router}: two groups
  with their own LR (METHOD.md section 5), decay (masked by kind) on the model only."""
  def group(lr, wd):
    return optax.adamw(schedule(lr, total_steps, warmup_steps), weight_decay=wd,
                       mask=decay_mask)
  labels = lambda tree: {k: jax.tree.map(lambda _: k, v) for k, v in tree.items()}
  return in_fp32(optax.chain(
      optax.clip_by_global_norm(clip),
      optax.multi_transform({"model": group(model_lr, weight_decay),
                             "router": group(router_lr, 0.0)}, labels)))


def master_weights(params, master: str = "float32"):
  """The weights a phase trains: fp32 copies of `params` ("float32") or `params` as stored
  ("param")."""
  return to_dtype(params, jnp.float32) if check_master(master) == "float32" else params


def cast_for_step(loss_fn: Callable, stored) -> Callable:
  """`loss_fn(params, *args)` that first casts the master weights to the dtypes of `stored`
  (the params as the model keeps them), so each step computes as inference will."""
  return lambda params, *args: loss_fn(like(params, stored), *args)
