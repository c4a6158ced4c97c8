"""The per-dtype tolerances of every check against naive attention in float64.

Room: self-check's table (below `flashvjp.testing`): the one place the tolerances are
stated; flashvjp.testing, `python -m flashvjp check` (`flashvjp._selfcheck`) and the test
suite import them from here. `max_rel_err` (max |got - ref| / max |ref|) is a measurement
for precision tables (tests/test_precision.py, benchmarks/gpu_check.py), not a pass/fail
check.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# The tolerance per input dtype (float64 reference); the pass rule it enters is
# flashvjp.testing._compare.PASS_RULE: |got - ref| <= TOL * (max |ref| + |ref|) per entry.
TOL = {
    jnp.dtype(jnp.float64): 1e-10,
    jnp.dtype(jnp.float32): 1e-5,
    jnp.dtype(jnp.float16): 2e-3,
    jnp.dtype(jnp.bfloat16): 1e-2,
}
# float32 inputs whose matmuls run in TF32: the GPU's float32 default (jax.nn's too) when
# jax.default_matmul_precision is unset. The tensor cores keep 10 of the 23 mantissa bits
# (truncated, no rounding: Triton emits no cvt.rna for plain TF32 dots), so this is half
# precision on every matmul operand (scores, probabilities, dS). Pallas-Triton's interpret
# mode emulates it (flashvjp.pallas._common.tf32_truncate), so a CPU test asserts what the
# GPU gives.
TOL_TF32 = 5e-3
# "high" on Pallas-Triton: Triton's 3xTF32 split (emulated in interpret mode). Measured on
# 10 of the shared test base's float32 cases (head dim 16, seq 37-45; 2026-12-03): max |err| /
# max |ref| 2.9e-7 .. 5.8e-7 over out, lse and every gradient (IEEE "highest": 2.2e-7 ..
# 4e-7); each product loses ~2^-22 relative (the dropped small x small term), so it is
# held to float32's scale-relative tolerance, not to the elementwise HIGHEST_* bounds.
TOL_TF32X3 = TOL[jnp.dtype(jnp.float32)]
# "highest" (IEEE float32 dots) on float32 inputs, elementwise against float64 naive
# attention: |got - ref| <= atol + rtol * |ref| for out, lse, dq, dk, dv. (The scale-relative
# TOL[float32] still applies to every leaf, and to the gradients of bias / score_mod arrays,
# which sum seq_q * seq_kv terms.)
HIGHEST_ATOL = 1e-6
HIGHEST_RTOL = 1e-6


def tolerance(dtype, implementation: str = "naive", precision=None, platform=None) -> float:
  """The tolerance for `dtype` through `implementation` at matmul `precision`.

  precision: a jax.default_matmul_precision value (None: the one in effect now).
  float32 gets TOL_TF32 where the matmuls run in TF32: at "default" the Pallas-Triton
  kernels (GPU, and interpret mode, which emulates the GPU) and every implementation on a
  GPU (XLA's float32 default there), at "high" XLA on a GPU (its HIGH is TF32 there);
  TOL_TF32X3 for Pallas-Triton at "high"; otherwise TOL[dtype] (docs/implementations.md "Precision").
  """
  from flashvjp import _config
  from flashvjp import _dispatch
  dtype = jnp.dtype(dtype)
  if dtype != jnp.float32:
    return TOL[dtype]
  if precision is None:
    precision = jax.config.jax_default_matmul_precision
  precision = _config.canonical_precision(precision)
  if precision == "highest":
    return TOL[dtype]
  plat = _dispatch.platform() if platform is None else platform
  triton = implementation == "pallas_triton" or (
      implementation == "pallas" and _dispatch.family_for_platform(plat) == "pallas_triton")
  gpu = plat in ("gpu", "cuda", "rocm")
  if precision == "high":
    return TOL_TF32X3 if triton else (TOL_TF32 if gpu else TOL[dtype])
  return TOL_TF32 if triton or gpu else TOL[dtype]


def highest_violations(got, ref, atol=HIGHEST_ATOL, rtol=HIGHEST_RTOL) -> int:
  """How many entries of `got` miss float64 `ref` by more than atol + rtol * |ref| (NaN, or
  a finite / inf pattern unlike the reference's, counts as every entry)."""
  g = np.asarray(jnp.asarray(got, jnp.float64))
  r = np.asarray(jnp.asarray(ref, jnp.float64))
  f = np.isfinite(r)
  if np.isnan(g).any() or not np.array_equal(np.isfinite(g), f):
    return int(g.size)
  return int((np.abs(g[f] - r[f]) > atol + rtol * np.abs(r[f])).sum())


def max_rel_err(got, ref) -> float:
  """max |got - ref| / max |ref| over the reference's finite entries (NaN -> inf)."""
  g = np.asarray(jnp.asarray(got, jnp.float64))
  r = np.asarray(jnp.asarray(ref, jnp.float64))
  f = np.isfinite(r)
  if np.isnan(g).any() or not np.array_equal(np.isfinite(g), f):
    return float("inf")
  if not f.any():
    return 0.0
  return float(np.abs(g[f] - r[f]).max() / max(np.abs(r[f]).max(), 1e-30))
