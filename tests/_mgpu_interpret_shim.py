"""A shim for the Mosaic-GPU interpreter with the sequence sharded over virtual CPU devices.

At the end of every kernel the interpreter (jax 0.11.2 - 0.12.x) asserts that no barrier is
allocated anywhere in the process (`GPUSharedMemory.assert_no_barriers_allocated`). With
several virtual devices their kernels run at the same time, so a kernel that ends while
another device's kernel holds its barriers fails the check although neither leaks (a
one-kernel program under shard_map over 2 devices fails it; `tests/test_pallas_mosaic_gpu_
sharded.py::test_the_shim_is_needed_and_enough`). `deferred_barrier_check` moves the check
to the end of the whole program: inside the block the per-kernel check is off; leaving it
runs the interpreter's own check once, when every device is done. Everything else (race
detection, barrier phases, SMEM per device) is the interpreter's, unchanged.
"""
from __future__ import annotations

import contextlib

import jax

# The interpreter versions this shim was written against: others are refused (check the
# interpreter again, then extend the list or drop the shim).
PINNED = ((0, 11, 2), (0, 12, 0))


def applies() -> bool:
  version = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())
  return PINNED[0] <= version <= PINNED[1]  # 0.12.0.1 reads as (0, 12, 0)


@contextlib.contextmanager
def deferred_barrier_check():
  """Inside: no per-kernel check of leftover barriers; on exit: the interpreter's check once."""
  if not applies():
    raise RuntimeError(f"tests/_mgpu_interpret_shim.py is pinned to jax {PINNED}, found"
                       f" {jax.__version__}: check the interpreter's barrier check again")
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
  from jax._src.pallas.mosaic_gpu.interpret import shared_memory
  cls = shared_memory.GPUSharedMemory
  check = cls.assert_no_barriers_allocated
  cls.assert_no_barriers_allocated = lambda self: None
  try:
    yield
  finally:
    cls.assert_no_barriers_allocated = check
  if gpu_callbacks._shared_memory is not None:  # pylint: disable=protected-access
    check(gpu_callbacks._get_shared_memory())  # pylint: disable=protected-access
