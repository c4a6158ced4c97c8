"""Flax's ``attention_fn`` convention as one `flashvjp.flash_attention` call.

Room: ecosystem adapter, below `flashvjp.flax` (the public names, and the mapping from
Flax's arguments in its docstring) and `flashvjp._flax_modules` (the Flax modules, which
build their attention_fn here): both import this module, it imports neither. Holds no
attention math and does not import flax (nnx's sow excepted, on use).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flashvjp import _api


def _broadcast_pair(name, x, batch_dims, target_tail):
  """A Flax mask/bias [batch..., heads, q, kv] (broadcastable) -> rank 4 [B or 1, h, q, kv]."""
  if x is None:
    return None
  if not _api._is_array(x):
    raise TypeError(f"{name} must be an array, got {type(x).__name__}")
  nb = len(batch_dims)
  full = tuple(batch_dims) + tuple(target_tail)
  given = tuple(x.shape)  # errors name the shape the user passed, not the padded one
  if x.ndim > nb + 3:
    raise ValueError(f"{name} must broadcast to [batch..., heads, q_length, kv_length] = {full},"
                     f" got shape {x.shape}")
  if name == "mask" and x.dtype != jnp.bool_:
    if not (jnp.issubdtype(x.dtype, jnp.number)):
      raise TypeError(f"mask must be bool or numeric (nonzero = attend), got dtype {x.dtype}")
    x = x != 0  # Flax's make_attention_mask returns float32 0/1 masks; nonzero attends
  x = jnp.reshape(x, (1,) * (nb + 3 - x.ndim) + tuple(x.shape))
  for got, want in zip(x.shape, full):
    if got not in (1, want):
      raise ValueError(f"{name} of shape {given} does not broadcast to"
                       f" [batch..., heads, q_length, kv_length] = {full}")
  if all(d == 1 for d in x.shape[:nb]):
    return jnp.reshape(x, (1,) + tuple(x.shape[nb:]))
  x = jnp.broadcast_to(x, tuple(batch_dims) + tuple(x.shape[nb:]))
  return jnp.reshape(x, (math.prod(batch_dims),) + tuple(x.shape[nb:]))


def _and_causal(causal, is_causal: bool, Lq: int, Lkv: int):
  """The factory's `causal` AND nnx's top-left ``is_causal``: the stricter of the two."""
  if not is_causal or causal is False:
    return causal or is_causal
  if causal == "bottom_right" and Lkv < Lq:  # kv <= q + (Lkv - Lq) is inside kv <= q
    return causal
  return True


def _sow(module, max_logits):
  """Sow into a linen or an nnx module (told apart without importing Flax)."""
  if hasattr(module, "scope"):  # linen
    module.sow("intermediates", "max_logits", max_logits)
  else:  # nnx
    from flax import nnx
    module.sow(nnx.Intermediate, "max_logits", max_logits)


def make_attention_fn(*, causal: bool | str = False,
                      window: tuple[int | None, int | None] | None = None,
                      score_mod: Callable | None = None, scale: float | None = None,
                      implementation: str | None = None, block_q: int | None = None,
                      block_kv: int | None = None, mask_mod: Callable | None = None,
                      sinks: jax.Array | None = None, max_logits: bool = False) -> Callable:
  """An ``attention_fn`` for Flax with flashvjp options baked in.

  Args:
    causal: causal attention (True: top-left aligned; "bottom_right": the ends
      aligned, `flashvjp.flash_attention`'s) without a dense mask; combined (AND) with
      any ``mask`` Flax passes and with nnx's ``is_causal`` (top-left).
    window: (left, right) local window, as in `flashvjp.flash_attention`.
    score_mod: a flashvjp score_mod, e.g. `flashvjp.softcap(50.0)`. Arrays it closes
      over receive gradients only where the closure is built inside the traced
      function; a module that learns a table should call `flash_attention` itself.
    scale: logit scale (default 1 / sqrt(head_dim), as Flax).
    implementation: None (choose; see `flashvjp.explain`), "pallas", "blockwise", "naive".
    block_q, block_kv: block sizes (None: tuned defaults).
    mask_mod: ``(b, h, q_idx, kv_idx) -> bool`` (e.g. `flashvjp.chunked(1024)`), ANDed
      with Flax's mask; b is the index into the flattened batch dims.
    sinks: float [num_heads] attention sinks. As for score_mod's arrays, a learned sink
      receives its gradient when the attention_fn is built inside the traced function
      (e.g. in the module's ``__call__`` from a ``self.param``).
    max_logits: sow the max logits (`flash_attention`'s ``return_max_logits``: float32
      ``[batch..., num_heads]``, no gradient) into the calling module as ``"max_logits"``,
      for QK-clip. Flax hands the module to the attention_fn only with
      ``sow_weights=True``; flashvjp sows the max logits there instead of the weights
      (it never builds them). nnx: ``mha(x, sow_weights=True)``, then
      ``nnx.pop(mha, nnx.Intermediate)``; linen: ``MultiHeadDotProductAttention(...,
      attention_fn=...)``, ``apply(..., sow_weights=True, mutable=["intermediates"])``.

  Returns:
    A function with Flax's attention_fn signature (see `attention_fn`).
  """
  max_logits = _api._check_flag("max_logits", max_logits)

  def attention_fn(query: jax.Array, key: jax.Array, value: jax.Array,
                   bias: jax.Array | None = None, mask: jax.Array | None = None,
                   broadcast_dropout: bool = True, dropout_rng: jax.Array | None = None,
                   dropout_rate: float = 0.0, deterministic: bool = False,
                   dtype: Any = None, precision: Any = None, module: Any = None,
                   force_fp32_for_softmax: bool = False,
                   qk_attn_weights_einsum: Callable | None = None,
                   attn_weights_value_einsum: Callable | None = None,
                   einsum_dot_general: Callable | None = None,
                   is_causal: bool = False) -> jax.Array:
    """Flax-compatible dot-product attention computed by flashvjp.

    Args:
      query: [batch..., q_length, num_heads, qk_depth].
      key: [batch..., kv_length, num_kv_heads, qk_depth]; num_heads % num_kv_heads == 0.
      value: [batch..., kv_length, num_kv_heads, v_depth].
      bias: float, broadcastable to [batch..., num_heads, q_length, kv_length].
      mask: bool or numeric (as Flax's make_attention_mask returns), broadcastable to
        [batch..., num_heads, q_length, kv_length]; True / nonzero = attend.
      broadcast_dropout: True (Flax's default): one keep-mask shared across the batch
        dims and heads, as Flax; False: independent per batch row and head.
      dropout_rng: PRNG key; required when dropout is active.
      dropout_rate: dropout probability on the attention probabilities.
      deterministic: True disables dropout.
      dtype: computation dtype for query/key/value (default: promoted input dtype).
      precision: not used (accumulation is float32 or wider).
      module: must be None (``sow_weights`` needs the weights, which flashvjp never builds).
      force_fp32_for_softmax: accepted; flashvjp's softmax is always float32 or wider.
      qk_attn_weights_einsum, attn_weights_value_einsum, einsum_dot_general: must be None.
      is_causal: causal attention (nnx passes it); combined with the factory's ``causal``.

    Returns:
      [batch..., q_length, num_heads, v_depth] in the computation dtype.
    """
    del precision, force_fp32_for_softmax  # documented above
    if not isinstance(broadcast_dropout, (bool, np.bool_)):
      raise TypeError(f"broadcast_dropout must be a bool, got {broadcast_dropout!r}")
    if module is not None and not max_logits:
      raise ValueError("module is set (sow_weights=True?): flashvjp's attention_fn never"
                       " materialises the attention weights, so it cannot sow them (with"
                       " make_attention_fn(max_logits=True) it sows the max logits instead)")
    if max_logits and module is None:
      raise ValueError("make_attention_fn(max_logits=True) sows the max logits into the calling"
                       " module, which Flax passes only with sow_weights=True (nnx: mha(x,"
                       " sow_weights=True); linen: apply(..., sow_weights=True,"
                       " mutable=['intermediates']))")
    for name, f in (("qk_attn_weights_einsum", qk_attn_weights_einsum),
                    ("attn_weights_value_einsum", attn_weights_value_einsum),
                    ("einsum_dot_general", einsum_dot_general)):
      if f is not None:
        raise ValueError(f"{name} must be None: flashvjp computes attention in its own"
                         f" kernels and cannot use a custom einsum, got {f!r}")
    if not isinstance(is_causal, bool):
      raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    for name, x in (("query", query), ("key", key), ("value", value)):
      if not _api._is_array(x):
        raise TypeError(f"{name} must be a jax or numpy array, got {type(x).__name__}")
      if x.ndim < 3:
        raise ValueError(f"{name} must have shape [batch..., length, heads, features],"
                         f" got shape {x.shape}")
    if not query.ndim == key.ndim == value.ndim:
      raise ValueError("query, key and value must have the same rank, got shapes"
                       f" {query.shape}, {key.shape}, {value.shape}")
    batch_dims = tuple(query.shape[:-3])
    if tuple(key.shape[:-3]) != batch_dims or tuple(value.shape[:-3]) != batch_dims:
      raise ValueError("query, key and value batch dims must match, got shapes"
                       f" {query.shape}, {key.shape}, {value.shape}")
    compute = jnp.result_type(query, key, value) if dtype is None else jnp.dtype(dtype)
    Lq, H = query.shape[-3], query.shape[-2]
    Lkv = key.shape[-3]
    B = math.prod(batch_dims)

    def to_bhld(x):  # [batch..., L, H, D] -> [B, H, L, D]
      x = jnp.asarray(x).astype(compute)
      return jnp.swapaxes(jnp.reshape(x, (B,) + tuple(x.shape[-3:])), 1, 2)

    tail = (H, Lq, Lkv)
    out = _api.flash_attention(
        to_bhld(query), to_bhld(key), to_bhld(value),
        bias=_broadcast_pair("bias", bias, batch_dims, tail),
        mask=_broadcast_pair("mask", mask, batch_dims, tail),
        causal=_and_causal(causal, is_causal, Lq, Lkv), window=window, score_mod=score_mod, scale=scale,
        dropout_rate=dropout_rate, dropout_rng=dropout_rng, deterministic=bool(deterministic),
        implementation=implementation, block_q=block_q, block_kv=block_kv,
        dropout_broadcast=(bool(broadcast_dropout), bool(broadcast_dropout)),
        mask_mod=mask_mod, sinks=sinks, return_max_logits=max_logits)
    if max_logits:
      out, ml = out
      _sow(module, jnp.reshape(ml, batch_dims + (H,)))
    out = jnp.swapaxes(out, 1, 2)  # [B, Lq, H, Dv]
    return jnp.reshape(out, batch_dims + tuple(out.shape[1:]))

  return attention_fn


attention_fn = make_attention_fn()
attention_fn.__name__ = attention_fn.__qualname__ = "attention_fn"

__all__ = ["attention_fn", "make_attention_fn"]
