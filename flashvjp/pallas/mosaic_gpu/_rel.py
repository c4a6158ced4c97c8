"""Rows read by kv_idx - q_idx as windows of a skewed array: how the Mosaic-GPU kernels will
read a Toeplitz tile with one TMA copy (the forward's consumers, the dQ, dK/dV and tangent
kernels).

Room: Mosaic-GPU kernels (the family's own). A mod's value that depends on the positions
only through ``kv_idx - q_idx`` (``table[h, clip(kv_idx - q_idx, -d, d) + d]``, T5
buckets) reaches the kernels as a row per (b, h) over the differences
(`flashvjp.pallas._common.PosResiduals.rel`: element ``kv - q + Sqp - 1``). A [rows, cols]
tile of it is Toeplitz: constant along its diagonals. The Triton family gathers it, and the
Mosaic-TPU family rolls lanes; Hopper's TMA copies rectangles. So XLA skews the row once:

* ``skewed(rel, Sqp, Skvp, rows)[..., i, c] = rel[..., c - i + rows - 1]``: every
  [rows, cols] tile of queries ``q0 .. q0 + rows - 1`` against keys ``k0 .. k0 + cols - 1``
  (the forward's and the dQ kernel's orientation) is the window starting at column
  ``window_start(q0, k0, Sqp, rows)``: one TMA copy of a [rows, cols] rectangle at a dynamic,
  unaligned column offset.
* ``skewed(..., transposed=True)``, the same array reversed along both axes: the
  [rows, cols] tiles of keys ``k0 ..`` against queries ``q0 ..`` (the dK/dV kernel's
  orientation, keys as rows), at ``window_start(q0, k0, Sqp, rows, Skvp, transposed=True)``.

Cost: ``rows * (Sqp + Skvp - rows)`` float32 per (b, h) row (64 rows: 64 x the row), built
by one gather with static indices. Checked by `tests/test_pallas_mosaic_gpu_rel.py` against
the tiles read element by element, and with the windows copied by TMA in a Mosaic-GPU kernel
(interpret mode, race detection).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def width(Sqp: int, Skvp: int, rows: int) -> int:
  """Columns of the skewed array: every window of every tile fits."""
  if not 0 < rows <= min(Sqp, Skvp):
    raise ValueError(f"rows ({rows}) must be in (0, min(Sqp, Skvp)] = (0, {min(Sqp, Skvp)}]")
  return Sqp + Skvp - rows


def indices(Sqp: int, Skvp: int, rows: int, transposed: bool = False) -> np.ndarray:
  """int32 [rows, width]: which element of a rel row (`PosResiduals.rel` layout, length
  Sqp + Skvp; element Sqp + Skvp - 1 is never read) each element of the skewed array holds."""
  w = width(Sqp, Skvp, rows)
  i = np.arange(rows)[:, None]
  c = np.arange(w)[None, :]
  idx = c - i + rows - 1
  if transposed:
    idx = idx[::-1, ::-1]
  return np.ascontiguousarray(idx, np.int32)


def skewed(rel, Sqp: int, Skvp: int, rows: int, transposed: bool = False):
  """[..., rows, width] from rel rows [..., L >= Sqp + Skvp - 1] (a jax or numpy array):
  the array whose windows are the Toeplitz tiles (module doc)."""
  if rel.shape[-1] < Sqp + Skvp - 1:
    raise ValueError(f"rel rows of length {rel.shape[-1]} are shorter than the"
                     f" Sqp + Skvp - 1 = {Sqp + Skvp - 1} differences")
  return rel[..., indices(Sqp, Skvp, rows, transposed)]


def window_start(q0, k0, Sqp: int, rows: int, Skvp: int | None = None,
                 transposed: bool = False):
  """The first column of the window that is the tile with first query q0 and first key k0
  (ints or traced int32): ``k0 - q0 + Sqp - rows``, or with `transposed` (keys as rows)
  ``q0 - k0 + Skvp - rows``. Every such start, for q0 <= Sqp - rows (or k0 <= Skvp - rows),
  is >= 0 and its window ends inside `width`."""
  if transposed:
    if Skvp is None:
      raise ValueError("a transposed window needs Skvp")
    return q0 - k0 + (Skvp - rows)
  return k0 - q0 + (Sqp - rows)


def rows(pos, n: int, B: int, H: int, Sqp: int, Skvp: int):
  """Rel residual n of `pos` (`PosResiduals.rel`, [B|1, H|1, L]) as a kernel with padded
  lengths (Sqp, Skvp) reads it: sliced to [B', H, Sqp + Skvp] (`PosResiduals.rel_slice`),
  float32 for a float residual, else int32 (the tile part casts it back). B' is 1 when the
  residual is the same for every batch index (`PosResiduals.rel_batch_free`: a table per
  head), so its skewed array is not repeated per batch; the kernels read batch 0 then."""
  row = jnp.asarray(pos.rel[n])
  dt = jnp.float32 if jnp.issubdtype(row.dtype, jnp.inexact) else jnp.int32
  row = row[..., pos.rel_slice(Sqp, Skvp)].astype(dt)
  free = n < len(pos.rel_batch_free) and pos.rel_batch_free[n]
  if free:
    row = row[:1]
  return jnp.broadcast_to(row, (1 if free else B, H, row.shape[-1]))


def operand(pos, n: int, B: int, H: int, Sqp: int, Skvp: int, rows_: int,
            transposed: bool = False):
  """The skewed array [B' (1 or B), H, rows_, width] of rel residual n of `pos` (`rows`)."""
  return skewed(rows(pos, n, B, H, Sqp, Skvp), Sqp, Skvp, rows_, transposed)


def batch_index(ref, b):
  """The batch index of a skewed array `ref` (a kernel ref): b, or 0 for one shared by every
  batch index (`rows`)."""
  return b if ref.shape[0] > 1 else 0
