"""Reading collectives out of a lowered or compiled train step, and checking them against what
the sharding hook issues.

Two views of one program:
  StableHLO (`lowered.as_text()`)      the collectives we wrote, before XLA touches them: the
                                       hook's all_gathers of bf16 bit patterns (ui16), one
                                       per gather group (a layer's parameters packed).
  compiled HLO (`compiled.as_text()`)  after SPMD partitioning and optimization. Any collective
                                       XLA adds to reshard arrays (say for an optimizer update
                                       outside the shard_map) shows up here, named in its
                                       metadata after the value or op it serves
                                       (`state.params['embed']`, `jit(step)/add`), where ours
                                       carry the name of the primitive that issued them
                                       (`.../all_gather`, `.../reduce_scatter`).
The hook gathers integer views (u16) because XLA:CPU carries bf16 collectives out in f32 (float
normalization), which rewrites NaN payloads; an integer gather stays u16 in the compiled view on
every backend.
"""
from __future__ import annotations

import dataclasses
import math
import re

import jax

from moejax.sharding.layout import Layout

PRIMITIVE = {"all-gather": "all_gather", "reduce-scatter": "reduce_scatter"}

_ARRAY = re.compile(r"\b(pred|[a-z]+\d*)\[([\d,]*)\]")
_HLO_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.+?)\s+"
                     r"(?P<op>all-gather|all-gather-start|reduce-scatter)\(")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_STABLEHLO_GATHER = re.compile(r"stablehlo\.all_gather\b.*->\s*(?P<type>\(?tensor<.*)$")
_TENSOR = re.compile(r"tensor<((?:\d+x)*)([a-z]+\d*)>")


@dataclasses.dataclass(frozen=True)
class Collective:
  op: str            # "all-gather" | "reduce-scatter"
  dtype: str         # "bf16", "f32", ...
  shape: tuple       # result shape
  op_name: str = ""  # metadata: the JAX op (or value) it was made for

  def __str__(self):
    where = f" (op_name {self.op_name!r})" if self.op_name else ""
    return f"{self.op} -> {self.dtype}[{','.join(map(str, self.shape))}]{where}"


def _shape(dims: str, sep: str) -> tuple:
  return tuple(int(s) for s in dims.split(sep) if s)


def compiled_collectives(hlo_text: str) -> list[Collective]:
  """Every all-gather / reduce-scatter result in compiled HLO text (tuples flattened)."""
  out = []
  for line in hlo_text.splitlines():
    m = _HLO_OP.match(line)
    if not m:
      continue
    arrays = [(dtype, _shape(dims, ",")) for dtype, dims in _ARRAY.findall(m["type"])]
    op = m["op"]
    if op == "all-gather-start":          # async form: (operands..., results...)
      op, arrays = "all-gather", arrays[len(arrays) // 2:]
    name = _OP_NAME.search(line)
    out += [Collective(op, d, s, name[1] if name else "") for d, s in arrays]
  return out


def stablehlo_gathers(text: str) -> list[Collective]:
  """Every all_gather result in StableHLO text."""
  out = []
  for line in text.splitlines():
    m = _STABLEHLO_GATHER.search(line)
    if m:
      out += [Collective("all-gather", dtype, _shape(dims, "x"))
              for dims, dtype in _TENSOR.findall(m["type"])]
  return out


_STABLEHLO_REDUCTION = re.compile(r'"stablehlo\.(reduce_scatter|all_reduce)"')
_REGION_END = re.compile(r"^\s*\}\)\s*:.*->\s*(?P<type>\(?tensor<.*)$")


def stablehlo_reductions(text: str) -> list[Collective]:
  """Every reduce_scatter / all_reduce result in StableHLO text (their type follows the
  reduction's region, on the line that closes it)."""
  out, pending = [], []
  for line in text.splitlines():
    m = _STABLEHLO_REDUCTION.search(line)
    if m:
      pending.append(m[1].replace("_", "-"))
    elif pending and (end := _REGION_END.match(line)):
      op = pending.pop()
      out += [Collective(op, dtype, _shape(dims, "x"))
              for dims, dtype in _TENSOR.findall(end["type"])]
  return out


def hook_shapes(layout, num_devices: int) -> dict[str, set[tuple]]:
  """Result shapes of the hook's plain collectives: {"all-gather": [W, N] for each gather group
  and dtype (`hook.gather_leaves` packs a group's plain sharded leaves of one dtype into one
  flat buffer of N values per device), "reduce-scatter": [N]}, codec off."""
  from moejax.sharding import axes
  gatherer = layout.gatherer
  gathers, scatters = set(), set()
  for group in gatherer.groups:
    sizes: dict = {}
    for path, lay in zip(_paths(gatherer.param_meta[group]), jax.tree.leaves(
        gatherer.layouts[group], is_leaf=lambda v: isinstance(v, Layout))):
      if lay.kind != "shard":
        continue
      float32 = gatherer.report_group(group, path) in axes.FLOAT32_GROUPS
      n = math.prod(gatherer.shard_shape(group, path))
      sizes[float32] = sizes.get(float32, 0) + n
    for n in sizes.values():
      gathers.add((num_devices, n))
      scatters.add((n,))
  return {"all-gather": gathers, "reduce-scatter": scatters}


def _paths(tree) -> list[str]:
  return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


def stacked_shapes(layout) -> set[tuple]:
  """Shapes of the stored layer-stacked arrays (parameters and, alike, optimizer moments)."""
  return {tuple(x.shape) for x in jax.tree.leaves(layout.param_shapes["layers"])}


def problems(found: list[Collective], expected: dict[str, set[tuple]],
             dtypes: dict[str, set[str]], stacked: set[tuple] = frozenset()) -> list[str]:
  """Every all-gather / reduce-scatter in `found` that the hook did not issue; [] if none.

  One the hook issued: made by the JAX primitive (not added by XLA), with a result shape the
  hook produces (a gather group's packed buffer [W, N]; its shard [N]) and an allowed dtype.
  """
  out = []
  for c in found:
    if c.op not in expected:
      continue
    if c.op_name.rsplit("/", 1)[-1] != PRIMITIVE[c.op]:
      out.append(f"{c}: added by XLA, not issued by a {PRIMITIVE[c.op]} in the step")
    if c.shape not in expected[c.op]:
      note = ", a whole layer-stacked array" if c.shape in stacked else ""
      out.append(f"{c}: not a shape the hook produces{note}")
    if c.dtype not in dtypes[c.op]:
      out.append(f"{c}: dtype {c.dtype}, expected one of {sorted(dtypes[c.op])}")
  return out


def missing(found: list[Collective], expected: dict[str, set[tuple]]) -> list[str]:
  """Hook collectives (op, shape) that do not occur in `found` at all."""
  return [f"{op} -> {list(shape)}" for op, shapes in expected.items()
          for shape in sorted(shapes) if not any(c.op == op and c.shape == shape for c in found)]


def stablehlo_problems(found: list[Collective], expected: dict[str, set[tuple]],
                       dtype: str = "ui16") -> list[str]:
  """The gathers as written: each in `dtype` and of a shape the hook gathers."""
  shapes = expected["all-gather"]
  return [f"{c}: " + ("not a shape the hook gathers" if c.shape not in shapes else
                      f"gathers {c.dtype}, the hook gathers {dtype}")
          for c in found if c.shape not in shapes or c.dtype != dtype]


# -- conditionals ---------------------------------------------------------------------------------
COLLECTIVE_OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
                  "ragged-all-to-all")
_COLLECTIVE = re.compile(r"=\s.*?\b(" + "|".join(COLLECTIVE_OPS) + r")(?:-start)?\(")
_DOT = re.compile(r"=\s.*?\b(dot|convolution)\(")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLED = re.compile(r"\b(?:branch_computations|true_computation|false_computation|to_apply|body|"
                     r"condition|calls)=\{?((?:%?[\w.\-]+(?:,\s*)?)+)\}?")


def _computations(hlo_text: str) -> dict[str, list[str]]:
  comps, current = {}, None
  for line in hlo_text.splitlines():
    m = _COMPUTATION.match(line)
    if m and not line.startswith(" "):
      current = m[1]
      comps[current] = []
    elif current is not None:
      comps[current].append(line)
  return comps


def _called(line: str) -> list[str]:
  return [name.strip().lstrip("%") for m in _CALLED.finditer(line) for name in m[1].split(",")]


@dataclasses.dataclass(frozen=True)
class Branch:
  """One branch of a conditional in compiled HLO, with everything it calls."""
  name: str
  collectives: tuple   # ops, e.g. ("all-gather", ...)
  dots: int            # matmuls (the layer compute a collective could hide behind)


def _reachable(comps: dict, start: str) -> set:
  """`start` and every computation it calls, transitively."""
  seen, todo = set(), [start]
  while todo:
    name = todo.pop()
    if name in seen or name not in comps:
      continue
    seen.add(name)
    for inner in comps[name]:
      todo += _called(inner)
  return seen


def conditional_branches(hlo_text: str) -> list[Branch]:
  comps = _computations(hlo_text)
  out = []
  for lines in comps.values():
    for line in lines:
      if " conditional(" not in line:
        continue
      for branch in _called(line):
        body = [inner for name in _reachable(comps, branch) for inner in comps[name]]
        out.append(Branch(branch, tuple(m[1] for inner in body
                                        if (m := _COLLECTIVE.search(inner))),
                          sum(bool(_DOT.search(inner)) for inner in body)))
  return out


def lonely_collectives(hlo_text: str) -> list[str]:
  """Computations that issue a collective but hold no matmul, themselves or in what they call
  (fusions): a collective there has no layer compute beside it to overlap. [] when every
  collective shares its computation with some matmul."""
  comps = _computations(hlo_text)

  def has_dot(name: str) -> bool:
    return any(_DOT.search(line) for c in _reachable(comps, name) for line in comps[c])

  return [f"{name}: {', '.join(ops)}" for name, lines in comps.items()
          if (ops := [m[1] for line in lines if (m := _COLLECTIVE.search(line))])
          and not has_dot(name)]


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPERAND = re.compile(r"%([\w.\-]+)")
_OPCODE = re.compile(r"(?:^|\s)[a-z][\w\-]*\(")


def _operands(line: str) -> list[str]:
  """The instruction's operands: the names in its argument list (not the computations it
  calls)."""
  body = line[_INSTRUCTION.match(line).end():]
  start = _OPCODE.search(body).end() - 1          # past the result type: the op's "("
  depth, end = 0, start
  for end in range(start, len(body)):
    depth += {"(": 1, ")": -1}.get(body[end], 0)
    if depth == 0:
      break
  return _OPERAND.findall(body[start:end])


@dataclasses.dataclass(frozen=True)
class LoopCollective:
  body: str          # the while body's computation
  op: str            # "reduce-scatter", ...
  name: str          # the instruction


def loop_collectives_after_matmuls(hlo_text: str) -> list[LoopCollective]:
  """Collectives in a while loop's body (a layer scan's iteration) whose operands wait on a
  matmul of the same iteration. [] when every collective of
  every loop can be issued at its iteration's start, under the iteration's matmuls: the
  prefetched gather of the next layer, a reduce-scatter of the gradient the previous iteration
  computed; a gradient reduce-scattered where it is computed, or a psum of the router's counts,
  waits on them."""
  comps = _computations(hlo_text)
  bodies = {name for lines in comps.values() for line in lines if " while(" in line
            for name in re.findall(r"\bbody=%?([\w.\-]+)", line)}

  def has_dot(line: str) -> bool:
    return bool(_DOT.search(line)) or any(
        _DOT.search(inner) for name in _called(line) for c in _reachable(comps, name)
        for inner in comps[c])

  out = []
  for body in sorted(bodies):
    lines = {m[1]: line for line in comps[body] if (m := _INSTRUCTION.match(line))}
    after_dot: dict[str, bool] = {}

    def waits(name: str) -> bool:       # the value depends on a matmul of this body
      if name not in lines:
        return False
      if name not in after_dot:
        after_dot[name] = False         # (a cycle cannot occur; guards the recursion)
        line = lines[name]
        after_dot[name] = has_dot(line) or any(waits(o) for o in _operands(line))
      return after_dot[name]

    for name, line in lines.items():
      if (m := _COLLECTIVE.search(line)) and any(waits(o) for o in _operands(line)):
        out.append(LoopCollective(body, m[1], name))
  return out
