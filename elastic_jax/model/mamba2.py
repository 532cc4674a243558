"""Mamba-2 mixer (Nemotron-H variant): split in_proj, causal depthwise conv, SSD, gated group norm.

Leaves (heads stored as [groups, heads_per_group] so a per-group head budget is a prefix):
in_z/in_x [D,G,H,P], in_B/in_C [D,G,N], in_dt [D,G,H], conv_x [K,G,H,P] (+ conv_x_bias [G,H,P]),
conv_B/conv_C [K,G,N] (+ biases), dt_bias/A_log/D [G,H], norm [G,H,P], out_proj [G,H,P,D].
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from elastic_jax.config import ModelConfig
from elastic_jax.model import initializers as init
from elastic_jax.model import linear
from elastic_jax.model.norms import channel_score, gated_group_rms_norm
from elastic_jax.model import token_shards
from elastic_jax.model.ssd import ssd_chunked, ssd_sequential
from pallas_kernels import ssd as ssd_kernel

SSD_IMPLS = ("chunked", "sequential")


def _declare(m: nn.Module, c: ModelConfig) -> dict:
  """The mixer's parameters, each with its logical axis names."""
  D, G, H, P, N, K = (c.hidden_size, c.mamba_n_groups, c.mamba_heads_per_group, c.mamba_head_dim,
                      c.ssm_state_size, c.conv_kernel)
  pd = c.param_dtype
  lin = init.normal(c.initializer_range)
  conv = init.uniform(1.0 / math.sqrt(K))
  heads, state = ("mamba_groups", "mamba_heads"), ("mamba_groups", "ssm_state")
  chans = heads + ("mamba_head_dim",)
  table = {
      "in_z": ((D, G, H, P), ("embed",) + chans, lin, pd),
      "in_x": ((D, G, H, P), ("embed",) + chans, lin, pd),
      "in_B": ((D, G, N), ("embed",) + state, lin, pd),
      "in_C": ((D, G, N), ("embed",) + state, lin, pd),
      "in_dt": ((D, G, H), ("embed",) + heads, lin, pd),
      "conv_x": ((K, G, H, P), ("conv",) + chans, conv, pd),
      "conv_B": ((K, G, N), ("conv",) + state, conv, pd),
      "conv_C": ((K, G, N), ("conv",) + state, conv, pd),
      # Small SSM parameters stay fp32 (as in the reference implementation).
      "dt_bias": ((G, H), heads, init.dt_bias(c.time_step_min, c.time_step_max,
                                             c.time_step_floor), "float32"),
      "A_log": ((G, H), heads, init.a_log, "float32"),
      "D": ((G, H), heads, init.ones, "float32"),
      "norm": ((G, H, P), chans, init.ones, pd),
      "out_proj": ((G, H, P, D), chans + ("embed",),
                   init.normal(c.initializer_range / math.sqrt(c.num_layers)), pd),
  }
  if c.use_conv_bias:
    table.update({"conv_x_bias": ((G, H, P), chans, conv, pd),
                  "conv_B_bias": ((G, N), state, conv, pd),
                  "conv_C_bias": ((G, N), state, conv, pd)})
  return init.declare(m, table)


class Mamba2(nn.Module):
  """The Mamba-2 mixer as a module; `__call__` returns (out, aux) like every mixer (see `mamba2`)."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x_BTD, head_mask_GH=None, *, ssd: str = "chunked", collect: bool = False,
               state=None, valid_BT=None, channel_mask_P=None, starts_BT=None):
    return mamba2(_declare(self, self.config), x_BTD, self.config, head_mask_GH, ssd=ssd,
                  collect=collect, state=state, valid_BT=valid_BT, channel_mask_P=channel_mask_P,
                  starts_BT=starts_BT)


def causal_conv(x_BTC, w_KC, b_C=None, prev_BKC=None, n_pad_B=None, starts_BT=None):
  """Depthwise causal conv over time: out[t] = sum_k w[k] * x[t - K + 1 + k] (+ bias).

  Channel dims after T may be any shape; `w` is [K, *channels]. Inputs before t = 0 are zeros,
  or `prev_BKC`, the last K - 1 inputs of the preceding tokens (the decode conv state); then
  returns (out, the new conv state). `n_pad_B` (with `prev_BKC`): row b's first n inputs are
  left padding (zeros) that the stream skips, so the previous state joins its first real input.
  `starts_BT` (without `prev_BKC`): True where a packed document begins; inputs of an earlier
  document count as zeros.
  """
  K = w_KC.shape[0]
  T = x_BTC.shape[1]
  if prev_BKC is None:
    xp = jnp.pad(x_BTC, [(0, 0), (K - 1, 0)] + [(0, 0)] * (x_BTC.ndim - 2))
    if starts_BT is not None:
      seg = jnp.cumsum(starts_BT, axis=1)
      segp = jnp.pad(seg, [(0, 0), (K - 1, 0)], constant_values=-1)
      same = lambda k: (segp[:, k:k + T] == seg).reshape(seg.shape + (1,) * (x_BTC.ndim - 2))
      out = sum(jnp.where(same(k), xp[:, k:k + T], 0) * w_KC[k] for k in range(K))
      return out if b_C is None else out + b_C
  else:
    xp = jnp.concatenate([prev_BKC.astype(x_BTC.dtype), x_BTC], axis=1)
    if n_pad_B is not None:
      # Permute [prev, pads, real] to [pads, prev, real]: the zero pads then sit before the
      # stream and the K - 1 inputs before each real one are the true preceding inputs.
      i, n = jnp.arange(K - 1 + T), n_pad_B[:, None]
      src = jnp.where(i < n, i + K - 1, jnp.where(i < n + K - 1, i - n, i))
      xp = jax.vmap(lambda row, s: row[s])(xp, src)
  out = sum(xp[:, k:k + T] * w_KC[k] for k in range(K))
  out = out if b_C is None else out + b_C
  return out if prev_BKC is None else (out, xp[:, T:])


def init_state(c: ModelConfig, batch: int, dtype=None) -> dict:
  """Empty decode state: the last K - 1 conv inputs per stream and the SSM state (fp32)."""
  G, H, P, N, K = (c.mamba_n_groups, c.mamba_heads_per_group, c.mamba_head_dim, c.ssm_state_size,
                   c.conv_kernel)
  dt_ = jnp.dtype(dtype or c.compute_dtype)
  return {"conv_x": jnp.zeros((batch, K - 1, G, H, P), dt_),
          "conv_B": jnp.zeros((batch, K - 1, G, N), dt_),
          "conv_C": jnp.zeros((batch, K - 1, G, N), dt_),
          "ssm": jnp.zeros((batch, G, H, P, N), jnp.float32)}


def _kernel_ssd(xs, dt, A, Bm, Cm, chunk_size: int, h0, D, head_mask_GH):
  """The Pallas SSD kernel (`pallas_kernels.ssd.ssd`) on each token shard's own sequences
  (`token_shards.run`): GSPMD cannot partition a Mosaic or Triton call. The island is untyped
  (the kernel declares its outputs without shard_map's varying-axes types)."""
  rows = {"x": xs, "dt": dt, "B": Bm, "C": Cm, "h0": h0}
  whole = {"A": A, "D": D, "keep": head_mask_GH}

  def fn(r, w):
    out = ssd_kernel.ssd(r["x"], r["dt"], w["A"], r["B"], r["C"], chunk_size, r["h0"], w["D"],
                         w["keep"])
    return out, {}, {}

  return token_shards.run(fn, (rows,), (whole,), check_vma=False)[0]


def mamba2(p: dict, x_BTD, c: ModelConfig, head_mask_GH=None, *, ssd: str = "chunked",
           collect: bool = False, state=None, valid_BT=None, channel_mask_P=None,
           starts_BT=None):
  """Mamba-2 mixer forward on params `p`: (out [B,T,D], aux). `head_mask_GH` keeps a prefix of
  heads in each group, `channel_mask_P` a prefix of every head's channels (the SSD runs per
  channel, so dropping a channel is masking it in the output norm's statistic and output).

  aux["stats"]: with `collect`, {"x": sum_b (mean_t |x part of in_proj|)^2} of shape [G,H,P],
  "amax": {"out_proj": the largest |input| of out_proj}}, else None. aux["state"]: with a
  decode `state` (see `init_state`), the new state after the T tokens, else None.
  `valid_BT` False marks left padding (in each row, False entries precede True ones): padded
  tokens leave the conv and SSM state untouched (dt = 0), so a padded row computes what the
  unpadded one does, also when the padding follows earlier tokens in `state`.
  `starts_BT` (full sequences, `segment_packing`): True where a packed document begins; the
  conv and the SSM state restart there.
  """
  dt_ = jnp.dtype(c.compute_dtype)
  x_BTD = x_BTD.astype(dt_)
  proj = lambda w, spec: linear.einsum(spec, x_BTD, w, dt_)
  z = proj(p["in_z"], "btd,dghp->btghp")
  xs = proj(p["in_x"], "btd,dghp->btghp")
  Bm = proj(p["in_B"], "btd,dgn->btgn")
  Cm = proj(p["in_C"], "btd,dgn->btgn")
  dt_raw = proj(p["in_dt"], "btd,dgh->btgh")
  stats = {"x": channel_score(xs)} if collect else None
  if valid_BT is not None:
    keep = lambda v: jnp.where(valid_BT.reshape(valid_BT.shape + (1,) * (v.ndim - 2)), v, 0)
    xs, Bm, Cm = keep(xs), keep(Bm), keep(Cm)

  new_state = {}
  n_pad = None if valid_BT is None else jnp.sum(~valid_BT, axis=1)
  def conv(v, name):
    args = (v, p[name].astype(dt_), _opt(p, name + "_bias", dt_))
    if state is None:
      return jax.nn.silu(causal_conv(*args, starts_BT=starts_BT))
    out, new_state[name] = causal_conv(*args, prev_BKC=state[name], n_pad_B=n_pad)
    return jax.nn.silu(out)
  xs, Bm, Cm = conv(xs, "conv_x"), conv(Bm, "conv_B"), conv(Cm, "conv_C")

  lo, hi = c.time_step_limit
  dt = jnp.clip(jax.nn.softplus(dt_raw.astype(jnp.float32) + p["dt_bias"].astype(jnp.float32)), lo, hi)
  if valid_BT is not None:
    dt = jnp.where(valid_BT[..., None, None], dt, 0.0)
  A = -jnp.exp(p["A_log"].astype(jnp.float32))
  h0 = None if state is None else state["ssm"]
  if ssd not in SSD_IMPLS:
    raise ValueError(f"ssd must be one of {SSD_IMPLS}, got {ssd!r}")
  # One decode token is one recurrence step; the chunked form would pad it to a whole chunk.
  D = p["D"].astype(jnp.float32)
  if starts_BT is not None and c.kernels == "pallas":
    raise ValueError("segment_packing: the Pallas SSD kernel does not reset state at document "
                     "starts; use kernels='xla'")
  if ssd == "chunked" and xs.shape[1] > 1 and c.kernels == "pallas":
    # Heads a hard budget mask drops are skipped by the kernel; its output for them (D x only)
    # is masked below, as the reference's is.
    y, h = _kernel_ssd(xs, dt, A, Bm, Cm, c.chunk_size, h0, D, head_mask_GH)
  else:
    if ssd == "chunked" and xs.shape[1] > 1:
      y, h = ssd_chunked(xs, dt, A, Bm, Cm, c.chunk_size, initial_state=h0, starts_BT=starts_BT)
    else:
      y, h = ssd_sequential(xs, dt, A, Bm, Cm, initial_state=h0, starts_BT=starts_BT)
    y = y + D[..., None] * xs.astype(jnp.float32)
  new_state["ssm"] = h
  mask = head_mask_GH
  if channel_mask_P is not None:
    heads = jnp.ones(y.shape[2:4]) if head_mask_GH is None else head_mask_GH
    mask = heads.astype(jnp.float32)[..., None] * channel_mask_P.astype(jnp.float32)
  y = gated_group_rms_norm(y, z, p["norm"], c.norm_eps, mask).astype(dt_)
  if collect:
    stats["amax"] = {"out_proj": jnp.max(jnp.abs(y.astype(jnp.float32)))}
  out = linear.einsum("btghp,ghpd->btd", y, p["out_proj"], dt_)
  return out, {"stats": stats, "state": None if state is None else new_state}


def _opt(p, name, dtype):
  return p[name].astype(dtype) if name in p else None
