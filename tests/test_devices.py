"""Paths that touch more than one device (conftest forces 8 host devices): a checkpoint restored
onto a mesh, a forward with the batch split over the devices, generation on a device other than
the first. Each against the same computation on one device (fp32)."""
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from elastic_jax import apply, from_counts
from elastic_jax.inference import generate as G
from elastic_jax.io import checkpoint
from test_generate import CHUNK, MAX_LEN, SMALL, _toks

fwd = jax.jit(apply, static_argnames=("config",))


@pytest.fixture(scope="module")
def mesh():
  assert jax.device_count() == 8, "conftest sets 8 host devices"
  return Mesh(np.array(jax.devices()), ("data",))


def test_restore_onto_a_mesh(cfg, params, mesh, tmp_path):
  """Every restored leaf (full and a budget's prefix) lives on all 8 devices, values unchanged."""
  path = checkpoint.save(str(tmp_path / "ckpt"), params, cfg, budget_counts={"small": SMALL})
  replicated = NamedSharding(mesh, P())
  for budget in (None, "small"):
    one, _ = checkpoint.restore(path, budget)
    many, small_cfg = checkpoint.restore(path, budget, sharding=replicated)
    leaves = jax.tree_util.tree_leaves(many)
    assert all(x.sharding == replicated for x in leaves)
    assert all(len(x.devices()) == 8 for x in leaves)
    jax.tree_util.tree_map(np.testing.assert_array_equal, one, many)
  assert small_cfg.hidden_size == SMALL["hidden"]


def test_forward_with_the_batch_split_over_devices(cfg, params, mesh):
  """Params replicated, 8 rows split one per device: the logits of one device (1e-5), at full
  size and at a budget."""
  tokens = np.random.RandomState(3).randint(0, cfg.vocab_size, (8, 13)).astype(np.int32)
  rep = jax.device_put(params, NamedSharding(mesh, P()))
  split = jax.device_put(tokens, NamedSharding(mesh, P("data")))
  assert len(split.addressable_shards) == 8 and split.addressable_shards[0].data.shape == (1, 13)
  for masks in (None, from_counts(cfg, SMALL)):
    got = fwd(rep, split, masks, config=cfg)
    assert len(got.devices()) == 8
    np.testing.assert_allclose(got, fwd(params, tokens, masks, config=cfg), rtol=1e-5,
                               atol=1e-5)


def test_generate_on_a_later_device(cfg, params):
  """A sub-model whose params live on device 3 keeps its cache there and generates what it
  generates on device 0."""
  dev = jax.devices()[3]
  prompts = [list(_toks(cfg)[0, :5]), list(_toks(cfg)[1, :3])]
  ref = G.generate(G.standalone(params, cfg, SMALL), prompts, 6, max_len=MAX_LEN, chunk=CHUNK)
  moved = G.standalone(jax.device_put(params, dev), cfg, SMALL)
  state = G.prefill(moved, prompts, max_len=MAX_LEN, chunk=CHUNK)
  assert all(x.devices() == {dev} for x in jax.tree_util.tree_leaves(state.cache)
             if isinstance(x, jax.Array))
  assert G.generate(moved, prompts, 6, max_len=MAX_LEN, chunk=CHUNK) == ref


def test_generate_with_params_sharded_over_a_mesh(cfg, params):
  """Params sharded by their logical axes (fsdp x tensor x expert): the decode cache is sharded
  over the same mesh (streams over fsdp, KV and Mamba heads over tensor), keeps that layout
  step after step, and generation equals one device."""
  from elastic_jax.parallel import mesh as M
  from elastic_jax.parallel import sharding as S
  mesh = M.make_mesh("fsdp:2,tensor:2,expert:2")
  prompts = [list(_toks(cfg)[0, :5]), list(_toks(cfg)[1, :3])]
  ref = G.generate(G.SubModel(params, cfg), prompts, 6, max_len=MAX_LEN, chunk=CHUNK)
  sharded = G.SubModel(jax.device_put(params, S.param_shardings(params, cfg, mesh)), cfg)
  state = G.prefill(sharded, prompts, max_len=MAX_LEN, chunk=CHUNK)
  want = S.cache_shardings(state.cache, mesh)
  specs = {jax.tree_util.keystr(p): s.spec
           for p, s in jax.tree_util.tree_flatten_with_path(want)[0]}
  kv = next(v for k, v in specs.items() if k.endswith("['k']"))
  ssm = next(v for k, v in specs.items() if k.endswith("['ssm']"))
  assert kv[0] == "fsdp" and kv[2] == "tensor" and ssm[0] == "fsdp" and ssm[2] == "tensor"
  state = G.feed(sharded, state, state.pending)
  state = G.feed(sharded, state, state.pending)
  for got, w, x in zip(jax.tree.leaves(jax.tree.map(lambda x: x.sharding, state.cache)),
                       jax.tree.leaves(want), jax.tree.leaves(state.cache)):
    assert got.is_equivalent_to(w, x.ndim), (got, w)
  assert S.replicated_leaves(state.cache, min_size=64) == []
  assert G.generate(sharded, prompts, 6, max_len=MAX_LEN, chunk=CHUNK) == ref
