"""flash_attention inside JAX transformations and a tiny training loop."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashvjp
from tests import _util

IMPLS = ("blockwise",)
attn = functools.partial(flashvjp.flash_attention, block_q=8, block_kv=8, causal=True)


def _ref(q, k, v, **kw):
  return flashvjp.flash_attention(*_util.as64((q, k, v)), implementation="naive", causal=True, **kw)


@pytest.mark.parametrize("impl", IMPLS)
def test_jit_and_value_and_grad(impl):
  q, k, v = _util.random_qkv(0, 1, 2, 1, 20, 20, 8)
  f = lambda q, k, v, impl: jnp.sum(jnp.sin(attn(q, k, v, implementation=impl)))
  got = jax.jit(jax.value_and_grad(f, (0, 1, 2)), static_argnums=3)(q, k, v, impl)
  ref = jax.value_and_grad(f, (0, 1, 2))(*_util.as64((q, k, v)), "naive")
  _util.assert_close(got, ref, jnp.float32, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_over_extra_axis(impl):
  q, k, v = _util.random_qkv(1, 3, 2, 2, 12, 12, 4)  # leading 3 is the vmapped axis
  qs, ks, vs = (x[:, None] for x in (q, k, v))  # [3, 1, H, S, D]
  g = jax.vmap(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v, implementation=impl) ** 2), (0, 1, 2)))
  got = g(qs, ks, vs)
  ref = jax.vmap(jax.grad(lambda q, k, v: jnp.sum(_ref(q, k, v) ** 2), (0, 1, 2)))(*_util.as64((qs, ks, vs)))
  _util.assert_close(got, ref, jnp.float32, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_remat(impl):
  q, k, v = _util.random_qkv(2, 1, 2, 1, 16, 16, 4)
  f = jax.checkpoint(lambda q, k, v: jnp.sum(attn(q, k, v, implementation=impl) ** 2))
  got = jax.grad(f, (0, 1, 2))(q, k, v)
  ref = jax.grad(lambda q, k, v: jnp.sum(_ref(q, k, v) ** 2), (0, 1, 2))(*_util.as64((q, k, v)))
  _util.assert_close(got, ref, jnp.float32, impl=impl)


def _layers(x, ws, impl):
  """A stack of attention layers over lax.scan: x [B, H, S, D], ws [L, D, D]."""
  def layer(h, w):
    qkv = h @ w
    out = (attn(qkv, h, h, implementation=impl) if impl != "naive" else _ref(qkv, h, h))
    return h + out, None
  return jax.lax.scan(layer, x, ws)[0]


@pytest.mark.parametrize("impl", IMPLS)
def test_scan_over_layers(impl):
  x = _util.random_qkv(3, 1, 2, 2, 16, 16, 8)[0]
  ws = 0.3 * jax.random.normal(jax.random.key(0), (3, 8, 8), jnp.float32)
  f = lambda x, ws, impl: jnp.sum(_layers(x, ws, impl) ** 2)
  got = jax.jit(jax.value_and_grad(f, (0, 1)), static_argnums=2)(x, ws, impl)
  ref = jax.value_and_grad(f, (0, 1))(*_util.as64((x, ws)), "naive")
  _util.assert_close(got, ref, jnp.float32, impl=impl)


def test_training_loop_loss_decreases_identically():
  """A few plain SGD steps on a toy attention layer: same losses for naive and blockwise."""
  key = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(key[0], (2, 24, 16), jnp.float64)
  target = jnp.roll(x, 1, axis=1)
  params0 = {n: 0.2 * jax.random.normal(kk, (16, 16), jnp.float64) for n, kk in zip("qkv", key[1:])}

  def loss(params, impl):
    split = lambda t: t.reshape(2, 24, 2, 8).transpose(0, 2, 1, 3)
    q, k, v = (split(x @ params[n]) for n in "qkv")
    out = flashvjp.flash_attention(q, k, v, causal=True, implementation=impl, block_q=8, block_kv=8)
    out = out.transpose(0, 2, 1, 3).reshape(2, 24, 16)
    return jnp.mean((out - target) ** 2)

  def train(impl):
    params, losses = params0, []
    step = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    for _ in range(8):
      l, g = step(params, impl)
      params = jax.tree_util.tree_map(lambda p, d: p - 3.0 * d, params, g)
      losses.append(float(l))
    return np.array(losses)

  a, b = train("blockwise"), train("naive")
  assert a[-1] < 0.9 * a[0] and np.all(np.diff(a) < 0), a
  np.testing.assert_allclose(a, b, rtol=1e-10)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_traced_scale_is_differentiable(dtype):
  """scale as a traced array (a learned temperature): value and gradients (incl. d/dscale)
  against float64 autodiff of naive attention, under jit."""
  q, k, v = _util.random_qkv(7, 2, 4, 2, 24, 20, 8, dtype=dtype)
  bias = jax.random.normal(jax.random.key(1), (1, 4, 24, 20), jnp.float64).astype(dtype)
  t = jnp.asarray(0.37, jnp.float32)

  def loss(impl, q, k, v, t):
    out = flashvjp.flash_attention(q, k, v, bias=bias, scale=t, causal=True, implementation=impl,
                                   block_q=8, block_kv=8)
    return jnp.sum(jnp.sin(out.astype(jnp.float32)))

  got = jax.jit(jax.value_and_grad(functools.partial(loss, "blockwise"), (0, 1, 2, 3)))(q, k, v, t)
  ref = jax.value_and_grad(functools.partial(loss, "naive"), (0, 1, 2, 3))(
      *_util.as64((q, k, v, t)))
  (val, (dq, dk, dv, dt)), (val_r, (dq_r, dk_r, dv_r, dt_r)) = got, ref
  _util.assert_close((val, dq, dk, dv), (val_r, dq_r, dk_r, dv_r), dtype)
  # d/dscale = sum(q * dL/d(scale q)) sums 2*4*24*8 terms that cancel: its tolerance is
  # relative to the sum of their magnitudes.
  terms = jnp.sum(jnp.abs(q.astype(jnp.float64) * dq_r / 0.37))
  assert abs(float(dt) - float(dt_r)) <= flashvjp._check.tolerance(dtype) * float(terms), (dt, dt_r, terms)
  # The same value as a Python float scale.
  fixed = flashvjp.flash_attention(q, k, v, bias=bias, scale=0.37, causal=True,
                                   implementation="blockwise", block_q=8, block_kv=8)
  _util.assert_close(flashvjp.flash_attention(q, k, v, bias=bias, scale=t, causal=True,
                                              implementation="blockwise", block_q=8, block_kv=8),
                     fixed.astype(jnp.float64), dtype)


def test_traced_scale_in_dot_product_attention_matches_jax_nn():
  q, k, v = (jnp.swapaxes(x, 1, 2) for x in _util.random_qkv(8, 1, 2, 2, 16, 16, 8))
  f = lambda fn: jax.grad(lambda t: jnp.sum(fn(q, k, v, scale=t, is_causal=True) ** 2))
  got = jax.jit(f(flashvjp.dot_product_attention))(jnp.float32(0.3))
  ref = jax.grad(
      lambda t: jnp.sum(jax.nn.dot_product_attention(*_util.as64((q, k, v)), scale=t,
                                                     is_causal=True) ** 2))(jnp.float64(0.3))
  _util.assert_close(got, ref, jnp.float32)
