"""Lowering limits of the Mosaic-TPU kernels, encoded once.

Room: Pallas-TPU limits. The kernels are not built yet: every input is refused
with that reason, so `implementation="pallas_tpu"` is a clear error and
`implementation=None` on a TPU takes the blockwise path (visible in `explain`).
"""
from __future__ import annotations


def supports(*, platform, interpret, query_shape, key_shape, value_shape, dtype,
             has_score_mod=False, has_dropout=False, score_mod=None, score_mod_consts=()):
  del platform, interpret, query_shape, key_shape, value_shape, dtype
  del has_score_mod, has_dropout, score_mod, score_mod_consts
  return False, "the Mosaic-TPU kernels are not built yet"
