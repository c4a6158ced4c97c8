"""Bottom-right causal alignment (`causal="bottom_right"`): kv_pos <= q_pos + seq_kv - seq_q.

What chunked prefill and decoding against a KV cache need (FlashAttention's causal, PyTorch's
causal_lower_right). The reference is float64 naive attention with the same mask written out
densely in numpy: `flashvjp.testing.check` gives `fn` (bottom-right, plus that mask, a
no-op for a correct implementation) and the reference (the mask alone) the same kwargs, so
the check is independent of how flashvjp translates the option. Forward, lse and every
gradient; every backend (kernels in interpret mode); under plain-jit sequence sharding
(ring, Ulysses, all-gather) and `ring_attention` with unequal q / kv lengths.
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


def _bottom_right(Sq, Skv):
  return jnp.asarray(np.arange(Skv)[None, :] <= np.arange(Sq)[:, None] + (Skv - Sq))


def _fn(impl, **fixed):
  def fn(q, k, v, **kw):
    return flashvjp.flash_attention(q, k, v, causal="bottom_right", implementation=impl,
                                    **fixed, **kw)
  return fn


@pytest.mark.parametrize("impl,Sq,Skv", [
    ("blockwise", 20, 52), ("blockwise", 52, 20), ("blockwise", 33, 33),
    ("pallas_triton", 20, 52), ("pallas_triton", 52, 20),
    ("pallas_tpu", 20, 52), ("pallas_tpu", 52, 20)])
def test_every_backend_against_the_dense_mask(impl, Sq, Skv):
  q, k, v = _util.random_qkv(0, 2, 4, 2, Sq, Skv, 16, 8, jnp.float32)
  extra = {} if impl == "blockwise" else dict(block_q=16, block_kv=16)
  rep = testing.check(_fn(impl, **extra), query=q, key=k, value=v, mask=_bottom_right(Sq, Skv),
                      return_lse=True, tolerance=_check.tolerance(jnp.float32, impl))
  assert rep.passed, str(rep)
  out, lse = flashvjp.flash_attention(q, k, v, causal="bottom_right", return_lse=True,
                                      implementation=impl, **extra)
  if Sq > Skv:  # the first Sq - Skv rows see nothing: out 0, lse -inf, never NaN
    assert np.isneginf(np.asarray(lse)[:, :, : Sq - Skv]).all()
    assert not np.asarray(out)[:, :, : Sq - Skv].any()
  else:
    assert np.isfinite(np.asarray(lse)).all()


def test_mosaic_gpu_and_window_and_the_drop_in():
  q, k, v = _util.random_qkv(1, 1, 2, 2, 40, 72, 64, 64, jnp.bfloat16)
  rep = testing.check(_fn("pallas_mosaic_gpu"), query=q, key=k, value=v,
                      mask=_bottom_right(40, 72), return_lse=True,
                      tolerance=_check.tolerance(jnp.bfloat16, "pallas_mosaic_gpu"))
  assert rep.passed, str(rep)
  # a window stays top-left and is ANDed: kv in [q - 10, q + 32 + 3] and kv <= q + 32
  q, k, v = _util.random_qkv(2, 1, 2, 2, 40, 72, 16, 16, jnp.float32)
  i, j = np.arange(40)[:, None], np.arange(72)[None, :]
  m = jnp.asarray((j <= i + 32) & (j >= i - 10) & (j <= i + 35))
  rep = testing.check(_fn("blockwise", window=(10, 35)), query=q, key=k, value=v, mask=m)
  assert rep.passed, str(rep)
  t = lambda x: jnp.swapaxes(x, 1, 2)
  got = flashvjp.dot_product_attention(t(q), t(k), t(v), is_causal="bottom_right")
  want = flashvjp.flash_attention(q, k, v, mask=_bottom_right(40, 72), implementation="naive")
  np.testing.assert_allclose(np.asarray(got), np.asarray(t(want)), atol=2e-6, rtol=2e-6)
  # top_left is True; equal lengths make the two the same
  same = [flashvjp.flash_attention(q[:, :, :32], k[:, :, :32], v[:, :, :32], causal=c)
          for c in (True, "top_left", "bottom_right")]
  for x in same[1:]:
    np.testing.assert_array_equal(np.asarray(x), np.asarray(same[0]))
  with pytest.raises(TypeError, match="causal must be a bool, 'top_left' or 'bottom_right'"):
    flashvjp.flash_attention(q, k, v, causal="lower_right")


@pytest.fixture(scope="module")
def mesh():
  return Mesh(np.array(jax.devices()[:4]), ("sp",))


SEQ = P(None, None, "sp", None)


@pytest.mark.parametrize("strategy", ["ring", "ulysses", "all_gather"])
def test_plain_jit_sequence_sharded(mesh, strategy):
  q, k, v = _util.random_qkv(3, 1, 4, 4, 64, 128, 16, 16, jnp.float32)
  xs = [jax.device_put(x, NamedSharding(mesh, SEQ)) for x in (q, k, v)]
  d = flashvjp.explain(*xs, causal="bottom_right", context_parallel=strategy)
  assert d.context_parallel is not None and d.context_parallel.name == strategy, str(d)
  # the mask with its head dim full (Ulysses splits a pair array by heads)
  m = jnp.broadcast_to(_bottom_right(64, 128), (1, 4, 64, 128))
  rep = testing.check(_fn(None, context_parallel=strategy), query=xs[0], key=xs[1],
                      value=xs[2], mask=m)
  assert rep.passed, str(rep)


def test_ring_attention_with_unequal_lengths(mesh):
  from flashvjp.distributed import _compat
  q, k, v = _util.random_qkv(4, 1, 2, 2, 64, 128, 16, 16, jnp.float32)
  ring = _compat.shard_map(
      lambda q, k, v: flashvjp.ring_attention(q, k, v, axis_name="sp", causal="bottom_right",
                                              implementation="blockwise"),
      mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ, check_vma=False)
  want = flashvjp.flash_attention(*_util.as64((q, k, v)), mask=_bottom_right(64, 128),
                                  implementation="naive")
  np.testing.assert_allclose(np.asarray(ring(q, k, v), np.float64), np.asarray(want),
                             atol=2e-6, rtol=2e-6)
