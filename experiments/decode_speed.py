"""Prefill and decode tokens/s per budget (sliced standalone sub-models) vs the full model, next
to each budget's active-parameter ratio (`elastic_jax.count_params`).

Random weights (speed does not depend on training) on the scaled Nemotron 3 Nano shape of
`scaled.py` (--quick: its reduced widths, three layers) in fp32 (CPU has no fast bf16 matmul).
Prefill: `generate.prefill` of a batch of prompts in one chunk; decode: `generate.decode` (the
jitted one-token step plus the host loop that streaming needs) for a fixed number of tokens.
Every budget is compiled first, then timed `--reps` times, budgets interleaved (median). MoE
dispatch: "auto" (`model.moe.choose_impl`) unless `--prefill_moe` / `--decode_moe` name one.

`--moe_sweep` measures instead what `choose_impl`'s CPU rule rests on: decode tokens/s with the
MoE forced to "gather" and to "ragged", in the whole on-device decode loop, per budget and batch
size (and at the tiny config), alternating which dispatch runs first; writes moe_rule.md.

  python experiments/decode_speed.py            # scaled nano_v3, a few minutes on 2 CPU cores
  python experiments/decode_speed.py --moe_sweep   # ~9 minutes (9 of the 52 layers)
  python experiments/decode_speed.py --quick [--moe_sweep]   # reduced shape, seconds (CI)
"""
from __future__ import annotations

import os
import statistics
import time


def time_prefill_decode(pre, dec, prompts, max_len: int, chunk: int, new_tokens: int):
  """Seconds for one prefill (slice `pre`) and for decoding `new_tokens` after it (`dec`)."""
  import jax

  from elastic_jax.inference import generate as G
  t0 = time.perf_counter()
  s = G.prefill(pre, prompts, max_len=max_len, chunk=chunk)
  jax.block_until_ready(s.logits)
  t1 = time.perf_counter()
  _, s = G.decode(dec, s, new_tokens)
  jax.block_until_ready(s.logits)
  return t1 - t0, time.perf_counter() - t1


def run(out: str, quick: bool = False, batch: int | None = None, prompt_len: int | None = None,
        new_tokens: int | None = None, reps: int | None = None, prefill_moe: str = "auto",
        decode_moe: str = "auto") -> list[dict]:
  """Measures every budget; prints and writes `out/decode_speed.md`; returns the rows."""
  import jax
  import numpy as np

  from elastic_jax import count_params
  from elastic_jax.inference import generate as G
  from scaled import paper_like_budgets, random_params, scaled_config

  cfg = scaled_config(reduced=quick).replace(param_dtype="float32", compute_dtype="float32")
  if quick:   # three layers, one of each kind: compiles in seconds
    cfg = cfg.replace(layer_pattern="M*E")
  batch = batch or (2 if quick else 4)
  prompt_len = prompt_len or (32 if quick else 128)
  new_tokens = new_tokens or (8 if quick else 32)
  reps = reps or (1 if quick else 5)
  params = random_params(cfg)
  prompts = np.random.RandomState(0).randint(5, cfg.vocab_size, (batch, prompt_len)).tolist()
  max_len = prompt_len + new_tokens
  full = count_params(cfg)
  slices = {}
  for name, counts in paper_like_budgets(cfg).items():
    pre = G.standalone(params, cfg, counts, name, moe_impl=prefill_moe)
    slices[name] = (counts, pre, G.SubModel(pre.params, pre.config, None, name, moe_impl=decode_moe))
    time_prefill_decode(pre, slices[name][2], prompts, max_len, prompt_len, new_tokens)  # compile
  # Budgets interleaved within each repetition, so a load change on a shared machine hits all.
  times = {name: [] for name in slices}
  for _ in range(reps):
    for name, (_, pre, dec) in slices.items():
      times[name].append(time_prefill_decode(pre, dec, prompts, max_len, prompt_len, new_tokens))
  rows = []
  for name, (counts, pre, _) in slices.items():
    pc = count_params(pre.config)
    t_pre = statistics.median(t for t, _ in times[name])
    t_dec = statistics.median(t for _, t in times[name])
    rows.append({"budget": name, "counts": counts or "full", "active_params": pc.active,
                 "active_ratio": pc.active / full.active, "total_ratio": pc.total / full.total,
                 "prefill_tok_s": batch * prompt_len / t_pre,
                 "decode_tok_s": batch * new_tokens / t_dec})
  for r in rows:
    r["prefill_ratio"] = r["prefill_tok_s"] / rows[0]["prefill_tok_s"]
    r["decode_ratio"] = r["decode_tok_s"] / rows[0]["decode_tok_s"]
  head = (f"Decode speed per budget, {cfg.num_layers} layers, hidden {cfg.hidden_size}, fp32, "
          f"{jax.devices()[0].platform} ({os.cpu_count()} cores), batch {batch}, prompt "
          f"{prompt_len}, {new_tokens} new tokens, MoE dispatch {prefill_moe} (prefill) / "
          f"{decode_moe} (decode), median of {reps}.")
  table = ["| budget | active params | active ratio | total ratio | prefill tok/s | "
           "prefill speed-up | decode tok/s | decode speed-up | 1 / active ratio |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    table.append(f"| {r['budget']} | {r['active_params']:,} | {r['active_ratio']:.3f} | "
                 f"{r['total_ratio']:.3f} | "
                 f"{r['prefill_tok_s']:,.0f} | {r['prefill_ratio']:.2f}x | "
                 f"{r['decode_tok_s']:,.1f} | {r['decode_ratio']:.2f}x | "
                 f"{1 / r['active_ratio']:.2f}x |")
  _write(out, "decode_speed.md", "Decode speed", head, table)
  return rows


def _write(out: str, name: str, title: str, head: str, table: list[str]) -> None:
  """Prints `head` and the markdown `table`; writes both under `# title` to `out/name`."""
  text = head + "\n\n" + "\n".join(table) + "\n"
  print(text)
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, name), "w") as f:
    f.write(f"# {title}\n\n" + text)


# The sweep's stack: nano_v3's block mix (Mamba, MoE, one attention layer) in 9 of its 52 layers,
# so the MoE's share of a decode step is the full stack's while compiles take a fifth as long.
SWEEP_PATTERN = "MEM*EMEME"


def moe_sweep(out: str, quick: bool = False, batches=None, reps: int | None = None,
              new_tokens: int | None = None, prompt_len: int = 64) -> list[dict]:
  """Decode tokens/s with the MoE forced to "gather" and to "ragged" per (shape, batch):
  the scaled budgets and the tiny config (quick: the reduced shape's full budget). Prints and
  writes `out/moe_rule.md`; returns the rows (with g_over_r = gather / ragged tokens/s)."""
  import jax
  import numpy as np

  from configs.tiny import MODEL as TINY
  from elastic_jax.inference import generate as G
  from scaled import paper_like_budgets, random_params, scaled_config

  batches = tuple(batches or ((1, 4) if quick else (1, 2, 4, 8, 16)))
  reps = reps or (1 if quick else 7)
  new_tokens = new_tokens or (4 if quick else 32)
  fp32 = dict(param_dtype="float32", compute_dtype="float32")
  scaled = scaled_config(reduced=quick).replace(
      layer_pattern="M*E" if quick else SWEEP_PATTERN, **fp32)
  shapes = [(scaled, paper_like_budgets(scaled))]
  if quick:
    shapes[0] = (scaled, {"30B-like": {}})
  else:
    shapes.append((TINY.replace(**fp32), {"tiny": {}}))
  rows = []
  for cfg, budgets in shapes:
    params = random_params(cfg)
    for name, counts in budgets.items():
      pre = G.standalone(params, cfg, counts, name)
      c = pre.config
      decs = {impl: G.SubModel(pre.params, c, None, name, moe_impl=impl)
              for impl in ("gather", "ragged")}
      for B in batches:
        prompts = np.random.RandomState(0).randint(5, cfg.vocab_size, (B, prompt_len)).tolist()
        timed = lambda dec: time_prefill_decode(pre, dec, prompts, prompt_len + new_tokens,
                                                prompt_len, new_tokens)[1]
        for dec in decs.values():
          timed(dec)   # compile
        t = {impl: [] for impl in decs}
        for rep in range(reps):
          for impl in (("gather", "ragged") if rep % 2 else ("ragged", "gather")):
            t[impl].append(timed(decs[impl]))
        tok_s = {impl: B * new_tokens / statistics.median(v) for impl, v in t.items()}
        rows.append({"shape": name, "experts": c.n_routed_experts, "k": c.num_experts_per_tok,
                     "hidden": c.hidden_size, "expert_width": c.moe_intermediate_size,
                     "batch": B, "assignments": B * c.num_experts_per_tok,
                     "gather_tok_s": tok_s["gather"], "ragged_tok_s": tok_s["ragged"],
                     "g_over_r": tok_s["gather"] / tok_s["ragged"]})
        print(f"  {name} B{B}: gather {tok_s['gather']:,.1f} ragged {tok_s['ragged']:,.1f} "
              f"tok/s", flush=True)
  head = (f"Decode tokens/s by MoE dispatch, whole on-device decode loop, fp32, "
          f"{jax.devices()[0].platform} ({os.cpu_count()} cores), prompt {prompt_len}, "
          f"{new_tokens} new tokens, median of {reps} (dispatches alternating first); scaled "
          f"shapes in {scaled.num_layers} layers ({scaled.layer_pattern}).")
  table = ["| shape | experts | k | hidden | expert width | batch | T*k | gather tok/s | "
           "ragged tok/s | gather / ragged |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    table.append(f"| {r['shape']} | {r['experts']} | {r['k']} | {r['hidden']} | "
                 f"{r['expert_width']} | {r['batch']} | {r['assignments']} | "
                 f"{r['gather_tok_s']:,.1f} | {r['ragged_tok_s']:,.1f} | {r['g_over_r']:.2f} |")
  _write(out, "moe_rule.md", "MoE dispatch in decode: gather vs ragged", head, table)
  return rows


def main(argv):
  del argv
  from absl import flags
  F = flags.FLAGS
  if F.moe_sweep:
    moe_sweep(F.out, F.quick, F.batches and [int(b) for b in F.batches], F.reps, F.new_tokens)
    return
  run(F.out, F.quick, F.batch, F.prompt_len, F.new_tokens, F.reps, F.prefill_moe, F.decode_moe)


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_string("out", "runs/decode_speed", "where to write decode_speed.md")
  flags.DEFINE_bool("quick", False, "reduced shape and counts (CI)")
  flags.DEFINE_integer("batch", None, "prompts per batch (default 4; quick 2)")
  flags.DEFINE_integer("prompt_len", None, "prompt tokens (default 128; quick 32)")
  flags.DEFINE_integer("new_tokens", None, "decoded tokens per row (default 32; quick 8)")
  flags.DEFINE_integer("reps", None, "timed repetitions (default 5; quick 1)")
  flags.DEFINE_enum("prefill_moe", "auto", ["auto", "dense", "ragged", "gather"],
                    "MoE dispatch, prefill")
  flags.DEFINE_enum("decode_moe", "auto", ["auto", "dense", "ragged", "gather"],
                    "MoE dispatch, decode")
  flags.DEFINE_bool("moe_sweep", False, "gather vs ragged decode per shape and batch instead")
  flags.DEFINE_list("batches", None, "the sweep's batch sizes (default 1,2,4,8,16; quick 1,4)")
  app.run(main)
