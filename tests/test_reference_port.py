"""experiments/reference_port.py (the plain-jnp port, our decode's speed baseline) computes our
model: prefill and decode logits equal `elastic_jax.apply`, greedy tokens equal `generate`'s."""
import math
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "experiments"))

import reference_port as R  # noqa: E402
from elastic_jax import apply  # noqa: E402
from elastic_jax.inference import generate as G  # noqa: E402

T, N = 20, 4   # prompt tokens (more than one SSD chunk of 16), decoded tokens


def _params(cfg):
  """`scaled.random_params` with every leaf made to matter: random biases (the router's changes
  the selection), dt_bias in [-10, 1], norm scales and D around 1, and attention weights 10x
  larger (q, k: peaked scores; v, o: attention weighs in the residual stream)."""
  from scaled import random_params
  rs = np.random.RandomState(1)

  def leaf(path, x):
    name, s = jax.tree_util.keystr(path), x.shape
    if "dt_bias" in name:
      v = rs.uniform(-10, 1, s)
    elif "bias" in name:
      v = rs.normal(0, 0.05 if "router" in name else 0.1, s)
    elif "norm" in name or "'D'" in name:
      v = 1 + rs.normal(0, 0.2, s)
    elif re.search(r"'mixer'\]\['[qkvo]'", name):
      v = 10 * np.asarray(x)
    else:
      return x
    return jnp.asarray(v, x.dtype)

  return jax.tree_util.tree_map_with_path(leaf, random_params(cfg))


@pytest.fixture(scope="module")
def setup():
  """fp32 tiny config with transformers' dt clamp (time_step_min, inf), random weights, and
  tokens for a prompt of T plus N fed tokens."""
  from configs.tiny import MODEL
  cfg = MODEL.replace(param_dtype="float32", compute_dtype="float32",
                      time_step_limit=(MODEL.time_step_min, math.inf))
  ids = np.random.RandomState(0).randint(5, cfg.vocab_size, (2, T + N)).astype(np.int32)
  return cfg, _params(cfg), ids


def _close(port, ours):
  np.testing.assert_allclose(np.asarray(port), ours, rtol=0, atol=1e-4 * np.abs(ours).max())


# Also a clamp that bites at both ends for most heads (dt = softplus(...) spans ~1e-5 .. 1.5),
# and a pattern with a dense MLP layer ('-'), which the tiny config lacks.
@pytest.mark.parametrize("change", [{}, {"time_step_limit": (0.1, 0.3)}, {"layer_pattern": "M-*E"}],
                         ids=["tiny", "clamp", "mlp"])
def test_prefill_and_decode_logits_equal_apply(setup, change):
  """The prefill's logits, then those of N decode steps, equal `apply`'s on the whole sequence
  (causal: its position t holds the logits after the first t + 1 tokens)."""
  cfg, params, ids = setup
  if change:
    cfg = cfg.replace(**change)
    params = _params(cfg) if "layer_pattern" in change else params
  ours = np.asarray(apply(params, ids, config=cfg))
  logits, cache = R.prefill(params, cfg, ids[:, :T], R.init_cache(cfg, 2, T + N))
  _close(logits, ours[:, T - 1])
  for i in range(N):
    logits, cache = R.decode_step(params, cfg, ids[:, T + i], cache, T + i)
    _close(logits, ours[:, T + i])


def test_greedy_equals_generate(setup):
  """B=2 greedy tokens equal `generate.generate`'s (prefill in one chunk, jitted decode step)."""
  cfg, params, ids = setup
  want = G.generate(G.SubModel(params, cfg), ids[:, :T].tolist(), N + 1, chunk=T)
  got = R.greedy(params, cfg, ids[:, :T], N + 1, max_len=T + N)   # exactly the columns fed
  assert np.asarray(got).tolist() == want
