"""Model configuration for the Nemotron-H family and its elastic axes.

`ModelConfig` is a frozen, hashable dataclass so it can be a static argument of `jax.jit`.
Layer pattern characters follow HF `hybrid_override_pattern`: ``M`` Mamba-2, ``*`` attention,
``E`` MoE, ``-`` dense squared-ReLU MLP.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

LAYER_KINDS = {"M": "mamba", "*": "attention", "E": "moe", "-": "mlp"}
DTYPES = ("float32", "bfloat16", "float16")
REMAT = ("none", "full", "save_dots")
ATTENTION_IMPLS = ("blocked", "dot_product", "splash")
KERNELS = ("xla", "pallas")
EXPERT_PLACEMENTS = ("contiguous", "balanced")
EP_DISPATCHES = ("auto", "ragged", "gather")
# Elastic axis name -> (field listing its choices, field holding its full size).
CHOICE_FIELDS = {"hidden": ("hidden_choices", "hidden_size"),
                 "mamba_heads": ("mamba_head_choices", "mamba_num_heads"),
                 "moe_experts": ("expert_choices", "n_routed_experts"),
                 "moe_ffn": ("moe_ffn_choices", "moe_intermediate_size"),
                 "attention_heads": ("attention_head_choices", "num_attention_heads"),
                 "mamba_head_dim": ("mamba_head_dim_choices", "mamba_head_dim"),
                 "depth": ("depth_choices", "num_layers")}
# The axes beyond the paper: with one choice (the full size) their field holds ().
OPTIONAL_CHOICE_FIELDS = ("attention_head_choices", "mamba_head_dim_choices", "depth_choices")
# Per-layer axes: axis name -> per-layer size field, and the layer kind each one sizes.
PER_LAYER_FIELDS = {"mamba_heads": "mamba_heads_per_layer", "moe_experts": "experts_per_layer",
                    "moe_ffn": "moe_ffn_per_layer", "attention_heads": "attention_heads_per_layer",
                    "mamba_head_dim": "mamba_head_dim_per_layer"}
PER_LAYER_KINDS = {"mamba_heads": "M", "moe_experts": "E", "moe_ffn": "E", "attention_heads": "*",
                   "mamba_head_dim": "M"}
# What a budget can target, each as a fraction of the parent's value (elastic/measures.py):
# active / total parameters, inference memory bytes, request latency (an analytic cost model).
BUDGET_MEASURES = ("active", "total", "memory", "latency")


def _targets(name, target) -> tuple[tuple[str, float], ...]:
  """A budget's targets as ((measure, fraction), ...) in BUDGET_MEASURES order: a number is an
  active-parameter fraction; a mapping names its measures."""
  if isinstance(target, Mapping):
    bad = sorted(set(target) - set(BUDGET_MEASURES))
    if bad or not target:
      raise ValueError(f"ModelConfig.budgets: budget {name!r} targets {sorted(target)}; each "
                       f"must be one of {list(BUDGET_MEASURES)} (at least one)")
    return tuple((m, float(target[m])) for m in BUDGET_MEASURES if m in target)
  if isinstance(target, (tuple, list)):  # ((measure, fraction), ...) as normalised here
    return _targets(name, dict(target))
  return (("active", float(target)),)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of one hybrid Mamba-2 / attention / MoE model, plus its elastic choices.

  Each `*_choices` tuple lists the allowed sizes of one elastic axis, descending, the first being
  the full size. `mamba_head_choices` counts heads over the whole layer (a multiple of
  `mamba_n_groups`: the same number is kept in every group). `budgets` names the nested
  sub-models and their targets, each a fraction of the parent's value: a number targets active
  parameters, a mapping any of `BUDGET_MEASURES` at once (e.g. {"total": 0.73, "active": 0.78});
  stored as (name, ((measure, fraction), ...)).
  """
  layer_pattern: str
  hidden_size: int
  vocab_size: int
  # Attention (GQA, no positional encoding).
  num_attention_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  # Mamba-2.
  mamba_num_heads: int = 8
  mamba_head_dim: int = 8
  ssm_state_size: int = 16
  mamba_n_groups: int = 2
  conv_kernel: int = 4
  chunk_size: int = 16
  use_conv_bias: bool = True
  time_step_limit: tuple[float, float] = (0.0, math.inf)
  time_step_min: float = 0.001
  time_step_max: float = 0.1
  time_step_floor: float = 1e-4
  # MoE.
  n_routed_experts: int = 8
  num_experts_per_tok: int = 2
  moe_intermediate_size: int = 32
  moe_shared_expert_intermediate_size: int = 64
  routed_scaling_factor: float = 1.0
  norm_topk_prob: bool = True
  # Dense MLP layers ('-').
  intermediate_size: int = 64
  # Numerics.
  norm_eps: float = 1e-5
  initializer_range: float = 0.02
  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  # Layer stack: scan one repeating unit of the pattern (compiles once for any depth) where the
  # pattern has one and the model is homogeneous; else a Python loop. `remat`: recompute each
  # block in the backward pass ("full"), keep its matmul outputs ("save_dots"), or not ("none").
  scan_layers: bool = False
  remat: str = "none"
  # Full-sequence attention runs in blocks of this many queries, each recomputed in the
  # backward pass, so memory grows as block x T instead of T x T. Sequences no longer than one
  # block take the one-shot path.
  attention_query_block: int = 512
  # Full-sequence attention: "blocked" (the query blocks above; XLA, any backend, the default),
  # "dot_product" (`jax.nn.dot_product_attention`: cuDNN flash attention on GPUs that support
  # it, else XLA's one-shot [T, T] scores) or "splash" (the TPU's splash attention kernel,
  # blocks of attention_query_block; interpreted on CPU, for tests). Decoding over a cache is
  # the same for all.
  attention_impl: str = "blocked"
  # The chunked SSD scan and the grouped expert matmul (MoE dispatch "ragged" / "ep"): "xla"
  # (pure jnp and `jax.lax.ragged_dot`, the fast CPU path) or "pallas" (`pallas_kernels`: the
  # SSD kernels, megablox on TPU, tokamax on GPU; run in Pallas' interpreter on CPU, for tests).
  kernels: str = "xla"
  # Order of the routed experts in the params' expert axis: "contiguous" (logical order, what
  # checkpoints, slicing and export hold) or "balanced" (`model.expert_placement`: every
  # budget's expert prefix spread evenly over the shards of an expert-parallel mesh; training
  # permutes into it and back, the model permutes the expert masks to match).
  expert_placement: str = "contiguous"
  # Expert-parallel dispatch when tokens are split over the `expert` axis too (MoE "ep"):
  # "ragged" (each assignment sent to its expert's shard and back with
  # `jax.lax.ragged_all_to_all`; emulated with all_gather on CPU, which cannot compile it),
  # "gather" (all_gather the tokens, psum_scatter the outputs: portable), or "auto" (ragged on
  # GPU / TPU, gather on CPU).
  ep_dispatch: str = "auto"
  # Packed training rows hold several documents, each starting with `bos_token_id`: with
  # `segment_packing`, full-sequence passes keep attention and the Mamba conv and SSM state
  # within each document (a row computes what its documents would alone). Decoding over a
  # cache holds one document and is unaffected.
  segment_packing: bool = False
  # Special tokens (real tokenizer: bos 1, eos 2, pad 0, <think> 12, </think> 13).
  bos_token_id: int = 1
  eos_token_id: int = 2
  pad_token_id: int = 0
  # Elastic axes; empty means "full size only".
  hidden_choices: tuple[int, ...] = ()
  mamba_head_choices: tuple[int, ...] = ()
  expert_choices: tuple[int, ...] = ()
  moe_ffn_choices: tuple[int, ...] = ()
  # Axes beyond the paper (Nemotron Elastic / Flextron): query heads per attention layer (the
  # same number kept in each KV group, so a multiple of `num_kv_heads`) and channels per Mamba
  # head. Inert by default: full size only, stored as () (as depth's below).
  attention_head_choices: tuple[int, ...] = ()
  mamba_head_dim_choices: tuple[int, ...] = ()
  # Depth: how many layers a budget keeps (the first choice is all of them), which ones by
  # `depth_order`: layer indices, most important first (set by nesting from the loss increase
  # when each layer is dropped); () = the pattern's order. Keeping n layers keeps
  # depth_order[:n], in the pattern's order.
  depth_choices: tuple[int, ...] = ()
  depth_order: tuple[int, ...] = ()
  budgets: tuple[tuple[str, Any], ...] = (("full", 1.0),)
  # Heterogeneous (sliced per-layer) models: one size per layer of that kind; () = homogeneous.
  # The homogeneous fields above then hold the largest per-layer size.
  mamba_heads_per_layer: tuple[int, ...] = ()
  experts_per_layer: tuple[int, ...] = ()
  moe_ffn_per_layer: tuple[int, ...] = ()
  attention_heads_per_layer: tuple[int, ...] = ()
  mamba_head_dim_per_layer: tuple[int, ...] = ()

  def __post_init__(self):
    # Fill empty choice lists with the full size, then validate everything.
    for name, size_field in CHOICE_FIELDS.values():
      value = tuple(int(v) for v in getattr(self, name)) or (getattr(self, size_field),)
      if name in OPTIONAL_CHOICE_FIELDS and len(value) == 1:
        # Full size only: kept as () so that a config made by `replace(num_attention_heads=...,
        # layer_pattern=...)` (or an HF parent's shapes) carries no stale full size.
        value = ()
      object.__setattr__(self, name, value)
    for name in PER_LAYER_FIELDS.values():
      object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
    object.__setattr__(self, "depth_order", tuple(int(v) for v in self.depth_order))
    object.__setattr__(self, "time_step_limit", tuple(float(v) for v in self.time_step_limit))
    object.__setattr__(self, "budgets", tuple((str(n), _targets(n, t)) for n, t in self.budgets))
    self._validate()

  # ---------------------------------------------------------------- derived shapes
  @property
  def num_layers(self) -> int:
    return len(self.layer_pattern)

  def layers_of(self, kind: str) -> tuple[int, ...]:
    """Indices of the layers whose pattern char is `kind` ('M', '*', 'E', '-')."""
    return tuple(i for i, c in enumerate(self.layer_pattern) if c == kind)

  @property
  def layer_ranks(self) -> tuple[int, ...]:
    """Each layer's position in `depth_order` (0 = most important): keeping n layers keeps
    those of rank < n."""
    order = self.depth_order or tuple(range(self.num_layers))
    ranks = [0] * self.num_layers
    for r, layer in enumerate(order):
      ranks[layer] = r
    return tuple(ranks)

  def kept_layers(self, depth: int) -> tuple[int, ...]:
    """The layers (ascending) a budget keeping `depth` of them keeps."""
    return tuple(i for i, r in enumerate(self.layer_ranks) if r < depth)

  @property
  def mamba_heads_per_group(self) -> int:
    return self.mamba_num_heads // self.mamba_n_groups

  @property
  def mamba_d_inner(self) -> int:
    return self.mamba_num_heads * self.mamba_head_dim

  @property
  def budget_names(self) -> tuple[str, ...]:
    return tuple(n for n, _ in self.budgets)

  def budget_name_check(self, name: str) -> str:
    if name not in self.budget_names:
      raise ValueError(f"unknown budget {name!r}; allowed: {list(self.budget_names)}")
    return name

  def budget_targets(self, name: str) -> dict[str, float]:
    """{measure: fraction of the parent's value} of budget `name`."""
    return dict(self.budgets[self.budget_names.index(self.budget_name_check(name))][1])

  def budget_fraction(self, name: str) -> float:
    """The budget's size as one number (its active target, else its first target): orders the
    budgets and places an off-grid budget between its neighbours."""
    t = self.budget_targets(name)
    return t.get("active", next(iter(t.values())))

  @property
  def budget_measures(self) -> tuple[str, ...]:
    """The measures any budget targets, in BUDGET_MEASURES order."""
    used = {m for _, t in self.budgets for m, _ in t}
    return tuple(m for m in BUDGET_MEASURES if m in used)

  @property
  def is_homogeneous(self) -> bool:
    return not any(getattr(self, f) for f in PER_LAYER_FIELDS.values())

  def layer_config(self, layer: int) -> "ModelConfig":
    """This config with the per-layer sizes of `layer` as the homogeneous sizes."""
    if self.is_homogeneous:
      return self
    kind = self.layer_pattern[layer]
    kw = {f: () for f in PER_LAYER_FIELDS.values()}
    for axis, per_field in PER_LAYER_FIELDS.items():
      sizes = getattr(self, per_field)
      if PER_LAYER_KINDS[axis] == kind and sizes:
        kw[CHOICE_FIELDS[axis][1]] = sizes[self.layers_of(kind).index(layer)]
    kw.update({choices: () for choices, _ in CHOICE_FIELDS.values()})
    return self.replace(**kw)

  def replace(self, **kwargs) -> "ModelConfig":
    return dataclasses.replace(self, **kwargs)

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["time_step_limit"] = list(self.time_step_limit)
    d["budgets"] = [[n, dict(t)] for n, t in self.budgets]
    return d

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
      raise ValueError(f"unknown ModelConfig fields {unknown}; allowed: {sorted(known)}")
    d = dict(d)
    for k in [f for f, _ in CHOICE_FIELDS.values()] + ["time_step_limit", "depth_order"]:
      if k in d:
        d[k] = tuple(d[k])
    for k in PER_LAYER_FIELDS.values():
      if k in d:
        d[k] = tuple(d[k])
    if "budgets" in d:
      d["budgets"] = tuple(tuple(b) for b in d["budgets"])
    return cls(**d)

  # ---------------------------------------------------------------- validation
  def _validate(self):
    def err(field, msg):
      raise ValueError(f"ModelConfig.{field}: {msg}")

    bad = sorted(set(self.layer_pattern) - set(LAYER_KINDS))
    if not self.layer_pattern or bad:
      err("layer_pattern", f"must be a non-empty string over {sorted(LAYER_KINDS)}; got "
          f"{self.layer_pattern!r} (bad chars {bad})")
    for f in ("hidden_size", "vocab_size", "num_attention_heads", "num_kv_heads", "head_dim",
              "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "mamba_n_groups",
              "conv_kernel", "chunk_size", "n_routed_experts", "num_experts_per_tok",
              "moe_intermediate_size", "moe_shared_expert_intermediate_size",
              "intermediate_size", "attention_query_block"):
      v = getattr(self, f)
      if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        err(f, f"must be a positive int, got {v!r}")
    if self.num_attention_heads % self.num_kv_heads:
      err("num_kv_heads", f"{self.num_kv_heads} must divide num_attention_heads="
          f"{self.num_attention_heads}")
    if self.mamba_num_heads % self.mamba_n_groups:
      err("mamba_n_groups", f"{self.mamba_n_groups} must divide mamba_num_heads="
          f"{self.mamba_num_heads}")
    if self.num_experts_per_tok > self.n_routed_experts:
      err("num_experts_per_tok", f"{self.num_experts_per_tok} > n_routed_experts="
          f"{self.n_routed_experts}")
    lo, hi = self.time_step_limit
    if not 0.0 <= lo <= hi:
      err("time_step_limit", f"need 0 <= min <= max, got {self.time_step_limit}")
    if self.norm_eps <= 0:
      err("norm_eps", f"must be > 0, got {self.norm_eps}")
    for f in ("param_dtype", "compute_dtype"):
      if getattr(self, f) not in DTYPES:
        err(f, f"{getattr(self, f)!r} not in {DTYPES}")
    if self.remat not in REMAT:
      err("remat", f"{self.remat!r} not in {REMAT}")
    if self.attention_impl not in ATTENTION_IMPLS:
      err("attention_impl", f"{self.attention_impl!r} not in {ATTENTION_IMPLS}")
    if self.kernels not in KERNELS:
      err("kernels", f"{self.kernels!r} not in {KERNELS}")
    if self.expert_placement not in EXPERT_PLACEMENTS:
      err("expert_placement", f"{self.expert_placement!r} not in {EXPERT_PLACEMENTS}")
    if self.ep_dispatch not in EP_DISPATCHES:
      err("ep_dispatch", f"{self.ep_dispatch!r} not in {EP_DISPATCHES}")
    if not isinstance(self.segment_packing, bool):
      err("segment_packing", f"must be a bool, got {self.segment_packing!r}")
    if self.segment_packing and self.kernels == "pallas":
      err("segment_packing", "the Pallas SSD kernel does not reset state at document starts; "
          "use kernels='xla'")
    if not isinstance(self.scan_layers, bool):
      err("scan_layers", f"must be a bool, got {self.scan_layers!r}")
    self._validate_choices(err)
    for axis, per_field in PER_LAYER_FIELDS.items():
      kind, size_field = PER_LAYER_KINDS[axis], CHOICE_FIELDS[axis][1]
      sizes = getattr(self, per_field)
      n = self.layer_pattern.count(kind)
      if sizes and (len(sizes) != n or max(sizes) != getattr(self, size_field) or min(sizes) <= 0):
        err(per_field, f"needs {n} positive sizes (one per {kind!r} layer) whose max equals "
            f"{size_field}={getattr(self, size_field)}, got {sizes}")
    bad = [h for h in self.mamba_heads_per_layer if h % self.mamba_n_groups]
    if bad:
      err("mamba_heads_per_layer", f"{bad} are not multiples of mamba_n_groups")
    if self.depth_order and sorted(self.depth_order) != list(range(self.num_layers)):
      err("depth_order", f"must list every layer index 0..{self.num_layers - 1} once, got "
          f"{self.depth_order}")
    bad = [h for h in self.attention_heads_per_layer if h % self.num_kv_heads]
    if bad:
      err("attention_heads_per_layer", f"{bad} are not multiples of num_kv_heads")
    bad = [e for e in self.experts_per_layer if e < self.num_experts_per_tok]
    if bad:
      err("experts_per_layer", f"{bad} are below num_experts_per_tok")
    names = [n for n, _ in self.budgets]
    if not names or len(set(names)) != len(names):
      err("budgets", f"need unique budget names, got {names}")
    fracs = [f for _, t in self.budgets for _, f in t]
    if any(not 0 < f <= 1 for f in fracs) or any(f != 1.0 for _, f in self.budgets[0][1]):
      err("budgets", f"target fractions must lie in (0, 1], the first budget's all 1.0 (the "
          f"parent), got {[(n, dict(t)) for n, t in self.budgets]}")
    sizes = [self.budget_fraction(n) for n in names]
    if sizes != sorted(sizes, reverse=True):
      err("budgets", f"budgets must descend in size (active target, else the first), got {sizes}")

  def _validate_choices(self, err):
    for field, size_field in CHOICE_FIELDS.values():
      full = getattr(self, size_field)
      ch = getattr(self, field) or (full,)
      if ch[0] != full:
        err(field, f"first choice must be the full size {full}, got {ch}")
      if any(c <= 0 for c in ch) or list(ch) != sorted(set(ch), reverse=True):
        err(field, f"choices must be positive, unique and descending, got {ch}")
    bad = [c for c in self.mamba_head_choices if c % self.mamba_n_groups]
    if bad:
      err("mamba_head_choices", f"{bad} are not multiples of mamba_n_groups={self.mamba_n_groups}")
    bad = [c for c in self.attention_head_choices if c % self.num_kv_heads]
    if bad:
      err("attention_head_choices", f"{bad} are not multiples of num_kv_heads={self.num_kv_heads}")
    bad = [c for c in self.expert_choices if c < self.num_experts_per_tok]
    if bad:
      err("expert_choices", f"{bad} are below num_experts_per_tok={self.num_experts_per_tok}")
