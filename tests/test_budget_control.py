"""Think-then-answer (standard, elastic re-prefill, transplant) against a naive greedy re-run of
`apply`; families from a checkpoint; streaming; the generate CLI and the two experiment scripts
in reduced mode on a tiny random-weight checkpoint."""
import importlib.util
import json
import types
import io
import os
import re
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest

from elastic_jax.inference import budget_control as bc
from elastic_jax import from_counts, rng
from elastic_jax.io import checkpoint
from elastic_jax.inference import generate as G
from elastic_jax.training import data
from elastic_jax.training.data import train_tokenizer
from test_generate import CHUNK, MAX_LEN, SMALL, _toks, naive_greedy

EXPERIMENTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "experiments")
CAP, ANSWER = 4, 3
QUICK_LEN = 512   # one cache size for the quick experiment and the CLI test


def _naive_control(think, answer, prompt, end_think, eos):
  """Reference: greedy think (stop at </think> / eos or the cap), append </think>, answer."""
  out = naive_greedy(think.params, think.config, prompt, CAP + 1, think.masks,
                     stop=(end_think, eos))
  stop = next((j for j, t in enumerate(out) if t in (end_think, eos)), None)
  trace = out[:stop] if stop is not None and stop <= CAP else out[:CAP]
  capped = stop is None or stop > CAP
  ans = naive_greedy(answer.params, answer.config, prompt + trace + [end_think], ANSWER,
                     answer.masks, stop=(eos,))
  return trace, (ans[:-1] if ans and ans[-1] == eos else ans), capped


@pytest.fixture(scope="module")
def masked_family(cfg, params):
  return bc.Family(params, cfg, {"small": SMALL}, mode="masked")


def test_standard_and_elastic_match_naive(cfg, params, masked_family):
  toks = _toks(cfg)
  prompts = [list(toks[0, :6]), list(toks[1, :3])]
  full, small = masked_family.get("full"), masked_family.get("small")
  assert masked_family.get("small") is small and masked_family.names == ["full", "small"]
  # </think> := the first new token the small slice writes after its first on row 0, so one
  # trace ends by itself after `n_think` tokens.
  out = naive_greedy(params, cfg, prompts[0], CAP, from_counts(cfg, SMALL))
  n_think = next(j for j in range(1, CAP) if out[j] not in out[:j])
  end_think = out[n_think]
  eos = 0
  for think, answer, mode in ((full, full, "standard"), (small, full, "reprefill"),
                              (small, small, "standard")):
    streamed = [[], []]
    res = bc.think_then_answer(think, answer, prompts, CAP, ANSWER, end_think=end_think, eos=eos,
                               max_len=MAX_LEN, chunk=CHUNK,
                               on_token=lambda i, t: streamed[i].append(t))
    for p, r, s in zip(prompts, res, streamed):
      trace, ans, capped = _naive_control(think, answer, p, end_think, eos)
      assert (r.think, r.answer, r.capped, r.mode) == (trace, ans, capped, mode)
      assert s[:len(trace) + 1] == trace + [end_think]
    if think is small:
      assert not res[0].capped and len(res[0].think) == n_think


def test_transplant_sliced_equals_masked(cfg, params, masked_family):
  """Think large, answer small continuing its cache: sliced (heads truncated) == masked."""
  sliced = bc.Family(params, cfg, {"small": SMALL}, mode="sliced")
  toks = _toks(cfg)
  prompts = [list(toks[0, :6]), list(toks[1, :3])]
  res = [bc.think_then_answer(f.get("full"), f.get("small"), prompts, CAP, ANSWER,
                              continue_cache=True, max_len=MAX_LEN, chunk=CHUNK)
         for f in (sliced, masked_family)]
  for a, b in zip(*res):
    assert a.mode == b.mode == "transplant"
    assert (a.think, a.answer) == (b.think, b.answer)
    np.testing.assert_allclose(a.first_logits, b.first_logits, rtol=1e-4, atol=1e-4)


def test_errors(cfg, params, masked_family):
  full = masked_family.get("full")
  with pytest.raises(ValueError, match=r"unknown budget 'tiny'; allowed: \['full', 'small'\]"):
    masked_family.get("tiny")
  with pytest.raises(ValueError, match="unknown mode 'fast'"):
    bc.Family(params, cfg, {}, mode="fast")
  with pytest.raises(ValueError, match="max_think_tokens >= 0"):
    bc.think_then_answer(full, full, [[1, 5]], -1, 3)
  with pytest.raises(ValueError, match="mismatched slices: vocab"):
    bc.think_then_answer(full, G.SubModel(None, cfg.replace(vocab_size=32)), [[1, 5]], 2, 3)
  with pytest.raises(ValueError, match="cache overflow"):
    bc.think_then_answer(full, full, [[1, 5]], 12, 8, max_len=MAX_LEN, chunk=CHUNK)


def test_stream_printer():
  tok = train_tokenizer(["a b </think>c", "price 10"] * 4, 280)
  ids = tok.encode("x ü y </think>z").ids  # ü: two byte tokens, never merged
  one, many = io.StringIO(), io.StringIO()
  p1, p2 = bc.StreamPrinter(tok, 1, one), bc.StreamPrinter(tok, 2, many)
  partial = []
  for t in ids:
    p1(0, t)
    p2(1, t)
    partial.append(one.getvalue())
  p1.finish()
  p2.finish()
  assert one.getvalue() == "x ü y </think>z\n"
  assert all("\ufffd" not in s for s in partial) and len(set(partial)) > 3
  assert many.getvalue() == "[0] \n[1] x ü y </think>z\n\n"
  assert bc.is_correct(tok, tok.encode(" 10 ").ids, "10 ")
  assert not bc.is_correct(tok, tok.encode("10").ids, "1")


# ------------------------------------------------------------------ checkpoint, CLI, experiments
@pytest.fixture(scope="module")
def tiny_ckpt(cfg, params, tmp_path_factory):
  """A random-weight nested checkpoint with a real tokenizer (vocab 288 > the 261 byte-level
  base tokens); budgets full / small. The shared params' first three layers (M * E: quick
  to compile) with a larger vocab."""
  d = tmp_path_factory.mktemp("bc")
  tok = train_tokenizer(["Calculate 3 + 4 - 2.\n<think> 3 + 4 = 7 </think>5"] * 8, 288)
  tok.save(str(d / "tokenizer.json"))
  ccfg = cfg.replace(vocab_size=288, layer_pattern="M*E")
  rs = np.random.RandomState(0)
  params = {**params, "layers": {str(i): params["layers"][str(i)] for i in range(3)},
            "embed": rs.normal(0, 0.2, (288, cfg.hidden_size)).astype(np.float32),
            "lm_head": rs.normal(0, 0.2, (cfg.hidden_size, 288)).astype(np.float32)}
  return checkpoint.save(str(d / "nested"), params, ccfg, tokenizer=str(d / "tokenizer.json"),
                         budget_counts={"full": {}, "small": SMALL})


def test_slice_and_generate_refuse_stored_counts_outside_their_band(tiny_ckpt, tmp_path):
  """A trained family's checkpoint (router_config in its metadata) whose stored counts for a
  budget miss its targets: `slice` and the generation family refuse that name and serve the
  others; explicit counts still slice."""
  import dataclasses
  from elastic_jax import count_params
  from elastic_jax.elastic import router as R
  from elastic_jax.slice import run
  params, c = checkpoint.restore(tiny_ckpt)
  frac = count_params(c, SMALL).active / count_params(c).active
  c = c.replace(budgets=(("full", 1.0), ("ok", frac), ("bad", frac * 0.8)))
  path = checkpoint.save(str(tmp_path / "nested"), params, c,
                         tokenizer=checkpoint.tokenizer_file(tiny_ckpt),
                         budget_counts={"full": {}, "ok": SMALL, "bad": SMALL},
                         extra={"router_config": dataclasses.asdict(R.RouterConfig())})
  with pytest.raises(ValueError, match=r"budget 'bad': its stored counts .* are off its targets "
                                       r"by active \+25.0% \(band 5%\)"):
    run(path, "bad", str(tmp_path / "out"), "orbax")
  run(path, "ok", str(tmp_path / "out"), "orbax")
  run(path, SMALL, str(tmp_path / "out2"), "orbax")
  fam = bc.load_family(path)
  assert fam.get("ok").config.hidden_size == 24
  with pytest.raises(ValueError, match="budget 'bad': its stored counts"):
    fam.get("bad")


def test_load_family(tiny_ckpt):
  fam = bc.load_family(tiny_ckpt, mode="sliced")
  assert fam.names == ["full", "small"] and fam.get("small").config.hidden_size == 24
  with pytest.raises(ValueError, match=r"unknown budget 'big'; allowed: \['full', 'small'\]"):
    fam.get("big")
  ids = bc.prompt_ids(fam.tokenizer, "Calculate 3 + 4.")
  assert ids[0] == 1 and ids[-1] == 3 and bc.special_ids(fam.tokenizer) == {"end_think": 4,
                                                                             "eos": 2}
  with pytest.raises(ValueError, match="unknown mode"):
    bc.load_family(tiny_ckpt, mode="fast")


def _script(name):
  sys.path.insert(0, EXPERIMENTS)
  spec = importlib.util.spec_from_file_location(name, os.path.join(EXPERIMENTS, f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_budget_control_experiment_quick(tiny_ckpt, tmp_path):
  exp = _script("budget_control")
  front = exp.frontier([(3.0, 0.5), (1.0, 0.2), (2.0, 0.1), (4.0, 0.5), (2.5, 0.4)])
  assert front == [(1.0, 0.2), (2.5, 0.4), (3.0, 0.5)]
  cmp = exp.compare(front, [(0.5, 0.2), (2.0, 0.45)])
  assert cmp["acc_gain"] == pytest.approx((0.05, 2.5, 0.4)) and cmp["speedup"][:2] == (2.0, 1.0)
  rows = exp.run(tiny_ckpt, str(tmp_path), quick=True, max_len=QUICK_LEN)
  assert {r["kind"] for r in rows} == {"standard", "elastic", "transplant"}
  # One transplant row recomputed item by item outside the experiment: its accuracy, think
  # length and first-answer-logit cosine against the re-prefill are what the table reports.
  row = next(r for r in rows if r["kind"] == "transplant" and r["cap"] == 8)
  fam = bc.load_family(tiny_ckpt, mode="sliced")
  q, special = exp.QUICK, bc.special_ids(fam.tokenizer)
  items = data.reasoning_examples(q["n"], seed=10_000, sources=("chain_arithmetic",))  # no run
  assert all("[" in r for r in (l.split("|")[4] for l in
             (tmp_path / "budget_control.md").read_text().splitlines() if l.startswith("| st")))
  hits, think, cos = [], [], []
  for ex in items:
    prompt = bc.prompt_ids(fam.tokenizer, ex["question"])
    t, e = (bc.think_then_answer(fam.get(row["think"]), fam.get(row["answer"]), [prompt], 8,
                                 q["max_answer_tokens"], continue_cache=tr, max_len=QUICK_LEN,
                                 chunk=32, **special)[0] for tr in (True, False))
    hits.append(bc.is_correct(fam.tokenizer, t.answer, ex["answer"]))
    think.append(len(t.think))
    a, b = np.asarray(t.first_logits), np.asarray(e.first_logits)
    cos.append(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))))
  assert row["accuracy"] == np.mean(hits) and row["think_tokens"] == np.mean(think)
  assert row["cosine"] == pytest.approx(np.mean(cos), rel=1e-5)
  md = (tmp_path / "budget_control.md").read_text()
  assert md.count("\n| ") >= len(rows) and (tmp_path / "budget_control.png").stat().st_size > 0


def test_budget_control_intervals():
  exp = _script("budget_control")
  assert exp.wilson(30, 60) == pytest.approx((0.3773, 0.6227), abs=1e-4)   # textbook value
  assert exp.wilson(0, 60) == pytest.approx((0.0, 0.0602), abs=1e-4)
  # Every interval holds its proportion (the plot's error bars are never negative).
  assert all(exp.wilson(h, n)[0] <= h / n <= exp.wilson(h, n)[1]
             for n in range(1, 100) for h in range(n + 1))
  # elastic (answers every item at half the latency) dominates standard (answers none): every
  # resample gives gain 1 and latency ratio 2; a 50/50 item split gives an interval around 0.5.
  configs = [("standard", "full", "full", 0), ("elastic", "small", "full", 0)]
  boot = exp.bootstrap_compare(configs, [[0] * 40, [1] * 40], [[1.0] * 40, [0.5] * 40], 200)
  assert boot["elastic"]["acc_gain"] == (1.0, 1.0) and boot["elastic"]["speedup"] == (2.0, 2.0)
  assert boot["elastic"]["top_acc_gain"] == (1.0, 1.0) and boot["elastic"]["top_defined"] == (1, 1)
  # At standard's most accurate point (3.0, 0.9): elastic's best at <= 3.0 is 0.5 (-0.4); it
  # reaches 0.9 only at 4.0 (ratio 0.75); nothing at all when every elastic point is slower.
  top = exp.at_most_accurate([(1.0, 0.2), (3.0, 0.9)], [(0.5, 0.5), (4.0, 0.95)])
  assert top["point"] == (3.0, 0.9) and top["acc_gain"] == pytest.approx(-0.4)
  assert top["speedup"] == 0.75
  assert exp.at_most_accurate([(1.0, 0.9)], [(2.0, 0.5)]) == {"point": (1.0, 0.9),
                                                              "acc_gain": None, "speedup": None}
  assert "transplant" not in boot
  boot = exp.bootstrap_compare(configs, [[0] * 40, [0, 1] * 20], [[1.0] * 40, [0.5] * 40], 500)
  lo, hi = boot["elastic"]["acc_gain"]
  assert 0.2 < lo < 0.5 < hi < 0.8


def test_budget_control_items_are_the_runs_held_out(tmp_path):
  from elastic_jax.training import pipeline
  exp = _script("budget_control")
  (tmp_path / "nested").mkdir()
  ev = {"n_reasoning": 8, "sources": ["chain_arithmetic"]}
  (tmp_path / "run_config.json").write_text(json.dumps({"config": {"seed": 3}, "held_out": ev}))
  items, where = exp.held_out_items(str(tmp_path / "nested"), 5, None, ("chain_arithmetic",))
  run = types.SimpleNamespace(config=ml_collections.ConfigDict({"seed": 3, "eval": ev}))
  assert items == pipeline.held_out(run)[:5] and "seed 3" in where   # what its corpus excludes
  with pytest.raises(ValueError, match="n_reasoning=8"):
    exp.held_out_items(str(tmp_path / "nested"), 9, None, ("chain_arithmetic",))
  items, where = exp.held_out_items(str(tmp_path / "nested"), 5, 7, ("chain_arithmetic",))
  assert items == data.reasoning_examples(5, seed=7, sources=("chain_arithmetic",))


def test_decode_speed_experiment_quick(tmp_path):
  rows = _script("decode_speed").run(str(tmp_path), quick=True)
  assert [r["budget"] for r in rows] == ["30B-like", "23B-like", "12B-like"]
  for r in rows[1:]:   # each budget against the full model's measured speed
    assert r["decode_ratio"] == pytest.approx(r["decode_tok_s"] / rows[0]["decode_tok_s"])
  assert rows[2]["active_ratio"] < rows[1]["active_ratio"] < 1
  assert all(r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 for r in rows)
  assert (tmp_path / "decode_speed.md").read_text().count("\n| ") >= 4
  sweep = _script("decode_speed").moe_sweep(str(tmp_path), quick=True)
  assert [(r["batch"], r["assignments"]) for r in sweep] == [(1, 6), (4, 24)]
  for r in sweep:
    assert r["g_over_r"] == pytest.approx(r["gather_tok_s"] / r["ragged_tok_s"])
  assert (tmp_path / "moe_rule.md").read_text().count("\n| ") == 3   # header, two rows


def test_generate_cli_streams(tiny_ckpt):
  """Runs after the quick experiment: same slices and cache size, so the programs it compiled
  come from the persistent compilation cache."""
  r = subprocess.run([sys.executable, "-m", "elastic_jax.generate", f"--checkpoint={tiny_ckpt}",
                      "--think_budget=small", "--answer_budget=full", "--max_think_tokens=5",
                      "--max_answer_tokens=3", "--prompt=Calculate 3 + 4.",
                      f"--max_len={QUICK_LEN}"], capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "[small -> full, reprefill, sliced models]" in r.stderr
  # The trace is cut at the 5-token cap: </think> is forced there and the answer follows it.
  think = re.search(r"think (\d+) tokens(, capped)?", r.stderr)
  assert think and int(think.group(1)) <= 5
  assert think.group(2) is None or int(think.group(1)) == 5
  assert r.stdout.count("</think>") == 1


def test_generate_cli_masked_continue_cache_sampled(tiny_ckpt):
  """--mode=masked --transplant --temperature --seed --kernels=pallas: the CLI writes what
  `think_then_answer` writes on the masked family (XLA kernels) with that sampler and key (and
  not the greedy answer): the Pallas SSD, skipping the heads the small budget drops, changes
  nothing."""
  q = "Calculate 3 + 4."
  r = subprocess.run([sys.executable, "-m", "elastic_jax.generate", f"--checkpoint={tiny_ckpt}",
                      "--think_budget=small", "--answer_budget=full", "--max_think_tokens=6",
                      "--max_answer_tokens=4", f"--prompt={q}", f"--max_len={QUICK_LEN}",
                      "--mode=masked", "--transplant", "--temperature=1.5", "--seed=3",
                      "--kernels=pallas"],
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "[small -> full, transplant, masked parent]" in r.stderr
  fam = bc.load_family(tiny_ckpt, mode="masked")
  prompt, special = bc.prompt_ids(fam.tokenizer, q), bc.special_ids(fam.tokenizer)
  sampled, greedy = (bc.think_then_answer(fam.get("small"), fam.get("full"), [prompt], 6, 4,
                                          sampler=s, key=rng.key(3, "sampling"),
                                          continue_cache=True, max_len=QUICK_LEN, **special)[0]
                     for s in (G.Sampler(1.5), G.Sampler()))
  assert (sampled.think, sampled.answer) != (greedy.think, greedy.answer)
  answer = bc.answer_text(fam.tokenizer, sampled.answer)
  assert f"A: {answer!r} (think {len(sampled.think)} tokens" in r.stderr
