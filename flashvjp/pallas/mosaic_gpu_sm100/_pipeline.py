"""What the Blackwell kernels share: the K / V TMA ring, the MMA warp's software pipeline, the
masked / unmasked split of a CTA's steps, zeroing a TMEM accumulator.

Room: Pallas Mosaic-GPU backend for Blackwell (the kernels' common steps; see the package
docstring).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

STAGES = 2  # ring slots
CORR_COLS = 32  # TMEM columns moved to / from registers at a time


def stream_kv(n, t, bkv, k_src, v_src, k_s, v_s, k_loaded, v_loaded, k_free, v_free):
  """The TMA warp's step n: K and V rows [t * bkv, (t + 1) * bkv) of `k_src` / `v_src` (refs
  already at their batch and head) into ring slot n % STAGES, each once the MMA that read the
  slot two steps ago has arrived on its free barrier."""
  s = n % STAGES
  rows = pl.ds(t * bkv, bkv)

  @pl.when(n >= STAGES)
  def _():
    plgpu.barrier_wait(k_free.at[s])
  plgpu.copy_gmem_to_smem(k_src.at[rows], k_s.at[s], k_loaded.at[s])

  @pl.when(n >= STAGES)
  def _():
    plgpu.barrier_wait(v_free.at[s])
  plgpu.copy_gmem_to_smem(v_src.at[rows], v_s.at[s], v_loaded.at[s])


def mma_pipeline(steps, start, first, second):
  """The MMA warp's order: `start()`, first(0); for n: first(n + 1), second(n), so the next
  step's first products run while the other warpgroup works on step n (none when steps == 0).
  """
  @pl.when(steps > 0)
  def _():
    start()
    first(0)

  @pl.loop(0, steps)
  def _(n):
    @pl.when(n + 1 < steps)
    def _():
      first(n + 1)
    second(n)


def edge_runs(lo, hi, full, step, carry):
  """`step(i, carry, masked)` for i in [lo, hi): masked outside `full` ([f_lo, f_hi), the
  blocks every pair of which the mask model allows, clipped into [lo, hi)), unmasked inside."""
  f_lo = jnp.clip(full[0], lo, jnp.maximum(hi, lo))
  f_hi = jnp.clip(full[1], f_lo, jnp.maximum(hi, lo))
  for start, stop, masked in ((lo, f_lo, True), (f_lo, f_hi, False), (f_hi, hi, True)):
    carry = lax.fori_loop(start, stop, lambda i, c, masked=masked: step(i, c, masked), carry)
  return carry


def zero_tmem(ref, rows: int, cols: int, layout) -> None:
  """Store 0 into a float32 TMEM accumulator (`rows` x `cols`), CORR_COLS columns at a time,
  and commit: for a CTA whose loop issued no MMA."""
  for c in range(cols // CORR_COLS):
    plgpu.async_store_tmem(ref.at[:, pl.ds(c * CORR_COLS, CORR_COLS)],
                           plgpu.layout_cast(jnp.zeros((rows, CORR_COLS), jnp.float32), layout))
  plgpu.commit_tmem()
