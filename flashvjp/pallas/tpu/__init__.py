"""Pallas Mosaic-TPU kernels: forward that saves logsumexp, hand-written backward.

Room: Pallas-TPU backend. `forward` / `backward` have the interface of
`flashvjp.pallas.triton` (and `flashvjp.blockwise`); `_limits` says what the
Mosaic-TPU lowering can take; `_layout` holds the TPU geometry, the block visiting
lists and the per-tile math. Compiled on a TPU, interpret mode elsewhere.

`_interpret.INTERPRET_PARAMS`: a test hook. When set to a `pltpu.InterpretParams` (see
`flashvjp.pallas._compat.tpu_interpret_params`), interpret-mode calls run under the
Mosaic simulator (VMEM, DMA, semaphores, race detection) instead of the HLO interpreter.
"""
from flashvjp.pallas.tpu.backward import backward
from flashvjp.pallas.tpu.forward import forward

__all__ = ["forward", "backward"]
