"""Pallas backward (FlashAttention-2): preprocess, dK/dV kernel, dQ kernel, dbias kernel.

Room: Pallas kernels (backward). Probabilities are recomputed from the saved
logsumexp; nothing O(seq_q * seq_kv) is kept or written.

* preprocess: delta = rowsum(dO * O) - dlse (an XLA fusion, O(seq) work); empty
  and padded rows get lse = the largest finite number (`_common.lse_pad_value`) so
  that exp(s - lse) = 0 there (zero, finite grads; masked entries get p = 0 by a
  select), and no inf is produced for finite inputs.
* dK/dV kernel: grid (batch, kv head, kv block); loops over the G query heads of
  the group and, for each, over the q blocks that see this kv block
  (`MaskSpec.q_block_range`; with segment ids / a dense mask / a mask_mod the compacted
  PARTIAL and FULL q block lists of this kv block, `_mask.block_lists(by="kv")`), so GQA
  gradients are summed in-kernel without repeating K/V per query head. Its tiles are
  transposed ([bk, bq]: sT = k q^T, dpT = v dO^T, dV += pT dO, dK += dsT q, as
  FlashAttention-2/3), so every dot has M = block_kv rows (wgmma on sm_90) whatever block_q.
* dQ kernel: grid (batch, head, q block); loops over the allowed kv blocks (static
  bounds, or the forward's kind of block lists). When
  score_mod has differentiable consts it also writes one partial dconsts per program,
  summed outside the kernel (deterministic, no atomics).
* dbias kernel: grid over the bias' own blocks; loops over the dims the bias is
  broadcast along, so a bias broadcast over batch/heads/rows gets its reduced
  gradient without any [B, H, Sq, Skv] array (with segment ids / a dense mask / a
  mask_mod, over the block lists along the broadcast seq dim). A separate pallas_call, so XLA drops
  it when the bias gradient is unused.

A mask_mod is applied as in the forward: its block classes join the lists (per kernel,
resampled to that kernel's blocks) and its tile part masks PARTIAL blocks only.

Every output block is written by exactly one program with a sequential loop:
bitwise deterministic.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from flashvjp import _delta
from flashvjp._config import AttentionConfig
from flashvjp.pallas import _common as C
from flashvjp.pallas import _compat
from flashvjp.pallas.triton import forward as F


def _i32(x):
  """Loop bounds as int32 (with jax_enable_x64 a Python int would make int64 loop indices)."""
  return jnp.asarray(x, jnp.int32)


def _tile_grads(cfg, g, q, k, v, do, lse, delta, t, consts, seed_ref, acc, masked, n_diff,
                transposed=False, diff_pos=()):
  """Backward math of one [bq, bk] tile.

  Returns (pd, ds, dconsts): pd = dropped-out probabilities (for dV), ds = dL/d(pre-mod
  score incl. bias) (not yet multiplied by scale), dconsts = grads of the first
  `n_diff` consts from this tile (empty tuple when n_diff == 0), then of the per-position
  residual tiles t.pos[k] for k in `diff_pos` (each in its tile's shape).
  `transposed` (the dK/dV kernel): pd, ds are [bk, bq] (pT, dsT; t.bias / t.mask given
  transposed), so that every dot has M = block_kv rows (wgmma on sm_90 for block_kv >= 64,
  whatever block_q): sT = k q^T, dpT = v do^T.
  """
  diff = None
  if cfg.score_mod is not None:
    diff = tuple(consts[:n_diff])
    consts = tuple(consts[n_diff:])
  # exp2 domain (`lse` is lse * log2(e), `_preprocess`): each exponent one FFMA and one ex2.
  # With nothing else on the scores the scale is folded into log2(e): s is not formed.
  raw = cfg.score_mod is None and t.bias is None
  s, ok, sm_vjp = C.scores(dataclasses.replace(cfg, scale=1.0) if raw else cfg, g, q, k, t,
                           consts, acc, masked, diff_consts=diff, transposed=transposed,
                           diff_pos=diff_pos)
  row = (None, slice(None)) if transposed else (slice(None), None)  # lse / delta per q
  d = s * jnp.asarray(cfg.scale * C.LOG2E if raw else C.LOG2E, acc) - lse[row]
  if ok is not None:  # p = exp2(mask_value) = 0 on masked entries, whatever the row's lse
    d = jnp.where(ok, d, C.mask_value(acc))
  p = jnp.exp2(d)
  dp = C.dot_nt(v, do, acc, cfg) if transposed else C.dot_nt(do, v, acc, cfg)
  pd = p
  if cfg.dropout_active:
    keep = C.dropout_scale(cfg, g, seed_ref, t, acc, transposed=transposed)
    pd, dp = p * keep, dp * keep
  ds = p * (dp - delta[row])
  if ok is not None:
    # A masked entry contributes exactly nothing: select, not p * (...) = 0 * (dp - delta),
    # which is NaN where a masked V row overflows dp (finfo.max padding; `C.select_masked`).
    ds = C.select_masked(ok, ds)
  dconsts = ()
  if sm_vjp is not None:
    ds, dconsts = sm_vjp(ds)  # at finite masked scores (`C.masked_scores_for_mod`)
  return pd, ds, tuple(dconsts)


def _preprocess(out, lse, dout, dlse, g: C.Geometry, acc):
  """delta = rowsum(dO * O) - dlse and the backward lse in the exp2 domain (lse * log2(e),
  as `_tile_grads` reads it), padded.

  Empty (lse = -inf) and padded rows get `lse_pad_value` (finite): p = 0 there.
  """
  delta = _delta.delta(out, dout, dlse, acc)
  big = C.lse_pad_value(acc)
  lse2 = lse.astype(acc) * jnp.asarray(C.LOG2E, acc)
  lse_b = jnp.where(jnp.isfinite(lse2), lse2, big)  # no -inf operand (debug_infs)
  pad = ((0, 0), (0, 0), (0, g.Sqp - g.Sq))
  return jnp.pad(delta, pad), jnp.pad(lse_b, pad, constant_values=big)


# ---- dK / dV ------------------------------------------------------------------

def _group5(x, g: C.Geometry):
  """A bias / mask / block-list array [B', H', ...] -> [B', Hkv|1, G|1, ...] (free reshape)."""
  if x.shape[1] == 1:
    return x[:, :, None]
  return x.reshape((x.shape[0], g.Hkv, g.G) + x.shape[2:])


def _positions_gi(r, prefix, gi, g: C.Geometry, i, j):
  """The per-position residual tiles of head gi for the dK/dV kernel: q ones [bq] (rows of
  the whole [G, Sqp]), kv ones [bk] (this program's block), as [bq, 1] / [1, bk] tiles
  ([1, bq] / [bk, 1] transposed), rel ones [bq, bk] ([bk, bq]) from the whole [G, L] rows."""
  q_ax, kv_ax = ((None, slice(None)), (slice(None), None)) if g.transposed else (
      (slice(None), None), (None, slice(None)))
  rows = _compat.ds(i * g.bq, g.bq)
  qs = [r[f"{prefix}q{n}"][gi, rows][q_ax] for n in range(C.count_refs(r, f"{prefix}q"))]
  kvs = [r[f"{prefix}kv{n}"][gi, :][kv_ax] for n in range(C.count_refs(r, f"{prefix}kv"))]
  n_rel = C.count_refs(r, f"{prefix}rel")
  e = F.rel_index(g, i, j, g.transposed) if n_rel else None
  rels = [r[f"{prefix}rel{n}"][gi, e] for n in range(n_rel)]
  return tuple(qs + kvs + rels)


def _dkdv_kernel(*refs, cfg, g: C.Geometry, names, n_consts, scalar, masked, mod_scalar=(),
                 n_q_pos=0, n_kv_diff=0):
  masked_any = masked
  r = dict(zip(names + ["dk", "dv"] + [f"dposkv{n}" for n in range(n_kv_diff)], refs))
  diff_pos = tuple(range(n_q_pos, n_q_pos + n_kv_diff))  # the float kv residuals in t.pos
  acc = C.acc_dtype(r["q"].dtype)
  b, hk, j = _compat.program_id(0), _compat.program_id(1), _compat.program_id(2)
  k, v = r["k"][...], r["v"][...]
  const_refs = [r[f"const{n}"] for n in range(n_consts)]  # [G, ...] per-head residuals
  kv_seg = r["kv_seg"][...] if "kv_seg" in r else None
  off = C.load_offsets(r.get("offsets"))
  lo, hi = C.mask_spec(cfg).q_block_range(j, g.bq, g.bk, g.nq)

  def lead(name, gi):
    return (gi if r[name].shape[0] != 1 else 0,)

  def group_body(gi, carry):
    h = hk * g.G + gi
    consts = C.load_head_consts(const_refs, scalar, (gi,))
    mconsts = F.load_mod_consts(r, mod_scalar, (gi,))

    def q_body(i, masked, carry):
      dk, dv, dpk = carry
      rows = _compat.ds(i * g.bq, g.bq)
      q, do = r["q"][gi, rows, :], r["do"][gi, rows, :]
      t = C.TileInputs(b=b, h=h, i=i, j=j, kv_seg=kv_seg, mod=mconsts, off=off)
      t.pos = _positions_gi(r, "pos", gi, g, i, j)
      t.mpos = _positions_gi(r, "mpos", gi, g, i, j)
      for name in ("bias", "mask"):  # [bq|1, bk|1] tiles (used transposed when g.transposed)
        if name in r:
          x = C.pair_tile(r[name], lead(name, gi), i, j, g, full_q=True, full_kv=False)
          setattr(t, name, x.T if g.transposed else x)
      if kv_seg is not None:
        t.q_seg = r["q_seg"][rows]
      pd, ds, dc = _tile_grads(cfg, g, q, k, v, do, r["lse"][gi, rows], r["delta"][gi, rows],
                               t, consts, r.get("seed"), acc, masked, 0,
                               transposed=g.transposed, diff_pos=diff_pos)
      dpk = tuple(a + jnp.reshape(c, (g.bk,)).astype(a.dtype) for a, c in zip(dpk, dc))
      ds = ds * jnp.asarray(cfg.scale, acc)
      if g.transposed:  # pd, ds are [bk, bq]: all four dots have M = bk (wgmma with bk >= 64)
        dv = dv + C.dot_nn(pd.astype(do.dtype), do, acc, cfg)
        dk = dk + C.dot_nn(ds.astype(q.dtype), q, acc, cfg)
      else:  # [bq, bk] (the launch table's choice where transposed tiles spill)
        dv = dv + C.dot_tn(pd.astype(do.dtype), do, acc, cfg)
        dk = dk + C.dot_tn(ds.astype(q.dtype), q, acc, cfg)
      return dk, dv, dpk

    def run(start, stop, masked, carry):
      return lax.fori_loop(start, stop, lambda i, c: q_body(i, masked, c), carry)

    carry = carry + (tuple(jnp.zeros((g.bk,), acc) for _ in range(n_kv_diff)),)
    if "lists" in r:  # segment ids / dense mask / mask_mod: this kv block's q block lists
      gl = lead("lists", gi)
      counts = (r["counts"][gl + (0, j)], r["counts"][gl + (1, j)])
      dk, dv, dpk = C.list_loops(counts, lambda kind, t: r["lists"][gl + (kind, t)], q_body,
                                 carry)
    elif not masked_any:
      dk, dv, dpk = run(lo, hi, False, carry)
    else:
      dk, dv, dpk = C.split_loop(run, lo, hi, C.full_q_blocks(cfg, g, j), carry)
    for n, d in enumerate(dpk):  # d(kv residual) of head gi: this kv block's columns
      r[f"dposkv{n}"][gi, :] = d.astype(r[f"dposkv{n}"].dtype)
    return dk, dv

  init = (jnp.zeros((g.bk, g.Dp), acc), jnp.zeros((g.bk, g.Dvp), acc))
  dk, dv = lax.fori_loop(_i32(0), _i32(g.G), group_body, init)
  r["dk"][...] = dk.astype(r["dk"].dtype)
  r["dv"][...] = dv.astype(r["dv"].dtype)


def _add_positions_grouped(ins, g: C.Geometry, pos, prefix):
  """Per-position residuals for the dK/dV kernel's (batch, kv head, kv block) grid: q ones
  [B, Hkv, G, Sqp] whole, kv ones [B, Hkv, G, bk] this program's block, rel rows
  [B, Hkv, G, Sqp + Skvp] whole."""
  if pos is None:
    return
  L = g.Sqp + g.Skvp
  for n, x in enumerate(pos.rel):
    ins.add(f"{prefix}rel{n}", x[..., pos.rel_slice(g.Sqp, g.Skvp)].reshape(g.B, g.Hkv, g.G, L),
            _compat.block_spec((None, None, g.G, L), lambda b, h, j: (b, h, 0, 0)))
  for n, x in enumerate(pos.q):
    ins.add(f"{prefix}q{n}", x[..., : g.Sqp].reshape(g.B, g.Hkv, g.G, g.Sqp), _compat.block_spec(
        (None, None, g.G, g.Sqp), lambda b, h, j: (b, h, 0, 0)))
  for n, x in enumerate(pos.kv):
    ins.add(f"{prefix}kv{n}", x[..., : g.Skvp].reshape(g.B, g.Hkv, g.G, g.Skvp),
            _compat.block_spec((None, None, g.G, g.bk), lambda b, h, j: (b, h, 0, j)))


def _grad_dtype(g: C.Geometry, dtype, acc):
  """The dK / dV kernel's output dtype: the inputs' (rounded once in the kernel, no float32
  copy of dk / dv in temp), float32 above head dim 128, where the rounding epilogue made
  the causal kernel spill 4 bytes on sm_90a (benchmarks/triton_sm90.py: d192 / d256)."""
  return dtype if max(g.Dp, g.Dvp) <= 128 else acc


def _dkdv(cfg, g, qp, kp, vp, dop, lse_p, delta_p, bias_p, mask_p, q_seg_p, kv_seg_p, lists_kv,
          seed, consts, scalar, masked, acc, msplit=None, offsets=None, pos=None):
  G = g.G
  ins = C.KernelInputs()
  ins.add("q", qp.reshape(g.B, g.Hkv, G, g.Sqp, g.Dp),
          _compat.block_spec((None, None, G, g.Sqp, g.Dp), lambda b, h, j: (b, h, 0, 0, 0)))
  ins.add("do", dop.reshape(g.B, g.Hkv, G, g.Sqp, g.Dvp),
          _compat.block_spec((None, None, G, g.Sqp, g.Dvp), lambda b, h, j: (b, h, 0, 0, 0)))
  ins.add("k", kp, _compat.block_spec((None, None, g.bk, g.Dp), lambda b, h, j: (b, h, j, 0)))
  ins.add("v", vp, _compat.block_spec((None, None, g.bk, g.Dvp), lambda b, h, j: (b, h, j, 0)))
  for name, x in (("lse", lse_p), ("delta", delta_p)):
    ins.add(name, x.reshape(g.B, g.Hkv, G, g.Sqp),
            _compat.block_spec((None, None, G, g.Sqp), lambda b, h, j: (b, h, 0, 0)))
  for name, x in (("bias", bias_p), ("mask", mask_p)):
    if x is None:
      continue
    x5 = _group5(x, g)
    Bp, Hp, Gp, Sq2, Sk2 = x5.shape
    ins.add(name, x5, _compat.block_spec(
        (None, None, Gp, Sq2, g.bk if Sk2 != 1 else 1),
        functools.partial(lambda Bp, Hp, Sk2, b, h, j: (
            b if Bp != 1 else 0, h if Hp != 1 else 0, 0, 0, j if Sk2 != 1 else 0), Bp, Hp, Sk2)))
  if q_seg_p is not None:
    ins.add("q_seg", q_seg_p, _compat.block_spec((None, g.Sqp), lambda b, h, j: (b, 0)))
    ins.add("kv_seg", kv_seg_p, _compat.block_spec((None, g.bk), lambda b, h, j: (b, j)))
  if lists_kv is not None:  # _common.block_lists(by="kv"), grouped like the bias / mask
    counts, blocks = (_group5(x, g) for x in lists_kv)  # [B', Hkv|1, G|1, 2, nk], [.., nk, 2, nq]
    Bl, Hl, Gl = counts.shape[:3]
    bh = lambda b, h: (b if Bl != 1 else 0, h if Hl != 1 else 0)
    ins.add("counts", counts, _compat.block_spec(
        (None, None, Gl, 2, g.nk), lambda b, h, j: bh(b, h) + (0, 0, 0)))
    ins.add("lists", blocks, _compat.block_spec(
        (None, None, Gl, None, 2, g.nq), lambda b, h, j: bh(b, h) + (0, j, 0, 0)))
  if cfg.dropout_active:
    ins.add("seed", seed, F._full_spec(seed))
  F.add_offsets(ins, offsets)
  mod_arrays = () if msplit is None else msplit.arrays
  for prefix, arrays in (("const", consts), ("mconst", mod_arrays)):
    for n, c in enumerate(arrays):  # per-(b, h) residuals [B, H, ...] -> [B, Hkv, G, ...]
      c5 = c.reshape((g.B, g.Hkv, G) + c.shape[2:])
      nd = c.ndim - 2
      ins.add(f"{prefix}{n}", c5, _compat.block_spec(
          (None, None, G) + c.shape[2:],
          functools.partial(lambda nd, b, h, j: (b, h, 0) + (0,) * nd, nd)))
  _add_positions_grouped(ins, g, pos, "pos")
  _add_positions_grouped(ins, g, None if msplit is None else msplit.pos, "mpos")
  n_kv_diff = 0 if pos is None else pos.n_kv_diff
  kernel = functools.partial(_dkdv_kernel, cfg=cfg, g=g, names=ins.names,
                             n_consts=len(consts), scalar=scalar, masked=masked,
                             mod_scalar=() if msplit is None else msplit.scalar,
                             n_q_pos=0 if pos is None else len(pos.q), n_kv_diff=n_kv_diff)
  dpos_shape = jax.ShapeDtypeStruct((g.B, g.Hkv, G, g.Skvp), acc)
  dpos_spec = _compat.block_spec((None, None, G, g.bk), lambda b, h, j: (b, h, 0, j))
  dk, dv, *dposkv = _compat.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((g.B, g.Hkv, g.Skvp, g.Dp), _grad_dtype(g, kp.dtype, acc)),
                 jax.ShapeDtypeStruct((g.B, g.Hkv, g.Skvp, g.Dvp), _grad_dtype(g, vp.dtype, acc)),
                 *(dpos_shape,) * n_kv_diff),
      grid=(g.B, g.Hkv, g.nk),
      in_specs=ins.specs,
      out_specs=(_compat.block_spec((None, None, g.bk, g.Dp), lambda b, h, j: (b, h, j, 0)),
                 _compat.block_spec((None, None, g.bk, g.Dvp), lambda b, h, j: (b, h, j, 0)),
                 *(dpos_spec,) * n_kv_diff),
      interpret=cfg.interpret, name="flashvjp_bwd_dkdv",
      num_warps=g.num_warps, num_stages=g.num_stages,
  )(*ins.arrays)
  return dk, dv, tuple(d.reshape(g.B, g.H, g.Skvp) for d in dposkv)


# ---- dQ (+ score_mod dconsts partials) ----------------------------------------

def _dq_kernel(*refs, cfg, g: C.Geometry, names, n_consts, scalar, n_diff, masked, mod_scalar=(),
               n_q_diff=0):
  masked_any = masked
  r = dict(zip(names + ["dq"] + [f"dconst{n}" for n in range(n_diff)]
               + [f"dposq{n}" for n in range(n_q_diff)], refs))
  diff_pos = tuple(range(n_q_diff))  # the float q residuals lead t.pos
  acc = C.acc_dtype(r["q"].dtype)
  b, h, i = _compat.program_id(0), _compat.program_id(1), _compat.program_id(2)
  q, do = r["q"][...], r["do"][...]
  lse, delta = r["lse"][...], r["delta"][...]
  consts = C.load_head_consts([r[f"const{n}"] for n in range(n_consts)], scalar)
  mconsts = F.load_mod_consts(r, mod_scalar)
  off = C.load_offsets(r.get("offsets"))
  lo, hi = C.mask_spec(cfg).kv_block_range(i, g.bq, g.bk, g.nk)

  def body(j, masked, carry):
    dq, dcs = carry
    t = F.load_tile_inputs(r, g, b, h, i, j, mconsts, off)
    cols = _compat.ds(j * g.bk, g.bk)
    k = r["k"][cols, :]
    _, ds, dc = _tile_grads(cfg, g, q, k, r["v"][cols, :], do, lse, delta, t, consts,
                            r.get("seed"), acc, masked, n_diff, diff_pos=diff_pos)
    ds = ds * jnp.asarray(cfg.scale, acc)
    dq = dq + C.dot_nn(ds.astype(k.dtype), k, acc, cfg)
    dc = tuple(dc[:n_diff]) + tuple(jnp.reshape(c, (g.bq,)) for c in dc[n_diff:])
    dcs = tuple(a + c.astype(a.dtype) for a, c in zip(dcs, dc))
    return dq, dcs

  def run(start, stop, masked, carry):
    return lax.fori_loop(start, stop, lambda j, c: body(j, masked, c), carry)

  dc0 = tuple(jnp.zeros(jnp.shape(consts[n]), r[f"dconst{n}"].dtype) for n in range(n_diff))
  dc0 += tuple(jnp.zeros((g.bq,), acc) for _ in range(n_q_diff))
  init = (jnp.zeros((g.bq, g.Dp), acc), dc0)
  if "lists" in r:  # segment ids / dense mask / mask_mod: the kv block lists of q block i
    dq, dcs = F.list_loops(r, i, body, init)
  elif not masked_any:
    dq, dcs = run(lo, hi, False, init)
  else:
    dq, dcs = C.split_loop(run, lo, hi, C.full_kv_blocks(cfg, g, i), init)
  r["dq"][...] = dq.astype(r["dq"].dtype)
  for n, d in enumerate(dcs[:n_diff]):
    r[f"dconst{n}"][...] = jnp.reshape(d, r[f"dconst{n}"].shape)
  for n, d in enumerate(dcs[n_diff:]):  # d(q residual): this q block's rows
    r[f"dposq{n}"][...] = d.astype(r[f"dposq{n}"].dtype)


def _dq(cfg, g, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, scalar, dop, lse_p, delta_p,
        masked, acc, n_diff, mod=None, msplit=None, offsets=None, pos=None):
  ins = F.kernel_inputs(cfg, g, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, mod, msplit,
                        offsets, pos)
  ins.add("do", dop, _compat.block_spec((None, None, g.bq, g.Dvp), lambda b, h, i: (b, h, i, 0)))
  for name, x in (("lse", lse_p), ("delta", delta_p)):
    ins.add(name, x, _compat.block_spec((None, None, g.bq), lambda b, h, i: (b, h, i)))
  out_shape = [jax.ShapeDtypeStruct((g.B, g.H, g.Sqp, g.Dp), q.dtype)]
  out_specs = [_compat.block_spec((None, None, g.bq, g.Dp), lambda b, h, i: (b, h, i, 0))]
  for c in consts[:n_diff]:  # one partial d(residual) per program: [B, H, nq, ...]
    rest = c.shape[2:]
    nd = len(rest)
    out_shape.append(jax.ShapeDtypeStruct((g.B, g.H, g.nq) + rest, jnp.promote_types(c.dtype, acc)))
    out_specs.append(_compat.block_spec(
        (None, None, None) + rest, functools.partial(lambda nd, b, h, i: (b, h, i) + (0,) * nd, nd)))
  n_q_diff = 0 if pos is None else pos.n_q_diff
  for _ in range(n_q_diff):
    out_shape.append(jax.ShapeDtypeStruct((g.B, g.H, g.Sqp), acc))
    out_specs.append(_compat.block_spec((None, None, g.bq), lambda b, h, i: (b, h, i)))
  kernel = functools.partial(_dq_kernel, cfg=cfg, g=g, names=ins.names, n_consts=len(consts),
                             scalar=scalar, n_diff=n_diff, masked=masked,
                             mod_scalar=() if msplit is None else msplit.scalar,
                             n_q_diff=n_q_diff)
  outs = _compat.pallas_call(
      kernel, out_shape=tuple(out_shape), grid=(g.B, g.H, g.nq), in_specs=ins.specs,
      out_specs=tuple(out_specs), interpret=cfg.interpret, name="flashvjp_bwd_dq",
      num_warps=g.num_warps, num_stages=g.num_stages,
  )(*ins.arrays)
  dq, partials, dposq = outs[0], outs[1:1 + n_diff], outs[1 + n_diff:]
  dres = tuple(p.sum(axis=2) for p in partials)  # [B, H, ...]
  return dq, dres, tuple(dposq)


# ---- dbias ----------------------------------------------------------------------

def _add_whole_rest(ins, cfg, g: C.Geometry, seed, offsets, consts, msplit, pos):
  """The seed, global offsets, score_mod / mask_mod residuals and the per-position residuals
  of the score_mod ("pos") and the mask_mod ("mpos") as whole [B, H, ...] inputs (the dbias
  and drel kernels index them by (b, h) themselves)."""
  if cfg.dropout_active:
    ins.add("seed", seed, F._full_spec(seed))
  F.add_offsets(ins, offsets)
  for n, c in enumerate(consts):
    ins.add(f"const{n}", c, F._full_spec(c))
  for n, c in enumerate(() if msplit is None else msplit.arrays):
    ins.add(f"mconst{n}", c, F._full_spec(c))
  for prefix, p in (("pos", pos), ("mpos", None if msplit is None else msplit.pos)):
    if p is None:
      continue
    for kind, xs, cut in (("q", p.q, slice(0, g.Sqp)), ("kv", p.kv, slice(0, g.Skvp)),
                          ("rel", p.rel, p.rel_slice(g.Sqp, g.Skvp))):
      for n, x in enumerate(xs):
        x = x[..., cut]
        ins.add(f"{prefix}{kind}{n}", x, F._full_spec(x))


def _positions_bh(r, prefix, b, h, g: C.Geometry, i, j):
  """The per-position residual tiles of tile (i, j) of (b, h) from whole inputs
  (`_add_whole_rest`): [bq, 1], then [1, bk], then [bq, bk]."""
  rows, cols = _compat.ds(i * g.bq, g.bq), _compat.ds(j * g.bk, g.bk)
  n_rel = C.count_refs(r, f"{prefix}rel")
  e = F.rel_index(g, i, j) if n_rel else None
  return tuple(
      [r[f"{prefix}q{n}"][b, h, rows][:, None] for n in range(C.count_refs(r, f"{prefix}q"))]
      + [r[f"{prefix}kv{n}"][b, h, cols][None, :] for n in range(C.count_refs(r, f"{prefix}kv"))]
      + [r[f"{prefix}rel{n}"][b, h, e] for n in range(n_rel)])


def _dbias_kernel(*refs, cfg, g: C.Geometry, names, n_consts, scalar, masked, bias_shape,
                  mod_scalar=()):
  r = dict(zip(names + ["dbias"], refs))
  acc = C.acc_dtype(r["q"].dtype)
  Bb, Hb, Sqb, Skb = bias_shape
  pb, ph, pi, pj = (_compat.program_id(a) for a in range(4))
  bias_tile = r["bias"][...]
  const_refs = [r[f"const{n}"] for n in range(n_consts)]  # [B, H, ...] per-head residuals
  nb = g.B if Bb == 1 else 1
  nh = g.H if Hb == 1 else 1
  spec = C.mask_spec(cfg)
  sparse = "q_seg" in r or "mask" in r or cfg.mask_mod is not None  # block lists / classes
  off = C.load_offsets(r.get("offsets"))

  def bh_body(t_bh, accum):
    b = pb if Bb != 1 else (t_bh // nh if nh != 1 else t_bh)
    h = ph if Hb != 1 else (t_bh % nh if nh != 1 else t_bh)
    consts = C.load_head_consts(const_refs, scalar, (b, h))
    mconsts = F.load_mod_consts(r, mod_scalar, (b, h))

    def tile(i, j, masked, accum):
      rows, cols = _compat.ds(i * g.bq, g.bq), _compat.ds(j * g.bk, g.bk)
      q, do = r["q"][b, h, rows, :], r["do"][b, h, rows, :]
      hkv = h // g.G
      k, v = r["k"][b, hkv, cols, :], r["v"][b, hkv, cols, :]
      t = C.TileInputs(b=b, h=h, i=i, j=j, bias=bias_tile, mod=mconsts, off=off)
      if "mask" in r:
        m = r["mask"]
        t.mask = C.pair_tile(m, (0 if m.shape[0] == 1 else b, 0 if m.shape[1] == 1 else h),
                             i, j, g, full_q=True, full_kv=True)
      if "q_seg" in r:
        t.q_seg, t.kv_seg = r["q_seg"][b, rows], r["kv_seg"][b, cols]
      for prefix in ("pos", "mpos"):
        setattr(t, prefix, _positions_bh(r, prefix, b, h, g, i, j))
      _, ds, _ = _tile_grads(cfg, g, q, k, v, do, r["lse"][b, h, rows],
                             r["delta"][b, h, rows], t, consts, r.get("seed"), acc, masked, 0)
      if Sqb == 1:
        ds = ds.sum(axis=0, keepdims=True)
      if Skb == 1:
        ds = ds.sum(axis=1, keepdims=True)
      return accum + ds

    if sparse and Sqb != 1 and Skb != 1:
      # One (q, kv) block per program: the tile itself, with the elementwise mask (an
      # empty block gives p = 0, ds = 0); no loop or branch inside the (b, h) loop.
      return tile(pi, pj, True, accum)
    if sparse:  # the compacted block lists: of q block i (by="q") or kv block pj (by="kv")
      x = r["lists"]
      lb = (0 if x.shape[0] == 1 else b, 0 if x.shape[1] == 1 else h)

      def row_lists(row, body, accum):
        counts = (r["counts"][lb + (0, row)], r["counts"][lb + (1, row)])
        return C.list_loops(counts, lambda kind, n: x[lb + (row, kind, n)], body, accum)

      if Skb != 1:  # bias broadcast over q: the q blocks that see kv block pj
        return row_lists(pj, lambda i, mk, a: tile(i, pj, mk, a), accum)
      q_row = lambda i, a: row_lists(i, lambda j, mk, a_: tile(i, j, mk, a_), a)
      return q_row(pi, accum) if Sqb != 1 else lax.fori_loop(_i32(0), _i32(g.nq), q_row, accum)

    def i_body(i, accum):
      lo, hi = spec.kv_block_range(i, g.bq, g.bk, g.nk)
      if Skb != 1:
        lo, hi = jnp.maximum(lo, pj), jnp.minimum(hi, pj + 1)
      return lax.fori_loop(lo, hi, lambda j, a: tile(i, j, masked, a), accum)

    i_lo, i_hi = (pi, pi + 1) if Sqb != 1 else (_i32(0), _i32(g.nq))
    return lax.fori_loop(i_lo, i_hi, i_body, accum)

  init = jnp.zeros(r["dbias"].shape, acc)
  r["dbias"][...] = lax.fori_loop(_i32(0), _i32(nb * nh), bh_body, init).astype(r["dbias"].dtype)


def _dbias(cfg, g, qp, kp, vp, dop, lse_p, delta_p, bias_p, mask_p, q_seg_p, kv_seg_p, mask_b,
           seed, consts, scalar, masked, acc, mod_cls=None, msplit=None, offsets=None, pos=None):
  ins = C.KernelInputs()
  Bb, Hb, Sqb, Skb = bias_p.shape
  bq, bk = (g.bq if Sqb != 1 else 1), (g.bk if Skb != 1 else 1)
  counts = lists = None
  sparse = q_seg_p is not None or mask_b is not None or mod_cls is not None
  if sparse and (Sqb == 1 or Skb == 1):
    # A program loops over kv blocks (bias broadcast over kv: lists per q block) or over
    # q blocks (broadcast over q: lists per kv block). A bias with both seq dims has one
    # block per program and needs no list.
    by = "q" if Skb == 1 else "kv"
    counts, lists = C.block_lists(cfg, g, q_seg_p, kv_seg_p, mask_b, by=by, mod_cls=mod_cls)
  for name, x in (("q", qp), ("k", kp), ("v", vp), ("do", dop), ("lse", lse_p),
                  ("delta", delta_p), ("mask", mask_p), ("q_seg", q_seg_p), ("kv_seg", kv_seg_p),
                  ("counts", counts), ("lists", lists)):
    if x is not None:
      ins.add(name, x, F._full_spec(x))
  ins.add("bias", bias_p, _compat.block_spec((None, None, bq, bk), lambda b, h, i, j: (b, h, i, j)))
  _add_whole_rest(ins, cfg, g, seed, offsets, consts, msplit, pos)
  kernel = functools.partial(_dbias_kernel, cfg=cfg, g=g, names=ins.names, n_consts=len(consts),
                             scalar=scalar, masked=masked, bias_shape=bias_p.shape,
                             mod_scalar=() if msplit is None else msplit.scalar)
  grid = (Bb, Hb, g.nq if Sqb != 1 else 1, g.nk if Skb != 1 else 1)
  gb = C.relaunch(cfg, g, "dbias", qp.dtype)
  return _compat.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(bias_p.shape, acc), grid=grid, in_specs=ins.specs,
      out_specs=_compat.block_spec((None, None, bq, bk), lambda b, h, i, j: (b, h, i, j)),
      interpret=cfg.interpret, name="flashvjp_bwd_dbias",
      num_warps=gb.num_warps, num_stages=gb.num_stages,
  )(*ins.arrays)


# ---- d(rel residuals): rows read by kv_idx - q_idx ----------------------------------

def _drel_kernel(*refs, cfg, g: C.Geometry, names, n_consts, scalar, mod_scalar, n_fixed_pos,
                 n_rel_diff):
  """Program (b, h, t): the tiles of block diagonal t (kv block - q block = t - (nq - 1)),
  whose elements all map to the same 2 * block - 1 differences: their d(rel residual)
  tiles summed elementwise, in order (deterministic); `_common.rel_grad_rows` reduces the
  diagonals. With segment ids / a dense mask / a mask_mod, only the diagonal's non-empty
  tiles (`_common.diagonal_lists`: PARTIAL ones masked, FULL ones not)."""
  r = dict(zip(names + [f"drel{n}" for n in range(n_rel_diff)], refs))
  acc = C.acc_dtype(r["q"].dtype)
  b, h, t_diag = _compat.program_id(0), _compat.program_id(1), _compat.program_id(2)
  consts = C.load_head_consts([r[f"const{n}"] for n in range(n_consts)], scalar, (b, h))
  mconsts = F.load_mod_consts(r, mod_scalar, (b, h))
  off = C.load_offsets(r.get("offsets"))
  spec = C.mask_spec(cfg)
  shift = t_diag - (g.nq - 1)  # kv block - q block
  diff_pos = tuple(range(n_fixed_pos, n_fixed_pos + n_rel_diff))

  def tile(i, masked, accum):
    j = i + shift
    rows, cols = _compat.ds(i * g.bq, g.bq), _compat.ds(j * g.bk, g.bk)
    hkv = h // g.G
    t = C.TileInputs(b=b, h=h, i=i, j=j, mod=mconsts, off=off)
    for name in ("bias", "mask"):
      if name in r:
        x = r[name]
        lead = (0 if x.shape[0] == 1 else b, 0 if x.shape[1] == 1 else h)
        setattr(t, name, C.pair_tile(x, lead, i, j, g, full_q=True, full_kv=True))
    if "q_seg" in r:
      t.q_seg, t.kv_seg = r["q_seg"][b, rows], r["kv_seg"][b, cols]
    t.pos = _positions_bh(r, "pos", b, h, g, i, j)
    t.mpos = _positions_bh(r, "mpos", b, h, g, i, j)
    _, _, dc = _tile_grads(cfg, g, r["q"][b, h, rows, :], r["k"][b, hkv, cols, :],
                           r["v"][b, hkv, cols, :], r["do"][b, h, rows, :],
                           r["lse"][b, h, rows], r["delta"][b, h, rows], t, consts,
                           r.get("seed"), acc, masked, 0, diff_pos=diff_pos)
    return tuple(a + c.astype(a.dtype) for a, c in zip(accum, dc))

  init = tuple(jnp.zeros((g.bq, g.bk), acc) for _ in range(n_rel_diff))
  if "dlists" in r:  # segment ids / dense mask / mask_mod: this diagonal's non-empty tiles
    x = r["dlists"]
    lb = (0 if x.shape[0] == 1 else b, 0 if x.shape[1] == 1 else h)
    counts = (r["dcounts"][lb + (0, t_diag)], r["dcounts"][lb + (1, t_diag)])
    out = C.list_loops(counts, lambda kind, n: x[lb + (t_diag, kind, n)], tile, init)
    for n, d in enumerate(out):
      r[f"drel{n}"][...] = d
    return
  # The diagonal's tiles hold kv - q in [shift * n - (n - 1), shift * n + (n - 1)]: outside
  # the causal / window band the whole diagonal is empty (no loop; no branch inside the loop,
  # so Triton pipelines its loads). Padding: the elementwise mask.
  n = g.bq
  i_lo, i_hi = jnp.maximum(0, -shift), jnp.minimum(g.nq, g.nk - shift)
  live = jnp.asarray(True)
  if spec.right is not None:
    live = live & (shift * n - (n - 1) <= spec.right)
  if spec.left is not None:
    live = live & (shift * n + (n - 1) >= -spec.left)
  i_hi = jnp.where(live, i_hi, i_lo)
  out = lax.fori_loop(_i32(i_lo), _i32(i_hi), lambda i, a: tile(i, True, a), init)
  for n, d in enumerate(out):
    r[f"drel{n}"][...] = d


def _drel(cfg, g, q, k, v, dout, out, lse, dlse, bias, mask, q_seg, kv_seg, seed, consts,
          scalar, msplit, pos, offsets, acc, mod=None):
  """d(rel residuals) [B, H, rel_sqp + Skvp'] of the float rel residuals (`PosResiduals.rel`),
  by a kernel over the block diagonals (grid (B, H, nq + nk - 1), square blocks)."""
  ins = C.KernelInputs()
  delta_p, lse_p = _preprocess(out, lse, dout, dlse, g, acc)
  mask_p = C.pad_pair(mask, g)
  q_seg_p, kv_seg_p = C.pad_segments(q_seg, kv_seg, g)
  for name, x in (("q", C.pad_operand(cfg, q, g.Sqp, g.Dp)), ("k", C.pad_operand(cfg, k, g.Skvp, g.Dp)),
                  ("v", C.pad_operand(cfg, v, g.Skvp, g.Dvp)),
                  ("do", C.pad_operand(cfg, dout, g.Sqp, g.Dvp)), ("lse", lse_p), ("delta", delta_p),
                  ("bias", C.pad_pair(bias, g)),
                  ("mask", None if mask_p is None else mask_p.astype(jnp.int8)),
                  ("q_seg", q_seg_p), ("kv_seg", kv_seg_p)):
    if x is not None:
      ins.add(name, x, F._full_spec(x))
  lists = C.diagonal_lists(cfg, g, q_seg_p, kv_seg_p, mask_p, C.mod_classes(cfg, g, mod))
  if lists is not None:
    ins.add("dcounts", lists[0], F._full_spec(lists[0]))
    ins.add("dlists", lists[1], F._full_spec(lists[1]))
  _add_whole_rest(ins, cfg, g, seed, offsets, consts, msplit, pos)
  n_rel = pos.n_rel_diff
  kernel = functools.partial(_drel_kernel, cfg=cfg, g=g, names=ins.names, n_consts=len(consts),
                             scalar=scalar, mod_scalar=() if msplit is None else msplit.scalar,
                             n_fixed_pos=len(pos.q) + len(pos.kv), n_rel_diff=n_rel)
  n_diag = g.nq + g.nk - 1
  tiles = _compat.pallas_call(
      kernel, out_shape=(jax.ShapeDtypeStruct((g.B, g.H, n_diag, g.bq, g.bk), acc),) * n_rel,
      grid=(g.B, g.H, n_diag), in_specs=ins.specs,
      out_specs=(_compat.block_spec((None, None, None, g.bq, g.bk),
                                    lambda b, h, t: (b, h, t, 0, 0)),) * n_rel,
      interpret=cfg.interpret, name="flashvjp_bwd_drel",
      num_warps=g.num_warps, num_stages=g.num_stages,
  )(*ins.arrays)
  return tuple(C.rel_grad_rows(x, pos, g) for x in tiles)


# ---- entry point ------------------------------------------------------------------

def backward(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed, consts,
             out, lse, dout, dlse, mod=None, offsets=None):
  """Hand-written Pallas backward.

  Args:
    cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts: as `forward`.
    out: [B, H, Sq, Dv] forward output; lse: [B, H, Sq] its logsumexp (-inf on empty rows).
    dout: [B, H, Sq, Dv] cotangent of out; dlse: [B, H, Sq] cotangent of lse (or None).
    mod: None, or the mask_mod's `ModInputs` (as `forward`).
    offsets: None, or the global (b0, h0, q0, kv0) of local element 0 (as `forward`).

  Returns:
    (dq [B, H, Sq, D], dk [B, Hkv, Skv, D], dv [B, Hkv, Skv, Dv] in the input dtype,
     dbias in bias' own shape and dtype (or None), tuple of grads of the
     cfg.num_diff_consts differentiable score_mod consts).
  """
  bq_dkv, bk_dkv = cfg.blocks.dkv
  bq_dq, bk_dq = cfg.blocks.dq
  acc = C.acc_dtype(q.dtype)
  n_user_diff = cfg.num_diff_consts
  user_consts = tuple(consts)
  cfg, consts = C.hoist_score_mod(cfg, consts, acc)
  g = C.geometry(cfg, q.shape, k.shape, v.shape, bq_dkv, bk_dkv, role="dkdv", dtype=q.dtype)
  g_dq = C.geometry(cfg, q.shape, k.shape, v.shape, bq_dq, bk_dq, role="dq", dtype=q.dtype)
  # per-position residuals cover both kernels' padded lengths (each slices its own)
  positions = C.Positions(cfg.seq_q, cfg.seq_kv, max(g.Sqp, g_dq.Sqp), max(g.Skvp, g_dq.Skvp),
                          rel=True)
  split = C.split_per_head(cfg, tuple(jnp.asarray(c) for c in consts), acc, q.shape[0],
                           q.shape[1], grads=True, offsets=offsets, positions=positions)
  consts, scalar, n_diff, pos = split.arrays, split.scalar, split.n_diff, split.pos
  msplit = C.split_mask_mod(split.cfg, mod, q.shape[0], q.shape[1], offsets, positions)
  cfg = msplit.cfg
  has_seg, has_mask = q_seg is not None, mask is not None

  # dK / dV (and dbias, which shares its blocks)
  masked = C.needs_mask(cfg, g, has_seg, has_mask)
  delta_p, lse_p = _preprocess(out, lse, dout, dlse, g, acc)
  qp, dop = C.pad_operand(cfg, q, g.Sqp, g.Dp), C.pad_operand(cfg, dout, g.Sqp, g.Dvp)
  kp, vp = C.pad_operand(cfg, k, g.Skvp, g.Dp), C.pad_operand(cfg, v, g.Skvp, g.Dvp)
  bias_p, mask_b = C.pad_pair(bias, g), C.pad_pair(mask, g)
  mask_p = None if mask_b is None else mask_b.astype(jnp.int8)
  q_seg_p, kv_seg_p = C.pad_segments(q_seg, kv_seg, g)
  mod_cls = C.mod_classes(cfg, g, mod)
  lists_kv = C.block_lists(cfg, g, q_seg_p, kv_seg_p, mask_b, by="kv", mod_cls=mod_cls)
  dk, dv, dposkv = _dkdv(cfg, g, qp, kp, vp, dop, lse_p, delta_p, bias_p, mask_p, q_seg_p,
                         kv_seg_p, lists_kv, seed, consts, scalar, masked, acc, msplit, offsets,
                         pos)
  dk = dk[:, :, : g.Skv, : g.D].astype(k.dtype)
  dv = dv[:, :, : g.Skv, : g.Dv].astype(v.dtype)
  dbias = None
  if bias is not None:
    dbias = _dbias(cfg, g, qp, kp, vp, dop, lse_p, delta_p, bias_p, mask_p, q_seg_p, kv_seg_p,
                   mask_b, seed, consts, scalar, masked, acc, mod_cls, msplit, offsets, pos)
    dbias = dbias[:, :, : bias.shape[2], : bias.shape[3]].astype(bias.dtype)

  # dQ (and the score_mod consts' grads).
  g = g_dq
  masked = C.needs_mask(cfg, g, has_seg, has_mask)
  delta_p, lse_p = _preprocess(out, lse, dout, dlse, g, acc)
  dop = C.pad_operand(cfg, dout, g.Sqp, g.Dvp)
  dq, dres, dposq = _dq(cfg, g, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, scalar, dop,
                        lse_p, delta_p, masked, acc, n_diff, mod, msplit, offsets, pos)
  dq = dq[:, :, : g.Sq, : g.D].astype(q.dtype)
  drel = ()
  if pos is not None and pos.n_rel_diff:  # square blocks: a block diagonal's tiles align
    blk = min(g_dq.bq, g_dq.bk)
    g_rel = C.geometry(cfg, q.shape, k.shape, v.shape, blk, blk, role="dq", dtype=q.dtype)
    assert g_rel.bq == g_rel.bk, (g_rel.bq, g_rel.bk)
    drel = _drel(cfg, g_rel, q, k, v, dout, out, lse, dlse, bias, mask, q_seg, kv_seg, seed,
                 consts, scalar, msplit, pos, offsets, acc, mod)
  if split.to_consts is not None:  # grads to the arrays, through per-head / -position residuals
    dres = tuple(d[..., 0] if sc else d for d, sc in zip(dres, scalar))
    fit = lambda ds, xs: tuple(C.pad_to(d, 2, x.shape[2]) for d, x in zip(ds, xs))
    assert pos is not None or not (dposq or dposkv)
    dconsts = tuple(split.to_consts(dres, *(() if pos is None else (
        fit(dposq, pos.q), fit(dposkv, pos.kv), drel))))
  else:  # differentiable consts that the scores do not depend on
    dconsts = tuple(jnp.zeros(jnp.shape(c), jnp.result_type(c)) for c in user_consts[:n_user_diff])
  dconsts = tuple(d.astype(jnp.result_type(c)) for d, c in zip(dconsts, user_consts[:n_user_diff]))
  return dq, dk, dv, dbias, dconsts
