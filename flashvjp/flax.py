"""Flax integration: an ``attention_fn`` for MultiHeadAttention (linen and nnx).

Room: ecosystem adapter. Translates Flax's attention_fn convention into one
`flashvjp.flash_attention` call (`flashvjp._flax_fn`, below this module and the Flax
modules); holds no attention math and does not import flax.

Usage::

    import flashvjp.flax
    import flax.linen as nn
    from flax import nnx

    nn.MultiHeadDotProductAttention(num_heads=8, attention_fn=flashvjp.flax.attention_fn)
    nnx.MultiHeadAttention(num_heads=8, in_features=512, rngs=nnx.Rngs(0),
                           attention_fn=flashvjp.flax.attention_fn)

    # causal (or windowed) attention without Flax's dense [batch, 1, L, L] causal mask:
    nn.MultiHeadDotProductAttention(
        num_heads=8, attention_fn=flashvjp.flax.make_attention_fn(causal=True))

Mapping from Flax's arguments:

  * layout ``[batch..., length, heads, features]``: any number of batch dims
    (including none), flattened into one batch for flashvjp and restored after;
  * ``mask`` (True or nonzero = attend; Flax's ``make_attention_mask`` and
    ``make_causal_mask`` return float32 0/1 masks by default) and ``bias``:
    broadcastable to ``[batch..., heads, q_length, kv_length]``, as in Flax;
  * ``is_causal`` (nnx passes it): causal, top-left aligned, never a dense mask;
  * dropout on the attention probabilities when ``dropout_rate > 0`` and
    ``deterministic`` is False, drawn from ``dropout_rng`` by flashvjp's own
    counter-based hash (`flashvjp.dropout_mask`), a pure function of
    (dropout_rng, batch index, head, q_pos, kv_pos), where the batch index is the
    row-major flattened index over the batch dims. ``broadcast_dropout=True``
    (Flax's default) shares one [q_length, kv_length] keep-mask across every batch
    dim and head, exactly as Flax's ``dropout_shape = (1,) * (key.ndim - 2) +
    attn_weights.shape[-2:]``: the hash sees b = 0 and h = 0, so the mask is
    ``flashvjp.dropout_mask(rng, shape, rate, broadcast=(True, True))``.
    ``broadcast_dropout=False`` draws an independent mask per batch row and head.
    (The bits differ from Flax's ``jax.random.bernoulli``; the distribution and the
    sharing are the same);
  * ``dtype``: query, key and value are cast to it (default: their promoted dtype);
    accumulation is float32 (or float64 for float64 inputs) whatever the dtype, so
    ``force_fp32_for_softmax`` is always satisfied and ``precision`` is not used;
  * ``module`` (set by ``sow_weights=True``) and custom einsums
    (``qk_attn_weights_einsum``, ``attn_weights_value_einsum``, ``einsum_dot_general``)
    raise ValueError: flashvjp never materialises the attention weights; with
    ``make_attention_fn(max_logits=True)`` the module gets the max logits sown instead
    (QK-clip);
  * remat: ``nn.remat`` / ``nnx.remat`` with ``policy=flashvjp.flax.checkpoint_policy(base)``
    saves attention's output and logsumexp, so the backward never re-runs its forward.

The one intended difference from Flax's default: a query row whose mask is all
False outputs 0 (Flax averages the values over all keys there).
"""
from __future__ import annotations

from flashvjp._flax_fn import attention_fn
from flashvjp._flax_fn import make_attention_fn
from flashvjp._remat import RESIDUAL_NAMES
from flashvjp._remat import checkpoint_policy  # for nn.remat / nnx.remat(policy=...)


def __getattr__(name: str):
  """Flax modules owning flashvjp's learned parameters (they import flax: loaded on use)."""
  if name in ("MultiHeadAttention", "MultiHeadDotProductAttention"):
    from flashvjp import _flax_modules
    return getattr(_flax_modules, name)
  raise AttributeError(f"module 'flashvjp.flax' has no attribute {name!r}")


# (MultiHeadAttention / MultiHeadDotProductAttention import Flax: by name only, not `*`)
__all__ = ["attention_fn", "make_attention_fn", "checkpoint_policy", "RESIDUAL_NAMES"]
