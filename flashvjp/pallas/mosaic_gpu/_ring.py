"""The ring protocol of the Mosaic-GPU backward kernels (Hopper, sm_90a), shared with the
d(rel) and tangent kernels.

Room: Pallas Mosaic-GPU backend (backward), below `backward`, `drel` and `tangent`, which
all import it. Two warpgroups per program: warpgroup 1 streams each step's tiles by TMA into
a ring of SMEM slots (`_produce`, one "loaded" barrier per buffer and slot, waiting on the
slot's "free" barrier before a refill), warpgroup 0 waits for a slot (`_wait_loaded`), reads
it (`_slot_inputs`, SS-wgmma `_mm_t2`) and frees it. Here too: the TMA sources of a block /
pair tile / rel window, the operand name classes (per-q vectors, per-kv-position words, rel
rows), the visit-list rows, the interpret-mode parameters and the test-only fault injection
(`_TEST_MUTATION`: one synchronisation step removed, so the race detector can be shown to
catch it).
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from flashvjp.pallas import _common as C
from flashvjp.pallas.mosaic_gpu import _compat
from flashvjp.pallas.mosaic_gpu import _rel

_STAGES = 2  # ring slots of the streamed operands
_BLOCK = 64  # block_q = block_kv: one wgmma M tile per compute warpgroup
_WARPGROUPS = 2  # per CTA (every kernel)

# Test-only fault injection (tests/test_pallas_mosaic_gpu_backward.py): a name from
# _MUTATIONS removes one synchronisation step so the interpreter's race detector can be
# shown to catch it. Read when the kernels are traced; never set outside tests.
_MUTATIONS = ("skip_loaded_wait", "skip_free_wait", "skip_lse_fence", "skip_dbias_wait",
              "skip_drel_free_wait", "skip_drel_fence")  # the last two: the d(rel) kernel's
_TEST_MUTATION: str | None = None
_DETECT_RACES = True  # interpret mode: race detection on (the tests assert none)


def _i32(x):
  """A scalar as int32 (with jax_enable_x64 a Python int would make int64 indices)."""
  return jnp.asarray(x, jnp.int32)


def _mutated(name: str) -> bool:
  return _TEST_MUTATION == name


def _smem(shape, dtype, minor):
  """A wgmma operand tile in SMEM, swizzled for rows of `minor` elements: every operand of
  one wgmma must share its swizzle, so a kernel uses one for all its tiles (the narrowest
  tile's)."""
  return _compat.plgpu().SMEM(shape, dtype, transforms=_compat.mma_transforms(dtype, minor))


def _mm_t2(shape, a1, b1, a2, b2):
  """(a1 @ b1^T, a2 @ b2^T) on the tensor cores (SS-wgmma, operands in SMEM), both issued
  before either is read back (one wgmma wait for the two): [M, N] each."""
  plgpu = _compat.plgpu()

  def body(acc1, acc2):
    plgpu.wgmma(acc1, a1, b1.T)
    plgpu.wgmma(acc2, a2, b2.T)
    return acc1[...], acc2[...]

  return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))


def _wait_loaded(loaded, slot):
  plgpu = _compat.plgpu()
  for n_bar, bar in enumerate(loaded):
    if n_bar == 0 and _mutated("skip_loaded_wait"):
      continue
    plgpu.barrier_wait(bar.at[slot])


def _produce_step(t, fill, free, stages=_STAGES, mutation="skip_free_wait"):
  """The producer's step t: its operands into slot t % stages (`fill(slot)` issues the TMA
  copies), once the consumer freed the slot's previous step (the wait a test removes with
  `mutation`)."""
  plgpu = _compat.plgpu()
  slot = lax.rem(t, _i32(stages))
  if not _mutated(mutation):
    @pl.when(t >= stages)
    def _wait_free():
      plgpu.barrier_wait(free.at[slot])
  fill(slot)


def _produce(total, fill, free, stages=_STAGES, mutation="skip_free_wait"):
  """The producer warpgroup's loop over steps [0, total) (`fill(t, slot)`)."""
  def body(t, carry):
    _produce_step(t, functools.partial(fill, t), free, stages, mutation)
    return carry

  lax.fori_loop(_i32(0), total, body, None)


def _visit_row(r, b, h, row):
  """Row `row` of the kernel's visit lists (`backward._visit_lists`, `drel._diagonal_visits`)
  for (b, h), or None without lists: (n_partial, n_full, the block of step n), read as
  scalars from GMEM."""
  if "visits" not in r:
    return None
  ref = r["visits"]
  ref = ref.at[b if ref.shape[0] != 1 else 0, h if ref.shape[1] != 1 else 0, row]
  return ref[0], ref[1], lambda n: ref[2 + n]


def _block(ref, b, h, sl):
  """The TMA source of one block of a [B, H, S, D], [B, H, S] or [B, S] operand."""
  if len(ref.shape) == 4:
    return ref.at[b, h, sl, :]
  if len(ref.shape) == 3:
    return ref.at[b, h, sl]
  return ref.at[b, sl]


# Operands with both seq dims ([B|1, H|1, Sqp, Skvp]): a tile depends on both blocks, so it
# always streams with the loop; the dK/dV kernel reads the transposed copy ("...T": its
# [bk, bq] tiles).
_PAIRS = ("bias", "mask")


def _pair_tile(ref, b, h, rows, cols):
  """The TMA source of one tile of a [B|1, H|1, S1, S2] operand (mask, bias)."""
  return ref.at[b if ref.shape[0] != 1 else 0, h if ref.shape[1] != 1 else 0, rows, cols]


def _load_mask(ref):
  """bool tile of an int8 mask tile in SMEM, in the wgmma accumulator's layout (a generic
  load: the tile is not swizzled, so not the optimized path)."""
  wgmma_layout, _, _ = _compat.layouts()
  return _compat.plgpu().load(ref, layout=wgmma_layout, optimized=False) != 0


# Per-q vectors broadcast to a tile (loaded from SMEM with the wgmma layout's row / column
# vector layout); the kv ones ("kv_seg") are per kv position.
_Q_VECTORS = ("q_seg", "cq", "cq2", "kv0", "qg", "qm")


def _is_q_vector(name: str) -> bool:
  """A per-q word travelling like lse: segment ids, dropout words, the score_mod's global
  q index, per-head residuals ("res<n>") and per-q-position ones ("qres<n>"), their
  tangents ("tres<n>", "tqres<n>": the tangent kernel's), the mask_mod's ("qm", "mres<n>",
  "mqres<n>")."""
  return name in _Q_VECTORS or name.startswith(("res", "mres", "tres", "qres", "mqres",
                                                "tqres"))


def _is_rel(name: str) -> bool:
  """A row by kv_idx - q_idx (the score_mod's "relres<n>", the mask_mod's "mrelres<n>", the
  tangents' "trelres<n>"): [B, H, Sqp + Skvp] in `backward._inputs`, the skewed array [B, H, 64,
  width] (`_rel`) in a kernel, whose ring takes one [rows, cols] window per step."""
  return name.startswith(("relres", "mrelres", "trelres"))


def _rel_window(r, name, b, h, q0, k0, g: C.Geometry, transposed: bool):
  """The TMA source of the window of skewed rel array `name` (`_rel`, made by
  `backward._launch` and `drel.rel_grads` at the operands' padded lengths) that is the tile
  of queries q0.. against keys k0..: [bk, bq] with keys as rows when `transposed` (the dK/dV
  kernel's tiles), else [bq, bk]."""
  rows, cols = (g.bk, g.bq) if transposed else (g.bq, g.bk)
  start = _rel.window_start(q0, k0, r["q"].shape[2], rows, r["k"].shape[2], transposed)
  return r[name].at[_rel.batch_index(r[name], b), h, :, pl.ds(start, cols)]


def _is_kv_vector(name: str) -> bool:
  """A per-(b, h, kv position) word: the score_mod's per-kv-position residuals ("kvres<n>"),
  their tangents ("tkvres<n>"), the mask_mod's ("mkvres<n>"). [B, H, Skvp]: indexed by the
  query head (unlike K / V and the kv segment ids)."""
  return name.startswith(("kvres", "mkvres", "tkvres"))


def _slot_inputs(rs, slot, vecs, shape):
  """`vecs` with the kv side of ring slot `slot` read generically into [bq, bk] tiles
  (`shape`): kv segment ids and per-kv-position words ([bk] each, broadcast), the dense mask
  ("dense"), the bias (float32) and the rel windows."""
  plgpu = _compat.plgpu()
  wgmma_layout, _, col = _compat.layouts()
  v = dict(vecs)
  for name in rs:
    if name == "kv_seg" or _is_kv_vector(name):
      v[name] = lax.broadcast_in_dim(plgpu.load(rs[name].at[slot], layout=col), shape, [1])
  if "mask" in rs:
    v["dense"] = _load_mask(rs["mask"].at[slot])
  if "bias" in rs:
    v["bias"] = plgpu.load(rs["bias"].at[slot], layout=wgmma_layout,
                           optimized=False).astype(jnp.float32)
  for name in rs:
    if _is_rel(name):
      v[name] = plgpu.load(rs[name].at[slot], layout=wgmma_layout, optimized=False)
  return v


def _interpret(cfg):
  return _compat.interpret_params(detect_races=_DETECT_RACES) if cfg.interpret else None
