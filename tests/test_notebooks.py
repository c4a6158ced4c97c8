"""Every notebook in notebooks/ executes top to bottom (so the examples never rot).

The notebooks assert their own claims (agreement with jax.nn and naive, learning,
linear memory); a failing assert fails this test. Skipped cleanly when the
notebook extras (nbclient, nbformat, ipykernel, flax, optax, matplotlib) are missing.
"""
from __future__ import annotations

import pathlib
import time

import pytest

for _mod in ("nbclient", "nbformat", "ipykernel", "flax", "optax", "matplotlib"):
  pytest.importorskip(_mod)

import nbclient  # noqa: E402
import nbformat  # noqa: E402

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300  # per cell; each notebook takes well under 60 s on an idle CPU


def test_notebooks_found():
  assert len(NOTEBOOKS) >= 3, f"expected notebooks in notebooks/, found {NOTEBOOKS}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path):
  nb = nbformat.read(path, as_version=4)
  assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
      f"{path.name} is committed with outputs; clear them")
  client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                   resources={"metadata": {"path": str(path.parent)}})
  t0 = time.perf_counter()
  client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
  print(f"{path.name}: {time.perf_counter() - t0:.1f}s")
