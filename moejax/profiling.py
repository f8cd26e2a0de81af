"""Where a compiled step spends its time, by moejax source line.

`profile(compiled, args)` runs a compiled function under `jax.profiler.trace`, reads each op's
time from the trace (a GPU's device lanes; on XLA:CPU the thunk executor's host spans, summed
over the devices' threads, waits included) and names each op by the moejax line it came from:
the innermost stack frame under `moejax/` of the compiled HLO's metadata (`hlo_sources`). Ops
of a transposed VJP carry the line that called the VJP (for the prefetched scan's backward,
`moejax/sharding/prefetch.py`); the named scopes moejax puts on its parts (`scoped`, SCOPES)
survive there, so `by_scope` splits forward and backward time by part. Used by
`scripts/device_check.py` (`profile`) and `bench/step.py --profile`.

Nothing beyond jax: the trace is read from the Perfetto JSON that `jax.profiler.trace` writes
beside its XPlane (`create_perfetto_trace=True`), so no profiler plugin is needed to read it.
"""
from __future__ import annotations

import collections
import functools
import glob
import gzip
import json
import os
import re
import tempfile

import jax

_FRAME_TABLE = re.compile(r"^(\d+) (?:\"(.*)\"|\{(.*)\})$")
_META = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*metadata=\{([^}]*)\}")
_CALLS = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*\bcalls=%([\w.\-]+)")
_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_CONTAINERS = ("while", "conditional", "call")   # spans that hold other ops' spans
OUTSIDE = "(outside moejax)"
# moejax's named scopes (`scoped`): they survive autodiff and remat in the ops' names, where a
# transposed op's stack frames point only at the VJP's call.
SCOPES = ("attention", "router", "experts", "replicas", "norm", "gather", "codec_encode",
          "codec_decode", "optimizer")
_SCOPE = re.compile(r"(?<![\w])(" + "|".join(SCOPES) + r")(?![\w])")


def scope(name: str):
  """`jax.named_scope(name)` for one of SCOPES (a context manager)."""
  if name not in SCOPES:
    raise ValueError(f"scope {name!r}: must be one of {SCOPES}")
  return jax.named_scope(name)


def scoped(name: str):
  """Decorator: the function's ops under `scope(name)`."""
  scope(name)   # checked where the decorator is applied, not at the first call

  def wrap(fn):
    @functools.wraps(fn)
    def inner(*args, **kwargs):
      with scope(name):
        return fn(*args, **kwargs)
    return inner
  return wrap


def scope_of(op_name: str) -> str:
  """An op's innermost moejax scope, "+ backward" when autodiff transposed it; "other" outside
  every scope. The name's last part is the op's primitive, never a scope (a `gather` primitive
  inside codec_decode is codec_decode's)."""
  found = _SCOPE.findall(op_name.rpartition("/")[0])
  scope = found[-1] if found else "other"
  return scope + (" backward" if "transpose(" in op_name else "")


def _frame_tables(text: str) -> dict:
  tables, table = {}, None
  for line in text.splitlines():
    if line in _TABLES:
      table = tables.setdefault(line, {})
      continue
    m = _FRAME_TABLE.match(line) if table is not None else None
    if m:
      table[int(m[1])] = m[2] if m[2] is not None else dict(
          kv.split("=", 1) for kv in m[3].split())
    elif line.strip():
      table = None
  return tables


def hlo_sources(text: str) -> dict[str, tuple[str, str]]:
  """Compiled HLO text -> {instruction: (op_name, "moejax/path.py:line")}: the innermost stack
  frame under moejax/ of the instruction's metadata, OUTSIDE when none is; a fusion without
  metadata of its own takes its fused root's."""
  tables = _frame_tables(text)
  frames = tables.get("StackFrames", {})

  def source(frame_id: int) -> str:
    seen = set()
    while frame_id in frames and frame_id not in seen:
      seen.add(frame_id)
      loc = tables["FileLocations"][int(frames[frame_id]["file_location_id"])]
      path = tables["FileNames"][int(loc["file_name_id"])]
      if "/moejax/" in path or path.startswith("moejax/"):
        return f"moejax/{path.split('moejax/', 1)[1]}:{loc['line']}"
      frame_id = int(frames[frame_id]["parent_frame_id"])
    return OUTSIDE

  own, roots, calls, computation = {}, {}, {}, None
  for line in text.splitlines():
    if line.startswith(("%", "ENTRY")):
      computation = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
    m = _META.match(line)
    if m:
      meta = dict(re.findall(r'(\w+)=("[^"]*"|\S+)', m[2]))
      entry = (meta.get("op_name", "").strip('"'),
               source(int(meta["stack_frame_id"])) if "stack_frame_id" in meta else OUTSIDE)
      own[m[1]] = entry
      if line.lstrip().startswith("ROOT") and computation:
        roots[computation] = entry
    c = _CALLS.match(line)
    if c:
      calls[c[1]] = c[2]
  for name, called in calls.items():
    if name not in own and called in roots:
      own[name] = roots[called]
  return own


def op_times(trace: dict, calls: int = 1) -> tuple[dict[str, float], bool]:
  """A Perfetto trace (as `jax.profiler.trace` writes it) -> ({op: ms per call}, whether the
  times are a device's). Loops and conditionals are not counted apart from the ops inside."""
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  timed = [e for e in events if "dur" in e and e.get("ph") != "M"]
  on_device = [e for e in timed if procs.get(e.get("pid"), "").startswith("/device:")]
  # XLA:CPU has no device lane: its thunk executor's spans on the host, named by `hlo_op`.
  spans = on_device or [e for e in timed if "hlo_op" in (e.get("args") or {})
                        and not e["name"].startswith("end: ")]
  per_op = collections.Counter()
  for e in spans:
    name = (e.get("args") or {}).get("hlo_op") or e["name"]
    if name.split(".")[0] not in _CONTAINERS:
      per_op[name] += e["dur"] / 1e3 / calls   # us -> ms per call
  return dict(per_op), bool(on_device)


def profile(compiled, args, *, calls: int = 3, top: int = 30, run=None) -> dict:
  """Runs `compiled(*args)` once, then `calls` times under the profiler (or `run()`, when the
  call has to thread state itself) -> {calls, module, device_events, ms_per_call, ops,
  by_scope {`scope_of`: ms per call}, by_source {moejax line: ms per call}, top_ops [{op, ms,
  op_name, source}]}, the largest `top` of the last two."""
  text = compiled.as_text()
  module = re.search(r"^HloModule ([\w.\-]+)", text, re.M)[1]
  run = run or (lambda: jax.block_until_ready(compiled(*args)))
  run()
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      for _ in range(calls):
        run()
    path = glob.glob(os.path.join(trace_dir, "**", "*.json.gz"), recursive=True)[0]
    with gzip.open(path, "rt") as f:
      trace = json.load(f)
  per_op, on_device = op_times(trace, calls)
  if not per_op:   # a GPU without CUPTI traces no device lane, and its host has no op spans
    raise RuntimeError(f"the profiler's trace of {module} holds no op spans (on a GPU: is "
                       "CUPTI installed?)")
  sources = hlo_sources(text)
  by_source, by_scope = collections.Counter(), collections.Counter()
  for name, ms in per_op.items():
    by_source[sources.get(name, ("", f"(no metadata: {name.split('.')[0]})"))[1]] += ms
    by_scope[scope_of(sources.get(name, ("", ""))[0])] += ms
  return {"calls": calls, "module": module, "device_events": on_device,
          "ms_per_call": sum(per_op.values()), "ops": len(per_op),
          "by_scope": dict(by_scope.most_common()), "by_source": dict(by_source.most_common(top)),
          "top_ops": [{"op": n, "ms": ms, "op_name": sources.get(n, ("", ""))[0][-120:],
                       "source": sources.get(n, ("", ""))[1]}
                      for n, ms in collections.Counter(per_op).most_common(top)]}
