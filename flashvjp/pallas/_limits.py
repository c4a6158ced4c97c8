"""Lowering limits shared by the Pallas kernel families (each family's `_limits` adds its own).

Room: Pallas limits (shared part). Both families take the same head dims and, in
interpret mode, the same dtypes; a score_mod's or mask_mod's per-tile part must use
elementwise primitives only (neither Triton nor Mosaic-TPU lowers a gather on a tile).
"""
from __future__ import annotations

import jax.numpy as jnp

from flashvjp import _indexing
from flashvjp.pallas import _common
from flashvjp.pallas._common import MAX_HEAD_DIM

INTERPRET_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)
COMPILED_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
# Primitives a scalar score_mod may use on a tile: elementwise math, comparisons, casts
# and selects (both lowerings have rules for these). Anything reading an array at a
# computed position (gather, dynamic_slice) has no rule.
ELEMENTWISE_PRIMITIVES = frozenset("""
abs acos acosh add add_any and asin asinh atan atan2 atanh bitcast_convert_type cbrt ceil clamp
clz cond convert_element_type cos cosh div eq erf_inv exp exp2 expm1 floor ge gt integer_pow
is_finite le log log1p log2 logistic lt max min mul ne neg nextafter not or population_count pow
rem rsqrt select_n shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square
sub tan tanh xor broadcast_in_dim squeeze reshape jit custom_jvp_call stop_gradient
""".split())


def all_eqns(jaxpr):
  """Every equation of `jaxpr`, descending into sub-jaxprs (cond branches, jit, ...)."""
  for e in jaxpr.eqns:
    subs = [v for v in e.params.values() if hasattr(v, "eqns") or hasattr(v, "jaxpr")]
    if subs:
      for sub in subs:
        yield from all_eqns(sub.jaxpr if hasattr(sub, "jaxpr") else sub)
    else:
      yield e


# Operand classes every family compiles, and those a family with per-position residuals adds.
_COMPILED = ("per (b, h)", "whole")
_BY_ONE_POSITION = ("by q position", "by kv position", "by q position and by kv position")
_BY_DIFFERENCE = ("by kv_idx - q_idx",)


def _operands_note(fn, mod: str, consts, positions: bool, rel: bool = False) -> str:
  """The operands the family cannot read, named with how they are read (`flashvjp._indexing`)."""
  ok = _COMPILED + (_BY_ONE_POSITION if positions else ()) + (_BY_DIFFERENCE if rel else ())
  ops = [o for o in _indexing.of_mod(fn, mod, consts) if o.how not in ok]
  return "".join(f"; {_indexing.compile_hint(o)}" for o in ops)


def _position_split(fn, consts, acc, positions: bool, rel: bool = False):
  """(fn, per-position residual avals) as the kernels split it: with `positions` (a family
  whose kernels read per-position residuals) what fn reads by one position is hoisted
  (`flashvjp.pallas._positions`), with `rel` also what it reads by kv_idx - q_idx."""
  if not positions:
    return fn, ()
  hoisted = _common._hoisted(  # pylint: disable=protected-access
      fn, consts, acc, _common.Positions(1, 1, 1, 1, rel=rel))
  return (fn, ()) if hoisted is None else (hoisted[1], hoisted[2])


def score_mod_problem(score_mod, consts, acc_dtype, *, lowering, residual_problem,
                      positions: bool = False, rel: bool = False):
  """Why a (closure-converted, scalar) score_mod's per-tile part cannot lower, or None.

  The per-(b, h) part is precomputed by XLA (`_common.split_per_head`), and with
  `positions` (the family's kernels read per-position residuals) so is what the score_mod
  reads by one position (and with `rel` by kv_idx - q_idx); the tile part must use
  `ELEMENTWISE_PRIMITIVES`, and
  `residual_problem(aval)` (a message or None) says whether the family can read each
  per-head residual inside its kernels.
  """
  fn, consts = _common.hoist_constants(score_mod, consts, acc_dtype)
  fn, pos_avals = _position_split(fn, consts, acc_dtype, positions, rel)
  _, _, res_avals, tile = _common.split_score_mod_jaxprs(fn, consts, acc_dtype, pos_avals)
  bad = sorted({e.primitive.name for e in all_eqns(tile.jaxpr)} - ELEMENTWISE_PRIMITIVES)
  if bad:
    note = _operands_note(score_mod, "score_mod", consts, positions, rel)
    example = ("an array read at both positions at once, pairs[q_idx, kv_idx]" if rel
               else "indexing a table by the relative position kv_idx - q_idx")
    return (f"score_mod uses {', '.join(bad)} on per-position values, which the {lowering}"
            f" lowering cannot apply to a tile (e.g. {example}, a gather)" + note)
  for a in res_avals:
    problem = residual_problem(a)
    if problem is not None:
      return problem
  return None


def mask_mod_problem(mask_mod, consts, *, lowering, residual_problem, positions: bool = False,
                     rel: bool = False):
  """Why a (scalar, `_mask_mod.ScalarMaskMod`) mask_mod's per-tile part cannot lower, or None.

  As `score_mod_problem`: the per-(b, h) part (``prefix_lengths[b]``) is precomputed by
  XLA (`_common.split_mask_mod`); the tile part must use `ELEMENTWISE_PRIMITIVES`, and
  `residual_problem(aval, "mask_mod")` must accept each per-head residual.
  """
  _, _, res_avals, tile, _, _ = _common.split_mask_mod_jaxprs(
      mask_mod, tuple(consts), _common.Positions(1, 1, 1, 1, rel=rel) if positions else None)
  bad = sorted({e.primitive.name for e in all_eqns(tile.jaxpr)} - ELEMENTWISE_PRIMITIVES)
  if bad:
    example = ("an array read at both positions at once, pairs[q_idx, kv_idx]" if positions
               else "document_causal's doc_ids[b, q_idx]")
    note = _operands_note(mask_mod, "mask_mod", consts, positions, rel)
    return (f"mask_mod uses {', '.join(bad)} on per-position values, which the {lowering}"
            f" lowering cannot apply to a tile (e.g. {example}, a gather); the blockwise path"
            " or interpret mode run it" + note)
  for a in res_avals:
    problem = residual_problem(a, "mask_mod")
    if problem is not None:
      return problem
  return None


def supports(*, kernels, interpret_name, compiled_name, score_mod_problem_fn, platform,
             interpret, query_shape, value_shape, dtype, has_score_mod, score_mod,
             score_mod_consts, mask_mod=None, mask_mod_consts=(),
             mask_mod_problem_fn=None):
  """The checks both families make, in order: head dims, dtype, mask_mod, score_mod. (ok, reason).

  Compiled, a mask_mod's tile part is checked by `mask_mod_problem_fn(mask_mod, consts)`
  (the family's `mask_mod_problem` rules); interpret mode runs any mask_mod.
  """
  D, Dv = query_shape[-1], value_shape[-1]
  if max(D, Dv) > MAX_HEAD_DIM:
    return False, (f"head_dim {D} / head_dim_v {Dv}: {kernels} support head dims up to"
                   f" {MAX_HEAD_DIM}")
  dt = jnp.dtype(dtype)
  if interpret:
    if not any(dt == jnp.dtype(d) for d in INTERPRET_DTYPES):
      return False, f"dtype {dt.name} is not float16/bfloat16/float32/float64"
    return True, f"{interpret_name} in interpret mode on {platform!r}"
  if not any(dt == jnp.dtype(d) for d in COMPILED_DTYPES):
    return False, f"dtype {dt.name}: {kernels} support float16, bfloat16 and float32"
  if mask_mod is not None and mask_mod_problem_fn is not None:
    problem = mask_mod_problem_fn(mask_mod, mask_mod_consts)
    if problem is not None:
      return False, problem
  if has_score_mod and score_mod is not None:
    problem = score_mod_problem_fn(score_mod, score_mod_consts,
                                   jnp.promote_types(dt, jnp.float32))
    if problem is not None:
      return False, problem
  return True, f"{compiled_name}, {dt.name}, head_dim {D}"
