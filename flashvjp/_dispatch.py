"""Which implementation runs, and why: decided before tracing, from known limits.

Room: dispatch. Never catches exceptions to choose; the decision is a value
(`Decision`) that `flashvjp.explain` returns and that is logged at debug level.

Names a user may pass (`REQUESTABLE`): None (choose), "pallas" (this platform's
kernel family: Triton on GPU, Mosaic on TPU, Triton in interpret mode on CPU),
"pallas_triton" / "pallas_tpu" / "pallas_mosaic_gpu" (one family: compiled on its own platform,
interpret mode elsewhere unless ``interpret=False`` is passed, which lowers the
compiled kernels, e.g. for ``jax.export(..., platforms=["cuda"])`` on a CPU host),
"blockwise" and "naive". A `Decision.implementation` is always concrete: one of
`CONCRETE`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
from absl import logging

from flashvjp import _config
from flashvjp import _record
from flashvjp import _target

REQUESTABLE = ("pallas", "pallas_triton", "pallas_tpu", "pallas_mosaic_gpu", "blockwise", "naive")
CONCRETE = ("pallas_triton", "pallas_tpu", "pallas_mosaic_gpu", "blockwise", "naive")
# Backward compatibility: the old name of the tuple of accepted names.
IMPLEMENTATIONS = REQUESTABLE

_FAMILY_PLATFORM = {"pallas_triton": "gpu", "pallas_tpu": "tpu", "pallas_mosaic_gpu": "gpu"}


@dataclasses.dataclass(frozen=True)
class Decision:
  implementation: str  # one of CONCRETE
  interpret: bool  # Pallas interpret mode
  reason: str
  # Under jit with the sequence sharded: the context-parallel strategy
  # (flashvjp._strategy.Strategy) the partitioning rule runs; None when not sharded.
  context_parallel: Any = None
  # The program's target (flashvjp._target.Target): the platform and device count the
  # decision was made for (the inputs' shardings, else the abstract mesh, else the host).
  target: Any = None
  # explain(): how the query was read (layout and dims), so a misread layout shows
  reading: str | None = None
  # explain(): how the score_mod / mask_mod reads each array it closes over
  # (`flashvjp._indexing.Operand`: per (b, h), by q / kv position, by kv_idx - q_idx, ...)
  operands: tuple = ()

  @property
  def is_pallas(self) -> bool:
    return self.implementation.startswith("pallas")

  @property
  def forward_mode(self) -> dict:
    """What runs for jvp / grad / hvp / second order on this path (docs/forward_mode.md)."""
    from flashvjp import _vjp  # lazy: _vjp imports the kernels
    return _vjp.forward_mode_paths(self.implementation)

  @property
  def family(self) -> str | None:
    """"triton", "tpu", "mosaic_gpu" or None (not a Pallas path)."""
    return self.implementation.split("_", 1)[1] if self.is_pallas else None

  def __str__(self) -> str:
    mode = " (interpret mode)" if self.is_pallas and self.interpret else ""
    cp = "" if self.context_parallel is None else f"; sequence sharded: {self.context_parallel}"
    tgt = "" if self.target is None else f"; target: {self.target}"
    rd = "" if self.reading is None else f"; {self.reading}"
    ops = "".join(f"; {o}" for o in self.operands)
    return f"{self.implementation}{mode}: {self.reason}{tgt}{cp}{rd}{ops}"


def platform() -> str:
  """The host's default backend (the target when nothing else says; `flashvjp._target`)."""
  return jax.default_backend()


def family_for_platform(plat: str) -> str:
  """The kernel family "pallas" means on `plat` (Triton on GPU and CPU, Mosaic on TPU)."""
  return "pallas_tpu" if _target.home(plat) == "tpu" else "pallas_triton"


def _limits(family: str):
  if family == "pallas_mosaic_gpu":
    from flashvjp.pallas.mosaic_gpu import _limits as mgpu_limits  # the Mosaic-GPU limits
    return mgpu_limits
  if family == "pallas_tpu":
    from flashvjp.pallas.tpu import _limits as tpu_limits  # the Mosaic-TPU limits, encoded once
    return tpu_limits
  from flashvjp.pallas.triton import _limits as triton_limits  # the Triton limits, encoded once
  return triton_limits


def decide(requested, *, interpret, query_shape, key_shape, value_shape, dtype,
           has_score_mod=False, has_dropout=False, score_mod=None,
           score_mod_consts=(), mask_mod=None, mask_mod_consts=(), target=None,
           causal=False) -> Decision:
  """Choose the implementation for `target` (a `flashvjp._target.Target`; None: the host's
  default backend). Raises ValueError for a named Pallas family on an unsupported input.

  On a Hopper target, None / "pallas" runs the Mosaic-GPU family instead of Pallas-Triton
  where a GPU check recorded it valid and faster for the class (head dim, `causal`:
  `_config.MOSAIC_GPU_EARNED`) and it takes the input; a target of unknown kind (a
  deviceless export) keeps Pallas-Triton."""
  decision = _decide(requested, interpret=interpret, query_shape=query_shape,
                     key_shape=key_shape, value_shape=value_shape, dtype=dtype,
                     has_score_mod=has_score_mod, has_dropout=has_dropout, score_mod=score_mod,
                     score_mod_consts=score_mod_consts, mask_mod=mask_mod,
                     mask_mod_consts=mask_mod_consts,
                     plat=_platform_of(target))
  if (requested in (None, "pallas") and decision.implementation == "pallas_triton"
      and not decision.interpret):
    decision = _earned_mosaic(decision, target, causal, query_shape=query_shape,
                              key_shape=key_shape, value_shape=value_shape, dtype=dtype,
                              has_score_mod=has_score_mod, has_dropout=has_dropout,
                              score_mod=score_mod, score_mod_consts=score_mod_consts,
                              mask_mod=mask_mod, mask_mod_consts=mask_mod_consts)
  if decision.implementation == "pallas_mosaic_gpu" and not decision.interpret:
    kind = None if target is None else target.device_kind
    mgpu = _limits("pallas_mosaic_gpu")
    problem = mgpu.device_problem(kind)
    if problem is None and mgpu.gpu_arch(kind) == "sm_100a":
      problem = mgpu.blackwell_problem(query_shape=query_shape, value_shape=value_shape,
                                       has_score_mod=has_score_mod, has_dropout=has_dropout,
                                       mask_mod=mask_mod)
      decision = dataclasses.replace(decision, reason=(
          f"{decision.reason}; the target {kind!r} is Blackwell: the sm_100a kernels"
          " (tcgen05 / TMEM: forward, dQ, dK/dV; no tangent kernel yet, never run on a B200)"))
    if problem is not None:
      raise ValueError(f"implementation='pallas_mosaic_gpu' cannot run on the target: {problem}")
  return dataclasses.replace(decision, target=target)


def mosaic_gpu_arch(target) -> str | None:
  """The compiled Mosaic-GPU kernels' arch for `target` (`AttentionConfig.gpu_arch`)."""
  return _limits("pallas_mosaic_gpu").gpu_arch(None if target is None else target.device_kind)


def _earned_mosaic(decision: Decision, target, causal: bool, **inputs) -> Decision:
  """`decision` (compiled Pallas-Triton), or the Mosaic-GPU family where it earned the
  default on this Hopper target (`_config.MOSAIC_GPU_EARNED`) and takes the input."""
  kind = None if target is None else target.device_kind
  mgpu = _limits("pallas_mosaic_gpu")
  if kind is None or mgpu.device_problem(kind) is not None:
    return decision
  if mgpu.gpu_arch(kind) == "sm_100a":  # Hopper's evidence does not carry over to Blackwell
    return dataclasses.replace(decision, reason=(
        f"{decision.reason}; the target {kind!r} is Blackwell, where the Mosaic-GPU family's"
        " sm_100a kernels have not run on a GPU yet: they become the default only once a GPU"
        " check on a B200 records them valid and faster (implementation='pallas_mosaic_gpu'"
        " runs them now)"))
  head_dim = max(inputs["query_shape"][-1], inputs["value_shape"][-1])
  evidence = _config.mosaic_gpu_earned(head_dim, causal)
  if evidence is None:
    return decision
  ok, why = mgpu.supports(platform="gpu", interpret=False, **inputs)
  if not ok:
    return dataclasses.replace(decision, reason=(
        f"{decision.reason}; the Mosaic-GPU family earned this class ({evidence}) but does not"
        f" take this input: {why}"))
  return Decision("pallas_mosaic_gpu", False, (
      f"the target {kind!r} is Hopper and the launch table records the Mosaic-GPU family"
      f" valid and faster than Pallas-Triton for head_dim {_config.head_dim_bucket(head_dim)},"
      f" causal={bool(causal)} ({evidence}); {why}"))


def _platform_of(target) -> str:
  """The target's platform; the host's (`platform()`) when the target is the default backend."""
  if target is None or target.source == _target.SOURCES[2]:
    return platform()
  return target.platform


def _decide(requested, *, interpret, query_shape, key_shape, value_shape, dtype, has_score_mod,
            has_dropout, score_mod, score_mod_consts, mask_mod, mask_mod_consts,
            plat) -> Decision:
  if requested == "naive":
    return Decision("naive", False, "requested: the reference, differentiated by autodiff")
  if requested == "blockwise":
    return Decision("blockwise", False, "requested: pure-JAX blockwise forward and backward")
  family = family_for_platform(plat) if requested in (None, "pallas") else requested
  native = _target.home(plat) == _FAMILY_PLATFORM[family]
  interp = (not native) if interpret is None else bool(interpret)

  def ask():
    return _limits(family).supports(
        platform=plat, interpret=interp, query_shape=query_shape, key_shape=key_shape,
        value_shape=value_shape, dtype=dtype, has_score_mod=has_score_mod,
        has_dropout=has_dropout, score_mod=score_mod, score_mod_consts=score_mod_consts,
        mask_mod=mask_mod, mask_mod_consts=mask_mod_consts)

  if requested == "pallas" and not native and not interp:
    raise ValueError(
        f"implementation='pallas' with interpret=False on platform {plat!r}: this platform's"
        " kernels run only in interpret mode here; pass interpret=True (or None), or name the"
        " family (implementation='pallas_triton' / 'pallas_tpu') to lower its compiled kernels"
        " for their platform (jax.export)")
  if requested is not None:
    ok, why = ask()
    if not ok:
      raise ValueError(f"implementation={requested!r} cannot run this input: {why}")
    if not interp and not native:
      why += (f" (compiled kernels requested with interpret=False on a {plat!r} host: they only"
              f" run when lowered for {_FAMILY_PLATFORM[family]}, e.g. by jax.export)")
    return Decision(family, interp, f"requested; {why}")
  # requested is None: Pallas where it compiles natively, blockwise elsewhere.
  if not native:
    return Decision("blockwise", False,
                    f"platform is {plat!r}: Pallas would only run in interpret mode there,"
                    " the blockwise pure-JAX path is the fast one")
  if interp:
    return Decision("blockwise", False,
                    f"interpret=True requested on {plat!r}: using blockwise")
  ok, why = ask()
  if not ok:
    return Decision("blockwise", False, f"Pallas kernels do not support this input: {why}")
  return Decision(family, False, f"platform is {plat!r} and {why}")


def log(decision: Decision) -> None:
  """The traced call's decision: a debug log line, and an event for open recorders
  (`flashvjp.record_decisions`)."""
  logging.debug("flashvjp attention path: %s", decision)
  _record.add(_record.Event("dispatch", "call", decision))
