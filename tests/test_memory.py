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


def test_blockwise_fwd_bwd_temp_memory_budget():
  """fwd+bwd temp memory stays at two [B, H, S, D] float32 arrays plus the score tiles.

  Measured as benchmarks/bench_cpu.py does (vjp with dO an argument): 16.3 MiB at seq 4096,
  B=1, H=8, D=64. A transposed copy of all of K for dQ^T = K^T dS^T took it to 24.3 MiB.
  """
  B, H, S, D = 1, 8, 4096, 64
  x = jax.ShapeDtypeStruct((B, H, S, D), jnp.float32)
  attn = lambda q, k, v: flashvjp.flash_attention(q, k, v, causal=True,
                                                  implementation="blockwise")

  def fwd_bwd(q, k, v, do):
    _, vjp = jax.vjp(attn, q, k, v)
    return vjp(do)

  temp = jax.jit(fwd_bwd).lower(x, x, x, x).compile().memory_analysis().temp_size_in_bytes
  seq_array = B * H * S * D * 4
  tile = B * H * 256 * 256 * 4  # one float32 [B, H, 256, 256] score tile (default blocks)
  assert temp <= 2 * seq_array + 2 * tile, (temp / 2**20, "MiB")
