"""score_mod: the type, built-ins, and how closed-over arrays become explicit inputs.

Room: score_mod. A score_mod is elementwise:
``(scores, b, h, q_idx, kv_idx) -> scores`` with global int32 indices shaped to
broadcast against the scores. flashvjp traces it once on scalars with
`jax.closure_convert`, so that any array it closes over (an ALiBi slope vector, a
learned relative-position table) becomes an explicit input of the custom_vjp and
receives its gradient; every implementation then applies the scalar function to
its own tile shape through `jnp.vectorize`.
"""
from __future__ import annotations

import math
from typing import Callable, Protocol, Tuple

import jax
import jax.numpy as jnp


class ScoreMod(Protocol):
  """The callable type of `score_mod`."""

  def __call__(self, scores: jax.Array, b: jax.Array, h: jax.Array,
               q_idx: jax.Array, kv_idx: jax.Array) -> jax.Array:
    ...


def softcap(cap: float) -> ScoreMod:
  """Gemma-style logit soft-capping: ``cap * tanh(scores / cap)``."""
  if not cap > 0:
    raise ValueError(f"cap must be positive, got {cap!r}")

  def mod(scores, b, h, q_idx, kv_idx):
    del b, h, q_idx, kv_idx
    return cap * jnp.tanh(scores / cap)

  return mod


def alibi_slopes(num_heads: int) -> jax.Array:
  """The standard ALiBi slopes (Press et al.) for `num_heads` heads, float32 [num_heads]."""
  def pow2(n):
    start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
    return [start * start**i for i in range(n)]
  if math.log2(num_heads).is_integer():
    s = pow2(num_heads)
  else:
    p = 2 ** math.floor(math.log2(num_heads))
    s = pow2(p) + pow2(2 * p)[0::2][: num_heads - p]
  return jnp.asarray(s, jnp.float32)


def alibi(slopes: jax.Array) -> ScoreMod:
  """ALiBi: ``scores + slopes[h] * (kv_idx - q_idx)``; `slopes` [num_heads] is differentiable."""
  def mod(scores, b, h, q_idx, kv_idx):
    del b
    return scores + slopes[h].astype(scores.dtype) * (kv_idx - q_idx).astype(scores.dtype)

  return mod


def relative_position_bias(table: jax.Array, max_distance: int) -> ScoreMod:
  """Learned relative-position bias: ``scores + table[h, clip(kv - q, -d, d) + d]``.

  Args:
    table: [num_heads, 2 * max_distance + 1], differentiable.
    max_distance: distances beyond it share the edge bucket.
  """
  if table.ndim != 2 or table.shape[1] != 2 * max_distance + 1:
    raise ValueError(
        f"table must be [num_heads, 2 * max_distance + 1] = [H, {2 * max_distance + 1}],"
        f" got {table.shape}")

  def mod(scores, b, h, q_idx, kv_idx):
    del b
    rel = jnp.clip(kv_idx - q_idx, -max_distance, max_distance) + max_distance
    return scores + table[h, rel].astype(scores.dtype)

  return mod


def convert(score_mod: Callable, acc_dtype) -> Tuple[Callable, tuple, int]:
  """Closure-convert `score_mod` on scalars.

  Returns (fn, consts, num_diff) where fn(s, b, h, q, kv, *consts) is the scalar
  function and the first num_diff consts are inexact (differentiable).
  """
  s = jnp.zeros((), acc_dtype)
  i = jnp.zeros((), jnp.int32)
  fn, consts = jax.closure_convert(score_mod, s, i, i, i, i)
  consts = list(consts)
  diff = [c for c in consts if jnp.issubdtype(jnp.result_type(c), jnp.inexact)]
  nondiff = [c for c in consts if not jnp.issubdtype(jnp.result_type(c), jnp.inexact)]
  pos = {id(c): n for n, c in enumerate(consts)}
  perm = [pos[id(c)] for c in diff + nondiff]

  def reordered(s, b, h, q, kv, *cs):
    orig = [None] * len(cs)
    for new_i, old_i in enumerate(perm):
      orig[old_i] = cs[new_i]
    return fn(s, b, h, q, kv, *orig)

  return reordered, tuple(diff + nondiff), len(diff)


def apply(fn: Callable, consts, scores, b, h, q_idx, kv_idx):
  """Apply the scalar score_mod `fn` elementwise to a tile, broadcasting the indices."""
  vec = jnp.vectorize(lambda s, b_, h_, q_, k_: fn(s, b_, h_, q_, k_, *consts))
  out = vec(scores, b, h, q_idx, kv_idx)
  return jnp.broadcast_to(out, scores.shape).astype(scores.dtype)
