"""The one mask model: causal, window, segment ids, dense mask, mask_mod, padding.

Room: mask model. Every implementation (naive, blockwise, pallas, ring) asks
this module which (q, kv) positions may attend, and which blocks can be skipped.

Alignment (top-left, as jax.nn and PyTorch)::

    causal, seq_q=4, seq_kv=6        window=(1, 1)
        kv 0 1 2 3 4 5                 kv 0 1 2 3 4 5
    q 0    x . . . . .             q 0    x x . . . .
    q 1    x x . . . .             q 1    x x x . . .
    q 2    x x x . . .             q 2    . x x x . .
    q 3    x x x x . .             q 3    . . x x x .

A position is allowed when every given condition allows it:
  causal:      kv_pos <= q_pos
  window:      q_pos - left <= kv_pos <= q_pos + right (a None side is unbounded)
  segment_ids: q_segment_ids[b, q_pos] == kv_segment_ids[b, kv_pos]
  mask:        mask[b, h, q_pos, kv_pos] (broadcast)
  mask_mod:    mask_mod(b, h, q_pos, kv_pos) (flashvjp._mask_mod: scalar form, block classes)
  padding:     q_pos < seq_q and kv_pos < seq_kv (internal padding never attends)

Static work stays static: the block-bound methods of `MaskSpec` compute in numpy (Python
ints out) when their inputs are static, and emit jnp ops only for traced ones (a kernel's
program id, an iota in the graph); `static_block_ranges` caches the per-row ranges per
static configuration. Tracing flash_attention runs no jax op (tests/test_compile.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_NO_CONSTANTS = threading.local()


@contextlib.contextmanager
def no_static_constants():
  """While tracing a body that may close over no array constants (a `custom_partitioning`
  op's global body: jax asserts `not closed_call.consts`), the static block lists are built
  from iotas instead of numpy (`static_constants_allowed`). The per-shard bodies the
  partitioner lowers are traced outside it, and get numpy constants."""
  depth = getattr(_NO_CONSTANTS, "depth", 0)
  _NO_CONSTANTS.depth = depth + 1
  try:
    yield
  finally:
    _NO_CONSTANTS.depth = depth


def static_constants_allowed() -> bool:
  return getattr(_NO_CONSTANTS, "depth", 0) == 0


def is_static(*xs) -> bool:
  """True when no x is a jax value (Python / numpy numbers and numpy arrays only).

  The block-bound methods below take either: on static inputs they compute in numpy and
  return Python ints (numpy int32 arrays for array inputs), so work known before tracing
  never dispatches a jax op (no device op, no XLA compile while tracing); on traced
  inputs (a kernel's program id, an iota inside the traced graph) they emit jnp ops.
  """
  return not any(isinstance(x, (jax.Array, jax.core.Tracer)) for x in xs)


def _xp(*xs):
  return np if is_static(*xs) else jnp


def _static_out(*xs):
  """numpy results -> Python ints (scalars) or int32 arrays."""
  out = tuple(int(x) if np.ndim(x) == 0 else np.asarray(x, np.int32) for x in xs)
  return out if len(out) != 1 else out[0]


def _block_span(lo, hi, block: int, num_blocks: int):
  """The blocks [lo_b, hi_b) holding positions [lo, hi) (empty when lo >= hi)."""
  if is_static(lo, hi):
    lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
    hi_b = np.clip((hi + block - 1) // block, 0, num_blocks)
    hi_b = np.where(lo >= hi, 0, hi_b)
    return _static_out(np.minimum(lo // block, hi_b), hi_b)
  lo, hi = jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)
  hi_b = jnp.clip((hi + block - 1) // block, 0, num_blocks)
  hi_b = jnp.where(lo >= hi, 0, hi_b)
  return jnp.minimum(lo // block, hi_b), hi_b


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """The static part of the mask model."""

  causal: bool = False
  window: tuple[int | None, int | None] | None = None
  seq_q: int = 0
  seq_kv: int = 0

  @property
  def left(self) -> int | None:
    return None if self.window is None else self.window[0]

  @property
  def right(self) -> int | None:
    if self.causal:
      r = 0 if self.window is None or self.window[1] is None else min(0, self.window[1])
      return r
    return None if self.window is None else self.window[1]

  # ---- element predicate -------------------------------------------------
  def allowed(self, q_idx, kv_idx, *, q_seg=None, kv_seg=None, dense=None):
    """Bool array: may q_idx attend kv_idx? Arguments broadcast against each other.

    q_idx, kv_idx: global int positions. q_seg / kv_seg: segment ids at those
    positions (already broadcast-shaped). dense: the dense mask block.
    """
    ok = (q_idx < self.seq_q) & (kv_idx < self.seq_kv)
    if self.right is not None:
      ok = ok & (kv_idx <= q_idx + self.right)
    if self.left is not None:
      ok = ok & (kv_idx >= q_idx - self.left)
    if q_seg is not None:
      ok = ok & (q_seg == kv_seg)
    if dense is not None:
      ok = ok & dense
    return ok

  # ---- static block bounds ---------------------------------------------
  def kv_range(self, q_start, q_end):
    """[lo, hi) of kv positions any query in [q_start, q_end) may attend (ints or traced)."""
    xp = _xp(q_start, q_end)
    lo = 0
    hi = self.seq_kv
    if self.right is not None:
      hi = xp.minimum(hi, xp.maximum(q_end - 1 + self.right + 1, 0))
    if self.left is not None:
      lo = xp.maximum(0, q_start - self.left)
    return _static_out(lo, hi) if xp is np else (lo, hi)

  def q_range(self, kv_start, kv_end):
    """[lo, hi) of q positions that may attend some kv in [kv_start, kv_end)."""
    xp = _xp(kv_start, kv_end)
    lo = 0
    hi = self.seq_q
    if self.right is not None:  # kv <= q + right  ->  q >= kv - right
      lo = xp.maximum(0, kv_start - self.right)
    if self.left is not None:  # kv >= q - left  ->  q <= kv + left
      hi = xp.minimum(hi, xp.maximum(kv_end - 1 + self.left + 1, 0))
    return _static_out(lo, hi) if xp is np else (lo, hi)

  def kv_block_range(self, q_block, block_q, block_kv, num_kv_blocks):
    """[lo, hi) of kv block indices that q block `q_block` must visit."""
    # Padding rows past seq_q attend nothing: the block's real rows decide its range.
    xp = _xp(q_block)
    lo, hi = self.kv_range(q_block * block_q, xp.minimum((q_block + 1) * block_q, self.seq_q))
    return _block_span(lo, hi, block_kv, num_kv_blocks)

  def q_block_range(self, kv_block, block_q, block_kv, num_q_blocks):
    """[lo, hi) of q block indices that visit kv block `kv_block`."""
    xp = _xp(kv_block)
    lo, hi = self.q_range(kv_block * block_kv,
                          xp.minimum((kv_block + 1) * block_kv, self.seq_kv))
    return _block_span(lo, hi, block_q, num_q_blocks)

  # ---- block classification: blocks that need no elementwise mask -----------
  # Causal, window and kv padding remove a contiguous band of block pairs; blocks
  # strictly inside the allowed band need no elementwise mask (FlashAttention's
  # "diagonal blocks only"). Segment ids and dense masks are elementwise everywhere.
  # Query padding is not considered: padded rows are sliced off in the forward and
  # have lse = +inf (so p = 0) in the backward.

  def full_kv_block_range(self, q_block, block_q, block_kv):
    """[lo, hi) of kv blocks whose every pair with q block `q_block` is allowed."""
    xp = _xp(q_block)
    lim = xp.asarray(self.seq_kv, xp.int32)  # kv positions < lim are real (not padding)
    if self.right is not None:  # kv <= q + right for the block's first q
      lim = xp.minimum(lim, q_block * block_q + self.right + 1)
    hi = xp.maximum(lim, 0) // block_kv
    lo = xp.asarray(0, xp.int32)
    if self.left is not None:  # kv >= q - left for the block's last q
      lo = _cdiv_nonneg((q_block + 1) * block_q - 1 - self.left, block_kv)
    return _static_out(lo, hi) if xp is np else (lo, hi)

  def full_q_block_range(self, kv_block, block_q, block_kv, num_q_blocks):
    """[lo, hi) of q blocks all of whose pairs with kv block `kv_block` are allowed."""
    xp = _xp(kv_block)
    hi = xp.asarray(num_q_blocks, xp.int32)
    lo = xp.asarray(0, xp.int32)
    if self.right is not None:  # last kv <= first q + right
      lo = _cdiv_nonneg((kv_block + 1) * block_kv - 1 - self.right, block_q)
    if self.left is not None:  # first kv >= last q - left
      hi = xp.maximum(kv_block * block_kv + self.left + 1, 0) // block_q
    # A kv block reaching into the padding needs the mask for every q block.
    hi = xp.where((kv_block + 1) * block_kv > self.seq_kv, lo, hi)
    return _static_out(lo, hi) if xp is np else (lo, hi)

  def static_block_ranges(self, by: str, block_q: int, block_kv: int, num_q_blocks: int,
                          num_kv_blocks: int):
    """Per row, the (lo, hi) column block range as Python ints (cached; no jax op).

    by="q": per q block, `kv_block_range`; by="kv": per kv block, `q_block_range`.
    """
    return static_block_ranges(self, by, block_q, block_kv, num_q_blocks, num_kv_blocks)

  def visited_fraction(self, block_q, block_kv) -> float:
    """Fraction of (q block, kv block) pairs inside the static bounds (for FLOP counts)."""
    nq = -(-self.seq_q // block_q)
    nk = -(-self.seq_kv // block_kv)
    ranges = static_block_ranges(self, "q", block_q, block_kv, nq, nk)
    total = sum(max(hi - lo, 0) for lo, hi in ranges)
    return total / max(nq * nk, 1)

  def dense(self, q_seg=None, kv_seg=None, mask=None):
    """The full allowed array, broadcast to rank 4 (reference and tests only)."""
    q_idx = jnp.arange(self.seq_q, dtype=jnp.int32)[None, None, :, None]
    kv_idx = jnp.arange(self.seq_kv, dtype=jnp.int32)[None, None, None, :]
    qs = None if q_seg is None else q_seg[:, None, :, None]
    ks = None if kv_seg is None else kv_seg[:, None, None, :]
    return self.allowed(q_idx, kv_idx, q_seg=qs, kv_seg=ks, dense=mask)


def block_any_table(q_seg, kv_seg, mask, block_q, block_kv, num_q_blocks, num_kv_blocks,
                    mod_classes=None):
  """Per block pair: may any position in it attend? Padded inputs; None where undecidable.

  Returns a bool array [B', H', nq, nk] (B', H' are 1 or full) that is False only
  where the segment ids, the dense mask or the mask_mod's classes (`mod_classes`, int8
  [B', H', nq, nk] at these blocks, see `resample_classes`) leave the whole block empty,
  or None when none is given. Segment ids decide by range overlap (conservative).
  """
  table = None if mod_classes is None else (mod_classes != EMPTY)
  if q_seg is not None:
    B = q_seg.shape[0]
    qb = q_seg.reshape(B, num_q_blocks, block_q)
    kb = kv_seg.reshape(B, num_kv_blocks, block_kv)
    qmin, qmax = qb.min(-1), qb.max(-1)
    kmin, kmax = kb.min(-1), kb.max(-1)
    seg = (qmin[:, :, None] <= kmax[:, None, :]) & (kmin[:, None, :] <= qmax[:, :, None])
    table = seg[:, None]  # [B, 1, nq, nk]
  if mask is not None:
    Bm, Hm, Sq, Sk = mask.shape
    nq = num_q_blocks if Sq != 1 else 1
    nk = num_kv_blocks if Sk != 1 else 1
    bq = block_q if Sq != 1 else 1
    bk = block_kv if Sk != 1 else 1
    m = mask.reshape(Bm, Hm, nq, bq, nk, bk).any(axis=(3, 5))
    m = jnp.broadcast_to(m, (Bm, Hm, num_q_blocks, num_kv_blocks))
    table = m if table is None else (table & m)
  return table


def resample_classes(classes, src_block_q: int, src_block_kv: int, block_q: int, block_kv: int,
                     seq_q: int, seq_kv: int, num_q_blocks: int, num_kv_blocks: int):
  """Block classes at (src_block_q, src_block_kv) -> at (block_q, block_kv).

  A new block is EMPTY when every source block it overlaps (over real positions,
  q < seq_q, kv < seq_kv) is EMPTY, FULL when every one is FULL, else PARTIAL: exact when
  one block size is a multiple of the other, conservative (PARTIAL, so masked) otherwise.
  Blocks made only of padding are EMPTY. Memory O(source table), via 2-D prefix sums.
  """
  if (src_block_q, src_block_kv) == (block_q, block_kv) and tuple(classes.shape[2:]) == (
      num_q_blocks, num_kv_blocks):
    return classes

  def bounds(n, block, src_block, seq):
    start = jnp.arange(n, dtype=jnp.int32) * block
    stop = jnp.minimum(start + block, seq)  # real positions only
    return start // src_block, jnp.maximum(stop - 1, start) // src_block + 1, stop > start

  q_lo, q_hi, q_real = bounds(num_q_blocks, block_q, src_block_q, seq_q)
  k_lo, k_hi, k_real = bounds(num_kv_blocks, block_kv, src_block_kv, seq_kv)
  n_src_q, n_src_k = classes.shape[2], classes.shape[3]
  q_lo, q_hi = jnp.minimum(q_lo, n_src_q), jnp.minimum(q_hi, n_src_q)
  k_lo, k_hi = jnp.minimum(k_lo, n_src_k), jnp.minimum(k_hi, n_src_k)

  def rect_count(x):  # x [B', H', NQ, NK] bool -> count over each new block's rectangle
    c = jnp.cumsum(jnp.cumsum(x.astype(jnp.int32), axis=2), axis=3)
    c = jnp.pad(c, ((0, 0), (0, 0), (1, 0), (1, 0)))
    at = lambda qi, ki: c[:, :, qi[:, None], ki[None, :]]
    return at(q_hi, k_hi) - at(q_lo, k_hi) - at(q_hi, k_lo) + at(q_lo, k_lo)

  area = ((q_hi - q_lo)[:, None] * (k_hi - k_lo)[None, :])[None, None]
  n_empty, n_full = rect_count(classes == EMPTY), rect_count(classes == FULL)
  real = (q_real[:, None] & k_real[None, :])[None, None]
  out = jnp.where(n_full == area, FULL, jnp.where(n_empty == area, EMPTY, PARTIAL))
  return jnp.where(real, out, EMPTY).astype(jnp.int8)


# ---- block classification and compacted block lists ------------------------------
# Each (q block, kv block) pair is EMPTY (no position may attend: skipped, no copy, no
# matmul), PARTIAL (some may: the elementwise mask is applied) or FULL (every position
# may: no mask). Kernels loop over compacted per-row lists of the non-empty blocks
# (splash attention's data_next, FlexAttention's kv_num_blocks + kv_indices), so an
# empty block costs nothing and the loop has no branch around its loads.

EMPTY, PARTIAL, FULL = 0, 1, 2


class BlockLists(NamedTuple):
  """Compacted per-row block lists, int32. Rows are q blocks (by="q") or kv blocks (by="kv").

  For row r of leading index (b', h') (B', H' are 1 where nothing varies along
  batch / heads): ``partial[b', h', r, :num_partial[b', h', r]]`` are the column
  blocks that need the elementwise mask, in increasing order, and ``full[...,
  :num_full]`` those that need none. Entries past the count repeat the last valid
  index (0 for an empty list), so an idle pipelined step re-fetches the same block.
  """

  num_partial: jax.Array  # [B', H', n_rows]
  partial: jax.Array  # [B', H', n_rows, n_cols]
  num_full: jax.Array  # [B', H', n_rows]
  full: jax.Array  # [B', H', n_rows, n_cols]


def block_classes(spec: MaskSpec, q_seg, kv_seg, mask, block_q, block_kv, num_q_blocks,
                  num_kv_blocks, mod_classes=None):
  """int8 [B', H', nq, nk]: EMPTY / PARTIAL / FULL per (q block, kv block).

  Inputs are padded to whole blocks: q_seg [B, nq*bq] and kv_seg [B, nk*bk] int
  (or None; padding repeats the edge id), mask bool rank 4 with dims 1 or full
  (or None; padding False). Causal, window and sequence padding come from `spec`
  (exact); segment ids decide by id-range overlap (exact for sorted ids, as packed
  documents are; conservative otherwise: a block may be visited and masked); the
  dense mask by any / all over the block; a mask_mod by its classes (`mod_classes`,
  int8 [B', H', nq, nk] at these blocks: `resample_classes`). Query padding does not make
  a block partial (padded rows are sliced off in the forward and get p = 0 backward).
  """
  nq, nk = num_q_blocks, num_kv_blocks
  if static_constants_allowed():  # the static part: numpy constants (no device op)
    static = static_block_classes(spec, block_q, block_kv, nq, nk)
    some, every = static != EMPTY, static == FULL
  else:
    i = jnp.arange(nq, dtype=jnp.int32)[:, None]
    j = jnp.arange(nk, dtype=jnp.int32)[None, :]
    lo, hi = spec.kv_block_range(i, block_q, block_kv, nk)
    f_lo, f_hi = spec.full_kv_block_range(i, block_q, block_kv)
    some = (j >= lo) & (j < hi)
    every = some & (j >= f_lo) & (j < f_hi)
  some, every = some[None, None], every[None, None]  # [1, 1, nq, nk]
  if q_seg is not None:
    B = q_seg.shape[0]
    qb = q_seg.reshape(B, nq, block_q)
    kb = kv_seg.reshape(B, nk, block_kv)
    qmin, qmax = qb.min(-1)[:, :, None], qb.max(-1)[:, :, None]
    kmin, kmax = kb.min(-1)[:, None, :], kb.max(-1)[:, None, :]
    some = some & ((qmin <= kmax) & (kmin <= qmax))[:, None]
    # one id on both sides: qmax <= kmin <= kmax <= qmin <= qmax (no separate equalities:
    # compares of the four block extremes only, which XLA fuses into one op)
    every = every & ((qmax <= kmin) & (kmax <= qmin))[:, None]
  if mask is not None:
    Bm, Hm, Sq, Sk = mask.shape
    mq, mk = (nq, block_q) if Sq != 1 else (1, 1)
    kq, kk = (nk, block_kv) if Sk != 1 else (1, 1)
    m = mask.reshape(Bm, Hm, mq, mk, kq, kk)
    some = some & m.any(axis=(3, 5))
    every = every & m.all(axis=(3, 5))
  if mod_classes is not None:
    some = some & (mod_classes != EMPTY)
    every = every & (mod_classes == FULL)
  cls = jnp.where(every, FULL, jnp.where(some, PARTIAL, EMPTY)).astype(jnp.int8)
  return jnp.broadcast_to(cls, cls.shape[:2] + (nq, nk))  # keep both block axes


def _compact(selected):
  """(count [...], indices [..., n]) of the True entries of `selected` [..., n], padded."""
  count = jnp.sum(selected, axis=-1, dtype=jnp.int32)
  order = jnp.argsort(jnp.logical_not(selected), axis=-1, stable=True).astype(jnp.int32)
  last = jnp.take_along_axis(order, jnp.maximum(count - 1, 0)[..., None], axis=-1)
  last = jnp.where(count[..., None] > 0, last, 0)
  pos = lax.broadcasted_iota(jnp.int32, order.shape, order.ndim - 1)
  return count, jnp.where(pos < count[..., None], order, last)


def compact_np(selected: np.ndarray):
  """`_compact` in numpy (static classes known at trace time)."""
  selected = np.asarray(selected, bool)
  count = selected.sum(-1).astype(np.int32)
  n = selected.shape[-1]
  order = np.argsort(~selected, axis=-1, kind="stable").astype(np.int32)
  last = np.take_along_axis(order, np.maximum(count - 1, 0)[..., None], axis=-1)
  last = np.where(count[..., None] > 0, last, 0)
  return count, np.where(np.arange(n) < count[..., None], order, last).astype(np.int32)


@functools.lru_cache(maxsize=512)
def static_block_classes(spec: MaskSpec, block_q: int, block_kv: int, num_q_blocks: int,
                         num_kv_blocks: int) -> np.ndarray:
  """`block_classes` with no segment ids, dense mask or mask_mod, in numpy: int8 [nq, nk]
  from causal / window / padding alone (read-only; cached per static configuration), so
  a static mask's lists are constants of the program, not device ops."""
  i = np.arange(num_q_blocks)[:, None]
  j = np.arange(num_kv_blocks)[None, :]
  lo, hi = spec.kv_block_range(i, block_q, block_kv, num_kv_blocks)
  f_lo, f_hi = spec.full_kv_block_range(i, block_q, block_kv)
  some = (j >= lo) & (j < hi)
  every = some & (j >= f_lo) & (j < f_hi)
  cls = np.where(every, FULL, np.where(some, PARTIAL, EMPTY)).astype(np.int8)
  cls = np.broadcast_to(cls, (num_q_blocks, num_kv_blocks)).copy()
  cls.flags.writeable = False
  return cls


def block_lists(spec: MaskSpec, q_seg, kv_seg, mask, block_q, block_kv, num_q_blocks,
                num_kv_blocks, *, by: str = "q", mod_classes=None) -> BlockLists:
  """Compacted lists of the non-empty blocks per row (see `BlockLists`, `block_classes`).

  by="q": per q block, its kv blocks (forward, dQ). by="kv": per kv block, its q
  blocks (dK/dV).
  """
  if by not in ("q", "kv"):
    raise ValueError(f"by must be 'q' or 'kv', got {by!r}")
  cls = block_classes(spec, q_seg, kv_seg, mask, block_q, block_kv, num_q_blocks,
                      num_kv_blocks, mod_classes)
  if by == "kv":
    cls = jnp.swapaxes(cls, -1, -2)
  num_partial, partial = _compact(cls == PARTIAL)
  num_full, full = _compact(cls == FULL)
  return BlockLists(num_partial, partial, num_full, full)


def _cdiv_nonneg(x, b):
  xp = _xp(x)
  return (xp.maximum(x, 0) + b - 1) // b


@functools.lru_cache(maxsize=512)
def static_block_ranges(spec: MaskSpec, by: str, block_q: int, block_kv: int,
                        num_q_blocks: int, num_kv_blocks: int):
  """`MaskSpec.static_block_ranges`: tuple of (lo, hi) Python ints per row, in numpy."""
  if by == "q":
    lo, hi = spec.kv_block_range(np.arange(num_q_blocks), block_q, block_kv, num_kv_blocks)
    n = num_q_blocks
  elif by == "kv":
    lo, hi = spec.q_block_range(np.arange(num_kv_blocks), block_q, block_kv, num_q_blocks)
    n = num_kv_blocks
  else:
    raise ValueError(f"by must be 'q' or 'kv', got {by!r}")
  lo, hi = np.broadcast_to(lo, (n,)), np.broadcast_to(hi, (n,))
  return tuple((int(a), int(b)) for a, b in zip(lo, hi))


def split_loop(run, lo, hi, full, carry):
  """`run(start, stop, masked, carry)` over [lo, hi): unmasked inside `full`, masked outside.

  `full` is a [lo, hi) block range from `full_kv_block_range` / `full_q_block_range`, or
  None when every block needs the elementwise mask (segment ids, dense mask).
  """
  if full is None:
    return run(lo, hi, True, carry)
  f_lo = jnp.clip(full[0], lo, hi)
  f_hi = jnp.clip(full[1], f_lo, hi)
  carry = run(lo, f_lo, True, carry)
  carry = run(f_lo, f_hi, False, carry)
  return run(f_hi, hi, True, carry)


def pad_axis(x, axis, size, mode="constant", keep_broadcast=True):
  """Pad `x` along `axis` up to `size`; a broadcast (size-1) axis stays as it is."""
  if x is None or x.shape[axis] == size or (keep_broadcast and x.shape[axis] == 1):
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  if mode == "edge":
    return jnp.pad(x, widths, mode="edge")
  return jnp.pad(x, widths)


def num_blocks(n: int, block: int) -> int:
  return -(-n // block)

