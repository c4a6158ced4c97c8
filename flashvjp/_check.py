"""Gradient check of every available implementation against naive attention in float64.

Room: self-check (the main job of `python -m flashvjp check`). Also the one place
the per-dtype tolerances are stated; the test suite imports them from here.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List

import jax
import jax.numpy as jnp
import numpy as np

# max |got - ref| <= TOL * max |ref|, per input dtype (float64 reference).
TOL = {
    jnp.dtype(jnp.float64): 1e-10,
    jnp.dtype(jnp.float32): 1e-5,
    jnp.dtype(jnp.float16): 2e-3,
    jnp.dtype(jnp.bfloat16): 1e-2,
}


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
  errors: tuple  # out, dq, dk, dv
  tol: float

  @property
  def passed(self) -> bool:
    return all(e <= self.tol for e in self.errors)


def _features(B, H, Sq) -> List[tuple]:
  from flashvjp import _score_mod
  rng = np.random.default_rng(0)
  mask = rng.random((B, 1, Sq, Sq)) > 0.3
  mask[:, :, 1] = False  # an empty row
  seg = np.repeat(np.arange(Sq)[None] // 23, B, 0).astype(np.int32)
  bias = jax.random.normal(jax.random.key(1), (1, H, Sq, Sq), jnp.float64)
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
  ]


def run(implementations, dtype=jnp.float32, B=1, H=4, Hkv=2, S=70, D=32,
        progress: Callable = lambda it: it) -> List[Row]:
  """Forward and gradients of each implementation vs naive (float64) on a few features."""
  import flashvjp
  keys = jax.random.split(jax.random.key(0), 4)
  q64 = jax.random.normal(keys[0], (B, H, S, D), jnp.float64)
  k64 = jax.random.normal(keys[1], (B, Hkv, S, D), jnp.float64)
  v64 = jax.random.normal(keys[2], (B, Hkv, S, D), jnp.float64)
  w = jax.random.normal(keys[3], (B, H, S, D), jnp.float64)
  q, k, v = (x.astype(dtype) for x in (q64, k64, v64))
  q64, k64, v64 = (x.astype(jnp.float64) for x in (q, k, v))
  rows = []
  for name, kw in progress(_features(B, H, S)):
    def loss(q, k, v, impl, **extra):
      args = dict(kw)
      if "bias" in args:
        args["bias"] = args["bias"].astype(q.dtype)
      return jnp.sum(flashvjp.flash_attention(q, k, v, implementation=impl, **args, **extra)
                     .astype(jnp.float64) * w)
    fwd_ref = flashvjp.flash_attention(q64, k64, v64, implementation="naive", **kw)
    g_ref = jax.grad(loss, (0, 1, 2))(q64, k64, v64, "naive")
    for impl in implementations:
      extra = dict(block_q=32, block_kv=16)
      out = flashvjp.flash_attention(q, k, v, implementation=impl, **kw, **extra)
      g = jax.jit(jax.grad(loss, (0, 1, 2)), static_argnums=3)(q, k, v, impl)
      errs = (max_rel_err(out, fwd_ref),) + tuple(max_rel_err(a, b) for a, b in zip(g, g_ref))
      rows.append(Row(impl, name, errs, TOL[jnp.dtype(dtype)]))
  return rows
