"""Pallas forward kernel: online softmax, writes out and logsumexp.

Room: Pallas kernels (forward). Grid (batch, head, q block); each program keeps
its q tile and loops over kv blocks, accumulating in float32 (float64 for float64
inputs in interpret mode). Causal / window / padding only: the mask model's static
bounds (`MaskSpec.kv_block_range` on the program id), the elementwise mask only on
edge blocks (`split_loop`). With segment ids, a dense mask or a mask_mod: two loops
over this q block's compacted kv block lists (`_mask.block_lists`, kernel inputs), the PARTIAL
list with the elementwise mask and the FULL list without; empty blocks are never
visited and no branch surrounds the K/V loads, so Triton pipelines them. A mask_mod
adds its block classes to the lists (resampled to the kernel's blocks) and its tile
part (`_common.split_mask_mod`: per-(b, h) residuals loaded once per program) to the
elementwise mask of PARTIAL blocks; FULL blocks never evaluate it.

No inf is produced inside the kernel for finite inputs (`_common.mask_value`); the
-inf lse of an empty row is made outside it.

GQA: the K/V index maps read kv head h // G, so K/V are never repeated.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from flashvjp._config import AttentionConfig
from flashvjp.pallas import _common as C
from flashvjp.pallas import _compat


def _full_spec(x):
  """The whole array as one block (for small inputs: seed, score_mod consts)."""
  nd = x.ndim
  return _compat.block_spec(x.shape, lambda *ids: (0,) * nd)


def kernel_inputs(cfg: AttentionConfig, g: C.Geometry, q, k, v, bias, mask, q_seg, kv_seg, seed,
                  consts, mod=None, msplit=None, offsets=None, pos=None):
  """Padded inputs and specs for a kernel with grid (batch, head, q block).

  Shared by the forward and the dQ kernel. `consts` are the per-(b, h) score_mod
  residuals of `_common.split_per_head`; `mod` the mask_mod's `ModInputs` (its block
  classes join the lists) and `msplit` its `_common.ModSplit` (residuals "mconst{n}");
  `offsets` the global offsets (`_common.offset_operand`: an int32 [4] input "offsets");
  `pos` the score_mod's per-position residuals (`_common.PosResiduals`, `add_positions`).
  """
  G = g.G
  ins = C.KernelInputs()
  qp = C.pad_operand(cfg, q, g.Sqp, g.Dp)
  kp = C.pad_operand(cfg, k, g.Skvp, g.Dp)
  vp = C.pad_operand(cfg, v, g.Skvp, g.Dvp)
  ins.add("q", qp, _compat.block_spec((None, None, g.bq, g.Dp), lambda b, h, i: (b, h, i, 0)))
  ins.add("k", kp, _compat.block_spec((None, None, g.Skvp, g.Dp),
                                      lambda b, h, i: (b, h // G, 0, 0)))
  ins.add("v", vp, _compat.block_spec((None, None, g.Skvp, g.Dvp),
                                      lambda b, h, i: (b, h // G, 0, 0)))
  mask_p = C.pad_pair(mask, g)
  for name, x in (("bias", C.pad_pair(bias, g)),
                  ("mask", None if mask_p is None else mask_p.astype(jnp.int8))):
    if x is None:
      continue
    ins.add(name, x, pair_spec_q(x, g))
  q_seg_p, kv_seg_p = C.pad_segments(q_seg, kv_seg, g)
  if q_seg_p is not None:
    ins.add("q_seg", q_seg_p, _compat.block_spec((None, g.bq), lambda b, h, i: (b, i)))
    ins.add("kv_seg", kv_seg_p, _compat.block_spec((None, g.Skvp), lambda b, h, i: (b, 0)))
  add_block_lists(ins, C.block_lists(cfg, g, q_seg_p, kv_seg_p, mask_p, by="q",
                                     mod_cls=C.mod_classes(cfg, g, mod)), g)
  if cfg.dropout_active:
    ins.add("seed", seed, _full_spec(seed))
  add_offsets(ins, offsets)
  mod_arrays = () if msplit is None else msplit.arrays
  for prefix, arrays in (("const", consts), ("mconst", mod_arrays)):
    for n, c in enumerate(arrays):  # per-(b, h) score_mod / mask_mod residuals [B, H, ...]
      nd = c.ndim - 2
      ins.add(f"{prefix}{n}", c, _compat.block_spec(
          (None, None) + c.shape[2:],
          functools.partial(lambda nd, b, h, i: (b, h) + (0,) * nd, nd)))
  add_positions(ins, g, pos, "pos")
  add_positions(ins, g, None if msplit is None else msplit.pos, "mpos")
  return ins


def add_positions(ins, g: C.Geometry, pos, prefix):
  """Per-position residuals (`_common.PosResiduals`) for a (batch, head, q block) grid:
  "{prefix}q{n}" this program's [bq] rows, "{prefix}kv{n}" the whole [Skvp] row,
  "{prefix}rel{n}" the whole [Sqp + Skvp] row of differences (`rel_tile`)."""
  if pos is None:
    return
  for n, x in enumerate(pos.q):
    ins.add(f"{prefix}q{n}", x[..., : g.Sqp],
            _compat.block_spec((None, None, g.bq), lambda b, h, i: (b, h, i)))
  for n, x in enumerate(pos.kv):
    ins.add(f"{prefix}kv{n}", x[..., : g.Skvp],
            _compat.block_spec((None, None, g.Skvp), lambda b, h, i: (b, h, 0)))
  for n, x in enumerate(pos.rel):
    ins.add(f"{prefix}rel{n}", x[..., pos.rel_slice(g.Sqp, g.Skvp)],
            _compat.block_spec((None, None, g.Sqp + g.Skvp), lambda b, h, i: (b, h, 0)))


def rel_index(g: C.Geometry, i, j, transposed: bool = False):
  """Where tile (i, j) reads a rel row (`_common.PosResiduals.rel_slice`): kv - q + Sqp - 1,
  int32 [bq, bk] ([bk, bq] transposed). A gather load of a row Triton lowers as pointer
  arithmetic; its [bq + bk - 1] distinct elements stay in L1."""
  qi, ki = C.tile_indices(g, i, j, transposed)
  return ki - qi + (g.Sqp - 1)


def load_positions(r, g: C.Geometry, i, j, prefix):
  """The per-position residual tiles of tile (i, j) for a (batch, head, q block) program:
  q ones [bq, 1], then kv ones [1, bk], then rel ones [bq, bk] (`add_positions`)."""
  qs = [r[f"{prefix}q{n}"][...][:, None] for n in range(C.count_refs(r, f"{prefix}q"))]
  kvs = [r[f"{prefix}kv{n}"][_compat.ds(j * g.bk, g.bk)][None, :]
         for n in range(C.count_refs(r, f"{prefix}kv"))]
  n_rel = C.count_refs(r, f"{prefix}rel")
  e = rel_index(g, i, j) if n_rel else None
  rels = [r[f"{prefix}rel{n}"][e] for n in range(n_rel)]
  return tuple(qs + kvs + rels)


def add_offsets(ins, offsets):
  """The global offsets as an int32 [4] input "offsets" (whole, read as scalars), if any."""
  off = C.offset_operand(offsets)
  if off is not None:
    ins.add("offsets", off, _full_spec(off))


def load_mod_consts(r, msplit_scalar, lead=()):
  """The mask_mod residuals of this program's (b, h) ("mconst{n}" refs; `lead` indexes
  leading dims, as `_common.load_head_consts`)."""
  return C.load_head_consts([r[f"mconst{n}"] for n in range(len(msplit_scalar))],
                            msplit_scalar, lead)


def add_block_lists(ins, lists, g: C.Geometry):
  """Add `_common.block_lists(..., by="q")` for a (batch, head, q block) grid: this
  program's row of lists; a broadcast (size-1) batch / head dim maps to 0."""
  if lists is None:
    return
  counts, blocks = lists
  Bl, Hl = counts.shape[0], counts.shape[1]
  ins.add("counts", counts, _compat.block_spec(
      (None, None, 2, g.nq), lambda b, h, i: (b if Bl != 1 else 0, h if Hl != 1 else 0, 0, 0)))
  ins.add("lists", blocks, _compat.block_spec(
      (None, None, None, 2, g.nk),
      lambda b, h, i: (b if Bl != 1 else 0, h if Hl != 1 else 0, i, 0, 0)))


def list_loops(r, i, body, carry):
  """`_common.list_loops` over this q block's lists (the inputs of `add_block_lists`)."""
  counts = (r["counts"][0, i], r["counts"][1, i])
  return C.list_loops(counts, lambda kind, t: r["lists"][kind, t], body, carry)


def pair_spec_q(x, g: C.Geometry):
  """BlockSpec of a padded rank-4 bias/mask for a (batch, head, q block) grid.

  A size-1 (broadcast) dim maps to block 0 and is never copied per program.
  """
  Bp, Hp, Sq2, Sk2 = x.shape
  return _compat.block_spec(
      (None, None, g.bq if Sq2 != 1 else 1, Sk2),
      lambda b, h, i: (b if Bp != 1 else 0, h if Hp != 1 else 0, i if Sq2 != 1 else 0, 0))


def load_tile_inputs(r, g: C.Geometry, b, h, i, j, mod=(), off=None):
  """TileInputs of tile (i, j) for a (batch, head, q block) program (`mod`: the loaded
  mask_mod residuals; `off`: the loaded global offsets, `_common.load_offsets`)."""
  t = C.TileInputs(b=b, h=h, i=i, j=j, mod=tuple(mod), off=off)
  if "bias" in r:
    t.bias = C.pair_tile(r["bias"], (), i, j, g, full_q=False, full_kv=True)
  if "mask" in r:
    t.mask = C.pair_tile(r["mask"], (), i, j, g, full_q=False, full_kv=True)
  if "q_seg" in r:
    t.q_seg = r["q_seg"][...]
    t.kv_seg = r["kv_seg"][_compat.ds(j * g.bk, g.bk)]
  t.pos, t.mpos = load_positions(r, g, i, j, "pos"), load_positions(r, g, i, j, "mpos")
  return t


def positions(cfg: AttentionConfig, g: C.Geometry):
  """What `_common.split_per_head` needs to hoist per-position residuals for geometry g
  (these kernels look rows up by kv_idx - q_idx too)."""
  return C.Positions(cfg.seq_q, cfg.seq_kv, g.Sqp, g.Skvp, rel=True)


def _forward_kernel(*refs, cfg: AttentionConfig, g: C.Geometry, names, n_consts, scalar, masked,
                    mod_scalar=()):
  r = dict(zip(names + ["out", "lse"] + (["row_max"] if cfg.max_logits else []), refs))
  acc = C.acc_dtype(r["q"].dtype)
  b, h, i = _compat.program_id(0), _compat.program_id(1), _compat.program_id(2)
  q = r["q"][...]
  consts = C.load_head_consts([r[f"const{n}"] for n in range(n_consts)], scalar)
  mconsts = load_mod_consts(r, mod_scalar)
  off = C.load_offsets(r.get("offsets"))
  lo, hi = C.mask_spec(cfg).kv_block_range(i, g.bq, g.bk, g.nk)

  neg = C.mask_value(acc)
  # The softmax runs in the exp2 domain: m is the running max of s * log2(e), and each
  # exponent is one FFMA and one ex2 (exp2 is libdevice's ex2.approx; exp is __nv_expf's
  # range reduction, several instructions an entry). With nothing else on the scores and a
  # positive scale the max is taken on q k itself (`raw`), so the scale is folded into
  # log2(e): p = exp2(qk * scale * log2(e) - m).
  raw = (cfg.score_mod is None and "bias" not in r and cfg.scale > 0)
  xs = jnp.asarray(cfg.scale * C.LOG2E if raw else C.LOG2E, acc)
  cfg_s = dataclasses.replace(cfg, scale=1.0) if raw else cfg

  def body(j, masked, carry):
    m, l, o = carry
    t = load_tile_inputs(r, g, b, h, i, j, mconsts, off)
    kv = _compat.ds(j * g.bk, g.bk)
    x, ok, _ = C.scores(cfg_s, g, q, r["k"][kv, :], t, consts, acc, masked)
    if ok is None:
      m_new = jnp.maximum(m, x.max(axis=-1) * xs)
      p = jnp.exp2(x * xs - m_new[:, None])
    else:  # masked entries: out of the max, and p = exp2(mask_value) = 0 by a select
      # (m starts at mask_value, so m_new stays finite where top * xs overflows)
      m_new = jnp.maximum(m, jnp.where(ok, x, neg).max(axis=-1) * xs)
      p = jnp.exp2(jnp.where(ok, x * xs - m_new[:, None], neg))
    alpha = jnp.exp2(m - m_new)
    l = alpha * l + p.sum(axis=-1)
    if cfg.dropout_active:
      p = p * C.dropout_scale(cfg, g, r["seed"], t, acc)
    vt = r["v"][kv, :]
    if cfg.out_f32:  # a traced scale (AttentionConfig.out_f32): p @ v in float32, exact delta
      pv = C.dot_nn(p, vt.astype(acc), acc, dataclasses.replace(cfg, precision="highest"))
    else:
      pv = C.dot_nn(p.astype(vt.dtype), vt, acc, cfg)
    o = alpha[:, None] * o + pv
    return m_new, l, o

  def run(start, stop, masked, carry):
    return lax.fori_loop(start, stop, lambda j, c: body(j, masked, c), carry)

  # m starts at mask_value (not -inf): a row that sees no allowed entry keeps l == 0.
  init = (jnp.full((g.bq,), neg, acc), jnp.zeros((g.bq,), acc), jnp.zeros((g.bq, g.Dvp), acc))
  if "lists" in r:  # segment ids / dense mask / mask_mod: the compacted block lists
    m, l, o = list_loops(r, i, body, init)
  elif not masked:
    m, l, o = run(lo, hi, False, init)
  else:
    m, l, o = C.split_loop(run, lo, hi, C.full_kv_blocks(cfg, g, i), init)
  empty = l == 0.0
  o = o / jnp.where(empty, 1.0, l)[:, None]
  r["out"][...] = o.astype(r["out"].dtype)
  # Empty (and padded) rows: lse = mask_value here, -inf outside the kernel (`forward`).
  m = m * jnp.asarray(1 / C.LOG2E, acc)  # back to natural units
  r["lse"][...] = jnp.where(empty, neg, m + jnp.log(jnp.where(empty, 1.0, l)))
  if cfg.max_logits:  # the running max over allowed entries: the row's max logit
    r["row_max"][...] = jnp.where(empty, neg, m)


def forward(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, mod=None,
            offsets=None):
  """Pallas forward.

  Args:
    cfg: static configuration (cfg.interpret selects interpret mode).
    q: [B, H, Sq, D]; k: [B, Hkv, Skv, D]; v: [B, Hkv, Skv, Dv].
    bias: None or rank 4 float, dims 1 or full. mask: None or rank-4 bool, dims 1 or full.
    q_seg, kv_seg: None or int32 [B, Sq] / [B, Skv]. seed: uint32 [2] or None.
    consts: score_mod consts (differentiable first).
    mod: None, or the mask_mod's `ModInputs` (block classes at cfg.mask_mod_blocks, consts;
      classes None: every block PARTIAL, `_common.mod_classes`).
    offsets: None, or the global (b0, h0, q0, kv0) of local element (0, 0, 0, 0), Python
      ints or traced int32 scalars (`_common.offset_operand`): score_mod, mask_mod and
      dropout see global positions, the static mask (causal, window) local ones.

  Returns:
    (out [B, H, Sq, Dv] in q.dtype, lse [B, H, Sq] float32 (float64 for float64 inputs)),
    and the row maxima [B, H, Sq] (the same dtype; -inf: an empty row) when cfg.max_logits.
  """
  g = C.geometry(cfg, q.shape, k.shape, v.shape, cfg.blocks.block_q, cfg.blocks.block_kv,
                 dtype=q.dtype)
  acc = C.acc_dtype(q.dtype)
  cfg, consts = C.hoist_score_mod(cfg, consts, acc)
  split = C.split_per_head(cfg, consts, acc, g.B, g.H, grads=False, offsets=offsets,
                           positions=positions(cfg, g))
  msplit = C.split_mask_mod(split.cfg, mod, g.B, g.H, offsets, positions(cfg, g))
  cfg = msplit.cfg
  ins = kernel_inputs(cfg, g, q, k, v, bias, mask, q_seg, kv_seg, seed, split.arrays, mod, msplit,
                      offsets, split.pos)
  masked = C.needs_mask(cfg, g, q_seg is not None, mask is not None)
  kernel = functools.partial(_forward_kernel, cfg=cfg, g=g, names=ins.names,
                             n_consts=len(split.arrays), scalar=split.scalar, masked=masked,
                             mod_scalar=msplit.scalar)
  rows_shape = jax.ShapeDtypeStruct((g.B, g.H, g.Sqp), acc)
  rows_spec = _compat.block_spec((None, None, g.bq), lambda b, h, i: (b, h, i))
  n_rows = 2 if cfg.max_logits else 1  # lse (+ the row maxima)
  out, *rows = _compat.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((g.B, g.H, g.Sqp, g.Dvp), acc if cfg.out_f32 else q.dtype),
                 *(rows_shape,) * n_rows),
      grid=(g.B, g.H, g.nq),
      in_specs=ins.specs,
      out_specs=(_compat.block_spec((None, None, g.bq, g.Dvp), lambda b, h, i: (b, h, i, 0)),
                 *(rows_spec,) * n_rows),
      interpret=cfg.interpret, name="flashvjp_fwd",
      num_warps=g.num_warps, num_stages=g.num_stages,
  )(*ins.arrays)
  # the API's -inf lse (and row max) of an empty row, after slicing off the padded rows
  rows = C.neg_inf_at_empty([x[:, :, : g.Sq] for x in rows], acc)
  return (out[:, :, : g.Sq, : g.Dv],) + rows
