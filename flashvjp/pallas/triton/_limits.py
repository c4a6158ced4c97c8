"""Lowering limits of the Pallas kernels, encoded once.

Room: Pallas limits. `flashvjp._dispatch` asks `supports(...)` before tracing any
kernel; the answer is a value (ok, reason), never a caught exception.

Interpret mode (any platform): float16, bfloat16, float32 and float64, head dims
up to 256, every feature.

Triton (GPU, compiled): float16, bfloat16 and float32 (no float64), head dims up
to 256 (padded to a power of two >= 16), sequence blocks rounded to powers of two
>= 16. A score_mod's per-position part must lower to Triton: no gather / dynamic
indexing by q_idx or kv_idx (per-head indexing such as ALiBi's ``slopes[h]`` is
precomputed outside the kernels and is fine); checked on its jaxpr when the
dispatcher passes the score_mod (`score_mod_lowering_problem`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flashvjp.pallas import _common
from flashvjp.pallas._common import MAX_HEAD_DIM

_INTERPRET_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)
_TRITON_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
# Primitives a scalar score_mod may use under Triton: elementwise math, comparisons,
# casts and selects (the Triton lowering has rules for these on tiles). Anything
# reading an array at a computed position (gather, dynamic_slice) has no rule.
_TRITON_SCORE_MOD_PRIMITIVES = frozenset("""
abs acos acosh add add_any and asin asinh atan atan2 atanh bitcast_convert_type cbrt ceil clamp
clz cond convert_element_type cos cosh div eq erf_inv exp exp2 expm1 floor ge gt integer_pow
is_finite le log log1p log2 logistic lt max min mul ne neg nextafter not or population_count pow
rem rsqrt select_n shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square
sub tan tanh xor broadcast_in_dim squeeze reshape jit custom_jvp_call stop_gradient
""".split())


def score_mod_lowering_problem(score_mod, consts, acc_dtype=jnp.float32):
  """Why a (closure-converted, scalar) score_mod cannot lower to Triton, or None.

  The kernels run only the score_mod's per-tile part: what depends on (b, h) and
  the closed-over arrays alone (ALiBi's ``slopes[h]``) is precomputed per head by
  XLA (`flashvjp.pallas._common.split_per_head`). So only the per-tile part must
  use primitives the Triton lowering can apply to a tile, and the per-head values it
  reads must have power-of-2 sizes.

  Args:
    score_mod: fn(s, b, h, q_idx, kv_idx, *consts) -> s on scalars.
    consts: the arrays it takes after the indices.
  """
  fn, consts = _common.hoist_constants(score_mod, consts, acc_dtype)
  _, _, res_avals, tile = _common.split_score_mod_jaxprs(fn, consts, acc_dtype)
  bad = sorted({e.primitive.name for e in _all_eqns(tile.jaxpr)} - _TRITON_SCORE_MOD_PRIMITIVES)
  if bad:
    return (f"score_mod uses {', '.join(bad)} on per-position values, which the Pallas Triton"
            " lowering cannot apply to a tile (e.g. indexing a table by the relative position"
            " kv_idx - q_idx is a gather)")
  for a in res_avals:
    size = int(np.prod(a.shape))
    if size & (size - 1):
      return (f"score_mod reads a per-head value of shape {a.shape} inside the kernel: the"
              " Triton lowering loads only tensors whose size is a power of 2")
  return None


def _all_eqns(jaxpr):
  for e in jaxpr.eqns:
    subs = [v for v in e.params.values() if hasattr(v, "eqns") or hasattr(v, "jaxpr")]
    if subs:
      for sub in subs:
        yield from _all_eqns(sub.jaxpr if hasattr(sub, "jaxpr") else sub)
    else:
      yield e


def supports(*, platform, interpret, query_shape, key_shape, value_shape, dtype,
             has_score_mod=False, has_dropout=False, score_mod=None, score_mod_consts=()):
  """Can the Pallas kernels run this input? Returns (ok, reason); reason says why (not).

  Args:
    platform: jax backend name ("cpu", "gpu", "cuda", "rocm", "tpu").
    interpret: Pallas interpret mode.
    query_shape, key_shape, value_shape: [B, H, Sq, D], [B, Hkv, Skv, D], [B, Hkv, Skv, Dv].
    dtype: the input dtype.
    has_score_mod, has_dropout: features in use.
    score_mod, score_mod_consts: optional closure-converted score_mod and its consts; when
      given (compiled GPU only), its jaxpr is checked against the Triton lowering.
  """
  del has_dropout  # the uint32 hash lowers everywhere
  D, Dv = query_shape[-1], value_shape[-1]
  if max(D, Dv) > MAX_HEAD_DIM:
    return False, (f"head_dim {D} / head_dim_v {Dv}: the Pallas kernels support head dims up to"
                   f" {MAX_HEAD_DIM}")
  dt = jnp.dtype(dtype)
  if interpret:
    if not any(dt == jnp.dtype(d) for d in _INTERPRET_DTYPES):
      return False, f"dtype {dt.name} is not float16/bfloat16/float32/float64"
    return True, f"Pallas kernels in interpret mode on {platform!r}"
  # Compiled (interpret=False) off a GPU is allowed when asked for by name: the kernels
  # then lower for CUDA (jax.export(..., platforms=["cuda"]) on a CPU host); `_dispatch`
  # says so in the decision's reason.
  if not any(dt == jnp.dtype(d) for d in _TRITON_DTYPES):
    return False, f"dtype {dt.name}: the Triton kernels support float16, bfloat16 and float32"
  if has_score_mod and score_mod is not None:
    problem = score_mod_lowering_problem(score_mod, score_mod_consts,
                                         jnp.promote_types(dt, jnp.float32))
    if problem is not None:
      return False, problem
  return True, f"Pallas Triton kernels, {dt.name}, head_dim {D}"
