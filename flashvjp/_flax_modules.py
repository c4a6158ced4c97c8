"""Flax attention modules that own flashvjp's learned parameters (imports flax).

Room: ecosystem adapter. `flashvjp.flax.MultiHeadAttention` (nnx) and
`flashvjp.flax.MultiHeadDotProductAttention` (linen) are Flax's own modules with two
optional parameters of their own, passed to `flashvjp.flash_attention` on every call so that
their gradients flow through the kernels' backward:

* ``sinks`` float32 [num_heads] (``learned_sinks=True``; initialised to 0): attention sinks;
* ``relative_position_bias`` float32 [num_heads, 2 * max_distance + 1]
  (``max_distance=d``; initialised to 0): `flashvjp.relative_position_bias`'s table.

plus ``causal`` (True / "bottom_right"), ``window`` and ``implementation``. Everything else
is Flax's (projections, masks, dropout, ``dtype``); the module's attention_fn is flashvjp's
(`flashvjp.flax.make_attention_fn`), built on each call from the current parameter values
(an attention_fn passed in is not used). Loaded on first use by `flashvjp.flax.__getattr__`.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from flax import nnx

from flashvjp import _flax_fn
from flashvjp import _score_mod


def _attention_fn(causal, window, implementation, table, max_distance, sinks):
  score_mod = None if table is None else _score_mod.relative_position_bias(table, max_distance)
  return _flax_fn.make_attention_fn(causal=causal, window=window, score_mod=score_mod,
                                    sinks=sinks, implementation=implementation)


def _check(max_distance, learned_sinks):
  if max_distance is not None and (not isinstance(max_distance, int) or max_distance < 1):
    raise ValueError(f"max_distance must be None or a positive int, got {max_distance!r}")
  if not isinstance(learned_sinks, bool):
    raise TypeError(f"learned_sinks must be a bool, got {learned_sinks!r}")


class MultiHeadAttention(nnx.MultiHeadAttention):
  """`flax.nnx.MultiHeadAttention` computed by flashvjp, with learned sinks and a learned
  relative-position bias as parameters of the module (see the module docstring)."""

  def __init__(self, num_heads: int, in_features: int, *, causal: bool | str = False,
               window=None, max_distance: int | None = None, learned_sinks: bool = False,
               implementation: str | None = None, rngs: nnx.Rngs, **kwargs: Any):
    _check(max_distance, learned_sinks)
    kwargs.pop("attention_fn", None)
    super().__init__(num_heads, in_features, rngs=rngs, **kwargs)
    self.flash_options = (causal, window, implementation, max_distance)
    self.sinks = nnx.Param(jnp.zeros((num_heads,), jnp.float32)) if learned_sinks else None
    self.relative_position_bias = (
        nnx.Param(jnp.zeros((num_heads, 2 * max_distance + 1), jnp.float32))
        if max_distance is not None else None)

  # nnx.MultiHeadAttention calls self.attention_fn(...): a property, so that the function
  # reads this module's parameters as they are in the traced call (nnx.jit / nnx.grad
  # rebuild the module; a function bound once at construction would see stale values).
  @property
  def attention_fn(self):
    causal, window, implementation, d = self.flash_options
    table = None if self.relative_position_bias is None else self.relative_position_bias[...]
    sinks = None if self.sinks is None else self.sinks[...]
    return _attention_fn(causal, window, implementation, table, d, sinks)

  @attention_fn.setter
  def attention_fn(self, fn):  # the parent's __init__ stores its default; ours is used
    del fn


class MultiHeadDotProductAttention(nn.MultiHeadDotProductAttention):
  """`flax.linen.MultiHeadDotProductAttention` computed by flashvjp, with learned sinks
  (param "sinks") and a learned relative-position bias (param "relative_position_bias")."""

  causal: bool | str = False
  window: Any = None
  max_distance: int | None = None
  learned_sinks: bool = False
  implementation: str | None = None

  def __post_init__(self):
    _check(self.max_distance, self.learned_sinks)
    super().__post_init__()
    # the parent's __call__ calls self.attention_fn: this module's own method, which
    # creates / reads the parameters in the parent's compact scope
    object.__setattr__(self, "attention_fn", self._flash_attention)

  # linen passes only the keywords the attention_fn's signature names: name them all
  def _flash_attention(self, query, key, value, bias=None, mask=None, broadcast_dropout=True,
                       dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                       precision=None, module=None, force_fp32_for_softmax=False,
                       qk_attn_weights_einsum=None, attn_weights_value_einsum=None,
                       einsum_dot_general=None, is_causal=False):
    kwargs = dict(bias=bias, mask=mask, broadcast_dropout=broadcast_dropout,
                  dropout_rng=dropout_rng, dropout_rate=dropout_rate,
                  deterministic=deterministic, dtype=dtype, precision=precision, module=module,
                  force_fp32_for_softmax=force_fp32_for_softmax,
                  qk_attn_weights_einsum=qk_attn_weights_einsum,
                  attn_weights_value_einsum=attn_weights_value_einsum,
                  einsum_dot_general=einsum_dot_general, is_causal=is_causal)
    H = query.shape[-2]
    sinks = (self.param("sinks", nn.initializers.zeros_init(), (H,), jnp.float32)
             if self.learned_sinks else None)
    table = None
    if self.max_distance is not None:
      table = self.param("relative_position_bias", nn.initializers.zeros_init(),
                         (H, 2 * self.max_distance + 1), jnp.float32)
    fn = _attention_fn(self.causal, self.window, self.implementation, table,
                       self.max_distance, sinks)
    return fn(query, key, value, **kwargs)
