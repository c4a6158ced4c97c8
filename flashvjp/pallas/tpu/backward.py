"""Mosaic-TPU backward (FlashAttention-2): dK/dV kernel, dQ kernel, dbias kernel.

Room: Pallas-TPU kernels (backward). Probabilities are recomputed from the saved
logsumexp; nothing O(seq_q * seq_kv) is kept or written.

* preprocess (XLA, O(seq)): delta = rowsum(dO * O) - dlse; empty and padded rows get
  lse = the largest finite number so that exp(s - lse) = 0 there (zero, finite grads;
  masked entries get p = 0 by a select: no inf inside the kernels for finite inputs).
  Both travel lane-major [B, H, 1, Sq] when block_q is a multiple of 128, else
  lane-broadcast [B, H, Sq, 128] (`add_rows`).
* dK/dV: grid (batch, kv head, kv block, step); the step axis ("arbitrary") walks the
  G query heads of the group and, for each, this kv block's compacted list of
  non-empty q blocks (`_mask.block_lists(by="kv")`), so GQA gradients are summed in
  VMEM scratch without repeating K/V, and an empty block is never copied.
* dQ: grid (batch, head, q block, step) over the same lists as the forward; with
  differentiable score_mod arrays it also writes one partial d(residual) per program,
  summed outside (deterministic, no atomics).
* dbias: grid over the bias' own blocks plus one "arbitrary" axis over every (b, h,
  q block, kv block) the bias is broadcast along; a separate pallas_call, so XLA drops
  it when the bias gradient is unused. Empty tiles (block classes, scalar-prefetched)
  skip the matmuls.

A mask_mod works as in the forward in every kernel: its block classes (resampled to the
kernel's blocks) join the lists / the dbias class table, its tile part masks PARTIAL
blocks only.

Every output block is written by exactly one program after a sequential reduction:
bitwise deterministic.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from flashvjp import _delta
from flashvjp._config import AttentionConfig
from flashvjp.pallas import _common as C
from flashvjp.pallas import _compat
from flashvjp.pallas.tpu import _layout as Lo
from flashvjp.pallas.tpu import forward as F

_bs = F._bs
PARALLEL, ARBITRARY = F.PARALLEL, F.ARBITRARY


def tile_grads(cfg, g, q, k, v, do, lse, delta, t, consts, seed_ref, acc, masked, n_diff,
               diff_pos=()):
  """(pd, ds, dconsts) of one [bq, bk] tile (as the Triton family's `_tile_grads`).

  pd: dropped-out probabilities (for dV); ds: dL/d(pre-mod score incl. bias), not yet
  multiplied by scale; dconsts: grads of the first `n_diff` residuals from this tile.
  lse / delta: [bq, 1].
  """
  diff = None
  if cfg.score_mod is not None:
    diff = tuple(consts[:n_diff])
    consts = tuple(consts[n_diff:])
  s, ok, sm_vjp = Lo.scores(cfg, g, q, k, t, consts, acc, masked, diff_consts=diff,
                            diff_pos=diff_pos)
  d = s - lse
  if ok is not None:  # p = exp(mask_value) = 0 on masked entries, whatever the row's lse
    d = jnp.where(ok, d, C.mask_value(acc))
  p = jnp.exp(d)
  dp = Lo.dot_nt(do, v, acc, cfg)
  pd = p
  if cfg.dropout_active:
    keep = Lo.dropout_scale(cfg, g, seed_ref, t, acc)
    pd, dp = p * keep, dp * keep
  ds = p * (dp - delta)
  if ok is not None:
    # A masked entry contributes exactly nothing: select, not p * (...) = 0 * (dp - delta),
    # which is NaN where a masked V row overflows dp (finfo.max padding; `C.select_masked`).
    ds = C.select_masked(ok, ds)
  dconsts = ()
  if sm_vjp is not None:
    ds, dconsts = sm_vjp(ds)  # at finite masked scores (`C.masked_scores_for_mod`)
  return pd, ds, tuple(dconsts)


def preprocess(out, lse, dout, dlse, Sqp, acc):
  """(delta, lse_b) [B, H, Sqp]: lse = the largest finite number on empty / padded rows
  (`_common.lse_pad_value`: p = 0 there, no inf), delta 0 on padded rows."""
  delta = _delta.delta(out, dout, dlse, acc)
  big = C.lse_pad_value(acc)
  lse_b = jnp.where(jnp.isfinite(lse), lse.astype(acc), big)  # no -inf operand (debug_infs)
  lse_b = jnp.pad(lse_b, ((0, 0), (0, 0), (0, Sqp - lse.shape[2])), constant_values=big)
  return C.pad_to(delta, 2, Sqp), lse_b


def add_rows(ins, g: C.Geometry, delta, lse, index):
  """lse / delta for the kernel; `index(*grid, *prefetch) -> (b, h, q block)`.

  Lane-major [B, H, 1, Sqp] (block (1, bq), read as a [bq, 1] column, as splash's dQ
  kernel does) when bq is a multiple of 128 or the whole padded sequence; else
  lane-broadcast [B, H, Sqp, 128] (block (bq, 128), 128x the memory).
  """
  lanes = Lo.rows_lane_major(g)
  for name, x in (("lse", lse), ("delta", delta)):
    if lanes:
      ins.add(name, x[:, :, None, :], _bs(
          (None, None, 1, g.bq), lambda *a: (index(*a)[0], index(*a)[1], 0, index(*a)[2])))
    else:
      ins.add(name, Lo.lane_rows(x, g.Sqp), _bs(
          (None, None, g.bq, Lo.LANES), lambda *a: (index(*a)[0], index(*a)[1], index(*a)[2], 0)))


read_rows = Lo.read_column  # [bq, 1] column of a lse / delta block in either layout


# ---- dK / dV ------------------------------------------------------------------------

def _dkdv_kernel(cnt_ref, ent_ref, *refs, cfg, g: C.Geometry, lists: Lo.Lists, names, meta,
                 may_mask, mod_meta=None, n_q_pos=0, n_kv_diff=0):
  dpk = [f"dposkv{n}" for n in range(n_kv_diff)]
  r = dict(zip(names + ["dk", "dv"] + dpk + ["dk_s", "dv_s"]
               + [f"dpk_s{n}" for n in range(n_kv_diff)], refs))
  diff_pos = tuple(range(n_q_pos, n_q_pos + n_kv_diff))  # the float kv residuals in t.pos
  acc = r["dk_s"].dtype
  b, hk, j, t_ = (_compat.program_id(a) for a in range(4))
  gi, s = Lo.div(t_, lists.W), Lo.rem(t_, lists.W)
  h = hk * g.G + gi
  active, i, partial = F.step_info(lists, cnt_ref, ent_ref, b, h, j, s)

  @pl.when(t_ == 0)
  def _init():
    r["dk_s"][...] = jnp.zeros(r["dk_s"].shape, acc)
    r["dv_s"][...] = jnp.zeros(r["dv_s"].shape, acc)

  if n_kv_diff:
    @pl.when(s == 0)
    def _init_head():  # d(kv residual) per query head: its own [8, bk] accumulator
      for n in range(n_kv_diff):
        r[f"dpk_s{n}"][...] = jnp.zeros(r[f"dpk_s{n}"].shape, acc)

  def compute(masked):
    consts = Lo.load_consts([r[f"const{n}"] for n in range(len(meta.scalar))], meta, b, h)
    t = Lo.load_tile(r, b, h, i, j, F.load_mod_consts(r, mod_meta, b, h), g)
    q, do = r["q"][...], r["do"][...]
    pd, ds, dc = tile_grads(cfg, g, q, r["k"][...], r["v"][...], do, read_rows(r["lse"]),
                            read_rows(r["delta"]), t, consts, r.get("seed"), acc, masked, 0,
                            diff_pos)
    for n, d in enumerate(dc):  # [1, bk] rows, sublane-broadcast
      ref = r[f"dpk_s{n}"]
      ref[...] += jnp.broadcast_to(d.astype(acc), ref.shape)
    r["dv_s"][...] += Lo.dot_tn(pd.astype(do.dtype), do, acc, cfg)
    ds = ds * jnp.asarray(cfg.scale, acc)
    r["dk_s"][...] += Lo.dot_tn(ds.astype(q.dtype), q, acc, cfg)

  F.when_active(active, partial, may_mask, compute)

  if n_kv_diff:
    @pl.when(s == lists.W - 1)
    def _finish_head():
      for n in range(n_kv_diff):
        r[f"dposkv{n}"][...] = r[f"dpk_s{n}"][0:1, :]

  @pl.when(t_ == g.G * lists.W - 1)
  def _finish():
    r["dk"][...] = r["dk_s"][...].astype(r["dk"].dtype)
    r["dv"][...] = r["dv_s"][...].astype(r["dv"].dtype)


def _dkdv(cfg, g, q, k, v, dout, lse_l, delta_l, bias, mask, q_seg, kv_seg, seed, carrays, meta,
          acc, mod=None, marrays=(), mmeta=None, offsets=None, pos=None, mpos=None):
  (q_l, k_l), lists, counts, entries = F.prepare(cfg, g, q_seg, kv_seg, mask, "kv", mod)
  G, W = g.G, lists.W

  def index(b, hk, j, t, cnt, ent, *_):
    h = hk * G + Lo.div(t, W)
    return b, h, lists.block(ent, b, h, j, Lo.rem(t, W))

  def q_map(*a):
    b, h, i = index(*a)
    return (b, h, i, 0)

  def tile_index(*a):
    b, h, i = index(*a)
    return b, h, i, a[2]

  kv_map = lambda b, hk, j, t, *_: (b, hk, j, 0)
  ins = C.KernelInputs()
  ins.add("q", C.pad_seq_head(q, g.Sqp, g.Dp), _bs((None, None, g.bq, g.Dp), q_map))
  ins.add("do", C.pad_seq_head(dout, g.Sqp, g.Dvp), _bs((None, None, g.bq, g.Dvp), q_map))
  add_rows(ins, g, delta_l, lse_l, index)
  ins.add("k", C.pad_seq_head(k, g.Skvp, g.Dp), _bs((None, None, g.bk, g.Dp), kv_map))
  ins.add("v", C.pad_seq_head(v, g.Skvp, g.Dvp), _bs((None, None, g.bk, g.Dvp), kv_map))
  F.add_common(ins, cfg, g, tile_index, bias_p=C.pad_pair(bias, g),
               mask_p=None if mask is None else C.pad_pair(mask, g).astype(jnp.int8),
               seg_l=(q_l, k_l), seed=seed, const_arrays=carrays, meta=meta,
               mod_arrays=marrays, mod_meta=mmeta, offsets=offsets,
               pos=Lo.position_layouts(pos, g), mpos=Lo.position_layouts(mpos, g))
  may_mask = Lo.maybe_partial(cfg, g, q_seg is not None, mask is not None)
  n_kv_diff = 0 if pos is None else pos.n_kv_diff
  kernel = functools.partial(_dkdv_kernel, cfg=cfg, g=g, lists=lists, names=ins.names,
                             meta=meta, may_mask=may_mask, mod_meta=mmeta,
                             n_q_pos=0 if pos is None else len(pos.q), n_kv_diff=n_kv_diff)
  dpk_map = lambda b, hk, j, t, *_: (b, hk * G + Lo.div(t, W), 0, j)
  tiles = g.B * g.H * Lo.static_tiles(cfg, g, "kv")
  isz = jnp.dtype(q.dtype).itemsize
  cost = _compat.cost_estimate(
      4 * tiles * g.bq * g.bk * (g.Dp + g.Dvp), tiles * g.bq * g.bk,
      tiles * g.bq * (g.Dp + g.Dvp) * isz + 2 * g.B * g.Hkv * g.Skvp * (g.Dp + g.Dvp) * isz)
  dk, dv, *dposkv = _compat.tpu_pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((g.B, g.Hkv, g.Skvp, g.Dp), k.dtype),
                 jax.ShapeDtypeStruct((g.B, g.Hkv, g.Skvp, g.Dvp), v.dtype),
                 *(jax.ShapeDtypeStruct((g.B, g.H, 1, g.Skvp), acc),) * n_kv_diff),
      grid=(g.B, g.Hkv, g.nk, G * W),
      in_specs=ins.specs,
      out_specs=(_bs((None, None, g.bk, g.Dp), kv_map), _bs((None, None, g.bk, g.Dvp), kv_map),
                 *(_bs((None, None, 1, g.bk), dpk_map),) * n_kv_diff),
      scratch_shapes=[_compat.tpu_vmem((g.bk, g.Dp), acc), _compat.tpu_vmem((g.bk, g.Dvp), acc),
                      *(_compat.tpu_vmem((Lo.SUBLANES, g.bk), acc),) * n_kv_diff],
      num_scalar_prefetch=2,
      dimension_semantics=(PARALLEL, PARALLEL, PARALLEL, ARBITRARY),
      interpret=F.interpret_arg(cfg), name="flashvjp_tpu_bwd_dkdv", cost=cost,
  )(counts, entries, *ins.arrays)
  return dk, dv, tuple(d[:, :, 0, :] for d in dposkv)


# ---- dQ (+ score_mod residual grads) ----------------------------------------------------

def _dq_kernel(cnt_ref, ent_ref, *refs, cfg, g: C.Geometry, lists: Lo.Lists, names, meta,
               may_mask, n_diff, dc_sizes, mod_meta=None, n_q_diff=0):
  outs = (["dq"] + [f"dconst{n}" for n in range(n_diff)]
          + [f"dposq{n}" for n in range(n_q_diff)])
  scratch = (["dq_s"] + [f"dc_s{n}" for n in range(n_diff)]
             + [f"dpq_s{n}" for n in range(n_q_diff)])
  diff_pos = tuple(range(n_q_diff))  # the float q residuals lead t.pos
  r = dict(zip(names + outs + scratch, refs))
  acc = r["dq_s"].dtype
  b, h, i, s = (_compat.program_id(a) for a in range(4))
  active, j, partial = F.step_info(lists, cnt_ref, ent_ref, b, h, i, s)

  @pl.when(s == 0)
  def _init():
    for name in scratch:
      r[name][...] = jnp.zeros(r[name].shape, r[name].dtype)

  def compute(masked):
    consts = Lo.load_consts([r[f"const{n}"] for n in range(len(meta.scalar))], meta, b, h)
    t = Lo.load_tile(r, b, h, i, j, F.load_mod_consts(r, mod_meta, b, h), g)
    k = r["k"][...]
    _, ds, dc = tile_grads(cfg, g, r["q"][...], k, r["v"][...], r["do"][...], read_rows(r["lse"]),
                           read_rows(r["delta"]), t, consts, r.get("seed"), acc, masked, n_diff,
                           diff_pos)
    ds = ds * jnp.asarray(cfg.scale, acc)
    r["dq_s"][...] += Lo.dot_nn(ds.astype(k.dtype), k, acc, cfg)
    for n, d in enumerate(dc[n_diff:]):  # [bq, 1] columns, lane-broadcast
      ref = r[f"dpq_s{n}"]
      ref[...] += jnp.broadcast_to(d.astype(acc), ref.shape)
    for n, (d, size) in enumerate(zip(dc[:n_diff], dc_sizes)):
      ref = r[f"dc_s{n}"]
      row = jnp.reshape(d.astype(ref.dtype), (1, size))
      if size != ref.shape[1]:
        row = jnp.pad(row, ((0, 0), (0, ref.shape[1] - size)))
      ref[...] += jnp.broadcast_to(row, ref.shape)

  F.when_active(active, partial, may_mask, compute)

  @pl.when(s == lists.W - 1)
  def _finish():
    r["dq"][...] = r["dq_s"][...].astype(r["dq"].dtype)
    for n in range(n_diff):
      r[f"dconst{n}"][...] = r[f"dc_s{n}"][...]
    for n in range(n_q_diff):
      Lo.write_column(r[f"dposq{n}"], r[f"dpq_s{n}"][:, 0:1])


def _dq(cfg, g, q, k, v, dout, lse_l, delta_l, bias, mask, q_seg, kv_seg, seed, carrays, meta,
        acc, n_diff, diff_shapes, mod=None, marrays=(), mmeta=None, offsets=None, pos=None,
        mpos=None):
  seg_l, lists, counts, entries = F.prepare(cfg, g, q_seg, kv_seg, mask, "q", mod)
  q_seg_l, kv_seg_l = seg_l
  ins = F.row_inputs(cfg, g, lists, q, k, v, bias, mask, q_seg_l, kv_seg_l, seed, carrays, meta,
                     marrays, mmeta, offsets, Lo.position_layouts(pos, g),
                     Lo.position_layouts(mpos, g))
  row_map = lambda b, h, i, s, *_: (b, h, i, 0)
  ins.add("do", C.pad_seq_head(dout, g.Sqp, g.Dvp), _bs((None, None, g.bq, g.Dvp), row_map))
  add_rows(ins, g, delta_l, lse_l, lambda b, h, i, s, *_: (b, h, i))
  out_shape = [jax.ShapeDtypeStruct((g.B, g.H, g.Sqp, g.Dp), q.dtype)]
  out_specs = [_bs((None, None, g.bq, g.Dp), row_map)]
  scratch = [_compat.tpu_vmem((g.bq, g.Dp), acc)]
  sizes = []
  for shape in diff_shapes:  # one partial per program: [B, H, nq, 8, L] (a lane-dense row)
    size = math.prod(shape)
    L = Lo.round_up(size, Lo.LANES)
    sizes.append(size)
    out_shape.append(jax.ShapeDtypeStruct((g.B, g.H, g.nq, Lo.SUBLANES, L), acc))
    out_specs.append(_bs((None, None, None, Lo.SUBLANES, L), lambda b, h, i, s, *_: (b, h, i, 0, 0)))
    scratch.append(_compat.tpu_vmem((Lo.SUBLANES, L), acc))
  n_q_diff = 0 if pos is None else pos.n_q_diff
  lanes = Lo.rows_lane_major(g)
  for _ in range(n_q_diff):  # d(q residual), laid out as the residual (`Lo.position_layouts`)
    if lanes:
      out_shape.append(jax.ShapeDtypeStruct((g.B, g.H, 1, g.Sqp), acc))
      out_specs.append(_bs((None, None, 1, g.bq), lambda b, h, i, s, *_: (b, h, 0, i)))
    else:
      out_shape.append(jax.ShapeDtypeStruct((g.B, g.H, g.Sqp, Lo.LANES), acc))
      out_specs.append(_bs((None, None, g.bq, Lo.LANES), row_map))
    scratch.append(_compat.tpu_vmem((g.bq, Lo.LANES), acc))
  may_mask = Lo.maybe_partial(cfg, g, q_seg is not None, mask is not None)
  kernel = functools.partial(_dq_kernel, cfg=cfg, g=g, lists=lists, names=ins.names, meta=meta,
                             may_mask=may_mask, n_diff=n_diff, dc_sizes=tuple(sizes),
                             mod_meta=mmeta, n_q_diff=n_q_diff)
  tiles = g.B * g.H * Lo.static_tiles(cfg, g, "q")
  isz = jnp.dtype(q.dtype).itemsize
  cost = _compat.cost_estimate(
      2 * tiles * g.bq * g.bk * (2 * g.Dp + g.Dvp), tiles * g.bq * g.bk,
      tiles * g.bk * (g.Dp + g.Dvp) * isz + 2 * g.B * g.H * g.Sqp * (g.Dp + g.Dvp) * isz)
  outs = _compat.tpu_pallas_call(
      kernel, out_shape=tuple(out_shape), grid=(g.B, g.H, g.nq, lists.W), in_specs=ins.specs,
      out_specs=tuple(out_specs), scratch_shapes=scratch, num_scalar_prefetch=2,
      dimension_semantics=(PARALLEL, PARALLEL, PARALLEL, ARBITRARY),
      interpret=F.interpret_arg(cfg), name="flashvjp_tpu_bwd_dq", cost=cost,
  )(counts, entries, *ins.arrays)
  dq, partials, dposq = outs[0], outs[1:1 + n_diff], outs[1 + n_diff:]
  dres = tuple(p_[:, :, :, 0, :size].sum(axis=2).reshape((g.B, g.H) + tuple(shape))
               for p_, size, shape in zip(partials, sizes, diff_shapes))
  return dq, dres, tuple(d[:, :, 0, :] if lanes else d[..., 0] for d in dposq)


# ---- dbias ----------------------------------------------------------------------------

def _dbias_kernel(cls_ref, *refs, cfg, g: C.Geometry, names, meta, may_mask, bias_shape, red,
                  Bl, Hl, mod_meta=None):
  r = dict(zip(names + ["dbias", "acc_s"], refs))
  acc = r["acc_s"].dtype
  pids = tuple(_compat.program_id(a) for a in range(5))
  b, h, i, j = _decode(pids, bias_shape, red)
  rr = pids[4]
  c = cls_ref[(((b if Bl != 1 else 0) * Hl + (h if Hl != 1 else 0)) * g.nq + i) * g.nk + j]
  c = c.astype(jnp.int32)

  @pl.when(rr == 0)
  def _init():
    r["acc_s"][...] = jnp.zeros(r["acc_s"].shape, acc)

  def compute(masked):
    consts = Lo.load_consts([r[f"const{n}"] for n in range(len(meta.scalar))], meta, b, h)
    t = Lo.load_tile(r, b, h, i, j, F.load_mod_consts(r, mod_meta, b, h), g)
    _, ds, _ = tile_grads(cfg, g, r["q"][...], r["k"][...], r["v"][...], r["do"][...],
                          read_rows(r["lse"]), read_rows(r["delta"]), t, consts, r.get("seed"), acc,
                          masked, 0)
    if bias_shape[2] == 1:
      ds = ds.sum(axis=0, keepdims=True)
    if bias_shape[3] == 1:
      ds = ds.sum(axis=1, keepdims=True)
    r["acc_s"][...] += ds

  F.when_active(c != 0, c == 1, may_mask, compute)

  @pl.when(rr == red[1] - 1)
  def _finish():
    r["dbias"][...] = r["acc_s"][...].astype(r["dbias"].dtype)


def _reduction(bias_shape, g: C.Geometry):
  """(dims reduced along the 5th grid axis, their total extent)."""
  Bb, Hb, Sqb, Skb = bias_shape
  dims = tuple(d for d, (n, full) in enumerate(((Bb, g.B), (Hb, g.H), (Sqb, g.nq), (Skb, g.nk)))
               if n == 1)
  ext = {0: g.B, 1: g.H, 2: g.nq, 3: g.nk}
  total = 1
  for d in dims:
    total *= ext[d]
  return dims, total, ext


def _decode(pids, bias_shape, red):
  """(b, h, i, j) of a dbias grid step: the bias' own block, or a digit of the reduction."""
  dims, total, ext = red
  out = list(pids[:4])
  rem = pids[4]
  for d in reversed(dims):
    out[d] = Lo.rem(rem, ext[d])
    rem = Lo.div(rem, ext[d])
  return tuple(out)


def _dbias(cfg, g, q, k, v, dout, lse_l, delta_l, bias, mask, q_seg, kv_seg, seed, carrays, meta,
           acc, mod=None, marrays=(), mmeta=None, offsets=None, pos=None, mpos=None):
  q_seg_p, kv_seg_p, q_l, k_l = Lo.segments(q_seg, kv_seg, g)
  mask_p = None if mask is None else C.pad_pair(mask, g)
  Bl, Hl, cls = Lo.block_class_table(cfg, g, q_seg_p, kv_seg_p, mask_p, C.mod_classes(cfg, g, mod))
  bias_p = C.pad_pair(bias, g)
  bshape = bias_p.shape
  red = _reduction(bshape, g)
  G = g.G

  def index(*a):
    b, h, i, j = _decode(a[:5], bshape, red)
    return b, h, i, j

  ins = C.KernelInputs()
  ins.add("q", C.pad_seq_head(q, g.Sqp, g.Dp),
          _bs((None, None, g.bq, g.Dp), lambda *a: (index(*a)[0], index(*a)[1], index(*a)[2], 0)))
  ins.add("do", C.pad_seq_head(dout, g.Sqp, g.Dvp),
          _bs((None, None, g.bq, g.Dvp), lambda *a: (index(*a)[0], index(*a)[1], index(*a)[2], 0)))
  add_rows(ins, g, delta_l, lse_l, lambda *a: index(*a)[:3])
  ins.add("k", C.pad_seq_head(k, g.Skvp, g.Dp),
          _bs((None, None, g.bk, g.Dp), lambda *a: (index(*a)[0], Lo.div(index(*a)[1], G), index(*a)[3], 0)))
  ins.add("v", C.pad_seq_head(v, g.Skvp, g.Dvp),
          _bs((None, None, g.bk, g.Dvp), lambda *a: (index(*a)[0], Lo.div(index(*a)[1], G), index(*a)[3], 0)))
  F.add_common(ins, cfg, g, index, bias_p=bias_p,
               mask_p=None if mask_p is None else mask_p.astype(jnp.int8),
               seg_l=(q_l, k_l), seed=seed, const_arrays=carrays, meta=meta,
               mod_arrays=marrays, mod_meta=mmeta, offsets=offsets,
               pos=Lo.position_layouts(pos, g), mpos=Lo.position_layouts(mpos, g))
  may_mask = Lo.maybe_partial(cfg, g, q_seg is not None, mask is not None)
  kernel = functools.partial(_dbias_kernel, cfg=cfg, g=g, names=ins.names, meta=meta,
                             may_mask=may_mask, bias_shape=bshape, red=red, Bl=Bl, Hl=Hl,
                             mod_meta=mmeta)
  Bb, Hb, Sqb, Skb = bshape
  blk = (g.bq if Sqb != 1 else 1, g.bk if Skb != 1 else 1)
  own = lambda pb, ph, pi, pj, *_: (pb, ph, pi, pj)
  grid = (Bb, Hb, g.nq if Sqb != 1 else 1, g.nk if Skb != 1 else 1, red[1])
  return _compat.tpu_pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(bshape, acc), grid=grid, in_specs=ins.specs,
      out_specs=_bs((None, None) + blk, own), scratch_shapes=[_compat.tpu_vmem(blk, acc)],
      num_scalar_prefetch=1,
      dimension_semantics=(PARALLEL, PARALLEL, PARALLEL, PARALLEL, ARBITRARY),
      interpret=F.interpret_arg(cfg), name="flashvjp_tpu_bwd_dbias",
  )(cls, *ins.arrays)


# ---- d(rel residuals): rows read by kv_idx - q_idx -------------------------------------

def _diag_step(g: C.Geometry, t, s):
  """(q block, kv block, active) of step s along block diagonal t (kv block - q block =
  t - (nq - 1)); steps past the diagonal's length repeat its last tile (no DMA)."""
  shift = t - (g.nq - 1)
  i0 = jnp.maximum(0, -shift)
  count = jnp.minimum(g.nq, g.nk - shift) - i0
  i = i0 + jnp.minimum(s, count - 1)
  return i, i + shift, s < count


def _drel_kernel(cls_ref, *refs, cfg, g: C.Geometry, names, meta, may_mask, Bl, Hl,
                 mod_meta=None, n_fixed_pos=0, n_rel_diff=1):
  """Program (b, h, t): the tiles of block diagonal t, whose elements all map to the same
  2 * block - 1 differences: their d(rel residual) tiles summed elementwise in VMEM, in
  order (deterministic); `_common.rel_grad_rows` reduces the diagonals. Empty blocks (the
  class table: causal, window, segments, masks, a mask_mod's classes) are skipped."""
  r = dict(zip(names + [f"drel{n}" for n in range(n_rel_diff)]
               + [f"drel_s{n}" for n in range(n_rel_diff)], refs))
  acc = r["drel_s0"].dtype
  b, h, t_, s = (_compat.program_id(a) for a in range(4))
  i, j, in_diag = _diag_step(g, t_, s)
  c = cls_ref[(((b if Bl != 1 else 0) * Hl + (h if Hl != 1 else 0)) * g.nq + i) * g.nk + j]
  c = c.astype(jnp.int32)
  diff_pos = tuple(range(n_fixed_pos, n_fixed_pos + n_rel_diff))

  @pl.when(s == 0)
  def _init():
    for n in range(n_rel_diff):
      r[f"drel_s{n}"][...] = jnp.zeros(r[f"drel_s{n}"].shape, acc)

  def compute(masked):
    consts = Lo.load_consts([r[f"const{n}"] for n in range(len(meta.scalar))], meta, b, h)
    t = Lo.load_tile(r, b, h, i, j, F.load_mod_consts(r, mod_meta, b, h), g)
    _, _, dc = tile_grads(cfg, g, r["q"][...], r["k"][...], r["v"][...], r["do"][...],
                          read_rows(r["lse"]), read_rows(r["delta"]), t, consts, r.get("seed"),
                          acc, masked, 0, diff_pos)
    for n, d in enumerate(dc):
      r[f"drel_s{n}"][...] += d.astype(acc)

  F.when_active(in_diag & (c != 0), c == 1, may_mask, compute)

  @pl.when(s == min(g.nq, g.nk) - 1)
  def _finish():
    for n in range(n_rel_diff):
      r[f"drel{n}"][...] = r[f"drel_s{n}"][...]


def _drel(cfg, g, q, k, v, dout, out, lse, dlse, bias, mask, q_seg, kv_seg, seed, carrays, meta,
          acc, mod=None, marrays=(), mmeta=None, offsets=None, pos=None, mpos=None):
  """d(rel residuals) rows of the float rel residuals (`PosResiduals.rel`): grid (B, H,
  nq + nk - 1 block diagonals, steps along one), square blocks."""
  delta_l, lse_l = preprocess(out, lse, dout, dlse, g.Sqp, acc)
  q_seg_p, kv_seg_p, q_l, k_l = Lo.segments(q_seg, kv_seg, g)
  mask_p = None if mask is None else C.pad_pair(mask, g)
  Bl, Hl, cls = Lo.block_class_table(cfg, g, q_seg_p, kv_seg_p, mask_p, C.mod_classes(cfg, g, mod))
  G = g.G

  def index(b, h, t, s, *_):
    i, j, _ = _diag_step(g, t, s)
    return b, h, i, j

  ins = C.KernelInputs()
  ins.add("q", C.pad_seq_head(q, g.Sqp, g.Dp),
          _bs((None, None, g.bq, g.Dp), lambda *a: index(*a)[:3] + (0,)))
  ins.add("do", C.pad_seq_head(dout, g.Sqp, g.Dvp),
          _bs((None, None, g.bq, g.Dvp), lambda *a: index(*a)[:3] + (0,)))
  add_rows(ins, g, delta_l, lse_l, lambda *a: index(*a)[:3])
  ins.add("k", C.pad_seq_head(k, g.Skvp, g.Dp),
          _bs((None, None, g.bk, g.Dp), lambda *a: (a[0], Lo.div(a[1], G), index(*a)[3], 0)))
  ins.add("v", C.pad_seq_head(v, g.Skvp, g.Dvp),
          _bs((None, None, g.bk, g.Dvp), lambda *a: (a[0], Lo.div(a[1], G), index(*a)[3], 0)))
  F.add_common(ins, cfg, g, index, bias_p=C.pad_pair(bias, g),
               mask_p=None if mask_p is None else mask_p.astype(jnp.int8),
               seg_l=(q_l, k_l), seed=seed, const_arrays=carrays, meta=meta,
               mod_arrays=marrays, mod_meta=mmeta, offsets=offsets,
               pos=Lo.position_layouts(pos, g), mpos=Lo.position_layouts(mpos, g))
  n_rel = pos.n_rel_diff
  kernel = functools.partial(
      _drel_kernel, cfg=cfg, g=g, names=ins.names, meta=meta,
      may_mask=Lo.maybe_partial(cfg, g, q_seg is not None, mask is not None), Bl=Bl, Hl=Hl,
      mod_meta=mmeta, n_fixed_pos=len(pos.q) + len(pos.kv), n_rel_diff=n_rel)
  n_diag = g.nq + g.nk - 1
  own = lambda b, h, t, s, *_: (b, h, t, 0, 0)
  tiles = _compat.tpu_pallas_call(
      kernel, out_shape=(jax.ShapeDtypeStruct((g.B, g.H, n_diag, g.bq, g.bk), acc),) * n_rel,
      grid=(g.B, g.H, n_diag, min(g.nq, g.nk)), in_specs=ins.specs,
      out_specs=(_bs((None, None, None, g.bq, g.bk), own),) * n_rel,
      scratch_shapes=[_compat.tpu_vmem((g.bq, g.bk), acc)] * n_rel, num_scalar_prefetch=1,
      dimension_semantics=(PARALLEL, PARALLEL, PARALLEL, ARBITRARY),
      interpret=F.interpret_arg(cfg), name="flashvjp_tpu_bwd_drel",
  )(cls, *ins.arrays)
  return tuple(C.rel_grad_rows(x, pos, g) for x in tiles)


def rel_geometry(q_shape, k_shape, v_shape) -> C.Geometry:
  """Square 128 x 128 blocks for `_drel` (a block diagonal's tiles then share their
  differences; q padded to whole 128-row blocks)."""
  g = Lo.geometry(q_shape, k_shape, v_shape, Lo.LANES, Lo.LANES)
  return dataclasses.replace(g, bq=g.bk)


# ---- entry point ------------------------------------------------------------------------

def backward(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed, consts,
             out, lse, dout, dlse, mod=None, offsets=None):
  """Hand-written Mosaic-TPU backward (interface of `flashvjp.pallas.triton.backward`,
  `offsets` included).

  Returns:
    (dq, dk, dv in the input dtype, dbias in bias' shape and dtype (or None), grads of the
     cfg.num_diff_consts differentiable score_mod consts).
  """
  acc = C.acc_dtype(q.dtype)
  n_user_diff = cfg.num_diff_consts
  user_consts = tuple(consts)
  B, H = q.shape[0], q.shape[1]
  g = Lo.geometry(q.shape, k.shape, v.shape, *cfg.blocks.dkv)
  g2 = Lo.geometry(q.shape, k.shape, v.shape, *cfg.blocks.dq)
  g_rel = rel_geometry(q.shape, k.shape, v.shape)
  # per-position residuals cover every kernel's padded lengths (each slices its own)
  positions = C.Positions(cfg.seq_q, cfg.seq_kv, max(g.Sqp, g2.Sqp, g_rel.Sqp),
                          max(g.Skvp, g2.Skvp, g_rel.Skvp), rel=True)
  cfg, split, carrays, meta = F.split_consts(cfg, consts, acc, B, H, grads=True, offsets=offsets,
                                             positions=positions)
  cfg, marrays, mmeta, mpos = F.split_mod(cfg, mod, acc, B, H, offsets, positions)
  pos = split.pos
  mod_kw = dict(mod=mod, marrays=marrays, mmeta=mmeta, offsets=offsets, pos=pos, mpos=mpos)
  n_diff = split.n_diff

  # dK / dV (and dbias, on the same blocks).
  delta_l, lse_l = preprocess(out, lse, dout, dlse, g.Sqp, acc)
  dk, dv, dposkv = _dkdv(cfg, g, q, k, v, dout, lse_l, delta_l, bias, mask, q_seg, kv_seg,
                         seed, carrays, meta, acc, **mod_kw)
  dk, dv = dk[:, :, : g.Skv, : g.D], dv[:, :, : g.Skv, : g.Dv]
  dbias = None
  if bias is not None:
    dbias = _dbias(cfg, g, q, k, v, dout, lse_l, delta_l, bias, mask, q_seg, kv_seg, seed,
                   carrays, meta, acc, **mod_kw)
    dbias = dbias[:, :, : bias.shape[2], : bias.shape[3]].astype(bias.dtype)

  # dQ (and the score_mod residuals' grads).
  if g2.Sqp != g.Sqp:
    delta_l, lse_l = preprocess(out, lse, dout, dlse, g2.Sqp, acc)
  diff_shapes = [tuple(a.shape[2:]) if not sc else () for a, sc in
                 zip(split.arrays[:n_diff], split.scalar[:n_diff])]
  dq, dres, dposq = _dq(cfg, g2, q, k, v, dout, lse_l, delta_l, bias, mask, q_seg, kv_seg,
                        seed, carrays, meta, acc, n_diff, diff_shapes, **mod_kw)
  dq = dq[:, :, : g2.Sq, : g2.D]
  drel = ()
  if pos is not None and pos.n_rel_diff:
    drel = _drel(cfg, g_rel, q, k, v, dout, out, lse, dlse, bias, mask, q_seg, kv_seg, seed,
                 carrays, meta, acc, **mod_kw)
  if split.to_consts is not None:  # grads to the arrays, through per-head / -position residuals
    fit = lambda ds, xs: tuple(C.pad_to(d, 2, x.shape[2]) for d, x in zip(ds, xs))
    dconsts = tuple(split.to_consts(dres, *(() if pos is None else (
        fit(dposq, pos.q), fit(dposkv, pos.kv), drel))))
  else:  # differentiable consts that the scores do not depend on
    dconsts = tuple(jnp.zeros(jnp.shape(c), jnp.result_type(c)) for c in user_consts[:n_user_diff])
  dconsts = tuple(d.astype(jnp.result_type(c)) for d, c in zip(dconsts, user_consts[:n_user_diff]))
  return dq, dk, dv, dbias, dconsts
