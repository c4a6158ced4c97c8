"""The documentation site's API reference (docs/api.md) lists every public name.

The site itself is built by `.ci/checks` (Sphinx, warnings as errors: broken links and
references fail); its Python snippets run in tests/test_docs.py, like the README's.
"""
from __future__ import annotations

import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api.md"
# Each public module whose `__all__` the reference must cover (add a module here and to api.md).
MODULES = ["flashvjp", "flashvjp.flax", "flashvjp.testing", "flashvjp.testing.strategies"]
_DIRECTIVE = re.compile(r"^\.\. auto(?P<kind>\w+):: (?P<target>[\w.]+)(?P<opts>(?:\n +:.*)*)", re.M)


def documented():
  """{qualified name} of the autodoc directives in docs/api.md (`currentmodule` is flashvjp);
  an `automodule` with `:members:` covers its module's __all__."""
  out = set()
  for m in _DIRECTIVE.finditer(API.read_text()):
    target = m.group("target")
    if m.group("kind") == "module":
      out.add(target)  # the module itself (a submodule named in a package's __all__)
      if ":members:" in m.group("opts"):
        out.update(f"{target}.{n}" for n in importlib.import_module(target).__all__)
      continue
    out.add(target if "." in target else f"flashvjp.{target}")
  return out


@pytest.mark.parametrize("module", MODULES)
def test_every_public_name_is_in_the_api_reference(module):
  names = {f"{module}.{n}" for n in importlib.import_module(module).__all__}
  missing = sorted(names - documented())
  assert not missing, f"not in docs/api.md: {missing}"


def test_every_api_entry_exists():
  for name in documented():
    mod, _, attr = name.rpartition(".")
    assert hasattr(importlib.import_module(mod), attr), name
