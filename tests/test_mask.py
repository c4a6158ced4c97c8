"""The mask model's block classification and compacted block lists, against brute force.

Brute force: the element predicate (`MaskSpec.allowed`) on every padded position, then
per block any / all. The classification must never call a block EMPTY that has an
allowed position, nor FULL one that has a forbidden real position; with sorted segment
ids (packed documents) its emptiness is exact, so no kernel visits an empty block.
"""
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from flashvjp import _mask


@st.composite
def layouts(draw):
  sq = draw(st.integers(1, 90))
  skv = draw(st.one_of(st.just(sq), st.integers(1, 90)))
  bq = draw(st.sampled_from([4, 8, 16]))
  bk = draw(st.sampled_from([4, 8, 16]))
  causal = draw(st.booleans())
  window = draw(st.one_of(st.none(), st.tuples(st.one_of(st.none(), st.integers(0, 30)),
                                                 st.one_of(st.none(), st.integers(0, 30)))))
  rng = np.random.default_rng(draw(st.integers(0, 2**16)))
  B, H = 2, 3
  seg = draw(st.booleans()) and sq == skv
  q_seg = kv_seg = None
  if seg:  # sorted ids: packed documents
    ids = np.sort(rng.integers(0, 4, (B, sq)), axis=1).astype(np.int32)
    q_seg = kv_seg = ids
  mask = None
  mshape = draw(st.sampled_from([None, (B, H, sq, skv), (B, 1, 1, skv), (1, H, sq, 1)]))
  if mshape is not None:
    dense = rng.random(mshape) < draw(st.floats(0.0, 1.0))
    if draw(st.booleans()):  # whole blocks of True / False
      dense = np.ones(mshape, bool) if draw(st.booleans()) else dense
    mask = dense
  return sq, skv, bq, bk, causal, window, q_seg, kv_seg, mask


def _padded(sq, skv, bq, bk, q_seg, kv_seg, mask):
  nq, nk = -(-sq // bq), -(-skv // bk)
  qs = ks = m = None
  if q_seg is not None:
    qs = _mask.pad_axis(jnp.asarray(q_seg), 1, nq * bq, "edge", keep_broadcast=False)
    ks = _mask.pad_axis(jnp.asarray(kv_seg), 1, nk * bk, "edge", keep_broadcast=False)
  if mask is not None:
    m = _mask.pad_axis(_mask.pad_axis(jnp.asarray(mask), 2, nq * bq), 3, nk * bk)
  return nq, nk, qs, ks, m


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_block_classes_against_brute_force(layout):
  sq, skv, bq, bk, causal, window, q_seg, kv_seg, mask = layout
  spec = _mask.MaskSpec(causal, window, sq, skv)
  nq, nk, qs, ks, m = _padded(sq, skv, bq, bk, q_seg, kv_seg, mask)
  cls = np.asarray(_mask.block_classes(spec, qs, ks, m, bq, bk, nq, nk))
  assert cls.shape[-2:] == (nq, nk)  # every block pair, also when nothing varies along q
  qi = np.arange(nq * bq)[None, None, :, None]
  ki = np.arange(nk * bk)[None, None, None, :]
  allowed = np.asarray(spec.allowed(
      jnp.asarray(qi), jnp.asarray(ki),
      q_seg=None if qs is None else qs[:, None, :, None],
      kv_seg=None if ks is None else ks[:, None, None, :],
      dense=m))
  allowed = np.broadcast_to(allowed, np.broadcast_shapes(allowed.shape, cls.shape[:2] + (1, 1)))
  blocks = allowed.reshape(allowed.shape[:2] + (nq, bq, nk, bk))
  any_ = blocks.any(axis=(3, 5))
  real_q = (np.arange(nq * bq) < sq).reshape(nq, bq)[None, None, :, :, None, None]
  all_real = np.where(real_q, blocks, True).all(axis=(3, 5))
  cls = np.broadcast_to(cls, any_.shape)
  # Sound: EMPTY has no allowed position; FULL has no forbidden real position.
  assert not (any_ & (cls == _mask.EMPTY)).any()
  assert not (~all_real & (cls == _mask.FULL)).any()
  # Exact emptiness where one source decides (static bounds alone; sorted self-attention
  # segment ids with causal; a dense mask alone): nothing empty is visited in vain. Sources
  # are combined per block (any & any), which is conservative when two overlap partially.
  static = causal or window is not None
  if ((q_seg is None and mask is None) or (mask is None and window is None)
      or (q_seg is None and not static)):
    np.testing.assert_array_equal(cls != _mask.EMPTY, any_)
  # Without segments or a dense mask, and whole q blocks, full is exact too (with a padded
  # last q block the window's left bound is taken at the block's last padded row).
  if q_seg is None and mask is None and sq % bq == 0:
    np.testing.assert_array_equal(cls == _mask.FULL, all_real & any_)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(), st.sampled_from(["q", "kv"]))
def test_block_lists_compact_the_classes(layout, by):
  sq, skv, bq, bk, causal, window, q_seg, kv_seg, mask = layout
  spec = _mask.MaskSpec(causal, window, sq, skv)
  nq, nk, qs, ks, m = _padded(sq, skv, bq, bk, q_seg, kv_seg, mask)
  cls = np.asarray(_mask.block_classes(spec, qs, ks, m, bq, bk, nq, nk))
  lists = _mask.block_lists(spec, qs, ks, m, bq, bk, nq, nk, by=by)
  if by == "kv":
    cls = np.swapaxes(cls, -1, -2)
  for count, idx, want in ((lists.num_partial, lists.partial, _mask.PARTIAL),
                           (lists.num_full, lists.full, _mask.FULL)):
    count, idx = np.asarray(count), np.asarray(idx)
    assert count.dtype == np.int32 and idx.dtype == np.int32
    assert idx.shape == cls.shape
    for lead in np.ndindex(*cls.shape[:-1]):
      expect = np.flatnonzero(cls[lead] == want)
      n = count[lead]
      assert n == len(expect)
      np.testing.assert_array_equal(idx[lead][:n], expect)
      pad = expect[-1] if n else 0  # idle steps repeat the last block: no new copy
      assert (idx[lead][n:] == pad).all()


def test_causal_lists_by_hand():
  """seq 100, blocks 32: diagonal blocks partial (the last also holds kv padding)."""
  spec = _mask.MaskSpec(True, None, 100, 100)
  lists = _mask.block_lists(spec, None, None, None, 32, 32, 4, 4)
  assert np.asarray(lists.num_partial).tolist() == [[[1, 1, 1, 1]]]
  assert np.asarray(lists.num_full).tolist() == [[[0, 1, 2, 3]]]
  assert np.asarray(lists.full)[0, 0, 3].tolist() == [0, 1, 2, 2]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_static_block_bounds_equal_the_traced_ones(layout):
  """The numpy path (static inputs: Python ints out, no jax op) and the jnp path (traced
  block index, as inside a kernel) of every block-bound method agree on every block."""
  import jax  # pylint: disable=import-outside-toplevel
  sq, skv, bq, bk, causal, window, *_ = layout
  spec = _mask.MaskSpec(causal, window, sq, skv)
  nq, nk = -(-sq // bq), -(-skv // bk)

  def methods(r, by):
    if by == "q":
      return (spec.kv_block_range(r, bq, bk, nk), spec.full_kv_block_range(r, bq, bk))
    return (spec.q_block_range(r, bq, bk, nq), spec.full_q_block_range(r, bq, bk, nq))

  for by, n in (("q", nq), ("kv", nk)):
    traced = jax.jit(jax.vmap(lambda r, by=by: methods(r, by)))(jnp.arange(n, dtype=jnp.int32))
    traced = np.broadcast_to(np.asarray(traced), (2, 2, n))
    static = np.array([[list(p) for p in methods(r, by)] for r in range(n)]).transpose(1, 2, 0)
    assert all(isinstance(x, int) for r in range(n) for p in methods(r, by) for x in p)
    np.testing.assert_array_equal(static, traced)
    assert spec.static_block_ranges(by, bq, bk, nq, nk) == tuple(
        tuple(int(x) for x in static[0, :, r]) for r in range(n))
