"""Gradient check of every available implementation against naive attention in float64.

Room: self-check (the main job of `python -m flashvjp check`): its fixed feature rows,
each one `flashvjp.testing.check` (the one comparison). Also the one place the per-dtype
tolerances are stated; flashvjp.testing and the test suite import them from here.
`max_rel_err` (max |got - ref| / max |ref|) is a measurement for precision tables
(tests/test_precision.py, benchmarks/gpu_check.py), not a pass/fail check.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
  from flashvjp.testing import Report

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


@dataclasses.dataclass
class Row:
  implementation: str
  feature: str
  errors: tuple  # out, dq, dk, dv; () when not run (see `skipped` / `error`)
  tol: float
  seconds: float = 0.0  # wall time of this row (compile + run)
  skipped: str | None = None  # why the implementation does not run this feature here
  report: Report | None = None  # the flashvjp.testing.Report (every quantity compared)
  error: str | None = None  # what a user's function raised (the row fails)

  @property
  def passed(self) -> bool:
    return self.skipped is None and self.error is None and self.report is not None and (
        self.report.passed)

  def others(self):
    """The compared quantities beyond out, dq, dk, dv (dbias, dsinks, d score_mod[0], ...)."""
    if self.report is None:
      return ()
    return tuple(q for q in self.report.quantities if q.name not in ("out", "dq", "dk", "dv"))

  def to_dict(self) -> dict:
    return dict(implementation=self.implementation, feature=self.feature, passed=self.passed,
                seconds=round(self.seconds, 3), skipped=self.skipped, error=self.error,
                report=None if self.report is None else self.report.to_dict())


def _features(B, H, Sq) -> list[tuple]:
  import flashvjp
  from flashvjp import _score_mod
  rng = np.random.default_rng(0)
  mask = rng.random((B, 1, Sq, Sq)) > 0.3
  mask[:, :, 1] = False  # an empty row
  seg = np.repeat(np.arange(Sq)[None] // 23, B, 0).astype(np.int32)
  bias = jax.random.normal(jax.random.key(1), (1, H, Sq, Sq), jnp.float64)
  kv_bias = jnp.asarray(rng.standard_normal((B, Sq)))
  rel_table = jnp.asarray(rng.standard_normal((H, 17)))
  return [
      ("plain", {}),
      ("causal", dict(causal=True)),
      ("window(8,4)", dict(window=(8, 4))),
      ("segment_ids", dict(segment_ids=jnp.asarray(seg))),
      ("mask+empty row", dict(mask=jnp.asarray(mask))),
      ("bias", dict(bias=bias)),
      ("softcap", dict(score_mod=_score_mod.softcap(3.0), causal=True)),
      ("alibi", dict(score_mod=_score_mod.alibi(_score_mod.alibi_slopes(H)), causal=True)),
      ("dropout 0.2", dict(dropout_rate=0.2, dropout_rng=jax.random.key(3), deterministic=False)),
      ("mask_mod prefix_lm", dict(mask_mod=flashvjp.prefix_lm(
          jnp.asarray((np.arange(B) * 17 + 9) % Sq, jnp.int32)))),
      # arrays read by one position (per-position residuals in the kernels)
      ("score_mod kv bias", dict(score_mod=lambda s, b, h, i, j: s + kv_bias[b, j], causal=True)),
      ("mask_mod document_causal", dict(mask_mod=flashvjp.document_causal(jnp.asarray(seg)))),
      # read by kv_idx - q_idx (a row of differences per (b, h) in the Triton kernels)
      ("score_mod relative_position_bias", dict(
          score_mod=_score_mod.relative_position_bias(rel_table, 8), causal=True)),
      ("sinks", dict(sinks=jnp.linspace(-1.0, 2.0, H), causal=True)),
  ]


FEATURES = ("plain", "causal", "window(8,4)", "segment_ids", "mask+empty row", "bias", "softcap",
            "alibi", "dropout 0.2", "mask_mod prefix_lm", "score_mod kv bias",
            "mask_mod document_causal", "score_mod relative_position_bias", "sinks")


def run(implementations, dtype=jnp.float32, B=1, H=4, Hkv=2, S=70, D=32,
        progress: Callable = lambda it: it, on_row: Callable[[Row], None] | None = None,
        features: Sequence[str] | None = None, fn: Callable | None = None) -> list[Row]:
  """Forward and gradients of each implementation vs naive (float64) on a few features.

  Each row is one `flashvjp.testing.check` (out, dq, dk, dv, and the gradients of the
  feature's bias, sinks or score_mod arrays). `on_row(row)` is called as each row
  finishes (the CLI prints it then). `features` selects a subset of `FEATURES` (default:
  all). A feature that an implementation's encoded limits exclude on this platform
  (`flashvjp.explain` raises ValueError) gives a row with `skipped` set, which does not
  count as passed. `fn`: check this function (flash_attention's signature) instead of
  flashvjp's implementations; `implementations` is then its one label, and an
  exception it raises fails the row (`Row.error`).
  """
  import time

  import flashvjp
  from flashvjp import testing
  if features is not None:
    unknown = sorted(set(features) - set(FEATURES))
    if unknown:
      raise ValueError(f"features must be among {FEATURES}, got unknown {unknown}")
  keys = jax.random.split(jax.random.key(0), 3)
  with testing._check._x64():  # pylint: disable=protected-access
    q, k, v = (jax.random.normal(kk, shape, jnp.float64).astype(dtype) for kk, shape in zip(
        keys, ((B, H, S, D), (B, Hkv, S, D), (B, Hkv, S, D))))
    selected = [(n, {a: (x.astype(dtype) if a == "bias" else x) for a, x in kw.items()})
                for n, kw in _features(B, H, S) if features is None or n in features]
  rows = []
  for name, kw in progress(selected):
    for impl in implementations:
      t0 = time.perf_counter()
      extra = {} if fn is not None else dict(implementation=impl, block_q=32, block_kv=16)
      tol = tolerance(dtype, "naive" if fn is not None else impl)  # TF32 for Pallas-Triton f32
      try:
        if fn is None:
          flashvjp.explain(q, k, v, **kw, **extra)
      except ValueError as e:  # this family's limits exclude the feature here: say so
        row = Row(impl, name, (), tol, skipped=str(e))
      else:
        try:
          report = testing.check(fn, query=q, key=k, value=v, tolerance=tol, **kw, **extra)
        except Exception as e:
          if fn is None:
            raise
          row = Row(impl, name, (), tol, error=f"{type(e).__name__}: {e}")
        else:
          errs = tuple(report[n].error for n in ("out", "dq", "dk", "dv"))
          row = Row(impl, name, errs, tol, report=report)
      row.seconds = time.perf_counter() - t0
      rows.append(row)
      if on_row is not None:
        on_row(row)
  return rows
