"""Naive attention: the oracle. einsum, softmax, einsum; differentiated by JAX autodiff.

Room: reference. Kept simple and obviously right; it materialises the full
[batch, num_heads, seq_q, seq_kv] scores, so use it on small shapes only.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from flashvjp import _dropout
from flashvjp import _mask_mod
from flashvjp import _score_mod
from flashvjp._config import AttentionConfig
from flashvjp._mask import MaskSpec


def mask_spec(cfg: AttentionConfig) -> MaskSpec:
  return MaskSpec(causal=cfg.causal, window=cfg.window, seq_q=cfg.seq_q, seq_kv=cfg.seq_kv)


def attention(cfg: AttentionConfig, q, k, v, bias, mask, q_seg, kv_seg, seed, consts, mod=None):
  """Returns (out [B, H, Sq, Dv] in q.dtype, lse [B, H, Sq] float32-or-wider), and each row's
  maximum allowed logit (-inf for none) as a third output when cfg.max_logits."""
  B, H, Sq, _ = q.shape
  Hkv, Skv = k.shape[1], k.shape[2]
  acc = jnp.promote_types(q.dtype, jnp.float32)
  group = H // Hkv
  k = jnp.repeat(k, group, axis=1)
  v = jnp.repeat(v, group, axis=1)
  s = jnp.einsum("bhqd,bhkd->bhqk", q.astype(acc), k.astype(acc)) * cfg.scale
  if bias is not None:
    s = s + bias.astype(acc)
  b_idx = jnp.arange(B, dtype=jnp.int32)[:, None, None, None]
  h_idx = jnp.arange(H, dtype=jnp.int32)[None, :, None, None]
  q_idx = jnp.arange(Sq, dtype=jnp.int32)[None, None, :, None]
  kv_idx = jnp.arange(Skv, dtype=jnp.int32)[None, None, None, :]
  allowed = mask_spec(cfg).dense(q_seg, kv_seg, mask)
  if cfg.mask_mod is not None:
    allowed = allowed & _mask_mod.apply(cfg.mask_mod, mod.consts, b_idx, h_idx, q_idx, kv_idx)
  allowed = jnp.broadcast_to(allowed, s.shape)
  # A masked position may hold any finite K / V (padding filled with finfo.max): its score
  # is selected away before anything else reads it, and the output is (e @ v) / l rather
  # than (e / l) @ v, so that no cotangent multiplies a masked entry's inf dO . v by p = 0.
  s = jnp.where(allowed, s, 0.0)
  if cfg.score_mod is not None:
    s = _score_mod.apply(cfg.score_mod, consts, s, b_idx, h_idx, q_idx, kv_idx)
  s = jnp.where(allowed, s, -jnp.inf)
  m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  e = jnp.where(allowed, jnp.exp(s - m), 0.0)
  l = jnp.sum(e, axis=-1, keepdims=True)
  empty = l == 0.0
  lse = jnp.where(empty, -jnp.inf, jnp.log(jnp.where(empty, 1.0, l)) + m)[..., 0]
  if cfg.dropout_active:
    keep = _dropout.keep(seed[0], seed[1], b_idx, h_idx, q_idx, kv_idx, cfg.dropout_rate,
                         cfg.dropout_broadcast)
    e = jnp.where(keep, e / (1.0 - cfg.dropout_rate), 0.0)
  out = jnp.einsum("bhqk,bhkd->bhqd", e, v.astype(acc)) / jnp.where(empty, 1.0, l)
  if cfg.max_logits:
    return out.astype(q.dtype), lse, jax.lax.stop_gradient(jnp.max(s, axis=-1))
  return out.astype(q.dtype), lse
