"""Blackwell (sm_100a) backward: the dQ kernel (single CTA, tcgen05 MMAs, S / dP / dQ in TMEM).

Room: Pallas Mosaic-GPU backend for Blackwell (not dispatched yet; see the package docstring).
`dq(cfg, q, k, v, out, lse, dout, dlse)` is dL/dq of the forward `forward.forward` computes
(the same inputs and mask model: [B, H, S, D] layouts, GQA / MQA, causal and window masks, any
sequence lengths, head dims up to 128); deterministic (each CTA owns its dQ rows, no atomics).
The dK / dV kernel comes next (docs/blackwell.md).

One CTA per (128-row q tile, head, batch), two warpgroups, the forward's protocol:
  WG0, warp 0: the tcgen05 MMAs: S = Q K^T and dP = dO V^T into TMEM (one commit for both),
    then dQ += dS K with dS read from TMEM (packed 16-bit), in the order s(0); for n: s(n + 1),
    dq(n), so the next scores run under the elementwise work.
  WG0, warp 1: TMA: Q and dO once, then K and V into 2-slot SMEM rings; a V slot is free once
    dP's MMA read it, a K slot once dQ's did.
  WG1: P = exp2(S * scale * log2(e) - lse2) (lse2 = lse * log2(e), the largest finite float32
    at empty rows: P = 0 there), dS = P (dP - delta), masked entries exactly 0 (the shared mask
    model on edge blocks only); the epilogue (dQ * scale).
Barriers (who arrives -> who waits):
  q_bar / do_bar: Q's / dO's TMA -> the MMA warp, once; rows_bar[2]: lse2's / delta's TMA
    (issued by WG1) -> WG1.
  k_loaded[s] / v_loaded[s]: the TMA -> the MMA warp, per step.
  k_free[s]: dQ's MMA reading K -> the TMA warp; v_free[s]: dP's MMA reading V -> the TMA warp.
  s_ready: tcgen05_commit after S and dP -> WG1, per step.
  s_consumed: WG1, once S_n and dP_n are in registers -> the MMA warp before S_{n+1} / dP_{n+1}
    overwrite them (single-buffered).
  ds_ready: WG1, once dS_n is in TMEM -> the MMA warp before dQ += dS_n K_n.
  dq_done: tcgen05_commit after dQ's MMA -> WG1 before it overwrites dS (single-buffered), and
    before the epilogue.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from flashvjp._config import AttentionConfig
from flashvjp.pallas import _common as C
from flashvjp.pallas.mosaic_gpu import _compat
from flashvjp.pallas.mosaic_gpu_sm100 import forward as F

LOG2E = math.log2(math.e)


def dq(cfg: AttentionConfig, q, k, v, out, lse, dout, dlse=None, *, interpret=None):
  """dL/dq [B, H, Sq, D] in q's dtype, for the forward's out [B, H, Sq, Dv], lse [B, H, Sq]
  (-inf at empty rows), the cotangents dout [B, H, Sq, Dv] and dlse [B, H, Sq] (or None).

  `interpret`: None follows cfg.interpret (the GPU interpreter with race detection). What the
  kernel lacks is a NotImplementedError naming it (the forward's `forward_problem`)."""
  problem = F.forward_problem(cfg, q, k, v)
  if problem is None and dout.shape != q.shape[:3] + v.shape[3:]:
    problem = f"dout must be [B, H, Sq, Dv] = {q.shape[:3] + v.shape[3:]}, got {dout.shape}"
  if problem is not None:
    raise NotImplementedError(f"pallas_mosaic_gpu dq (sm_100a): {problem}")
  if interpret is None:
    interpret = cfg.interpret
  B, H, Sq, D = q.shape
  Hkv, Skv, Dv = k.shape[1], k.shape[2], v.shape[3]
  G = H // Hkv
  BQ, BKV, STAGES = F.BQ, F.BKV, F.STAGES
  Dp, Dvp = F._round_up(D, F.HEAD_ALIGN), F._round_up(Dv, F.HEAD_ALIGN)
  Sqp, Skvp = F._round_up(Sq, BQ), F._round_up(Skv, BKV)
  nq, nk = Sqp // BQ, Skvp // BKV
  dt = q.dtype
  spec = C.mask_spec(cfg)
  scale2 = float(cfg.scale) * LOG2E
  NATIVE = plgpu.Layout.TCGEN05_TMEM_NATIVE
  ROW = NATIVE.reduce(1)
  TC = plgpu.Layout.TCGEN05
  L = plgpu.layout_cast
  i32 = lambda x: jnp.asarray(x, jnp.int32)
  lse2, delta = C.log2_rows(out, lse, dout, dlse, Sqp)

  def body(q_g, k_g, v_g, do_g, lse_g, delta_g, dq_g,
           q_s, do_s, k_s, v_s, lse_s, delta_s, s_t, dp_t, ds_t, dq_t,
           q_bar, do_bar, rows_bar, k_loaded, v_loaded, k_free, v_free, s_ready, s_consumed,
           ds_ready, dq_done):
    dq_s = q_s  # dQ's staging tile: Q's, read by no MMA once the last one is done
    i, h, b = lax.axis_index("q"), lax.axis_index("h"), lax.axis_index("b")
    kvh = lax.div(h, i32(G))
    rows = pl.ds(i * BQ, BQ)
    lo, hi = (i32(x) for x in spec.kv_block_range(i, BQ, BKV, nk))
    steps = jnp.maximum(hi - lo, 0)
    wg = lax.axis_index("wg")

    @pl.when(wg == 0)
    def _mma_tma_wg():
      @plgpu.warp_map
      def _(w):
        @pl.when(w == 1)
        def _tma():
          @pl.when(steps > 0)
          def _():
            plgpu.copy_gmem_to_smem(q_g.at[b, h, rows], q_s, q_bar)
            plgpu.copy_gmem_to_smem(do_g.at[b, h, rows], do_s, do_bar)

          @pl.loop(0, steps)
          def _(n):
            s = n % STAGES
            ks = pl.ds((lo + n) * BKV, BKV)

            @pl.when(n >= STAGES)
            def _():
              plgpu.barrier_wait(k_free.at[s])
            plgpu.copy_gmem_to_smem(k_g.at[b, kvh, ks], k_s.at[s], k_loaded.at[s])

            @pl.when(n >= STAGES)
            def _():
              plgpu.barrier_wait(v_free.at[s])
            plgpu.copy_gmem_to_smem(v_g.at[b, kvh, ks], v_s.at[s], v_loaded.at[s])

        @pl.when(w == 0)
        def _mma():
          def scores(n):
            s = n % STAGES
            plgpu.barrier_wait(k_loaded.at[s])
            plgpu.barrier_wait(v_loaded.at[s])

            @pl.when(n > 0)
            def _():
              plgpu.barrier_wait(s_consumed)   # WG1 has read S_{n-1} and dP_{n-1}
            plgpu.tcgen05_mma(s_t, q_s, k_s.at[s].T, accumulate=False)
            plgpu.tcgen05_mma(dp_t, do_s, v_s.at[s].T, v_free.at[s], accumulate=False)
            plgpu.tcgen05_commit_arrive(s_ready)

          def dq_step(n):
            s = n % STAGES
            plgpu.barrier_wait(ds_ready)       # dS_n in TMEM
            plgpu.tcgen05_mma(dq_t, ds_t, k_s.at[s], k_free.at[s], accumulate=n > 0)
            plgpu.tcgen05_commit_arrive(dq_done)

          @pl.when(steps > 0)
          def _():
            plgpu.barrier_wait(q_bar)
            plgpu.barrier_wait(do_bar)
            scores(0)

          @pl.loop(0, steps)
          def _(n):
            @pl.when(n + 1 < steps)
            def _():
              scores(n + 1)
            dq_step(n)

    @pl.when(wg == 1)
    def _grad_wg():
      plgpu.copy_gmem_to_smem(lse_g.at[b, h, rows], lse_s, rows_bar.at[0])
      plgpu.copy_gmem_to_smem(delta_g.at[b, h, rows], delta_s, rows_bar.at[1])
      plgpu.barrier_wait(rows_bar.at[0])
      plgpu.barrier_wait(rows_bar.at[1])
      lse_r = plgpu.load(lse_s, layout=ROW, optimized=False)
      delta_r = plgpu.load(delta_s, layout=ROW, optimized=False)
      bc = lambda x: L(lax.broadcast_in_dim(x, (BQ, BKV), [0]), NATIVE)

      def step(n, carry, masked):
        plgpu.barrier_wait(s_ready)
        sc = plgpu.async_load_tmem(s_t, layout=NATIVE)
        dp = plgpu.async_load_tmem(dp_t, layout=NATIVE)
        plgpu.wait_load_tmem()

        @pl.when(n + 1 < steps)
        def _():
          plgpu.barrier_arrive(s_consumed)
        p = L(jnp.exp2(sc * scale2 - bc(lse_r)), NATIVE)
        ds = L(p * (dp - bc(delta_r)), NATIVE)
        if masked:  # an edge block: the mask model elementwise (causal, window, padding)
          qi = i * BQ + plgpu.broadcasted_iota(jnp.int32, (BQ, BKV), 0, layout=NATIVE)
          ki = (lo + n) * BKV + plgpu.broadcasted_iota(jnp.int32, (BQ, BKV), 1, layout=NATIVE)
          ds = L(jnp.where(spec.allowed(qi, ki), ds, 0.0), NATIVE)

        @pl.when(n > 0)
        def _():
          plgpu.barrier_wait(dq_done)         # dQ += dS_{n-1} K done: dS free
        plgpu.async_store_tmem(ds_t, L(ds.astype(dt), NATIVE))
        plgpu.commit_tmem()
        plgpu.barrier_arrive(ds_ready)
        return carry

      f_lo, f_hi = (i32(x) for x in spec.full_kv_block_range(i, BQ, BKV))
      f_lo = jnp.clip(f_lo - lo, 0, steps)
      f_hi = jnp.clip(f_hi - lo, f_lo, steps)
      for start, stop, masked in ((0, f_lo, True), (f_lo, f_hi, False), (f_hi, steps, True)):
        lax.fori_loop(start, stop, lambda n, c, masked=masked: step(n, c, masked), 0)

      @pl.when(steps > 0)
      def _():
        plgpu.barrier_wait(dq_done)           # the last dQ MMA done

      @pl.when(steps == 0)
      def _():  # no kv block: no MMA wrote dQ
        for c in range(Dp // F.CORR_COLS):
          plgpu.async_store_tmem(dq_t.at[:, pl.ds(c * F.CORR_COLS, F.CORR_COLS)],
                                 L(jnp.zeros((BQ, F.CORR_COLS), jnp.float32), NATIVE))
        plgpu.commit_tmem()

      g = plgpu.async_load_tmem(dq_t, layout=TC)
      plgpu.wait_load_tmem()
      dq_s[...] = (g * float(cfg.scale)).astype(dt)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(dq_s, dq_g.at[b, h, rows])
      plgpu.wait_smem_to_gmem(0)

  otc = dict(orders_tensor_core=True)
  kw: dict = {}
  if interpret:
    kw["interpret"] = _compat.interpret_params(detect_races=True)
  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((B, H, Sqp, Dp), dt),
      grid=(nq, H, B), grid_names=("q", "h", "b"),
      num_threads=2, thread_name="wg",
      scratch_types=(
          F._tiled((BQ, Dp), dt), F._tiled((BQ, Dvp), dt),
          F._tiled((STAGES, BKV, Dp), dt), F._tiled((STAGES, BKV, Dvp), dt),
          plgpu.SMEM((BQ,), jnp.float32), plgpu.SMEM((BQ,), jnp.float32),
          plgpu.TMEM((BQ, BKV), jnp.float32),               # S
          plgpu.TMEM((BQ, BKV), jnp.float32),               # dP
          plgpu.TMEM((BQ, BKV), dt, packed=True),           # dS
          plgpu.TMEM((BQ, Dp), jnp.float32),                # dQ
          plgpu.Barrier(),                                   # q_bar
          plgpu.Barrier(),                                   # do_bar
          plgpu.Barrier(num_barriers=2),                     # rows_bar: lse2, delta
          plgpu.Barrier(num_barriers=STAGES),                # k_loaded
          plgpu.Barrier(num_barriers=STAGES),                # v_loaded
          plgpu.Barrier(num_barriers=STAGES, **otc),         # k_free
          plgpu.Barrier(num_barriers=STAGES, **otc),         # v_free
          plgpu.Barrier(**otc),                              # s_ready
          plgpu.Barrier(**otc),                              # s_consumed
          plgpu.Barrier(**otc),                              # ds_ready
          plgpu.Barrier(**otc),                              # dq_done
      ),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      **kw,
  )
  g = kernel(C.pad_seq_head(q, Sqp, Dp), C.pad_seq_head(k, Skvp, Dp),
             C.pad_seq_head(v, Skvp, Dvp), C.pad_seq_head(dout.astype(dt), Sqp, Dvp), lse2, delta)
  return g[:, :, :Sq, :D]
