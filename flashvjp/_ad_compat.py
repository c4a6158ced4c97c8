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


def define(name: str, impl, abstract_eval, batch_rule, jvp_rule, transpose_rule,
           lowering=None, effects=None) -> Primitive:
  """A multiple-results primitive: impl (a JAX function of the operands and params),
  its abstract evaluation, lowering (`lowering(ctx)` -> the impl to lower there, default
  impl: `mlir.lower_fun(impl)`), batching, JVP and transpose. `effects(*avals, **params)`:
  the impl's effects where it has any (an interpreter's ordered callbacks), so that the
  program threads their tokens into the lowering (`mlir.lower_fun` passes them on)."""
  prim = Primitive(name)
  prim.multiple_results = True
  if _apply_primitive is not None:
    prim.def_impl(functools.partial(_apply_primitive, prim))
  else:  # pragma: no cover
    prim.def_impl(lambda *args, **params: jax.jit(functools.partial(impl, **params))(*args))
  if effects is None:
    prim.def_abstract_eval(abstract_eval)
  else:
    prim.def_effectful_abstract_eval(
        lambda *avals, **params: (abstract_eval(*avals, **params), effects(*avals, **params)))
  if lowering is None:
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=True))
  else:
    mlir.register_lowering(prim, lambda ctx, *args, **params: mlir.lower_fun(
        lowering(ctx), multiple_results=True)(ctx, *args, **params))
  batching.primitive_batchers[prim] = functools.partial(batch_rule, prim)
  ad.primitive_jvps[prim] = jvp_rule
  ad.primitive_transposes[prim] = transpose_rule
  return prim


def traced_effects(fn, avals):
  """The effects of `fn` traced at `avals` (a jaxpr's effect set)."""
  specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
  return jax.make_jaxpr(fn)(*specs).effects


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


# ---- shard_map's varying-manual-axes types (check_vma) -------------------------------
# The set is ``aval.manual_axis_type.varying`` on some releases and ``aval.vma`` on others.

def varying_axes(x) -> frozenset:
  """The manual mesh axes over which `x` varies (empty outside shard_map or without checks)."""
  if not isinstance(x, jax.Array) and not hasattr(x, "aval"):
    return frozenset()  # a Python / numpy constant
  aval = jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)  # type: ignore[attr-defined]  # jax < 0.6
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))


def match_varying(x, ref):
  """`x`, marked as varying over every manual axis over which `ref` varies.

  Loop carries and switch branches must agree on their varying axes under shard_map's
  check_vma; fresh constants (zeros, -inf) are invariant until marked.
  """
  missing = varying_axes(ref) - varying_axes(x)
  if not missing:
    return x
  return jax.lax.pcast(x, tuple(missing), to="varying")


def unify_varying(*xs):
  """Every array of `xs` varying over the union of their varying axes (None stays None).

  A user function traced outside shard_map (a score_mod / mask_mod jaxpr) is evaluated
  with primitives bound directly, which do not insert the casts jnp does: its inputs
  must agree first.
  """
  axes = frozenset().union(*(varying_axes(x) for x in xs if x is not None))
  if not axes:
    return xs
  out = []
  for x in xs:
    missing = () if x is None else tuple(axes - varying_axes(x))
    out.append(jax.lax.pcast(jax.numpy.asarray(x), missing, to="varying") if missing else x)
  return tuple(out)


# Call-like primitives whose body `eval_jaxpr_varying` inlines: (param holding the body).
_INLINE = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
           "core_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
           "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
           "remat": "jaxpr", "checkpoint": "jaxpr"}


def eval_jaxpr_varying(jaxpr, consts, *args, override=None, add_any_as_add: bool = False):
  """`jax.core.eval_jaxpr`, for a jaxpr traced outside shard_map evaluated inside it.

  With check_vma every primitive's operands must agree on their varying axes, and a
  stored jaxpr's literals and constants are invariant: each equation's operands are
  unified first (`unify_varying`), and call-like equations (jit, custom_jvp / custom_vjp
  calls) are inlined so that their bodies get the same treatment (a custom rule's body is
  then differentiated by JAX directly). Without any varying operand this is eval_jaxpr.
  `override(n, invals) -> invals`: rewrites the operands of top-level equation n
  (`flashvjp._aligned`: a slice of a local array at a shifted start). `add_any_as_add`:
  autodiff's accumulation primitive (`add_any`, which the Mosaic-GPU lowering has no rule
  for) is evaluated as `lax.add`, in inlined bodies too.
  """
  from jax.extend import core as ext_core
  if (override is None and not add_any_as_add
      and not any(varying_axes(x) for x in (*consts, *args))):
    return jax.core.eval_jaxpr(jaxpr, consts, *args)
  env: dict = {}

  def read(v):
    return v.val if isinstance(v, ext_core.Literal) else env[v]

  for v, x in zip(list(jaxpr.constvars) + list(jaxpr.invars), [*consts, *args]):
    env[v] = x
  for n, eqn in enumerate(jaxpr.eqns):
    invals = [read(v) for v in eqn.invars]
    if override is not None:
      invals = override(n, invals)
    name = eqn.primitive.name
    if name in _INLINE and _INLINE[name] in eqn.params:
      body = eqn.params[_INLINE[name]]
      inner = getattr(body, "jaxpr", body)
      inner_consts = list(getattr(body, "consts", ()))
      ans = eval_jaxpr_varying(inner, inner_consts, *invals, add_any_as_add=add_any_as_add)
    elif add_any_as_add and name == "add_any":
      ans = jax.lax.add(*unify_varying(*invals))
    else:
      invals = list(unify_varying(*invals))
      bp = eqn.primitive.get_bind_params(eqn.params)
      subfuns, bp = bp if isinstance(bp, tuple) else ((), bp)  # jax < 0.11: (subfuns, params)
      ans = eqn.primitive.bind(*subfuns, *invals, **bp)
    if eqn.primitive.multiple_results or name in _INLINE:
      for v, x in zip(eqn.outvars, ans):
        env[v] = x
    else:
      env[eqn.outvars[0]] = ans
  return [read(v) for v in jaxpr.outvars]


def lowering_has_devices(ctx) -> bool:
  """Whether a lowering context has a device assignment of more than one device (where a
  custom_partitioning call can be partitioned). A one-primitive program evaluated outside
  jit (a `jax.linearize` function called eagerly) is lowered without one, and
  custom_partitioning's lowering then fails."""
  ac = getattr(ctx.module_context, "axis_context", None)
  devices = getattr(ac, "device_assignment", ())
  if type(ac).__name__ == "ShardingContext":
    return devices is not None and len(devices) > 1
  return True
