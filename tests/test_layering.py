"""The package's floors: a module imports from its own floor or below, never above.

BUILD.md / ../shared/STYLE.md describe the house: foundations (config, mask model,
score_mod, mask_mod, dropout, the reference), the backends (blockwise, pallas), the
partitioning rule, the differentiation rules and dispatch, the API, then the
user-facing layers (distributed, jax.nn drop-in, flax, checks) and the entry points.
The imports are read with `ast` (lazy imports inside functions included), so an arrow
running back up the house fails here before it becomes a cycle.
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
  """flashvjp submodules imported by the file (absolute and relative imports)."""
  tree = ast.parse(path.read_text())
  is_pkg = path.name == "__init__.py"
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name.startswith("flashvjp."):
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
