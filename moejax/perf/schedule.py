"""Overlap as the schedule issues it: a program of operations on streams, simulated.

A `Program` is a list of operations, each on one stream (`compute`, `comm`, or any other name:
a side stream for codec kernels, a data-parallel all-reduce stream) with a duration and the
operations it waits for. Each stream runs its operations in program order; an operation starts
when its stream is free and everything it waits for has finished. The step time is when the
last operation ends.

The breakdown walks the critical path back from the last operation: each operation on it
contributes its duration to its kind, so the kinds sum to the step time; work that overlapped
with the critical path does not appear. Kinds: compute, straggler (an operation's excess over
its balanced duration: the slowest device's expert work, the busiest link of an all-to-all),
host (framework time per fetched tensor), codec (encode / decode kernels), ag, rs, ar, a2a,
spag, sprs, bcast, optimizer, reshard.
"""
from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass
class Op:
  kind: str
  stream: str
  seconds: float
  deps: tuple[int, ...]
  label: str = ""


@dataclasses.dataclass
class Program:
  ops: list[Op] = dataclasses.field(default_factory=list)

  def add(self, kind: str, stream: str, seconds: float, deps=(), label: str = "") -> int:
    if seconds < 0:
      raise ValueError(f"{kind} {label}: negative duration {seconds}")
    deps = tuple(d for d in (deps if isinstance(deps, (tuple, list)) else (deps,))
                 if d is not None)
    self.ops.append(Op(kind, stream, float(seconds), deps, label))
    return len(self.ops) - 1

  def add_split(self, kind: str, stream: str, seconds: float, balanced: float, deps=(),
                label: str = "") -> int:
    """An operation whose balanced part is `balanced`: the excess goes in as a `straggler`
    operation right after it (same stream)."""
    balanced = min(balanced, seconds)
    first = self.add(kind, stream, balanced, deps, label)
    if seconds - balanced > 0:
      return self.add("straggler", stream, seconds - balanced, (first,), label + " (wait)")
    return first


@dataclasses.dataclass(frozen=True)
class Result:
  seconds: float
  exposed: dict[str, float]
  """Critical-path seconds by kind (sums to `seconds`)."""
  busy: dict[str, float]
  """Total seconds of work by kind, overlapped or not."""


def simulate(program: Program) -> Result:
  ops = program.ops
  end = [0.0] * len(ops)
  binding = [-1] * len(ops)       # the operation whose end this one's start waited for
  free: dict[str, float] = {}
  last_on: dict[str, int] = {}
  for i, op in enumerate(ops):
    start, why = free.get(op.stream, 0.0), last_on.get(op.stream, -1)
    for d in op.deps:
      if d >= i:
        raise ValueError(f"operation {i} ({op.kind}) waits for a later one ({d})")
      if end[d] > start:
        start, why = end[d], d
    end[i] = start + op.seconds
    binding[i] = why
    free[op.stream] = end[i]
    last_on[op.stream] = i
  busy: dict[str, float] = collections.defaultdict(float)
  for op in ops:
    busy[op.kind] += op.seconds
  exposed: dict[str, float] = collections.defaultdict(float)
  if ops:
    i = max(range(len(ops)), key=lambda j: end[j])
    total = end[i]
    while i >= 0:
      exposed[ops[i].kind] += ops[i].seconds
      i = binding[i]
  else:
    total = 0.0
  return Result(total, dict(exposed), dict(busy))
