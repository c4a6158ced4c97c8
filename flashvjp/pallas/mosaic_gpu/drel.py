"""Pallas Mosaic-GPU d(rel) kernel (Hopper, sm_90a): gradients of tables read by kv_idx - q_idx.

Room: Pallas Mosaic-GPU backend (backward, one more kernel). A score_mod's value read through
``kv_idx - q_idx`` only (`relative_position_bias`'s table, T5 buckets) reaches the kernels as
a row over the differences (`_common.PosResiduals.rel`); its gradient is, per difference, the
sum of dL/d(value) over every (q, kv) pair with that difference: sums along the diagonals.

The tiles of one block diagonal (q block i, kv block i + t - (nq - 1); square 64 blocks) all
hold the same 127 differences, so one program per (batch, head, block diagonal) sums its
diagonal's [64, 64] d(value) tiles elementwise, in order (deterministic, no atomics), and XLA
reduces each summed tile along its diagonals (`_common.rel_grad_rows`), as the Triton and
Mosaic-TPU families' drel kernels do.

Two warpgroups (the backward kernels' structure and ring protocol, `backward`, `_ring`):
warpgroup 1 streams each tile's operands by TMA into a ring of slots (Q, dO, lse, delta and
the per-q words of block i; K, V and the per-kv words of block j; the dense mask / bias tiles;
the rel residuals' windows of their skewed arrays, `_rel`), warpgroup 0 recomputes S = Q K^T
and dP = dO V^T on SS-wgmma, the probabilities from the saved logsumexp (`_tile._probs`: mask,
bias, dropout, the mods), dS and the score_mod's vjp with respect to the rel residuals only,
and accumulates their tiles in registers; they leave through SMEM by TMA. Visited tiles: the
causal / window band of the mask model's static bounds, or the diagonal's non-empty tiles with
segment ids, a dense mask or a mask_mod (`_common.diagonal_lists`); every visited tile runs
the elementwise mask. Ring: two slots, one at head dims above 128 (four [64, 256] tiles a
slot).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from flashvjp import _mask
from flashvjp._config import AttentionConfig
from flashvjp.pallas import _common as C
from flashvjp.pallas.mosaic_gpu import _compat
from flashvjp.pallas.mosaic_gpu import _rel
from flashvjp.pallas.mosaic_gpu import _ring as R
from flashvjp.pallas.mosaic_gpu import _tile as T
from flashvjp.pallas.mosaic_gpu import forward as F

_KV_SIDE = ("k", "v", "kv_seg")  # indexed by the kv head (kv_seg: per batch)


def _stages(g: C.Geometry) -> int:
  """Ring slots: two, one above head dim 128 (Q, dO, K and V of [64, 256] take 128 KiB)."""
  return R._STAGES if max(g.Dp, g.Dvp) <= 128 else 1


def _is_q_side(name: str) -> bool:
  return name in ("q", "do", "lse", "delta") or R._is_q_vector(name)


def _drel_kernel(*refs, cfg, g: C.Geometry, names, ring, n_rel, stages):
  plgpu = _compat.plgpu()
  wgmma_layout, row, _ = _compat.layouts()
  r = dict(zip(names, refs))
  out_refs = refs[len(names):len(names) + n_rel]
  (ring_smem, tiles), loaded, free = refs[len(names) + n_rel:]
  rs = dict(zip(ring, ring_smem))
  b, h, t = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("t")
  wg = lax.axis_index("wg")
  hk = lax.div(h, R._i32(g.G))
  shift = t - (g.nq - 1)  # kv block - q block
  listed = R._visit_row(r, b, h, t)
  if listed is None:
    # The diagonal's tiles hold kv - q in [shift * n - (n - 1), shift * n + (n - 1)]: outside
    # the causal / window band the whole diagonal is empty
    spec, n = C.mask_spec(cfg), g.bq
    i_lo = jnp.maximum(0, -shift)
    i_hi = jnp.minimum(g.nq, g.nk - shift)
    live = jnp.asarray(True)
    if spec.right is not None:
      live = live & (shift * n - (n - 1) <= spec.right)
    if spec.left is not None:
      live = live & (shift * n + (n - 1) >= -spec.left)
    steps = jnp.where(live, i_hi - i_lo, 0).astype(jnp.int32)
    block_of = lambda m: i_lo + m
  else:  # the PARTIAL tiles, then the FULL ones (every visited tile is masked: exact)
    steps = listed[0] + listed[1]
    block_of = listed[2]

  @pl.when(wg == 1)
  def _producer():
    def fill(m, slot):
      i = block_of(m)
      j = i + shift
      rows, cols = pl.ds(i * g.bq, g.bq), pl.ds(j * g.bk, g.bk)
      for name, bar in zip(ring, loaded):
        if name in R._PAIRS:
          src = R._pair_tile(r[name], b, h, rows, cols)
        elif R._is_rel(name):
          src = R._rel_window(r, name, b, h, i * g.bq, j * g.bk, g, transposed=False)
        elif name in _KV_SIDE:
          src = R._block(r[name], b, hk, cols)
        elif R._is_kv_vector(name):
          src = R._block(r[name], b, h, cols)
        else:
          src = R._block(r[name], b, h, rows)
        plgpu.copy_gmem_to_smem(src, rs[name].at[slot], bar.at[slot])

    R._produce(steps, fill, free, stages, "skip_drel_free_wait")

  @pl.when(wg == 0)
  def _compute():
    shape = (g.bq, g.bk)
    q_iota = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=wgmma_layout)
    kv_iota = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=wgmma_layout)

    def step(m, accs):
      slot = lax.rem(m, R._i32(stages))
      i = block_of(m)
      j = i + shift
      R._wait_loaded(loaded, slot)
      s, dp = R._mm_t2(shape, rs["q"].at[slot], rs["k"].at[slot], rs["do"].at[slot],
                       rs["v"].at[slot])
      # the q side's per-row words (lse, delta, ...), then the kv side's (`_slot_inputs`)
      v = {name: lax.broadcast_in_dim(plgpu.load(rs[name].at[slot], layout=row), shape, [0])
           for name in rs if _is_q_side(name) and name not in ("q", "do")}
      v = R._slot_inputs(rs, slot, v, shape)
      lse2, delta = v.pop("lse"), v.pop("delta")
      p, ok, keep, sm_vjp = T._probs(cfg, s, lse2, i * g.bq + q_iota, j * g.bk + kv_iota, True,
                                     v, rel_diff=n_rel)
      _, drel = T._dscores(p, dp, delta, ok, keep, sm_vjp)
      if not R._mutated("skip_drel_fence"):
        plgpu.commit_smem()  # the slot's generic loads before the producer's TMA refill
      plgpu.wgmma_wait(0)
      plgpu.barrier_arrive(free.at[slot])
      return tuple(a + d for a, d in zip(accs, drel))

    zero = tuple(_compat.wgmma_tile(jnp.zeros(shape, jnp.float32)) for _ in range(n_rel))
    accs = lax.fori_loop(R._i32(0), steps, step, zero)
    for buf, x in zip(tiles, accs):
      buf[...] = x
    plgpu.commit_smem()
    for buf, ref in zip(tiles, out_refs):
      plgpu.copy_smem_to_gmem(buf, ref.at[b, h, t])
    plgpu.wait_smem_to_gmem(0)


def _diagonal_visits(cfg: AttentionConfig, g: C.Geometry, q_seg, kv_seg, mask, mod):
  """int32 [B', H', n_diag, 2 + nq] or None: per block diagonal n_partial, n_full, then the q
  blocks of its PARTIAL tiles followed by its FULL ones (`_common.diagonal_lists`)."""
  q_seg_p, kv_seg_p = C.pad_segments(q_seg, kv_seg, g)
  mask_p = None if mask is None else C.pad_pair(mask.astype(jnp.bool_), g)
  mod_cls = None
  if cfg.mask_mod is not None:
    mod_cls = (C.mod_classes(cfg, g, mod) if mod is not None
               else jnp.full((1, 1, g.nq, g.nk), _mask.PARTIAL, jnp.int8))
  lists = C.diagonal_lists(cfg, g, q_seg_p, kv_seg_p, mask_p, mod_cls)
  if lists is None:
    return None
  counts, blocks = lists
  n_partial, n_full, entries = F.visit_entries(counts, blocks)
  return jnp.concatenate([n_partial[..., None], n_full[..., None], entries], axis=-1)


def rel_grads(cfg: AttentionConfig, g: C.Geometry, arrays, pos: C.PosResiduals, q_seg, kv_seg,
              mask, mod):
  """d(the first pos.n_rel_diff rel residuals) rows [B, H, rel_sqp + Skvp'] (`pos`'s layout).

  `cfg`: with the mods' tile parts (`backward._inputs`); `g`: its 64-block geometry;
  `arrays`: the backward's named operands (q, k, v, do, lse, delta, the per-row / per-column
  words, "mask" / "bias" tiles, the rel rows "relres<n>" ...)."""
  plgpu = _compat.plgpu()
  n_rel = pos.n_rel_diff
  assert g.bq == g.bk == R._BLOCK, g
  Sqp, Skvp = arrays["q"].shape[2], arrays["k"].shape[2]
  ins = {n: (_rel.skewed(x, Sqp, Skvp, g.bq) if R._is_rel(n) else x)
         for n, x in arrays.items() if n not in ("maskT", "biasT")}
  visits = _diagonal_visits(cfg, g, q_seg, kv_seg, mask, mod)
  if visits is not None:
    ins["visits"] = visits
  ring = [n for n in ins if n != "visits"]
  names = list(ins)
  stages = _stages(g)
  minor = min(g.bq, g.bk, g.Dp, g.Dvp)
  tile = (g.bq, g.bk)

  def buf(name):
    x = ins[name]
    if name in R._PAIRS or R._is_rel(name):
      return plgpu.SMEM((stages,) + tile, x.dtype)
    if x.ndim == 4:
      return R._smem((stages, g.bq, x.shape[3]), x.dtype, minor)
    return plgpu.SMEM((stages, g.bq), x.dtype)

  smem = (tuple(buf(n) for n in ring), tuple(plgpu.SMEM(tile, jnp.float32)
                                              for _ in range(n_rel)))
  scratch = (smem, tuple(plgpu.Barrier(num_barriers=stages) for _ in ring),
             plgpu.Barrier(num_barriers=stages))
  n_diag = g.nq + g.nk - 1
  kernel = plgpu.kernel(
      functools.partial(_drel_kernel, cfg=cfg, g=g, names=names, ring=ring, n_rel=n_rel,
                        stages=stages),
      out_type=(jax.ShapeDtypeStruct((g.B, g.H, n_diag, g.bq, g.bk), jnp.float32),) * n_rel,
      scratch_types=scratch, grid=(g.B, g.H, n_diag), grid_names=("b", "h", "t"),
      kernel_name="flashvjp_bwd_drel", num_threads=R._WARPGROUPS, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True), interpret=R._interpret(cfg))
  tiles = kernel(*ins.values())
  tiles = tiles if isinstance(tiles, (tuple, list)) else (tiles,)
  return tuple(C.rel_grad_rows(x, pos, g) for x in tiles)


__all__ = ["rel_grads"]
