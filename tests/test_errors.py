"""Every error of API.md: the stated exception, raised before any kernel, naming the argument."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashvjp

q = jnp.zeros((2, 4, 8, 16), jnp.float32)
k = jnp.zeros((2, 2, 10, 16), jnp.float32)
v = jnp.zeros((2, 2, 10, 8), jnp.float32)

CASES = [
    (dict(query=jnp.zeros((4, 8, 16), jnp.float32)), ValueError, "query.*rank 4"),
    (dict(key=jnp.zeros((2, 2, 10), jnp.float32)), ValueError, "key.*rank 4"),
    (dict(query=[[1.0]]), TypeError, "query"),
    (dict(key=jnp.zeros((3, 2, 10, 16), jnp.float32)), ValueError, "batch"),
    (dict(key=jnp.zeros((2, 2, 10, 12), jnp.float32)), ValueError, "head_dim"),
    (dict(value=jnp.zeros((2, 2, 11, 8), jnp.float32)), ValueError, "seq"),
    (dict(key=jnp.zeros((2, 3, 10, 16), jnp.float32), value=jnp.zeros((2, 3, 10, 8), jnp.float32)), ValueError, "multiple of num_kv_heads"),
    (dict(value=jnp.zeros((2, 2, 10, 8), jnp.bfloat16)), TypeError, "same dtype"),
    (dict(query=jnp.zeros((2, 4, 8, 16), jnp.int32)), TypeError, "query.*float"),
    (dict(mask=jnp.ones((8, 10), jnp.int32)), TypeError, "mask.*bool"),
    (dict(mask=jnp.ones((8, 9), bool)), ValueError, "mask.*broadcast"),
    (dict(bias=jnp.ones((3, 8, 10), jnp.float32)), ValueError, "bias.*broadcast"),
    (dict(bias=jnp.ones((8, 10), jnp.int32)), TypeError, "bias.*float"),
    (dict(segment_ids=jnp.zeros((2, 8), jnp.int32)), ValueError, "segment_ids.*pair"),
    (dict(segment_ids=(jnp.zeros((2, 8), jnp.float32), jnp.zeros((2, 10), jnp.int32))), TypeError, "segment_ids.*integer"),
    (dict(segment_ids=(jnp.zeros((2, 7), jnp.int32), jnp.zeros((2, 10), jnp.int32))), ValueError, "segment_ids.*shape"),
    (dict(segment_ids=(jnp.zeros((2, 8), jnp.int32),)), ValueError, "segment_ids"),
    (dict(dropout_rate=1.0), ValueError, "dropout_rate.*\\[0, 1\\)"),
    (dict(dropout_rate=-0.1), ValueError, "dropout_rate"),
    (dict(dropout_rate=0.1, deterministic=False), ValueError, "dropout_rng"),
    (dict(window=(-1, 2)), ValueError, "window left"),
    (dict(window=(1, -2)), ValueError, "window right"),
    (dict(window=3), ValueError, "window"),
    (dict(block_q=0), ValueError, "block_q"),
    (dict(block_kv=-4), ValueError, "block_kv"),
    (dict(block_q=2.5), TypeError, "block_q"),
    (dict(implementation="cudnn"), ValueError, "implementation"),
    (dict(score_mod=lambda s, b, h, qi, ki: s.sum(-1)), ValueError, "score_mod.*shape"),
    (dict(score_mod=3), TypeError, "score_mod"),
    (dict(causal="yes"), TypeError, "causal"),
    # dropout_rng: one PRNG key (typed, shape (); or legacy uint32[2])
    (dict(dropout_rate=0.1, deterministic=False, dropout_rng=0), TypeError, "dropout_rng.*single JAX PRNG key"),
    (dict(dropout_rate=0.1, deterministic=False, dropout_rng=0.5), TypeError, "dropout_rng"),
    (dict(dropout_rate=0.1, deterministic=False, dropout_rng=jax.random.split(jax.random.key(0), 2)), ValueError, "dropout_rng.*single PRNG key.*shape \\(2,\\)"),
    (dict(dropout_rate=0.1, deterministic=False, dropout_rng=jax.random.split(jax.random.PRNGKey(0), 2)), ValueError, "dropout_rng.*shape \\(2, 2\\)"),
    (dict(dropout_rate=0.1, deterministic=False, dropout_rng=jnp.zeros((2,), jnp.int32)), TypeError, "dropout_rng.*dtype int32"),
    (dict(dropout_rng=0), TypeError, "dropout_rng"),  # checked even when dropout is off
    (dict(dropout_rate=0.1, deterministic=False, dropout_rng=jax.random.key(0), dropout_broadcast=(True,)), TypeError, "dropout_broadcast"),
    # score_mod must be elementwise; errors while tracing it name it
    (dict(score_mod=lambda s, b, h, qi, ki: s - jnp.max(s)), ValueError, "score_mod must be elementwise.*reduce_max"),
    (dict(score_mod=lambda s, b, h, qi, ki: jnp.cumsum(s, axis=-1)), ValueError, "score_mod must be elementwise.*cumsum"),
    (dict(score_mod=lambda s, b, h, qi, ki: s - s.mean(axis=-1, keepdims=True)), ValueError, "score_mod must be elementwise"),
    (dict(score_mod=lambda s, b, h, qi, ki: s + s[:, :, :1]), ValueError, "score_mod must be elementwise"),
    (dict(score_mod=lambda s, b, h, qi, ki: s + jnp.zeros((2, 4, 8, 10)) * h), ValueError, "score_mod must be elementwise.*block"),
    (dict(score_mod=lambda s, b, h, qi, ki: s if s > 0 else -s), ValueError, "score_mod raised .* traced"),
    (dict(score_mod=lambda s, b, h, qi, ki: s + float(qi)), TypeError, "score_mod raised .* traced"),
    (dict(score_mod=lambda s, b, h, qi, ki: s > 0), TypeError, "score_mod must return float.*bool.*mask_mod"),
    (dict(score_mod=lambda s, b, h, qi, ki: (s > 0).astype(jnp.int32)), TypeError, "score_mod must return float.*int32"),
    # scale: a Python number or a scalar float array
    (dict(scale=jnp.ones((3,), jnp.float32)), ValueError, "scale must be a scalar"),
    (dict(scale=jnp.int32(2)), TypeError, "scale.*dtype"),
    (dict(scale="0.5"), TypeError, "scale"),
]


@pytest.mark.parametrize("overrides,exc,pattern", CASES)
def test_bad_input_raises_naming_the_argument(overrides, exc, pattern):
  args = dict(query=q, key=k, value=v)
  for n in ("query", "key", "value"):
    if n in overrides:
      args[n] = overrides.pop(n)
  with pytest.raises(exc, match=pattern):
    flashvjp.flash_attention(args["query"], args["key"], args["value"], **overrides)
  with pytest.raises(exc, match=pattern):
    flashvjp.explain(args["query"], args["key"], args["value"], **overrides)


def test_errors_raise_before_tracing_a_kernel(monkeypatch):
  from flashvjp import blockwise
  called = []
  monkeypatch.setattr(blockwise, "forward", lambda *a, **k: called.append(1))
  with pytest.raises(ValueError):
    flashvjp.flash_attention(q, k, v, mask=jnp.ones((8, 9), bool), implementation="blockwise")
  assert not called


def test_dropout_mask_errors():
  with pytest.raises(ValueError, match="rate"):
    flashvjp.dropout_mask(jax.random.key(0), (1, 1, 2, 2), 1.5)
  with pytest.raises(ValueError, match="shape"):
    flashvjp.dropout_mask(jax.random.key(0), (2, 2), 0.5)


def test_builtin_score_mod_errors():
  with pytest.raises(ValueError, match="cap"):
    flashvjp.softcap(0.0)
  with pytest.raises(ValueError, match="table"):
    flashvjp.relative_position_bias(jnp.zeros((4, 5), jnp.float32), max_distance=3)


def test_numpy_inputs_accepted():
  out = flashvjp.flash_attention(np.asarray(q), np.asarray(k), np.asarray(v), implementation="blockwise")
  assert out.shape == (2, 4, 8, 8)


def test_score_mod_tracing_error_is_chained():
  """The wrapped error names score_mod and keeps the original as its cause."""
  with pytest.raises(ValueError, match="score_mod raised ValueError") as info:
    flashvjp.flash_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s if s > 0 else -s)
  assert "truth value of an array" in str(info.value.__cause__)
  with pytest.raises(TypeError, match="score_mod raised TypeError") as info:
    flashvjp.flash_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + float(qi))
  assert isinstance(info.value.__cause__, TypeError)


def test_elementwise_score_mods_are_accepted():
  """The elementwise check rejects none of the built-ins or index-driven gathers from tables."""
  table = jnp.linspace(-1.0, 1.0, 4 * 7, dtype=jnp.float32).reshape(4, 7)
  for sm in (flashvjp.softcap(5.0), flashvjp.alibi(flashvjp.alibi_slopes(4)),
             flashvjp.relative_position_bias(table, 3),
             # numpy arrays, indexed by traced head / distance indices
             flashvjp.alibi(np.asarray(flashvjp.alibi_slopes(4))),
             flashvjp.relative_position_bias(np.asarray(table), 3),
             lambda s, b, h, qi, ki: jnp.where(ki > qi, s * 0.5, s) + b.astype(s.dtype),
             lambda s, b, h, qi, ki: jnp.maximum(s, 0.0) + jnp.sum(table)):
    out = flashvjp.flash_attention(q, k, v, score_mod=sm, implementation="blockwise")
    assert out.shape == (2, 4, 8, 8) and bool(jnp.all(jnp.isfinite(out)))


def test_score_mod_checked_under_jit_with_traced_closure():
  """Inside jit a score_mod closing over a traced array is still checked (and rejected)."""
  t = jnp.ones((4,), jnp.float32)
  bad = jax.jit(lambda t: flashvjp.flash_attention(
      q, k, v, score_mod=lambda s, b, h, qi, ki: s * t[h] - jnp.max(s)))
  with pytest.raises(ValueError, match="score_mod must be elementwise"):
    bad(t)
  good = jax.jit(lambda t: flashvjp.flash_attention(
      q, k, v, score_mod=lambda s, b, h, qi, ki: s * t[h], implementation="blockwise"))
  assert good(t).shape == (2, 4, 8, 8)


def test_single_keys_accepted():
  for key in (jax.random.key(0), jax.random.PRNGKey(0), jax.random.split(jax.random.key(0), 2)[1]):
    out = flashvjp.flash_attention(q, k, v, dropout_rate=0.5, dropout_rng=key, deterministic=False,
                                   implementation="blockwise")
    assert bool(jnp.all(jnp.isfinite(out)))
