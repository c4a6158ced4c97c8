"""Decoding against a partly filled KV cache: bottom-right causal per sequence.

`dot_product_attention(q, k, v, is_causal="bottom_right", key_value_seq_lengths=kv_len,
query_seq_lengths=q_len)` aligns each sequence's diagonal to its own lengths, as
FlashAttention's ``cache_seqlens`` and every decoding loop: ``kv_pos <= q_pos + kv_len[b] -
q_len[b]`` (kv_len defaults to S, q_len to T), not to the buffer's end (``q_pos + S - T``).

The reference is float64 naive attention given only the mask written out densely in numpy
(`_dense`); the function under test gets only the lengths (its `mask` keyword is dropped, so
that the dense mask cannot repair a wrong alignment). `flashvjp.testing.check` compares out,
lse and every gradient. The old buffer alignment is a superset of the new one here, so each
case also asserts that the two meanings give different answers: the check can fail.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flashvjp
from flashvjp import _check
from flashvjp import testing
from tests import _util

B, N, K, H = 3, 4, 2, 16  # GQA: 4 query heads read 2 kv heads


def _dense(T, S, kv_len, q_len=None, buffer=False):
  """bool [B, 1, T, S]: kv < kv_len[b], q < q_len[b] and the bottom-right diagonal, at each
  sequence's lengths (or, buffer=True, the old meaning: at the buffer's end S - T)."""
  kv_len = np.asarray(kv_len)
  q_len = np.full(len(kv_len), T) if q_len is None else np.asarray(q_len)
  off = np.full(len(kv_len), S - T) if buffer else kv_len - q_len
  i, j = np.arange(T)[None, :, None], np.arange(S)[None, None, :]
  m = ((j <= i + off[:, None, None]) & (j < kv_len[:, None, None])
       & (i < q_len[:, None, None]))
  return jnp.asarray(m[:, None])


def _t(x):
  return jnp.swapaxes(x, 1, 2)


def _fn(impl, kv_len, q_len=None, mask_mod=None):
  """flash_attention's signature (BHSD) around the drop-in (BSHD) with the lengths; the
  check's dense `mask` (the reference's) is not passed on."""
  def fn(q, k, v, mask=None, return_lse=False):
    del mask
    kw = {} if mask_mod is None else dict(mask_mod=mask_mod)
    res = flashvjp.dot_product_attention(
        _t(q), _t(k), _t(v), is_causal="bottom_right", key_value_seq_lengths=kv_len,
        query_seq_lengths=q_len, implementation=impl, return_residual=return_lse, **kw)
    if return_lse:
      return _t(res[0]), _t(res[1])
    return _t(res)
  return fn


def _naive(q, k, v, m):
  out, lse = flashvjp.flash_attention(*_util.as64((q, k, v)), mask=m, return_lse=True,
                                      implementation="naive")
  return np.asarray(out), np.asarray(lse)


# (S, kv lengths, T, q lengths): a decode step (T = 1) and a chunk of 4 (chunked prefill,
# speculative decoding), with and without query lengths (a q length 0 and a kv length
# shorter than the chunk included)
DECODE = (64, (30, 64, 7), 1, None)
CHUNK = (64, (30, 64, 7), 4, None)
CHUNK_Q = (64, (30, 64, 2), 4, (2, 4, 0))
DECODE_Q = (64, (30, 64, 7), 1, (1, 0, 1))
# three 64-key blocks (Pallas interpret mode's), so whole blocks are empty, partial or full
WIDE = (192, (30, 192, 77), 4, None)
WIDE_Q = (192, (30, 192, 77), 4, (1, 4, 3))
CASES = {"decode": DECODE, "chunk": CHUNK, "chunk_q": CHUNK_Q, "decode_q": DECODE_Q,
         "wide": WIDE, "wide_q": WIDE_Q}


def _run_check(impl, case, seed=0):
  S, kv_len, T, q_len = CASES[case]
  q, k, v = _util.random_qkv(seed, B, N, K, T, S, H, H, jnp.float32)
  kv = jnp.asarray(kv_len, jnp.int32)
  ql = None if q_len is None else jnp.asarray(q_len, jnp.int32)
  m = _dense(T, S, kv_len, q_len)
  rep = testing.check(_fn(impl, kv, ql), query=q, key=k, value=v, mask=m, return_lse=True,
                      tolerance=_check.tolerance(jnp.float32, impl))
  assert rep.passed, str(rep)
  # the old meaning (the diagonal at the buffer's end) answers differently for a chunk: the
  # check can fail. One query (a decode step) sees every filled key either way.
  new, old = _naive(q, k, v, m)[0], _naive(q, k, v, _dense(T, S, kv_len, q_len, buffer=True))[0]
  if T > 1:
    assert np.abs(new - old).max() > 1e-2, (case, np.abs(new - old).max())
  else:
    np.testing.assert_array_equal(new, old)
  return q, k, v, kv, ql


@pytest.mark.parametrize("case", ["decode", "chunk", "chunk_q", "decode_q", "wide", "wide_q"])
@pytest.mark.parametrize("impl", ["naive", "blockwise"])
def test_against_the_dense_mask(impl, case):
  _run_check(impl, case)


@pytest.mark.parametrize("case", ["chunk", "wide_q", "decode_q"])
@pytest.mark.parametrize("impl", ["pallas_triton", "pallas_tpu"])
def test_kernels_in_interpret_mode(impl, case):
  _run_check(impl, case)


def test_padded_rows_give_zero_and_finite_gradients():
  q, k, v, kv, ql = _run_check("blockwise", "chunk_q")
  S, kv_len, T, q_len = CHUNK_Q

  def loss(q, k, v):
    out, lse = flashvjp.dot_product_attention(
        _t(q), _t(k), _t(v), is_causal="bottom_right", key_value_seq_lengths=kv,
        query_seq_lengths=ql, return_residual=True)
    return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)

  (_, (out, lse)), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
  out, lse, dq = np.asarray(out), np.asarray(lse), np.asarray(grads[0])
  for g in grads:
    assert np.isfinite(np.asarray(g)).all()
  for b in range(B):
    padded = np.arange(T) >= q_len[b]
    # rows of no key: padded queries, and the first q_len - kv_len rows when kv_len < q_len
    empty = padded | (np.arange(T) + kv_len[b] - q_len[b] < 0)
    assert not out[b, padded].any() and np.isneginf(lse[b, empty]).all()
    assert not dq[b, :, padded].any()
    assert np.isfinite(lse[b, ~empty]).all()


def test_the_issue_case_old_error_and_new():
  """The issue's numbers at a 512-key buffer with lengths [300, 512, 77] and 4 new queries:
  the buffer alignment was off by about 0.1; aligned per sequence, float32 rounding."""
  S, T, kv_len = 512, 4, (300, 512, 77)
  q, k, v = _util.random_qkv(5, B, N, K, T, S, 64, 64, jnp.float32)
  kv = jnp.asarray(kv_len, jnp.int32)
  got = np.asarray(_fn("blockwise", kv)(q, k, v))
  new, _ = _naive(q, k, v, _dense(T, S, kv_len))
  old, _ = _naive(q, k, v, _dense(T, S, kv_len, buffer=True))
  assert np.abs(old - new).max() > 5e-2
  assert np.abs(got - new).max() < 1e-5


def test_under_jit_with_traced_lengths_and_a_user_mask_mod():
  """A decoding loop's lengths are traced: one compile serves every step; a user mask_mod
  (here keys evicted before start[b]) is ANDed."""
  S, T = 64, 4
  q, k, v = _util.random_qkv(6, B, N, K, T, S, H, H, jnp.float32)
  start = jnp.asarray([3, 0, 10], jnp.int32)
  evict = lambda b, h, q_idx, kv_idx: kv_idx >= start[b]

  @jax.jit
  def step(q, k, v, kv):
    return _fn("blockwise", kv, mask_mod=evict)(q, k, v)

  for kv_len in ((30, 64, 12), (31, 60, 13)):
    m = _dense(T, S, kv_len) & (np.arange(S) >= np.asarray(start)[:, None, None, None])
    got = step(q, k, v, jnp.asarray(kv_len, jnp.int32))
    np.testing.assert_allclose(np.asarray(got), _naive(q, k, v, m)[0], atol=2e-6, rtol=2e-6)
  assert step._cache_size() == 1


def test_top_left_and_no_lengths_keep_their_meaning():
  S, T, kv_len = 64, 4, (30, 64, 7)
  q, k, v = _util.random_qkv(7, B, N, K, T, S, H, H, jnp.float32)
  kv = jnp.asarray(kv_len, jnp.int32)
  i, j = np.arange(T)[:, None], np.arange(S)[None, :]
  pad = np.arange(S)[None, None, None, :] < np.asarray(kv_len)[:, None, None, None]
  # is_causal=True (jax.nn's) stays top-left with lengths
  got = flashvjp.dot_product_attention(_t(q), _t(k), _t(v), is_causal=True,
                                       key_value_seq_lengths=kv)
  want = _naive(q, k, v, jnp.asarray(pad & (j <= i)))[0]
  np.testing.assert_allclose(np.asarray(_t(got)), want, atol=2e-6, rtol=2e-6)
  # no lengths: the buffer's end (S - T), as before
  got = flashvjp.dot_product_attention(_t(q), _t(k), _t(v), is_causal="bottom_right")
  want = _naive(q, k, v, jnp.asarray(j <= i + S - T))[0]
  np.testing.assert_allclose(np.asarray(_t(got)), want, atol=2e-6, rtol=2e-6)


def test_explain_with_the_drop_in_keywords():
  S, T = 64, 4
  bshd = lambda n, heads: jax.ShapeDtypeStruct((B, n, heads, H), jnp.float32)
  q, kv = bshd(T, N), bshd(S, K)  # T != S and GQA: read as BSHD, not as [B, H, S, D]
  lens = np.array([30, 64, 7], np.int32)
  d = flashvjp.explain(q, kv, kv, is_causal="bottom_right", key_value_seq_lengths=lens)
  assert "BSHD: batch 3, heads 4, seq 4" in str(d)
  assert "kv_pos <= q_pos + kv_len[b] - q_len[b]" in str(d) and "kept too" in str(d), str(d)
  assert [(o.mod, o.index, o.how) for o in d.operands] == [("mask_mod", 0, "per (b, h)")]
  d = flashvjp.explain(q, kv, kv, is_causal="bottom_right", key_value_seq_lengths=lens,
                       query_seq_lengths=np.array([1, 4, 2], np.int32))
  assert "no static bound" in str(d), str(d)
  d = flashvjp.explain(q, kv, kv, is_causal=True, key_value_seq_lengths=lens)
  assert "kv_len[b]" not in str(d) and d.operands == ()


def test_plain_jit_sequence_sharded():
  """q, k, v sharded along the sequence over the 8 virtual devices: the partitioned program
  (a context-parallel strategy) reads the offsets per batch as one device does."""
  mesh = Mesh(np.array(jax.devices()[:8]), ("sp",))
  S, T, kv_len = 64, 8, (30, 64, 12)
  q, k, v = _util.random_qkv(8, B, N, K, T, S, H, H, jnp.float32)
  xs = [jax.device_put(x, NamedSharding(mesh, P(None, None, "sp", None))) for x in (q, k, v)]
  kv = jnp.asarray(kv_len, jnp.int32)
  d = flashvjp.explain(*(jax.device_put(_t(x), NamedSharding(mesh, P(None, "sp", None, None)))
                         for x in (q, k, v)), is_causal="bottom_right", key_value_seq_lengths=kv)
  assert d.context_parallel is not None, str(d)
  with flashvjp.record_decisions() as events:
    rep = testing.check(_fn(None, kv), query=xs[0], key=xs[1], value=xs[2],
                        mask=_dense(T, S, kv_len), return_lse=True)
  assert rep.passed, str(rep)
  assert any(e.stage == "partition" and e.detail is not None for e in events), events


def test_a_user_mask_mods_ring_hint_is_kept():
  """The AND is inside the user's mask, so its kv_intervals hint (the ring skips chunk pairs
  outside it) still holds; the per-sequence bound adds none (the offsets may be traced)."""
  from flashvjp import _api
  user = flashvjp.chunked(16)
  causal, mod = _api._per_sequence_causal(None, jnp.asarray([30, 64, 7]), B, 4, 64, user)
  assert causal == "bottom_right" and mod.kv_intervals is user.kv_intervals
  causal, mod = _api._per_sequence_causal(jnp.asarray([1, 4, 2]), None, B, 4, 64)
  assert causal is False and not hasattr(mod, "kv_intervals")
