"""Ahead-of-time plans: compile a sharded program from `jax.ShapeDtypeStruct`s (no weights are
allocated) and read XLA's per-device memory for it.

`compiled.memory_analysis()` reports, per device, the bytes of the arguments, outputs and
temporaries of the partitioned program; the peak we report is arguments + outputs + temporaries
- aliased (donated) bytes, the live set XLA plans for. FLOPs come from the caller (XLA's
`cost_analysis` counts a scan body once).
"""
from __future__ import annotations

import dataclasses
import time

import jax

GiB = 1024 ** 3


def abstract(tree, shardings):
  """ShapeDtypeStructs of `tree` (arrays or structs) carrying `shardings` (a matching tree)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


@dataclasses.dataclass(frozen=True)
class Memory:
  """Per-device bytes of one compiled program."""
  arguments: int
  outputs: int
  temporaries: int
  aliased: int
  code: int

  @property
  def peak(self) -> int:
    return self.arguments + self.outputs + self.temporaries - self.aliased

  def gib(self) -> dict:
    return {k: v / GiB for k, v in dataclasses.asdict(self).items()} | {"peak": self.peak / GiB}


def memory_of(compiled) -> Memory:
  m = compiled.memory_analysis()
  if m is None:
    raise ValueError("this backend reports no memory analysis for compiled programs")
  return Memory(m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes,
                m.alias_size_in_bytes, m.generated_code_size_in_bytes)


def compile_aot(jitted, *abstract_args):
  """(compiled, seconds to lower + compile) for a jitted function at abstract arguments."""
  t0 = time.perf_counter()
  compiled = jitted.trace(*abstract_args).lower().compile()
  return compiled, time.perf_counter() - t0
