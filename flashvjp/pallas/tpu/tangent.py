"""Mosaic-TPU tangent kernel: the fused forward-mode pass (issue 12).

Room: Pallas-TPU kernels (forward mode). The forward kernel's grid (batch, head, q block,
step), its scalar-prefetched block visiting lists and inputs (`forward.row_inputs`), plus
the tangents t_q (a [bq, D] tile), t_k / t_v (the listed kv block, like K / V), t_bias
(tiles like bias), the score_mod residuals' tangents (the JVP of the per-(b, h) split,
carried like the residuals), the forward's out tile and lse (as the backward reads it:
`backward.add_rows` layout, the largest finite number on empty / padded rows so p = 0).
Per listed kv block, in VMEM scratch:

    t_s  = scale * (t_q k^T + q t_k^T) + t_bias   (+ score_mod's jvp on the tile)
    p    = exp(s - lse)
    mu  += rowsum(p * t_s);   a += (pd * t_s) @ v + pd @ t_v

and at the last step t_out = a - mu * out, t_lse = mu (lane layout of the forward's lse).
Nothing of size [seq_q, seq_kv]; no running max (the lse is exact).
"""
from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from flashvjp._config import AttentionConfig
from flashvjp.pallas import _common as C
from flashvjp.pallas import _compat
from flashvjp.pallas.tpu import _layout as Lo

# The modules (the package's `forward` / `backward` attributes are the functions).
F = importlib.import_module("flashvjp.pallas.tpu.forward")
BW = importlib.import_module("flashvjp.pallas.tpu.backward")


def _tangent_kernel(cnt_ref, ent_ref, *refs, cfg, g: C.Geometry, lists: Lo.Lists, names, meta,
                    tmeta, n_float, may_mask, mod_meta=None):
  r = dict(zip(names + ["t_out", "t_lse", "mu_s", "a_s"], refs))
  acc = r["a_s"].dtype
  b, h, i, s = (_compat.program_id(a) for a in range(4))
  active, j, partial = F.step_info(lists, cnt_ref, ent_ref, b, h, i, s)
  mu_s, a_s = r["mu_s"], r["a_s"]

  @pl.when(s == 0)
  def _init():
    mu_s[...] = jnp.zeros(mu_s.shape, acc)
    a_s[...] = jnp.zeros(a_s.shape, acc)

  def compute(masked):
    consts = Lo.load_consts([r[f"const{n}"] for n in range(len(meta.scalar))], meta, b, h)
    tconsts = Lo.load_consts([r[f"tconst{n}"] for n in range(len(tmeta.scalar))], tmeta, b, h)
    t = Lo.load_tile(r, b, h, i, j, F.load_mod_consts(r, mod_meta, b, h), g)
    q, k = r["q"][...], r["k"][...]
    qi, ki = C.tile_indices(g, t.i, t.j)
    scale = jnp.asarray(cfg.scale, acc)
    sc = Lo.dot_nt(q, k, acc, cfg) * scale
    ts = None
    if "tq" in r:
      ts = Lo.dot_nt(r["tq"][...], k, acc, cfg)
    if "tk" in r:
      qtk = Lo.dot_nt(q, r["tk"][...], acc, cfg)
      ts = qtk if ts is None else ts + qtk
    ts = jnp.zeros_like(sc) if ts is None else ts * scale
    if t.bias is not None:
      sc = sc + t.bias.astype(acc)
    if "tbias" in r:
      ts = ts + r["tbias"][...].astype(acc)
    if cfg.score_mod is not None:
      sc, ts = C.modded_jvp(cfg, sc, ts, t, qi, ki, consts, n_float, tuple(tconsts),
                            Lo.load_positions(r, "tpos", i, j, g))
    lse = BW.read_rows(r["lse"])
    if masked:
      dense = None if t.mask is None else (t.mask.astype(jnp.int32) != 0)
      ok = C.mask_spec(cfg).allowed(qi, ki, q_seg=t.q_seg, kv_seg=t.kv_seg, dense=dense)
      if cfg.mask_mod is not None:
        ok = ok & C.mask_mod_allowed(cfg, t, qi, ki)
      p = jnp.exp(jnp.where(ok, sc - lse, C.mask_value(acc)))
      ts = jnp.where(ok, ts, 0.0)
    else:
      p = jnp.exp(sc - lse)
    pts = p * ts
    mu_s[...] = mu_s[...] + jnp.broadcast_to(pts.sum(axis=-1, keepdims=True), mu_s.shape)
    pd = p
    if cfg.dropout_active:
      keep = Lo.dropout_scale(cfg, g, r["seed"], t, acc)
      pd, pts = p * keep, pts * keep
    v = r["v"][...]
    a = Lo.dot_nn(pts.astype(v.dtype), v, acc, cfg)
    if "tv" in r:
      tv = r["tv"][...]
      a = a + Lo.dot_nn(pd.astype(tv.dtype), tv, acc, cfg)
    a_s[...] = a_s[...] + a

  F.when_active(active, partial, may_mask, compute)

  @pl.when(s == lists.W - 1)
  def _finish():
    mu = mu_s[:, 0:1]
    a = a_s[...]
    if "out" in r:  # without out: a (the caller subtracts mu * out, `_delta.tangent_out`)
      a = a - mu * r["out"][...].astype(acc)
    r["t_out"][...] = a.astype(r["t_out"].dtype)
    Lo.write_column(r["t_lse"], mu_s[:, 0:1])


def tangent(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out, lse,
            tq, tk, tv, tbias, tconsts, mod=None, offsets=None):
  """The fused tangent pass (`flashvjp.blockwise._tangent.tangent`'s interface; `offsets`
  as `forward.forward`)."""
  g = Lo.geometry(q.shape, k.shape, v.shape, cfg.blocks.block_q, cfg.blocks.block_kv)
  acc = C.acc_dtype(q.dtype)
  n_user = cfg.num_diff_consts
  tconsts = tuple(tconsts) if tconsts is not None else (None,) * n_user
  cfg0, consts0 = C.hoist_score_mod(cfg, consts, acc)
  consts0 = tuple(jnp.asarray(c) for c in consts0)
  positions = F.positions(cfg, g)
  cfg, split, carrays, meta = F.split_consts(cfg, consts, acc, g.B, g.H, grads=False,
                                             offsets=offsets, positions=positions)
  n_float = sum(1 for x in split.arrays if jnp.issubdtype(x.dtype, jnp.inexact))
  tarrays: tuple = ()
  tmeta = Lo.ConstMeta((), g.H)
  res_t, pos_t = C.residual_tangents(cfg0, consts0, tconsts, acc, g.B, g.H, split, offsets,
                                     positions)
  if res_t:
    tsplit = C.HeadSplit(cfg, tuple(res_t), tuple(split.scalar[:n_float]))
    tarrays, tmeta = Lo.const_arrays(tsplit, acc), Lo.ConstMeta(tuple(split.scalar[:n_float]), g.H)
  cfg, marrays, mmeta, mpos = F.split_mod(cfg, mod, acc, g.B, g.H, offsets, positions)
  seg_l, lists, counts, entries = F.prepare(cfg, g, q_seg, kv_seg, mask, "q", mod)
  ins = F.row_inputs(cfg, g, lists, q, k, v, bias, mask, *seg_l, seed, carrays, meta, marrays,
                     mmeta, offsets, Lo.position_layouts(split.pos, g),
                     Lo.position_layouts(mpos, g))
  G = g.G

  def kv_block(b, h, i, s, cnt, ent):
    return lists.block(ent, b, h, i, s)

  def index(b, h, i, s, cnt, ent, *_):
    return b, h, i, kv_block(b, h, i, s, cnt, ent)

  F.add_positions(ins, g, index, Lo.position_layouts(pos_t, g), "tpos")
  for n, (c, sc) in enumerate(zip(tarrays, tmeta.scalar)):
    if sc:
      ins.add(f"tconst{n}", c, _compat.smem_spec(c.shape))
    else:
      ins.add(f"tconst{n}", c, F._bs(c.shape, functools.partial(lambda nd, *a: (0,) * nd, c.ndim)))
  row = lambda b, h, i, s, *_: (b, h, i, 0)
  kv_map = lambda b, h, i, s, cnt, ent, *_: (b, Lo.div(h, G), kv_block(b, h, i, s, cnt, ent), 0)
  if tq is not None:
    ins.add("tq", C.pad_seq_head(tq, g.Sqp, g.Dp), F._bs((None, None, g.bq, g.Dp), row))
  if tk is not None:
    ins.add("tk", C.pad_seq_head(tk, g.Skvp, g.Dp), F._bs((None, None, g.bk, g.Dp), kv_map))
  if tv is not None:
    ins.add("tv", C.pad_seq_head(tv, g.Skvp, g.Dvp), F._bs((None, None, g.bk, g.Dvp), kv_map))
  if tbias is not None:
    tb = C.pad_pair(tbias, g)
    ins.add("tbias", tb, F.pair_spec(tb, g, index))
  if out is not None:
    ins.add("out", C.pad_seq_head(out, g.Sqp, g.Dvp), F._bs((None, None, g.bq, g.Dvp), row))
  out_dtype = out.dtype if out is not None else (acc if cfg.out_f32 else q.dtype)
  big = C.lse_pad_value(acc)
  lse_b = jnp.where(jnp.isfinite(lse), lse.astype(acc), big)
  lse_b = jnp.pad(lse_b, ((0, 0), (0, 0), (0, g.Sqp - g.Sq)), constant_values=big)
  lanes = Lo.rows_lane_major(g)
  if lanes:
    ins.add("lse", lse_b[:, :, None, :], F._bs((None, None, 1, g.bq),
                                               lambda b, h, i, s, *_: (b, h, 0, i)))
  else:
    ins.add("lse", Lo.lane_rows(lse_b, g.Sqp), F._bs((None, None, g.bq, Lo.LANES), row))
  may_mask = Lo.maybe_partial(cfg, g, q_seg is not None, mask is not None)
  kernel = functools.partial(_tangent_kernel, cfg=cfg, g=g, lists=lists, names=ins.names,
                             meta=meta, tmeta=tmeta, n_float=n_float, may_mask=may_mask,
                             mod_meta=mmeta)
  if lanes:
    t_lse_shape, t_lse_spec = (g.B, g.H, 1, g.Sqp), F._bs((None, None, 1, g.bq),
                                                          lambda b, h, i, s, *_: (b, h, 0, i))
  else:
    t_lse_shape, t_lse_spec = (g.B, g.H, g.Sqp, Lo.LANES), F._bs((None, None, g.bq, Lo.LANES), row)
  t_out, t_lse = _compat.tpu_pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((g.B, g.H, g.Sqp, g.Dvp), out_dtype),
                 jax.ShapeDtypeStruct(t_lse_shape, acc)),
      grid=(g.B, g.H, g.nq, lists.W),
      in_specs=ins.specs,
      out_specs=(F._bs((None, None, g.bq, g.Dvp), row), t_lse_spec),
      scratch_shapes=[_compat.tpu_vmem((g.bq, Lo.LANES), acc),
                      _compat.tpu_vmem((g.bq, g.Dvp), acc)],
      num_scalar_prefetch=2,
      dimension_semantics=(F.PARALLEL, F.PARALLEL, F.PARALLEL, F.ARBITRARY),
      interpret=F.interpret_arg(cfg), name="flashvjp_tpu_tangent",
  )(counts, entries, *ins.arrays)
  t_lse = t_lse[:, :, 0, : g.Sq] if lanes else t_lse[:, :, : g.Sq, 0]
  return t_out[:, :, : g.Sq, : g.Dv], t_lse.astype(lse.dtype)
