"""Lowering limits of the Pallas kernels, encoded once. (Placeholder until the kernels land.)"""


def supports(*, platform, interpret, query_shape, key_shape, value_shape, dtype,
             has_score_mod=False, has_dropout=False):
  return False, "the Pallas kernels are not implemented yet"
