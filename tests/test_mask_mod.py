"""mask_mod, BlockMask, the built-in mask_mods, and attention sinks.

Independent references: every mask_mod is compared with the same mask written densely
by hand in numpy (and given as `mask=`), block classes with the dense mask's per-block
any / all, and sinks with a float64 attention that appends one key per head whose logit
is sinks[h] and whose value is zero. Every implementation's mask_mod and sinks cases
against float64 naive live in the shared base (tests/attention_base.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import flashvjp
from flashvjp import _mask
from flashvjp import _mask_mod
from tests import _util

B, H, S, D = 2, 4, 50, 8


def _grid(B_, H_, Sq, Skv):
  b = np.arange(B_)[:, None, None, None]
  h = np.arange(H_)[None, :, None, None]
  q = np.arange(Sq)[None, None, :, None]
  k = np.arange(Skv)[None, None, None, :]
  return b, h, q, k


def _docs():
  return np.array([[0] * 12 + [1] * 20 + [2] * 18, [0] * 30 + [3] * 20], np.int32)


# name -> (mask_mod, the same mask by hand in numpy, [B, H|1, S, S])
def _builtins():
  b, h, q, k = _grid(B, 1, S, S)
  lengths = np.array([7, 33], np.int32)
  docs = _docs()
  return {
      "prefix_lm": (flashvjp.prefix_lm(jnp.asarray(lengths)),
                    (k <= q) | (k < lengths[b])),
      "prefix_lm_int": (flashvjp.prefix_lm(9), (k <= q) | (k < 9) | (b < 0)),
      "chunked": (flashvjp.chunked(16), (q // 16 == k // 16) & (k <= q) | (b < 0)),
      "chunked_bidirectional": (flashvjp.chunked(16, causal=False), (q // 16 == k // 16) | (b < 0)),
      "sliding_window_with_global": (
          flashvjp.sliding_window_with_global(5, 3),
          ((q - k < 5) & (k <= q) | (k < 3) & (k <= q) | (q < 3) & (k <= q)) | (b < 0)),
      "sliding_window_with_global_bidirectional": (
          flashvjp.sliding_window_with_global(5, 3, causal=False),
          (np.abs(q - k) < 5) | (k < 3) | (q < 3) | (b < 0)),
      "document_causal": (flashvjp.document_causal(jnp.asarray(docs)),
                          (docs[:, None, :, None] == docs[:, None, None, :]) & (k <= q)),
  }


BUILTINS = _builtins()


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtin_equals_its_hand_written_dense_mask(name):
  mod, dense = BUILTINS[name]
  b, h, q, k = _grid(B, H, S, S)
  got = _mask_mod.apply(_mask_mod.convert(mod)[0], _mask_mod.convert(mod)[1], *map(jnp.asarray, (b, h, q, k)))
  np.testing.assert_array_equal(np.broadcast_to(np.asarray(got), (B, H, S, S)),
                                np.broadcast_to(dense, (B, H, S, S)))


@pytest.mark.parametrize("impl", ["blockwise", "naive"])
@pytest.mark.parametrize("name", ["prefix_lm", "document_causal", "sliding_window_with_global"])
def test_mask_mod_equals_the_dense_mask_forward_and_gradients(name, impl):
  """Forward, lse and gradients with mask_mod == with the hand-written dense mask (float64)."""
  mod, dense = BUILTINS[name]
  q, k, v = _util.random_qkv(3, B, H, 2, S, S, D, dtype=jnp.float64)

  def f(q, k, v, **kw):
    out, lse = flashvjp.flash_attention(q, k, v, return_lse=True, implementation=impl, block_q=16,
                                        block_kv=8, **kw)
    return jnp.sum(out * jnp.cos(out)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)

  got = jax.value_and_grad(lambda *a: f(*a, mask_mod=mod), (0, 1, 2), has_aux=True)(q, k, v)
  ref = jax.value_and_grad(lambda *a: f(*a, mask=jnp.asarray(dense)), (0, 1, 2), has_aux=True)(q, k, v)
  _util.assert_close(got, ref, jnp.float64, what=f"{impl}/{name}")


def _dense_classes(dense, bq, bk):
  """EMPTY / PARTIAL / FULL per block from a dense [B', H', Sq, Skv] bool mask (numpy)."""
  Bm, Hm, Sq, Skv = dense.shape
  nq, nk = -(-Sq // bq), -(-Skv // bk)
  out = np.zeros((Bm, Hm, nq, nk), np.int8)
  for i in range(nq):
    for j in range(nk):
      blk = dense[:, :, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
      out[:, :, i, j] = np.where(blk.all(axis=(2, 3)), _mask.FULL,
                                 np.where(blk.any(axis=(2, 3)), _mask.PARTIAL, _mask.EMPTY))
  return out


@pytest.mark.parametrize("blocks", [(16, 16), (8, 32), (7, 5), (64, 64)])
@pytest.mark.parametrize("name", ["prefix_lm", "chunked", "document_causal"])
def test_block_classes_match_the_dense_masks_any_and_all(name, blocks):
  mod, dense = BUILTINS[name]
  bm = flashvjp.make_block_mask(mod, B, H, S, S, *blocks)
  want = _dense_classes(np.broadcast_to(dense, (B,) + dense.shape[1:]), min(blocks[0], S),
                        min(blocks[1], S))
  got = np.asarray(bm.classes)
  assert got.shape[1] == 1, "a mask_mod that ignores h gets a broadcast head axis"
  np.testing.assert_array_equal(np.broadcast_to(got, (B,) + got.shape[1:]), want)


def test_block_mask_reads_batch_and_head_when_the_mask_mod_does():
  mod = lambda b, h, q, k: jnp.abs(q - k) <= 2 + 5 * h + b
  bm = flashvjp.make_block_mask(mod, B, H, S, S, 8, 8)
  b, h, q, k = _grid(B, H, S, S)
  assert bm.classes.shape == (B, H, 7, 7)
  np.testing.assert_array_equal(np.asarray(bm.classes), _dense_classes(np.abs(q - k) <= 2 + 5 * h + b, 8, 8))
  assert 0.0 < float(bm.fraction_computed()) < 1.0


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.integers(1, 12), st.integers(1, 12),
       st.integers(1, 12), st.integers(1, 12), st.integers(0, 2**31 - 1))
def test_resampled_classes_are_exact_or_conservative(sq, skv, bq, bk, nbq, nbk, seed):
  """Resampling a random mask's classes to other blocks: never EMPTY where something is
  allowed, never FULL where something is not; exact when the block sizes divide."""
  dense = np.random.default_rng(seed).random((1, 1, sq, skv)) < 0.5
  dense[:, :, : sq // 2, : skv // 3] = True  # some full blocks
  dense[:, :, sq // 2:, skv // 2:] = False  # some empty blocks
  src = _dense_classes(dense, bq, bk)
  got = np.asarray(_mask.resample_classes(jnp.asarray(src), bq, bk, nbq, nbk, sq, skv,
                                          -(-sq // nbq), -(-skv // nbk)))
  want = _dense_classes(dense, nbq, nbk)
  assert not ((got == _mask.EMPTY) & (want != _mask.EMPTY)).any()
  assert not ((got == _mask.FULL) & (want != _mask.FULL)).any()
  if nbq % bq == 0 and nbk % bk == 0:  # each new block is a union of whole source blocks
    np.testing.assert_array_equal(got, want)


def test_block_mask_at_other_blocks_gives_the_same_result_and_jits():
  mod, dense = BUILTINS["document_causal"]
  q, k, v = _util.random_qkv(4, B, H, 2, S, S, D, dtype=jnp.float64)
  ref = flashvjp.flash_attention(q, k, v, mask=jnp.asarray(dense), implementation="blockwise")

  @jax.jit
  def step(q, k, v, docs):
    m = flashvjp.document_causal(docs)
    bm = flashvjp.make_block_mask(m, B, H, S, S, 32, 8)  # built inside the step, per batch
    return flashvjp.flash_attention(q, k, v, mask_mod=m, block_mask=bm, implementation="blockwise",
                                    block_q=16, block_kv=16)

  _util.assert_close(step(q, k, v, jnp.asarray(_docs())), ref, jnp.float64)


def test_block_mask_skips_empty_blocks():
  """A mask_mod that allows only the first kv block: the blockwise loop visits one block per row."""
  mod = lambda b, h, q, k: k < 16
  q, k, v = _util.random_qkv(5, 1, 2, 2, 64, 64, D)
  f = lambda q, k, v: flashvjp.flash_attention(q, k, v, mask_mod=mod, implementation="blockwise",
                                               block_q=16, block_kv=16)
  bm = flashvjp.make_block_mask(mod, 1, 2, 64, 64, 16, 16)
  assert float(bm.fraction_computed()) == 0.25 and float(bm.fraction_partial()) == 0.0
  ref = flashvjp.flash_attention(q[:, :, :, :], k[:, :, :16], v[:, :, :16], implementation="naive")
  _util.assert_close(f(q, k, v), ref, jnp.float32)


def test_closure_over_a_traced_array_inside_jit_and_vmap():
  q, k, v = _util.random_qkv(6, B, H, 2, S, S, D, dtype=jnp.float64)

  @jax.jit
  def f(q, k, v, lengths):
    return flashvjp.flash_attention(q, k, v, mask_mod=flashvjp.prefix_lm(lengths),
                                    implementation="blockwise", block_q=16, block_kv=16)

  _, dense = BUILTINS["prefix_lm"]
  ref = flashvjp.flash_attention(q, k, v, mask=jnp.asarray(dense), implementation="naive")
  _util.assert_close(f(q, k, v, jnp.asarray([7, 33], jnp.int32)), ref, jnp.float64)
  # vmap over a stack of prefix lengths (one mask per vmapped call)
  outs = jax.vmap(f, (None, None, None, 0))(q, k, v, jnp.asarray([[7, 33], [7, 33]], jnp.int32))
  _util.assert_close(outs, jnp.stack([ref, ref]), jnp.float64)


def test_mask_mod_and_dense_mask_combine_by_and():
  q, k, v = _util.random_qkv(7, B, H, 2, S, S, D, dtype=jnp.float64)
  mod, dense = BUILTINS["chunked"]
  extra = np.random.default_rng(0).random((B, 1, S, S)) > 0.3
  got = flashvjp.flash_attention(q, k, v, mask_mod=mod, mask=jnp.asarray(extra), window=(6, None),
                                 implementation="blockwise", block_q=16, block_kv=16)
  _, _, qq, kk = _grid(B, 1, S, S)
  both = dense & extra & (kk >= qq - 6)
  ref = flashvjp.flash_attention(q, k, v, mask=jnp.asarray(both), implementation="naive")
  _util.assert_close(got, ref, jnp.float64)


@pytest.mark.parametrize("mod, exc, match", [
    (lambda b, h, q, k: q - k, TypeError, "mask_mod must return bool"),
    (lambda b, h, q, k: k <= jnp.max(q), ValueError, "mask_mod must be elementwise.*reduce_max"),
    (lambda b, h, q, k: jnp.cumsum(k, axis=-1) > 3, ValueError, "mask_mod must be elementwise"),
    (lambda b, h, q, k: (q > k) if q > 2 else (q < k), ValueError, "mask_mod raised .* traced"),
    (lambda b, h, q, k: jnp.ones((3, 3), bool), ValueError, "broadcastable"),
    (3, TypeError, "mask_mod must be callable"),
])
def test_mask_mod_errors(mod, exc, match):
  q = jnp.ones((1, 2, 8, 4))
  with pytest.raises(exc, match=match):
    flashvjp.flash_attention(q, q, q, mask_mod=mod)


def test_block_mask_errors():
  q = jnp.ones((1, 2, 8, 4))
  causal = lambda b, h, qi, ki: qi >= ki
  with pytest.raises(ValueError, match="block_mask needs the mask_mod"):
    flashvjp.flash_attention(q, q, q, block_mask=flashvjp.make_block_mask(causal, 1, 2, 8, 8))
  with pytest.raises(ValueError, match="block_mask was made for"):
    flashvjp.flash_attention(q, q, q, mask_mod=causal,
                             block_mask=flashvjp.make_block_mask(causal, 1, 2, 8, 9))
  with pytest.raises(TypeError, match="block_mask must be a flashvjp.BlockMask"):
    flashvjp.flash_attention(q, q, q, mask_mod=causal, block_mask=jnp.ones((1, 1, 1, 1), jnp.int8))
  with pytest.raises(ValueError, match="block_q must be a positive int"):
    flashvjp.make_block_mask(causal, 1, 2, 8, 8, block_q=0)


def test_memory_with_a_mask_mod_is_linear_in_seq_and_no_seq_squared_array():
  """Compiled temp bytes of fwd+bwd with a mask_mod (blockwise) at 8k and 16k: ~2x, not 4x;
  and no value of size seq_q * seq_kv anywhere in the jaxpr (classification included)."""
  mod = flashvjp.chunked(1024)

  def loss(q, k, v):
    return flashvjp.flash_attention(q, k, v, mask_mod=mod, implementation="blockwise").sum()

  def temp(seq):
    x = jax.ShapeDtypeStruct((1, 2, seq, 32), jnp.float32)
    g = jax.grad(loss, (0, 1, 2))
    return jax.jit(g).lower(x, x, x).compile().memory_analysis().temp_size_in_bytes, \
        jax.make_jaxpr(g)(x, x, x)

  (t8, _), (t16, jaxpr) = temp(8192), temp(16384)
  assert t16 < 2.6 * t8, (t8, t16)
  assert t16 < 64 * 2**20, t16

  def avals(j):
    for e in j.eqns:
      for v in e.outvars:
        yield v.aval
      for p in e.params.values():
        for sub in (p if isinstance(p, (tuple, list)) else (p,)):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            yield from avals(inner)

  biggest = max(int(np.prod(a.shape)) for a in avals(jaxpr.jaxpr) if hasattr(a, "shape"))
  assert biggest < 16384 * 16384 // 16, biggest


# ---- sinks ---------------------------------------------------------------------------

def _sink_reference(q, k, v, sinks, mask):
  """float64 attention with one extra key per head: logit sinks[h], value 0."""
  G = q.shape[1] // k.shape[1]
  k, v = jnp.repeat(k, G, axis=1), jnp.repeat(v, G, axis=1)
  s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(q.shape[-1])
  s = jnp.where(mask, s, -jnp.inf)
  sink_col = jnp.broadcast_to(sinks[None, :, None, None], s.shape[:3] + (1,))
  s = jnp.concatenate([s, sink_col], axis=-1)
  lse = jax.nn.logsumexp(s, axis=-1)
  p = jnp.exp(s - lse[..., None])
  vz = jnp.concatenate([v, jnp.zeros(v.shape[:2] + (1, v.shape[3]), v.dtype)], axis=2)
  return jnp.einsum("bhqk,bhkd->bhqd", p, vz), lse


@pytest.mark.parametrize("impl", ["blockwise", "naive", "pallas"])
def test_sinks_against_an_appended_key(impl):
  q, k, v = _util.random_qkv(8, B, H, 2, 24, 24, D, dtype=jnp.float64)
  sinks = jnp.asarray([0.3, -2.0, 1.7, 0.0], jnp.float64)
  mask = np.tril(np.ones((24, 24), bool))[None, None].repeat(B, 0)
  mask[1, :, 5] = False  # an empty row: out 0, lse = sinks[h]
  w = jax.random.normal(jax.random.key(0), (B, H, 24, D), jnp.float64)

  def loss(fn, q, k, v, sinks):
    out, lse = fn(q, k, v, sinks)
    return jnp.sum(out * w) + jnp.sum(jnp.sin(lse)), (out, lse)

  got_fn = lambda q, k, v, s: flashvjp.flash_attention(
      q, k, v, sinks=s, mask=jnp.asarray(mask), return_lse=True, implementation=impl, block_q=8,
      block_kv=8)
  ref_fn = lambda q, k, v, s: _sink_reference(q, k, v, s, jnp.asarray(mask))
  got = jax.value_and_grad(lambda *a: loss(got_fn, *a), (0, 1, 2, 3), has_aux=True)(q, k, v, sinks)
  ref = jax.value_and_grad(lambda *a: loss(ref_fn, *a), (0, 1, 2, 3), has_aux=True)(q, k, v, sinks)
  _util.assert_close(got, ref, jnp.float64, what=f"sinks/{impl}")
  (_, (out, lse)), grads = got
  np.testing.assert_array_equal(np.asarray(out[1, :, 5]), 0.0)
  np.testing.assert_allclose(np.asarray(lse[1, :, 5]), np.asarray(sinks))
  assert all(np.isfinite(np.asarray(g)).all() for g in grads)


def test_sinks_errors():
  q = jnp.ones((1, 2, 8, 4))
  with pytest.raises(ValueError, match=r"sinks must have shape \[num_heads\] = \[2\]"):
    flashvjp.flash_attention(q, q, q, sinks=jnp.ones(3))
  with pytest.raises(TypeError, match="sinks must be a float array"):
    flashvjp.flash_attention(q, q, q, sinks=jnp.ones(2, jnp.int32))


def test_array_literals_built_inside_the_function_under_jit():
  """A mask_mod / score_mod that builds its array inside its body, first traced inside the
  caller's jit: its constant stays concrete, so the elementwise check reads its values
  (a staged constant was once replaced by zeros there, rejecting a valid mask_mod)."""
  q, k, v = _util.random_qkv(9, B, H, 2, 37, 37, D, dtype=jnp.float64)
  mm = lambda b, h, qi, kv: kv < jnp.asarray([7, 30])[b]
  sm = lambda s, b, h, qi, kv: s + jnp.asarray([0.5, -0.25, 1.0, 0.0])[h]
  f = jax.jit(lambda q, k, v: flashvjp.flash_attention(q, k, v, mask_mod=mm, score_mod=sm,
                                                       implementation="blockwise"))
  _, _, qq, kk = _grid(B, 1, 37, 37)
  dense = kk < np.asarray([7, 30])[:, None, None, None]
  bias = jnp.asarray([0.5, -0.25, 1.0, 0.0])[None, :, None, None]
  ref = flashvjp.flash_attention(q, k, v, mask=jnp.asarray(dense), bias=jnp.broadcast_to(bias, (1, H, 37, 37)),
                                 implementation="naive")
  _util.assert_close(f(q, k, v), ref, jnp.float64)


_S = jax.ShapeDtypeStruct
_TILE_IDX = (_S((2, 1, 1, 1), jnp.int32), _S((1, 2, 1, 1), jnp.int32),
             _S((1, 1, 3, 1), jnp.int32), _S((1, 1, 1, 4), jnp.int32))


@pytest.mark.parametrize("name, mod, proven", [
    ("chunked", flashvjp.chunked(16), True),
    ("sliding_window_with_global", flashvjp.sliding_window_with_global(8, 2), True),
    ("prefix_lm (array)", flashvjp.prefix_lm(jnp.asarray([3, 5])), True),
    ("document_causal", flashvjp.document_causal(jnp.zeros((2, 64), jnp.int32)), True),
    ("flipped", lambda b, h, q, k: jnp.flip(q) >= k, False),
    ("summed", lambda b, h, q, k: k <= q + jnp.sum(b), False),
    ("shape-dependent", lambda b, h, q, k: (k <= q) if q.ndim == 0 else (k < q), False),
])
def test_provably_elementwise_accepts_only_what_it_can_prove(name, mod, proven):
  """The structural proof that lets `check` skip evaluating a mask_mod: it accepts
  pointwise index arithmetic and table lookups, and nothing that moves entries or differs
  from the scalar form (those go to the numeric check)."""
  fn, _ = _mask_mod.convert(mod)
  tile = jax.make_jaxpr(mod)(*_TILE_IDX)
  assert flashvjp._score_mod.provably_elementwise(tile.jaxpr, fn._jaxpr, 4) is proven, name


def test_unprovable_mask_mods_are_still_checked_numerically():
  """Not provable -> evaluated: one that differs from its scalar form is still rejected."""
  q = jnp.ones((1, 2, 8, 4))
  bad = lambda b, h, qi, ki: (ki <= qi) if qi.ndim == 0 else (ki < qi)
  with pytest.raises(ValueError, match="mask_mod must be elementwise"):
    flashvjp.flash_attention(q, q, q, mask_mod=bad)
  rev = lambda b, h, qi, ki: jnp.flip(qi) >= ki
  with pytest.raises(ValueError, match="mask_mod must be elementwise"):
    flashvjp.flash_attention(q, q, q, mask_mod=rev)
