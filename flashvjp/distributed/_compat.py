"""The one place where JAX version differences of the distributed code live.

Room: distributed / compat. Supported: jax 0.10.2 - 0.12 (``jax.shard_map`` with
``check_vma``, ``lax.axis_size``, ``lax.pcast``). The varying-manual-axes set of a type is
``aval.manual_axis_type.varying`` there and ``aval.vma`` in other releases.
"""
from __future__ import annotations

import jax
from jax import lax

# The varying-axes helpers live with the ring backend (a floor below); re-exported here.
from flashvjp.ring._compat import match_varying  # noqa: F401
from flashvjp.ring._compat import sum_to_match  # noqa: F401
from flashvjp.ring._compat import varying_axes  # noqa: F401

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

