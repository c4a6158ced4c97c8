"""Counter-based dropout keep-mask shared by every implementation.

Room: dropout. keep(b, h, q, kv) is a pure function of (seed, b, h, q_pos, kv_pos)
built from 32-bit integer mixing only (xor, shifts, multiplies), so that the
blockwise path, the Pallas kernels (in-kernel) and `dropout_mask` draw exactly the
same bits, forward and backward, with no O(seq^2) array.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_U32 = jnp.uint32


def _fmix(x):
  """murmur3's 32-bit finaliser: a bijection with good avalanche."""
  x = x ^ (x >> 16)
  x = x * _U32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * _U32(0xC2B2AE35)
  x = x ^ (x >> 16)
  return x


def seed_from_key(rng) -> jax.Array:
  """uint32[2] seed words from a PRNG key (typed or raw uint32)."""
  rng = jnp.asarray(rng) if not hasattr(rng, "dtype") else rng
  if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
    data = jax.random.key_data(rng)
  else:
    data = rng
  data = jnp.ravel(data).astype(jnp.uint32)
  if data.shape[0] == 1:
    return jnp.stack([data[0], _U32(0)])
  s0 = data[0::2]
  s1 = data[1::2]
  return jnp.stack([jnp.bitwise_xor.reduce(s0), jnp.bitwise_xor.reduce(s1)])


def threshold(rate: float) -> int:
  """Entries whose bits are below this are dropped: P(drop) = rate."""
  return int(min(round(rate * 2.0**32), 2**32 - 1))


def random_bits(seed0, seed1, b, h, q_pos, kv_pos):
  """uint32 bits for the given (broadcasting) int coordinates."""
  c = _fmix(seed0.astype(_U32) ^ _fmix(seed1.astype(_U32) + _U32(0x9E3779B9)))
  c = _fmix(c ^ (jnp.asarray(b).astype(_U32) * _U32(0x27D4EB2F)))
  c = _fmix(c + jnp.asarray(h).astype(_U32) * _U32(0x165667B1))
  cq = _fmix(c ^ (jnp.asarray(q_pos).astype(_U32) * _U32(0x9E3779B1)))
  cq2 = _fmix(cq + _U32(0x7FEB352D))
  x = _fmix((jnp.asarray(kv_pos).astype(_U32) * _U32(0x85EBCA77)) ^ cq)
  return _fmix(x + cq2)


def keep(seed0, seed1, b, h, q_pos, kv_pos, rate: float):
  """Bool keep-mask: True with probability 1 - rate."""
  return random_bits(seed0, seed1, b, h, q_pos, kv_pos) >= _U32(threshold(rate))


def dropout_mask(dropout_rng, shape, rate: float) -> jax.Array:
  """The exact bool keep-mask [batch, num_heads, seq_q, seq_kv] every implementation uses.

  Args:
    dropout_rng: a JAX PRNG key.
    shape: (batch, num_heads, seq_q, seq_kv).
    rate: dropout probability in [0, 1).
  """
  if len(shape) != 4:
    raise ValueError(f"shape must be (batch, num_heads, seq_q, seq_kv), got {shape!r}")
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"rate must be in [0, 1), got {rate!r}")
  seed = seed_from_key(dropout_rng)
  B, H, Sq, Sk = shape
  b = jnp.arange(B, dtype=jnp.int32)[:, None, None, None]
  h = jnp.arange(H, dtype=jnp.int32)[None, :, None, None]
  q = jnp.arange(Sq, dtype=jnp.int32)[None, None, :, None]
  k = jnp.arange(Sk, dtype=jnp.int32)[None, None, None, :]
  return keep(seed[0], seed[1], b, h, q, k, rate)


__all__ = ["dropout_mask", "keep", "seed_from_key", "threshold"]
