"""Max logits (`return_max_logits=True`, QK-clip): the maximum scaled, modified logit over
allowed positions per (batch, head), from the forward pass itself, without gradient.

The reference is float64: an independent numpy computation for a combination of features
(it also checks the reference implementation), and `implementation="naive"` in float64 for
every feature of the shared test cases (tests/attention_base.py). Kernels run in interpret
mode (Triton, Mosaic-TPU, Mosaic-GPU); the sharded tests run the ring, Ulysses and the
all-gather under plain jit on 4 virtual devices, and `ring_attention` / `sharded_attention`.
Tolerance: `flashvjp._check.tolerance` of the dtype and implementation, relative to max
|reference| (the pass rule of every other check).
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
from tests import _util
from tests import attention_base as base


def _assert_max_close(got, want, dtype, impl):
  got = np.asarray(jnp.asarray(got, jnp.float64))
  want = np.asarray(want, np.float64)
  assert got.shape == want.shape, (got.shape, want.shape)
  assert not np.isnan(got).any()
  inf = np.isinf(want)
  np.testing.assert_array_equal(got[inf], want[inf])  # -inf exactly where nothing is allowed
  assert np.isfinite(got[~inf]).all()
  tol = _check.tolerance(dtype, impl)
  scale = np.abs(want[~inf]).max() if (~inf).any() else 1.0
  err = np.abs(got[~inf] - want[~inf]).max() if (~inf).any() else 0.0
  assert err <= tol * scale, f"{impl} {dtype}: max |error| {err:.3g} > {tol} x {scale:.3g}"


def _numpy_max_logits(q, k, *, scale, bias, allowed, softcap):
  """float64 numpy: max over allowed kv of softcap(scale * q.k + bias), per (b, h)."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  k = np.repeat(k, q.shape[1] // k.shape[1], axis=1)
  s = scale * np.einsum("bhqd,bhkd->bhqk", q, k) + bias
  s = softcap * np.tanh(s / softcap)
  s = np.where(allowed, s, -np.inf)
  return s.max(axis=(2, 3))


@pytest.mark.parametrize("impl", ["blockwise", "pallas_triton", "pallas_tpu", "naive"])
def test_against_an_independent_float64_numpy_reference(impl):
  B, H, Hkv, S, D = 2, 4, 2, 40, 16
  q, k, v = _util.random_qkv(3, B, H, Hkv, S, S, D, D, jnp.float32)
  rng = np.random.default_rng(0)
  bias = rng.standard_normal((1, H, S, S)).astype(np.float32)
  seg = np.zeros((B, S), np.int32)
  seg[0, 17:] = 1
  seg[1, 30:] = 1
  mask = np.ones((B, H, S, S), bool)
  mask[1, 2] = False  # (b=1, h=2) attends nothing: -inf
  i, j = np.arange(S)[:, None], np.arange(S)[None, :]
  allowed = (j <= i) & (seg[:, None, :, None] == seg[:, None, None, :]) & mask
  want = _numpy_max_logits(q, k, scale=D ** -0.5, bias=bias, allowed=allowed, softcap=3.0)
  assert np.isneginf(want[1, 2]) and np.isfinite(want[0]).all()
  out, got = flashvjp.flash_attention(
      q, k, v, causal=True, segment_ids=jnp.asarray(seg), mask=jnp.asarray(mask),
      bias=jnp.asarray(bias), score_mod=flashvjp.softcap(3.0), implementation=impl,
      block_q=16, block_kv=16, return_max_logits=True)
  assert got.shape == (B, H) and got.dtype == jnp.float32
  assert not np.isnan(np.asarray(out)).any()
  _assert_max_close(got, want, jnp.float32, impl)


def _case_max(impl, name, dtype, **extra):
  q, k, v, _, d, with_diff = base.case_problem(name, dtype)
  kw = with_diff(d, **extra)
  if impl == "naive":
    q, k, v, d = _util.as64((q, k, v, d))
    kw = with_diff(d, **extra)
  else:
    kw.update(block_q=base.BLOCK_Q, block_kv=base.BLOCK_KV)
  return flashvjp.flash_attention(q, k, v, implementation=impl, return_max_logits=True, **kw)[1]


@pytest.mark.parametrize("name", sorted(base.CASES))
def test_every_feature_blockwise(name):
  _assert_max_close(_case_max("blockwise", name, jnp.float32), _case_max("naive", name, None),
                    jnp.float32, "blockwise")


KERNEL_CASES = ["causal", "window", "segment_pair", "mask_dense", "bias_full", "relative_bias",
                "dropout", "mask_mod_block_mask", "sinks_empty_rows", "combo"]


@pytest.mark.parametrize("name", KERNEL_CASES)
@pytest.mark.parametrize("impl", ["pallas_triton", "pallas_tpu"])
def test_every_feature_kernels(impl, name):
  _assert_max_close(_case_max(impl, name, jnp.float32), _case_max("naive", name, None),
                    jnp.float32, impl)


@pytest.mark.parametrize("name", ["causal", "segments", "bias_full", "sinks_empty_rows"])
def test_mosaic_gpu_forward(name):
  _assert_max_close(_case_max("pallas_mosaic_gpu", name, jnp.bfloat16),
                    _case_max("naive", name, None), jnp.bfloat16, "pallas_mosaic_gpu")


def test_no_gradient_and_forward_mode_and_traced_scale():
  q, k, v = _util.random_qkv(1, 1, 2, 2, 24, 24, 8, 8, jnp.float32)
  f = lambda q, k, s: flashvjp.flash_attention(q, k, v, causal=True, scale=s,
                                               implementation="blockwise",
                                               return_max_logits=True)[1]
  s = jnp.float32(0.3)
  gq, gk, gs = jax.grad(lambda *a: f(*a).sum(), argnums=(0, 1, 2))(q, k, s)
  assert not np.asarray(gq).any() and not np.asarray(gk).any() and float(gs) == 0.0
  ml, t = jax.jvp(f, (q, k, s), (q, k, jnp.float32(1.0)))
  assert not np.asarray(t).any()
  i, j = np.arange(24)[:, None], np.arange(24)[None, :]
  want = _numpy_max_logits(q, k, scale=0.3, bias=0.0, allowed=j <= i, softcap=1e30)
  _assert_max_close(ml, want, jnp.float32, "blockwise")
  # with return_lse too: (out, lse, max_logits)
  res = flashvjp.flash_attention(q, k, v, return_lse=True, return_max_logits=True)
  assert len(res) == 3 and res[2].shape == (1, 2)
  with pytest.raises(TypeError, match="return_max_logits"):
    flashvjp.flash_attention(q, k, v, return_max_logits="yes")


SEQ = P(None, None, "sp", None)


@pytest.fixture(scope="module")
def mesh():
  return Mesh(np.array(jax.devices()[:4]), ("sp",))


def _sharded_problem():
  q, k, v = _util.random_qkv(5, 1, 4, 4, 128, 128, 16, 16, jnp.float32)
  kw = dict(causal=True, window=(40, 0), score_mod=flashvjp.softcap(4.0))
  want = flashvjp.flash_attention(*_util.as64((q, k, v)), implementation="naive",
                                  return_max_logits=True, **kw)[1]
  return (q, k, v), kw, want


@pytest.mark.parametrize("impl", ["blockwise", "pallas_triton"])
@pytest.mark.parametrize("strategy", ["ring", "ulysses", "all_gather"])
def test_plain_jit_sequence_sharded(mesh, strategy, impl):
  (q, k, v), kw, want = _sharded_problem()
  xs = [jax.device_put(x, NamedSharding(mesh, SEQ)) for x in (q, k, v)]
  d = flashvjp.explain(*xs, context_parallel=strategy, implementation=impl, **kw)
  assert d.context_parallel is not None and d.context_parallel.name == strategy, str(d)
  f = jax.jit(lambda q, k, v: flashvjp.flash_attention(
      q, k, v, context_parallel=strategy, implementation=impl, return_max_logits=True, **kw))
  _assert_max_close(f(*xs)[1], want, jnp.float32, impl)


def test_ring_attention_and_sharded_attention(mesh):
  from flashvjp.distributed import _compat
  (q, k, v), kw, want = _sharded_problem()
  fn = _compat.shard_map(
      lambda q, k, v: flashvjp.ring_attention(q, k, v, axis_name="sp", return_max_logits=True,
                                              implementation="blockwise", **kw),
      mesh=mesh, in_specs=(SEQ,) * 3, out_specs=(SEQ, P()), check_vma=False)
  _assert_max_close(fn(q, k, v)[1], want, jnp.float32, "blockwise")
  out, lse, ml = flashvjp.sharded_attention(q, k, v, mesh=mesh, seq_axis="sp", return_lse=True,
                                            return_max_logits=True, **kw)
  _assert_max_close(ml, want, jnp.float32, "blockwise")
