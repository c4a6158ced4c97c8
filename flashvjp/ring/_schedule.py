"""The static schedule of a ring call: which chunk pairs meet, with which mask, at which step.

Room: ring / schedule. Python and numpy only (no jax op runs here): everything is known
from the mesh axis size, the layout, the local lengths and the mask's static structure.

Geometry. P devices on the ring axis; device d holds `pieces` of the global sequence:
one (global chunk d, layout "contiguous") or two (global half-chunks d and 2P-1-d,
layout "zigzag", see `flashvjp.to_zigzag`). At ring step s device i holds the K/V of
device j = (i - s) mod P. For every (q piece a, kv piece b) the global origin difference
delta = q_start - kv_start is a Python int for each (s, i), so the pair's causal / window
mask is the one-device mask model at a shifted window (kv <= q + right becomes
kv <= q + (right + delta) in the pair's own positions; `pair_window`): the backends'
static block skipping applies to every pair, and nothing of the mask is re-implemented.

Per (s, a, b) the distinct masks over devices are the branches of one `lax.switch`, with
the per-device branch index a numpy table; `None` is "this device skips the pair". A
step at which every device skips every pair is not taken at all: no compute and no
collective (a window shorter than a chunk rings to its neighbours only).

A mask_mod may carry a static hint, `mask_mod.kv_intervals(q_lo, q_hi)` -> the kv
position intervals [lo, hi) any query in [q_lo, q_hi) may attend (the built-in `chunked`,
`prefix_lm` with concrete lengths, `sliding_window_with_global` have one): pairs outside
them are skipped too. Without a hint every pair of a mask_mod call is computed (its
elementwise mask keeps the result exact).
"""
from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Callable
from collections.abc import Hashable

from flashvjp import _mask

LAYOUTS = ("contiguous", "zigzag")


@dataclasses.dataclass(frozen=True)
class Piece:
  """A contiguous run of the local sequence: local [local, local + length) is global
  [start, start + length)."""

  local: int
  start: int
  length: int


def pieces(layout: str, device: int, num_devices: int, local_len: int) -> tuple[Piece, ...]:
  if layout == "contiguous":
    return (Piece(0, device * local_len, local_len),)
  h = local_len // 2
  return (Piece(0, device * h, h), Piece(h, (2 * num_devices - 1 - device) * h, h))


def pair_window(causal: bool, window, delta: int, len_q: int, len_kv: int):
  """The pair's mask as ("skip",) / ("full",) / ("window", (left, right)) in its own positions.

  One-device semantics (top-left causal, window (left, right) around the diagonal) at
  global positions q = q0 + a, kv = kv0 + c with q0 - kv0 = delta.
  """
  spec = _mask.MaskSpec(causal, window, len_q, len_kv)
  left, right = spec.left, spec.right
  if left is None and right is None:
    return ("full",)
  left = None if left is None else left - delta
  right = None if right is None else right + delta
  # A side that no position pair of the rectangle reaches is no constraint.
  if left is not None and left >= len_q - 1:
    left = None
  if right is not None and right >= len_kv - 1:
    right = None
  if left is None and right is None:
    return ("full",)
  pair = _mask.MaskSpec(False, (left, right), len_q, len_kv)
  ((lo, hi),) = pair.static_block_ranges("q", len_q, len_kv, 1, 1)
  if hi <= lo or (left is not None and right is not None and left + right < 0):
    return ("skip",)
  return ("window", (left, right))


def _hint_allows(hint: Callable | None, q: Piece, kv: Piece) -> bool:
  if hint is None:
    return True
  for lo, hi in hint(q.start, q.start + q.length):
    if max(lo, kv.start) < min(hi, kv.start + kv.length):
      return True
  return False


@dataclasses.dataclass(frozen=True)
class Step:
  """One ring step s: per (q piece, kv piece) pair, the branches and each device's index."""

  shift: int
  pairs: tuple  # ((a, b, branches: tuple of masks, index: tuple[int, ...] per device), ...)


def check_head_groups(groups, heads: int, kv_heads: int, where: str = "") -> int:
  """`ring_head_groups` as an int: a positive int dividing the query and kv head counts
  (`where`: " on each device" for the local counts), else ValueError naming it."""
  if isinstance(groups, bool) or not isinstance(groups, numbers.Integral) or int(groups) < 1:
    raise ValueError(f"ring_head_groups must be a positive int, got {groups!r}")
  groups = int(groups)
  if heads % groups or kv_heads % groups:
    raise ValueError(f"ring_head_groups={groups} must divide num_heads ({heads}) and"
                     f" num_kv_heads ({kv_heads}){where}")
  return groups


@dataclasses.dataclass(frozen=True)
class RingSpec:
  """Static description of one ring call (part of the AttentionConfig: hashable)."""

  axis_name: Hashable
  axis_size: int
  layout: str
  inner: str  # the per-pair backend: "blockwise", "pallas_triton" or "pallas_tpu"
  batch_axis: Hashable | None = None  # mesh axes batch / heads are sharded over, if any:
  head_axis: Hashable | None = None  # the global (b, h) of dropout and score/mask_mod
  mask_mod_hint: Callable | None = None  # `kv_intervals` of the mask_mod (see module doc)
  # K/V all-gathered once and dK/dV reduce-scattered (Llama 3 style, O(seq) memory for
  # K/V) instead of passed around: the same schedule, the chunk in hand sliced locally.
  gather: bool = False
  # The ring run once per group of kv heads (with their query heads), one group after the
  # other: the ring's per-device state (the chunk in flight, the float32 dQ / dK / dV sums)
  # is that of Hkv / head_groups kv heads. 1: every head in one ring.
  head_groups: int = 1
  # Hierarchical ("usp"): the sequence is also sharded over `ulysses_axis` (the inner mesh
  # axes, `ulysses_size` devices), minor to `axis_name`: an all-to-all over it trades the
  # sequence for heads around the ring (`flashvjp.ring._ulysses`), which then runs over
  # `axis_name` on chunks of seq / axis_size for num_heads / ulysses_size heads.
  ulysses_axis: Hashable | None = None
  ulysses_size: int = 1

  def steps(self, causal: bool, window, len_q: int, len_kv: int) -> tuple[Step, ...]:
    return _steps(self.axis_size, self.layout, causal, window, len_q, len_kv,
                  self.mask_mod_hint)


@functools.lru_cache(maxsize=128)
def _steps(n: int, layout: str, causal: bool, window, len_q: int, len_kv: int, hint):
  out = []
  for s in range(n):
    pairs = []
    qps = [pieces(layout, i, n, len_q) for i in range(n)]
    kps = [pieces(layout, (i - s) % n, n, len_kv) for i in range(n)]
    for a in range(len(qps[0])):
      for b in range(len(kps[0])):
        masks = []
        for i in range(n):
          qp, kp = qps[i][a], kps[i][b]
          m = pair_window(causal, window, qp.start - kp.start, qp.length, kp.length)
          if m != ("skip",) and not _hint_allows(hint, qp, kp):
            m = ("skip",)
          masks.append(m)
        if all(m == ("skip",) for m in masks):
          continue
        branches = tuple(dict.fromkeys(masks))  # first-seen order, deduplicated
        pairs.append((a, b, branches, tuple(branches.index(m) for m in masks)))
    if pairs:
      out.append(Step(s, tuple(pairs)))
  return tuple(out)

