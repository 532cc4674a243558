"""Per-budget evaluation of a nested family: sizes, validation loss / perplexity and generated
reasoning accuracy of each sliced sub-model, and the markdown table the main job prints."""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from elastic_jax.elastic.axes import AXES
from elastic_jax.config import ModelConfig
from elastic_jax.elastic.params_count import count_params
from elastic_jax.quant.tree import dequantize_params
from elastic_jax.training.phases import lm_loss
from elastic_jax.elastic.slicing import slice_params


_lm_loss = jax.jit(lm_loss, static_argnums=2)


def val_loss(params, config: ModelConfig, rows: np.ndarray, batch_size: int = 16) -> float:
  """Mean next-token cross-entropy over validation `rows` ([n, L+1]; a partial last batch is
  dropped only if there is more than one batch)."""
  n = len(rows) if len(rows) < batch_size else len(rows) // batch_size * batch_size
  if n == 0:
    raise ValueError("no validation rows")
  step = min(batch_size, n)
  losses = [float(_lm_loss(params, rows[i:i + step], config)) for i in range(0, n, step)]
  return float(np.mean(losses))


def answer_accuracy(params, config: ModelConfig, tokenizer, examples: Sequence[Mapping],
                    max_think_tokens: int, max_answer_tokens: int) -> float:
  """Exact match of the generated answer (greedy; think up to the cap, `</think>` forced there,
  then answer) against each example's gold answer."""
  from elastic_jax.inference import budget_control as bc
  from elastic_jax.inference.generate import SubModel
  if not examples:
    return float("nan")
  slc = SubModel(params, config)
  prompts = [bc.prompt_ids(tokenizer, ex["question"]) for ex in examples]
  results = bc.think_then_answer(slc, slc, prompts, max_think_tokens, max_answer_tokens,
                                 **bc.special_ids(tokenizer))
  hits = [bc.is_correct(tokenizer, r.answer, ex["answer"]) for r, ex in zip(results, examples)]
  return float(np.mean(hits))


def report(params, config: ModelConfig, budget_counts: Mapping[str, Mapping[str, Any]],
           val_rows, tokenizer, examples: Sequence[Mapping] = (), *,
           max_think_tokens: int = 48, max_answer_tokens: int = 8) -> list[dict]:
  """One row per budget: counts (of the elastic axes, those with more than one choice), total /
  active params and ratio, val loss / ppl, accuracy. `params` may be quantized (QTensor
  leaves): each budget is sliced from the quantized parent, then dequantized."""
  full = count_params(config)
  rows = []
  for name, counts in budget_counts.items():
    small, small_cfg = slice_params(params, config, counts)
    small = dequantize_params(small)
    pc = count_params(small_cfg)
    loss = val_loss(small, small_cfg, val_rows)
    acc = answer_accuracy(small, small_cfg, tokenizer, examples, max_think_tokens,
                          max_answer_tokens) if examples else float("nan")
    rows.append({"budget": name, "target": config.budget_fraction(name),
                 "targets": config.budget_targets(name),
                 "counts": {a: list(v) if isinstance(v, tuple) else int(v)
                            for a, v in counts.items() if len(AXES[a].choices(config)) > 1},
                 "total_params": pc.total, "active_params": pc.active,
                 "active_ratio": pc.active / full.active,
                 "total_ratio": pc.total / full.total, "val_loss": loss,
                 "val_ppl": math.exp(loss), "answer_acc": acc})
  return rows


def markdown_table(rows: Sequence[Mapping]) -> str:
  """The per-budget table (see `report`) as markdown: counts of the axes the rows carry."""
  axes = [a for a in AXES if any(a in r["counts"] for r in rows)]
  out = [f"| budget | target | counts ({', '.join(axes)}) | total params | active params | "
         "active ratio | val loss | val ppl | answer acc |",
         "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    counts = ", ".join(str(r["counts"].get(a, "-")) for a in axes)
    targets = r.get("targets") or {"active": r["target"]}
    target = (f"{r['target']:.2f}" if list(targets) == ["active"] else
              ", ".join(f"{m} {f:.2f}" for m, f in targets.items()))
    out.append(f"| {r['budget']} | {target} | {counts} | {r['total_params']:,} | "
               f"{r['active_params']:,} | {r['active_ratio']:.3f} | {r['val_loss']:.3f} | "
               f"{r['val_ppl']:.1f} | {r['answer_acc']:.3f} |")
  return "\n".join(out)
