"""The Mosaic-GPU family as a backend: `forward` / `backward` with the interface of
`flashvjp.pallas.triton` (what `flashvjp._vjp`, the partitioning rule and the ring call; the
tangent kernel is `flashvjp.pallas.mosaic_gpu.tangent`).

Room: Pallas Mosaic-GPU backend. The package keeps its modules `forward` / `backward` as
modules (the kernels' tests import them); this module holds the two entry points. They run the
Hopper (sm_90a) kernels, or, where the program's target is Blackwell (`cfg.gpu_arch ==
"sm_100a"`, from the target's device kind at dispatch), those of
`flashvjp.pallas.mosaic_gpu_sm100`.
"""
from flashvjp.pallas.mosaic_gpu import backward as _hopper_backward
from flashvjp.pallas.mosaic_gpu import forward as _hopper_forward

__all__ = ["forward", "backward"]


def _sm100():
  from flashvjp.pallas.mosaic_gpu_sm100 import backend
  return backend


def forward(cfg, *args, **kw):
  if cfg.gpu_arch == "sm_100a":
    return _sm100().forward(cfg, *args, **kw)
  return _hopper_forward.forward(cfg, *args, **kw)


def backward(cfg, *args, **kw):
  if cfg.gpu_arch == "sm_100a":
    return _sm100().backward(cfg, *args, **kw)
  return _hopper_backward.backward(cfg, *args, **kw)
