"""Elastic knowledge distillation losses (METHOD.md section 5).

Loss = forward KL(teacher || student) on logits at T = 1 (no student cross-entropy) plus
lambda x the router's budget loss. One budget per micro-batch; masks come from the router.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from elastic_jax.elastic import deploy
from elastic_jax.elastic import router as router_lib
from elastic_jax.config import ModelConfig
from elastic_jax.model.lm import lm_head
from elastic_jax.model.model import apply, apply_hidden


def forward_kl(teacher_logits, student_logits, weights=None):
  """Mean over tokens of KL(p_teacher || p_student), fp32; `weights` [B,T] masks tokens."""
  t = jax.nn.log_softmax(teacher_logits.astype(jnp.float32), -1)
  s = jax.nn.log_softmax(student_logits.astype(jnp.float32), -1)
  kl = jnp.sum(jnp.exp(t) * (t - s), -1)
  if weights is None:
    return jnp.mean(kl)
  return jnp.sum(kl * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def _chunks(x_BTX, chunk: int):
  """[n, B, chunk, ...] chunks of the sequence axis, the last one zero-padded."""
  B, T = x_BTX.shape[:2]
  n = -(-T // chunk)
  x = jnp.pad(x_BTX, [(0, 0), (0, n * chunk - T)] + [(0, 0)] * (x_BTX.ndim - 2))
  return jnp.moveaxis(x.reshape((B, n, chunk) + x_BTX.shape[2:]), 1, 0)


def chunked_forward_kl(teacher_BTD, student_BTD, teacher_head_DV, student_head_DV,
                       config: ModelConfig, chunk: int):
  """`forward_kl` of the two models' logits, computed `chunk` tokens at a time from their final
  hidden states and lm_heads: each chunk's [B, chunk, V] logits exist only inside its
  (rematerialised) scan step, so neither model's [B, T, V] logits are ever held."""
  B, T, _ = student_BTD.shape

  @jax.checkpoint
  def one(total, xs):
    t, s = xs   # zero-padded tokens give both models all-zero logits: KL 0
    t = jax.nn.log_softmax(lm_head(t, teacher_head_DV, config), -1)
    s = jax.nn.log_softmax(lm_head(s, student_head_DV, config), -1)
    return total + jnp.sum(jnp.exp(t) * (t - s)), None

  total, _ = jax.lax.scan(one, jnp.zeros((), jnp.float32),
                          (_chunks(teacher_BTD, chunk), _chunks(student_BTD, chunk)))
  return total / (B * T)


def chunked_cross_entropy(hidden_BTD, head_DV, targets_BT, config: ModelConfig, chunk: int):
  """Mean cross-entropy of `targets` under the logits of `hidden` x `head`, `chunk` tokens at
  a time (each chunk's [B, chunk, V] logits live only inside its rematerialised scan step)."""
  B, T, _ = hidden_BTD.shape
  valid = _chunks(jnp.ones((B, T), jnp.float32), chunk)   # the padded tail does not count

  @jax.checkpoint
  def one(total, xs):
    h, y, w = xs
    logp = jax.nn.log_softmax(lm_head(h, head_DV, config), -1)
    return total - jnp.sum(w * jnp.take_along_axis(logp, y[..., None], -1)[..., 0]), None

  total, _ = jax.lax.scan(one, jnp.zeros((), jnp.float32),
                          (_chunks(hidden_BTD, chunk), _chunks(targets_BT, chunk), valid))
  return total / (B * T)


def elastic_loss(params, router_params, teacher_logits, tokens, onehot, targets, step,
                 total_steps, key, *, config: ModelConfig, rc: router_lib.RouterConfig,
                 budget_weight: float = 1.0, hard_prob: float = 0.004, moe_impl: str = "dense",
                 teacher_lm_head=None, kd_chunk: int = 0, band=None):
  """(loss, metrics) for one micro-batch at one budget. `targets` are the budget's targets
  ({measure: fraction}, or one active fraction; see `router.budget_loss`).

  `band`: (combinations, in_band row) of the budget (`deploy.band_table`): adds
  `rc.band_weight` * -log P(in band) under the router's distribution, so its argmax, not only
  the architecture deployed, lands inside every band (metric "out_of_band").

  With `kd_chunk` > 0, `teacher_logits` is the teacher's final hidden states [B,T,D]
  (`model.apply_hidden`) and `teacher_lm_head` its head: the KD term runs `kd_chunk` tokens at
  a time (`chunked_forward_kl`), never holding full-vocabulary logits."""
  scale = router_lib.logit_scale(step, total_steps, rc)
  tau = router_lib.temperature(step, rc)
  logits = router_lib.logits(router_params, onehot, config, rc)
  k_hard, k_sample = jax.random.split(key)
  hard = jax.random.bernoulli(k_hard, hard_prob)
  probs, router_probs = {}, {}
  for (name, lg), k in zip(logits.items(), jax.random.split(k_sample, len(logits))):
    soft = router_lib.gumbel_softmax(lg * scale, tau, k)
    st = router_lib.straight_through(soft)  # = gumbel_softmax(..., hard=True), same sample
    probs[name] = jnp.where(hard, st, soft)
    router_probs[name] = jax.nn.softmax(lg * scale, -1)
  masks = router_lib.masks_from_probs(probs, config, "soft")
  if kd_chunk:
    student = apply_hidden(params, tokens, masks, config=config, moe_impl=moe_impl)
    kd = chunked_forward_kl(teacher_logits, student, teacher_lm_head, params["lm_head"], config,
                            kd_chunk)
  else:
    kd = forward_kl(teacher_logits, apply(params, tokens, masks, config=config, moe_impl=moe_impl))
  # The budget loss on the Gumbel sample (as the paper) meets KD's gradient where it acts;
  # the same loss on the argmax architecture (what is deployed, with the gradient of the
  # router's distribution pi) keeps pi's mode inside the band, where the sample-based term has
  # no gradient once the sample saturates to one-hot.
  bl = router_lib.budget_loss(probs, config, targets, rc)
  deployed = {n: router_lib.straight_through(p) for n, p in router_probs.items()}
  bl = bl + router_lib.budget_loss(deployed, config, targets, rc)
  metrics = {"kd": kd, "budget_loss": bl, "tau": tau, "scale": scale}
  if band is not None:
    combos, in_band = band
    nll = deploy.out_of_band_nll({n: lg * scale for n, lg in logits.items()}, config, rc,
                                 combos, in_band)
    bl = bl + rc.band_weight * nll
    metrics["out_of_band"] = nll
  return kd + budget_weight * bl, metrics
