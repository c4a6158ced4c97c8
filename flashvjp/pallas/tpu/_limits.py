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
precomputed outside the kernels and is fine. A mask_mod obeys the same rule
(`mask_mod_lowering_problem`): prefix_lm, chunked and sliding_window_with_global lower;
document_causal (doc_ids[b, q_idx]) does not.
"""
from __future__ import annotations

import jax.numpy as jnp

from flashvjp.pallas import _limits as shared


def _residual_problem(aval, what="score_mod"):
  if aval.shape != ():
    return (f"{what} reads a per-head array of shape {aval.shape} inside the kernel: the"
            " Mosaic-TPU kernels take per-head scalars only (in SMEM)")
  return None


def score_mod_lowering_problem(score_mod, consts, acc_dtype=jnp.float32):
  """Why a (closure-converted, scalar) score_mod cannot lower to Mosaic-TPU, or None."""
  return shared.score_mod_problem(score_mod, consts, acc_dtype, lowering="Mosaic-TPU",
                                  residual_problem=_residual_problem, positions=True, rel=True)


def mask_mod_lowering_problem(mask_mod, consts):
  """Why a (scalar) mask_mod cannot lower to Mosaic-TPU, or None.

  As for a score_mod: what depends on (b, h) and the closed-over arrays alone (prefix_lm's
  ``prefix_lengths[b]``) is precomputed per head by XLA (`_common.split_mask_mod`); the
  per-tile part must be elementwise (document_causal's ``doc_ids[b, q_idx]`` is a gather:
  it runs in interpret mode and on the blockwise path only).
  """
  return shared.mask_mod_problem(mask_mod, consts, lowering="Mosaic-TPU",
                                 residual_problem=_residual_problem, positions=True, rel=True)


def supports(*, platform, interpret, query_shape, key_shape, value_shape, dtype,
             has_score_mod=False, has_dropout=False, score_mod=None, score_mod_consts=(),
             mask_mod=None, mask_mod_consts=()):
  """Can the Mosaic-TPU kernels run this input? Returns (ok, reason).

  Args: as `flashvjp.pallas.triton._limits.supports` (the uint32 dropout hash lowers on
  TPU: 32-bit integer ops).
  """
  del key_shape, has_dropout
  return shared.supports(
      kernels="the Mosaic-TPU kernels", interpret_name="Pallas Mosaic-TPU kernels",
      compiled_name="Pallas Mosaic-TPU kernels", score_mod_problem_fn=score_mod_lowering_problem,
      platform=platform, interpret=interpret, query_shape=query_shape,
      value_shape=value_shape, dtype=dtype, has_score_mod=has_score_mod, score_mod=score_mod,
      score_mod_consts=score_mod_consts, mask_mod=mask_mod, mask_mod_consts=mask_mod_consts,
      mask_mod_problem_fn=mask_mod_lowering_problem)
