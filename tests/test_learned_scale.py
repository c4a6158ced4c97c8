"""A traced (learned) scale with 16-bit inputs and a bias: the bias folded through the scale.

flashvjp._api._fold_scale / _fold_bias: the kernels get bias' = (bias - row shift) / scale in
float32 and the scale as the score_mod's first step. These check the values that division
could break (a scale of 0, negative or tiny, -inf and masking entries of the bias, masked
rows), broadcast biases, forward mode and second order through it, sinks in the shifted
frame, and that explain says what runs. Accuracy against naive autodiff in the same dtype:
tests/test_testing.py.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashvjp
from flashvjp import testing
from tests import _util

B, H, HKV, SQ, SKV, D = 2, 2, 1, 12, 16, 8
F16 = jnp.float16
IMPLS = ["blockwise", "pallas_triton"]


def _qkv(seed=0, dtype=F16):
  rng = np.random.default_rng(seed)
  arr = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
  return arr(B, H, SQ, D), arr(B, HKV, SKV, D), arr(B, HKV, SKV, D)


def _masking_bias(dtype=F16):
  """N(0, 1) with -inf entries, a row of -inf (masked: out 0) and a row of finfo.min."""
  b = np.random.default_rng(7).standard_normal((B, H, SQ, SKV)).astype(np.float32)
  b[:, :, ::3, 5:9] = -np.inf
  b[:, :, 4, :] = -np.inf
  b[0, 0, 6, :] = float(jnp.finfo(dtype).min)
  return jnp.asarray(b, dtype)


def _blocks(impl):
  return {} if impl == "naive" else dict(block_q=8, block_kv=8)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scale", [0.3, -0.3, 0.0, 1e-5, 30.0])
def test_masking_bias_any_scale_finite_and_correct(impl, scale):
  """Every gradient finite (no 0 * inf, inf - inf, 0 / 0), a fully masked row gives out 0,
  lse -inf and zero dq / d bias rows; everything within float16's tolerance of float64
  naive. A scale below _FOLD_MIN_SCALE (0 included) pre-scales the query instead."""
  q, k, v = _qkv()
  bias, sc = _masking_bias(), jnp.float32(scale)

  def f(q, k, v, bias, sc):
    out, lse = flashvjp.flash_attention(q, k, v, bias=bias, scale=sc, implementation=impl,
                                        return_lse=True, **_blocks(impl))
    w = jnp.cos(jnp.arange(D, dtype=jnp.float32))[None, None, None]
    loss = jnp.sum(out.astype(jnp.float32) * w)
    return loss + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)

  (_, (out, lse)), g = jax.jit(jax.value_and_grad(f, (0, 1, 2, 3, 4), has_aux=True))(
      q, k, v, bias, sc)
  for x in g:
    assert np.isfinite(np.asarray(x, np.float64)).all()
  assert np.all(np.asarray(out)[:, :, 4] == 0) and np.all(np.isneginf(np.asarray(lse)[:, :, 4]))
  assert np.all(np.asarray(g[0])[:, :, 4] == 0) and np.all(np.asarray(g[3])[:, :, 4] == 0)
  r = testing.check(query=q, key=k, value=v, bias=bias, scale=sc, implementation=impl,
                    return_lse=True, **_blocks(impl))
  assert r.passed, str(r)


@pytest.mark.parametrize("shape", [(1, 1, SQ, SKV), (B, 1, 1, SKV), (1, H, SQ, 1)])
def test_broadcast_bias(shape):
  q, k, v = _qkv(1)
  bias = jnp.asarray(np.random.default_rng(2).standard_normal(shape), F16)
  kw = dict(query=q, key=k, value=v, bias=bias, scale=jnp.float32(0.4), causal=True,
            return_lse=True)
  r = testing.check(**kw, implementation="blockwise", block_q=8, block_kv=8)
  n = testing.check(**kw, implementation="naive")
  assert r.passed, str(r)
  assert r["dbias"].shape == shape
  assert r["dscale"].error <= 2 * max(n["dscale"].error, 1e-5), (r, n)


def test_float32_masking_values_stay_masking():
  """-1e30 over a scale of 0.3 (beyond _FOLD_HUGE: no gradient to the scale) and f32 values
  whose quotient would overflow (clamped, a masking value still) next to ordinary ones."""
  q, k, v = _qkv(3)
  b = np.random.default_rng(4).standard_normal((B, H, SQ, SKV)).astype(np.float32)
  b[:, :, 7, 3:] = -1e30
  b[:, :, 2, ::2] = np.finfo(np.float32).min
  r = testing.check(query=q, key=k, value=v, bias=jnp.asarray(b), scale=jnp.float32(0.3),
                    implementation="blockwise", return_lse=True, block_q=8, block_kv=8)
  assert r.passed, str(r)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_jvp_through_the_fold(impl, softcap):
  """Forward mode with tangents on q, the bias (with -inf entries), the scale and sinks:
  no inf ever meets a zero tangent (the Triton tangent kernel differentiates the tile part
  against its per-head values with dense zero tangents)."""
  q, k, v = _qkv(5)
  bias = _masking_bias()
  sinks = jnp.asarray([0.5, -1.0], F16)
  rng = np.random.default_rng(6)
  tq = jnp.asarray(rng.standard_normal(q.shape), F16)
  tb = jnp.asarray(rng.standard_normal(bias.shape), F16)
  mod = None if softcap is None else flashvjp.softcap(softcap)

  def run(impl, q, bias, sc, sinks, tangents):
    f = lambda q, b, s, sk: flashvjp.flash_attention(
        q, k.astype(q.dtype), v.astype(q.dtype), bias=b, scale=s, sinks=sk, causal=True,
        score_mod=mod, return_lse=True, implementation=impl, **_blocks(impl))
    return jax.jvp(f, (q, bias, sc, sinks), tangents)

  ts = (tq, tb, jnp.float32(1.0), jnp.asarray([1.0, 0.5], F16))
  got = jax.jit(lambda *a: run(impl, *a))(q, bias, jnp.float32(0.3), sinks, ts)
  ref = run("naive", *_util.as64((q, bias, jnp.float32(0.3), sinks, ts)))
  for x in jax.tree_util.tree_leaves(got):
    assert not np.isnan(np.asarray(x, np.float64)).any()
  _util.assert_close(got, ref, F16, what=f"jvp {impl}", impl=impl)


def test_hvp_through_the_fold():
  """Forward-over-reverse (the blockwise backward differentiated in forward mode) through
  the folded bias and scale."""
  q, k, v = _qkv(8)
  bias = jnp.asarray(np.random.default_rng(9).standard_normal((1, H, SQ, SKV)), F16)

  def grads(impl, q, bias, sc):
    def loss(q, bias, sc):
      out = flashvjp.flash_attention(q, k.astype(q.dtype), v.astype(q.dtype), bias=bias,
                                     scale=sc, implementation=impl, **_blocks(impl))
      return jnp.sum(out.astype(jnp.float32) ** 2)
    return jax.grad(loss, (0, 1, 2))(q, bias, sc)

  t = (jnp.ones_like(q), jnp.ones_like(bias), jnp.float32(1.0))
  got = jax.jvp(lambda *a: grads("blockwise", *a), (q, bias, jnp.float32(0.3)), t)
  ref = jax.jvp(lambda *a: grads("naive", *a), *_util.as64(((q, bias, jnp.float32(0.3)), t)))
  _util.assert_close(got, ref, F16, what="hvp")


def test_sinks_in_the_shifted_frame():
  """Without a score_mod each folded bias row is shifted by its max (lse gets it back):
  sinks, applied inside the op, are shifted with it."""
  q, k, v = _qkv(10)
  bias = _masking_bias() + jnp.asarray(5.0, F16)
  r = testing.check(query=q, key=k, value=v, bias=bias, scale=jnp.float32(0.3),
                    sinks=jnp.asarray([0.5, 3.0], F16), mask=jnp.ones((1, 1, SQ, SKV), bool),
                    implementation="blockwise", return_lse=True, block_q=8, block_kv=8)
  assert r.passed, str(r)
  assert r["dscale"].error < 1e-5, str(r)  # d sinks comes back in float16


def test_explain_says_what_runs():
  q, k, v = _qkv()
  bias = jnp.zeros((1, H, SQ, SKV), F16)
  d = flashvjp.explain(q, k, v, bias=bias, scale=jnp.float32(0.3))
  assert "score_mod's first step" in d.reason and "bias divided by it in float32" in d.reason
  assert any(o.mod == "score_mod" and o.shape == () for o in d.operands)
  d = flashvjp.explain(q, k, v, scale=jnp.float32(0.3))
  assert "score_mod's first step" in d.reason and "bias" not in d.reason
  d = flashvjp.explain(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                       bias=bias, scale=jnp.float32(0.3))
  assert "first step" not in d.reason and not d.operands
