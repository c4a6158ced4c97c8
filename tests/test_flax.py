"""flashvjp.flax.attention_fn inside Flax's MultiHeadAttention (linen and nnx).

References are Flax's own default attention_fn in float64 (same parameters, same
inputs); rows whose mask is all False are the one intended difference and are
kept out of these comparisons (the padding masks here leave every query row
at least one key). Dropout is checked against `flashvjp.dropout_mask`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import flashvjp  # noqa: E402
import flashvjp.flax  # noqa: E402
from flashvjp._check import tolerance  # noqa: E402
from tests._util import assert_close  # noqa: E402

F32, F64 = jnp.float32, jnp.float64
BATCH, L, FEAT, HEADS = 2, 10, 16, 4


def _x(seed, shape=(BATCH, L, FEAT), dtype=F64):
  return jax.random.normal(jax.random.key(seed), shape, F64).astype(dtype)


def _causal_padding_mask():
  """[B, 1, L, L]: causal and key padding (batch 1 has 6 valid keys); no empty row."""
  valid = jnp.arange(L)[None, :] < jnp.asarray([L, 6])[:, None]
  return nn.combine_masks(nn.make_causal_mask(jnp.ones((BATCH, L))),
                          nn.make_attention_mask(jnp.ones((BATCH, L), bool), valid))


def _assert_grads_close(got, ref, dtype, what):
  """assert_close per leaf; a leaf whose true gradient is 0 (the key projection's bias:
  softmax ignores a per-row constant) is checked against the tree's largest gradient."""
  scale = max(float(jnp.abs(r).max()) for r in jax.tree_util.tree_leaves(ref))
  for n, (g, r) in enumerate(zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref))):
    if float(jnp.abs(r).max()) < 1e3 * tolerance(dtype) * scale:
      assert float(jnp.abs(g).max()) <= 1e3 * tolerance(dtype) * scale, f"{what} leaf {n}"
    else:
      assert_close(g, r, dtype, f"{what} leaf {n}")


@pytest.mark.parametrize("dtype", [F64, F32])
def test_linen_matches_default_attention_forward_and_grads(dtype):
  def make(attention_fn):
    return nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=FEAT, dtype=dtype,
                                           param_dtype=dtype, attention_fn=attention_fn)

  x = _x(0, dtype=dtype)
  mask = _causal_padding_mask()
  params = make(nn.dot_product_attention).init(jax.random.key(1), x, mask=mask)

  def loss(module, params, x):
    y = module.apply(params, x, mask=mask)
    return jnp.sum(y * _x(2, dtype=dtype)), y

  grad = lambda m: jax.jit(jax.value_and_grad(lambda p, x: loss(m, p, x), argnums=(0, 1),
                                              has_aux=True))(params, x)
  (_, y), g = grad(make(flashvjp.flax.attention_fn))
  # float64 reference: Flax's default attention on float64 copies of the same parameters.
  ref_module = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=FEAT, dtype=F64,
                                               param_dtype=F64)
  p64, x64 = jax.tree_util.tree_map(lambda a: a.astype(F64), (params, x))
  (_, y_ref), g_ref = jax.value_and_grad(
      lambda p, x: (jnp.sum(ref_module.apply(p, x, mask=mask) * _x(2, dtype=dtype).astype(F64)),
                    ref_module.apply(p, x, mask=mask)), argnums=(0, 1), has_aux=True)(p64, x64)
  assert y.dtype == dtype and y.shape == x.shape
  assert_close(y, y_ref, dtype, "linen out")
  _assert_grads_close(g, g_ref, dtype, "linen grads")


def test_linen_make_attention_fn_causal_needs_no_mask():
  x = _x(3)
  dense = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=FEAT, param_dtype=F64,
                                          dtype=F64)
  ours = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=FEAT, param_dtype=F64,
                                         dtype=F64,
                                         attention_fn=flashvjp.flax.make_attention_fn(causal=True))
  params = dense.init(jax.random.key(0), x)
  y_ref = dense.apply(params, x, mask=nn.make_causal_mask(jnp.ones((BATCH, L))))
  assert_close(ours.apply(params, x), y_ref, F64, "causal factory")


def test_nnx_matches_default_attention_forward_and_grads():
  def make(attention_fn):
    return nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEAT, qkv_features=FEAT,
                                  decode=False, dtype=F64, param_dtype=F64,
                                  rngs=nnx.Rngs(0), attention_fn=attention_fn)

  def reference_attention(query, key, value, mask=None, is_causal=False, **unused):
    # nnx.dot_product_attention routes to jax.nn's float32 softmax; linen's stays float64.
    causal = jnp.tril(jnp.ones((query.shape[-3], key.shape[-3]), bool))
    mask = nn.combine_masks(mask, causal[None, None]) if is_causal else mask
    return nn.dot_product_attention(query, key, value, mask=mask)

  ours, ref = make(flashvjp.flax.attention_fn), make(reference_attention)
  x, ct = _x(4), _x(5)
  valid = jnp.arange(L)[None, :] < jnp.asarray([L, 7])[:, None]
  mask = nnx.make_attention_mask(jnp.ones((BATCH, L), bool), valid)  # key padding

  def loss(model, x):
    return jnp.sum(model(x, mask=mask, is_causal=True) * ct)

  l_ours, g_ours = nnx.value_and_grad(loss, argnums=(0, 1))(ours, x)
  l_ref, g_ref = nnx.value_and_grad(loss, argnums=(0, 1))(ref, x)
  assert_close(ours(x, mask=mask, is_causal=True), ref(x, mask=mask, is_causal=True), F64,
               "nnx out")
  assert_close(l_ours, l_ref, F64, "nnx loss")
  _assert_grads_close(nnx.state(g_ours[0], nnx.Param), nnx.state(g_ref[0], nnx.Param), F64,
                      "nnx param grads")
  assert_close(g_ours[1], g_ref[1], F64, "nnx input grad")


@pytest.mark.parametrize("batch_dims", [(), (3,), (2, 3)])
def test_attention_fn_batch_dims_and_gqa_match_flax(batch_dims):
  """Any number of batch dims (incl. none); a [heads, q, kv] mask broadcast over them."""
  kq, kk, kv, km = jax.random.split(jax.random.key(6), 4)
  q = jax.random.normal(kq, batch_dims + (5, HEADS, 8), F64)
  k = jax.random.normal(kk, batch_dims + (7, HEADS, 8), F64)
  v = jax.random.normal(kv, batch_dims + (7, HEADS, 6), F64)
  mask = jax.random.bernoulli(km, 0.6, batch_dims + (1, 5, 7)).at[..., 0].set(True)
  bias = jax.random.normal(km, (HEADS, 5, 7), F64)
  got = jax.jit(flashvjp.flax.attention_fn)(q, k, v, bias=bias, mask=mask)
  ref = nn.dot_product_attention(q, k, v, bias=bias.reshape((1,) * len(batch_dims) + bias.shape),
                                 mask=mask)
  assert got.shape == batch_dims + (5, HEADS, 6)
  assert_close(got, ref, F64, f"batch dims {batch_dims}")
  # GQA: 2 kv heads shared by 4 query heads equals repeating them for Flax.
  k2, v2 = k[..., :2, :], v[..., :2, :]
  got = jax.jit(flashvjp.flax.attention_fn)(q, k2, v2, mask=mask)
  ref = nn.dot_product_attention(q, jnp.repeat(k2, 2, axis=-2), jnp.repeat(v2, 2, axis=-2),
                                 mask=mask)
  assert_close(got, ref, F64, "gqa")


def test_dropout_is_flashvjp_hash_on_probabilities_and_deterministic():
  """broadcast_dropout=False: one mask per (flattened) batch row and head."""
  kq, kk, kv = jax.random.split(jax.random.key(7), 3)
  batch_dims, Lq, Lk, D, rate = (2, 3), 6, 9, 8, 0.3
  q = jax.random.normal(kq, batch_dims + (Lq, HEADS, D), F64)
  k = jax.random.normal(kk, batch_dims + (Lk, HEADS, D), F64)
  v = jax.random.normal(kv, batch_dims + (Lk, HEADS, D), F64)
  rng = jax.random.key(11)
  fn = jax.jit(flashvjp.flax.attention_fn, static_argnames=("deterministic", "dropout_rate",
                                                             "broadcast_dropout"))
  run = lambda r, det: fn(q, k, v, dropout_rng=r, dropout_rate=rate, deterministic=det,
                          broadcast_dropout=False)
  got = run(rng, False)
  # Independent computation: softmax weights (Flax, no dropout) * keep / (1 - rate) @ v,
  # with keep from flashvjp.dropout_mask over the flattened batch [6, heads, Lq, Lk].
  w = nn.dot_product_attention_weights(q, k)  # [2, 3, heads, Lq, Lk]
  keep = flashvjp.dropout_mask(rng, (6, HEADS, Lq, Lk), rate).reshape(w.shape)
  ref = jnp.einsum("...hqk,...khd->...qhd", jnp.where(keep, w / (1 - rate), 0.0), v)
  assert_close(got, ref, F64, "dropout")
  np.testing.assert_array_equal(np.asarray(run(rng, False)), np.asarray(got))  # same key
  assert not np.allclose(np.asarray(run(jax.random.key(12), False)), np.asarray(got))
  assert_close(run(None, True), nn.dot_product_attention(q, k, v), F64, "deterministic")


def test_broadcast_dropout_shares_the_mask_as_flax_does():
  """broadcast_dropout=True (Flax's default): Flax draws keep of shape
  (1,) * (key.ndim - 2) + (q_length, kv_length), one mask for every batch dim and head.
  The adapter's mask follows that rule, and is dropout_mask(..., broadcast=(True, True))."""
  kq, kk, kv = jax.random.split(jax.random.key(5), 3)
  batch_dims, Lq, Lk, D, rate = (2, 3), 6, 9, 8, 0.4
  q = jax.random.normal(kq, batch_dims + (Lq, HEADS, D), F64)
  k = jax.random.normal(kk, batch_dims + (Lk, HEADS, D), F64)
  v = jax.random.normal(kv, batch_dims + (Lk, HEADS, D), F64)
  rng = jax.random.key(3)
  got = flashvjp.flax.attention_fn(q, k, v, dropout_rng=rng, dropout_rate=rate,
                                   deterministic=False)  # broadcast_dropout defaults to True
  # Flax's own shape rule for the broadcast keep-mask, filled with flashvjp's bits:
  flax_shape = tuple([1] * (k.ndim - 2)) + (Lq, Lk)  # as flax.linen.dot_product_attention_weights
  keep_small = flashvjp.dropout_mask(rng, (1, 1, Lq, Lk), rate).reshape(flax_shape)
  keep_full = flashvjp.dropout_mask(rng, (6, HEADS, Lq, Lk), rate, broadcast=(True, True))
  w = nn.dot_product_attention_weights(q, k)  # [2, 3, heads, Lq, Lk]
  np.testing.assert_array_equal(np.asarray(keep_full), np.broadcast_to(
      np.asarray(keep_small).reshape(1, 1, Lq, Lk), keep_full.shape))
  np.testing.assert_array_equal(np.asarray(keep_full)[0, 0], np.asarray(keep_full)[5, HEADS - 1])
  ref = jnp.einsum("...hqk,...khd->...qhd", jnp.where(keep_small, w / (1 - rate), 0.0), v)
  assert_close(got, ref, F64, "broadcast dropout")
  # Not the per-row masks of broadcast_dropout=False.
  per_row = flashvjp.flax.attention_fn(q, k, v, dropout_rng=rng, dropout_rate=rate,
                                       deterministic=False, broadcast_dropout=False)
  assert not np.allclose(np.asarray(per_row), np.asarray(got))
  # And Flax's module passes broadcast_dropout=True by default: the same shared mask, so the
  # dropped positions coincide across the batch rows of a module call.
  with pytest.raises(TypeError, match="broadcast_dropout"):
    flashvjp.flax.attention_fn(q, k, v, broadcast_dropout="yes")


def test_linen_module_dropout_determinism_and_grads():
  module = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=FEAT, dropout_rate=0.5,
                                           param_dtype=F64, dtype=F64,
                                           attention_fn=flashvjp.flax.attention_fn)
  x = _x(8)
  params = module.init(jax.random.key(0), x, deterministic=True)
  apply = lambda p, r: module.apply(p, x, deterministic=False, rngs={"dropout": r})
  a, b = apply(params, jax.random.key(1)), apply(params, jax.random.key(1))
  c = apply(params, jax.random.key(2))
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not np.allclose(np.asarray(a), np.asarray(c))
  det = module.apply(params, x, deterministic=True)
  ref = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=FEAT, param_dtype=F64,
                                        dtype=F64).apply(params, x)
  assert_close(det, ref, F64, "deterministic")
  # with dropout active, the gradient matches autodiff through the naive implementation
  naive = nn.MultiHeadDotProductAttention(
      num_heads=HEADS, qkv_features=FEAT, dropout_rate=0.5, param_dtype=F64, dtype=F64,
      attention_fn=flashvjp.flax.make_attention_fn(implementation="naive"))
  g = jax.grad(lambda p: jnp.sum(apply(p, jax.random.key(3)) ** 2))(params)
  g_ref = jax.grad(lambda p: jnp.sum(naive.apply(p, x, deterministic=False,
                                                 rngs={"dropout": jax.random.key(3)}) ** 2))(params)
  _assert_grads_close(g, g_ref, F64, "dropout grads")


def test_dropout_follows_flax_deterministic_without_a_warning():
  """Flax's convention (deterministic defaults to False): a rate and a key apply dropout;
  deterministic=True, said explicitly, turns it off. Neither warns."""
  import warnings
  q = _x(0, (1, 6, 2, 4))
  fn = flashvjp.flax.make_attention_fn(implementation="blockwise")
  key = jax.random.key(1)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    plain = fn(q, q, q)
    dropped = fn(q, q, q, dropout_rate=0.5, dropout_rng=key)
    off = fn(q, q, q, dropout_rate=0.5, dropout_rng=key, deterministic=True)
  assert not np.allclose(np.asarray(dropped), np.asarray(plain))
  np.testing.assert_array_equal(np.asarray(off), np.asarray(plain))


def test_attention_fn_signature_and_errors():
  import inspect
  params = inspect.signature(flashvjp.flax.attention_fn).parameters
  for name in ("query", "key", "value", "bias", "mask", "broadcast_dropout", "dropout_rng",
               "dropout_rate", "deterministic", "dtype", "precision", "module", "is_causal"):
    assert name in params, name
  q = _x(0, (BATCH, L, HEADS, 8))
  with pytest.raises(ValueError, match="module is set"):
    flashvjp.flax.attention_fn(q, q, q, module=object())
  with pytest.raises(ValueError, match="qk_attn_weights_einsum must be None"):
    flashvjp.flax.attention_fn(q, q, q, qk_attn_weights_einsum=jnp.einsum)
  with pytest.raises(ValueError, match="mask of shape"):
    flashvjp.flax.attention_fn(q, q, q, mask=jnp.ones((BATCH, 3, L, L), bool))
  with pytest.raises(ValueError, match=r"mask of shape \(2, 16\) does not broadcast"):
    flashvjp.flax.attention_fn(q, q, q, mask=jnp.ones((2, 16), bool))  # the shape passed
  with pytest.raises(ValueError, match=r"bias of shape \(3, 10\) does not broadcast"):
    flashvjp.flax.attention_fn(q, q, q, bias=jnp.ones((3, L), F32))
  with pytest.raises(ValueError, match="batch dims must match"):
    flashvjp.flax.attention_fn(q, q[:1], q[:1])
  with pytest.raises(ValueError, match="dropout_rng is required"):
    flashvjp.flax.attention_fn(q, q, q, dropout_rate=0.1, deterministic=False)
  with pytest.raises(ValueError, match="must have shape"):
    flashvjp.flax.attention_fn(q[0, 0], q[0, 0], q[0, 0])
  module = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=flashvjp.flax.attention_fn)
  p = module.init(jax.random.key(0), _x(0))
  with pytest.raises(ValueError, match="module is set"):
    module.apply(p, _x(0), sow_weights=True)


def test_make_attention_fn_window_and_score_mod_match_explicit_forms():
  """The factory's window equals Flax's default with the same band as a dense mask, and its
  score_mod equals flash_attention on the transposed inputs (independently computed)."""
  kq, kk, kv = jax.random.split(jax.random.key(9), 3)
  q = jax.random.normal(kq, (BATCH, L, HEADS, 8), F64)
  k = jax.random.normal(kk, (BATCH, L, HEADS, 8), F64)
  v = jax.random.normal(kv, (BATCH, L, HEADS, 8), F64)
  pos = jnp.arange(L)
  band = (pos[None, :] >= pos[:, None] - 2) & (pos[None, :] <= pos[:, None] + 1)
  got = jax.jit(flashvjp.flax.make_attention_fn(window=(2, 1)))(q, k, v)
  assert_close(got, nn.dot_product_attention(q, k, v, mask=band[None, None]), F64, "window")
  cap = 1.5
  got = jax.jit(flashvjp.flax.make_attention_fn(score_mod=flashvjp.softcap(cap)))(q, k, v)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(8.0)
  ref = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(cap * jnp.tanh(s / cap), axis=-1), v)
  assert_close(got, ref, F64, "softcap")


def test_make_attention_fn_mask_mod_and_sinks_match_explicit_forms():
  """mask_mod equals Flax's default with the same dense mask; sinks equal a float64 softmax
  with one extra zero-value key per head (independently computed)."""
  kq, kk, kv = jax.random.split(jax.random.key(10), 3)
  q = jax.random.normal(kq, (BATCH, L, HEADS, 8), F64)
  k = jax.random.normal(kk, (BATCH, L, HEADS, 8), F64)
  v = jax.random.normal(kv, (BATCH, L, HEADS, 8), F64)
  pos = jnp.arange(L)
  chunk = (pos[None, :] // 4 == pos[:, None] // 4) & (pos[None, :] <= pos[:, None])
  got = jax.jit(flashvjp.flax.make_attention_fn(mask_mod=flashvjp.chunked(4)))(q, k, v)
  assert_close(got, nn.dot_product_attention(q, k, v, mask=chunk[None, None]), F64, "mask_mod")
  sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], F64)
  got = jax.jit(flashvjp.flax.make_attention_fn(sinks=sinks))(q, k, v)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(8.0)
  s = jnp.concatenate([s, jnp.broadcast_to(sinks[None, :, None, None], s.shape[:3] + (1,))], -1)
  p = jax.nn.softmax(s, axis=-1)[..., :-1]
  assert_close(got, jnp.einsum("bhqk,bkhd->bqhd", p, v), F64, "sinks")


def test_max_logits_are_sown_for_qk_clip_in_nnx_and_linen():
  fn = flashvjp.flax.make_attention_fn(causal=True, max_logits=True)
  x = jax.random.normal(jax.random.key(0), (2, 24, 16), jnp.float32)
  mha = nnx.MultiHeadAttention(num_heads=2, in_features=16, decode=False, rngs=nnx.Rngs(0),
                               attention_fn=fn)
  mha(x, sow_weights=True)
  sown = nnx.pop(mha, nnx.Intermediate)
  (got,) = jax.tree_util.tree_leaves(sown)
  # the reference: the module's own projections, float64 causal logits, max per (b, h)
  q = np.asarray(mha.query(x), np.float64)
  k = np.asarray(mha.key(x), np.float64)
  s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  s = np.where(np.tril(np.ones((24, 24), bool)), s, -np.inf)
  np.testing.assert_allclose(np.asarray(got), s.max(axis=(2, 3)), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="sow_weights=True"):
    mha(x)  # no module handed over: nowhere to sow
  lin = nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=fn)
  params = {"params": lin.init(jax.random.key(1), x, sow_weights=True)["params"]}
  _, state = lin.apply(params, x, sow_weights=True, mutable=["intermediates"])
  (got,) = jax.tree_util.tree_leaves(state["intermediates"])
  assert got.shape == (2, 2) and np.isfinite(np.asarray(got)).all()
  assert flashvjp.flax.checkpoint_policy is flashvjp.checkpoint_policy


def _reference_attention_fn(table, sinks, d, causal=True):
  """Plain JAX attention with a relative-position table and sinks, autodiff'd (the oracle)."""
  def fn(query, key, value, mask=None, **_):
    D = query.shape[-1]
    s = jnp.einsum("bqhd,bkhd->bhqk", query, key) / np.sqrt(D)
    L = query.shape[-3]
    rel = jnp.clip(jnp.arange(L)[None, :] - jnp.arange(L)[:, None], -d, d) + d
    s = s + table[:, rel][None]
    if causal:
      s = jnp.where(jnp.tril(jnp.ones((L, L), bool)), s, -jnp.inf)
    m = jnp.maximum(s.max(-1, keepdims=True), sinks[None, :, None, None])
    e = jnp.exp(s - m)
    den = e.sum(-1, keepdims=True) + jnp.exp(sinks[None, :, None, None] - m)
    return jnp.einsum("bhqk,bkhd->bqhd", e / den, value)
  return fn


def test_modules_own_learned_sinks_and_relative_position_tables():
  x = jax.random.normal(jax.random.key(0), (2, 12, 16), jnp.float32)
  d = 4
  mod = flashvjp.flax.MultiHeadAttention(2, 16, causal=True, max_distance=d, learned_sinks=True,
                                         decode=False, rngs=nnx.Rngs(0))
  mod.sinks[...] = jnp.asarray([0.5, -1.0])
  mod.relative_position_bias[...] = jax.random.normal(jax.random.key(1), (2, 2 * d + 1))
  def ref_loss(table, sinks):  # the module's own projections around the plain-JAX oracle
    o = _reference_attention_fn(table, sinks, d)(mod.query(x), mod.key(x), mod.value(x))
    return mod.out(o).sum()

  val, g = nnx.value_and_grad(lambda m: m(x).sum())(mod)
  got = (val, (g.relative_position_bias[...], g.sinks[...]))
  want = jax.value_and_grad(ref_loss, argnums=(0, 1))(mod.relative_position_bias[...],
                                                      mod.sinks[...])
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)
  assert np.abs(np.asarray(got[1][0])).sum() > 0 and np.abs(np.asarray(got[1][1])).sum() > 0

  # linen: the parameters live in the module's params, gradients included
  lin = flashvjp.flax.MultiHeadDotProductAttention(num_heads=2, causal=True, max_distance=d,
                                                   learned_sinks=True)
  params = lin.init(jax.random.key(2), x)["params"]
  assert params["sinks"].shape == (2,) and params["relative_position_bias"].shape == (2, 9)
  params = dict(params, sinks=jnp.asarray([0.3, 1.0]),
                relative_position_bias=jax.random.normal(jax.random.key(3), (2, 9)))
  proj = {k: v for k, v in params.items() if k not in ("sinks", "relative_position_bias")}

  def lin_loss(p, which):
    if which == "ours":
      return lin.apply({"params": p}, x).sum()
    fn = _reference_attention_fn(p["relative_position_bias"], p["sinks"], d)
    return nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=fn).apply(
        {"params": proj}, x).sum()

  got = jax.value_and_grad(lin_loss)(params, "ours")
  want = jax.value_and_grad(lin_loss)(params, "ref")
  np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=2e-5)
  for name in ("sinks", "relative_position_bias"):
    np.testing.assert_allclose(np.asarray(got[1][name]), np.asarray(want[1][name]),
                               rtol=2e-4, atol=2e-5)
