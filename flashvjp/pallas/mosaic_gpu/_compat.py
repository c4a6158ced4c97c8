"""Every Mosaic-GPU Pallas spelling the family uses, in one place (jax 0.11.2-0.12).

Room: Pallas Mosaic-GPU compatibility. The family needs jax >= 0.11.2: the GPU
interpret mode (`plgpu.InterpretGPUParams`) is public from 0.11.1 and 0.11.2 is
the GPU image's version. `unavailable()` says why the family cannot run on this
jax (None when it can), so dispatch refuses it with that reason before tracing.
"""
from __future__ import annotations

import math
import os

import jax

MIN_JAX = (0, 11, 2)


def _version() -> tuple[int, ...]:
  parts = []
  for p in jax.__version__.split(".")[:3]:
    digits = "".join(ch for ch in p if ch.isdigit())
    parts.append(int(digits or 0))
  return tuple(parts)


def unavailable() -> str | None:
  """None when this jax has what the family needs, else the reason (names the version)."""
  if _version() < MIN_JAX:
    need = ".".join(map(str, MIN_JAX))
    return (f"the pallas_mosaic_gpu family needs jax >= {need} (found jax {jax.__version__});"
            " use implementation='pallas_triton' on this jax")
  try:
    from jax.experimental.pallas import mosaic_gpu as _plgpu  # noqa: F401
  except ImportError as e:  # pragma: no cover - a build without Mosaic-GPU Pallas
    return f"jax.experimental.pallas.mosaic_gpu does not import on this install: {e}"
  return None


BLACKWELL_MIN_JAX = (0, 12)


def blackwell_unavailable() -> str | None:
  """Why this jax cannot run the Blackwell (sm_100a) kernels (None when it can). They need
  jax >= 0.12: its tcgen05 MMA / TMEM API and the interpreter they are verified in (jax
  0.11.2's has the API, but its interpreter rejects a barrier whose last completion a warp
  leaves unobserved at exit, which the hardware allows)."""
  missing = unavailable()
  if missing is not None:
    return missing
  mg = plgpu()
  if (_version() < BLACKWELL_MIN_JAX or not hasattr(mg, "tcgen05_mma")
          or not hasattr(mg.Layout, "TCGEN05_TMEM_NATIVE")):
    need = ".".join(map(str, BLACKWELL_MIN_JAX))
    return (f"the Blackwell (sm_100a) Mosaic-GPU kernels need jax >= {need} (tcgen05, TMEM;"
            f" found jax {jax.__version__})")
  return None


def plgpu():
  """The `jax.experimental.pallas.mosaic_gpu` module (after `unavailable()` said None)."""
  from jax.experimental.pallas import mosaic_gpu
  return mosaic_gpu


def interpret_params(detect_races: bool = True):
  """`plgpu.InterpretGPUParams` for CPU runs (simulated SMEM, TMA, barriers, wgmma)."""
  return plgpu().InterpretGPUParams(detect_races=detect_races)


def cpu_pool_threads() -> int:
  """Threads of XLA's CPU client pool: the NPROC environment variable when it is set (XLA
  reads it when the CPU client starts), else the CPUs this process may run on."""
  v = os.environ.get("NPROC", "").strip()
  if v.isdigit():
    return int(v)
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # pragma: no cover - no sched_getaffinity (macOS)
    return os.cpu_count() or 1


def interpret_threads_problem(warpgroups: int, kernel: str) -> str | None:
  """Why the GPU interpreter would hang for a kernel of `warpgroups` warpgroups here, or None.

  The interpreter runs each warpgroup of a CTA as its own program on XLA's CPU client pool,
  and a warpgroup waiting at a barrier holds its pool thread: with fewer pool threads than
  warpgroups the one that must arrive can wait for a thread forever (seen: a 3-warpgroup
  forward on a 1- or 2-thread pool). Checked before tracing, so the answer is an error, not a
  hang. Only the CPU client is concerned (interpret mode on a GPU host runs elsewhere).
  """
  devices = _named_axes_size()
  if devices > 1:
    # Inside shard_map the interpreter treats the mesh's devices as one program: each
    # kernel's clean-up waits at a barrier for the same kernel on every device, so devices
    # that run different kernels (the causal ring skips different chunk pairs) hang there
    return (f"the Mosaic-GPU interpreter cannot run the {kernel} kernel inside shard_map over"
            f" {devices} devices: it ends every kernel with a barrier across the devices, which"
            " hangs when they run different kernels (the causal ring). Run it on one device, or"
            " under plain jax.jit with the sequence sharded (the partitioning rule), or"
            " compiled (interpret=False) on a GPU")
  if jax.default_backend() != "cpu":
    return None
  have = cpu_pool_threads()
  if have >= warpgroups:
    return None
  return (f"the Mosaic-GPU interpreter runs the {kernel} kernel's {warpgroups} warpgroups as"
          f" concurrent programs on XLA's CPU thread pool, which has {have} thread(s) here:"
          f" it would deadlock at the first barrier. Set the environment variable"
          f" NPROC={max(warpgroups, 4)} (or more) before JAX starts (XLA sizes that pool from"
          f" it), or run interpret=False on a GPU")


def _named_axes_size() -> int:
  """The number of devices of the named (shard_map) axes the caller is traced under (1: none);
  what the GPU interpreter reads as the devices of one program."""
  from jax._src import core  # the axis environment (no public spelling in jax 0.11-0.12)
  return int(math.prod(core.get_axis_env().axis_sizes.values()))


# ---- Pallas / Mosaic-GPU spellings the kernels use (jax 0.11.2-0.12) ----------------------

def ds(start, size):
  """`pl.ds`: a dynamic slice of `size` rows from `start`."""
  from jax.experimental import pallas as pl
  return pl.ds(start, size)


def when(cond):
  """`pl.when` (a decorator: run the body where `cond` holds)."""
  from jax.experimental import pallas as pl
  return pl.when(cond)


def run_scoped(fn, *types, collective_axes=None):
  """`pl.run_scoped`: allocate `types`, call fn(*refs); `collective_axes` names the thread
  axis whose warpgroups share the allocation (SMEM tiles and barriers of a CTA)."""
  from jax.experimental import pallas as pl
  if collective_axes is None:
    return pl.run_scoped(fn, *types)
  return pl.run_scoped(fn, *types, collective_axes=collective_axes)


def accumulate(init, fn, *, interpret: bool):
  """``init + A @ B`` for the wgmma(s) ``fn(acc_ref)`` issues: compiled, into an accumulator
  that starts from `init` (`pl.run_state` with `plgpu.ACC.init`: the MMAs add to the carried
  registers, no fresh zeroed accumulator and no add after it); interpreted, into a fresh
  accumulator then added to `init`, because the GPU interpreter does not handle
  `pl.run_state`. The two are the same float32 sum there: the interpreter's wgmma adds the
  whole product to the accumulator at once (a fresh one holds 0 + A @ B)."""
  mg = plgpu()
  if interpret:
    def scoped(acc_ref):
      fn(acc_ref)
      return acc_ref[...]
    return init + run_scoped(scoped, mg.ACC(init.shape, init.dtype))
  from jax.experimental import pallas as pl
  return pl.run_state(fn)(mg.ACC.init(init))


def smem_tile(shape, dtype):
  """An SMEM buffer of 16-bit [..., rows, 64k] tiles in the wgmma operand layout: (8, 64)
  tiling and the 128-byte swizzle (a 16-bit row of 64 elements is 128 bytes)."""
  mg = plgpu()
  return mg.SMEM(shape, dtype, transforms=(mg.TilingTransform((8, 64)),
                                           mg.SwizzleTransform(128)))


def wgmma_tile(x):
  """A [rows, cols] register value in the wgmma accumulator layout."""
  mg = plgpu()
  return mg.layout_cast(x, mg.Layout.WGMMA)


def wgmma_row_vector(x):
  """A [rows] register value in the layout of a wgmma tile reduced over its columns."""
  mg = plgpu()
  return mg.layout_cast(x, mg.Layout.WGMMA.reduce(1))


def wgmma_layout():
  """The wgmma accumulator layout (of a [rows, cols] register tile)."""
  return plgpu().Layout.WGMMA


def wgmma_row_layout():
  """The layout of a per-row vector of a wgmma tile (the tile reduced over its columns)."""
  return plgpu().Layout.WGMMA.reduce(1)


def wgmma_col_layout():
  """The layout of a per-column vector of a wgmma tile (the tile reduced over its rows)."""
  return plgpu().Layout.WGMMA.reduce(0)


def wgmma_iota(shape, dim):
  """int32 iota along `dim` of a [rows, cols] tile in the wgmma accumulator layout."""
  mg = plgpu()
  import jax.numpy as jnp
  return mg.broadcasted_iota(jnp.int32, shape, dim, layout=mg.Layout.WGMMA)


def named_barrier(op: str, base: int, stride: int, num_threads: int) -> None:
  """PTX ``bar.<op>`` (``op``: "arrive" or "sync") on the CTA's hardware named barrier
  ``base + stride * warpgroup`` for `num_threads` threads (a multiple of 32): one instruction,
  no phase to track, as FA3's and tokamax's schedule barriers. The warpgroup index is taken
  from the thread index without a warp broadcast, so ptxas keeps the id in the general
  register the instruction reads (a uniform one would be moved over at every use). Mosaic-GPU
  itself uses ids 0 to 1 + warpgroups (`gpu.barrier` and its warpgroup barriers): kernels
  take theirs from `_limits.NAMED_BARRIER_BASE`. Compiled kernels only: the GPU interpreter
  does not run inline PTX (a kernel keeps an mbarrier form of the same schedule there)."""
  if op not in ("arrive", "sync"):
    raise ValueError(f"op must be 'arrive' or 'sync', got {op!r}")
  if num_threads <= 0 or num_threads % 32:
    raise ValueError(f"num_threads must be a positive multiple of 32, got {num_threads}")
  mg = plgpu()
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith
  from jax.experimental.mosaic.gpu import utils as mgpu_utils

  @mg.inline_mgpu()
  def bar(_):
    i32 = ir.IntegerType.get_signless(32)
    wg = mgpu_utils.warpgroup_idx(sync=False)
    bid = arith.addi(mgpu_utils.c(base, i32), arith.muli(wg, mgpu_utils.c(stride, i32)))
    mgpu_utils.inline_ptx(f"bar.{op} $0, {num_threads};", bid, has_side_effects=True,
                          convergent=True)
  bar()


def opaque_i32(x, dep):
  """`x` (an int32 scalar, the same in the whole warpgroup) through an inline PTX move that
  also takes `dep`: LLVM cannot see through it, so what is computed from the result inside a
  loop whose step `dep` is stays in the loop (not hoisted out of it as loop-invariant).
  Compiled kernels only (inline PTX)."""
  mg = plgpu()
  import jax.numpy as jnp
  from jax._src.lib.mlir import ir
  from jax.experimental.mosaic import gpu as mgpu
  from jax.experimental.mosaic.gpu import utils as mgpu_utils

  @mg.inline_mgpu(arg_types=(mg.Layout.WG_SPLAT, mg.Layout.WG_SPLAT),
                  return_type=mg.ShapeDtypeStruct((), jnp.int32, mg.Layout.WG_SPLAT))
  def mov(_, a, d):
    i32 = ir.IntegerType.get_signless(32)
    r = mgpu_utils.inline_ptx("mov.b32 $0, $1; // $2", a.registers[()], d.registers[()],
                              result_types=i32, has_side_effects=True)
    return mgpu.FragmentedArray.splat(r, (), is_signed=True)
  return mov(x, dep)


# ---- backward kernels (flashvjp/pallas/mosaic_gpu/backward.py) ------------------------

def wide_dkdv_q_tiles() -> bool:
  """Whether this jax's Mosaic compiler fits the plain head-dim-128 dK/dV kernel at q tiles
  of 64 (the dK and dV accumulators, 128 registers a thread, beside [64, 64] P^T / dS^T):
  jax 0.12's does (0 spills, sm_90a ptxas); jax 0.11.2's, the GPU image's, spilled 4 B."""
  return _version() >= (0, 12)


def mma_transforms(dtype, minor: int):
  """SMEM transforms of a wgmma operand tile of `dtype` whose last dim has `minor` elements:
  (8, swizzle bytes) tiles and the largest swizzle (32, 64 or 128 bytes) the row fills."""
  import numpy as np
  pg = plgpu()
  swizzle = min(128, minor * np.dtype(dtype).itemsize)
  return (pg.TilingTransform((8, swizzle // np.dtype(dtype).itemsize)),
          pg.SwizzleTransform(swizzle))


def layouts():
  """(WGMMA, its row vector layout, its column vector layout): the register layouts of a
  wgmma accumulator tile and of a per-row / per-column vector broadcast against it."""
  wgmma = plgpu().Layout.WGMMA
  return wgmma, wgmma.reduce(1), wgmma.reduce(0)


def _gpu_callbacks():
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
  return gpu_callbacks


def interpret_races_found() -> bool:
  """Whether the GPU interpreter's race detector has reported a race since its last reset."""
  return bool(_gpu_callbacks().get_races().races_found)


def reset_interpret_state() -> None:
  """Reset the GPU interpreter's global state (needed after a kernel raised inside it)."""
  _gpu_callbacks().reset_gpu_interpret_mode_state()
