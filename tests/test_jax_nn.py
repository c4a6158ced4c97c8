"""flashvjp.dot_product_attention against jax.nn.dot_product_attention(implementation="xla").

The oracle is jax.nn's XLA path run on float64 copies of the inputs; flashvjp runs
in float32 and must match within TOL[float32], forward and gradients (q, k, v,
bias), on every combination of jax.nn's options. Rows with no allowed key are the
one intended difference (flashvjp: 0; jax.nn: mean of V): they are excluded from
the comparison by an independently computed numpy mask and tested on their own.
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashvjp
from tests._util import assert_close

F32 = jnp.float32
B, T, S, N, K, H = 2, 12, 20, 4, 2, 8  # T != S: top-left alignment matters


def _inputs(seed, *, T=T, S=S, N=N, K=K, H=H, Hv=None, dtype=F32):
  ks = jax.random.split(jax.random.key(seed), 6)
  Hv = H if Hv is None else Hv
  q = jax.random.normal(ks[0], (B, T, N, H), jnp.float64).astype(dtype)
  k = jax.random.normal(ks[1], (B, S, K, H), jnp.float64).astype(dtype)
  v = jax.random.normal(ks[2], (B, S, K, Hv), jnp.float64).astype(dtype)
  bias = jax.random.normal(ks[3], (1, N, T, S), jnp.float64).astype(dtype)
  mask = np.array(jax.random.bernoulli(ks[4], 0.7, (B, 1, T, S)))
  mask[0, 0, 3, :] = False  # a fully masked row
  ct = jax.random.normal(ks[5], (B, T, N, Hv), jnp.float64).astype(dtype)
  return q, k, v, bias, jnp.asarray(mask), ct


def _allowed_np(T, S, *, mask=None, causal=False, window=None, q_len=None, kv_len=None):
  """Independent numpy model of jax.nn's masking: bool [B, 1 or N, T, S]."""
  t = np.arange(T)[:, None]
  s = np.arange(S)[None, :]
  ok = np.ones((B, 1, T, S), bool)
  if mask is not None:
    ok = ok & np.asarray(mask)
  if causal:
    ok = ok & (s <= t)
  if window is not None:
    left, right = (window, window) if isinstance(window, int) else window
    ok = ok & (s >= t - left) & (s <= t + right)
  if q_len is not None:
    ok = ok & (t < np.asarray(q_len)[:, None, None, None])
  if kv_len is not None:
    ok = ok & (s < np.asarray(kv_len)[:, None, None, None])
  return ok


def _dead_rows(allowed, q_len, T):
  """[B, T, 1]: rows with no allowed key that are not query padding (jax.nn zeroes those)."""
  dead = ~allowed.any(-1).any(1)  # [B, T]
  if q_len is not None:
    dead &= np.arange(T)[None, :] < np.asarray(q_len)[:, None]
  return dead[:, :, None]


def _loss_and_grads(fn, q, k, v, bias, ct, kwargs):
  def loss(q, k, v, bias):
    out = fn(q, k, v, bias, **kwargs)
    return jnp.sum(out.astype(ct.dtype) * ct), out
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
      q, k, v, bias)
  return out, grads


# Every combination of jax.nn's masking options (2^5), each with a differentiable bias
# (bias is additive and independent of masking; runs without bias are in the shape tests).
OPTIONS = ("mask", "is_causal", "local_window_size", "query_seq_lengths",
           "key_value_seq_lengths")
COMBOS = [c for n in range(len(OPTIONS) + 1) for c in itertools.combinations(OPTIONS, n)]


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "+".join(c) or "plain")
def test_matches_jax_nn_every_combination(combo):
  q, k, v, bias, mask, ct = _inputs(len(combo))
  q_len = jnp.asarray([T - 5, T], jnp.int32)
  kv_len = jnp.asarray([S - 13, 0], jnp.int32)  # batch 1: no key at all
  window = (2, 3)
  kwargs = {}
  if "mask" in combo:
    kwargs["mask"] = mask
  if "is_causal" in combo:
    kwargs["is_causal"] = True
  if "local_window_size" in combo:
    kwargs["local_window_size"] = window
  if "query_seq_lengths" in combo:
    kwargs["query_seq_lengths"] = q_len
  if "key_value_seq_lengths" in combo:
    kwargs["key_value_seq_lengths"] = kv_len

  def ref(q, k, v, bias, **kw):
    return jax.nn.dot_product_attention(q, k, v, bias, implementation="xla", **kw)

  allowed = _allowed_np(T, S, mask=kwargs.get("mask"), causal="is_causal" in combo,
                        window=window if "local_window_size" in combo else None,
                        q_len=kwargs.get("query_seq_lengths"),
                        kv_len=kwargs.get("key_value_seq_lengths"))
  dead = _dead_rows(allowed, kwargs.get("query_seq_lengths"), T)
  ct = jnp.where(dead[..., None], 0.0, ct).astype(F32)  # dead rows: no gradient from them
  out, grads = _loss_and_grads(flashvjp.dot_product_attention, q, k, v, bias, ct, kwargs)
  ref_in = [x.astype(jnp.float64) for x in (q, k, v, bias, ct)]
  ref_out, ref_grads = _loss_and_grads(ref, *ref_in, kwargs)

  assert out.shape == (B, T, N, H) and out.dtype == F32
  live = ~dead[..., None]
  assert_close(jnp.where(live, out, 0.0), jnp.where(live, ref_out, 0.0), F32, "out")
  np.testing.assert_array_equal(np.asarray(out)[np.broadcast_to(dead[..., None], out.shape)], 0.0)
  assert_close(grads, ref_grads, F32, f"grads {combo}")


@pytest.mark.parametrize("case", ["gqa_mqa", "rank3", "scale", "int_window", "head_dim_v",
                                  "bias_broadcast", "causal_square"])
def test_matches_jax_nn_shapes(case):
  kw, shape = {}, {}
  if case == "gqa_mqa":
    shape = dict(N=6, K=1)
  elif case == "head_dim_v":
    shape = dict(Hv=5)
  elif case == "causal_square":
    shape = dict(T=S)
  q, k, v, bias, mask, ct = _inputs(7, **shape)
  if case == "scale":
    kw["scale"] = 0.3
  elif case == "int_window":
    kw["local_window_size"] = 3
  elif case == "causal_square":
    kw["is_causal"] = True
  if case == "bias_broadcast":
    bias = bias[:, :1, :1, :]  # [1, 1, 1, S]
  use_bias = case in ("bias_broadcast", "scale")

  if case == "rank3":
    q, k, v, ct = q[0], k[0], v[0], ct[0]
    kw["is_causal"] = True
  if case == "head_dim_v":
    # jax.nn needs value's shape == key's: reference by the definition, p @ v per head.
    out = flashvjp.dot_product_attention(q, k, v, is_causal=True)
    g = N // K
    s = jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.float64),
                   jnp.repeat(k, g, axis=2).astype(jnp.float64)) / np.sqrt(H)
    s = jnp.where(np.tril(np.ones((T, S), bool)), s, -jnp.inf)
    ref = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, -1),
                     jnp.repeat(v, g, axis=2).astype(jnp.float64))
    assert out.shape == (B, T, N, 5)
    assert_close(out, ref, F32, "head_dim_v")
    return

  def ours(q, k, v, bias, **kw):
    return flashvjp.dot_product_attention(q, k, v, bias if use_bias else None, **kw)

  def ref(q, k, v, bias, **kw):
    return jax.nn.dot_product_attention(q, k, v, bias if use_bias else None,
                                        implementation="xla", **kw)

  out, g_ours = _loss_and_grads(ours, q, k, v, bias, ct, kw)
  ref_in = [x.astype(jnp.float64) for x in (q, k, v, bias, ct)]
  ref, g_ref = _loss_and_grads(ref, *ref_in, kw)
  assert out.shape == q.shape[:-1] + (v.shape[-1],)
  assert_close(out, ref, F32, case)
  if not use_bias:
    g_ours, g_ref = g_ours[:3], g_ref[:3]
  assert_close(g_ours, g_ref, F32, f"{case} grads")
  if case == "bias_broadcast":
    assert g_ours[3].shape == (1, 1, 1, S)


def test_fully_masked_row_is_zero_where_jax_nn_averages_v():
  """The one intended difference, stated as a test."""
  q, k, v, _, _, _ = _inputs(3)
  kv_len = jnp.asarray([S, 0], jnp.int32)  # batch 1 has no keys at all
  mask = np.ones((B, 1, T, S), bool)
  mask[0, 0, 5, :] = False  # batch 0, query 5: a fully masked row
  kw = dict(mask=jnp.asarray(mask), key_value_seq_lengths=kv_len)
  ours = flashvjp.dot_product_attention(q, k, v, **kw)
  theirs = jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)
  np.testing.assert_array_equal(np.asarray(ours[1]), 0.0)
  np.testing.assert_array_equal(np.asarray(ours[0, 5]), 0.0)
  # jax.nn: uniform weights over all S keys -> mean of V (per kv head).
  mean_v = jnp.repeat(jnp.mean(v, axis=1), N // K, axis=1)  # [B, N, H]
  assert_close(theirs[1], jnp.broadcast_to(mean_v[1], (T, N, H)), F32, "jax.nn batch 1")
  assert_close(theirs[0, 5], mean_v[0], F32, "jax.nn row (0, 5)")
  # everything else agrees
  assert_close(ours[0, :5], theirs[0, :5], F32, "live rows")
  # and the gradient through a dead row is zero, finite
  g = jax.grad(lambda q, k, v: jnp.sum(flashvjp.dot_product_attention(q, k, v, **kw)[1]),
               argnums=(0, 1, 2))(q, k, v)
  for x in g:
    assert np.isfinite(np.asarray(x)).all()
  np.testing.assert_array_equal(np.asarray(g[0][1]), 0.0)


def test_return_residual_matches_jax_nn_logsumexp():
  q, k, v, bias, _, _ = _inputs(4)
  kw = dict(is_causal=True, query_seq_lengths=jnp.asarray([T, T - 2], jnp.int32))
  out, lse = flashvjp.dot_product_attention(q, k, v, bias, return_residual=True, **kw)
  ref_out, ref_lse = jax.nn.dot_product_attention(
      *(x.astype(jnp.float64) for x in (q, k, v, bias)), implementation="xla",
      return_residual=True, **kw)
  assert lse.shape == (B, T, N) and lse.dtype == F32
  assert_close(out, ref_out, F32, "out")
  assert_close(lse[0], ref_lse[0], F32, "lse")
  assert_close(lse[1, :T - 2], ref_lse[1, :T - 2], F32, "lse live")
  assert np.isneginf(np.asarray(lse[1, T - 2:])).all()  # padded queries: no allowed key


def test_seq_lengths_never_build_a_dense_mask():
  """Lengths become segment ids: no [.., T, S]-sized array anywhere in the forward+backward."""
  Tb, Sb = 1536, 1664  # larger than the blockwise default block, so tiles are smaller
  q = jax.ShapeDtypeStruct((1, Tb, 2, 8), F32)
  kv = jax.ShapeDtypeStruct((1, Sb, 2, 8), F32)
  lens = (jax.ShapeDtypeStruct((1,), jnp.int32),) * 2

  def f(q, k, v, ql, kl):
    return jnp.sum(flashvjp.dot_product_attention(
        q, k, v, query_seq_lengths=ql, key_value_seq_lengths=kl, is_causal=True,
        implementation="blockwise"))

  jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(q, kv, kv, *lens)

  def shapes(jp):
    for eqn in jp.eqns:
      for var in eqn.outvars:
        yield getattr(var.aval, "shape", ())
      for p in eqn.params.values():
        for sub in (p if isinstance(p, (tuple, list)) else (p,)):
          sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
          if hasattr(sub, "eqns"):
            yield from shapes(sub)

  seen = list(shapes(jaxpr.jaxpr))
  assert seen, "empty jaxpr"
  big = [s for s in seen if int(np.prod(s, dtype=np.int64)) >= Tb * Sb // 2]
  assert not big, f"O(seq^2) intermediates: {big}"


def test_rejects_jax_nn_backend_names_and_bad_input():
  q, k, v, *_ = _inputs(0)
  with pytest.raises(ValueError, match="implementation='xla' is a jax.nn backend"):
    flashvjp.dot_product_attention(q, k, v, implementation="xla")
  with pytest.raises(ValueError, match="implementation='cudnn'"):
    flashvjp.dot_product_attention(q, k, v, implementation="cudnn")
  with pytest.raises(ValueError, match="implementation must be None or one of"):
    flashvjp.dot_product_attention(q, k, v, implementation="flash")
  with pytest.raises(ValueError, match="local_window_size left must be >= 0"):
    flashvjp.dot_product_attention(q, k, v, local_window_size=(-1, 2))
  with pytest.raises(ValueError, match="local_window_size must be an int or a pair"):
    flashvjp.dot_product_attention(q, k, v, local_window_size=(1, 2, 3))
  with pytest.raises(ValueError, match=r"query_seq_lengths must have shape \[batch\]"):
    flashvjp.dot_product_attention(q, k, v, query_seq_lengths=jnp.ones((3,), jnp.int32))
  with pytest.raises(TypeError, match="key_value_seq_lengths must be an integer array"):
    flashvjp.dot_product_attention(q, k, v, key_value_seq_lengths=jnp.ones((B,), F32))
  with pytest.raises(ValueError, match="query must have rank 4"):
    flashvjp.dot_product_attention(q[0, 0], k, v)
  with pytest.raises(ValueError, match="same rank"):
    flashvjp.dot_product_attention(q[0], k, v)
  with pytest.raises(TypeError, match="is_causal must be a bool"):
    flashvjp.dot_product_attention(q, k, v, is_causal=1)
  with pytest.raises(TypeError, match="mask must be a bool"):
    flashvjp.dot_product_attention(q, k, v, mask=jnp.ones((T, S), F32))
  with pytest.raises(ValueError, match="bias of shape"):
    flashvjp.dot_product_attention(q, k, v, jnp.ones((T + 1, S), F32))


def test_mixed_dtypes_are_a_value_error_as_in_jax_nn():
  q, k, v, *_ = _inputs(0)
  bf = lambda x: x.astype(jnp.bfloat16)
  for args, name in (((q, bf(k), bf(v)), "query"), ((q, k, bf(v)), "value"),
                     ((bf(q), k, v), "query")):
    with pytest.raises(ValueError) as ours:
      flashvjp.dot_product_attention(*args)
    with pytest.raises(ValueError) as theirs:
      jax.nn.dot_product_attention(*args)
    assert str(ours.value).startswith(f"{name} dtype should be {args[1].dtype}")
    assert str(theirs.value).startswith(f"{name} dtype should be {args[1].dtype}")


def test_explain_reports_the_path_for_the_drop_in():
  """The drop-in runs the same dispatch as flash_attention (observable via explain)."""
  q, k, v, *_ = _inputs(0)
  d = flashvjp.explain(jnp.swapaxes(q, 1, 2), jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2))
  assert d.implementation in ("blockwise", "pallas_triton")
  out_naive = flashvjp.dot_product_attention(q, k, v, is_causal=True, implementation="naive")
  out_bw = flashvjp.dot_product_attention(q, k, v, is_causal=True, implementation="blockwise")
  assert_close(out_bw, out_naive, F32, "blockwise vs naive")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_matches_jax_nn_float64(dtype):
  """Half-precision inputs: output and gradients in the input dtype, within TOL[dtype]."""
  q, k, v, bias, _, ct = _inputs(9, dtype=dtype)
  kw = dict(is_causal=True, key_value_seq_lengths=jnp.asarray([S, S - 4], jnp.int32))
  out, grads = _loss_and_grads(flashvjp.dot_product_attention, q, k, v, bias, ct, kw)
  ref_in = [x.astype(jnp.float64) for x in (q, k, v, bias, ct)]
  ref_out, ref_grads = _loss_and_grads(
      lambda *a, **k_: jax.nn.dot_product_attention(*a, implementation="xla", **k_),
      *ref_in, kw)
  assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
  assert_close(out, ref_out, dtype, "out")
  assert_close(grads, ref_grads, dtype, "grads")


def test_mask_mod_and_sinks_extensions_match_dense_forms():
  """The keyword-only extensions: mask_mod equals jax.nn with the same dense mask; sinks
  equal jax.nn's logits with one extra zero-value key per head (float64)."""
  q, k, v, _, _, _ = _inputs(21, T=S)  # float32 through flashvjp, float64 references
  q64, k64, v64 = (x.astype(jnp.float64) for x in (q, k, v))
  t, s_ = np.arange(S)[:, None], np.arange(S)[None, :]
  prefix = jnp.asarray([3, 11], jnp.int32)
  dense = (s_ <= t)[None, None] | (s_[None, None] < np.asarray(prefix)[:, None, None, None])
  got = flashvjp.dot_product_attention(q, k, v, mask_mod=flashvjp.prefix_lm(prefix))
  ref = jax.nn.dot_product_attention(q64, k64, v64, mask=jnp.asarray(dense), implementation="xla")
  assert_close(got, ref, F32, "mask_mod")
  sinks = jnp.asarray([0.2, -0.7, 1.1, 3.0], F32)
  got = flashvjp.dot_product_attention(q, k, v, sinks=sinks)
  kk = jnp.repeat(k64, N // K, axis=2)
  vv = jnp.repeat(v64, N // K, axis=2)
  logits = jnp.einsum("btnh,bsnh->bnts", q64, kk) / np.sqrt(H)
  sinks = sinks.astype(jnp.float64)
  logits = jnp.concatenate([logits, jnp.broadcast_to(sinks[None, :, None, None], logits.shape[:3] + (1,))], -1)
  p = jax.nn.softmax(logits, axis=-1)[..., :-1]
  assert_close(got, jnp.einsum("bnts,bsnh->btnh", p, vv), F32, "sinks")


def test_return_max_logits_extension():
  rng = np.random.default_rng(4)
  q, k, v = (jnp.asarray(rng.standard_normal((2, 20, 4, 8)), jnp.float32) for _ in range(3))
  out, ml = flashvjp.dot_product_attention(q, k, v, is_causal=True, return_max_logits=True)
  s = np.einsum("btnh,bsnh->bnts", np.asarray(q, np.float64), np.asarray(k, np.float64))
  s = np.where(np.tril(np.ones((20, 20), bool)), s / np.sqrt(8), -np.inf)
  np.testing.assert_allclose(np.asarray(ml), s.max(axis=(2, 3)), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(out), np.asarray(
      flashvjp.dot_product_attention(q, k, v, is_causal=True)), rtol=1e-6, atol=1e-6)
  out3, lse3, ml3 = flashvjp.dot_product_attention(q[0], k[0], v[0], is_causal=True,
                                                   return_residual=True, return_max_logits=True)
  assert out3.shape == (20, 4, 8) and lse3.shape == (20, 4) and ml3.shape == (4,)
  np.testing.assert_allclose(np.asarray(ml3), np.asarray(ml[0]), rtol=1e-6)
