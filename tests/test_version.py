"""One version: `flashvjp.__version__` is what the package metadata says (pyproject reads it)."""
from __future__ import annotations

import importlib.metadata
import json
import pathlib
import re

import pytest

import flashvjp

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_version_is_single_sourced():
  tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
  pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
  assert "version" not in pyproject["project"]
  assert "version" in pyproject["project"]["dynamic"]
  assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "flashvjp.__version__"}
  assert re.fullmatch(r"\d+\.\d+\.\d+", flashvjp.__version__), flashvjp.__version__


def test_changelog_has_this_version():
  text = (ROOT / "CHANGELOG.md").read_text()
  assert re.search(rf"^## \[{re.escape(flashvjp.__version__)}\]", text, re.M), flashvjp.__version__


def test_installed_metadata_matches():
  try:
    dist = importlib.metadata.distribution("flashvjp")
  except importlib.metadata.PackageNotFoundError:
    pytest.skip("flashvjp is not installed (imported from the source tree only)")
  url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
  if url.startswith("file://") and pathlib.Path(url[7:]).resolve() != ROOT:
    pytest.skip(f"the installed flashvjp is another checkout ({url}), not this tree")
  assert dist.version == flashvjp.__version__
