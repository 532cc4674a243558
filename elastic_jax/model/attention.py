"""Causal GQA self-attention without positional encoding (NoPE), softmax in fp32.

Leaves: q [D,Hq,hd], k/v [D,Hkv,hd], o [Hq,hd,D]. Query heads are stored KV-group-minor: head
h = r * Hkv + g is the r-th query head of KV group g, so keeping the first r heads of every group
(the elastic "attention_heads" axis) is a prefix of the head dim. (HF's Nemotron-H orders them
group-major, h = g * rep + r; `io.hf` converts.)
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from elastic_jax.config import ModelConfig
from elastic_jax.model import initializers as init
from elastic_jax.model import linear
from elastic_jax.model import token_shards
from elastic_jax.model.norms import channel_score
from pallas_kernels import platform


class Attention(nn.Module):
  """GQA self-attention as a module; `__call__` returns (out, aux) like every mixer."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x_BTD, head_mask_H=None, *, state=None, pos=None, key_valid_BS=None,
               collect: bool = False, starts_BT=None):
    c = self.config
    D, Hq, Hkv, hd = c.hidden_size, c.num_attention_heads, c.num_kv_heads, c.head_dim
    lin = init.normal(c.initializer_range)
    out = init.normal(c.initializer_range / math.sqrt(c.num_layers))
    pd, qh, kvh = c.param_dtype, ("q_heads", "head_dim"), ("kv_heads", "head_dim")
    p = init.declare(self, {"q": ((D, Hq, hd), ("embed",) + qh, lin, pd),
                            "k": ((D, Hkv, hd), ("embed",) + kvh, lin, pd),
                            "v": ((D, Hkv, hd), ("embed",) + kvh, lin, pd),
                            "o": ((Hq, hd, D), qh + ("embed",), out, pd)})
    return attention(p, x_BTD, c, state, pos, key_valid_BS, head_mask_H, collect, starts_BT)


def attend(q_BTKRd, k_BSKd, v_BSKd, mask_TS):
  """Grouped attention core. q heads are [kv_head, rep]; mask_TS True = may attend: [T, S], or
  [B|1, 1, 1, T, S] (one mask per row, shared by the heads).

  The scores are laid out [B, K, R*T, S]: each KV head's queries (all R of its query heads) in
  one matmul against its keys, the softmax over the last axis, with no transpose of the score
  tensor anywhere (fp32 scores and softmax, GQA without repeating K and V; probabilities cast
  to V's dtype as `jax.nn.dot_product_attention` does). Forward and backward against that
  function's XLA implementation, which it replaced (median of 15, 2-core CPU, fp32): B4 T256
  with 2 x 2 heads 1.9-2.3 -> 1.5-1.8 ms forward, 7.3-7.9 -> 5.0-5.3 ms forward and backward;
  B8 T512 with 2 x 16 heads 186-199 -> 104-112 ms and 629-666 -> 363-388 ms; the scaled
  nano_v3 shape's whole B8 T512 forward 8.47 -> 7.99 s (the tiny train step: unchanged)."""
  B, T, K, R, d = q_BTKRd.shape
  S = k_BSKd.shape[1]
  if mask_TS.ndim == 5:
    if mask_TS.shape[1:3] != (1, 1):
      raise ValueError(f"attention mask {mask_TS.shape} varies over heads; expected "
                       "[B|1, 1, 1, T, S]")
    mask = mask_TS[:, 0, 0]
  else:
    mask = mask_TS[None]
  mask = jnp.broadcast_to(mask[:, None, None], (mask.shape[0], 1, R, T, S))
  mask = mask.reshape(mask.shape[0], 1, R * T, S)
  q = jnp.transpose(q_BTKRd, (0, 2, 3, 1, 4)).reshape(B, K, R * T, d)
  k, v = jnp.swapaxes(k_BSKd, 1, 2), jnp.swapaxes(v_BSKd, 1, 2)   # [B, K, S, d]
  s = jnp.einsum("bkqd,bksd->bkqs", q, k, preferred_element_type=jnp.float32) * (d ** -0.5)
  s = jnp.where(mask, s, jnp.finfo(jnp.float32).min)
  p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkqs,bksd->bkqd", p, v)
  return jnp.transpose(out.reshape(B, K, R, T, d), (0, 3, 1, 2, 4)).astype(q_BTKRd.dtype)


def attend_causal(q_BTKRd, k_BTKd, v_BTKd, block: int, seg_BT=None):
  """Causal attention of a full sequence, `block` queries at a time: each block's scores
  [block, T] live only inside its (rematerialised) step, so memory is linear in T. Equals
  `attend` with a lower-triangular mask; with `seg_BT` (document ids of packed rows), also
  within each document."""
  B, T = q_BTKRd.shape[:2]
  if T <= block:
    mask = jnp.tril(jnp.ones((T, T), bool))
    if seg_BT is not None:
      mask = (mask & (seg_BT[:, :, None] == seg_BT[:, None, :]))[:, None, None]
    return attend(q_BTKRd, k_BTKd, v_BTKd, mask)
  n = -(-T // block)
  q = jnp.pad(q_BTKRd, ((0, 0), (0, n * block - T)) + ((0, 0),) * 3)  # pad rows see all keys
  q_NBtKRd = jnp.moveaxis(q.reshape(B, n, block, *q.shape[2:]), 1, 0)
  col_S = jnp.arange(T)

  seg_pad = None if seg_BT is None else jnp.pad(seg_BT, ((0, 0), (0, n * block - T)))

  @jax.checkpoint
  def one(args):
    i, q_BtKRd = args
    mask = col_S[None, :] <= (i * block + jnp.arange(block))[:, None]
    if seg_pad is not None:
      rows = jax.lax.dynamic_slice_in_dim(seg_pad, i * block, block, axis=1)
      mask = (mask & (rows[:, :, None] == seg_BT[:, None, :]))[:, None, None]
    return attend(q_BtKRd, k_BTKd, v_BTKd, mask)

  out = jax.lax.map(one, (jnp.arange(n), q_NBtKRd))
  return jnp.moveaxis(out, 0, 1).reshape(B, n * block, *out.shape[3:])[:, :T]


SPLASH_LANES = 128   # splash's kv blocks are whole 128-lane tiles on a TPU


def attend_splash(q_BTKRd, k_BTKd, v_BTKd, block: int, seg_BT=None):
  """Causal attention through the TPU's splash kernel (`jax.experimental.pallas.ops.tpu.
  splash_attention`; run in Pallas' interpreter when building for CPU): a multi-query call per
  (batch row, KV head) over its R query heads, blocks of up to `block` queries and keys, fp32
  softmax inside the kernel, its own backward kernels; no [T, T] scores anywhere. Blocks are
  whole 128-lane tiles (`block` rounded up); T is padded to whole blocks (padded keys come
  after every real query, so the causal mask hides them); with `seg_BT` (document ids)
  queries attend within their document. On a mesh it runs per token shard
  (`token_shards.run`): XLA cannot partition a Mosaic call. Equals `attend_causal`."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
  B, T, K, R, d = q_BTKRd.shape
  lanes = lambda n: -(-n // SPLASH_LANES) * SPLASH_LANES
  blk = min(lanes(block), lanes(T))
  Tp = -(-T // blk) * blk
  sizes = sk.BlockSizes(block_q=blk, block_kv=blk, block_q_dkv=blk, block_kv_dkv=blk,
                        block_q_dq=blk, block_kv_dq=blk)
  kernel = sk.make_splash_mqa_single_device(
      sm.MultiHeadMask([sm.CausalMask((Tp, Tp))] * R), block_sizes=sizes,
      interpret=platform.current() == "cpu")
  pad = lambda a: jnp.pad(a, ((0, 0), (0, Tp - T)) + ((0, 0),) * (a.ndim - 2))
  rows = {"q": jnp.moveaxis(pad(q_BTKRd * (d ** -0.5)), 1, 3),     # [B, K, R, Tp, d]
          "k": jnp.moveaxis(pad(k_BTKd), 1, 2), "v": jnp.moveaxis(pad(v_BTKd), 1, 2),
          "seg": None if seg_BT is None else jnp.pad(seg_BT, ((0, 0), (0, Tp - T)),
                                                     constant_values=-1)}

  def fn(r):
    def one(q_RTd, k_Td, v_Td, seg_T):
      ids = None if seg_T is None else sk.SegmentIds(q=seg_T, kv=seg_T)
      return kernel(q_RTd, k_Td, v_Td, segment_ids=ids)
    per_head = jax.vmap(one, in_axes=(0, 0, 0, None))
    seg_axis = None if r["seg"] is None else 0
    out = jax.vmap(per_head, in_axes=(0, 0, 0, seg_axis))(r["q"], r["k"], r["v"], r["seg"])
    return out, {}, {}

  out_BKRTd = token_shards.run(fn, (rows,), (), check_vma=False)[0]
  return jnp.moveaxis(out_BKRTd, 3, 1)[:, :T].astype(q_BTKRd.dtype)


def init_state(c: ModelConfig, batch: int, max_len: int, dtype=None) -> dict:
  """Empty KV cache with room for `max_len` tokens."""
  shape = (batch, max_len, c.num_kv_heads, c.head_dim)
  dt_ = jnp.dtype(dtype or c.compute_dtype)
  return {"k": jnp.zeros(shape, dt_), "v": jnp.zeros(shape, dt_)}


def attention(p: dict, x_BTD, c: ModelConfig, state=None, pos=None, key_valid_BS=None,
              head_mask_H=None, collect: bool = False, starts_BT=None):
  """Causal attention on params `p`: (out [B,T,D], aux). With a KV cache `state` (see
  `init_state`), the T new tokens go to cache columns [pos, pos + T) and attend to every earlier
  column marked in `key_valid_BS` (which already covers the new columns); aux["state"] is then
  the new cache (else None). `head_mask_H` scales each query head's output (a hard prefix mask
  drops heads exactly as slicing them does). aux["stats"]: with `collect`, {"heads": the
  Minitron score of each head's output channels [Hq, hd], "amax": {"o": the largest |input| of
  the output projection}}, else None. `starts_BT` (full sequences, `segment_packing`): True
  where a packed document begins; queries attend within their own document."""
  dt_ = jnp.dtype(c.compute_dtype)
  x_BTD = x_BTD.astype(dt_)
  B, T, _ = x_BTD.shape
  Hkv, rep = c.num_kv_heads, c.num_attention_heads // c.num_kv_heads
  # Stored [rep, Hkv] (KV-group-minor); the attention core wants [Hkv, rep].
  q = linear.einsum("btd,dhk->bthk", x_BTD, p["q"], dt_).reshape(B, T, rep, Hkv, c.head_dim)
  q = jnp.swapaxes(q, 2, 3)
  k = linear.einsum("btd,dhk->bthk", x_BTD, p["k"], dt_)
  v = linear.einsum("btd,dhk->bthk", x_BTD, p["v"], dt_)
  seg = None if starts_BT is None or state is not None else jnp.cumsum(starts_BT, axis=1)
  if state is None and c.attention_impl == "dot_product":
    same = None if seg is None else (seg[:, :, None] == seg[:, None, :])[:, None]
    out = jax.nn.dot_product_attention(q.reshape(B, T, Hkv * rep, c.head_dim), k, v,
                                       mask=same, is_causal=True)
  elif state is None and c.attention_impl == "splash":
    out = attend_splash(q, k, v, c.attention_query_block, seg)
  elif state is None:
    out = attend_causal(q, k, v, c.attention_query_block, seg)
  else:
    put = lambda cache, new: jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype),
                                                          (0, pos, 0, 0))
    state = {"k": put(state["k"], k), "v": put(state["v"], v)}
    k, v = state["k"].astype(dt_), state["v"].astype(dt_)
    col_S = jnp.arange(k.shape[1])
    row_T = pos + jnp.arange(T)
    # A padding query keeps its own column so its softmax row is never empty (NaN-free).
    mask = ((key_valid_BS[:, None, :] & (col_S <= row_T[:, None])) | (col_S == row_T[:, None]))
    out = attend(q, k, v, mask[:, None, None])
  out = jnp.swapaxes(out.reshape(B, T, Hkv, rep, c.head_dim), 2, 3)
  out = out.reshape(B, T, c.num_attention_heads, c.head_dim)
  stats = {"heads": channel_score(out)} if collect else None
  if head_mask_H is not None:
    out = out * head_mask_H.astype(out.dtype)[:, None]
  if collect:
    stats["amax"] = {"o": jnp.max(jnp.abs(out.astype(jnp.float32)))}
  out = linear.einsum("bthk,hkd->btd", out, p["o"], dt_)
  return out, {"stats": stats, "state": state}
