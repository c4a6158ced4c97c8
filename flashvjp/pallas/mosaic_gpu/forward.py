"""Pallas Mosaic-GPU forward kernel (Hopper, sm_90a): TMA K/V ring, SS-wgmma, exp2 softmax.

Room: Pallas Mosaic-GPU backend (forward). One CTA per (128-row q tile, head, batch) runs
three warpgroups (`Plan`): a producer streams K and V blocks by TMA into a ring of `slots`
SMEM slots (per-slot "loaded" barriers the TMA completes, per-slot "consumed" barriers
both consumers arrive on before a slot is refilled), and two consumers (setmaxnreg
232 / 40) each own 64 query rows: Q tile in SMEM, S = Q K^T on wgmma, the online softmax
in the exp2 domain (log2(e) folded into the scale; with nothing else on the scores the row
max is taken on q k itself and scaled once per row, so each exponent is one FFMA), and
P V on wgmma (one product of all the value columns). Compiled, P is the register operand and the
products accumulate into the carried, rescaled output (`pl.run_state`:
`_compat.accumulate`), as tokamax's and JAX's FA3 forwards do. Interpreted, P is staged in
SMEM and each product lands in a fresh accumulator added to the output, since the GPU
interpreter handles neither a register operand nor `pl.run_state`: the same bf16 P, the
same float32 sum (the interpreter's wgmma adds the whole product at once). One consumer
(64 rows per CTA) when the queries fit in 64 rows.

Causal / window / kv padding: the producer fetches the kv blocks of the CTA's rows inside
the mask model's static bounds (`MaskSpec.kv_block_range`); each consumer computes those
of its own 64 rows in three phases (`_mask.split_loop`'s: masked edge blocks, unmasked
interior blocks, masked edge blocks) and passes by the others (waiting and releasing the
slot: barrier phases are counted per thread). So both consumers take part in every step
of the CTA and FA3's ping-pong schedule barrier pairs up (`Plan.pingpong`: one
consumer's softmax overlaps the other's wgmma). The elementwise mask runs only on edge
blocks. Masked scores use the finite `_common.mask_value` (no inf inside the kernel for
finite inputs); an empty row gets l == 0, out 0 and lse -inf (made outside the kernel, as
the Triton family does).

Visit lists (segment ids, a dense mask, a mask_mod): a CTA's kv blocks come from the
Triton family's compacted block lists at its blocks (`visit_lists`, read as scalars from
GMEM): the producer fetches the PARTIAL blocks and then the FULL ones, never an EMPTY one;
each consumer computes the PARTIAL blocks inside its own rows' static bounds with the
elementwise mask (passing by the others) and every FULL block without it.

Segment ids (packed documents): the ids ride along (q ids with Q, kv ids in the ring with
K). Bias and dense masks (`PairForm`): a full [Sq, Skv] one streams
through the ring with K (a [128, bk] block per slot), a per-key [1, Skv] one as a vector
per slot, a per-query [Sq, 1] one is loaded once per consumer. The bias is added to the
scores in the exp2 domain; the mask (bfloat16 0 / 1 blocks, float32 vectors) joins the
elementwise mask of the PARTIAL blocks. Dropout:
the family's counter hash (`flashvjp._dropout`), its per-row words made by XLA
([B, H, 3, Sq], loaded with Q), each entry finished in registers: the same keep bits as
every other implementation. Global offsets (a ring chunk pair, `offsets`): only dropout
reads global positions here (the static mask is local); its row words are made at the
global (b, h, q) and the global kv offset rides along as the third word.

GQA: the producer reads kv head h // G; K/V are never repeated in memory. Sequence
lengths are zero-padded to whole blocks outside the kernel and head dims to a multiple
of 64 (the 128-byte swizzle of a 16-bit row).

score_mod / mask_mod whose per-(b, h) values are scalars (softcap, ALiBi slopes, prefix-LM
lengths; `_common.split_per_head` / `split_mask_mod` fold (b, h) into them): their tile
parts run on each tile's scores in the consumer (`ModRows`: the residuals, the global q and
the global kv offset ride as per-row words loaded with Q), as every family applies them
(`_common.scores`): masked q k set to 0, scale, bias, the score_mod, then the exp2 domain;
the mask_mod joins the elementwise mask of the PARTIAL blocks (its block classes, at the
family's finest blocks `_config.PALLAS_MOSAIC_GPU_BLOCKS`, make the visit lists).

Arrays a mod reads by one position (`document_causal`'s ids, a per-key bias, a per-query
temperature; `_common.PosResiduals`): per-q-position values are more per-row words (loaded
with Q), per-kv-position ones column words streamed with K (int32 / float32 [n, bk] per
ring slot, read generically before the slot's release, like the kv ids).

Tables read by kv_idx - q_idx (`relative_position_bias`, T5 buckets; `PosResiduals.rel`):
each consumer's [64, bk] Toeplitz tile is one TMA window of a skewed array XLA builds once
(`_rel`: [B, H, 64, Sqp + Skvp - 64] per table), fetched by the producer into the ring slot
with K (one barrier per slot and consumer) and read generically before the slot's release.
A CTA of one consumer then takes one ring slot (`plan`'s `rel`).

Not implemented (refused before any kernel is built): arrays per head, float32 / float64
inputs, a float32 out.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flashvjp import _dropout
from flashvjp import _mask
from flashvjp._config import AttentionConfig
from flashvjp.pallas import _common as C
from flashvjp.pallas.mosaic_gpu import _compat
from flashvjp.pallas.mosaic_gpu import _limits
from flashvjp.pallas.mosaic_gpu import _rel

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# One consumer warpgroup owns 64 query rows (the M of one wgmma).
ROWS_PER_WARPGROUP = 64
WARPGROUP_THREADS = 128
# The barrier waits (and the fence) a test may remove to check that the interpreter catches
# the race (`_build(..., skip_wait=...)`; never set outside tests). "side_fence": the proxy
# fence between the generic loads of a slot's side data (kv ids, bias / mask blocks) and
# the slot's release to the TMA producer.
SKIPPABLE_WAITS = ("k_loaded", "v_loaded", "k_consumed", "v_consumed", "q_loaded",
                   "side_fence")
# setmaxnreg with two consumer warpgroups (3 x 128 threads share 64K registers): the
# consumers get what the TMA producer gives up (2 x 232 + 40 <= 512 per thread slot; a
# kernel of more than 128 value columns 2 x 240 + 32: `Plan.registers`).
V_PART = 128  # value columns of one forward kernel with per-entry features (`forward`)
V_WHOLE = 256  # value columns of one forward kernel without them
CONSUMER_REGISTERS = 232
PRODUCER_REGISTERS = 40
# A kernel of 256 value columns: the head-dim-256 causal forward spilled 224 B at 232 / 40
# and none at 240 / 32 (the producer's TMA issue fits 32); at head dim 128, 240 / 32 changed
# the loops by -15 to +12 instructions (sm_90a SASS), so they keep 232 / 40.
WIDE_REGISTERS = (240, 32)
# A CTA's visit list (`visit_lists`): n_partial, n_full, then per consumer warpgroup w the
# [start, stop) of its own blocks among the PARTIAL ones; the kv blocks follow.
VISIT_HEADER = 6


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static sizes of one forward launch."""

  B: int
  H: int
  Hkv: int
  Sq: int
  Skv: int
  D: int
  Dv: int
  consumers: int  # consumer warpgroups per CTA, 64 query rows each
  bk: int  # kv rows per block (64 or 128)
  Dp: int  # head dims padded to a multiple of 64
  Dvp: int
  slots: int  # K/V ring depth
  slot_extra: int = 0  # bytes per ring slot besides K and V (kv segment ids, bias / mask)
  pingpong: bool = True  # two consumers take turns on the tensor cores (FA3's schedule)
  out_f32: bool = False  # out in float32 (a traced scale: `AttentionConfig.out_f32`)

  @property
  def G(self) -> int:
    return self.H // self.Hkv

  @property
  def rows(self) -> int:
    """Query rows of one consumer warpgroup."""
    return ROWS_PER_WARPGROUP

  @property
  def registers(self) -> tuple[int, int]:
    """setmaxnreg of the (consumer, producer) warpgroups."""
    return WIDE_REGISTERS if self.Dvp > V_PART else (CONSUMER_REGISTERS, PRODUCER_REGISTERS)

  @property
  def bq(self) -> int:
    """Query rows of one CTA."""
    return self.consumers * self.rows

  @property
  def nq(self) -> int:
    return _mask.num_blocks(self.Sq, self.bq)

  @property
  def nk(self) -> int:
    return _mask.num_blocks(self.Skv, self.bk)

  @property
  def Sqp(self) -> int:
    return self.nq * self.bq

  @property
  def Skvp(self) -> int:
    return self.nk * self.bk

  def smem_bytes(self, itemsize: int = 2) -> int:
    """SMEM the kernel allocates (tiles, not counting barriers)."""
    q = self.bq * self.Dp
    o = 0 if self.Dvp == self.Dp or self.out_f32 else self.bq * self.Dvp
    ring = self.slots * self.bk * (self.Dp + self.Dvp)
    p = self.bq * self.bk
    o32 = 4 * self.bq * self.Dvp if self.out_f32 else 0  # its own float32 staging tile
    return ((q + o + ring + p) * itemsize + o32 + 4 * self.bq
            + self.slots * self.slot_extra)


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def plan(q_shape, k_shape, v_shape, block_kv: int | None = None, slots: int | None = None,
         consumers: int | None = None, elementwise: bool = False,
         slot_extra=lambda bq, bk: 0, pingpong: bool = True, out_f32: bool = False,
         rel: bool = False) -> Plan:
  """The launch sizes: two consumer warpgroups (128 query rows per CTA; one when the
  sequence fits in 64 rows), kv blocks of 128 for head dims <= 128 and 64 above (the
  consumer's registers: S, the output and a P V accumulator are live at once), and a
  ring of 2 slots (a CTA of one consumer: up to 3) within the SMEM budget (FA3's Hopper
  forward at head dim 128: 64 rows per consumer, kv blocks of 128, 2 slots). `elementwise` (segment ids, dropout: more
  per-entry work on every tile) takes kv blocks of 64: at 128 the consumer spills
  (sm_90a, ptxas: 8-168 bytes), at 64 it does not. `slot_extra(bq, bk)`: the bytes each
  ring slot holds besides K and V. `pingpong`: with two consumers, FA3's schedule barrier
  (one consumer's softmax overlaps the other's wgmma).

  More than 128 value columns with per-entry features spill on sm_90a (segment ids, head dim
  256: 116 bytes): `forward` runs two kernels of at most `V_PART` value columns each then.

  `rel` (windows of tables read by kv_idx - q_idx in the ring): a CTA of one consumer gets one
  slot. With two or three, ptxas 13.0 crashed (sm_90a, exit status 139, head dim 128, kv
  blocks of 64: one table at 3 slots, two at 2); with one it compiles without spills
  (237 registers, two tables)."""
  B, H, Sq, D = q_shape
  Hkv, Skv, Dv = k_shape[1], k_shape[2], v_shape[3]
  Dp, Dvp = _round_up(D, 64), _round_up(Dv, 64)
  auto = consumers is None
  if consumers is None:
    consumers = 1 if Sq <= ROWS_PER_WARPGROUP else 2
  if consumers not in (1, 2):
    raise ValueError(f"consumers must be 1 or 2, got {consumers}")
  if block_kv is None:
    block_kv = 128 if max(Dp, Dvp) <= 128 and Skv > 64 and not elementwise else 64
  if block_kv not in (64, 128):
    raise ValueError(f"block_kv must be 64 or 128, got {block_kv}")
  nk = _mask.num_blocks(Skv, block_kv)
  extra = slot_extra(consumers * ROWS_PER_WARPGROUP, block_kv)
  make = lambda n: Plan(B, H, Hkv, Sq, Skv, D, Dv, consumers, block_kv, Dp, Dvp, n, extra,
                        pingpong and consumers == 2, out_f32)
  if slots is None:
    # Two consumers need two slots: with one, the kernel deadlocked (interpret mode, head dim
    # 256 with kv blocks of 64 and a float32 out); a CTA of one consumer is planned instead.
    one = (1,) if rel else (3, 2, 1)
    # Two consumers take two slots (FA3's and tokamax's stages): a third would cost each
    # step of the main loop a division by 3 for its slot (22 more instructions per iteration
    # at head dim 64, sm_90a SASS: benchmarks/mosaic_gpu_sass.py), for latency hiding no GPU
    # has measured.
    fits = [n for n in (one if consumers == 1 else (2,))
            if make(n).smem_bytes() <= _limits.SMEM_BUDGET]
    if not fits and auto and consumers == 2:
      return plan(q_shape, k_shape, v_shape, block_kv=block_kv, slots=slots, consumers=1,
                  elementwise=elementwise, slot_extra=slot_extra, pingpong=pingpong,
                  out_f32=out_f32, rel=rel)
    if not fits:
      raise NotImplementedError(
          f"pallas_mosaic_gpu forward: head dims {D} / {Dv} with kv blocks of {block_kv} need"
          f" {make(1).smem_bytes()} bytes of SMEM for one ring slot (budget"
          f" {_limits.SMEM_BUDGET})")
    slots = fits[0]
  return make(max(1, min(slots, nk)))


def _build(cfg: AttentionConfig, p: Plan, dtype, *, segments: bool = False, bias=None,
           mask=None, mods: ModRows | None = None, lists: bool = False, interpret=None,
           skip_wait: str | None = None):
  """The kernel as a function of padded operands -> (out, lse).

  Operands: q [B, H, Sqp, Dp], k [B, Hkv, Skvp, Dp], v [B, Hkv, Skvp, Dvp], then with
  `segments` the padded segment ids q_seg int32 [B, Sqp] and kv_seg int32 [B, Skvp], then
  with dropout the hash's per-row words uint32 [B, H, 3, Sqp] (`dropout_rows`), then a
  bias, then a dense mask, each in its `PairForm` (`bias`, `mask`: the forms), then with
  `mods` (cfg's score_mod / mask_mod: their tile parts) the per-row words int32
  [B, H, n_int, Sqp] and, when there are float residuals, float32 [B, H, n_float, Sqp]
  (`mod_rows`), then with `lists` the CTAs' visit lists int32 [B', H', nq, VISIT_HEADER + nk]
  (`visit_lists`: segment ids / a dense mask / a mask_mod skip EMPTY blocks).
  `skip_wait` (tests only) removes one barrier wait (`SKIPPABLE_WAITS`), to check that
  the interpreter's race detector sees the hazard it guards against.
  """
  if skip_wait is not None and skip_wait not in SKIPPABLE_WAITS:
    raise ValueError(f"skip_wait must be one of {SKIPPABLE_WAITS}, got {skip_wait!r}")
  # segment ids, a dense mask and a mask_mod always come with visit lists (`visit_lists`):
  # without them the unmasked blocks come from causal / window / padding alone
  assert lists or not (segments or mask is not None or cfg.mask_mod is not None)
  mg = _compat.plgpu()
  f32 = jnp.float32
  spec = C.mask_spec(cfg)
  masked = (segments or mask is not None or cfg.causal or cfg.window is not None
            or p.Skvp != p.Skv or cfg.mask_mod is not None)
  has_mods = mods is not None
  mr = mods if mods is not None else ModRows(0, 0)
  scale2 = float(cfg.scale) * LOG2E
  neg = float(jnp.finfo(f32).min)
  rows, bk, slots, nc = p.rows, p.bk, p.slots, p.consumers
  i32 = lambda x: jnp.asarray(x, jnp.int32)
  dropout = cfg.dropout_active
  u32 = jnp.uint32
  pairs = {n: f for n, f in (("bias", bias), ("mask", mask)) if f is not None}
  streamed = [n for n, f in pairs.items() if f.kind != "q"]  # read from the ring slots
  # the mods' per-kv-position words, streamed with K: "modkvi" / "modkvf" [count, bk] a slot
  col_words = [(kind, count) for kind, count in (("i", mr.n_kv_int), ("f", mr.n_kv_float))
               if count]
  # the rel residuals' windows: one [rows, bk] tile per consumer per ring slot
  n_rel = len(mr.rel_dtypes)
  # per-slot side data (kv ids, bias / mask blocks, kv words, rel windows) is read after the
  # QK product with generic loads: the K slot is released only after them, behind a proxy
  # fence
  late_release = segments or bool(streamed) or bool(col_words) or bool(n_rel)

  def wait(name, barrier):
    if skip_wait != name:
      mg.barrier_wait(barrier)

  def kv_blocks(i):
    """[lo, hi) of the kv blocks CTA i fetches (all its consumers' blocks)."""
    lo, hi = spec.kv_block_range(i, p.bq, bk, p.nk)
    return i32(lo), i32(hi)

  def own_blocks(r, lo, hi):
    """Within [lo, hi): the kv blocks of row block r (64 rows), and the unmasked ones (no
    visit lists: causal / window / padding only)."""
    a, z = spec.kv_block_range(r, rows, bk, p.nk)
    a = jnp.clip(i32(a), lo, hi)
    z = jnp.clip(i32(z), a, hi)
    if not masked:
      return a, z, a, z
    f_lo, f_hi = spec.full_kv_block_range(r, rows, bk)
    f_lo = jnp.clip(i32(f_lo), a, z)
    f_hi = jnp.clip(i32(f_hi), f_lo, z)
    return a, z, f_lo, f_hi

  def visits(R, i, h, b):
    """(steps, block_of, segments) of CTA i: the number of kv blocks its producer fetches,
    step n's kv block, and each consumer's (first step, stop step, masked) runs (steps
    outside them: blocks of the CTA the consumer passes by). With visit lists: the
    PARTIAL blocks, then the FULL ones (`visit_lists`); else [lo, hi) of the static bounds."""
    if lists:
      hb = lambda ref: ref.at[b if ref.shape[0] > 1 else 0, h if ref.shape[1] > 1 else 0, i]
      row = hb(R["visits"])
      n_partial, n_full = row[0], row[1]
      block_of = lambda n: row[VISIT_HEADER + n]

      def listed_runs(w):
        start, stop = row[2 + 2 * w], row[3 + 2 * w]
        return ((start, stop, True), (n_partial, n_partial + n_full, False))
      return n_partial + n_full, block_of, listed_runs
    lo, hi = kv_blocks(i)

    def bounded_runs(w):
      a, z, f_lo, f_hi = own_blocks(i * nc + w, lo, hi)
      return ((a - lo, f_lo - lo, True), (f_lo - lo, f_hi - lo, False),
              (f_hi - lo, z - lo, True))
    return hi - lo, (lambda n: lo + n), bounded_runs

  def consumer(R, w, i, h, b):
    q_smem, o_smem, p_smem, lse_smem = (R[n].at[w] for n in ("q_s", "o_s", "p_s", "lse_s"))
    r = i * nc + w  # this warpgroup's 64-row block
    steps, block_of, runs = visits(R, i, h, b)
    q_rows = pl_ds(r * rows, rows)
    mg.copy_gmem_to_smem(R["q"].at[b, h, q_rows], q_smem, R["q_bar"].at[w])
    if segments:
      mg.copy_gmem_to_smem(R["q_seg"].at[b, q_rows], R["qseg_s"].at[w], R["qseg_bar"].at[w])
      wait("q_loaded", R["qseg_bar"].at[w])
      q_seg = mg.load(R["qseg_s"].at[w], layout=_compat.wgmma_row_layout())  # [rows]
    if dropout:
      mg.copy_gmem_to_smem(R["drop_rows"].at[b, h, :, q_rows], R["drop_s"].at[w],
                           R["drop_bar"].at[w])
      wait("q_loaded", R["drop_bar"].at[w])
      row_words = tuple(mg.load(R["drop_s"].at[w, n], layout=_compat.wgmma_row_layout())
                        for n in range(3))  # [rows] uint32 each: cq, cq2, kv0
    words = {}  # the mods' per-row words (`ModRows`): [rows] int32 / float32 each
    if has_mods:
      for kind, count in (("i", mr.n_int), ("f", mr.n_float)):
        if count:
          mg.copy_gmem_to_smem(R["mod_" + kind].at[b, h, :, q_rows], R[f"mod{kind}_s"].at[w],
                               R[f"mod{kind}_bar"].at[w])
          wait("q_loaded", R[f"mod{kind}_bar"].at[w])
          words[kind] = [mg.load(R[f"mod{kind}_s"].at[w, c],
                                 layout=_compat.wgmma_row_layout()) for c in range(count)]
    per_query = {}  # pairs of kind "q": [rows] float32, loaded once
    for n, f in pairs.items():
      if f.kind == "q":
        bb, hb = f.index(b, h)
        mg.copy_gmem_to_smem(R[n].at[bb, hb, q_rows], R[n + "_s"].at[w], R[n + "_bar"].at[w])
        wait("q_loaded", R[n + "_bar"].at[w])
        per_query[n] = mg.load(R[n + "_s"].at[w], layout=_compat.wgmma_row_layout())
    wait("q_loaded", R["q_bar"].at[w])

    def dropped(prob, t):
      """prob / (1 - rate) where the shared counter hash keeps (t, q) entries, else 0."""
      kv = ((t * bk + _compat.wgmma_iota((rows, bk), 1)).astype(u32)
            + _rows(row_words[2], prob.shape))  # the global kv position (mod 2^32)
      bits = _dropout.bits_from_row(_rows(row_words[0], prob.shape),
                                    _rows(row_words[1], prob.shape), kv)
      keep = bits >= u32(_dropout.threshold(cfg.dropout_rate))
      return jnp.where(keep, prob * (1.0 / (1.0 - cfg.dropout_rate)), 0.0)

    def slot_of(n):
      return lax.rem(n, i32(slots))

    # FA3's ping-pong schedule (each consumer's wgmma runs while the other does its softmax).
    # Compiled: two hardware named barriers, as FA3 and tokamax (`_compat.named_barrier`):
    # consumer w arrives on the other's once its S = Q K^T is issued and syncs on its own
    # before P V, consumer 1 one sync ahead at the start, consumer 0 one arrive more at the
    # end (one instruction each). Interpreted (no inline PTX there): the same turns as
    # meetings on one mbarrier of both consumers, consumer 1 one meeting behind.
    named = p.pingpong and not interpret
    sched = _limits.NAMED_BARRIER_BASE

    def rendezvous():
      """Both consumers meet here (the interpreted schedule)."""
      mg.barrier_arrive(R["sched"])
      mg.barrier_wait(R["sched"])

    def qk_issued():
      """This consumer's S = Q K^T is issued: the other's P V may go."""
      if named:
        _compat.named_barrier("arrive", sched + 1, -1, 2 * WARPGROUP_THREADS)
      elif p.pingpong:
        rendezvous()

    def softmax_done():
      if p.pingpong and not named:
        mg.barrier_arrive(R["sched"])

    def pv_turn():
      """Wait for this consumer's turn on the tensor cores (the other's S is issued)."""
      if named:
        _compat.named_barrier("sync", sched, 1, 2 * WARPGROUP_THREADS)
      elif p.pingpong:
        mg.barrier_wait(R["sched"])

    def wait_k(slot):
      """K (and the kv segment ids) of `slot` are in SMEM."""
      wait("k_loaded", R["k_bar"].at[slot])
      if segments:
        wait("k_loaded", R["kseg_bar"].at[slot])
      for n in streamed:
        wait("k_loaded", R[n + "_bar"].at[slot])
      for kind, _ in col_words:
        wait("k_loaded", R[f"modkv{kind}_bar"].at[slot])
      for e in range(n_rel):  # this consumer's window
        wait("k_loaded", R[f"rel{e}_bar"].at[slot * nc + w])

    def q_step(n):
      """Q's SMEM tile for step n's S = Q K^T. Above 8 k-steps (head dims > 128) its address
      goes through an opaque move each step (`_compat.opaque_i32`): hoisted out of the loop,
      the 16 loop-invariant Q descriptors overfill the 63 uniform registers, and ptxas moves
      them in and out of general registers every iteration (sm_90a, head dim 256, full /
      causal: 448 / 434 instructions an iteration, 40 or more of them R2UR / MOV / UMOV);
      recomputed, each is one UIADD3.64 beside its K descriptor's (412 / 419). At head dims
      <= 128 the 8 fit (D=128 full: 476 recomputed vs 473), so the tile stays hoisted."""
      if not interpret and p.Dp > 128:
        return R["q_s"].at[_compat.opaque_i32(w, n)]
      return q_smem

    def step(n, carry, masked_step):
      m, l, acc = carry
      slot = slot_of(n)
      t = block_of(n)  # the kv block
      wait_k(slot)

      def qk(acc_ref):
        mg.wgmma(acc_ref, q_step(n), R["k_s"].at[slot].T)
        qk_issued()  # the other consumer's turn (its softmax ran during this wgmma)
        return acc_ref[...]

      s = _compat.run_scoped(qk, mg.ACC((rows, bk), f32))

      def pair_value(n):
        """The [rows, bk] float32 values of bias / mask `n` on this tile."""
        kind = pairs[n].kind
        if kind == "q":
          return _rows(per_query[n], (rows, bk))
        if kind == "kv":
          col = mg.load(R[n + "_s"].at[slot], layout=_compat.wgmma_col_layout())
          return lax.broadcast_in_dim(col, (rows, bk), [1])
        tile = mg.load(R[n + "_s"].at[slot, pl_ds(w * rows, rows)], layout=_compat.wgmma_layout())
        return tile.astype(f32)

      bias_v = None if bias is None else pair_value("bias")
      dense = None if mask is None else pair_value("mask") != 0.0
      if segments:
        kv_seg = mg.load(R["kseg_s"].at[slot], layout=_compat.wgmma_col_layout())  # [bk]
      cols = {kind: [mg.load(R[f"modkv{kind}_s"].at[slot, c], layout=_compat.wgmma_col_layout())
                     for c in range(count)] for kind, count in col_words}
      rels = [mg.load(R[f"rel{e}_s"].at[slot, w], layout=_compat.wgmma_layout())
              for e in range(n_rel)]
      if late_release and skip_wait != "side_fence":
        mg.commit_smem()  # the slot's side data is read: fence it against the TMA refill
      mg.barrier_arrive(R["k_free"].at[slot])
      ok = None
      if masked_step or has_mods:
        qi = r * rows + _compat.wgmma_iota((rows, bk), 0)
        ki = t * bk + _compat.wgmma_iota((rows, bk), 1)
      if masked_step:
        if segments:
          ok = spec.allowed(qi, ki, q_seg=_rows(q_seg, (rows, bk)),
                            kv_seg=lax.broadcast_in_dim(kv_seg, (rows, bk), [1]), dense=dense)
        else:
          ok = spec.allowed(qi, ki, dense=dense)
        if cfg.mask_mod is not None:  # at positions clamped into the real ones, global
          ok = ok & mr.allowed(cfg, words, ki, (rows, bk), cols, rels)
      # raw: the row max taken on q k itself and scaled once per row (a positive scale and
      # nothing else on the scores: max commutes with it), the exponent one FFMA an entry
      raw = cfg.score_mod is None and bias_v is None and scale2 > 0.0
      if raw:
        pass  # s stays q k; the scale joins the row max and the exponent
      elif cfg.score_mod is None:
        s = s * scale2
        if bias_v is not None:  # in the exp2 domain: bias * log2(e)
          s = s + bias_v * LOG2E
      else:  # as every family (`C.scores`): masked q k to 0, scale, bias, the mod; exp2
        st = C.masked_scores_for_mod(cfg, s, ok) * f32(cfg.scale)
        if bias_v is not None:
          st = st + bias_v
        s = mr.score(cfg, words, st, ki, cols, rels) * LOG2E
      if masked_step:
        assert ok is not None
        top = jnp.where(ok, s, neg).max(axis=1)
        m_new = jnp.maximum(m, top * scale2 if raw else top)
      else:
        m_new = jnp.maximum(m, s.max(axis=1) * scale2 if raw else s.max(axis=1))
      e = s * scale2 - _rows(m_new, s.shape) if raw else s - _rows(m_new, s.shape)
      if masked_step:
        assert ok is not None
        e = jnp.where(ok, e, neg)
      prob = jnp.exp2(e)
      alpha = jnp.exp2(m - m_new)
      l = alpha * l + prob.sum(axis=1)
      if dropout:
        prob = dropped(prob, t)
      # P V's left operand: compiled, P in registers (register-operand wgmma); interpreted,
      # P staged in SMEM (the interpreter takes no register operand): the same bf16 values
      p_op = prob.astype(dtype)
      if interpret:
        p_smem[...] = p_op
        mg.commit_smem()  # the generic-proxy stores of P before the wgmma reads them
        p_op = p_smem
      softmax_done()
      wait("v_loaded", R["v_bar"].at[slot])
      pv_turn()  # the tensor cores are ours again

      def pv(acc_ref):
        mg.wgmma(acc_ref, p_op, R["v_s"].at[slot])

      # P V added to the rescaled running output (one wgmma of N = Dvp <= 256; compiled, the
      # MMAs accumulate into its registers: `_compat.accumulate`)
      acc = _compat.accumulate(acc * _rows(alpha, acc.shape), pv, interpret=bool(interpret))
      mg.barrier_arrive(R["v_free"].at[slot])
      return m_new, l, acc

    def pass_by(n, carry):
      """A block of the CTA's outside this warpgroup's rows: keep the barrier phases in
      step (every wait is counted per thread) and release the slot."""
      slot = slot_of(n)
      wait_k(slot)
      mg.barrier_arrive(R["k_free"].at[slot])
      wait("v_loaded", R["v_bar"].at[slot])
      mg.barrier_arrive(R["v_free"].at[slot])
      qk_issued()  # the schedule's turns of a computed step
      softmax_done()
      pv_turn()
      return carry

    def run(start, stop, masked_step, carry):
      return lax.fori_loop(start, stop, lambda t, c: step(t, c, masked_step), carry)

    carry = (_compat.wgmma_row_vector(jnp.full((rows,), neg, f32)),
             _compat.wgmma_row_vector(jnp.zeros((rows,), f32)),
             _compat.wgmma_tile(jnp.zeros((rows, p.Dvp), f32)))
    if p.pingpong:  # consumer 1 starts one turn behind
      _compat.when(w == 1)(pv_turn if named else rendezvous)
    # the CTA's steps in order: each run of this consumer's, the steps between them passed
    # by (with one consumer the runs cover every step)
    done = i32(0)
    for start, stop, masked_run in runs(w):
      if nc > 1:
        carry = lax.fori_loop(done, start, pass_by, carry)
      carry = run(start, stop, masked_run, carry)
      done = stop
    if nc > 1:
      carry = lax.fori_loop(done, steps, pass_by, carry)
    if p.pingpong:  # consumer 1's last turn
      _compat.when(w == 0)(qk_issued)
    m, l, acc = carry
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    o_smem[...] = (acc / _rows(l_safe, acc.shape)).astype(o_smem.dtype)
    lse_smem[...] = jnp.where(empty, neg, m * LN2 + jnp.log(l_safe))
    if cfg.max_logits:  # the running max (log2 units) is the row's max logit
      R["max_s"].at[w][...] = jnp.where(empty, neg, m * LN2)
    mg.commit_smem()
    mg.copy_smem_to_gmem(o_smem, R["out"].at[b, h, q_rows])
    mg.copy_smem_to_gmem(lse_smem, R["lse"].at[b, h, q_rows])
    if cfg.max_logits:
      mg.copy_smem_to_gmem(R["max_s"].at[w], R["row_max"].at[b, h, q_rows])
    mg.wait_smem_to_gmem(0)

  def producer(R, i, h, b):
    steps, block_of, _ = visits(R, i, h, b)
    kvh = lax.div(h, jnp.asarray(p.G, h.dtype))

    def fetch(n, _):
      t = block_of(n)
      slot = lax.rem(n, i32(slots))
      blk = pl_ds(t * bk, bk)

      @_compat.when(n >= slots)
      def _wait_k_free():
        wait("k_consumed", R["k_free"].at[slot])

      mg.copy_gmem_to_smem(R["k"].at[b, kvh, blk], R["k_s"].at[slot], R["k_bar"].at[slot])
      if segments:
        mg.copy_gmem_to_smem(R["kv_seg"].at[b, blk], R["kseg_s"].at[slot],
                             R["kseg_bar"].at[slot])
      for name in streamed:
        bb, hb = pairs[name].index(b, h)
        src = (R[name].at[bb, hb, blk] if pairs[name].kind == "kv"
               else R[name].at[bb, hb, pl_ds(i * p.bq, p.bq), blk])
        mg.copy_gmem_to_smem(src, R[name + "_s"].at[slot], R[name + "_bar"].at[slot])
      for kind, _ in col_words:
        mg.copy_gmem_to_smem(R[f"modkv_{kind}"].at[b, h, :, blk], R[f"modkv{kind}_s"].at[slot],
                             R[f"modkv{kind}_bar"].at[slot])
      for e in range(n_rel):  # each consumer's [rows, bk] window of the skewed array
        for w in range(nc):
          start = _rel.window_start((i * nc + w) * rows, t * bk, p.Sqp, rows)
          src = R[f"rel{e}"]
          mg.copy_gmem_to_smem(src.at[_rel.batch_index(src, b), h, :, pl_ds(start, bk)],
                               R[f"rel{e}_s"].at[slot, w], R[f"rel{e}_bar"].at[slot * nc + w])

      @_compat.when(n >= slots)
      def _wait_v_free():
        wait("v_consumed", R["v_free"].at[slot])

      mg.copy_gmem_to_smem(R["v"].at[b, kvh, blk], R["v_s"].at[slot], R["v_bar"].at[slot])
      return None

    lax.fori_loop(i32(0), steps, fetch, None)

  in_names = (["q", "k", "v"] + (["q_seg", "kv_seg"] if segments else [])
              + (["drop_rows"] if dropout else []) + list(pairs)
              + ([] if not has_mods else ["mod_i"] + (["mod_f"] if mr.n_float else []))
              + [f"modkv_{kind}" for kind, _ in col_words] + [f"rel{n}" for n in range(n_rel)]
              + (["visits"] if lists else []))
  smem = functools.partial(_compat.smem_tile, dtype=dtype)
  tiles = {"q_s": smem((nc, rows, p.Dp)),
           # out's staging tile: Q's once Q is read, else its own (a float32 out: plain
           # layout, written from the accumulator's registers and stored by TMA)
           "o_s": (mg.SMEM((nc, rows, p.Dvp), f32) if p.out_f32
                   else None if p.Dvp == p.Dp else smem((nc, rows, p.Dvp))),
           "k_s": smem((slots, bk, p.Dp)),
           "v_s": smem((slots, bk, p.Dvp)),
           "p_s": smem((nc, rows, bk)),
           "lse_s": mg.SMEM((nc, rows), f32)}
  if cfg.max_logits:
    tiles["max_s"] = mg.SMEM((nc, rows), f32)
  bars = {"q_bar": mg.Barrier(num_barriers=nc),
          "k_bar": mg.Barrier(num_barriers=slots),
          "v_bar": mg.Barrier(num_barriers=slots),
          "k_free": mg.Barrier(num_arrivals=nc, num_barriers=slots),
          "v_free": mg.Barrier(num_arrivals=nc, num_barriers=slots)}
  if segments:
    tiles.update(qseg_s=mg.SMEM((nc, rows), jnp.int32), kseg_s=mg.SMEM((slots, bk), jnp.int32))
    bars.update(qseg_bar=mg.Barrier(num_barriers=nc), kseg_bar=mg.Barrier(num_barriers=slots))
  if p.pingpong and interpret:  # the interpreted schedule (compiled: named barriers)
    bars["sched"] = mg.Barrier(num_arrivals=nc)
  if dropout:
    tiles.update(drop_s=mg.SMEM((nc, 3, rows), u32))
    bars.update(drop_bar=mg.Barrier(num_barriers=nc))
  if has_mods:
    for kind, count, dt in (("i", mr.n_int, jnp.int32), ("f", mr.n_float, f32)):
      if count:
        tiles[f"mod{kind}_s"] = mg.SMEM((nc, count, rows), dt)
        bars[f"mod{kind}_bar"] = mg.Barrier(num_barriers=nc)
  for kind, count in col_words:
    tiles[f"modkv{kind}_s"] = mg.SMEM((slots, count, bk), jnp.int32 if kind == "i" else f32)
    bars[f"modkv{kind}_bar"] = mg.Barrier(num_barriers=slots)
  for e, dt in enumerate(mr.rel_dtypes):
    tiles[f"rel{e}_s"] = mg.SMEM((slots, nc, rows, bk), dt)
    bars[f"rel{e}_bar"] = mg.Barrier(num_barriers=slots * nc)
  for n, f in pairs.items():
    shape = {"q": (nc, rows), "kv": (slots, bk), "tile": (slots, p.bq, bk)}[f.kind]
    tiles[n + "_s"] = mg.SMEM(shape, f.dtype)
    bars[n + "_bar"] = mg.Barrier(num_barriers=nc if f.kind == "q" else slots)

  def body(R):
    if R["o_s"] is None:
      R["o_s"] = R["q_s"]
    i, h, b = lax.axis_index("q"), lax.axis_index("h"), lax.axis_index("b")
    wg = lax.axis_index("wg")

    @_compat.when(wg < nc)
    def _():
      if nc > 1:
        mg.set_max_registers(p.registers[0], action="increase")
      consumer(R, wg, i, h, b)

    @_compat.when(wg == nc)
    def _():
      if nc > 1:
        mg.set_max_registers(p.registers[1], action="decrease")
      producer(R, i, h, b)

  def entry(*refs):
    R = dict(zip(in_names + ["out", "lse"] + (["row_max"] if cfg.max_logits else []), refs))
    t_names, b_names = list(tiles), list(bars)

    def scoped(*allocs):
      ts, bs = allocs
      body(dict(R, **dict(zip(t_names, ts)), **dict(zip(b_names, bs))))

    _compat.run_scoped(scoped, tuple(tiles.values()), tuple(bars.values()),
                       collective_axes="wg")

  out_type = (jax.ShapeDtypeStruct((p.B, p.H, p.Sqp, p.Dvp), f32 if p.out_f32 else dtype),
              *(jax.ShapeDtypeStruct((p.B, p.H, p.Sqp), f32),) * (2 if cfg.max_logits else 1))
  return mg.kernel(entry, out_type=out_type, grid=(p.nq, p.H, p.B), grid_names=("q", "h", "b"),
                   num_threads=nc + 1, thread_name="wg", interpret=interpret,
                   compiler_params=mg.CompilerParams(approx_math=True))


@dataclasses.dataclass(frozen=True)
class PairForm:
  """How a rank-4 bias or dense mask (each dim 1 or full) reaches the kernel.

  kind "tile" ([.., Sq, Skv]): a [128, bk] block per ring slot, 16-bit (a bias in its own
  dtype when that is 16-bit, a mask as bfloat16 0 / 1), else float32; "kv" ([.., 1, Skv]):
  a float32 [bk] vector per ring slot; "q" ([.., Sq | 1, 1]): a float32 [64] vector per
  consumer, loaded once. `per_batch` / `per_head`: whether the batch / head dims are full
  (else index 0 is read for every b / h).
  """

  kind: str
  dtype: jnp.dtype
  per_batch: bool
  per_head: bool

  @staticmethod
  def of(x) -> PairForm:
    Bb, Hb, Sq2, Sk2 = x.shape
    kind = "q" if Sk2 == 1 else ("kv" if Sq2 == 1 else "tile")
    dtype = jnp.dtype(jnp.bfloat16 if x.dtype == jnp.bool_ else x.dtype)
    if kind != "tile" or dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
      dtype = jnp.dtype(jnp.float32)
    return PairForm(kind, dtype, Bb != 1, Hb != 1)

  def index(self, b, h):
    zero = jnp.zeros((), jnp.int32)
    return (b if self.per_batch else zero), (h if self.per_head else zero)

  def slot_bytes(self, bq: int, bk: int) -> int:
    return {"q": 0, "kv": 4 * bk, "tile": bq * bk * self.dtype.itemsize}[self.kind]

  def operand(self, x, p: Plan):
    """The padded array the kernel reads: [Bb, Hb, Sqp, Skvp], [Bb, Hb, Skvp] or [Bb, Hb, Sqp]
    (a mask's padding is False, i.e. masked)."""
    if self.kind == "tile":
      return C.pad_pair(x.astype(self.dtype), p)
    if self.kind == "kv":
      return _mask.pad_axis(x[:, :, 0, :].astype(jnp.float32), 2, p.Skvp)
    col = jnp.broadcast_to(x[:, :, :, 0], x.shape[:2] + (p.Sq,)).astype(jnp.float32)
    return _mask.pad_axis(col, 2, p.Sqp)


@dataclasses.dataclass(frozen=True)
class ModRows:
  """How the score_mod / mask_mod tile parts read their per-row words in the kernel.

  int32 words: 0 the global kv offset kv0, 1 the global q of each row (the score_mod's),
  2 the global q clamped into the real rows (the mask_mod's), then the integer per-(b, h)
  residuals and per-q-position residuals; float32 words: the float ones. `sm_order` /
  `mm_order`: per residual of the score_mod / mask_mod tile part, in its order (per-(b, h)
  ones, then q-position ones), ("i" | "f", word index). Per-kv-position residuals are
  column words streamed with K (int32 [n_kv_int, bk] and float32 [n_kv_float, bk] per ring
  slot): `sm_kv` / `mm_kv` ("i" | "f", column word index), after the row ones.
  """

  n_int: int
  n_float: int
  sm_order: tuple = ()
  mm_order: tuple = ()
  n_kv_int: int = 0
  n_kv_float: int = 0
  sm_kv: tuple = ()
  mm_kv: tuple = ()
  rel_dtypes: tuple = ()  # per rel residual (score_mod's, then mask_mod's): int32 / float32
  sm_rel: tuple = ()  # the score_mod's rel residuals: indices into rel_dtypes
  mm_rel: tuple = ()

  def _res(self, words, order, shape, cols=None, kv_order=(), rels=None, rel_order=()):
    rows = tuple(_rows(words[kind][n], shape) for kind, n in order)
    return (rows + tuple(lax.broadcast_in_dim(cols[kind][n], shape, [1]) for kind, n in kv_order)
            + tuple(rels[n] for n in rel_order))

  def score(self, cfg: AttentionConfig, words, st, ki, cols=None, rels=None):
    """The score_mod's tile part at global positions (b, h folded into its residuals);
    `rels`: the tiles of the rel residuals (`rel_dtypes`), [rows, bk] each."""
    assert cfg.score_mod is not None
    score_mod, shape = cfg.score_mod, st.shape
    q = _rows(words["i"][1], shape)
    kv = ki + _rows(words["i"][0], shape)
    mod = jnp.vectorize(lambda x, q_, k_, *r: score_mod(x, 0, 0, q_, k_, *r))
    return mod(st, q, kv, *self._res(words, self.sm_order, shape, cols, self.sm_kv, rels,
                                     self.sm_rel))

  def allowed(self, cfg: AttentionConfig, words, ki, shape, cols=None, rels=None):
    """The mask_mod's tile part at global positions clamped into the real sequences."""
    assert cfg.mask_mod is not None
    mask_mod = cfg.mask_mod
    q = _rows(words["i"][2], shape)
    kv = jnp.minimum(ki, cfg.seq_kv - 1) + _rows(words["i"][0], shape)
    fn = jnp.vectorize(lambda q_, k_, *r: mask_mod(0, 0, q_, k_, *r))
    return fn(q, kv, *self._res(words, self.mm_order, shape, cols, self.mm_kv, rels,
                                self.mm_rel))


def mod_rows(cfg: AttentionConfig, sm_arrays, mm_arrays, p: Plan, offsets=None, sm_pos=None,
             mm_pos=None):
  """(ModRows, int32 [B, H, n_int, Sqp], float32 [B, H, n_float, Sqp] or None, int32
  [B, H, n_kv_int, Skvp] or None, float32 [B, H, n_kv_float, Skvp] or None, the rel
  residuals' skewed arrays [B or 1, H, 64, width] (a list; `_rel.operand`)): the per-row and
  per-kv-column words and the rel windows of the score_mod's / mask_mod's tile parts
  (`ModRows`);
  `sm_arrays` / `mm_arrays` their per-(b, h) scalar residuals [B, H, 1]
  (`_common.split_per_head` / `split_mask_mod`, global (b, h) folded in through `offsets`),
  `sm_pos` / `mm_pos` their per-position residuals (`_common.PosResiduals` or None)."""
  _, _, q0, kv0 = (0, 0, 0, 0) if offsets is None else tuple(offsets)
  i32 = lambda o: jnp.asarray(o, jnp.int32)
  q = jnp.arange(p.Sqp, dtype=jnp.int32)
  ints = [i32(kv0), q + i32(q0), jnp.minimum(q, p.Sq - 1) + i32(q0)]
  floats: list = []
  kv_ints: list = []
  kv_floats: list = []
  orders, kv_orders, rel_orders = [], [], []
  rels: list = []

  def place(r, fl, it, order):
    if jnp.issubdtype(r.dtype, jnp.inexact):
      order.append(("f", len(fl)))
      fl.append(r.astype(jnp.float32))
    else:
      order.append(("i", len(it)))
      it.append(r.astype(jnp.int32))

  for arrays, pos in ((sm_arrays, sm_pos), (mm_arrays, mm_pos)):
    order: list = []
    kv_order: list = []
    for r in arrays:
      place(r, floats, ints, order)
    if pos is not None:
      for r in pos.q:
        place(r[..., :p.Sqp], floats, ints, order)
      for r in pos.kv:
        place(r[..., :p.Skvp], kv_floats, kv_ints, kv_order)
    rel_order = []
    for n in range(0 if pos is None else len(pos.rel)):
      rel_order.append(len(rels))
      rels.append(_rel.operand(pos, n, p.B, p.H, p.Sqp, p.Skvp, ROWS_PER_WARPGROUP))
    orders.append(tuple(order))
    kv_orders.append(tuple(kv_order))
    rel_orders.append(tuple(rel_order))

  def stack(xs, dt, n):
    shape = (p.B, p.H, n)
    return jnp.stack([jnp.broadcast_to(x, shape).astype(dt) for x in xs], axis=2) if xs else None

  rows = ModRows(len(ints), len(floats), orders[0], orders[1], len(kv_ints), len(kv_floats),
                 kv_orders[0], kv_orders[1], tuple(jnp.dtype(x.dtype) for x in rels),
                 rel_orders[0], rel_orders[1])
  return (rows, stack(ints, jnp.int32, p.Sqp), stack(floats, jnp.float32, p.Sqp),
          stack(kv_ints, jnp.int32, p.Skvp), stack(kv_floats, jnp.float32, p.Skvp), rels)


def visit_entries(counts, blocks):
  """(n_partial, n_full [B', H', n_rows], blocks [B', H', n_rows, n_cols]) of
  `_common.block_lists`' (counts, lists): each row's PARTIAL blocks followed by its FULL
  ones (the order the kernels' producers fetch them; past the end: repeats)."""
  n_partial, n_full = counts[:, :, 0], counts[:, :, 1]
  partial, full = blocks[..., 0, :], blocks[..., 1, :]
  n_cols = partial.shape[-1]
  col = jnp.arange(n_cols, dtype=jnp.int32)[None, None, None, :]
  np_ = n_partial[..., None]
  later = jnp.take_along_axis(full, jnp.clip(col - np_, 0, n_cols - 1), axis=-1)
  return n_partial, n_full, jnp.where(col < np_, partial, later).astype(jnp.int32)


def _cta_geometry(p: Plan) -> C.Geometry:
  """The plan's blocks as the shared Geometry (the CTA's rows, the ring's kv blocks)."""
  return C.Geometry(B=p.B, H=p.H, Hkv=p.Hkv, Sq=p.Sq, Skv=p.Skv, D=p.D, Dv=p.Dv, bq=p.bq,
                    bk=p.bk, Dp=p.Dp, Dvp=p.Dvp)


def visit_lists(cfg: AttentionConfig, p: Plan, q_seg_p, kv_seg_p, mask, mod_cls):
  """The CTAs' kv blocks when segment ids, a dense mask or a mask_mod can empty a block, as
  the Triton family's lists (`_common.block_lists`, by q block at the CTA's rows): int32
  [B', H', nq, VISIT_HEADER + nk], or None without any of them.

  Row (b', h', i): n_partial, n_full, then for each consumer warpgroup w (64 rows) the
  [start, stop) of the PARTIAL entries inside its own static bounds (sorted lists: one
  contiguous run; the other PARTIAL entries are blocks only the other consumer's rows may
  see, which w passes by), then the PARTIAL kv blocks followed by the FULL ones (FULL for
  the CTA's rows: inside both consumers' bounds). EMPTY blocks are never fetched.
  `q_seg_p`, `kv_seg_p`: padded to the plan's blocks; `mask`: the caller's rank-4 mask;
  `mod_cls`: the mask_mod's classes at the CTA's blocks (`_common.mod_classes`).
  """
  mask_p = None if mask is None else C.pad_pair(mask.astype(jnp.bool_), p)
  lists = C.block_lists(cfg, _cta_geometry(p), q_seg_p, kv_seg_p, mask_p, "q", mod_cls)
  if lists is None:
    return None
  n_partial, n_full, entries = visit_entries(*lists)
  partial = lists[1][..., 0, :]  # [B', H', nq, nk]
  col = jnp.arange(p.nk, dtype=jnp.int32)[None, None, None, :]
  spec = C.mask_spec(cfg)
  header = [n_partial, n_full]
  real = col < n_partial[..., None]
  for w in range(2):  # a second consumer's entries are read only when it exists
    r = np.arange(p.nq) * p.consumers + min(w, p.consumers - 1)
    a, z = spec.kv_block_range(r, ROWS_PER_WARPGROUP, p.bk, p.nk)
    a = jnp.asarray(np.broadcast_to(a, (p.nq,)), jnp.int32)[None, None, :, None]
    z = jnp.asarray(np.broadcast_to(z, (p.nq,)), jnp.int32)[None, None, :, None]
    header += [jnp.sum(real & (partial < a), -1, dtype=jnp.int32),
               jnp.sum(real & (partial < z), -1, dtype=jnp.int32)]
  head = jnp.stack(header, axis=-1)
  return jnp.concatenate([head, entries], axis=-1).astype(jnp.int32)


def dropout_rows(cfg: AttentionConfig, seed, p: Plan, offsets=None):
  """uint32 [B, H, 3, Sqp]: the counter hash's per-row words (`_dropout.row_words`) of every
  (b, h, q) at its global position, computed by XLA, and the global kv offset (the same in
  every row); the kernel finishes each entry (`_dropout.bits_from_row`) at kv0 + its local kv.
  `offsets`: None or the global (b0, h0, q0, kv0) of local element 0 (ints or traced)."""
  b0, h0, q0, kv0 = (0, 0, 0, 0) if offsets is None else tuple(offsets)
  i32 = lambda o: jnp.asarray(o, jnp.int32)
  b = jnp.arange(p.B, dtype=jnp.int32)[:, None, None] + i32(b0)
  h = jnp.arange(p.H, dtype=jnp.int32)[None, :, None] + i32(h0)
  q = jnp.arange(p.Sqp, dtype=jnp.int32)[None, None, :] + i32(q0)
  b, h = _dropout.hash_coords(cfg.dropout_broadcast, b, h)
  cq, cq2 = _dropout.row_words(seed[0], seed[1], b, h, q)
  shape = (p.B, p.H, p.Sqp)
  words = (cq, cq2, i32(kv0).astype(jnp.uint32))
  return jnp.stack([jnp.broadcast_to(x, shape) for x in words], axis=2)


def positions(cfg: AttentionConfig) -> C.Positions:
  """The family's per-position residual layout (`_common.split_per_head(positions=)`): q and
  kv positions and rows by kv_idx - q_idx (read as windows of a skewed array, `_rel`),
  padded to 128 (every kernel's blocks divide it; each slices its own padded length)."""
  return C.Positions(cfg.seq_q, cfg.seq_kv, _round_up(cfg.seq_q, 128),
                     _round_up(cfg.seq_kv, 128), rel=True)


@dataclasses.dataclass
class Mods:
  """A score_mod / mask_mod split for these kernels (`split_mods`)."""

  cfg: AttentionConfig  # with the tile parts
  sm_arrays: tuple  # the score_mod's per-(b, h) scalar residuals [B, H, 1]
  mm_arrays: tuple  # the mask_mod's
  split: C.HeadSplit | None  # the score_mod's split
  sm_pos: C.PosResiduals | None  # its per-position residuals
  mm_pos: C.PosResiduals | None  # the mask_mod's


def split_mods(cfg: AttentionConfig, consts, mod, B: int, H: int, offsets=None, *,
               grads: bool = False, role: str = "forward") -> Mods:
  """The score_mod's and mask_mod's tile parts, per-(b, h) scalar residuals and per-position
  residuals (`_common.split_per_head` with gradients to the differentiable consts when
  `grads`, `split_mask_mod`; global (b, h) and positions through `offsets`). A residual that
  is an array per head is refused, naming the kernel (`role`: "forward" / "backward")."""
  f32 = jnp.float32
  sm_arrays: tuple = ()
  split = None
  where = positions(cfg)
  if cfg.score_mod is not None:
    cfg, consts = C.hoist_score_mod(cfg, consts, f32)
    split = C.split_per_head(cfg, tuple(jnp.asarray(c) for c in consts), f32, B, H,
                             grads=grads, offsets=offsets, positions=where)
    if not all(split.scalar):
      raise NotImplementedError(
          f"the pallas_mosaic_gpu {role} supports a score_mod whose per-head values are"
          " scalars (softcap, ALiBi slopes), not arrays per head; use"
          " implementation='pallas_triton'")
    cfg, sm_arrays = split.cfg, split.arrays
  msplit = C.split_mask_mod(cfg, mod, B, H, offsets, where)
  if not all(msplit.scalar):
    raise NotImplementedError(
        f"the pallas_mosaic_gpu {role} supports a mask_mod whose per-head values are scalars,"
        " not arrays per head; use implementation='pallas_triton'")
  sm_pos = None if split is None else split.pos
  cfg = msplit.cfg
  if cfg.score_mod is not None:
    cfg = dataclasses.replace(cfg, score_mod=_float32_words(
        cfg.score_mod, sm_arrays, sm_pos, lead=5))
  if cfg.mask_mod is not None:
    cfg = dataclasses.replace(cfg, mask_mod=_float32_words(
        cfg.mask_mod, msplit.arrays, msplit.pos, lead=4))
  return Mods(cfg, sm_arrays, msplit.arrays, split, sm_pos, msplit.pos)


def _float32_words(tile, arrays, pos, lead: int):
  """`tile` taking its float residuals as the kernels' float32 words: each is cast back to
  its own dtype inside (a float64 array under x64 made float64 residuals, and the tile part
  was traced with them), a score_mod's result to its score's dtype; `tile` itself when
  every float residual is float32."""
  dtypes = [x.dtype for x in arrays]
  if pos is not None:
    dtypes += [x.dtype for x in pos.q + pos.kv + pos.rel]
  if all(not jnp.issubdtype(d, jnp.inexact) or d == jnp.float32 for d in dtypes):
    return tile

  def cast(*args):
    res = tuple(jnp.asarray(x).astype(d) if jnp.issubdtype(d, jnp.inexact) else x
                for x, d in zip(args[lead:], dtypes))
    out = tile(*args[:lead], *res)
    return jnp.asarray(out).astype(jnp.asarray(args[0]).dtype) if lead == 5 else out  # s's
  return cast


def pl_ds(start, size):
  return _compat.ds(start, size)


def _rows(x, shape):
  """A per-row vector [rows] broadcast over a [rows, cols] tile."""
  return lax.broadcast_in_dim(x, shape, [0])


def forward(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, mod=None,
            offsets=None, *, block_kv: int | None = None, slots: int | None = None,
            consumers: int | None = None, pingpong: bool = True, interpret=None,
            _skip_wait: str | None = None):
  """Mosaic-GPU forward with the interface of `flashvjp.pallas.triton.forward`.

  Args:
    cfg: static configuration; cfg.interpret runs the kernel under the Mosaic-GPU
      interpreter (race detection on) unless `interpret` gives other parameters.
    q: [B, H, Sq, D]; k: [B, Hkv, Skv, D]; v: [B, Hkv, Skv, Dv]; float16 or bfloat16.
    bias, mask, q_seg, kv_seg, seed, consts, mod, offsets: as the Triton forward's (`mod`:
      the mask_mod's `ModInputs`; its block classes make the visit lists). What the kernel
      lacks is refused (`_limits.forward_problem`, `split_mods`) before building a kernel.
    block_kv, slots, consumers, pingpong: override the launch plan (`plan`; tests).

  Returns:
    (out [B, H, Sq, Dv] in q.dtype (float32 with cfg.out_f32), lse [B, H, Sq] float32,
    natural log, -inf for an empty row), and the row maxima [B, H, Sq] float32 (-inf: empty)
    when cfg.max_logits.
  """
  problem = _limits.forward_problem(cfg, q, k, v, bias=bias, mask=mask, q_seg=q_seg,
                                    kv_seg=kv_seg, seed=seed, consts=consts, mod=mod,
                                    offsets=offsets)
  if problem is not None:
    raise NotImplementedError(f"pallas_mosaic_gpu forward: {problem}")
  # Up to 256 value columns in one kernel where nothing but causal / window / padding acts on
  # the scores: with P V accumulating into the running output (no second accumulator) its
  # [64, 256] float32 (128 registers a thread) fits (sm_90a ptxas, head dim 256: 0 spills,
  # 412 / 419 instructions per iteration full / causal for 4.19 MMA MFLOP). With segment ids
  # (116 B spilled), another per-entry feature, a float32 out (its staging tile overflows
  # shared memory) or max logits, two kernels of at most `V_PART` columns, each computing
  # the scores in full and half of out (the backward's column split, here by XLA): 0 spills
  # (168 registers), at 1.5x the Q K^T matmuls. Both return the same lse.
  per_entry = (q_seg is not None or cfg.dropout_active or bias is not None or mask is not None
               or cfg.score_mod is not None or cfg.mask_mod is not None or cfg.out_f32
               or cfg.max_logits)
  if v.shape[3] > (V_PART if per_entry else V_WHOLE):
    kw = dict(mod=mod, offsets=offsets, block_kv=block_kv, slots=slots, consumers=consumers,
              pingpong=pingpong, interpret=interpret, _skip_wait=_skip_wait)
    args = (bias, mask, q_seg, kv_seg, seed, consts)
    first, *rows = forward(cfg, q, k, v[..., :V_PART], *args, **kw)
    second = forward(cfg, q, k, v[..., V_PART:], *args, **kw)[0]
    return (jnp.concatenate([first, second], axis=-1), *rows)
  forms = [None if x is None else PairForm.of(x) for x in (bias, mask)]
  mods_split = split_mods(cfg, consts, mod, q.shape[0], q.shape[1], offsets)
  cfg = mods_split.cfg
  has_mods = cfg.score_mod is not None or cfg.mask_mod is not None
  n_cols = sum(len(x.kv) for x in (mods_split.sm_pos, mods_split.mm_pos) if x is not None)
  n_rel = sum(len(x.rel) for x in (mods_split.sm_pos, mods_split.mm_pos) if x is not None)
  p = plan(q.shape, k.shape, v.shape, block_kv=block_kv, slots=slots, consumers=consumers,
           elementwise=(q_seg is not None or cfg.dropout_active or bias is not None
                        or mask is not None or has_mods),
           slot_extra=lambda bq, bk: (4 * bk if q_seg is not None else 0) + sum(
               f.slot_bytes(bq, bk) for f in forms if f is not None) + 4 * bk * n_cols
           + 4 * bq * bk * n_rel,  # the rel windows: [64, bk] per consumer
           pingpong=pingpong, out_f32=cfg.out_f32, rel=n_rel > 0)
  if interpret is None and cfg.interpret:
    interpret = _compat.interpret_params(detect_races=True)
  if interpret:
    threads = _compat.interpret_threads_problem(p.consumers + 1, "forward")
    if threads is not None:
      raise RuntimeError(f"pallas_mosaic_gpu forward (interpret): {threads}")
  segments = q_seg is not None
  mods = words_i = words_f = cols_i = cols_f = None
  rels: list = []
  if has_mods:
    mods, words_i, words_f, cols_i, cols_f, rels = mod_rows(
        cfg, mods_split.sm_arrays, mods_split.mm_arrays, p, offsets, mods_split.sm_pos,
        mods_split.mm_pos)
  q_seg_p = kv_seg_p = None
  if segments:  # padding repeats the edge id (the mask model masks padded positions)
    q_seg_p, kv_seg_p = (x.astype(jnp.int32) for x in C.pad_segments(q_seg, kv_seg, p))
  mod_cls = None
  if cfg.mask_mod is not None:
    mod_cls = (C.mod_classes(cfg, _cta_geometry(p), mod) if mod is not None
               else jnp.full((1, 1, p.nq, p.nk), _mask.PARTIAL, jnp.int8))
  visit = visit_lists(cfg, p, q_seg_p, kv_seg_p, mask, mod_cls)
  kernel = _build(cfg, p, q.dtype, segments=segments, bias=forms[0], mask=forms[1], mods=mods,
                  lists=visit is not None, interpret=interpret, skip_wait=_skip_wait)
  operands = [C.pad_seq_head(q, p.Sqp, p.Dp), C.pad_seq_head(k, p.Skvp, p.Dp),
              C.pad_seq_head(v, p.Skvp, p.Dvp)]
  if segments:
    operands += [q_seg_p, kv_seg_p]
  if cfg.dropout_active:
    operands.append(dropout_rows(cfg, seed, p, offsets))
  for x, f in zip((bias, mask), forms):
    if f is not None:
      operands.append(f.operand(x, p))
  operands += [x for x in (words_i, words_f, cols_i, cols_f) if x is not None] + rels
  if visit is not None:
    operands.append(visit)
  out, *rows = kernel(*operands)
  # lse (+ the row maxima with cfg.max_logits), -inf at empty rows
  rows = C.neg_inf_at_empty([x[:, :, : p.Sq] for x in rows], jnp.float32)
  return (out[:, :, : p.Sq, : p.Dv],) + rows
