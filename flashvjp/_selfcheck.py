"""Gradient check of every available implementation against naive attention in float64.

Room: self-check (the main job of `python -m flashvjp check`): its fixed feature rows,
each one `flashvjp.testing.check` (the one comparison), at the tolerances of the one table
(`flashvjp._check`).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import flashvjp  # the public names: run's refusals are flashvjp.explain's (tests patch it)
from flashvjp import _check
from flashvjp import _score_mod
from flashvjp import testing
from flashvjp.testing import Report


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
      # (TF32's for float32 through Pallas-Triton)
      tol = _check.tolerance(dtype, "naive" if fn is not None else impl)
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
