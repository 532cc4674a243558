"""The steps of the main job, reusable by experiments: data, the nested parent, the elastic family.

Everything lives in one run directory: tokenizer.json, metrics.jsonl, tb/ (TensorBoard),
checkpoints/<phase>/ (Orbax CheckpointManager per phase), parent/ (the nested teacher) and
nested/ (the trained family). Each step resumes from what the directory already holds.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
from typing import Sequence

import jax

from elastic_jax import rng
from elastic_jax.io import checkpoint, lock
from elastic_jax.training import data, optim, phases
from elastic_jax.elastic import deploy, measures
from elastic_jax.elastic import router as router_lib
from elastic_jax.config import CHOICE_FIELDS, EXPERT_PLACEMENTS, ModelConfig
from elastic_jax.elastic.importance import compute_importance
from elastic_jax.training.metrics import MetricsWriter
from elastic_jax.model.model import init, param_shapes
from elastic_jax.parallel import mesh as mesh_lib
from elastic_jax.parallel import sharding as shd
from elastic_jax.elastic.nesting import nest, nested_config
from elastic_jax.quant import tree as quant_tree
from elastic_jax.quant.qtensor import FORMATS
from elastic_jax.quant.tree import QuantSpec


# Run-config fields with a range: (field, type, low, high, low inclusive). `int` fields must be
# ints; `float` fields any real number.
_RANGES = (
    ("seed", int, 0, None, True), ("log_every", int, 1, None, True),
    ("checkpoint.keep", int, 1, None, True), ("checkpoint.save_every", int, 1, None, True),
    ("data.n_text", int, 0, None, True), ("data.n_reasoning", int, 0, None, True),
    ("data.seq_len", int, 2, None, True), ("data.batch", int, 1, None, True),
    ("pretrain.steps", int, 0, None, True), ("pretrain.lr", float, 0, None, False),
    ("pretrain.warmup", int, 0, None, True), ("pretrain.weight_decay", float, 0, None, True),
    ("elastic.stage1_steps", int, 0, None, True), ("elastic.stage2_steps", int, 0, None, True),
    ("elastic.stage2_len_mult", int, 1, None, True), ("elastic.lr", float, 0, None, False),
    ("elastic.router_lr", float, 0, None, False), ("elastic.warmup", int, 0, None, True),
    ("elastic.weight_decay", float, 0, None, True), ("elastic.budget_weight", float, 0, None, True),
    ("elastic.hard_prob", float, 0, 1, True), ("elastic.calib_batches", int, 1, None, True),
    ("router.hidden", int, 1, None, True), ("router.scale_end", float, 0, None, False),
    ("router.tau_min", float, 0, 1, False), ("router.tau_anneal_frac", float, 0, 1, False),
    ("router.band", float, 0, 1, True), ("router.anchor_weight", float, 0, None, True),
    ("router.band_weight", float, 0, None, True),
    ("quant.qad_steps", int, 0, None, True), ("quant.lr", float, 0, None, False),
    ("quant.warmup", int, 0, None, True),
    ("eval.n_reasoning", int, 0, None, True), ("eval.max_think_tokens", int, 1, None, True),
    ("eval.max_answer_tokens", int, 1, None, True),
)


def _check_range(c, field: str, kind, lo, hi, lo_incl: bool) -> None:
  value = c
  for part in field.split("."):
    value = value[part]
  ok_type = (isinstance(value, int) if kind is int else isinstance(value, (int, float)))
  ok = ok_type and not isinstance(value, bool) and (value >= lo if lo_incl else value > lo) and (
      hi is None or value <= hi)
  if not ok:
    bound = f"{'>=' if lo_incl else '>'} {lo}" + ("" if hi is None else f" and <= {hi}")
    raise ValueError(f"{field} must be {'an int' if kind is int else 'a number'} {bound}, "
                     f"got {value!r}")


def check_run_config(c) -> None:
  """ValueError naming the first run-config field whose value would misbehave (e.g.
  `checkpoint.keep=0` would delete each checkpoint as soon as it is committed), before any
  work is done."""
  for rule in _RANGES:
    _check_range(c, *rule)
  optim.check_master(c.optim.master)
  if c.elastic.expert_placement not in EXPERT_PLACEMENTS:
    raise ValueError(f"elastic.expert_placement must be one of {EXPERT_PLACEMENTS}, got "
                     f"{c.elastic.expert_placement!r}")
  phases.check_chunk("pretrain.lm_chunk", c.pretrain.lm_chunk)
  phases.check_chunk("elastic.kd_chunk", c.elastic.kd_chunk)
  phases.check_budget_probs(len(c.model.budgets), c.elastic.p_full, tuple(c.elastic.stage2_probs))
  cost_model(c)
  ModelConfig.from_dict(c.model.to_dict())  # budgets and shapes, before anything is written
  quant_spec(c)
  M = c.elastic.micro_batches
  if not isinstance(M, int) or isinstance(M, bool) or M < 1 or c.data.batch % M:
    raise ValueError(f"elastic.micro_batches must be an int >= 1 dividing data.batch "
                     f"({c.data.batch}), got {M!r}")


def quant_spec(config) -> QuantSpec | None:
  """The run's quantized family (`quant` section) as a QuantSpec, None without one; checks the
  format, the leaf names and (nvfp4) that the config's block dims and choices allow nesting."""
  q = config.quant
  if not q.format:
    return None
  if q.format not in FORMATS:
    raise ValueError(f"quant.format must be one of '', {', '.join(map(repr, FORMATS))}; got "
                     f"{q.format!r}")
  spec = QuantSpec(q.format, tuple(q.leaves), tuple(q.fp8_leaves))
  quant_tree.check(ModelConfig.from_dict(config.model.to_dict()), spec)
  return spec


# Config sections that change what a run computes: a rerun on the same workdir must match them
# (logging, checkpointing, evaluation and the mesh may change between attempts). The `quant`
# section is recorded per format: quantizing a finished run adds to it (see `_check_rerun`).
RESULT_SECTIONS = ("seed", "model", "data", "pretrain", "elastic", "router", "optim")
RUN_RECORD = "run_config.json"
# What `restart` removes from a workdir: the run's own outputs, nothing else.
RUN_OUTPUTS = ("checkpoints", "parent", "nested", "tb", "metrics.jsonl", "tokenizer.json",
               RUN_RECORD) + tuple(f"nested_{f}" for f in FORMATS)


def _flat(d, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


@dataclasses.dataclass
class Run:
  """One run directory and its ml_collections config (see configs/training.py). `inputs`: what
  else decides the result (e.g. the data files, the HF parent); a rerun must match them and the
  config's RESULT_SECTIONS, or pass `restart` to clear the workdir's outputs and start over."""
  config: object          # ml_collections.ConfigDict
  workdir: str
  inputs: dict = dataclasses.field(default_factory=dict)
  restart: bool = False

  def __post_init__(self):
    check_run_config(self.config)   # refused before anything is written
    self.workdir = os.path.abspath(self.workdir)
    os.makedirs(self.workdir, exist_ok=True)
    # One job per workdir (process 0 holds the lock for a multi-process job).
    self._lock = lock.lock_workdir(self.workdir) if jax.process_index() == 0 else None
    if self._lock is not None:
      for name in checkpoint.leftover_tmp_dirs(self.workdir):
        shutil.rmtree(os.path.join(self.workdir, name))
        print(f"removed {name}: a save that a killed run left unfinished", flush=True)
      self._check_rerun()
    self.writer = MetricsWriter(self.workdir)

  def _check_rerun(self) -> None:
    """Records the settings in RUN_RECORD on the first attempt; refuses a rerun whose settings
    differ, naming the fields (`restart` removes RUN_OUTPUTS first)."""
    c = self.config.to_dict()
    inputs = {k: v for k, v in self.inputs.items() if v}   # an unset input is no input
    # The held-out evaluation items decide the corpus too (it leaves their questions out).
    held = {"n_reasoning": c["eval"]["n_reasoning"], "sources": list(c["eval"]["sources"])}
    record = {"config": {k: c[k] for k in RESULT_SECTIONS}, "held_out": held, "inputs": inputs}
    if c["quant"]["format"]:
      record["quant"] = {c["quant"]["format"]: c["quant"]}
    record = json.loads(json.dumps(record))
    path = os.path.join(self.workdir, RUN_RECORD)
    if self.restart:
      for name in RUN_OUTPUTS:
        target = os.path.join(self.workdir, name)
        if os.path.isdir(target):
          shutil.rmtree(target)
        elif os.path.exists(target):
          os.remove(target)
    if os.path.exists(path):
      with open(path) as f:
        old_record = json.load(f)
      # Records written before "held_out" was recorded: their runs are taken to match (and
      # the record is completed below).
      legacy = "held_out" not in old_record
      old_record = {**old_record, "held_out": old_record.get("held_out", held)}
      # Every format a run has quantized to stays recorded; only a format made before must
      # keep its settings (a new one, or none, adds nothing to compare).
      made, asked = old_record.get("quant", {}), record.pop("quant", {})
      # Formats made before fp8_leaves existed had none.
      made = {f: {"fp8_leaves": [], **v} for f, v in made.items()}
      compared = dict(record)
      if made:
        compared["quant"] = {**made, **{f: v for f, v in asked.items() if f in made}}
      if made or asked:
        record["quant"] = {**made, **asked}
      old, new = _flat(old_record), _flat(compared)
      changed = sorted(k for k in set(old) | set(new)
                       if old.get(k, "<unset>") != new.get(k, "<unset>"))
      if changed:
        raise ValueError(f"{self.workdir} holds a run with other settings ({', '.join(changed[:6])}"
                         f"{', ...' if len(changed) > 6 else ''}); rerun with the same settings "
                         "to resume, pass --restart to start this workdir over, or use another "
                         "--workdir")
      if record == old_record and not legacy:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(record, f, indent=1)
    os.replace(tmp, path)

  @property
  def tokenizer_path(self) -> str:
    return os.path.join(self.workdir, "tokenizer.json")

  @functools.cached_property
  def mesh(self):
    """The device mesh of `config.parallel.mesh`, or None (one device)."""
    spec = self.config.parallel.mesh
    if not spec:
      return None
    m = mesh_lib.make_mesh(spec)
    print(f"mesh: {mesh_lib.describe(m)} over {m.size} {m.devices.flat[0].platform} devices",
          flush=True)
    return m

  @property
  def rules(self) -> tuple:
    """The config's logical-axis sharding rules as a tuple of (name, mesh axes) pairs."""
    return tuple(map(tuple, self.config.parallel.rules))

  def loop(self, phase: str) -> phases.LoopOptions:
    c = self.config
    return phases.LoopOptions(os.path.join(self.workdir, "checkpoints", phase), self.writer,
                              c.log_every, c.checkpoint.save_every, c.checkpoint.keep,
                              mesh=self.mesh, rules=self.rules,
                              master=c.optim.master)

  @property
  def seq_lens(self) -> tuple[int, int]:
    L1 = self.config.data.seq_len
    return L1, L1 * self.config.elastic.stage2_len_mult


def model_config(run: Run, hf_dir: str | None = None):
  """(ModelConfig, HF params or None): the config's model, or the shapes of a local HF parent
  with the config's elastic choices and budgets. Refuses a budget no architecture among the
  choices can satisfy (`deploy.check_feasible`) before any work."""
  cfg = ModelConfig.from_dict(run.config.model.to_dict())
  if not hf_dir:
    deploy.check_feasible(cfg, router_config(run.config, 1))
    return cfg, None
  from elastic_jax.io import hf
  elastic = {f: getattr(cfg, f) for f, _ in CHOICE_FIELDS.values()}
  cfg = hf.load_config(hf_dir, budgets=cfg.budgets, **elastic)
  deploy.check_feasible(cfg, router_config(run.config, 1))
  place = None
  if run.mesh is not None:   # each tensor goes to its shard as it is read
    place = shd.place_by_path(shd.param_shardings(param_shapes(cfg), cfg, run.mesh, run.rules))
  return cfg, hf.load_params(hf_dir, cfg, place)


def load_data(run: Run, cfg: ModelConfig, data_files: Sequence[str] = ()) -> data.TrainingData:
  """The embedded corpus (or local files), tokenizer and packed rows at both stage lengths. The
  embedded corpus holds none of the held-out evaluation questions (`held_out`)."""
  c = run.config
  docs = (data.local_corpus(data_files) if data_files else
          data.default_corpus(c.data.n_text, c.data.n_reasoning,
                              rng.seed_for(c.seed, "corpus"),
                              tuple(c.data.reasoning_sources), tuple(c.data.reasoning_weights),
                              exclude_questions=[e["question"] for e in held_out(run)]))
  td = data.prepare(docs, cfg.vocab_size, run.seq_lens, run.tokenizer_path,
                    min_val_rows=c.data.batch)
  print(f"data: {len(docs):,} docs, {td.rows[run.seq_lens[0]].size:,} training tokens, "
        f"{td.val.size:,} validation tokens, vocab {td.tokenizer.get_vocab_size()}", flush=True)
  return td


def nested_parent(run: Run, cfg: ModelConfig, td: data.TrainingData, hf_params=None):
  """(a) + (b): the parent (pretrained here unless given), ranked and nested; saved to parent/
  and loaded from there on re-runs. Returns (params, config): with elastic depth the config
  gains the layer ranking (`depth_order`), which every later step reads."""
  c, path = run.config, os.path.join(run.workdir, "parent")
  if os.path.isdir(path):
    saved = checkpoint.load_config(path)
    teacher, cfg = checkpoint.restore(path, expected_config=cfg.replace(
        depth_order=saved.depth_order))
    print(f"parent: loaded the nested parent from {path}", flush=True)
    return teacher, cfg
  L1, B = run.seq_lens[0], c.data.batch
  params = hf_params
  if params is None:
    params = phases.pretrain(init(cfg, rng.key(c.seed, "init")), cfg,
                             td.iterator(L1, B, rng.seed_for(c.seed, "pretrain_data")),
                             c.pretrain.steps, run.loop("pretrain"), lr=c.pretrain.lr,
                             warmup=c.pretrain.warmup, weight_decay=c.pretrain.weight_decay,
                             lm_chunk=c.pretrain.lm_chunk, moe_impl=c.elastic.moe_impl)
  calib_it = td.iterator(L1, B, rng.seed_for(c.seed, "calib_data"))
  calib = [next(calib_it)[:, :-1] for _ in range(c.elastic.calib_batches)]
  # The elastic phase's MoE dispatch: any sparse one collects from the routed tokens alone.
  scores = compute_importance(params, cfg, calib, moe_impl=c.elastic.moe_impl)
  teacher, cfg = nest(params, cfg, scores), nested_config(cfg, scores)
  checkpoint.save(path, teacher, cfg, tokenizer=run.tokenizer_path, overwrite=True)
  print(f"parent: ranked and nested, saved to {path}", flush=True)
  return teacher, cfg


def cost_model(config) -> measures.CostModel:
  """The run config's `router.cost` (the memory / latency measures' serving point)."""
  given = config.router.cost.to_dict()
  allowed = [f.name for f in dataclasses.fields(measures.CostModel)]
  unknown = sorted(set(given) - set(allowed))
  if unknown:
    raise ValueError(f"router.cost: unknown fields {unknown}; allowed: {allowed}")
  return measures.CostModel(**given)


def router_config(config, total_steps: int) -> router_lib.RouterConfig:
  """RouterConfig from a run config; tau decays to tau_min at `tau_anneal_frac` of training."""
  r = config.router
  anneal = max(1, int(r.tau_anneal_frac * total_steps))
  return router_lib.RouterConfig(hidden=r.hidden, per_layer=tuple(r.per_layer),
                                 scale_end=r.scale_end, tau_min=r.tau_min,
                                 tau_decay=r.tau_min ** (1.0 / anneal), band=r.band,
                                 anchor_weight=r.anchor_weight, band_weight=r.band_weight,
                                 cost=cost_model(config))


@dataclasses.dataclass
class TrainedFamily:
  """The trained nested family: params, router and the router's counts per budget."""
  params: dict
  router: dict
  router_config: router_lib.RouterConfig
  budget_counts: dict
  schedule: phases.ElasticSchedule

  def tokens(self, run: Run) -> int:
    """Student tokens the elastic phase consumed (both stages)."""
    L1, L2 = run.seq_lens
    B = run.config.data.batch
    return B * (self.schedule.stage1_steps * L1 + self.schedule.stage2_steps * L2)


def elastic_family(run: Run, cfg: ModelConfig, teacher, td: data.TrainingData) -> TrainedFamily:
  """(c) + (d): elastic KD of the whole family from the nested parent, then one nested
  checkpoint (params + router + the router's counts per budget) in nested/."""
  c, e = run.config, run.config.elastic
  schedule = phases.ElasticSchedule(len(cfg.budgets), e.stage1_steps, e.stage2_steps, e.p_full,
                                    tuple(e.stage2_probs), rng.seed_for(c.seed, "budget"),
                                    e.micro_batches)
  rc = router_config(run.config, schedule.total)
  L1, L2 = run.seq_lens
  B = c.data.batch
  params, router = phases.elastic(
      teacher, teacher, cfg, router_lib.init(cfg, rc, rng.key(c.seed, "router_init")), rc,
      schedule, {1: td.iterator(L1, B, rng.seed_for(c.seed, "stage1_data")),
                 2: td.iterator(L2, B, rng.seed_for(c.seed, "stage2_data"))},
      run.loop("elastic"), lr=e.lr, router_lr=e.router_lr, warmup=e.warmup,
      budget_weight=e.budget_weight, hard_prob=e.hard_prob, seed=c.seed, moe_impl=e.moe_impl,
      kd_chunk=e.kd_chunk, weight_decay=e.weight_decay, expert_placement=e.expert_placement)
  counts, report = {}, {}
  for n in cfg.budget_names:
    # Deployed: the router's best architecture inside every band of the budget's targets.
    counts[n] = deploy.deployed_counts(router, cfg, rc, n)
    argmax = router_lib.chosen_counts(router, cfg, rc, n)
    report[n] = {"deployed": deploy.achieved(cfg, rc, counts[n], n), "argmax_counts": argmax,
                 "argmax": deploy.achieved(cfg, rc, argmax, n)}
    off = lambda c: ", ".join(f"{m} {e:+.1%}" for m, e in deploy.errors(cfg, rc, c, n).items())
    if argmax == counts[n] and min(cfg.budget_targets(n).values()) < 1:
      print(f"budget {n}: the router's argmax {argmax} is in band ({off(argmax)}; band "
            f"{rc.band:.0%})", flush=True)
    elif argmax != counts[n]:
      print(f"budget {n}: the router's argmax {argmax} is off its targets by {off(argmax)} "
            f"(band {rc.band:.0%}); deploying its best choice in band, {counts[n]} "
            f"({off(counts[n])})", flush=True)
  # The metadata records, per budget, each target with the deployed and the argmax ratios.
  checkpoint.save(os.path.join(run.workdir, "nested"), params, cfg, router=router,
                  budget_counts=counts, tokenizer=run.tokenizer_path,
                  extra={"router_config": dataclasses.asdict(rc), "budget_report": report},
                  overwrite=True)
  return TrainedFamily(params, router, rc, counts, schedule)


def quantized_family(run: Run, cfg: ModelConfig, family: TrainedFamily,
                     td: data.TrainingData):
  """(e): the trained family quantized once to `quant.format` after `quant.qad_steps` of
  quantization-aware distillation (`phases.qad`: every budget's fake-quantized sub-model vs the
  same budget of the unquantized family, budgets drawn as in stage 1, the router frozen at its
  deployed counts), saved as one quantized nested checkpoint in nested_<format>/ and loaded
  from there on re-runs. Returns the quantized params (QTensor leaves), or None without a
  `quant.format`."""
  c, q = run.config, run.config.quant
  spec = quant_spec(c)
  if spec is None:
    return None
  quant_tree.check(cfg, spec)
  path = os.path.join(run.workdir, f"nested_{spec.fmt}")
  if os.path.isdir(path):
    qparams, _ = checkpoint.restore(path, expected_config=cfg)
    print(f"quant: loaded the {spec.fmt} family from {path}", flush=True)
    return qparams
  params = family.params
  if q.qad_steps:
    e = c.elastic
    schedule = phases.ElasticSchedule(len(cfg.budgets), q.qad_steps, 0, e.p_full,
                                      tuple(e.stage2_probs), rng.seed_for(c.seed, "qad_budget"),
                                      e.micro_batches)
    batches = td.iterator(run.seq_lens[0], c.data.batch, rng.seed_for(c.seed, "qad_data"))
    params = phases.qad(params, cfg, family.budget_counts, spec, schedule, batches,
                        run.loop(f"qad_{spec.fmt}"), lr=q.lr, warmup=q.warmup,
                        moe_impl=e.moe_impl, kd_chunk=e.kd_chunk)
  qparams = quant_tree.quantize_params(params, cfg, spec)
  nested = checkpoint.load_metadata(os.path.join(run.workdir, "nested"))
  checkpoint.save(path, qparams, cfg, router=family.router, budget_counts=family.budget_counts,
                  tokenizer=run.tokenizer_path,
                  extra={**nested.get("extra", {}),
                         "quant": {**q.to_dict(), "leaves": list(q.leaves),
                                   "fp8_leaves": list(q.fp8_leaves)}},
                  overwrite=True)
  how = f"QAD {q.qad_steps} steps" if q.qad_steps else "PTQ"
  print(f"quant: {spec.fmt} family ({how}) saved to {path}", flush=True)
  return qparams


def train_family(run: Run, hf_dir: str | None = None, data_files: Sequence[str] = ()):
  """(a) to (d) of the main job, each step resuming from the workdir: (config, data, nested
  parent, trained family)."""
  cfg, hf_params = model_config(run, hf_dir)
  td = load_data(run, cfg, data_files)
  teacher, cfg = nested_parent(run, cfg, td, hf_params)
  return cfg, td, teacher, elastic_family(run, cfg, teacher, td)


def held_out(run: Run) -> list[dict]:
  """Reasoning items for evaluation, from a seed the corpus does not use."""
  ev = run.config.eval
  return held_out_for(run.config.seed, ev.n_reasoning, ev.sources)


def held_out_for(seed: int, n_reasoning: int, sources: Sequence[str]) -> list[dict]:
  """`held_out` of a run with this seed and these eval settings (what its run record holds)."""
  return data.reasoning_examples(n_reasoning, seed=rng.seed_for(seed, "eval"),
                                 sources=tuple(sources))
