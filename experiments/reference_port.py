"""A compact plain-jax.numpy port of Nemotron-H for inference: what a straightforward JAX port
looks like, kept as the speed baseline for our decode (`speed.py`).

Pure functions over our canonical params pytree ({"embed" [V,D], "layers": {"0": {"norm":
{"scale"}, "mixer": {...}}, ...}, "final_norm": {"scale"}, "lm_head" [D,V]}). No Flax, budget
masks, padding or sharding, and none of our model code: the math is written out here
(`tests/test_reference_port.py` checks it against `elastic_jax.apply`). Numerics follow ours: an
fp32 residual stream, norms, router, dt and SSM state in fp32, matmuls in `cfg.compute_dtype`.
Layer widths are read from the params, so a sliced sub-model (with its config) runs too.

  cache = init_cache(cfg, B, max_len)
  logits_BV, cache = prefill(params, cfg, ids_BT, cache)           # the prompt, from position 0
  logits_BV, cache = decode_step(params, cfg, tok_B, cache, pos)   # cache donated
  new_BN = greedy(params, cfg, ids_BT, n_new, max_len)
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from elastic_jax.config import ModelConfig

F32 = jnp.float32


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> list:
  """One entry per layer: a KV cache of `max_len` columns ('*'); the last K-1 conv inputs and
  the SSM state [B,G,H,P,N] in fp32 ('M'); {} for MoE / MLP layers."""
  dt, cache = jnp.dtype(cfg.compute_dtype), []
  for i, kind in enumerate(cfg.layer_pattern):
    c = cfg.layer_config(i)
    G, H, P, N = c.mamba_n_groups, c.mamba_heads_per_group, c.mamba_head_dim, c.ssm_state_size
    K, kv = c.conv_kernel, (batch, max_len, c.num_kv_heads, c.head_dim)
    if kind == "M":
      cache.append({"conv_x": jnp.zeros((batch, K - 1, G, H, P), dt),
                    "conv_B": jnp.zeros((batch, K - 1, G, N), dt),
                    "conv_C": jnp.zeros((batch, K - 1, G, N), dt),
                    "ssm": jnp.zeros((batch, G, H, P, N), F32)})
    elif kind == "*":
      cache.append({"k": jnp.zeros(kv, dt), "v": jnp.zeros(kv, dt)})
    else:
      cache.append({})
  return cache


def rms_norm(x, scale, eps):
  """RMSNorm over the last dim, in fp32."""
  x = x.astype(F32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale.astype(F32)


def relu2(x):
  return jnp.square(jax.nn.relu(x))


def conv_silu(x_BTC, w_KC, b_C, prev_BKC):
  """SiLU of the depthwise causal conv of x continuing `prev` (the K-1 inputs before it);
  returns (out, the last K-1 inputs). Channel dims after T may have any shape."""
  K, T = w_KC.shape[0], x_BTC.shape[1]
  xp = jnp.concatenate([prev_BKC, x_BTC], 1)
  return jax.nn.silu(sum(xp[:, k:k + T] * w_KC[k] for k in range(K)) + b_C), xp[:, T:]


def ssm_step(h_BGHPN, inp, A_GH, D_GH):
  """One Mamba-2 recurrence step (fp32): h = exp(dt A) h + dt x B^T; y = h C + D x."""
  x, dt, Bm, Cm = inp   # [B,G,H,P], [B,G,H], [B,G,N], [B,G,N]
  h = (jnp.exp(dt * A_GH)[..., None, None] * h_BGHPN
       + (dt[..., None] * x)[..., None] * Bm[:, :, None, None, :])
  return h, jnp.einsum("bghpn,bgn->bghp", h, Cm) + D_GH[..., None] * x


def mamba(p, x_BTD, cfg: ModelConfig, st):
  """Mamba-2 mixer (split in_proj, causal conv, SSM, gated group RMSNorm) continuing state `st`."""
  dt_ = x_BTD.dtype
  w = lambda n: p[n].astype(dt_)
  proj = lambda n, spec: jnp.einsum(spec, x_BTD, w(n))
  z, xs = proj("in_z", "btd,dghp->btghp"), proj("in_x", "btd,dghp->btghp")
  Bm, Cm = proj("in_B", "btd,dgn->btgn"), proj("in_C", "btd,dgn->btgn")
  new = {}
  conv = lambda v, n: conv_silu(v, w(n), w(n + "_bias") if n + "_bias" in p else 0, st[n])
  (xs, new["conv_x"]), (Bm, new["conv_B"]), (Cm, new["conv_C"]) = (
      conv(xs, "conv_x"), conv(Bm, "conv_B"), conv(Cm, "conv_C"))
  dt = jax.nn.softplus(proj("in_dt", "btd,dgh->btgh").astype(F32) + p["dt_bias"].astype(F32))
  dt = jnp.clip(dt, *cfg.time_step_limit)
  step = functools.partial(ssm_step, A_GH=-jnp.exp(p["A_log"].astype(F32)),
                           D_GH=p["D"].astype(F32))
  seq = [a.astype(F32) for a in (xs, dt, Bm, Cm)]
  if x_BTD.shape[1] == 1:   # decode: one step, no loop
    new["ssm"], y = step(st["ssm"], [a[:, 0] for a in seq])
    y = y[:, None]
  else:                     # prefill: the recurrence as a scan over time
    new["ssm"], y = jax.lax.scan(step, st["ssm"], [jnp.moveaxis(a, 1, 0) for a in seq])
    y = jnp.moveaxis(y, 0, 1)
  g = y * jax.nn.silu(z.astype(F32))   # gated RMSNorm per group, over its heads x head dim
  g = g * jax.lax.rsqrt(jnp.mean(g * g, (-2, -1), keepdims=True) + cfg.norm_eps)
  g = (g * p["norm"].astype(F32)).astype(dt_)
  return jnp.einsum("btghp,ghpd->btd", g, w("out_proj")), new


def attention(p, x_BTD, st, pos):
  """Causal GQA attention without positional encoding; the T new tokens' K and V go to cache
  columns [pos, pos + T). Query head h = r * Hkv + g reads KV head g."""
  dt_ = x_BTD.dtype
  B, T, _ = x_BTD.shape
  Hq, hd = p["q"].shape[1:]
  Hkv = p["k"].shape[1]
  q = jnp.einsum("btd,dhk->bthk", x_BTD, p["q"].astype(dt_)).reshape(B, T, Hq // Hkv, Hkv, hd)
  put = lambda c, n: jax.lax.dynamic_update_slice(
      c, jnp.einsum("btd,dhk->bthk", x_BTD, p[n].astype(dt_)).astype(c.dtype), (0, pos, 0, 0))
  k, v = put(st["k"], "k"), put(st["v"], "v")
  s = jnp.einsum("btrgk,bsgk->bgrts", q, k.astype(dt_), preferred_element_type=F32)
  s = s / math.sqrt(hd)
  causal = jnp.arange(k.shape[1])[None, :] <= (pos + jnp.arange(T))[:, None]
  a = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), -1).astype(dt_)
  o = jnp.einsum("bgrts,bsgk->btrgk", a, v.astype(dt_)).reshape(B, T, Hq, hd)
  return jnp.einsum("bthk,hkd->btd", o, p["o"].astype(dt_)), {"k": k, "v": v}


def moe(p, x_BTD, cfg: ModelConfig):
  """Sigmoid router (fp32) whose correction bias only selects; top-k gates normalised and times
  `routed_scaling_factor`; squared-ReLU experts plus the shared expert."""
  dt_ = x_BTD.dtype
  B, T, D = x_BTD.shape
  x = x_BTD.reshape(B * T, D)
  E, k = p["up"].shape[0], cfg.num_experts_per_tok
  scores = jax.nn.sigmoid(x.astype(F32) @ p["router"].astype(F32))
  _, idx = jax.lax.top_k(scores + p["router_bias"].astype(F32), k)
  g = jnp.take_along_axis(scores, idx, -1)
  if cfg.norm_topk_prob:
    g = g / (jnp.sum(g, -1, keepdims=True) + 1e-20)
  g = (g * cfg.routed_scaling_factor).astype(dt_)
  up, down = p["up"].astype(dt_), p["down"].astype(dt_)
  if B * T * k <= E:   # a few tokens (decode): gather each token's k experts
    y = jnp.einsum("tkf,tkfd->tkd", relu2(jnp.einsum("td,tkdf->tkf", x, up[idx])), down[idx])
    routed = jnp.einsum("tk,tkd->td", g, y)
  else:                # many tokens (prefill): every expert on every token, gate-weighted
    gate_TE = jnp.sum(jax.nn.one_hot(idx, E, dtype=dt_) * g[..., None], 1)
    y = jnp.einsum("tef,efd->ted", relu2(jnp.einsum("td,edf->tef", x, up)), down)
    routed = jnp.einsum("te,ted->td", gate_TE, y)
  shared = relu2(x @ p["shared_up"].astype(dt_)) @ p["shared_down"].astype(dt_)
  return (routed + shared).reshape(B, T, D)


def forward(params, cfg: ModelConfig, ids_BT, cache, pos):
  """(last position's logits [B,V] fp32, new cache): the T tokens continue the cache at `pos`."""
  dt_ = jnp.dtype(cfg.compute_dtype)
  x = params["embed"][ids_BT].astype(F32)
  new = []
  for i, kind in enumerate(cfg.layer_pattern):
    layer, st = params["layers"][str(i)], cache[i]
    h = rms_norm(x, layer["norm"]["scale"], cfg.norm_eps).astype(dt_)
    p = layer["mixer"]
    if kind == "M":
      out, st = mamba(p, h, cfg, st)
    elif kind == "*":
      out, st = attention(p, h, st, pos)
    elif kind == "E":
      out = moe(p, h, cfg)
    else:   # '-': dense squared-ReLU MLP
      out = relu2(h @ p["up"].astype(dt_)) @ p["down"].astype(dt_)
    x = x + out.astype(F32)
    new.append(st)
  x = rms_norm(x[:, -1], params["final_norm"]["scale"], cfg.norm_eps).astype(dt_)
  head = params["lm_head"] if "lm_head" in params else params["embed"].T   # tied: embed^T
  return jnp.einsum("bd,dv->bv", x, head.astype(dt_), preferred_element_type=F32), new


@functools.partial(jax.jit, static_argnames="cfg", donate_argnames="cache")
def prefill(params, cfg: ModelConfig, ids_BT, cache):
  """The prompt [B,T] into a fresh cache: (last logits [B,V] fp32, cache)."""
  return forward(params, cfg, ids_BT, cache, 0)


@functools.partial(jax.jit, static_argnames="cfg", donate_argnames="cache")
def decode_step(params, cfg: ModelConfig, tok_B, cache, pos):
  """One token per row at position `pos` (the tokens already in the cache): (logits, cache)."""
  return forward(params, cfg, tok_B[:, None], cache, pos)


def greedy(params, cfg: ModelConfig, ids_BT, n_new: int, max_len: int):
  """[B, n_new] int32 greedy tokens after the prompt: prefill, then a host loop of steps."""
  ids_BT = jnp.asarray(ids_BT, jnp.int32)
  B, T = ids_BT.shape
  logits, cache = prefill(params, cfg, ids_BT, init_cache(cfg, B, max_len))
  out = [jnp.argmax(logits, -1).astype(jnp.int32)]
  for pos in range(T, T + n_new - 1):
    logits, cache = decode_step(params, cfg, out[-1], cache, pos)
    out.append(jnp.argmax(logits, -1).astype(jnp.int32))
  return jnp.stack(out, 1)
