"""Issue 32: score_mod / mask_mod that read arrays by q or kv position, in the Pallas kernels.

What a mod reads from an array by one position (a per-key bias `bias[b, kv_idx]`, a per-query
temperature `t[q_idx]`, document ids `doc[b, q_idx] == doc[b, kv_idx]`) travels as
per-position residuals (`flashvjp.pallas._positions`): [B, H, seq] arrays the kernels slice
per tile like segment ids, with gradients per row (dQ kernel) and per column (dK/dV kernel).
Checked here in interpret mode (the Triton kernels' exact shapes) against float64 autodiff of
naive attention: forward, gradients to q, k, v, a bias and each array, and the tangent;
the deviceless H100 compiles are in tests/test_aot.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashvjp
from flashvjp import _mask
from flashvjp import _mask_mod
from flashvjp import _score_mod
from flashvjp.pallas import _positions
from tests import _util

B, H, HKV, SQ, SKV, D = 2, 4, 2, 40, 56, 16
BLOCKS = dict(block_q=16, block_kv=16)


def _kv_bias(bv):
  return lambda s, b, h, i, j: s + bv[b, j]


def _q_temperature(t):
  return lambda s, b, h, i, j: s * t[i]


def _both(bv, t):  # a q residual and a kv residual in one mod, with a per-head factor
  return lambda s, b, h, i, j: s * t[i] + bv[b, j] * (1.0 + 0.1 * h)


ARRAYS = {
    "kv_bias": lambda rng: (rng.standard_normal((B, SKV)),),
    "q_temperature": lambda rng: (1.0 + 0.3 * rng.standard_normal((SQ,)),),
    "both": lambda rng: (rng.standard_normal((B, SKV)), 1.0 + 0.3 * rng.standard_normal((SQ,))),
}
MODS = {"kv_bias": _kv_bias, "q_temperature": _q_temperature, "both": _both}


def _inputs(name, dtype=jnp.float32):
  rng = np.random.default_rng(7)
  q, k, v = _util.random_qkv(11, B, H, HKV, SQ, SKV, D, dtype=dtype)
  arrays = tuple(jnp.asarray(a, jnp.float64).astype(dtype) for a in ARRAYS[name](rng))
  bias = jnp.asarray(rng.standard_normal((1, H, SQ, SKV)), jnp.float64).astype(dtype)
  return q, k, v, bias, arrays


FAMILIES = ["pallas_triton", "pallas_tpu"]


@pytest.mark.parametrize("impl", FAMILIES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("name", sorted(MODS))
def test_grads_to_q_k_v_and_every_array(name, with_bias, impl):
  q, k, v, bias, arrays = _inputs(name)
  w = jax.random.normal(jax.random.key(3), (B, H, SQ, D), jnp.float64)

  def loss(impl, q, k, v, bias, arrays):
    extra = {} if impl == "naive" else BLOCKS
    out = flashvjp.flash_attention(q, k, v, bias=bias if with_bias else None, causal=True,
                                   score_mod=MODS[name](*arrays), implementation=impl,
                                   **extra)
    return jnp.sum(out.astype(jnp.float64) * w), out

  args = (q, k, v, bias, arrays)
  (_, got_out), got = jax.value_and_grad(
      lambda *a: loss(impl, *a), (0, 1, 2, 3, 4), has_aux=True)(*args)
  (_, ref_out), ref = jax.value_and_grad(
      lambda *a: loss("naive", *a), (0, 1, 2, 3, 4), has_aux=True)(*_util.as64(args))
  _util.assert_close(got_out, ref_out, jnp.float32, f"{name} out", impl=impl)
  names = ("dq", "dk", "dv", "dbias", "darrays")
  for what, g, r in zip(names, got, ref):
    if what == "dbias" and not with_bias:
      continue
    _util.assert_close(g, r, jnp.float32, f"{name} {what}", impl=impl)
  assert any(float(jnp.abs(d).max()) > 0 for d in got[4])  # the arrays do get gradients


def test_tpu_lane_major_rows():
  """Mosaic-TPU with one 128-row q block: q residuals and their gradients travel lane-major
  [B, H, 1, Sqp] (the compiled defaults' layout), not lane-broadcast (the other tests)."""
  q, k, v, _, arrays = _inputs("both")
  from flashvjp.pallas.tpu import _layout
  assert _layout.rows_lane_major(_layout.geometry(q.shape, k.shape, v.shape, 128, 128))

  def loss(impl, q, k, v, arrays):
    extra = {} if impl == "naive" else dict(block_q=128, block_kv=128)
    out = flashvjp.flash_attention(q, k, v, causal=True, score_mod=MODS["both"](*arrays),
                                   implementation=impl, **extra)
    return jnp.sum(jnp.sin(out.astype(jnp.float64)))

  got = jax.value_and_grad(lambda *a: loss("pallas_tpu", *a), (0, 1, 2, 3))(q, k, v, arrays)
  ref = jax.value_and_grad(lambda *a: loss("naive", *a), (0, 1, 2, 3))(
      *_util.as64((q, k, v, arrays)))
  _util.assert_close(got, ref, jnp.float32, "lane-major", impl="pallas_tpu")


@pytest.mark.parametrize("impl", FAMILIES)
@pytest.mark.parametrize("name", sorted(MODS))
def test_tangent_with_array_tangents(name, impl):
  q, k, v, _, arrays = _inputs(name)
  primals = (q, k, v, arrays)
  keys = jax.random.split(jax.random.key(5), 4)
  tangents = jax.tree_util.tree_map(
      lambda x, kk: jax.random.normal(kk, x.shape, jnp.float32), primals,
      (keys[0], keys[1], keys[2], (keys[3],) * len(arrays)))

  def run(impl, primals, tangents):
    extra = {} if impl == "naive" else BLOCKS
    f = lambda q, k, v, a: flashvjp.flash_attention(
        q, k, v, causal=True, score_mod=MODS[name](*a), implementation=impl,
        return_lse=True, **extra)
    return jax.jvp(f, primals, tangents)

  got = run(impl, primals, tangents)
  ref = run("naive", _util.as64(primals), _util.as64(tangents))
  _util.assert_close(got, ref, jnp.float32, f"{name} jvp", impl=impl)


def _docs(n_docs, S=SQ, batch=B):
  ids = np.repeat(np.arange(n_docs), -(-S // n_docs))[:S]
  return jnp.asarray(np.stack([ids, np.roll(ids, 3)])[:batch].astype(np.int32))


@pytest.mark.parametrize("impl", FAMILIES)
def test_document_causal_grads_and_tangent(impl):
  """With a bias too: the dbias kernels read the mask_mod's per-position values as well."""
  _check_mask_mod_grad_and_jvp(impl, flashvjp.document_causal(jnp.sort(_docs(5), axis=1)),
                               SQ, seed=2, bias_key=4, what="document_causal")


def _check_mask_mod_grad_and_jvp(impl, mm, skv, seed, bias_key, what):
  """value_and_grad (to q, k, v and a full bias) and jvp (along q, k, v) of attention with
  the mask_mod `mm`, `impl` against float64 naive attention."""
  q, k, v = _util.random_qkv(seed, B, H, HKV, SQ, skv, D)
  w = jax.random.normal(jax.random.key(1), (B, H, SQ, D), jnp.float64)
  bias = jax.random.normal(jax.random.key(bias_key), (1, H, SQ, skv), jnp.float32)

  def f(impl, q, k, v, bias=None):
    extra = {} if impl == "naive" else BLOCKS
    return flashvjp.flash_attention(q, k, v, bias=bias, mask_mod=mm, implementation=impl,
                                    **extra)

  loss = lambda impl, *a: jnp.sum(f(impl, *a).astype(jnp.float64) * w)
  got = jax.value_and_grad(lambda *a: loss(impl, *a), (0, 1, 2, 3))(q, k, v, bias)
  ref = jax.value_and_grad(lambda *a: loss("naive", *a), (0, 1, 2, 3))(
      *_util.as64((q, k, v, bias)))
  _util.assert_close(got, ref, jnp.float32, f"{what} grad", impl=impl)
  t = _util.random_qkv(9, B, H, HKV, SQ, skv, D)
  got = jax.jvp(lambda *a: f(impl, *a), (q, k, v), t)
  ref = jax.jvp(lambda *a: f("naive", *a), _util.as64((q, k, v)), _util.as64(t))
  _util.assert_close(got, ref, jnp.float32, f"{what} jvp", impl=impl)


# ---- the split itself -----------------------------------------------------------------

def _hoist(mod, consts_shapes=None):
  fn, consts, _ = _score_mod.convert(mod, jnp.float32)
  return _positions.hoist(fn, consts, jnp.float32)


def test_what_is_hoisted():
  bv, t = jnp.ones((B, SKV)), jnp.ones((SQ,))
  h = _hoist(_both(bv, t))
  assert (len(h.q_avals), len(h.kv_avals)) == (1, 1) and h.problem is None
  # elementwise functions of one position stay in the tile (nothing to hoist): the mods that
  # compiled before keep their form, and a relative-position table is not a one-position read
  assert _hoist(flashvjp.alibi(jnp.ones(H))) is None
  assert _hoist(lambda s, b, h_, i, j: jnp.where(j < 5, s, 2 * s)) is None
  assert _hoist(flashvjp.relative_position_bias(jnp.ones((H, 9)), 4)) is None
  # a row read by one position and then indexed by the other cannot travel as a scalar
  table = jnp.ones((SQ, SKV))
  h = _hoist(lambda s, b, h_, i, j: s + table[i][j])
  assert h is None or h.problem is not None


def test_residuals_are_the_arrays_at_each_position():
  """q residuals [B, H, Sqp] at every padded position, clamped into the sequence, shifted by
  the global offsets (a ring's chunk)."""
  from flashvjp.pallas import _common
  rng = np.random.default_rng(0)
  bv, t = jnp.asarray(rng.standard_normal((B, 3 * SKV))), jnp.asarray(rng.standard_normal(SQ))
  fn, consts, _ = _score_mod.convert(_both(bv, t), jnp.float32)
  h = _positions.hoist(fn, consts, jnp.float32)
  bs, hs = _common.global_batch_heads(B, H)
  q_res, kv_res, _ = _common._position_arrays(h, consts, bs, hs, (SQ, 20, 48, 32), (0, 0, 0, 7))
  ti = np.minimum(np.arange(48), SQ - 1)
  np.testing.assert_array_equal(np.asarray(q_res[0]), np.broadcast_to(np.asarray(t)[ti], (B, H, 48)))
  kvi = np.minimum(np.arange(32), 19) + 7
  want = np.asarray(bv)[:, kvi][:, None, :] * (1.0 + 0.1 * np.arange(H))[None, :, None]
  np.testing.assert_allclose(np.asarray(kv_res[0]), want, rtol=1e-6)


# ---- dispatch and work ----------------------------------------------------------------

@pytest.mark.parametrize("impl", FAMILIES)
def test_families_compile_them_and_explain_names_the_class(impl):
  q = jax.ShapeDtypeStruct((B, H, 256, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((B, HKV, 256, 64), jnp.bfloat16)
  bv, t, doc = jnp.ones((B, 256)), jnp.ones((256,)), jnp.zeros((B, 256), jnp.int32)
  for kw, how in ((dict(score_mod=_kv_bias(bv)), "by kv position"),
                  (dict(score_mod=_q_temperature(t)), "by q position"),
                  (dict(mask_mod=flashvjp.document_causal(doc)),
                   "by q position and by kv position")):
    d = flashvjp.explain(q, k, k, implementation=impl, interpret=False, **kw)
    assert d.implementation == impl and not d.interpret, d
    assert [o.how for o in d.operands] == [how], d.operands


def test_document_causal_visits_the_blocks_segment_ids_visit():
  """8 equal documents in one row: the mask_mod's block classes (from the arrays, once per
  batch) give the kernels the same block lists as segment_ids with causal: about 1/8 of
  causal's blocks."""
  S, bq = 1024, 64
  docs = jnp.asarray(np.repeat(np.arange(8), S // 8)[None].astype(np.int32))
  fn, consts, uses = _mask_mod.check(flashvjp.document_causal(docs), (1, 1, S, S))
  mod_cls = _mask_mod.classify(fn, consts, uses, 1, 1, S, S, bq, bq)
  spec = _mask.MaskSpec(True, None, S, S)
  nb = S // bq
  seg_cls = _mask.block_classes(spec, docs, docs, None, bq, bq, nb, nb)
  mod_lists = _mask.block_classes(_mask.MaskSpec(False, None, S, S), None, None, None, bq, bq,
                                  nb, nb, mod_classes=mod_cls)
  visited = lambda c: int((np.asarray(c) != _mask.EMPTY).sum())
  causal = visited(_mask.block_classes(spec, None, None, None, bq, bq, nb, nb))
  assert visited(mod_lists) == visited(seg_cls)
  np.testing.assert_array_equal(np.asarray(mod_lists) != _mask.EMPTY,
                                np.broadcast_to(np.asarray(seg_cls) != _mask.EMPTY,
                                                np.shape(mod_lists)))
  assert visited(seg_cls) <= causal / 8 + nb, (visited(seg_cls), causal)


def test_refusal_names_only_what_the_family_cannot_read():
  """A mod with a kv bias and a relative-position table (both compiled) and a pair table read
  at both positions at once (refused): the refusal names the pair table ("otherwise"), not
  the others."""
  q = jax.ShapeDtypeStruct((B, H, 256, 64), jnp.bfloat16)
  bv, table, pairs = jnp.ones((B, 256)), jnp.ones((H, 9)), jnp.ones((256, 256))
  sm = lambda s, b, h, i, j: s + bv[b, j] + table[h, jnp.clip(j - i, -4, 4) + 4]
  sm2 = lambda s, b, h, i, j: sm(s, b, h, i, j) + pairs[i, j]
  for impl in FAMILIES:
    assert flashvjp.explain(q, q, q, score_mod=sm, implementation=impl,
                            interpret=False).implementation == impl
    with pytest.raises(ValueError, match="otherwise") as e:
      flashvjp.explain(q, q, q, score_mod=sm2, implementation=impl, interpret=False)
    assert "score_mod[2]" in str(e.value), str(e.value)  # the pair table, not the others
    assert "score_mod[0]" not in str(e.value) and "score_mod[1]" not in str(e.value)


# ---- the kv_idx - q_idx class (relative positions) in both families -----------------------

REL_MODS = {
    # the built-in (the README's headline score_mod)
    "relative_position_bias": lambda tb: flashvjp.relative_position_bias(tb[0], 4),
    # T5's bucketed table, user-written
    "t5": lambda tb: (lambda s, b, h, i, j: s + tb[1][h, _util.t5_bucket(j - i)]),
    # q_idx - kv_idx per batch, times a per-query temperature: a rel and a q residual
    "per_batch_times_q": lambda tb: (
        lambda s, b, h, i, j: s * tb[3][i] + tb[2][b, jnp.clip(i - j, 0, 11)]),
}
REL_USES = {"relative_position_bias": (0,), "t5": (1,), "per_batch_times_q": (2, 3)}


def _rel_tables(dtype=jnp.float32):
  rng = np.random.default_rng(3)
  return tuple(jnp.asarray(a, jnp.float64).astype(dtype) for a in (
      rng.standard_normal((H, 9)), rng.standard_normal((H, 8)), rng.standard_normal((B, 12)),
      1.0 + 0.3 * rng.standard_normal((SQ,))))


@pytest.mark.parametrize("impl", FAMILIES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("name", sorted(REL_MODS))
def test_rel_grads_to_q_k_v_bias_and_tables(name, causal, impl):
  """Forward, gradients to q, k, v, a bias and the tables (the drel kernel over block
  diagonals and the strip reduction), against float64 autodiff of naive attention."""
  q, k, v, bias, _ = _inputs("kv_bias")
  tables = _rel_tables()
  w = jax.random.normal(jax.random.key(3), (B, H, SQ, D), jnp.float64)

  def loss(impl, q, k, v, bias, tables):
    extra = {} if impl == "naive" else BLOCKS
    out = flashvjp.flash_attention(q, k, v, bias=bias, causal=causal,
                                   score_mod=REL_MODS[name](tables), implementation=impl,
                                   **extra)
    return jnp.sum(out.astype(jnp.float64) * w), out

  args = (q, k, v, bias, tables)
  (_, got_out), got = jax.value_and_grad(
      lambda *a: loss(impl, *a), (0, 1, 2, 3, 4), has_aux=True)(*args)
  (_, ref_out), ref = jax.value_and_grad(
      lambda *a: loss("naive", *a), (0, 1, 2, 3, 4), has_aux=True)(*_util.as64(args))
  _util.assert_close(got_out, ref_out, jnp.float32, f"{name} out", impl=impl)
  for what, g, r in zip(("dq", "dk", "dv", "dbias", "dtables"), got, ref):
    _util.assert_close(g, r, jnp.float32, f"{name} {what}", impl=impl)
  for n in REL_USES[name]:  # the tables the mod reads get gradients
    assert float(jnp.abs(got[4][n]).max()) > 0, n


@pytest.mark.parametrize("impl", FAMILIES)
@pytest.mark.parametrize("name", sorted(REL_MODS))
def test_rel_tangent_with_table_tangents(name, impl):
  q, k, v, _, _ = _inputs("kv_bias")
  tables = _rel_tables()
  primals = (q, k, v, tables)
  keys = jax.random.split(jax.random.key(6), 4)
  tangents = jax.tree_util.tree_map(
      lambda x, kk: jax.random.normal(kk, x.shape, jnp.float32), primals,
      (keys[0], keys[1], keys[2], (keys[3],) * len(tables)))

  def run(impl, primals, tangents):
    extra = {} if impl == "naive" else BLOCKS
    f = lambda q, k, v, tb: flashvjp.flash_attention(
        q, k, v, causal=True, score_mod=REL_MODS[name](tb), implementation=impl,
        return_lse=True, **extra)
    return jax.jvp(f, primals, tangents)

  got = run(impl, primals, tangents)
  ref = run("naive", _util.as64(primals), _util.as64(tangents))
  _util.assert_close(got, ref, jnp.float32, f"{name} jvp", impl=impl)


def test_rel_is_hoisted_only_for_a_family_that_reads_it():
  from flashvjp.pallas import _common
  tb = _rel_tables()
  fn, consts, _ = _score_mod.convert(REL_MODS["per_batch_times_q"](tb), jnp.float32)
  assert _positions.hoist(fn, consts, jnp.float32).rel_avals == ()  # q only (no rel reader)
  h = _positions.hoist(fn, consts, jnp.float32, rel=True)
  assert (len(h.q_avals), len(h.kv_avals), len(h.rel_avals)) == (1, 0, 1) and h.problem is None
  # ALiBi's slope * (kv - q) is elementwise: it stays in the tile
  fn, consts, _ = _score_mod.convert(flashvjp.alibi(jnp.ones(H)), jnp.float32)
  assert _positions.hoist(fn, consts, jnp.float32, rel=True) is None
  # the row: element e is the difference e - (Sqp - 1), clamped, plus kv0 - q0 (a ring chunk)
  fn, consts, _ = _score_mod.convert(REL_MODS["relative_position_bias"](tb), jnp.float32)
  h = _positions.hoist(fn, consts, jnp.float32, rel=True)
  bs, hs = _common.global_batch_heads(B, H)
  sq, skv, Sqp, Skvp, q0, kv0 = 5, 7, 8, 16, 10, 13
  _, _, (row,) = _common._position_arrays(h, consts, bs, hs, (sq, skv, Sqp, Skvp),
                                          (0, 0, q0, kv0))
  d = np.clip(np.arange(Sqp + Skvp) - (Sqp - 1), 1 - sq, skv - 1) + kv0 - q0
  want = np.asarray(tb[0])[:, np.clip(d, -4, 4) + 4]
  np.testing.assert_allclose(np.asarray(row), np.broadcast_to(want, (B, H, Sqp + Skvp)))


def test_rel_strips_are_the_diagonal_sums():
  """`rel_strips`: tile t of the block diagonals adds its diagonal sums at t * n + c."""
  from flashvjp.pallas import _common
  n, nq, nk = 4, 2, 3
  tiles = np.random.default_rng(0).standard_normal((1, 1, nq + nk - 1, n, n))
  want = np.zeros((nq + nk) * n)
  for t in range(nq + nk - 1):
    for i in range(n):
      for j in range(n):
        want[t * n + j - i + n - 1] += tiles[0, 0, t, i, j]
  np.testing.assert_allclose(np.asarray(_common.rel_strips(jnp.asarray(tiles)))[0, 0], want)


@pytest.mark.parametrize("impl", FAMILIES)
def test_families_compile_rel_and_explain_names_the_class(impl):
  q = jax.ShapeDtypeStruct((B, H, 256, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((B, HKV, 256, 64), jnp.bfloat16)
  for name in sorted(REL_MODS):
    tb = (jnp.ones((H, 9)), jnp.ones((H, 8)), jnp.ones((B, 12)), jnp.ones((256,)))
    d = flashvjp.explain(q, k, k, implementation=impl, interpret=False,
                         score_mod=REL_MODS[name](tb))
    assert d.implementation == impl and not d.interpret, d
    assert "by kv_idx - q_idx" in {o.how for o in d.operands}, d.operands


@pytest.mark.parametrize("impl", FAMILIES)
def test_rel_mask_mod_grads_and_tangent(impl):
  """A mask_mod reading a table by kv_idx - q_idx (a banded pattern with holes): its row
  travels like a score_mod's, for the forward, every backward kernel and the tangent."""
  keep = jnp.asarray(np.random.default_rng(2).random(33) < 0.7).at[16].set(True)
  mm = lambda b, h, i, j: keep[jnp.clip(j - i, -16, 16) + 16]
  _check_mask_mod_grad_and_jvp(impl, mm, SKV, seed=4, bias_key=8, what="rel mask_mod")
  qs = jax.ShapeDtypeStruct((B, H, 256, 64), jnp.bfloat16)
  d = flashvjp.explain(qs, qs, qs, mask_mod=mm, implementation=impl, interpret=False)
  assert [o.how for o in d.operands] == ["by kv_idx - q_idx"], d.operands


@pytest.mark.parametrize("impl", FAMILIES)
def test_rel_with_segments_dense_mask_and_documents(impl):
  """A relative-position table with segment ids and a dense mask, and with document_causal:
  the drel kernels then walk only each block diagonal's non-empty tiles (Triton: diagonal
  lists; Mosaic-TPU: the class table), masked where PARTIAL."""
  q, k, v = _util.random_qkv(12, B, H, HKV, SQ, SQ, D)
  tb = _rel_tables()
  seg = jnp.sort(_docs(3), axis=1)
  dense = jnp.asarray(np.random.default_rng(4).random((B, 1, SQ, SQ)) > 0.2)
  w = jax.random.normal(jax.random.key(2), (B, H, SQ, D), jnp.float64)
  cases = (dict(segment_ids=seg, mask=dense), dict(mask_mod=flashvjp.document_causal(seg)))
  for kw in cases:
    def loss(impl, q, k, v, table, kw=kw):
      extra = {} if impl == "naive" else BLOCKS
      out = flashvjp.flash_attention(q, k, v, score_mod=flashvjp.relative_position_bias(table, 4),
                                     implementation=impl, **kw, **extra)
      return jnp.sum(out.astype(jnp.float64) * w), out

    (_, got_out), got = jax.value_and_grad(lambda *a: loss(impl, *a), (0, 1, 2, 3),
                                           has_aux=True)(q, k, v, tb[0])
    (_, ref_out), ref = jax.value_and_grad(lambda *a: loss("naive", *a), (0, 1, 2, 3),
                                           has_aux=True)(*_util.as64((q, k, v, tb[0])))
    _util.assert_close((got_out, got), (ref_out, ref), jnp.float32, f"rel {sorted(kw)}",
                       impl=impl)
    assert float(jnp.abs(got[3]).max()) > 0
