"""The oracle itself, checked against a plain numpy float64 loop written from API.md's text."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashvjp
from tests import _util


def numpy_attention(q, k, v, *, causal=False, window=None, q_seg=None, kv_seg=None, mask=None,
                    bias=None, scale=None, keep=None, rate=0.0):
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, H, Sq, D = q.shape
  Hkv, Skv = k.shape[1], k.shape[2]
  scale = 1 / np.sqrt(D) if scale is None else scale
  out = np.zeros((B, H, Sq, v.shape[3]))
  lse = np.full((B, H, Sq), -np.inf)
  for b in range(B):
    for h in range(H):
      kh = h // (H // Hkv)
      for i in range(Sq):
        s, ok = [], []
        for j in range(Skv):
          x = scale * q[b, h, i] @ k[b, kh, j]
          if bias is not None:
            x += np.broadcast_to(bias, (B, H, Sq, Skv))[b, h, i, j]
          allowed = True
          if causal and j > i:
            allowed = False
          if window is not None:
            if window[0] is not None and j < i - window[0]:
              allowed = False
            if window[1] is not None and j > i + window[1]:
              allowed = False
          if q_seg is not None and q_seg[b, i] != kv_seg[b, j]:
            allowed = False
          if mask is not None and not np.broadcast_to(mask, (B, H, Sq, Skv))[b, h, i, j]:
            allowed = False
          s.append(x)
          ok.append(allowed)
        s, ok = np.array(s), np.array(ok)
        if not ok.any():
          continue
        m = s[ok].max()
        e = np.where(ok, np.exp(s - m), 0.0)
        p = e / e.sum()
        lse[b, h, i] = m + np.log(e.sum())
        if keep is not None:
          p = np.where(keep[b, h, i], p / (1 - rate), 0.0)
        out[b, h, i] = p @ v[b, kh]
  return out, lse


@pytest.mark.parametrize("kw", [
    dict(), dict(causal=True), dict(window=(2, 1)), dict(causal=True, window=(3, None)),
    dict(window=(None, 0)), dict(segments=True), dict(mask=True), dict(bias=True),
])
def test_naive_matches_numpy_loops(kw):
  q, k, v = _util.random_qkv(0, 2, 4, 2, 7, 9, 3, 2, jnp.float64)
  rng = np.random.default_rng(0)
  args = {}
  np_args = {}
  if kw.get("causal"):
    args["causal"] = np_args["causal"] = True
  if "window" in kw:
    args["window"] = np_args["window"] = kw["window"]
  if kw.get("segments"):
    qs = np.array([[0, 0, 1, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 3]], np.int32)
    ks = np.array([[0, 1, 1, 2, 2, 2, 2, 2, 2], [1, 1, 1, 1, 0, 0, 0, 2, 2]], np.int32)
    args["segment_ids"] = (jnp.asarray(qs), jnp.asarray(ks))
    np_args.update(q_seg=qs, kv_seg=ks)
  if kw.get("mask"):
    m = rng.random((2, 1, 7, 9)) > 0.4
    m[0, 0, 4] = False
    args["mask"] = jnp.asarray(m)
    np_args["mask"] = m
  if kw.get("bias"):
    bias = rng.normal(size=(1, 4, 1, 9))
    args["bias"] = jnp.asarray(bias)
    np_args["bias"] = bias
  out, lse = flashvjp.flash_attention(q, k, v, implementation="naive", return_lse=True, **args)
  ref_out, ref_lse = numpy_attention(q, k, v, **np_args)
  np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-12, atol=1e-12)


def test_naive_dropout_uses_dropout_mask():
  q, k, v = _util.random_qkv(1, 1, 2, 2, 6, 8, 3, dtype=jnp.float64)
  key = jax.random.key(3)
  out = flashvjp.flash_attention(q, k, v, dropout_rate=0.4, dropout_rng=key, deterministic=False,
                                 implementation="naive")
  keep = np.asarray(flashvjp.dropout_mask(key, (1, 2, 6, 8), 0.4))
  ref, _ = numpy_attention(q, k, v, keep=keep, rate=0.4)
  np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-12, atol=1e-12)
