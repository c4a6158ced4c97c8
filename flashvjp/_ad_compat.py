"""JAX primitive-definition API used by forward mode (`flashvjp._vjp`), in one place.

Room: compatibility. Supported: jax 0.10.2, 0.11.2 and 0.12. Everything forward mode
needs to define its two primitives (a tangent pass and its derivative) is public in all
three: `jax.extend.core.Primitive`, `jax.interpreters.{ad, batching, mlir}`
(`ad.primitive_jvps`, `ad.primitive_transposes`, `ad.Zero`, `ad.UndefinedPrimal`,
`batching.primitive_batchers`, `mlir.lower_fun`) and
`jax.custom_derivatives.SymbolicZero`. Only the eager implementation of a primitive
(`apply_primitive`: compile the primitive alone, as jax's own primitives do) is internal;
it is imported here, with a plain jit fallback should it move.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import Primitive
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir

_apply_primitive: Callable[..., Any] | None
try:  # jax 0.10.2-0.12: the same function
  from jax._src.dispatch import apply_primitive as _apply_primitive
except ImportError:  # pragma: no cover
  _apply_primitive = None

Zero = ad.Zero
UndefinedPrimal = ad.UndefinedPrimal
not_mapped = getattr(batching, "not_mapped", None)  # None on jax 0.10.2-0.12


def define(name: str, impl, abstract_eval, batch_rule, jvp_rule, transpose_rule) -> Primitive:
  """A multiple-results primitive: impl (a JAX function of the operands and params),
  its abstract evaluation, lowering (`mlir.lower_fun(impl)`), batching, JVP and transpose."""
  prim = Primitive(name)
  prim.multiple_results = True
  if _apply_primitive is not None:
    prim.def_impl(functools.partial(_apply_primitive, prim))
  else:  # pragma: no cover
    prim.def_impl(lambda *args, **params: jax.jit(functools.partial(impl, **params))(*args))
  prim.def_abstract_eval(abstract_eval)
  mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=True))
  batching.primitive_batchers[prim] = functools.partial(batch_rule, prim)
  ad.primitive_jvps[prim] = jvp_rule
  ad.primitive_transposes[prim] = transpose_rule
  return prim


def aval_like(aval, shape):
  """`aval` (a ShapedArray: dtype, and on jax 0.12 its manual-axis / vma type under
  shard_map) with another shape."""
  return aval.update(shape=tuple(shape), weak_type=False)


def is_zero(t) -> bool:
  """A symbolic zero tangent (inside a custom_jvp rule or a primitive rule)."""
  return t is None or isinstance(t, (Zero, SymbolicZero))


def instantiate(t):
  """A symbolic zero as a zeros array of its aval (tangent dtype); else t."""
  if isinstance(t, Zero):
    return ad.instantiate_zeros(t)
  if isinstance(t, SymbolicZero):
    return jax.numpy.zeros(t.shape, t.dtype)
  return t
