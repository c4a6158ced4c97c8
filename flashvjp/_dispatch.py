"""Which implementation runs, and why: decided before tracing, from known limits.

Room: dispatch. Never catches exceptions to choose; the decision is a value
(`Decision`) that `flashvjp.explain` returns and that is logged at debug level.
"""
from __future__ import annotations

import dataclasses

import jax
from absl import logging

IMPLEMENTATIONS = ("pallas", "blockwise", "naive")


@dataclasses.dataclass(frozen=True)
class Decision:
  implementation: str  # "pallas", "blockwise" or "naive"
  interpret: bool  # Pallas interpret mode
  reason: str

  def __str__(self):
    mode = " (interpret mode)" if self.implementation == "pallas" and self.interpret else ""
    return f"{self.implementation}{mode}: {self.reason}"


def platform() -> str:
  return jax.default_backend()


def decide(requested, *, interpret, query_shape, key_shape, value_shape, dtype,
           has_score_mod=False, has_dropout=False, score_mod=None,
           score_mod_consts=()) -> Decision:
  """Choose the implementation. Raises ValueError for "pallas" on an unsupported input."""
  plat = platform()
  interp = (plat == "cpu") if interpret is None else bool(interpret)
  if requested == "naive":
    return Decision("naive", False, "requested: the reference, differentiated by autodiff")
  if requested == "blockwise":
    return Decision("blockwise", False, "requested: pure-JAX blockwise forward and backward")
  from flashvjp.pallas import _limits  # the lowering limits, encoded once
  ok, why = _limits.supports(platform=plat, interpret=interp, query_shape=query_shape,
                             key_shape=key_shape, value_shape=value_shape, dtype=dtype,
                             has_score_mod=has_score_mod, has_dropout=has_dropout,
                             score_mod=score_mod, score_mod_consts=score_mod_consts)
  if requested == "pallas":
    if not ok:
      raise ValueError(f"implementation='pallas' cannot run this input: {why}")
    return Decision("pallas", interp, f"requested; {why}")
  # requested is None: Pallas where it compiles natively, blockwise elsewhere.
  if plat not in ("gpu", "cuda", "rocm"):
    return Decision("blockwise", False,
                    f"platform is {plat!r}: Pallas would only run in interpret mode there,"
                    " the blockwise pure-JAX path is the fast one")
  if interp:
    return Decision("blockwise", False, "interpret=True requested on a GPU: using blockwise")
  if not ok:
    return Decision("blockwise", False, f"Pallas kernels do not support this input: {why}")
  return Decision("pallas", False, f"platform is {plat!r} and {why}")


def log(decision: Decision) -> None:
  logging.debug("flashvjp attention path: %s", decision)
