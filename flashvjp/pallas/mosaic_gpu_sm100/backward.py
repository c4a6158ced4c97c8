"""Blackwell (sm_100a) backward: dQ and dK / dV kernels (single CTA, tcgen05 MMAs, TMEM).

Room: Pallas Mosaic-GPU backend for Blackwell (see the package docstring).
`dq(cfg, q, k, v, out, lse, dout, dlse)` is dL/dq of the forward `forward.forward` computes
(the same inputs and mask model: [B, H, S, D] layouts, GQA / MQA, causal and window masks, any
sequence lengths, head dims up to 128); `dkdv(...)` is (dL/dk, dL/dv), the GQA group's query
heads summed in-kernel (K / V never repeated). Both deterministic: each CTA owns its output
rows, no atomics.

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

The dK / dV kernel (`dkdv`): one CTA per (128-row kv block, kv head, batch), the transposed
products (tokamax's sm100 VJP's orientation): S^T = K Q^T and dP^T = V dO^T into TMEM
[128 kv, 64 q] (TCGEN05 layout: lse2 and delta as column vectors), P^T and dS^T packed to TMEM
as the A operands of dV += P^T dO and dK += dS^T Q; the steps walk the group's query heads and,
per head, the q blocks the mask model gives the kv block (edge blocks masked elementwise). K and
V are loaded once; Q, dO, lse2 and delta stream through a 2-slot ring: a Q slot is free once
dK's MMA (the last to read it) is done, a dO slot once dV's is, an lse2 / delta slot once WG1
has read it (`rows_free`, behind a proxy fence). TMEM: 64 + 32 + 64 + 32 + D + Dv <= 448 columns.
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
from flashvjp.pallas.mosaic_gpu_sm100 import _pipeline as P
from flashvjp.pallas.mosaic_gpu_sm100 import forward as F

LOG2E = math.log2(math.e)


def _operands(what, cfg, q, k, v, out, lse, dout, dlse):
  """The backward kernels' operands, padded once for both: q, k, v and dO to whole blocks and
  head dims, lse2 and delta (`C.log2_rows`); first the checks (a NotImplementedError naming
  `what` and the missing piece: the forward's `forward_problem`)."""
  problem = F.forward_problem(cfg, q, k, v)
  if problem is None and dout.shape != q.shape[:3] + v.shape[3:]:
    problem = f"dout must be [B, H, Sq, Dv] = {q.shape[:3] + v.shape[3:]}, got {dout.shape}"
  if problem is not None:
    raise NotImplementedError(f"pallas_mosaic_gpu {what} (sm_100a): {problem}")
  Dp, Dvp = F._round_up(q.shape[3], F.HEAD_ALIGN), F._round_up(v.shape[3], F.HEAD_ALIGN)
  Sqp, Skvp = F._round_up(q.shape[2], F.BQ), F._round_up(k.shape[2], F.BKV)
  return (C.pad_seq_head(q, Sqp, Dp), C.pad_seq_head(k, Skvp, Dp), C.pad_seq_head(v, Skvp, Dvp),
          C.pad_seq_head(dout.astype(q.dtype), Sqp, Dvp),
          *C.log2_rows(out, lse, dout, dlse, Sqp))


def dq(cfg: AttentionConfig, q, k, v, out, lse, dout, dlse=None, *, interpret=None):
  """dL/dq [B, H, Sq, D] in q's dtype, for the forward's out [B, H, Sq, Dv], lse [B, H, Sq]
  (-inf at empty rows), the cotangents dout [B, H, Sq, Dv] and dlse [B, H, Sq] (or None).

  `interpret`: None follows cfg.interpret (the GPU interpreter with race detection). What the
  kernel lacks is a NotImplementedError naming it (the forward's `forward_problem`)."""
  return _dq(cfg, q, k, v, _operands("dq", cfg, q, k, v, out, lse, dout, dlse), interpret)


def _dq(cfg: AttentionConfig, q, k, v, operands, interpret):
  """`dq` on `_operands`' padded arrays (q, k, v for their shapes and dtype)."""
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
            P.stream_kv(n, lo + n, BKV, k_g.at[b, kvh], v_g.at[b, kvh], k_s, v_s, k_loaded,
                        v_loaded, k_free, v_free)

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

          def start():
            plgpu.barrier_wait(q_bar)
            plgpu.barrier_wait(do_bar)

          P.mma_pipeline(steps, start, scores, dq_step)

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

      full = tuple(i32(x) - lo for x in spec.full_kv_block_range(i, BQ, BKV))
      P.edge_runs(i32(0), steps, full, step, 0)

      @pl.when(steps > 0)
      def _():
        plgpu.barrier_wait(dq_done)           # the last dQ MMA done

      @pl.when(steps == 0)
      def _():  # no kv block: no MMA wrote dQ
        P.zero_tmem(dq_t, BQ, Dp, NATIVE)

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
      grid=(nq, H, B), grid_names=("q", "h", "b"), kernel_name="flashvjp_sm100_bwd_dq",
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
  g = kernel(*operands)
  return g[:, :, :Sq, :D]


BQ_DKV = 64  # q rows per dK / dV step (the N of S^T = K Q^T)


def dkdv(cfg: AttentionConfig, q, k, v, out, lse, dout, dlse=None, *, interpret=None):
  """(dL/dk [B, Hkv, Skv, D], dL/dv [B, Hkv, Skv, Dv]) in k's dtype, the GQA group's query heads
  summed; the arguments as `dq`'s."""
  return _dkdv(cfg, q, k, v, _operands("dkdv", cfg, q, k, v, out, lse, dout, dlse), interpret)


def _dkdv(cfg: AttentionConfig, q, k, v, operands, interpret):
  """`dkdv` on `_operands`' padded arrays (q, k, v for their shapes and dtype)."""
  if interpret is None:
    interpret = cfg.interpret
  B, H, Sq, D = q.shape
  Hkv, Skv, Dv = k.shape[1], k.shape[2], v.shape[3]
  G = H // Hkv
  BQ, BKV, STAGES = BQ_DKV, F.BKV, F.STAGES
  Dp, Dvp = F._round_up(D, F.HEAD_ALIGN), F._round_up(Dv, F.HEAD_ALIGN)
  Sqp, Skvp = F._round_up(Sq, F.BQ), F._round_up(Skv, BKV)
  nq, nk = Sqp // BQ, Skvp // BKV
  dt = q.dtype
  spec = C.mask_spec(cfg)
  scale2 = float(cfg.scale) * LOG2E
  TC = plgpu.Layout.TCGEN05
  COL = TC.reduce(0)
  L = plgpu.layout_cast
  i32 = lambda x: jnp.asarray(x, jnp.int32)

  def body(q_g, k_g, v_g, do_g, lse_g, delta_g, dk_g, dv_g,
           k_s, v_s, q_s, do_s, lse_s, delta_s, st_t, pt_t, dpt_t, dst_t, dk_t, dv_t,
           kv_bar, qdo_loaded, rows_loaded, q_free, do_free, rows_free, s_ready, s_consumed,
           p_ready, ds_ready, dv_done, dk_done):
    j, hk, b = lax.axis_index("kv"), lax.axis_index("h"), lax.axis_index("b")
    kv_rows = pl.ds(j * BKV, BKV)
    qlo, qhi = (i32(x) for x in spec.q_block_range(j, BQ, BKV, nq))
    per_head = jnp.maximum(qhi - qlo, 0)
    steps = G * per_head
    safe = jnp.maximum(per_head, 1)

    def head_and_block(n):
      return hk * G + lax.div(n, safe), qlo + lax.rem(n, safe)

    wg = lax.axis_index("wg")

    @pl.when(wg == 0)
    def _mma_tma_wg():
      @plgpu.warp_map
      def _(w):
        @pl.when(w == 1)
        def _tma():
          @pl.when(steps > 0)
          def _():
            plgpu.copy_gmem_to_smem(k_g.at[b, hk, kv_rows], k_s, kv_bar)
            plgpu.copy_gmem_to_smem(v_g.at[b, hk, kv_rows], v_s, kv_bar)

          @pl.loop(0, steps)
          def _(n):
            s = n % STAGES
            h, qb = head_and_block(n)
            qs = pl.ds(qb * BQ, BQ)

            @pl.when(n >= STAGES)
            def _():
              plgpu.barrier_wait(q_free.at[s])  # dK's MMA of step n - 2 read the slot
            plgpu.copy_gmem_to_smem(q_g.at[b, h, qs], q_s.at[s], qdo_loaded.at[s])

            @pl.when(n >= STAGES)
            def _():
              plgpu.barrier_wait(do_free.at[s])  # dV's MMA of step n - 2 read the slot
            plgpu.copy_gmem_to_smem(do_g.at[b, h, qs], do_s.at[s], qdo_loaded.at[s])

            @pl.when(n >= STAGES)
            def _():
              plgpu.barrier_wait(rows_free.at[s])  # WG1 has read step n - 2's lse2, delta
            plgpu.copy_gmem_to_smem(lse_g.at[b, h, qs], lse_s.at[s], rows_loaded.at[s])
            plgpu.copy_gmem_to_smem(delta_g.at[b, h, qs], delta_s.at[s], rows_loaded.at[s])

        @pl.when(w == 0)
        def _mma():
          def scores(n):
            s = n % STAGES
            plgpu.barrier_wait(qdo_loaded.at[s])

            @pl.when(n > 0)
            def _():
              plgpu.barrier_wait(s_consumed)   # WG1 has read S^T_{n-1} and dP^T_{n-1}
            plgpu.tcgen05_mma(st_t, k_s, q_s.at[s].T, accumulate=False)
            plgpu.tcgen05_mma(dpt_t, v_s, do_s.at[s].T, accumulate=False)
            plgpu.tcgen05_commit_arrive(s_ready)

          def grads(n):
            s = n % STAGES
            plgpu.barrier_wait(p_ready)        # P^T_n in TMEM
            plgpu.tcgen05_mma(dv_t, pt_t, do_s.at[s], do_free.at[s], accumulate=n > 0)
            plgpu.tcgen05_commit_arrive(dv_done)
            plgpu.barrier_wait(ds_ready)       # dS^T_n in TMEM
            plgpu.tcgen05_mma(dk_t, dst_t, q_s.at[s], q_free.at[s], accumulate=n > 0)
            plgpu.tcgen05_commit_arrive(dk_done)

          P.mma_pipeline(steps, lambda: plgpu.barrier_wait(kv_bar), scores, grads)

    @pl.when(wg == 1)
    def _grad_wg():
      bc = lambda x: L(lax.broadcast_in_dim(x, (BKV, BQ), [1]), TC)

      def step(n, qb, masked):
        s = n % STAGES
        plgpu.barrier_wait(s_ready)
        st = plgpu.async_load_tmem(st_t, layout=TC)
        dpt = plgpu.async_load_tmem(dpt_t, layout=TC)
        plgpu.wait_load_tmem()

        @pl.when(n + 1 < steps)
        def _():
          plgpu.barrier_arrive(s_consumed)
        plgpu.barrier_wait(rows_loaded.at[s])
        lse_c = plgpu.load(lse_s.at[s], layout=COL, optimized=False)
        delta_c = plgpu.load(delta_s.at[s], layout=COL, optimized=False)

        @pl.when(n + STAGES < steps)
        def _():
          plgpu.commit_smem()  # the generic loads before the TMA refill (a proxy fence)
          plgpu.barrier_arrive(rows_free.at[s])
        pt = L(jnp.exp2(st * scale2 - bc(lse_c)), TC)
        if masked:  # an edge block: the mask model elementwise (causal, window, padding)
          ki = j * BKV + plgpu.broadcasted_iota(jnp.int32, (BKV, BQ), 0, layout=TC)
          qi = qb * BQ + plgpu.broadcasted_iota(jnp.int32, (BKV, BQ), 1, layout=TC)
          pt = L(jnp.where(spec.allowed(qi, ki), pt, 0.0), TC)

        @pl.when(n > 0)
        def _():
          plgpu.barrier_wait(dv_done)         # dV += P^T_{n-1} dO done: P^T free
        plgpu.async_store_tmem(pt_t, L(pt.astype(dt), TC))
        plgpu.commit_tmem()
        plgpu.barrier_arrive(p_ready)
        dst = L(pt * (dpt - bc(delta_c)), TC)  # 0 wherever P^T is (masked, empty rows)

        @pl.when(n > 0)
        def _():
          plgpu.barrier_wait(dk_done)         # dK += dS^T_{n-1} Q done: dS^T free
        plgpu.async_store_tmem(dst_t, L(dst.astype(dt), TC))
        plgpu.commit_tmem()
        plgpu.barrier_arrive(ds_ready)

      full = tuple(i32(x) for x in spec.full_q_block_range(j, BQ, BKV, nq))

      def head(g, carry):
        base = g * per_head - qlo  # step n of q block qb: base + qb

        def q_step(qb, c, masked):
          step(base + qb, qb, masked)
          return c
        return P.edge_runs(qlo, qhi, full, q_step, carry)
      lax.fori_loop(0, G, head, 0)

      @pl.when(steps > 0)
      def _():
        plgpu.barrier_wait(dv_done)           # the last dV and dK MMAs done
        plgpu.barrier_wait(dk_done)

      @pl.when(steps == 0)
      def _():  # no q block attends this kv block: no MMA wrote dK / dV
        P.zero_tmem(dk_t, BKV, Dp, TC)
        P.zero_tmem(dv_t, BKV, Dvp, TC)

      dk = plgpu.async_load_tmem(dk_t, layout=TC)
      dv = plgpu.async_load_tmem(dv_t, layout=TC)
      plgpu.wait_load_tmem()
      k_s[...] = (dk * float(cfg.scale)).astype(dt)  # K / V's tiles, read by no MMA now
      v_s[...] = dv.astype(dt)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(k_s, dk_g.at[b, hk, kv_rows])
      plgpu.copy_smem_to_gmem(v_s, dv_g.at[b, hk, kv_rows])
      plgpu.wait_smem_to_gmem(0)

  otc = dict(orders_tensor_core=True)
  kw: dict = {}
  if interpret:
    kw["interpret"] = _compat.interpret_params(detect_races=True)
  kernel = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((B, Hkv, Skvp, Dp), dt),
                jax.ShapeDtypeStruct((B, Hkv, Skvp, Dvp), dt)),
      grid=(nk, Hkv, B), grid_names=("kv", "h", "b"), kernel_name="flashvjp_sm100_bwd_dkdv",
      num_threads=2, thread_name="wg",
      scratch_types=(
          F._tiled((BKV, Dp), dt), F._tiled((BKV, Dvp), dt),
          F._tiled((STAGES, BQ, Dp), dt), F._tiled((STAGES, BQ, Dvp), dt),
          plgpu.SMEM((STAGES, BQ), jnp.float32), plgpu.SMEM((STAGES, BQ), jnp.float32),
          plgpu.TMEM((BKV, BQ), jnp.float32),               # S^T
          plgpu.TMEM((BKV, BQ), dt, packed=True),           # P^T
          plgpu.TMEM((BKV, BQ), jnp.float32),               # dP^T
          plgpu.TMEM((BKV, BQ), dt, packed=True),           # dS^T
          plgpu.TMEM((BKV, Dp), jnp.float32),               # dK
          plgpu.TMEM((BKV, Dvp), jnp.float32),              # dV
          plgpu.Barrier(num_arrivals=2),                     # kv_bar: K and V
          plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),  # qdo_loaded: Q and dO
          plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),  # rows_loaded: lse2, delta
          plgpu.Barrier(num_barriers=STAGES, **otc),         # q_free
          plgpu.Barrier(num_barriers=STAGES, **otc),         # do_free
          plgpu.Barrier(num_barriers=STAGES),                # rows_free
          plgpu.Barrier(**otc),                              # s_ready
          plgpu.Barrier(**otc),                              # s_consumed
          plgpu.Barrier(**otc),                              # p_ready
          plgpu.Barrier(**otc),                              # ds_ready
          plgpu.Barrier(**otc),                              # dv_done
          plgpu.Barrier(**otc),                              # dk_done
      ),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      **kw,
  )
  dk, dv = kernel(*operands)
  return dk[:, :, :Skv, :D], dv[:, :, :Skv, :Dv]


def backward(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out, lse,
             dout, dlse, mod=None, offsets=None):
  """(dq, dk, dv, None, ()): the Hopper family's `backward` interface (no dbias, no score_mod
  consts' gradients: what the kernels lack is a NotImplementedError naming it, before any
  kernel)."""
  problem = F.forward_problem(cfg, q, k, v, bias=bias, mask=mask, q_seg=q_seg, kv_seg=kv_seg,
                              seed=seed, consts=consts, mod=mod, offsets=offsets)
  if problem is not None:
    raise NotImplementedError(f"pallas_mosaic_gpu backward (sm_100a): {problem}")
  operands = _operands("backward", cfg, q, k, v, out, lse, dout, dlse)
  dk, dv = _dkdv(cfg, q, k, v, operands, None)
  return _dq(cfg, q, k, v, operands, None), dk, dv, None, ()
