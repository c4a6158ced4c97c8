"""Float32 matmul precision: follows jax.default_matmul_precision, as jax.nn does.

GPU float32 default = TF32 (jax.nn's default on a GPU); "high" = Triton's 3xTF32 split
(nearly float32); "highest" = IEEE float32 dots. Pallas-Triton's interpret mode emulates
each on the CPU (flashvjp.pallas._common), so these CPU tests assert the accuracy the GPU
gives; the tolerances are flashvjp._check.TOL / TOL_TF32 / TOL_TF32X3 / HIGHEST_*
(docs/implementations.md "Precision"). The shared base (tests/attention_base.py) holds the per-case checks:
"highest" elementwise against float64, and extreme values in masked K / V at each setting.
"""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import flashvjp
from flashvjp import _check
from flashvjp import _config
from flashvjp.pallas import _common
from tests import _util

F32 = jnp.float32


def _run(impl, precision, dtype=F32, **kw):
  """(out, lse, dq, dk, dv) of a causal GQA case with padding, under `precision`."""
  q, k, v = _util.random_qkv(0, 1, 4, 2, 70, 70, 32, dtype=dtype)
  w = jax.random.normal(jax.random.key(1), (1, 4, 70, 32), jnp.float64)

  def loss(q, k, v):
    out, lse = flashvjp.flash_attention(q, k, v, causal=True, return_lse=True, implementation=impl,
                                        **kw)
    return jnp.sum(out.astype(jnp.float64) * w) + jnp.sum(lse.astype(jnp.float64)), (out, lse)

  if impl == "naive":
    q, k, v = _util.as64((q, k, v))
  ctx = jax.default_matmul_precision(precision) if precision else contextlib.nullcontext()
  with ctx:
    (_, (out, lse)), g = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
  return (out, lse) + tuple(g)


def _errors(got, ref):
  return [_check.max_rel_err(a, b) for a, b in zip(got, ref)]


@pytest.fixture(scope="module")
def reference():
  return _run("naive", None)


def test_default_float32_is_tf32_in_interpret_mode(reference):
  """The default precision emulates TF32: worse than float32, within TOL_TF32.

  Fails if the emulation is missing (the errors would be float32-small) or if it is
  worse than the stated TF32 tolerance.
  """
  errs = _errors(_run("pallas", None, block_q=16, block_kv=16), reference)
  assert _check.tolerance(F32, "pallas") == _check.TOL_TF32
  assert max(errs) <= _check.TOL_TF32, errs
  assert max(errs) > 10 * _check.TOL[jnp.dtype(F32)], f"no TF32 emulation? {errs}"


@pytest.mark.parametrize("name", ["highest", "float32"])
def test_highest_is_float32_accurate(reference, name):
  got = _run("pallas", name, block_q=16, block_kv=16)
  errs = _errors(got, reference)
  assert _check.tolerance(F32, "pallas", precision=name) == _check.TOL[jnp.dtype(F32)]
  assert max(errs) <= _check.TOL[jnp.dtype(F32)], errs
  for a, b in zip(got, reference):
    assert _check.highest_violations(a, b) == 0


@pytest.mark.parametrize("name", ["high", "TF32_TF32_F32_X3"])
def test_high_is_3xtf32(reference, name):
  """"high" is Triton's 3xTF32: within TOL_TF32X3, and not IEEE float32 (fails if the
  setting were TF32, or IEEE, or the emulation missing)."""
  got = _run("pallas", name, block_q=16, block_kv=16)
  errs = _errors(got, reference)
  assert _check.tolerance(F32, "pallas", precision=name) == _check.TOL_TF32X3
  assert max(errs) <= _check.TOL_TF32X3, errs
  ieee = _run("pallas", "highest", block_q=16, block_kv=16)
  assert max(_errors(got, ieee)) > 1e-7, "high computed the IEEE float32 dots"
  # (Not asserted: that IEEE is closer to float64 than 3xTF32. Both are float32-level, and
  # which is closer depends on the host's summation order: on a 2026-12-04 CI host IEEE's
  # error was 5.6e-7 and 3xTF32's 3.8e-7. TF32 would exceed TOL_TF32X3 above.)


def test_high_saturates_to_the_tf32_range():
  """finfo.max would round up to inf in the 3xTF32 split (cvt.rna); saturated it stays
  finite through the split; NaN stays NaN, ordinary values are unchanged."""
  big = np.finfo(np.float32).max
  x = jnp.asarray([big, -big, 1.5, -3.0, np.nan, _common.TF32_MAX], F32)
  assert not np.isfinite(np.asarray(_common.tf32_round(x[:1])))[0]  # the overflow itself
  y = np.asarray(_common.tf32x3_operand(x))
  np.testing.assert_array_equal(y[[0, 1, 2, 3, 5]], [_common.TF32_MAX, -_common.TF32_MAX, 1.5,
                                                      -3.0, _common.TF32_MAX])
  assert np.isnan(y[4])
  assert np.isfinite(np.asarray(_common.tf32_round(y[[0, 1, 5]]))).all()
  assert _common.TF32_MAX == float(np.float32(_common.tf32_truncate(jnp.asarray(big, F32))))


@pytest.mark.parametrize("how", ["key_lengths", "dense_mask"])
def test_naive_reference_masked_extreme_values(how):
  """The oracle itself: finfo.max in masked K / V gives no NaN in dq ((e @ v) / l, not
  (e / l) @ v, whose softmax VJP sums 0 * inf over the row)."""
  from tests import attention_base as AB
  clean, dirty = AB.run_garbage("naive", how, None)
  AB.assert_garbage_changes_nothing(clean, dirty, f"naive/{how}")


def test_low_precision_inputs_ignore_the_float32_precision():
  """bfloat16 operands have nothing to round: the precision changes no bit."""
  a = _run("pallas", None, dtype=jnp.bfloat16, block_q=16, block_kv=16)
  b = _run("pallas", "highest", dtype=jnp.bfloat16, block_q=16, block_kv=16)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_blockwise_on_cpu_is_float32_at_any_precision(reference):
  errs = _errors(_run("blockwise", None, block_q=16, block_kv=16), reference)
  assert _check.tolerance(F32, "blockwise", platform="cpu") == _check.TOL[jnp.dtype(F32)]
  assert max(errs) <= _check.TOL[jnp.dtype(F32)], errs


def test_tolerance_table():
  assert _check.tolerance(F32, "pallas_triton", "tensorfloat32") == _check.TOL_TF32
  assert _check.tolerance(F32, "pallas_triton", "high") == _check.TOL_TF32X3
  assert _check.tolerance(F32, "pallas_tpu", "high", platform="cpu") == _check.TOL[jnp.dtype(F32)]
  assert _check.tolerance(F32, "blockwise", None, platform="gpu") == _check.TOL_TF32
  assert _check.tolerance(F32, "blockwise", "high", platform="gpu") == _check.TOL_TF32
  assert _check.tolerance(F32, "blockwise", "highest", platform="gpu") == _check.TOL[jnp.dtype(F32)]
  assert _check.tolerance(jnp.bfloat16, "pallas_triton") == _check.TOL[jnp.dtype(jnp.bfloat16)]
  # TF32 keeps as many mantissa bits as float16: its tolerance sits between float32's and bf16's.
  assert _check.TOL[jnp.dtype(F32)] < _check.TOL_TF32 < _check.TOL[jnp.dtype(jnp.bfloat16)]


def test_canonical_precision():
  for name in (None, "default", "bfloat16", "tensorfloat32", "fastest", "TF32_TF32_F32",
               lax.Precision.DEFAULT):
    assert _config.canonical_precision(name) == "default", name
  for name in ("high", "bfloat16_3x", "TF32_TF32_F32_X3", lax.Precision.HIGH,
               lax.DotAlgorithmPreset.TF32_TF32_F32_X3):
    assert _config.canonical_precision(name) == "high", name
  for name in ("highest", "float32", "F32_F32_F32", lax.Precision.HIGHEST):
    assert _config.canonical_precision(name) == "highest", name
  with pytest.raises(ValueError, match="jax_default_matmul_precision"):
    _config.canonical_precision("BF16_BF16_F32_X6")


def test_unsupported_precision_is_a_clear_error_before_any_kernel():
  q, k, v = _util.random_qkv(0, 1, 1, 1, 8, 8, 8)
  with jax.default_matmul_precision("BF16_BF16_F32_X6"):
    with pytest.raises(ValueError, match="jax_default_matmul_precision"):
      flashvjp.flash_attention(q, k, v, implementation="pallas")


def test_tf32_rounding_helpers():
  one = np.float32(1.0)
  ulp = np.float32(2.0 ** -10)  # the TF32 spacing at 1.0
  x = jnp.asarray([one + ulp, one + ulp / 2, one + ulp * 0.75, -(one + ulp * 0.75), np.inf, -3.0],
                  F32)
  np.testing.assert_array_equal(_common.tf32_truncate(x),
                                [one + ulp, one, one, -one, np.inf, -3.0])
  np.testing.assert_array_equal(_common.tf32_round(x),
                                [one + ulp, one + ulp, one + ulp, -(one + ulp), np.inf, -3.0])
  assert np.isnan(_common.tf32_round(jnp.asarray([np.nan], F32))[0])


def _kernel_dot_precisions(precision, implementation="pallas_triton"):
  """The precision of every float32 dot_general inside the compiled-path pallas_calls."""
  q, k, v = _util.random_qkv(0, 1, 2, 2, 64, 64, 64)

  def loss(q, k, v):
    return flashvjp.flash_attention(q, k, v, causal=True, implementation=implementation,
                                    interpret=False).sum()

  ctx = jax.default_matmul_precision(precision) if precision else contextlib.nullcontext()
  with ctx:
    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, k, v)
  found = []

  def walk(jx, in_kernel):
    for e in jx.eqns:
      if in_kernel and e.primitive.name == "dot_general":
        found.append(e.params["precision"])
      for p in e.params.values():
        for sub in (p if isinstance(p, tuple) else (p,)):  # cond branches: a tuple
          sub = getattr(sub, "jaxpr", sub)
          if hasattr(sub, "eqns"):
            walk(sub, in_kernel or e.primitive.name == "pallas_call")

  walk(jaxpr.jaxpr, False)
  return found


def test_kernels_pass_the_precision_to_triton():
  """DEFAULT lowers to Triton inputPrecision=tf32, TF32_TF32_F32_X3 to tf32x3 and F32_F32_F32
  to ieee (Pallas' rule); the compile check (benchmarks) confirms the PTX: wgmma / mma.sync
  .tf32 for the first two, fma for "highest"."""
  default = _kernel_dot_precisions(None)
  assert len(default) >= 7, default  # fwd 2, dK/dV 4, dQ 3
  assert all(p in (lax.Precision.DEFAULT, (lax.Precision.DEFAULT, lax.Precision.DEFAULT))
             for p in default), default
  high = _kernel_dot_precisions("high")
  assert high and all(p == lax.DotAlgorithmPreset.TF32_TF32_F32_X3 for p in high), high
  highest = _kernel_dot_precisions("highest")
  assert highest and all(p == lax.DotAlgorithmPreset.F32_F32_F32 for p in highest), highest


def test_tpu_kernels_pass_the_precision_to_mosaic():
  """Mosaic's float32 contraction per setting: DEFAULT (no attribute), HIGH (bf16x3),
  HIGHEST (fp32); JAX's Mosaic lowering maps each (flashvjp.pallas.tpu._layout)."""
  for name, want in ((None, lax.Precision.DEFAULT), ("high", lax.Precision.HIGH),
                     ("highest", lax.Precision.HIGHEST)):
    found = _kernel_dot_precisions(name, "pallas_tpu")
    assert len(found) >= 7, (name, found)
    assert all(p == (want, want) for p in found), (name, found)


def test_launch_table_covers_every_kernel():
  """Every (head dim, dtype, precision, role) has an entry; 16-bit and TF32 kernels keep
  >= 64-row accumulator tiles (wgmma) up to head dim 128 (the compile check's table)."""
  for hd in (16, 64, 80, 96, 128, 192, 256):
    for dtype in (jnp.bfloat16, jnp.float16, F32):
      for precision in _config.PRECISIONS:
        for role in ("fwd", "dkdv", "dq", "dbias"):
          L = _config.launch(hd, dtype, precision, role)
          rows = L.block_kv if role in ("dkdv", "dbias") else L.block_q
          assert L.num_stages >= 1 and L.num_warps in (4, 8), (hd, dtype, precision, role, L)
          if hd <= 128 and _config.matmul_kind(dtype, precision) in ("16bit", "tf32"):
            assert rows >= 64, (hd, dtype, precision, role, L)
  assert _config.default_block_sizes("pallas_triton", True) == _config.PALLAS_INTERPRET_DEFAULT
  d = _config.default_block_sizes("pallas_triton", False, head_dim=128, dtype=jnp.bfloat16)
  assert d.dkv == (_config.launch(128, jnp.bfloat16, "default", "dkdv").block_q,
                   _config.launch(128, jnp.bfloat16, "default", "dkdv").block_kv)
