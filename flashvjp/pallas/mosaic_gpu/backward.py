"""Pallas Mosaic-GPU backward (Hopper, sm_90a): a dK/dV kernel and a dQ kernel.

Room: Pallas Mosaic-GPU backend (backward). Probabilities are recomputed from the saved
logsumexp in the exp2 domain; nothing O(seq_q * seq_kv) is kept or written; no atomics:
every output block is written by exactly one program (bitwise deterministic).

Both kernels run two warpgroups per program (`plgpu.kernel`, num_threads=2):

* warpgroup 0 computes. It loads its program's resident tiles itself (TMA, one barrier
  each) and then consumes a ring of `_STAGES` SMEM slots; every matmul is an SS-wgmma
  (both operands in SMEM: P and dS are stored to SMEM, fenced with `commit_smem`, then fed
  to the tensor cores), so the interpreter runs the kernels as they are (no register-operand
  wgmma, no `pl.run_state`). The dK / dV / dQ accumulators are wgmma accumulator refs
  (`plgpu.ACC`) that live across the whole loop.
* warpgroup 1 produces: it streams the loop's tiles into the ring by TMA, one "loaded"
  barrier per buffer and slot, and waits on the slot's "free" barrier (arrived at by the
  consumer once its wgmmas on that slot completed) before refilling it.

dK/dV kernel: grid (batch, kv head, kv block); loops over the G query heads of the group
and, for each, over the q blocks that see this kv block (`MaskSpec.q_block_range`), so GQA
gradients are summed in-kernel without repeating K/V. Ring: Q, dO, lse, delta of one q
block. Tiles are transposed ([bk, bq]: sT = K Q^T, dPT = V dO^T, dV += PT dO, dK += dST Q).
The lse / delta slots are read with generic loads: the consumer fences (`commit_smem`)
before it frees the slot, or the producer's TMA refill would race those reads (the race of
JAX's own dkv kernel).

dQ kernel: grid (batch, head, q block); loops over the kv blocks of q block i
(`MaskSpec.kv_block_range`). Ring: K, V of one kv block.

Causal / window / sequence padding: whole blocks outside the mask model's static bounds are
never visited; the elementwise mask runs only on the blocks outside
`full_q_block_range` / `full_kv_block_range` (three loops: masked, unmasked, masked).

Segment ids: the q block's ids travel with it (ring slot or resident SMEM, 1-D TMA), and
every block inside the static bounds is visited with the elementwise mask (no block
skipping by segment yet: packed documents cost like their causal / window bounds).

Supported: bfloat16 / float16 inputs (float32 accumulation), head dims <= 128 (padded with
zeros to a multiple of 64), GQA / MQA, causal, window, segment ids, any sequence lengths
(padded to whole 64-blocks), a cotangent on lse (folded into delta). Not yet: bias / dbias,
a dense mask, score_mod, mask_mod, dropout, global offsets; `backward` refuses them by
name before any kernel runs.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from flashvjp import _mask
from flashvjp._config import AttentionConfig
from flashvjp.pallas import _common as C
from flashvjp.pallas.mosaic_gpu import _compat

LOG2E = math.log2(math.e)
_STAGES = 2  # ring slots of the streamed operands
_BLOCK = 64  # block_q = block_kv: one wgmma M tile per compute warpgroup
_MAX_HEAD_DIM = 128
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# Test-only fault injection (tests/test_pallas_mosaic_gpu_backward.py): a name from
# _MUTATIONS removes one synchronisation step so the interpreter's race detector can be
# shown to catch it. Read when the kernels are traced; never set outside tests.
_MUTATIONS = ("skip_loaded_wait", "skip_free_wait", "skip_lse_fence")
_TEST_MUTATION: str | None = None
_DETECT_RACES = True  # interpret mode: race detection on (the tests assert none)


@dataclasses.dataclass(frozen=True)
class _Geo:
  """Static sizes of one backward launch (sequences padded to whole blocks)."""

  B: int
  H: int
  Hkv: int
  Sq: int
  Skv: int
  Dp: int
  Dvp: int
  bq: int = _BLOCK
  bk: int = _BLOCK

  @property
  def G(self) -> int:
    return self.H // self.Hkv

  @property
  def nq(self) -> int:
    return -(-self.Sq // self.bq)

  @property
  def nk(self) -> int:
    return -(-self.Skv // self.bk)

  @property
  def Sqp(self) -> int:
    return self.nq * self.bq

  @property
  def Skvp(self) -> int:
    return self.nk * self.bk


def _pad_head(d: int) -> int:
  return -(-d // 64) * 64


def _i32(x):
  """A scalar as int32 (with jax_enable_x64 a Python int would make int64 indices)."""
  return jnp.asarray(x, jnp.int32)


def _mutated(name: str) -> bool:
  return _TEST_MUTATION == name


def _preprocess(out, lse, dout, dlse, g: _Geo):
  """(lse2, delta), float32 [B, H, Sqp]: lse in the log2 domain and rowsum(dO * O) - dlse.

  Empty (lse = -inf) and padded rows get the largest finite float32 as lse2, so that
  exp2(s2 - lse2) == 0 there (zero, finite gradients); padded rows get delta 0.
  """
  f32 = jnp.float32
  delta = jnp.sum(dout.astype(f32) * out.astype(f32), axis=-1)
  if dlse is not None:
    delta = delta - dlse.astype(f32)
  big = jnp.finfo(f32).max
  lse2 = jnp.where(jnp.isfinite(lse), lse.astype(f32) * f32(LOG2E), big)
  pad = ((0, 0), (0, 0), (0, g.Sqp - g.Sq))
  return jnp.pad(lse2, pad, constant_values=big), jnp.pad(delta, pad)


def _smem(shape, dtype):
  return _compat.plgpu().SMEM(shape, dtype, transforms=_compat.mma_transforms(dtype))


def _visit(run, lo, hi, full, masked_any):
  """`run(start, stop, masked)` over [lo, hi): unmasked inside `full`, masked outside
  (`full` None: every block masked)."""
  if not masked_any:
    run(lo, hi, False)
    return
  if full is None:
    run(lo, hi, True)
    return
  f_lo = jnp.clip(full[0], lo, hi)
  f_hi = jnp.clip(full[1], f_lo, hi)
  run(lo, f_lo, True)
  run(f_lo, f_hi, False)
  run(f_hi, hi, True)


def _tile_probs(cfg, s, lse2, delta, dp, q_idx, kv_idx, masked, q_seg=None, kv_seg=None):
  """(p, ds) of one tile from raw scores s = q k (any orientation; lse2 / delta, the
  indices and segment ids already broadcast to the tile). ds is dL/d(q k): the softmax
  scale included."""
  f32 = jnp.float32
  d = s * f32(cfg.scale * LOG2E) - lse2
  ok = None
  if masked:
    ok = C.mask_spec(cfg).allowed(q_idx, kv_idx, q_seg=q_seg, kv_seg=kv_seg)
    d = jnp.where(ok, d, C.mask_value(f32))
  p = jnp.exp2(d)
  ds = p * (dp - delta)
  if ok is not None:
    # A select, not p * (...): a masked entry contributes exactly nothing.
    ds = jnp.where(ok, ds, f32(0.0))
  return p, ds * f32(cfg.scale)


def _split_refs(refs, n_in, n_out):
  return refs[:n_in], refs[n_in:n_in + n_out], refs[n_in + n_out:]


def _mm_t(shape, a, b):
  """a @ b^T on the tensor cores (SS-wgmma, both operands in SMEM), read back: [M, N]."""
  plgpu = _compat.plgpu()

  def body(acc):
    plgpu.wgmma(acc, a, b.T)
    return acc[...]

  return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def _wait_loaded(loaded, slot):
  plgpu = _compat.plgpu()
  for n_bar, bar in enumerate(loaded):
    if n_bar == 0 and _mutated("skip_loaded_wait"):
      continue
    plgpu.barrier_wait(bar.at[slot])


def _produce(total, fill, free):
  """The producer warpgroup's loop: step t's operands into slot t % _STAGES (`fill(t, slot)`
  issues the TMA copies), once the consumer freed the slot's previous step."""
  plgpu = _compat.plgpu()

  def body(t, carry):
    slot = lax.rem(t, _i32(_STAGES))
    if not _mutated("skip_free_wait"):
      @pl.when(t >= _STAGES)
      def _wait_free():
        plgpu.barrier_wait(free.at[slot])
    fill(t, slot)
    return carry

  lax.fori_loop(_i32(0), total, body, None)


# ---- dK / dV ----------------------------------------------------------------------

def _dkdv_kernel(*refs, cfg, g: _Geo, masked_any, has_seg):
  plgpu = _compat.plgpu()
  wgmma_layout, row, col = _compat.layouts()
  ins, (dk_ref, dv_ref), (smem, loaded, free, kv_bars) = _split_refs(refs, 6 + 2 * has_seg, 2)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins[:6]
  k_smem, v_smem, rings, p_smem, ds_smem, resident = smem
  q_ring, do_ring, lse_ring, delta_ring = rings[:4]
  b, hk, j = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("kv")
  wg = lax.axis_index("wg")
  spec = C.mask_spec(cfg)
  lo, hi = spec.q_block_range(j, g.bq, g.bk, g.nq)
  lo, hi = jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)
  n = hi - lo
  G = g.G
  cols = pl.ds(j * g.bk, g.bk)

  @pl.when(wg == 1)
  def _producer():
    def fill(t, slot):
      gi, i = lax.div(t, n), lo + lax.rem(t, n)
      h = hk * G + gi
      rows = pl.ds(i * g.bq, g.bq)
      srcs = [q_ref.at[b, h, rows, :], do_ref.at[b, h, rows, :], lse_ref.at[b, h, rows],
              delta_ref.at[b, h, rows]]
      if has_seg:
        srcs.append(ins[6].at[b, rows])
      for src, ring, bar in zip(srcs, rings, loaded):
        plgpu.copy_gmem_to_smem(src, ring.at[slot], bar.at[slot])

    _produce(G * n, fill, free)

  @pl.when(wg == 0)
  def _compute():
    srcs = [k_ref.at[b, hk, cols, :], v_ref.at[b, hk, cols, :]]
    if has_seg:
      srcs.append(ins[7].at[b, cols])
    for n_bar, (src, dst) in enumerate(zip(srcs, (k_smem, v_smem) + tuple(resident))):
      plgpu.copy_gmem_to_smem(src, dst, kv_bars.at[n_bar])
    for n_bar in range(len(srcs)):
      plgpu.barrier_wait(kv_bars.at[n_bar])
    shape = (g.bk, g.bq)
    kv_idx = j * g.bk + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=wgmma_layout)
    q_iota = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=wgmma_layout)
    per_q = lambda x: lax.broadcast_in_dim(x, shape, [1])
    kv_seg = None
    if has_seg:
      kv_seg = lax.broadcast_in_dim(plgpu.load(resident[0], layout=row), shape, [0])

    def scope(dk_acc, dv_acc):
      def step(t, i, masked):
        slot = lax.rem(t, _i32(_STAGES))
        q_s, do_s = q_ring.at[slot], do_ring.at[slot]
        _wait_loaded(loaded, slot)
        sT = _mm_t(shape, k_smem, q_s)
        dpT = _mm_t(shape, v_smem, do_s)
        lse2 = plgpu.load(lse_ring.at[slot], layout=col)
        delta = plgpu.load(delta_ring.at[slot], layout=col)
        q_seg = per_q(plgpu.load(rings[4].at[slot], layout=col)) if has_seg else None
        pT, dsT = _tile_probs(cfg, sT, per_q(lse2), per_q(delta), dpT, i * g.bq + q_iota,
                              kv_idx, masked, q_seg, kv_seg)
        p_smem[...] = pT.astype(p_smem.dtype)
        ds_smem[...] = dsT.astype(ds_smem.dtype)
        if not _mutated("skip_lse_fence"):
          # Orders this thread's generic SMEM accesses (the lse / delta / segment loads, the
          # P / dS stores) before the async proxy: the wgmmas below and the producer's TMA
          # refill of this slot.
          plgpu.commit_smem()
        plgpu.wgmma(dv_acc, p_smem, do_s)
        plgpu.wgmma(dk_acc, ds_smem, q_s)
        plgpu.wgmma_wait(0)  # the slot's Q / dO are read: hand it back
        plgpu.barrier_arrive(free.at[slot])

      def group(gi, carry):
        base = gi * n - lo  # step index t = base + i

        def run(start, stop, masked):
          def body(i, c):
            step(base + i, i, masked)
            return c
          lax.fori_loop(start, stop, body, None)

        full = None if has_seg else spec.full_q_block_range(j, g.bq, g.bk, g.nq)
        _visit(run, lo, hi, full, masked_any)
        return carry

      lax.fori_loop(_i32(0), _i32(G), group, None)
      return dk_acc[...], dv_acc[...]

    dk, dv = pl.run_scoped(scope, plgpu.ACC((g.bk, g.Dp), jnp.float32),
                           plgpu.ACC((g.bk, g.Dvp), jnp.float32))
    k_smem[...] = dk.astype(k_smem.dtype)
    v_smem[...] = dv.astype(v_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[b, hk, cols, :], commit_group=False)
    plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[b, hk, cols, :], commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0)


def _dkdv(cfg, g: _Geo, qp, kp, vp, dop, lse2, delta, segs, masked_any):
  plgpu = _compat.plgpu()
  dt = qp.dtype
  has_seg = segs is not None
  vec = lambda *shape, dtype=jnp.float32: plgpu.SMEM(shape, dtype)
  rings = [_smem((_STAGES, g.bq, g.Dp), dt), _smem((_STAGES, g.bq, g.Dvp), dt),
           vec(_STAGES, g.bq), vec(_STAGES, g.bq)]
  resident = []
  if has_seg:
    rings.append(vec(_STAGES, g.bq, dtype=jnp.int32))
    resident.append(vec(g.bk, dtype=jnp.int32))
  smem = (_smem((g.bk, g.Dp), dt), _smem((g.bk, g.Dvp), dt), tuple(rings),
          _smem((g.bk, g.bq), dt), _smem((g.bk, g.bq), dt), tuple(resident))
  loaded = tuple(plgpu.Barrier(num_barriers=_STAGES) for _ in rings)
  kernel = plgpu.kernel(
      functools.partial(_dkdv_kernel, cfg=cfg, g=g, masked_any=masked_any, has_seg=has_seg),
      out_type=(jax.ShapeDtypeStruct((g.B, g.Hkv, g.Skvp, g.Dp), dt),
                jax.ShapeDtypeStruct((g.B, g.Hkv, g.Skvp, g.Dvp), dt)),
      scratch_types=(smem, loaded, plgpu.Barrier(num_barriers=_STAGES),
                     plgpu.Barrier(num_barriers=2 + len(resident))),
      grid=(g.B, g.Hkv, g.nk), grid_names=("b", "h", "kv"), kernel_name="flashvjp_bwd_dkdv",
      num_threads=2, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=_interpret(cfg))
  return kernel(qp, kp, vp, dop, lse2, delta, *(segs or ()))


# ---- dQ ------------------------------------------------------------------------------

def _dq_kernel(*refs, cfg, g: _Geo, masked_any, has_seg):
  plgpu = _compat.plgpu()
  wgmma_layout, row, col = _compat.layouts()
  ins, (dq_ref,), (smem, loaded, free, q_bars) = _split_refs(refs, 6 + 2 * has_seg, 1)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins[:6]
  q_smem, do_smem, lse_smem, delta_smem, rings, ds_smem, resident = smem
  k_ring, v_ring = rings[:2]
  b, h, i = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("q")
  wg = lax.axis_index("wg")
  hk = lax.div(h, _i32(g.G))
  spec = C.mask_spec(cfg)
  lo, hi = spec.kv_block_range(i, g.bq, g.bk, g.nk)
  lo, hi = jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)
  rows = pl.ds(i * g.bq, g.bq)

  @pl.when(wg == 1)
  def _producer():
    def fill(t, slot):
      cols = pl.ds((lo + t) * g.bk, g.bk)
      srcs = [k_ref.at[b, hk, cols, :], v_ref.at[b, hk, cols, :]]
      if has_seg:
        srcs.append(ins[7].at[b, cols])
      for src, ring, bar in zip(srcs, rings, loaded):
        plgpu.copy_gmem_to_smem(src, ring.at[slot], bar.at[slot])

    _produce(hi - lo, fill, free)

  @pl.when(wg == 0)
  def _compute():
    srcs = [q_ref.at[b, h, rows, :], do_ref.at[b, h, rows, :], lse_ref.at[b, h, rows],
            delta_ref.at[b, h, rows]]
    dsts = [q_smem, do_smem, lse_smem, delta_smem] + list(resident)
    if has_seg:
      srcs.append(ins[6].at[b, rows])
    for n_bar, (src, dst) in enumerate(zip(srcs, dsts)):
      plgpu.copy_gmem_to_smem(src, dst, q_bars.at[n_bar])
    for n_bar in range(len(srcs)):
      plgpu.barrier_wait(q_bars.at[n_bar])
    shape = (g.bq, g.bk)
    per_q = lambda x: lax.broadcast_in_dim(x, shape, [0])
    lse2 = per_q(plgpu.load(lse_smem, layout=row))
    delta = per_q(plgpu.load(delta_smem, layout=row))
    q_seg = per_q(plgpu.load(resident[0], layout=row)) if has_seg else None
    q_idx = i * g.bq + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=wgmma_layout)
    kv_iota = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=wgmma_layout)

    def scope(dq_acc):
      def step(j, masked):
        slot = lax.rem(j - lo, _i32(_STAGES))
        k_s, v_s = k_ring.at[slot], v_ring.at[slot]
        _wait_loaded(loaded, slot)
        s = _mm_t(shape, q_smem, k_s)
        dp = _mm_t(shape, do_smem, v_s)
        kv_seg = None
        if has_seg:
          kv_seg = lax.broadcast_in_dim(plgpu.load(rings[2].at[slot], layout=col), shape, [1])
        _, ds = _tile_probs(cfg, s, lse2, delta, dp, q_idx, j * g.bk + kv_iota, masked, q_seg,
                            kv_seg)
        ds_smem[...] = ds.astype(ds_smem.dtype)
        # The dS stores before the wgmma reads them; the kv segment ids' loads before the
        # producer's TMA refill of this slot.
        plgpu.commit_smem()
        plgpu.wgmma(dq_acc, ds_smem, k_s)
        plgpu.wgmma_wait(0)  # the slot's K / V are read: hand it back
        plgpu.barrier_arrive(free.at[slot])

      def run(start, stop, masked):
        def body(j, c):
          step(j, masked)
          return c
        lax.fori_loop(start, stop, body, None)

      full = None if has_seg else spec.full_kv_block_range(i, g.bq, g.bk)
      _visit(run, lo, hi, full, masked_any)
      return dq_acc[...]

    dq = pl.run_scoped(scope, plgpu.ACC((g.bq, g.Dp), jnp.float32))
    q_smem[...] = dq.astype(q_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[b, h, rows, :])
    plgpu.wait_smem_to_gmem(0)


def _dq(cfg, g: _Geo, qp, kp, vp, dop, lse2, delta, segs, masked_any):
  plgpu = _compat.plgpu()
  dt = qp.dtype
  has_seg = segs is not None
  vec = lambda *shape, dtype=jnp.float32: plgpu.SMEM(shape, dtype)
  rings = [_smem((_STAGES, g.bk, g.Dp), dt), _smem((_STAGES, g.bk, g.Dvp), dt)]
  resident = []
  if has_seg:
    rings.append(vec(_STAGES, g.bk, dtype=jnp.int32))
    resident.append(vec(g.bq, dtype=jnp.int32))
  smem = (_smem((g.bq, g.Dp), dt), _smem((g.bq, g.Dvp), dt), vec(g.bq), vec(g.bq),
          tuple(rings), _smem((g.bq, g.bk), dt), tuple(resident))
  loaded = tuple(plgpu.Barrier(num_barriers=_STAGES) for _ in rings)
  kernel = plgpu.kernel(
      functools.partial(_dq_kernel, cfg=cfg, g=g, masked_any=masked_any, has_seg=has_seg),
      out_type=jax.ShapeDtypeStruct((g.B, g.H, g.Sqp, g.Dp), dt),
      scratch_types=(smem, loaded, plgpu.Barrier(num_barriers=_STAGES),
                     plgpu.Barrier(num_barriers=4 + len(resident))),
      grid=(g.B, g.H, g.nq), grid_names=("b", "h", "q"), kernel_name="flashvjp_bwd_dq",
      num_threads=2, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=_interpret(cfg))
  return kernel(qp, kp, vp, dop, lse2, delta, *(segs or ()))


# ---- entry point -----------------------------------------------------------------------

def _interpret(cfg):
  return _compat.interpret_params(detect_races=_DETECT_RACES) if cfg.interpret else None


def check_supported(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, seed, consts, mod=None,
                    offsets=None):
  """Raise NotImplementedError / ValueError naming the first feature this backward lacks."""
  why = _compat.unavailable()
  if why is not None:
    raise NotImplementedError(why)
  missing = [
      ("bias (and its gradient dbias)", bias is not None),
      ("a dense boolean mask", mask is not None),
      ("score_mod", cfg.score_mod is not None or bool(tuple(consts))),
      ("mask_mod", cfg.mask_mod is not None or mod is not None),
      ("dropout", cfg.dropout_active),
      ("global offsets (a ring chunk pair)", C.offset_operand(offsets) is not None),
  ]
  for name, present in missing:
    if present:
      raise NotImplementedError(
          f"the pallas_mosaic_gpu backward does not support {name} yet;"
          " use implementation='pallas_triton'")
  del seed
  if jnp.dtype(q.dtype) not in _DTYPES or not (q.dtype == k.dtype == v.dtype):
    raise ValueError("the pallas_mosaic_gpu backward takes bfloat16 or float16 q, k, v of one"
                     f" dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  if max(q.shape[3], v.shape[3]) > _MAX_HEAD_DIM:
    raise ValueError(f"the pallas_mosaic_gpu backward supports head dims <= {_MAX_HEAD_DIM},"
                     f" got {q.shape[3]} (q/k) and {v.shape[3]} (v)")
  if q.shape[1] % k.shape[1]:
    raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")


def backward(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed, consts,
             out, lse, dout, dlse, mod=None, offsets=None):
  """Hand-written Mosaic-GPU backward (the interface of `flashvjp.pallas.triton.backward`).

  Args:
    cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts: as the forward.
    out: [B, H, Sq, Dv] forward output; lse: [B, H, Sq] its logsumexp (-inf on empty rows).
    dout: [B, H, Sq, Dv] cotangent of out; dlse: [B, H, Sq] cotangent of lse (or None).
    mod: None, or the mask_mod's `ModInputs` (not supported yet: must be None).
    offsets: None, or all-zero global offsets (others are not supported yet).

  Returns:
    (dq [B, H, Sq, D], dk [B, Hkv, Skv, D], dv [B, Hkv, Skv, Dv] in the input dtype,
     dbias (always None: no bias support yet), dconsts (always ())).
  """
  check_supported(cfg, q, k, v, bias, mask, q_seg, seed, consts, mod, offsets)
  B, H, Sq, D = q.shape
  Hkv, Skv, Dv = k.shape[1], k.shape[2], v.shape[3]
  g = _Geo(B=B, H=H, Hkv=Hkv, Sq=Sq, Skv=Skv, Dp=_pad_head(D), Dvp=_pad_head(Dv))
  segs = None
  if q_seg is not None:  # padding repeats the edge id (padded positions are masked anyway)
    segs = (_mask.pad_axis(q_seg, 1, g.Sqp, "edge", keep_broadcast=False).astype(jnp.int32),
            _mask.pad_axis(kv_seg, 1, g.Skvp, "edge", keep_broadcast=False).astype(jnp.int32))
  masked_any = (cfg.causal or cfg.window is not None or segs is not None or g.Sqp != Sq
                or g.Skvp != Skv)
  lse2, delta = _preprocess(out, lse, dout, dlse, g)
  qp, dop = C.pad_seq_head(q, g.Sqp, g.Dp), C.pad_seq_head(dout.astype(q.dtype), g.Sqp, g.Dvp)
  kp, vp = C.pad_seq_head(k, g.Skvp, g.Dp), C.pad_seq_head(v, g.Skvp, g.Dvp)
  dk, dv = _dkdv(cfg, g, qp, kp, vp, dop, lse2, delta, segs, masked_any)
  dq = _dq(cfg, g, qp, kp, vp, dop, lse2, delta, segs, masked_any)
  dq = dq[:, :, :Sq, :D]
  dk = dk[:, :, :Skv, :D]
  dv = dv[:, :, :Skv, :Dv]
  return dq, dk, dv, None, ()
