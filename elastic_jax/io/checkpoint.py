"""One nested Orbax checkpoint for the whole family; restore any sub-model reading prefixes only.

Layout of a checkpoint directory:
  metadata.json   format tag, ModelConfig, axis choices, budget -> counts, tokenizer reference
  state/          Orbax PyTree checkpoint of {"params": ..., "router": ...} (router optional)
Arrays are stored in small chunks, so restoring a sub-model (Orbax partial restore with a smaller
`global_shape`, i.e. a prefix of each dim) reads about that sub-model's share of the bytes.
Saves are atomic: everything is written to a temporary sibling directory, then renamed.

A quantized family (`quant.tree.quantize_params`: QTensor leaves) saves the same way: each
QTensor's packed codes, block scales and global scale are arrays of their own, the metadata
records each quantized leaf's format and block axis, and a sub-model reads the prefix of its
codes and scales that its float prefix stands for (`quant.qtensor.abstract`).
"""
from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import time
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from elastic_jax.config import ModelConfig
from elastic_jax.elastic.axes import AXES, normalize_counts
from elastic_jax.elastic.slicing import sliced_config
from elastic_jax.io import fingerprint
from elastic_jax.model import layouts
from elastic_jax.model.model import param_shapes
from elastic_jax.parallel import sharding as shd
from elastic_jax.parallel.rules import DEFAULT_RULES, Rules, mesh_axes_of
from elastic_jax.quant import qtensor

FORMAT = "elastic-jax-nested-v2"
TOKENIZER_FILE = "tokenizer.json"   # stored inside the checkpoint folder
# v1 (elastic-jax 0.1): layers as a list and bare norm weights; restored through `layouts`.
LEGACY_FORMATS = ("elastic-jax-nested-v1",)
# Each leaf is split into about CHUNKS_PER_LEAF chunks (bounded in bytes): fine enough that a
# prefix restore reads close to its share, coarse enough to keep the file count moderate.
CHUNKS_PER_LEAF = 128
MIN_CHUNK_BYTES, MAX_CHUNK_BYTES = 4 << 10, 8 << 20


class CheckpointError(ValueError):
  pass


def _checkpointer():
  # Plain zarr (one file per chunk) rather than OCDBT: a prefix restore then opens only the
  # chunk files it intersects.
  return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False))


def _flat_shapes(tree) -> dict[str, tuple]:
  """{leaf path: shape}; a QTensor is one leaf of its float shape."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=qtensor.is_qtensor)
  return {jax.tree_util.keystr(p): tuple(x.shape) for p, x in flat}


def _component_shapes(tree) -> dict[str, tuple]:
  """{array path: shape} of every stored array (a QTensor's components by name), keyed the way
  Orbax's metadata tree spells them (attribute names as dict keys)."""
  key = lambda k: repr(k.name if isinstance(k, jax.tree_util.GetAttrKey) else
                       getattr(k, "key", getattr(k, "idx", None)))
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {"".join(f"[{key(k)}]" for k in p): tuple(x.shape) for p, x in flat}


def _quantized(params) -> dict[str, dict]:
  """{leaf path: format, block axis, float dtype} of every QTensor leaf of `params`."""
  flat, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=qtensor.is_qtensor)
  return {jax.tree_util.keystr(p): qtensor.describe(x) for p, x in flat
          if qtensor.is_qtensor(x)}


def _as_quantized(shapes, recorded: Mapping[str, Mapping]):
  """The float `shapes` tree with each leaf the checkpoint stores quantized replaced by the
  abstract QTensor of that shape (`recorded`: metadata "quantized", keyed by leaf path)."""
  if not recorded:
    return shapes
  return jax.tree_util.tree_map_with_path(
      lambda p, s: (qtensor.abstract(s.shape, **recorded[jax.tree_util.keystr(p)])
                    if jax.tree_util.keystr(p) in recorded else s), shapes)


def _quantized_boxes(boxes: Mapping, params) -> dict:
  """`prefix_boxes` with each quantized leaf's entry replaced by its components' boxes (the
  codes and scales a float prefix box stands for)."""
  flat, _ = jax.tree_util.tree_flatten_with_path({"params": params}, is_leaf=qtensor.is_qtensor)
  out = dict(boxes)
  for p, x in flat:
    k = jax.tree_util.keystr(p)
    if qtensor.is_qtensor(x):
      for comp in ("codes", "block_scale", "global_scale"):
        if getattr(x, comp) is not None:
          out[f"{k}.{comp}"] = sorted({qtensor.component_shapes(x, b)[comp]
                                       for b in out[k]})
      del out[k]
  return out


def _check_params(params, config: ModelConfig, what: str):
  want, got = _flat_shapes(param_shapes(config)), _flat_shapes(params)
  missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
  if missing or extra:
    raise CheckpointError(f"{what}: parameter tree does not match the config; missing "
                          f"{missing[:5]}, unexpected {extra[:5]}")
  for k, shape in want.items():
    if got[k] != shape:
      raise CheckpointError(f"{what}: leaf {k} has shape {got[k]}, config expects {shape}")


def leftover_tmp_dirs(directory: str) -> list[str]:
  """Names in `directory` of unfinished `save` outputs (`<name>.tmp-<pid>-<ns>` folders that a
  killed process left; a finished save renames its folder)."""
  pat = re.compile(r"^.+\.tmp-\d+-\d+$")
  return sorted(n for n in os.listdir(directory)
                if pat.match(n) and os.path.isdir(os.path.join(directory, n)))


def save(path: str, params, config: ModelConfig, *, router=None,
         budget_counts: Mapping[str, Mapping[str, Any]] | None = None,
         tokenizer: str | None = None, extra: Mapping[str, Any] | None = None,
         overwrite: bool = False, chunk_byte_size: int | None = None) -> str:
  """Atomically writes a nested checkpoint of `params` (the full parent) to `path`.

  `chunk_byte_size` fixes the stored chunk size; by default each leaf gets about
  `CHUNKS_PER_LEAF` chunks of 4 KiB to 8 MiB.
  """
  path = os.path.abspath(path)
  _check_params(params, config, "save")
  budget_counts = {str(b): dict(c) for b, c in (budget_counts or {}).items()}
  for b, c in budget_counts.items():
    config.budget_fraction(b)
    normalize_counts(config, c)
  if os.path.exists(path) and not overwrite:
    raise CheckpointError(f"{path} exists; pass overwrite=True to replace it")
  if tokenizer and not os.path.isfile(tokenizer):
    raise CheckpointError(f"tokenizer file {tokenizer!r} not found")
  if os.path.exists(path) and not is_checkpoint(path):
    raise CheckpointError(f"refusing to replace {path}: it is not a checkpoint of ours (no "
                          f"{FORMAT!r} metadata.json); remove it yourself or pick another path")
  # Every process writes its shards into the same temporary folder (named by process 0);
  # process 0 alone writes the metadata and renames it into place.
  tmp = f"{path}.tmp-{_shared_suffix()}"
  primary = jax.process_index() == 0
  if primary:
    os.makedirs(tmp)
  _sync(f"checkpoint.save:mkdir:{tmp}")
  try:
    state = {"params": params} if router is None else {"params": params, "router": router}
    args = jax.tree_util.tree_map(
        lambda x: ocp.SaveArgs(chunk_byte_size=chunk_byte_size or _auto_chunk_bytes(x)), state)
    _checkpointer().save(os.path.join(tmp, "state"), state, save_args=args)
    sums = fingerprint.fingerprints(state)
    # Of every prefix box a sub-model restore can read (any counts among the choices, per
    # layer too): it is checked without reading the rest of each leaf.
    flat = {jax.tree_util.keystr(k): x for k, x in
            jax.tree_util.tree_flatten_with_path({"params": params})[0]}
    boxes = fingerprint.box_fingerprints(flat, _quantized_boxes(prefix_boxes(config), params))
    if tokenizer and primary:   # inside the checkpoint: a moved run keeps its own tokenizer
      shutil.copyfile(tokenizer, os.path.join(tmp, TOKENIZER_FILE))
    meta = {"format": FORMAT, "config": config.to_dict(),
            "axes": {n: list(a.choices(config)) for n, a in AXES.items()},
            "budget_counts": {b: {k: list(v) if isinstance(v, (list, tuple)) else int(v)
                                  for k, v in c.items()} for b, c in budget_counts.items()},
            "has_router": router is not None, "tokenizer": TOKENIZER_FILE if tokenizer else None,
            "extra": dict(extra or {}),
            "leaf_shapes": {k: list(v) for k, v in _flat_shapes(params).items()},
            "quantized": _quantized(params),
            "fingerprints": sums, "box_fingerprints": boxes}
    if primary:
      with open(os.path.join(tmp, "metadata.json"), "w") as f:
        json.dump(meta, f, indent=1)
      old = None
      if os.path.exists(path):
        old = f"{path}.old-{time.time_ns()}"
        os.rename(path, old)
      os.rename(tmp, path)
      if old:
        shutil.rmtree(old, ignore_errors=True)
  except BaseException:
    if primary:
      shutil.rmtree(tmp, ignore_errors=True)
    raise
  _sync(f"checkpoint.save:done:{path}")   # no process reads `path` before it is in place
  return path


def _shared_suffix() -> str:
  """"<pid>-<ns>" of process 0, the same on every process (the leftover-save pattern)."""
  here = (os.getpid(), time.time_ns())
  if jax.process_count() == 1:
    return f"{here[0]}-{here[1]}"
  words = np.array([here[0], here[1] >> 32, here[1] & 0xFFFFFFFF], np.uint32)
  pid, hi, lo = (int(w) for w in multihost_utils.broadcast_one_to_all(words))
  return f"{pid}-{(hi << 32) | lo}"


def _sync(name: str) -> None:
  """A barrier across processes (nothing with one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def _auto_chunk_bytes(x) -> int:
  nbytes = int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize
  return int(min(max(nbytes // CHUNKS_PER_LEAF, MIN_CHUNK_BYTES), MAX_CHUNK_BYTES))


def tokenizer_file(path: str) -> str | None:
  """The tokenizer of checkpoint `path`: the copy stored inside it; for checkpoints written
  before tokenizers were stored, the file its metadata names, or one of that name beside it."""
  ref = load_metadata(path).get("tokenizer")
  if not ref:
    return None
  cands = [os.path.join(path, ref)] if not os.path.isabs(ref) else []
  cands += [ref, os.path.join(os.path.dirname(os.path.abspath(path)), os.path.basename(ref))]
  for cand in cands:
    if os.path.isfile(cand):
      return cand
  raise CheckpointError(f"{path}: tokenizer file {ref!r} not found")


def is_checkpoint(path: str) -> bool:
  """Whether `path` is a directory `save` wrote (its metadata.json names our format)."""
  try:
    with open(os.path.join(path, "metadata.json")) as f:
      return str(json.load(f).get("format", "")).startswith("elastic-jax")
  except (OSError, ValueError, AttributeError):
    return False


def load_metadata(path: str) -> dict:
  meta_path = os.path.join(path, "metadata.json")
  if not os.path.isdir(path):
    raise CheckpointError(f"no checkpoint directory at {path}")
  try:
    with open(meta_path) as f:
      meta = json.load(f)
  except FileNotFoundError:
    raise CheckpointError(f"{path}: missing metadata.json (not an elastic-jax checkpoint, or "
                          "an interrupted save)") from None
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{meta_path}: corrupt JSON ({e})") from None
  if meta.get("format") not in (FORMAT,) + LEGACY_FORMATS:
    raise CheckpointError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r} (or the "
                          f"older {list(LEGACY_FORMATS)})")
  return meta


def load_config(path: str) -> ModelConfig:
  try:
    return ModelConfig.from_dict(load_metadata(path)["config"])
  except (TypeError, KeyError) as e:
    raise CheckpointError(f"{path}: bad config in metadata.json ({e})") from None


def resolve_counts(path: str, budget: str | Mapping[str, Any] | None) -> dict | None:
  """Budget name (looked up in the checkpoint's budget table) or explicit counts -> counts."""
  if budget is None or isinstance(budget, Mapping):
    return None if budget is None else dict(budget)
  meta = load_metadata(path)
  table = meta.get("budget_counts", {})
  if budget not in table:
    raise CheckpointError(f"{path}: unknown budget {budget!r}; this checkpoint has counts for "
                          f"{sorted(table)} (or pass explicit per-axis counts)")
  return table[budget]


def prefix_boxes(config: ModelConfig) -> dict[str, list[tuple[int, ...]]]:
  """{leaf path (as `fingerprint.fingerprints` names it): every prefix shape a sub-model restore
  can read from it}: per dim, the sizes of the axis that touches it (`AXES` uses; each choice's
  `dim_size`), else the full size; all their combinations."""
  shapes = {tuple(k.key for k in path): x.shape for path, x in
            jax.tree_util.tree_flatten_with_path({"params": param_shapes(config)})[0]}
  options = {path: [{n} for n in shape] for path, shape in shapes.items()}
  for axis in AXES.values():
    sizes = {int(axis.dim_size(c, config)) for c in axis.choices(config)}
    for use in axis.uses:
      if use.kind == "global":
        paths = [("params",) + use.path]
      else:
        paths = [("params", "layers", str(i)) + use.path
                 for i, kind in enumerate(config.layer_pattern) if use.kind in (kind, "all")]
      for path in paths:   # a sliced model's config may list choices above its own size
        options[path][use.dim] |= {n for n in sizes if n <= shapes[path][use.dim]}
  return {"".join(f"[{k!r}]" for k in path): sorted(itertools.product(*map(sorted, opts)))
          for path, opts in options.items()}


def _box_mismatches(params, recorded: Mapping) -> list[str]:
  """Leaves of a restored sub-model whose prefix-box fingerprint differs from the one recorded
  for that box of the stored leaf."""
  bad = []
  for path, x in jax.tree_util.tree_flatten_with_path({"params": params})[0]:
    key = jax.tree_util.keystr(path)
    want = (recorded.get(key) or {}).get(",".join(map(str, x.shape)))
    if want is not None and fingerprint.box_fingerprint(x) != list(want):
      bad.append(key)
  return bad


def restore(path: str, budget: str | Mapping[str, Any] | None = None, *,
            expected_config: ModelConfig | None = None, sharding=None,
            rules: Rules = DEFAULT_RULES):
  """(params, config) of the sub-model at `budget` (a name or per-axis counts; None = full).

  Reads only the prefix of every array that the sub-model needs, and checks what it read
  against the fingerprints recorded at save time: the whole leaves' for a full read, and for a
  sub-model (a named budget or any counts among the choices, per layer too) each leaf's
  prefix box (`prefix_boxes`, `fingerprint.box_fingerprints`).

  `sharding`: where the arrays land, read straight into it (each process reads its shards): a
  `jax.sharding.Mesh` (every leaf on its logical-axis sharding for the sub-model's shapes, by
  `rules`; `parallel.sharding.param_shardings`), one `Sharding` for every leaf, or a pytree of
  shardings matching the sub-model's params. Default: the first device."""
  path = os.path.abspath(path)
  config = load_config(path)
  if expected_config is not None and expected_config != config:
    a, b = expected_config.to_dict(), config.to_dict()
    diff = sorted(k for k in a if a[k] != b.get(k))
    raise CheckpointError(f"{path}: config mismatch in fields {diff}")
  counts = resolve_counts(path, budget)
  small = sliced_config(config, counts)
  meta = load_metadata(path)
  # A v1 checkpoint stores the 0.1 layout: read it as such, convert after the restore.
  legacy = meta["format"] in LEGACY_FORMATS
  layout = layouts.to_legacy if legacy else (lambda tree: tree)
  stored = meta["leaf_shapes"]
  want = _flat_shapes(layout(param_shapes(config)))
  for k, shape in want.items():
    if k not in stored:
      raise CheckpointError(f"{path}: checkpoint lacks leaf {k}")
    if tuple(stored[k]) != shape:
      raise CheckpointError(f"{path}: leaf {k} stored with shape {tuple(stored[k])}, config "
                            f"expects {shape}")
  ckptr = _checkpointer()
  state_dir = os.path.join(path, "state")
  try:
    on_disk = ckptr.metadata(state_dir).item_metadata.tree["params"]
  except Exception as e:  # orbax raises many types for a damaged directory
    raise CheckpointError(f"{path}: unreadable Orbax state ({type(e).__name__}: {e})") from None
  quantized = meta.get("quantized") or {}
  disk_shapes = _component_shapes(on_disk)
  for k, shape in _component_shapes(
      _as_quantized(layout(param_shapes(config)), quantized)).items():
    if disk_shapes.get(k) != shape:
      raise CheckpointError(f"{path}: Orbax state leaf {k} has shape {disk_shapes.get(k)}, "
                            f"expected {shape}")
  shapes = param_shapes(small)
  sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
  if isinstance(sharding, jax.sharding.Mesh):
    sharding = shd.param_shardings(shapes, small, sharding, rules)
  if isinstance(sharding, jax.sharding.Sharding):
    sharding = jax.tree_util.tree_map(lambda _: sharding, shapes)
  # A depth budget reads only its kept layers, under their stored (parent) indices.
  kept = config.kept_layers(normalize_counts(config, counts)["depth"][0])
  stored_names = lambda tree: {**tree, "layers": {str(kept[int(j)]): v
                                                  for j, v in tree["layers"].items()}}
  abstract = layout(_as_quantized(stored_names(shapes), quantized))
  # A quantized leaf's codes and block scales land as its float leaf would (same rank), its
  # global scale on the same devices, whole.
  sharding = jax.tree_util.tree_map_with_path(
      lambda p, sh, s: (_component_shardings(sh, quantized[jax.tree_util.keystr(p)], s.shape)
                        if jax.tree_util.keystr(p) in quantized else sh),
      stored_names(sharding), stored_names(shapes))
  args = jax.tree_util.tree_map(
      lambda s, sh: ocp.ArrayRestoreArgs(global_shape=s.shape, dtype=s.dtype, sharding=sh,
                                         strict=False), abstract, layout(sharding))
  try:
    state = ckptr.restore(state_dir, item={"params": abstract}, restore_args={"params": args},
                          partial_restore=True)  # the router, if any, is restored separately
  except Exception as e:
    raise CheckpointError(f"{path}: restore failed ({type(e).__name__}: {e})") from None
  if counts is None:   # a full read: the whole leaves' fingerprints
    bad = fingerprint.mismatches({"params": state["params"]}, meta.get("fingerprints") or {})
  else:                # a sub-model: each leaf's prefix box
    bad = [] if legacy else _box_mismatches(state["params"], meta.get("box_fingerprints") or {})
  if bad:
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    raise CheckpointError(f"{path}: leaf {bad[0]}{more} does not match the fingerprint "
                          f"recorded when it was saved: corrupt files under {state_dir}")
  params = layouts.from_legacy(state["params"]) if legacy else state["params"]
  params = {**params, "layers": {str(j): params["layers"][str(i)] for j, i in enumerate(kept)}}
  _check_params(params, small, "restore")
  return params, small


def _component_shardings(sh, desc: Mapping, shape) -> qtensor.QTensor:
  """Shardings of the components of a QTensor (`desc`: its recorded format, axis, dtype) whose
  float leaf of `shape` would have `sh`: codes and block scales split as the float leaf is,
  except along a dim the shorter component no longer divides (the block axis: 1/2, 1/16), which
  stays whole; the global scale whole, on the same devices."""
  a = qtensor.abstract(shape, **desc)
  if not isinstance(sh, jax.sharding.NamedSharding):
    return qtensor.QTensor(sh, None if a.block_scale is None else sh, sh, **desc)

  def fit(comp):
    spec = list(sh.spec) + [None] * (len(comp.shape) - len(sh.spec))
    for d, names in enumerate(spec):
      parts = int(np.prod([sh.mesh.shape[n] for n in mesh_axes_of(names)]))
      if comp.shape[d] % parts:
        spec[d] = None
    return jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(*spec))

  whole = jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec())
  return qtensor.QTensor(fit(a.codes), None if a.block_scale is None else fit(a.block_scale),
                         whole, **desc)


def restore_router(path: str):
  """The router state saved with the checkpoint (None if it has none)."""
  if not load_metadata(path).get("has_router"):
    return None
  return _checkpointer().restore(os.path.join(os.path.abspath(path), "state"))["router"]


def bytes_read() -> int:
  """Bytes tensorstore has read from local files in this process (for benchmarks)."""
  import tensorstore as ts
  metrics = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read")
  return int(sum(v["value"] for m in metrics for v in m.get("values", [])))

