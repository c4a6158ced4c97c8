"""Segment-id visit lists built by one small Mosaic-TPU kernel (one op of the program).

Room: Pallas-TPU backend (shared part), below `_layout.visit_lists`, which calls it.

With segment ids the kernels' visit lists depend on data, so the device builds them. As XLA
ops that is a chain (the id extremes of each block, a reshape, the block classes, a running
count, the count, the clipped slot and the entries: 8 ops on TPU v5e, each run in sequence
with its own fixed cost). This kernel does the chain in one custom call, per batch row:

1. each row block's and each column block's id extremes (min / max over the block);
2. the block classes: the static part (causal / window / padding, a numpy table) and the
   ids' overlap (`_mask.block_classes`' rule: some = the id ranges meet, every = one id);
3. the running count of non-empty blocks along each row, one matmul with a triangle of
   ones (0 / 1 in bfloat16, sums in float32: exact);
4. slot p's entry: ``4 * block + 2 * idle + needs_mask``, where block = #{j : c[j] <= p'}
   and p' = min(p, count - 1) (idle slots repeat the row's last block: no DMA), needs_mask
   from the one non-empty block j with c[j] == p' + 1.

The idle bit replaces the counts array: `_layout.Lists` (``flagged=True``) reads a step's
activity from its entry. Rows lie on the lanes and columns on the sublanes, so a column sum
is a lane row, stored as the slot's row of the output ``[B * Wp, rows]`` (slot-major per
batch row; Wp = W rounded up to 8 sublanes), which the attention kernels scalar-prefetch.

The ids arrive in the attention kernels' sublane-broadcast layout ``[B, 8, S]`` (the kv
ids' layout already in the program; a self-attention's q ids are the same array), whole per
batch row in VMEM, so the kernel is used up to `MAX_IDS` positions per side
(`_layout.visit_lists` builds longer lists with XLA ops, where their fixed costs are a
small share of the kernels').
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from flashvjp import _mask
from flashvjp.pallas import _compat

# Mosaic's tile (`_layout.LANES` / `SUBLANES`: `_layout` imports this module, not the reverse)
LANES = 128
SUBLANES = 8
# Positions per side the kernel holds in VMEM: [8, S] int32 ids, two buffers, both sides:
# 8 * 4 * 2 * 2 * 32768 = 4 MiB, inside every TPU's default scoped VMEM.
MAX_IDS = 32768
# Largest padded class table [columns, rows] (int32 and the running count beside it).
MAX_TABLE = 512 * 512

_BIG = np.int32(np.iinfo(np.int32).max)
_SMALL = np.int32(np.iinfo(np.int32).min)


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def fits(n_rows: int, n_cols: int, s_rows: int, s_cols: int) -> bool:
  """Whether the kernel takes these block counts and (padded) sequence lengths."""
  return (max(s_rows, s_cols) <= MAX_IDS
          and _round_up(n_rows, LANES) * _round_up(n_cols, LANES) <= MAX_TABLE)


def _extremes(ids_ref, n: int, blk: int, shape, axis: int):
  """(min, max) of each block of `blk` ids, as `shape` vectors ([1, n'] lanes or [n', 1]
  sublanes; entries past n: BIG / SMALL, which meet nothing)."""
  S = ids_ref.shape[-1]
  pos = lax.broadcasted_iota(jnp.int32, shape, axis)

  def block(i):
    if blk % LANES == 0:  # an aligned slice of the block
      x = ids_ref[0:1, pl.ds(pl.multiple_of(i * np.int32(blk), LANES), blk)]
      return (jnp.min(x, axis=1, keepdims=True), jnp.max(x, axis=1, keepdims=True))
    x = ids_ref[0:1, :]  # sub-128 blocks: the whole row, masked to block i
    own = lax.div(lax.broadcasted_iota(jnp.int32, (1, S), 1), np.int32(blk)) == i
    return (jnp.min(jnp.where(own, x, _BIG), axis=1, keepdims=True),
            jnp.max(jnp.where(own, x, _SMALL), axis=1, keepdims=True))

  def step(_, carry):
    i, mn, mx = carry
    a, b = block(i)
    at = pos == i
    return i + np.int32(1), jnp.where(at, a, mn), jnp.where(at, b, mx)

  init = (np.int32(0), jnp.full(shape, _BIG, jnp.int32), jnp.full(shape, _SMALL, jnp.int32))
  return _loop(n, step, init)[1:]


def _loop(n: int, body, init):
  """n steps of body(None, carry) -> carry, whose carry leads with its own int32 index (a
  while loop: with jax_enable_x64, fori_loop's scan counts in int64, which Mosaic cannot
  lower)."""
  cond = lambda c: (c[0] if isinstance(c, tuple) else c) < np.int32(n)
  return lax.while_loop(cond, lambda c: body(None, c), init)


def _kernel(tab_ref, rows_ref, cols_ref, out_ref, *, n_rows, n_cols, b_rows, b_cols, Wp):
  ncp, nrp = tab_ref.shape
  rmin, rmax = _extremes(rows_ref, n_rows, b_rows, (1, nrp), 1)
  cmin, cmax = _extremes(cols_ref, n_cols, b_cols, (ncp, 1), 0)
  tab = tab_ref[...]
  sel = (tab != _mask.EMPTY) & (rmin <= cmax) & (cmin <= rmax)
  full = (tab == _mask.FULL) & (rmax <= cmin) & (cmax <= rmin)
  part = sel & jnp.logical_not(full)
  tri = (lax.broadcasted_iota(jnp.int32, (ncp, ncp), 1)
         <= lax.broadcasted_iota(jnp.int32, (ncp, ncp), 0))  # tri[j, j'] = j' <= j
  f1, f0 = np.float32(1), np.float32(0)  # (float32 under jax_enable_x64 too)
  c = jnp.dot(jnp.where(tri, f1, f0).astype(jnp.bfloat16),
              jnp.where(sel, f1, f0).astype(jnp.bfloat16),
              preferred_element_type=jnp.float32).astype(jnp.int32)  # [ncp, nrp]
  count = c[ncp - 1:ncp, :]
  i0, i1, i2, i4 = (np.int32(x) for x in (0, 1, 2, 4))  # int32 under jax_enable_x64

  def slot(_, p):
    pp = jnp.minimum(p, count - i1)
    t = jnp.where(c <= pp, i4, i0) + jnp.where((c == pp + i1) & part, i1, i0)
    e = jnp.sum(t, axis=0, keepdims=True, dtype=jnp.int32) + jnp.where(p >= count, i2, i0)
    out_ref[pl.ds(p, 1), :] = e[:, :n_rows]
    return p + i1

  _loop(Wp, slot, np.int32(0))


def build(static_cls: np.ndarray, rows_l, cols_l, b_rows: int, b_cols: int, W: int,
          interpret):
  """Entries int32 [B * Wp, n_rows] (`_layout.Lists` with flagged=True).

  static_cls: numpy int8 [n_rows, n_cols] (the static classes, rows by columns);
  rows_l / cols_l: the two sides' ids, int32 [B, 8, S] (sublane-broadcast), S = n * block.
  """
  n_rows, n_cols = static_cls.shape
  B = rows_l.shape[0]
  nrp, ncp = _round_up(n_rows, LANES), _round_up(n_cols, LANES)
  tab = np.full((ncp, nrp), _mask.EMPTY, np.int32)
  tab[:n_cols, :n_rows] = static_cls.T
  Wp = _round_up(W, SUBLANES)
  kernel = functools.partial(_kernel, n_rows=n_rows, n_cols=n_cols, b_rows=b_rows,
                             b_cols=b_cols, Wp=Wp)
  Sr, Sc = rows_l.shape[-1], cols_l.shape[-1]
  return _compat.tpu_pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((B * Wp, n_rows), jnp.int32),
      grid=(B,),
      in_specs=[_compat.block_spec((ncp, nrp), lambda b: (0, 0)),
                _compat.block_spec((None, SUBLANES, Sr), lambda b: (b, 0, 0)),
                _compat.block_spec((None, SUBLANES, Sc), lambda b: (b, 0, 0))],
      out_specs=_compat.block_spec((Wp, n_rows), lambda b: (b, 0)),
      scratch_shapes=[], num_scalar_prefetch=0, dimension_semantics=("parallel",),
      interpret=interpret, name="flashvjp_tpu_lists",
  )(tab, rows_l, cols_l)
