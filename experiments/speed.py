"""Side by side with transformers' PyTorch Nemotron-H on this machine's CPU (issue 18): prefill,
decode and a training step, on the same random weights through our HF export; then decode per
budget (masked parent and sliced sub-model) against the active-parameter ratio.

Shapes: the tiny config (`configs.tiny`) and the scaled Nemotron 3 Nano of `scaled.py` (all 52
layers, hidden 336, 32 experts top-6, vocab 16K), both fp32 (CPU has no fast bf16 matmul) with
transformers' dt clamp `(time_step_min, inf)` so the two compute the same function: the logits
are compared first and the run stops if they differ. Weights: `scaled.random_params`, written by
`io.hf.save_pretrained` and read by `NemotronHForCausalLM.from_pretrained`.

Cells (ours / transformers, both greedy, the cache built by both):
- prefill B x T: `generate.prefill` in one chunk / `model(ids, use_cache=True, logits_to_keep=1)`;
- decode B of N tokens after a T-token prompt (prefill untimed): `generate.decode` (the jitted
  step and the host loop streaming needs) / a loop of `model(next, cache=cache)`;
- train step B x T: next-token cross-entropy, backward, AdamW update, jitted with donated state
  / `loss.backward(); optimizer.step()`.
Ours dispatches the MoE with `--moe_impl` ("auto": `model.moe.choose_impl`). Like the CLIs, the
process restarts itself with glibc's malloc on transparent huge pages (ELASTIC_JAX_HUGE_PAGES=0
off) and with ELASTIC_JAX_KEEP_HOST_MEMORY=1 keeps freed host memory (`elastic_jax.host_memory`;
both sides gain or lose by either); the train table names the setting and counts the step's page
faults. torch uses as many threads as XLA's CPU client (every core); the two are interleaved within
each repetition (one untimed warm-up each, which also compiles ours; `TRAIN_WARMUP` for the train
cells, which a full run times at least `TRAIN_REPS` times), and the median is reported. A ratio
above 1 means ours is faster.

  python experiments/speed.py            # tiny and scaled, about 20 minutes on 2 CPU cores
  python experiments/speed.py --quick    # tiny shape, small cells, one repetition (CI)
"""
from __future__ import annotations

import math
import os
import resource
import statistics
import tempfile
import time

from decode_speed import time_prefill_decode
from timing import matmul_peak

# (batch, prompt tokens) of the prefill cells, (batch, new tokens) of the decode cells, and the
# train step's (batch, tokens), full and quick.
CELLS = {False: {"prefill": [(1, 128), (1, 512), (8, 128), (8, 512)], "decode": [(1, 64), (8, 64)],
                 "train": [(4, 256)], "prompt": 128},
         True: {"prefill": [(1, 16), (2, 32)], "decode": [(2, 4)], "train": [(2, 16)],
                "prompt": 8}}


def configs(quick: bool) -> dict:
  """{name: fp32 ModelConfig with transformers' dt clamp}: tiny, and scaled unless `quick`."""
  from configs.tiny import MODEL
  from scaled import scaled_config
  shapes = {"tiny": MODEL} if quick else {"tiny": MODEL, "scaled": scaled_config(False)}
  return {n: c.replace(param_dtype="float32", compute_dtype="float32",
                       time_step_limit=(c.time_step_min, math.inf)) for n, c in shapes.items()}


def hf_model(params, cfg, folder: str):
  """transformers' NemotronHForCausalLM holding `params` (fp32, eval mode)."""
  import torch
  import transformers

  from elastic_jax.io import hf
  hf.save_pretrained(folder, params, cfg, overwrite=True)
  return transformers.NemotronHForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def check_logits(params, cfg, model, T: int = 32) -> float:
  """Max |ours - transformers| over the logits of one random sequence; raises when it exceeds
  1e-4 of the largest logit (fp32 on both sides: equal up to summation order)."""
  import jax
  import numpy as np
  import torch

  from elastic_jax import apply
  ids = np.random.RandomState(1).randint(5, cfg.vocab_size, (1, T)).astype(np.int32)
  ours = np.asarray(jax.jit(apply, static_argnames=("config", "moe_impl"))(
      params, ids, config=cfg, moe_impl="dense"))
  with torch.inference_mode():
    ref = model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
  diff = float(np.abs(ours - ref).max())
  if diff > 1e-4 * float(np.abs(ref).max()):
    raise RuntimeError(f"logits differ from transformers by {diff:.3g}: not the same model")
  return diff


def train_flops(cfg, B: int, T: int) -> float:
  """Model FLOPs of one training step on B x T tokens, PaLM's count: 6 x (active parameters
  without the input embedding) per token, plus 12 x T x heads x head_dim per token per attention
  layer (scores and values, forward and backward); the Mamba scan's own FLOPs are left out."""
  from elastic_jax import count_params
  n_attn = cfg.layer_pattern.count("*")
  per_token = (6 * count_params(cfg).active_without_embedding
               + 12 * n_attn * T * cfg.num_attention_heads * cfg.head_dim)
  return float(per_token * B * T)


def _prompts(cfg, B: int, T: int, seed: int = 0):
  import numpy as np
  return np.random.RandomState(seed).randint(5, cfg.vocab_size, (B, T)).astype(np.int32)


def prefill_timer(sub, prompts, T: int):
  """A timer of prefilling the T-token `prompts` with `sub` in one chunk."""
  return lambda: time_prefill_decode(sub, sub, prompts, T + 1, T, 0)[0]


def decode_timer(sub, prompts, P: int, N: int):
  """A timer of decoding N tokens per row with `sub` after the P-token `prompts` (the prefill
  runs untimed)."""
  return lambda: time_prefill_decode(sub, sub, prompts, P + N + 1, P, N)[1]


def _hf_cache(out):
  return getattr(out, "cache", None) or getattr(out, "past_key_values", None)


def ours_cells(params, cfg, moe_impl: str, cells: dict) -> dict:
  """{(kind, B, T): timer} for our model; a timer runs once and returns its seconds."""
  from elastic_jax.inference import generate as G
  sub = G.SubModel(params, cfg, moe_impl=moe_impl)
  timers = {}
  for B, T in cells["prefill"]:
    timers[("prefill", B, T)] = prefill_timer(sub, list(_prompts(cfg, B, T)), T)
  P = cells["prompt"]
  for B, N in cells["decode"]:
    timers[("decode", B, N)] = decode_timer(sub, list(_prompts(cfg, B, P)), P, N)
  for B, T in cells["train"]:
    timers[("train", B, T)] = train_timer(params, cfg, moe_impl, B, T)
  return timers


def train_timer(params, cfg, moe_impl: str, B: int, T: int):
  """A timer of one train step on B x T tokens (next-token cross-entropy, AdamW, jitted with
  donated state, on a copy of `params` in the stacked layout); its `faults` list gets the
  host's minor page faults of each call."""
  import jax

  from elastic_jax.model.model import to_stack_layout
  from elastic_jax.training import optim, phases
  x = _prompts(cfg, B, T + 1)
  opt = optim.adamw(1e-4, 1000, 0)
  step = phases.train_step(lambda p, x: (phases.lm_loss(p, x, cfg, moe_impl=moe_impl), {}), opt)
  stacked = to_stack_layout(params, cfg)
  box = {"state": {"params": jax.tree.map(lambda a: a.copy(), stacked), "opt": opt.init(stacked)}}

  def train():
    faults, t = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    box["state"], m = step(box["state"], x)
    jax.block_until_ready(m["loss"])
    t = time.perf_counter() - t
    train.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
    return t
  train.faults = []
  return train


def port_cells(params, cfg, cells: dict) -> dict:
  """Decode timers of the plain-jnp reference port (`reference_port.py`): prefill untimed, then
  N jitted steps, each token's argmax fed back on device (no host sync per token; ours syncs
  once per block of `generate.DECODE_BLOCK` steps under a stop rule, and per token when
  streaming)."""
  import jax
  import jax.numpy as jnp

  import reference_port as R
  timers, P = {}, cells["prompt"]
  for B, N in cells["decode"]:
    ids = jnp.asarray(_prompts(cfg, B, P))

    def decode(ids=ids, B=B, N=N):
      logits, cache = R.prefill(params, cfg, ids, R.init_cache(cfg, B, P + N + 1))
      jax.block_until_ready(logits)
      t = time.perf_counter()
      for pos in range(P, P + N):
        logits, cache = R.decode_step(params, cfg, jnp.argmax(logits, -1).astype(jnp.int32),
                                      cache, pos)
      jax.block_until_ready(logits)
      return time.perf_counter() - t
    timers[("decode", B, N)] = decode
  return timers


def hf_cells(model, cfg, cells: dict) -> dict:
  """The same cells for transformers' model (timers as `ours_cells`)."""
  import torch
  timers = {}
  for B, T in cells["prefill"]:
    ids = torch.tensor(_prompts(cfg, B, T), dtype=torch.long)

    def prefill(ids=ids):
      with torch.inference_mode():
        t = time.perf_counter()
        model(ids, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - t
    timers[("prefill", B, T)] = prefill
  P = cells["prompt"]
  for B, N in cells["decode"]:
    ids = torch.tensor(_prompts(cfg, B, P), dtype=torch.long)

    def decode(ids=ids, N=N):
      with torch.inference_mode():
        out = model(ids, use_cache=True, logits_to_keep=1)
        t = time.perf_counter()
        for _ in range(N):
          nxt = out.logits[:, -1].argmax(-1, keepdim=True)
          out = model(nxt, cache=_hf_cache(out), use_cache=True)
        return time.perf_counter() - t
    timers[("decode", B, N)] = decode
  for B, T in cells["train"]:
    ids = torch.tensor(_prompts(cfg, B, T + 1), dtype=torch.long)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train(ids=ids, opt=opt):
      model.train()
      t = time.perf_counter()
      opt.zero_grad(set_to_none=True)
      model(ids, labels=ids).loss.backward()
      opt.step()
      dt = time.perf_counter() - t
      model.eval()
      return dt
    timers[("train", B, T)] = train
  return timers


TRAIN_WARMUP = 5   # untimed steps per side before a train cell's timed ones
TRAIN_REPS = 25    # timed steps per side of a full run's train cells (at least)


def interleaved(timers: dict[str, callable], reps: int, warmup: int = 1) -> dict[str, float]:
  """Median seconds of each timer over `reps` rounds, after `warmup` untimed calls each (the first
  compiles ours); the timers alternate within each round so that a change of load on a shared
  machine hits all."""
  for f in timers.values():
    for _ in range(warmup):
      f()
  times = {n: [] for n in timers}
  for _ in range(reps):
    for n, f in timers.items():
      times[n].append(f())
  return {n: statistics.median(v) for n, v in times.items()}


def side_by_side(name: str, cfg, params, moe_impl: str, quick: bool, reps: int,
                 folder: str) -> tuple[list[dict], float]:
  """Every cell of one shape, ours against transformers: (rows, logit difference)."""
  model = hf_model(params, cfg, folder)
  diff = check_logits(params, cfg, model)
  cells = CELLS[quick]
  ours, ref = ours_cells(params, cfg, moe_impl, cells), hf_cells(model, cfg, cells)
  port = port_cells(params, cfg, cells)
  rows = []
  for key in ours:   # one cell at a time: every side's compiled state and caches stay small
    timers = {"ours": ours[key], "hf": ref[key]}
    if key in port:
      timers["port"] = port[key]
    kind, B, T = key
    # A training run is its steady state: ours' first 2-4 steps after the compile ran 40-70%
    # slower than the rest here (94, 86, 77, 81 ms, then 55-57), so both sides warm up longer;
    # and this VM's noise comes in bursts of several steps, so a full run times more of them.
    train = kind == "train"
    n = max(reps, TRAIN_REPS) if train and not quick else reps
    t = interleaved(timers, n, TRAIN_WARMUP if train else 1)
    faults = getattr(ours[key], "faults", None)
    rows.append({"shape": name, "cell": kind, "B": B, "T": T, "ours_s": t["ours"],
                 "hf_s": t["hf"], "ratio": t["hf"] / t["ours"], "port_s": t.get("port"),
                 "faults": statistics.median(faults) if faults else None, "reps": n})
    print(f"  {name} {kind} B{B} {'N' if kind == 'decode' else 'T'}{T}: ours "
          f"{t['ours']:.3f} s, transformers {t['hf']:.3f} s, {t['hf'] / t['ours']:.2f}x" +
          (f"; plain-jnp port {t['port']:.3f} s" if "port" in t else ""), flush=True)
  return rows, diff


def budgets(cfg, params, moe_impl: str, quick: bool, reps: int) -> list[dict]:
  """Decode tokens/s of the full model, and per budget of the masked parent and the sliced
  sub-model, against the active-parameter ratio (`count_params`)."""
  from elastic_jax import count_params
  from elastic_jax.inference import generate as G
  from scaled import paper_like_budgets
  B, P, N = (2, 8, 4) if quick else (4, 128, 32)
  prompts = list(_prompts(cfg, B, P))
  timer = lambda sub: decode_timer(sub, prompts, P, N)

  full = count_params(cfg).active
  subs, timers = {}, {}
  for name, counts in paper_like_budgets(cfg).items():
    sliced = G.standalone(params, cfg, counts, name, moe_impl=moe_impl)
    subs[name] = count_params(sliced.config).active / full
    timers[(name, "sliced")] = timer(sliced)
    if counts:
      timers[(name, "masked")] = timer(G.parent_at_budget(params, cfg, counts, name,
                                                          moe_impl=moe_impl))
  t = interleaved(timers, reps)
  base = t[("30B-like", "sliced")]
  rows = []
  for name, active in subs.items():
    for mode in ("masked", "sliced"):
      if (name, mode) in t:
        speed = base / t[(name, mode)]
        rows.append({"budget": name, "mode": mode, "active_ratio": active,
                     "decode_tok_s": B * N / t[(name, mode)], "speedup": speed,
                     "of_ideal": speed * active})
  return rows


def report(shape_rows: list[dict], diffs: dict, budget_rows: list[dict], moe_impl: str,
           reps: int, peak: float | None = None, cfgs: dict | None = None,
           host_memory_mode: str = "glibc's default") -> str:
  """The markdown tables (and the header naming the machine and settings)."""
  import jax
  import torch
  import transformers
  head = (f"Ours (jax {jax.__version__}, MoE dispatch `{moe_impl}`) against transformers "
          f"{transformers.__version__} `NemotronHForCausalLM` (torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads), fp32, {os.cpu_count()} CPU cores, same weights "
          f"(max logit difference: " + ", ".join(f"{n} {d:.1e}" for n, d in diffs.items()) +
          f"), median of {reps}. Ratio = transformers' time / ours (above 1: ours is faster).")
  lines = [head, "", "| shape | cell | batch | tokens | ours s | transformers s | ratio |",
           "|---|---|---:|---:|---:|---:|---:|"]
  for r in shape_rows:
    what = f"{r['T']} new" if r["cell"] == "decode" else str(r["T"])
    lines.append(f"| {r['shape']} | {r['cell']} | {r['B']} | {what} | {r['ours_s']:.3f} | "
                 f"{r['hf_s']:.3f} | {r['ratio']:.2f}x |")
  decode = [r for r in shape_rows if r.get("port_s")]
  if decode:
    lines += ["", "Decode against a plain-jnp reference port of the same model "
              "(`reference_port.py`: no masks, no padding, no host sync per token; same weights, "
              "same tokens), tokens/s; ratio = port's time / ours (above 1: ours is faster):", "",
              "| shape | batch | new tokens | ours tok/s | port tok/s | ratio |",
              "|---|---:|---:|---:|---:|---:|"]
    for r in decode:
      n = r["B"] * r["T"]
      lines.append(f"| {r['shape']} | {r['B']} | {r['T']} | {n / r['ours_s']:,.0f} | "
                   f"{n / r['port_s']:,.0f} | {r['port_s'] / r['ours_s']:.2f}x |")
  train = [r for r in shape_rows if r["cell"] == "train"]
  if peak and train and cfgs:
    lines += ["", f"Training steps against this CPU's measured fp32 matmul rate "
              f"({peak / 1e9:.1f} GFLOP/s, median of 10 jitted 1024 x 1024 products; model FLOPs: "
              f"`train_flops`); host memory: {host_memory_mode} (`host_memory`), the host's "
              f"minor page faults per step; median of {train[0]['reps']} steps per side after "
              f"{TRAIN_WARMUP} untimed ones:", "",
              "| shape | batch | tokens | ours tok/s | ours GFLOP/s | of peak | page faults "
              "| transformers tok/s | transformers of peak |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in train:
      f = train_flops(cfgs[r["shape"]], r["B"], r["T"])
      lines.append(f"| {r['shape']} | {r['B']} | {r['T']} | {r['B'] * r['T'] / r['ours_s']:,.0f} "
                   f"| {f / r['ours_s'] / 1e9:.1f} | {f / r['ours_s'] / peak:.1%} | "
                   f"{r['faults']:,.0f} | {r['B'] * r['T'] / r['hf_s']:,.0f} | "
                   f"{f / r['hf_s'] / peak:.1%} |")
  if budget_rows:
    lines += ["", "Decode per budget (ours; speed-up over the full model; ideal = 1 / active "
              "ratio; of ideal = speed-up x active ratio, target >= 0.9 for sliced):", "",
              "| budget | mode | active ratio | decode tok/s | speed-up | ideal | of ideal |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for r in budget_rows:
      lines.append(f"| {r['budget']} | {r['mode']} | {r['active_ratio']:.3f} | "
                   f"{r['decode_tok_s']:,.1f} | {r['speedup']:.2f}x | "
                   f"{1 / r['active_ratio']:.2f}x | {r['of_ideal']:.2f} |")
  return "\n".join(lines) + "\n"


def run(out: str, quick: bool = False, reps: int | None = None, moe_impl: str = "auto",
        shapes: tuple[str, ...] = (), host_memory_mode: str = "glibc's default"
        ) -> tuple[list[dict], list[dict]]:
  """Runs every cell; prints and writes `out/speed.md`; returns (cell rows, budget rows).
  `host_memory_mode`: this process's malloc setting (`malloc_setting`; the report names it)."""
  import torch

  from scaled import random_params
  reps = reps or (1 if quick else 3)
  torch.set_num_threads(len(os.sched_getaffinity(0)))   # XLA:CPU's pool spans these cores
  rows, diffs, budget_rows = [], {}, []
  cfgs = {n: c for n, c in configs(quick).items() if not shapes or n in shapes}
  with tempfile.TemporaryDirectory() as folder:
    for name, cfg in cfgs.items():
      params = random_params(cfg)
      print(f"{name}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
            f"{cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}", flush=True)
      r, diffs[name] = side_by_side(name, cfg, params, moe_impl, quick, reps, folder)
      rows += r
      if name == ("tiny" if quick else "scaled"):
        budget_rows = budgets(cfg, params, moe_impl, quick, reps)
  import jax.numpy as jnp
  peak = matmul_peak(jnp.float32, 1024, 10) * 1e12   # FLOP/s
  text = report(rows, diffs, budget_rows, moe_impl, reps, peak, cfgs, host_memory_mode)
  print(text)
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "speed.md"), "w") as f:
    f.write("# Speed against transformers\n\n" + text)
  return rows, budget_rows


def malloc_setting(kept: bool) -> str:
  """This process's malloc setting in words: huge pages (`host_memory.huge_pages_active`) and /
  or the kept heap (`kept`: `keep_freed_memory` applied), else glibc's default."""
  from elastic_jax import host_memory
  parts = (["transparent huge pages (`glibc.malloc.hugetlb=1`)"]
           if host_memory.huge_pages_active() else []) + (["freed memory kept"] if kept else [])
  return " and ".join(parts) or "glibc's default"


def main(argv):
  del argv
  from absl import flags

  from elastic_jax import host_memory
  host_memory.restart_with_huge_pages()   # as the CLIs do (exec, once)
  kept = host_memory.keep_freed_memory()   # opt-in, as for the CLIs; before jax starts
  F = flags.FLAGS
  run(F.out, F.quick, F.reps, F.moe_impl, tuple(F.shapes or ()), malloc_setting(kept))


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_string("out", "runs/speed", "where to write speed.md")
  flags.DEFINE_bool("quick", False, "tiny shape, small cells, one repetition (CI)")
  flags.DEFINE_integer("reps", None, "timed repetitions (default 3; quick 1)")
  flags.DEFINE_enum("moe_impl", "auto", ["auto", "dense", "ragged", "gather"], "our MoE dispatch")
  flags.DEFINE_list("shapes", None, "only these shapes (tiny, scaled); default all")
  app.run(main)
