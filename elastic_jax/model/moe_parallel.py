"""Expert parallelism: the routed experts split over the mesh's `expert` axis, computed inside a
`jax.shard_map` island.

The fp32 router runs outside the island (its [D, E] weights are small); inside, each expert
shard holds E / EP consecutive experts and computes, dropless, every assignment of its tokens
to those experts (sorted by expert, grouped matmuls (`pallas_kernels.gmm`), the other
shards' assignments parked past the last group, where the grouped matmul writes zeros), then
the shards' partial outputs are summed:
- tokens not split over `expert` (the batch rule leaves that axis out): every shard already
  holds the same tokens; `psum` over `expert` adds the shards' parts;
- tokens split over `expert` too: with `ep_dispatch` "ragged" each assignment travels to its
  expert's shard and back (`jax.lax.ragged_all_to_all`, dropless; emulated with all_gather on
  CPU); with "gather" (the portable path) `all_gather` the shard group's tokens, compute,
  `psum_scatter` each token's sum back to the shard that owns it.
Weights enter the island gathered over every other axis (FSDP / tensor: one layer's experts at a
time) and split over `expert`. Outside a mesh with an `expert` axis larger than 1, the same
function runs the ragged path on each token shard (`token_shards.run`; one device: as it is).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from elastic_jax.model import token_shards
from pallas_kernels import platform
from pallas_kernels.gmm import gmm

EXPERT_AXIS = "expert"


def expert_mesh():
  """The ambient mesh (`jax.set_mesh`) if it splits experts over an `expert` axis > 1, else None."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or EXPERT_AXIS not in mesh.axis_names or mesh.shape[EXPERT_AXIS] == 1:
    return None
  return mesh


def assignments(x_TD, gates, idx, up, down, ffn_mask_F, dt_, first: int | jax.Array = 0,
                gmm_backend: str = "xla"):
  """The T*k (token, expert) assignments sorted by expert, each through its expert with grouped
  matmuls (`pallas_kernels.gmm.gmm`): {"token": [T*k] token index, "expert": [T*k] local expert (E_local
  for assignments outside this shard's [first, first + E_local), sorted last), "gate": [T*k]
  (0 outside the shard), "act": [T*k, F] relu^2 of the up projection (FFN mask applied), "y":
  [T*k, D] the expert's output, not yet gated}. Dropless, static shapes. `gmm_backend`: the
  grouped matmul's kernel (`pallas_kernels.gmm.GMM_BACKENDS`)."""
  T, k = idx.shape
  E = up.shape[0]
  flat = idx.reshape(-1) - first
  mine = (flat >= 0) & (flat < E)
  group = jnp.where(mine, flat, E)               # others sort last, past every group
  order = jnp.argsort(group, stable=True)
  group_sizes = jnp.bincount(group, length=E + 1)[:E].astype(jnp.int32)
  token_of = order // k
  act, y = _expert_ffn(x_TD[token_of], up, down, group_sizes, ffn_mask_F, dt_, gmm_backend)
  return {"token": token_of, "expert": group[order],
          "gate": jnp.where(mine, gates.reshape(-1), 0.0)[order], "act": act, "y": y}


def _expert_ffn(rows, up, down, group_sizes, ffn_mask_F, dt_, gmm_backend):
  """(relu^2 of the up projection, FFN mask applied; the down projection) of rows sorted by
  expert, `group_sizes` rows per expert (rows past the last group give zeros)."""
  h = gmm(rows, up.astype(dt_), group_sizes, backend=gmm_backend)
  if ffn_mask_F is not None:
    h = h * ffn_mask_F.astype(dt_)
  act = jnp.square(jax.nn.relu(h))
  return act, gmm(act, down.astype(dt_), group_sizes, backend=gmm_backend)


def combine(a: dict, x_TD, dt_):
  """sum over each token's assignments of gate * expert output (`assignments`)."""
  y = a["y"] * a["gate"][:, None].astype(dt_)
  return jnp.zeros_like(x_TD).at[a["token"]].add(y)


def local_experts(x_TD, gates, idx, up, down, ffn_mask_F, dt_, first: int | jax.Array = 0,
                  gmm_backend: str = "xla"):
  """sum_k gate * expert(x) over the assignments (t, k) whose expert lies in this shard's
  [first, first + E_local); the rest contribute 0. Dropless, static shapes."""
  return combine(assignments(x_TD, gates, idx, up, down, ffn_mask_F, dt_, first, gmm_backend),
                 x_TD, dt_)


def emulate_ragged() -> bool:
  """Whether the ragged all-to-all is emulated (when building for CPU, which cannot compile it)."""
  return platform.current() == "cpu"


def _ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                       axis: str):
  """`jax.lax.ragged_all_to_all` over `axis`; on CPU (XLA:CPU cannot compile it) the same
  result from an all_gather of every shard's operand and offsets: receiver r takes, from each
  sender s, rows [input_offsets_s[r], + send_sizes_s[r]) into [output_offsets_s[r], ...)."""
  if not emulate_ragged():
    return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes,
                                      output_offsets, recv_sizes, axis_name=axis)
  del recv_sizes   # implied by the senders' send_sizes
  me = jax.lax.axis_index(axis)
  gather = lambda a: jax.lax.all_gather(a, axis)          # [S, ...] every shard's
  ops, ins, sends, outs = gather(operand), gather(input_offsets), gather(send_sizes), \
      gather(output_offsets)
  j = jnp.arange(output.shape[0])
  for s in range(ops.shape[0]):
    start, n, at = ins[s, me], sends[s, me], outs[s, me]
    here = (j >= at) & (j < at + n)
    rows = ops[s][jnp.clip(start + j - at, 0, ops.shape[1] - 1)]
    output = jnp.where(here.reshape((-1,) + (1,) * (output.ndim - 1)), rows, output)
  return output


def _exchange(x, gates, idx, up, down, ffn_mask_F, dt_, gmm_backend):
  """Inside the island, tokens split over `expert`: each (token, expert) assignment travels to
  the shard holding its expert (`ragged_all_to_all`, sorted by expert, so each shard receives
  its senders' rows one block per sender), runs through that shard's experts (grouped
  matmuls), and comes back the same way; the owner sums its tokens' gated outputs. Dropless:
  the receive buffer holds the worst case (every assignment of every shard on one shard)."""
  S = jax.lax.axis_size(EXPERT_AXIS)
  me = jax.lax.axis_index(EXPERT_AXIS)
  T, k = idx.shape
  E_local = up.shape[0]
  flat = idx.reshape(-1)
  order = jnp.argsort(flat, stable=True)     # by expert, so by owner shard too
  owner = flat[order] // E_local
  send_sizes = jnp.bincount(owner, length=S).astype(jnp.int32)
  input_offsets = (jnp.cumsum(send_sizes) - send_sizes).astype(jnp.int32)
  counts = jax.lax.all_gather(send_sizes, EXPERT_AXIS)          # [sender, receiver]
  recv_sizes = counts[:, me]
  # Where my block lands on each receiver: after the blocks of the senders before me.
  output_offsets = (jnp.cumsum(counts, axis=0) - counts)[me].astype(jnp.int32)
  cap = T * k * S
  a2a = lambda v, out, ins, sends, outs, recvs: _ragged_all_to_all(v, out, ins, sends, outs,
                                                                   recvs, EXPERT_AXIS)
  rows = a2a(x[order // k].astype(dt_), jnp.zeros((cap, x.shape[1]), dt_), input_offsets,
             send_sizes, output_offsets, recv_sizes)
  local = (flat[order] - owner * E_local).astype(jnp.int32)
  got = a2a(local, jnp.full((cap,), E_local, jnp.int32), input_offsets, send_sizes,
            output_offsets, recv_sizes)
  # Received rows grouped by local expert; unused buffer rows (expert E_local) park last.
  group = jnp.where(jnp.arange(cap) < jnp.sum(recv_sizes), got, E_local)
  by_expert = jnp.argsort(group, stable=True)
  sizes = jnp.bincount(group, length=E_local + 1)[:E_local].astype(jnp.int32)
  _, y = _expert_ffn(rows[by_expert], up, down, sizes, ffn_mask_F, dt_, gmm_backend)
  y = jnp.zeros_like(y).at[by_expert].set(y)        # back in received order
  # Back to the senders: my receive blocks start where the earlier senders' end.
  back_in = (jnp.cumsum(recv_sizes) - recv_sizes).astype(jnp.int32)
  back_out = (jnp.cumsum(counts, axis=1) - counts)[:, me].astype(jnp.int32)
  y_sorted = a2a(y, jnp.zeros((T * k, y.shape[1]), dt_), back_in, recv_sizes, back_out,
                 send_sizes)
  gate = gates.reshape(-1)[order].astype(dt_)
  return jnp.zeros((T, x.shape[1]), dt_).at[order // k].add(y_sorted * gate[:, None])


def typed_island(gmm_backend: str) -> bool:
  """Whether an island running grouped matmuls on `gmm_backend` can keep shard_map's varying-
  axes typing (`check_vma`): the shipped Pallas kernels (megablox, tokamax) declare their
  outputs without it and refuse to trace under it, so their islands run untyped, where
  shard_map sums the cotangents of inputs that enter whole itself."""
  return gmm_backend not in ("megablox", "tokamax")


def sharded_local_experts(x_TD, gates, idx, up, down, ffn_mask_F, dt_,
                          gmm_backend: str = "xla", batch: int | None = None):
  """`local_experts` over every expert, each token shard sorting and running only its own
  assignments (`token_shards.run`; `batch`: the sequences [T, ...] flattens)."""
  fn = lambda x, g, i, u, d: (local_experts(x, g, i, u, d, ffn_mask_F, dt_,
                                            gmm_backend=gmm_backend), {}, {})
  return token_shards.run(fn, (x_TD, gates, idx), (up, down), typed_island(gmm_backend),
                          batch)[0]


def routed_experts(p: dict, x_TD, gates, idx, ffn_mask_F, dt_, gmm_backend: str = "xla",
                   dispatch: str = "auto", batch: int | None = None):
  """The routed experts' output [T, D], split over the mesh's `expert` axis when there is one.
  `dispatch` (`ModelConfig.ep_dispatch`) picks how tokens split over `expert` reach their
  experts: "ragged" (`_exchange`), "gather", or "auto" (ragged on GPU / TPU). `batch`: how many
  sequences x_TD flattens (token shards take whole ones)."""
  mesh = expert_mesh()
  if mesh is None:
    return sharded_local_experts(x_TD, gates, idx, p["up"], p["down"], ffn_mask_F, dt_,
                                 gmm_backend=gmm_backend, batch=batch)
  E, ep = p["up"].shape[0], mesh.shape[EXPERT_AXIS]
  if E % ep:
    raise ValueError(f"{E} routed experts do not split over expert axis of size {ep}")
  axes = token_shards.token_axes(mesh)
  split = EXPERT_AXIS in axes
  rows = P(axes or None)
  ragged = split and (dispatch == "ragged" or (dispatch == "auto" and not emulate_ragged()))

  def island(x, g, i, up, down):
    if ragged:
      return _exchange(x, g, i, up, down, ffn_mask_F, dt_, gmm_backend)
    if split:
      x, g, i = (jax.lax.all_gather(a, EXPERT_AXIS, tiled=True) for a in (x, g, i))
    else:
      # The same tokens on every expert shard, each using them for its own experts: typed as
      # varying so that their cotangents are summed over the shards (pcast's transpose is a
      # psum; the implicit cast jax inserts misses the gather below and keeps one shard's part).
      x, g = (jax.lax.pcast(a, EXPERT_AXIS, to="varying") for a in (x, g))
    first = jax.lax.axis_index(EXPERT_AXIS) * up.shape[0]
    y = local_experts(x, g, i, up, down, ffn_mask_F, dt_, first, gmm_backend)
    if split:
      return jax.lax.psum_scatter(y, EXPERT_AXIS, scatter_dimension=0, tiled=True)
    return jax.lax.psum(y, EXPERT_AXIS)

  experts = P(EXPERT_AXIS)
  return jax.shard_map(island, mesh=mesh, in_specs=(rows, rows, rows, experts, experts),
                       check_vma=typed_island(gmm_backend),
                       out_specs=rows)(x_TD, gates, idx, p["up"], p["down"])
