"""The one place where JAX version differences of the distributed code live.

Room: distributed / compat. Supported: jax 0.10.2 - 0.12 (``jax.shard_map`` with
``check_vma``, ``lax.axis_size``, ``lax.pcast``). The varying-manual-axes set of a type is
``aval.manual_axis_type.varying`` there and ``aval.vma`` in other releases.
"""
from __future__ import annotations

import jax
from jax import lax

shard_map = jax.shard_map  # jax >= 0.10 (pyproject); earlier: jax.experimental.shard_map


def axis_size(axis_name) -> int:
  """Static size of a bound mesh axis; ValueError naming axis_name when it is not bound."""
  try:
    if hasattr(lax, "axis_size"):
      return int(lax.axis_size(axis_name))
    return int(lax.psum(1, axis_name))
  except NameError as e:  # jax raises NameError for an unbound axis name
    raise ValueError(
        f"axis_name {axis_name!r} is not a bound mesh axis: call ring_attention inside"
        f" jax.shard_map over a mesh that has this axis ({e})") from None


def varying_axes(x) -> frozenset:
  """The manual mesh axes over which `x` varies (empty outside shard_map or without checks)."""
  aval = jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)  # type: ignore[attr-defined]  # jax < 0.6
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))


def match_varying(x, ref):
  """`x`, marked as varying over every manual axis over which `ref` varies.

  Loop carries and cond branches must agree on their varying axes under shard_map's
  check_vma; fresh constants (zeros, -inf) are invariant until marked.
  """
  missing = varying_axes(ref) - varying_axes(x)
  if not missing:
    return x
  return lax.pcast(x, tuple(missing), to="varying")


def sum_to_match(ct, primal):
  """A cotangent summed over the manual axes over which it varies but its primal does not.

  An input replicated over an axis (a broadcast bias) is used by every device of it;
  its gradient is the sum of the devices' contributions.
  """
  extra = varying_axes(ct) - varying_axes(primal)
  if not extra:
    return ct
  return lax.psum(ct, tuple(extra))
