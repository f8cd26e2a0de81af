"""The import graph of moejax, read from the source: no module imports itself through others, and
no two packages import each other (imports inside functions count too)."""
import ast
import os

from tests.helpers import REPO

PACKAGE = "moejax"


def _modules() -> dict[str, str]:
  """{dotted module name: path} of every module under moejax/."""
  out = {}
  root = os.path.join(REPO, PACKAGE)
  for dirpath, _, files in os.walk(root):
    for name in files:
      if name.endswith(".py"):
        rel = os.path.relpath(os.path.join(dirpath, name), REPO)[:-3].replace(os.sep, ".")
        out[rel.removesuffix(".__init__")] = os.path.join(dirpath, name)
  return out


def _imports(modules: dict[str, str]) -> dict[str, set[str]]:
  """{module: moejax modules it imports}, `from a import b` resolved to a.b when that is one."""
  graph = {}
  for module, path in modules.items():
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read(), path)
    is_package = path.endswith("__init__.py")
    targets = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          parts = module.split(".")
          parts = parts[:len(parts) - node.level + (1 if is_package else 0)]
          base = ".".join(parts + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                 for a in node.names]
      else:
        continue
      for name in names:
        while name and name not in modules:   # a name inside a module: the module
          name = name.rpartition(".")[0]
        if name.startswith(PACKAGE) and name != module:
          targets.add(name)
    graph[module] = targets
  return graph


def _package(module: str) -> str:
  parts = module.split(".")
  return ".".join(parts[:2]) if len(parts) > 1 else module


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  state: dict[str, int] = {}
  stack: list[str] = []

  def visit(node):
    state[node] = 1
    stack.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 1:
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state:
        found = visit(nxt)
        if found:
          return found
    stack.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return None


def test_no_module_import_cycle():
  graph = _imports(_modules())
  # A package's __init__ importing its own submodules is how packages export names.
  graph = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}
  cycle = _cycle(graph)
  assert cycle is None, " -> ".join(cycle)


def test_no_two_packages_import_each_other():
  graph = _imports(_modules())
  edges = {(_package(m), _package(t)) for m, ts in graph.items() for t in ts
           if _package(m) != _package(t)}
  both = sorted((a, b) for a, b in edges if (b, a) in edges and a < b)
  assert not both, both


def test_the_reader_sees_known_edges():
  """Guards the reader itself: edges that exist must be found."""
  graph = _imports(_modules())
  assert "moejax.codec.bits" in graph["moejax.codec.gather"]
  assert "moejax.sharding.hook" in graph["moejax.sharding.gatherer"]
