"""A drop-in for `jax.nn.dot_product_attention`, running flashvjp.

Room: ecosystem adapter. Translates jax.nn's layout and arguments into one
`flashvjp.flash_attention` call and back; holds no attention math of its own.

    jax.nn.dot_product_attention          flashvjp.flash_attention
    -----------------------------         -------------------------------------------
    [batch, seq, heads, head_dim]         [batch, heads, seq, head_dim] (transposed)
    [seq, heads, head_dim] (rank 3)       batch of 1, squeezed again on the way out
    is_causal                             causal (top-left aligned, as jax.nn)
    is_causal="bottom_right" + lengths    a mask_mod: kv <= q + kv_len[b] - q_len[b]
    local_window_size=w or (l, r)         window=(w, w) or (l, r)
    query_seq_lengths [batch]             q segment ids: 0 where pos < len, else -1
    key_value_seq_lengths [batch]         kv segment ids: 0 where pos < len, else -2
    bias, mask (broadcast to BNTS/NTS)    bias, mask (same broadcasting)

Sequence lengths become segment ids, never a dense [batch, heads, seq_q, seq_kv]
mask, so memory stays O(seq). Padded query rows (pos >= query_seq_lengths) give 0,
as in jax.nn. With is_causal="bottom_right" the lengths also place each sequence's
diagonal (a KV cache partly filled: docs/decoding.md), through an int32 [batch] offset
read per batch index by a mask_mod (`_api._per_sequence_causal`).

The one intended difference: a query row with no allowed key (for example
key_value_seq_lengths == 0, or a mask row that is all False) gives 0 here, while
jax.nn's XLA path fills masked logits with a large negative number and so
returns the average of V over all keys for such a row.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from flashvjp import _api
from flashvjp import _dispatch

# jax.nn's backend names; flashvjp runs its own implementations instead.
_JAX_NN_IMPLEMENTATIONS = ("xla", "cudnn")


def _lengths(name, lengths, batch):
  if lengths is None:
    return None
  lengths = jnp.asarray(lengths)
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array [batch], got dtype {lengths.dtype}")
  if lengths.shape != (batch,):
    raise ValueError(f"{name} must have shape [batch] = ({batch},), got {lengths.shape}")
  return lengths.astype(jnp.int32)


def _segment_ids(q_lengths, kv_lengths, batch, seq_q, seq_kv):
  """Sequence lengths -> (q_ids [B, Sq], kv_ids [B, Skv]) int32, or None.

  Valid positions get id 0 on both sides; padded queries get -1 and padded keys
  -2, so a padded position never matches anything (and padded queries output 0).
  """
  if q_lengths is None and kv_lengths is None:
    return None

  def ids(lengths, seq, pad_id):
    if lengths is None:
      return jnp.zeros((batch, seq), jnp.int32)
    pos = jnp.arange(seq, dtype=jnp.int32)[None, :]
    return jnp.where(pos < lengths[:, None], jnp.int32(0), jnp.int32(pad_id))

  return ids(q_lengths, seq_q, -1), ids(kv_lengths, seq_kv, -2)


def dot_product_attention(
    query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None = None,
    mask: jax.Array | None = None, *, scale: float | jax.Array | None = None,
    is_causal: bool | str = False, query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None, return_residual: bool = False,
    mask_mod: Callable | None = None,
    sinks: jax.Array | None = None,
    return_max_logits: bool = False) -> jax.Array | tuple[jax.Array, ...]:
  """`jax.nn.dot_product_attention`'s signature and meaning, computed by flashvjp.

  Switch by changing one import: ``from flashvjp import dot_product_attention``.
  Uppercase letters as in jax.nn: B batch, T query length, S key length, N query
  heads, K kv heads (N % K == 0: GQA/MQA), H head dim.

  Args:
    query: [B, T, N, H] or [T, N, H].
    key: [B, S, K, H] or [S, K, H] (same rank as query).
    value: [B, S, K, H_v] or [S, K, H_v]; H_v may differ from H (a flashvjp extension).
    bias: float, broadcastable to [B, N, T, S] (or [N, T, S] for rank-3 inputs);
      added to the scaled logits; differentiable.
    mask: bool, broadcastable like bias; True = may attend.
    scale: logit scale (default 1 / sqrt(H)): a Python float, or a scalar array such as
      a traced, learned temperature (differentiable, as in jax.nn; see flash_attention).
    is_causal: key position <= query position (top-left aligned when T != S, as
      jax.nn; lengths do not move it). flashvjp extension: ``"bottom_right"`` aligns the
      ends, as FlashAttention and PyTorch's causal_lower_right: key position <= query
      position + S - T, and with `key_value_seq_lengths` and/or `query_seq_lengths` the
      ends of each sequence: key position <= query position + kv_len[b] - q_len[b]
      (kv_len defaults to S, q_len to T), FlashAttention's ``cache_seqlens``. That is
      decoding against a KV cache buffer of S keys of which kv_len[b] are filled, the
      T new queries (q_len[b] of them real) being the last tokens of sequence b: a decode
      step (T = 1) or a chunk (chunked prefill, speculative decoding); docs/decoding.md.
      A query row whose sequence has fewer keys than queries before it sees nothing (0).
    query_seq_lengths: int [B]; query rows at positions >= length output 0 (and get
      zero gradients).
    key_value_seq_lengths: int [B]; keys at positions >= length are ignored.
    local_window_size: int w (= (w, w)) or (left, right): query t attends keys in
      [t - left, t + right]. A None side is unbounded (flashvjp extension).
    implementation: flashvjp's implementation names: None (choose; see
      `flashvjp.explain`), "pallas", "blockwise" or "naive". jax.nn's "xla" and
      "cudnn" are rejected with a ValueError rather than silently mapped: call
      `jax.nn.dot_product_attention` itself for those.
    return_residual: also return the logsumexp of the logits, float32 [B, T, N]
      (or [T, N]). Unlike jax.nn's it is differentiable, and -inf for a row with
      no allowed key.
    mask_mod: flashvjp extension (keyword only): ``(b, h, q_idx, kv_idx) -> bool`` with
      h the query head N (see `flashvjp.flash_attention`); ANDed with the other masks
      (with ``is_causal="bottom_right"`` and lengths, with the per-sequence diagonal).
    sinks: flashvjp extension (keyword only): float [N], differentiable attention sinks.
    return_max_logits: flashvjp extension (keyword only): also return the max logits,
      float32 [B, N] (or [N]; `flash_attention`'s ``return_max_logits``: no gradient),
      last in the returned tuple.

  Returns:
    [B, T, N, H_v] (or [T, N, H_v]) in query's dtype; with return_residual, (out, lse);
    with return_max_logits, the max logits appended: (out, max_logits) or
    (out, lse, max_logits).

  A row with no allowed key returns 0 (jax.nn's XLA path returns mean(V) there);
  this is the one intended difference from jax.nn.
  """
  if implementation in _JAX_NN_IMPLEMENTATIONS:
    raise ValueError(
        f"implementation={implementation!r} is a jax.nn backend name; flashvjp's"
        f" dot_product_attention accepts None or one of {_dispatch.IMPLEMENTATIONS}"
        f" (call jax.nn.dot_product_attention for implementation={implementation!r})")
  if implementation is not None and implementation not in _dispatch.IMPLEMENTATIONS:
    raise ValueError(f"implementation must be None or one of {_dispatch.IMPLEMENTATIONS},"
                     f" got {implementation!r}")
  for name, x in (("query", query), ("key", key), ("value", value)):
    if not _api._is_array(x):
      raise TypeError(f"{name} must be a jax or numpy array, got {type(x).__name__}")
    if x.ndim not in (3, 4):
      raise ValueError(f"{name} must have rank 4 [batch, seq, heads, head_dim] or rank 3"
                       f" [seq, heads, head_dim], got shape {x.shape}")
  if not query.ndim == key.ndim == value.ndim:
    raise ValueError("query, key and value must have the same rank, got shapes"
                     f" {query.shape}, {key.shape}, {value.shape}")
  for name, x in (("value", value), ("query", query)):  # jax.nn's check, its type and order
    if x.dtype != key.dtype:
      raise ValueError(f"{name} dtype should be {key.dtype} (key's dtype: query, key and value"
                       f" must have one dtype, as in jax.nn.dot_product_attention), but got"
                       f" {x.dtype}")
  if not isinstance(is_causal, bool) and is_causal not in ("top_left", "bottom_right"):
    raise TypeError(f"is_causal must be a bool (or flashvjp's 'bottom_right' / 'top_left'),"
                    f" got {is_causal!r}")
  if not isinstance(return_residual, bool):
    raise TypeError(f"return_residual must be a bool, got {return_residual!r}")
  window = _api._local_window(local_window_size)
  rank3 = query.ndim == 3
  if rank3:
    query, key, value = query[None], key[None], value[None]
  B, T, _, _ = query.shape
  S = key.shape[1]
  q_len = _lengths("query_seq_lengths", query_seq_lengths, B)
  kv_len = _lengths("key_value_seq_lengths", key_value_seq_lengths, B)
  segment_ids = _segment_ids(q_len, kv_len, B, T, S)
  causal = is_causal
  if is_causal == "bottom_right" and segment_ids is not None:  # each sequence's own end
    causal, mask_mod = _api._per_sequence_causal(q_len, kv_len, B, T, S, mask_mod)

  to_bnth = lambda x: jnp.swapaxes(x, 1, 2)
  # flash_attention takes a scalar-array scale too; its annotation (float | None) is the narrow
  # one. (Drop the ignore when _api widens it: warn_unused_ignores will say so.)
  result = _api.flash_attention(
      to_bnth(query), to_bnth(key), to_bnth(value), bias=bias, mask=mask, causal=causal,
      window=window, segment_ids=segment_ids, scale=scale,  # type: ignore[arg-type]
      return_lse=return_residual, implementation=implementation, mask_mod=mask_mod, sinks=sinks,
      return_max_logits=return_max_logits)
  max_logits: tuple = ()
  if return_max_logits:  # last in flash_attention's tuple
    parts = tuple(result)
    max_logits = (parts[-1][0] if rank3 else parts[-1],)
    result = parts[0] if len(parts) == 2 else parts[:-1]
  if not return_residual:
    out = to_bnth(result)  # [B, T, N, H_v]
    out = out[0] if rank3 else out
    return (out, *max_logits) if max_logits else out
  out, lse = result
  out, lse = to_bnth(out), jnp.swapaxes(lse, 1, 2)  # [B, T, N, H_v], [B, T, N]
  return ((out[0], lse[0]) if rank3 else (out, lse)) + max_logits

__all__ = ["dot_product_attention"]
