"""Sphinx configuration of the flashvjp documentation site (BUILD.md: "Docs").

The source directory is the repository root (`sphinx-build -c docs . docs/_build/html`), so the
pages link to each other, to README.md, BUILD.md, the notebooks and the recorded benchmark results
by the same relative paths that work on a code host; nothing is copied. Only the files named in
`include_patterns` are read. Notebooks are rendered with their committed outputs (never executed
here: tests/test_notebooks.py executes them).
"""
from __future__ import annotations

import pathlib
import sys

# Document the tree being built, not whichever flashvjp is installed.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import flashvjp

project = "flashvjp"
author = "the flashvjp authors"
copyright = "the flashvjp authors; Apache-2.0"
release = flashvjp.__version__
version = release

root_doc = "docs/index"
include_patterns = [
  "docs/*.md", "README.md", "BUILD.md", "CHANGELOG.md", "notebooks/*.ipynb",
  "benchmarks/results/*.md",
]
exclude_patterns = ["docs/_build/**"]

extensions = [
  "myst_nb",  # Markdown (MyST) pages and notebooks
  "sphinx.ext.autodoc",
  "sphinx.ext.napoleon",  # Google-style docstrings (Args:, Returns:, Raises:)
  "sphinx.ext.viewcode",
]

# Broken references fail the build (-W): page links, and Python references (nitpicky). Types
# of other libraries are left unlinked: CI has no network for intersphinx inventories.
nitpicky = True
nitpick_ignore_regex = [
  ("py:class", r"(jax|jaxlib|numpy|np|jnp|flax|optax)(\..*)?"),
  ("py:class", r"(collections\.abc|typing)\..*"),
]

nb_execution_mode = "off"  # the committed outputs are the rendered ones
myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 3  # README/doc links to "#a-section" resolve

autodoc_typehints = "description"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": False, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

html_theme = "furo"
html_title = f"flashvjp {release}"
html_extra_path = ["_root"]  # (relative to docs/) index.html at the site root -> docs/index.html
