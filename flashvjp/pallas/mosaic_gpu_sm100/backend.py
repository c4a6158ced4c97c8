"""The Blackwell (sm_100a) kernels as a backend: `forward` / `backward` with the interface of
`flashvjp.pallas.mosaic_gpu.backend` (which calls these where the program's target is Blackwell).

Room: Pallas Mosaic-GPU backend for Blackwell. No tangent kernel yet: the family's `tangent`
refuses sm_100a by name.
"""
from flashvjp.pallas.mosaic_gpu_sm100.backward import backward
from flashvjp.pallas.mosaic_gpu_sm100.forward import forward

__all__ = ["forward", "backward"]
