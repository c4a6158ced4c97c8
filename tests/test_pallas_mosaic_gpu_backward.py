"""The Mosaic-GPU backward kernels under GPU interpret mode on CPU (race detection on).

dq, dk, dv of `flashvjp.pallas.mosaic_gpu.backward` against autodiff of float64 naive
attention (the forward residuals out / lse come from that float64 reference, so these
tests need no Mosaic-GPU forward), for plain, causal, window, GQA / MQA, head dims 64 / 128
(and a padded 80), sequence lengths that are not multiples of the 64-blocks, an lse
cotangent, empty rows and kv blocks no query sees; then segment ids, a dense mask, a bias
with dbias, dropout (and its hash split), Dv != D under jit, global offsets (ring chunk
pairs), a score_mod with a differentiable const, a mask_mod, determinism. Every run asserts
that the interpreter found no race. Mutation tests remove one synchronisation step each
(test-only flag) and assert that the interpreter reports it. What is not supported is
refused by name. A deviceless sm_90a compile (the CUDA plugin's Mosaic compiler and ptxas,
no GPU) checks for register spills and shared memory.
"""
import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from flashvjp import _dropout
from flashvjp import _mask_mod
from flashvjp import reference
from flashvjp._config import AttentionConfig
from flashvjp._config import BlockSizes
from flashvjp.pallas._common import Geometry
from flashvjp.pallas.mosaic_gpu import _compat
from tests import _sass
from tests import _util

_WHY = _compat.unavailable()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"Mosaic-GPU Pallas: {_WHY}")

if _WHY is None:
  from flashvjp.pallas.mosaic_gpu import _ring
  from flashvjp.pallas.mosaic_gpu import _tile
  from flashvjp.pallas.mosaic_gpu import backward as mgpu_backward


def _cfg(Sq, Skv, D, causal=False, window=None, **kw):
  kw.setdefault("dropout_rate", 0.0)
  return AttentionConfig(scale=D ** -0.5, causal=causal, window=window, seq_q=Sq, seq_kv=Skv,
                         blocks=BlockSizes(), interpret=True, **kw)


def _inputs(B, H, Hkv, Sq, Skv, D, dtype, seed=0, Dv=None):
  Dv = D if Dv is None else Dv
  q, k, v = _util.random_qkv(seed, B, H, Hkv, Sq, Skv, D, Dv, dtype=dtype)
  kd, kl = jax.random.split(jax.random.key(seed + 1))
  do = jax.random.normal(kd, (B, H, Sq, Dv), jnp.float64).astype(dtype)
  dlse = jax.random.normal(kl, (B, H, Sq), jnp.float64).astype(jnp.float32)
  return q, k, v, do, dlse


def _reference(cfg, q, k, v, do, dlse, segs=(None, None), seed=None, mask=None):
  """(out, lse, (dq, dk, dv)) of float64 naive attention; dlse None: no lse cotangent."""
  f64 = _util.as64
  fwd = lambda q, k, v: reference.attention(cfg, q, k, v, None, mask, *segs, seed, ())
  (out, lse), vjp = jax.vjp(fwd, f64(q), f64(k), f64(v))
  lse_ct = jnp.zeros_like(lse) if dlse is None else f64(dlse)
  return out, lse, vjp((f64(do), lse_ct))


def _run(cfg, q, k, v, do, dlse, out, lse, segs=(None, None), seed=None, mask=None):
  _compat.reset_interpret_state()
  got = mgpu_backward.backward(cfg, q, k, v, None, mask, *segs, seed, (),
                               out.astype(q.dtype), lse.astype(jnp.float32), do, dlse)
  got = jax.block_until_ready(got)
  assert not _compat.interpret_races_found(), "GPU interpret mode reported a race"
  return got


CASES = {
    # name: (B, H, Hkv, Sq, Skv, D, dtype, causal, window, with dlse)
    "plain_d64": (1, 1, 1, 128, 128, 64, jnp.bfloat16, False, None, False),
    "causal_gqa_ragged_dlse": (1, 4, 2, 200, 136, 64, jnp.bfloat16, True, None, True),
    "window_mqa_d128_f16": (1, 2, 1, 96, 160, 128, jnp.float16, False, (40, 10), False),
    "causal_d128_full_blocks": (1, 2, 1, 192, 192, 128, jnp.bfloat16, True, None, False),
    "padded_head_batch": (2, 1, 1, 130, 70, 80, jnp.bfloat16, False, None, True),
    "causal_kv_blocks_unseen": (1, 1, 1, 64, 192, 64, jnp.float16, True, None, False),
    "empty_rows": (1, 2, 1, 128, 128, 64, jnp.bfloat16, False, (None, -70), True),
    "mqa_h4_window_causal": (1, 4, 1, 130, 130, 64, jnp.bfloat16, True, (70, None), False),
    # above head dim 128 two programs share each block's output columns (`_parts`)
    "causal_gqa_d256_dlse": (1, 2, 1, 130, 100, 256, jnp.bfloat16, True, None, True),
    "padded_d192_f16": (1, 1, 1, 64, 96, 192, jnp.float16, False, None, False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_grads_match_float64_autodiff(name):
  B, H, Hkv, Sq, Skv, D, dtype, causal, window, with_dlse = CASES[name]
  cfg = _cfg(Sq, Skv, D, causal, window)
  q, k, v, do, dlse = _inputs(B, H, Hkv, Sq, Skv, D, dtype)
  dlse = dlse if with_dlse else None
  out, lse, ref = _reference(cfg, q, k, v, do, dlse)
  if name == "empty_rows":
    assert bool(jnp.any(jnp.isneginf(lse))), "the case must have empty rows"
  dq, dk, dv, dbias, dconsts = _run(cfg, q, k, v, do, dlse, out, lse)
  assert dbias is None and dconsts == ()
  assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
  assert dq.dtype == dk.dtype == dv.dtype == jnp.dtype(dtype)
  _util.assert_close((dq, dk, dv), ref, dtype, what=f"mosaic_gpu backward {name}")


def test_segment_ids():
  """Packed documents (ids not aligned to the 64-blocks), causal, GQA, ragged lengths, dlse;
  a q position whose segment has no kv position gives an empty row."""
  B, H, Hkv, Sq, Skv, D = 2, 2, 1, 150, 150, 64
  cfg = _cfg(Sq, Skv, D, causal=True)
  q, k, v, do, dlse = _inputs(B, H, Hkv, Sq, Skv, D, jnp.bfloat16, seed=5)
  pos = jnp.arange(Sq, dtype=jnp.int32)
  q_seg = jnp.stack([pos // 40, jnp.where(pos < 90, 0, 1)])
  kv_seg = q_seg.at[1, 90:100].set(7)  # q 90..99 (segment 1): no kv of theirs before them
  segs = (q_seg, kv_seg)
  out, lse, ref = _reference(cfg, q, k, v, do, dlse, segs)
  assert bool(jnp.any(jnp.isneginf(lse))), "the case must have empty rows"
  got = _run(cfg, q, k, v, do, dlse, out, lse, segs)
  _util.assert_close(got[:3], ref, jnp.bfloat16, what="mosaic_gpu backward segment ids")


@pytest.mark.parametrize("shape", [(2, 2, 100, 90), (1, 2, 1, 90)])
def test_dense_mask(shape):
  """A dense boolean mask (full, or broadcast over batch and queries: key padding), GQA,
  ragged, dlse, with fully masked rows (the full mask) and window."""
  B, H, Hkv, Sq, Skv, D = 2, 2, 1, 100, 90, 64
  cfg = _cfg(Sq, Skv, D, window=(None, 40))
  q, k, v, do, dlse = _inputs(B, H, Hkv, Sq, Skv, D, jnp.bfloat16, seed=13)
  mask = jax.random.bernoulli(jax.random.key(2), 0.6, shape)
  if shape[2] != 1:
    mask = mask.at[:, :, 5, :].set(False)  # an empty row
  out, lse, ref = _reference(cfg, q, k, v, do, dlse, mask=mask)
  got = _run(cfg, q, k, v, do, dlse, out, lse, mask=mask)
  _util.assert_close(got[:3], ref, jnp.bfloat16, what=f"mosaic_gpu backward mask {shape}")


@pytest.mark.parametrize("shape", [(2, 2, 100, 90), (1, 2, 1, 90)])
def test_bias_and_dbias(shape):
  """A float bias (full, or broadcast over batch and queries) and its gradient, causal, GQA,
  ragged, dlse, float32 bias with bfloat16 q / k / v."""
  B, H, Hkv, Sq, Skv, D = 2, 2, 1, 100, 90, 64
  cfg = _cfg(Sq, Skv, D, causal=True)
  q, k, v, do, dlse = _inputs(B, H, Hkv, Sq, Skv, D, jnp.bfloat16, seed=17)
  bias = jax.random.normal(jax.random.key(4), shape, jnp.float64).astype(jnp.float32)
  f64 = _util.as64
  fwd = lambda q, k, v, bias: reference.attention(cfg, q, k, v, bias, None, None, None, None,
                                                  ())
  (out, lse), vjp = jax.vjp(fwd, f64(q), f64(k), f64(v), f64(bias))
  ref = vjp((f64(do), f64(dlse)))
  _compat.reset_interpret_state()
  dq, dk, dv, dbias, _ = jax.block_until_ready(mgpu_backward.backward(
      cfg, q, k, v, bias, None, None, None, None, (), out.astype(q.dtype),
      lse.astype(jnp.float32), do, dlse))
  assert not _compat.interpret_races_found()
  assert dbias.shape == bias.shape and dbias.dtype == bias.dtype
  _util.assert_close((dq, dk, dv), ref[:3], jnp.bfloat16, what=f"mosaic_gpu bias {shape}")
  _util.assert_close(dbias, ref[3], jnp.bfloat16, what=f"mosaic_gpu dbias {shape}")


@pytest.mark.parametrize("broadcast", [(False, False), (True, False), (False, True)])
def test_dropout_hash_split(broadcast):
  """The kernels' dropout bits (per-row words from XLA, finished per element in the kernel)
  are exactly `_dropout.keep`'s, for every (b, h, q, kv) of a small grid (no kernel run)."""
  B, H, S = 2, 3, 80
  cfg = _cfg(S, S, 64, dropout_rate=0.3, dropout_broadcast=broadcast)
  blk = _ring._BLOCK
  g = Geometry(B=B, H=H, Hkv=H, Sq=S, Skv=S, D=64, Dv=64, bq=blk, bk=blk, Dp=64, Dvp=64)
  seed = jnp.asarray([0x1234567, 0x89ABCDE], jnp.uint32)
  cq, cq2 = _tile._dropout_rows(cfg, seed, g)
  kv = jnp.arange(S, dtype=jnp.int32)[None, None, None, :]
  got = _tile._keep(cfg, kv, cq[..., :S, None], cq2[..., :S, None]) > 0
  b = jnp.arange(B, dtype=jnp.int32)[:, None, None, None]
  h = jnp.arange(H, dtype=jnp.int32)[None, :, None, None]
  q = jnp.arange(S, dtype=jnp.int32)[None, None, :, None]
  want = _dropout.keep(seed[0], seed[1], b, h, q, kv, 0.3, broadcast)
  assert bool(jnp.all(got == want))


def _softcap(s, b, h, q_idx, kv_idx):
  return 20.0 * jnp.tanh(s / 20.0)


@pytest.mark.parametrize("D,mod", [(64, False), (128, True), (256, False)])
def test_dropout(D, mod):
  """Dropout (rate 0.25, the shared counter hash), causal, GQA, ragged, dlse; the smaller
  blocks of the register-heaviest cases: at head dim 256 the dK/dV kernel runs q blocks of
  16 (`_dkdv_block_q`), at 128 with a score_mod (a softcap) also the dQ kernel kv blocks of
  32 (`_stream_block`)."""
  B, H, Hkv, Sq, Skv = 1, 2, 1, 136, 136
  cfg = _cfg(Sq, Skv, D, causal=True, dropout_rate=0.25, score_mod=_softcap if mod else None)
  g = Geometry(B=B, H=H, Hkv=Hkv, Sq=Sq, Skv=Skv, D=D, Dv=D, bq=64, bk=64, Dp=D, Dvp=D)
  assert mgpu_backward._dkdv_block_q(g, cfg) == (16 if D > 64 else 64)
  assert mgpu_backward._stream_block(g, cfg) == (64 if D == 64 else 32)
  q, k, v, do, dlse = _inputs(B, H, Hkv, Sq, Skv, D, jnp.bfloat16, seed=7)
  seed = _dropout.seed_from_key(jax.random.key(11))
  out, lse, ref = _reference(cfg, q, k, v, do, dlse, seed=seed)
  got = _run(cfg, q, k, v, do, dlse, out, lse, seed=seed)
  _util.assert_close(got[:3], ref, jnp.bfloat16, what="mosaic_gpu backward dropout")


def test_dkdv_q_block_at_head_dim_128_is_64_only_for_plain_scores():
  """The dK/dV kernel's q tiles at head dim 128: 64 where nothing but causal / window /
  padding acts on the scores and this jax's compiler fits it (0.12: no spill), else 32
  (segment ids, a bias, dropout, a score_mod: the registers); what `backward` passes."""
  cfg = _cfg(256, 256, 128, causal=True)
  g = Geometry(B=1, H=2, Hkv=1, Sq=256, Skv=256, D=128, Dv=128, bq=64, bk=64, Dp=128, Dvp=128)
  plain = dict.fromkeys(("q", "k", "v", "do", "lse", "delta"))
  wide = 64 if _compat.wide_dkdv_q_tiles() else 32
  assert mgpu_backward._dkdv_block_q(g, cfg, plain) == wide
  assert mgpu_backward._dkdv_block_q(g, cfg) == 32  # operands unknown
  assert mgpu_backward._dkdv_block_q(g, cfg, dict(plain, q_seg=None, kv_seg=None)) == 32
  assert mgpu_backward._dkdv_block_q(g, cfg, dict(plain, bias=None, biasT=None)) == 32
  soft = _cfg(256, 256, 128, causal=True, score_mod=_softcap)
  assert mgpu_backward._dkdv_block_q(g, soft, plain) == 32
  g256 = dataclasses.replace(g, D=256, Dv=256, Dp=256, Dvp=256)
  assert mgpu_backward._dkdv_block_q(g256, cfg, plain) == 32


def test_dq_kv_block_at_head_dim_256_follows_its_shared_memory():
  """Two output parts (head dim 256): the dQ kernel streams kv blocks of 64 where their SMEM
  fits the budget and nothing heavy on registers runs (plain, segment ids, a dense mask),
  else 32 (a bias: float32 tiles; dropout; the tangent kernel, given no operands)."""
  B, H, S, D = 1, 2, 256, 256
  g = Geometry(B=B, H=H, Hkv=1, Sq=S, Skv=S, D=D, Dv=D, bq=64, bk=64, Dp=D, Dvp=D)
  a = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)
  arrays = dict(q=a((B, H, S, D)), k=a((B, 1, S, D)), v=a((B, 1, S, D)), do=a((B, H, S, D)),
                lse=a((B, H, S), jnp.float32), delta=a((B, H, S), jnp.float32))
  cfg = _cfg(S, S, D, causal=True)
  assert mgpu_backward._stream_block(g, cfg, arrays) == 64
  assert mgpu_backward._scratch_bytes("dq", arrays, ["k", "v"], ["q", "do", "lse", "delta"],
                                      g) <= mgpu_backward._limits.SMEM_BUDGET
  mask = dict(arrays, mask=a((B, 1, S, S), jnp.int8))
  assert mgpu_backward._stream_block(g, cfg, mask) == 64
  bias = dict(arrays, bias=a((B, 1, S, S), jnp.float32), biasT=a((B, 1, S, S), jnp.float32))
  assert mgpu_backward._stream_block(g, cfg, bias) == 32
  dropout = _cfg(S, S, D, causal=True, dropout_rate=0.1)
  assert mgpu_backward._stream_block(g, dropout, arrays) == 32
  assert mgpu_backward._stream_block(g) == 32  # the tangent kernel's
  g128 = dataclasses.replace(g, D=128, Dv=128, Dp=128, Dvp=128)
  assert mgpu_backward._stream_block(g128, cfg, arrays) == 64


@pytest.mark.parametrize("D,Dv", [(64, 128), (256, 64)])
def test_value_head_dim_differs_under_jit(D, Dv):
  """Dv != D (dV / dO tiles wider than Q / K; or, at D = 256, the two programs' halves of a
  value dim padded to 128), causal, through jax.jit."""
  B, H, Hkv, Sq, Skv = 1, 2, 2, 100, 120
  cfg = _cfg(Sq, Skv, D, causal=True)
  q, k, v, do, dlse = _inputs(B, H, Hkv, Sq, Skv, D, jnp.bfloat16, seed=9, Dv=Dv)
  out, lse, ref = _reference(cfg, q, k, v, do, dlse)
  _compat.reset_interpret_state()
  f = jax.jit(lambda q, k, v, o, lse, do, dlse: mgpu_backward.backward(
      cfg, q, k, v, None, None, None, None, None, (), o, lse, do, dlse)[:3])
  got = jax.block_until_ready(f(q, k, v, out.astype(q.dtype), lse.astype(jnp.float32), do,
                                dlse))
  assert not _compat.interpret_races_found()
  assert got[2].shape == v.shape
  _util.assert_close(got, ref, jnp.bfloat16, what="mosaic_gpu backward Dv != D")


def test_dropout_global_offsets():
  """A ring chunk pair with dropout: batch 1, head 1, q rows 64.. of a global problem against
  each of its two kv chunks, offsets (1, 1, 64, 64 * c). The pairs' dQ sum to the global dQ
  of those rows and each pair's dK / dV are the global ones from those rows (float64
  reference with dO zero elsewhere): the keep bits are those of the global positions."""
  B, H, S, D, C = 2, 2, 128, 64, 64
  cfg = _cfg(S, S, D, dropout_rate=0.2)
  q, k, v, do, _ = _inputs(B, H, H, S, S, D, jnp.bfloat16, seed=21)
  seed = _dropout.seed_from_key(jax.random.key(5))
  rows = (slice(1, 2), slice(1, 2), slice(C, S))
  do_rows = jnp.zeros_like(do).at[rows].set(do[rows])  # only these rows' cotangent
  out, lse, ref = _reference(cfg, q, k, v, do_rows, None, seed=seed)
  local = _cfg(C, C, D, dropout_rate=0.2)
  dq = 0
  for c in range(2):
    cols = (slice(1, 2), slice(1, 2), slice(c * C, (c + 1) * C))
    _compat.reset_interpret_state()
    got = mgpu_backward.backward(local, q[rows], k[cols], v[cols], None, None, None, None,
                                 seed, (), out[rows].astype(q.dtype),
                                 lse[rows].astype(jnp.float32), do[rows], None,
                                 offsets=(1, 1, C, c * C))
    got = jax.block_until_ready(got)
    assert not _compat.interpret_races_found()
    dq = dq + got[0].astype(jnp.float32)
    _util.assert_close(got[1:3], (ref[1][cols], ref[2][cols]), jnp.bfloat16,
                       what=f"mosaic_gpu dropout offsets dk/dv chunk {c}")
  _util.assert_close(dq, ref[0][rows], jnp.bfloat16, what="mosaic_gpu dropout offsets dq")


def _alibi_softcap(s, b, h, q_idx, kv_idx, slopes):
  """ALiBi (a per-head slope: a per-(b, h) residual) then a tanh softcap of 20."""
  s = s - slopes[h] * jnp.abs(q_idx - kv_idx).astype(s.dtype)
  return 20.0 * jnp.tanh(s / 20.0)


@pytest.mark.parametrize("offsets,D", [(None, 64), ((1, 1, 64, 0), 64), (None, 128),
                                       (None, 256)])
def test_score_mod(offsets, D):
  """score_mod (ALiBi + softcap: per-head residual, global indices, a nonlinear vjp) with
  differentiable slopes, causal (None) or a chunk pair at global offsets (batch 1, head 1,
  q rows 64..: its dQ / dK / dV / dslopes against the global float64 problem with dO zero
  elsewhere), with a bias; at head dim 256 both programs of a block compute dbias and
  dslopes' rows, the first writes them; at 128 the dQ kernel streams kv blocks of 32 (a
  score_mod with differentiable slopes: `_stream_block`)."""
  B, H, S = 2, 2, 128
  slopes = jnp.asarray([0.5, 0.125], jnp.float32)
  causal = offsets is None
  cfg = _cfg(S, S, D, causal=causal, score_mod=_alibi_softcap, num_diff_consts=1)
  q, k, v, do, dlse = _inputs(B, H, H, S, S, D, jnp.bfloat16, seed=23)
  bias = jax.random.normal(jax.random.key(8), (1, H, S, S), jnp.float32)
  sl = (slice(None),) * 3 if causal else (slice(1, 2), slice(1, 2), slice(64, S))
  if not causal:
    do, dlse = jnp.zeros_like(do).at[sl].set(do[sl]), None
  f64 = _util.as64
  fwd = lambda q, k, v, sl_: reference.attention(cfg, q, k, v, f64(bias), None, None, None,
                                                 None, (sl_,))
  (out, lse), vjp = jax.vjp(fwd, f64(q), f64(k), f64(v), f64(slopes))
  ref = vjp((f64(do), jnp.zeros_like(lse) if dlse is None else f64(dlse)))
  local = cfg if causal else _cfg(64, S, D, score_mod=_alibi_softcap, num_diff_consts=1)
  kv = sl[:2] + (slice(None),)
  # O in float32: dslopes sums d(score) * |q - kv| over the tile, where rows cancel; O
  # rounded to bfloat16 (in delta = rowsum(dO O)) put the chunk pair's dslopes at 1.05e-2
  # of its scale, against a bfloat16 tolerance of 1e-2.
  _compat.reset_interpret_state()
  got = jax.block_until_ready(mgpu_backward.backward(
      local, q[sl], k[kv], v[kv], bias[(slice(None),) + sl[1:]], None, None, None, None,
      (slopes,), out[sl].astype(jnp.float32), lse[sl].astype(jnp.float32), do[sl],
      None if dlse is None else dlse[sl], offsets=offsets))
  assert not _compat.interpret_races_found()
  _util.assert_close(got[:3], (ref[0][sl], ref[1][kv], ref[2][kv]), jnp.bfloat16,
                     what=f"mosaic_gpu score_mod offsets={offsets}")
  (dslopes,) = got[4]
  assert dslopes.dtype == slopes.dtype
  _util.assert_close(dslopes, ref[3], jnp.bfloat16, what=f"mosaic_gpu dslopes {offsets}")


def _prefix_lm(b, h, q_idx, kv_idx, lengths):
  """Prefix LM: the first lengths[b] keys are visible to every query, the rest causally."""
  return (kv_idx <= q_idx) | (kv_idx < lengths[b])


def test_mask_mod():
  """mask_mod (prefix LM, a per-batch residual), ragged, GQA, dlse, with a window."""
  B, H, Hkv, S, D = 2, 2, 1, 100, 64
  cfg = _cfg(S, S, D, window=(60, None), mask_mod=_prefix_lm)
  mod = _mask_mod.ModInputs(None, (jnp.asarray([30, 70], jnp.int32),))
  q, k, v, do, dlse = _inputs(B, H, Hkv, S, S, D, jnp.bfloat16, seed=29)
  f64 = _util.as64
  fwd = lambda q, k, v: reference.attention(cfg, q, k, v, None, None, None, None, None, (),
                                            mod)
  (out, lse), vjp = jax.vjp(fwd, f64(q), f64(k), f64(v))
  ref = vjp((f64(do), f64(dlse)))
  _compat.reset_interpret_state()
  got = jax.block_until_ready(mgpu_backward.backward(
      cfg, q, k, v, None, None, None, None, None, (), out.astype(q.dtype),
      lse.astype(jnp.float32), do, dlse, mod))
  assert not _compat.interpret_races_found()
  _util.assert_close(got[:3], ref, jnp.bfloat16, what="mosaic_gpu mask_mod")


def test_deterministic():
  """Two runs, bitwise the same (no atomics: every output block has one writer)."""
  cfg = _cfg(72, 72, 64, causal=True)
  q, k, v, do, dlse = _inputs(1, 1, 1, 72, 72, 64, jnp.bfloat16, seed=3)
  out, lse, _ = _reference(cfg, q, k, v, do, dlse)
  a = _run(cfg, q, k, v, do, dlse, out, lse)
  b = _run(cfg, q, k, v, do, dlse, out, lse)
  for x, y in zip(a[:3], b[:3]):
    assert bool(jnp.all(x == y))


# ---- mutation: the race detector sees a missing synchronisation -----------------------

# What the interpreter says about a broken protocol: a race between two accesses, or a
# barrier phase that completed while nobody waited on the one before (which one comes first
# depends on the simulated threads' interleaving).
_REPORTS = ("RACE DETECTED", "no threads observed phase")


def assert_mutation_caught(monkeypatch, name, run):
  """`run()` (a call of the backward's kernels, or of kernels sharing their ring protocol)
  is clean; with the mutation `name` (`_ring._MUTATIONS`: one synchronisation step
  removed) the interpreter reports the hazard. Leaves the interpreter reset."""
  assert name in _ring._MUTATIONS
  _compat.reset_interpret_state()
  jax.block_until_ready(run())  # the same call, unmutated: clean
  assert not _compat.interpret_races_found()
  monkeypatch.setattr(_ring, "_TEST_MUTATION", name)
  _compat.reset_interpret_state()
  try:
    with pytest.raises(Exception) as info:
      jax.block_until_ready(run())
  finally:
    monkeypatch.setattr(_ring, "_TEST_MUTATION", None)
    _compat.reset_interpret_state()
    jax.clear_caches()
  text = str(info.value)
  assert any(r in text for r in _REPORTS), text[-2000:]


@pytest.mark.parametrize("name", [
    # The compute warpgroup reads a Q slot without waiting for its TMA.
    "skip_loaded_wait",
    # The producer refills a slot the compute warpgroup may still read.
    "skip_free_wait",
    # No proxy fence between the generic lse / delta loads and the TMA refill of their slot
    # (the race of JAX's own dkv kernel).
    "skip_lse_fence",
    # The dQ kernel overwrites its dbias SMEM tile before the previous tile's TMA store
    # has read it.
    "skip_dbias_wait",
])
def test_mutation_is_caught(monkeypatch, name):
  S, D = 192, 64
  cfg = _cfg(S, S, D)
  q = jnp.ones((1, 1, S, D), jnp.bfloat16)
  lse = jnp.zeros((1, 1, S), jnp.float32)
  bias = jnp.zeros((1, 1, S, S), jnp.float32) if name == "skip_dbias_wait" else None
  run = lambda: mgpu_backward.backward(cfg, q, q, q, bias, None, None, None, None, (), q, lse,
                                       q, None)
  assert_mutation_caught(monkeypatch, name, run)


# ---- what the kernels refuse -------------------------------------------------------------

def test_unsupported_features_are_named():
  S, D = 64, 64
  q = jnp.zeros((1, 1, S, D), jnp.bfloat16)
  cfg = _cfg(S, S, D)

  def call(cfg=cfg, q=q, bias=None, mask=None, consts=(), offsets=None):
    lse_ = jnp.zeros(q.shape[:3], jnp.float32)
    return mgpu_backward.backward(cfg, q, q, q, bias, mask, None, None, None, consts, q, lse_, q,
                                  None, offsets=offsets)

  # an array read at both positions (arrays read by one position or by kv_idx - q_idx are
  # taken)
  with pytest.raises(NotImplementedError, match="not arrays per head"):
    call(cfg=dataclasses.replace(cfg, score_mod=lambda s, b, h, qi, ki, t: s + t[qi, ki]),
         consts=(jnp.zeros((S, S), jnp.float32),))
  with pytest.raises(ValueError, match="seed"):
    call(cfg=dataclasses.replace(cfg, dropout_rate=0.1))
  with pytest.raises(NotImplementedError, match="mask_mod whose per-head values are scalars"):
    mm = _mask_mod.ModInputs(None, (jnp.ones((S, S), jnp.int32),))  # read at both positions
    mgpu_backward.backward(
        dataclasses.replace(cfg, mask_mod=lambda b, h, qi, ki, t: t[qi, ki] > 0), q, q, q, None,
        None, None, None, None, (), q, jnp.zeros((1, 1, S), jnp.float32), q, None, mm)
  with pytest.raises(ValueError, match="offsets"):
    call(offsets=(0, 64))
  with pytest.raises(ValueError, match="bfloat16 or float16"):
    call(q=q.astype(jnp.float32))
  with pytest.raises(ValueError, match="head dims"):
    call(q=jnp.zeros((1, 1, S, 320), jnp.bfloat16))


# ---- deviceless sm_90a compile (the CUDA plugin's Mosaic compiler and ptxas, no GPU) ----------

_TARGET = pathlib.Path(__file__).resolve().parent.parent / "flashvjp" / "targets" / "h100_sxm.txtpb"
_H100_SMEM_OPTIN = 232448  # 227 KiB per block

# Run in a fresh process: JAX_PLATFORMS=cpu with the CUDA plugin present, as jax's own
# deviceless AOT test (the test session's jax may have initialised without it).
_COMPILE = r"""
import sys
import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec
from flashvjp._config import AttentionConfig, BlockSizes
from flashvjp._mask_mod import ModInputs
from flashvjp.pallas.mosaic_gpu import backward as mgpu_backward
target, D, features = open(sys.argv[1]).read(), int(sys.argv[2]), sys.argv[3].split("+")
seg, rate = "seg" in features, (0.1 if "drop" in features else 0.0)
topo = topologies.get_topology_desc(platform="cuda", target_config=target, topology="1x1x1")
sh = NamedSharding(topologies.make_mesh(topo, (1,), ("x",)), PartitionSpec())
B, H, Hkv, S = 1, 4, 2, 1024
def mod(s, b, h, q_idx, kv_idx, slopes):  # ALiBi + tanh softcap
  return 20.0 * jnp.tanh((s - slopes[h] * jnp.abs(q_idx - kv_idx).astype(s.dtype)) / 20.0)
cfg = AttentionConfig(scale=D ** -0.5, causal=True, window=None, seq_q=S, seq_kv=S,
                      dropout_rate=rate, blocks=BlockSizes(), interpret=False,
                      score_mod=mod if "mod" in features else None,
                      num_diff_consts=1 if "mod" in features else 0,
                      mask_mod=(lambda b, h, q, kv, n: (kv <= q) | (kv < n[b]))
                      if "prefix" in features else None)
mm = ModInputs(None, (jnp.asarray([300], jnp.int32),)) if "prefix" in features else None
if "pos" in features:  # arrays read by position: a per-key bias (with its gradient), doc ids
  cfg = AttentionConfig(scale=D ** -0.5, causal=True, window=None, seq_q=S, seq_kv=S,
                        dropout_rate=rate, blocks=BlockSizes(), interpret=False,
                        score_mod=lambda s, b, h, q, kv, bv: s + bv[b, kv], num_diff_consts=1,
                        mask_mod=lambda b, h, q, kv, d: d[b, q] == d[b, kv],
                        mask_mod_blocks=(32, 64))
  mm = ModInputs(None, (jnp.zeros((B, S), jnp.int32),))
consts = (jnp.linspace(0.1, 0.5, H, dtype=jnp.float32),) if "mod" in features else ()
consts = (jnp.zeros((B, S), jnp.float32),) if "pos" in features else consts
if "rel" in features:  # a table read by kv_idx - q_idx (relative_position_bias), its gradient
  cfg = AttentionConfig(scale=D ** -0.5, causal=True, window=None, seq_q=S, seq_kv=S,
                        dropout_rate=rate, blocks=BlockSizes(), interpret=False,
                        score_mod=lambda s, b, h, q, kv, t: s + t[h, jnp.clip(kv - q, -64, 64)
                                                                   + 64], num_diff_consts=1)
  consts = (jnp.zeros((H, 129), jnp.float32),)
seed = jnp.asarray([1, 2], jnp.uint32) if rate else None
mask = jnp.tril(jnp.ones((S, S), bool))[None, None] if "mask" in features else None
bias = jnp.ones((1, H, S, S), jnp.float32) if "bias" in features else None
off = (0, 1, 0, 64) if "off" in features else None
f = lambda q, k, v, o, lse, do, *segs: mgpu_backward.backward(
    cfg, q, k, v, bias, mask, *(segs or (None, None)), seed, consts, o, lse, do, None, mm,
    offsets=off)  # every output: the d(rel) kernel's feed the table's gradient
a = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
segs = (a((B, S), jnp.int32), a((B, S), jnp.int32)) if seg else ()
jax.jit(f).lower(a((B, H, S, D)), a((B, Hkv, S, D)), a((B, Hkv, S, D)), a((B, H, S, D)),
                 a((B, H, S), jnp.float32), a((B, H, S, D)), *segs).compile()
print("COMPILED")
"""


def _cuda_plugin() -> bool:
  """The CUDA plugin at jaxlib's version (tests/_aot.py: jax ignores another)."""
  from tests import _aot
  return _aot.HAS_CUDA_PLUGIN


def _compile_sm90a(D, features, dump_dir, script=None):
  """Compile both backward kernels (or what `script` compiles, with the same arguments) for
  H100 in a fresh process; their PTX, ptxas report and resources land in dump_dir (the MLIR
  pass logs, tens of MB each, are deleted)."""
  root = pathlib.Path(__file__).resolve().parent.parent
  env = dict(os.environ, JAX_PLATFORMS="cpu", MOSAIC_GPU_DUMP_TO=str(dump_dir),
             MOSAIC_GPU_DUMP_PTXAS="1", PYTHONPATH=str(root))
  proc = subprocess.run([sys.executable, "-c", script or _COMPILE, str(_TARGET), str(D),
                         features],
                        env=env, cwd=root, capture_output=True, text=True, timeout=600)
  for log in dump_dir.glob("*.mlir-passes.log"):
    log.unlink()
  assert "COMPILED" in proc.stdout, proc.stderr[-4000:]


@pytest.mark.skipif(not _cuda_plugin(), reason="needs jax-cuda12-plugin / -pjrt (deviceless "
                    "sm_90a compile); no GPU needed")
@pytest.mark.parametrize("D,features", [(64, ""), (128, ""),
                                        (64, "seg+drop+mask+bias+off+mod+prefix"),
                                        (128, "seg+drop+mask+bias+off"), (128, "pos"),
                                        (128, "seg+mask+bias+off+prefix"),
                                        (128, "mod"), (128, "seg+drop+mask+bias+off+mod+prefix"),
                                        (128, "rel"), (256, "rel"),
                                        (256, ""), (256, "seg+drop+mask+bias+off"),
                                        (256, "seg+mask+off"), (256, "seg+drop+mask+off")])
def test_sm90a_compile_no_spills(D, features, tmp_path):
  """Both kernels (causal, GQA, bf16, S=1024; with segment ids, dropout at global offsets, a
  dense mask, a bias with its gradient, a score_mod, a mask_mod, arrays read by position, a
  table read by kv_idx - q_idx) compile
  for sm_90a with the CUDA plugin's Mosaic compiler; ptxas reports no spill and
  shared memory fits an H100 / H200 block. At D=128 causal, the SASS too."""
  _compile_sm90a(D, features, tmp_path)
  for kernel in ("flashvjp_bwd_dkdv", "flashvjp_bwd_dq") + (
      ("flashvjp_bwd_drel",) if "rel" in features else ()):
    (ptxas,) = tmp_path.glob(f"{kernel}_*.ptxas")
    report = ptxas.read_text()
    assert "sm_90a" in report, report
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert spills and not any(spills), report
    (resources,) = tmp_path.glob(f"{kernel}_*.resources.txt")
    smem = int(re.search(r"smem_scratch_bytes=(\d+)", resources.read_text()).group(1))
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    print(f"sm_90a {kernel} D={D} causal {features or 'plain'}: {regs} registers,"
          f" {sum(spills)} spill bytes, {smem} B smem")
    assert smem <= _H100_SMEM_OPTIN, (kernel, smem)
  if D != 128 or features or _sass.unavailable() is not None:
    return
  # the SASS (D=128, causal): warpgroup MMAs (HGMMA) and TMA loads (UTMALDG) of the streamed
  # operand inside the main loop, no mma.sync fallback
  for kernel, dots in (("flashvjp_bwd_dkdv", 4), ("flashvjp_bwd_dq", 3)):
    (ptx,) = tmp_path.glob(f"{kernel}_*.ptx")
    listing = _sass.Listing.parse(_sass.sass(str(ptx)))
    mma, tma = listing.count("HGMMA", in_loops=True), listing.count("UTMALDG", in_loops=True)
    print(f"sm_90a {kernel} D=128 causal SASS: HGMMA {mma} of {listing.count('HGMMA')} in"
          f" main loops, UTMALDG {tma} of {listing.count('UTMALDG')}")
    # dK/dV: S = K Q^T, dP = V dO^T, dV += P dO, dK += dS Q; dQ: S, dP, dQ += dS K
    assert mma >= dots and mma >= listing.count("HGMMA") // 2, (kernel, listing.loops)
    assert tma >= 2, kernel  # the streamed Q / dO (dK/dV) or K / V (dQ) tiles
    assert listing.count("HMMA") == 0, kernel