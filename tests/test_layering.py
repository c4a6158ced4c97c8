"""The package's floors: a module imports from its own floor or below, never above.

BUILD.md / ../shared/STYLE.md describe the house: foundations (config, mask model,
score_mod, mask_mod, dropout, the reference), the backends (blockwise, pallas), the
partitioning rule, the differentiation rules and dispatch, the API, then the
user-facing layers (distributed, jax.nn drop-in, flax, checks) and the entry points.
The imports are read with `ast` (lazy imports inside functions included), so an arrow
running back up the house fails here before it becomes a cycle. Within a floor, modules
may import each other one way only: the import graph of the package (the same `ast`
reading: module-level, function-level and TYPE_CHECKING imports alike) has no cycle
(`test_no_import_cycle`, which names the importing lines of any it finds).
"""
from __future__ import annotations

import ast
import pathlib

import pytest

import flashvjp

PKG = pathlib.Path(flashvjp.__file__).parent

# Floor of each module (dotted name below `flashvjp`, prefix match: "pallas" covers
# "pallas.triton.forward"). Lower numbers are lower floors.
FLOORS = {
    "_config": 0, "_mask": 0, "_score_mod": 0, "_mask_mod": 0, "_dropout": 0, "_aligned": 0,
    "_ad_compat": 0, "reference": 0, "_target": 0, "_delta": 0, "_remat": 0, "_record": 0, "_indexing": 0,
    "blockwise": 1, "pallas": 1,
    "_partition": 2, "_strategy": 2, "ring": 2,
    "_vjp": 3, "_dispatch": 3,
    "_api": 4, "_check": 4,
    "distributed": 5, "_jax_nn": 5, "flax": 5, "_flax_fn": 5, "_flax_modules": 5, "testing": 5,
    "_bench": 6, "_plan": 6, "_selfcheck": 6, "cli": 6, "__main__": 6, "__init__": 6,
}


def _floor(dotted: str) -> int:
  parts = dotted.split(".")
  for n in range(len(parts), 0, -1):
    name = ".".join(parts[:n])
    if name in FLOORS:
      return FLOORS[name]
  raise KeyError(f"module flashvjp.{dotted} has no floor in FLOORS: add it")


def _modules():
  for path in sorted(PKG.rglob("*.py")):
    rel = path.relative_to(PKG).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
      parts = parts[:-1]
    yield ".".join(parts), path


def _imports(path: pathlib.Path, dotted: str):
  """flashvjp submodules imported by the file (absolute and relative imports); `import
  flashvjp` and `from flashvjp import flash_attention` import the package's own `__init__`."""
  tree = ast.parse(path.read_text())
  is_pkg = path.name == "__init__.py"
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name == "flashvjp":
          yield "__init__", node.lineno
        elif a.name.startswith("flashvjp."):
          yield a.name[len("flashvjp."):], node.lineno
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = dotted.split(".") if dotted != "__init__" else []
        if not is_pkg:
          base = base[:-1]
        base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
        mod = ".".join(base + ([node.module] if node.module else []))
      elif node.module == "flashvjp" or (node.module or "").startswith("flashvjp."):
        mod = node.module[len("flashvjp."):] if node.module != "flashvjp" else ""
      else:
        continue
      for a in node.names:
        target = f"{mod}.{a.name}" if mod else a.name
        # `from flashvjp import _mask` names a submodule; `from flashvjp._x import f` a name in it.
        if (PKG / pathlib.Path(*target.split("."))).with_suffix(".py").exists() or (
            PKG / pathlib.Path(*target.split("."))).is_dir():
          yield target, node.lineno
        elif mod:
          yield mod, node.lineno
        else:  # a name of the package's __init__ (its public API)
          yield "__init__", node.lineno


def _module_of(target: str, known) -> str:
  """The module an import target lies in: itself, or the nearest enclosing one."""
  parts = target.split(".")
  for n in range(len(parts), 0, -1):
    name = ".".join(parts[:n])
    if name in known:
      return name
  return "__init__"


def _graph(replace=None) -> dict[str, dict[str, int]]:
  """{module: {module it imports: the first line that does}} over the package (dotted names
  below `flashvjp`; "__init__" is the package itself). `replace`: {module: path} read
  instead of the module's own file (the tests of the checker). A package's __init__ that
  imports its submodules is an edge; the parent package Python runs before a submodule is
  not (every re-exporting package would be a cycle with each of its modules)."""
  files = {**dict(_modules()), **(replace or {})}
  graph: dict[str, dict[str, int]] = {}
  for dotted, path in files.items():
    edges = graph.setdefault(dotted, {})
    for target, line in _imports(path, dotted):
      to = _module_of(target, files)
      if to != dotted:
        edges.setdefault(to, line)
  return graph


def _components(graph) -> list[set[str]]:
  """The strongly connected components of `graph` that hold more than one module (modules
  that import each other, directly or around a cycle; Tarjan's algorithm)."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  components: list[set[str]] = []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = set()
      while True:
        w = stack.pop()
        on_stack.discard(w)
        comp.add(w)
        if w == v:
          break
      if len(comp) > 1:
        components.append(comp)

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return components


def _cycle_in(comp, graph) -> list[str]:
  """A shortest cycle [m, ..., m] through the first module (by name) of component `comp`
  (breadth-first from it back to itself, within the component)."""
  start = min(comp)
  came_from: dict[str, str] = {}
  frontier = [start]
  while start not in came_from:
    nxt = []
    for v in frontier:
      for w in sorted(graph[v]):
        if w in comp and w not in came_from:
          came_from[w] = v
          nxt.append(w)
    frontier = nxt
  path = [start]
  while len(path) == 1 or path[-1] != start:
    path.append(came_from[path[-1]])
  return path[::-1]


def _cycles(graph) -> list[list[str]]:
  """One cycle per component of `_components(graph)`, sorted."""
  return sorted(_cycle_in(c, graph) for c in _components(graph))


def _describe(cycle, graph) -> str:
  """flashvjp.a:12 -> flashvjp.b:40 -> flashvjp.a (a imports b at line 12, b imports a at 40)."""
  name = lambda m: "flashvjp" if m == "__init__" else f"flashvjp.{m}"
  return " -> ".join(f"{name(a)}:{graph[a][b]}" for a, b in zip(cycle, cycle[1:])) + (
      f" -> {name(cycle[-1])}")


def test_every_module_has_a_floor():
  for dotted, _ in _modules():
    _floor(dotted)


@pytest.mark.parametrize("dotted,path", list(_modules()), ids=lambda x: str(x))
def test_no_import_runs_up_a_floor(dotted, path):
  own = _floor(dotted)
  bad = [(t, line) for t, line in _imports(path, dotted) if _floor(t) > own]
  assert not bad, (f"flashvjp.{dotted} (floor {own}) imports from above: "
                   + ", ".join(f"flashvjp.{t} (floor {_floor(t)}) at line {line}" for t, line in bad))


def test_the_checker_sees_an_upward_import(tmp_path):
  """The test itself can fail: an upward import in a kernel file is reported."""
  f = tmp_path / "x.py"
  f.write_text("def g():\n  from flashvjp import _api\n  from flashvjp.distributed import _ring\n")
  found = [t for t, _ in _imports(f, "blockwise._x")]
  assert found == ["_api", "distributed._ring"]
  assert all(_floor(t) > _floor("blockwise._x") for t in found)


def test_the_checker_sees_the_package_itself(tmp_path):
  """`import flashvjp` / `from flashvjp import flash_attention` import the package's own
  __init__ (the top floor): below it, the public names are read where they are defined."""
  f = tmp_path / "x.py"
  f.write_text("import flashvjp\ndef g():\n  from flashvjp import flash_attention\n")
  assert [t for t, _ in _imports(f, "testing._x")] == ["__init__", "__init__"]
  assert _floor("__init__") > _floor("testing._x")


def test_no_import_cycle():
  graph = _graph()
  knots = sorted(sorted(c) for c in _components(graph))
  assert not knots, (
      "import cycles between flashvjp modules (module:line of each import; move what both"
      " need into the lower one):\n  " + "\n  ".join(
          f"{_describe(_cycle_in(set(k), graph), graph)}  (modules in this knot: {', '.join(k)})"
          for k in knots))


def test_the_cycle_checker_sees_a_lazy_cycle(tmp_path):
  """The cycle test itself can fail: a function-local import back (two foundations), and a
  module under the package's __init__ that imports the package itself (as testing once did
  for flashvjp.flash_attention), are reported with their lines."""
  config, mask = tmp_path / "_config.py", tmp_path / "_mask.py"
  config.write_text("def f():\n  import flashvjp._mask\n")
  mask.write_text("from flashvjp import _config\n")
  graph = _graph({"_config": config, "_mask": mask})
  assert _cycles(graph) == [["_config", "_mask", "_config"]]
  assert _describe(_cycles(graph)[0], graph) == (
      "flashvjp._config:2 -> flashvjp._mask:1 -> flashvjp._config")
  check = tmp_path / "_check.py"
  check.write_text("def check():\n  import flashvjp\n  return flashvjp.flash_attention\n")
  graph = _graph({"testing._check": check})
  assert _cycles(graph) == [["__init__", "testing", "testing._check", "__init__"]]

