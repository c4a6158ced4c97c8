"""flash_attention and friends: validate, normalise, dispatch.

Room: public API. Everything a user can get wrong is checked here, before any
kernel is traced, and reported with the argument's name, what was expected and
what was given. Kernels never import this module.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
import re
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flashvjp import _config
from flashvjp import _dispatch
from flashvjp import _dropout
from flashvjp import _indexing
from flashvjp import _mask_mod
from flashvjp import _partition
from flashvjp import _remat
from flashvjp import _score_mod
from flashvjp import _strategy
from flashvjp import _target
from flashvjp import _vjp
from flashvjp import reference
from flashvjp._config import AttentionConfig
from flashvjp._config import BlockSizes
from flashvjp._config import default_block_sizes
from flashvjp.ring import _schedule

_FLOATS = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


# A sharding applied inside jax.jit (`with_sharding_constraint`, `jit(in_shardings=...)`) is
# known only when XLA partitions the program, after tracing: the partitioning rule
# (`flashvjp._partition`) checks it then, and XLA reports an exception of that Python
# callback as `JaxRuntimeError: INTERNAL: custom_partitioner: <traceback>`. The handler
# below gives the user the ValueError / TypeError flashvjp raised, with its own message,
# so that `except ValueError` catches a sequence that the shard count does not divide.
_PKG_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep  # flashvjp's own frames
_PARTITIONER_ERROR = re.compile(
    r'^  File "(?P<file>[^"]*)".*\n(?:(?!  File ).*\n)*?(?P<kind>ValueError|TypeError): (?P<msg>.*)$',
    re.M)


def _partitioner_error(err: Exception) -> Exception | None:
  """flashvjp's own ValueError / TypeError inside an XLA custom_partitioner error, or None.

  The error text holds the Python traceback of the partitioning callback: the exception is
  flashvjp's when the last frame before it is a file of this package.
  """
  text = str(err)
  if "custom_partitioner" not in text:
    return None
  found = list(_PARTITIONER_ERROR.finditer(text))
  if not found:
    return None
  last = found[-1]
  if not os.path.abspath(last["file"]).startswith(_PKG_DIR):
    return None
  cls = ValueError if last["kind"] == "ValueError" else TypeError
  return cls(f"{last['msg'].rstrip()} (found while XLA partitioned the program under jax.jit,"
             " where the sharding was applied)")


def _register_partitioner_errors() -> None:
  try:  # jax's hook for compile errors (jax._src.compiler, jax 0.10.2-0.12)
    from jax._src import compiler
    register = compiler.register_xla_runtime_error_handler
  except (ImportError, AttributeError):  # without it the error stays JaxRuntimeError
    return
  if _partitioner_error not in getattr(compiler, "_XLA_RUNTIME_ERROR_HANDLERS", ()):
    register(_partitioner_error)


_register_partitioner_errors()


def _is_array(x, allow_shapes=False):
  if allow_shapes and isinstance(x, jax.ShapeDtypeStruct):
    return True
  return isinstance(x, (jax.Array, np.ndarray)) or hasattr(x, "__jax_array__")


def _check_qkv(query, key, value, allow_shapes=False):
  for name, x in (("query", query), ("key", key), ("value", value)):
    if not _is_array(x, allow_shapes):
      raise TypeError(f"{name} must be a jax or numpy array, got {type(x).__name__}")
    if x.ndim != 4:
      raise ValueError(f"{name} must have rank 4 [batch, heads, seq, head_dim], got shape {x.shape}")
    if not any(x.dtype == d for d in _FLOATS):
      raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
  if not (query.dtype == key.dtype == value.dtype):
    raise TypeError("query, key and value must have the same dtype, got "
                    f"query {query.dtype}, key {key.dtype}, value {value.dtype}")
  B, H, _, D = query.shape
  if key.shape[0] != B or value.shape[0] != B:
    raise ValueError(f"batch mismatch: query has batch {B}, key {key.shape[0]}, value {value.shape[0]}")
  if key.shape[3] != D:
    raise ValueError(f"head_dim mismatch: query has head_dim {D}, key has {key.shape[3]}")
  if key.shape[1] != value.shape[1]:
    raise ValueError(f"num_kv_heads mismatch: key has {key.shape[1]} heads, value has {value.shape[1]}")
  if key.shape[2] != value.shape[2]:
    raise ValueError(f"seq mismatch: key has seq_kv {key.shape[2]}, value has {value.shape[2]}")
  if key.shape[1] == 0 or H % key.shape[1] != 0:
    raise ValueError(f"num_heads of query ({H}) must be a multiple of num_kv_heads of key ({key.shape[1]})")
  if min(query.shape) == 0 or min(key.shape) == 0 or min(value.shape) == 0:
    raise ValueError(f"query, key and value must be non-empty, got shapes {query.shape}, {key.shape}, {value.shape}")


def _pair_rank4(name, x, target, want_bool):
  """Normalise a bias/mask to rank 4 with each dim 1 or full."""
  if not _is_array(x):
    raise TypeError(f"{name} must be an array, got {type(x).__name__}")
  if want_bool and x.dtype != jnp.bool_:
    raise TypeError(f"{name} must be a bool array (True = may attend), got dtype {x.dtype}")
  if not want_bool and not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name} must be a float array, got dtype {x.dtype}")
  if x.ndim > 4:
    raise ValueError(f"{name} must broadcast to [batch, num_heads, seq_q, seq_kv] = {target}, got shape {x.shape}")
  shape = (1,) * (4 - x.ndim) + tuple(x.shape)
  for got, want in zip(shape, target):
    if got not in (1, want):
      raise ValueError(f"{name} of shape {x.shape} does not broadcast to [batch, num_heads, seq_q, seq_kv] = {target}")
  return jnp.reshape(x, shape)


def _check_segments(segment_ids, B, Sq, Skv):
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise ValueError(f"segment_ids as a pair must be (q_ids, kv_ids), got {len(segment_ids)} items")
    q_ids, kv_ids = segment_ids
  else:
    if Sq != Skv:
      raise ValueError("segment_ids must be a pair (q_ids [batch, seq_q], kv_ids [batch, seq_kv])"
                       f" when seq_q ({Sq}) != seq_kv ({Skv})")
    q_ids = kv_ids = segment_ids
  for name, ids, S in (("segment_ids (q)", q_ids, Sq), ("segment_ids (kv)", kv_ids, Skv)):
    if not _is_array(ids):
      raise TypeError(f"{name} must be an int array, got {type(ids).__name__}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise TypeError(f"{name} must have an integer dtype, got {ids.dtype}")
    if tuple(ids.shape) != (B, S):
      raise ValueError(f"{name} must have shape [batch, seq] = {(B, S)}, got {ids.shape}")
  return q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)


def _check_window(window, name="window"):
  """A (left, right) pair of non-negative ints or None (unbounded side); None means no window."""
  if window is None:
    return None
  if not isinstance(window, (tuple, list)) or len(window) != 2:
    raise ValueError(f"{name} must be a pair (left, right) of ints or None, got {window!r}")
  out: list = []
  for side, w in zip(("left", "right"), window):
    if w is None:
      out.append(None)
      continue
    if not isinstance(w, numbers.Integral) or isinstance(w, bool):
      raise TypeError(f"{name} {side} must be an int or None, got {w!r}")
    if w < 0:
      raise ValueError(f"{name} {side} must be >= 0, got {w}")
    out.append(int(w))
  return tuple(out)


def _local_window(local_window_size):
  """jax.nn's local_window_size (int w = (w, w), or (left, right)) -> flashvjp's window
  (the drop-in's and explain's)."""
  if local_window_size is None:
    return None
  if isinstance(local_window_size, numbers.Integral) and not isinstance(local_window_size, bool):
    local_window_size = (local_window_size, local_window_size)
  if not isinstance(local_window_size, (tuple, list)) or len(local_window_size) != 2:
    raise ValueError("local_window_size must be an int or a pair (left, right) of ints,"
                     f" got {local_window_size!r}")
  return _check_window(local_window_size, name="local_window_size")


CAUSAL = (False, True, "top_left", "bottom_right")


def _align_causal(causal, window, seq_q: int, seq_kv: int):
  """(causal bool, window) of the mask model for `causal` = False / True / "top_left" /
  "bottom_right" (kv_pos <= q_pos + seq_kv - seq_q: the last query sees the last key, as
  FlashAttention's causal and PyTorch's causal_lower_right; chunked prefill, decoding
  against a KV cache). Bottom-right with seq_q != seq_kv is the window's right bound
  min(right, seq_kv - seq_q) (negative when seq_q > seq_kv: the first seq_q - seq_kv rows
  attend nothing); the window itself stays top-left (it is ANDed, as every mask)."""
  if isinstance(causal, (bool, np.bool_)):
    return bool(causal), window
  if not isinstance(causal, str) or causal not in CAUSAL:
    raise TypeError(f"causal must be a bool, 'top_left' or 'bottom_right', got {causal!r}")
  if causal == "top_left" or seq_q == seq_kv:
    return True, window
  d = int(seq_kv) - int(seq_q)
  left, right = (None, None) if window is None else window
  return False, (left, d if right is None else min(right, d))


def _per_sequence_causal(q_lengths, kv_lengths, batch: int, seq_q: int, seq_kv: int,
                         mask_mod=None):
  """The drop-in's ``is_causal="bottom_right"`` with sequence lengths: (causal, mask_mod).

  Each sequence's diagonal ends at its own lengths (FlashAttention's ``cache_seqlens``, a
  decoding loop over a partly filled KV cache): ``kv_pos <= q_pos + off[b]`` with
  ``off[b] = kv_len[b] - q_len[b]`` (kv_len defaults to seq_kv, q_len to seq_q), an int32
  [batch] array read per batch index by a mask_mod (ANDed with the user's `mask_mod`, whose
  ring hint it keeps). Without q lengths ``off[b] <= seq_kv - seq_q``, so the static
  bottom-right bound holds as well and stays (whole blocks skipped statically); with them
  an offset may exceed it (fewer valid queries than seq_q), and causal is False. The
  lengths themselves still become segment ids (padding), as for any drop-in call.
  """
  def full(n):
    return jnp.full((batch,), n, jnp.int32)
  q_n = full(seq_q) if q_lengths is None else jnp.asarray(q_lengths, jnp.int32)
  kv_n = full(seq_kv) if kv_lengths is None else jnp.asarray(kv_lengths, jnp.int32)
  off = kv_n - q_n

  def aligned(b, h, q_idx, kv_idx):
    del h
    return kv_idx <= q_idx + off[b]

  mod = aligned
  if mask_mod is not None:
    def mod(b, h, q_idx, kv_idx):
      return aligned(b, h, q_idx, kv_idx) & mask_mod(b, h, q_idx, kv_idx)
    hint = getattr(mask_mod, "kv_intervals", None)
    if hint is not None:  # a superset of the user's mask is one of the AND too
      mod.kv_intervals = hint  # type: ignore[attr-defined]
  return ("bottom_right" if q_lengths is None else False), mod


def _check_block(name, b):
  if b is None:
    return None
  if not isinstance(b, numbers.Integral) or isinstance(b, bool):
    raise TypeError(f"{name} must be a positive int, got {b!r}")
  if b <= 0:
    raise ValueError(f"{name} must be a positive int, got {b}")
  return int(b)


def _check_flag(name, x):
  if not isinstance(x, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool, got {x!r}")
  return bool(x)


def _check_sinks(sinks, H):
  if sinks is None:
    return None
  if not _is_array(sinks):
    raise TypeError(f"sinks must be a float array of shape [num_heads] = [{H}], got"
                    f" {type(sinks).__name__}")
  if not jnp.issubdtype(sinks.dtype, jnp.floating):
    raise TypeError(f"sinks must be a float array of shape [num_heads] = [{H}], got dtype"
                    f" {sinks.dtype}")
  if tuple(sinks.shape) != (H,):
    raise ValueError(f"sinks must have shape [num_heads] = [{H}], got {tuple(sinks.shape)}")
  return sinks


def _check_explicit_axes(**arrays):
  """A clear error for arrays whose type is sharded over Explicit mesh axes (sharding in
  types, `jax.make_mesh`'s default on recent jax): the kernels and the partitioning rule
  need Auto axes."""
  for name, x in arrays.items():
    if not isinstance(x, (jax.Array, jax.core.Tracer)):
      continue
    sharding = getattr(jax.typeof(x), "sharding", None) if hasattr(jax, "typeof") else None
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    types = dict(zip(getattr(mesh, "axis_names", ()), getattr(mesh, "axis_types", ())))
    used = [a for entry in (spec or ()) if entry is not None
            for a in (entry if isinstance(entry, tuple) else (entry,))]
    explicit = [a for a in used if "Explicit" in str(types.get(a, ""))]
    if explicit:
      raise ValueError(
          f"{name} is sharded over Explicit mesh axes {explicit} (sharding in types, e.g."
          " jax.make_mesh's default): flash_attention partitions over Auto axes only. Build"
          " the mesh with axis_types=(jax.sharding.AxisType.Auto,) * ndim (or"
          " jax.sharding.Mesh(devices, names)) and place the arrays with NamedSharding")


def _check_axes(name: str, axes):
  """None, a mesh axis name or a tuple / list of them, as a tuple (hashable), else TypeError."""
  if axes is None:
    return None
  items = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
  if not items or not all(isinstance(a, str) for a in items):
    raise TypeError(f"{name} must be a mesh axis name or a tuple of them, got {axes!r}")
  return items


def _prepare(query, key, value, *, bias, mask, causal, window, segment_ids, score_mod, scale,
             dropout_rate, dropout_rng, deterministic, implementation, block_q, block_kv,
             interpret, dropout_broadcast=(False, False), mask_mod=None, block_mask=None,
             sinks=None, allow_shapes=False, fold_scale=False, context_parallel="auto",
             max_logits=False, causal_lengths=None, program_target=None,
             ring_head_groups=1, outside_bias=False, intra_node_axes=None):
  """Validate everything; return (decision, cfg, arrays) without tracing any kernel.

  fold_scale: an array (traced) scale with low-precision inputs becomes the first step of
  the score_mod (`_fold_scale`) instead of pre-scaling the query in `attend`; with a bias
  (or `outside_bias`: one the caller normalises itself, as ring_attention), the bias is
  folded through it there (`AttentionConfig.fold_bias`).
  """
  _check_qkv(query, key, value, allow_shapes)
  _check_explicit_axes(query=query, key=key, value=value)
  B, H, Sq, D = query.shape
  Skv = key.shape[2]
  target = (B, H, Sq, Skv)
  if implementation is not None and implementation not in _dispatch.IMPLEMENTATIONS:
    raise ValueError(f"implementation must be None or one of {_dispatch.IMPLEMENTATIONS}, got {implementation!r}")
  window = _check_window(window)
  causal, window = _align_causal(causal, window, *(causal_lengths or (Sq, Skv)))
  block_q = _check_block("block_q", block_q)
  block_kv = _check_block("block_kv", block_kv)
  if isinstance(dropout_rate, bool) or not isinstance(dropout_rate, numbers.Real):
    raise TypeError(f"dropout_rate must be a float in [0, 1), got {dropout_rate!r}")
  if not 0.0 <= float(dropout_rate) < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
  if deterministic is None:  # left at its default: True (no dropout), as attnax's names had it
    deterministic = True
    if float(dropout_rate) > 0.0 and dropout_rng is not None and not allow_shapes:
      warnings.warn(
          f"flashvjp: dropout_rate={dropout_rate} and a dropout_rng were given but deterministic"
          " was left at its default (True), so no dropout is applied. Pass deterministic=False"
          " to apply dropout, or deterministic=True to say that none is meant (as at eval"
          " time).", UserWarning, stacklevel=_user_stacklevel())
  dropout_active = float(dropout_rate) > 0.0 and not deterministic
  if dropout_active and dropout_rng is None:
    raise ValueError("dropout_rng is required when dropout is active"
                     f" (dropout_rate={dropout_rate}, deterministic=False), got None")
  if dropout_rng is not None:
    _dropout.check_key(dropout_rng, "dropout_rng")
  dropout_broadcast = _dropout.check_broadcast(dropout_broadcast, "dropout_broadcast")
  scale, scale_array = _check_scale(scale, D)
  bias = None if bias is None else _pair_rank4("bias", bias, target, want_bool=False)
  mask = None if mask is None else _pair_rank4("mask", mask, target, want_bool=True)
  q_seg = kv_seg = None
  if segment_ids is not None:
    q_seg, kv_seg = _check_segments(segment_ids, B, Sq, Skv)
  acc = jnp.promote_types(query.dtype, jnp.float32)
  sm_fn, consts, n_diff = None, (), 0
  if score_mod is not None and not callable(score_mod):
    raise TypeError(f"score_mod must be callable (scores, b, h, q_idx, kv_idx) -> scores, got {type(score_mod).__name__}")
  out_f32 = (fold_scale and scale_array is not None and implementation != "naive"
             and jnp.dtype(query.dtype).itemsize <= 2)
  fold_bias = bool(out_f32) and (bias is not None or bool(outside_bias))
  # the folded bias' rows shifted by their max: exact only when no score_mod follows
  fold_shift = fold_bias and score_mod is None
  if out_f32:  # with a bias, `attend` divides it by the scale (scale_array stays for that)
    score_mod = _fold_scale(scale_array, score_mod, with_bias=fold_bias)
    scale_array = scale_array if fold_bias else None
  if score_mod is not None:
    sm_fn, consts, n_diff = _score_mod.check(score_mod, target, acc)
  mm_fn, mm_consts, mm_uses = None, (), (True, True)
  if block_mask is not None and mask_mod is None:
    raise ValueError("block_mask needs the mask_mod it was made from: pass mask_mod= too"
                     " (flash_attention(..., mask_mod=m, block_mask=make_block_mask(m, ...)))")
  if mask_mod is not None:
    mm_fn, mm_consts, mm_uses = _mask_mod.check(mask_mod, target)
  if block_mask is not None:
    _mask_mod.check_block_mask(block_mask, target)
  sinks = _check_sinks(sinks, H)
  if context_parallel is None:
    context_parallel = "auto"
  if not isinstance(context_parallel, str) or context_parallel not in _strategy.REQUESTS:
    raise ValueError(f"context_parallel must be one of {_strategy.REQUESTS}, got"
                     f" {context_parallel!r}")
  intra_node_axes = _check_axes("intra_node_axes", intra_node_axes)
  ring_head_groups = _schedule.check_head_groups(ring_head_groups, H, key.shape[1])
  if ring_head_groups > 1 and context_parallel not in ("ring", "usp", "all_gather"):
    raise ValueError(f"ring_head_groups={ring_head_groups} needs context_parallel='ring',"
                     f" 'usp' or 'all_gather' (the ring run per group of kv heads), got"
                     f" {context_parallel!r}")

  # the program's target (platform, devices); explain(target=...) names one instead
  program = _target.of(query, key, value) if program_target is None else program_target
  problem = None if allow_shapes else _target.deviceless_partition_problem(program)
  if problem is not None and implementation != "naive":
    raise NotImplementedError(problem)
  decision = _dispatch.decide(
      implementation, interpret=interpret, query_shape=query.shape, key_shape=key.shape,
      value_shape=value.shape, dtype=query.dtype, has_score_mod=score_mod is not None,
      has_dropout=dropout_active, score_mod=sm_fn, score_mod_consts=consts, mask_mod=mm_fn,
      mask_mod_consts=mm_consts, target=program, causal=bool(causal))
  precision = _config.canonical_precision(jax.config.jax_default_matmul_precision)
  defaults = default_block_sizes(decision.implementation, decision.interpret,
                                 head_dim=max(D, value.shape[3]), dtype=query.dtype,
                                 precision=precision)
  if block_q is None and block_kv is None:
    blocks = defaults  # includes the tuned backward block sizes
  else:
    blocks = BlockSizes(block_q or defaults.block_q, block_kv or defaults.block_kv)
  mm_blocks, mm_classes = None, None
  if mm_fn is not None:
    if block_mask is not None:
      mm_blocks, mm_classes = (block_mask.block_q, block_mask.block_kv), block_mask.classes
      mm_uses = (block_mask.classes.shape[0] != 1 or B == 1,
                 block_mask.classes.shape[1] != 1 or H == 1)
    else:  # classified inside `_run`, at the smallest of the passes' blocks, so that every
      # pass's blocks are multiples of it (powers of 2 for Pallas) and its lists exact
      mm_blocks = (min(blocks.block_q, blocks.dkv[0], blocks.dq[0], Sq),
                   min(blocks.block_kv, blocks.dkv[1], blocks.dq[1], Skv))
  cfg = AttentionConfig(
      scale=scale, causal=bool(causal), window=window, seq_q=Sq, seq_kv=Skv,
      dropout_rate=float(dropout_rate) if dropout_active else 0.0, blocks=blocks,
      score_mod=sm_fn, num_diff_consts=n_diff, interpret=decision.interpret,
      implementation=decision.implementation, precision=precision,
      dropout_broadcast=dropout_broadcast if dropout_active else (False, False),
      mask_mod=mm_fn, mask_mod_blocks=mm_blocks, mask_mod_uses=mm_uses,
      out_f32=bool(out_f32) and decision.implementation != "naive", fold_bias=fold_bias,
      fold_shift=fold_shift,
      context_parallel=context_parallel, ring_head_groups=ring_head_groups,
      intra_node_axes=intra_node_axes,
      # the hint only matters when a mesh can shard the sequence; on one device it would
      # only make the config (and the compile cache) depend on the mask_mod object
      mask_mod_hint=getattr(mask_mod, "kv_intervals", None) if program.partition else None,
      partition=program.partition, max_logits=bool(max_logits),
      gpu_arch=(_dispatch.mosaic_gpu_arch(program)
                if decision.implementation == "pallas_mosaic_gpu" and not decision.interpret
                else None))
  if cfg.out_f32:  # a traced scale with 16-bit inputs (`_fold_scale`): say where it went
    decision = dataclasses.replace(decision, reason=(
        f"{decision.reason}; the traced scale is the score_mod's first step (score_mod[0]),"
        " out float32 inside the op" + (", the bias divided by it in float32"
                                        if cfg.fold_bias else "")))
  seed = _dropout.seed_from_key(dropout_rng) if dropout_active else None
  if not allow_shapes:
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
  arrays = (query, key, value, bias, mask, q_seg, kv_seg, seed, consts, scale_array, mm_consts,
            mm_classes, sinks)
  return decision, cfg, arrays


def _user_stacklevel() -> int:
  """warnings.warn's stacklevel, called from here, of the first frame outside flashvjp."""
  frame, level = sys._getframe(1), 1
  while frame.f_code.co_filename.startswith(_PKG_DIR) and frame.f_back is not None:
    frame, level = frame.f_back, level + 1
  return level


# A traced scale with a bias (`_fold_scale`): the bias is folded through the scale where
# |scale| >= _FOLD_MIN_SCALE; below it (0 included) the query is pre-scaled as before.
_FOLD_MIN_SCALE = 2.0 ** -14
# A folded value (bias / scale, or a folded score) beyond this in magnitude (an inf, or a
# masking value such as -1e30 or finfo.min divided by the scale) gives the scale no gradient.
_FOLD_HUGE = 2.0 ** 64
_F32_MAX = float(np.finfo(np.float32).max)


def _fold_scale(scale_array, score_mod, with_bias=False):
  """A traced scale as the first step of the score_mod: ``s -> score_mod(scale * s, ...)``.

  For bfloat16 / float16 inputs. The kernels then run with scale 1.0 on the query as
  given, the scale is a differentiable array of the score_mod (its gradient accumulated
  in float32 from the float32 score tiles, d scale = sum(dS * q k^T)), and the op keeps
  out in float32 (`AttentionConfig.out_f32`: p @ v in float32, out rounded to the
  query's dtype after the op), so that the backward's delta = rowsum(dO * O) matches its
  float32 probabilities. Pre-scaling the query instead gives d scale = sum(q * dq) from
  dq in the query's dtype, and delta from the rounded out, whose error d scale (a sum
  over every score, mostly cancelling) amplifies: about 8x naive bfloat16 autodiff's
  error (tests/test_testing.py), 10-18x with a bias (float16 and bfloat16).

  with_bias: the bias, added after the scale, is folded through it
  (``scale * q k^T + bias = scale * (q k^T + bias / scale)``): `attend` gives the kernels
  ``bias' = (bias - shift) / scale`` in float32 (`_fold_bias`: float32 so that d bias'
  comes back in float32, since autodiff forms d scale from two terms,
  ``sum(dS * (q k^T + bias'))`` here and ``-sum(dS * bias')`` through the
  division, which cancel to ``sum(dS * q k^T)`` at float32 precision; shift, each bias
  row's largest finite entry when no score_mod follows, keeps bias' small and is added
  back to lse), and d bias = d bias' / scale. The cancellation costs about float32's
  epsilon times |bias - shift| / |scale * q k^T| relative, far below 16-bit rounding
  unless the bias dominates the logits by thousands. Where |scale| < `_FOLD_MIN_SCALE` (0
  included) the folded part is 1 and `attend` pre-scales the query instead (no division
  by a tiny scale; d scale as accurate as before there). A folded score beyond
  `_FOLD_HUGE` (an infinite bias, or a masking value such as finfo.min over the scale)
  keeps its value with no gradient to the scale (never inf - inf, nor 0 * inf).
  """
  def mod(s, b, h, q_idx, kv_idx):
    c = scale_array.astype(s.dtype)
    if with_bias:
      c = jnp.where(jnp.abs(c) >= _FOLD_MIN_SCALE, c, 1.0)  # `_fold_split`'s folded part
      # beyond _FOLD_HUGE: c * s without a gradient to c; an inf (an infinite bias, which
      # `_fold_bias` leaves as it is) passes unscaled: it never multiplies c, since the
      # kernels' tangent passes differentiate the tile part against their per-head values
      # with dense zero tangents (inf * 0 is NaN)
      huge, inf = ~(jnp.abs(s) <= _FOLD_HUGE), jnp.isinf(s)
      s_huge = jnp.where(inf, s, jnp.where(inf, 0.0, s) * lax.stop_gradient(c))
      s = jnp.where(huge, s_huge, jnp.where(huge, 0.0, s) * c)
    else:
      s = s * c
    return s if score_mod is None else score_mod(s, b, h, q_idx, kv_idx)
  return mod


def _fold_split(scale_array):
  """(folded part, query part) of a traced scale with a bias (`_fold_scale`), float32:
  (scale, 1) where |scale| >= _FOLD_MIN_SCALE, else (1, scale)."""
  c = scale_array.astype(jnp.float32)
  folds = jnp.abs(c) >= _FOLD_MIN_SCALE
  return jnp.where(folds, c, 1.0), jnp.where(folds, 1.0, c)


def _fold_bias(bias, c, shift_rows=True):
  """(bias', shift): ``bias' = (bias - shift) / c`` in float32 (`_fold_scale`'s with_bias),
  c the folded part of the scale; with shift_rows, shift [.., 1] is each bias row's
  largest finite entry (0 for a row with none), a constant (no gradient) that `attend`
  adds back to lse and the row maxima; else None (no shift).

  The shift leaves the softmax as it is (lse moves by it; only without a score_mod, which
  need not commute with it: `AttentionConfig.fold_shift`) and keeps the folded values
  small where they are not masking values: a row made only of large entries (finfo.min
  over every key of a padded row) becomes zeros instead of a cancellation, in d scale's
  two terms, of values 1 / scale times its size.
  An infinite entry stays as it is (the score_mod's step passes an infinite score
  unscaled), so -inf still removes a position whatever c's sign; a finite entry whose
  quotient would overflow is clamped to +-finfo(float32).max / 2 (a masking value stays a
  finite masking value). d bias = d bias' / c everywhere; entries beyond `_FOLD_HUGE` give
  c no gradient (as in the step). One float32 array in the bias' shape (the kernels'
  operand, also what the derivative reads), no other copy (`_fold_div`).
  """
  shift = None
  if shift_rows:
    shift = jnp.max(jnp.where(jnp.isfinite(bias), bias, -jnp.inf), axis=-1,
                    keepdims=True).astype(jnp.float32)
    shift = lax.stop_gradient(jnp.where(jnp.isfinite(shift), shift, 0.0))
  return _fold_div(bias, jnp.zeros((), jnp.float32) if shift is None else shift, c), shift


def _fold_value(bias, shift, c):
  """where(finite, clip(bias - shift, +-lim) / c, bias) in float32, lim = max / 2 * |c|."""
  b = bias.astype(jnp.float32)
  lim = (_F32_MAX / 2) * jnp.abs(c)  # |b - shift| <= lim: the quotient is finite
  return jnp.where(jnp.isfinite(b), jnp.clip(b - shift, -lim, lim) / c, b)


_fold_div = jax.custom_jvp(_fold_value)


@_fold_div.defjvp
def _fold_div_jvp(primals, tangents):
  bias, shift, c = primals
  t_bias, _, t_c = tangents  # shift: a constant (stop_gradient)
  y = _fold_value(bias, shift, c)
  keep = jnp.abs(y) <= _FOLD_HUGE  # not inf, clamped or a masking value: d / dc = -y / c
  return y, t_bias.astype(jnp.float32) / c - jnp.where(keep, y, 0.0) * (t_c / c)


def _check_scale(scale, head_dim):
  """(static float scale, None) for a Python number; (1.0, scalar array) for an array.

  An array scale (a traced, learned temperature) is applied to the query before the
  kernels (`_run`), which then use scale 1.0, so autodiff gives its gradient.
  """
  if scale is None:
    return 1.0 / math.sqrt(head_dim), None
  if isinstance(scale, bool):
    raise TypeError(f"scale must be a float or a scalar float array, got {scale!r}")
  if isinstance(scale, numbers.Real):
    return float(scale), None
  if not _is_array(scale):
    raise TypeError(f"scale must be a float or a scalar float array, got {type(scale).__name__}")
  if jnp.ndim(scale) != 0 and jnp.size(scale) != 1:
    raise ValueError(f"scale must be a scalar, got an array of shape {jnp.shape(scale)}")
  if not jnp.issubdtype(jnp.result_type(scale), jnp.floating):
    raise TypeError(f"scale must be a float or a scalar float array, got dtype {jnp.result_type(scale)}")
  return 1.0, jnp.reshape(scale, ())


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("return_lse",))
def _run(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, scale_array,
         mod_consts=(), mod_classes=None, sinks=None, return_lse=True):
  """The attention body, jitted on the static config: compiled once per configuration.

  Outside jit, every call with the same shapes, dtypes and options reuses one
  executable (the score_mod in cfg compares by its traced computation); inside a
  user's jit it is an inlined nested call. Returns (out, lse), or (out, None) without
  return_lse: lse is then no output of the jit, so an empty row's -inf lse is never
  materialized (nor seen by jax.debug_infs, which checks a jit's outputs).

  A mask_mod's block classes are computed here once per call (both passes use them)
  unless a BlockMask brought them; sinks are applied to (out, lse) inside the op
  (`_vjp.apply_sinks`).
  """
  out, lse, row_max = attend(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts,
                             scale_array, mod_consts, mod_classes, sinks)
  # cfg.max_logits: per (batch, head), the max over the rows (over the shards when the
  # sequence is sharded: XLA's all-reduce of a max over a sharded axis)
  max_logits = None if row_max is None else jnp.max(row_max, axis=-1)
  return (out, lse if return_lse else None, max_logits)


def attend(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, scale_array,
           mod_consts=(), mod_classes=None, sinks=None):
  """(out, lse, row_max): `_run`'s body, unjitted (the ring calls it inside shard_map).
  row_max [B, H, Sq] (each row's max allowed logit, no gradient) with cfg.max_logits, else
  None.

  A ring call (cfg.ring) gets no mask_mod classes: each chunk pair masks elementwise
  and its static hint (`flashvjp.ring._schedule`) skips whole pairs.
  """
  shift = None  # cfg.fold_bias: the bias rows' shift (`_fold_bias`), added back to lse
  if scale_array is not None:
    # A traced scale: pre-scale the query in the accumulation dtype (rounded once to the
    # query's dtype, e.g. bfloat16), kernels run with scale 1.0; autodiff differentiates it.
    # With cfg.fold_bias the score_mod multiplies by the folded part (`_fold_scale`), the
    # bias is divided by it, and the query takes the rest (1, or the scale when tiny).
    acc = jnp.promote_types(q.dtype, jnp.float32)
    q_scale = scale_array
    if cfg.fold_bias:
      folded, q_scale = _fold_split(scale_array)
      if bias is not None:
        bias, shift = _fold_bias(bias, folded, cfg.fold_shift)
    q = (q.astype(acc) * q_scale.astype(acc)).astype(q.dtype)
  mod = None
  if cfg.mask_mod is not None:
    # naive: dense; ring: elementwise per pair; with more than one device the partitioning
    # rule classifies each device's own slice (flashvjp._partition)
    if mod_classes is None and cfg.implementation not in ("naive", "ring") and \
        not cfg.partition:
      B, H = q.shape[0], q.shape[1]
      assert cfg.mask_mod_blocks is not None  # set with mask_mod
      mod_classes = _mask_mod.classify(cfg.mask_mod, mod_consts, cfg.mask_mod_uses, B, H,
                                       cfg.seq_q, cfg.seq_kv, *cfg.mask_mod_blocks)
      mod_classes = _remat.name_mask_mod_blocks(mod_classes)  # a checkpoint policy saves them
    mod = _mask_mod.ModInputs(mod_classes, tuple(mod_consts))
  # sinks (`_vjp.apply_sinks`): per head, as [1, H, 1] row logits; in the shifted frame of a
  # folded bias (`_fold_bias`) less the shift. Inside the op for every implementation but
  # naive (there, after it)
  row_sinks = None
  if sinks is not None:
    row_sinks = sinks.astype(jnp.promote_types(q.dtype, jnp.float32))[None, :, None]
    if shift is not None:
      row_sinks = row_sinks - shift[..., 0]
  if cfg.implementation == "naive":
    res = reference.attention(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, mod)
    if row_sinks is not None:
      res = _vjp.apply_sinks(res[0], res[1], row_sinks) + tuple(res[2:])
  else:
    n = cfg.num_diff_consts
    res = _vjp.attention(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed,
                         tuple(consts[:n]), tuple(consts[n:]), mod, row_sinks)
  out, lse = res[:2]
  # the row maxima: logits only (sinks are no position), no gradient (QK-clip reads them)
  row_max = lax.stop_gradient(res[2]) if cfg.max_logits else None
  if shift is not None:  # the softmax of bias - shift: lse and the logits move by shift
    lse = lse + shift[..., 0].astype(lse.dtype)
    row_max = None if row_max is None else row_max + shift[..., 0].astype(row_max.dtype)
  out = out.astype(q.dtype)  # cfg.out_f32: the op's float32 out, rounded once here
  return out, lse, row_max


def flash_attention(
    query, key, value, *, bias=None, mask=None, causal: bool | str = False,
    window: tuple[int | None, int | None] | None = None, segment_ids=None,
    score_mod=None, scale: float | None = None, dropout_rate: float = 0.0,
    dropout_rng=None, deterministic: bool | None = None, return_lse: bool = False,
    implementation: str | None = None, block_q: int | None = None,
    block_kv: int | None = None, interpret: bool | None = None,
    dropout_broadcast: tuple[bool, bool] = (False, False), mask_mod=None, block_mask=None,
    sinks=None, context_parallel: str = "auto", return_max_logits: bool = False,
    ring_head_groups: int = 1, intra_node_axes=None):
  """Exact, memory-efficient, differentiable attention.

  Semantics, in order: ``s = scale * q @ k^T``; ``s += bias``;
  ``s = score_mod(s, b, h, q_idx, kv_idx)``; positions not allowed by mask, mask_mod,
  causal, window or segment_ids are removed; ``p = softmax(s)`` over kv (with `sinks`,
  the denominator also holds ``exp(sinks[h])``); dropout on ``p``; ``out = p @ v``. A
  query row with no allowed position gives 0 output, -inf lse (``sinks[h]`` with sinks)
  and zero gradients.

  Differentiable in reverse mode (``jax.grad``: the hand-written backward on the residuals
  q, k, v, out, lse) and in forward mode (``jax.jvp``, ``jax.linearize``, ``jax.jacfwd``:
  a fused O(seq)-memory tangent pass), and to second order by forward-over-reverse
  (Hessian-vector products: ``jax.jvp(jax.grad(f), (x,), (v,))``, ``jax.hessian``);
  reverse-over-reverse (``jax.grad`` of a function of ``jax.grad``) raises
  NotImplementedError naming forward-over-reverse. See docs/forward_mode.md and
  ``explain(...).forward_mode``.

  Args:
    query: [batch, num_heads, seq_q, head_dim].
    key: [batch, num_kv_heads, seq_kv, head_dim]; num_heads % num_kv_heads == 0 (GQA/MQA).
    value: [batch, num_kv_heads, seq_kv, head_dim_v].
    bias: float, broadcastable to [batch, num_heads, seq_q, seq_kv]; differentiable.
    mask: bool, broadcastable to [batch, num_heads, seq_q, seq_kv]; True = may attend.
    causal: False, True / "top_left" (kv_pos <= q_pos, as jax.nn), or "bottom_right"
      (kv_pos <= q_pos + seq_kv - seq_q: the last query sees the last key, as
      FlashAttention and PyTorch's causal_lower_right; for chunked prefill and decoding
      against a KV cache). The same when seq_q == seq_kv. With seq_q > seq_kv, bottom-right
      leaves the first seq_q - seq_kv rows nothing (out 0, lse -inf). The bound is the
      buffer's (the arrays' seq_q and seq_kv) also with `segment_ids` or a `mask`:
      segment ids may pack many sequences of any lengths, so they do not move the
      diagonal. To align it to each sequence's own lengths (a KV cache buffer partly
      filled), use `flashvjp.dot_product_attention(..., is_causal="bottom_right",
      key_value_seq_lengths=..., query_seq_lengths=...)` (docs/decoding.md), or a
      mask_mod ``kv_idx <= q_idx + off[b]`` with ``off = kv_len - q_len`` int32 [batch].
    window: (left, right): q_pos - left <= kv_pos <= q_pos + right; None side = unbounded.
    segment_ids: int [batch, seq] (seq_q == seq_kv) or (q_ids [batch, seq_q], kv_ids [batch, seq_kv]).
    score_mod: (scores, b, h, q_idx, kv_idx) -> scores, elementwise; arrays it closes over
      get gradients.
    mask_mod: (b, h, q_idx, kv_idx) -> bool, elementwise (True = may attend), ANDed with
      the other masks; arrays it closes over (prefix lengths, document ids) work. Its
      block classes (empty blocks skipped, full blocks unmasked) are computed once per
      call in O(seq) memory, or taken from `block_mask`. Built-ins: `flashvjp.prefix_lm`,
      `chunked`, `sliding_window_with_global`, `document_causal`.
    block_mask: `flashvjp.make_block_mask(mask_mod, B, H, seq_q, seq_kv)`, built once per
      batch and passed with the same mask_mod.
    sinks: float [num_heads], differentiable: a per-head logit in every row's softmax
      denominator that attends to no value (gpt-oss-style attention sinks).
    scale: default 1 / sqrt(head_dim). A Python float is compiled in. A scalar float
      array (for example a traced, learned temperature, as jax.nn accepts) is
      differentiable. For float32 inputs it multiplies the query in float32 before the
      kernels, the product rounded once to the query's dtype. For bfloat16 / float16
      inputs it multiplies the float32 scores inside the kernels (as the first step of
      the score_mod), with ``p @ v`` and out kept in float32 inside the op (out rounded
      after it: the residual out is float32), so that d scale, a sum over every score, is
      accumulated in float32 with an exact ``delta``: its error is that of float32, not
      8-18x naive 16-bit autodiff's. A bias, added after the scale, is then folded
      through it (``scale * q k^T + bias = scale * (q k^T + bias / scale)``): the kernels
      get ``(bias - shift) / scale`` in float32 (a float32 copy in the bias' own broadcast
      shape, and a float32 d bias' from the kernels; shift is each bias row's largest
      finite entry without a score_mod, else 0; -inf entries stay -inf) and d bias =
      d bias' / scale. Where abs(scale) < 2^-14 (0 included) the query is pre-scaled as for
      float32 instead.
    dropout_rate: dropout probability on p; active only when deterministic=False.
    dropout_rng: one JAX PRNG key (``jax.random.key(seed)``, shape (), or a legacy
      ``jax.random.PRNGKey(seed)``, uint32 [2]); required when dropout is active. An int,
      a float or a batch of keys (``jax.random.split(key, n)``) is rejected.
    dropout_broadcast: (batch, heads): share the dropout keep-mask across the batch
      and/or the heads (Flax's ``broadcast_dropout=True`` is (True, True));
      `flashvjp.dropout_mask(..., broadcast=...)` returns that mask.
    deterministic: True disables dropout, False applies it. Left unset (None) it is True
      (no dropout, the seed names' default), with a UserWarning when a dropout_rate > 0
      and a dropout_rng are given: that pair asks for dropout, the default turns it off.
    return_lse: also return lse float32 [batch, num_heads, seq_q] (differentiable).
    return_max_logits: also return max_logits float32 [batch, num_heads]: the maximum
      of the logits over allowed positions (after scale, bias and score_mod, before the
      softmax; sinks are no position), from the same forward pass, for QK-clip (MuonClip).
      -inf for a (batch, head) with no allowed position; with the sequence sharded, the
      max over the shards. No gradient flows through it (``stop_gradient``).
    implementation: None (choose), "pallas" (this platform's kernels), "pallas_triton",
      "pallas_tpu", "pallas_mosaic_gpu" (Hopper, and Blackwell with its sm_100a kernels, which
      take no per-entry feature, head dims above 128 or forward mode yet; chosen by None /
      "pallas" only where a GPU check recorded it valid and faster on Hopper,
      `_config.MOSAIC_GPU_EARNED`, never yet on Blackwell), "blockwise" or
      "naive". The platform is the program's target (the inputs' shardings, else the abstract mesh in
      context, else the host). See `explain`.
    block_q, block_kv: block sizes (None: tuned defaults); any positive size works.
    interpret: Pallas interpret mode; None means exactly when the platform is CPU.
    context_parallel: under ``jax.jit`` with query / key / value sharded along the
      sequence (a NamedSharding), the context-parallel strategy run inside the
      partition: "auto" (default: of the ring, Ulysses and usp, the one with the least
      time on the slowest link class, or the fewest bytes where the links are unknown;
      never a gather of the whole sequence), "ring" (K/V chunks passed around with
      ppermute), "ulysses" (all-to-all sequence <-> heads; num_heads and num_kv_heads
      divisible by the sequence shards), "usp" (the sequence over two or more mesh axes:
      Ulysses over the inner, minor ones, e.g. the GPUs of a node, the ring over the
      outer ones, e.g. the nodes; heads divisible by the inner devices) or "all_gather"
      (K/V gathered once, O(seq) memory for K/V). `explain` on sharded inputs says which
      runs, the split, the bytes per link class and why. Ignored when the sequence is
      not sharded.
    intra_node_axes: the mesh axes (a name or a tuple) whose devices share a node (NVLink,
      ICI); the sequence's other axes cross nodes (InfiniBand, DCN). For the cost model of
      ``context_parallel="auto"``; None (default): read from the devices' placement (a
      process, or a TPU slice, is a node; unknown with one device per process, where the
      choice weighs bytes only).
    ring_head_groups: with context_parallel "ring", "usp" or "all_gather", run the ring once per
      group of num_kv_heads / ring_head_groups kv heads (and their query heads), one
      group after the other: each device then holds the ring's state (the K/V chunk in
      flight, the float32 dQ sums, the dK/dV sums that travel) for one group only, for
      ring_head_groups times the steps, each with 1 / ring_head_groups of the work and
      of the bytes. Must divide num_heads and num_kv_heads on each device. Default 1.

  Returns:
    out [batch, num_heads, seq_q, head_dim_v] in query's dtype; (out, lse) with return_lse;
    (out, max_logits) with return_max_logits; (out, lse, max_logits) with both.
  """
  decision, cfg, arrays = _prepare(
      query, key, value, bias=bias, mask=mask, causal=causal, window=window,
      segment_ids=segment_ids, score_mod=score_mod, scale=scale, dropout_rate=dropout_rate,
      dropout_rng=dropout_rng, deterministic=deterministic, implementation=implementation,
      block_q=block_q, block_kv=block_kv, interpret=interpret,
      dropout_broadcast=dropout_broadcast, mask_mod=mask_mod, block_mask=block_mask,
      sinks=sinks, fold_scale=True, context_parallel=context_parallel,
      max_logits=_check_flag("return_max_logits", return_max_logits),
      ring_head_groups=ring_head_groups, intra_node_axes=intra_node_axes)
  _dispatch.log(decision)
  out, lse, max_logits = _run(cfg, *arrays, return_lse=bool(return_lse))
  extra = ((lse,) if return_lse else ()) + ((max_logits,) if return_max_logits else ())
  return (out, *extra) if extra else out


_DROP_IN_KEYWORDS = ("is_causal", "local_window_size", "query_seq_lengths",
                     "key_value_seq_lengths", "return_residual")


def _as_bhsd(x):
  """A ShapeDtypeStruct of a [B, S, H, D] input read as [B, H, S, D] (its NamedSharding's
  spec permuted alike): static, no array op."""
  shape = tuple(x.shape)
  shape = (shape[0], shape[2], shape[1]) + shape[3:]
  sharding = getattr(x, "sharding", None)
  spec = getattr(sharding, "spec", None)
  if isinstance(sharding, jax.sharding.NamedSharding) and spec is not None:
    sp = tuple(spec) + (None,) * (4 - len(spec))
    sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(
        sp[0], sp[2], sp[1], *sp[3:]))
    return jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding)
  return jax.ShapeDtypeStruct(shape, x.dtype)


def explain(query, key, value, *, layout: str | None = None, target=None,
            **kwargs) -> _dispatch.Decision:
  """Which implementation `flash_attention(query, key, value, **kwargs)` would run, and why.

  Takes the same arguments (arrays or jax.ShapeDtypeStruct for query/key/value are
  fine for shapes-only questions); runs no kernel. When `query` carries a NamedSharding
  that splits the sequence (a sharded array, or
  ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)``), the decision's
  `context_parallel` is the strategy `jax.jit` runs for it (`flashvjp._strategy`:
  which, why, the bytes each device moves, what it holds), as the partitioning rule
  computes it; otherwise None. Shardings applied inside `jax.jit` are decided when XLA
  partitions the program: `flashvjp.record_decisions()` records those decisions.

  Args:
    layout: "BHSD" (flash_attention's [batch, heads, seq, head_dim]) or "BSHD" (the jax.nn
      drop-in's [batch, seq, heads, head_dim]). None: "BSHD" when a drop-in keyword is
      given (is_causal, local_window_size, query_seq_lengths, key_value_seq_lengths,
      return_residual), else "BHSD". The decision says how the query was read.
    target: what to decide for instead of the program's own target: a name ("cpu",
      "h100", "h100x8", "h200", "b200", "v5e", "v6e", ... `flashvjp._target.NAMED`), for
      "what would run on an H100 / a TPU v5e" from a laptop (no compiler needed;
      `flashvjp.plan` compiles for the same names).
  """
  for k in ("return_lse", "return_max_logits"):
    kwargs.pop(k, None)
  drop_in = sorted(set(kwargs) & set(_DROP_IN_KEYWORDS))
  if layout is None:
    layout = "BSHD" if drop_in else "BHSD"
  if layout not in ("BHSD", "BSHD"):
    raise ValueError(f"layout must be 'BHSD' or 'BSHD', got {layout!r}")
  if drop_in and layout != "BSHD":
    raise TypeError(f"{drop_in} are dot_product_attention's keywords (layout 'BSHD'); with"
                    " layout='BHSD' use flash_attention's (causal, window, segment_ids)")
  if target is not None:
    target = _target.named(target)
  per_sequence = ""
  if layout == "BSHD":
    for name, x in (("query", query), ("key", key), ("value", value)):
      if not _is_array(x, True):
        raise TypeError(f"{name} must be a jax or numpy array, got {type(x).__name__}")
      if x.ndim != 4:
        raise ValueError(f"{name} must have rank 4 [batch, seq, heads, head_dim] (layout"
                         f" 'BSHD'), got shape {x.shape}")
    # the rest of `_check_qkv` once read as [batch, heads, seq, head_dim] (in `_prepare`):
    # read as BHSD here it would take seq_kv for num_kv_heads (decoding: T != S, GQA)
    if target is None:  # the inputs' target, read before they become shapes
      target = _target.of(query, key, value)
    query, key, value = (_as_bhsd(x) for x in (query, key, value))
    kwargs.pop("return_residual", None)
    if "is_causal" in kwargs:
      kwargs["causal"] = kwargs.pop("is_causal")
    lws = _local_window(kwargs.pop("local_window_size", None))
    if lws is not None:
      kwargs["window"] = lws
    ql, kvl = kwargs.pop("query_seq_lengths", None), kwargs.pop("key_value_seq_lengths", None)
    if ql is not None or kvl is not None:  # the drop-in's lengths become segment ids
      B, Sq, Skv = query.shape[0], query.shape[2], key.shape[2]
      kwargs["segment_ids"] = (np.zeros((B, Sq), np.int32), np.zeros((B, Skv), np.int32))
      if kwargs.get("causal") == "bottom_right":  # aligned to each sequence's lengths
        zeros = lambda x: None if x is None else np.zeros((B,), np.int32)
        kwargs["causal"], kwargs["mask_mod"] = _per_sequence_causal(
            zeros(ql), zeros(kvl), B, Sq, Skv, kwargs.get("mask_mod"))
        per_sequence = (
            "; is_causal='bottom_right' with sequence lengths: aligned to each sequence's"
            " lengths, kv_pos <= q_pos + kv_len[b] - q_len[b] (the offsets int32[batch]:"
            " mask_mod[0]; " + ("the static bound kv_pos <= q_pos + seq_kv - seq_q kept too)"
                                if ql is None else "no static bound: with query lengths an"
                                " offset may exceed seq_kv - seq_q)"))
  params = dict(bias=None, mask=None, causal=False, window=None, segment_ids=None,
                score_mod=None, scale=None, dropout_rate=0.0, dropout_rng=None,
                deterministic=True, implementation=None, block_q=None, block_kv=None,
                interpret=None, dropout_broadcast=(False, False), mask_mod=None,
                block_mask=None, sinks=None, context_parallel="auto", ring_head_groups=1,
                intra_node_axes=None)
  unknown = set(kwargs) - set(params)
  if unknown:
    raise TypeError(f"explain() got unexpected arguments {sorted(unknown)}")
  params.update(kwargs)
  decision, cfg, arrays = _prepare(query, key, value, **params, allow_shapes=True,
                                   program_target=target, fold_scale=True)
  B, H, Sq, D = query.shape
  operands = sum((_indexing.of_mod(fn, name) for fn, name in
                  ((cfg.score_mod, "score_mod"), (cfg.mask_mod, "mask_mod")) if fn is not None),
                 ())
  decision = dataclasses.replace(
      decision, reading=(f"query read as {layout}: batch {B}, heads {H}, seq {Sq}, head_dim"
                         f" {D}{per_sequence}"),
      operands=operands)
  sharding = getattr(query, "sharding", None)
  spec = getattr(sharding, "spec", None)
  if sharding is not None and spec is not None and cfg.implementation != "naive":
    bias, mask, q_seg = arrays[3], arrays[4], arrays[5]
    pairs = {n: (tuple(x.shape), x.dtype) for n, x in (("bias", bias), ("mask", mask))
             if x is not None}
    if cfg.fold_bias and bias is not None:  # the kernels get bias / scale in float32
      pairs["bias"] = (tuple(bias.shape), jnp.dtype(jnp.float32))
    strategy = _partition.strategy_for(
        cfg, sharding.mesh, spec, tuple(query.shape), tuple(key.shape), tuple(value.shape),
        jnp.dtype(query.dtype).itemsize, pairs, q_seg is not None)
    decision = dataclasses.replace(decision, context_parallel=strategy)
    if strategy is not None:  # arrays read at exactly one position: split, not copied
      split = _partition.split_arrays(cfg.implementation, cfg, query.dtype, Sq, key.shape[2],
                                      arrays[8], arrays[10])
      decision = dataclasses.replace(decision, operands=tuple(
          dataclasses.replace(o, split=split.get((o.mod, o.index), "")) for o in operands))
  return decision


def pallas_flash_attention(query, key, value, *, mask=None, score_mod=None, dropout_rng=None,
                           dropout_rate=0.0, deterministic=None, block_q=128, block_kv=128,
                           force_fallback=False):
  """Seed-compatible name: the Pallas kernels (blockwise with force_fallback=True).

  Layout [batch, heads, seq, head_dim], any seq lengths, differentiable.
  """
  return flash_attention(
      query, key, value, mask=mask, score_mod=score_mod, dropout_rng=dropout_rng,
      dropout_rate=dropout_rate, deterministic=deterministic, block_q=block_q,
      block_kv=block_kv, implementation="blockwise" if force_fallback else "pallas")


def memory_efficient_attention(query, key, value, *, mask=None, score_mod=None, dropout_rng=None,
                               dropout_rate=0.0, deterministic=None, block_size=256):
  """Seed-compatible name: the blockwise pure-JAX path with square blocks of `block_size`."""
  return flash_attention(
      query, key, value, mask=mask, score_mod=score_mod, dropout_rng=dropout_rng,
      dropout_rate=dropout_rate, deterministic=deterministic, block_q=block_size,
      block_kv=block_size, implementation="blockwise")
