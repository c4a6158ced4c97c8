"""What a compiled program decided: events recorded while tracing and partitioning.

Room: foundations. `flashvjp.explain` answers before tracing, from the inputs it is given;
inside `jax.jit` with shardings applied there (`with_sharding_constraint`,
`jit(in_shardings=...)`) the partitioning rule decides the context-parallel strategy only
when XLA partitions the program. `record_decisions()` collects both: each traced call's
dispatch decision (which implementation, for which target) and each partitioned pass's
plan (forward / backward / tangent: the strategy, or the sequence whole, and the mesh
axes). Writers call `add`; nothing is recorded unless a recorder is open.

A cached executable is not traced or partitioned again, so it records nothing: record
around the first compile (or a fresh `jax.jit`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

STAGES = ("dispatch", "partition")


@dataclasses.dataclass(frozen=True)
class Event:
  """One decision. stage "dispatch": `detail` is the call's `flashvjp.Decision`;
  stage "partition": `detail` is the `flashvjp._strategy.Strategy` of the sequence-sharded
  pass (None: the sequence is whole on each device) and `axes` the mesh axes of (batch,
  heads, sequence)."""

  stage: str  # one of STAGES
  kind: str  # "call", or the partitioned pass: "forward", "backward", "tangent"
  detail: Any
  axes: tuple = ()

  def __str__(self) -> str:
    if self.stage == "dispatch":
      return f"dispatch: {self.detail}"
    b, h, s = (self.axes + (None, None, None))[:3]
    split = f"batch over {b}, heads over {h}, sequence over {s}"
    what = "sequence whole" if self.detail is None else str(self.detail)
    return f"partition ({self.kind}; {split}): {what}"


_ACTIVE: list[list[Event]] = []
_LOCK = threading.Lock()  # XLA may call the partitioner from another thread


def add(event: Event) -> None:
  """Append `event` to every open recorder (no-op when none is open)."""
  with _LOCK:
    for rec in _ACTIVE:
      rec.append(event)


@contextlib.contextmanager
def record_decisions() -> Iterator[list[Event]]:
  """Collect the decisions made while tracing and compiling inside the block::

      with flashvjp.record_decisions() as events:
        jax.jit(step).lower(x).compile()     # or a first call
      for e in events:
        print(e)   # dispatch: ...; partition (forward; ...): ulysses ...

  Yields a list of `Event` records, filled as the program is traced (stage "dispatch", one per
  flash_attention call) and partitioned (stage "partition", one per sharded pass).
  """
  rec: list[Event] = []
  with _LOCK:
    _ACTIVE.append(rec)
  try:
    yield rec
  finally:
    with _LOCK:
      _ACTIVE.remove(rec)
