"""The main job: parent -> importance + nesting -> elastic KD with the budget router -> one nested
checkpoint -> per-budget report.

  python -m elastic_jax.train --workdir=runs/tiny            # tiny default, embedded corpus
  python -m elastic_jax.train --hf_dir=/local/nemotron_h ... # start from a HF parent

Not yet: Orbax CheckpointManager with exact mid-run resume, TensorBoard summaries and the
two-context-length stage schedule beyond a shorter/longer sequence switch (see issue notes).
"""
from __future__ import annotations

import json
import math
import os
import time

from absl import app, flags

flags.DEFINE_string("config", "tiny", "model preset in configs/")
flags.DEFINE_string("workdir", "runs/tiny", "output directory")
flags.DEFINE_string("hf_dir", None, "start from this local Nemotron-H parent instead of pretraining")
flags.DEFINE_list("data_files", [], "local .txt/.jsonl files instead of the embedded corpus")
flags.DEFINE_integer("pretrain_steps", 300, "parent pretraining steps (ignored with --hf_dir)")
flags.DEFINE_integer("stage1_steps", 150, "elastic KD steps at --seq_len, uniform budgets")
flags.DEFINE_integer("stage2_steps", 50, "elastic KD steps at 2 x --seq_len, p = 0.5/0.3/0.2")
flags.DEFINE_integer("batch", 16, "sequences per step")
flags.DEFINE_integer("seq_len", 64, "stage-1 / pretraining sequence length")
flags.DEFINE_float("lr", 3e-3, "parent pretraining learning rate")
flags.DEFINE_float("kd_lr", 1e-3, "elastic model learning rate")
flags.DEFINE_float("router_lr", 1e-2, "router learning rate")
flags.DEFINE_float("p_full", 0.33, "probability of the full budget in stage 1")
flags.DEFINE_integer("seed", 0, "seed")
flags.DEFINE_integer("log_every", 25, "steps between progress lines")
FLAGS = flags.FLAGS


def _log(path, record):
  with open(path, "a") as f:
    f.write(json.dumps(record) + "\n")


def _check_finite(value, what, step):
  if not math.isfinite(value):
    raise FloatingPointError(f"{what} is {value} at step {step}; lower the learning rate or check "
                             "the data (no checkpoint was written from this state)")


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from absl import logging
  logging.set_verbosity(logging.ERROR)  # Orbax warns per small chunk

  from configs import model_config
  from elastic_jax import apply, checkpoint, count_params, data, hf, init
  from elastic_jax import router as R
  from elastic_jax.distill import elastic_loss
  from elastic_jax.importance import compute_importance
  from elastic_jax.nesting import nest
  from elastic_jax.slicing import slice_params

  os.makedirs(FLAGS.workdir, exist_ok=True)
  metrics_path = os.path.join(FLAGS.workdir, "metrics.jsonl")
  t_start = time.perf_counter()
  # ---------------------------------------------------------------- data + tokenizer
  if FLAGS.hf_dir:
    cfg, params = hf.load_pretrained(FLAGS.hf_dir)
  else:
    cfg, params = model_config(FLAGS.config), None
  docs = data.local_corpus(FLAGS.data_files) if FLAGS.data_files else data.default_corpus(seed=FLAGS.seed)
  held_out = data.reasoning_examples(64, seed=FLAGS.seed + 1000)
  tok_path = os.path.join(FLAGS.workdir, "tokenizer.json")
  tok = data.train_tokenizer(docs, cfg.vocab_size)
  tok.save(tok_path)
  ids = [e.ids for e in tok.encode_batch(docs)]
  rows = {L: data.pack(ids, L) for L in (FLAGS.seq_len, 2 * FLAGS.seq_len)}
  n_val = max(FLAGS.batch, len(rows[FLAGS.seq_len]) // 20)
  val = jnp.asarray(rows[FLAGS.seq_len][:n_val])
  train_iters = {L: iter(data.make_dataset(r[n_val // (L // FLAGS.seq_len):], FLAGS.batch,
                                           seed=FLAGS.seed)) for L, r in rows.items()}
  print(f"data: {len(docs):,} docs, {sum(map(len, ids)):,} tokens, vocab {tok.get_vocab_size()}",
        flush=True)

  def ce(p, x, c, masks=None):
    logits = apply(p, x[:, :-1], masks, config=c)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), x[:, 1:, None], -1))

  # ---------------------------------------------------------------- (a) parent
  if params is None:
    params = init(cfg, jax.random.PRNGKey(FLAGS.seed))
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, FLAGS.lr, 20, max(FLAGS.pretrain_steps, 21))))
    state = opt.init(params)

    @jax.jit
    def pre_step(p, s, x):
      loss, g = jax.value_and_grad(ce)(p, x, cfg)
      u, s = opt.update(g, s, p)
      return optax.apply_updates(p, u), s, loss

    t0 = time.perf_counter()
    for step in range(1, FLAGS.pretrain_steps + 1):
      params, state, loss = pre_step(params, state, jnp.asarray(next(train_iters[FLAGS.seq_len])))
      if step % FLAGS.log_every == 0 or step == FLAGS.pretrain_steps:
        loss = float(loss)
        _check_finite(loss, "pretraining loss", step)
        dt = time.perf_counter() - t0
        tps = step * FLAGS.batch * FLAGS.seq_len / dt
        eta = (FLAGS.pretrain_steps - step) * dt / step
        print(f"pretrain {step}/{FLAGS.pretrain_steps} loss {loss:.3f} {tps:,.0f} tok/s "
              f"eta {eta:.0f}s", flush=True)
        _log(metrics_path, {"phase": "pretrain", "step": step, "loss": loss, "tok_per_s": tps})
  # ---------------------------------------------------------------- (b) importance + nesting
  calib = [jnp.asarray(next(train_iters[FLAGS.seq_len])) for _ in range(8)]
  params = nest(params, cfg, compute_importance(params, cfg, calib))
  teacher = params
  # ---------------------------------------------------------------- (c) elastic KD
  rc = R.RouterConfig()
  router = R.init(cfg, rc, jax.random.PRNGKey(FLAGS.seed + 1))
  total = FLAGS.stage1_steps + FLAGS.stage2_steps
  opt = R.make_optimizer(total, FLAGS.kd_lr, FLAGS.router_lr, warmup_steps=10)
  state = {"model": params, "router": router}
  opt_state = opt.init(state)
  fractions = [f for _, f in cfg.budgets]

  @jax.jit
  def kd_step(st, os_, x, onehot, frac, step, key):
    t_logits = apply(teacher, x, config=cfg)
    def loss_fn(s):
      return elastic_loss(s["model"], s["router"], t_logits, x, onehot, frac, step, total, key,
                          config=cfg, rc=rc)
    (loss, m), g = jax.value_and_grad(loss_fn, has_aux=True)(st)
    u, os_ = opt.update(g, os_, st)
    return optax.apply_updates(st, u), os_, loss, m

  rng = np.random.RandomState(FLAGS.seed)
  t0 = time.perf_counter()
  tokens_seen = 0
  for step in range(1, total + 1):
    stage2 = step > FLAGS.stage1_steps
    L = 2 * FLAGS.seq_len if stage2 else FLAGS.seq_len
    if stage2:
      b = rng.choice(len(fractions), p=np.asarray([0.5, 0.3, 0.2][:len(fractions)]) /
                     sum([0.5, 0.3, 0.2][:len(fractions)]))
    else:
      b = 0 if rng.rand() < FLAGS.p_full or len(fractions) == 1 else rng.randint(1, len(fractions))
    x = jnp.asarray(next(train_iters[L])[:, :L])
    onehot = jax.nn.one_hot(b, len(fractions))
    state, opt_state, loss, m = kd_step(state, opt_state, x, onehot, fractions[b], step,
                                        jax.random.PRNGKey(FLAGS.seed * 7919 + step))
    tokens_seen += x.size
    if step % FLAGS.log_every == 0 or step == total:
      loss = float(loss)
      _check_finite(loss, "elastic loss", step)
      dt = time.perf_counter() - t0
      print(f"elastic {step}/{total} budget {cfg.budget_names[b]} loss {loss:.3f} kd "
            f"{float(m['kd']):.3f} budget {float(m['budget_loss']):.3f} "
            f"{tokens_seen / dt:,.0f} tok/s eta {(total - step) * dt / step:.0f}s", flush=True)
      _log(metrics_path, {"phase": "elastic", "step": step, "budget": cfg.budget_names[b],
                          "loss": loss, "kd": float(m["kd"]),
                          "budget_loss": float(m["budget_loss"]), "tok_per_s": tokens_seen / dt})
  # ---------------------------------------------------------------- (d) + (e)
  params, router = state["model"], state["router"]
  full_active = count_params(cfg).active
  budget_counts, table = {}, []
  for name, frac in cfg.budgets:
    lg = R.logits(router, R.budget_onehot(cfg, name), cfg, rc)
    probs = {n: jax.nn.softmax(l * rc.scale_end, -1) for n, l in lg.items()}
    counts = R.argmax_counts(probs, cfg)
    budget_counts[name] = counts
    small, small_cfg = slice_params(params, cfg, counts)
    pc = count_params(small_cfg)
    vloss = float(jax.jit(lambda p, x: ce(p, x, small_cfg))(small, val))
    acc = _answer_accuracy(small, small_cfg, tok, held_out, apply)
    table.append((name, frac, counts, pc, pc.active / full_active, vloss, acc))
  path = checkpoint.save(os.path.join(FLAGS.workdir, "nested"), params, cfg, router=router,
                         budget_counts=budget_counts, tokenizer=tok_path, overwrite=True)
  print(f"\nnested checkpoint: {path}  ({time.perf_counter() - t_start:.0f}s total)")
  print("| budget | target | counts (hidden, mamba_heads, moe_experts, moe_ffn) | total params "
        "| active params | active ratio | val loss | val ppl | answer acc |")
  print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
  for name, frac, counts, pc, ratio, vloss, acc in table:
    c = ", ".join(str(counts[a]) for a in ("hidden", "mamba_heads", "moe_experts", "moe_ffn"))
    print(f"| {name} | {frac:.2f} | {c} | {pc.total:,} | {pc.active:,} | {ratio:.3f} | "
          f"{vloss:.3f} | {math.exp(vloss):.1f} | {acc:.3f} |")
    _log(metrics_path, {"phase": "report", "budget": name, "target": frac,
                        "counts": {k: list(v) if isinstance(v, tuple) else v
                                   for k, v in counts.items()},
                        "active_ratio": ratio, "val_loss": vloss, "answer_acc": acc})


def _answer_accuracy(params, cfg, tok, examples, apply, width: int = 256):
  """Teacher-forced exact match of the answer tokens after the gold think trace, all examples
  in one padded batch (generation lands with the generation issue)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  x = np.zeros((len(examples), width), np.int32)
  spans = []
  for i, ex in enumerate(examples):
    seq = [1] + tok.encode(data_prefix(ex)).ids
    answer = tok.encode(ex["answer"]).ids + [2]
    seq = (seq + answer)[-width:]
    x[i, :len(seq)] = seq
    spans.append((len(seq) - len(answer) - 1, answer))  # logits at i predict token i + 1
  pred = np.asarray(jnp.argmax(jax.jit(lambda p, t: apply(p, t, config=cfg))(params, x), -1))
  hits = sum(int(np.array_equal(pred[i, s:s + len(a)], a)) for i, (s, a) in enumerate(spans))
  return hits / max(len(examples), 1)


def data_prefix(ex):
  from elastic_jax.data import format_example
  return format_example(ex, with_answer=False)


if __name__ == "__main__":
  app.run(main)
