"""Budget control: think with one slice of the family, answer with another (Star Elastic).

- standard: one slice thinks up to a cap of tokens; at the cap `</think>` is forced and the same
  slice answers, continuing its own cache;
- elastic: a (small) think slice writes the trace up to its cap, then a (large) answer slice
  re-prefills prompt + trace + `</think>` and writes the answer (exact for the answer slice);
- elastic with `continue_cache=True`: the answer slice continues the think slice's cache instead of
  re-prefilling (approximate: see `generate.transplant_cache`).

A `Family` holds the nested parent loaded once from a checkpoint and hands out slices by budget
name: standalone sub-models cut to their shapes ("sliced") or the parent with budget masks ("masked").
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from elastic_jax.elastic import deploy
from elastic_jax.io import checkpoint
from elastic_jax.inference import generate as gen
from elastic_jax.config import ModelConfig
from elastic_jax.inference.generate import (Sampler, SubModel, check_matmul, decode, feed,
                                            parent_at_budget, prefill, round_up, standalone,
                                            stop_rule)

MODES = ("sliced", "masked")


def _token_id(tokenizer, text: str) -> int:
  i = tokenizer.token_to_id(text)
  if i is None:
    raise ValueError(f"the tokenizer has no special token {text!r}")
  return int(i)


def special_ids(tokenizer) -> dict:
  """{"end_think": id, "eos": id}: the keyword arguments `think_then_answer` needs."""
  from elastic_jax.training.data import END_THINK, EOS
  return {"end_think": _token_id(tokenizer, END_THINK), "eos": _token_id(tokenizer, EOS)}


def prompt_ids(tokenizer, question: str) -> list[int]:
  """Token ids of `<bos>question\n<think>`: the training format up to the trace."""
  from elastic_jax.training.data import BOS, THINK
  return [_token_id(tokenizer, BOS)] + tokenizer.encode(f"{question}\n{THINK}").ids


def answer_text(tokenizer, ids: Sequence[int]) -> str:
  """Decoded text without special tokens, stripped."""
  return tokenizer.decode([int(i) for i in ids], skip_special_tokens=True).strip()


def is_correct(tokenizer, ids: Sequence[int], gold: str) -> bool:
  """Exact match of the generated answer text (stripped) with the gold answer (stripped)."""
  return answer_text(tokenizer, ids) == str(gold).strip()


@dataclasses.dataclass
class Family:
  """The nested parent of one checkpoint and its budgets; `get(name)` returns a `SubModel`."""
  params: Any
  config: ModelConfig
  budget_counts: Mapping[str, Mapping[str, Any]]
  tokenizer: Any = None
  mode: str = "sliced"
  moe_impl: str = "auto"
  invalid: Mapping[str, str] = dataclasses.field(default_factory=dict)  # budget -> why refused
  matmul: str = "auto"   # quantized weights: SubModel.matmul
  _slices: dict = dataclasses.field(default_factory=dict, repr=False)

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"unknown mode {self.mode!r}; allowed: {list(MODES)}")

  @property
  def names(self) -> list[str]:
    """Budget names this family can serve ("full" always)."""
    return list(dict.fromkeys(["full", *self.budget_counts]))

  def get(self, budget: str) -> SubModel:
    """The slice at budget `budget` (built once, then shared: same name = same object)."""
    if budget not in self.names:
      raise ValueError(f"unknown budget {budget!r}; allowed: {self.names}")
    if budget in self.invalid:
      raise ValueError(self.invalid[budget])
    if budget not in self._slices:
      counts = self.budget_counts.get(budget)
      make = standalone if self.mode == "sliced" else parent_at_budget
      self._slices[budget] = make(self.params, self.config, counts, budget, self.moe_impl,
                                  self.matmul)
    return self._slices[budget]


def _tokenizer_path(path: str) -> str:
  found = checkpoint.tokenizer_file(path)
  if found is None:
    raise ValueError(f"{path}: the checkpoint names no tokenizer (save it with tokenizer=...)")
  return found


def load_family(path: str, mode: str = "sliced", moe_impl: str = "auto",
                kernels: str | None = None, matmul: str = "auto") -> Family:
  """Loads the full parent of a nested checkpoint once, with its budget table and tokenizer;
  slices are cut in memory on demand, so switching budget never reloads weights. `kernels`
  ("xla" | "pallas", `ModelConfig.kernels`) overrides the checkpoint's choice; `matmul`: how
  a quantized checkpoint's weights compute (`SubModel.matmul`)."""
  from elastic_jax.training.data import load_tokenizer
  if mode not in MODES:
    raise ValueError(f"unknown mode {mode!r}; allowed: {list(MODES)}")
  check_matmul(matmul)
  meta = checkpoint.load_metadata(path)
  tok = load_tokenizer(_tokenizer_path(path))
  special_ids(tok)  # fail early if the tokenizer lacks <eos> or </think>
  params, cfg = checkpoint.restore(path)
  if kernels is not None:
    cfg = cfg.replace(kernels=kernels)
  table = meta.get("budget_counts", {})
  rc = deploy.stored_router_config(meta)
  invalid = {}
  for name, counts in table.items():
    if rc is not None and name in cfg.budget_names:   # deployed counts must meet the targets
      why = deploy.violation(cfg, rc, counts, name)
      if why:
        invalid[name] = f"{path}: {why}"
  return Family(params, cfg, table, tok, mode, moe_impl, invalid, matmul)


@dataclasses.dataclass
class Result:
  """One row of think-then-answer: trace ids (without `</think>`), answer ids (without eos),
  whether the cap cut the trace, the control mode and the answer slice's first logits."""
  think: list[int]
  answer: list[int]
  capped: bool
  mode: str
  first_logits: np.ndarray


def control_mode(think: SubModel, answer: SubModel, continue_cache: bool = False) -> str:
  """"standard" (one slice), "transplant" or "reprefill" (elastic)."""
  if think is answer:
    return "standard"
  return "transplant" if continue_cache else "reprefill"


def max_len_for(prompts: Sequence[Sequence[int]], max_think_tokens: int, max_answer_tokens: int,
                chunk: int = 32) -> int:
  """A cache size that fits every control mode (re-prefill re-pads prompt + trace)."""
  width = round_up(max(len(p) for p in prompts), chunk)
  return round_up(width + max_think_tokens + 1, chunk) + round_up(max_answer_tokens, chunk)


def think_then_answer(think: SubModel, answer: SubModel, prompts: Sequence[Sequence[int]],
                      max_think_tokens: int, max_answer_tokens: int, *, end_think: int = 4,
                      eos: int = 2, sampler: Sampler = Sampler(),
                      key=None, continue_cache: bool = False,
                      on_token: Callable[[int, int], None] | None = None,
                      max_len: int | None = None, chunk: int = 32) -> list[Result]:
  """Budget-controlled generation for prompts ending in `<think>`.

  `think` writes up to `max_think_tokens` trace tokens per row (a row stops at `</think>` or
  eos; at the cap `</think>` is forced); then `answer` reads `</think>` and writes up to
  `max_answer_tokens` (stopping at eos). The same slice object for both = standard control;
  different slices = elastic (re-prefill, or with `continue_cache` the answer slice continues the think
  slice's cache, fitted by `generate.transplant`). `on_token`
  sees every emitted token, the forced `</think>` included, eos excluded."""
  if think.config.vocab_size != answer.config.vocab_size:
    raise ValueError(f"mismatched slices: vocab {think.config.vocab_size} vs "
                     f"{answer.config.vocab_size}")
  if max_think_tokens < 0 or max_answer_tokens < 1:
    raise ValueError(f"need max_think_tokens >= 0 and max_answer_tokens >= 1, got "
                     f"{max_think_tokens}, {max_answer_tokens}")
  mode = control_mode(think, answer, continue_cache)
  need = max_len_for(prompts, max_think_tokens, max_answer_tokens, chunk)
  max_len = max_len or need
  if max_len < need:
    raise ValueError(f"cache overflow: max_len {max_len} < {need} needed for these prompts and "
                     "caps")
  key = jax.random.PRNGKey(0) if key is None else key
  k_pre, k_think, k_pre2, k_ans = jax.random.split(key, 4)
  ends = (end_think, eos)
  state = prefill(think, prompts, max_len=max_len, sampler=sampler, key=k_pre, chunk=chunk)
  trace, state = decode(think, state, max_think_tokens, sampler=sampler, key=k_think,
                        on_token=on_token,
                        choose=lambda i, t, out: None if t in ends or len(out) >= max_think_tokens
                        else t)
  # Capped = the cap, not the model, ended the trace.
  capped = [len(t) >= max_think_tokens and int(p) not in ends
            for t, p in zip(trace, state.pending)]
  B = len(prompts)
  if on_token is not None:
    for i in range(B):
      on_token(i, end_think)
  if mode == "reprefill":
    state = prefill(answer, [list(p) + t + [end_think] for p, t in zip(prompts, trace)],
                    max_len=max_len, sampler=sampler, key=k_pre2, chunk=chunk)
  else:
    state = dataclasses.replace(state, active=np.ones(B, bool))
    if mode == "transplant":
      state = gen.transplant(state, answer)
    state = feed(answer, state, np.full(B, end_think), sampler=sampler, key=k_pre2)
  first = np.asarray(state.logits)
  show = None if on_token is None else (lambda i, t: None if t == eos else on_token(i, t))
  out, _ = decode(answer, state, max_answer_tokens, choose=stop_rule((eos,)),
                  sampler=sampler, key=k_ans, on_token=show)
  return [Result(t, a[:-1] if a and a[-1] == eos else a, c, mode, f)
          for t, a, c, f in zip(trace, out, capped, first)]


class StreamPrinter:
  """`on_token` callback that writes decoded text as it is produced: live for one row; with
  several rows, each row's text when `finish` is called."""

  def __init__(self, tokenizer, n_rows: int, stream=sys.stdout):
    self.tok, self.stream = tokenizer, stream
    self.ids = [[] for _ in range(n_rows)]
    self.shown = ""

  def __call__(self, row: int, token: int):
    self.ids[row].append(int(token))
    if len(self.ids) == 1:
      text = self.tok.decode(self.ids[0], skip_special_tokens=False)
      # Hold back an incomplete UTF-8 sequence (decoded as U+FFFD) until its last byte.
      if not text.endswith("\ufffd") and text.startswith(self.shown):
        self.stream.write(text[len(self.shown):])
        self.stream.flush()
        self.shown = text

  def finish(self):
    """Writes what is still held back (or every row's text) and a newline."""
    if len(self.ids) == 1:
      text = self.tok.decode(self.ids[0], skip_special_tokens=False)
      self.stream.write(text[len(self.shown):] if text.startswith(self.shown) else "")
    else:
      for i, ids in enumerate(self.ids):
        self.stream.write(f"[{i}] {self.tok.decode(ids, skip_special_tokens=False)}\n")
    self.stream.write("\n")
    self.stream.flush()
