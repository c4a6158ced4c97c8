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
from tests import _util

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


# ---- the kernels reading rel tables (interpret mode, race detection on) -------------------

_WHY = _compat.unavailable()
_needs_mgpu = pytest.mark.skipif(_WHY is not None, reason=f"Mosaic-GPU Pallas: {_WHY}")


def _rel_score_mod(s, b, h, q_idx, kv_idx, table, buckets):
  """`relative_position_bias`'s table (clipped distances) and a T5 bucketed table, both
  read by kv_idx - q_idx, both differentiable."""
  del b
  d = kv_idx - q_idx
  return (s + table[h, jnp.clip(d, -16, 16) + 16].astype(s.dtype)
          + buckets[h, _util.t5_bucket(d)].astype(s.dtype))


def _rel_problem(S=200, Skv=None, B=1, H=2, Hkv=1, D=64, seed=0, causal=True, **kw):
  from tests import test_pallas_mosaic_gpu_backward as backward_tests
  Skv = S if Skv is None else Skv
  rng = np.random.default_rng(seed)
  q, k, v = _util.random_qkv(seed, B, H, Hkv, S, Skv, D, dtype=jnp.bfloat16)
  table = jnp.asarray(rng.standard_normal((H, 33)), jnp.float32)
  buckets = jnp.asarray(rng.standard_normal((H, 8)), jnp.float32)
  cfg = backward_tests._cfg(S, Skv, D, causal=causal, score_mod=_rel_score_mod,
                            num_diff_consts=2, **kw)
  return cfg, (q, k, v), (table, buckets)


def _reference(cfg, qkv, consts, **kw):
  from flashvjp import reference
  fwd = lambda q, k, v, *c: reference.attention(cfg, q, k, v, None, None, None, None, None, c,
                                                **kw)
  return fwd, tuple(_util.as64(x) for x in qkv + consts)


@_needs_mgpu
@pytest.mark.parametrize("S,Skv,D", [(200, 200, 64), (96, 160, 128)])
def test_rel_tables_forward_backward_and_table_gradients(S, Skv, D):
  """Forward (out, lse), dq / dk / dv and d(table), d(buckets) against float64 autodiff of
  naive attention: the forward's consumers, the dQ and dK/dV kernels read each tile as a TMA
  window; the tables' gradients are the block-diagonal sums."""
  from flashvjp.pallas.mosaic_gpu import backward as mgpu_backward
  from flashvjp.pallas.mosaic_gpu import forward as mgpu_forward
  cfg, qkv, consts = _rel_problem(S, Skv, D=D, causal=S == Skv)
  fwd, primals = _reference(cfg, qkv, consts)
  (out, lse), vjp = jax.vjp(fwd, *primals)
  do = jax.random.normal(jax.random.key(1), out.shape, jnp.float64).astype(jnp.bfloat16)
  ref = vjp((_util.as64(do), jnp.zeros_like(lse)))
  _compat.reset_interpret_state()
  got_out, got_lse = jax.block_until_ready(mgpu_forward.forward(
      cfg, *qkv, None, None, None, None, None, consts))
  assert not _compat.interpret_races_found()
  _util.assert_close((got_out, got_lse), (out, lse), jnp.bfloat16, what="rel forward")
  _compat.reset_interpret_state()
  got = jax.block_until_ready(mgpu_backward.backward(
      cfg, *qkv, None, None, None, None, None, consts, out.astype(jnp.float32),
      lse.astype(jnp.float32), do, None))
  assert not _compat.interpret_races_found()
  _util.assert_close(tuple(got[:3]) + tuple(got[4]), ref, jnp.bfloat16,
                     what="rel dq, dk, dv, d table, d buckets")
  assert all(float(jnp.abs(d).max()) > 0 for d in got[4])  # the tables do get gradients


@_needs_mgpu
def test_rel_tables_tangent_along_inputs_and_tables():
  from flashvjp.pallas.mosaic_gpu import tangent as mgpu_tangent
  cfg, qkv, consts = _rel_problem(S=136, seed=1)
  fwd, primals = _reference(cfg, qkv, consts)
  rng = np.random.default_rng(2)
  tangents = tuple(jnp.asarray(rng.standard_normal(x.shape), x.dtype) for x in qkv + consts)
  (out, lse), (t_out, t_lse) = jax.jvp(fwd, primals, tuple(_util.as64(t) for t in tangents))
  _compat.reset_interpret_state()
  got = jax.block_until_ready(mgpu_tangent.tangent(
      cfg, *qkv, None, None, None, None, None, consts, out.astype(jnp.bfloat16),
      lse.astype(jnp.float32), *tangents[:3], None, tangents[3:]))
  assert not _compat.interpret_races_found()
  _util.assert_close(got, (t_out, t_lse), jnp.bfloat16, what="rel tangent")
  # along the tables alone: the rel residuals' own tangents reach the kernel (not causal:
  # in the first causal rows t_out = a - t_lse * out nearly cancels, and out in bfloat16
  # costs 1.3e-2 there, in the Pallas-Triton family's tangent as in this one)
  cfg, qkv, consts = _rel_problem(S=136, seed=1, causal=False)
  fwd, primals = _reference(cfg, qkv, consts)
  (out, lse) = fwd(*primals)
  zero = tuple(jnp.zeros_like(x) for x in qkv)
  (_, _), (t_out, t_lse) = jax.jvp(fwd, primals, tuple(_util.as64(t) for t in zero + tangents[3:]))
  got = mgpu_tangent.tangent(cfg, *qkv, None, None, None, None, None, consts,
                             out.astype(jnp.bfloat16), lse.astype(jnp.float32), None, None, None,
                             None, tangents[3:])
  _util.assert_close(got, (t_out, t_lse), jnp.bfloat16, what="rel tangent, tables only")
  assert float(jnp.abs(got[0]).max()) > 0


@_needs_mgpu
def test_rel_tables_chunk_pair_reads_global_differences():
  """q rows 64.. against kv rows 0..128 of a 192-long problem at offsets (0, 0, 64, 0): the
  pair's tiles read the global differences kv - q."""
  from flashvjp import reference
  from flashvjp.pallas.mosaic_gpu import forward as mgpu_forward
  from tests import test_pallas_mosaic_gpu_backward as backward_tests
  S, C = 192, 64
  cfg, qkv, consts = _rel_problem(S=S, seed=3, causal=False)
  q, k, v = qkv
  local = backward_tests._cfg(S - C, 2 * C, 64, score_mod=_rel_score_mod, num_diff_consts=2)
  _compat.reset_interpret_state()
  out, lse = jax.block_until_ready(mgpu_forward.forward(
      local, q[:, :, C:], k[:, :, :2 * C], v[:, :, :2 * C], None, None, None, None, None, consts,
      offsets=(0, 0, C, 0)))
  assert not _compat.interpret_races_found()
  keep = jnp.asarray(np.arange(S) < 2 * C)[None, None, None, :]
  f64 = _util.as64
  ro, rl = reference.attention(cfg, *(f64(x) for x in qkv), None, keep, None, None, None,
                               tuple(f64(c) for c in consts))
  _util.assert_close((out, lse), (ro[:, :, C:], rl[:, :, C:]), jnp.bfloat16, what="rel pair")


@_needs_mgpu
def test_rel_tables_with_segments_and_dropout():
  """Segment ids (the d(rel) kernel follows each block diagonal's non-empty tiles,
  `_common.diagonal_lists`) and dropout (the same keep bits in all four kernels): forward,
  dq / dk / dv and the tables' gradients against float64."""
  from flashvjp import reference
  from flashvjp.pallas.mosaic_gpu import backward as mgpu_backward
  from flashvjp.pallas.mosaic_gpu import forward as mgpu_forward
  S = 200
  cfg, qkv, consts = _rel_problem(S, seed=5, causal=False, dropout_rate=0.2)
  seg = jnp.asarray(np.repeat(np.arange(4), 50)[None], jnp.int32)
  seed = jnp.asarray([3, 7], jnp.uint32)
  fwd = lambda q, k, v, *c: reference.attention(cfg, q, k, v, None, None, seg, seg, seed, c)
  primals = tuple(_util.as64(x) for x in qkv + consts)
  (out, lse), vjp = jax.vjp(fwd, *primals)
  do = jax.random.normal(jax.random.key(2), out.shape, jnp.float64).astype(jnp.bfloat16)
  ref = vjp((_util.as64(do), jnp.zeros_like(lse)))
  _compat.reset_interpret_state()
  got_out, got_lse = mgpu_forward.forward(cfg, *qkv, None, None, seg, seg, seed, consts)
  got = jax.block_until_ready(mgpu_backward.backward(
      cfg, *qkv, None, None, seg, seg, seed, consts, out.astype(jnp.float32),
      lse.astype(jnp.float32), do, None))
  assert not _compat.interpret_races_found()
  _util.assert_close((got_out, got_lse), (out, lse), jnp.bfloat16, what="rel + seg + drop fwd")
  _util.assert_close(tuple(got[:3]) + tuple(got[4]), ref, jnp.bfloat16,
                     what="rel + seg + drop: dq, dk, dv, d table, d buckets")


@_needs_mgpu
@pytest.mark.parametrize("name", [
    # The d(rel) kernel's producer refills a slot its compute warpgroup may still read.
    "skip_drel_free_wait",
    # No proxy fence between the generic loads of a slot (lse, delta, rel windows) and the
    # TMA refill of that slot.
    "skip_drel_fence",
])
def test_rel_gradient_kernel_mutation_is_caught(monkeypatch, name):
  from flashvjp.pallas.mosaic_gpu import backward as mgpu_backward
  from tests import test_pallas_mosaic_gpu_backward as backward_tests
  cfg, qkv, consts = _rel_problem(S=192, seed=6, causal=False)
  out = jnp.ones_like(qkv[0])
  lse = jnp.zeros(qkv[0].shape[:3], jnp.float32)
  run = lambda: mgpu_backward.backward(cfg, *qkv, None, None, None, None, None, consts, out, lse,
                                       out, None)
  backward_tests.assert_mutation_caught(monkeypatch, name, run)


@_needs_mgpu
def test_forward_plan_counts_the_windows_and_gives_one_consumer_one_slot():
  """The forward's plan counts each consumer's [64, bk] float32 windows per ring slot; when
  two tables' windows push a head-dim-128 CTA to one consumer, it gets one slot (ptxas 13.0
  crashed at two and three); a table-free plan of one consumer keeps its three."""
  from flashvjp.pallas.mosaic_gpu import forward as mgpu_forward
  shapes = ((1, 4, 1024, 128), (1, 2, 1024, 128), (1, 2, 1024, 128))
  windows = lambda n: (lambda bq, bk: 4 * bq * bk * n)
  one = mgpu_forward.plan(*shapes, elementwise=True, slot_extra=windows(1), rel=True)
  assert (one.consumers, one.slots) == (2, 2) and one.slot_extra == 4 * 128 * 64
  two = mgpu_forward.plan(*shapes, elementwise=True, slot_extra=windows(2), rel=True)
  assert (two.consumers, two.slots) == (1, 1)
  assert mgpu_forward.plan(*shapes, elementwise=True, slot_extra=windows(2)).slots == 3


def _per_batch_score_mod(s, b, h, q_idx, kv_idx, table, per_batch):
  """A table per head (the same for every batch index) and one per batch, both by kv - q."""
  d = jnp.clip(kv_idx - q_idx, -16, 16) + 16
  return s + table[h, d].astype(s.dtype) + per_batch[b, d].astype(s.dtype)


@_needs_mgpu
def test_rel_tables_per_head_are_not_repeated_per_batch():
  """Batch 2: a table per head is read from one skewed array for every batch index (its rows
  are marked batch-free from the mod's jaxpr), a table per batch from one per batch index;
  forward, dq / dk / dv and both tables' gradients against float64."""
  from flashvjp.pallas.mosaic_gpu import backward as mgpu_backward
  from flashvjp.pallas.mosaic_gpu import forward as mgpu_forward
  from tests import test_pallas_mosaic_gpu_backward as backward_tests
  S, H = 136, 2
  rng = np.random.default_rng(7)
  q, k, v = _util.random_qkv(7, 2, H, 1, S, S, 64, dtype=jnp.bfloat16)
  consts = (jnp.asarray(rng.standard_normal((H, 33)), jnp.float32),
            jnp.asarray(rng.standard_normal((2, 33)), jnp.float32))
  cfg = backward_tests._cfg(S, S, 64, causal=True, score_mod=_per_batch_score_mod,
                            num_diff_consts=2)
  split = mgpu_forward.split_mods(cfg, consts, None, 2, H)
  assert split.sm_pos.rel_batch_free == (True, False)
  fwd, primals = _reference(cfg, (q, k, v), consts)
  (out, lse), vjp = jax.vjp(fwd, *primals)
  do = jax.random.normal(jax.random.key(3), out.shape, jnp.float64).astype(jnp.bfloat16)
  ref = vjp((_util.as64(do), jnp.zeros_like(lse)))
  _compat.reset_interpret_state()
  got_out, got_lse = mgpu_forward.forward(cfg, q, k, v, None, None, None, None, None, consts)
  got = jax.block_until_ready(mgpu_backward.backward(
      cfg, q, k, v, None, None, None, None, None, consts, out.astype(jnp.float32),
      lse.astype(jnp.float32), do, None))
  assert not _compat.interpret_races_found()
  _util.assert_close((got_out, got_lse), (out, lse), jnp.bfloat16, what="per-batch rel fwd")
  _util.assert_close(tuple(got[:3]) + tuple(got[4]), ref, jnp.bfloat16,
                     what="per-batch rel: dq, dk, dv, d table, d per_batch")
