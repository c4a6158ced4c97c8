"""The shared test base: every implementation against autodiff of naive attention in float64.

Subclass `AttentionTests` per implementation (tests/test_blockwise.py,
tests/test_pallas.py) and set IMPLEMENTATION / EXTRA_KWARGS. Each feature and
combination is one case, checked by the public `flashvjp.testing.check` (the one
comparison, also behind `python -m flashvjp check`): forward, lse and gradients of
(q, k, v, bias, score_mod arrays, sinks) against float64 naive attention, with the
tolerance of `flashvjp._check.tolerance` for the input dtype.
"""
from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest

import flashvjp
from flashvjp import _check
from tests import _util

# Shapes that exercise padding (seq not a multiple of the blocks), several blocks,
# GQA (4 query heads on 2 kv heads) and head_dim_v != head_dim.
B, H, HKV, SQ, SKV, D, DV = 2, 4, 2, 37, 45, 16, 8
BLOCK_Q, BLOCK_KV = 16, 16


def _segments(seq, cuts, batch=B):
  ids = np.zeros((batch, seq), np.int32)
  for b in range(batch):
    for c in cuts[b % len(cuts)]:
      ids[b, c:] += 1
  return jnp.asarray(ids)


def _empty_row_mask():
  m = np.random.default_rng(0).random((B, 1, SQ, SKV)) > 0.5
  m[:, :, 3] = False  # row 3 attends nothing
  m[1, :, 10:14] = False
  return jnp.asarray(m)


def _per_head_mod(b, h, q_idx, kv_idx):
  """A mask_mod reading b and h: head-dependent windows, batch 1 skips even keys."""
  near = jnp.abs(q_idx - kv_idx) <= 4 + 6 * h
  return near & ((b == 0) | (kv_idx % 2 == 1))


# name -> (shape overrides, kwargs factory taking dtype). Arrays returned under the
# key "diff" are differentiated too (bias, score_mod tables).
def _cases():
  rel_table = lambda dt: 0.1 * jax.random.normal(jax.random.key(7), (H, 2 * 6 + 1), jnp.float64).astype(dt)
  slopes = lambda dt: flashvjp.alibi_slopes(H).astype(dt)
  c = {
      "plain": ({}, lambda dt: {}),
      "causal": ({}, lambda dt: dict(causal=True)),
      "causal_square": (dict(Skv=SQ), lambda dt: dict(causal=True)),
      "window": ({}, lambda dt: dict(window=(5, 3))),
      "window_left_only": ({}, lambda dt: dict(window=(4, None))),
      "causal_window": ({}, lambda dt: dict(causal=True, window=(6, None))),
      "segments": (dict(Skv=SQ), lambda dt: dict(segment_ids=_segments(SQ, [[5, 20], [12]]))),
      "segment_pair": ({}, lambda dt: dict(segment_ids=(_segments(SQ, [[10, 30]]), _segments(SKV, [[8, 40]])))),
      "mask_dense": ({}, lambda dt: dict(mask=_empty_row_mask())),
      "mask_2d": ({}, lambda dt: dict(mask=jnp.asarray(np.random.default_rng(1).random((SQ, SKV)) > 0.3))),
      "mask_per_head_kv": ({}, lambda dt: dict(mask=jnp.asarray(np.random.default_rng(2).random((1, H, 1, SKV)) > 0.3))),
      "bias_full": ({}, lambda dt: dict(diff=dict(bias=jax.random.normal(jax.random.key(3), (B, H, SQ, SKV), jnp.float64).astype(dt)))),
      "bias_head_kv": ({}, lambda dt: dict(diff=dict(bias=jax.random.normal(jax.random.key(4), (1, H, 1, SKV), jnp.float64).astype(dt)))),
      "bias_2d": ({}, lambda dt: dict(diff=dict(bias=jax.random.normal(jax.random.key(5), (SQ, SKV), jnp.float64).astype(dt)))),
      "softcap": ({}, lambda dt: dict(score_mod=flashvjp.softcap(2.0))),
      "alibi": ({}, lambda dt: dict(causal=True, diff=dict(score_mod=(flashvjp.alibi, slopes(dt))))),
      "relative_bias": ({}, lambda dt: dict(diff=dict(score_mod=(functools.partial(flashvjp.relative_position_bias, max_distance=6), rel_table(dt))))),
      "mqa": (dict(Hkv=1), lambda dt: dict(causal=True)),
      "mha_same_dv": (dict(Hkv=H, Dv=D), lambda dt: {}),
      "dropout": ({}, lambda dt: dict(dropout_rate=0.3, dropout_rng=jax.random.key(11), deterministic=False)),
      "scale": ({}, lambda dt: dict(scale=0.37, causal=True)),
      # mask_mod (closures over arrays: per-batch prefix lengths, document ids), ANDed with
      # the other masks; a precomputed BlockMask at other blocks than the kernels' (resampled).
      "mask_mod_prefix_lm": ({}, lambda dt: dict(mask_mod=flashvjp.prefix_lm(jnp.asarray([5, 30], jnp.int32)))),
      "mask_mod_document": (dict(Skv=SQ), lambda dt: dict(mask_mod=flashvjp.document_causal(_segments(SQ, [[5, 20], [12]])))),
      "mask_mod_chunked_window": ({}, lambda dt: dict(mask_mod=flashvjp.chunked(12, causal=False), window=(5, 3))),
      "mask_mod_global_and_mask": ({}, lambda dt: dict(mask_mod=flashvjp.sliding_window_with_global(6, 3), mask=_empty_row_mask())),
      "mask_mod_block_mask": ({}, lambda dt: dict(
          mask_mod=_per_head_mod, block_mask=flashvjp.make_block_mask(_per_head_mod, B, H, SQ, SKV, 8, 32))),
      # sinks (differentiable), also with empty rows.
      "sinks": ({}, lambda dt: dict(causal=True, diff=dict(sinks=jnp.asarray([0.5, -1.0, 2.0, 0.0], dt)))),
      "sinks_empty_rows": ({}, lambda dt: dict(mask=_empty_row_mask(), diff=dict(sinks=jnp.asarray([1.5, -0.5, 0.0, 3.0], dt)))),
      "combo": (dict(Skv=SQ), lambda dt: dict(
          causal=True, segment_ids=_segments(SQ, [[9], [20]]), mask=_empty_row_mask()[:, :, :, :SQ],
          dropout_rate=0.2, dropout_rng=jax.random.key(5), deterministic=False,
          diff=dict(bias=jax.random.normal(jax.random.key(6), (1, H, SQ, SQ), jnp.float64).astype(dt),
                    score_mod=(flashvjp.alibi, slopes(dt))))),
  }
  return c


CASES = _cases()


def case_problem(name, dtype, seed=0):
  """The inputs of a case: (q, k, v, dims, arrays, with_diff).

  `arrays` are the case's differentiable arrays by name (bias, sinks, score_mod's table or
  slopes); ``with_diff(d, **extra)`` gives the flash_attention kwargs of the case with the
  arrays of `d` (same names) in place, plus `extra`.
  """
  shape, make = CASES[name]
  dims = dict(B=B, H=H, Hkv=HKV, Sq=SQ, Skv=SKV, D=D, Dv=DV)
  dims.update(shape)
  q, k, v = _util.random_qkv(seed, dims["B"], dims["H"], dims["Hkv"], dims["Sq"], dims["Skv"],
                             dims["D"], dims["Dv"], dtype)
  kw = make(dtype)
  diff = kw.pop("diff", {})
  arrays = {n: (x[1] if isinstance(x, tuple) else x) for n, x in diff.items()}

  def with_diff(d, **extra):
    args = dict(kw, **extra)
    for n in ("bias", "sinks"):
      if n in d:
        args[n] = d[n]
    if "score_mod" in d:
      args["score_mod"] = diff["score_mod"][0](d["score_mod"])
    return args

  return q, k, v, dims, arrays, with_diff


def run_case(impl, name, dtype, *, return_lse=True, block_q=BLOCK_Q, block_kv=BLOCK_KV, extra=None,
             seed=0, precision=None):
  """(value, grads) of a weighted loss of (out, lse) for implementation `impl`, under
  jax.default_matmul_precision(`precision`) when given."""
  q, k, v, dims, d, with_diff = case_problem(name, dtype, seed)
  if impl == "naive":
    q, k, v, d = _util.as64((q, k, v, d))
  extra = dict(extra or {})
  if impl != "naive":
    extra.update(block_q=block_q, block_kv=block_kv)
  kr = jax.random.split(jax.random.key(seed + 100), 2)
  w_out = jax.random.normal(kr[0], (dims["B"], dims["H"], dims["Sq"], dims["Dv"]), jnp.float64)
  w_lse = jax.random.normal(kr[1], (dims["B"], dims["H"], dims["Sq"]), jnp.float64)

  def loss(q, k, v, d):
    res = flashvjp.flash_attention(q, k, v, implementation=impl, return_lse=return_lse,
                                   **with_diff(d, **extra))
    out, lse = res if return_lse else (res, None)
    total = jnp.sum(out.astype(jnp.float64) * w_out)
    if lse is not None:
      lse64 = lse.astype(jnp.float64)
      total = total + jnp.sum(jnp.where(jnp.isfinite(lse64), lse64, 0.0) * w_lse)
    return total, res

  ctx = jax.default_matmul_precision(precision) if precision else contextlib.nullcontext()
  with ctx:
    (val, res), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        q, k, v, d)
  return res, grads


# ---- extreme finite values in masked positions ---------------------------------------------

def garbage_kv(k, v, masked_kv):
  """k, v with every masked key position [B, Skv] overwritten by extreme finite values:
  finfo.max, -finfo.max, and NaN-free garbage of magnitude 1e30 (cycling over positions)."""
  big = np.finfo(np.float32).max
  pos = np.arange(k.shape[2])
  pattern = np.where(pos % 3 == 0, big, np.where(pos % 3 == 1, -big, 1e30))[None, None, :, None]
  noise = np.random.default_rng(5).standard_normal(k.shape[:3] + (1,))
  fill = np.where(pos[None, None, :, None] % 3 == 2, pattern * noise, pattern)
  sel = np.asarray(masked_kv)[:, None, :, None]
  fk = np.where(sel, np.broadcast_to(fill, k.shape[:3] + (1,)), np.asarray(k, np.float64))
  fv = np.where(sel, np.broadcast_to(fill, v.shape[:3] + (1,)), np.asarray(v, np.float64))
  return jnp.asarray(fk, k.dtype), jnp.asarray(fv, v.dtype)


GARBAGE_MASKS = ("key_lengths", "dense_mask", "segment_ids")


def run_garbage(impl, how, precision, extra=None, score_mod=None):
  """[(out, lse, dq, dk, dv) with clean K / V, the same with masked K / V garbage]: one jit,
  called twice. Masked by `how`: key_value_seq_lengths (flashvjp.dot_product_attention),
  a dense key mask, or segment ids whose padding segment is masked."""
  B_, H_, Hkv_, S_, D_ = 2, 2, 1, 40, 16
  q, k, v = _util.random_qkv(3, B_, H_, Hkv_, S_, S_, D_)
  lengths = np.array([26, 9], np.int32)
  masked_kv = np.arange(S_)[None, :] >= lengths[:, None]
  w = jax.random.normal(jax.random.key(4), (B_, H_, S_, D_), jnp.float64)
  kw = dict(implementation=impl, **(extra or {}))
  if impl != "naive":
    kw.update(block_q=16, block_kv=16)
  if score_mod is not None:
    kw["score_mod"] = score_mod

  def attend(q, k, v):
    if how == "key_lengths":
      out, lse = flashvjp.dot_product_attention(  # (default blocks: no block kwargs)
          *(jnp.swapaxes(x, 1, 2) for x in (q, k, v)), key_value_seq_lengths=lengths,
          return_residual=True, implementation=impl)
      return jnp.swapaxes(out, 1, 2), lse
    if how == "dense_mask":
      return flashvjp.flash_attention(q, k, v, mask=jnp.asarray(~masked_kv)[:, None, None, :],
                                      return_lse=True, **kw)
    seg_q = jnp.zeros((B_, S_), jnp.int32)
    seg_kv = jnp.asarray(masked_kv.astype(np.int32))  # padding = segment 1, never a query's
    return flashvjp.flash_attention(q, k, v, segment_ids=(seg_q, seg_kv), return_lse=True, **kw)

  def loss(q, k, v):
    out, lse = attend(q, k, v)
    return jnp.sum(out.astype(jnp.float64) * w) + jnp.sum(lse.astype(jnp.float64)), (out, lse)

  ctx = jax.default_matmul_precision(precision) if precision else contextlib.nullcontext()
  with ctx:
    f = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))
    res = []
    for kk, vv in ((k, v), garbage_kv(k, v, masked_kv)):
      (_, (out, lse)), g = f(q, kk, vv)
      res.append(tuple(np.asarray(x) for x in (out, lse) + tuple(g)))
  return res


def assert_garbage_changes_nothing(clean, dirty, what):
  """No NaN / inf anywhere, and every result bitwise the clean one: a masked entry
  contributes exactly nothing (out, lse, dq of every row; dk, dv are 0 at masked keys)."""
  for name, c, d in zip(("out", "lse", "dq", "dk", "dv"), clean, dirty):
    assert np.isfinite(d).all(), f"{what}: {np.count_nonzero(~np.isfinite(d))} non-finite in {name}"
    np.testing.assert_array_equal(d, c, err_msg=f"{what}: {name}")


class AttentionTests:
  """Shared checks; subclasses set IMPLEMENTATION and may set EXTRA_KWARGS / DTYPE_CASES."""

  IMPLEMENTATION = "blockwise"
  EXTRA_KWARGS: dict = {}
  # Cases run in low precision (each dtype on a few features keeps the suite fast).
  LOW_PRECISION_CASES = ("causal", "mask_dense", "bias_head_kv", "alibi")

  def check(self, name, dtype, *, return_lse=True, block_q=BLOCK_Q, block_kv=BLOCK_KV, seed=0):
    """The case through flashvjp.testing.check (out, lse, dq, dk, dv and the gradients of
    bias, sinks and the arrays the score_mod closes over, found by flashvjp.testing)."""
    q, k, v, _, arrays, with_diff = case_problem(name, dtype, seed)
    kwargs = with_diff(arrays, **self.EXTRA_KWARGS)
    report = flashvjp.testing.check(
        query=q, key=k, value=v, implementation=self.IMPLEMENTATION, block_q=block_q,
        block_kv=block_kv, return_lse=return_lse, seed=seed, **kwargs,
        tolerance=_util.tolerance(dtype, self.IMPLEMENTATION))
    assert report.passed, f"{self.IMPLEMENTATION}/{name}/{jnp.dtype(dtype).name}\n{report}"
    expected = ["dq", "dk", "dv"] + [f"d{n}" for n in ("bias", "sinks") if n in arrays]
    assert set(expected) <= set(report.names), report.names
    if "score_mod" in arrays:
      assert "d score_mod[0]" in report.names, report.names

  @pytest.mark.parametrize("name", sorted(CASES))
  def test_feature_float32(self, name):
    self.check(name, jnp.float32)

  @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
  @pytest.mark.parametrize("name", LOW_PRECISION_CASES)
  def test_feature_low_precision(self, name, dtype):
    self.check(name, dtype)

  def test_without_lse(self):
    self.check("causal", jnp.float32, return_lse=False)

  @pytest.mark.parametrize("blocks", [(1, 7), (64, 5), (13, 128)])
  def test_any_block_size(self, blocks):
    self.check("causal_window", jnp.float32, block_q=blocks[0], block_kv=blocks[1])

  # ---- precision and extreme values (docs/implementations.md "Precision") ----
  PRECISIONS = (None, "high", "highest")
  # A representative set of the cases for the IEEE float32 check at "highest" (combo: causal,
  # segment ids, a dense mask with empty rows, dropout, bias and ALiBi together). Every case
  # was measured (docs/implementations.md "Precision"): the largest error is 0.91 of the bound.
  HIGHEST_CASES = ("plain", "causal_window", "mask_dense", "softcap", "mqa", "combo")

  @pytest.mark.parametrize("precision", PRECISIONS)
  @pytest.mark.parametrize("how", GARBAGE_MASKS)
  def test_masked_extreme_values_change_nothing(self, how, precision):
    """Masked K / V rows holding finfo.max, -finfo.max or 1e30 garbage: no NaN / inf in
    out, lse, dq, dk, dv, and every value bitwise the clean inputs' (fails on 0 * inf)."""
    clean, dirty = run_garbage(self.IMPLEMENTATION, how, precision, self.EXTRA_KWARGS)
    assert_garbage_changes_nothing(clean, dirty, f"{self.IMPLEMENTATION}/{how}/{precision}")

  def test_masked_extreme_values_with_score_mod(self):
    """The same through a score_mod (softcap): a masked q k of +-inf never reaches its
    derivative (tanh'(inf) * 0)."""
    clean, dirty = run_garbage(self.IMPLEMENTATION, "segment_ids", "high", self.EXTRA_KWARGS,
                               score_mod=flashvjp.softcap(3.0))
    assert_garbage_changes_nothing(clean, dirty, f"{self.IMPLEMENTATION}/softcap")

  @pytest.mark.parametrize("name", HIGHEST_CASES)
  def test_highest_is_ieee_float32(self, name):
    """At "highest", out / lse / dq / dk / dv within HIGHEST_ATOL + HIGHEST_RTOL * |ref| of
    float64 naive attention, elementwise (what an IEEE float32 computation gives); the rest
    (bias / score_mod array gradients) at the scale-relative TOL[float32]."""
    got = run_case(self.IMPLEMENTATION, name, jnp.float32, extra=self.EXTRA_KWARGS,
                   precision="highest")
    ref = run_case("naive", name, jnp.float32)
    what = f"{self.IMPLEMENTATION}/{name}/highest"
    _util.assert_close(got, ref, jnp.float32, what=what, impl=self.IMPLEMENTATION)
    (out, lse), (dq, dk, dv, _) = got
    (r_out, r_lse), (r_dq, r_dk, r_dv, _) = ref
    for leaf, g, r in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv),
                          (r_out, r_lse, r_dq, r_dk, r_dv)):
      bad = _check.highest_violations(g, r)
      assert bad == 0, f"{what}: {bad} entries of {leaf} beyond 1e-6 + 1e-6 |ref|"

  def test_empty_rows_zero_output_and_gradients(self):
    q, k, v = _util.random_qkv(1, 1, 2, 1, 8, 8, 4)
    mask = jnp.ones((1, 1, 8, 8), bool).at[:, :, 2].set(False)

    def f(q, k, v):
      out, lse = flashvjp.flash_attention(q, k, v, mask=mask, return_lse=True,
                                          implementation=self.IMPLEMENTATION, block_q=4, block_kv=4,
                                          **self.EXTRA_KWARGS)
      return jnp.sum(out**2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)

    (_, (out, lse)), g = jax.value_and_grad(f, (0, 1, 2), has_aux=True)(q, k, v)
    np.testing.assert_array_equal(np.asarray(out[:, :, 2]), 0.0)
    assert np.all(np.asarray(lse[:, :, 2]) == -np.inf)
    assert np.isfinite(np.asarray(lse[:, :, [0, 1, 3]])).all()
    for x in g:
      assert np.isfinite(np.asarray(x)).all()
    np.testing.assert_array_equal(np.asarray(g[0][:, :, 2]), 0.0)

  def test_numerical_gradients_float64(self):
    """Finite differences on a tiny float64 problem (no oracle involved)."""
    q, k, v = _util.random_qkv(2, 1, 2, 1, 5, 6, 3, 2, jnp.float64)
    bias = 0.3 * jax.random.normal(jax.random.key(0), (1, 2, 5, 6), jnp.float64)
    mask = jnp.asarray(np.random.default_rng(3).random((5, 6)) > 0.2)
    f = lambda q, k, v, bias: flashvjp.flash_attention(
        q, k, v, bias=bias, mask=mask, causal=True, window=(3, None), implementation=self.IMPLEMENTATION,
        block_q=2, block_kv=4, **self.EXTRA_KWARGS)
    jax.test_util.check_grads(f, (q, k, v, bias), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)
