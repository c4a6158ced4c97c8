"""Every Pallas API spelling the kernels use, in one place.

Room: Pallas compatibility. The kernels import `pl`-level names only from here,
so that a Pallas API change is fixed in this file and nowhere else.

Checked against jax 0.10.2, 0.11.2 and 0.12.0.1:

* ``pl.BlockSpec(block_shape, index_map)``: block shape first in all three (before
  jax 0.4.31 the index map came first); we always pass keywords.
* ``None`` in a block shape squeezes that dimension in all three (``pl.squeezed``
  is the newer spelling of the same thing).
* ``pl.program_id`` / ``pl.ds(start, size)``: same in all three; 0.10.2's
  ``pl.ds`` defaults ``size`` to None, later ones to a sentinel, so we always pass it.
* ``pl.load`` / ``pl.store`` are gone from ``jax.experimental.pallas`` in all three
  (they live in ``jax.experimental.pallas.triton``); the kernels use ``ref[...]``
  indexing, which lowers both in interpret mode and through Triton.
* Triton compiler params: ``jax.experimental.pallas.triton.CompilerParams(num_warps=,
  num_stages=)`` in all three (``TritonCompilerParams`` before jax 0.6,
  ``compiler_params=dict(triton=...)`` before 0.4.32).
* ``interpret=``: a bool in all three (newer versions also take InterpretParams).
"""
from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence

import jax
import jax.extend
import numpy as np
from jax.experimental import pallas as pl

try:  # Triton params are importable on CPU-only installs too; guard for slim builds.
  from jax.experimental.pallas import triton as _plgpu
except ImportError:  # pragma: no cover - only on builds without the Triton module
  _plgpu = None  # type: ignore[assignment]


def program_id(axis: int):
  """The index of this program along grid axis `axis` (traced int32)."""
  return pl.program_id(axis)


def ds(start, size: int):
  """A dynamic slice of static `size` starting at (traced) `start`."""
  return pl.ds(start, size)


def block_spec(block_shape: Sequence[int | None], index_map: Callable) -> pl.BlockSpec:
  """BlockSpec with `None` entries squeezed; `index_map(*program_ids) -> block indices`.

  Python int indices are made int32: with `jax_enable_x64` they would trace as int64,
  which Mosaic-TPU's compiler cannot legalize in an index map ("failed to legalize
  operation 'func.func'", found by the deviceless TPU compile, tests/test_aot.py).
  """
  def index_map_i32(*ids):
    out = index_map(*ids)
    return tuple(np.int32(x) if isinstance(x, int) else x for x in out)
  return pl.BlockSpec(block_shape=tuple(block_shape), index_map=index_map_i32)


def compiler_params(*, interpret: bool, num_warps: int, num_stages: int):
  """Triton compiler params, or None in interpret mode."""
  if interpret:
    return None
  if _plgpu is None or not hasattr(_plgpu, "CompilerParams"):
    raise NotImplementedError(
        "this jax has no jax.experimental.pallas.triton.CompilerParams; "
        "flashvjp's Pallas kernels need jax >= 0.10")
  return _plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def pallas_call(kernel, *, out_shape, grid, in_specs, out_specs, interpret: bool, name: str,
                num_warps: int = 4, num_stages: int = 2):
  """`pl.pallas_call` with the Triton params and interpret flag spelled for this jax."""
  kwargs = dict(out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
                interpret=bool(interpret), name=name)
  params = compiler_params(interpret=interpret, num_warps=num_warps, num_stages=num_stages)
  if params is not None:
    kwargs["compiler_params"] = params
  call = pl.pallas_call(kernel, **kwargs)
  if interpret:
    return call
  from flashvjp.pallas import _on_target  # the compiled kernel, lowered for the program's GPU
  return _on_target.on_target(call)


def eval_jaxpr(jaxpr, consts, *args):
  """Evaluate an open jaxpr (``jax.core.eval_jaxpr`` in all three versions)."""
  return jax.core.eval_jaxpr(jaxpr, consts, *args)


def jaxpr_as_fun(closed_jaxpr):
  """A Python callable evaluating a ClosedJaxpr (``jax.extend.core.jaxpr_as_fun``)."""
  return jax.extend.core.jaxpr_as_fun(closed_jaxpr)


def partial_eval(closed_jaxpr, unknowns):
  """Split a ClosedJaxpr by data dependence on the `unknowns` inputs.

  Returns (known, unknown, residual avals): known(*known inputs) -> residuals;
  unknown(*residuals, *unknown inputs) -> outputs (all outputs are unknown).
  ``partial_eval_jaxpr_nounits`` is private but has this signature in jax 0.10-0.12.
  """
  from jax._src.interpreters import partial_eval as pe
  known, unknown, _, res_avals = pe.partial_eval_jaxpr_nounits(
      closed_jaxpr, list(unknowns), instantiate=True)
  return known, unknown, res_avals


def next_power_of_2(n: int) -> int:
  return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


# ---- Mosaic-TPU spellings (the pallas/tpu kernels) ------------------------------------
# jax 0.11.2 and 0.12.0.1: pltpu.PrefetchScalarGridSpec(num_scalar_prefetch, grid, in_specs,
# out_specs, scratch_shapes), pltpu.CompilerParams(dimension_semantics=...), pltpu.VMEM(shape,
# dtype) scratch, pl.BlockSpec(memory_space=pltpu.SMEM) for a whole array in SMEM,
# pltpu.InterpretParams (the Mosaic simulator; interpret= takes it), pl.CostEstimate.
# Older spellings: pltpu.TPUCompilerParams (jax < 0.6); InterpretParams may be absent.
try:
  from jax.experimental.pallas import tpu as _pltpu
except ImportError:  # pragma: no cover - only on builds without the TPU module
  _pltpu = None  # type: ignore[assignment]


def tpu_compiler_params(dimension_semantics):
  cls = getattr(_pltpu, "CompilerParams", None) or _pltpu.TPUCompilerParams  # type: ignore[attr-defined]  # jax < 0.6
  return cls(dimension_semantics=tuple(dimension_semantics))


def tpu_roll(x, shift, axis: int, *, stride: int | None = None, stride_axis: int | None = None):
  """pltpu.roll: jnp.roll's direction (out[c] = x[c - shift]); with a stride, slice n along
  `stride_axis` rolls by shift + n * stride (a static shift then: Mosaic has no strided
  dynamic rotation)."""
  return _pltpu.roll(x, shift, axis, stride=stride, stride_axis=stride_axis)


def tpu_vmem(shape, dtype):
  """A VMEM scratch buffer of `shape` / `dtype`."""
  return _pltpu.VMEM(tuple(shape), dtype)


def smem_spec(shape: Sequence[int]) -> pl.BlockSpec:
  """The whole (small) array of `shape` in scalar memory (int32 block indices: the default
  index map's would be int64 under `jax_enable_x64`, which Mosaic-TPU cannot compile)."""
  nd = len(shape)
  return pl.BlockSpec(block_shape=tuple(shape), index_map=lambda *ids: (np.int32(0),) * nd,
                      memory_space=_pltpu.SMEM)


def tpu_interpret_params(**kwargs):
  """pltpu.InterpretParams(**kwargs) (DMA / race checking simulator), or None on jax without it."""
  cls = getattr(_pltpu, "InterpretParams", None) or getattr(_pltpu, "TPUInterpretParams", None)
  return None if cls is None else cls(**kwargs)


def cost_estimate(flops: int, transcendentals: int, bytes_accessed: int):
  if not hasattr(pl, "CostEstimate"):
    return None
  return pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals),
                         bytes_accessed=int(bytes_accessed))


def tpu_pallas_call(kernel, *, out_shape, grid, in_specs, out_specs, scratch_shapes,
                    num_scalar_prefetch, dimension_semantics, interpret, name, cost=None):
  """`pl.pallas_call` with a scalar-prefetch grid spec and Mosaic compiler params.

  `interpret`: False (Mosaic), True (the HLO interpreter) or an InterpretParams.
  """
  grid_spec = _pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=num_scalar_prefetch, grid=tuple(grid), in_specs=list(in_specs),
      out_specs=out_specs, scratch_shapes=list(scratch_shapes))
  kwargs = dict(out_shape=out_shape, grid_spec=grid_spec, name=name,
                compiler_params=tpu_compiler_params(dimension_semantics),
                interpret=interpret if not isinstance(interpret, bool) else bool(interpret))
  if cost is not None:
    kwargs["cost_estimate"] = cost
  return pl.pallas_call(kernel, **kwargs)


__all__ = ["block_spec", "compiler_params", "ds", "eval_jaxpr", "jaxpr_as_fun", "partial_eval", "next_power_of_2", "pallas_call", "program_id"]
