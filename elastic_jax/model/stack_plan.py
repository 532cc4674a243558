"""How a layer pattern maps onto one scanned unit: `plan_stack(pattern) -> StackPlan`.

A scan runs one compiled body (the unit, a short run of layer kinds) over stacked parameters.
Nemotron-H patterns are nearly periodic: nano_v3 is ``M`` + 22 x ``[*]EM`` + ``E`` where the
attention slot is present in 6 of the 22 units. A slot may be optional (absent units skip it with
a `cond`; its stacked parameters there are zero padding); layers before the first unit (`head`)
and after the last (`tail`) run unrolled. The plan is chosen by a small search that minimises
unrolled layers plus padded parameters (attention / MLP slots only may be optional: padding a
Mamba or MoE layer would cost more than it saves).
"""
from __future__ import annotations

import dataclasses
import functools

# Kinds a unit may leave out in some repeats (their layers are small next to Mamba / MoE).
OPTIONAL_KINDS = "*-"
MAX_UNIT = 6
# Padded parameters are counted in layers, with these weights (a padded attention layer of
# nano_v3 holds ~2% of an MoE layer's parameters, ~50% of a Mamba layer's).
PAD_COST = {"*": 0.1, "-": 0.3}


@dataclasses.dataclass(frozen=True)
class StackPlan:
  """`head` layers, then `len(units)` repeats of the `slots` unit, then `tail` layers.

  `units[u][s]` is the pattern index of slot s in repeat u, or None where that optional slot is
  absent. Indices cover every layer exactly once, in order.
  """
  pattern: str
  head: tuple[int, ...]
  slots: str
  optional: tuple[bool, ...]
  units: tuple[tuple[int | None, ...], ...]
  tail: tuple[int, ...]

  @property
  def num_units(self) -> int:
    return len(self.units)

  @property
  def padded(self) -> int:
    return sum(i is None for unit in self.units for i in unit)

  def describe(self) -> str:
    slots = "".join(f"[{k}]" if o else k for k, o in zip(self.slots, self.optional))
    return (f"{len(self.head)} head + {self.num_units} x {slots} ({self.padded} padded) + "
            f"{len(self.tail)} tail layers")


def _parse(pattern: str, start: int, slots: str, optional: tuple[bool, ...]):
  """Greedy: consume as many units as possible from `start`; returns (units, end)."""
  units, p = [], start
  while True:
    q, unit = p, []
    for kind, opt in zip(slots, optional):
      if q < len(pattern) and pattern[q] == kind:
        unit.append(q)
        q += 1
      elif opt:
        unit.append(None)
      else:
        return units, p
    units.append(tuple(unit))
    p = q


@functools.lru_cache(maxsize=64)
def plan_stack(pattern: str) -> StackPlan | None:
  """The cheapest plan with at least two units, or None (then the stack runs as a loop)."""
  best, best_cost = None, None
  candidates = {pattern[i:i + n] for n in range(1, MAX_UNIT + 1)
                for i in range(len(pattern) - n + 1)}
  for slots in sorted(candidates, key=lambda s: (len(s), s)):
    opt_pos = [i for i, k in enumerate(slots) if k in OPTIONAL_KINDS]
    if len(opt_pos) == len(slots):
      continue  # a unit must hold at least one required layer
    for mask in range(1 << len(opt_pos)):
      optional = tuple(any(i == opt_pos[b] and mask >> b & 1 for b in range(len(opt_pos)))
                       for i in range(len(slots)))
      for start in range(len(slots) + 1):
        units, end = _parse(pattern, start, slots, optional)
        if len(units) < 2:
          continue
        pad = sum(PAD_COST[slots[s]] for unit in units for s, i in enumerate(unit) if i is None)
        cost = start + (len(pattern) - end) + pad
        if best_cost is None or cost < best_cost - 1e-9:
          best_cost = cost
          best = StackPlan(pattern, tuple(range(start)), slots, optional, tuple(units),
                           tuple(range(end, len(pattern))))
  return best
