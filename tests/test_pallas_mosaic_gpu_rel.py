"""Issue 29's way for the Mosaic-GPU kernels to read rows by kv_idx - q_idx
(`flashvjp/pallas/mosaic_gpu/_rel.py`): every Toeplitz tile is a window of a skewed array.

Checked element by element against the rel row in both orientations (queries as rows: the
forward and dQ kernels; keys as rows: the dK/dV kernel), and with the windows copied by TMA
in a small Mosaic-GPU kernel at dynamic, unaligned column offsets (interpret mode, race
detection), which is how the kernels will read them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashvjp.pallas.mosaic_gpu import _compat
from flashvjp.pallas.mosaic_gpu import _rel

SQP, SKVP, ROWS, COLS = 256, 384, 64, 64


def _rel_row(seed=0, Sqp=SQP, Skvp=SKVP):
  """A rel row in `PosResiduals.rel`'s layout: element e is difference e - (Sqp - 1); the
  values encode the difference so a wrong read cannot match."""
  rng = np.random.default_rng(seed)
  return (np.arange(Sqp + Skvp) - (Sqp - 1) + rng.random(Sqp + Skvp) / 4).astype(np.float32)


def _tile(rel, q0, k0, rows, cols, Sqp, transposed):
  """The tile read element by element: rel[kv - q + Sqp - 1]."""
  if transposed:  # keys as rows, queries as columns
    j = np.arange(rows)[:, None]
    i = np.arange(cols)[None, :]
  else:
    i = np.arange(rows)[:, None]
    j = np.arange(cols)[None, :]
  return rel[(k0 + j) - (q0 + i) + Sqp - 1]


@pytest.mark.parametrize("transposed", [False, True], ids=["q_rows", "kv_rows"])
@pytest.mark.parametrize("Sqp,Skvp", [(SQP, SKVP), (SKVP, SQP), (128, 128)])
def test_every_tile_is_a_window(transposed, Sqp, Skvp):
  rel = _rel_row(1, Sqp, Skvp)
  W = np.asarray(_rel.skewed(rel, Sqp, Skvp, ROWS, transposed))
  assert W.shape == (ROWS, _rel.width(Sqp, Skvp, ROWS)) == (ROWS, Sqp + Skvp - ROWS)
  rows_of, cols_of = (Skvp, Sqp) if transposed else (Sqp, Skvp)
  for r0 in range(0, rows_of - ROWS + 1, 16):
    for c0 in range(0, cols_of - COLS + 1, 16):
      q0, k0 = (c0, r0) if transposed else (r0, c0)
      s = _rel.window_start(q0, k0, Sqp, ROWS, Skvp, transposed=transposed)
      assert 0 <= s and s + COLS <= W.shape[1], (q0, k0, s)
      np.testing.assert_array_equal(W[:, s:s + COLS],
                                    _tile(rel, q0, k0, ROWS, COLS, Sqp, transposed),
                                    err_msg=f"q0={q0} k0={k0} transposed={transposed}")


def test_skew_of_batched_jax_rows_and_bad_arguments():
  rel = jnp.stack([jnp.asarray(_rel_row(s)) for s in range(3)]).reshape(3, 1, -1)
  W = _rel.skewed(rel, SQP, SKVP, ROWS)
  assert W.shape == (3, 1, ROWS, SQP + SKVP - ROWS)
  np.testing.assert_array_equal(np.asarray(W[2, 0]), _rel.skewed(_rel_row(2), SQP, SKVP, ROWS))
  with pytest.raises(ValueError, match="shorter than"):
    _rel.skewed(rel[..., :100], SQP, SKVP, ROWS)
  with pytest.raises(ValueError, match="rows"):
    _rel.width(SQP, SKVP, 512)
  with pytest.raises(ValueError, match="needs Skvp"):
    _rel.window_start(0, 0, SQP, ROWS, transposed=True)


@pytest.mark.skipif(_compat.unavailable() is not None,
                    reason=f"Mosaic-GPU Pallas: {_compat.unavailable()}")
@pytest.mark.parametrize("transposed", [False, True], ids=["q_rows", "kv_rows"])
def test_windows_copied_by_tma_at_dynamic_unaligned_offsets(transposed):
  """One TMA copy per tile of a [64, 64] float32 window at a column offset read from memory
  (odd offsets included), into SMEM, then out: each equals the tile read element by element."""
  mg = _compat.plgpu()
  rel = _rel_row(2)
  W = jnp.asarray(_rel.skewed(rel, SQP, SKVP, ROWS, transposed))
  # (q0, k0): the kernels' tiles start at multiples of 16 (their smallest blocks); an odd
  # start shows the copy does not depend on that
  tiles = [(0, 0), (64, 128), (192, 0), (0, 320), (128, 256), (16, 48), (5, 130)]
  starts = np.array([_rel.window_start(q0, k0, SQP, ROWS, SKVP, transposed=transposed)
                     for q0, k0 in tiles], np.int32)
  assert (starts % 16 != 0).any() and (starts % 2 == 1).any(), starts
  n = len(tiles)

  def make(wait):
    def body(w_ref, starts_ref, out_ref, smem, bars):
      for t in range(n):
        s = starts_ref[t]
        mg.copy_gmem_to_smem(w_ref.at[:, _compat.ds(s, COLS)], smem.at[t], bars.at[t])
        if wait:
          mg.barrier_wait(bars.at[t])
        mg.copy_smem_to_gmem(smem.at[t], out_ref.at[t])
      mg.wait_smem_to_gmem(0)
    return mg.kernel(
        body, out_type=jax.ShapeDtypeStruct((n, ROWS, COLS), jnp.float32),
        scratch_types=[mg.SMEM((n, ROWS, COLS), jnp.float32),
                       mg.Barrier(num_arrivals=1, num_barriers=n)],
        interpret=_compat.interpret_params(detect_races=True))

  _compat.reset_interpret_state()
  got = np.asarray(make(wait=True)(W, jnp.asarray(starts)))
  assert not _compat.interpret_races_found()
  for t, (q0, k0) in enumerate(tiles):
    np.testing.assert_array_equal(got[t], _tile(rel, q0, k0, ROWS, COLS, SQP, transposed),
                                  err_msg=f"tile {t}: q0={q0} k0={k0}")
  # the barrier wait guards a real hazard: without it the race detector fires
  _compat.reset_interpret_state()
  raised = None
  try:
    jax.block_until_ready(make(wait=False)(W, jnp.asarray(starts)))
  except Exception as e:  # the interpreter raises on a detected race (on_race="raise")
    raised = e
  assert raised is not None or _compat.interpret_races_found(), "the missing wait went unnoticed"
