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
  _util.assert_close(got, ref, jnp.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_over_extra_axis(impl):
  q, k, v = _util.random_qkv(1, 3, 2, 2, 12, 12, 4)  # leading 3 is the vmapped axis
  qs, ks, vs = (x[:, None] for x in (q, k, v))  # [3, 1, H, S, D]
  g = jax.vmap(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v, implementation=impl) ** 2), (0, 1, 2)))
  got = g(qs, ks, vs)
  ref = jax.vmap(jax.grad(lambda q, k, v: jnp.sum(_ref(q, k, v) ** 2), (0, 1, 2)))(*_util.as64((qs, ks, vs)))
  _util.assert_close(got, ref, jnp.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_remat(impl):
  q, k, v = _util.random_qkv(2, 1, 2, 1, 16, 16, 4)
  f = jax.checkpoint(lambda q, k, v: jnp.sum(attn(q, k, v, implementation=impl) ** 2))
  got = jax.grad(f, (0, 1, 2))(q, k, v)
  ref = jax.grad(lambda q, k, v: jnp.sum(_ref(q, k, v) ** 2), (0, 1, 2))(*_util.as64((q, k, v)))
  _util.assert_close(got, ref, jnp.float32)


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
  _util.assert_close(got, ref, jnp.float32)


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
