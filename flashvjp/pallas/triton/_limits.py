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
dispatcher passes the score_mod (`score_mod_lowering_problem`). A mask_mod obeys the
same rule (`mask_mod_lowering_problem`): prefix_lm, chunked and
sliding_window_with_global lower; document_causal (doc_ids[b, q_idx]) does not.
"""
from __future__ import annotations

import numpy as np

from flashvjp.pallas import _limits as shared


def _residual_problem(aval, what="score_mod"):
  size = int(np.prod(aval.shape))
  if size & (size - 1):
    return (f"{what} reads a per-head value of shape {aval.shape} inside the kernel: the"
            " Triton lowering loads only tensors whose size is a power of 2")
  return None


def score_mod_lowering_problem(score_mod, consts, acc_dtype=np.float32):
  """Why a (closure-converted, scalar) score_mod cannot lower to Triton, or None.

  The kernels run only the score_mod's per-tile part: what depends on (b, h) and
  the closed-over arrays alone (ALiBi's ``slopes[h]``) is precomputed per head by
  XLA (`flashvjp.pallas._common.split_per_head`), and so is what it reads from an array by
  one position (``bias_vec[kv_idx]``: per-position residuals, `flashvjp.pallas._positions`,
  sliced per tile like segment ids) or by kv_idx - q_idx (``table[h, bucket(kv_idx - q_idx)]``:
  a row per (b, h) over the differences, read by a gather load). So only the per-tile part must
  use primitives the Triton lowering can apply to a tile, and the per-head values it
  reads must have power-of-2 sizes.

  Args:
    score_mod: fn(s, b, h, q_idx, kv_idx, *consts) -> s on scalars.
    consts: the arrays it takes after the indices.
  """
  return shared.score_mod_problem(score_mod, consts, acc_dtype, lowering="Pallas Triton",
                                  residual_problem=_residual_problem, positions=True, rel=True)


def mask_mod_lowering_problem(mask_mod, consts):
  """Why a (scalar) mask_mod cannot lower to Pallas Triton, or None.

  As for a score_mod: what depends on (b, h) and the closed-over arrays alone (prefix_lm's
  ``prefix_lengths[b]``) is precomputed per head by XLA (`_common.split_mask_mod`); the
  per-tile part must be elementwise. document_causal's ``doc_ids[b, q_idx]`` and
  ``doc_ids[b, kv_idx]`` are per-position residuals (`flashvjp.pallas._positions`), and
  what it reads by kv_idx - q_idx a row of differences.
  """
  return shared.mask_mod_problem(mask_mod, consts, lowering="Pallas Triton",
                                 residual_problem=_residual_problem, positions=True, rel=True)


def supports(*, platform, interpret, query_shape, key_shape, value_shape, dtype,
             has_score_mod=False, has_dropout=False, score_mod=None, score_mod_consts=(),
             mask_mod=None, mask_mod_consts=()):
  """Can the Pallas kernels run this input? Returns (ok, reason); reason says why (not).

  Compiled (interpret=False) off a GPU is allowed when asked for by name: the kernels
  then lower for CUDA (jax.export(..., platforms=["cuda"]) on a CPU host); `_dispatch`
  says so in the decision's reason.

  Args:
    platform: jax backend name ("cpu", "gpu", "cuda", "rocm", "tpu").
    interpret: Pallas interpret mode.
    query_shape, key_shape, value_shape: [B, H, Sq, D], [B, Hkv, Skv, D], [B, Hkv, Skv, Dv].
    dtype: the input dtype.
    has_score_mod, has_dropout: features in use (the uint32 dropout hash lowers everywhere).
    score_mod, score_mod_consts: optional closure-converted score_mod and its consts; when
      given (compiled GPU only), its jaxpr is checked against the Triton lowering.
  """
  del key_shape, has_dropout
  return shared.supports(
      kernels="the Pallas kernels", interpret_name="Pallas kernels",
      compiled_name="Pallas Triton kernels", score_mod_problem_fn=score_mod_lowering_problem,
      platform=platform, interpret=interpret, query_shape=query_shape,
      value_shape=value_shape, dtype=dtype, has_score_mod=has_score_mod, score_mod=score_mod,
      score_mod_consts=score_mod_consts, mask_mod=mask_mod, mask_mod_consts=mask_mod_consts,
      mask_mod_problem_fn=mask_mod_lowering_problem)
