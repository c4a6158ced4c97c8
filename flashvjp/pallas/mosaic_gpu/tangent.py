"""Pallas Mosaic-GPU tangent kernel (Hopper, sm_90a): the fused forward-mode pass.

Room: Pallas Mosaic-GPU backend (forward mode). The dQ kernel's structure (`backward`): grid
(batch, head, 64-row q block), two warpgroups: a producer streams the kv side of each visited
block by TMA into a ring of `_ring._STAGES` slots (K, V and their tangents t_k, t_v,
segment ids, dense mask / bias / t_bias tiles), over the same blocks as every other kernel
(the mask model's static bounds, or the visit lists of segment ids, a dense mask, a
mask_mod); the compute warpgroup holds Q, t_q, the lse row and the per-row words (dropout,
the mods' residuals and their tangents) and, per block, on SS-wgmma:

    s    = q k^T,   t_s = scale * (t_q k^T + q t_k^T) + t_bias   (+ the score_mod's jvp)
    p    = exp2(s2 - lse2)                  (the forward's exact lse: no rescaling)
    mu  += rowsum(p * t_s)
    a   += (pd * t_s) v + pd t_v            (pd: p with the dropout keep scaling)

then t_out = a - mu * out (out loaded into Q's SMEM after the loop) and t_lse = mu: one
[64, Dv] accumulator and a row, nothing of size [seq_q, seq_kv]. With out=None the kernel
returns a (the caller subtracts mu * out where out's rows are, `flashvjp._delta`).

Takes what the backward takes: bfloat16 / float16, head dims <= 256 (above 128, as the
backward: two programs per q block, each t_out's half, kv blocks of 32), GQA / MQA, causal,
window, segment ids, a dense mask, a bias (and its tangent), dropout, global offsets, a
score_mod with per-(b, h) scalar residuals, arrays read by one position and tables read
by kv_idx - q_idx (and the tangents of its float ones: per-row words, column words streamed
with K, windows of skewed arrays) and a mask_mod. With rel windows the ring may take kv
blocks of 32 (when 64 does not fit shared memory). Bias tiles keep a 16-bit bias' dtype (else float32); a configuration whose ring
does not fit Hopper's shared memory is refused by name (`smem_problem`).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from flashvjp._config import AttentionConfig
from flashvjp.pallas import _common as C
from flashvjp.pallas.mosaic_gpu import _compat
from flashvjp.pallas.mosaic_gpu import _rel
from flashvjp.pallas.mosaic_gpu import _ring as R
from flashvjp.pallas.mosaic_gpu import _tile as T
from flashvjp.pallas.mosaic_gpu import backward as Bw
from flashvjp.pallas.mosaic_gpu import forward as F

# Hopper's opt-in shared memory per block (227 KiB), less room for the barriers and the
# compiler's own scratch: the compiler's count exceeds `smem_bytes` by 2272 bytes for the
# largest rings (sm_90a, every feature and tangent: 233696 against 231424 at head dim 128,
# 237792 against 235520 at 256, both over the limit and refused).
SMEM_LIMIT = 232448
_OVERHEAD = 4096
_ALIGN = 1024  # every SMEM buffer starts at a multiple (jax's mosaic_gpu SMEM_ALIGNMENT)


def _tangent_kernel(*refs, cfg, g: C.Geometry, masked_any, names, ring, resident):
  plgpu = _compat.plgpu()
  wgmma_layout, row, col = _compat.layouts()
  r = dict(zip(names, refs))
  t_out_ref, t_lse_ref = refs[len(names):len(names) + 2]
  (ring_smem, res_smem, tiles), loaded, free, res_bars = refs[len(names) + 2:]
  pt_smem, pd_smem, mu_smem = tiles[:3]
  rs = dict(zip(ring, ring_smem))
  res = dict(zip(resident, res_smem))
  b, h, i = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("q")
  wg, part = lax.axis_index("wg"), lax.axis_index("d")
  parts = Bw._parts(g)
  wv = g.Dvp // parts  # this program's t_out columns
  rows = pl.ds(i * g.bq, g.bq)
  kv = Bw._KvStream(cfg, g, r, b, h, i)
  f32 = jnp.float32

  @pl.when(wg == 1)
  def _producer():
    kv.produce(ring, rs, loaded, free)

  @pl.when(wg == 0)
  def _compute():
    lse2, vecs, q_idx, kv_iota = kv.load_rows(resident, res, res_bars)
    q_smem = res["q"]
    shape = (g.bq, g.bk)

    def scores(k_s, tk_s):
      """(q k^T, t_q k^T + q t_k^T) of one slot, issued together (one wgmma wait)."""
      def body(acc_s, acc_t):
        plgpu.wgmma(acc_s, q_smem, k_s.T)
        if "tq" in res:
          plgpu.wgmma(acc_t, res["tq"], k_s.T)
        if tk_s is not None:
          plgpu.wgmma(acc_t, q_smem, tk_s.T)
        return acc_s[...], acc_t[...]

      return pl.run_scoped(body, plgpu.ACC(shape, f32), plgpu.ACC(shape, f32))

    def scope(a_acc):
      def step(n, masked, mu):
        slot = lax.rem(n, R._i32(R._STAGES))
        j = kv.block_of(n)  # the kv block
        R._wait_loaded(loaded, slot)
        tk_s = rs["tk"].at[slot] if "tk" in rs else None
        s, ts = scores(rs["k"].at[slot], tk_s)
        v = kv.slot_inputs(rs, slot, vecs)
        ts = ts * f32(cfg.scale)
        if "tbias" in rs:
          ts = ts + plgpu.load(rs["tbias"].at[slot], layout=wgmma_layout,
                               optimized=False).astype(f32)
        p, ok, m, ts = T._probs(cfg, s, lse2, q_idx, j * g.bk + kv_iota, masked, v,
                                tangent=ts)
        pt = p * ts
        if ok is not None:  # a select: a masked entry contributes exactly nothing
          pt = jnp.where(ok, pt, f32(0.0))
        mu = mu + jnp.sum(pt, axis=1)
        pd = p if m is None else p * m
        pt_smem[...] = (pt if m is None else pt * m).astype(pt_smem.dtype)
        pd_smem[...] = pd.astype(pd_smem.dtype)
        # the P stores before the wgmmas read them; the kv-side loads (segment ids, mask,
        # bias tiles) before the producer's TMA refill of this slot
        plgpu.commit_smem()
        plgpu.wgmma(a_acc, pt_smem, Bw._cols(rs["v"].at[slot], part, wv, parts))
        if "tv" in rs:
          plgpu.wgmma(a_acc, pd_smem, Bw._cols(rs["tv"].at[slot], part, wv, parts))
        plgpu.wgmma_wait(0)  # the slot's tiles are read: hand it back
        plgpu.barrier_arrive(free.at[slot])
        return mu

      def run(start, stop, masked, carry):  # steps [start, stop)
        return lax.fori_loop(start, stop, lambda n, c: step(n, masked, c), carry)

      zero = plgpu.layout_cast(jnp.zeros((g.bq,), f32), row)
      mu = kv.visit(run, masked_any, zero)
      return a_acc[...], mu

    a, mu = pl.run_scoped(scope, plgpu.ACC((g.bq, wv), f32))
    mu_smem[...] = mu
    # half the columns with two parts, in [bq, bk] chunks staged in the P tiles by turns;
    # else all of them, staged in Q's buffer (read by now) or their own
    stages = ((pt_smem, pd_smem) if parts > 1
              else (q_smem if g.Dvp == g.Dp else tiles[3],))
    cols = lambda ref, c, w: ref.at[b, h, rows, pl.ds(part * wv + c, w)]

    def minus_mu_out(buf, c, w, x):  # t_out = a - mu * out, out loaded into the buffer first
      plgpu.copy_gmem_to_smem(cols(r["out"], c, w), buf, res_bars.at[0])
      plgpu.barrier_wait(res_bars.at[0])
      return x - lax.broadcast_in_dim(mu, x.shape, [0]) * buf[...].astype(f32)

    Bw._store_chunks(((a, functools.partial(cols, t_out_ref)),), stages,
                     before=minus_mu_out if "out" in r else None)

    @pl.when(part == 0)  # every part computes it; the first writes it
    def _store_t_lse():
      plgpu.copy_smem_to_gmem(mu_smem, t_lse_ref.at[b, h, rows])
    plgpu.wait_smem_to_gmem(0)


def smem_bytes(g: C.Geometry, arrays) -> int:
  """Shared memory of the tangent kernel on these operands: its `backward._scratch` buffers
  (rings, resident tiles, P tiles, staging), each starting at a 1024-byte boundary as Pallas
  Mosaic-GPU allocates them; barriers aside."""
  ring, resident = Bw._operands("tangent", arrays)
  smem = Bw._scratch("tangent", arrays, ring, resident, g)[0]
  return sum(-(-math.prod(x.shape) * jnp.dtype(x.dtype).itemsize // _ALIGN) * _ALIGN
             for part in smem for x in part)


def tangent(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out, lse,
            tq, tk, tv, tbias, tconsts, mod=None, offsets=None):
  """The fused tangent pass (`flashvjp.pallas.triton.tangent.tangent`'s interface).

  `tq`, `tk`, `tv`, `tbias`: tangents shaped like their primals, or None (zero); `tconsts`:
  one tangent (or None) per differentiable score_mod const.

  Returns (t_out [B, H, Sq, Dv] in out's dtype, t_lse [B, H, Sq] in lse's dtype); with
  out=None, (a, t_lse): t_out before its `- t_lse * out` term (`flashvjp._delta`).
  """
  if cfg.gpu_arch == "sm_100a":
    raise NotImplementedError(
        "pallas_mosaic_gpu tangent (sm_100a): the Blackwell kernels have no tangent kernel yet"
        " (jax.jvp, HVPs); use implementation='pallas_triton' for forward mode on Blackwell")
  Bw.check_supported(cfg, q, k, v, bias, mask, q_seg, seed, consts, mod, offsets,
                     role="tangent kernel")
  n_user = cfg.num_diff_consts
  tconsts = tuple(tconsts) if tconsts is not None else (None,) * n_user
  ins = Bw._inputs(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, mod, offsets,
                   role="tangent", grads=False)
  g, arrays = dataclasses.replace(ins.g, bk=Bw._stream_block(ins.g)), ins.arrays
  f32 = jnp.float32
  if cfg.score_mod is not None and any(t is not None for t in tconsts):
    hcfg, hconsts = C.hoist_score_mod(cfg, consts, f32)
    res_t, pos_t = C.residual_tangents(hcfg, hconsts, tconsts, f32, g.B, g.H, ins.split,
                                       offsets, F.positions(cfg))
    for n, t in enumerate(res_t):  # the first len(res_t) residuals are the float ones
      arrays[f"tres{n}"] = jnp.broadcast_to(t.astype(f32), (g.B, g.H, g.Sqp))
    if pos_t is not None:  # the float per-position residuals' tangents (floats first)
      for n, t in enumerate(pos_t.q):
        arrays[f"tqres{n}"] = t[..., :g.Sqp].astype(f32)
      for n, t in enumerate(pos_t.kv):
        arrays[f"tkvres{n}"] = t[..., :g.Skvp].astype(f32)
      for n in range(len(pos_t.rel)):  # rows by kv_idx - q_idx: windows, like the rel ones
        arrays[f"trelres{n}"] = _rel.rows(pos_t, n, g.B, g.H, ins.g.Sqp, ins.g.Skvp)
  cfg = ins.cfg
  if bias is not None:  # a 16-bit bias keeps its dtype (shared memory), else float32
    dt = bias.dtype if jnp.dtype(bias.dtype).itemsize == 2 else f32
    arrays["bias"] = arrays["bias"].astype(dt)
  if tbias is not None:
    tdt = tbias.dtype if jnp.dtype(tbias.dtype).itemsize == 2 else f32
    arrays["tbias"] = Bw._pad_pair_tiles(tbias.astype(tdt), g)
  if tq is not None:
    arrays["tq"] = C.pad_seq_head(tq.astype(q.dtype), g.Sqp, g.Dp)
  if tk is not None:
    arrays["tk"] = C.pad_seq_head(tk.astype(q.dtype), g.Skvp, g.Dp)
  if tv is not None:
    arrays["tv"] = C.pad_seq_head(tv.astype(q.dtype), g.Skvp, g.Dvp)
  arrays["lse"] = Bw._lse2(lse, g)
  if out is not None:
    arrays["out"] = C.pad_seq_head(out.astype(q.dtype), g.Sqp, g.Dvp)
  problem = smem_problem(g, arrays)
  if problem is not None and g.bk > R._BLOCK // 2:
    # a ring of kv blocks of 32 instead (the rel windows, [64, bk] float32 each, and their
    # tangents' fill shared memory at 64); the operands stay padded to 64-blocks
    g = dataclasses.replace(g, bk=R._BLOCK // 2)
    problem = smem_problem(g, arrays)
  if problem is not None:
    raise NotImplementedError(problem)
  visits = Bw._visit_lists(cfg, g, q_seg, kv_seg, mask, mod, "q")
  out_type = (jax.ShapeDtypeStruct((g.B, g.H, g.Sqp, g.Dvp), q.dtype),
              jax.ShapeDtypeStruct((g.B, g.H, g.Sqp), f32))
  t_out, t_lse = Bw._launch("tangent", cfg, g, arrays, ins.masked_any, visits,
                            body=_tangent_kernel, out_type=out_type)
  t_out = t_out[:, :, :g.Sq, :g.Dv]
  if out is not None:
    t_out = t_out.astype(out.dtype)
  return t_out, t_lse[:, :, :g.Sq].astype(lse.dtype)


def smem_problem(g: C.Geometry, arrays) -> str | None:
  """Why the tangent kernel's tiles do not fit a Hopper block's shared memory, or None."""
  need = smem_bytes(g, {n: x for n, x in arrays.items() if n not in ("maskT", "biasT")})
  if need + _OVERHEAD <= SMEM_LIMIT:
    return None
  return (f"the pallas_mosaic_gpu tangent kernel needs {need} bytes of shared memory here"
          f" (head dim {g.D}, the tangents of q / k / v / bias, the bias / mask tiles and the"
          f" windows of tables read by kv_idx - q_idx in a {R._STAGES}-slot ring) and {_OVERHEAD} for barriers, over Hopper's {SMEM_LIMIT};"
          " use"
          " implementation='pallas_triton'")


__all__ = ["tangent", "smem_problem"]
