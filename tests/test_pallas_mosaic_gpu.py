"""The Pallas Mosaic-GPU forward kernel: interpret mode with race detection, an sm_90a compile.

Room: tests (Pallas Mosaic-GPU family). On CPU the kernel runs as it is under the
Mosaic-GPU interpreter (`plgpu.InterpretGPUParams(detect_races=True)`: simulated SMEM,
TMA, barriers and SS-wgmma), against float64 naive attention at the per-dtype tolerance,
and no race may be reported. A mutation test removes one barrier wait at a time and
requires the interpreter to report it. Not simulated (so not tested here): wgmma
asynchrony (waits are no-ops) and a missing wait on a TMA copy the waiting warpgroup
issued itself (the Q tile's load; the interpreter orders it by program order). The
deviceless compile for H100 (sm_90a) runs where the CUDA plugin is installed: ptxas's
registers, spills and the kernel's SMEM are checked, and its SASS (tests/_sass.py) shows the
warpgroup MMAs and TMA loads inside the main loops and the register reallocation.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashvjp import _dropout
from flashvjp import reference
from flashvjp._config import AttentionConfig
from flashvjp._config import BlockSizes
from flashvjp.pallas.mosaic_gpu import _compat
from tests import _aot
from tests import _sass
from tests import _util

pytestmark = pytest.mark.skipif(
    _compat.unavailable() is not None, reason=f"Mosaic-GPU Pallas: {_compat.unavailable()}")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(Sq, Skv, D, causal=False, window=None, interpret=True, dropout_rate=0.0):
  return AttentionConfig(scale=D ** -0.5, causal=causal, window=window, seq_q=Sq, seq_kv=Skv,
                         dropout_rate=dropout_rate, blocks=BlockSizes(), interpret=interpret,
                         implementation="pallas_mosaic_gpu")


def _forward(*args, **kw):
  from flashvjp.pallas.mosaic_gpu import forward as F
  return F.forward(*args, **kw)


# name -> (B, H, Hkv, Sq, Skv, D, dtype, mask kwargs, launch overrides)
CASES = {
    "plain_d64": (1, 2, 2, 128, 128, 64, jnp.bfloat16, {}, {}),
    "plain_d128_f16_padded": (2, 1, 1, 100, 77, 128, jnp.float16, {}, {}),
    "causal_d128_padded": (1, 1, 1, 200, 200, 128, jnp.bfloat16, dict(causal=True), {}),
    "causal_gqa_d64_f16": (1, 4, 2, 130, 130, 64, jnp.float16, dict(causal=True), {}),
    "causal_rect_d64": (1, 1, 1, 64, 200, 64, jnp.bfloat16, dict(causal=True), {}),
    "window_d64": (1, 1, 1, 256, 256, 64, jnp.bfloat16, dict(window=(70, 20)), {}),
    # kv blocks of 64: the two consumers of a CTA own different kv ranges, so each passes
    # by blocks of the CTA's range (leading and trailing) that only the other computes
    "window_d64_bk64": (1, 1, 1, 256, 256, 64, jnp.float16, dict(window=(70, 20)),
                        dict(block_kv=64)),
    "window_no_pingpong": (1, 1, 1, 200, 200, 64, jnp.float16, dict(window=(30, 10)),
                           dict(pingpong=False)),
    "causal_one_consumer": (1, 1, 1, 150, 150, 128, jnp.bfloat16, dict(causal=True),
                            dict(consumers=1)),
    "window_left_causal_d128": (1, 1, 1, 192, 160, 128, jnp.float16,
                                dict(causal=True, window=(60, None)), {}),
    # rows q >= 97 attend nothing (kv >= q + 3): out 0, lse -inf
    "empty_rows": (1, 1, 1, 100, 100, 64, jnp.bfloat16, dict(window=(-3, 5)), {}),
    # kv >= q + 150: the second CTA (rows 128..199) has no kv block at all (no TMA, no
    # wgmma; its consumers only meet at the ping-pong barrier)
    "empty_cta": (1, 1, 1, 200, 200, 64, jnp.bfloat16, dict(window=(-150, None)), {}),
    "d256_causal": (1, 1, 1, 96, 96, 256, jnp.bfloat16, dict(causal=True), {}),
    "d32_padded_head": (1, 2, 1, 80, 80, 32, jnp.bfloat16, {}, {}),
    # head_dim_v != head_dim: the output tile gets its own SMEM buffer
    "dv64_d128_causal": (1, 2, 1, 130, 130, 128, jnp.bfloat16, dict(causal=True, Dv=64), {}),
    # packed documents (segment ids: every visited block masked elementwise); batch 1's
    # first q segment (id 0) has no kv of its id in the pair case: empty rows
    "segments_causal": (2, 1, 1, 200, 200, 64, jnp.bfloat16,
                        dict(causal=True, segments=([[30, 140], [90]], None)), {}),
    "segment_pair_gqa": (2, 2, 1, 150, 190, 128, jnp.float16,
                         dict(segments=([[40, 100], [20]], [[60, 120], [0, 77]])), {}),
    # dropout: the shared counter hash (the same keep bits as the reference's)
    "dropout_causal_gqa": (1, 4, 2, 130, 130, 64, jnp.bfloat16,
                           dict(causal=True, dropout_rate=0.3), {}),
    "dropout_d128_segments": (1, 1, 1, 130, 100, 128, jnp.float16,
                              dict(dropout_rate=0.2, segments=([[50]], [[30]])), {}),
    # bias: a full block per ring slot, a per-key vector per slot, a per-query vector
    "bias_full_causal": (2, 2, 1, 130, 130, 64, jnp.bfloat16,
                         dict(causal=True, bias=(2, 2, 130, 130)), dict(slots=2)),
    "bias_2d_f32_d128": (1, 1, 1, 100, 130, 128, jnp.float16, dict(bias=(1, 1, 100, 130),
                                                                   bias_dtype=jnp.float32), {}),
    "bias_head_kv_segments": (2, 2, 1, 130, 130, 64, jnp.bfloat16,
                              dict(bias=(1, 2, 1, 130), segments=([[70], [20, 90]], None)),
                              dict(slots=2)),
    "bias_per_query_window": (1, 2, 1, 200, 200, 64, jnp.float16,
                              dict(bias=(1, 2, 200, 1), window=(40, 40)), {}),
    # dense masks (bfloat16 0 / 1 blocks in the ring, vectors): rows 3 and 40-43 of batch 1
    # attend nothing (empty rows); per-key and per-query masks with causal. Rings of 2
    # slots for more kv blocks than slots: side data (ids, bias, mask) is refilled too
    "mask_full": (2, 2, 1, 100, 200, 64, jnp.bfloat16, dict(mask="full"), dict(slots=2)),
    "mask_per_key_causal_d128": (1, 2, 1, 130, 130, 128, jnp.float16,
                                 dict(mask="per_key", causal=True), {}),
    "mask_per_query_bias": (1, 2, 1, 90, 90, 64, jnp.bfloat16,
                            dict(mask="per_query", bias=(1, 2, 90, 90)), {}),
    # a 4-block kv ring of 2 slots: every slot is refilled twice
    "ring_wraps": (1, 1, 1, 64, 256, 64, jnp.bfloat16, {}, dict(block_kv=64, slots=2)),
}


def _dense_mask(form, B, H, Sq, Skv):
  """A random bool mask of the given broadcast form, with empty rows where it has rows."""
  shape = {"full": (B, 1, Sq, Skv), "per_key": (1, H, 1, Skv), "per_query": (B, H, Sq, 1)}[form]
  m = np.random.default_rng(0).random(shape) > 0.4
  if form != "per_key":
    m[-1, :, 3] = False
    m[-1, :, 40:44] = False
  return jnp.asarray(m)


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_matches_float64_reference_without_races(name):
  B, H, Hkv, Sq, Skv, D, dtype, mkw, launch = CASES[name]
  mkw = dict(mkw)
  Dv = mkw.pop("Dv", D)
  q, k, v = _util.random_qkv(sorted(CASES).index(name), B, H, Hkv, Sq, Skv, D, Dv, dtype=dtype)
  q_seg = kv_seg = None
  if "segments" in mkw:
    q_cuts, kv_cuts = mkw.pop("segments")
    q_seg = _util.segment_ids(B, Sq, q_cuts)
    kv_seg = q_seg if kv_cuts is None else _util.segment_ids(B, Skv, kv_cuts)
  bias = None
  if "bias" in mkw:
    shape, bias_dtype = mkw.pop("bias"), mkw.pop("bias_dtype", dtype)
    bias = jax.random.normal(jax.random.key(5), shape, jnp.float64).astype(bias_dtype)
  mask = None if "mask" not in mkw else _dense_mask(mkw.pop("mask"), B, H, Sq, Skv)
  cfg = _cfg(Sq, Skv, D, **mkw)
  seed = _dropout.seed_from_key(jax.random.key(11)) if cfg.dropout_active else None
  _compat.reset_interpret_state()
  out, lse = _forward(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, (), **launch)
  assert not _compat.interpret_races_found()
  assert out.shape == (B, H, Sq, Dv) and out.dtype == dtype
  assert lse.shape == (B, H, Sq) and lse.dtype == jnp.float32
  ref_out, ref_lse = reference.attention(cfg, *_util.as64((q, k, v, bias)), mask, q_seg,
                                         kv_seg, seed, ())
  _util.assert_close(out, ref_out, dtype, what=f"{name}/out")
  _util.assert_close(lse, ref_lse, dtype, what=f"{name}/lse")


@pytest.mark.parametrize("D", [64, 256])
def test_float32_out(D):
  """cfg.out_f32 (a traced scale folded into the score_mod): out leaves the kernel in float32
  (its own staging tile; at head dim 256 both kernels' halves), not rounded to bfloat16."""
  q, k, v = _util.random_qkv(3, 1, 2, 1, 130, 100, D, dtype=jnp.bfloat16)
  cfg = dataclasses.replace(_cfg(130, 100, D, causal=True), out_f32=True)
  _compat.reset_interpret_state()
  out, lse = _forward(cfg, q, k, v, None, None, None, None, None, ())
  assert not _compat.interpret_races_found()
  assert out.dtype == jnp.float32 and out.shape == (1, 2, 130, D)
  rounded = out.astype(jnp.bfloat16).astype(jnp.float32)
  assert float(jnp.mean(out != rounded)) > 0.9  # float32 values, not bfloat16 ones
  ref_out, ref_lse = reference.attention(cfg, *_util.as64((q, k, v)), None, None, None, None,
                                         None, ())
  _util.assert_close((out, lse), (ref_out, ref_lse), jnp.bfloat16, what="out_f32")


@pytest.mark.parametrize("consumers", [1, 2])
@pytest.mark.parametrize("skip", ["k_loaded", "v_loaded", "k_consumed", "v_consumed"])
def test_interpreter_reports_a_removed_barrier_wait(skip, consumers):
  """Each wait of the K/V ring guards a real hazard: without it the race detector fires."""
  Sq = 64 * consumers
  q, k, v = _util.random_qkv(0, 1, 1, 1, Sq, 256, 64, dtype=jnp.bfloat16)
  cfg = _cfg(Sq, 256, 64)
  _compat.reset_interpret_state()
  raised = None
  try:
    out, _ = _forward(cfg, q, k, v, None, None, None, None, None, (), block_kv=64, slots=2,
                      consumers=consumers, _skip_wait=skip)
    out.block_until_ready()
  except Exception as e:  # the interpreter raises on a detected race (on_race="raise")
    raised = e
  races = _compat.interpret_races_found()
  _compat.reset_interpret_state()
  assert raised is not None or races, f"removing the {skip} wait went unnoticed"
  if raised is not None:
    assert "RACE" in str(raised) or "arrier" in str(raised), str(raised)[:2000]


@pytest.mark.parametrize("side", ["segments", "bias", "mask"])
def test_interpreter_reports_a_removed_side_data_fence(side):
  """The generic loads of a slot's kv ids / bias block / mask block must be fenced
  (commit_smem) before the slot is released to the TMA refill: without it, a race."""
  q, k, v = _util.random_qkv(1, 1, 1, 1, 128, 256, 64, dtype=jnp.bfloat16)
  cfg = _cfg(128, 256, 64)
  kw = {"segments": dict(q_seg=jnp.zeros((1, 128), jnp.int32),
                         kv_seg=jnp.zeros((1, 256), jnp.int32)),
        "bias": dict(bias=jnp.zeros((1, 1, 128, 256), jnp.bfloat16)),
        "mask": dict(mask=jnp.ones((1, 1, 128, 256), bool))}[side]
  args = dict(dict(bias=None, mask=None, q_seg=None, kv_seg=None), **kw)
  _compat.reset_interpret_state()
  raised = None
  try:
    out, _ = _forward(cfg, q, k, v, args["bias"], args["mask"], args["q_seg"], args["kv_seg"],
                      None, (), block_kv=64, slots=2, _skip_wait="side_fence")
    out.block_until_ready()
  except Exception as e:
    raised = e
  races = _compat.interpret_races_found()
  _compat.reset_interpret_state()
  assert raised is not None or races, f"removing the {side} fence went unnoticed"


def test_dropout_at_global_offsets():
  """A chunk pair of a longer sequence (ring attention): dropout's hash at the global
  (b, h, q, kv), traced offsets, the static mask (causal) local; out matches the float64
  reference's chunk (the same keep bits)."""
  B, H, S, D = 1, 2, 160, 64
  q, k, v = _util.random_qkv(3, B, H, H, S, S, D, dtype=jnp.bfloat16)
  seed = _dropout.seed_from_key(jax.random.key(2))
  off = (1, 2, 300, 70)
  cfg = _cfg(S, S, D, causal=True, dropout_rate=0.25)
  _compat.reset_interpret_state()
  run = jax.jit(lambda q, k, v, o: _forward(cfg, q, k, v, None, None, None, None, seed, (),
                                             offsets=tuple(o[n] for n in range(4))))
  out, lse = run(q, k, v, jnp.asarray(off, jnp.int32))
  assert not _compat.interpret_races_found()
  # the reference over a [b0 + B, h0 + H, q0 + S, kv0 + S] problem whose chunk this is
  b0, h0, q0, kv0 = off
  big = [jnp.zeros((b0 + B, h0 + H, n + S, D), jnp.float64) for n in (q0, kv0, kv0)]
  big = [x.at[b0:, h0:, -S:].set(y.astype(jnp.float64)) for x, y in zip(big, (q, k, v))]
  allowed = np.zeros((1, 1, q0 + S, kv0 + S), bool)
  allowed[..., q0:, kv0:] = np.tril(np.ones((S, S), bool))  # causal in local positions
  big_cfg = _cfg(q0 + S, kv0 + S, D, dropout_rate=0.25)
  ref_out, ref_lse = reference.attention(big_cfg, *big, None, jnp.asarray(allowed), None, None,
                                         seed, ())
  _util.assert_close(out, ref_out[b0:, h0:, q0:], jnp.bfloat16, what="offsets/out")
  _util.assert_close(lse, ref_lse[b0:, h0:, q0:], jnp.bfloat16, what="offsets/lse")


def _alibi_softcap(s, b, h, q_idx, kv_idx, slopes):
  """ALiBi (a per-head slope: a per-(b, h) residual) then a tanh softcap of 20."""
  s = s - slopes[h] * jnp.abs(q_idx - kv_idx).astype(s.dtype)
  return 20.0 * jnp.tanh(s / 20.0)


def _prefix_lm(b, h, q_idx, kv_idx, lengths):
  return (kv_idx <= q_idx) | (kv_idx < lengths[b])


@pytest.mark.parametrize("offsets", [None, (1, 2, 64, 32)])
def test_score_mod_and_mask_mod(offsets):
  """A score_mod (ALiBi + softcap, per-head slopes) with a bias, and a mask_mod (prefix LM,
  per-batch lengths) with a window, GQA, ragged lengths: the tile parts in the consumer
  at global positions (a chunk pair at traced offsets: its part of the global problem);
  against float64, no race."""
  from flashvjp import _mask_mod
  B, H, Hkv, S, D = 2, 2, 1, 130, 64
  G = H // Hkv
  q, k, v = _util.random_qkv(5, B, H, Hkv, S, S, D, dtype=jnp.bfloat16)
  slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.float32)  # global heads
  lengths = jnp.asarray([30, 70, 50], jnp.int32)  # global batches
  bias = jax.random.normal(jax.random.key(8), (1, H, S, S), jnp.float32)
  mod = _mask_mod.ModInputs(None, (lengths,))
  b0, h0, q0, kv0 = (0, 0, 0, 0) if offsets is None else offsets
  base = _cfg(S, S, D, window=(60, None))
  sm = dataclasses.replace(base, score_mod=_alibi_softcap, num_diff_consts=1)
  mm = dataclasses.replace(base, mask_mod=_prefix_lm)
  # the global problem whose [b0:, h0:, q0:, kv0:] part the call is
  f64 = lambda x: x.astype(jnp.float64)
  gq = jnp.zeros((b0 + B, h0 + H, q0 + S, D)).at[b0:, h0:, q0:].set(f64(q))
  gk, gv = (jnp.zeros((b0 + B, (h0 + H) // G, kv0 + S, D)).at[b0:, h0 // G:, kv0:].set(f64(x))
            for x in (k, v))
  gbias = jnp.zeros((1, h0 + H, q0 + S, kv0 + S)).at[:, h0:, q0:, kv0:].set(f64(bias))
  allowed = np.zeros((1, 1, q0 + S, kv0 + S), bool)  # the window: static, local positions
  allowed[..., q0:, kv0:] = _mask_window(S, 60)
  for name, cfg, consts, m, bb, gb in (("score_mod", sm, (slopes,), None, bias, gbias),
                                       ("mask_mod", mm, (), mod, None, None)):
    _compat.reset_interpret_state()
    off = None if offsets is None else jnp.asarray(offsets, jnp.int32)
    run = jax.jit(lambda q, k, v, o, cfg=cfg, consts=consts, m=m, bb=bb: _forward(
        cfg, q, k, v, bb, None, None, None, None, consts, m,
        offsets=None if o is None else tuple(o[n] for n in range(4))))
    out, lse = run(q, k, v, off)
    assert not _compat.interpret_races_found(), name
    gcfg = dataclasses.replace(cfg, seq_q=q0 + S, seq_kv=kv0 + S, window=None)
    ro, rl = reference.attention(gcfg, gq, gk, gv, gb, jnp.asarray(allowed), None, None, None,
                                 consts, m)
    _util.assert_close(out, ro[b0:, h0:, q0:], jnp.bfloat16, what=f"{name} {offsets}/out")
    _util.assert_close(lse, rl[b0:, h0:, q0:], jnp.bfloat16, what=f"{name} {offsets}/lse")


def _mask_window(S, left):
  i = np.arange(S)[:, None]
  j = np.arange(S)[None, :]
  return (j >= i - left)


def test_refuses_what_it_does_not_implement():
  from flashvjp.pallas.mosaic_gpu import _limits
  q, k, v = _util.random_qkv(0, 1, 2, 1, 64, 64, 64, dtype=jnp.bfloat16)
  cfg = _cfg(64, 64, 64)
  seg = jnp.zeros((1, 64), jnp.int32)
  with pytest.raises(NotImplementedError, match="segment ids must be given for both"):
    _forward(cfg, q, k, v, None, None, seg, None, None, ())
  with pytest.raises(NotImplementedError, match="dropout needs a seed"):
    _forward(_cfg(64, 64, 64, dropout_rate=0.1), q, k, v, None, None, None, None, None, ())
  with pytest.raises(NotImplementedError, match="per-head values are scalars"):
    # an array read at both positions (arrays read by one position or by kv_idx - q_idx
    # are taken)
    pair = dataclasses.replace(cfg, score_mod=lambda s, b, h, i, j, t: s + t[i, j])
    _forward(pair, q, k, v, None, None, None, None, None, (jnp.ones((64, 64)),))
  with pytest.raises(NotImplementedError, match="offsets must be"):
    _forward(cfg, q, k, v, None, None, None, None, None, (), offsets=(0, 64))
  q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
  with pytest.raises(NotImplementedError, match="float32"):
    _forward(cfg, q32, k32, v32, None, None, None, None, None, ())
  common = dict(platform="cpu", interpret=True, query_shape=q.shape, key_shape=k.shape,
                value_shape=v.shape)
  assert _limits.supports(dtype=jnp.bfloat16, **common)[0]
  assert _limits.supports(dtype=jnp.bfloat16, has_dropout=True, **common)[0]  # both kernels
  big = dict(common, query_shape=(1, 2, 64, 320), key_shape=(1, 1, 64, 320),
             value_shape=(1, 1, 64, 320))
  wide = dict(common, query_shape=(1, 2, 64, 256), key_shape=(1, 1, 64, 256),
              value_shape=(1, 1, 64, 256))
  assert _limits.supports(dtype=jnp.bfloat16, **wide)[0]  # every kernel takes head dim 256
  for kw, word in ((dict(dtype=jnp.float32, **common), "float32"),
                   (dict(dtype=jnp.bfloat16, has_score_mod=True, score_mod_consts=(
                       jnp.ones((64, 64)),),
                         score_mod=lambda s, b, h, i, j, t: s + t[i, j],
                         **common), "score_mod uses dynamic_slice"),
                   (dict(dtype=jnp.bfloat16, **big), "head dims up to 256")):
    ok, reason = _limits.supports(**kw)
    assert not ok and word in reason, reason
  # a table read by kv_idx - q_idx is taken (windows of a skewed array, `_rel`)
  assert _limits.supports(dtype=jnp.bfloat16, has_score_mod=True,
                          score_mod_consts=(jnp.ones((17,)),),
                          score_mod=lambda s, b, h, i, j, t: s + t[jnp.clip(j - i, -8, 8) + 8],
                          **common)[0]
  ok, reason = _limits.supports(**dict(common, interpret=False), dtype=jnp.bfloat16)
  assert not ok and "CUDA" in reason
  # compiled, a mod's float64 array (x64) is refused: the kernels read float32 words
  wide = dict(common, interpret=False, platform="gpu", dtype=jnp.bfloat16, has_score_mod=True,
              score_mod=lambda s, b, h, i, j, t: s + t[j])
  ok, reason = _limits.supports(**wide, score_mod_consts=(jnp.ones((64,), jnp.float64),))
  assert not ok and "float64" in reason and "pallas_triton" in reason, reason
  assert _limits.supports(**wide, score_mod_consts=(jnp.ones((64,), jnp.float32),))[0]


# ---- deviceless sm_90a compile (CUDA plugin, no GPU) ---------------------------------------

_COMPILE = textwrap.dedent("""
    import dataclasses, os, sys
    import jax, jax.numpy as jnp
    from jax.experimental import topologies
    from flashvjp._config import AttentionConfig, BlockSizes
    from flashvjp.pallas.mosaic_gpu import forward as F
    D, S, variants = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
    tc = open(os.path.join("flashvjp", "targets", "h100_sxm.txtpb")).read()
    topo = topologies.get_topology_desc(platform="cuda", target_config=tc, topology="1x1x1")
    mesh = topologies.make_mesh(topo, (1,), ("x",))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    q = jax.ShapeDtypeStruct((1, 4, S, D), jnp.bfloat16, sharding=sh)
    kv = jax.ShapeDtypeStruct((1, 2, S, D), jnp.bfloat16, sharding=sh)
    seg = jax.ShapeDtypeStruct((1, S), jnp.int32, sharding=sh)
    seed = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=sh)
    for variant in variants:  # one kernel each, dumped as entry_<n> in this order
      cfg = AttentionConfig(scale=D ** -0.5, causal=True, window=None, seq_q=S, seq_kv=S,
                            dropout_rate=0.1 if variant == "dropout" else 0.0,
                            blocks=BlockSizes())
      if variant == "segments":
        f = lambda q, k, v, s: F.forward(cfg, q, k, v, None, None, s, s, None, ())
        args = (q, kv, kv, seg)
      elif variant == "dropout":
        f = lambda q, k, v, r: F.forward(cfg, q, k, v, None, None, None, None, r, ())
        args = (q, kv, kv, seed)
      elif variant == "bias":  # a full [B, H, S, S] bias: a [128, 64] block per ring slot
        f = lambda q, k, v, a: F.forward(cfg, q, k, v, a, None, None, None, None, ())
        args = (q, kv, kv, jax.ShapeDtypeStruct((1, 4, S, S), jnp.bfloat16, sharding=sh))
      elif variant == "mask":  # a dense [S, S] mask: bfloat16 0 / 1 blocks in the ring
        f = lambda q, k, v, m: F.forward(cfg, q, k, v, None, m, None, None, None, ())
        args = (q, kv, kv, jax.ShapeDtypeStruct((1, 1, S, S), jnp.bool_, sharding=sh))
      elif variant == "score_mod":  # ALiBi slopes (per head) + softcap
        def sm(s, b, h, i, j, sl):
          return 20.0 * jnp.tanh((s - sl[h] * jnp.abs(i - j).astype(s.dtype)) / 20.0)
        mcfg = dataclasses.replace(cfg, score_mod=sm, num_diff_consts=1)
        f = lambda q, k, v, sl: F.forward(mcfg, q, k, v, None, None, None, None, None, (sl,))
        args = (q, kv, kv, jax.ShapeDtypeStruct((4,), jnp.float32, sharding=sh))
      elif variant == "positions":  # arrays read by position: a per-key bias, document ids
        from flashvjp._mask_mod import ModInputs
        mcfg = dataclasses.replace(
            cfg, causal=False, score_mod=lambda s, b, h, i, j, bv: s + bv[b, j],
            num_diff_consts=1, mask_mod=lambda b, h, i, j, d: (d[b, i] == d[b, j]) & (j <= i),
            mask_mod_blocks=(32, 64))
        f = lambda q, k, v, bv, d: F.forward(mcfg, q, k, v, None, None, None, None, None,
                                             (bv,), ModInputs(None, (d,)))
        args = (q, kv, kv, jax.ShapeDtypeStruct((1, S), jnp.float32, sharding=sh),
                jax.ShapeDtypeStruct((1, S), jnp.int32, sharding=sh))
      elif variant == "rel":  # tables read by kv_idx - q_idx: relative_position_bias + T5 buckets
        def rel(s, b, h, i, j, t, tb):
          d = j - i
          far = jnp.minimum(4 + jnp.log2(jnp.maximum(jnp.abs(d), 1)).astype(jnp.int32), 7)
          bucket = jnp.where(jnp.abs(d) < 4, jnp.abs(d), far) + 8 * (d > 0)
          return s + t[h, jnp.clip(d, -64, 64) + 64] + tb[h, bucket]
        mcfg = dataclasses.replace(cfg, score_mod=rel, num_diff_consts=2)
        f = lambda q, k, v, t, tb: F.forward(mcfg, q, k, v, None, None, None, None, None, (t, tb))
        args = (q, kv, kv, jax.ShapeDtypeStruct((4, 129), jnp.float32, sharding=sh),
                jax.ShapeDtypeStruct((4, 16), jnp.float32, sharding=sh))
      elif variant == "out_f32":  # a float32 out (a traced scale folded into the score_mod)
        f = lambda q, k, v: F.forward(dataclasses.replace(cfg, out_f32=True), q, k, v, None,
                                      None, None, None, None, ())
        args = (q, kv, kv)
      elif variant == "mask_mod":  # prefix LM lengths per batch
        from flashvjp._mask_mod import ModInputs
        mcfg = dataclasses.replace(cfg, mask_mod=lambda b, h, i, j, n: (j <= i) | (j < n[b]))
        f = lambda q, k, v, n: F.forward(mcfg, q, k, v, None, None, None, None, None, (),
                                         ModInputs(None, (n,)))
        args = (q, kv, kv, jax.ShapeDtypeStruct((1,), jnp.int32, sharding=sh))
      else:
        f = lambda q, k, v: F.forward(cfg, q, k, v, None, None, None, None, None, ())
        args = (q, kv, kv)
      jax.jit(f).lower(*args).compile()
      print("COMPILED", variant, flush=True)
""")
VARIANTS = ("causal", "segments", "dropout", "bias", "mask", "score_mod", "mask_mod",
            "positions", "out_f32", "rel")


def compile_sm90(D, S, variants, dump_dir):
  """Compile causal forwards for H100 in a subprocess (JAX_PLATFORMS=cpu, the CUDA plugin's
  Mosaic-GPU compiler and ptxas): {variant: (registers, spill bytes, smem bytes)}."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", MOSAIC_GPU_DUMP_TO=str(dump_dir),
             MOSAIC_GPU_DUMP_PTXAS="1", PYTHONPATH=ROOT)
  r = subprocess.run([sys.executable, "-c", _COMPILE, str(D), str(S), ",".join(variants)],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.stdout.count("COMPILED") == len(variants), r.stderr[-4000:]
  found = {}
  for n, variant in enumerate(variants):
    ptxas = open(os.path.join(dump_dir, f"entry_{n}.ptxas")).read()
    resources = open(os.path.join(dump_dir, f"entry_{n}.resources.txt")).read()
    smem = int(re.search(r"smem_scratch_bytes=(\d+)", resources)[1])
    found[variant] = parse_ptxas(ptxas) + (smem,)
  return found


def parse_ptxas(text):
  """(registers, spill store + load bytes) of the one kernel in a ptxas -v report."""
  regs = int(re.search(r"Used (\d+) registers", text)[1])
  spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
  return regs, int(spills[1]) + int(spills[2])


def test_named_barrier_checks_its_arguments():
  """The named-barrier helper refuses an unknown op and a thread count bar.sync would not take
  (a multiple of 32) before emitting anything."""
  with pytest.raises(ValueError, match="op"):
    _compat.named_barrier("wait", 4, 1, 256)
  with pytest.raises(ValueError, match="num_threads"):
    _compat.named_barrier("sync", 4, 1, 100)


def test_parse_ptxas():
  text = ("ptxas info    : Function properties for entry_mosaic_gpu_kernel\n"
          "    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
          "ptxas info    : Used 251 registers, used 16 barriers, 1 bytes smem\n")
  assert parse_ptxas(text) == (251, 12)


@pytest.mark.skipif(not _aot.HAS_CUDA_PLUGIN,
                    reason=f"the deviceless sm_90a compile: {_aot.CUDA_PROBLEM}")
@pytest.mark.parametrize("D", [64, 128, 256])
def test_compiles_for_sm90a_without_spills(D, tmp_path):
  """Causal forwards (plain, segment ids, dropout, bias, dense mask, a score_mod, a mask_mod,
  mods reading arrays by position, a float32 out, tables read by kv_idx - q_idx; at head dims
  64 and 256 plain and segment ids; at 256 plain one kernel of 256 value columns, with
  segment ids two computing half of out each) compile for H100 with no register spill and within the SMEM of a Hopper block (227 KiB). The plain causal
  forward's SASS (two consumers and the producer; when nvdisasm is installed): HGMMA (QK^T
  and PV of each consumer) and UTMALDG (K and V into a ring slot) inside loops, the
  producer / consumer register reallocation (USETMAXREG) that the warp specialization relies
  on, and the schedule's named barriers (BAR.ARV / BAR.SYNC) in the consumers' loops."""
  # every variant at 128 (the registers' tightest with two consumers of kv blocks of 128);
  # at 64 and 256 plain and segment ids (CI time)
  found = compile_sm90(D, 1024, VARIANTS if D == 128 else VARIANTS[:2], tmp_path)
  for variant, (regs, spills, smem) in found.items():
    print(f"sm_90a forward D={D} causal {variant}: {regs} registers (at launch; setmaxnreg"
          f" {forward_module().CONSUMER_REGISTERS} / {forward_module().PRODUCER_REGISTERS},"
          f" 256 value columns {forward_module().WIDE_REGISTERS}),"
          f" {spills} spill bytes, {smem} B smem")
    assert spills == 0, (variant, spills)
    assert regs <= 255
    assert smem <= 227 * 1024
  if _sass.unavailable() is not None:
    return
  assert VARIANTS[0] == "causal"
  listing = _sass.Listing.parse(_sass.sass(str(tmp_path / "entry_0.ptx")))
  mma = listing.count("HGMMA", in_loops=True)
  tma = listing.count("UTMALDG", in_loops=True)
  print(f"sm_90a forward D={D} causal SASS: {len(listing.opcodes)} instructions,"
        f" HGMMA {mma} of {listing.count('HGMMA')} in main loops, UTMALDG {tma} of"
        f" {listing.count('UTMALDG')}, USETMAXREG {listing.count('USETMAXREG')}")
  # each consumer's loop: QK^T and PV (D/64 x block 16-deep k-steps each, >= 2), so >= 4 HGMMA
  assert mma >= 4 and mma >= listing.count("HGMMA") // 2, listing.loops
  assert tma >= 2  # K and V of a slot, issued by the producer's loop
  assert listing.count("USETMAXREG") >= 2  # the producer gives up registers, consumers take
  assert listing.count("HMMA") == 0  # no mma.sync fallback
  # FA3's ping-pong on hardware named barriers (`_compat.named_barrier`): each consumer's
  # loop arrives on the other's barrier and syncs on its own, one instruction each
  assert listing.count("BAR.ARV", in_loops=True) >= 2, listing.loops
  assert listing.count("BAR.SYNC", in_loops=True) >= 2, listing.loops


def test_sass_listing_parse(monkeypatch):
  text = textwrap.dedent("""\
      /*0000*/                   MOV R1, c[0x0][0x28] ;
      .L_x_1:
      /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;
      /*0020*/              @!P0 BRA `(.L_x_1) ;
      /*0030*/                   UTMALDG.5D [UR8], [UR4] ;
      .L_x_2:
      /*0040*/              @!P0 BRA `(.L_x_2) ;
      /*0050*/                   BRA `(.L_x_1) ;
      """)
  listing = _sass.Listing.parse(text)
  assert listing.opcodes == ("MOV", "HGMMA.64x64x16.F32.BF16", "BRA", "UTMALDG.5D", "BRA",
                             "BRA")
  assert listing.loops == ((1, 2), (4, 4))  # the unconditional branch back is not a loop
  assert listing.count("HGMMA") == 1 and listing.count("UTMALDG") == 1
  monkeypatch.setattr(_sass, "MIN_LOOP", 1)
  assert listing.count("HGMMA", in_loops=True) == 1
  assert listing.count("UTMALDG", in_loops=True) == 0


def forward_module():
  from flashvjp.pallas.mosaic_gpu import forward as F
  return F
