"""Mosaic-TPU forward kernel: online softmax over the listed kv blocks, writes out and lse.

Room: Pallas-TPU kernels (forward). Grid (batch, head, q block, step): the step axis
is the kv reduction ("arbitrary", innermost) and walks this q block's compacted list
of non-empty kv blocks (scalar-prefetched; `_layout.visit_lists`). m / l / acc live
in VMEM scratch (float32; float64 for float64 inputs in interpret mode), initialised
at step 0 and written out at the last step. Steps past the row's count repeat the
last block index: no DMA, no matmul. A mask_mod's block classes join the lists and its
tile part (`_common.split_mask_mod`; per-(b, h) residuals in SMEM) joins the elementwise
mask of PARTIAL blocks; FULL blocks never evaluate it.

GQA: the K/V index maps read kv head h // G, so K/V are never repeated.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from flashvjp._config import AttentionConfig
from flashvjp.pallas import _common as C
from flashvjp.pallas import _compat
from flashvjp.pallas.tpu import _interpret
from flashvjp.pallas.tpu import _layout as Lo

PARALLEL, ARBITRARY = "parallel", "arbitrary"


def _bs(shape, index_map):
  return _compat.block_spec(shape, index_map)


def pair_spec(x, g: C.Geometry, index):
  """BlockSpec of a padded rank-4 bias / mask: a (bq|1, bk|1) tile per step.

  `index(*grid, *prefetch) -> (b, h, i, j)`; size-1 (broadcast) dims map to block 0.
  """
  Bp, Hp, Sq2, Sk2 = x.shape

  def imap(*a):
    b, h, i, j = index(*a)
    return (b if Bp != 1 else 0, h if Hp != 1 else 0, i if Sq2 != 1 else 0,
            j if Sk2 != 1 else 0)

  return _bs((None, None, g.bq if Sq2 != 1 else 1, g.bk if Sk2 != 1 else 1), imap)


def add_common(ins: C.KernelInputs, cfg, g: C.Geometry, index, *, bias_p, mask_p, seg_l, seed,
               const_arrays, meta: Lo.ConstMeta, mod_arrays=(), mod_meta=None, offsets=None,
               pos=((), (), ()), mpos=((), (), ())):
  """Bias, mask, segment ids, seed, global offsets and score_mod / mask_mod residuals for
  any (b, h, i, j) grid (mask_mod residuals: "mconst{n}", described by `mod_meta`; the
  offsets: int32 [4] "offsets" in SMEM, `_common.offset_operand`).

  `index(*grid, *prefetch) -> (b, h, i, j)`: the tile a grid step works on.
  """
  for name, x in (("bias", bias_p), ("mask", mask_p)):
    if x is not None:
      ins.add(name, x, pair_spec(x, g, index))
  q_l, k_l = seg_l
  if q_l is not None:
    def q_seg_map(*a):
      b, _, i, _ = index(*a)
      return (b, i, 0)

    def kv_seg_map(*a):
      b, _, _, j = index(*a)
      return (b, 0, j)

    ins.add("q_seg", q_l, _bs((None, g.bq, Lo.LANES), q_seg_map))
    ins.add("kv_seg", k_l, _bs((None, Lo.SUBLANES, g.bk), kv_seg_map))
  if cfg.dropout_active:
    words = Lo.seed_words(seed)
    ins.add("seed", words, _compat.smem_spec(words.shape))
  off = C.offset_operand(offsets)
  if off is not None:
    ins.add("offsets", off, _compat.smem_spec(off.shape))
  add_positions(ins, g, index, pos, "pos")
  add_positions(ins, g, index, mpos, "mpos")
  mod_scalar = () if mod_meta is None else mod_meta.scalar
  for prefix, arrays, scalar in (("const", const_arrays, meta.scalar),
                                 ("mconst", mod_arrays, mod_scalar)):
    for n, (c, sc) in enumerate(zip(arrays, scalar)):
      if sc:
        ins.add(f"{prefix}{n}", c, _compat.smem_spec(c.shape))
      else:
        nd = c.ndim
        ins.add(f"{prefix}{n}", c, _bs(c.shape, functools.partial(lambda nd, *a: (0,) * nd, nd)))


def add_positions(ins: C.KernelInputs, g: C.Geometry, index, layouts, prefix: str):
  """Per-position residuals in `_layout.position_layouts` (q ones, kv ones, rel rows) as
  inputs "{prefix}q{n}" / "{prefix}kv{n}" / "{prefix}rel{n}": this step's (1, bq) or
  (bq, 128) / (1, bk) blocks, the (b, h) row (`index` as `add_common`'s)."""
  qs, kvs, rels = layouts

  def q_pos_map(*a):
    b, h, i, _ = index(*a)
    return (b, h, i, 0)

  def q_lane_map(*a):
    b, h, i, _ = index(*a)
    return (b, h, 0, i)

  def kv_pos_map(*a):
    b, h, _, j = index(*a)
    return (b, h, 0, j)

  for n, x in enumerate(qs):
    if x.shape[2] == 1:  # lane-major [B, H, 1, Sqp]
      ins.add(f"{prefix}q{n}", x, _bs((None, None, 1, g.bq), q_lane_map))
    else:
      ins.add(f"{prefix}q{n}", x, _bs((None, None, g.bq, Lo.LANES), q_pos_map))
  for n, x in enumerate(kvs):
    ins.add(f"{prefix}kv{n}", x, _bs((None, None, 1, g.bk), kv_pos_map))

  def row_map(*a):
    b, h, _, _ = index(*a)
    return (b, h, 0, 0)

  for n, x in enumerate(rels):
    ins.add(f"{prefix}rel{n}", x, _bs((None, None, 1, x.shape[-1]), row_map))


def load_mod_consts(r, mod_meta, b, h):
  """The mask_mod residuals of (b, h) (refs "mconst{n}"; () without a mask_mod)."""
  if mod_meta is None:
    return ()
  return Lo.load_consts([r[f"mconst{n}"] for n in range(len(mod_meta.scalar))], mod_meta, b, h)


def row_inputs(cfg: AttentionConfig, g: C.Geometry, lists: Lo.Lists, q, k, v, bias, mask,
               q_seg, kv_seg, seed, const_arrays, meta, mod_arrays=(), mod_meta=None,
               offsets=None, pos=((), (), ()), mpos=((), (), ())):
  """Inputs for a (batch, head, q block, step) grid (the forward and dQ kernels)."""
  G = g.G

  def kv_block(b, h, i, s, cnt, ent):
    return lists.block(ent, b, h, i, s)

  def index(b, h, i, s, cnt, ent, *_):
    return b, h, i, kv_block(b, h, i, s, cnt, ent)

  ins = C.KernelInputs()
  ins.add("q", C.pad_seq_head(q, g.Sqp, g.Dp),
          _bs((None, None, g.bq, g.Dp), lambda b, h, i, s, *_: (b, h, i, 0)))
  ins.add("k", C.pad_seq_head(k, g.Skvp, g.Dp),
          _bs((None, None, g.bk, g.Dp),
              lambda b, h, i, s, cnt, ent, *_: (b, Lo.div(h, G), kv_block(b, h, i, s, cnt, ent), 0)))
  ins.add("v", C.pad_seq_head(v, g.Skvp, g.Dvp),
          _bs((None, None, g.bk, g.Dvp),
              lambda b, h, i, s, cnt, ent, *_: (b, Lo.div(h, G), kv_block(b, h, i, s, cnt, ent), 0)))
  add_common(ins, cfg, g, index, bias_p=C.pad_pair(bias, g),
             mask_p=None if mask is None else C.pad_pair(mask, g).astype(jnp.int8),
             seg_l=(q_seg, kv_seg), seed=seed, const_arrays=const_arrays, meta=meta,
             mod_arrays=mod_arrays, mod_meta=mod_meta, offsets=offsets, pos=pos, mpos=mpos)
  return ins


def prepare(cfg, g, q_seg, kv_seg, mask, by, mod=None):
  """(segment layouts, Lists, counts, entries) for one kernel's blocks (`mod`: the
  mask_mod's `ModInputs`, whose classes join the lists)."""
  q_seg_p, kv_seg_p, q_l, k_l = Lo.segments(q_seg, kv_seg, g)
  mask_p = None if mask is None else C.pad_pair(mask, g)
  lists, counts, entries = Lo.visit_lists(cfg, g, q_seg_p, kv_seg_p, mask_p, by,
                                          C.mod_classes(cfg, g, mod))
  return (q_l, k_l), lists, counts, entries


def step_info(lists: Lo.Lists, cnt_ref, ent_ref, b, h, row, s):
  """(active, block, needs_mask) of step s of `row`'s list."""
  return lists.step(cnt_ref, ent_ref, b, h, row, s)


def when_active(active, partial, may_mask: bool, compute):
  """Run compute(masked) on active steps: masked only on partial blocks."""
  if not may_mask:
    pl.when(active)(lambda: compute(False))
    return
  pl.when(active & partial)(lambda: compute(True))
  pl.when(active & jnp.logical_not(partial))(lambda: compute(False))


def _forward_kernel(cnt_ref, ent_ref, *refs, cfg, g: C.Geometry, lists: Lo.Lists, names,
                    meta: Lo.ConstMeta, may_mask, mod_meta=None):
  rows = ["lse", "row_max"] if cfg.max_logits else ["lse"]
  r = dict(zip(names + ["out"] + rows + ["m_s", "l_s", "o_s"], refs))
  acc = r["o_s"].dtype
  b, h, i, s = (_compat.program_id(a) for a in range(4))
  active, j, partial = step_info(lists, cnt_ref, ent_ref, b, h, i, s)
  m_s, l_s, o_s = r["m_s"], r["l_s"], r["o_s"]

  neg = C.mask_value(acc)  # finite stand-in for -inf: no inf inside the kernel

  @pl.when(s == 0)
  def _init():  # m starts at mask_value: a row that sees no allowed entry keeps l == 0
    m_s[...] = jnp.full(m_s.shape, neg, acc)
    l_s[...] = jnp.zeros(l_s.shape, acc)
    o_s[...] = jnp.zeros(o_s.shape, acc)

  def compute(masked):
    consts = Lo.load_consts([r[f"const{n}"] for n in range(len(meta.scalar))], meta, b, h)
    t = Lo.load_tile(r, b, h, i, j, load_mod_consts(r, mod_meta, b, h), g)
    sc, ok, _ = Lo.scores(cfg, g, r["q"][...], r["k"][...], t, consts, acc, masked)
    m_prev, l_prev = m_s[:, 0:1], l_s[:, 0:1]
    if ok is None:
      m_new = jnp.maximum(m_prev, sc.max(axis=-1, keepdims=True))
      p = jnp.exp(sc - m_new)
    else:  # masked entries: out of the max, and p = exp(mask_value) = 0 by a select
      m_new = jnp.maximum(m_prev, jnp.where(ok, sc, neg).max(axis=-1, keepdims=True))
      p = jnp.exp(jnp.where(ok, sc - m_new, neg))
    alpha = jnp.exp(m_prev - m_new)
    l_new = alpha * l_prev + p.sum(axis=-1, keepdims=True)
    if cfg.dropout_active:
      p = p * Lo.dropout_scale(cfg, g, r["seed"], t, acc)
    vt = r["v"][...]
    if cfg.out_f32:  # a traced scale (AttentionConfig.out_f32): p @ v in float32, exact delta
      pv = Lo.dot_nn(p, vt.astype(acc), acc, dataclasses.replace(cfg, precision="highest"))
    else:
      pv = Lo.dot_nn(p.astype(vt.dtype), vt, acc, cfg)
    o_s[...] = alpha * o_s[...] + pv
    m_s[...] = jnp.broadcast_to(m_new, m_s.shape)
    l_s[...] = jnp.broadcast_to(l_new, l_s.shape)

  when_active(active, partial, may_mask, compute)

  @pl.when(s == lists.W - 1)
  def _finish():
    l = l_s[:, 0:1]
    empty = l == 0.0
    r["out"][...] = (o_s[...] / jnp.where(empty, 1.0, l)).astype(r["out"].dtype)
    # Empty (and padded) rows: lse = mask_value here, -inf outside the kernel (`forward`).
    lse = jnp.where(empty, neg, m_s[:, 0:1] + jnp.log(jnp.where(empty, 1.0, l)))
    # cfg.max_logits: the running max over allowed entries is the row's max logit
    for name, x in (("lse", lse), ("row_max", jnp.where(empty, neg, m_s[:, 0:1]))):
      if name in r:
        Lo.write_column(r[name], x)


def positions(cfg: AttentionConfig, g: C.Geometry):
  """What `_common.split_per_head` needs to hoist per-position residuals for geometry g
  (these kernels read rows by kv_idx - q_idx too: `_layout.rel_tile`)."""
  return C.Positions(cfg.seq_q, cfg.seq_kv, g.Sqp, g.Skvp, rel=True)


def split_mod(cfg, mod, acc, B, H, offsets=None, positions=None):
  """(cfg with the per-tile mask_mod, kernel arrays, ConstMeta or None, PosResiduals or
  None) of a mask_mod (`_common.split_mask_mod`; residuals travel as the score_mod's do)."""
  msplit = C.split_mask_mod(cfg, mod, B, H, offsets, positions)
  if msplit.cfg.mask_mod is None:
    return msplit.cfg, (), None, None
  return (msplit.cfg, Lo.const_arrays(msplit, acc), Lo.ConstMeta(tuple(msplit.scalar), H),
          msplit.pos)


def split_consts(cfg, consts, acc, B, H, grads, offsets=None, positions=None):
  """(cfg with the per-tile score_mod, HeadSplit, kernel arrays, ConstMeta)."""
  cfg, consts = C.hoist_score_mod(cfg, consts, acc)
  split = C.split_per_head(cfg, tuple(jnp.asarray(c) for c in consts), acc, B, H, grads=grads,
                           offsets=offsets, positions=positions)
  return split.cfg, split, Lo.const_arrays(split, acc), Lo.ConstMeta(tuple(split.scalar), H)


interpret_arg = _interpret.interpret_arg


def forward(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, mod=None,
            offsets=None):
  """Mosaic-TPU forward (interface of `flashvjp.pallas.triton.forward`, `offsets` included:
  the global (b0, h0, q0, kv0) of local element 0, read by the kernels from SMEM).

  Returns:
    (out [B, H, Sq, Dv] in q.dtype, lse [B, H, Sq] float32 (float64 for float64 inputs)),
    and the row maxima (the same dtype; -inf: an empty row) when cfg.max_logits.
  """
  g = Lo.geometry(q.shape, k.shape, v.shape, cfg.blocks.block_q, cfg.blocks.block_kv)
  acc = C.acc_dtype(q.dtype)
  cfg, split, carrays, meta = split_consts(cfg, consts, acc, g.B, g.H, grads=False,
                                          offsets=offsets, positions=positions(cfg, g))
  cfg, marrays, mmeta, mpos = split_mod(cfg, mod, acc, g.B, g.H, offsets, positions(cfg, g))
  seg_l, lists, counts, entries = prepare(cfg, g, q_seg, kv_seg, mask, "q", mod)
  q_seg_l, kv_seg_l = seg_l
  ins = row_inputs(cfg, g, lists, q, k, v, bias, mask, q_seg_l, kv_seg_l, seed, carrays, meta,
                   marrays, mmeta, offsets, Lo.position_layouts(split.pos, g),
                   Lo.position_layouts(mpos, g))
  may_mask = Lo.maybe_partial(cfg, g, q_seg is not None, mask is not None)
  kernel = functools.partial(_forward_kernel, cfg=cfg, g=g, lists=lists, names=ins.names,
                             meta=meta, may_mask=may_mask, mod_meta=mmeta)
  out_map = lambda b, h, i, s, *_: (b, h, i, 0)
  cost = forward_cost(cfg, g, q.dtype, bias is not None)
  # lse: lane-major [B, H, 1, Sqp] when block_q is a multiple of 128 (the compiled
  # defaults); else lane-broadcast [B, H, Sqp, 128] (128x the memory), as splash.
  lanes = g.bq % Lo.LANES == 0
  if lanes:
    lse_shape, lse_spec = (g.B, g.H, 1, g.Sqp), _bs((None, None, 1, g.bq),
                                                    lambda b, h, i, s, *_: (b, h, 0, i))
  else:
    lse_shape, lse_spec = (g.B, g.H, g.Sqp, Lo.LANES), _bs((None, None, g.bq, Lo.LANES), out_map)
  n_rows = 2 if cfg.max_logits else 1  # lse (+ the row maxima, laid out alike)
  out, *rows = _compat.tpu_pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((g.B, g.H, g.Sqp, g.Dvp), acc if cfg.out_f32 else q.dtype),
                 *(jax.ShapeDtypeStruct(lse_shape, acc),) * n_rows),
      grid=(g.B, g.H, g.nq, lists.W),
      in_specs=ins.specs,
      out_specs=(_bs((None, None, g.bq, g.Dvp), out_map), *(lse_spec,) * n_rows),
      scratch_shapes=[_compat.tpu_vmem((g.bq, Lo.LANES), acc),
                      _compat.tpu_vmem((g.bq, Lo.LANES), acc),
                      _compat.tpu_vmem((g.bq, g.Dvp), acc)],
      num_scalar_prefetch=2,
      dimension_semantics=(PARALLEL, PARALLEL, PARALLEL, ARBITRARY),
      interpret=interpret_arg(cfg), name="flashvjp_tpu_fwd", cost=cost,
  )(counts, entries, *ins.arrays)
  rows = [x[:, :, 0, : g.Sq] if lanes else x[:, :, : g.Sq, 0] for x in rows]
  rows = C.neg_inf_at_empty(rows, acc)  # the API's -inf lse (and row max) of an empty row
  return (out[:, :, : g.Sq, : g.Dv],) + rows


def forward_cost(cfg, g: C.Geometry, dtype, has_bias: bool):
  """pl.CostEstimate from the static (causal / window) tile count: an upper bound."""
  tiles = g.B * g.H * Lo.static_tiles(cfg, g, "q")
  isz = jnp.dtype(dtype).itemsize
  flops = 2 * tiles * g.bq * g.bk * (g.Dp + g.Dvp)
  trans = tiles * g.bq * g.bk
  lse_row = 4 if g.bq % Lo.LANES == 0 else Lo.LANES * 4  # lane-major or lane-broadcast lse
  nbytes = (g.B * g.H * g.Sqp * (g.Dp + g.Dvp) * isz + g.B * g.H * g.Sqp * lse_row
            + tiles * g.bk * (g.Dp + g.Dvp) * isz + (tiles * g.bq * g.bk * 4 if has_bias else 0))
  return _compat.cost_estimate(flops, trans, nbytes)
