"""The Pallas kernels (interpret mode on CPU): the shared base plus Pallas-specific structure.

The shared base (tests/attention_base.py) checks every feature against float64
naive attention. The tests below check what is particular to the kernels: the
grad is the hand-written kernels (separate forward / backward pallas_calls),
agreement with the blockwise path to float32 rounding, the dropout keep-mask,
bitwise determinism, no O(seq^2) or per-query-head K/V arrays, and the limits.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashvjp
from flashvjp.pallas import _common
from flashvjp.pallas.triton import _limits
from tests import _util
from tests.attention_base import AttentionTests


class TestPallasInterpret(AttentionTests):
  IMPLEMENTATION = "pallas"


# ---- helpers ---------------------------------------------------------------------

def _subjaxprs(eqn):
  for v in eqn.params.values():
    if hasattr(v, "jaxpr") and hasattr(v, "consts"):  # ClosedJaxpr
      yield v.jaxpr
    elif hasattr(v, "eqns"):  # Jaxpr
      yield v


def _eqns(jaxpr, into_kernels=True):
  for e in jaxpr.eqns:
    yield e
    if e.primitive.name == "pallas_call" and not into_kernels:
      continue
    for sub in _subjaxprs(e):
      yield from _eqns(sub, into_kernels)


def _pallas_call_names(closed_jaxpr):
  return [str(e.params.get("name", e.params.get("name_and_src_info")))
          for e in _eqns(closed_jaxpr.jaxpr) if e.primitive.name == "pallas_call"]


def _count(names, kernel):
  return sum(1 for n in names if kernel in n)


def _pallas(q, k, v, **kw):
  """Pallas attention under jit (interpret mode is slow op by op)."""
  kw.setdefault("block_q", 16)
  kw.setdefault("block_kv", 16)
  return jax.jit(lambda q, k, v: flashvjp.flash_attention(q, k, v, implementation="pallas", **kw))(
      q, k, v)


# ---- structure ---------------------------------------------------------------------

def test_grad_runs_forward_and_separate_backward_kernels():
  q, k, v = _util.random_qkv(0, 1, 4, 2, 32, 32, 16)
  bias = jnp.zeros((1, 4, 1, 32), jnp.float32)
  loss = lambda q, k, v, bias: _pallas(q, k, v, bias=bias, causal=True).sum()
  fwd_names = _pallas_call_names(jax.make_jaxpr(loss)(q, k, v, bias))
  assert fwd_names and all("flashvjp_fwd" in n for n in fwd_names), fwd_names
  names = _pallas_call_names(jax.make_jaxpr(jax.grad(loss, (0, 1, 2, 3)))(q, k, v, bias))
  assert _count(names, "flashvjp_fwd") == 1, names
  assert _count(names, "flashvjp_bwd_dkdv") == 1, names
  assert _count(names, "flashvjp_bwd_dq") == 1, names
  assert _count(names, "flashvjp_bwd_dbias") == 1, names
  # Without a bias there is no dbias kernel.
  names = _pallas_call_names(jax.make_jaxpr(jax.grad(lambda q: _pallas(q, k, v).sum()))(q))
  assert _count(names, "flashvjp_bwd_dbias") == 0, names
  assert _count(names, "flashvjp_bwd_dq") == 1, names


def test_no_quadratic_array_and_no_kv_repeat():
  """Grad with GQA and a batch/head/row-broadcast bias: outside the kernels nothing has
  B*H*Sq*Skv elements, and no array holds K/V for every query head."""
  B, H, Hkv, Sq, Skv, D = 2, 4, 1, 48, 64, 16
  q, k, v = _util.random_qkv(1, B, H, Hkv, Sq, Skv, D)
  bias = jnp.ones((1, 1, 1, Skv), jnp.float32)
  loss = lambda q, k, v, bias: _pallas(q, k, v, bias=bias, block_q=16, block_kv=32).sum()
  jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1, 2, 3)))(q, k, v, bias)
  kernel_inputs = set()
  for e in _eqns(jaxpr.jaxpr, into_kernels=False):
    for var in e.outvars:
      shape = tuple(getattr(var.aval, "shape", ()))
      assert int(np.prod(shape)) < B * H * Sq * Skv, f"{e.primitive.name}: O(seq^2) array {shape}"
      assert shape != (B, H, Skv, D), f"{e.primitive.name}: K/V repeated per query head"
    if e.primitive.name == "pallas_call":
      kernel_inputs |= {tuple(x.aval.shape) for x in e.invars}
  assert (B, Hkv, Skv, D) in kernel_inputs, kernel_inputs
  assert (B, H, Skv, D) not in kernel_inputs, kernel_inputs


@pytest.mark.parametrize("kw", [
    dict(causal=True, window=(9, 2)),
    dict(dropout_rate=0.25, dropout_rng=jax.random.key(3), deterministic=False, causal=True),
], ids=["causal_window", "dropout"])
def test_matches_blockwise_to_float32_rounding(kw):
  q, k, v = _util.random_qkv(4, 2, 4, 2, 45, 37, 16, 8)
  bias = 0.5 * jax.random.normal(jax.random.key(1), (1, 4, 45, 37), jnp.float32)

  def run(impl):
    def loss(q, k, v, bias):
      out, lse = flashvjp.flash_attention(q, k, v, bias=bias, implementation=impl, block_q=16,
                                          block_kv=16, return_lse=True, **kw)
      return jnp.sum(out * jnp.sin(out)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0)), (out, lse)
    (_, res), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(q, k, v, bias)
    return res, grads

  with jax.default_matmul_precision("highest"):  # full float32 on both (IEEE dots in the kernels)
    got, ref = run("pallas"), run("blockwise")
  for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
    g, r = np.asarray(g), np.asarray(r)
    np.testing.assert_array_equal(np.isfinite(g), np.isfinite(r))
    f = np.isfinite(r)
    scale = max(np.abs(r[f]).max(), 1e-30)
    assert np.abs(g[f] - r[f]).max() <= 2e-6 * scale, np.abs(g[f] - r[f]).max() / scale


def test_dropout_keep_mask_is_the_shared_one():
  """With v = identity the output is the dropped-out probability matrix itself."""
  B, H, S = 1, 2, 24
  q, k, _ = _util.random_qkv(5, B, H, H, S, S, 16)
  v = jnp.broadcast_to(jnp.eye(S, dtype=jnp.float32), (B, H, S, S))
  rng, rate = jax.random.key(42), 0.4
  want = np.asarray(flashvjp.dropout_mask(rng, (B, H, S, S), rate))
  for impl in ("pallas", "blockwise"):
    out = jax.jit(lambda q, k, v, impl=impl: flashvjp.flash_attention(
        q, k, v, dropout_rate=rate, dropout_rng=rng, deterministic=False, implementation=impl,
        block_q=16, block_kv=16))(q, k, v)
    np.testing.assert_array_equal(np.asarray(out) != 0, want, err_msg=impl)
  assert 0.3 < 1 - want.mean() < 0.5


def test_bitwise_deterministic():
  q, k, v = _util.random_qkv(6, 2, 4, 2, 40, 40, 16)
  bias = jax.random.normal(jax.random.key(2), (2, 1, 40, 40), jnp.float32)
  seg = jnp.asarray(np.repeat([[0] * 15 + [1] * 25], 2, axis=0), jnp.int32)

  def make():
    def loss(q, k, v, bias):
      out = _pallas(q, k, v, bias=bias, segment_ids=seg, causal=True, dropout_rate=0.1,
                    dropout_rng=jax.random.key(0), deterministic=False,
                    score_mod=flashvjp.softcap(3.0))
      return jnp.sum(out ** 2), out
    return jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))

  f = make()  # one executable run twice: run-to-run nondeterminism (atomics) would show here
  a, b = f(q, k, v, bias), f(q, k, v, bias)
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_block_skipping_keeps_empty_blocks_exact():
  """A mask whose kv blocks 1 and 3 are entirely False: skipped blocks change nothing."""
  q, k, v = _util.random_qkv(7, 1, 2, 2, 32, 64, 16)
  mask = np.ones((1, 1, 32, 64), bool)
  mask[..., 16:32] = False
  mask[..., 48:] = False
  got = _pallas(q, k, v, mask=jnp.asarray(mask))
  ref = _pallas(q[..., :, :], k[:, :, np.r_[0:16, 32:48]], v[:, :, np.r_[0:16, 32:48]])
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-6, atol=1e-6)


def _kernel_primitives(closed_jaxpr):
  """{pallas_call name: set of primitive names inside its kernel body}."""
  found = {}
  for e in _eqns(closed_jaxpr.jaxpr, into_kernels=False):
    if e.primitive.name == "pallas_call":
      name = str(e.params.get("name", e.params.get("name_and_src_info")))
      found[name] = {x.primitive.name for sub in _subjaxprs(e) for x in _eqns(sub)}
  return found


_SPARSE_SEG = np.repeat([[0] * 20 + [1] * 30 + [2] * 14], 2, axis=0).astype(np.int32)


@pytest.mark.parametrize("kw", [
    dict(segment_ids=_SPARSE_SEG),
    dict(mask=np.random.default_rng(0).random((2, 4, 64, 64)) > 0.5),
    dict(mask=np.random.default_rng(1).random((1, 4, 1, 64)) > 0.5, causal=True,
         bias=np.zeros((2, 4, 64, 64), np.float32)),  # dbias per (q, kv) block: block classes
    dict(segment_ids=_SPARSE_SEG, bias=np.zeros((1, 4, 64, 1), np.float32)),  # dbias: lists
], ids=["segments", "mask_per_head", "mask_q_broadcast_causal_bias", "segments_bias_rows"])
def test_block_sparse_kernels_loop_without_a_branch(kw):
  """Segment ids / a dense mask: every kernel (forward, dK/dV, dQ, dbias) loops over the
  compacted block lists; no `cond` (an scf.if around the K/V loads under Triton, which
  stops software pipelining) is left in any kernel body, and the loops are there."""
  q, k, v = _util.random_qkv(9, 2, 4, 2, 64, 64, 16)
  kw = {n: jnp.asarray(x) for n, x in kw.items() if not isinstance(x, bool)} | {
      n: x for n, x in kw.items() if isinstance(x, bool)}
  bias = kw.pop("bias", None)

  def loss(q, k, v, bias):
    return jnp.sum(_pallas(q, k, v, bias=bias, block_q=16, block_kv=16, **kw) ** 2)

  argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
  kernels = _kernel_primitives(jax.make_jaxpr(jax.grad(loss, argnums))(q, k, v, bias))
  want = {"flashvjp_fwd", "flashvjp_bwd_dkdv", "flashvjp_bwd_dq"} | (
      set() if bias is None else {"flashvjp_bwd_dbias"})
  assert {w for w in want if any(w in n for n in kernels)} == want, sorted(kernels)
  for name, prims in kernels.items():
    assert "cond" not in prims, f"{name}: a branch in the kernel body"
    assert "while" in prims, f"{name}: no loop"


_PER_HEAD_MASK = np.random.default_rng(4).random((1, 4, 64, 64)) > 0.4
_PER_HEAD_MASK[..., 16:32, :] = False  # whole empty block rows and columns
_PER_HEAD_MASK[..., 48:] = False
_PREFIX = jnp.asarray([7, 30], jnp.int32)  # per-batch prefix lengths read by a mask_mod


@pytest.mark.parametrize("kw, bias_shape", [
    (dict(segment_ids=_SPARSE_SEG, causal=True), None),
    (dict(segment_ids=_SPARSE_SEG), (2, 4, 64, 1)),  # dbias: kv lists per q block
    (dict(mask=_PER_HEAD_MASK), (1, 4, 1, 64)),  # dbias: q lists per kv block
    (dict(segment_ids=_SPARSE_SEG, mask=_PER_HEAD_MASK), (1, 4, 1, 1)),  # every q block's lists
    (dict(mask=_PER_HEAD_MASK[:, :, :1], causal=True), (2, 1, 64, 64)),  # dbias: one tile
    # mask_mod (per-batch prefix lengths, chunks): its classes in every kernel's lists
    (dict(mask_mod=lambda b, h, q, kv: ((kv <= q) | (kv < _PREFIX[b])) & (q // 32 == kv // 32)),
     (1, 4, 1, 64)),  # dbias: q lists per kv block
    (dict(mask_mod=flashvjp.sliding_window_with_global(12, 3), segment_ids=_SPARSE_SEG),
     (2, 4, 64, 64)),  # dbias: one tile, mask_mod ANDed with segment ids
], ids=["segments_causal", "segments_bias_rows", "mask_bias_cols", "both_bias_scalar",
        "mask_q_broadcast_bias_full", "mask_mod_bias_cols", "mask_mod_segments_bias_full"])
def test_block_sparse_numerics(kw, bias_shape):
  """Packed documents / per-head masks / mask_mods with whole empty block pairs, through every kernel
  (forward, dK/dV, dQ, dbias on each of its block-list paths): out, lse and all gradients
  against float64 naive attention."""
  q, k, v = _util.random_qkv(10, 2, 4, 2, 64, 64, 16)
  kw = {n: (jnp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
  bias = None if bias_shape is None else 0.5 * jax.random.normal(
      jax.random.key(11), bias_shape, jnp.float64).astype(jnp.float32)

  def run(impl, q, k, v, bias):
    blocks = dict(block_q=16, block_kv=16) if impl != "naive" else {}

    def loss(q, k, v, bias):
      out, lse = flashvjp.flash_attention(q, k, v, bias=bias, return_lse=True,
                                          implementation=impl, **blocks, **kw)
      finite_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
      return jnp.sum(jnp.sin(out)) + jnp.sum(finite_lse * jnp.cos(finite_lse)), (out, lse)

    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    (_, res), grads = jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))(q, k, v, bias)
    return res, grads

  with jax.default_matmul_precision("highest"):
    got = run("pallas", q, k, v, bias)
  ref = run("naive", *_util.as64((q, k, v)), None if bias is None else bias.astype(jnp.float64))
  _util.assert_close(got, ref, jnp.float32, what="pallas/block_sparse")


# ---- jax.debug_infs: no inf produced for finite inputs ------------------------------

@pytest.mark.parametrize("impl", ["pallas", "blockwise"])
def test_debug_infs_jax_regression_case(impl):
  """jax-ml/jax#37422 (zeros, float64, a key mask) and its key-length variant, under
  jax.debug_infs, eager: no InternalFloatingPointError, and the output is exact."""
  T, S, K, N, H = 5, 7, 3, 6, 11
  z = lambda *shape: np.zeros(shape, np.float64)
  with jax.debug_infs(True):
    out = flashvjp.dot_product_attention(z(T, N, H), z(S, K, H), z(S, K, H),
                                         mask=np.r_[:S] <= S // 2, implementation=impl)
    out_len = flashvjp.dot_product_attention(
        z(2, T, N, H), z(2, S, K, H), z(2, S, K, H),
        key_value_seq_lengths=np.array([S // 2 + 1, S], np.int32), implementation=impl)
  np.testing.assert_array_equal(np.asarray(out), 0.0)
  np.testing.assert_array_equal(np.asarray(out_len), 0.0)


@pytest.mark.parametrize("impl", ["pallas", "blockwise"])
def test_debug_infs_empty_query_rows_without_lse(impl):
  """query_seq_lengths leaves rows with no allowed key (out = 0, lse = -inf): without
  return_lse the -inf lse is never produced, so jax.debug_infs stays quiet, eager."""
  rng = np.random.default_rng(5)
  q, k, v = (rng.standard_normal((2, n, 4, 8)) for n in (7, 9, 9))
  lengths = np.array([3, 7], np.int32)
  with jax.debug_infs(True):
    got = flashvjp.dot_product_attention(q, k, v, query_seq_lengths=lengths,
                                         implementation=impl)
  ref = flashvjp.dot_product_attention(q, k, v, query_seq_lengths=lengths, implementation="naive")
  np.testing.assert_array_equal(np.asarray(got)[0, 3:], 0.0)
  _util.assert_close(got, ref, jnp.float64, what=f"{impl}/empty_rows")


def test_debug_infs_grads_every_kernel_output_finite():
  """Every kernel output finite under jax.debug_infs, forward and backward (`_util`)."""
  _util.check_debug_infs_grads("pallas")


# ---- limits ------------------------------------------------------------------------

def _supports(**kw):
  args = dict(platform="gpu", interpret=False, query_shape=(1, 2, 128, 64),
              key_shape=(1, 2, 128, 64), value_shape=(1, 2, 128, 64), dtype=jnp.bfloat16)
  args.update(kw)
  return _limits.supports(**args)


def test_limits():
  assert _supports()[0]
  assert _supports(interpret=True, platform="cpu", dtype=jnp.float64)[0]
  ok, why = _supports(dtype=jnp.float64)
  assert not ok and "float64" in why
  ok, why = _supports(query_shape=(1, 2, 128, 512), key_shape=(1, 2, 128, 512))
  assert not ok and "256" in why
  # Compiled Triton kernels off a GPU lower for CUDA (jax.export on a CPU host); the
  # dispatcher allows that only for implementation="pallas_triton" (tests/test_dispatch.py).
  assert _supports(platform="cpu")[0]


def test_limits_score_mod_against_triton_rules():
  from flashvjp import _score_mod
  fn, consts, _ = _score_mod.convert(flashvjp.softcap(2.0), jnp.float32)
  assert _supports(has_score_mod=True, score_mod=fn, score_mod_consts=consts)[0]
  # ALiBi's slopes[h] is per-head: precomputed outside the kernels, so it lowers
  # (also with 12 heads, a non-power-of-2 slope vector).
  fn, consts, _ = _score_mod.convert(flashvjp.alibi(flashvjp.alibi_slopes(12)), jnp.float32)
  assert _supports(has_score_mod=True, score_mod=fn, score_mod_consts=consts)[0]
  # A table indexed by kv_idx - q_idx is a row of differences per (b, h): it lowers.
  table = jnp.zeros((4, 9), jnp.float32)
  fn, consts, _ = _score_mod.convert(flashvjp.relative_position_bias(table, 4), jnp.float32)
  assert _supports(has_score_mod=True, score_mod=fn, score_mod_consts=consts)[0]
  # One indexed by both positions at once is a gather on the tile: refused, with the reason.
  pairs = jnp.zeros((16, 16), jnp.float32)
  fn, consts, _ = _score_mod.convert(lambda s, b, h, i, j: s + pairs[i, j], jnp.float32)
  ok, why = _supports(has_score_mod=True, score_mod=fn, score_mod_consts=consts)
  assert not ok and "gather" in why and "otherwise" in why, why


def test_pallas_on_cpu_without_interpret_is_a_clear_error():
  q, k, v = _util.random_qkv(0, 1, 1, 1, 8, 8, 8)
  if jax.default_backend() != "cpu":
    pytest.skip("checks the CPU error")
  with pytest.raises(ValueError, match="interpret"):
    flashvjp.flash_attention(q, k, v, implementation="pallas", interpret=False)


def test_geometry_is_triton_shaped():
  for block, seq, want in ((1, 100, 16), (48, 100, 64), (128, 37, 64), (64, 1000, 64)):
    assert _common.effective_block(block, seq) == want
  assert [_common.padded_head_dim(d) for d in (1, 8, 16, 40, 64, 96, 256)] == \
      [16, 16, 16, 64, 64, 128, 256]


def test_head_dim_padding_forward():
  """Head dims that are not powers of 2 (padded to 128 in-kernel) against naive."""
  q, k, v = _util.random_qkv(8, 1, 2, 1, 20, 24, 72, 40)
  got = _pallas(q, k, v, causal=True)
  ref = flashvjp.flash_attention(*_util.as64((q, k, v)), causal=True, implementation="naive")
  _util.assert_close(got, ref, jnp.float32, impl="pallas")


# ---- transformations (the composition tests of tests/test_composition.py, on the kernels) ----

from tests import test_composition as _composition  # noqa: E402


@pytest.mark.parametrize("check", [_composition.test_jit_and_value_and_grad,
                                   _composition.test_vmap_over_extra_axis,
                                   _composition.test_remat,
                                   _composition.test_scan_over_layers],
                         ids=["jit_grad", "vmap", "remat", "scan"])
def test_composition(check):
  check("pallas")


# ---- both dK/dV orientations (the launch table transposes per row) -------------------

@pytest.mark.parametrize("head_dim", [64, 96])
def test_dkdv_both_orientations_against_naive(head_dim):
  """float32 at head dim 64 runs the transposed dK/dV tiles ([bk, bq]), at 96 the untransposed
  ones (the table keeps TF32 d80-128 untransposed: transposed spills): both against float64
  naive with every tile input the orientation touches (bias, segments, score_mod, dropout)."""
  from flashvjp import _config
  orient = {d: _config.launch(d, jnp.float32, "default", "dkdv").transposed for d in (64, 96)}
  assert orient[64] != orient[96], orient  # the two parametrizations cover both branches
  B, H, Hkv, S = 1, 2, 1, 40
  q, k, v = _util.random_qkv(3, B, H, Hkv, S, S, head_dim, 24)
  bias = jax.random.normal(jax.random.key(9), (1, H, S, S), jnp.float32)
  seg = jnp.asarray(np.repeat((np.arange(S) >= 13)[None].astype(np.int32), B, 0))
  kw = dict(causal=True, segment_ids=seg, score_mod=flashvjp.alibi(flashvjp.alibi_slopes(H)),
            dropout_rate=0.25, dropout_rng=jax.random.key(4), deterministic=False)
  w = jax.random.normal(jax.random.key(5), (B, H, S, 24), jnp.float64)

  def loss(impl, q, k, v, bias):
    out = flashvjp.flash_attention(q, k, v, bias=bias, implementation=impl, block_q=16,
                                   block_kv=16, **kw)
    return jnp.sum(out.astype(jnp.float64) * w)

  got = jax.grad(lambda *a: loss("pallas", *a), (0, 1, 2, 3))(q, k, v, bias)
  ref = jax.grad(lambda *a: loss("naive", *a), (0, 1, 2, 3))(*_util.as64((q, k, v, bias)))
  for name, g, r in zip(("dq", "dk", "dv", "dbias"), got, ref):
    _util.assert_close(g, r, jnp.float32, name, impl="pallas_triton")


# ---- mask_mod -------------------------------------------------------------------------

def _mod_setup(mod, B, H, S, bq, bk, uses=(True, True), mod_blocks=(16, 16)):
  """(cfg with the scalar mask_mod, ModInputs at mod_blocks, dense allowed [B', H', S, S])."""
  from flashvjp import _config
  from flashvjp import _mask_mod
  fn, consts, uses = _mask_mod.check(mod, (B, H, S, S))
  classes = _mask_mod.classify(fn, consts, uses, B, H, S, S, *mod_blocks)
  cfg = _config.AttentionConfig(
      scale=1.0, causal=False, window=None, seq_q=S, seq_kv=S, dropout_rate=0.0,
      blocks=_config.BlockSizes(bq, bk), mask_mod=fn, mask_mod_blocks=mod_blocks,
      mask_mod_uses=uses)
  Bp, Hp = classes.shape[:2]
  idx = lambda n, shape: jnp.arange(n, dtype=jnp.int32).reshape(shape)
  dense = _mask_mod.apply(fn, consts, idx(Bp, (Bp, 1, 1, 1)), idx(Hp, (1, Hp, 1, 1)),
                          idx(S, (1, 1, S, 1)), idx(S, (1, 1, 1, S)))
  dense = np.asarray(jnp.broadcast_to(dense, (Bp, Hp, S, S)))
  return cfg, _mask_mod.ModInputs(classes, consts), dense


@pytest.mark.parametrize("mod_blocks", [(16, 16), (8, 8), (8, 32)],
                         ids=["same_blocks", "finer_classes", "coarser_kv_classes"])
def test_mask_mod_lists_visit_exactly_the_non_empty_blocks(mod_blocks):
  """A mask_mod's block classes (resampled to the kernel's blocks when they differ) make
  the kernels' lists: per q block (forward, dQ) and per kv block (dK/dV), the PARTIAL list
  is exactly the blocks the mask_mod allows somewhere but not everywhere, the FULL list
  exactly those it allows everywhere; an EMPTY block is in neither (never visited).
  Classes at coarser blocks than the kernel's are resampled conservatively: a kernel block
  inside a PARTIAL class block stays PARTIAL (masked), never FULL."""
  B, H, S, bq, bk = 2, 1, 96, 16, 16
  mod = lambda b, h, q, kv: ((kv <= q) | (kv < jnp.asarray([20, 50])[b])) & (q // 32 == kv // 32) | (kv < 3)
  cfg, mod_in, dense = _mod_setup(mod, B, H, S, bq, bk, mod_blocks=mod_blocks)
  g = _common.geometry(cfg, (B, H, S, 16), (B, H, S, 16), (B, H, S, 16), bq, bk)
  tiles = dense.reshape(dense.shape[0], dense.shape[1], g.nq, bq, g.nk, bk)
  some, every = tiles.any(axis=(3, 5)), tiles.all(axis=(3, 5))
  for by in ("q", "kv"):
    counts, lists = (np.asarray(x) for x in _common.block_lists(
        cfg, g, None, None, None, by, mod_cls=_common.mod_classes(cfg, g, mod_in)))
    s_, e_ = (some, every) if by == "q" else (np.swapaxes(some, 2, 3), np.swapaxes(every, 2, 3))
    for b in range(counts.shape[0]):
      for row in range(counts.shape[3]):
        partial = lists[b, 0, row, 0, : counts[b, 0, 0, row]]
        full = lists[b, 0, row, 1, : counts[b, 0, 1, row]]
        if mod_blocks[1] > bk:  # conservative: FULL only where truly full, nothing non-empty lost
          assert set(full) <= set(np.flatnonzero(e_[b, 0, row]))
          assert set(np.flatnonzero(s_[b, 0, row])) <= set(full) | set(partial)
          continue
        np.testing.assert_array_equal(full, np.flatnonzero(e_[b, 0, row]))
        np.testing.assert_array_equal(partial, np.flatnonzero(s_[b, 0, row] & ~e_[b, 0, row]))
  assert (~some).sum() > 0 and every.sum() > 0  # the case has EMPTY and FULL blocks


def test_mask_mod_empty_blocks_are_never_read():
  """K/V of a kv block no query may attend (EMPTY for every q block) hold NaN: a kernel
  that copied or multiplied them would put NaN into out or dQ. The mask_mod also reads a
  per-batch array (a residual loaded per program)."""
  q, k, v = _util.random_qkv(21, 2, 2, 1, 48, 64, 16)
  k = k.at[:, :, 16:32].set(jnp.nan)
  v = v.at[:, :, 16:32].set(jnp.nan)
  lengths = jnp.asarray([10, 40], jnp.int32)
  mod = lambda b, h, qi, kv: ((kv <= qi) | (kv < lengths[b])) & ((kv < 16) | (kv >= 32))

  def loss(q, k, v):
    return jnp.sum(_pallas(q, k, v, mask_mod=mod) ** 2)

  val, (dq, dk, dv) = jax.value_and_grad(loss, (0, 1, 2))(q, k, v)
  assert np.isfinite(np.asarray(val)) and np.isfinite(np.asarray(dq)).all()
  keep = np.r_[0:16, 32:64]
  assert np.isfinite(np.asarray(dk)[:, :, keep]).all() and np.isfinite(np.asarray(dv)[:, :, keep]).all()
  ref = flashvjp.flash_attention(q, k[:, :, keep], v[:, :, keep], implementation="naive",
                                 mask_mod=lambda b, h, qi, kv: mod(b, h, qi, jnp.where(kv >= 16, kv + 16, kv)))
  with jax.default_matmul_precision("highest"):  # not TF32: compare to float32 rounding
    got = _pallas(q, k, v, mask_mod=mod)
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_mask_mod_dispatch_compiled():
  """document_causal reads doc_ids[b, q_idx] and doc_ids[b, kv_idx] per position: both
  families take them as per-position residuals (issue 32), so implementation=None on a GPU
  compiles them; a mask_mod that indexes an array by both positions at once is refused,
  naming mask_mod. prefix_lm / chunked / sliding_window_with_global stay on the kernels."""
  from flashvjp import _dispatch
  x = jax.ShapeDtypeStruct((2, 2, 64, 32), jnp.bfloat16)
  docs = flashvjp.document_causal(jnp.zeros((2, 64), jnp.int32))
  for impl in ("pallas_triton", "pallas_tpu"):
    d = flashvjp.explain(x, x, x, mask_mod=docs, implementation=impl, interpret=False)
    assert not d.interpret and [o.how for o in d.operands] == ["by q position and by kv position"]
  pairs = jnp.zeros((64, 64), jnp.bool_)
  with pytest.raises(ValueError, match="mask_mod uses (gather|dynamic_slice)"):
    flashvjp.explain(x, x, x, mask_mod=lambda b, h, i, j: pairs[i, j],
                     implementation="pallas_triton", interpret=False)
  # Interpret mode gathers fine.
  assert flashvjp.explain(x, x, x, mask_mod=docs, implementation="pallas_triton").interpret
  mp = pytest.MonkeyPatch()
  try:
    mp.setattr(_dispatch, "platform", lambda: "gpu")
    for ok in (docs, flashvjp.prefix_lm(jnp.asarray([3, 40], jnp.int32)), flashvjp.chunked(16),
               flashvjp.sliding_window_with_global(8, 2)):
      d = flashvjp.explain(x, x, x, mask_mod=ok)
      assert (d.implementation, d.interpret) == ("pallas_triton", False), d
  finally:
    mp.undo()
