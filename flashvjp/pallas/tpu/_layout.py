"""TPU geometry, block visiting lists and the per-tile math of the Mosaic-TPU kernels.

Room: Pallas-TPU backend (shared part). Runs outside the kernels (padding, lists,
lane layouts) or inside a kernel body on one [block_q, block_kv] tile.

Layout rules (Mosaic): the last two dims of every block are multiples of (8, 128) or
equal to the array's. Hence:

* head dims are zero-padded to a multiple of 128 lanes;
* block_q is rounded up to a multiple of 8 (sublanes), block_kv to a multiple of 128
  (kv positions are the lanes of a [block_q, block_kv] score tile);
* per-row vectors (lse, delta, q segment ids) travel lane-broadcast as [.., S, 128]
  (read as a [block_q, 1] column), kv segment ids sublane-broadcast as [B, 8, Skv]
  (read as a [1, block_kv] row), as in JAX's TPU flash / splash attention;
* small per-(batch, head) scalars (score_mod and mask_mod residuals, the dropout seed)
  the global offsets of a ring's chunk pair and the block lists live in SMEM.

Block sparsity: each kernel's innermost ("arbitrary") grid axis walks a compacted
per-row list of the non-empty blocks (`flashvjp._mask.block_lists`, merged here
into one increasing visiting order with a per-entry "needs the elementwise mask"
bit; a mask_mod's block classes join them, resampled to the kernel's blocks). The lists
are scalar-prefetched, the K/V (or Q) index maps read them, and
entries past a row's count repeat the last block, so an idle step issues neither a
DMA nor a matmul. The axis is as long as the longest row allowed by the static
causal / window bounds (`static_width`), never the full kv length for local masks.
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
from flashvjp.pallas import _compat
from flashvjp.pallas.tpu import _interpret
from flashvjp.pallas.tpu import _lists

LANES = 128
SUBLANES = 8
MAX_HEAD_DIM = C.MAX_HEAD_DIM


def div(x, n: int):
  """x // n for traced non-negative int32 x (truncating lax.div: jnp's floor division
  lowers through `sign`, which Mosaic lowers only with a known TPU generation)."""
  return x if n == 1 else lax.div(x, jnp.asarray(n, jnp.int32))


def rem(x, n: int):
  """x % n for traced non-negative int32 x (see `div`)."""
  return jnp.zeros_like(x) if n == 1 else lax.rem(x, jnp.asarray(n, jnp.int32))


def round_up(x: int, m: int) -> int:
  return -(-int(x) // m) * m


def geometry(q_shape, k_shape, v_shape, block_q, block_kv) -> C.Geometry:
  """Static sizes of one TPU kernel: (8, 128)-legal blocks, 128-lane head dims."""
  B, H, Sq, D = q_shape
  Hkv, Skv, Dv = k_shape[1], k_shape[2], v_shape[3]
  bq = round_up(min(block_q, Sq), SUBLANES)
  bk = round_up(min(block_kv, Skv), LANES)
  return C.Geometry(B=B, H=H, Hkv=Hkv, Sq=Sq, Skv=Skv, D=D, Dv=Dv, bq=bq, bk=bk,
                    Dp=round_up(D, LANES), Dvp=round_up(Dv, LANES))


# ---- block visiting lists ----------------------------------------------------------

def _static_ranges(spec: _mask.MaskSpec, g: C.Geometry, by: str):
  """Per row (q block for by="q", kv block for by="kv"): (lo, hi) column block bounds
  from causal / window / padding alone, as Python ints (`MaskSpec.static_block_ranges`:
  numpy, cached; the bounds `_mask.block_classes` applies, so no list is longer)."""
  return spec.static_block_ranges(by, g.bq, g.bk, g.nq, g.nk)


def static_width(cfg: AttentionConfig, g: C.Geometry, by: str) -> int:
  """Length of the list axis: the most blocks any row visits under causal / window."""
  return max(1, max(hi - lo for lo, hi in _static_ranges(C.mask_spec(cfg), g, by)))


def static_tiles(cfg: AttentionConfig, g: C.Geometry, by: str = "q") -> int:
  """(row, column) block pairs inside the static bounds, per (batch, head)."""
  return sum(max(hi - lo, 0) for lo, hi in _static_ranges(C.mask_spec(cfg), g, by))


@dataclasses.dataclass(frozen=True)
class Lists:
  """Static layout of the SMEM block lists (arrays travel as scalar-prefetch args).

  counts: [Bl * Hl * R]; entries: [Bl * Hl * R * W], entry = 2 * block + needs_mask
  (int16 when they fit, else int32; read back as int32). Bl / Hl / R are 1 when the lists do not vary along batch / heads / rows.
  slot_major: entries [W, Bl * Hl * R] (2-D). flagged (the segment-id kernel's lists,
  `_lists.build`): entries int32 [Bl * Wp, R] (slot-major per batch row, Wp = W rounded up
  to 8), entry = 4 * block + 2 * idle + needs_mask; the counts array is unused.
  """

  Bl: int
  Hl: int
  R: int
  W: int
  slot_major: bool = False  # entries [W, Bl * Hl * R] (2-D), not flat [rows * W]
  flagged: bool = False

  @property
  def Wp(self) -> int:
    return round_up(self.W, SUBLANES)

  def row(self, b, h, r):
    bb = b if self.Bl != 1 else 0
    hh = h if self.Hl != 1 else 0
    rr = r if self.R != 1 else 0
    return (bb * self.Hl + hh) * self.R + rr

  def entry(self, ent_ref, b, h, r, s):
    if self.flagged:  # entries [Bl * Wp, R]; Hl == 1
      bb = b if self.Bl != 1 else 0
      return ent_ref[bb * self.Wp + s, r if self.R != 1 else 0]
    if self.slot_major:  # entries [W, Bl * Hl * R]
      return ent_ref[s, self.row(b, h, r)].astype(jnp.int32)
    return ent_ref[self.row(b, h, r) * self.W + s].astype(jnp.int32)

  def block(self, ent_ref, b, h, r, s):
    """Step s's block of row r (what the index maps read)."""
    e = self.entry(ent_ref, b, h, r, s)
    return div(e, 4) if self.flagged else div(e, 2)

  def step(self, cnt_ref, ent_ref, b, h, r, s):
    """(active, block, needs_mask) of step s of row r."""
    e = self.entry(ent_ref, b, h, r, s)
    if self.flagged:
      return rem(e, 4) < 2, div(e, 4), rem(e, 2) == 1
    return s < self.count(cnt_ref, b, h, r), div(e, 2), rem(e, 2) == 1

  def rows(self, entries) -> np.ndarray:
    """The entries as numpy [Bl * Hl * R, W] in the `2 * block + needs_mask` form, row by
    row, whichever way they are stored (tests and benchmarks read the lists so)."""
    if self.flagged:
      e = self._flagged_slots(entries).transpose(0, 2, 1)
      return (2 * (e >> 2) + (e & 1)).reshape(self.Bl * self.R, self.W)
    e = np.asarray(entries)
    return e.T.copy() if self.slot_major else e.reshape(self.Bl * self.Hl * self.R, self.W)

  def host_counts(self, counts, entries) -> np.ndarray:
    """The counts as numpy [Bl * Hl * R] (flagged lists: the active entries per row)."""
    if not self.flagged:
      return np.asarray(counts).reshape(-1)
    return ((self._flagged_slots(entries) & 2) == 0).sum(axis=1).reshape(-1)

  def _flagged_slots(self, entries) -> np.ndarray:
    """Flagged entries as numpy [Bl, W, R] (the slot padding to Wp dropped)."""
    return np.asarray(entries).reshape(self.Bl, self.Wp, self.R)[:, : self.W]

  def count(self, cnt_ref, b, h, r):
    return cnt_ref[self.row(b, h, r)].astype(jnp.int32)


def _entries_dtype(n_cols: int):
  # SMEM is small: int16 words when the entries fit (as splash attention downcasts).
  return np.int16 if 2 * n_cols + 2 < 2**15 else np.int32


@functools.lru_cache(maxsize=512)
def _static_visit_lists(cfg: AttentionConfig, g: C.Geometry, by: str):
  """`visit_lists` for causal / window / padding alone, in numpy (read-only constants)."""
  cls = _mask.static_block_classes(C.mask_spec(cfg), g.bq, g.bk, g.nq, g.nk)
  if by == "kv":
    cls = cls.T
  W = min(static_width(cfg, g, by), cls.shape[-1])
  count, idx = _mask.compact_np(cls != _mask.EMPTY)
  part = np.take_along_axis(cls, idx, axis=-1) == _mask.PARTIAL
  entries = np.where(count[:, None] > 0, 2 * idx + part, 0)[:, :W]
  small = _entries_dtype(cls.shape[-1])
  count, entries = count.astype(small), np.ascontiguousarray(entries).reshape(-1).astype(small)
  count.flags.writeable = entries.flags.writeable = False
  return Lists(1, 1, cls.shape[0], W), count, entries


def visit_lists(cfg: AttentionConfig, g: C.Geometry, q_seg_p, kv_seg_p, mask_p, by: str,
                mod_cls=None):
  """(Lists, counts, entries): one increasing visiting order per row, partial and full merged.

  q_seg_p / kv_seg_p: padded int32 segment ids (or None); mask_p: padded bool mask (or None);
  mod_cls: the mask_mod's block classes at these blocks (`_common.mod_classes`, or None).
  Without any of them (no mask, causal, window, padding) the lists are numpy constants built
  at trace time (`_static_visit_lists`, cached): the program computes nothing for them. With
  them, the device computes the block classes and then the lists from one running count and
  one fusion of compares and sums (`_mask._compact`'s way: no sort, no gather).
  """
  static = q_seg_p is None and mask_p is None and mod_cls is None
  if static and _mask.static_constants_allowed():
    return _static_visit_lists(cfg, g, by)
  spec = C.mask_spec(cfg)
  if mask_p is None and mod_cls is None and _mask.static_constants_allowed():
    # segment ids alone: one kernel builds the lists (`_lists`), when the ids fit its VMEM
    rows, cols = (g.nq, g.nk) if by == "q" else (g.nk, g.nq)
    if _lists.fits(rows, cols, g.Sqp, g.Skvp):
      table = _mask.static_block_classes(spec, g.bq, g.bk, g.nq, g.nk)
      table = table if by == "q" else table.T
      W = min(static_width(cfg, g, by), table.shape[-1])
      q_k, k_k = _sublane_ids(q_seg_p), _sublane_ids(kv_seg_p)
      sides = (q_k, k_k, g.bq, g.bk) if by == "q" else (k_k, q_k, g.bk, g.bq)
      entries = _lists.build(table, *sides, W, _interpret.interpret_arg(cfg))
      return (Lists(q_seg_p.shape[0], 1, rows, W, flagged=True), _UNUSED_COUNTS, entries)
  # `_mask.block_lists`, on classes broadcast to every (q block, kv block): where nothing
  # varies along the rows, block_classes returns a size-1 row dim, which by="kv" would
  # turn into a size-1 column dim.
  cls = _mask.block_classes(spec, q_seg_p, kv_seg_p, mask_p, g.bq, g.bk, g.nq, g.nk, mod_cls)
  cls = jnp.broadcast_to(cls, cls.shape[:2] + (g.nq, g.nk))
  if by == "kv":
    cls = jnp.swapaxes(cls, -1, -2)
  n_cols = cls.shape[-1]
  W = min(static_width(cfg, g, by), n_cols)
  # The visiting order is every non-empty block in increasing order, entry = 2 * block +
  # needs_mask; past the count, the last entry again (0 for an empty row). With c the running
  # count of non-empty blocks and p slot p clipped to count - 1: slot p's block is
  # #{j : c[j] <= p} and it needs the mask when the one block j with c[j] == p + 1 that is
  # non-empty (the first such j) is partial, so the entry is one sum over j (one fusion after
  # the running count; -1 for an empty row makes it 0).
  sel = cls != _mask.EMPTY
  part = cls == _mask.PARTIAL
  # The running count as one matmul with a triangle of ones (exact: 0 / 1 in bfloat16, sums
  # in float32), which XLA fuses with the classification feeding it (a cumsum is a
  # reduce-window of its own).
  tri: np.ndarray | jax.Array
  if _mask.static_constants_allowed():
    tri = np.triu(np.ones((n_cols, n_cols), jnp.bfloat16))  # tri[j', j] = j' <= j
  else:
    tri = (lax.broadcasted_iota(jnp.int32, (n_cols, n_cols), 0)
           <= lax.broadcasted_iota(jnp.int32, (n_cols, n_cols), 1)).astype(jnp.bfloat16)
  c = jnp.dot(sel.astype(jnp.bfloat16), tri, preferred_element_type=jnp.float32)
  c = c.astype(jnp.int32)
  count = c[..., -1]
  Bl, Hl, R = count.shape
  p = lax.broadcasted_iota(jnp.int32, count.shape + (W, 1), count.ndim)
  p = jnp.minimum(p, count[..., None, None] - 1)
  cj = c[..., None, :]  # [..., 1, n_cols]
  small = _entries_dtype(n_cols)
  entries = jnp.sum(2 * (cj <= p).astype(small) + ((cj == p + 1) & part[..., None, :]).astype(small),
                    axis=-1, dtype=small)
  # Stored slot-major (entry of (row, slot) at slot * rows + row): XLA:TPU lays a [rows, W]
  # array with the rows minor when W is small, and reads that layout as this flat order
  # without a relayout copy.
  entries = entries.reshape(Bl * Hl * R, W).T  # [W, rows]: 2-D in SMEM, no flattening relayout
  return Lists(Bl, Hl, R, W, slot_major=True), count.reshape(-1).astype(small), entries


_UNUSED_COUNTS = np.zeros((1,), np.int32)  # flagged lists' counts operand (read by none)
_UNUSED_COUNTS.flags.writeable = False


def _sublane_ids(ids_p):
  """Padded ids [B, S] -> the kernels' sublane-broadcast layout [B, 8, S] int32."""
  return jnp.broadcast_to(ids_p[:, None, :], (ids_p.shape[0], SUBLANES, ids_p.shape[1])
                          ).astype(jnp.int32)


def block_class_table(cfg: AttentionConfig, g: C.Geometry, q_seg_p, kv_seg_p, mask_p,
                      mod_cls=None):
  """(Bl, Hl, flat int8 [Bl * Hl * nq * nk]): EMPTY / PARTIAL / FULL per block pair (SMEM);
  numpy constants without segment ids, a dense mask or a mask_mod."""
  if q_seg_p is None and mask_p is None and mod_cls is None and (
      _mask.static_constants_allowed()):
    return 1, 1, _mask.static_block_classes(C.mask_spec(cfg), g.bq, g.bk, g.nq, g.nk).reshape(-1)
  cls = _mask.block_classes(C.mask_spec(cfg), q_seg_p, kv_seg_p, mask_p, g.bq, g.bk, g.nq,
                            g.nk, mod_cls)
  cls = jnp.broadcast_to(cls, cls.shape[:2] + (g.nq, g.nk))
  return cls.shape[0], cls.shape[1], cls.astype(jnp.int8).reshape(-1)


def maybe_partial(cfg: AttentionConfig, g: C.Geometry, has_seg: bool, has_mask: bool) -> bool:
  """Can any block need the elementwise mask? (Query padding never does.)"""
  return (cfg.causal or cfg.window is not None or has_seg or has_mask
          or cfg.mask_mod is not None or g.Skvp != g.Skv)


# ---- inputs (outside the kernels) ----------------------------------------------------

def lane_rows(x, S):
  """[..., S0] per-row values -> [..., S, 128] (padded, lane-broadcast)."""
  x = C.pad_to(x, x.ndim - 1, S)
  return jnp.broadcast_to(x[..., None], x.shape + (LANES,))


def segments(q_seg, kv_seg, g: C.Geometry):
  """Padded ids (for the lists) and their kernel layouts [B, Sqp, 128] / [B, 8, Skvp]."""
  if q_seg is None:
    return None, None, None, None
  qp, kp = C.pad_segments(q_seg, kv_seg, g)
  q_l = jnp.broadcast_to(qp[:, :, None], qp.shape + (LANES,)).astype(jnp.int32)
  k_l = _sublane_ids(kp)
  return qp, kp, q_l, k_l


@dataclasses.dataclass(frozen=True)
class ConstMeta:
  """How each score_mod residual travels: scalar (SMEM, flat [B * H]) or array (VMEM)."""

  scalar: tuple
  H: int


def const_arrays(split: C.HeadSplit | C.ModSplit, acc):
  """Residuals [B, H, ...] -> kernel arrays (float ones in `acc`, ints in int32)."""
  arrays = []
  for c, sc in zip(split.arrays, split.scalar):
    dt = acc if jnp.issubdtype(c.dtype, jnp.inexact) else jnp.int32
    c = c.astype(dt)
    arrays.append(c.reshape(-1) if sc else c)
  return tuple(arrays)


def load_consts(refs, meta: ConstMeta, b, h):
  return tuple(ref[b * meta.H + h] if sc else ref[b, h] for ref, sc in zip(refs, meta.scalar))


# ---- per-tile math (inside kernel bodies) --------------------------------------------

# Mosaic's contraction precision of float32 operands per setting (JAX's Mosaic lowering:
# DEFAULT -> no attribute (Mosaic's default), HIGH -> bf16x3, HIGHEST -> fp32). Interpret
# mode runs the CPU's IEEE float32 dot whatever the setting (no bf16-pass emulation: the
# tests of this family assert float32 accuracy at every setting).
TPU_F32_PRECISION = {"default": lax.Precision.DEFAULT, "high": lax.Precision.HIGH,
                     "highest": lax.Precision.HIGHEST}


def _dot(a, b, dims, acc, cfg):
  """Float32 accumulation; float32 operands at cfg.precision (`TPU_F32_PRECISION`), full
  float32 in interpret mode."""
  prec = None
  if jnp.dtype(a.dtype) == jnp.float32:
    prec = (lax.Precision.HIGHEST if cfg.interpret
            else TPU_F32_PRECISION[getattr(cfg, "precision", "default")])
  return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=acc)


def dot_nt(a, b, acc, cfg):
  return _dot(a, b, (((1,), (1,)), ((), ())), acc, cfg)


def dot_nn(a, b, acc, cfg):
  return _dot(a, b, (((1,), (0,)), ((), ())), acc, cfg)


def dot_tn(a, b, acc, cfg):
  return _dot(a, b, (((0,), (0,)), ((), ())), acc, cfg)


@dataclasses.dataclass
class Tile:
  """What one [bq, bk] tile's scores may read (already loaded)."""

  b: jax.Array
  h: jax.Array
  i: jax.Array
  j: jax.Array
  bias: jax.Array | None = None  # [bq|1, bk|1]
  mask: jax.Array | None = None  # int8 [bq|1, bk|1]
  q_seg: jax.Array | None = None  # int32 [bq, 1]
  kv_seg: jax.Array | None = None  # int32 [1, bk]
  mod: tuple = ()  # the mask_mod's residuals of (b, h), loaded
  off: tuple | None = None  # global (b0, h0, q0, kv0) int32 scalars (`_common.load_offsets`)
  pos: tuple = ()  # per-position residuals (`_common.PosResiduals`): [bq, 1] then [1, bk]
  mpos: tuple = ()  # the mask_mod's


def load_tile(r, b, h, i, j, mod=(), g: C.Geometry | None = None) -> Tile:
  """Tile inputs from the refs of a kernel whose blocks are this tile's (`mod`: the loaded
  mask_mod residuals; the global offsets from the SMEM ref "offsets", if any; `g`: the
  geometry, for rel rows)."""
  t = Tile(b=b, h=h, i=i, j=j, mod=tuple(mod), off=C.load_offsets(r.get("offsets")))
  if "bias" in r:
    t.bias = r["bias"][...]
  if "mask" in r:
    t.mask = r["mask"][...]
  if "q_seg" in r:
    t.q_seg = r["q_seg"][:, 0:1]
    t.kv_seg = r["kv_seg"][0:1, :]
  t.pos, t.mpos = load_positions(r, "pos", i, j, g), load_positions(r, "mpos", i, j, g)
  return t


def rows_lane_major(g: C.Geometry) -> bool:
  """Whether per-row vectors (lse, delta, q per-position residuals) travel lane-major
  [B, H, 1, Sqp] (block (1, bq), read as a [bq, 1] column): when bq is a multiple of 128
  or the whole padded sequence; else lane-broadcast [B, H, Sqp, 128] (128x the memory)."""
  return g.bq % LANES == 0 or g.nq == 1


def rel_window(g: C.Geometry) -> int:
  """Lanes of the aligned window a tile reads from a rel row (`rel_tile`)."""
  return round_up(g.bq + g.bk - 1 + LANES - 1, LANES)


def position_layouts(pos, g: C.Geometry):
  """Per-position residuals (`_common.PosResiduals`, or None) as kernel arrays: q ones
  lane-major [B, H, 1, Sqp] (or lane-broadcast [B, H, Sqp, 128], `rows_lane_major`), read as
  a [bq, 1] column; kv ones [B, H, 1, Skvp], read as a [1, bk] row; rel rows (by kv_idx -
  q_idx) [B, H, 1, L], element kv - q + Sqp - 1, zero-padded by a window (`rel_tile`). Floats
  keep their dtype (the tile part's jaxpr takes them so), other dtypes travel as int32."""
  if pos is None:
    return (), (), ()
  cast = lambda x: x if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(jnp.int32)
  if rows_lane_major(g):
    qs = tuple(cast(x[..., : g.Sqp])[:, :, None, :] for x in pos.q)
  else:
    qs = tuple(lane_rows(cast(x[..., : g.Sqp]), g.Sqp) for x in pos.q)
  kvs = tuple(cast(x[..., : g.Skvp])[:, :, None, :] for x in pos.kv)
  L = round_up(g.Sqp + g.Skvp, LANES) + rel_window(g)
  rels = tuple(C.pad_to(cast(x[..., pos.rel_slice(g.Sqp, g.Skvp)]), 2, L)[:, :, None, :]
               for x in pos.rel)
  return qs, kvs, rels


def read_column(ref):
  """[bq, 1] column of a per-row block in either layout of `rows_lane_major`."""
  if ref.shape[0] == 1:  # lane-major (1, bq)
    return jnp.expand_dims(ref[0], -1)
  return ref[:, 0:1]


def write_column(ref, col):
  """Write a [bq, 1] column `col` into a per-row output block in either layout."""
  x = jnp.broadcast_to(col, (col.shape[0], LANES))
  if ref.shape[0] == 1:  # lane-major (1, bq) block: a [bq, 128] -> [128, bq] transpose
    x = jnp.transpose(x)[0:1, :]
  ref[...] = x.astype(ref.dtype)


def rel_tile(ref, g: C.Geometry, i, j):
  """Tile (i, j) of a rel row (a [1, L] block, `position_layouts`): [bq, bk], element (r, c)
  = row[j * bk + c - (i * bq + r) + Sqp - 1], a Toeplitz tile. No gather (Mosaic has no
  lane gather from memory): a 128-aligned window load, a uniform dynamic lane roll that
  left-aligns it, a broadcast to bq rows and one static strided roll (row r by r more)."""
  Lw = rel_window(g)
  i, j = jnp.asarray(i, jnp.int32), jnp.asarray(j, jnp.int32)  # int32 shifts under x64 too
  w0 = j * g.bk - (i + 1) * g.bq + g.Sqp  # the element of difference j*bk - (i*bq + bq - 1)
  base = div(w0, LANES) * LANES
  off = w0 - base
  w = ref[:, pl.ds(pl.multiple_of(base, LANES), Lw)]  # [1, Lw]
  w = _compat.tpu_roll(w, rem(Lw - off, Lw), 1)  # w[c] = row[w0 + c]
  x = jnp.broadcast_to(w, (g.bq, Lw))
  # x[r, c] = w[c + bq - 1 - r]; an int32 shift (a Python int would be i64 under x64)
  x = _compat.tpu_roll(x, np.int32(Lw - (g.bq - 1)), 1, stride=1, stride_axis=0)
  return x[:, : g.bk]


def load_positions(r, prefix: str, i, j, g: C.Geometry | None = None) -> tuple:
  """The per-position residual tiles of this step's blocks (`position_layouts`): [bq, 1]
  columns, [1, bk] rows, then [bq, bk] rel tiles (which need the geometry `g`)."""
  rels: tuple = ()
  if C.count_refs(r, f"{prefix}rel"):
    assert g is not None, "rel rows need the geometry"
    rels = tuple(rel_tile(r[f"{prefix}rel{n}"], g, i, j)
                 for n in range(C.count_refs(r, f"{prefix}rel")))
  return (tuple(read_column(r[f"{prefix}q{n}"]) for n in range(C.count_refs(r, f"{prefix}q")))
          + tuple(r[f"{prefix}kv{n}"][0:1, :] for n in range(C.count_refs(r, f"{prefix}kv")))
          + rels)


def scores(cfg: AttentionConfig, g: C.Geometry, q, k, t: Tile, consts, acc, masked,
           diff_consts=None, diff_pos=()):
  """scale * q k^T + bias, score_mod -> (s [bq, bk], ok, score_mod vjp or None).

  The semantics of `flashvjp.pallas._common.scores` (same mask model in local positions,
  the same score_mod call and mask_mod tile part at global int32 indices, t.off added),
  on TPU-shaped segment ids. `ok` is the mask model's
  bool [bq, bk] (None when not `masked`); `s` is unmasked: callers select with `ok`
  against the finite `_common.mask_value`, never -inf, so that no inf is produced inside
  the kernels for finite inputs (`jax.debug_infs`).
  """
  qi, ki = C.tile_indices(g, t.i, t.j)
  ok = None
  if masked:
    # int8 tile widened before the compare (int8 vector compares are not on every TPU).
    dense = None if t.mask is None else (t.mask.astype(jnp.int32) != 0)
    ok = C.mask_spec(cfg).allowed(qi, ki, q_seg=t.q_seg, kv_seg=t.kv_seg, dense=dense)
    if cfg.mask_mod is not None:  # PARTIAL blocks only (FULL ones come with masked=False)
      ok = ok & C.mask_mod_allowed(cfg, t, qi, ki)
  qk = C.masked_scores_for_mod(cfg, dot_nt(q, k, acc, cfg), ok)
  s, sm_vjp = C.biased_modded(cfg, qk, t, qi, ki, consts, acc, diff_consts, diff_pos)
  return s, ok, sm_vjp


def dropout_scale(cfg, g, seed_ref, t: Tile, acc):
  """The shared counter hash, through the same helper as the Triton kernels."""
  return C.dropout_scale(cfg, g, seed_ref, C.TileInputs(b=t.b, h=t.h, i=t.i, j=t.j, off=t.off),
                         acc)


def seed_words(seed):
  """uint32 [2] -> int32 [2] (bit-identical) for SMEM; `_dropout.keep` casts back."""
  return lax.bitcast_convert_type(seed.astype(jnp.uint32), jnp.int32)
