"""The Mosaic-TPU kernels' test hook: interpret mode under the Mosaic simulator.

Room: Pallas-TPU backend, below `forward` / `backward` / `tangent` (read when they build a
pallas_call, `forward.interpret_arg`) and the partitioning rule (`_partition`: the
simulator's callbacks are ordered effects, which custom_partitioning cannot lower).

`INTERPRET_PARAMS`: when set to a `pltpu.InterpretParams` (see
`flashvjp.pallas._compat.tpu_interpret_params`), interpret-mode calls run under the Mosaic
simulator (VMEM, DMA, semaphores, race detection) instead of the HLO interpreter. Set by
tests only (monkeypatch).
"""
from __future__ import annotations

from typing import Any

INTERPRET_PARAMS: Any = None


def interpret_arg(cfg) -> Any:
  """What pallas_call's interpret= gets: False, True or the test hook's InterpretParams."""
  if cfg.interpret and INTERPRET_PARAMS is not None:
    return INTERPRET_PARAMS
  return bool(cfg.interpret)
