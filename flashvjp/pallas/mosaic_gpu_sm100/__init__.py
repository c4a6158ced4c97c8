"""Pallas Mosaic-GPU kernels for Blackwell (sm_100a): tcgen05 MMAs, TMEM accumulators.

Room: Pallas Mosaic-GPU backend for Blackwell (issue 46). **A prototype, not reachable through
`implementation=`**: one single-CTA forward kernel (`forward.forward`) for one (batch, head),
full attention, head dims 64 / 128, checked in the GPU interpreter with race detection against
float64 naive attention and compiled deviceless for sm_100a. No feature, no backward, no
tangent, no dispatch yet; Blackwell runs Pallas-Triton (docs/blackwell.md says what jax 0.12
offers and what can be verified without a B200). Needs jax >= 0.12 (`tcgen05_mma`, TMEM).
"""
