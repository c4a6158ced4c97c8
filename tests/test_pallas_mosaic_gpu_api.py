"""The Mosaic-GPU family behind the one op: `implementation="pallas_mosaic_gpu"`.

The kernels' own checks (interpret mode with race detection, mutations, sm_90a compiles) are
tests/test_pallas_mosaic_gpu.py (forward) and tests/test_pallas_mosaic_gpu_backward.py. Here:
the dispatch (named only, Hopper only, refusals before any kernel), `jax.grad` / `jax.jvp`
through `flash_attention` against float64 naive attention, and the deviceless H100 compile of
the public call.
"""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashvjp
from flashvjp.pallas.mosaic_gpu import _compat
from tests import _aot

pytestmark = pytest.mark.skipif(_compat.unavailable() is not None,
                                reason=str(_compat.unavailable()))

IMPL = "pallas_mosaic_gpu"


def _qkv(B=1, H=4, Hkv=2, S=128, D=64, dtype=jnp.bfloat16, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((B, H, S, D)), dtype)
  k = jnp.asarray(rng.standard_normal((B, Hkv, S, D)), dtype)
  v = jnp.asarray(rng.standard_normal((B, Hkv, S, D)), dtype)
  return q, k, v


def test_named_only_interpret_on_cpu_and_its_own_tangent_kernel():
  q, k, v = _qkv()
  d = flashvjp.explain(q, k, v, causal=True, implementation=IMPL)
  assert d.implementation == IMPL and d.interpret and d.family == "mosaic_gpu"
  assert "Mosaic-GPU fused tangent kernel" in d.forward_mode["jvp"]
  # never chosen by itself: None picks blockwise on CPU, "pallas" the Triton family
  assert flashvjp.explain(q, k, v).implementation == "blockwise"
  assert flashvjp.explain(q, k, v, implementation="pallas").implementation == "pallas_triton"


def test_refusals_name_the_family_that_takes_it():
  q, k, v = _qkv(dtype=jnp.float32)
  with pytest.raises(ValueError, match="pallas_triton"):
    flashvjp.explain(q, k, v, implementation=IMPL)
  q, k, v = _qkv()
  # arrays read by one position and tables read by kv_idx - q_idx are taken (per-position
  # residuals, rel windows)...
  bias_vec = jnp.linspace(-1.0, 1.0, 128)
  table = jnp.linspace(-1.0, 1.0, 4 * 17).reshape(4, 17)
  for kw in (dict(score_mod=lambda s, b, h, i, j: s + bias_vec[j]),
             dict(mask_mod=flashvjp.document_causal(jnp.zeros((1, 128), jnp.int32))),
             dict(score_mod=flashvjp.relative_position_bias(table, 8))):
    assert flashvjp.explain(q, k, v, implementation=IMPL, **kw).implementation == IMPL
  # ... an array read at both positions is not: the Triton / Mosaic-TPU families take it
  pair_bias = jnp.ones((128, 128))
  with pytest.raises(ValueError, match=r"score_mod.*both positions"):
    flashvjp.explain(q, k, v, implementation=IMPL,
                     score_mod=lambda s, b, h, i, j: s + pair_bias[i, j])
  pairs = jnp.ones((128, 128), bool)
  with pytest.raises(ValueError, match=r"mask_mod"):
    flashvjp.explain(q, k, v, implementation=IMPL, mask_mod=lambda b, h, i, j: pairs[i, j])


def test_old_jax_is_refused_naming_the_version(monkeypatch):
  monkeypatch.setattr(_compat, "_version", lambda: (0, 10, 2))
  q, k, v = _qkv()
  with pytest.raises(ValueError, match=r"jax >= 0\.11\.2"):
    flashvjp.explain(q, k, v, implementation=IMPL)


def test_a_cpu_pool_too_small_for_the_interpreter_is_an_error_not_a_hang(monkeypatch):
  # The interpreter runs each warpgroup as a program on XLA's CPU pool (sized from NPROC):
  # the 3-warpgroup forward on a 2-thread pool deadlocked CI at a barrier. The check reads
  # the environment, so a small NPROC here must refuse before anything is traced.
  monkeypatch.setenv("NPROC", "2")
  assert _compat.cpu_pool_threads() == 2
  q, k, v = _qkv(S=256)  # 256 rows: two consumer warpgroups and the producer
  with pytest.raises(RuntimeError, match=r"forward.*3 warpgroups.*NPROC=4"):
    jax.jit(lambda q, k, v: flashvjp.flash_attention(
        q, k, v, causal=True, implementation=IMPL)).trace(q, k, v)
  monkeypatch.setenv("NPROC", "1")
  loss = lambda q: flashvjp.flash_attention(q, k, v, implementation=IMPL).sum()
  with pytest.raises(RuntimeError, match="NPROC"):
    jax.jit(jax.grad(loss)).trace(q)
  monkeypatch.setenv("NPROC", "3")
  assert _compat.interpret_threads_problem(3, "forward") is None
  assert "backward" in _compat.interpret_threads_problem(4, "backward")


def test_grad_through_flash_attention_against_float64():
  q, k, v = _qkv(S=160)  # not a multiple of the blocks
  report = flashvjp.testing.check(query=q, key=k, value=v, causal=True, implementation=IMPL)
  assert report.passed, str(report)


def test_jvp_through_flash_attention_against_float64(monkeypatch):
  """jax.jvp runs the family's forward and its tangent kernel (fails if forward mode took
  another pass: the blockwise tangent is made unreachable)."""
  from flashvjp.blockwise import _tangent
  monkeypatch.setattr(_tangent, "tangent", None)
  q, k, v = _qkv(S=128, seed=1)
  t = _qkv(S=128, seed=2)
  f = lambda impl: lambda q, k, v: flashvjp.flash_attention(q, k, v, window=(32, 0),
                                                            implementation=impl)
  out, tan = jax.jit(lambda *a: jax.jvp(f(IMPL), a[:3], a[3:]))(q, k, v, *t)
  f64 = lambda xs: tuple(x.astype(jnp.float64) for x in xs)
  ref_out, ref_tan = jax.jvp(f("naive"), f64((q, k, v)), f64(t))
  for got, ref in ((out, ref_out), (tan, ref_tan)):
    got = np.asarray(got.astype(jnp.float64))
    err = np.abs(got - np.asarray(ref)).max() / np.abs(np.asarray(ref)).max()
    assert np.isfinite(got).all() and err < flashvjp._check.tolerance(jnp.bfloat16, IMPL)


def test_score_mod_and_mask_mod_grads_against_float64():
  """The forward and backward kernels apply a score_mod and a mask_mod whose per-(b, h)
  values are scalars: ALiBi slopes (their gradient too) with a softcap, prefix-LM lengths
  per batch; out and the gradients to q, k, v and the slopes against float64 naive
  attention's autodiff."""
  q, k, v = _qkv(B=2, S=160, seed=3)  # not a multiple of the blocks
  slopes = flashvjp.alibi_slopes(4)
  lengths = jnp.asarray([40, 100], jnp.int32)

  def f(impl):
    def run(q, k, v, sl):
      cap = flashvjp.softcap(20.0)
      al = flashvjp.alibi(sl)
      out = flashvjp.flash_attention(
          q, k, v, implementation=impl, mask_mod=flashvjp.prefix_lm(lengths),
          score_mod=lambda s, b, h, i, j: cap(al(s, b, h, i, j), b, h, i, j))
      return out
    return run

  w = jnp.asarray(np.random.default_rng(4).standard_normal(q.shape), jnp.float32)
  loss = lambda impl: lambda *a: jnp.sum(f(impl)(*a).astype(jnp.float32) * w)
  got = jax.value_and_grad(loss(IMPL), argnums=(0, 1, 2, 3))(q, k, v, slopes)
  f64 = lambda xs: tuple(x.astype(jnp.float64) for x in xs)
  ref = jax.value_and_grad(loss("naive"), argnums=(0, 1, 2, 3))(*f64((q, k, v, slopes)))
  tol = flashvjp._check.tolerance(jnp.bfloat16, IMPL)
  for name, g, r in zip(["out . w", "dq", "dk", "dv", "dslopes"],
                        jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
    g, r = np.asarray(jnp.asarray(g, jnp.float64)), np.asarray(r)
    err = np.abs(g - r).max() / max(np.abs(r).max(), 1e-30)
    assert np.isfinite(g).all() and err < tol, (name, err, tol)


@_aot.needs_cuda
def test_h100_compile_of_the_public_call():
  mesh = _aot.gpu_mesh("h100")
  q = _aot.sds(mesh, (2, 8, 4096, 128), jnp.bfloat16)
  k = _aot.sds(mesh, (2, 2, 4096, 128), jnp.bfloat16)
  loss = lambda q, k, v: flashvjp.flash_attention(q, k, v, causal=True, implementation=IMPL
                                                  ).astype(jnp.float32).sum()
  d = flashvjp.explain(q, k, k, causal=True, implementation=IMPL)
  assert not d.interpret and d.target.platform == "gpu"
  hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, k, k).compile().as_text()
  assert hlo.count('custom_call_target="mosaic_gpu') >= 3  # forward, dK/dV, dQ
  assert not _aot.interpret_loops(hlo)
  assert "flashvjp_sm100" not in hlo  # Hopper's kernels on a Hopper target


def test_the_targets_device_kind_picks_the_kernels():
  """Hopper kinds run the sm_90a kernels, Blackwell ones the sm_100a kernels, others (Ampere)
  are refused naming Pallas-Triton; an unknown kind (a deviceless export) keeps Hopper's."""
  from flashvjp.pallas.mosaic_gpu import _limits
  assert _limits.gpu_arch("NVIDIA H100 80GB HBM3") is None
  assert _limits.gpu_arch("NVIDIA B200") == _limits.gpu_arch("NVIDIA GB200") == "sm_100a"
  assert _limits.gpu_arch(None) is None
  for kind in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA B200", None):
    assert _limits.device_problem(kind) is None, kind
  assert "pallas_triton" in _limits.device_problem("NVIDIA A100-SXM4-80GB")


_B200_COMPILE = """
import jax, jax.numpy as jnp
from jax.experimental.mosaic.gpu import utils as mgpu_utils
mgpu_utils._infer_arch = lambda: (10, 0)  # the target's arch (no GPU here: docs/blackwell.md)
import flashvjp
from tests import _aot
mesh = _aot.gpu_mesh("b200")
q = _aot.sds(mesh, (1, 4, 1024, 128), jnp.bfloat16)
k = _aot.sds(mesh, (1, 2, 1024, 128), jnp.bfloat16)
loss = lambda q, k, v: flashvjp.flash_attention(q, k, v, causal=True,
                                                implementation="pallas_mosaic_gpu"
                                                ).astype(jnp.float32).sum()
print(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, k, k).compile().as_text())
print("COMPILED")
"""


@_aot.needs_cuda
def test_b200_compile_of_the_public_call_runs_the_sm100_kernels(monkeypatch):
  """On a Blackwell target the family runs its sm_100a kernels (forward, dQ, dK/dV), read from
  the target's device kind: jit(value_and_grad) compiles for a B200 with no GPU; what those
  kernels lack is refused by name (at dispatch, or at their entry), forward mode included;
  `"pallas"` keeps Pallas-Triton there and says why."""
  if _compat.blackwell_unavailable() is not None:
    pytest.skip(_compat.blackwell_unavailable())
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  # Mosaic infers the arch from a local GPU, 9.0 without one (docs/blackwell.md): a deviceless
  # B200 compile sets the target's
  monkeypatch.setattr(mgpu_utils, "_infer_arch", lambda: (10, 0))
  mesh = _aot.gpu_mesh("b200")
  q = _aot.sds(mesh, (1, 4, 1024, 128), jnp.bfloat16)
  k = _aot.sds(mesh, (1, 2, 1024, 128), jnp.bfloat16)
  d = flashvjp.explain(q, k, k, causal=True, implementation=IMPL)
  assert not d.interpret and "Blackwell" in d.reason and "sm_100a" in d.reason
  # the compile in a fresh process (ptxas keeps the first compile's SM version in a process)
  proc = subprocess.run([sys.executable, "-c", _B200_COMPILE], capture_output=True, text=True,
                        timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert "COMPILED" in proc.stdout, proc.stderr[-4000:]
  hlo = proc.stdout
  assert hlo.count('custom_call_target="mosaic_gpu') >= 3  # forward, dK/dV, dQ
  for name in ("flashvjp_sm100_fwd", "flashvjp_sm100_bwd_dq", "flashvjp_sm100_bwd_dkdv"):
    assert name in hlo, name
  assert "flashvjp_bwd_dkdv" not in hlo  # not Hopper's
  with pytest.raises(NotImplementedError, match="tangent.*sm_100a"):
    jax.jit(lambda q, k, v: jax.jvp(lambda q: flashvjp.flash_attention(
        q, k, v, implementation=IMPL), (q,), (q,))).lower(q, k, k)
  with pytest.raises(NotImplementedError, match="sm_100a.*bias"):
    jax.jit(lambda q, k, v, b: flashvjp.flash_attention(q, k, v, bias=b, implementation=IMPL)
            ).lower(q, k, k, _aot.sds(mesh, (1, 1, 1024, 1024), jnp.float32))
  wide = _aot.sds(mesh, (1, 4, 1024, 256), jnp.bfloat16)
  with pytest.raises(ValueError, match="Blackwell.*head_dim 256"):
    flashvjp.explain(wide, wide, wide, implementation=IMPL)
  d = flashvjp.explain(q, k, k, causal=True)
  assert d.implementation == "pallas_triton" and "Blackwell" in d.reason


def _poisoned_blocks_case(form):
  """S=256, GQA: keys 64..127 are attended by no query and queries 192..255 attend no key
  (segment ids, a dense mask or a mask_mod), under causal. Returns the call's keyword
  arguments for `flash_attention`."""
  S = 256
  pos = np.arange(S)
  if form == "segments":
    q_ids = np.where(pos < 128, 0, np.where(pos < 192, 2, 3))
    kv_ids = np.where(pos < 64, 0, np.where(pos < 128, 1, 2))
    return dict(segment_ids=(jnp.asarray(q_ids[None], jnp.int32),
                             jnp.asarray(kv_ids[None], jnp.int32)))
  keep = lambda q, kv: ((kv < 64) | (kv >= 128)) & (q < 192)
  if form == "mask":
    m = np.random.default_rng(5).random((1, 1, S, S)) > 0.2
    m &= keep(pos[:, None], pos[None, :])
    return dict(mask=jnp.asarray(m))
  if form == "bias+mask_mod":  # dbias: the dQ kernel's skipped tiles must read as zero
    bias = jnp.asarray(np.random.default_rng(6).standard_normal((1, 2, S, S)), jnp.float32)
    return dict(bias=bias, mask_mod=lambda b, h, q, kv: keep(q, kv))
  return dict(mask_mod=lambda b, h, q, kv: keep(q, kv))


@pytest.mark.parametrize("form", ["segments", "mask", "mask_mod", "bias+mask_mod"])
def test_empty_blocks_are_never_read(form):
  """Blocks that segment ids, a dense mask or a mask_mod leave EMPTY are skipped by every
  kernel (the visit lists, as the Triton family's): K / V of keys 64..127 (no query attends
  them) and Q / dO of queries 192..255 (they attend nothing) hold NaN, which a kernel that
  fetched and multiplied them would put into out, dQ, dK or dV (0 * NaN). Out and the
  gradients equal float64 naive attention's on clean inputs (those keys get zero dK / dV)."""
  q, k, v = _qkv(H=2, Hkv=1, S=256, seed=7)
  kw = dict(_poisoned_blocks_case(form), causal=True)
  bias = kw.pop("bias", None)
  rng = np.random.default_rng(8)
  dout = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  nan_k = k.at[:, :, 64:128].set(jnp.nan)
  nan_v = v.at[:, :, 64:128].set(jnp.nan)
  nan_q = q.at[:, :, 192:].set(jnp.nan)
  nan_do = dout.at[:, :, 192:].set(jnp.nan)

  def f(impl):
    return lambda q, k, v, b: flashvjp.flash_attention(
        q, k, v, bias=b, implementation=impl, **kw).astype(jnp.promote_types(q.dtype,
                                                                             jnp.float32))

  b_in = () if bias is None else (bias,)
  run = f(IMPL) if bias is not None else (lambda q, k, v: f(IMPL)(q, k, v, None))
  out, vjp = jax.vjp(run, nan_q, nan_k, nan_v, *b_in)
  grads = vjp(nan_do)
  f64 = lambda xs: tuple(x.astype(jnp.float64) for x in xs)
  ref_run = f("naive") if bias is not None else (lambda q, k, v: f("naive")(q, k, v, None))
  ref_out, ref_vjp = jax.vjp(ref_run, *f64((q, k, v) + b_in))
  ref_grads = ref_vjp(dout.at[:, :, 192:].set(0.0).astype(jnp.float64))
  tol = flashvjp._check.tolerance(jnp.bfloat16, IMPL)
  names = ["out", "dq", "dk", "dv", "dbias"]
  for name, g, r in zip(names, (out,) + tuple(grads), (ref_out,) + tuple(ref_grads)):
    g, r = np.asarray(jnp.asarray(g, jnp.float64)), np.asarray(r)
    if name == "dq":  # the poisoned queries attend nothing: dq 0 there (and in the reference)
      g, r = g[:, :, :192], r[:, :, :192]
    assert np.isfinite(g).all(), f"{name}: NaN from a block that should never be read"
    err = np.abs(g - r).max() / max(np.abs(r).max(), 1e-30)
    assert err < tol, (name, err, tol)
  assert np.all(np.asarray(grads[1])[:, :, 64:128] == 0)  # dk of the keys no query sees


def test_visit_lists_are_the_mask_models_non_empty_blocks():
  """Work count: each Mosaic-GPU kernel's visit lists hold exactly the blocks the mask model
  (`_mask.block_classes`, as the Triton family's lists) finds non-empty at that kernel's
  blocks, the PARTIAL ones (masked) first, then the FULL ones (unmasked): the forward per
  128-row CTA (each consumer's PARTIAL run: the entries inside its own 64 rows' static
  bounds), dQ per 64-row q block, dK/dV per kv block. Segment ids, a dense mask and causal."""
  from flashvjp import _mask
  from flashvjp._config import PALLAS_MOSAIC_GPU_BLOCKS
  from flashvjp._config import AttentionConfig
  from flashvjp.pallas import _common as C
  from flashvjp.pallas.mosaic_gpu import backward as Bw
  from flashvjp.pallas.mosaic_gpu import forward as F
  B, H, S, D = 2, 2, 400, 64
  cfg = AttentionConfig(scale=0.125, causal=True, window=None, seq_q=S, seq_kv=S,
                        dropout_rate=0.0, blocks=PALLAS_MOSAIC_GPU_BLOCKS, implementation=IMPL)
  rng = np.random.default_rng(9)
  ids = jnp.asarray(np.cumsum(rng.random((B, S)) < 0.01, axis=1), jnp.int32)
  mask = jnp.asarray(rng.random((1, H, S, S)) > 0.3).at[:, 1, :, 100:230].set(False)

  def check(visits, g, by, header=2):
    q_seg_p, kv_seg_p = C.pad_segments(ids, ids, g)
    cls = np.asarray(_mask.block_classes(C.mask_spec(cfg), q_seg_p, kv_seg_p,
                                         C.pad_pair(mask, g), g.bq, g.bk, g.nq, g.nk))
    cls = np.broadcast_to(cls, (B, H, g.nq, g.nk))
    if by == "kv":
      cls = np.swapaxes(cls, 2, 3)
    visits = np.asarray(visits)
    assert visits.shape[:2] == (B, H)
    total = 0
    for b, h, row in np.ndindex(*cls.shape[:3]):
      n_p, n_f = visits[b, h, row, :2]
      listed = visits[b, h, row, header:header + n_p + n_f]
      np.testing.assert_array_equal(listed[:n_p], np.flatnonzero(cls[b, h, row] == _mask.PARTIAL))
      np.testing.assert_array_equal(listed[n_p:], np.flatnonzero(cls[b, h, row] == _mask.FULL))
      total += n_p + n_f
    assert total == (cls != _mask.EMPTY).sum() < cls.size // 2  # most blocks are skipped
    return visits, cls

  p = F.plan((B, H, S, D), (B, H, S, D), (B, H, S, D), elementwise=True)
  visits, _ = check(F.visit_lists(cfg, p, *C.pad_segments(ids, ids, p), mask, None),
                    F._cta_geometry(p), "q", header=F.VISIT_HEADER)
  for b, h, i in np.ndindex(B, H, p.nq):  # consumer w's run: entries in its static bounds
    n_p = visits[b, h, i, 0]
    partial = visits[b, h, i, F.VISIT_HEADER:F.VISIT_HEADER + n_p]
    for w in range(p.consumers):
      lo, hi = C.mask_spec(cfg).kv_block_range(i * p.consumers + w, 64, p.bk, p.nk)
      start, stop = visits[b, h, i, 2 + 2 * w:4 + 2 * w]
      np.testing.assert_array_equal(partial[start:stop], partial[(partial >= lo) & (partial < hi)])
  g = C.Geometry(B=B, H=H, Hkv=H, Sq=S, Skv=S, D=D, Dv=D, bq=64, bk=64, Dp=64, Dvp=64)
  check(Bw._visit_lists(cfg, g, ids, ids, mask, None, "q"), g, "q")
  g32 = C.Geometry(B=B, H=H, Hkv=H, Sq=S, Skv=S, D=D, Dv=D, bq=32, bk=64, Dp=64, Dvp=64)
  check(Bw._visit_lists(cfg, g32, ids, ids, mask, None, "kv"), g32, "kv")


def test_position_arrays_grads_through_flash_attention_against_float64():
  """`jax.value_and_grad` through `flash_attention` with a score_mod reading a per-(batch,
  key) bias (float32) and a per-query temperature (float64 under x64: read as float32 words,
  cast back inside the tile part) and `document_causal`: the Mosaic-GPU kernels take them
  (explain says so), and out and the gradients to q, k, v and both arrays match float64."""
  q, k, v = _qkv(B=2, H=2, Hkv=1, S=160, seed=11)
  rng = np.random.default_rng(12)
  bias_vec = jnp.asarray(rng.standard_normal((2, 160)), jnp.float32)
  temp = jnp.asarray(rng.uniform(0.5, 1.5, (160,)), jnp.float64)
  ids = jnp.asarray(np.cumsum(rng.random((2, 160)) < 0.02, axis=1), jnp.int32)
  mask_mod = flashvjp.document_causal(ids)

  def f(impl):
    def run(q, k, v, bv, t):
      return flashvjp.flash_attention(q, k, v, implementation=impl, mask_mod=mask_mod,
                                      score_mod=lambda s, b, h, i, j: s * t[i] + bv[b, j])
    return run

  assert flashvjp.explain(q, k, v, implementation=IMPL, mask_mod=mask_mod,
                          score_mod=lambda s, b, h, i, j: s + bias_vec[b, j]).implementation \
      == IMPL
  w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  loss = lambda impl: lambda *a: jnp.sum(f(impl)(*a).astype(jnp.float32) * w)
  got = jax.value_and_grad(loss(IMPL), argnums=(0, 1, 2, 3, 4))(q, k, v, bias_vec, temp)
  f64 = lambda xs: tuple(x.astype(jnp.float64) for x in xs)
  ref = jax.value_and_grad(loss("naive"), argnums=(0, 1, 2, 3, 4))(*f64((q, k, v, bias_vec,
                                                                        temp)))
  tol = flashvjp._check.tolerance(jnp.bfloat16, IMPL)
  names = ["out . w", "dq", "dk", "dv", "dbias_vec", "dtemp"]
  for name, g, r in zip(names, jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
    g, r = np.asarray(jnp.asarray(g, jnp.float64)), np.asarray(r)
    err = np.abs(g - r).max() / max(np.abs(r).max(), 1e-30)
    assert np.isfinite(g).all() and err < tol, (name, err, tol)
  assert got[1][4].dtype == jnp.float64  # the gradient in the array's own dtype


def test_relative_position_bias_grads_through_flash_attention_against_float64():
  """`jax.value_and_grad` through `flash_attention` with `relative_position_bias` (a table
  read by kv_idx - q_idx), causal: the Mosaic-GPU kernels take it (explain says so), and out
  and the gradients to q, k, v and the table match float64."""
  q, k, v = _qkv(B=1, H=2, Hkv=1, S=136, seed=13)
  rng = np.random.default_rng(14)
  table = jnp.asarray(rng.standard_normal((2, 2 * 24 + 1)), jnp.float32)

  def f(impl):
    def run(q, k, v, t):
      return flashvjp.flash_attention(q, k, v, implementation=impl, causal=True,
                                      score_mod=flashvjp.relative_position_bias(t, 24))
    return run

  assert flashvjp.explain(q, k, v, implementation=IMPL, causal=True,
                          score_mod=flashvjp.relative_position_bias(table, 24)).implementation \
      == IMPL
  w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  loss = lambda impl: lambda *a: jnp.sum(f(impl)(*a).astype(jnp.float32) * w)
  got = jax.value_and_grad(loss(IMPL), argnums=(0, 1, 2, 3))(q, k, v, table)
  f64 = lambda xs: tuple(x.astype(jnp.float64) for x in xs)
  ref = jax.value_and_grad(loss("naive"), argnums=(0, 1, 2, 3))(*f64((q, k, v, table)))
  tol = flashvjp._check.tolerance(jnp.bfloat16, IMPL)
  names = ["out . w", "dq", "dk", "dv", "dtable"]
  for name, g, r in zip(names, jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
    g, r = np.asarray(jnp.asarray(g, jnp.float64)), np.asarray(r)
    err = np.abs(g - r).max() / max(np.abs(r).max(), 1e-30)
    assert np.isfinite(g).all() and err < tol, (name, err, tol)
  assert float(jnp.abs(got[1][3]).max()) > 0


def test_mask_mod_reading_a_table_by_distance_against_float64():
  """A mask_mod that reads a boolean table by kv_idx - q_idx (a learned-band style mask): the
  Mosaic-GPU kernels read it as windows like a score_mod's table; out and the gradients to
  q, k, v match float64 (the block classes come from the mask_mod, so far bands are skipped)."""
  q, k, v = _qkv(B=1, H=2, Hkv=1, S=136, seed=15)
  band = jnp.asarray((np.arange(81) - 40) % 3 != 1)  # allowed distances, by kv - q + 40

  def mask_mod(b, h, i, j):
    d = j - i
    return (jnp.abs(d) <= 40) & band[jnp.clip(d, -40, 40) + 40]

  plan = flashvjp.explain(q, k, v, implementation=IMPL, mask_mod=mask_mod)
  assert plan.implementation == IMPL
  assert [o.how for o in plan.operands] == ["by kv_idx - q_idx"]
  rng = np.random.default_rng(16)
  w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  loss = lambda impl: lambda q, k, v: jnp.sum(flashvjp.flash_attention(
      q, k, v, implementation=impl, mask_mod=mask_mod).astype(jnp.float32) * w)
  got = jax.value_and_grad(loss(IMPL), argnums=(0, 1, 2))(q, k, v)
  ref = jax.value_and_grad(loss("naive"), argnums=(0, 1, 2))(
      *(x.astype(jnp.float64) for x in (q, k, v)))
  tol = flashvjp._check.tolerance(jnp.bfloat16, IMPL)
  for name, g, r in zip(["out . w", "dq", "dk", "dv"], jax.tree_util.tree_leaves(got),
                        jax.tree_util.tree_leaves(ref)):
    g, r = np.asarray(jnp.asarray(g, jnp.float64)), np.asarray(r)
    err = np.abs(g - r).max() / max(np.abs(r).max(), 1e-30)
    assert np.isfinite(g).all() and err < tol, (name, err, tol)


def test_the_launch_table_decides_where_the_family_earned_the_default(monkeypatch):
  """`None` / "pallas" on a Hopper target keeps Pallas-Triton until a GPU check records the
  Mosaic-GPU family valid and faster for a class (`_config.MOSAIC_GPU_EARNED`); then that
  class runs the Mosaic-GPU kernels and explain quotes the evidence. Other classes, other
  GPUs, targets of unknown kind and inputs the family refuses keep Pallas-Triton."""
  from flashvjp import _config
  from flashvjp import _dispatch
  from flashvjp import _target
  q, k, v = (jax.ShapeDtypeStruct((1, 4 if n == 0 else 2, 1024, 128), jnp.bfloat16)
             for n in range(3))
  explain = lambda target, **kw: flashvjp.explain(q, k, v, target=target, **kw)
  assert explain("h100", causal=True).implementation == "pallas_triton"  # nothing recorded
  monkeypatch.setitem(_config.MOSAIC_GPU_EARNED, (128, True),
                      "gpu_check 2027-01-01, NVIDIA H200: valid, 1.3x Pallas-Triton")
  for target in ("h100", "h200"):
    for impl in (None, "pallas"):
      d = explain(target, causal=True, implementation=impl)
      assert d.implementation == IMPL and not d.interpret, (target, impl, d)
      assert "1.3x Pallas-Triton" in d.reason and "head_dim 128, causal=True" in d.reason
  assert explain("h100", causal=False).implementation == "pallas_triton"  # not this class
  assert explain("b200", causal=True).implementation == "pallas_triton"  # not Hopper
  assert explain("h100", causal=True,
                 implementation="pallas_triton").implementation == "pallas_triton"  # named
  unknown = _target.Target("gpu", 1, None, _target.SOURCES[3])  # a deviceless export
  assert _dispatch.decide(None, interpret=None, query_shape=q.shape, key_shape=k.shape,
                          value_shape=v.shape, dtype=q.dtype, target=unknown,
                          causal=True).implementation == "pallas_triton"
  # an input the family refuses (float32): Pallas-Triton, saying why
  q32, k32, v32 = (jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v))
  d = flashvjp.explain(q32, k32, v32, target="h100", causal=True)
  assert d.implementation == "pallas_triton" and "does not take this input" in d.reason
