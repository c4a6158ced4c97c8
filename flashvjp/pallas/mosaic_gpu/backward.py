"""Pallas Mosaic-GPU backward (Hopper, sm_90a): a dK/dV kernel and a dQ kernel.

Room: Pallas Mosaic-GPU backend (backward). Probabilities are recomputed from the saved
logsumexp in the exp2 domain; nothing O(seq_q * seq_kv) is kept or written; no atomics:
every output block is written by exactly one program (bitwise deterministic). The ring
protocol below is `_ring`'s and the per-tile math (`_probs`, `_dscores`, dropout's `_keep`)
`_tile`'s, shared with the d(rel) kernel (`drel`, which this module calls) and the tangent
kernel (`tangent`, which builds on this module).

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
block (and its segment ids, dropout words, mask tile). Tiles are transposed ([bk, bq]:
sT = K Q^T, dPT = V dO^T, dV += PT dO, dK += dST Q). The lse / delta (segment, dropout,
mask) slots are read with generic loads: the consumer fences (`commit_smem`) before it
frees the slot, or the producer's TMA refill would race those reads (the race of JAX's own
dkv kernel; the dQ kernel fences its kv-side slots the same way).

dQ kernel: grid (batch, head, q block); loops over the kv blocks of q block i
(`MaskSpec.kv_block_range`). Ring: K, V of one kv block (and its segment ids, mask tile).

Causal / window / sequence padding: whole blocks outside the mask model's static bounds are
never visited; the elementwise mask runs only on the blocks outside
`full_q_block_range` / `full_kv_block_range` (three loops: masked, unmasked, masked).
With segment ids, a dense mask or a mask_mod, each program follows its row of the Triton
family's compacted block lists (`_visit_lists`, read as scalars from GMEM; per q head for
dK/dV): the PARTIAL blocks with the elementwise mask, then the FULL ones without; EMPTY
blocks are never fetched.

Segment ids: the q block's ids travel with it (ring slot or resident SMEM, 1-D TMA).

Dense mask and bias: tiles streamed with the loop ([bq, bk] for dQ; [bk, bq] tiles of a
transposed copy, made by XLA, for dK/dV), read generically into the wgmma layout; int8 for
the mask, float32 for the bias. Broadcast seq dims are materialised
([.., Sq, Skv]), broadcast batch / head dims are not. dbias: the dQ kernel writes each
visited tile's score gradient (float32, SMEM then TMA) into a [B, H, Sq, Skv]
intermediate; XLA zeroes the never-visited blocks (static bounds, visit lists) and sums the bias' broadcast dims
(`_reduce_dbias`): O(B H Sq Skv) memory, unlike the Triton family's dbias kernel.

Dropout: the counter hash of `flashvjp._dropout` (the same keep bits as every other
implementation), split where its inputs split: the per-(b, h, q) words are computed by XLA
and travel like lse; the kernels finish the hash per element (`_keep`).

score_mod: split by `C.split_per_head` as in the Triton family; its per-(b, h) residuals
must be scalars (softcap, ALiBi slopes) and travel as per-row words like lse, with the
global q index and the kv offset; the tile part and its vjp run per tile in the kernels.
Differentiable score_mod consts: the dQ kernel sums each differentiable residual's
per-element gradient over its kv tiles into per-row partials ([B, H, Sq], TMA); XLA sums
the rows and maps them to the consts (`HeadSplit.to_consts`). mask_mod: likewise (`C.split_mask_mod`), its
tile part evaluated at clamped global positions on the PARTIAL blocks; its block classes
make the visit lists.

Blocks: block_kv = 64 (one wgmma M tile per compute warpgroup), block_q = 64 for dQ and
for dK/dV up to head dim 64 without a score_mod and at 128 with nothing but causal /
window / padding on the scores under jax >= 0.12, 32 otherwise (`_dkdv_block_q`:
registers). Compiled, the dV / dK / dQ products take P^T, dS^T and dS as register operands
(as tokamax's kernels); interpreted, those are staged in SMEM, since the GPU interpreter
takes no register operand (the same 16-bit values). The caller's cfg.blocks are not read yet. sm_90a ptxas (causal GQA bf16,
S=1024): 0 spills for each feature alone, for segment ids + dropout + mask + bias + offsets
at head dim 128, and for every feature at once at 64 and 128 (a score_mod with
differentiable slopes + a bias + a mask_mod + segment ids + dropout + a dense mask +
offsets). At 128 that takes smaller blocks where a score_mod's vjp meets dropout or
gradients to its arrays (`_dkdv_block_q`: q blocks of 16 with dropout; `_stream_block`: the
dQ kernel's kv blocks of 32): with the 32 / 64 blocks the dK/dV kernel spilled 28 B (every
feature), the dQ kernel 4 B (ALiBi + softcap with differentiable slopes alone).

Head dims above 128 (up to 256, padded to a multiple of 128): the output accumulators do
not fit one warpgroup's registers ([64, 256] float32 dK and dV: 256 registers a thread), so
two programs share each block (the grid's last axis, `_parts`): each recomputes the block's
scores and dP in full (wgmmas over the whole head dim) and accumulates half of the output
columns (wgmma B operands sliced at whole swizzle tiles, `_cols`), written through the P / dS
tiles a chunk at a time (`_store_chunks`); what both compute (dbias, the residuals' row and
column gradients) the first writes. The cost: the dK/dV kernel's matmuls 1.5x, the dQ
kernel's 1.67x those of one program per block. The tangent kernel then streams kv blocks
of 32 rows, the dQ kernel 64 where its SMEM fits and nothing heavy on registers runs (no
dropout, score_mod or mask_mod; `_stream_block`), else 32. sm_90a ptxas at head dim 256 (causal GQA bf16, S=1024): 0
spills plain, with segment ids + a dense mask + a bias + offsets (dK/dV 255 registers, dQ
199) and with dropout added as well (dK/dV 255 registers with q blocks of 16, dQ 232).

Supported: bfloat16 / float16 inputs (float32 accumulation), head dims <= 256 (padded with
zeros to a multiple of 64; of 128 above 128), GQA / MQA, causal, window, segment ids, a
dense mask, a bias and dbias, dropout, any sequence lengths (padded to whole 64-blocks), a cotangent on lse
(folded into delta), global offsets (a ring chunk pair: dropout and the score_mod read
them), a score_mod (with differentiable consts) and a mask_mod with scalar per-head
residuals and arrays read by one position: per-q-position values travel like lse ("qres<n>"),
per-kv-position ones with the kv blocks ("kvres<n>": the dQ kernel's ring, and in the dK/dV
kernel's ring per step, by query head); their gradients are the dQ kernel's per-row sums and
the dK/dV kernel's per-column sums (one [B, H, Skvp] output each, written per query head),
mapped to the arrays by `HeadSplit.to_consts`. Tables read by kv_idx - q_idx ("relres<n>"):
each kernel's ring takes one window per step of a skewed array (`_rel`; the dK/dV kernel's
[bk, bq] tiles from the array reversed on both axes); their gradients (sums along every
tile's diagonals) come from a third kernel over the block diagonals (`drel`). Not yet:
per-head array residuals; `backward` refuses them by name before any kernel runs.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from flashvjp import _mask
from flashvjp._config import AttentionConfig
from flashvjp.pallas import _common as C
from flashvjp.pallas.mosaic_gpu import _compat
from flashvjp.pallas.mosaic_gpu import _limits
from flashvjp.pallas.mosaic_gpu import _rel
from flashvjp.pallas.mosaic_gpu import drel as _drel
from flashvjp.pallas.mosaic_gpu import forward as F
from flashvjp.pallas.mosaic_gpu._ring import _BLOCK
from flashvjp.pallas.mosaic_gpu._ring import _PAIRS
from flashvjp.pallas.mosaic_gpu._ring import _STAGES
from flashvjp.pallas.mosaic_gpu._ring import _WARPGROUPS
from flashvjp.pallas.mosaic_gpu._ring import _block
from flashvjp.pallas.mosaic_gpu._ring import _i32
from flashvjp.pallas.mosaic_gpu._ring import _interpret
from flashvjp.pallas.mosaic_gpu._ring import _is_kv_vector
from flashvjp.pallas.mosaic_gpu._ring import _is_q_vector
from flashvjp.pallas.mosaic_gpu._ring import _is_rel
from flashvjp.pallas.mosaic_gpu._ring import _load_mask
from flashvjp.pallas.mosaic_gpu._ring import _mm_t2
from flashvjp.pallas.mosaic_gpu._ring import _mutated
from flashvjp.pallas.mosaic_gpu._ring import _pair_tile
from flashvjp.pallas.mosaic_gpu._ring import _produce
from flashvjp.pallas.mosaic_gpu._ring import _produce_step
from flashvjp.pallas.mosaic_gpu._ring import _rel_window
from flashvjp.pallas.mosaic_gpu._ring import _slot_inputs
from flashvjp.pallas.mosaic_gpu._ring import _smem
from flashvjp.pallas.mosaic_gpu._ring import _visit_row
from flashvjp.pallas.mosaic_gpu._ring import _wait_loaded
from flashvjp.pallas.mosaic_gpu._tile import _dropout_rows
from flashvjp.pallas.mosaic_gpu._tile import _dscores
from flashvjp.pallas.mosaic_gpu._tile import _probs

_MAX_HEAD_DIM = 256
# The widest output accumulator a compute warpgroup holds: above it (head dims 129..256) the
# output columns are split over two programs per block (`_parts`).
_ACC_DIM = 128
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))




def _pad_head(d: int, parts: int = 1) -> int:
  """d zero-padded to a multiple of 64 per output part (`_parts`)."""
  return -(-d // (64 * parts)) * 64 * parts


def _head_parts(D: int, Dv: int) -> int:
  """How many programs share one block's output columns: 1 up to head dim `_ACC_DIM`, else 2
  (each holds half of the dK and dV, dQ, or t_out accumulator's columns and recomputes the
  block's scores in full: head dim 256 has no room for a [64, 256] float32 accumulator pair
  in one warpgroup's registers)."""
  return 1 if max(D, Dv) <= _ACC_DIM else 2


def _parts(g: C.Geometry) -> int:
  return _head_parts(g.Dp, g.Dvp)


def _stream_block(g: C.Geometry, cfg: AttentionConfig | None = None, arrays=None,
                  n_diff: int = 0) -> int:
  """The kv block of the dQ and tangent kernels (their streamed K / V rows): 64, or 32.

  With two output parts (`_parts`, head dims above 128): the tangent kernel's is 32 (a
  2-slot ring of [64, 256] K, V and their tangents would not fit shared memory beside the
  resident Q and t_q); the dQ kernel's (`cfg` and its operand `arrays` given) is 64 where its
  SMEM at 64 (`_scratch_bytes`) fits `_limits.SMEM_BUDGET` and no dropout, score_mod or
  mask_mod runs (the ones compiled at 64), else 32:
  plain, with segment ids or a dense mask the [64, 256] K / V ring fits beside the resident
  Q and dO (206848 B at head dim 256, sm_90a), with a bias (float32 tiles in the ring, the
  float32 dS tile) it does not; with dropout (its hash per entry) segment ids + a dense
  mask spilled 20 B at 255 registers (sm_90a ptxas, causal GQA, S=1024). At 64 the dQ main
  loop carries twice the MMA work in 343 instructions per iteration, where 32 took 250
  (head dim 256, full, S=8192: 15285 MMA FLOP per instruction, tokamax's 13443;
  `benchmarks/mosaic_gpu_sass.py`).
  With `cfg` (the dQ kernel's): 32 also above head dim 64 with a score_mod and dropout, or a
  score_mod whose arrays take gradients (per-row sums of its vjp): at 64 the dQ kernel
  spilled at head dim 128 (sm_90a ptxas, causal GQA: ALiBi + softcap with differentiable
  slopes 4 B at 255 registers; with dropout and a bias 8 B), at 32 it does not (197
  registers)."""
  if _parts(g) > 1:
    if cfg is None or arrays is None:
      return _BLOCK // 2
    dq_arrays = _kernel_arrays("dq", arrays)
    ring, resident = _operands("dq", {n.rstrip("T"): x for n, x in dq_arrays.items()})
    wide = dataclasses.replace(g, bk=_BLOCK)
    if (cfg.dropout_active  # registers: segment ids + dropout + a mask spilled 20 B at 64
            or cfg.score_mod is not None or cfg.mask_mod is not None  # (not compiled at 64)
            or _scratch_bytes("dq", dq_arrays, ring, resident, wide, n_diff)
            > _limits.SMEM_BUDGET):
      return _BLOCK // 2
  if cfg is not None and _mod_above_64(g, cfg) and (
      cfg.dropout_active or cfg.num_diff_consts > 0):
    return _BLOCK // 2
  return _BLOCK


def _mod_above_64(g: C.Geometry, cfg: AttentionConfig) -> bool:
  """A score_mod (its vjp's tiles) above head dim 64: where the backward kernels run short
  of registers once dropout (the hash per entry) or gradients to the mod's arrays (per-row
  sums) come too (smaller blocks: `_dkdv_block_q`, `_stream_block`)."""
  return max(g.Dp, g.Dvp) > 64 and cfg.score_mod is not None


def _cols(ref, part, width, parts):
  """Columns [part * width, (part + 1) * width) of an SMEM operand tile (the whole tile with
  one part): a wgmma B operand sliced at whole swizzle tiles."""
  return ref if parts == 1 else ref.at[:, pl.ds(part * width, width)]


def _store_chunks(pairs, bufs, before=None):
  """Write register tiles to GMEM through SMEM staging tiles, a chunk of `bufs[0]`'s width
  at a time: `pairs` are (x [rows, W], dst), dst(c0, w) the GMEM ref of x's columns [c0, c0 +
  w); `bufs` (free by now: the kernel's P / dS tiles, or a resident tile it has read, [rows,
  w] each) are used in turn, each reused once its previous TMA store has read it.
  `before(buf, c0, w, x)`, when given, returns the chunk to store (it may first load into
  the free `buf`)."""
  plgpu = _compat.plgpu()
  w = bufs[0].shape[1]
  chunks = [(x[:, c:c + w], c, dst) for x, dst in pairs for c in range(0, x.shape[1], w)]
  for n, (x, c, dst) in enumerate(chunks):
    buf = bufs[n % len(bufs)]
    if n >= len(bufs):  # its store of chunk n - len(bufs) has read it
      plgpu.wait_smem_to_gmem(len(bufs) - 1, wait_read_only=True)
    if before is not None:
      x = before(buf, c, w, x)
    buf[...] = x.astype(buf.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(buf, dst(c, w))


# The backward's operands when nothing but causal / window / padding acts on the scores.
_PLAIN_ARRAYS = frozenset({"q", "k", "v", "do", "lse", "delta"})


def _dkdv_block_q(g: C.Geometry, cfg, arrays=None) -> int:
  """The dK/dV kernel's q block. Its tiles are [bk, bq] (bq is the wgmma N dim, so 32 is
  legal; the kernel's SMEM tiles then share a 64-byte swizzle). Above head dim 64 the dK
  and dV accumulators alone take 128 registers a thread: 64 spilled (180 B at head dim 128
  with segment ids and dropout, sm_90a ptxas), 32 does not (the Triton family's launch
  table makes the same choice); so does a score_mod (its vjp's tiles: 16 B spilled at head
  dim 64 with a bias). With P^T and dS^T as register operands the plain head-dim-128 kernel
  (`arrays` only q, k, v, dO, lse and delta: nothing but causal / window / padding on the
  scores) at 64 fits jax 0.12's Mosaic compiler (`_compat.wide_dkdv_q_tiles`: 249 / 255
  registers full / causal, 0 spills; 330 / 381 instructions for 4.19 MMA MFLOP a step, 32
  took 218 / 254 for 2.10: 1.32x / 1.33x the MMA work per instruction, and wgmmas of N=64)
  but spills 4 B under jax 0.11.2's, the GPU image's, which stays at 32. Above head
  dim 128 with dropout, 16: at 32 the dK/dV kernel spilled 16 B (sm_90a ptxas, D=256,
  segment ids + dropout + a dense mask + a bias + offsets, 255
  registers), at 16 it does not (255 registers, 0 spills, shared memory 166912 -> 119808 B);
  so at head dim 128 with a score_mod and dropout (every feature at once: 28 B spilled at 32,
  0 at 16 with 231 registers). Speed not measured (no GPU here). The operands stay padded to
  64-blocks (the dQ kernel's)."""
  if cfg.dropout_active and (max(g.Dp, g.Dvp) > _ACC_DIM or _mod_above_64(g, cfg)):
    return 16
  if max(g.Dp, g.Dvp) <= 64 and cfg.score_mod is None:
    return 64
  if (arrays is not None and max(g.Dp, g.Dvp) <= _ACC_DIM and _compat.wide_dkdv_q_tiles()
          and set(arrays) <= _PLAIN_ARRAYS and cfg.score_mod is None and cfg.mask_mod is None
          and not cfg.dropout_active):
    return 64
  return 32


def _preprocess(out, lse, dout, dlse, g: C.Geometry):
  """(lse2, delta), float32 [B, H, Sqp] (`C.log2_rows`)."""
  return C.log2_rows(out, lse, dout, dlse, g.Sqp)


def _lse2(lse, g: C.Geometry):
  """float32 [B, H, Sqp]: lse in the log2 domain (`C.log2_lse`)."""
  return C.log2_lse(lse, g.Sqp)








def _visit(run, lo, hi, full, masked_any, carry=None):
  """`run(start, stop, masked, carry) -> carry` over [lo, hi): unmasked inside `full`,
  masked outside (`full` None: every block masked); all unmasked without `masked_any`."""
  if not masked_any:
    return run(lo, hi, False, carry)
  return _mask.split_loop(run, lo, hi, full, carry)
























def _visit_lists(cfg, g: C.Geometry, q_seg, kv_seg, mask, mod, by: str):
  """int32 [B', H', n_rows, 2 + n_cols], or None: per row (a q block for the dQ kernel,
  by="q"; a kv block for dK/dV, by="kv") n_partial, n_full, then its PARTIAL blocks
  followed by its FULL ones (`_common.block_lists` at the kernel's blocks, as the Triton
  family's): segment ids, a dense mask and a mask_mod's classes skip EMPTY blocks."""
  q_seg_p, kv_seg_p = C.pad_segments(q_seg, kv_seg, g)
  if q_seg_p is not None:
    q_seg_p, kv_seg_p = q_seg_p.astype(jnp.int32), kv_seg_p.astype(jnp.int32)
  mask_p = None if mask is None else C.pad_pair(mask.astype(jnp.bool_), g)
  mod_cls = None
  if cfg.mask_mod is not None:
    mod_cls = (C.mod_classes(cfg, g, mod) if mod is not None
               else jnp.full((1, 1, g.nq, g.nk), _mask.PARTIAL, jnp.int8))
  lists = C.block_lists(cfg, g, q_seg_p, kv_seg_p, mask_p, by, mod_cls)
  if lists is None:
    return None
  n_partial, n_full, entries = F.visit_entries(*lists)
  return jnp.concatenate([n_partial[..., None], n_full[..., None], entries], axis=-1)






def _kernel_arrays(kind, arrays):
  """The operands one kernel reads: a bias / mask pair in its orientation only (the
  transposed copies, "...T", are the dK/dV kernel's)."""
  return {n: x for n, x in arrays.items()
          if n.rstrip("T") not in _PAIRS or n.endswith("T") == (kind == "dkdv")}


def _operands(kind, arrays):
  """(ring, resident) operand names of a kernel ("dkdv", "dq" or "tangent"), in their SMEM
  order."""
  kv_vectors = [n for n in arrays if _is_kv_vector(n)]  # streamed with every loop step
  rels = [n for n in arrays if _is_rel(n)]  # a window per loop step
  if kind == "tangent":  # the dQ kernel's loop, with the tangents of q / k / v / bias
    q_side = [n for n in ("q", "tq", "lse") if n in arrays]
    kv_side = [n for n in ("k", "v", "tk", "tv", "kv_seg") if n in arrays]
    pairs = [p for p in _PAIRS + ("tbias",) if p in arrays]
    return kv_side + kv_vectors + pairs + rels, q_side + [n for n in arrays if _is_q_vector(n)]
  q_side = ["q", "do", "lse", "delta"] + [n for n in arrays if _is_q_vector(n)]
  kv_side = ["k", "v"] + ["kv_seg"] * ("kv_seg" in arrays)
  pairs = [p + ("T" if kind == "dkdv" else "") for p in _PAIRS if p in arrays]
  if kind == "dkdv":
    return q_side + kv_vectors + pairs + rels, kv_side
  return kv_side + kv_vectors + pairs + rels, q_side


def _scratch_specs(kind, arrays, ring, resident, g: C.Geometry, n_diff=0, n_kvd=0):
  """The SMEM buffers as (shape, dtype, minor or None: a swizzled wgmma operand tile), in
  three groups: the rings ([_STAGES, ...]), the resident buffers, the P / dS tiles."""
  rows = (g.bq, g.bk) if kind == "dkdv" else (g.bk, g.bq)  # (ring block, resident block)
  minor = min(g.bq, g.bk, g.Dp, g.Dvp)
  tile = (g.bk, g.bq) if kind == "dkdv" else (g.bq, g.bk)

  def buf(name, block, stages=()):
    x = arrays[name]
    if name.rstrip("T") in _PAIRS + ("tbias",) or _is_rel(name):  # a tile in the kernel's
      return (stages + tile, x.dtype, None)  # orientation, read generically
    if _is_kv_vector(name):
      return (stages + (g.bk,), x.dtype, None)
    if x.ndim == 4:
      return (stages + (block, x.shape[3]), x.dtype, minor)
    return (stages + (block,), x.dtype, None)

  dt = arrays["q"].dtype
  f32 = jnp.dtype(jnp.float32)
  # P and dS ([bk, bq]); dS ([bq, bk]); the tangent's P * t_s and P ([bq, bk])
  tiles = 1 if kind == "dq" else 2
  tile_bufs: list[tuple] = [(tile, dt, minor) for _ in range(tiles)]
  if kind == "tangent":  # t_lse on its way out; t_out's staging unless q's buffer fits it
    tile_bufs.append(((g.bq,), f32, None))
    if g.Dvp != g.Dp and _parts(g) == 1:  # (two parts stage t_out in the P tiles)
      tile_bufs.append(((g.bq, g.Dvp), dt, minor))
  if kind == "dq" and "bias" in arrays:  # dS in float32 on its way to the dbias output
    tile_bufs.append((tile, f32, None))
  if kind == "dq":  # per-row partial d(residual) of the score_mod, on their way out
    tile_bufs += [((g.bq,), f32, None) for _ in range(n_diff)]
  if kind == "dkdv":  # per-kv-position residual gradients of one head, on their way out
    tile_bufs += [((g.bk,), f32, None) for _ in range(n_kvd)]
  return ([buf(n, rows[0], (_STAGES,)) for n in ring], [buf(n, rows[1]) for n in resident],
          tile_bufs)


def _scratch_bytes(*args, **kwargs) -> int:
  """An upper bound on `_scratch`'s SMEM bytes (each buffer rounded up to the 1024 B a
  swizzled tile is aligned to), its barriers included."""
  total = 0
  for group in _scratch_specs(*args, **kwargs):
    for shape, dtype, _ in group:
      total += -(-int(np.prod(shape)) * jnp.dtype(dtype).itemsize // 1024) * 1024
  return total + 1024


def _scratch(kind, arrays, ring, resident, g: C.Geometry, n_diff=0, n_kvd=0):
  """SMEM (rings [_STAGES, ...] then resident buffers, then P / dS tiles) and barriers."""
  plgpu = _compat.plgpu()

  def make(spec):
    shape, dtype, minor = spec
    return plgpu.SMEM(shape, dtype) if minor is None else _smem(shape, dtype, minor)

  rings, res, tile_bufs = _scratch_specs(kind, arrays, ring, resident, g, n_diff, n_kvd)
  smem = (tuple(map(make, rings)), tuple(map(make, res)), tuple(map(make, tile_bufs)))
  return (smem, tuple(plgpu.Barrier(num_barriers=_STAGES) for _ in ring),
          plgpu.Barrier(num_barriers=_STAGES), plgpu.Barrier(num_barriers=len(resident)))


def _load_resident(srcs, dsts, bars):
  plgpu = _compat.plgpu()
  for n_bar, (src, dst) in enumerate(zip(srcs, dsts)):
    plgpu.copy_gmem_to_smem(src, dst, bars.at[n_bar])
  for n_bar in range(len(srcs)):
    plgpu.barrier_wait(bars.at[n_bar])
















# ---- dK / dV ----------------------------------------------------------------------

def _dkdv_kernel(*refs, cfg, g: C.Geometry, masked_any, names, ring, resident, pos_diff=(0, 0)):
  plgpu = _compat.plgpu()
  wgmma_layout, row, col = _compat.layouts()
  r = dict(zip(names, refs))
  n_kvd = pos_diff[1]  # per-kv-position residuals with gradients: [B, H, Skvp] outputs
  dk_ref, dv_ref = refs[len(names):len(names) + 2]
  dkv_refs = refs[len(names) + 2:len(names) + 2 + n_kvd]
  (ring_smem, res_smem, tiles), loaded, free, res_bars = refs[len(names) + 2 + n_kvd:]
  p_smem, ds_smem = tiles[:2]
  dkv_smem = tiles[2:]
  interpreted = bool(_interpret(cfg))
  rs = dict(zip(ring, ring_smem))
  res = dict(zip(resident, res_smem))
  b, hk, j = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("kv")
  wg, part = lax.axis_index("wg"), lax.axis_index("d")
  parts = _parts(g)
  wk, wv = g.Dp // parts, g.Dvp // parts  # this program's dK / dV columns
  spec = C.mask_spec(cfg)
  lo, hi = spec.q_block_range(j, g.bq, g.bk, g.nq)
  lo, hi = jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)
  n = hi - lo
  G = g.G
  cols = pl.ds(j * g.bk, g.bk)

  lists = lambda gi: _visit_row(r, b, hk * G + gi, j)

  @pl.when(wg == 1)
  def _producer():
    def fill(gi, i, slot):
      rows = pl.ds(i * g.bq, g.bq)
      for name, bar in zip(ring, loaded):
        if name.rstrip("T") in _PAIRS:
          src = _pair_tile(r[name], b, hk * G + gi, cols, rows)
        elif _is_rel(name):  # keys as rows
          src = _rel_window(r, name, b, hk * G + gi, i * g.bq, j * g.bk, g, transposed=True)
        else:  # per-q blocks, and this kv block's per-kv-position words of head gi
          src = _block(r[name], b, hk * G + gi, cols if _is_kv_vector(name) else rows)
        plgpu.copy_gmem_to_smem(src, rs[name].at[slot], bar.at[slot])

    if "visits" not in r:
      _produce(G * n, lambda t, slot: fill(lax.div(t, n), lo + lax.rem(t, n), slot), free)
      return

    def head(gi, base):  # head gi's listed q blocks, steps base, base + 1, ...
      n_partial, n_full, block_of = lists(gi)

      def one(m, c):
        _produce_step(base + m, functools.partial(fill, gi, block_of(m)), free)
        return c
      lax.fori_loop(_i32(0), n_partial + n_full, one, None)
      return base + n_partial + n_full

    lax.fori_loop(_i32(0), _i32(G), head, _i32(0))

  @pl.when(wg == 0)
  def _compute():
    _load_resident([_block(r[x], b, hk, cols) for x in resident],
                   [res[x] for x in resident], res_bars)
    k_smem, v_smem = res["k"], res["v"]
    shape = (g.bk, g.bq)
    kv_idx = j * g.bk + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=wgmma_layout)
    q_iota = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=wgmma_layout)
    per_q = lambda x: lax.broadcast_in_dim(x, shape, [1])
    vecs = {}
    if "kv_seg" in res:
      vecs["kv_seg"] = lax.broadcast_in_dim(plgpu.load(res["kv_seg"], layout=row), shape, [0])

    def scope(dk_acc, dv_acc):
      def step(t, i, masked, dkv_rows):
        slot = lax.rem(t, _i32(_STAGES))
        q_s, do_s = rs["q"].at[slot], rs["do"].at[slot]
        _wait_loaded(loaded, slot)
        sT, dpT = _mm_t2(shape, k_smem, q_s, v_smem, do_s)
        lse2 = per_q(plgpu.load(rs["lse"].at[slot], layout=col))
        delta = per_q(plgpu.load(rs["delta"].at[slot], layout=col))
        v = dict(vecs)
        for name in rs:
          if _is_q_vector(name):
            v[name] = per_q(plgpu.load(rs[name].at[slot], layout=col))
          elif _is_kv_vector(name):
            v[name] = lax.broadcast_in_dim(plgpu.load(rs[name].at[slot], layout=row), shape,
                                           [0])
        if "maskT" in rs:
          v["dense"] = _load_mask(rs["maskT"].at[slot])
        if "biasT" in rs:
          v["bias"] = plgpu.load(rs["biasT"].at[slot], layout=wgmma_layout, optimized=False)
        for name in rs:
          if _is_rel(name):
            v[name] = plgpu.load(rs[name].at[slot], layout=wgmma_layout, optimized=False)
        pT, ok, m, sm_vjp = _probs(cfg, sT, lse2, i * g.bq + q_iota, kv_idx, masked, v,
                                   pos_diff=pos_diff)
        # dV += P^T dO and dK += dS^T Q: compiled, P^T and dS^T are the register operands;
        # interpreted, they are staged in SMEM (the GPU interpreter takes no register
        # operand): the same 16-bit values either way
        p_op = (pT if m is None else pT * m).astype(p_smem.dtype)  # dropped out
        if interpreted:
          p_smem[...] = p_op
          p_op = p_smem
        dsT, dres = _dscores(pT, dpT, delta, ok, m, sm_vjp)
        # the kv-position residuals' gradients (the last n_kvd): summed over this q block
        dkv_rows = tuple(a + jnp.sum(x, axis=1)
                         for a, x in zip(dkv_rows, dres[len(dres) - n_kvd:]))
        ds_op = (dsT * jnp.float32(cfg.scale)).astype(ds_smem.dtype)
        if interpreted:
          ds_smem[...] = ds_op
          ds_op = ds_smem
        if not _mutated("skip_lse_fence"):
          # Orders this thread's generic SMEM accesses (the lse / delta / per-q vector loads,
          # the P / dS stores) before the async proxy: the wgmmas below and the producer's
          # TMA refill of this slot.
          plgpu.commit_smem()
        plgpu.wgmma(dv_acc, p_op, _cols(do_s, part, wv, parts))
        plgpu.wgmma(dk_acc, ds_op, _cols(q_s, part, wk, parts))
        plgpu.wgmma_wait(0)  # the slot's Q / dO are read: hand it back
        plgpu.barrier_arrive(free.at[slot])
        return dkv_rows

      def group(gi, base):  # head gi's q blocks, steps base, base + 1, ...
        listed = lists(gi)
        block_of = (lambda m: lo + m) if listed is None else listed[2]

        def run(start, stop, masked, carry):  # steps base + [start, stop)
          return lax.fori_loop(start, stop,
                               lambda m, c: step(base + m, block_of(m), masked, c), carry)

        zero = (plgpu.layout_cast(jnp.zeros((g.bk,), jnp.float32), row),) * n_kvd
        if listed is not None:  # the PARTIAL blocks masked, the FULL ones not
          n_partial, n_full, _ = listed
          dkv_rows = run(_i32(0), n_partial, True, zero)
          dkv_rows = run(n_partial, n_partial + n_full, False, dkv_rows)
          steps = n_partial + n_full
        else:  # causal / window / padding only (`_launch`: the rest comes with lists)
          full = spec.full_q_block_range(j, g.bq, g.bk, g.nq)
          dkv_rows = _visit(lambda a, z, m, c: run(a - lo, z - lo, m, c), lo, hi, full,
                            masked_any, zero)
          steps = n
        for buf, ref, x in zip(dkv_smem, dkv_refs, dkv_rows):  # head gi's, out by TMA
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous head's store read it
          buf[...] = x
          plgpu.commit_smem()

          @pl.when(part == 0)  # every part computes them; the first writes them
          def _store(buf=buf, ref=ref):
            plgpu.copy_smem_to_gmem(buf, ref.at[b, hk * G + gi, cols])
        return base + steps

      lax.fori_loop(_i32(0), _i32(G), group, _i32(0))
      return dk_acc[...], dv_acc[...]

    dk, dv = pl.run_scoped(scope, plgpu.ACC((g.bk, wk), jnp.float32),
                           plgpu.ACC((g.bk, wv), jnp.float32))
    if parts > 1:  # half the columns: out through the P / dS tiles, a chunk at a time
      _store_chunks(((dk, lambda c, w: dk_ref.at[b, hk, cols, pl.ds(part * wk + c, w)]),
                     (dv, lambda c, w: dv_ref.at[b, hk, cols, pl.ds(part * wv + c, w)])),
                    (p_smem, ds_smem))
      plgpu.wait_smem_to_gmem(0)
      return
    k_smem[...] = dk.astype(k_smem.dtype)
    v_smem[...] = dv.astype(v_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[b, hk, cols, :], commit_group=False)
    plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[b, hk, cols, :], commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0)


# ---- dQ ------------------------------------------------------------------------------

def _dq_kernel(*refs, cfg, g: C.Geometry, masked_any, names, ring, resident, pos_diff=(0, 0)):
  plgpu = _compat.plgpu()
  wgmma_layout, row, col = _compat.layouts()
  r = dict(zip(names, refs))
  has_bias = "bias" in r
  # per-row partial gradients: the per-(b, h) residuals' and the per-q-position ones'
  n_diff = (cfg.num_diff_consts if cfg.score_mod is not None else 0) + pos_diff[0]
  dq_ref = refs[len(names)]
  dbias_ref = refs[len(names) + 1] if has_bias else None
  dres_refs = refs[len(names) + 1 + has_bias:len(names) + 1 + has_bias + n_diff]
  (ring_smem, res_smem, tiles), loaded, free, res_bars = refs[len(names) + 1 + has_bias
                                                              + n_diff:]
  ds_smem = tiles[0]
  dres_smem = tiles[1 + has_bias:]
  interpreted = bool(_interpret(cfg))
  side_loads = bool(set(ring) - {"k", "v"})  # generic loads from the ring slots
  rs = dict(zip(ring, ring_smem))
  res = dict(zip(resident, res_smem))
  b, h, i = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("q")
  wg, part = lax.axis_index("wg"), lax.axis_index("d")
  parts = _parts(g)
  wq = g.Dp // parts  # this program's dQ columns
  rows = pl.ds(i * g.bq, g.bq)
  kv = _KvStream(cfg, g, r, b, h, i)
  block_of = kv.block_of

  @pl.when(wg == 1)
  def _producer():
    kv.produce(ring, rs, loaded, free)

  @pl.when(wg == 0)
  def _compute():
    lse2, vecs, q_idx, kv_iota = kv.load_rows(resident, res, res_bars)
    q_smem, do_smem = res["q"], res["do"]
    shape = (g.bq, g.bk)
    delta = lax.broadcast_in_dim(plgpu.load(res["delta"], layout=row), shape, [0])

    def scope(dq_acc):
      def step(n, masked, dres_rows):
        slot = lax.rem(n, _i32(_STAGES))
        j = block_of(n)  # the kv block
        k_s, v_s = rs["k"].at[slot], rs["v"].at[slot]
        _wait_loaded(loaded, slot)
        s, dp = _mm_t2(shape, q_smem, k_s, do_smem, v_s)
        v = kv.slot_inputs(rs, slot, vecs)
        p, ok, m, sm_vjp = _probs(cfg, s, lse2, q_idx, j * g.bk + kv_iota, masked, v,
                                  pos_diff=pos_diff)
        ds, dres = _dscores(p, dp, delta, ok, m, sm_vjp)  # kv-position ones last: not here
        dres_rows = tuple(a + jnp.sum(t, axis=1) for a, t in zip(dres_rows, dres))
        if has_bias:
          # dL/d(bias) of this tile: the score gradient itself, out through SMEM by TMA (its
          # previous tile's store must have read the buffer first).
          if not _mutated("skip_dbias_wait"):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          tiles[1][...] = ds
        ds16 = (ds * jnp.float32(cfg.scale)).astype(ds_smem.dtype)
        # dQ += dS K: compiled, dS is the register operand (as tokamax's dQ); interpreted,
        # it is staged in SMEM (the GPU interpreter takes no register operand): the same
        # 16-bit dS either way
        ds_op = ds16
        if interpreted:
          ds_smem[...] = ds16
          ds_op = ds_smem
        if interpreted or side_loads or has_bias:
          # The dS / d bias stores before the wgmma / TMA read them; the kv-side loads
          # (segment ids, mask, bias) before the producer's TMA refill of this slot.
          plgpu.commit_smem()
        if dbias_ref is not None:
          @pl.when(part == 0)  # every part computes it; the first writes it
          def _store_dbias():
            plgpu.copy_smem_to_gmem(tiles[1], dbias_ref.at[b, h, rows, pl.ds(j * g.bk, g.bk)])
        plgpu.wgmma(dq_acc, ds_op, _cols(k_s, part, wq, parts))
        plgpu.wgmma_wait(0)  # the slot's K / V are read: hand it back
        plgpu.barrier_arrive(free.at[slot])
        return dres_rows

      def run(start, stop, masked, carry):  # steps [start, stop)
        return lax.fori_loop(start, stop, lambda n, c: step(n, masked, c), carry)

      zero = plgpu.layout_cast(jnp.zeros((g.bq,), jnp.float32), row)
      dres_rows = kv.visit(run, masked_any, (zero,) * n_diff)
      return dq_acc[...], dres_rows

    dq, dres_rows = pl.run_scoped(scope, plgpu.ACC((g.bq, wq), jnp.float32))
    for buf, x in zip(dres_smem, dres_rows):  # per-row partial d(residual)
      buf[...] = x
    if parts > 1:  # half the columns: out through the dS tile, a chunk at a time
      _store_chunks(((dq, lambda c, w: dq_ref.at[b, h, rows, pl.ds(part * wq + c, w)]),),
                    (ds_smem,))
    else:
      q_smem[...] = dq.astype(q_smem.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[b, h, rows, :])

    @pl.when(part == 0)  # every part computes them; the first writes them
    def _store_rows():
      for buf, ref in zip(dres_smem, dres_refs):
        plgpu.copy_smem_to_gmem(buf, ref.at[b, h, rows])
    plgpu.wait_smem_to_gmem(0)


class _KvStream:
  """The kv blocks of q block i (the dQ and tangent kernels' loop): the static bounds'
  [lo, hi), or this row's visit lists when the kernel has them (`_visit_lists`)."""

  def __init__(self, cfg, g: C.Geometry, r, b, h, i):
    self.cfg, self.g, self.r, self.b, self.h, self.i = cfg, g, r, b, h, i
    lo, hi = C.mask_spec(cfg).kv_block_range(i, g.bq, g.bk, g.nk)
    self.lo, self.hi = jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)
    self.listed = _visit_row(r, b, h, i)
    if self.listed is None:
      self.steps = self.hi - self.lo
    else:
      self.steps = self.listed[0] + self.listed[1]

  def block_of(self, n):
    """Step n's kv block."""
    return self.lo + n if self.listed is None else self.listed[2](n)

  def produce(self, ring, rs, loaded, free):
    """The producer warpgroup: each step's kv-side tiles (the `ring` names) into its slot;
    pair tiles ([B|1, H|1, Sqp, Skvp]: mask, bias, its tangent) at (q block, kv block)."""
    plgpu = _compat.plgpu()
    g, r, b, h = self.g, self.r, self.b, self.h
    hk = lax.div(h, _i32(g.G))
    rows = pl.ds(self.i * g.bq, g.bq)

    def fill(t, slot):
      cols = pl.ds(self.block_of(t) * g.bk, g.bk)
      for name, bar in zip(ring, loaded):
        if name in _PAIRS + ("tbias",):
          src = _pair_tile(r[name], b, h, rows, cols)
        elif _is_rel(name):
          src = _rel_window(r, name, b, h, self.i * g.bq, self.block_of(t) * g.bk, g,
                            transposed=False)
        else:
          src = _block(r[name], b, h if _is_kv_vector(name) else hk, cols)
        plgpu.copy_gmem_to_smem(src, rs[name].at[slot], bar.at[slot])

    _produce(self.steps, fill, free)

  def load_rows(self, resident, res, res_bars):
    """The compute warpgroup's start: the q block's resident tiles in (TMA), then (lse2, the
    per-q vectors, the q indices, the kv iota), each a [bq, bk] tile."""
    plgpu = _compat.plgpu()
    wgmma_layout, row, _ = _compat.layouts()
    g, r, b, h, i = self.g, self.r, self.b, self.h, self.i
    rows = pl.ds(i * g.bq, g.bq)
    _load_resident([_block(r[x], b, h, rows) for x in resident],
                   [res[x] for x in resident], res_bars)
    shape = (g.bq, g.bk)
    per_q = lambda x: lax.broadcast_in_dim(plgpu.load(x, layout=row), shape, [0])
    vecs = {name: per_q(res[name]) for name in res if _is_q_vector(name)}
    q_idx = i * g.bq + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=wgmma_layout)
    kv_iota = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=wgmma_layout)
    return per_q(res["lse"]), vecs, q_idx, kv_iota

  def slot_inputs(self, rs, slot, vecs):
    """`_slot_inputs` at this loop's [bq, bk] tiles."""
    return _slot_inputs(rs, slot, vecs, (self.g.bq, self.g.bk))

  def visit(self, run, masked_any, carry):
    """`run(start, stop, masked, carry)` over the steps: with lists, the PARTIAL blocks
    masked then the FULL ones not; else (causal / window / padding only: `_launch`)
    masked / unmasked / masked by the static bounds."""
    if self.listed is not None:
      carry = run(_i32(0), self.listed[0], True, carry)
      return run(self.listed[0], self.steps, False, carry)
    g, lo = self.g, self.lo
    full = C.mask_spec(self.cfg).full_kv_block_range(self.i, g.bq, g.bk)
    return _visit(lambda a, z, m, c: run(a - lo, z - lo, m, c), lo, self.hi, full, masked_any,
                  carry)




def _launch(kind, cfg, g: C.Geometry, arrays, masked_any, visits=None, *, body=None,
            out_type=None, pos_diff=(0, 0)):
  """Build and run one kernel ("dkdv", "dq", or "tangent" with its `body` and `out_type`) on
  the named operand `arrays` (and its visit lists, `_visit_lists`, read from GMEM).
  `pos_diff`: how many leading per-q- / per-kv-position residuals take gradients (the dQ
  kernel returns the q ones per row, the dK/dV kernel the kv ones per column)."""
  plgpu = _compat.plgpu()
  # segment ids, a dense mask and a mask_mod always come with visit lists (`_visit_lists`):
  # the static-bounds loops take FULL blocks from causal / window / padding alone
  assert visits is not None or not ({"q_seg", "mask"} & set(arrays) or cfg.mask_mod is not None)
  arrays = _kernel_arrays(kind, arrays)
  if visits is not None:
    arrays["visits"] = visits
  # rel rows [B, H, Sqp + Skvp] -> the skewed arrays whose windows are this kernel's tiles
  Sqp, Skvp = arrays["q"].shape[2], arrays["k"].shape[2]
  arrays = {n: _rel.skewed(x, Sqp, Skvp, g.bk if kind == "dkdv" else g.bq, kind == "dkdv")
            if _is_rel(n) else x for n, x in arrays.items()}
  ring, resident = _operands(kind, {n.rstrip("T"): x for n, x in arrays.items()})
  names = list(arrays)
  dt = arrays["q"].dtype
  n_diff = (cfg.num_diff_consts if cfg.score_mod is not None else 0) + pos_diff[0]
  params = {}
  # the last grid axis ("d"): the programs sharing one block's output columns (`_parts`)
  if kind == "tangent":
    grid, grid_names = (g.B, g.H, g.nq, _parts(g)), ("b", "h", "q", "d")
  elif kind == "dkdv":
    body, grid, grid_names = _dkdv_kernel, (g.B, g.Hkv, g.nk, _parts(g)), ("b", "h", "kv", "d")
    out_type = (jax.ShapeDtypeStruct((g.B, g.Hkv, g.Skvp, g.Dp), dt),
                jax.ShapeDtypeStruct((g.B, g.Hkv, g.Skvp, g.Dvp), dt),
                *[jax.ShapeDtypeStruct((g.B, g.H, g.Skvp), jnp.float32)] * pos_diff[1])
    params["pos_diff"] = pos_diff
  else:
    body, grid, grid_names = _dq_kernel, (g.B, g.H, g.nq, _parts(g)), ("b", "h", "q", "d")
    params["pos_diff"] = pos_diff
    out_type = jax.ShapeDtypeStruct((g.B, g.H, g.Sqp, g.Dp), dt)
    outs = [out_type]
    if "bias" in arrays:  # dL/d(score) of every visited tile, [B, H, Sqp, Skvp] float32
      outs.append(jax.ShapeDtypeStruct((g.B, g.H, g.Sqp, g.Skvp), jnp.float32))
    # per-row partial d(residual) of each differentiable score_mod residual (per (b, h),
    # then per q position), [B, H, Sqp]
    outs += [jax.ShapeDtypeStruct((g.B, g.H, g.Sqp), jnp.float32)] * n_diff
    out_type = tuple(outs) if len(outs) > 1 else out_type
  kernel = plgpu.kernel(
      functools.partial(body, cfg=cfg, g=g, masked_any=masked_any, names=names, ring=ring,
                        resident=resident, **params),
      out_type=out_type,
      scratch_types=_scratch(kind, arrays, ring, resident, g, n_diff, pos_diff[1]),
      grid=grid, grid_names=grid_names,
      kernel_name="flashvjp_tangent" if kind == "tangent" else f"flashvjp_bwd_{kind}",
      num_threads=_WARPGROUPS, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=_interpret(cfg))
  return kernel(*arrays.values())


# ---- entry point -----------------------------------------------------------------------



def _reduce_dbias(cfg, ds, bias, g: C.Geometry, visits=None):
  """dbias in bias' shape and dtype from the dQ kernel's per-tile score gradients.

  ds [B, H, Sqp, Skvp] float32 holds every visited tile; the blocks the kernel skipped
  (outside the static bounds, or EMPTY in its visit lists `visits`) were never written, so
  they are selected to 0 first (masked entries are 0 anyway), then the bias' broadcast
  dims are summed.
  """
  Sq, Skv = cfg.seq_q, cfg.seq_kv
  if visits is not None:  # [B', H', nq, nk]: listed in row i
    n = visits[..., 0] + visits[..., 1]
    col = jnp.arange(g.nk, dtype=jnp.int32)
    listed = (visits[..., 2:, None] == col[None, None, None, None, :]) & (
        col[None, None, None, :, None] < n[..., None, None])
    tile = jnp.any(listed, axis=-2)
    tile = jnp.repeat(jnp.repeat(tile, g.bq, axis=2), g.bk, axis=3)
    ds = jnp.where(tile, ds, jnp.float32(0.0))
  ds = ds[:, :, :Sq, :Skv]
  ds = jnp.where(C.mask_spec(cfg).dense(), ds, jnp.float32(0.0))
  axes = tuple(a for a in range(4) if bias.shape[a] == 1 and ds.shape[a] != 1)
  if axes:
    ds = jnp.sum(ds, axis=axes, keepdims=True)
  return ds.astype(bias.dtype)


def _dconsts(split, dres_rows, dkv_cols, drel, user_consts, n_user_diff, Sq,
             where: C.Positions):
  """Grads of the differentiable score_mod consts from the dQ kernel's per-row partial
  d(residual) [B, H, Sqp] (per-(b, h) residuals: summed over the real rows; then per-q-
  position ones, as they are), the dK/dV kernel's d(per-kv-position residual) [B, H,
  Skvp] and d(rel residual) rows (`where`'s layout), mapped by `split.to_consts` (position
  ones padded to the family's layout `where`), in the consts' dtypes; zeros where the
  scores do not depend on them."""
  user = user_consts[:n_user_diff]
  if not n_user_diff:
    return ()
  if split is None or split.to_consts is None:
    return tuple(jnp.zeros(jnp.shape(c), jnp.result_type(c)) for c in user)
  dres = tuple(d[:, :, :Sq].sum(axis=2) for d in dres_rows[:split.n_diff])  # [B, H]
  pad = lambda x, n: jnp.pad(x, ((0, 0), (0, 0), (0, n - x.shape[2])))
  dq_pos = tuple(pad(d, where.Sqp) for d in dres_rows[split.n_diff:])
  dkv_pos = tuple(pad(d, where.Skvp) for d in dkv_cols)
  grads = split.to_consts(dres, dq_pos, dkv_pos, tuple(drel))
  return tuple(d.astype(jnp.result_type(c)) for d, c in zip(grads, user))


def check_supported(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, seed, consts, mod=None,
                    offsets=None, role: str = "backward"):
  """Raise NotImplementedError / ValueError naming the first feature this backward (or the
  tangent kernel: `role`) lacks."""
  why = _compat.unavailable()
  if why is not None:
    raise NotImplementedError(why)
  del bias, mask, q_seg, consts, mod  # all supported (array residuals refused in backward)
  C.offset_operand(offsets)  # ValueError unless None or (b0, h0, q0, kv0)
  if cfg.dropout_active and seed is None:
    raise ValueError("dropout needs its seed (uint32 [2]): got seed=None")
  if jnp.dtype(q.dtype) not in _DTYPES or not (q.dtype == k.dtype == v.dtype):
    raise ValueError(f"the pallas_mosaic_gpu {role} takes bfloat16 or float16 q, k, v of one"
                     f" dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  if max(q.shape[3], v.shape[3]) > _MAX_HEAD_DIM:
    raise ValueError(f"the pallas_mosaic_gpu {role} supports head dims <= {_MAX_HEAD_DIM},"
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
    mod: None, or the mask_mod's `ModInputs` (its consts; its block classes make the lists).
    offsets: None, or the global (b0, h0, q0, kv0) of local element 0 (a ring chunk pair):
      only dropout reads global positions here (the static mask stays local).

  Returns:
    (dq [B, H, Sq, D], dk [B, Hkv, Skv, D], dv [B, Hkv, Skv, Dv] in the input dtype,
     dbias in bias' own shape and dtype (or None), the grads of the cfg.num_diff_consts
     differentiable score_mod consts).
  """
  check_supported(cfg, q, k, v, bias, mask, q_seg, seed, consts, mod, offsets)
  user_consts, n_user_diff = tuple(consts), cfg.num_diff_consts
  ins = _inputs(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, mod, offsets,
                role="backward", grads=True)
  cfg, g, arrays = ins.cfg, ins.g, ins.arrays
  Sq, Skv, D, Dv = g.Sq, g.Skv, g.D, g.Dv
  arrays["do"] = C.pad_seq_head(dout.astype(q.dtype), g.Sqp, g.Dvp)
  arrays["lse"], arrays["delta"] = _preprocess(out, lse, dout, dlse, g)
  if bias is not None:  # float32 tiles (the dQ kernel writes dS in float32 next to them)
    arrays["bias"] = arrays["bias"].astype(jnp.float32)
    arrays["biasT"] = jnp.swapaxes(arrays["bias"], 2, 3)
  g_dkdv = dataclasses.replace(g, bq=_dkdv_block_q(g, cfg, arrays))
  dk, dv, *dkv_cols = _launch("dkdv", cfg, g_dkdv, arrays, ins.masked_any,
                              _visit_lists(cfg, g_dkdv, q_seg, kv_seg, mask, mod, "kv"),
                              pos_diff=ins.pos_diff)
  n_dq_diff = (cfg.num_diff_consts if cfg.score_mod is not None else 0) + ins.pos_diff[0]
  g_dq = dataclasses.replace(g, bk=_stream_block(g, cfg, arrays, n_dq_diff))
  dq_visits = _visit_lists(cfg, g_dq, q_seg, kv_seg, mask, mod, "q")
  outs = _launch("dq", cfg, g_dq, arrays, ins.masked_any, dq_visits, pos_diff=ins.pos_diff)
  outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
  dq = outs.pop(0)
  dbias = None
  if bias is not None:
    dbias = _reduce_dbias(cfg, outs.pop(0), bias, g_dq, dq_visits)
  dq = dq[:, :, :Sq, :D]
  dk = dk[:, :, :Skv, :D]
  dv = dv[:, :, :Skv, :Dv]
  drel: tuple = ()
  pos = getattr(ins.split, "pos", None)
  if pos is not None and pos.n_rel_diff:
    # d(rows read by kv_idx - q_idx): sums along the diagonals of every tile, by one more
    # kernel over the block diagonals
    drel = _drel.rel_grads(cfg, g, arrays, pos, q_seg, kv_seg, mask, mod)
  return dq, dk, dv, dbias, _dconsts(ins.split, outs, dkv_cols, drel, user_consts, n_user_diff,
                                     Sq, F.positions(cfg))


@dataclasses.dataclass
class Inputs:
  """What both backward kernels and the tangent kernel read, made once (`_inputs`)."""

  cfg: AttentionConfig  # with the mods' tile parts (`F.split_mods`)
  g: C.Geometry
  arrays: dict  # named padded operands (see `_inputs`)
  masked_any: bool
  split: object  # the score_mod's `C.HeadSplit`, or None
  sm_arrays: tuple  # its per-(b, h) scalar residuals [B, H, 1] (float32 / int32)
  pos_diff: tuple = (0, 0)  # its per-q- / per-kv-position residuals with gradients


def _inputs(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, mod,
            offsets, *, role: str, grads: bool) -> Inputs:
  """The operands every kernel of this module shares, padded to whole 64-blocks: q, k, v;
  segment ids; dropout's per-row words; the global kv offset, the score_mod's global q
  and per-(b, h) residuals ("res<n>"), the mask_mod's ("qm", "mres<n>"), one word per row;
  per-position residuals ("qres<n>" [B, H, Sqp] per row, "kvres<n>" [B, H, Skvp]; the
  mask_mod's "mqres<n>", "mkvres<n>"); the dense mask (int8) and bias (its own dtype) as
  [B|1, H|1, Sqp, Skvp] tiles, with transposed copies for the dK/dV kernel ("maskT",
  "biasT")."""
  if cfg.interpret:
    threads = _compat.interpret_threads_problem(_WARPGROUPS, role)
    if threads is not None:
      raise RuntimeError(f"pallas_mosaic_gpu {role} (interpret): {threads}")
  off = C.offset_operand(offsets)
  mods = F.split_mods(cfg, consts, mod, q.shape[0], q.shape[1], offsets, grads=grads,
                      role=role)
  cfg, sm_arrays, mm_arrays, split = mods.cfg, mods.sm_arrays, mods.mm_arrays, mods.split
  f32 = jnp.float32
  word = lambda r: r.astype(f32 if jnp.issubdtype(r.dtype, jnp.inexact) else jnp.int32)
  sm_arrays = tuple(word(r) for r in sm_arrays)
  B, H, Sq, D = q.shape
  Hkv, Skv, Dv = k.shape[1], k.shape[2], v.shape[3]
  parts = _head_parts(D, Dv)
  g = C.Geometry(B=B, H=H, Hkv=Hkv, Sq=Sq, Skv=Skv, D=D, Dv=Dv, bq=_BLOCK, bk=_BLOCK,
                 Dp=_pad_head(D, parts), Dvp=_pad_head(Dv, parts))
  segs = None
  if q_seg is not None:  # padding repeats the edge id (padded positions are masked anyway)
    segs = (_mask.pad_axis(q_seg, 1, g.Sqp, "edge", keep_broadcast=False).astype(jnp.int32),
            _mask.pad_axis(kv_seg, 1, g.Skvp, "edge", keep_broadcast=False).astype(jnp.int32))
  masked_any = (cfg.causal or cfg.window is not None or segs is not None or mask is not None
                or cfg.mask_mod is not None or g.Sqp != Sq or g.Skvp != Skv)
  if bias is not None and not jnp.issubdtype(bias.dtype, jnp.floating):
    raise ValueError(f"bias must be a float array, got {bias.dtype}")
  arrays = {"q": C.pad_seq_head(q, g.Sqp, g.Dp), "k": C.pad_seq_head(k, g.Skvp, g.Dp),
            "v": C.pad_seq_head(v, g.Skvp, g.Dvp)}
  if segs is not None:
    arrays["q_seg"], arrays["kv_seg"] = segs
  if cfg.dropout_active:
    arrays["cq"], arrays["cq2"] = _dropout_rows(cfg, seed, g, off)
  rows = (g.B, g.H, g.Sqp)
  if ((off is not None and cfg.dropout_active) or cfg.score_mod is not None
      or cfg.mask_mod is not None):
    # the global kv offset (dropout's hash and the score_mod read global positions)
    kv0 = 0 if off is None else off[3]
    arrays["kv0"] = jnp.broadcast_to(jnp.asarray(kv0, jnp.int32), rows)
  q0 = 0 if off is None else off[2]
  if cfg.score_mod is not None:
    # The score_mod's global q and its per-(b, h) residuals (global (b, h) folded in by
    # `C.split_per_head`), one word per row each.
    arrays["qg"] = jnp.broadcast_to(jnp.arange(g.Sqp, dtype=jnp.int32) + q0, rows)
    for n, r in enumerate(sm_arrays):
      arrays[f"res{n}"] = jnp.broadcast_to(r, rows)
  if cfg.mask_mod is not None:
    # The mask_mod's global q (clamped into the real rows first) and its residuals.
    qm = jnp.minimum(jnp.arange(g.Sqp, dtype=jnp.int32), Sq - 1) + q0
    arrays["qm"] = jnp.broadcast_to(qm, rows)
    for n, r in enumerate(mm_arrays):
      arrays[f"mres{n}"] = jnp.broadcast_to(word(r), rows)
  for prefix, pos in (("", mods.sm_pos), ("m", mods.mm_pos)):  # per-position residuals
    if pos is not None:
      for n, r in enumerate(pos.q):
        arrays[f"{prefix}qres{n}"] = word(r[..., :g.Sqp])
      for n, r in enumerate(pos.kv):
        arrays[f"{prefix}kvres{n}"] = word(r[..., :g.Skvp])
      for n in range(len(pos.rel)):
        arrays[f"{prefix}relres{n}"] = _rel.rows(pos, n, g.B, g.H, g.Sqp, g.Skvp)
  if mask is not None:
    # int8, padded with False; broadcast seq dims materialised (the kernels read whole
    # tiles), broadcast batch / head dims kept (indexed with 0). The dK/dV kernel reads it
    # transposed (one more int8 copy, made by XLA).
    m = jnp.broadcast_to(mask, mask.shape[:2] + (Sq, Skv)).astype(jnp.int8)
    m = jnp.pad(m, ((0, 0), (0, 0), (0, g.Sqp - Sq), (0, g.Skvp - Skv)))
    arrays["mask"], arrays["maskT"] = m, jnp.swapaxes(m, 2, 3)
  if bias is not None:
    arrays["bias"] = _pad_pair_tiles(bias, g)
  pos = mods.sm_pos
  pos_diff = (0, 0) if pos is None or not grads else (pos.n_q_diff, pos.n_kv_diff)
  return Inputs(cfg, g, arrays, masked_any, split, sm_arrays, pos_diff)


def _pad_pair_tiles(x, g: C.Geometry):
  """A [B|1, H|1, Sq|1, Skv|1] bias (or its tangent) as [B|1, H|1, Sqp, Skvp] tiles: seq dims
  materialised, padded with 0 (padded positions are masked)."""
  x = jnp.broadcast_to(x, x.shape[:2] + (g.Sq, g.Skv))
  return jnp.pad(x, ((0, 0), (0, 0), (0, g.Sqp - g.Sq), (0, g.Skvp - g.Skv)))
