"""delta = rowsum(dO * O) - dlse: the per-row term every backward subtracts from dP.

Room: foundations (floor 0). Each backend's backward computes it in its preprocess; a caller
that has the rows of O and dO where they are cheaper to read may fold rowsum(dO * O) into the
lse cotangent and pass `out=None` (Ulysses does: the rows are local before its all-to-all, so
the backward need not move O to the heads layout; `flashvjp._partition._ulysses`).

The tangent pass has the same per-row term the other way round: t_out = a - t_lse * O, with
a = sum_j p_ij (t_s_ij v_j + t_v_j). Given `out=None` a tangent pass returns (a, t_lse) and
the caller applies `tangent_out` where O's rows are local (Ulysses again: O stays put).
"""
from __future__ import annotations

import jax.numpy as jnp


def delta(out, dout, dlse, acc):
  """rowsum(dout * out) - dlse in `acc` ([..., S] from [..., S, Dv]); out None: -dlse (the
  caller folded the rowsum into dlse); dlse None: no lse cotangent."""
  if out is None:
    if dlse is None:
      raise ValueError("out=None needs dlse: the caller folds rowsum(dO * O) into it")
    return -dlse.astype(acc)
  d = jnp.sum(dout.astype(acc) * out.astype(acc), axis=-1)
  return d if dlse is None else d - dlse.astype(acc)


def fold(out, dout, dlse, acc):
  """The lse cotangent that carries rowsum(dout * out): pass it with out=None (same result)."""
  return -delta(out, dout, dlse, acc)


def tangent_out(a, t_lse, out):
  """t_out = a - t_lse * out, in out's dtype (a: a tangent pass's result with out=None)."""
  acc = jnp.promote_types(out.dtype, jnp.float32)
  return (a.astype(acc) - t_lse.astype(acc)[..., None] * out.astype(acc)).astype(out.dtype)
