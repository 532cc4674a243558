"""Shapes / dtypes of every block, and numerics against small independent references."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elastic_jax import apply, from_counts
from elastic_jax.model import attention as attn_lib
from elastic_jax.model import mamba2 as mamba_lib
from elastic_jax.model import mlp as mlp_lib
from elastic_jax.model import moe as moe_lib
from elastic_jax.model.norms import gated_group_rms_norm, rms_norm


def _layer(params, cfg, kind):
  return params["layers"][str(cfg.layer_pattern.index(kind))]["mixer"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_block_shapes_and_dtypes(cfg, params, dtype):
  c = cfg.replace(compute_dtype=dtype)
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, c.hidden_size))
  fns = {"M": mamba_lib.mamba2, "*": attn_lib.attention, "E": moe_lib.moe, "-": mlp_lib.mlp}
  for kind, fn in fns.items():
    out, aux = fn(_layer(params, c, kind), x, c)
    assert aux == {"stats": None, "state": None}
    chex.assert_shape(out, x.shape)
    chex.assert_type(out, jnp.dtype(dtype))
    chex.assert_tree_all_finite(out)
  y = rms_norm(x.astype(dtype), jnp.ones(c.hidden_size), 1e-5)
  chex.assert_type(y, jnp.dtype(dtype))


class ElasticLMJitVsEager(chex.TestCase):
  """The module's pure `apply`, eager and jitted, equals the jitted functional wrapper."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_module_apply(self):
    from conftest import CFG, perturb
    from elastic_jax import from_counts, init
    from elastic_jax.model import ElasticLM
    params = perturb(init(CFG, jax.random.PRNGKey(0)), jax.random.PRNGKey(1))
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, CFG.vocab_size, (2, 13)), jnp.int32)
    masks = from_counts(CFG, {"hidden": 24, "moe_experts": 6})
    fwd = self.variant(lambda p, t, m: ElasticLM(CFG).apply({"params": p}, t, masks=m)[0])
    logits = fwd(params, tokens, masks)
    chex.assert_shape(logits, tokens.shape + (CFG.vocab_size,))
    chex.assert_type(logits, jnp.float32)
    np.testing.assert_allclose(logits, apply(params, tokens, masks, config=CFG), rtol=1e-5,
                               atol=1e-5)


def test_apply_is_causal(cfg, params, tokens):
  full = apply(params, tokens, config=cfg)
  prefix = apply(params, tokens[:, :7], config=cfg)
  np.testing.assert_allclose(full[:, :7], prefix, atol=1e-5)


def test_apply_bad_inputs(cfg, params, tokens):
  with pytest.raises(ValueError, match="int array"):
    apply(params, tokens.astype(jnp.float32), config=cfg)
  with pytest.raises(ValueError, match="int array"):
    apply(params, tokens[0], config=cfg)
  with pytest.raises(ValueError, match="params have 6 layers.*has 5"):
    apply(params, tokens, config=cfg.replace(layer_pattern="M*E-M"))


def test_rms_norm_reference():
  x = np.random.RandomState(0).randn(3, 10).astype(np.float32)
  w = np.random.RandomState(1).randn(10).astype(np.float32)
  ref = x / np.sqrt(np.mean(x ** 2, -1, keepdims=True) + 1e-5) * w
  np.testing.assert_allclose(rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-5), ref, rtol=1e-5)


def test_gated_group_norm_reference():
  rs = np.random.RandomState(0)
  y, z = rs.randn(2, 3, 2, 4, 5).astype(np.float32), rs.randn(2, 3, 2, 4, 5).astype(np.float32)
  w = rs.randn(2, 4, 5).astype(np.float32)
  g = y * z / (1 + np.exp(-z))
  gg = g.reshape(2, 3, 2, 20)
  ref = (gg / np.sqrt(np.mean(gg ** 2, -1, keepdims=True) + 1e-5)).reshape(g.shape) * w
  np.testing.assert_allclose(gated_group_rms_norm(y, z, w, 1e-5), ref, rtol=1e-5, atol=1e-6)


def test_causal_conv_reference():
  rs = np.random.RandomState(0)
  x, w, b = rs.randn(2, 7, 3), rs.randn(4, 3), rs.randn(3)
  ref = np.zeros_like(x)
  for t in range(7):
    for k in range(4):
      if t - 3 + k >= 0:
        ref[:, t] += w[k] * x[:, t - 3 + k]
  np.testing.assert_allclose(mamba_lib.causal_conv(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b)),
                             ref + b, rtol=1e-5, atol=1e-5)


def test_mamba_chunked_equals_sequential(cfg, params):
  x = jax.random.normal(jax.random.PRNGKey(2), (2, 11, cfg.hidden_size))
  p = _layer(params, cfg, "M")
  np.testing.assert_allclose(mamba_lib.mamba2(p, x, cfg)[0],
                             mamba_lib.mamba2(p, x, cfg, ssd="sequential")[0], rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="ssd must be"):
    mamba_lib.mamba2(p, x, cfg, ssd="fast")


def test_attention_reference(cfg, params):
  """GQA NoPE attention vs an explicit per-head numpy loop (query head h reads KV head
  h % num_kv_heads: heads are stored KV-group-minor)."""
  p = jax.tree_util.tree_map(np.asarray, _layer(params, cfg, "*"))
  x = np.random.RandomState(3).randn(1, 6, cfg.hidden_size).astype(np.float32)
  G = cfg.num_kv_heads
  out = np.zeros((6, cfg.num_attention_heads, cfg.head_dim), np.float32)
  for h in range(cfg.num_attention_heads):
    q, k, v = x[0] @ p["q"][:, h], x[0] @ p["k"][:, h % G], x[0] @ p["v"][:, h % G]
    s = q @ k.T / np.sqrt(cfg.head_dim) + np.triu(np.full((6, 6), -np.inf), 1)
    a = np.exp(s - s.max(-1, keepdims=True))
    out[:, h] = (a / a.sum(-1, keepdims=True)) @ v
  ref = np.einsum("thk,hkd->td", out, p["o"])
  got, _ = attn_lib.attention(p, jnp.asarray(x), cfg)
  np.testing.assert_allclose(got[0], ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("T", [13, 16])   # 13: the last query block is padded
def test_query_blocked_attention_equals_one_shot(cfg, params, T):
  """Blocks of 4 queries (each rematerialised), `jax.nn.dot_product_attention` (the cuDNN
  path on GPUs; XLA here) and the splash kernel (TPU; interpreted here, T padded to a whole
  block) give the one-shot causal attention's values and gradients (fp32), and the whole
  masked forward is unchanged."""
  p = _layer(params, cfg, "*")
  x = jnp.asarray(np.random.RandomState(4).randn(2, T, cfg.hidden_size), jnp.float32)
  whole = cfg.replace(attention_query_block=T)
  f = lambda p, c: attn_lib.attention(p, x, c)[0]
  loss = lambda p, c: jnp.sum(jnp.sin(f(p, c)))
  toks = jnp.asarray(np.random.RandomState(5).randint(0, cfg.vocab_size, (2, T)), jnp.int32)
  masks = from_counts(cfg, {"hidden": 24, "mamba_heads": 6, "moe_experts": 6, "moe_ffn": 12})
  for other in (cfg.replace(attention_query_block=4), cfg.replace(attention_impl="dot_product"),
                cfg.replace(attention_impl="splash")):
    np.testing.assert_allclose(f(p, other), f(p, whole), rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(jax.grad(loss)(p, other), jax.grad(loss)(p, whole),
                                rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(apply(params, toks, masks, config=other),
                               apply(params, toks, masks, config=whole), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="attention_impl: 'flash' not in"):
    cfg.replace(attention_impl="flash")


def test_query_blocked_attention_memory_is_linear_in_length(cfg, params):
  """XLA's temp memory for a forward + backward at 4x the length grows ~4x with blocks of 64
  queries (the T x T scores would grow 16x)."""
  p = _layer(params, cfg, "*")
  c = cfg.replace(attention_query_block=64)

  def temp(T):
    x = jax.ShapeDtypeStruct((1, T, cfg.hidden_size), jnp.float32)
    g = jax.jit(jax.grad(lambda x: jnp.sum(attn_lib.attention(p, x, c)[0] ** 2)))
    return g.trace(x).lower().compile().memory_analysis().temp_size_in_bytes

  small, big = temp(512), temp(2048)
  assert big < 6 * small, (small, big)


def test_segment_packing_computes_each_document_alone(cfg, params):
  """segment_packing: a packed row (documents each starting with bos) gives, at every
  position, the logits of its document run alone: attention (query blocks and
  dot_product_attention, splash), the Mamba conv and the SSM state stop at each start (query blocks
  of 4 and SSD chunks of 4 cross the document edges); masked budgets and the scanned stack
  too; the packed row without it does not."""
  rs = np.random.RandomState(4)
  docs = np.concatenate([np.ones((4, 1), np.int32), rs.randint(3, cfg.vocab_size, (4, 4))], 1)
  row = docs.reshape(1, -1)
  masks = from_counts(cfg, {"hidden": 24, "mamba_heads": 4, "moe_experts": 6})
  for impl, m in (("blocked", None), ("blocked", masks), ("dot_product", None),
                  ("splash", None)):
    pcfg = cfg.replace(segment_packing=True, attention_impl=impl, attention_query_block=4)
    packed = np.asarray(apply(params, row, m, config=pcfg))[0]
    alone = np.asarray(apply(params, docs, m, config=pcfg)).reshape(packed.shape)
    np.testing.assert_allclose(packed, alone, rtol=1e-4, atol=1e-4, err_msg=impl)
  scanned = np.asarray(apply(params, row, config=pcfg, stack="scan"))[0]   # the training stack
  np.testing.assert_allclose(scanned, alone, rtol=1e-4, atol=1e-4)
  leaky = np.asarray(apply(params, row, config=pcfg.replace(segment_packing=False)))[0]
  assert np.abs(leaky[5:] - alone[5:]).max() > 1e-2


@pytest.mark.parametrize("spec,xs,ws", [
    ("btd,dghp->btghp", (2, 5, 6), (6, 2, 3, 4)),    # Mamba in_proj: [B, T] merge into rows
    ("btghp,ghpd->btd", (2, 5, 2, 3, 4), (2, 3, 4, 6)),   # out_proj
    ("td,df->tf", (5, 6), (6, 7))])                   # already rows: as it is
def test_rows_einsum_equals_einsum(spec, xs, ws):
  """`linear.rows_einsum`: jnp.einsum's value and gradients (1e-5), the leading [B, T] merged
  into one row dim, so every dot_general, the weight gradient's included, contracts one
  dim of rows at most."""
  from elastic_jax.model import linear
  x = jax.random.normal(jax.random.PRNGKey(0), xs)
  w = jax.random.normal(jax.random.PRNGKey(1), ws)
  loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(spec, x, w)))
  np.testing.assert_allclose(linear.rows_einsum(spec, x, w), jnp.einsum(spec, x, w), rtol=1e-5,
                             atol=1e-5)
  chex.assert_trees_all_close(jax.grad(loss(linear.rows_einsum), argnums=(0, 1))(x, w),
                              jax.grad(loss(jnp.einsum), argnums=(0, 1))(x, w),
                              rtol=1e-5, atol=1e-5)
  if spec.startswith("bt"):   # no product sees [B, T] as two dims: rows of B * T = 10
    jaxpr = jax.make_jaxpr(jax.grad(loss(linear.rows_einsum), argnums=(0, 1)))(x, w)
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 3   # forward, d(x), d(w)
    for e in dots:
      assert all(v.aval.shape[:2] != xs[:2] for v in e.invars), e
