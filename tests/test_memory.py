"""Compiled memory (memory_analysis) of fwd+bwd grows linearly with seq for blockwise.

conftest.py sets the CPU fusion flag that makes fused dots report their buffers.
"""
import jax
import jax.numpy as jnp
import pytest

import flashvjp


def temp_bytes(impl, seq, causal=True, H=4, D=32):
  x = jax.ShapeDtypeStruct((1, H, seq, D), jnp.float32)
  f = lambda q, k, v: jnp.sum(flashvjp.flash_attention(q, k, v, causal=causal, implementation=impl))
  g = jax.grad(f, (0, 1, 2))
  return jax.jit(g).lower(x, x, x).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("causal", [True, False])
def test_blockwise_temp_memory_is_linear_in_seq(causal):
  m1, m2, m4 = (temp_bytes("blockwise", s, causal) for s in (1024, 2048, 4096))
  # Quadratic growth would quadruple per doubling; linear (plus fixed tiles) at most doubles.
  assert m2 <= 2.2 * m1 and m4 <= 2.2 * m2, (m1, m2, m4)
  # and far below the [H, seq, seq] float32 score matrix naive keeps.
  assert m4 < 4 * 4096 * 4096 * 4 / 8


def test_naive_is_quadratic_so_the_measurement_can_fail():
  n1, n2 = temp_bytes("naive", 512), temp_bytes("naive", 1024)
  assert n2 > 3.0 * n1, (n1, n2)
  assert n2 > temp_bytes("blockwise", 1024)
