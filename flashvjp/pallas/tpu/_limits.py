"""Lowering limits of the Mosaic-TPU kernels, encoded once.

Room: Pallas-TPU limits. `flashvjp._dispatch` asks `supports(...)` before tracing any
kernel; the answer is a value (ok, reason), never a caught exception.

Interpret mode (any platform): float16, bfloat16, float32 and float64, head dims up
to 256, every feature (a score_mod may index its tables by position there).

Mosaic (TPU, compiled): float16, bfloat16 and float32 (no float64 on TPU), head dims
up to 256 (zero-padded to 128 lanes), blocks rounded to (8, 128). A score_mod's
per-position part must be elementwise: no gather / dynamic indexing by q_idx or
kv_idx (Mosaic has no vector gather), and the per-head values it reads must be
scalars (they live in SMEM). Per-head indexing such as ALiBi's ``slopes[h]`` is
precomputed outside the kernels and is fine.
"""
from __future__ import annotations

import jax.numpy as jnp

from flashvjp.pallas import _common
from flashvjp.pallas._common import MAX_HEAD_DIM

_INTERPRET_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)
_TPU_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)


def score_mod_lowering_problem(score_mod, consts, acc_dtype=jnp.float32):
  """Why a (closure-converted, scalar) score_mod cannot lower to Mosaic-TPU, or None."""
  # The elementwise primitive set is the same as the Triton family's (both lower
  # elementwise math, comparisons, casts and selects on tiles, neither has a gather).
  from flashvjp.pallas.triton._limits import _TRITON_SCORE_MOD_PRIMITIVES as ELEMENTWISE
  from flashvjp.pallas.triton._limits import _all_eqns
  fn, consts = _common.hoist_constants(score_mod, consts, acc_dtype)
  _, _, res_avals, tile = _common.split_score_mod_jaxprs(fn, consts, acc_dtype)
  bad = sorted({e.primitive.name for e in _all_eqns(tile.jaxpr)} - ELEMENTWISE)
  if bad:
    return (f"score_mod uses {', '.join(bad)} on per-position values, which the Mosaic-TPU"
            " lowering cannot apply to a tile (e.g. indexing a table by the relative position"
            " kv_idx - q_idx is a gather)")
  for a in res_avals:
    if a.shape != ():
      return (f"score_mod reads a per-head array of shape {a.shape} inside the kernel: the"
              " Mosaic-TPU kernels take per-head scalars only (in SMEM)")
  return None


def supports(*, platform, interpret, query_shape, key_shape, value_shape, dtype,
             has_score_mod=False, has_dropout=False, score_mod=None, score_mod_consts=()):
  """Can the Mosaic-TPU kernels run this input? Returns (ok, reason).

  Args: as `flashvjp.pallas.triton._limits.supports`.
  """
  del has_dropout  # the uint32 counter hash lowers on TPU (32-bit integer ops)
  D, Dv = query_shape[-1], value_shape[-1]
  if max(D, Dv) > MAX_HEAD_DIM:
    return False, (f"head_dim {D} / head_dim_v {Dv}: the Mosaic-TPU kernels support head dims"
                   f" up to {MAX_HEAD_DIM}")
  dt = jnp.dtype(dtype)
  if interpret:
    if not any(dt == jnp.dtype(d) for d in _INTERPRET_DTYPES):
      return False, f"dtype {dt.name} is not float16/bfloat16/float32/float64"
    return True, f"Pallas Mosaic-TPU kernels in interpret mode on {platform!r}"
  if not any(dt == jnp.dtype(d) for d in _TPU_DTYPES):
    return False, f"dtype {dt.name}: the Mosaic-TPU kernels support float16, bfloat16 and float32"
  if has_score_mod and score_mod is not None:
    problem = score_mod_lowering_problem(score_mod, score_mod_consts,
                                         jnp.promote_types(dt, jnp.float32))
    if problem is not None:
      return False, problem
  return True, f"Pallas Mosaic-TPU kernels, {dt.name}, head_dim {D}"
