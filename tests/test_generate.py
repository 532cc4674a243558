"""Cached generation against the full forward: prefill / decode / extend equal `apply` at every
position (all block kinds, padding, skipped rows, budgets; 1e-4 fp32), sampling statistics,
batched greedy generation against a naive re-run of `apply`, cache transplant, errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic_jax import apply, from_counts
from elastic_jax.inference import generate as G
from elastic_jax.model.model import apply_cached, init_cache

SMALL = {"hidden": 24, "mamba_heads": 4, "moe_experts": 6, "moe_ffn": 12}
MAX_LEN, CHUNK = 24, 4   # shared by every test here: one compiled step per (slice kind, T)
fwd = jax.jit(apply, static_argnames=("config",))   # the reference full forward


def _slice(kind, params, cfg):
  if kind == "full":
    return G.SubModel(params, cfg), fwd(params, _toks(cfg), config=cfg)
  if kind == "masked":
    s = G.parent_at_budget(params, cfg, SMALL, "small")
    return s, fwd(params, _toks(cfg), from_counts(cfg, SMALL), config=cfg)
  # The sliced model against the masked parent's forward (equal per test_slicing).
  s = G.standalone(params, cfg, SMALL, "small")
  return s, fwd(params, _toks(cfg), from_counts(cfg, SMALL), config=cfg)


def _toks(cfg):
  return np.random.RandomState(0).randint(5, cfg.vocab_size, (2, 13)).astype(np.int32)


@pytest.mark.parametrize("kind", ["full", "masked", "sliced"])
def test_cached_equals_forward(cfg, params, kind):
  """Prompts of lengths 5 / 3 (left padding over two prefill chunks), joint steps, steps with
  one row skipped, a multi-token extend whose padding follows real tokens: after every step
  each fed row's next-token logits equal the full forward's at that position."""
  slc, ref = _slice(kind, params, cfg)
  ref, toks = np.asarray(ref), _toks(cfg)
  n = [5, 3]
  state = G.prefill(slc, [toks[0, :5], toks[1, :3]], max_len=MAX_LEN, chunk=CHUNK)

  def check(rows=(0, 1)):
    for b in rows:
      np.testing.assert_allclose(np.asarray(state.logits[b]), ref[b, n[b] - 1], rtol=1e-4,
                                 atol=1e-4, err_msg=f"{kind} row {b} after {n[b]} tokens")

  check()
  for _ in range(2):
    state = G.feed(slc, state, [toks[0, n[0]], toks[1, n[1]]])
    n = [n[0] + 1, n[1] + 1]
    check()
  for _ in range(2):   # row 1 skipped: its caches (conv state too) must not move
    state = G.feed(slc, state, [toks[0, n[0]], 0], rows=[True, False])
    n[0] += 1
    check()
  chunk = np.stack([toks[0, 9:13], np.r_[0, 0, toks[1, 5:7]]])
  state = G.extend(slc, state, chunk, [[1, 1, 1, 1], [0, 0, 1, 1]])
  n = [13, 7]
  check()
  while n[1] < 13:
    state = G.feed(slc, state, [0, toks[1, n[1]]], rows=[False, True])
    n[1] += 1
    check([1])
  check([0])   # row 0 untouched by six skipped steps
  assert state.pos == 22


def test_apply_cached_last_only(cfg, params):
  """`last_only` returns the last position's logits, [B,1,V], equal to the last row of the full
  chunk's (which equal the full forward's), and the same cache."""
  toks = _toks(cfg)[:, :CHUNK]
  cache = init_cache(cfg, 2, MAX_LEN)
  full, c_full = apply_cached(params, toks, cache, config=cfg)
  last, c_last = apply_cached(params, toks, cache, config=cfg, last_only=True)
  assert full.shape == (2, CHUNK, cfg.vocab_size) and last.shape == (2, 1, cfg.vocab_size)
  np.testing.assert_allclose(np.asarray(last[:, 0]), np.asarray(full[:, -1]), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(full), np.asarray(fwd(params, toks, config=cfg)),
                             rtol=1e-4, atol=1e-4)
  jax.tree.map(np.testing.assert_array_equal, c_full, c_last)


def naive_greedy(params, cfg, prompt, n, masks=None, stop=()):
  """Reference: greedy tokens from re-running `apply` on the whole sequence, right-padded into
  row 0 of a [2, 13] batch (the shape `_toks` already compiled; a causal model ignores the
  padding on the right)."""
  seq = list(prompt)
  out = []
  for _ in range(n):
    tok = np.zeros(_toks(cfg).shape, np.int32)
    tok[0, :len(seq)] = seq
    nxt = int(np.argmax(np.asarray(fwd(params, tok, masks, config=cfg))[0, len(seq) - 1]))
    out.append(nxt)
    seq.append(nxt)
    if nxt in stop:
      break
  return out


def test_generate_batch_matches_naive(cfg, params):
  toks = _toks(cfg)
  slc = G.SubModel(params, cfg)
  prompts = [list(toks[0, :6]), list(toks[1, :2])]
  ref = [naive_greedy(params, cfg, p, 6) for p in prompts]
  streamed = [[], []]
  out = G.generate(slc, prompts, 6, max_len=MAX_LEN, chunk=CHUNK,
                   on_token=lambda i, t: streamed[i].append(t))
  assert out == ref and streamed == ref
  # A stop token: row 0 stops right after emitting it, row 1 runs to max tokens (or its stop).
  stop = ref[0][2]
  out = G.generate(slc, prompts, 6, stop_tokens=[stop], max_len=MAX_LEN, chunk=CHUNK)
  assert out[0] == ref[0][:3]
  assert out[1] == naive_greedy(params, cfg, prompts[1], 6, stop=(stop,))
  assert G.generate(slc, prompts, 2, max_len=MAX_LEN, chunk=CHUNK) == [r[:2] for r in ref]


def test_decode_on_device_equals_the_per_token_loop(cfg, params):
  """Under a stop rule, blocks of steps on device give what the host deciding every token
  gives: tokens, cache, pending token, logits and live rows, with sampling, a row stopping in
  the first block, a masked budget and a run across a block boundary."""
  slc = G.parent_at_budget(params, cfg, SMALL, "small")
  prompts = [[5, 6, 7], [8, 9], [10]]
  sampler = G.Sampler(temperature=1.5)
  key = jax.random.PRNGKey(3)
  rule = G.stop_rule([])
  n = MAX_LEN - CHUNK - 2
  assert n > G.DECODE_BLOCK
  free, _ = G.decode(slc, G.prefill(slc, prompts, max_len=MAX_LEN, chunk=CHUNK), n,
                     choose=rule, sampler=sampler, key=key)
  stop = free[1][3]   # row 1 stops at its 4th token; the others at theirs, if ever
  runs = {}
  for how, choose in (("device", G.stop_rule([stop])),
                      ("host", lambda i, t, o, r=G.stop_rule([stop]): r(i, t, o))):
    state = G.prefill(slc, prompts, max_len=MAX_LEN, chunk=CHUNK)
    runs[how] = G.decode(slc, state, n, choose=choose, sampler=sampler, key=key)
  (dev, s_dev), (host, s_host) = runs["device"], runs["host"]
  assert dev == host and len(dev[1]) == 4 and dev[1][-1] == stop
  assert max(len(r) for r in dev) > G.DECODE_BLOCK, [len(r) for r in dev]
  np.testing.assert_array_equal(s_dev.active, s_host.active)
  np.testing.assert_array_equal(s_dev.pending, s_host.pending)
  np.testing.assert_allclose(s_dev.logits, s_host.logits, rtol=1e-6, atol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6),
               s_dev.cache, s_host.cache)


def test_sample_statistics():
  logits = jnp.asarray([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
  rows = jnp.broadcast_to(logits, (20000, 6))
  sample = jax.jit(G.sample)   # one program: temperature and top_p are traced
  key = jax.random.PRNGKey(0)
  assert (np.asarray(sample(rows, key, 0.0, 1.0)) == 0).all()      # greedy
  assert (np.asarray(sample(rows, key, 1.0, 1e-6)) == 0).all()     # top_p keeps one token
  for temp, top_p in ((0.7, 1.0), (1.3, 0.8)):
    got = np.bincount(np.asarray(sample(rows, key, temp, top_p)), minlength=6) / 20000
    p = np.exp(np.asarray(logits[0]) / temp)
    p /= p.sum()
    keep = (np.cumsum(p) - p) < top_p      # numpy nucleus: smallest prefix with mass >= top_p
    want = np.where(keep, p, 0) / p[keep].sum()
    np.testing.assert_allclose(got, want, atol=0.015, err_msg=f"T={temp} top_p={top_p}")
    assert got[~keep].sum() == 0


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(temperature=float("nan")),
                                 dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_sampler(bad):
  with pytest.raises(ValueError, match="temperature|top_p"):
    G.Sampler(**bad)


def test_bad_input(cfg, params):
  slc = G.SubModel(params, cfg)
  with pytest.raises(ValueError, match="no prompts"):
    G.generate(slc, [], 2)
  with pytest.raises(ValueError, match="prompt 1 is empty"):
    G.generate(slc, [[1, 2], []], 2)
  with pytest.raises(ValueError, match=r"token ids \[64\] outside the vocab \[0, 64\)"):
    G.generate(slc, [[1, 64]], 2)
  with pytest.raises(ValueError, match="cache overflow"):
    G.generate(slc, [[1] * 5], 30, max_len=MAX_LEN, chunk=CHUNK)
  with pytest.raises(ValueError, match="cache overflow"):
    G.prefill(slc, [[1] * 24], max_len=MAX_LEN, chunk=CHUNK)
  state = G.DecodeState(init_cache(cfg, 1, 4), np.zeros(1, np.int32), None, np.ones(1, bool))
  with pytest.raises(ValueError, match=r"cache overflow: 0 \+ 8 tokens > max_len 4"):
    G.extend(slc, state, np.ones((1, 8), np.int32))
  with pytest.raises(ValueError, match="outside the vocab"):
    G.feed(slc, state, [-1])
  with pytest.raises(ValueError, match="left padding only"):
    G.extend(slc, state, np.ones((1, 2), np.int32), [[True, False]])


def _zero_dropped_heads(cache, cfg, keep_per_group):
  """The masked-small cache as the sliced small model would hold it: dropped heads empty."""
  layers = []
  for kind, st in zip(cfg.layer_pattern, cache["layers"]):
    if kind == "M":
      st = {**st, "conv_x": st["conv_x"].at[:, :, :, keep_per_group:].set(0),
            "ssm": st["ssm"].at[:, :, keep_per_group:].set(0)}
    layers.append(st)
  return {**cache, "layers": layers}


@pytest.mark.parametrize("direction", ["large_to_small", "small_to_large"])
def test_transplant_sliced_equals_masked(cfg, params, direction):
  """A sliced model continuing another size's cache (heads truncated / zero-padded) computes
  what the parent with budget masks computes from the same cache (independent code paths)."""
  toks = _toks(cfg)
  prompts = [list(toks[0, :7]), list(toks[1, :5])]
  full = G.SubModel(params, cfg)
  masked_small = G.parent_at_budget(params, cfg, SMALL)
  sliced_small = G.standalone(params, cfg, SMALL)
  if direction == "large_to_small":
    pairs = [(full, sliced_small), (full, masked_small)]
  else:
    pairs = [(sliced_small, full), (masked_small, full)]
  logits = []
  for think, answer in pairs:
    state = G.prefill(think, prompts, max_len=MAX_LEN, chunk=CHUNK)
    state = G.feed(think, state, toks[:, 7])
    if direction == "small_to_large" and think is masked_small:
      keep = SMALL["mamba_heads"] // cfg.mamba_n_groups
      state = G.DecodeState(_zero_dropped_heads(state.cache, cfg, keep), state.pending,
                            state.logits, state.active)
    moved = G.transplant(state, answer)
    assert jax.tree_util.tree_map(jnp.shape, moved.cache) == jax.tree_util.tree_map(
        jnp.shape, init_cache(answer.config, 2, MAX_LEN))
    logits.append(np.asarray(G.feed(answer, moved, toks[:, 8]).logits))
  np.testing.assert_allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4)
  # The transplant is approximate: a sliced answer model differs from its own re-prefill.
  answer = pairs[0][1]
  exact = G.prefill(answer, [p + [t, u] for p, t, u in zip(prompts, toks[:, 7], toks[:, 8])],
                    max_len=MAX_LEN, chunk=CHUNK)
  assert np.abs(np.asarray(exact.logits) - logits[0]).max() > 1e-3


def test_transplant_mismatch(cfg, params):
  cache = init_cache(cfg, 1, 8)
  other = cfg.replace(num_kv_heads=1)
  with pytest.raises(ValueError, match="mismatched slices: layer 1 k cache"):
    G.transplant_cache(cache, other)
  with pytest.raises(ValueError, match="mismatched slices: cache has 6 layers"):
    G.transplant_cache(cache, cfg.replace(layer_pattern="M*E"))
