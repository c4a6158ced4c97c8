"""Ring (context-parallel) attention: the sequence is sharded over a mesh axis.

Room: distributed / ring. Calls the backends' forward and hand-written backward
(flashvjp.blockwise, flashvjp.pallas) on (local queries, kv chunk in hand); never
autodiff through a forward. Reads the API's validation, the config and the
backend modules; the kernels know nothing about rings.

Each of the P devices on `axis_name` holds one sequence chunk of q, k, v. At step
s = 0 .. P-1 device i holds the kv chunk of device j = (i - s) mod P, sends it on to
device i + 1 (the send is issued before the compute so that XLA can overlap them),
and merges (out_c, lse_c) of its queries against that chunk into its running
(out, lse) through logsumexp. The backward rings again: dQ stays home, dK/dV
accumulators travel with their chunk and, after P hops, arrive at its owner. (The loop
body is uniform, so the last step's K/V send is unused: 1/P extra traffic, overlapped.)

Causal masking in global positions, per (query chunk, kv chunk) pair::

    contiguous (device i holds chunk i)       zigzag (device i holds chunks i, 2P-1-i)
      j == i: causal inside the pair            j == i: causal inside the local sequence
      j <  i: full (no mask)                    j <  i: all local q x first half of kv
      j >  i: skipped (all in the future)       j >  i: second half of q x all kv

Contiguous causal leaves device P-1 with P chunk pairs of work and device 0 with
one; zigzag gives every device the same work (one causal pair, then P-1 half pairs).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flashvjp import _api
from flashvjp._config import AttentionConfig
from flashvjp.distributed import _compat

LAYOUTS = ("contiguous", "zigzag")

# Per-step kinds of work (a lax.switch index is the position in _RingSpec.cases).
_SKIP, _FULL, _DIAG, _KV_FRONT, _Q_BACK = "skip", "full", "diag", "kv_front", "q_back"


@dataclasses.dataclass(frozen=True)
class _RingSpec:
  """Static description of one ring call (a custom_vjp nondiff argument)."""

  cfg: AttentionConfig  # the unmasked (local q) x (one kv chunk) configuration
  axis_name: Hashable
  axis_size: int
  causal: bool
  layout: str

  @property
  def cases(self):
    if not self.causal:
      return (_FULL,)
    if self.layout == "contiguous":
      return (_DIAG, _FULL, _SKIP)
    return (_DIAG, _KV_FRONT, _Q_BACK)

  def case_index(self, i, s):
    """Traced int32 index into `cases` for device i at ring step s."""
    if not self.causal:
      return jnp.int32(0)
    return jnp.where(s == 0, 0, jnp.where(i >= s, 1, 2)).astype(jnp.int32)

  def cfg_for(self, case):
    half = self.cfg.seq_q // 2
    if case == _DIAG:
      return dataclasses.replace(self.cfg, causal=True)
    if case == _KV_FRONT:
      return dataclasses.replace(self.cfg, seq_kv=half)
    if case == _Q_BACK:
      return dataclasses.replace(self.cfg, seq_q=half)
    return self.cfg


def _backend(name: str):
  """The backend module itself (per chunk, inside shard_map: no partitioning wrapper)."""
  if name == "blockwise":
    from flashvjp import blockwise
    return blockwise
  if name == "pallas_triton":
    from flashvjp.pallas import triton
    return triton
  if name == "pallas_tpu":
    from flashvjp.pallas import tpu
    return tpu
  raise ValueError(f"ring_attention has no backend named {name!r}")


def _shift(tree, spec: _RingSpec):
  """Send every leaf from device i to device i + 1 on the ring."""
  n = spec.axis_size
  perm = [(j, (j + 1) % n) for j in range(n)]
  return jax.tree_util.tree_map(lambda x: lax.ppermute(x, spec.axis_name, perm), tree)


def _halves(x, axis):
  h = x.shape[axis] // 2
  return lax.slice_in_dim(x, 0, h, axis=axis), lax.slice_in_dim(x, h, x.shape[axis], axis=axis)


def _seg_half(seg, front):
  if seg is None:
    return None
  a, b = _halves(seg, 1)
  return a if front else b


def _pad_front(x, axis, value):
  """Prepend a block of `value` as long as x along axis (a half back to full length)."""
  return jnp.concatenate([jnp.full_like(x, value), x], axis=axis)


def _pad_back(x, axis, value):
  return jnp.concatenate([x, jnp.full_like(x, value)], axis=axis)


# ---- one (local q) x (kv chunk) pair ------------------------------------------------

def _bias_half(bias, case):
  """The bias block of a half-chunk case (broadcast dims stay as they are)."""
  if bias is None:
    return None
  if case == _KV_FRONT and bias.shape[3] != 1:
    return _halves(bias, 3)[0]
  if case == _Q_BACK and bias.shape[2] != 1:
    return _halves(bias, 2)[1]
  return bias


def _chunk_forward(spec: _RingSpec, case, q, q_seg, chunk, bias):
  """(out [B, H, Sl, Dv] acc dtype, lse [B, H, Sl]) of local q against the kv chunk.

  bias: None or the rank-4 bias block of (local q, this chunk), dims 1 where broadcast.
  """
  k, v, kv_seg = chunk
  cfg = spec.cfg_for(case)
  acc = jnp.promote_types(q.dtype, jnp.float32)
  fwd = _backend(cfg.implementation).forward
  if case == _SKIP:
    B, H, Sl, _ = q.shape
    o = jnp.zeros((B, H, Sl, v.shape[3]), acc)
    return o, jnp.full((B, H, Sl), -jnp.inf, acc)
  bias = _bias_half(bias, case)
  if case in (_FULL, _DIAG):
    o, lse = fwd(cfg, q, k, v, bias, None, q_seg, kv_seg, None, ())
  elif case == _KV_FRONT:
    kf, vf = _halves(k, 2)[0], _halves(v, 2)[0]
    o, lse = fwd(cfg, q, kf, vf, bias, None, q_seg, _seg_half(kv_seg, True), None, ())
  else:  # _Q_BACK
    o, lse = fwd(cfg, _halves(q, 2)[1], k, v, bias, None, _seg_half(q_seg, False), kv_seg,
                 None, ())
    o, lse = _pad_front(o, 2, 0), _pad_front(lse, 2, -jnp.inf)
  return o.astype(acc), lse.astype(acc)


def _chunk_backward(spec: _RingSpec, case, q, q_seg, chunk, bias, out, lse, dout, dlse):
  """(dq [B, H, Sl, D], dk, dv [chunk shapes], dbias [bias block shape] or None), acc dtype."""
  k, v, kv_seg = chunk
  cfg = spec.cfg_for(case)
  acc = jnp.promote_types(q.dtype, jnp.float32)
  bwd = _backend(cfg.implementation).backward
  zeros = lambda x: None if x is None else jnp.zeros(x.shape, acc)
  if case == _SKIP:
    return zeros(q), zeros(k), zeros(v), zeros(bias)
  bias_c = _bias_half(bias, case)
  if case in (_FULL, _DIAG):
    dq, dk, dv, db, _ = bwd(cfg, q, k, v, bias_c, None, q_seg, kv_seg, None, (), out, lse, dout,
                            dlse)
  elif case == _KV_FRONT:
    kf, vf = _halves(k, 2)[0], _halves(v, 2)[0]
    dq, dk, dv, db, _ = bwd(cfg, q, kf, vf, bias_c, None, q_seg, _seg_half(kv_seg, True), None,
                            (), out, lse, dout, dlse)
    dk, dv = _pad_back(dk, 2, 0), _pad_back(dv, 2, 0)
    if db is not None and bias.shape[3] != 1:
      db = _pad_back(db, 3, 0)
  else:  # _Q_BACK
    back = lambda x: _halves(x, 2)[1]
    dq, dk, dv, db, _ = bwd(cfg, back(q), k, v, bias_c, None, _seg_half(q_seg, False), kv_seg,
                            None, (), back(out), back(lse), back(dout), back(dlse))
    dq = _pad_front(dq, 2, 0)
    if db is not None and bias.shape[2] != 1:
      db = _pad_front(db, 2, 0)
  db = None if db is None else db.astype(acc)
  return dq.astype(acc), dk.astype(acc), dv.astype(acc), db


def _bias_cols(bias, j, width):
  """Columns of kv chunk j (width `width`) of the local bias rows; broadcast kv dim as is."""
  if bias is None or bias.shape[3] == 1:
    return bias
  return lax.dynamic_slice_in_dim(bias, j * width, width, axis=3)


def _switch(spec: _RingSpec, i, s, branch_fn, ref, *operands):
  """Run branch_fn(case, *operands) for this step's case; outputs marked varying like ref."""
  def make(case):
    def branch(*ops):
      outs = branch_fn(case, *ops)
      return jax.tree_util.tree_map(lambda x: _compat.match_varying(x, ref), outs)
    return branch
  cases = spec.cases
  if len(cases) == 1:
    return make(cases[0])(*operands)
  return lax.switch(spec.case_index(i, s), [make(c) for c in cases], *operands)


def _merge(o, lse, o_c, lse_c):
  """Combine two partial softmax results over disjoint kv sets through their lse."""
  new = jnp.logaddexp(lse, lse_c)
  safe = jnp.where(new == -jnp.inf, 0.0, new)
  w, w_c = jnp.exp(lse - safe), jnp.exp(lse_c - safe)
  return o * w[..., None] + o_c * w_c[..., None], new


# ---- the ring, forward and backward ------------------------------------------------

def _ring_forward(spec: _RingSpec, q, k, v, bias, q_seg, kv_seg):
  acc = jnp.promote_types(q.dtype, jnp.float32)
  B, H, Sl, _ = q.shape
  n, Skv = spec.axis_size, k.shape[2]
  i = lax.axis_index(spec.axis_name)
  o0 = _compat.match_varying(jnp.zeros((B, H, Sl, v.shape[3]), acc), q)
  lse0 = _compat.match_varying(jnp.full((B, H, Sl), -jnp.inf, acc), q)

  def step(s, carry):
    chunk, o, lse = carry
    nxt = _shift(chunk, spec)  # issued first: the transfer overlaps this step's compute
    bias_c = _bias_cols(bias, (i - s) % n, Skv)
    o_c, lse_c = _switch(spec, i, s, functools.partial(_chunk_forward, spec), q, q, q_seg, chunk,
                         bias_c)
    o, lse = _merge(o, lse, o_c, lse_c)
    return nxt, o, lse

  _, o, lse = lax.fori_loop(0, n, step, ((k, v, kv_seg), o0, lse0))
  return o.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(spec: _RingSpec, q, k, v, bias, q_seg, kv_seg):
  return _ring_forward(spec, q, k, v, bias, q_seg, kv_seg)


def _ring_fwd(spec, q, k, v, bias, q_seg, kv_seg):
  out, lse = _ring_forward(spec, q, k, v, bias, q_seg, kv_seg)
  return (out, lse), (q, k, v, bias, q_seg, kv_seg, out, lse)


def _ring_bwd(spec, res, cts):
  q, k, v, bias, q_seg, kv_seg, out, lse = res
  dout, dlse = cts
  acc = jnp.promote_types(q.dtype, jnp.float32)
  dlse = jnp.zeros(lse.shape, acc) if dlse is None else dlse
  n, Skv = spec.axis_size, k.shape[2]
  i = lax.axis_index(spec.axis_name)
  zeros = lambda x: None if x is None else _compat.match_varying(jnp.zeros(x.shape, acc), q)

  def step(s, carry):
    chunk, dkv, dq, dbias = carry  # dkv: the dK/dV accumulators of the chunk in hand
    nxt = _shift(chunk, spec)
    j = (i - s) % n
    dq_c, dk_c, dv_c, db_c = _switch(
        spec, i, s,
        lambda case, *ops: _chunk_backward(spec, case, *ops),
        q, q, q_seg, chunk, _bias_cols(bias, j, Skv), out, lse, dout, dlse)
    dkv = _shift((dkv[0] + dk_c, dkv[1] + dv_c), spec)  # travels on with its chunk
    if dbias is not None:  # stays home: the bias rows are local, its columns follow chunk j
      if bias.shape[3] == 1:
        dbias = dbias + db_c
      else:
        cur = lax.dynamic_slice_in_dim(dbias, j * Skv, Skv, axis=3)
        dbias = lax.dynamic_update_slice_in_dim(dbias, cur + db_c, j * Skv, axis=3)
    return nxt, dkv, dq + dq_c, dbias

  init = ((k, v, kv_seg), (zeros(k), zeros(v)), zeros(q), zeros(bias))
  _, (dk, dv), dq, dbias = lax.fori_loop(0, n, step, init)
  # After P hops every accumulator is back on the device that owns its chunk.
  grads = (dq, dk, dv) + (() if bias is None else (dbias,))
  grads = tuple(_compat.sum_to_match(g.astype(x.dtype), x) for g, x in zip(grads, (q, k, v, bias)))
  dq, dk, dv = grads[:3]
  return (dq, dk, dv, grads[3] if bias is not None else None, None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)


# ---- public API ----------------------------------------------------------------------

def ring_attention(query, key, value, *, axis_name, causal: bool = False, segment_ids=None,
                   bias=None, scale: float | None = None, layout: str = "contiguous",
                   return_lse: bool = False, implementation: str | None = None,
                   block_q: int | None = None, block_kv: int | None = None,
                   interpret: bool | None = None):
  """Exact attention with the sequence sharded over a mesh axis; call inside shard_map.

  Same semantics as `flashvjp.flash_attention` on the global (unsharded) sequence,
  with the global arrays split into equal chunks along seq, chunk d on the d-th
  device of `axis_name` (``layout="contiguous"``), or permuted first with
  `to_zigzag` (``layout="zigzag"``, balanced causal work). Memory per device is
  O(local seq); the K/V chunks travel around the ring with `lax.ppermute`, never
  all-gathered. Differentiable: a custom_vjp whose backward rings again and calls
  the backend's hand-written backward per chunk.

  Args:
    query: local [batch, num_heads, seq_local, head_dim].
    key: local [batch, num_kv_heads, seq_local_kv, head_dim].
    value: local [batch, num_kv_heads, seq_local_kv, head_dim_v].
    axis_name: the shard_map mesh axis (or tuple of axes) the sequence is sharded over.
    causal: global top-left causal mask (needs seq_local == seq_local_kv).
    segment_ids: local int [batch, seq_local], or a pair (q_ids [batch, seq_local],
      kv_ids [batch, seq_local_kv]), laid out like the sequence (zigzag-permuted for
      ``layout="zigzag"``).
    bias: float, broadcastable to [batch, num_heads, seq_local, seq_kv_global]: the local
      query rows against every key (columns in the sequence's layout, so zigzag-permuted
      along both seq axes for ``layout="zigzag"``); differentiable. Stays on its device:
      each step reads the columns of the chunk in hand.
    scale: default 1 / sqrt(head_dim).
    layout: "contiguous" or "zigzag" (device d holds global chunks d and 2P-1-d of
      2P equal chunks; see `to_zigzag`). Only causal attention depends on it.
    return_lse: also return lse [batch, num_heads, seq_local] (float32, or wider), differentiable.
    implementation: None (choose), "blockwise" or "pallas"; "naive" is refused (it has
      no hand-written backward).
    block_q, block_kv: block sizes of the per-chunk kernels.
    interpret: Pallas interpret mode, as in `flash_attention`.

  Returns:
    local out [batch, num_heads, seq_local, head_dim_v] in query's dtype, or (out, lse).
  """
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  if not isinstance(causal, (bool, np.bool_)):
    raise TypeError(f"causal must be a bool, got {causal!r}")
  if implementation == "naive":
    raise ValueError("implementation='naive' cannot run in ring_attention: the ring calls a"
                     " hand-written per-chunk backward; use 'blockwise', 'pallas' or None")
  n = _compat.axis_size(axis_name)
  _, cfg, arrays = _api._prepare(
      query, key, value, bias=None, mask=None, causal=False, window=None,
      segment_ids=segment_ids, score_mod=None, scale=scale, dropout_rate=0.0, dropout_rng=None,
      deterministic=True, implementation=implementation, block_q=block_q, block_kv=block_kv,
      interpret=interpret)
  q, k, v, _, _, q_seg, kv_seg, _, _, scale_array = arrays[:10]
  if scale_array is not None:  # a traced scale: pre-scale the queries, as flash_attention does
    acc = jnp.promote_types(q.dtype, jnp.float32)
    q = (q.astype(acc) * scale_array.astype(acc)).astype(q.dtype)
  if bias is not None:
    target = (q.shape[0], q.shape[1], q.shape[2], n * k.shape[2])
    bias = _api._pair_rank4("bias", bias, target, want_bool=False)
  if causal and q.shape[2] != k.shape[2]:
    raise ValueError("causal ring_attention needs equal local seq lengths (the same global chunking"
                     f" of q and kv), got query seq {q.shape[2]} and key seq {k.shape[2]}")
  if layout == "zigzag" and causal and q.shape[2] % 2:
    raise ValueError("layout='zigzag' needs an even local seq length (two chunks per device),"
                     f" got {q.shape[2]}")
  spec = _RingSpec(cfg=cfg, axis_name=axis_name, axis_size=n, causal=bool(causal), layout=layout)
  out, lse = _ring(spec, q, k, v, bias, q_seg, kv_seg)
  return (out, lse) if return_lse else out


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
