"""Pallas Mosaic-GPU kernels for Blackwell (sm_100a): tcgen05 MMAs, TMEM accumulators.

Room: Pallas Mosaic-GPU backend for Blackwell (issue 46). **Not reachable through
`implementation=` yet**: a single-CTA forward kernel (`forward.forward`) with the Hopper
family's interface: [B, H, S, D] layouts, GQA / MQA, causal and window masks from the shared
mask model, any sequence lengths, head dims up to 128; everything else refused by name. It is
checked in the GPU interpreter with race detection against float64 naive attention and compiled
deviceless for sm_100a; so are the backward's dQ and dK / dV kernels (`backward.dq`,
`backward.dkdv`). No tangent kernel and no dispatch yet; Blackwell runs Pallas-Triton
(docs/blackwell.md says what jax 0.12 offers and what can be verified without a B200). Needs
jax >= 0.12 (`tcgen05_mma`, TMEM).
"""
