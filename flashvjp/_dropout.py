"""Counter-based dropout keep-mask shared by every implementation.

Room: dropout. keep(b, h, q, kv) is a pure function of (seed, b, h, q_pos, kv_pos)
built from 32-bit integer mixing only (xor, shifts, multiplies), so that the
blockwise path, the Pallas kernels (in-kernel) and `dropout_mask` draw exactly the
same bits, forward and backward, with no O(seq^2) array.
"""
from __future__ import annotations

from collections.abc import Sequence

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


def check_key(dropout_rng, name="dropout_rng"):
  """Raise TypeError / ValueError unless `dropout_rng` is one JAX PRNG key.

  Accepted: a new-style typed key of shape () (``jax.random.key``) or a legacy raw key,
  uint32 of shape [2] (``jax.random.PRNGKey``; [4] for the "rbg" implementations).
  """
  if isinstance(dropout_rng, (bool, int, float, complex)) or not hasattr(dropout_rng, "dtype"):
    raise TypeError(f"{name} must be a single JAX PRNG key (jax.random.key(seed) or"
                    f" jax.random.PRNGKey(seed)), got {type(dropout_rng).__name__} {dropout_rng!r}")
  shape = tuple(jnp.shape(dropout_rng))
  if jax.dtypes.issubdtype(dropout_rng.dtype, jax.dtypes.prng_key):
    if shape != ():
      raise ValueError(f"{name} must be a single PRNG key (shape ()), got a key array of shape"
                       f" {shape}; pass one key (e.g. keys[0]), not a batch of keys")
    return
  if dropout_rng.dtype != jnp.uint32:
    raise TypeError(f"{name} must be a JAX PRNG key (a typed key, or a legacy uint32[2] key),"
                    f" got an array of dtype {dropout_rng.dtype} and shape {shape}")
  if shape not in ((2,), (4,)):
    raise ValueError(f"{name} must be a single legacy PRNG key of shape (2,) (uint32), got shape"
                     f" {shape}; pass one key (e.g. keys[0]), not a batch of keys")


def seed_from_key(rng) -> jax.Array:
  """uint32[2] seed words from one PRNG key (typed, or raw uint32[2] / [4])."""
  rng = jnp.asarray(rng) if not hasattr(rng, "dtype") else rng
  if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
    data = jax.random.key_data(rng)
  else:
    data = rng
  data = jnp.ravel(data).astype(jnp.uint32)
  if data.shape[0] == 1:
    return jnp.stack([data[0], _U32(0)])
  if data.shape[0] == 2:
    return data
  s0 = data[0::2]
  s1 = data[1::2]
  return jnp.stack([jnp.bitwise_xor.reduce(s0), jnp.bitwise_xor.reduce(s1)])


def threshold(rate: float) -> int:
  """Entries whose bits are below this are dropped: P(drop) = rate."""
  return int(min(round(rate * 2.0**32), 2**32 - 1))


def random_bits(seed0, seed1, b, h, q_pos, kv_pos):
  """uint32 bits for the given (broadcasting) int coordinates."""
  cq, cq2 = row_words(seed0, seed1, b, h, q_pos)
  return bits_from_row(cq, cq2, kv_pos)


def row_words(seed0, seed1, b, h, q_pos):
  """The two uint32 words of `random_bits` that depend on (seed, b, h, q_pos) only.

  A kernel may compute them per query row outside (O(B H Sq)) and finish each entry with
  `bits_from_row`: the same bits as `random_bits`.
  """
  c = _fmix(seed0.astype(_U32) ^ _fmix(seed1.astype(_U32) + _U32(0x9E3779B9)))
  c = _fmix(c ^ (jnp.asarray(b).astype(_U32) * _U32(0x27D4EB2F)))
  c = _fmix(c + jnp.asarray(h).astype(_U32) * _U32(0x165667B1))
  cq = _fmix(c ^ (jnp.asarray(q_pos).astype(_U32) * _U32(0x9E3779B1)))
  cq2 = _fmix(cq + _U32(0x7FEB352D))
  return cq, cq2


def bits_from_row(cq, cq2, kv_pos):
  """`random_bits` from a row's `row_words` and the kv positions (broadcasting)."""
  x = _fmix((jnp.asarray(kv_pos).astype(_U32) * _U32(0x85EBCA77)) ^ cq)
  return _fmix(x + cq2)


def hash_coords(broadcast, b, h):
  """The (b, h) the hash sees: 0 along a broadcast dim (a mask shared over batch / heads).

  `broadcast` is (batch, heads), AttentionConfig.dropout_broadcast. Every
  implementation passes its (b, h) through here, so they all share the same mask.
  """
  bb, bh = broadcast
  return (0 if bb else b), (0 if bh else h)


def keep(seed0, seed1, b, h, q_pos, kv_pos, rate: float, broadcast=(False, False)):
  """Bool keep-mask: True with probability 1 - rate (shared over the `broadcast` dims)."""
  b, h = hash_coords(broadcast, b, h)
  return random_bits(seed0, seed1, b, h, q_pos, kv_pos) >= _U32(threshold(rate))


def dropout_mask(dropout_rng: jax.Array, shape: Sequence[int], rate: float,
                 broadcast: tuple[bool, bool] = (False, False)) -> jax.Array:
  """The exact bool keep-mask [batch, num_heads, seq_q, seq_kv] every implementation uses.

  Args:
    dropout_rng: a JAX PRNG key.
    shape: (batch, num_heads, seq_q, seq_kv).
    rate: dropout probability in [0, 1).
    broadcast: (batch, heads): share the mask across the batch and/or the heads, as
      `flash_attention(..., dropout_broadcast=...)` and Flax's ``broadcast_dropout``
      do (the returned mask still has the full shape).
  """
  if len(shape) != 4:
    raise ValueError(f"shape must be (batch, num_heads, seq_q, seq_kv), got {shape!r}")
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"rate must be in [0, 1), got {rate!r}")
  broadcast = check_broadcast(broadcast, "broadcast")
  check_key(dropout_rng)
  seed = seed_from_key(dropout_rng)
  B, H, Sq, Sk = shape
  b = jnp.arange(B, dtype=jnp.int32)[:, None, None, None]
  h = jnp.arange(H, dtype=jnp.int32)[None, :, None, None]
  q = jnp.arange(Sq, dtype=jnp.int32)[None, None, :, None]
  k = jnp.arange(Sk, dtype=jnp.int32)[None, None, None, :]
  m = keep(seed[0], seed[1], b, h, q, k, rate, broadcast)
  return jnp.broadcast_to(m, (B, H, Sq, Sk))


def check_broadcast(broadcast, name="dropout_broadcast"):
  """(batch, heads) pair of bools."""
  if (not isinstance(broadcast, (tuple, list)) or len(broadcast) != 2
      or not all(isinstance(x, (bool,)) for x in broadcast)):
    raise TypeError(f"{name} must be a pair of bools (batch, heads), got {broadcast!r}")
  return (bool(broadcast[0]), bool(broadcast[1]))


__all__ = ["check_key", "dropout_mask", "hash_coords", "keep", "seed_from_key", "threshold"]
