"""Pallas Mosaic-GPU kernels for Blackwell (sm_100a): tcgen05 MMAs, TMEM accumulators.

Room: Pallas Mosaic-GPU backend for Blackwell (issue 46). `implementation="pallas_mosaic_gpu"`
runs these where the program's target is Blackwell (`flashvjp.pallas.mosaic_gpu.backend` reads
`cfg.gpu_arch`, set at dispatch from the target's device kind; `backend` here holds the entry
points): a single-CTA forward (`forward.forward`) and the backward's dQ and dK / dV kernels
(`backward.dq`, `backward.dkdv`), with the Hopper family's interface: [B, H, S, D] layouts,
GQA / MQA, causal and window masks from the shared mask model, any sequence lengths, head dims
up to 128; everything else refused by name, forward mode included (no tangent kernel yet).
Checked in the GPU interpreter with race detection against float64 naive attention and its
autodiff, and compiled deviceless for sm_100a; never run on a B200, so `None` / `"pallas"` keep
Pallas-Triton on Blackwell (docs/blackwell.md). Needs jax >= 0.12 (`tcgen05_mma`, TMEM).
"""
