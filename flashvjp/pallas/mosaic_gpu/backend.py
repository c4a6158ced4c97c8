"""The Mosaic-GPU family as a backend: `forward` / `backward` with the interface of
`flashvjp.pallas.triton` (what `flashvjp._vjp`, the partitioning rule and the ring call; the
tangent kernel is `flashvjp.pallas.mosaic_gpu.tangent`).

Room: Pallas Mosaic-GPU backend. The package keeps its modules `forward` / `backward` as
modules (the kernels' tests import them); this module holds the two entry points.
"""
from flashvjp.pallas.mosaic_gpu.backward import backward
from flashvjp.pallas.mosaic_gpu.forward import forward

__all__ = ["forward", "backward"]
