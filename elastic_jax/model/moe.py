"""Nemotron-H MoE: fp32 sigmoid router with selection-only correction bias, normalised top-k
gates times `routed_scaling_factor`, squared-ReLU experts (not gated), plus one shared expert.

Leaves: router [D,E] fp32, router_bias [E] fp32, up [E,D,F], down [E,F,D], shared_up [D,Fs],
shared_down [Fs,D]. Four dispatch paths that compute the same function: "dense" (every expert on
every token, weighted by a sparse gate matrix; for CPU / tiny shapes), "ragged" (tokens sorted
by expert, grouped matmuls: `jax.lax.ragged_dot` (a loop of one-group row tiles on CPU), or
with `kernels="pallas"` the platform's kernel, `pallas_kernels.gmm`), "gather" (each token
gathers its k experts' weights: reads only active weights, for decoding a few tokens at a
time) and "ep" (expert parallel: "ragged" on each shard of the mesh's `expert` axis,
`model/moe_parallel.py`);
"auto" picks one by the platform, the number of tokens and the mesh (`choose_impl`, a measured
rule). With `kernels="pallas"` a hard expert-width mask multiplies only the kept columns
(`narrow_width`).
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from elastic_jax.config import ModelConfig
from elastic_jax.model import expert_placement
from elastic_jax.model import initializers as init
from elastic_jax.model import linear
from elastic_jax.model import moe_parallel
from elastic_jax.model import token_shards
from pallas_kernels import gmm as gmm_lib
from pallas_kernels import platform as platform_lib

MOE_IMPLS = ("dense", "ragged", "gather", "ep", "auto")


def choose_impl(tokens: int, c: ModelConfig) -> str:
  """The dispatch "auto" runs for `tokens` tokens (static at trace time).

  "ep" inside a mesh with an `expert` axis. On CPU "gather" for one token (a batch-1 decode
  step), else "ragged", whose grouped matmul is the tiled loop (`pallas_kernels.gmm_tiled`;
  XLA:CPU's own ragged_dot computes every expert for every row, 3.8-4.5x slower than dense).
  Measured on this project's 2-core CPU (fp32):
  - against "gather", in the whole on-device decode loop (`experiments/decode_speed.py
    --moe_sweep`, results/moe_rule.md; median of 7, tokens/s gather / ragged over the scaled
    nano_v3 slices, E 16-32, k 6, and the tiny config, E 8, k 2): one row 1.01-1.04 (in all
    52 layers 1.08-1.11), two 0.93-1.02, then ragged wins more with every row (four rows
    0.76-0.87, eight 0.55-0.63, sixteen 0.38-0.50);
  - against "dense" in the whole model (`experiments/speed.py`): T 64 9.8 against 19 ms, T 512
    44 against 201 (backward 99 against 201) at E 32, k 6; at the tiny config (E 8, k 2) T 512
    1.9 against 4.2 ms forward, 4.3 against 12.9 backward.
  On GPU / TPU (not measured here, no accelerator was lent): "gather" while the T*k assignments
  are no more than the experts (it reads only the routed experts' weights, a memory-bound
  decode's cost), else "ragged" on the platform's grouped-matmul kernel.
  """
  if moe_parallel.expert_mesh() is not None:
    return "ep"
  if platform_lib.current() == "cpu":
    return "gather" if tokens == 1 else "ragged"
  return "gather" if tokens * c.num_experts_per_tok <= c.n_routed_experts else "ragged"


class MoE(nn.Module):
  """The MoE mixer as a module; `__call__` returns (out, aux) like every mixer (see `moe`)."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x_BTD, expert_mask_E=None, ffn_mask_F=None, *, impl: str = "dense",
               collect: bool = False):
    c = self.config
    D, E, F, Fs = (c.hidden_size, c.n_routed_experts, c.moe_intermediate_size,
                   c.moe_shared_expert_intermediate_size)
    lin = init.normal(c.initializer_range)
    out = init.normal(c.initializer_range / math.sqrt(c.num_layers))
    pd = c.param_dtype
    p = init.declare(self, {
        # The router stays fp32 (selection is sensitive to rounding).
        "router": ((D, E), ("embed", "experts"), lin, "float32"),
        "router_bias": ((E,), ("experts",), init.zeros, "float32"),
        "up": ((E, D, F), ("experts", "embed", "expert_mlp"), lin, pd),
        "down": ((E, F, D), ("experts", "expert_mlp", "embed"), out, pd),
        "shared_up": ((D, Fs), ("embed", "mlp"), lin, pd),
        "shared_down": ((Fs, D), ("mlp", "embed"), out, pd)})
    return moe(p, x_BTD, c, expert_mask_E, ffn_mask_F, impl=impl, collect=collect)


def relu2(x):
  return jnp.square(jax.nn.relu(x))


def route(p: dict, x_TD, c: ModelConfig, expert_mask_E=None):
  """Returns (gates [T,k] fp32, expert indices [T,k] int32).

  The mask scales each expert's selection weight before top-k (as Megatron scales the score),
  here in the exp domain: `choice + log(m)`. A hard 0 is -inf (never selected); a soft
  staircase's tail mass pi -> 0 as the router sharpens drives the dropped experts to -inf, so the
  soft forward converges to the hard one; a mask constant over the kept experts (a hard mask
  times its probability) leaves the order unchanged, and the signed correction bias cannot lift
  a dropped expert (a product m * (s + b) would). Gates are scaled by the mask value so a mask
  scaled by a router probability carries gradient.
  """
  logits = jnp.einsum("td,de->te", x_TD.astype(jnp.float32), p["router"].astype(jnp.float32))
  scores = jax.nn.sigmoid(logits)
  choice = scores + p["router_bias"].astype(jnp.float32)
  if expert_mask_E is not None:
    # Selection carries no gradient (top-k indices); the mask reaches the loss through the gates.
    choice = choice + jnp.log(jax.lax.stop_gradient(expert_mask_E).astype(jnp.float32))
  _, idx = jax.lax.top_k(choice, c.num_experts_per_tok)
  gates = jnp.take_along_axis(scores, idx, axis=-1)
  if c.norm_topk_prob:
    gates = gates / (jnp.sum(gates, axis=-1, keepdims=True) + 1e-20)
  gates = gates * c.routed_scaling_factor
  if expert_mask_E is not None:
    gates = gates * expert_mask_E.astype(jnp.float32)[idx]
  return gates, idx


def _experts_dense(p, x_TD, gates, idx, ffn_mask_F, dt_, with_acts=False):
  E = p["up"].shape[0]
  combine_TE = jnp.sum(jax.nn.one_hot(idx, E, dtype=jnp.float32) * gates[..., None], axis=1)
  h = jnp.einsum("td,edf->tef", x_TD, p["up"].astype(dt_))
  if ffn_mask_F is not None:
    h = h * ffn_mask_F.astype(dt_)
  act = relu2(h)
  y = jnp.einsum("tef,efd->ted", act, p["down"].astype(dt_))
  out = jnp.einsum("te,ted->td", combine_TE.astype(dt_), y)
  return (out, act, y) if with_acts else out


def _experts_ragged(p, x_TD, gates, idx, ffn_mask_F, dt_, gmm_backend="xla", batch=None):
  return moe_parallel.sharded_local_experts(x_TD, gates, idx, p["up"], p["down"], ffn_mask_F,
                                            dt_, gmm_backend=gmm_backend, batch=batch)


def _experts_gather(p, x_TD, gates, idx, ffn_mask_F, dt_):
  h = jnp.einsum("td,tkdf->tkf", x_TD, p["up"][idx].astype(dt_))
  if ffn_mask_F is not None:
    h = h * ffn_mask_F.astype(dt_)
  y = jnp.einsum("tkf,tkfd->tkd", relu2(h), p["down"][idx].astype(dt_))
  return jnp.einsum("tk,tkd->td", gates.astype(dt_), y)


def kept_width(ffn_mask_F, widths: tuple[int, ...]) -> jax.Array:
  """Index into `widths` (ascending, the last the full width) of the narrowest that holds
  every nonzero column of the mask: a hard prefix mask's own width, the full width for a soft
  mask (nowhere 0)."""
  F = ffn_mask_F.shape[-1]
  last = jnp.max(jnp.where(ffn_mask_F != 0, jnp.arange(1, F + 1), 0))
  return jnp.searchsorted(jnp.asarray(widths, jnp.int32), last).astype(jnp.int32)


def narrow_width(experts, widths: tuple[int, ...]):
  """`experts(up [E,D,F], down [E,F,D], x, gates, idx, ffn_mask_F) -> out` as a function that
  multiplies only the columns a budget keeps: one branch per width in `widths` (the config's
  expert-width choices), each with the weights sliced to it, the mask choosing (`kept_width`).
  Exact in values and gradients: the mask multiplies before relu^2, whose derivative is 0 at
  0, so a column the mask zeroes contributes nothing and gets no gradient (its weights' and the
  mask's own are 0 on the full width too)."""
  def at(w):
    return lambda up, down, x, g, i, m: experts(up[..., :w], down[:, :w], x, g, i, m[:w])

  def f(up, down, x, g, i, m):
    return jax.lax.switch(kept_width(m, widths), [at(w) for w in widths], up, down, x, g, i, m)
  return f


_EXPERTS = {"dense": _experts_dense, "ragged": _experts_ragged, "gather": _experts_gather,
            "ep": moe_parallel.routed_experts}


def moe(p: dict, x_BTD, c: ModelConfig, expert_mask_E=None, ffn_mask_F=None, *,
        impl: str = "dense", collect: bool = False):
  """MoE forward on params `p`: (out [B,T,D], aux). aux["stats"]: with `collect`, calibration
  statistics (impl "dense": from every expert's activations; any other impl: from the T*k
  routed assignments only, the same values without [T, E, F] temporaries): ffn [F] = sum_b (mean over routed (t, e) of |g * relu^2 act|)^2, the
  gate-weighted down-projection input as ModelOpt reads it; per expert sums over routed tokens
  of g * ||E(x)|| (REAP), of ||E(x)|| (ungated) and the routed-token count; "amax": the
  largest |input| of each expert's up and down projection over its routed tokens ([E]; 0 for
  an expert no token reached) and of the shared down projection; else None.
  aux["state"] is always None (the MoE keeps no decode state)."""
  if impl not in MOE_IMPLS:
    raise ValueError(f"moe impl must be one of {MOE_IMPLS}, got {impl!r}")
  if impl == "auto":
    impl = choose_impl(x_BTD.shape[0] * x_BTD.shape[1], c)
  dt_ = jnp.dtype(c.compute_dtype)
  gmm_backend = gmm_lib.xla_backend() if c.kernels == "xla" else gmm_lib.pallas_backend()
  B, T, D = x_BTD.shape
  x_TD = x_BTD.reshape(B * T, D).astype(dt_)
  placed = c.expert_placement != "contiguous"
  if placed:  # params hold the experts in physical order; masks come in logical order
    perm = expert_placement.order(c.n_routed_experts, c.expert_placement)
    expert_mask_E = None if expert_mask_E is None else expert_mask_E[..., perm]
  gates, idx = route(p, x_TD, c, expert_mask_E)
  stats = None
  if collect:   # each token's largest |input|: the experts' up-projection amaxes
    x_amax_T = jnp.max(jnp.abs(x_TD.astype(jnp.float32)), axis=-1)
  if collect and impl != "dense":
    # The same statistics from the routed assignments alone: no [T, E, F] activations.
    E, k = p["up"].shape[0], c.num_experts_per_tok

    def routed_stats(x, g, i, x_amax, up, down):   # on one token shard's whole rows
      a = moe_parallel.assignments(x, g, i, up, down, ffn_mask_F, dt_, gmm_backend=gmm_backend)
      ga = jnp.abs(a["act"].astype(jnp.float32) * a["gate"][:, None])
      per_b = jax.ops.segment_sum(ga, a["token"] // T, num_segments=x.shape[0] // T) / (T * k)
      norm = jnp.linalg.norm(a["y"].astype(jnp.float32), axis=-1)
      by_expert = lambda v: jax.ops.segment_sum(v, a["expert"], num_segments=E + 1)[:E]
      # Largest |input| per expert (0 for an expert no token reached).
      max_by_expert = lambda v: jnp.maximum(
          jax.ops.segment_max(v, a["expert"], num_segments=E + 1)[:E], 0.0)
      sums = {"ffn": jnp.sum(jnp.square(per_b), 0), "reap_sum": by_expert(a["gate"] * norm),
              "norm_sum": by_expert(norm), "count": by_expert(jnp.ones_like(norm))}
      maxes = {"up": max_by_expert(x_amax[a["token"]]),
               "down": max_by_expert(jnp.max(jnp.abs(a["act"].astype(jnp.float32)), -1))}
      return moe_parallel.combine(a, x, dt_), sums, maxes

    routed, sums, maxes = token_shards.run(
        routed_stats, (x_TD, gates, idx, x_amax_T), (p["up"], p["down"]),
        moe_parallel.typed_island(gmm_backend), batch=B)
    stats = {**sums, "amax": maxes}
  elif collect:
    routed, act, y = _experts_dense(p, x_TD, gates, idx, ffn_mask_F, dt_, with_acts=True)
    E = p["up"].shape[0]
    hit_TE = jnp.sum(jax.nn.one_hot(idx, E, dtype=jnp.float32), axis=1)
    gate_TE = jnp.sum(jax.nn.one_hot(idx, E, dtype=jnp.float32) * gates[..., None], axis=1)
    norm_TE = jnp.linalg.norm(y.astype(jnp.float32), axis=-1)
    # gate_TE is 0 off the routed (t, e) pairs, so this also keeps only routed activations.
    a = jnp.abs(act.astype(jnp.float32) * gate_TE[..., None]).reshape(B, T, E, -1)
    per_b = jnp.sum(a, axis=(1, 2)) / jnp.maximum(jnp.sum(hit_TE.reshape(B, T, E), (1, 2)), 1)[:, None]
    stats = {"ffn": jnp.sum(jnp.square(per_b), 0),
             "reap_sum": jnp.sum(hit_TE * gate_TE * norm_TE, 0),
             "norm_sum": jnp.sum(hit_TE * norm_TE, 0), "count": jnp.sum(hit_TE, 0),
             "amax": {"up": jnp.max(hit_TE * x_amax_T[:, None], 0),
                      "down": jnp.max(jnp.abs(act.astype(jnp.float32)) * hit_TE[..., None],
                                      (0, 2))}}
  else:
    grouped = {"gmm_backend": gmm_backend, "batch": B} if impl in ("ragged", "ep") else {}
    if impl == "ep":
      grouped["dispatch"] = c.ep_dispatch
    experts = lambda up, down, x, g, i, m: _EXPERTS[impl](
        {"up": up, "down": down}, x, g, i, m, dt_, **grouped)
    F = p["up"].shape[-1]
    widths = sorted({w for w in c.moe_ffn_choices if w < F} | {F})
    if c.kernels == "pallas" and impl != "ep" and ffn_mask_F is not None and len(widths) > 1:
      experts = narrow_width(experts, tuple(widths))
    routed = experts(p["up"], p["down"], x_TD, gates, idx, ffn_mask_F)
  if stats is not None and placed:  # per-expert statistics back in logical order
    inv = np.argsort(perm)
    stats = jax.tree_util.tree_map_with_path(
        lambda path, v: v if path[-1].key == "ffn" else v[inv], stats)
  shared_act = relu2(linear.einsum("td,df->tf", x_TD, p["shared_up"], dt_))
  if stats is not None:
    stats["amax"]["shared_down"] = jnp.max(jnp.abs(shared_act.astype(jnp.float32)))
  shared = linear.einsum("tf,fd->td", shared_act, p["shared_down"], dt_)
  out = (routed + shared).reshape(B, T, D)
  return out, {"stats": stats, "state": None}
