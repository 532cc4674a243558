"""`ElasticLM`: embed -> layer stack (a Python loop, or one scanned and rematerialised unit) ->
final RMSNorm -> lm_head, taking `BudgetMasks` as data.

Parameter layouts (plain nested dicts, unboxed):
- loop (the canonical layout: what Orbax stores, slicing cuts and HF interop reads):
  {"embed": [V,D], "layers": {"0": {"norm": {"scale": [D]}, "mixer": {...}}, ..., "51": ...},
   "final_norm": {"scale": [D]}, "lm_head": [D,V]};
- scan: "layers" keeps the plan's head and tail blocks under their layer index and holds the
  unit's slots under "units" ({"0": slot 0 stacked over units, ...}; see `stack_plan`);
  `layouts.to_scanned` / `layouts.from_scanned` convert.
Decode caches are explicit inputs and outputs (loop only). Returns (logits [B,T,V] fp32, aux):
aux["stats"] one dict of calibration statistics per layer when `collect`, aux["cache"] the new
cache when one is given.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from elastic_jax.config import ModelConfig
from elastic_jax.model import initializers as init
from elastic_jax.model.block import Block
from elastic_jax.model.budget_masks import BudgetMasks
from elastic_jax.model.norms import RMSNorm
from elastic_jax.model.stack_plan import StackPlan, plan_stack

STACKS = ("loop", "scan")
REMAT_POLICIES = {"none": None, "full": jax.checkpoint_policies.nothing_saveable,
                  "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}
# Which BudgetMasks field each layer kind reads (per-layer fields, one row per layer of the kind).
LAYER_MASK_FIELDS = {"M": ("mamba_heads", "mamba_head_dim"), "E": ("moe_experts", "moe_ffn"),
                     "*": ("attention_heads",), "-": ()}


def layer_masks(masks: BudgetMasks, pattern: str) -> list[dict[str, Any]]:
  """One dict per layer: {field: this layer's mask row (or None)} for the fields its kind reads."""
  seen = {k: 0 for k in LAYER_MASK_FIELDS}
  out = []
  for i, kind in enumerate(pattern):
    out.append({f: masks.layer(f, seen[kind]) for f in LAYER_MASK_FIELDS[kind]})
    if masks.depth is not None:   # one entry per layer of any kind
      out[-1]["depth"] = masks.depth[i]
    seen[kind] += 1
  return out


def declare_globals(m: nn.Module, c: ModelConfig) -> dict:
  """The parameters outside the layer stack that are plain leaves (embed, lm_head)."""
  std = init.normal(c.initializer_range)
  return init.declare(m, {"embed": ((c.vocab_size, c.hidden_size), ("vocab", "embed"), std,
                                    c.param_dtype),
                          "lm_head": ((c.hidden_size, c.vocab_size), ("embed", "vocab"), std,
                                      c.param_dtype)})


def _remat(cls, policy: str):
  if policy not in REMAT_POLICIES:
    raise ValueError(f"remat must be one of {list(REMAT_POLICIES)}, got {policy!r}")
  if policy == "none":
    return cls
  return nn.remat(cls, policy=REMAT_POLICIES[policy], prevent_cse=False)


class _Unit(nn.Module):
  """One repeat of the plan's unit: its slots in order; absent optional slots are skipped.
  The scanned stack rematerialises whole units (`remat` here is "none" then): one saved
  residual per unit instead of one per block (at nano_v3 stage 2 on fsdp:64, three [23, B, T,
  D] fp32 stacks, 36 GiB per device, became one)."""
  config: ModelConfig
  plan: StackPlan
  moe_impl: str
  ssd: str
  remat: str

  @nn.compact
  def __call__(self, x, xs, hidden_mask):
    present_S, masks_S = xs
    block = _remat(Block, self.remat)
    for s, (kind, optional) in enumerate(zip(self.plan.slots, self.plan.optional)):
      blk = block(self.config, kind, self.moe_impl, self.ssd, name=str(s))
      if optional and not self.is_initializing():
        x = nn.cond(present_S[s], lambda mdl, x, m: mdl(x, m, hidden_mask)[0],
                    lambda mdl, x, m: x, blk, x, masks_S[s])
      else:
        x, _ = blk(x, masks_S[s], hidden_mask)
    return x, None


class ElasticLM(nn.Module):
  """The hybrid Mamba-2 / attention / MoE causal LM (Nemotron-H) with budget masks.

  `stack="scan"` needs a homogeneous config whose pattern has a plan (`plan_stack`); it serves
  training and full-sequence inference (no decode cache, no `collect`). `remat` applies to every
  block (to every unit of the scanned stack): "none", "full" (save nothing) or "save_dots"
  (keep matmul outputs).
  """
  config: ModelConfig
  stack: str = "loop"
  remat: str = "none"
  moe_impl: str = "dense"
  ssd: str = "chunked"
  collect: bool = False
  # True: logits [B,T,V]; "last": the last position's only, [B,1,V] (decoding needs no more);
  # False: the final (normed, masked) hidden states instead of logits.
  head: bool | str = True

  @nn.compact
  def __call__(self, tokens_BT, masks: BudgetMasks | None = None, *, cache=None, valid_BT=None):
    c = self.config
    masks = masks if masks is not None else BudgetMasks()
    p = declare_globals(self, c)
    hm = masks.hidden
    x = p["embed"][tokens_BT].astype(jnp.float32)
    if hm is not None:
      x = x * hm
    if self.stack not in STACKS:
      raise ValueError(f"stack must be one of {STACKS}, got {self.stack!r}")
    if self.stack == "scan" and (cache is not None or self.collect):
      raise ValueError("stack='scan' runs full sequences only: use stack='loop' for decode "
                       "caches and calibration statistics")
    per_layer = layer_masks(masks, c.layer_pattern)
    if c.segment_packing and cache is None:   # each layer also reads where documents start
      starts = tokens_BT == c.bos_token_id
      per_layer = [{**m, "doc_starts": starts} for m in per_layer]
    x, stats, new_layers = _Layers(c, self.stack, self.remat, self.moe_impl, self.ssd,
                                   self.collect, name="layers")(
        x, per_layer, hm, cache, valid_BT)
    x = RMSNorm(c.hidden_size, c.norm_eps, c.param_dtype, name="final_norm")(x, hm)
    if self.head == "last":
      x = x[:, -1:]
    out = lm_head(x, p["lm_head"], c) if self.head else x
    return out, {"stats": stats,
                 "cache": None if cache is None else {**cache, "layers": new_layers}}


def lm_head(x_BTD, w_DV, c: ModelConfig):
  """Logits [..., V] in fp32 from final hidden states (matmul in `compute_dtype`)."""
  dt_ = jnp.dtype(c.compute_dtype)
  # As rows [N, D]: the weight gradient then contracts one dim (see `linear.rows_einsum`).
  x_ND = x_BTD.reshape(-1, x_BTD.shape[-1]).astype(dt_)
  logits = jnp.einsum("nd,dv->nv", x_ND, w_DV.astype(dt_), preferred_element_type=jnp.float32)
  return logits.reshape(x_BTD.shape[:-1] + logits.shape[-1:])


class _Layers(nn.Module):
  """The layer stack; its blocks are named by layer index ("0".."L-1"), the scanned unit "units"."""
  config: ModelConfig
  stack: str
  remat: str
  moe_impl: str
  ssd: str
  collect: bool

  @nn.compact
  def __call__(self, x, per_layer, hm, cache, valid_BT):
    if self.stack == "scan":
      return self._scan(x, per_layer, hm), None, None
    stats, new_layers = [], []
    for i in range(self.config.num_layers):
      blk = self._block(i)
      if cache is None:
        x, aux = blk(x, per_layer[i], hm)
      else:
        x, aux = blk(x, per_layer[i], hm, cache["layers"][i], cache["pos"], cache["key_valid"],
                     valid_BT)
      stats.append(aux["stats"])
      # Stateless mixers (MoE, MLP) keep their empty cache entry.
      new_layers.append(aux["state"] if aux["state"] is not None else
                        (None if cache is None else cache["layers"][i]))
    return x, (stats if self.collect else None), new_layers

  def _block(self, i: int):
    c = self.config
    return _remat(Block, self.remat)(c.layer_config(i), c.layer_pattern[i], self.moe_impl,
                                     self.ssd, self.collect, name=str(i))

  def _scan(self, x, per_layer, hm):
    c = self.config
    plan = plan_stack(c.layer_pattern)
    if plan is None or not c.is_homogeneous:
      raise ValueError(f"stack='scan' needs a homogeneous config with a repeating pattern; "
                       f"{c.layer_pattern!r} (homogeneous={c.is_homogeneous}) runs as a loop")
    for i in plan.head:
      x, _ = self._block(i)(x, per_layer[i], hm)
    present = jnp.asarray([[i is not None for i in unit] for unit in plan.units])
    masks_S = [_stack_rows([per_layer[i] if i is not None else None for i in col],
                           per_layer[next(i for i in col if i is not None)])
               for col in zip(*plan.units)]
    unit = nn.scan(_remat(_Unit, self.remat), variable_axes={"params": 0},
                   split_rngs={"params": True}, in_axes=(0, nn.broadcast),
                   length=plan.num_units, metadata_params={nn.PARTITION_NAME: "layers"})
    x, _ = unit(c, plan, self.moe_impl, self.ssd, "none", name="units")(
        x, (present, masks_S), hm)
    for i in plan.tail:
      x, _ = self._block(i)(x, per_layer[i], hm)
    return x


def _stack_rows(rows, template):
  """Stacks per-layer mask dicts over units; an absent slot gets its slot's first real row."""
  rows = [template if r is None else r for r in rows]
  return jax.tree.map(lambda *a: jnp.stack(a), *rows)
