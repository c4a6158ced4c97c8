"""Ring (context-parallel) attention: the sequence is sharded over a mesh axis.

Room: distributed / ring. The user-facing entry point: validates the arguments with the
API's own checks (`flashvjp._api._prepare`), then runs the one differentiable op
(`flashvjp._vjp.attention`) with the ring backend (`flashvjp.ring`), so a sharded call
is the one-device op: every argument of `flash_attention`, reverse and forward mode,
the same mask / score_mod / dropout model (the ring hands each chunk pair its global
offsets), sinks once after the merge.

Each of the P devices on `axis_name` holds one sequence chunk of q, k, v
(``layout="contiguous"``) or two half-chunks d and 2P-1-d (``layout="zigzag"``, balanced
causal work, see `to_zigzag`). The schedule is static (`flashvjp.ring._schedule`): a
step at which no device has an unmasked pair is not taken, so a window or a chunked
mask moves only the K/V chunks someone attends to.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax

from flashvjp import _api
from flashvjp import _dispatch
from flashvjp import ring as _ring_backend
from flashvjp.distributed import _compat

LAYOUTS = _ring_backend.LAYOUTS


def ring_attention(query, key, value, *, axis_name, layout: str = "contiguous",
                   bias=None, mask=None, causal: bool | str = False, window=None,
                   segment_ids=None,
                   score_mod=None, scale=None, dropout_rate: float = 0.0, dropout_rng=None,
                   deterministic: bool | None = None, return_lse: bool = False,
                   implementation: str | None = None, block_q: int | None = None,
                   block_kv: int | None = None, interpret: bool | None = None,
                   dropout_broadcast: tuple[bool, bool] = (False, False), mask_mod=None,
                   block_mask=None, sinks=None, batch_axis=None, head_axis=None,
                   return_max_logits: bool = False, ring_head_groups: int = 1,
                   ulysses_axis=None):
  """Exact attention with the sequence sharded over a mesh axis; call inside shard_map.

  Same semantics and arguments as `flashvjp.flash_attention` on the global (unsharded)
  sequence, with the global arrays split into equal chunks along seq, chunk d on the
  d-th device of `axis_name` (``layout="contiguous"``), or permuted first with
  `to_zigzag` (``layout="zigzag"``). Memory per device is O(local seq); K/V chunks
  travel with `lax.ppermute`, never all-gathered, and only to the devices whose queries
  may attend them (causal, window, a mask_mod's static hint). Differentiable in reverse
  mode (the backend's hand-written backward per chunk pair), forward mode (`jax.jvp`,
  `jax.linearize`: the fused tangent pass per pair) and forward-over-reverse.

  Positions are global: causal / window / score_mod / mask_mod / dropout see the
  (q, kv) positions of the unsharded sequence (dropout draws the one-device keep-mask).
  The arguments not listed below (causal, window, score_mod, scale, dropout_rate,
  dropout_rng, deterministic, return_lse, block_q, block_kv, interpret, dropout_broadcast,
  mask_mod, sinks) are `flash_attention`'s, on the global sequence: causal=True is
  top-left and needs equal local q / kv lengths, causal="bottom_right" aligns the global
  sequences' ends (any local lengths), window is in global positions, sinks are added
  once, after the merge.

  Args:
    query: local [batch, num_heads, seq_local, head_dim].
    key: local [batch, num_kv_heads, seq_local_kv, head_dim].
    value: local [batch, num_kv_heads, seq_local_kv, head_dim_v].
    axis_name: the shard_map mesh axis (or tuple of axes) the sequence is sharded over.
    layout: "contiguous" or "zigzag" (device d holds global chunks d and 2P-1-d of 2P
      equal chunks; the arrays, segment ids, bias and mask must be in that order).
    bias, mask: broadcastable to [batch, num_heads, seq_local, seq_kv_global]: the local
      query rows against every key (columns in the sequence's layout). They stay on
      their device: each step reads the columns of the chunk in hand. bias is
      differentiable.
    segment_ids: local int [batch, seq_local], or a pair (q_ids, kv_ids), in the layout.
    batch_axis, head_axis: the mesh axes batch / heads are sharded over inside the same
      shard_map, if any (so that dropout, score_mod and mask_mod see global b / h).
    block_mask: refused (its classes are for the whole sequence on one device).
    implementation: None (choose), "blockwise", "pallas", "pallas_triton" or "pallas_tpu"
      (the per-pair backend); "naive" is refused (it has no hand-written backward). Every
      per-pair backend takes every argument: each pair gets its chunks' global offsets,
      so score_mod, mask_mod and dropout see global positions with the Pallas families
      too (a mask_mod is then evaluated elementwise on every block the pair visits).

    return_max_logits: also return max_logits float32 [batch, num_heads], the max over
      the whole (global) sequence, the same on every device (`flash_attention`'s).
    ring_head_groups: run the ring once per group of num_kv_heads / ring_head_groups kv
      heads (and their query heads), one group after the other: the ring's per-device
      state is one group's (`flash_attention`'s). Must divide the local num_heads and
      num_kv_heads. Default 1.
    ulysses_axis: hierarchical context parallelism (`flash_attention`'s
      ``context_parallel="usp"``): the sequence is sharded over (axis_name, ulysses_axis),
      ulysses_axis minor (the global chunk of device (r, u) is r * U + u), e.g. the GPUs of
      a node under the nodes. An all-to-all over ulysses_axis (U devices, joined by fast
      links) trades the sequence for heads, the ring runs over axis_name on chunks of
      seq / axis_size for num_heads / U heads, and an all-to-all trades back. num_heads
      and num_kv_heads must divide by U; layout "contiguous" only. None (default): the
      ring alone.

  Returns:
    local out [batch, num_heads, seq_local, head_dim_v] in query's dtype; (out, lse),
    (out, max_logits) or (out, lse, max_logits) as `flash_attention`.
  """
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  if implementation == "naive":
    raise ValueError("implementation='naive' cannot run in ring_attention: the ring calls a"
                     " hand-written per-chunk backward; use 'blockwise', 'pallas' or None")
  if block_mask is not None:
    raise ValueError("block_mask cannot be used in ring_attention: its classes are for the"
                     " whole sequence on one device; pass mask_mod alone (each chunk pair"
                     " is masked elementwise and skipped by the mask_mod's static hint)")
  n = _compat.axis_size(axis_name)
  _api._check_qkv(query, key, value)
  B, H, Sl, _ = query.shape
  nu = 1
  if ulysses_axis is not None:
    nu = _compat.axis_size(ulysses_axis)
    if layout != "contiguous":
      raise ValueError("ulysses_axis needs layout='contiguous' (the all-to-all joins the inner"
                       f" devices' chunks into one), got layout={layout!r}")
    if H % nu or key.shape[1] % nu:
      raise ValueError(f"ulysses_axis: num_heads ({H}) and num_kv_heads ({key.shape[1]}) must"
                       f" be divisible by its {nu} devices")
  ring_head_groups = _ring_backend.check_head_groups(
      ring_head_groups, H // nu, key.shape[1] // nu,
      " after the all-to-all over ulysses_axis" if nu > 1 else "")
  Skv = key.shape[2]
  pair_target = (B, H, Sl, n * nu * Skv)
  bias = None if bias is None else _api._pair_rank4("bias", bias, pair_target, want_bool=False)
  mask = None if mask is None else _api._pair_rank4("mask", mask, pair_target, want_bool=True)
  decision, cfg, arrays = _api._prepare(
      query, key, value, bias=None, mask=None, causal=causal, window=window,
      segment_ids=segment_ids, score_mod=score_mod, scale=scale, dropout_rate=dropout_rate,
      dropout_rng=dropout_rng, deterministic=deterministic, implementation=implementation,
      block_q=block_q, block_kv=block_kv, interpret=interpret,
      dropout_broadcast=dropout_broadcast, mask_mod=mask_mod, sinks=sinks,
      fold_scale=True, outside_bias=bias is not None,
      causal_lengths=(n * nu * Sl, n * nu * Skv),
      max_logits=_api._check_flag("return_max_logits", return_max_logits))
  _dispatch.log(decision)  # the per-pair backend (flashvjp.record_decisions sees it)
  q, k, v, _, _, q_seg, kv_seg, seed, consts, scale_array, mm_consts, _, sinks = arrays
  if cfg.causal and Sl != Skv:
    raise ValueError("causal ring_attention needs equal local seq lengths (the same global chunking"
                     f" of q and kv), got query seq {Sl} and key seq {Skv}")
  if layout == "zigzag" and (Sl % 2 or Skv % 2):
    raise ValueError("layout='zigzag' needs even local seq lengths (two half-chunks per"
                     f" device), got query seq {Sl} and key seq {Skv}")
  inner = cfg.implementation
  hint = getattr(mask_mod, "kv_intervals", None) if mask_mod is not None else None
  spec = _ring_backend.RingSpec(axis_name=axis_name, axis_size=n, layout=layout, inner=inner,
                                batch_axis=batch_axis, head_axis=head_axis,
                                mask_mod_hint=hint, head_groups=ring_head_groups,
                                ulysses_axis=ulysses_axis, ulysses_size=nu)
  ring_cfg = dataclasses.replace(cfg, implementation="ring", ring=spec)
  out, lse, row_max = _api.attend(ring_cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts,
                                  scale_array, mm_consts, None, sinks)
  extra = (lse,) if return_lse else ()
  if return_max_logits:  # [batch, num_heads], the max over every shard's rows
    over = axis_name if ulysses_axis is None else (
        tuple(_axes(axis_name)) + tuple(_axes(ulysses_axis)))
    extra += (lax.pmax(jnp.max(row_max, axis=-1), over),)
  return (out, *extra) if extra else out


def _axes(a) -> tuple:
  return tuple(a) if isinstance(a, (tuple, list)) else (a,)


def ring_schedule(num_devices: int, seq_local: int, *, layout: str = "contiguous",
                  causal: bool = False, window=None, mask_mod=None):
  """The static ring schedule (no jax op): which steps run and which pairs each device meets.

  Returns a list of dicts, one per step taken: {"shift": s (device i holds the K/V of
  device i - s), "pairs": [{"q_piece", "kv_piece", "masks": [per device: "skip", "full"
  or (left, right), the pair's window in its own positions]}]}. Steps left out move no
  data. For benchmarks and `explain`-style questions.
  """
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  window = _api._check_window(window)
  hint = getattr(mask_mod, "kv_intervals", None) if mask_mod is not None else None
  spec = _ring_backend.RingSpec(axis_name="_", axis_size=int(num_devices), layout=layout,
                                inner="blockwise", mask_mod_hint=hint)
  out = []
  for st in spec.steps(bool(causal), window, int(seq_local), int(seq_local)):
    pairs = []
    for a, b, branches, index in st.pairs:
      masks = [branches[ix] for ix in index]
      pairs.append({"q_piece": a, "kv_piece": b,
                    "masks": [m[0] if m[0] != "window" else m[1] for m in masks]})
    out.append({"shift": st.shift, "pairs": pairs})
  return out


def _zigzag_order(num_devices: int):
  order = []
  for d in range(num_devices):
    order += [d, 2 * num_devices - 1 - d]
  return np.asarray(order)


def _check_zigzag(x, num_devices, axis):
  if isinstance(num_devices, bool) or not isinstance(num_devices, (int, np.integer)) or num_devices <= 0:
    raise ValueError(f"num_devices must be a positive int, got {num_devices!r}")
  if not -x.ndim <= axis < x.ndim:
    raise ValueError(f"axis must index one of the {x.ndim} dims of x, got {axis}")
  axis = axis % x.ndim
  if x.shape[axis] % (2 * num_devices):
    raise ValueError(f"x.shape[{axis}] = {x.shape[axis]} must be divisible by 2 * num_devices"
                     f" = {2 * num_devices}")
  return axis


def to_zigzag(x, num_devices: int, axis: int = 2):
  """Permute a global sequence into the zigzag layout of `ring_attention`.

  The sequence (length S, divisible by 2 * num_devices) is cut into 2P chunks
  c_0 .. c_{2P-1}; the result is [c_0, c_{2P-1}, c_1, c_{2P-2}, ...], so that
  sharding it into P equal parts gives device d the chunks d and 2P-1-d.

  Args:
    x: any array; e.g. q/k/v [batch, heads, seq, dim] (axis=2) or segment ids
      [batch, seq] (axis=1).
    num_devices: P, the size of the ring axis.
    axis: the sequence axis.
  """
  axis = _check_zigzag(x, num_devices, axis)
  n = 2 * num_devices
  c = x.shape[axis] // n
  xs = x.reshape(x.shape[:axis] + (n, c) + x.shape[axis + 1:])
  xs = jnp.take(xs, jnp.asarray(_zigzag_order(num_devices)), axis=axis)
  return xs.reshape(x.shape)


def from_zigzag(x, num_devices: int, axis: int = 2):
  """Inverse of `to_zigzag`: back to the natural sequence order."""
  axis = _check_zigzag(x, num_devices, axis)
  n = 2 * num_devices
  c = x.shape[axis] // n
  xs = x.reshape(x.shape[:axis] + (n, c) + x.shape[axis + 1:])
  xs = jnp.take(xs, jnp.asarray(np.argsort(_zigzag_order(num_devices))), axis=axis)
  return xs.reshape(x.shape)
