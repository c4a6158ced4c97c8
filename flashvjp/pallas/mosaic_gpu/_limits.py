"""What the Pallas Mosaic-GPU kernels can run, encoded once.

Room: Pallas Mosaic-GPU limits. `supports(...)` answers before tracing (a value (ok,
reason), never a caught exception) and `forward_problem(...)` refuses, at the forward's
entry, every operand the kernel does not implement yet, so nothing falls back silently.

`supports` answers for the family: what both the forward and the backward take.

Forward: float16 / bfloat16 inputs (compiled and interpret mode alike: the kernel runs
16-bit wgmma), head dims up to 256 (zero-padded to a multiple of 64), GQA / MQA, causal,
window, segment ids, dropout, bias, dense masks, global offsets (ring chunk pairs), any
sequence lengths (padded to whole blocks), score_mod / mask_mod whose per-(b, h) values are
scalars (softcap, ALiBi, prefix LM) and that read arrays by one q or kv position
(`document_causal`, a per-key bias; `score_mod_problem`), a float32 out (a traced scale
folded into the score_mod), tables read by kv_idx - q_idx (windows of a skewed array). Not
yet: float32 / float64 inputs. Backward and tangent: the same (above head dim 128 two programs share each block's
output columns). So the family: 16-bit, head dims <= 256.
"""
from __future__ import annotations

import jax.numpy as jnp

from flashvjp.pallas import _limits as shared
from flashvjp.pallas.mosaic_gpu import _compat

MAX_HEAD_DIM = 256  # every kernel's (flashvjp/pallas/mosaic_gpu/backward.py: `_MAX_HEAD_DIM`)
DTYPES = (jnp.float16, jnp.bfloat16)
# Hopper's per-block SMEM (227 KiB) less a margin for barriers and alignment.
SMEM_BUDGET = 220 * 1024
# The first CTA named barrier (``bar.sync`` / ``bar.arrive`` id) a kernel may take: Mosaic-GPU
# uses 0 (`gpu.barrier`) and 1 + warpgroup index (its warpgroup barriers, 1-3 with three
# warpgroups); 16 in all.
NAMED_BARRIER_BASE = 4
_COMPILED_PLATFORMS = ("gpu", "cuda")


def supports(*, platform, interpret, query_shape, key_shape, value_shape, dtype,
             has_score_mod=False, has_dropout=False, score_mod=None, score_mod_consts=(),
             mask_mod=None, mask_mod_consts=()):
  """Can the Mosaic-GPU kernels run this input? (ok, reason); reason says why (not).

  Same arguments as `flashvjp.pallas.triton._limits.supports`. Compiled (interpret=False)
  runs on CUDA GPUs (sm_90a); interpret mode on any platform.
  """
  del key_shape
  missing = _compat.unavailable()
  if missing is not None:
    return False, missing
  D, Dv = query_shape[-1], value_shape[-1]
  if max(D, Dv) > MAX_HEAD_DIM:
    return False, (f"head_dim {D} / head_dim_v {Dv}: the Mosaic-GPU kernels support head"
                   f" dims up to {MAX_HEAD_DIM}; implementation='blockwise' takes them")
  dt = jnp.dtype(dtype)
  if not any(dt == jnp.dtype(d) for d in DTYPES):
    return False, (f"dtype {dt.name}: the Mosaic-GPU kernels support float16 and bfloat16"
                   " (16-bit wgmma); implementation='pallas_triton' takes float32 and float64")
  if mask_mod is not None:
    problem = mask_mod_problem(mask_mod, mask_mod_consts)
    if problem is not None:
      return False, problem
  if has_score_mod and score_mod is not None:
    problem = score_mod_problem(score_mod, score_mod_consts, jnp.float32)
    if problem is not None:
      return False, problem
  if interpret:
    return True, f"Mosaic-GPU kernels in interpret mode on {platform!r}"
  wide = [jnp.dtype(jnp.result_type(c)).name for c in tuple(score_mod_consts or ())
          + tuple(mask_mod_consts or ()) if jnp.dtype(jnp.result_type(c)).itemsize > 4
          and jnp.issubdtype(jnp.result_type(c), jnp.inexact)]
  if wide:
    return False, (f"a mod closes over {wide[0]} arrays: the compiled Mosaic-GPU kernels read"
                   " float32 words; pass float32 arrays or use implementation='pallas_triton'")
  if platform not in _COMPILED_PLATFORMS:
    return False, (f"the compiled Mosaic-GPU kernels need a CUDA GPU (sm_90a), not"
                   f" {platform!r}; use interpret=True")
  return True, f"Pallas Mosaic-GPU kernels, {dt.name}, head_dim {D}"


def _residual_problem(aval, mod: str = "score_mod") -> str | None:
  """The kernels read per-(b, h) residuals as one word per row: scalars only."""
  if tuple(aval.shape) != ():
    return (f"{mod}: a per-head value of shape {tuple(aval.shape)} (the Mosaic-GPU kernels"
            " read scalars per (batch, head): softcap, ALiBi slopes, prefix lengths);"
            " implementation='pallas_triton' takes it")
  return None


def score_mod_problem(score_mod, consts, acc_dtype):
  """Why the Mosaic-GPU kernels cannot apply this score_mod (a sentence), or None: its
  per-tile part must be elementwise, its per-(b, h) values scalars; what it reads by one q
  or kv position travels per position (`_common.PosResiduals`: row words with Q, column
  words with K), what it reads by kv_idx - q_idx as windows of a skewed array (`_rel`)."""
  return shared.score_mod_problem(score_mod, consts, acc_dtype, lowering="Mosaic-GPU",
                                  residual_problem=_residual_problem, positions=True, rel=True)


def mask_mod_problem(mask_mod, consts):
  """As `score_mod_problem`, for a mask_mod (`_mask_mod.ScalarMaskMod`)."""
  return shared.mask_mod_problem(mask_mod, consts, lowering="Mosaic-GPU",
                                 residual_problem=_residual_problem, positions=True, rel=True)


def forward_problem(cfg, q, k, v, *, bias=None, mask=None, q_seg=None, kv_seg=None, seed=None,
                    consts=(), mod=None, offsets=None):
  """Why the forward kernel cannot run this call (a sentence), or None when it can."""
  missing = _compat.unavailable()
  if missing is not None:
    return missing
  if (q_seg is None) != (kv_seg is None):
    return "segment ids must be given for both queries and keys (or neither)"
  if cfg.dropout_active and seed is None:
    return "dropout needs a seed"
  if offsets is not None and len(tuple(offsets)) != 4:
    return f"offsets must be (b0, h0, q0, kv0), got {offsets!r}"
  dts = {jnp.dtype(x.dtype) for x in (q, k, v)}
  if len(dts) != 1:
    return f"q, k, v must share one dtype, got {sorted(d.name for d in dts)}"
  dt = dts.pop()
  if not any(dt == jnp.dtype(d) for d in DTYPES):
    return f"dtype {dt.name}: the Mosaic-GPU kernels support float16 and bfloat16"
  D, Dv = q.shape[-1], v.shape[-1]
  if max(D, Dv) > MAX_HEAD_DIM:
    return f"head_dim {D} / head_dim_v {Dv} above {MAX_HEAD_DIM}"
  if q.shape[1] % k.shape[1]:
    return f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads"
  return None


# Hopper (sm_90a) parts by the device kind JAX reports ("NVIDIA H100 80GB HBM3", ...).
HOPPER_KINDS = ("H100", "H200", "H800", "H20", "GH200")
# Blackwell data-center parts (sm_100a: tcgen05, TMEM): the kernels of
# flashvjp.pallas.mosaic_gpu_sm100 (the "B" of "GB200" too).
BLACKWELL_KINDS = ("B200", "B100")
# What those kernels take (flashvjp/pallas/mosaic_gpu_sm100/forward.py `forward_problem`):
# no per-entry feature yet, head dims up to 128, no tangent kernel.
BLACKWELL_MAX_HEAD_DIM = 128


def gpu_arch(device_kind: str | None) -> str | None:
  """"sm_100a" for a Blackwell device kind, else None (Hopper's kernels, or unknown: a
  deviceless `jax.export(..., platforms=["cuda"])`)."""
  if device_kind is not None and any(b in device_kind for b in BLACKWELL_KINDS):
    return "sm_100a"
  return None


def device_problem(device_kind: str | None) -> str | None:
  """Why the compiled kernels cannot run on a GPU of `device_kind` (None: they can, or the
  kind is unknown, e.g. `jax.export(..., platforms=["cuda"])` with no device)."""
  if (device_kind is None or any(h in device_kind for h in HOPPER_KINDS)
          or gpu_arch(device_kind) is not None):
    return None
  return (f"the Mosaic-GPU kernels are written for Hopper (sm_90a: TMA, wgmma) and Blackwell"
          f" (sm_100a: tcgen05, TMEM), the target is {device_kind!r}; use"
          " implementation='pallas_triton' (it runs on Ampere, Hopper and Blackwell)")


def blackwell_problem(*, query_shape, value_shape, has_score_mod=False, has_dropout=False,
                      mask_mod=None) -> str | None:
  """Why the Blackwell (sm_100a) kernels cannot run this call, from what dispatch sees (the
  rest: bias, masks, segment ids, at the kernels' entry, by name), or None."""
  old = _compat.blackwell_unavailable()
  if old is not None:
    return f"{old}; use implementation='pallas_triton' there"
  D, Dv = query_shape[-1], value_shape[-1]
  missing = [n for n, x in (("a score_mod", has_score_mod), ("dropout", has_dropout),
                            ("a mask_mod", mask_mod is not None)) if x]
  if max(D, Dv) > BLACKWELL_MAX_HEAD_DIM:
    missing.append(f"head_dim {D} / head_dim_v {Dv} above {BLACKWELL_MAX_HEAD_DIM}")
  if not missing:
    return None
  return (f"the Blackwell (sm_100a) Mosaic-GPU kernels do not take {', '.join(missing)} yet;"
          " use implementation='pallas_triton' there")
