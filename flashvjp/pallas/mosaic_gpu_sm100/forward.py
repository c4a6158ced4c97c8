"""Blackwell (sm_100a) forward prototype: single CTA, tcgen05 MMAs, S and O in TMEM.

Room: Pallas Mosaic-GPU backend for Blackwell (prototype, not dispatched; see the package
docstring). q [Sq, D], k / v [Skv, D] (one batch and head), 16-bit; Sq, Skv multiples of 128;
D 64 or 128. Returns out [Sq, D] (q's dtype) = softmax(q k^T * D**-0.5) v and the float32
logsumexp [Sq] (natural log).

One CTA per 128-row q tile, two warpgroups:
  WG0, warp 0: issues the tcgen05 MMAs: S = Q K^T into TMEM, then O += P V with P read from
    TMEM (packed 16-bit), in the order qk(0); for j: qk(j + 1), pv(j), so the next Q K^T runs
    under the softmax.
  WG0, warp 1: TMA: Q once, then K and V into 2-slot SMEM rings, a slot refilled once the MMA
    that read it has arrived on its "free" barrier.
  WG1: the softmax (S one row per thread, the TMEM-native layout) in the exp2 domain, the
    rescaling of O in TMEM (32 columns at a time), and the epilogue (O / l, lse).
Barriers (who arrives -> who waits):
  q_bar: Q's TMA -> the MMA warp, once.
  k_loaded[s] / v_loaded[s]: the TMA -> the MMA warp, per step.
  k_free[s] / v_free[s]: the MMA reading the slot (tcgen05 completion) -> the TMA warp before
    it refills the slot.
  s_ready: tcgen05_commit after Q K^T -> the softmax, per step.
  s_consumed: the softmax, once S_j is in registers -> the MMA warp before Q K^T_{j+1}
    overwrites S (single-buffered).
  p_ready: the softmax, once P_j is in TMEM and O is rescaled -> the MMA warp before P V_j.
  o_ready: tcgen05_commit after P V_j -> the softmax, before it rescales O and overwrites P
    (single-buffered), and before the epilogue.
Single-buffered S and P, no correction warpgroup and no conditional rescaling yet: the
simplest protocol first (docs/blackwell.md lists what comes next).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from flashvjp.pallas.mosaic_gpu import _compat

BQ = 128  # q rows per CTA: a tcgen05 M tile
BKV = 128  # kv rows per step
STAGES = 2  # K / V ring slots
HEAD_DIMS = (64, 128)
CORR_COLS = 32  # O is rescaled this many TMEM columns at a time
LOG2E = math.log2(math.e)


def _tiled(shape, dt):
  """An MMA operand tile in SMEM: (8, 64) tiles, 128-byte swizzle (the Hopper family's
  `mma_transforms`, shared: tcgen05 reads the same SMEM operand layouts)."""
  return plgpu.SMEM(shape, dt, transforms=_compat.mma_transforms(dt, 64))


def check_inputs(q, k, v):
  """ValueError / TypeError naming the argument, before any kernel is built."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 2:
      raise ValueError(f"{name} must be [seq, head_dim] (one batch and head), got {x.shape}")
    if x.dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
      raise TypeError(f"{name} must be bfloat16 or float16, got {x.dtype}")
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  if q.shape[1] not in HEAD_DIMS or k.shape[1] != q.shape[1] or v.shape != k.shape:
    raise ValueError(f"head dims must be one of {HEAD_DIMS} and match (v as k), got q"
                     f" {q.shape}, k {k.shape}, v {v.shape}")
  for name, n in (("q", q.shape[0]), ("k", k.shape[0])):
    if n % BQ:
      raise ValueError(f"{name}'s sequence length must be a multiple of {BQ}, got {n}")


def forward(q, k, v, *, interpret: bool = False):
  """(out, lse) of full attention; `interpret`: the GPU interpreter with race detection."""
  check_inputs(q, k, v)
  S, D = q.shape
  T = k.shape[0]
  dt = q.dtype
  nk = T // BKV
  scale = D ** -0.5 * LOG2E
  NATIVE = plgpu.Layout.TCGEN05_TMEM_NATIVE
  ROW = NATIVE.reduce(1)
  TC = plgpu.Layout.TCGEN05
  TC_ROW = TC.reduce(1)
  L = plgpu.layout_cast

  def body(q_g, k_g, v_g, out_g, lse_g,
           q_s, k_s, v_s, o_s, lse_s, l_s, s_t, p_t, o_t,
           q_bar, k_loaded, v_loaded, k_free, v_free,
           s_ready, s_consumed, p_ready, o_ready):
    qi = lax.axis_index("q")
    rows = pl.ds(qi * BQ, BQ)
    wg = lax.axis_index("wg")

    @pl.when(wg == 0)
    def _mma_tma_wg():
      @plgpu.warp_map
      def _(w):
        @pl.when(w == 1)
        def _tma():
          plgpu.copy_gmem_to_smem(q_g.at[rows], q_s, q_bar)

          @pl.loop(0, nk)
          def _(j):
            s = j % STAGES
            ks = pl.ds(j * BKV, BKV)

            @pl.when(j >= STAGES)
            def _():
              plgpu.barrier_wait(k_free.at[s])
            plgpu.copy_gmem_to_smem(k_g.at[ks], k_s.at[s], k_loaded.at[s])

            @pl.when(j >= STAGES)
            def _():
              plgpu.barrier_wait(v_free.at[s])
            plgpu.copy_gmem_to_smem(v_g.at[ks], v_s.at[s], v_loaded.at[s])

        @pl.when(w == 0)
        def _mma():
          def qk(j):
            s = j % STAGES
            plgpu.barrier_wait(k_loaded.at[s])

            @pl.when(j > 0)
            def _():
              plgpu.barrier_wait(s_consumed)   # softmax has read S_{j-1}
            plgpu.tcgen05_mma(s_t, q_s, k_s.at[s].T, k_free.at[s],
                              accumulate=False)
            plgpu.tcgen05_commit_arrive(s_ready)

          def pv(j):
            s = j % STAGES
            plgpu.barrier_wait(v_loaded.at[s])
            plgpu.barrier_wait(p_ready)        # P_j stored, O rescaled
            plgpu.tcgen05_mma(o_t, p_t, v_s.at[s], v_free.at[s],
                              accumulate=j > 0)
            plgpu.tcgen05_commit_arrive(o_ready)

          plgpu.barrier_wait(q_bar)
          qk(0)

          @pl.loop(0, nk)
          def _(j):
            @pl.when(j + 1 < nk)
            def _():
              qk(j + 1)
            pv(j)

    @pl.when(wg == 1)
    def _softmax_wg():
      bc = lambda x: lax.broadcast_in_dim(x, (BQ, BKV), [0])

      def step(j, carry):
        m, l = carry
        plgpu.barrier_wait(s_ready)
        sc = plgpu.async_load_tmem(s_t, layout=NATIVE)
        plgpu.wait_load_tmem()

        @pl.when(j + 1 < nk)
        def _():
          plgpu.barrier_arrive(s_consumed)
        sc = L(sc * scale, NATIVE)
        m_new = L(jnp.maximum(m, L(sc.max(axis=1), ROW)), ROW)
        alpha = L(jnp.exp2(m - m_new), ROW)
        p = L(jnp.exp2(sc - L(bc(m_new), NATIVE)), NATIVE)
        l = L(l * alpha + L(p.sum(axis=1), ROW), ROW)

        @pl.when(j > 0)
        def _():
          plgpu.barrier_wait(o_ready)         # PV_{j-1} done: O and P free
          for c in range(D // CORR_COLS):
            cs = pl.ds(c * CORR_COLS, CORR_COLS)
            o = plgpu.async_load_tmem(o_t.at[:, cs], layout=NATIVE)
            plgpu.wait_load_tmem()
            o = L(o * L(lax.broadcast_in_dim(alpha, o.shape, [0]), NATIVE), NATIVE)
            plgpu.async_store_tmem(o_t.at[:, cs], o)

        plgpu.async_store_tmem(p_t, L(p.astype(dt), NATIVE))
        plgpu.commit_tmem()
        plgpu.barrier_arrive(p_ready)
        return m_new, l

      m0 = plgpu.layout_cast(jnp.full((BQ,), -jnp.inf, jnp.float32), ROW)
      l0 = plgpu.layout_cast(jnp.zeros((BQ,), jnp.float32), ROW)
      m, l = lax.fori_loop(0, nk, step, (m0, l0))

      plgpu.barrier_wait(o_ready)             # last PV done
      # relayout l (row-per-thread) to the TCGEN05 row layout through SMEM
      l_s[...] = l
      lse_s[...] = L(m * (1.0 / LOG2E) + jnp.log(l), ROW)
      l_t = plgpu.load(l_s, layout=TC_ROW, optimized=False)
      o = plgpu.async_load_tmem(o_t, layout=TC)
      plgpu.wait_load_tmem()
      o = o / lax.broadcast_in_dim(l_t, o.shape, [0])
      o_s[...] = o.astype(dt)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_s, out_g.at[rows])
      plgpu.copy_smem_to_gmem(lse_s, lse_g.at[rows])
      plgpu.wait_smem_to_gmem(0)

  otc = dict(orders_tensor_core=True)
  kw: dict = {}
  if interpret:
    kw["interpret"] = plgpu.InterpretGPUParams(detect_races=True)
  kernel = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((S, D), dt),
                jax.ShapeDtypeStruct((S,), jnp.float32)),
      grid=(S // BQ,), grid_names=("q",),
      num_threads=2, thread_name="wg",
      scratch_types=(
          _tiled((BQ, D), dt), _tiled((STAGES, BKV, D), dt), _tiled((STAGES, BKV, D), dt),
          _tiled((BQ, D), dt), plgpu.SMEM((BQ,), jnp.float32),
          plgpu.SMEM((BQ,), jnp.float32),
          plgpu.TMEM((BQ, BKV), jnp.float32),
          plgpu.TMEM((BQ, BKV), dt, packed=True),
          plgpu.TMEM((BQ, D), jnp.float32),
          plgpu.Barrier(),                                   # q_bar
          plgpu.Barrier(num_barriers=STAGES),                # k_loaded
          plgpu.Barrier(num_barriers=STAGES),                # v_loaded
          plgpu.Barrier(num_barriers=STAGES, **otc),         # k_free
          plgpu.Barrier(num_barriers=STAGES, **otc),         # v_free
          plgpu.Barrier(**otc),                              # s_ready
          plgpu.Barrier(**otc),                              # s_consumed
          plgpu.Barrier(**otc),                              # p_ready
          plgpu.Barrier(**otc),                              # o_ready
      ),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      **kw,
  )
  return kernel(q, k, v)
