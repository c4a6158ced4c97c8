"""Pallas kernels: shared pieces here, one folder per kernel family.

Room: Pallas backends. `_common` (geometry, padding, score_mod split, per-tile
math) and `_compat` (Pallas API spellings across jax versions) are shared;
`triton/` holds the GPU kernels and `tpu/` the Mosaic-TPU kernels, each with the
same roles (forward, backward, lowering limits). Each family's `forward` /
`backward` have the interface of `flashvjp.blockwise` and are called by the one
custom_vjp in `flashvjp._vjp`.
"""
