"""The fused tangent pass (forward-mode derivative) of blockwise attention.

Room: forward mode, blockwise. Given the forward's (out, lse) and tangents of
(q, k, v, bias, score_mod's differentiable consts), one loop over the same flat list
of (q block, kv block) pairs as the forward (`_impl._pairs`, row-major, the same block
skipping) computes, per tile,

    t_s   = scale * (t_q k^T + q t_k^T) + t_bias        (+ score_mod's jvp on the tile)
    p     = exp(s - lse)                               (exact: lse is the forward's)
    mu_i += sum_j p_ij t_s_ij                          (the tangent of lse)
    a_i  += sum_j pd_ij (t_s_ij v_j + t_v_j)           (pd: p with dropout's keep scaling)

and finally ``t_out = a - mu * out``, ``t_lse = mu``. The accumulators are O(seq)
([rows, Dv] and [rows]); nothing of size [seq_q, seq_kv] exists. Because the exact lse
is known there is no running max and no rescaling (as in the backward). Empty rows
(lse = -inf) read lse = +inf, so p = 0 there: zero, finite tangents.

Every tangent is optional (None = zero), so a JVP along one input skips the others'
matmuls.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from flashvjp import _score_mod
from flashvjp._config import AttentionConfig
from flashvjp.blockwise import _impl
from flashvjp.blockwise._impl import _carry_zero
from flashvjp.blockwise._impl import _Layout
from flashvjp.blockwise._impl import _pairs
from flashvjp.blockwise._impl import _put_rows
from flashvjp.blockwise._impl import _rows
from flashvjp.blockwise._impl import scoped


@scoped("flashvjp_blockwise_tangent")
def tangent(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out, lse,
            tq, tk, tv, tbias, tconsts, mod=None, offsets=None):
  """(t_out [B, H, Sq, Dv] in out's dtype, t_lse [B, H, Sq] in lse's dtype).

  `tq`, `tk`, `tv`, `tbias`: tangents shaped like their primals, or None (zero).
  `tconsts`: one tangent (or None) per differentiable score_mod const.
  """
  L = _Layout(cfg, q, k, v, cfg.blocks.block_q, cfg.blocks.block_kv, offsets)
  acc = L.acc
  n_diff = cfg.num_diff_consts
  diff_consts, fixed_consts = tuple(consts[:n_diff]), tuple(consts[n_diff:])
  tconsts = tuple(tconsts) if tconsts is not None else (None,) * n_diff
  has_tconsts = cfg.score_mod is not None and any(t is not None for t in tconsts)
  tconsts = tuple(jnp.zeros_like(c) if t is None else t.astype(c.dtype)
                  for c, t in zip(diff_consts, tconsts))

  q5 = L.q5(q)
  tq5 = None if tq is None else L.q5(tq)
  kp, vp = L.kv(k), L.kv(v)
  tkp = None if tk is None else L.kv(tk)
  tvp = None if tv is None else L.kv(tv)
  mask_p = L.pad_pair(mask)
  bias5, mask5 = L.pair5(L.pad_pair(bias)), L.pair5(mask_p)
  tbias5 = None if tbias is None else L.pair5(L.pad_pair(tbias))
  q_seg, kv_seg = L.segs(q_seg, kv_seg)
  table = L.block_table(q_seg, kv_seg, mask_p, mod)
  masked = L.needs_mask(q_seg is not None or mask is not None or mod is not None)
  count, walk0, at = _pairs(L, table, "q")

  lse_b = jnp.where(lse == -jnp.inf, jnp.inf, lse.astype(acc))
  lse5 = L.q5(jnp.pad(lse_b, ((0, 0), (0, 0), (0, L.Sqp - L.Sq)), constant_values=jnp.inf))
  rows = (L.B, L.Hkv, L.G, L.Sqp)

  def body(t, carry):
    mu_all, a_all, walk = carry
    i, j, walk = at(t, walk)
    q_blk, k_blk = L.q_tile(q5, i), L.kv_tile(kp, j)
    s = L.scores(q_blk, k_blk, bias5, i, j)
    # The scores' tangent: scale * (t_q k^T + q t_k^T) + t_bias, one dot when both are set.
    if tq5 is not None and tkp is not None:
      lhs = jnp.concatenate([L.q_tile(tq5, i), q_blk], axis=-1)
      rhs = jnp.concatenate([k_blk, L.kv_tile(tkp, j)], axis=-1)
      ts = L.scores(lhs, rhs, tbias5, i, j)
    elif tq5 is not None:
      ts = L.scores(L.q_tile(tq5, i), k_blk, tbias5, i, j)
    elif tkp is not None:
      ts = L.scores(q_blk, L.kv_tile(tkp, j), tbias5, i, j)
    elif tbias5 is not None:
      ts = jnp.broadcast_to(L.pair_tile(tbias5, i, j).astype(acc), s.shape)
    else:
      ts = jnp.zeros_like(s)
    if cfg.score_mod is not None:
      idx = L.indices(i, j)
      fn = lambda s_, c_: _score_mod.apply(cfg.score_mod, tuple(c_) + fixed_consts, s_, *idx)
      if has_tconsts:
        s, ts = jax.jvp(fn, (s, diff_consts), (ts, tconsts))
      else:
        s, ts = jax.jvp(lambda s_: fn(s_, diff_consts), (s,), (ts,))
    if masked:
      ok = L.allowed(i, j, q_seg, kv_seg, mask5, mod)
      s = jnp.where(ok, s, -jnp.inf)
      ts = jnp.where(ok, ts, 0.0)
    p = jnp.exp(s - _rows(lse5, i, L.bq)[..., None])
    pts = p * ts
    mu = _rows(mu_all, i, L.bq) + pts.sum(axis=-1)
    pd, ptsd = p, pts
    if cfg.dropout_active:
      ks = L.keep_scale(seed, i, j)
      pd, ptsd = p * ks, pts * ks
    shape4 = (L.B, L.Hkv, L.G * L.bq, L.bk)
    v_blk = L.kv_tile(vp, j)
    if tvp is not None:  # [pd*ts | pd] @ [v ; t_v]: one dot of depth 2 * block_kv
      lhs = jnp.concatenate([ptsd.reshape(shape4), pd.reshape(shape4)], axis=-1)
      rhs = jnp.concatenate([v_blk, L.kv_tile(tvp, j)], axis=2)
    else:
      lhs, rhs = ptsd.reshape(shape4), v_blk
    a = jnp.einsum("bhqk,bhkd->bhqd", lhs, rhs, preferred_element_type=acc)
    a = _rows(a_all, i, L.bq) + a.reshape(L.B, L.Hkv, L.G, L.bq, L.Dv)
    return (_put_rows(mu_all, mu, i, L.bq, 3), _put_rows(a_all, a, i, L.bq), walk)

  z0 = _carry_zero(acc, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out, lse, tq, tk, tv,
                   tbias, tconsts, mod)
  init = (jnp.zeros(rows, acc) + z0, jnp.zeros(rows + (L.Dv,), acc) + z0, walk0)
  mu, a, _ = lax.fori_loop(0, count, body, init)
  mu = mu.reshape(L.B, L.H, L.Sqp)[:, :, : L.Sq]
  a = a.reshape(L.B, L.H, L.Sqp, L.Dv)[:, :, : L.Sq]
  if out is None:  # the caller subtracts mu * out where out's rows are (`_delta.tangent_out`)
    return a.astype(acc if cfg.out_f32 else q.dtype), mu.astype(lse.dtype)
  t_out = a - mu[..., None] * out.astype(acc)
  return t_out.astype(out.dtype), mu.astype(lse.dtype)


__all__ = ["tangent"]
del _impl
