"""Pallas Mosaic-GPU kernels for Hopper (sm_90a): TMA, wgmma, warp specialization.

Room: Pallas Mosaic-GPU backend (under construction, not yet a selectable
implementation). `forward` / `backward` will have the interface of
`flashvjp.pallas.triton` (and `flashvjp.blockwise`). Needs jax >= 0.11.2
(`_compat.MIN_JAX`); on CPU the kernels run under Mosaic-GPU interpret mode
(`plgpu.InterpretGPUParams`, race detection on in the tests).
"""
