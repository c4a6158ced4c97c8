"""Blockwise attention in pure JAX (FlashAttention-2's algorithm, expressed with lax loops).

Room: blockwise backend. Reads the mask model, score_mod, dropout and config;
never the API. Each pass is ONE loop over a flat list of the (q block, kv block)
pairs it must visit (`_pairs`; few compiled kernels: benchmarks/compile_time.py).
Forward: online softmax, row-major pairs, the running max / sum and the output
accumulator of every row in O(seq) carries updated in place. Backward (hand-written,
one pass over the forward's row-major pairs, with kv-major tiles so every product is a
plain matmul): recompute probabilities from the saved logsumexp and add each pair's
dQ^T, dK, dV tiles into O(seq) accumulators. Walking the same pair list as the forward
lets XLA compile the two loops' index and tile-slice code into shared kernels. GQA works on
[batch, kv_heads, group, ...] views, so K/V are never repeated per query head.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flashvjp import _delta
from flashvjp import _dropout
from flashvjp import _mask
from flashvjp import _mask_mod
from flashvjp import _score_mod
from flashvjp._config import AttentionConfig


class _Layout:
  """Shapes, padding and tile access shared by the forward and the backward."""

  def __init__(self, cfg: AttentionConfig, q, k, v, block_q, block_kv, offsets=None):
    self.cfg = cfg
    # Global (b, h, q, kv) positions of this call's first element (ints or traced int32
    # scalars; None: 0): a chunk pair of a sharded sequence (flashvjp.ring) sees its global
    # indices in score_mod, mask_mod and dropout. The static mask (causal, window) is local:
    # the ring hands each pair its window relative to the pair's own origin.
    self.off = (0, 0, 0, 0) if offsets is None else tuple(offsets)
    self.B, self.H, self.Sq, self.D = q.shape
    self.Hkv, self.Skv, self.Dv = k.shape[1], k.shape[2], v.shape[3]
    self.G = self.H // self.Hkv
    self.bq = min(block_q, self.Sq)
    self.bk = min(block_kv, self.Skv)
    self.nq = _mask.num_blocks(self.Sq, self.bq)
    self.nk = _mask.num_blocks(self.Skv, self.bk)
    self.Sqp, self.Skvp = self.nq * self.bq, self.nk * self.bk
    self.acc = jnp.promote_types(q.dtype, jnp.float32)
    # Matmul operand dtype: 16-bit inputs stay 16-bit in the forward's and backward's dots
    # (accumulated in float32, with p and dS rounded to it, as the Pallas kernels and
    # FlashAttention do): on CPUs with bf16 matmul units (AMX, AVX512-BF16) a bf16 tile
    # product runs 1.6-3.3x faster than a float32 one (benchmarks/results/cpu_roofline.md).
    self.mm = q.dtype if jnp.dtype(q.dtype).itemsize <= 2 else self.acc
    self.spec = _mask.MaskSpec(cfg.causal, cfg.window, cfg.seq_q, cfg.seq_kv)

  # ---- input preparation ---------------------------------------------------
  def q5(self, x):
    """[B, H, Sq, ...] -> padded [B, Hkv, G, Sqp, ...]."""
    x = _mask.pad_axis(x, 2, self.Sqp, keep_broadcast=False)
    return x.reshape((self.B, self.Hkv, self.G) + x.shape[2:])

  def kv(self, x):
    """[B, Hkv, Skv, X] -> padded [B, Hkv, 1, Skvp, X]: the q side's rank (see `q5`)."""
    return _mask.pad_axis(x, 2, self.Skvp, keep_broadcast=False)[:, :, None]

  def pad_pair(self, x):
    """A rank-4 bias/mask (dims 1 or full), padded along its full seq dims."""
    if x is None:
      return None
    return _mask.pad_axis(_mask.pad_axis(x, 2, self.Sqp), 3, self.Skvp)

  def pair5(self, x):
    """Padded rank-4 bias/mask -> rank 5 [B', Hkv', G', Sq', Skv'] (1 where broadcast)."""
    if x is None:
      return None
    if x.shape[1] == 1:
      return x[:, :, None]
    return x.reshape(x.shape[0], self.Hkv, self.G, x.shape[2], x.shape[3])

  def segs(self, q_seg, kv_seg):
    if q_seg is None:
      return None, None
    return (_mask.pad_axis(q_seg, 1, self.Sqp, "edge", keep_broadcast=False),
            _mask.pad_axis(kv_seg, 1, self.Skvp, "edge", keep_broadcast=False))

  def block_table(self, q_seg, kv_seg, mask, mod=None):
    """bool [nq, nk]: False where a block pair is empty for every batch and head."""
    table = _mask.block_any_table(q_seg, kv_seg, mask, self.bq, self.bk, self.nq, self.nk,
                                  self.mod_classes(mod))
    return None if table is None else table.any(axis=(0, 1))

  def mod_classes(self, mod):
    """The mask_mod's block classes at this layout's blocks (None without a mask_mod)."""
    if mod is None or mod.classes is None:  # no classes (a ring's chunk pair): all PARTIAL
      return None
    assert self.cfg.mask_mod_blocks is not None  # set with every mask_mod
    src_bq, src_bk = self.cfg.mask_mod_blocks
    return _mask.resample_classes(mod.classes, src_bq, src_bk, self.bq, self.bk,
                                  self.Sq, self.Skv, self.nq, self.nk)

  def needs_mask(self, elementwise):
    """Whether any visited block needs the elementwise mask (static).

    One loop body per pass, masked wherever any block may need it. Splitting the loop
    into masked edge blocks and unmasked interior blocks (`_mask.split_loop`) saved
    about 3% of causal run time but gave each pass two distinct loop bodies in three
    while loops: 50 compiled XLA kernels for jit(grad) instead of 36
    (benchmarks/results/compile_time.md).
    """
    return bool(elementwise or self.cfg.causal or self.cfg.window is not None
                or self.Sqp != self.Sq or self.Skvp != self.Skv)

  # ---- tile access -----------------------------------------------------------
  def pair_tile(self, x5, i, j):
    if x5 is None:
      return None
    if x5.shape[3] != 1:
      x5 = _slice(x5, i * self.bq, self.bq, 3)
    if x5.shape[4] != 1:
      x5 = _slice(x5, j * self.bk, self.bk, 4)
    return x5

  def local_indices(self, i, j, t=False):
    """This call's own (b, h, q, kv) index tiles, broadcastable to the tile layout.

    The layout is [B, Hkv, G, bq, bk], or with t=True the backward's transposed
    [B, Hkv, bk, G, bq] (`_t`).
    """
    b = jnp.arange(self.B, dtype=jnp.int32).reshape(self.B, 1, 1, 1, 1)
    h = jnp.arange(self.H, dtype=jnp.int32).reshape(1, self.Hkv, self.G, 1, 1)
    qi = (i * self.bq + jnp.arange(self.bq, dtype=jnp.int32)).reshape(1, 1, 1, self.bq, 1)
    ki = (j * self.bk + jnp.arange(self.bk, dtype=jnp.int32)).reshape(1, 1, 1, 1, self.bk)
    return tuple(map(_t, (b, h, qi, ki))) if t else (b, h, qi, ki)

  def _global(self, idx):
    return tuple(x if isinstance(o, int) and o == 0 else x + jnp.asarray(o, jnp.int32)
                 for x, o in zip(idx, self.off))

  def indices(self, i, j, t=False):
    """Global (b, h, q, kv) index tiles (`local_indices` + the offsets): what score_mod,
    mask_mod and dropout's counter hash see."""
    return self._global(self.local_indices(i, j, t))

  def allowed(self, i, j, q_seg, kv_seg, mask5, mod=None, t=False):
    b, h, qi, ki = self.local_indices(i, j, t)
    qs = ks = None
    if q_seg is not None:
      qs = _slice(q_seg, i * self.bq, self.bq, 1)[:, None, None, :, None]
      ks = _slice(kv_seg, j * self.bk, self.bk, 1)[:, None, None, None, :]
      if t:
        qs, ks = _t(qs), _t(ks)
    dense = self.pair_tile(mask5, i, j)
    if t and dense is not None:
      dense = _t(dense)
    if mod is not None:
      # clamped into the real sequence locally, then made global
      gb, gh, gq, gk = self._global((b, h, jnp.minimum(qi, self.Sq - 1),
                                     jnp.minimum(ki, self.Skv - 1)))
      assert self.cfg.mask_mod is not None  # mod comes with a mask_mod
      ok = _mask_mod.apply(self.cfg.mask_mod, mod.consts, gb, gh, gq, gk)
      dense = ok if dense is None else (dense & ok)
    ok = self.spec.allowed(qi, ki, q_seg=qs, kv_seg=ks, dense=dense)
    # Materialised once per tile (it broadcasts over batch and heads unless segment ids,
    # a dense mask or a mask_mod vary there): otherwise XLA recomputes the predicate in
    # every fusion that reads it, per head (causal forward 10-15% slower at seq 4096-8192).
    return lax.optimization_barrier(ok)

  def scores(self, q_blk, k_blk, bias5, i, j):
    """scale * q k^T (+ bias) as [B, Hkv, G, bq, bk] in the accumulation dtype."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q_blk, k_blk, preferred_element_type=self.acc)
    s = s.reshape(self.B, self.Hkv, self.G, self.bq, self.bk) * jnp.asarray(self.cfg.scale, self.acc)
    if bias5 is not None:
      s = s + self.pair_tile(bias5, i, j).astype(self.acc)
    return s

  def scores_t(self, q_blk, k_blk, bias5, i, j):
    """`scores` in the transposed layout [B, Hkv, bk, G, bq]: k q^T."""
    s = jnp.einsum("bhkd,bhqd->bhkq", k_blk, q_blk, preferred_element_type=self.acc)
    s = s.reshape(self.B, self.Hkv, self.bk, self.G, self.bq) * jnp.asarray(self.cfg.scale, self.acc)
    if bias5 is not None:
      s = s + _t(self.pair_tile(bias5, i, j)).astype(self.acc)
    return s

  def keep_scale(self, seed, i, j, t=False):
    """Dropout multiplier tile: 1/(1-rate) where kept, 0 where dropped."""
    b, h, qi, ki = self.indices(i, j, t)
    keep = _dropout.keep(seed[0], seed[1], b, h, qi, ki, self.cfg.dropout_rate,
                         self.cfg.dropout_broadcast)
    return jnp.where(keep, jnp.asarray(1.0 / (1.0 - self.cfg.dropout_rate), self.acc), 0.0)

  def q_tile(self, x5, i, dtype=None):
    """[B, Hkv, G, Sqp, X] -> [B, Hkv, G*bq, X] tile of q block i, in `dtype` (default acc)."""
    t = _slice(x5, i * self.bq, self.bq, 3)
    return t.reshape(self.B, self.Hkv, self.G * self.bq, x5.shape[-1]).astype(dtype or self.acc)

  def kv_tile(self, x5, j, dtype=None):
    """[B, Hkv, 1, Skvp, X] -> [B, Hkv, bk, X] tile of kv block j, in `dtype` (default acc)."""
    t = _slice(x5, j * self.bk, self.bk, 3)
    return t.reshape(self.B, self.Hkv, self.bk, x5.shape[-1]).astype(dtype or self.acc)

  def q_mm(self, x5, i):
    """`q_tile` in the matmul operand dtype (`mm`)."""
    return self.q_tile(x5, i, self.mm)

  def kv_mm(self, x5, j):
    """`kv_tile` in the matmul operand dtype (`mm`)."""
    return self.kv_tile(x5, j, self.mm)


def _t(x):
  """[B, Hkv, G, bq, bk] (any dims broadcast) -> the backward's [B, Hkv, bk, G, bq]."""
  return jnp.transpose(x, (0, 1, 4, 2, 3))


def _carry_zero(acc, *refs):
  """A scalar 0 that varies over every shard_map axis any of `refs` varies over.

  Added to fresh loop-carry constants so that their types match the loop outputs
  under shard_map's check_vma (a plain jnp.zeros is invariant there).
  """
  z = jnp.zeros((), acc)
  for r in jax.tree_util.tree_leaves(refs):
    z = z + jnp.zeros_like(r, acc, shape=())
  return z


_MAX_UNROLLED_ROWS = 8  # the chain beyond: compile time grows with it (0.95 s at 128 rows)


@functools.lru_cache(maxsize=256)
def _static_walk(spec: _mask.MaskSpec, bq: int, bk: int, nq: int, nk: int, by: str):
  """(total pairs, first (row, col offset), row-end thresholds, (d row, d col) steps) of
  the static pair list: Python ints from numpy (`MaskSpec.static_block_ranges`), once per
  static configuration. Pair t's row is base row + the d rows of every threshold <= t,
  its column t + base offset + the d cols of those thresholds."""
  ranges = spec.static_block_ranges(by, bq, bk, nq, nk)
  ends, shift, base, prev = [], [], (0, 0), None
  acc_n = 0
  for r_, (lo_, hi_) in enumerate(ranges):
    size = max(hi_ - lo_, 0)
    if size:
      off = lo_ - acc_n
      if prev is None:
        base = (r_, off)
      else:
        ends.append(acc_n)
        shift.append((r_ - prev[0], off - prev[1]))
      prev = (r_, off)
    acc_n += size
  return acc_n, base, tuple(ends), tuple(shift)


@functools.lru_cache(maxsize=256)
def _contiguous(spec, bq, bk, nq, nk, by) -> bool:
  """Whether the rows with a non-empty static range are one contiguous run."""
  rows = [r for r, (lo, hi) in enumerate(spec.static_block_ranges(by, bq, bk, nq, nk))
          if hi > lo]
  return bool(rows) and rows[-1] - rows[0] + 1 == len(rows)


def _pairs(L: _Layout, table, by):
  """The block pairs one pass visits: (trip count, walk state, at(t, state) -> (i, j, state)).

  A single loop per pass runs over a flat list of (q block, kv block) pairs (row loop
  and column loop fused), so each pass compiles one loop body and no per-row
  init / finalise code inside a loop. The static bounds (causal, window, padding) give
  the list at trace time (in numpy, cached: `_static_walk`; no jax op runs while
  tracing), walked by a chain of scalar steps (few rows) or a carried (row, col); a dynamic block table (segment ids, dense mask) compacts it
  (`_mask._compact`), so empty blocks cost no branch (no lax.cond in the body) and the
  trip count is the number of non-empty pairs. `by` orders the list ("q": row-major,
  "kv": column-major).
  """
  n_rows, n_cols = (L.nq, L.nk) if by == "q" else (L.nk, L.nq)
  total, base, ends, shift = _static_walk(L.spec, L.bq, L.bk, L.nq, L.nk, by)

  def bounds(r):
    if by == "q":
      return L.spec.kv_block_range(r, L.bq, L.bk, L.nk)
    return L.spec.q_block_range(r, L.bq, L.bk, L.nq)

  def swap(row, col):
    return (row, col) if by == "q" else (col, row)

  if table is None and n_rows <= _MAX_UNROLLED_ROWS:
    # Static bounds: pair t's row is the number of row ends <= t and its column
    # t + (row start col - row offset), as sums of scalar steps with Python-int
    # thresholds (one small scalar kernel; no index arrays, no gathers).
    # lax primitives on int32 literals: the chain has a step per row (64 at seq 8192, in
    # three traced loops), and jnp's wrappers took ~30% of jit(grad)'s trace time.
    def at(t, state):
      t = lax.convert_element_type(t, np.int32)  # a no-op unless jax_enable_x64
      lit = lambda x: np.asarray(x, np.int32)
      zero = lit(0)
      row, col = lax.full((), base[0], np.int32), lax.add(t, lit(base[1]))
      for e, (dr, dc) in zip(ends, shift):
        past = lax.ge(t, lit(e))
        row = lax.add(row, lax.select(past, lit(dr), zero))
        col = lax.add(col, lax.select(past, lit(dc), zero))
      return swap(row, col) + (state,)
    return total, (), at

  if table is None and _contiguous(L.spec, L.bq, L.bk, L.nq, L.nk, by):
    # More rows: the walk is carried, (row, col) of pair t in the loop state; the next
    # pair is the next column, or the next row's first one (the bounds' arithmetic on the
    # traced row). O(1) ops per step at any seq, where the chain above has one per row:
    # jit(grad)'s XLA compile stays ~0.46 s CPU at seq 8192 and 32768 (the chain: 0.53 /
    # 0.95 s); run time unchanged (A/B at seq 4096 and 8192, compile_time.md). Needs the
    # non-empty rows to be one run (band masks: empty rows only before or after it).
    def at_carry(t, state):
      del t
      row, col = state
      nxt = col + 1
      wrap = nxt >= bounds(row)[1]
      row1 = row + wrap.astype(jnp.int32)
      col1 = jnp.where(wrap, bounds(row1)[0], nxt).astype(jnp.int32)
      return swap(row, col) + ((row1, col1),)
    r0 = base[0]
    walk0 = (lax.full((), r0, np.int32), lax.full((), bounds(r0)[0], np.int32))  # no consts
    return total, walk0, at_carry

  # The list is built from iotas (no array constants: custom_partitioning refuses them).
  r = lax.iota(jnp.int32, n_rows)
  lo, hi = bounds(r)
  lo = jnp.broadcast_to(lo, (n_rows,)).astype(jnp.int32)
  n = jnp.maximum(jnp.broadcast_to(hi, (n_rows,)).astype(jnp.int32) - lo, 0)
  end = jnp.cumsum(n)
  t = lax.iota(jnp.int32, max(total, 1))
  row = jnp.minimum(jnp.sum(end[None, :] <= t[:, None], axis=1, dtype=jnp.int32), n_rows - 1)
  col = jnp.clip(t - (end - n)[row] + lo[row], 0, n_cols - 1)
  ii, jj = swap(row, col)
  count = total
  if table is not None:
    count, order = _mask._compact(table[ii, jj] & (t < total))  # pylint: disable=protected-access
    ii, jj = ii[order], jj[order]

  def at_list(t, state):
    return _at(ii, t), _at(jj, t), state
  return count, (), at_list


def _at(x, t):
  """x[t] for a traced in-range t (no negative-index wrap)."""
  return lax.dynamic_index_in_dim(x, t, keepdims=False, allow_negative_indices=False)


def _slice(x, start, size, axis):
  """x[start : start + size] along `axis`, for an in-range start (no negative-index
  wrap: the wrap's compare and select would be copied into every kernel reading it)."""
  return lax.dynamic_slice_in_dim(x, start, size, axis, allow_negative_indices=False)


def _rows(x5, i, n, axis=3):
  return _slice(x5, i * n, n, axis)


def _put_rows(x5, t, i, n, axis=3):
  return lax.dynamic_update_slice_in_dim(x5, t, i * n, axis, allow_negative_indices=False)


def scoped(name: str):
  """Run a pass under `jax.named_scope(name)`: its loops carry the name in the compiled
  program's op_name metadata (profiles; the tests count passes by it, e.g. that a
  checkpointed layer runs the forward once)."""
  def wrap(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
      with jax.named_scope(name):
        return fn(*args, **kwargs)
    return run
  return wrap


@scoped("flashvjp_blockwise_fwd")
def forward(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, mod=None,
            offsets=None):
  """Returns (out [B, H, Sq, Dv] q.dtype, lse [B, H, Sq] float32 (or wider)), and each row's
  maximum allowed logit [B, H, Sq] (-inf: none) third when cfg.max_logits.

  offsets: None, or the global (b, h, q, kv) position of element 0 (see `_Layout`).
  """
  L = _Layout(cfg, q, k, v, cfg.blocks.block_q, cfg.blocks.block_kv, offsets)
  q5 = L.q5(q)
  kp, vp = L.kv(k), L.kv(v)
  mask_p = L.pad_pair(mask)
  bias5, mask5 = L.pair5(L.pad_pair(bias)), L.pair5(mask_p)
  q_seg, kv_seg = L.segs(q_seg, kv_seg)
  table = L.block_table(q_seg, kv_seg, mask_p, mod)
  masked = L.needs_mask(q_seg is not None or mask is not None or mod is not None)
  acc = L.acc
  rows = (L.B, L.Hkv, L.G, L.Sqp)
  z0 = _carry_zero(acc, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, mod)
  count, walk0, at = _pairs(L, table, "q")

  # Online softmax over a flat pair list; the running max, sum and output of every
  # row live in O(seq) carries and each step updates its q block's rows in place.
  def body(t, carry):
    ml_all, o_all, walk = carry
    i, j, walk = at(t, walk)
    s = L.scores(L.q_mm(q5, i), L.kv_mm(kp, j), bias5, i, j)
    if cfg.score_mod is not None:
      s = _score_mod.apply(cfg.score_mod, consts, s, *L.indices(i, j))
    if masked:
      s = jnp.where(L.allowed(i, j, q_seg, kv_seg, mask5, mod), s, -jnp.inf)
    ml, o = _rows(ml_all, i, L.bq), _rows(o_all, i, L.bq)
    m, l = ml[..., 0], ml[..., 1]
    m_new = jnp.maximum(m, s.max(axis=-1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_safe[..., None])
    alpha = jnp.exp(m - m_safe)
    l = alpha * l + p.sum(axis=-1)
    if cfg.dropout_active:
      p = p * L.keep_scale(seed, i, j)
    pv_mm = acc if cfg.out_f32 else L.mm  # float32 p @ v for an exact delta (cfg.out_f32)
    pv = jnp.einsum("bhqk,bhkd->bhqd", p.reshape(L.B, L.Hkv, L.G * L.bq, L.bk).astype(pv_mm),
                    L.kv_mm(vp, j).astype(pv_mm), preferred_element_type=acc)
    o = alpha[..., None] * o + pv.reshape(L.B, L.Hkv, L.G, L.bq, L.Dv)
    return (_put_rows(ml_all, jnp.stack([m_new, l], axis=-1), i, L.bq),
            _put_rows(o_all, o, i, L.bq), walk)

  # The running max and sum of each row share one carry (one in-place update per step).
  # (An iota select, not a stack of two constants, which XLA would fold into a literal.)
  ml0 = jnp.where(lax.broadcasted_iota(jnp.int32, rows + (2,), 4) == 0, -jnp.inf, z0)
  init = (ml0, jnp.zeros(rows + (L.Dv,), acc) + z0, walk0)
  ml, o, _ = lax.fori_loop(0, count, body, init)
  m, l = ml[..., 0], ml[..., 1]
  empty = l == 0.0
  out = (o / jnp.where(empty, 1.0, l)[..., None]).astype(acc if cfg.out_f32 else q.dtype)
  lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))
  out = out.reshape(L.B, L.H, L.Sqp, L.Dv)[:, :, : L.Sq]
  lse = lse.reshape(L.B, L.H, L.Sqp)[:, :, : L.Sq]
  if cfg.max_logits:  # the running max is the row's max logit (-inf: nothing allowed)
    return out, lse, lax.stop_gradient(m.reshape(L.B, L.H, L.Sqp)[:, :, : L.Sq])
  return out, lse


@scoped("flashvjp_blockwise_bwd")
def backward(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed, consts,
             out, lse, dout, dlse, mod=None, offsets=None):
  """Hand-written backward. Returns (dq, dk, dv, dbias or None, dconsts (differentiable ones)).

  The pairs are the forward's, in the forward's row-major order (`_pairs(..., "q")`): the
  index walk and the tile slices then compile to the same kernels as the forward's (XLA:CPU
  compiles each distinct kernel once: 2 fewer for jit(grad) at seq 2048 and 8192). dK_j and
  dV_j still receive their tiles in increasing i and dQ_i in increasing j, as in a
  column-major walk, so dq, dk, dv are bitwise the same (a score_mod's const gradients, sums
  over every pair, are summed in the new order); run time unchanged
  (benchmarks/results/compile_time.md).

  Tiles are kv-major ([B, Hkv, bk, G, bq]: s^T = k q^T), so that all five products are
  plain [M, K] x [K, N] matmuls: dV = P^T dO, dK = dS^T Q, and dQ^T = K^T dS^T (dQ is
  accumulated transposed and transposed once at the end). With q-major tiles dK and dV
  contract over the tile's first axis, which XLA:CPU runs as a transposed-operand dot:
  2-2.5x slower in float32 and 8-10x in bfloat16 (benchmarks/results/cpu_roofline.md).
  """
  bq, bk = cfg.blocks.dkv
  L = _Layout(cfg, q, k, v, bq, bk, offsets)
  acc = L.acc
  q5, do5 = L.q5(q), L.q5(dout)
  kp, vp = L.kv(k), L.kv(v)
  bias_p, mask_p = L.pad_pair(bias), L.pad_pair(mask)
  bias5, mask5 = L.pair5(bias_p), L.pair5(mask_p)
  q_seg, kv_seg = L.segs(q_seg, kv_seg)
  table = L.block_table(q_seg, kv_seg, mask_p, mod)
  masked = L.needs_mask(q_seg is not None or mask is not None or mod is not None)
  n_diff = cfg.num_diff_consts
  diff_consts, fixed_consts = tuple(consts[:n_diff]), tuple(consts[n_diff:])
  count, walk0, at = _pairs(L, table, "q")
  tile_t = (L.B, L.Hkv, L.bk, L.G * L.bq)

  # delta = rowsum(dO * O) - dlse; rows that are empty (lse = -inf) or padding get
  # lse = +inf so that exp(s - lse) = 0 there: zero, finite gradients.
  # (From dO in the loop's layout, do5: XLA then computes a dO produced by the caller, e.g.
  # 2 * out, in one kernel, not one per layout.)
  delta5 = _delta.delta(None if out is None else L.q5(out), do5,
                        None if dlse is None else L.q5(dlse), acc)
  lse_b = jnp.where(lse == -jnp.inf, jnp.inf, lse.astype(acc))
  lse5 = L.q5(jnp.pad(lse_b, ((0, 0), (0, 0), (0, L.Sqp - L.Sq)), constant_values=jnp.inf))

  def row_t(x5, i):
    """[B, Hkv, G, Sqp] per-row values of q block i, broadcast along the kv axis of a tile."""
    return _rows(x5, i, L.bq)[:, :, None]

  # One loop over the flat pair list (kv-block major). dQ^T, dK and dV are O(seq)
  # accumulators in the accumulation dtype; each step adds its tile in place.
  def body(t, carry):
    dqT, dk, dv, dbias, dconsts, walk = carry
    i, j, walk = at(t, walk)
    k_blk, v_blk = L.kv_mm(kp, j), L.kv_mm(vp, j)
    q_blk, do_blk = L.q_mm(q5, i), L.q_mm(do5, i)
    s = L.scores_t(q_blk, k_blk, bias5, i, j)
    if masked:
      ok = L.allowed(i, j, q_seg, kv_seg, mask5, mod, t=True)
    if (sm_fn := cfg.score_mod) is not None:
      if masked:  # a masked q k may be inf / NaN (any finite K there): keep it out of
        s = jnp.where(ok, s, 0.0)  # the score_mod's derivative (0 * f'(inf) = NaN)
      idx = L.indices(i, j, t=True)
      s, sm_vjp = jax.vjp(
          lambda s_, c_: _score_mod.apply(sm_fn, c_ + fixed_consts, s_, *idx),
          s, diff_consts)
    if masked:
      s = jnp.where(ok, s, -jnp.inf)
    p = jnp.exp(s - row_t(lse5, i))
    dp = jnp.einsum("bhkd,bhqd->bhkq", v_blk, do_blk, preferred_element_type=acc)
    dp = dp.reshape(p.shape)
    pd = p
    if cfg.dropout_active:
      ks = L.keep_scale(seed, i, j, t=True)
      pd, dp = p * ks, dp * ks
    dv_j = jnp.einsum("bhkq,bhqd->bhkd", pd.reshape(tile_t).astype(L.mm), do_blk,
                      preferred_element_type=acc)
    ds = p * (dp - row_t(delta5, i))
    if masked:  # a masked entry gives exactly 0, not 0 * (dp - delta): dp is inf / NaN
      ds = jnp.where(ok, ds, 0.0)  # where a masked V row holds, e.g., finfo.max
    if cfg.score_mod is not None:
      ds, dc = sm_vjp(ds)
      dconsts = tuple(a + b.astype(a.dtype) for a, b in zip(dconsts, dc))
    if dbias is not None:
      dbias = _add_bias_tile(L, dbias, jnp.transpose(ds, (0, 1, 3, 4, 2)), i, j)
    ds4 = (ds.reshape(tile_t) * jnp.asarray(cfg.scale, acc)).astype(L.mm)
    dk_j = jnp.einsum("bhkq,bhqd->bhkd", ds4, q_blk, preferred_element_type=acc)
    # K^T per tile, not a transposed copy of all of K (8 MiB more temp memory at seq
    # 4096, B=1, H=8; a whole-K copy made bfloat16 fwd+bwd ~20% faster, float32 no faster).
    kT_blk = jnp.swapaxes(k_blk, 2, 3)
    dqT_i = jnp.einsum("bhdk,bhkq->bhdq", kT_blk, ds4, preferred_element_type=acc)
    dqT_i = dqT_i.reshape(L.B, L.Hkv, L.D, L.G, L.bq)
    dqT = _put_rows(dqT, _rows(dqT, i, L.bq, 4) + dqT_i, i, L.bq, 4)
    dk = _put_rows(dk, _rows(dk, j, L.bk) + dk_j[:, :, None], j, L.bk)
    dv = _put_rows(dv, _rows(dv, j, L.bk) + dv_j[:, :, None], j, L.bk)
    return dqT, dk, dv, dbias, dconsts, walk

  z0 = _carry_zero(acc, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, out, lse, dout, dlse,
                   mod)
  dqT0 = jnp.zeros((L.B, L.Hkv, L.D, L.G, L.Sqp), acc) + z0
  dk0 = jnp.zeros((L.B, L.Hkv, 1, L.Skvp, L.D), acc) + z0
  dv0 = jnp.zeros((L.B, L.Hkv, 1, L.Skvp, L.Dv), acc) + z0
  dbias0 = None if bias is None else jnp.zeros(bias5.shape, acc) + z0
  dconsts0 = tuple(jnp.zeros(jnp.shape(c), jnp.promote_types(jnp.result_type(c), acc))
                   + z0.astype(jnp.promote_types(jnp.result_type(c), acc)) for c in diff_consts)
  dqT, dk, dv, dbias, dconsts, _ = lax.fori_loop(
      0, count, body, (dqT0, dk0, dv0, dbias0, dconsts0, walk0))
  dq = jnp.transpose(dqT, (0, 1, 3, 4, 2)).reshape(L.B, L.H, L.Sqp, L.D)[:, :, : L.Sq]
  dq = dq.astype(q.dtype)
  dk, dv = dk[:, :, 0, : L.Skv], dv[:, :, 0, : L.Skv]
  if dbias is not None:
    dbias = dbias.reshape(bias_p.shape)[:, :, : bias.shape[2], : bias.shape[3]].astype(bias.dtype)
  dconsts = tuple(d.astype(jnp.result_type(c)) for d, c in zip(dconsts, diff_consts))
  return dq, dk.astype(k.dtype), dv.astype(v.dtype), dbias, dconsts


def _add_bias_tile(L: _Layout, dbias5, ds, i, j):
  """Add ds [B, Hkv, G, bq, bk], reduced to the bias' broadcast dims, into dbias5."""
  axes = tuple(a for a in range(5) if dbias5.shape[a] == 1 and ds.shape[a] != 1)
  red = ds.sum(axis=axes, keepdims=True) if axes else ds
  zero = jnp.zeros((), jnp.int32)
  starts = [zero] * 5
  if dbias5.shape[3] != 1:
    starts[3] = jnp.asarray(i * L.bq, jnp.int32)
  if dbias5.shape[4] != 1:
    starts[4] = jnp.asarray(j * L.bk, jnp.int32)
  cur = lax.dynamic_slice(dbias5, starts, red.shape, allow_negative_indices=False)
  return lax.dynamic_update_slice(dbias5, cur + red.astype(dbias5.dtype), starts,
                                  allow_negative_indices=False)
