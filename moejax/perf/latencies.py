"""Latencies for XLA:GPU's scheduler from moejax's cost model: a profile in the format of XLA's
profile-guided latency estimator (`--xla_gpu_pgle_profile_file_or_directory_path`).

Why: XLA:GPU's latency-hiding scheduler places each collective's start and done by its own
estimate of what every instruction costs, and without measurements that estimate is a table
of constants (a matmul fusion "hides" a collective; `ragged-all-to-all` costs nothing, so the
codec's payload exchange, whose start and done it places side by side, runs synchronously:
docs/measurements.md, "The GPU schedule read without a GPU"). jax's own profile-guided
estimation (`jax_enable_pgle`) measures the latencies in a run's first steps; this gives them
before any run, from the program alone, the same on every process of a job (each builds the
same profile from the same program), on any described cluster.

`instruction_costs(hlo_text, gpu, net)` costs every instruction of a compiled program's
scheduled computations (not the fusions' bodies, which run as one kernel):
  matmul fusions, cuBLAS calls and  max(FLOPs / (peak x efficiency), bytes / HBM) + a launch
  grouped-matmul custom calls
  other fusions and kernels         bytes (operands + result) / HBM bandwidth + a launch
  collectives (start, or sync)      `moejax.perf.collectives.Net`'s alpha-beta time of its
                                    result over its replica group (a ragged all-to-all at its
                                    buffer's size: an upper bound)
  loops, conditionals, calls        trip count x the body's summed costs / the dearest branch
  tuples, parameters, bitcasts      nothing
`profile_text(costs)` writes them (microseconds) as the text proto XLA reads. The names are
the compiled program's; a second compile of the same lowering with the profile sees the same
names before its scheduler (`moejax.train.latency_profile` compiles twice).
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable

import numpy as np

from moejax.perf.collectives import Net
from moejax.perf.hardware import GPU

KERNEL_LAUNCH_S = 2e-6
"""A compute kernel's fixed cost (launch and tail; a few microseconds on H100-class GPUs)."""

_ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                  "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
                  "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25}
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*")
_OPERAND = re.compile(r"%([\w.\-]+)")
_CALLS = re.compile(r"\bcalls=%([\w.\-]+)")
_BODY = re.compile(r"\bbody=%([\w.\-]+)")
_BRANCHES = re.compile(r"\b(?:branch_computations=\{([^}]*)\}|true_computation=%([\w.\-]+)|"
                       r"false_computation=%([\w.\-]+)|to_apply=%([\w.\-]+))")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_CUBLAS_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute", "collective-broadcast")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain", "iota"}


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  shape: str
  op: str
  operands: tuple[str, ...]
  line: str


def _balanced(text: str, start: int) -> int:
  """The index just past the parenthesis that closes the one at `start`."""
  depth = 0
  for i in range(start, len(text)):
    if text[i] == "(":
      depth += 1
    elif text[i] == ")":
      depth -= 1
      if depth == 0:
        return i + 1
  raise ValueError(f"unbalanced parentheses in HLO line: {text[:200]}")


def parse_instruction(line: str) -> Instruction | None:
  m = _INSTRUCTION.match(line)
  if not m:
    return None
  rest = line[m.end():]
  if rest.startswith("("):
    end = _balanced(rest, 0)
  else:
    end = rest.index(" ")
  shape, after = rest[:end], rest[end:].lstrip()
  op_end = after.index("(")
  op = after[:op_end]
  args = after[op_end:_balanced(after, op_end)]
  return Instruction(m[1], shape, op, tuple(_OPERAND.findall(args)), line)


def parse_module(text: str) -> dict[str, list[Instruction]]:
  """{computation name: its instructions in order} of an HLO module's text."""
  comps: dict[str, list[Instruction]] = {}
  current = None
  for line in text.splitlines():
    if current is None:
      m = _HEADER.match(line)
      if m:
        current = comps.setdefault(m[1], [])
      continue
    if line.strip() == "}":
      current = None
      continue
    inst = parse_instruction(line)
    if inst is not None:
      current.append(inst)
  return comps


def shape_bytes(shape: str) -> float:
  """Bytes of an HLO shape (tuples summed; layouts ignored)."""
  total = 0.0
  for element, dims in _ARRAY.findall(shape):
    if element not in _ELEMENT_BYTES:
      continue        # token, opaque: nothing on the wire or in memory
    total += _ELEMENT_BYTES[element] * math.prod(int(d) for d in dims.split(",") if d)
  return total


def _dims(shape: str) -> list[int]:
  m = _ARRAY.search(shape)
  return [int(d) for d in m[2].split(",") if d] if m else []


def group_devices(line: str, num_devices: int) -> list[int]:
  """The device ids of one collective's first replica group (all devices if none given), from
  any of its printed forms: an explicit list, an iota ([G, W]<=[dims], transposed or not), or a
  mesh's named axes."""
  m = _GROUPS_LIST.search(line)
  if m:
    return [int(d) for d in m[1].split(",") if d]
  m = _GROUPS_IOTA.search(line)
  if m:
    groups = [int(g) for g in m[1].split(",")]
    rest = line[m.end():]
    dims_m = re.match(r"\[([0-9,]+)\](?:T\(([0-9,]+)\))?", rest)
    dims = [int(d) for d in dims_m[1].split(",")] if dims_m else [math.prod(groups)]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if dims_m and dims_m[2]:
      ids = ids.transpose([int(p) for p in dims_m[2].split(",")])
    return [int(d) for d in ids.reshape(groups[0], -1)[0]]
  m = _GROUPS_MESH.search(line)
  if m:
    sizes = [(a, int(n)) for a, n in re.findall(r"'?([\w]+)'?=(\d+)", m[1])]
    listed = {a.strip().strip("'") for a in m[2].split(",") if a.strip()}
    ids = np.arange(math.prod(n for _, n in sizes)).reshape([n for _, n in sizes])
    if not listed:
      return [int(d) for d in ids.reshape(-1)]
    first = tuple(slice(None) if a in listed else 0 for a, _ in sizes)
    return [int(d) for d in ids[first].reshape(-1)]
  return list(range(num_devices))


def group_size(line: str, num_devices: int) -> int:
  """The devices one collective spans (`group_devices`)."""
  return len(group_devices(line, num_devices))


def _collective_kind(inst: Instruction, comps) -> tuple[str, Instruction] | None:
  """(kind, the instruction carrying its groups and shape) of a collective: itself, a
  `*-start` of one, or an `async-start` wrapping one."""
  op = inst.op[:-len("-start")] if inst.op.endswith("-start") else inst.op
  if op in COLLECTIVES:
    return op, inst
  if inst.op == "async-start":
    m = _CALLS.search(inst.line)
    for wrapped in comps.get(m[1], []) if m else []:
      if wrapped.op in COLLECTIVES:
        return wrapped.op, wrapped
  return None


def _collective_seconds(kind: str, inst: Instruction, result_bytes: float, net: Net) -> float:
  devices = group_devices(inst.line, net.gpus)
  w = len(devices)
  if w <= 1:
    return 0.0
  # The group's own links: its GPUs over the nodes they sit on (device d on node d // per node),
  # e.g. {0, 8} across two nodes of 8 prices the network, not NVLink.
  nodes = len({d // net.cluster.gpus_per_node for d in devices})
  if nodes > 1 or w < net.gpus:
    net = Net(dataclasses.replace(net.cluster, gpus_per_node=-(-w // nodes)), w,
              net.intra_eff, net.inter_eff)
  if kind in ("all-gather", "collective-broadcast"):
    return net.all_gather(result_bytes, group=w)
  if kind == "reduce-scatter":
    return net.reduce_scatter(result_bytes * w, group=w)
  if kind == "all-reduce":
    return net.all_reduce(result_bytes, group=w)
  if kind in ("all-to-all", "ragged-all-to-all"):
    return net.uniform_all_to_all(result_bytes)
  # collective-permute: one peer's buffer, over the network when the group spans nodes
  return net.sparse(result_bytes, result_bytes if net.nodes > 1 else 0.0)


def _dot_flops(comp: list[Instruction], comps: dict | None = None, depth: int = 0) -> float:
  """FLOPs of the dots in a fused computation's body (and in fusions nested in it)."""
  shapes = {i.name: i.shape for i in comp}
  flops = 0.0
  for inst in comp:
    if inst.op == "fusion" and comps is not None and depth < 4:
      flops += sum(_dot_flops(comps.get(c, []), comps, depth + 1)
                   for c in _CALLS.findall(inst.line))
      continue
    if inst.op not in ("dot", "convolution") or not inst.operands:
      continue
    lhs = _dims(shapes.get(inst.operands[0], ""))
    m = _CONTRACTING.search(inst.line)
    k = math.prod(lhs[int(d)] for d in m[1].split(",") if d) if m and lhs else 1
    flops += 2.0 * math.prod(_dims(inst.shape)) * k
  return flops


def _cublas_flops(inst: Instruction, shapes: dict) -> float:
  m = _CUBLAS_CONTRACTING.search(inst.line)
  if not m or not inst.operands:
    return 0.0
  lhs = _dims(shapes.get(inst.operands[0], ""))
  k = math.prod(lhs[int(d.strip('" '))] for d in m[1].split(",") if d.strip('" ')) if lhs else 1
  return 2.0 * math.prod(_dims(inst.shape)) * k


_SLICING = ("dynamic-slice", "slice", "gather")
_PARAMETER = re.compile(r"\bparameter\((\d+)\)")


def _result_bytes(inst: Instruction) -> float:
  """A kernel's result; a cuBLAS call's scratch workspace (the s8 tuple element) left out."""
  if inst.op == "custom-call" and inst.shape.startswith("("):
    return sum(shape_bytes(f"{e}[{d}]") for e, d in _ARRAY.findall(inst.shape) if e != "s8")
  return shape_bytes(inst.shape)


def _moved_bytes(inst: Instruction, shapes: dict, comps: dict) -> float:
  """Bytes a kernel reads and writes: its result and its operands, but an operand it only
  slices (a layer's weights out of a stacked [L, ...] array in a scan body) counts the slices,
  and a dynamic-update-slice (alone or as a fusion's root) writes its update in place."""
  if inst.op in _SLICING:
    return 2.0 * _result_bytes(inst)
  if inst.op == "dynamic-update-slice":
    return 2.0 * shape_bytes(shapes.get(inst.operands[1], "")) if len(inst.operands) > 1 else 0.0
  out = _result_bytes(inst)
  ins = [shape_bytes(shapes.get(o, "")) for o in inst.operands]
  body = comps.get(next(iter(_CALLS.findall(inst.line)), ""), []) if inst.op == "fusion" else []
  if body:
    params = {}
    for i in body:
      m = _PARAMETER.search(i.line) if i.op == "parameter" else None
      if m:
        params[i.name] = int(m[1])
    users: dict[str, list[Instruction]] = {}
    for i in body:
      for o in set(i.operands):
        if o in params:
          users.setdefault(o, []).append(i)
    for name, index in params.items():
      used = users.get(name, [])
      if index < len(ins) and used and all(u.op in _SLICING and u.operands[0] == name
                                           for u in used):
        ins[index] = sum(_result_bytes(u) for u in used)
    root = body[-1]
    for i in body:
      if i.line.lstrip().startswith("ROOT"):
        root = i
    if (root.op == "dynamic-update-slice" and len(root.operands) > 1
            and root.operands[0] in params and params[root.operands[0]] < len(ins)):
      body_shapes = {i.name: i.shape for i in body}
      ins[params[root.operands[0]]] = 0.0            # updated in place
      out = shape_bytes(body_shapes.get(root.operands[1], ""))
  return out + sum(ins)


def _attention_flops(inst: Instruction, shapes: dict) -> float:
  """cuDNN's fused attention (`__cudnn$fmha...`, q [B, T, N, H] and k [B, S, Nk, H] as jax
  lays them out): 4 B T N S H forward (QK^T and PV), half of it causal, 2.5x that backward."""
  if len(inst.operands) < 2:
    return 0.0
  q, k = _dims(shapes.get(inst.operands[0], "")), _dims(shapes.get(inst.operands[1], ""))
  if len(q) != 4 or len(k) != 4:
    return 0.0
  flops = 4.0 * q[0] * q[1] * q[2] * k[1] * q[3]
  if "CAUSAL" in inst.line.upper():
    flops /= 2
  return flops * (2.5 if "backward" in inst.line.lower() else 1.0)


def _grouped_matmul_flops(inst: Instruction, shapes: dict) -> float:
  """FLOPs of a custom call shaped as a grouped matmul (the Hopper kernels' `mosaic_gpu`
  calls, `moejax.placement.hopper`): rows [M, K] by a stack [G, K, N] -> [M, N], or the
  transposed form [M, K], [M, N] -> [G, K, N]: 2 M K N either way (each row meets one group);
  0 for any other shape (its bytes price it)."""
  ops = [_dims(shapes.get(o, "")) for o in inst.operands]
  out = _dims(inst.shape)
  rows = [d for d in ops if len(d) == 2]
  for stack in (d for d in ops if len(d) == 3):
    for m_k in rows:
      if m_k[1] == stack[1] and out == [m_k[0], stack[2]]:
        return 2.0 * m_k[0] * m_k[1] * stack[2]
  if len(out) == 3:
    for m_k in rows:
      for m_n in rows:
        if m_k is not m_n and m_k[0] == m_n[0] and [m_k[1], m_n[1]] == out[1:]:
          return 2.0 * m_k[0] * m_k[1] * m_n[1]
  return 0.0


def instruction_costs(text: str, gpu: GPU, net: Net, efficiency: float) -> dict[str, float]:
  """{instruction name: seconds} for every instruction of the program's scheduled
  computations (see the module docstring). `efficiency`: the fraction of peak FLOP/s matmuls
  reach (the calibration's, `moejax.perf.model.Calibration.gpu`)."""
  comps = parse_module(text)
  fused = {m for c in comps.values() for i in c if i.op == "fusion"
           for m in _CALLS.findall(i.line)}
  flop_rate, hbm = gpu.peak_flops * efficiency, gpu.hbm_bandwidth
  costs: dict[str, float] = {}
  totals: dict[str, float] = {}

  def kernel(flops: float, bytes_: float) -> float:
    return max(flops / flop_rate, bytes_ / hbm) + KERNEL_LAUNCH_S

  def total(name: str) -> float:
    """A computation's instructions, one after another."""
    if name not in totals:
      totals[name] = 0.0        # (a cycle cannot occur in HLO; this guards the recursion)
      totals[name] = sum(cost(i, comps[name]) for i in comps.get(name, []))
    return totals[name]

  tables: dict[int, tuple[dict, dict]] = {}

  def cost(inst: Instruction, comp: list[Instruction]) -> float:
    if inst.name in costs:
      return costs[inst.name]
    if id(comp) not in tables:    # per computation: shapes by name, each async start's done
      tables[id(comp)] = ({i.name: i.shape for i in comp},
                          {i.operands[0]: i for i in comp if i.op.endswith("-done") and i.operands})
    shapes, done_of = tables[id(comp)]
    op = inst.op
    collective = _collective_kind(inst, comps)
    if collective is not None:
      kind, carrier = collective
      # An async pair's result is its done's (a start's shape holds its operands too); a sync
      # collective's its own.
      result = done_of[inst.name].shape if inst.name in done_of else carrier.shape
      seconds = _collective_seconds(kind, carrier, shape_bytes(result), net)
    elif op in _FREE or op.endswith("-done"):
      seconds = 0.0
    elif op == "while":
      m, trips = _BODY.search(inst.line), _TRIP_COUNT.search(inst.line)
      seconds = (int(trips[1]) if trips else 1) * (total(m[1]) if m else 0.0)
    elif op in ("conditional", "call"):
      names = [n for g in _BRANCHES.findall(inst.line) for part in g if part
               for n in _OPERAND.findall(part if part.startswith("%") else "%" + part)]
      seconds = max((total(n) for n in names), default=0.0)
    elif op == "async-start":
      m = _CALLS.search(inst.line)
      seconds = total(m[1]) if m else 0.0
    else:
      if op == "fusion-start" and inst.name in done_of:
        # an async fusion (XLA:GPU's start / done pair; the start's shape holds its operands
        # too): the kernel it wraps, with the done's result
        inst = dataclasses.replace(inst, op="fusion", shape=done_of[inst.name].shape)
        op = "fusion"
      moved = _moved_bytes(inst, shapes, comps)
      flops = 0.0
      if op == "fusion":
        flops = sum(_dot_flops(comps.get(c, []), comps) for c in _CALLS.findall(inst.line))
      elif op == "custom-call":
        flops = (_cublas_flops(inst, shapes) if "cublas" in inst.line else
                 _attention_flops(inst, shapes) if "fmha" in inst.line else
                 _grouped_matmul_flops(inst, shapes))
      elif op in ("dot", "convolution"):
        flops = _dot_flops([i for i in comp if i.name in inst.operands] + [inst])
      seconds = kernel(flops, moved)
    costs[inst.name] = seconds
    return seconds

  # Every computation but the fusions' bodies: an `async-start`'s wrapped collective is priced
  # in its own computation under its own name, the name XLA gives it when it makes the pair
  # synchronous, which a later compile's start wraps again.
  for name, comp in comps.items():
    if name not in fused:
      for inst in comp:
        cost(inst, comp)
  return costs


@dataclasses.dataclass(frozen=True)
class Exposure:
  """One collective of a priced schedule: its instruction, the jax op it came from (its
  metadata's op_name, the scopes that say which layer part issued it), seconds no compute
  covered and its own seconds, both over every execution."""
  name: str
  op_name: str
  exposed: float
  seconds: float


@dataclasses.dataclass(frozen=True)
class ScheduleTime:
  """A compiled schedule priced by `instruction_costs`: seconds of compute, of collectives, and
  of collectives exposed (a synchronous one whole; an async one by what its start-to-done
  window's compute leaves uncovered), each instruction counted once per execution (loop
  bodies times their trip count); `exposures` each synchronous collective and each async one
  whose done it found, most exposed first."""
  compute: float
  collectives: float
  exposed: float
  exposures: tuple[Exposure, ...] = ()
  compute_by_part: dict[str, float] = dataclasses.field(default_factory=dict)
  """Compute seconds by the part `schedule_time`'s `part_of` names from each instruction's
  op_name (empty without it), dearest first."""
  compute_by_line: dict[str, float] = dataclasses.field(default_factory=dict)
  """Compute seconds by the source line `schedule_time`'s `line_of` gives each instruction
  ("?" where it gives none; empty without it), dearest first."""

  @property
  def step(self) -> float:
    return self.compute + self.exposed

  def as_ms(self, digits: int = 2) -> dict[str, float]:
    """step, compute, collectives and exposed in milliseconds (a report's JSON)."""
    return {k: round(float(getattr(self, k)) * 1e3, digits)
            for k in ("step", "compute", "collectives", "exposed")}

  def most_exposed(self, n: int = 3, digits: int = 2) -> list[dict]:
    """The `n` most exposed collectives (JSON-ready, milliseconds), where any is exposed."""
    return [{"name": e.name, "op_name": e.op_name,
             "exposed_ms": round(float(e.exposed) * 1e3, digits),
             "ms": round(float(e.seconds) * 1e3, digits)}
            for e in self.exposures[:n] if round(e.exposed * 1e3, digits) > 0]


_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')     # (an escaped quote stays inside)


def _op_name(inst: Instruction) -> str:
  """The jax op an instruction came from (its metadata's op_name), "" where it has none."""
  m = _OP_NAME.search(inst.line)
  return m[1] if m else ""


def schedule_time(text: str, costs: dict[str, float],
                  part_of: Callable[[str], str] | None = None,
                  line_of: dict[str, str] | None = None) -> ScheduleTime:
  """`costs` (from `instruction_costs` of the same program) along the program's schedule: a
  compiled module prints each computation in its schedule's order. `part_of(op_name)`, where
  given, names the part of the model each compute instruction belongs to
  (`moejax.profiling.scope_of`: moejax's named scopes); `line_of`, where given, the source line
  of each instruction by name (`moejax.profiling.hlo_sources`: the innermost moejax frame)."""
  comps = parse_module(text)
  entry = _entry_name(text)
  runs: dict[str, float] = {}

  def visit(name: str, times: float) -> None:
    runs[name] = runs.get(name, 0.0) + times
    for inst in comps.get(name, []):
      if inst.op == "while":
        m, trips = _BODY.search(inst.line), _TRIP_COUNT.search(inst.line)
        if m:
          visit(m[1], times * (int(trips[1]) if trips else 1))
      elif inst.op in ("conditional", "call"):
        names = [n for g in _BRANCHES.findall(inst.line) for part in g if part
                 for n in _OPERAND.findall(part if part.startswith("%") else "%" + part)]
        for n in names[:1] if inst.op == "call" else names:
          visit(n, times / (1 if inst.op == "call" else len(names)))

  visit(entry, 1.0)
  compute = collectives = exposed_total = 0.0
  exposures: list[Exposure] = []
  by_part: dict[str, float] = {}
  by_line: dict[str, float] = {}

  def exposure(inst: Instruction, exposed: float, seconds: float) -> None:
    nonlocal exposed_total
    exposed_total += exposed          # in schedule order, as `collectives` is summed
    exposures.append(Exposure(inst.name, _op_name(inst), exposed, seconds))

  for name, times in runs.items():
    comp = comps.get(name, [])
    open_: dict[str, list] = {}        # async collectives in flight: [start, seconds left to cover]
    for inst in comp:
      seconds = costs.get(inst.name, 0.0)
      collective = _collective_kind(inst, comps)
      if inst.op in ("while", "conditional", "call"):
        for k in open_:                # (their bodies are counted where they run; a
          open_[k][1] -= seconds       # collective in flight runs under them)
        continue
      if collective is not None:
        collectives += times * seconds
        if inst.op.endswith("-start"):
          open_[inst.name] = [inst, seconds]
        else:
          exposure(inst, times * seconds, times * seconds)
        continue
      if inst.op.endswith("-done") and inst.operands and inst.operands[0] in open_:
        start, left = open_.pop(inst.operands[0])
        exposure(start, times * max(left, 0.0), times * costs.get(start.name, 0.0))
        continue
      compute += times * seconds
      if part_of is not None and seconds:
        part = part_of(_op_name(inst))
        by_part[part] = by_part.get(part, 0.0) + times * seconds
      if line_of is not None and seconds:
        line = line_of.get(inst.name, "?")
        by_line[line] = by_line.get(line, 0.0) + times * seconds
      for k in open_:
        open_[k][1] -= seconds
  exposures.sort(key=lambda e: -e.exposed)
  dearest = lambda d: dict(sorted(d.items(), key=lambda kv: -kv[1]))  # noqa: E731
  return ScheduleTime(compute, collectives, exposed_total, tuple(exposures), dearest(by_part),
                      dearest(by_line))


def _entry_name(text: str) -> str:
  for line in text.splitlines():
    if line.startswith("ENTRY"):
      m = _HEADER.match(line)
      if m:
        return m[1]
  raise ValueError("no ENTRY computation in the HLO text")


def profile_text(costs: dict[str, float]) -> str:
  """`costs` (seconds) as XLA's ProfiledInstructionsProto text (microseconds)."""
  return "".join(f'costs {{ name: "{name}" cost_us: {seconds * 1e6:.3f} }}\n'
                 for name, seconds in sorted(costs.items()))
