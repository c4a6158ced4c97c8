"""Pallas-Triton tangent kernel: the fused forward-mode pass (issue 12).

Room: Pallas kernels (forward mode). The forward kernel's grid, inputs and loops
(`forward.kernel_inputs`: grid (batch, head, q block), K/V rows read per kv head, the
static causal / window bounds with the elementwise mask on edge blocks only, or the
compacted PARTIAL / FULL block lists for segment ids, dense masks and mask_mods) plus
the tangents t_q (a [bq, D] tile), t_k, t_v (rows like K/V), t_bias (tiles like bias),
the forward's out tile and lse row. Per kv block:

    t_s  = scale * (t_q k^T + q t_k^T) + t_bias   (+ score_mod's jvp on the tile)
    p    = exp2(s log2(e) - lse log2(e))          (the forward's exact lse: no rescaling)
    mu  += rowsum(p * t_s)
    a   += (pd * t_s) @ v + pd @ t_v              (pd: p with the dropout keep scaling)

then t_out = a - mu * out and t_lse = mu: two [bq, Dv] / [bq] accumulators, nothing of
size [seq_q, seq_kv]. A score_mod's closed-over arrays are split per (b, h) as in the
forward (`_common.split_per_head`); their tangents are the JVP of that split (per-(b, h)
residual tangents, loaded like the residuals), and the tile part is differentiated with
`jax.jvp` in the kernel. Empty and padded rows read lse = `lse_pad_value` (so p = 0):
zero, finite tangents. Launch parameters are the forward's (not yet tuned or checked
by the sm_90 compile check).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
from jax import lax

from flashvjp._config import AttentionConfig
from flashvjp.pallas import _common as C
from flashvjp.pallas import _compat

# The module (the package's `forward` attribute is the forward function).
F = importlib.import_module("flashvjp.pallas.triton.forward")


def _tangent_kernel(*refs, cfg: AttentionConfig, g: C.Geometry, names, n_consts, scalar, n_float,
                    n_tconsts, masked, mod_scalar=()):
  r = dict(zip(names + ["t_out", "t_lse"], refs))
  acc = C.acc_dtype(r["q"].dtype)
  b, h, i = _compat.program_id(0), _compat.program_id(1), _compat.program_id(2)
  q = r["q"][...]
  tq = r["tq"][...] if "tq" in r else None
  consts = C.load_head_consts([r[f"const{n}"] for n in range(n_consts)], scalar)
  tconsts = C.load_head_consts([r[f"tconst{n}"] for n in range(n_tconsts)], scalar[:n_tconsts])
  mconsts = F.load_mod_consts(r, mod_scalar)
  off = C.load_offsets(r.get("offsets"))
  lse = r["lse"][...]
  lo, hi = C.mask_spec(cfg).kv_block_range(i, g.bq, g.bk, g.nk)
  scale = jnp.asarray(cfg.scale, acc)

  def body(j, masked, carry):
    mu, a = carry
    t = F.load_tile_inputs(r, g, b, h, i, j, mconsts, off)
    kv = _compat.ds(j * g.bk, g.bk)
    k = r["k"][kv, :]
    qi, ki = C.tile_indices(g, t.i, t.j)
    # exp2 domain (`lse` is lse * log2(e)): p = exp2(s * log2(e) - lse), one FFMA and one ex2
    # an entry; with nothing but the scale on the scores, the scale folds into log2(e)
    raw = t.bias is None and cfg.score_mod is None
    s = C.dot_nt(q, k, acc, cfg)
    if not raw:
      s = s * scale
    ts = None
    if tq is not None:
      ts = C.dot_nt(tq, k, acc, cfg)
    if "tk" in r:
      qtk = C.dot_nt(q, r["tk"][kv, :], acc, cfg)
      ts = qtk if ts is None else ts + qtk
    ts = jnp.zeros_like(s) if ts is None else ts * scale
    if t.bias is not None:
      s = s + t.bias.astype(acc)
    if "tbias" in r:
      ts = ts + C.pair_tile(r["tbias"], (), i, j, g, full_q=False, full_kv=True).astype(acc)
    if cfg.score_mod is not None:
      s, ts = C.modded_jvp(cfg, s, ts, t, qi, ki, consts, n_float, tuple(tconsts),
                           F.load_positions(r, g, i, j, "tpos"))
    neg = C.mask_value(acc)
    xs = jnp.asarray(cfg.scale * C.LOG2E if raw else C.LOG2E, acc)
    if masked:
      q_seg = None if t.q_seg is None else t.q_seg[:, None]
      kv_seg = None if t.kv_seg is None else t.kv_seg[None, :]
      dense = None if t.mask is None else (t.mask != 0)
      ok = C.mask_spec(cfg).allowed(qi, ki, q_seg=q_seg, kv_seg=kv_seg, dense=dense)
      if cfg.mask_mod is not None:
        ok = ok & C.mask_mod_allowed(cfg, t, qi, ki)
      p = jnp.exp2(jnp.where(ok, s * xs - lse[:, None], neg))
      ts = jnp.where(ok, ts, 0.0)
    else:
      p = jnp.exp2(s * xs - lse[:, None])
    pts = p * ts
    mu = mu + pts.sum(axis=-1)
    pd = p
    if cfg.dropout_active:
      keep = C.dropout_scale(cfg, g, r["seed"], t, acc)
      pd, pts = p * keep, pts * keep
    v = r["v"][kv, :]
    a = a + C.dot_nn(pts.astype(v.dtype), v, acc, cfg)
    if "tv" in r:
      tv = r["tv"][kv, :]
      a = a + C.dot_nn(pd.astype(tv.dtype), tv, acc, cfg)
    return mu, a

  def run(start, stop, masked, carry):
    return lax.fori_loop(start, stop, lambda j, c: body(j, masked, c), carry)

  init = (jnp.zeros((g.bq,), acc), jnp.zeros((g.bq, g.Dvp), acc))
  if "lists" in r:
    mu, a = F.list_loops(r, i, body, init)
  elif not masked:
    mu, a = run(lo, hi, False, init)
  else:
    mu, a = C.split_loop(run, lo, hi, C.full_kv_blocks(cfg, g, i), init)
  if "out" in r:
    a = a - mu[:, None] * r["out"][...].astype(acc)
  r["t_out"][...] = a.astype(r["t_out"].dtype)  # without out: a (`_delta.tangent_out`)
  r["t_lse"][...] = mu


# Shared memory the tangent kernel may plan for (sm_90: 227 KiB per block, some headroom).
SMEM_BUDGET = 200 * 1024


def _geometry(cfg: AttentionConfig, q, k, v, n_kv: int, n_q: int) -> C.Geometry:
  """The forward's geometry, with blocks shrunk to what the tangent kernel's extra tiles need.

  Per pipeline stage it loads n_kv [bk, D] tiles (k, v, and t_k, t_v when present) instead
  of the forward's two, and keeps n_q [bq, D] tiles (q, t_q) resident: halve block_kv, then
  block_q, until num_stages * n_kv * bk * D + n_q * bq * D bytes fit SMEM_BUDGET. Above
  head dim 128, at most 32 rows (the [bq, Dv] tangent accumulator and the t_q tile: 64 rows
  spilled at head dim 256). Checked by benchmarks/forward_mode_sm90.py (sm_90a, ptxas).
  """
  g = C.geometry(cfg, q.shape, k.shape, v.shape, cfg.blocks.block_q, cfg.blocks.block_kv,
                 dtype=q.dtype)
  isz = jnp.dtype(q.dtype).itemsize
  d = max(g.Dp, g.Dvp)
  smem = lambda bq, bk: g.num_stages * n_kv * bk * d * isz + n_q * bq * g.Dp * isz
  bq, bk = g.bq, g.bk
  while smem(bq, bk) > SMEM_BUDGET and bk > C.MIN_TRITON_DIM:
    bk //= 2
  while smem(bq, bk) > SMEM_BUDGET and bq > C.MIN_TRITON_DIM:
    bq //= 2
  if d > C.CAPPED_HEAD_DIM:
    bq = max(C.MIN_TRITON_DIM, min(bq, 32))
  if (bq, bk) == (g.bq, g.bk):
    return g
  warps = g.num_warps if bq >= 64 else min(g.num_warps, 4)
  return dataclasses.replace(g, bq=bq, bk=bk, num_warps=warps)


def tangent(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out, lse,
            tq, tk, tv, tbias, tconsts, mod=None, offsets=None):
  """The fused tangent pass (`flashvjp.blockwise._tangent.tangent`'s interface; `offsets`
  as `forward.forward`).

  Returns (t_out [B, H, Sq, Dv] in out's dtype, t_lse [B, H, Sq] in lse's dtype); with
  out=None, (a, t_lse): t_out before its `- t_lse * out` term (`flashvjp._delta`).
  """
  g = _geometry(cfg, q, k, v, n_kv=2 + (tk is not None) + (tv is not None),
                n_q=1 + (tq is not None))
  acc = C.acc_dtype(q.dtype)
  n_user = cfg.num_diff_consts
  tconsts = tuple(tconsts) if tconsts is not None else (None,) * n_user
  cfg, consts = C.hoist_score_mod(cfg, consts, acc)
  positions = F.positions(cfg, g)
  split = C.split_per_head(cfg, consts, acc, g.B, g.H, grads=False, offsets=offsets,
                           positions=positions)
  n_float = sum(1 for x in split.arrays if jnp.issubdtype(x.dtype, jnp.inexact))
  res_tangents, pos_tangents = C.residual_tangents(cfg, consts, tconsts, acc, g.B, g.H, split,
                                                   offsets, positions)
  msplit = C.split_mask_mod(split.cfg, mod, g.B, g.H, offsets, positions)
  cfg = msplit.cfg
  ins = F.kernel_inputs(cfg, g, q, k, v, bias, mask, q_seg, kv_seg, seed, split.arrays, mod,
                        msplit, offsets, split.pos)
  F.add_positions(ins, g, pos_tangents, "tpos")
  for n, c in enumerate(res_tangents):
    nd = c.ndim - 2
    ins.add(f"tconst{n}", c, _compat.block_spec(
        (None, None) + c.shape[2:], functools.partial(lambda nd, b, h, i: (b, h) + (0,) * nd, nd)))
  G = g.G
  q_spec = _compat.block_spec((None, None, g.bq, g.Dp), lambda b, h, i: (b, h, i, 0))
  if tq is not None:
    ins.add("tq", C.pad_operand(cfg, tq, g.Sqp, g.Dp), q_spec)
  if tk is not None:
    ins.add("tk", C.pad_operand(cfg, tk, g.Skvp, g.Dp), _compat.block_spec(
        (None, None, g.Skvp, g.Dp), lambda b, h, i: (b, h // G, 0, 0)))
  if tv is not None:
    ins.add("tv", C.pad_operand(cfg, tv, g.Skvp, g.Dvp), _compat.block_spec(
        (None, None, g.Skvp, g.Dvp), lambda b, h, i: (b, h // G, 0, 0)))
  if tbias is not None:
    tb = C.pad_pair(tbias, g)
    ins.add("tbias", tb, F.pair_spec_q(tb, g))
  if out is not None:
    ins.add("out", C.pad_seq_head(out, g.Sqp, g.Dvp),
            _compat.block_spec((None, None, g.bq, g.Dvp), lambda b, h, i: (b, h, i, 0)))
  out_dtype = out.dtype if out is not None else (acc if cfg.out_f32 else q.dtype)
  pad = C.lse_pad_value(acc)
  lse2 = lse.astype(acc) * jnp.asarray(C.LOG2E, acc)  # the kernel's exp2 domain
  lse_k = jnp.where(jnp.isfinite(lse2), lse2, pad)
  lse_k = jnp.pad(lse_k, ((0, 0), (0, 0), (0, g.Sqp - g.Sq)), constant_values=pad)
  ins.add("lse", lse_k, _compat.block_spec((None, None, g.bq), lambda b, h, i: (b, h, i)))
  masked = C.needs_mask(cfg, g, q_seg is not None, mask is not None)
  kernel = functools.partial(
      _tangent_kernel, cfg=cfg, g=g, names=ins.names, n_consts=len(split.arrays),
      scalar=split.scalar, n_float=n_float, n_tconsts=len(res_tangents), masked=masked,
      mod_scalar=msplit.scalar)
  t_out, t_lse = _compat.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((g.B, g.H, g.Sqp, g.Dvp), out_dtype),
                 jax.ShapeDtypeStruct((g.B, g.H, g.Sqp), acc)),
      grid=(g.B, g.H, g.nq),
      in_specs=ins.specs,
      out_specs=(_compat.block_spec((None, None, g.bq, g.Dvp), lambda b, h, i: (b, h, i, 0)),
                 _compat.block_spec((None, None, g.bq), lambda b, h, i: (b, h, i))),
      interpret=cfg.interpret, name="flashvjp_tangent",
      num_warps=g.num_warps, num_stages=g.num_stages,
  )(*ins.arrays)
  return t_out[:, :, : g.Sq, : g.Dv], t_lse[:, :, : g.Sq].astype(lse.dtype)
