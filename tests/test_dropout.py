"""The counter-based keep-mask: statistics, determinism, and the same mask in every path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashvjp
from tests import _util


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_keep_fraction_matches_rate(rate):
  keep = np.asarray(flashvjp.dropout_mask(jax.random.key(0), (2, 4, 128, 128), rate))
  n = keep.size
  # 6 standard deviations of a binomial proportion.
  assert abs(keep.mean() - (1 - rate)) < 6 * np.sqrt(rate * (1 - rate) / n)


def test_mask_depends_on_key_and_has_no_row_structure():
  a = np.asarray(flashvjp.dropout_mask(jax.random.key(0), (1, 2, 64, 64), 0.5))
  b = np.asarray(flashvjp.dropout_mask(jax.random.key(1), (1, 2, 64, 64), 0.5))
  assert (a != b).mean() > 0.4
  np.testing.assert_array_equal(a, np.asarray(flashvjp.dropout_mask(jax.random.key(0), (1, 2, 64, 64), 0.5)))
  # Neighbouring rows and heads are not copies or shifts of each other.
  assert (a[0, 0, 1:] != a[0, 0, :-1]).mean() > 0.4
  assert (a[0, 0] != a[0, 1]).mean() > 0.4
  assert (a[0, 0, 1:, 1:] != a[0, 0, :-1, :-1]).mean() > 0.4


def test_raw_uint32_key_accepted():
  k = jax.random.PRNGKey(0)
  np.testing.assert_array_equal(np.asarray(flashvjp.dropout_mask(k, (1, 1, 8, 8), 0.5)),
                                np.asarray(flashvjp.dropout_mask(jax.random.wrap_key_data(k), (1, 1, 8, 8), 0.5)))


def test_blockwise_dropout_equals_explicit_mask():
  """Dropout in blockwise equals naive attention with the dense dropout_mask applied by hand."""
  q, k, v = _util.random_qkv(0, 1, 2, 1, 20, 30, 4)
  key = jax.random.key(9)
  out = flashvjp.flash_attention(q, k, v, dropout_rate=0.5, dropout_rng=key, deterministic=False,
                                 implementation="blockwise", block_q=8, block_kv=8)
  keep = flashvjp.dropout_mask(key, (1, 2, 20, 30), 0.5)
  qq, kk, vv = _util.as64((q, k, v))
  p = jax.nn.softmax(jnp.einsum("bhqd,bhkd->bhqk", qq, jnp.repeat(kk, 2, 1)) / 2.0, axis=-1)
  ref = jnp.einsum("bhqk,bhkd->bhqd", jnp.where(keep, p / 0.5, 0.0), jnp.repeat(vv, 2, 1))
  _util.assert_close(out, ref, jnp.float32)


def test_deterministic_true_disables_dropout():
  q, k, v = _util.random_qkv(0, 1, 2, 1, 10, 10, 4)
  a = flashvjp.flash_attention(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(1),
                               deterministic=True, implementation="blockwise")
  b = flashvjp.flash_attention(q, k, v, implementation="blockwise")
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_rate_and_key_with_deterministic_left_at_its_default_warns():
  """A rate and a key ask for dropout; the default (deterministic=True) turns it off: say so."""
  import warnings
  q, k, v = _util.random_qkv(0, 1, 2, 1, 10, 10, 4)
  kw = dict(dropout_rate=0.5, dropout_rng=jax.random.key(1), implementation="blockwise")
  with pytest.warns(UserWarning, match="deterministic was left at its default") as rec:
    a = flashvjp.flash_attention(q, k, v, **kw)
  assert rec[0].filename == __file__  # points at the caller's line
  with pytest.warns(UserWarning, match="deterministic was left at its default"):
    flashvjp.memory_efficient_attention(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(1))
  b = flashvjp.flash_attention(q, k, v, implementation="blockwise")
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # still no dropout
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # said explicitly, or no key: no warning
    flashvjp.flash_attention(q, k, v, deterministic=True, **kw)
    flashvjp.flash_attention(q, k, v, deterministic=False, **kw)
    flashvjp.flash_attention(q, k, v, dropout_rate=0.5, implementation="blockwise")
    flashvjp.explain(q, k, v, **kw)


def test_broadcast_mask_is_shared_over_batch_and_heads():
  key = jax.random.key(4)
  full = np.asarray(flashvjp.dropout_mask(key, (3, 4, 16, 20), 0.5))
  both = np.asarray(flashvjp.dropout_mask(key, (3, 4, 16, 20), 0.5, broadcast=(True, True)))
  batch = np.asarray(flashvjp.dropout_mask(key, (3, 4, 16, 20), 0.5, broadcast=(True, False)))
  heads = np.asarray(flashvjp.dropout_mask(key, (3, 4, 16, 20), 0.5, broadcast=(False, True)))
  assert both.shape == batch.shape == heads.shape == (3, 4, 16, 20)
  np.testing.assert_array_equal(both, np.broadcast_to(full[:1, :1], both.shape))  # (b, h) = (0, 0)
  np.testing.assert_array_equal(batch, np.broadcast_to(full[:1], batch.shape))
  np.testing.assert_array_equal(heads, np.broadcast_to(full[:, :1], heads.shape))
  assert (full[1, 2] != full[0, 0]).mean() > 0.3  # unbroadcast masks differ
  with pytest.raises(TypeError, match="broadcast"):
    flashvjp.dropout_mask(key, (1, 1, 2, 2), 0.5, broadcast=True)


@pytest.mark.parametrize("impl", ["blockwise", "naive", "pallas"])
@pytest.mark.parametrize("broadcast", [(True, True), (True, False), (False, True)])
def test_dropout_broadcast_every_implementation(impl, broadcast):
  """Forward and gradients with a shared mask equal float64 attention with that explicit mask."""
  q, k, v = _util.random_qkv(5, 2, 4, 2, 12, 20, 8)
  key = jax.random.key(2)
  kw = dict(dropout_rate=0.3, dropout_rng=key, deterministic=False, dropout_broadcast=broadcast,
            implementation=impl, block_q=8, block_kv=8)
  f = lambda q, k, v: flashvjp.flash_attention(q, k, v, **kw)
  keep = flashvjp.dropout_mask(key, (2, 4, 12, 20), 0.3, broadcast=broadcast)

  def ref(q, k, v):
    p = jax.nn.softmax(jnp.einsum("bhqd,bhkd->bhqk", q, jnp.repeat(k, 2, 1)) / np.sqrt(8.0), axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", jnp.where(keep, p / 0.7, 0.0), jnp.repeat(v, 2, 1))

  loss = lambda fn: (lambda *a: jnp.sum(jnp.sin(fn(*a))))
  with jax.default_matmul_precision("highest"):  # full float32 dots (Pallas: no TF32 emulation)
    got = jax.value_and_grad(loss(f), (0, 1, 2))(q, k, v)
  want = jax.value_and_grad(loss(ref), (0, 1, 2))(*_util.as64((q, k, v)))
  _util.assert_close(got, want, jnp.float32)
