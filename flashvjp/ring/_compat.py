"""The one place where JAX version differences of the ring backend live.

Room: ring / compat. Supported: jax 0.10.2 - 0.12. The varying-manual-axes set of a type
is ``aval.manual_axis_type.varying`` on some releases and ``aval.vma`` on others;
``lax.pcast`` marks a value varying (shard_map's check_vma).
"""
from __future__ import annotations

from jax import lax

from flashvjp._ad_compat import match_varying  # noqa: F401  (re-exported)
from flashvjp._ad_compat import varying_axes


def sum_to_match(ct, primal):
  """A cotangent summed over the manual axes over which it varies but its primal does not.

  An input replicated over an axis (a broadcast bias, score_mod's arrays) is used by every
  device of it; its gradient is the sum of the devices' contributions.
  """
  extra = varying_axes(ct) - varying_axes(primal)
  if not extra:
    return ct
  return lax.psum(ct, tuple(extra))
