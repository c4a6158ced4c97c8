"""Blackwell (sm_100a) forward: single CTA, tcgen05 MMAs, S and O in TMEM.

Room: Pallas Mosaic-GPU backend for Blackwell (see the package docstring).
The interface of the Hopper family's `forward` (`flashvjp.pallas.mosaic_gpu.forward`): q [B, H,
Sq, D], k [B, Hkv, Skv, D], v [B, Hkv, Skv, Dv], 16-bit, head dims up to 128 (zero-padded to a
multiple of 64), any sequence lengths (padded to whole 128-blocks), GQA / MQA, causal and
window masks through the shared mask model (`flashvjp._mask.MaskSpec`: each CTA visits only
its kv block range; the elementwise mask runs on its edge blocks, the blocks in between pay
nothing for it). Returns out [B, H, Sq, Dv] (q's dtype) and the float32 logsumexp [B, H, Sq]
(natural log, -inf at rows that attend nothing, where out is 0). What it does not implement
yet (segment ids, masks, bias, dropout, mods, ring offsets, a float32 out, max logits, head
dims above 128) is refused by name (`forward_problem`) before any kernel is built.

One CTA per (128-row q tile, head, batch), two warpgroups:
  WG0, warp 0: issues the tcgen05 MMAs: S = Q K^T into TMEM, then O += P V with P read from
    TMEM (packed 16-bit), in the order qk(0); for n: qk(n + 1), pv(n), so the next Q K^T runs
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
  s_consumed: the softmax, once S_n is in registers -> the MMA warp before Q K^T_{n+1}
    overwrites S (single-buffered).
  p_ready: the softmax, once P_n is in TMEM and O is rescaled -> the MMA warp before P V_n.
  o_ready: tcgen05_commit after P V_n -> the softmax, before it rescales O and overwrites P
    (single-buffered), and before the epilogue.
Every warp walks the CTA's steps n = 0 .. steps - 1 (kv block lo + n); a CTA with no kv block
(a window past its rows) issues no MMA and writes out 0 and lse -inf. Single-buffered S and
P, no correction warpgroup and no conditional rescaling yet: the simplest protocol first
(docs/blackwell.md lists what comes next).
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
from flashvjp.pallas.mosaic_gpu import _limits
from flashvjp.pallas.mosaic_gpu_sm100 import _pipeline as P

BQ = 128  # q rows per CTA: a tcgen05 M tile
BKV = 128  # kv rows per step
STAGES = P.STAGES  # K / V ring slots
# S (128 columns) + P (64, packed) + O (<= 128) within TMEM's 512: dispatch's limit too
MAX_HEAD_DIM = _limits.BLACKWELL_MAX_HEAD_DIM
HEAD_ALIGN = 64  # head dims are zero-padded to a multiple of this (one swizzle row)
CORR_COLS = P.CORR_COLS  # O is rescaled this many TMEM columns at a time
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _tiled(shape, dt):
  """An MMA operand tile in SMEM: (8, 64) tiles, 128-byte swizzle (the Hopper family's
  `mma_transforms`, shared: tcgen05 reads the same SMEM operand layouts)."""
  return plgpu.SMEM(shape, dt, transforms=_compat.mma_transforms(dt, 64))


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def forward_problem(cfg: AttentionConfig, q, k, v, *, bias=None, mask=None, q_seg=None,
                    kv_seg=None, seed=None, consts=(), mod=None, offsets=None) -> str | None:
  """Why this kernel cannot run the call (a sentence naming the argument), or None."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      return f"{name} must be rank 4 ([batch, heads, seq, head_dim]), got shape {x.shape}"
    if jnp.dtype(x.dtype) not in DTYPES:
      return f"{name} is {jnp.dtype(x.dtype).name}: the sm_100a kernels take bfloat16 / float16"
  if not (q.dtype == k.dtype == v.dtype):
    return f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
  if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
    return f"shapes q {q.shape}, k {k.shape}, v {v.shape} do not match"
  if q.shape[1] % k.shape[1]:
    return f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads"
  if max(q.shape[3], v.shape[3]) > MAX_HEAD_DIM:
    return (f"head_dim {q.shape[3]} / head_dim_v {v.shape[3]} above {MAX_HEAD_DIM} (not yet on"
            " sm_100a)")
  named = (("bias", bias is not None), ("mask", mask is not None),
           ("segment ids", q_seg is not None or kv_seg is not None),
           ("dropout", cfg.dropout_active), ("score_mod", cfg.score_mod is not None),
           ("mask_mod", cfg.mask_mod is not None or mod is not None),
           ("ring offsets", offsets is not None), ("a float32 out", cfg.out_f32),
           ("max_logits", cfg.max_logits), ("score_mod consts", bool(tuple(consts))))
  missing = [n for n, present in named if present]
  if missing:
    return f"not yet on sm_100a: {', '.join(missing)}"
  return None


def forward(cfg: AttentionConfig, q, k, v, bias=None, mask=None, q_seg=None, kv_seg=None,
            seed=None, consts=(), mod=None, offsets=None, *, interpret=None):
  """(out, lse) with the interface of `flashvjp.pallas.mosaic_gpu.forward.forward`.

  `interpret`: None follows cfg.interpret (the GPU interpreter with race detection); True /
  False force it. What the kernel lacks is a NotImplementedError naming it (`forward_problem`).
  """
  problem = forward_problem(cfg, q, k, v, bias=bias, mask=mask, q_seg=q_seg, kv_seg=kv_seg,
                            seed=seed, consts=consts, mod=mod, offsets=offsets)
  if problem is not None:
    raise NotImplementedError(f"pallas_mosaic_gpu forward (sm_100a): {problem}")
  if interpret is None:
    interpret = cfg.interpret
  B, H, Sq, D = q.shape
  Hkv, Skv, Dv = k.shape[1], k.shape[2], v.shape[3]
  G = H // Hkv
  Dp, Dvp = _round_up(D, HEAD_ALIGN), _round_up(Dv, HEAD_ALIGN)
  Sqp, Skvp = _round_up(Sq, BQ), _round_up(Skv, BKV)
  nq, nk = Sqp // BQ, Skvp // BKV
  dt = q.dtype
  spec = C.mask_spec(cfg)
  scale2 = float(cfg.scale) * LOG2E
  neg = float(jnp.finfo(jnp.float32).min)  # C.mask_value(float32): the finite -inf
  NATIVE = plgpu.Layout.TCGEN05_TMEM_NATIVE
  ROW = NATIVE.reduce(1)
  TC = plgpu.Layout.TCGEN05
  TC_ROW = TC.reduce(1)
  L = plgpu.layout_cast
  i32 = lambda x: jnp.asarray(x, jnp.int32)

  def body(q_g, k_g, v_g, out_g, lse_g,
           q_s, k_s, v_s, o_s, lse_s, l_s, s_t, p_t, o_t,
           q_bar, k_loaded, v_loaded, k_free, v_free,
           s_ready, s_consumed, p_ready, o_ready):
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

          @pl.loop(0, steps)
          def _(n):
            P.stream_kv(n, lo + n, BKV, k_g.at[b, kvh], v_g.at[b, kvh], k_s, v_s, k_loaded,
                        v_loaded, k_free, v_free)

        @pl.when(w == 0)
        def _mma():
          def qk(n):
            s = n % STAGES
            plgpu.barrier_wait(k_loaded.at[s])

            @pl.when(n > 0)
            def _():
              plgpu.barrier_wait(s_consumed)   # the softmax has read S_{n-1}
            plgpu.tcgen05_mma(s_t, q_s, k_s.at[s].T, k_free.at[s], accumulate=False)
            plgpu.tcgen05_commit_arrive(s_ready)

          def pv(n):
            s = n % STAGES
            plgpu.barrier_wait(v_loaded.at[s])
            plgpu.barrier_wait(p_ready)        # P_n stored, O rescaled
            plgpu.tcgen05_mma(o_t, p_t, v_s.at[s], v_free.at[s], accumulate=n > 0)
            plgpu.tcgen05_commit_arrive(o_ready)

          P.mma_pipeline(steps, lambda: plgpu.barrier_wait(q_bar), qk, pv)

    @pl.when(wg == 1)
    def _softmax_wg():
      bc = lambda x: lax.broadcast_in_dim(x, (BQ, BKV), [0])

      def step(n, carry, masked):
        m, l = carry
        plgpu.barrier_wait(s_ready)
        sc = plgpu.async_load_tmem(s_t, layout=NATIVE)
        plgpu.wait_load_tmem()

        @pl.when(n + 1 < steps)
        def _():
          plgpu.barrier_arrive(s_consumed)
        sc = L(sc * scale2, NATIVE)
        if masked:  # an edge block: the mask model elementwise (causal, window, padding)
          qi = i * BQ + plgpu.broadcasted_iota(jnp.int32, (BQ, BKV), 0, layout=NATIVE)
          ki = (lo + n) * BKV + plgpu.broadcasted_iota(jnp.int32, (BQ, BKV), 1, layout=NATIVE)
          ok = spec.allowed(qi, ki)
          sc = L(jnp.where(ok, sc, neg), NATIVE)
        m_new = L(jnp.maximum(m, L(sc.max(axis=1), ROW)), ROW)
        alpha = L(jnp.exp2(m - m_new), ROW)
        p = L(jnp.exp2(sc - L(bc(m_new), NATIVE)), NATIVE)
        if masked:  # exactly 0 at masked entries (a row masked so far has m_new = neg)
          p = L(jnp.where(ok, p, 0.0), NATIVE)
        l = L(l * alpha + L(p.sum(axis=1), ROW), ROW)

        @pl.when(n > 0)
        def _():
          plgpu.barrier_wait(o_ready)         # PV_{n-1} done: O and P free
          for c in range(Dvp // CORR_COLS):
            cs = pl.ds(c * CORR_COLS, CORR_COLS)
            o = plgpu.async_load_tmem(o_t.at[:, cs], layout=NATIVE)
            plgpu.wait_load_tmem()
            o = L(o * L(lax.broadcast_in_dim(alpha, o.shape, [0]), NATIVE), NATIVE)
            plgpu.async_store_tmem(o_t.at[:, cs], o)

        plgpu.async_store_tmem(p_t, L(p.astype(dt), NATIVE))
        plgpu.commit_tmem()
        plgpu.barrier_arrive(p_ready)
        return m_new, l

      # the CTA's steps: masked edge blocks, the fully visible ones between, masked again
      full = tuple(i32(x) - lo for x in spec.full_kv_block_range(i, BQ, BKV))
      m, l = P.edge_runs(i32(0), steps, full, step,
                         (L(jnp.full((BQ,), neg, jnp.float32), ROW),
                          L(jnp.zeros((BQ,), jnp.float32), ROW)))

      @pl.when(steps > 0)
      def _():
        plgpu.barrier_wait(o_ready)           # the last PV done

      @pl.when(steps == 0)
      def _():  # no kv block: no MMA wrote O
        P.zero_tmem(o_t, BQ, Dvp, NATIVE)

      empty = l == 0.0
      # l (row per thread) into the TCGEN05 row layout through SMEM
      l_s[...] = L(jnp.where(empty, 1.0, l), ROW)
      lse_s[...] = L(jnp.where(empty, neg, m * LN2 + jnp.log(jnp.where(empty, 1.0, l))), ROW)
      l_t = plgpu.load(l_s, layout=TC_ROW, optimized=False)
      o = plgpu.async_load_tmem(o_t, layout=TC)
      plgpu.wait_load_tmem()
      o = o / lax.broadcast_in_dim(l_t, o.shape, [0])
      o_s[...] = o.astype(dt)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_s, out_g.at[b, h, rows])
      plgpu.copy_smem_to_gmem(lse_s, lse_g.at[b, h, rows])
      plgpu.wait_smem_to_gmem(0)

  otc = dict(orders_tensor_core=True)
  kw: dict = {}
  if interpret:
    kw["interpret"] = _compat.interpret_params(detect_races=True)
  kernel = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((B, H, Sqp, Dvp), dt),
                jax.ShapeDtypeStruct((B, H, Sqp), jnp.float32)),
      grid=(nq, H, B), grid_names=("q", "h", "b"), kernel_name="flashvjp_sm100_fwd",
      num_threads=2, thread_name="wg",
      scratch_types=(
          _tiled((BQ, Dp), dt), _tiled((STAGES, BKV, Dp), dt), _tiled((STAGES, BKV, Dvp), dt),
          _tiled((BQ, Dvp), dt), plgpu.SMEM((BQ,), jnp.float32),
          plgpu.SMEM((BQ,), jnp.float32),
          plgpu.TMEM((BQ, BKV), jnp.float32),
          plgpu.TMEM((BQ, BKV), dt, packed=True),
          plgpu.TMEM((BQ, Dvp), jnp.float32),
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
  out, lse = kernel(C.pad_seq_head(q, Sqp, Dp), C.pad_seq_head(k, Skvp, Dp),
                    C.pad_seq_head(v, Skvp, Dvp))
  (lse,) = C.neg_inf_at_empty([lse[:, :, :Sq]], jnp.float32)
  return out[:, :, :Sq, :Dv], lse
