"""Pallas Mosaic-GPU kernels for Hopper (sm_90a): TMA, wgmma, warp specialization.

Room: Pallas Mosaic-GPU backend, `implementation="pallas_mosaic_gpu"` (named only: `"pallas"`
and `None` keep choosing Pallas-Triton on GPUs until a run on a real GPU has shown this family
valid and faster). `backend.forward` / `backend.backward` and `tangent.tangent` (the fused
forward-mode pass) have the interface of `flashvjp.pallas.triton` (and `flashvjp.blockwise`).
`_limits` says what the kernels take. Needs jax >=
0.11.2 (`_compat.MIN_JAX`) and, compiled, a Hopper GPU; on CPU the kernels run under Mosaic-GPU
interpret mode (`plgpu.InterpretGPUParams`, race detection on).
"""
