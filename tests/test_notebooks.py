"""Every notebook in notebooks/ executes top to bottom (so the examples never rot).

The notebooks assert their own claims (agreement with jax.nn and naive, learning,
linear memory); a failing assert fails this test. They are committed *with* their
outputs, so that a reader sees the plots: this test checks that the committed copy
is executed and small, then runs a copy in memory and never writes the file.
Skipped cleanly when the notebook extras (nbclient, nbformat, ipykernel, flax, optax,
matplotlib) are missing.

Refresh the committed outputs after an API change (from the project root):

    python tests/test_notebooks.py --write            # all notebooks
    python tests/test_notebooks.py --write 02_training
"""
from __future__ import annotations

import pathlib
import sys
import time

import pytest

if __name__ != "__main__":
  for _mod in ("nbclient", "nbformat", "ipykernel", "flax", "optax", "matplotlib"):
    pytest.importorskip(_mod)

import nbclient
import nbformat

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300  # per cell; each notebook takes well under 60 s on an idle CPU
MAX_NOTEBOOK_BYTES = 400_000  # outputs are a few small PNG plots and printed lines


def execute(path: pathlib.Path):
  """The notebook at `path`, executed in a fresh kernel (in memory; the file is not written)."""
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                   record_timing=False,
                                   resources={"metadata": {"path": str(path.parent)}})
  client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
  return nb


def test_notebooks_found():
  assert len(NOTEBOOKS) >= 4, f"expected notebooks in notebooks/, found {NOTEBOOKS}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_with_outputs(path):
  """Every code cell was run, in order, without error; plots are there; the file is small."""
  assert path.stat().st_size < MAX_NOTEBOOK_BYTES, f"{path.name}: outputs too large"
  nb = nbformat.read(path, as_version=4)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), (
      f"{path.name} is not committed executed top to bottom: run"
      f" `python tests/test_notebooks.py --write {path.stem}`")
  outputs = [o for c in code for o in c.outputs]
  assert not [o for o in outputs if o.output_type == "error"], f"{path.name} has an error output"
  assert not [o for o in outputs if "Traceback" in o.get("text", "")], (
      f"{path.name} shows a traceback")
  if "plt." in "".join(c.source for c in code):
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name}: no plot saved"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path):
  before = path.read_bytes()
  t0 = time.perf_counter()
  nb = execute(path)
  print(f"{path.name}: {time.perf_counter() - t0:.1f}s")
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(c.execution_count is not None for c in code)
  assert path.read_bytes() == before  # executing never rewrites the committed notebook


if __name__ == "__main__":
  if sys.argv[1:2] != ["--write"]:
    sys.exit(__doc__)
  names = sys.argv[2:]
  for p in NOTEBOOKS:
    if names and p.stem not in names:
      continue
    t0 = time.perf_counter()
    nb = execute(p)
    nbformat.write(nb, p)
    print(f"wrote {p.name} ({time.perf_counter() - t0:.0f} s, {p.stat().st_size // 1000} kB)")
