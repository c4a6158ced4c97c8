"""The Mosaic-TPU kernels (interpret mode on CPU): the shared base plus TPU-specific checks.

The shared base (tests/attention_base.py) checks every feature against float64
naive attention with implementation="pallas_tpu" (the HLO interpreter). The tests
below check what is particular to this family: a subset under the Mosaic simulator
(`pltpu.InterpretParams`: VMEM, DMA, race detection), long sequences with several kv
blocks, bitwise determinism, agreement with the Triton family and the blockwise path,
the dispatcher picking the family on a TPU, block sparsity and the VMEM budget.
"""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashvjp
from flashvjp import _config
from flashvjp import _dispatch
from flashvjp import _mask
from flashvjp.pallas import _common
from flashvjp.pallas import _compat
from flashvjp.pallas.tpu import _interpret as tpu_interpret
from flashvjp.pallas.tpu import _layout
from flashvjp.pallas.tpu import _limits
from tests import _util
from tests.attention_base import AttentionTests
from tests.attention_base import run_case


class TestPallasTPUInterpret(AttentionTests):
  IMPLEMENTATION = "pallas_tpu"


# ---- helpers ---------------------------------------------------------------------

def _pallas_calls(closed_jaxpr):
  """Every pallas_call equation (recursing into jit / custom_vjp / partitioning bodies)."""
  def walk(jaxpr):
    for e in jaxpr.eqns:
      if e.primitive.name == "pallas_call":
        yield e
        continue
      for v in e.params.values():
        if hasattr(v, "jaxpr") and hasattr(v, "consts"):
          yield from walk(v.jaxpr)
        elif hasattr(v, "eqns"):
          yield from walk(v)
  return list(walk(closed_jaxpr.jaxpr))


def _assert_float32_rounding(got, ref, rel=2e-6):
  for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
    g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
    np.testing.assert_array_equal(np.isfinite(g), np.isfinite(r))
    f = np.isfinite(r)
    scale = max(np.abs(r[f]).max(), 1e-30)
    assert np.abs(g[f] - r[f]).max() <= rel * scale, np.abs(g[f] - r[f]).max() / scale


def _value_and_grads(impl, q, k, v, bias, **kw):
  def loss(q, k, v, bias):
    out, lse = flashvjp.flash_attention(q, k, v, bias=bias, implementation=impl,
                                        return_lse=True, **kw)
    return (jnp.sum(out * jnp.sin(out)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0)),
            (out, lse))
  (_, res), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(q, k, v, bias)
  return res, grads


# ---- the Mosaic simulator (DMA / VMEM / races) -------------------------------------

@pytest.mark.parametrize("name", ["mqa", "segment_pair", "bias_head_kv", "dropout"])
def test_mosaic_simulator_subset(name, monkeypatch):
  """Run under pltpu.InterpretParams(detect_races=True): every DMA, semaphore and VMEM
  access of the pipelined grid is simulated (out-of-bounds reads raise)."""
  params = _compat.tpu_interpret_params(detect_races=True)
  if params is None:
    pytest.skip("this jax has no pltpu.InterpretParams")
  # (The simulator's callbacks are ordered effects, which custom_partitioning cannot lower:
  # with INTERPRET_PARAMS set, the partitioning wrapper calls the kernels directly.)
  monkeypatch.setattr(tpu_interpret, "INTERPRET_PARAMS", params)
  got = run_case("pallas_tpu", name, jnp.float32)
  ref = run_case("naive", name, jnp.float32)
  _util.assert_close(got, ref, jnp.float32, what=f"pallas_tpu[InterpretParams]/{name}")


def test_mosaic_simulator_several_blocks(monkeypatch):
  """Several q and kv blocks (lane-major lse / delta, skipped causal blocks, a broadcast
  bias' gradient) under the simulator, against the blockwise path."""
  params = _compat.tpu_interpret_params(detect_races=True)
  if params is None:
    pytest.skip("this jax has no pltpu.InterpretParams")
  monkeypatch.setattr(tpu_interpret, "INTERPRET_PARAMS", params)
  q, k, v = _util.random_qkv(0, 1, 2, 1, 256, 384, 32, 16)
  bias = jax.random.normal(jax.random.key(1), (1, 2, 1, 384), jnp.float32)
  with jax.default_matmul_precision("highest"):
    got = _value_and_grads("pallas_tpu", q, k, v, bias, causal=True, block_q=128,
                           block_kv=128)
    ref = _value_and_grads("blockwise", q, k, v, bias, causal=True)
  _assert_float32_rounding(got, ref, rel=5e-6)


# ---- several blocks along both sequences -------------------------------------------

@pytest.mark.parametrize("kw", [
    dict(causal=True, block_q=128),  # lse / delta lane-major (block_q a multiple of 128)
    dict(window=(100, 37), segment_ids="docs", block_q=64),  # lane-broadcast
    dict(mask="per_head", bias="rows", dropout_rate=0.2, block_q=64),
], ids=["causal", "window_segments", "mask_bias_dropout"])
def test_long_sequences_several_kv_blocks(kw):
  """Sequences of several 128-lane kv blocks (the shared base's fit in one): lists with
  empty, partial and full blocks, GQA, head_dim_v != head_dim, both layouts of the per-row
  lse / delta; against float64 naive."""
  B, H, Hkv, Sq, Skv, D, Dv = 2, 4, 2, 200, 330, 32, 16
  kw = dict(kw)
  if kw.get("segment_ids") == "docs":
    ids = np.zeros((B, Sq), np.int32)
    ids[:, 60:] = 1
    ids[1, 150:] = 2
    kw["segment_ids"] = (jnp.asarray(ids), jnp.asarray(np.repeat(
        np.r_[np.zeros(100), np.ones(130), 2 * np.ones(100)][None].astype(np.int32), B, 0)))
  if kw.get("mask") == "per_head":
    m = np.random.default_rng(0).random((1, H, Sq, Skv)) > 0.3
    m[..., 130:260] = False  # a whole kv block empty for every row
    kw["mask"] = jnp.asarray(m)
  bias = None
  if kw.pop("bias", None) == "rows":
    bias = jax.random.normal(jax.random.key(3), (B, 1, Sq, 1), jnp.float32)
  if kw.get("dropout_rate"):
    kw.update(dropout_rng=jax.random.key(1), deterministic=False)
  q, k, v = _util.random_qkv(3, B, H, Hkv, Sq, Skv, D, Dv)
  block_q = kw.pop("block_q")
  got = _value_and_grads("pallas_tpu", q, k, v, bias, block_q=block_q, block_kv=128, **kw)
  ref = _value_and_grads("naive", *_util.as64((q, k, v)),
                         None if bias is None else bias.astype(jnp.float64), **kw)
  _util.assert_close(got, ref, jnp.float32, what="pallas_tpu/long")


# ---- determinism and agreement -------------------------------------------------------

def test_bitwise_deterministic():
  q, k, v = _util.random_qkv(6, 2, 4, 2, 40, 140, 16)
  bias = jax.random.normal(jax.random.key(2), (2, 1, 40, 140), jnp.float32)
  seg = (jnp.asarray(np.repeat([[0] * 15 + [1] * 25], 2, axis=0), jnp.int32),
         jnp.asarray(np.repeat([[0] * 50 + [1] * 90], 2, axis=0), jnp.int32))

  def loss(q, k, v, bias):
    out = flashvjp.flash_attention(
        q, k, v, bias=bias, segment_ids=seg, causal=True, dropout_rate=0.1,
        dropout_rng=jax.random.key(0), deterministic=False, score_mod=flashvjp.softcap(3.0),
        implementation="pallas_tpu", block_q=16, block_kv=128)
    return jnp.sum(out ** 2), out

  f = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))
  a, b = f(q, k, v, bias), f(q, k, v, bias)
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("kw", [
    dict(causal=True, window=(9, 2)),
    dict(dropout_rate=0.25, dropout_rng=jax.random.key(3), deterministic=False, causal=True),
], ids=["causal_window", "dropout"])
def test_tpu_equals_triton_equals_blockwise_to_float32_rounding(kw):
  q, k, v = _util.random_qkv(4, 2, 4, 2, 45, 150, 16, 8)
  bias = 0.5 * jax.random.normal(jax.random.key(1), (1, 4, 45, 150), jnp.float32)
  with jax.default_matmul_precision("highest"):  # full float32 everywhere
    runs = {impl: _value_and_grads(impl, q, k, v, bias, block_q=16, block_kv=128, **kw)
            for impl in ("pallas_tpu", "pallas_triton", "blockwise")}
  _assert_float32_rounding(runs["pallas_tpu"], runs["blockwise"])
  _assert_float32_rounding(runs["pallas_tpu"], runs["pallas_triton"])


def test_dropout_keep_mask_is_the_shared_one():
  """With v = identity the output is the dropped-out probability matrix itself."""
  B, H, S = 1, 2, 24
  q, k, _ = _util.random_qkv(5, B, H, H, S, S, 16)
  v = jnp.broadcast_to(jnp.eye(S, dtype=jnp.float32), (B, H, S, S))
  rng, rate = jax.random.key(42), 0.4
  want = np.asarray(flashvjp.dropout_mask(rng, (B, H, S, S), rate))
  out = jax.jit(lambda q, k, v: flashvjp.flash_attention(
      q, k, v, dropout_rate=rate, dropout_rng=rng, deterministic=False,
      implementation="pallas_tpu", block_q=8, block_kv=128))(q, k, v)
  np.testing.assert_array_equal(np.asarray(out) != 0, want)


# ---- jax.debug_infs: no inf produced for finite inputs ------------------------------

def test_debug_infs_regression_case_and_empty_rows():
  """jax-ml/jax#37422 (zeros, float64, a key mask), key lengths, and query rows with no
  allowed key (out = 0; without return_lse no -inf is produced) under jax.debug_infs."""
  T, S, K, N, H = 5, 7, 3, 6, 11
  z = lambda *shape: np.zeros(shape, np.float64)
  rng = np.random.default_rng(5)
  q, k, v = (rng.standard_normal((2, n, 4, 8)) for n in (7, 9, 9))
  lengths = np.array([3, 7], np.int32)
  attn = functools.partial(flashvjp.dot_product_attention, implementation="pallas_tpu")
  with jax.debug_infs(True):
    out = attn(z(T, N, H), z(S, K, H), z(S, K, H), mask=np.r_[:S] <= S // 2)
    out_len = attn(z(2, T, N, H), z(2, S, K, H), z(2, S, K, H),
                   key_value_seq_lengths=np.array([S // 2 + 1, S], np.int32))
    got = attn(q, k, v, query_seq_lengths=lengths)
  np.testing.assert_array_equal(np.asarray(out), 0.0)
  np.testing.assert_array_equal(np.asarray(out_len), 0.0)
  ref = flashvjp.dot_product_attention(q, k, v, query_seq_lengths=lengths, implementation="naive")
  np.testing.assert_array_equal(np.asarray(got)[0, 3:], 0.0)
  _util.assert_close(got, ref, jnp.float64, what="pallas_tpu/empty_rows")


def test_debug_infs_grads_every_kernel_output_finite():
  """Every kernel output finite under jax.debug_infs, forward and backward (`_util`)."""
  _util.check_debug_infs_grads("pallas_tpu")


# ---- dispatch -------------------------------------------------------------------------

def test_default_on_a_tpu_is_pallas_tpu(monkeypatch):
  """implementation=None picks the Mosaic kernels when the dispatcher sees a TPU, and
  "pallas" means them there; explain() says which family and why."""
  monkeypatch.setattr(_dispatch, "platform", lambda: "tpu")
  x = jax.ShapeDtypeStruct((2, 4, 256, 64), jnp.bfloat16)
  d = flashvjp.explain(x, x, x, causal=True)
  assert (d.implementation, d.interpret, d.family) == ("pallas_tpu", False, "tpu"), d
  assert "Mosaic-TPU" in d.reason and "'tpu'" in d.reason, d.reason
  assert flashvjp.explain(x, x, x, implementation="pallas").implementation == "pallas_tpu"
  # An input the Mosaic kernels cannot take falls back to blockwise, saying why.
  big = jax.ShapeDtypeStruct((1, 1, 64, 512), jnp.bfloat16)
  d = flashvjp.explain(big, big, big)
  assert d.implementation == "blockwise" and "head dims up to 256" in d.reason, d
  with pytest.raises(ValueError, match="head dims up to 256"):
    flashvjp.explain(big, big, big, implementation="pallas_tpu")


def test_named_family_off_tpu_runs_interpreted():
  if _dispatch.platform() != "cpu":
    pytest.skip("CPU dispatch rule")
  x = jax.ShapeDtypeStruct((1, 2, 16, 8), jnp.float32)
  d = flashvjp.explain(x, x, x, implementation="pallas_tpu")
  assert (d.implementation, d.interpret) == ("pallas_tpu", True), d
  d = flashvjp.explain(x, x, x, implementation="pallas_tpu", interpret=False)
  assert not d.interpret and "jax.export" in d.reason, d


def test_limits():
  ok, why = _limits.supports(platform="tpu", interpret=False, query_shape=(1, 1, 8, 64),
                             key_shape=(1, 1, 8, 64), value_shape=(1, 1, 8, 64),
                             dtype=jnp.float64)
  assert not ok and "float64" in why
  ok, _ = _limits.supports(platform="cpu", interpret=True, query_shape=(1, 1, 8, 64),
                           key_shape=(1, 1, 8, 64), value_shape=(1, 1, 8, 64),
                           dtype=jnp.float64)
  assert ok
  # A table lookup by relative position is a row of differences per (b, h): it lowers. One
  # indexed by both positions at once is a gather on the tile: refused, with the reason.
  table, pairs = jnp.zeros((4, 13), jnp.float32), jnp.zeros((8, 8), jnp.float32)
  sm = lambda s, b, h, q, kv, t: s + t[h, jnp.clip(kv - q, -6, 6) + 6]
  assert _limits.score_mod_lowering_problem(sm, (table,)) is None
  why = _limits.score_mod_lowering_problem(lambda s, b, h, q, kv, p: s + p[q, kv], (pairs,))
  assert "gather" in why and "score_mod[0] float32[8,8]: otherwise" in why, why
  assert _limits.score_mod_lowering_problem(
      lambda s, b, h, q, kv, sl: s + sl[h] * (kv - q), (jnp.ones(4),)) is None


# ---- block sparsity -----------------------------------------------------------------

def _static_cfg(causal, window, S, blocks):
  return _config.AttentionConfig(
      scale=1.0, causal=causal, window=window, seq_q=S, seq_kv=S, dropout_rate=0.0,
      blocks=blocks)


@pytest.mark.parametrize("causal,window,S,bq,bk", [
    (True, None, 1024, 128, 128), (False, None, 1000, 128, 256), (False, (300, 0), 2048, 256, 128),
    (True, (None, 40), 777, 64, 128), (False, (64, 64), 512, 128, 128)])
def test_static_lists_are_numpy_constants_equal_to_the_device_ones(causal, window, S, bq, bk):
  """Without segment ids, a dense mask or a mask_mod the lists are numpy arrays built at
  trace time (no device op), and hold exactly what the device path computes (which runs
  inside custom_partitioning bodies, where constants are not allowed), for both kernels'
  row orders; block_class_table likewise."""
  cfg = _static_cfg(causal, window, S, _config.BlockSizes(bq, bk))
  g = _layout.geometry((1, 1, S, 64), (1, 1, S, 64), (1, 1, S, 64), bq, bk)
  for by in ("q", "kv"):
    lists, counts, entries = _layout.visit_lists(cfg, g, None, None, None, by)
    assert isinstance(counts, np.ndarray) and isinstance(entries, np.ndarray)
    with _mask.no_static_constants():
      dlists, dcounts, dentries = _layout.visit_lists(cfg, g, None, None, None, by)
    assert not isinstance(dentries, np.ndarray)
    assert (lists.Bl, lists.Hl, lists.R, lists.W) == (dlists.Bl, dlists.Hl, dlists.R, dlists.W)
    np.testing.assert_array_equal(counts, np.asarray(dcounts))
    np.testing.assert_array_equal(lists.rows(entries), dlists.rows(dentries))
  table = _layout.block_class_table(cfg, g, None, None, None)
  with _mask.no_static_constants():
    dtable = _layout.block_class_table(cfg, g, None, None, None)
  assert isinstance(table[2], np.ndarray)
  np.testing.assert_array_equal(table[2], np.asarray(dtable[2]))


def test_lists_visit_exactly_the_non_empty_blocks():
  """Packed documents + causal: the merged lists hold every non-empty block once, in
  increasing order, with the mask bit set exactly on partial blocks; idle entries repeat
  the last block (no DMA)."""
  S, bq, bk = 1024, 128, 128
  ids = np.zeros((1, S), np.int32)
  for c in (200, 450, 700):
    ids[:, c:] += 1
  # interpret: the segment-id lists kernel runs on this CPU
  cfg = dataclasses.replace(_static_cfg(True, None, S, _config.BlockSizes(bq, bk)),
                            interpret=True)
  g = _layout.geometry((1, 1, S, 64), (1, 1, S, 64), (1, 1, S, 64), bq, bk)
  seg = jnp.asarray(ids)
  lists, counts, entries = _layout.visit_lists(cfg, g, seg, seg, None, "q")
  counts = lists.host_counts(counts, entries).reshape(lists.R)
  entries = lists.rows(entries).reshape(lists.R, lists.W)
  allowed = np.asarray(_mask.MaskSpec(True, None, S, S).dense(seg, seg))[0, 0]
  tiles = allowed.reshape(g.nq, bq, g.nk, bk)
  for i in range(g.nq):
    some = np.flatnonzero(tiles[i].any(axis=(0, 2)))
    every = tiles[i].all(axis=(0, 2))
    got = entries[i, : counts[i]]
    np.testing.assert_array_equal(got // 2, some)
    np.testing.assert_array_equal(got % 2 == 1, ~every[some])
    assert (entries[i, counts[i]:] == entries[i, counts[i] - 1]).all()
  assert lists.W == g.nk  # causal: the longest row visits every kv block


@pytest.mark.parametrize("causal,window,Sq,Skv,bq,bk", [
    (True, None, 1024, 1024, 128, 128), (False, None, 1000, 1000, 128, 256),
    (True, (300, 0), 2048, 2048, 256, 128), (True, (None, 40), 777, 777, 64, 128),
    (False, None, 512, 1536, 64, 128)])
def test_segment_id_lists_kernel_equals_the_xla_lists(monkeypatch, causal, window, Sq, Skv, bq,
                                                      bk):
  """The lists kernel (`_lists.build`, interpret mode) against the same lists as XLA ops
  (what longer ids and custom_partitioning bodies get), both rows orders, two batch rows of
  random sorted ids: the same visits, mask bits and counts; and the kernel's own idle bits
  mark exactly the slots past each row's count."""
  from flashvjp.pallas.tpu import _lists
  rng = np.random.default_rng(Sq + Skv + bq)
  cfg = dataclasses.replace(_static_cfg(causal, window, Sq, _config.BlockSizes(bq, bk)),
                            seq_kv=Skv, interpret=True)
  g = _layout.geometry((2, 1, Sq, 64), (2, 1, Skv, 64), (2, 1, Skv, 64), bq, bk)
  ids = [jnp.asarray(np.sort(rng.integers(0, 5, (2, n)), axis=1).astype(np.int32))
         for n in (Sq, Skv)]
  qp, kp = _common.pad_segments(*ids, g)
  for by in ("q", "kv"):
    lists, counts, entries = _layout.visit_lists(cfg, g, qp, kp, None, by)
    with monkeypatch.context() as m:
      m.setattr(_lists, "fits", lambda *a: False)
      xlists, xcounts, xentries = _layout.visit_lists(cfg, g, qp, kp, None, by)
    assert lists.flagged and not xlists.flagged
    assert (lists.Bl, lists.R, lists.W) == (xlists.Bl, xlists.R, xlists.W)
    got_counts = lists.host_counts(counts, entries)
    np.testing.assert_array_equal(got_counts, xlists.host_counts(xcounts, xentries))
    np.testing.assert_array_equal(lists.rows(entries), xlists.rows(xentries))
    raw = np.asarray(entries).reshape(lists.Bl, lists.Wp, lists.R)
    idle = (raw & 2) != 0
    slot = np.arange(lists.Wp)[None, :, None]
    np.testing.assert_array_equal(idle, slot >= got_counts.reshape(lists.Bl, 1, lists.R))


def test_mask_mod_lists_visit_exactly_the_non_empty_blocks():
  """Chunked local attention (chunk 256) with per-batch prefixes as a mask_mod, classes at
  the kernel's own blocks: the merged lists hold exactly the non-empty blocks, mask bit on
  partial ones only, per batch row (the classes vary with b)."""
  from flashvjp import _mask_mod
  from flashvjp.pallas import _common
  B, S, bq, bk = 2, 1024, 128, 128
  lengths = jnp.asarray([100, 300], jnp.int32)
  mod = lambda b, h, q, kv: ((kv <= q) | (kv < lengths[b])) & (q // 256 == kv // 256)
  fn, consts, uses = _mask_mod.check(mod, (B, 1, S, S))
  classes = _mask_mod.classify(fn, consts, uses, B, 1, S, S, bq, bk)
  cfg = dataclasses.replace(_static_cfg(False, None, S, _config.BlockSizes(bq, bk)),
                            mask_mod=fn, mask_mod_blocks=(bq, bk), mask_mod_uses=uses)
  g = _layout.geometry((B, 1, S, 64), (B, 1, S, 64), (B, 1, S, 64), bq, bk)
  mod_cls = _common.mod_classes(cfg, g, _mask_mod.ModInputs(classes, consts))
  idx = lambda shape: jnp.arange(max(shape), dtype=jnp.int32).reshape(shape)
  allowed = np.asarray(jnp.broadcast_to(_mask_mod.apply(
      fn, consts, idx((B, 1, 1)), 0, idx((1, S, 1)), idx((1, 1, S))), (B, S, S)))
  for by in ("q", "kv"):
    lists, counts, entries = _layout.visit_lists(cfg, g, None, None, None, by, mod_cls)
    counts = lists.host_counts(counts, entries).reshape(lists.Bl, lists.R)
    entries = lists.rows(entries).reshape(lists.Bl, lists.R, lists.W)
    assert lists.Bl == B
    for b in range(B):
      a = allowed[b] if by == "q" else allowed[b].T
      tiles = a.reshape(g.nq, bq, g.nk, bk)
      for row in range(g.nq):
        some = np.flatnonzero(tiles[row].any(axis=(0, 2)))
        every = tiles[row].all(axis=(0, 2))
        got = entries[b, row, : counts[b, row]]
        np.testing.assert_array_equal(got // 2, some)
        np.testing.assert_array_equal(got % 2 == 1, ~every[some])


def test_sliding_window_grid_is_as_short_as_the_window():
  S, bq, bk = 8192, 128, 128
  cfg = _static_cfg(True, (1024, 0), S, _config.BlockSizes(bq, bk))
  g = _layout.geometry((1, 1, S, 64), (1, 1, S, 64), (1, 1, S, 64), bq, bk)
  assert _layout.static_width(cfg, g, "q") == 1024 // bk + 1
  assert _layout.static_width(cfg, g, "kv") == 1024 // bq + 1


# ---- VMEM budget ----------------------------------------------------------------------

VMEM_BUDGET = 16 * 2**20  # the default scoped VMEM of the smallest current TPU


def _vmem_bytes(shape, dtype):
  """Bytes of a VMEM buffer: last two dims padded to the (8 * packing, 128) native tile."""
  itemsize = jnp.dtype(dtype).itemsize
  shape = (1,) * max(0, 2 - len(shape)) + tuple(shape)
  packing = max(1, 4 // itemsize)
  rows = _layout.round_up(shape[-2], 8 * packing)
  cols = _layout.round_up(shape[-1], 128)
  return math.prod(shape[:-2]) * rows * cols * itemsize


def kernel_footprints(closed_jaxpr):
  """{kernel name: VMEM bytes} = every VMEM block x 2 (double buffering) + scratch."""
  out = {}
  for e in _pallas_calls(closed_jaxpr):
    gm = e.params["grid_mapping"]
    total = 0
    for bm in gm.block_mappings:
      space = str(bm.block_aval.memory_space).lower()
      if "smem" in space:
        continue
      shape = [1 if not isinstance(b, int) and not hasattr(b, "block_size") else
               (b if isinstance(b, int) else b.block_size) for b in bm.block_shape]
      shape = [s for s, b in zip(shape, bm.block_shape) if "Squeezed" not in type(b).__name__]
      total += 2 * _vmem_bytes(shape, bm.array_aval.dtype)
    n = gm.num_scratch_operands
    for var in (e.params["jaxpr"].invars[-n:] if n else []):
      total += _vmem_bytes(var.aval.shape, var.aval.dtype)
    out[str(e.params["name"])] = total
  return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_vmem_footprint_of_the_default_blocks(dtype):
  """Every kernel's blocks x buffers + scratch at the compiled defaults, head_dim 256 and
  every optional input (full bias, dense per-head mask, segment ids, score_mod, dropout)
  fit in 16 MiB, so the defaults have a chance on real hardware."""
  B, H, S, D = 1, 2, 2048, 256
  x = jax.ShapeDtypeStruct((B, H, S, D), dtype)
  bias = jax.ShapeDtypeStruct((B, H, S, S), jnp.float32)
  mask = jax.ShapeDtypeStruct((B, H, S, S), jnp.bool_)
  seg = jax.ShapeDtypeStruct((B, S), jnp.int32)
  slopes = jax.ShapeDtypeStruct((H,), jnp.float32)

  def loss(q, k, v, bias, mask, seg, slopes):
    return flashvjp.flash_attention(
        q, k, v, bias=bias, mask=mask, segment_ids=seg, causal=True,
        score_mod=flashvjp.alibi(slopes), dropout_rate=0.1, dropout_rng=jax.random.key(0),
        deterministic=False, implementation="pallas_tpu", interpret=False
    ).astype(jnp.float32).sum()

  jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1, 2, 3, 6)))(x, x, x, bias, mask, seg, slopes)
  sizes = kernel_footprints(jaxpr)
  names = sorted(sizes)
  assert len(names) == 4 and all(n.startswith("flashvjp_tpu_") for n in names), names
  for name, size in sizes.items():
    assert 2**20 < size <= VMEM_BUDGET, (name, size / 2**20)


# ---- transformations (the composition tests of tests/test_composition.py, on these kernels) ----

from tests import test_composition as _composition  # noqa: E402


@pytest.mark.parametrize("check", [_composition.test_jit_and_value_and_grad,
                                   _composition.test_vmap_over_extra_axis,
                                   _composition.test_remat,
                                   _composition.test_scan_over_layers],
                         ids=["jit_grad", "vmap", "remat", "scan"])
def test_composition(check):
  check("pallas_tpu")
