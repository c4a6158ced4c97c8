"""Nameable residuals: what attention's backward needs, saved by a `jax.checkpoint` policy.

Room: training loops. The op's backward needs its inputs (q, k, v, ...), its output and
its logsumexp. The output and logsumexp are produced inside the op, so no user-side
`checkpoint_name` can reach the copies the backward reads; without them a checkpointed
layer re-runs attention's forward in the backward. The op names them here, where they are
made, so a policy that saves these names keeps them and XLA drops the recomputation.

Cost per layer: out [B, H, Sq, Dv] in the query's dtype and lse [B, H, Sq] float32, i.e.
O(seq * head_dim), never O(seq^2); a mask_mod's block classes [B|1, H|1, Sq/bq, Skv/bkv]
int8 too (the classification is otherwise re-run in the backward).
"""
from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

OUT = "flashvjp_out"
LSE = "flashvjp_lse"
MASK_MOD_BLOCKS = "flashvjp_mask_mod_blocks"
RESIDUAL_NAMES = (OUT, LSE, MASK_MOD_BLOCKS)


def name_residuals(out, lse):
  """(out, lse), named for a checkpoint policy (identity otherwise)."""
  return checkpoint_name(out, OUT), checkpoint_name(lse, LSE)


def name_mask_mod_blocks(classes):
  """A mask_mod's block classes (a pytree of int arrays), named for a checkpoint policy."""
  return jax.tree_util.tree_map(lambda c: checkpoint_name(c, MASK_MOD_BLOCKS), classes)


def checkpoint_policy(base=None):
  """A `jax.checkpoint` policy that saves attention's residuals, and what `base` saves.

  With it, a checkpointed layer's backward runs the attention backward on the saved
  output and logsumexp instead of re-running the attention forward::

      policy = flashvjp.checkpoint_policy(
          jax.checkpoint_policies.save_only_these_names("q", "k", "v"))
      layer = jax.checkpoint(layer, policy=policy)   # or nnx.remat / nn.remat(policy=...)

  `base`: None (save only attention's residuals), or any checkpoint policy (e.g.
  `jax.checkpoint_policies.dots_saveable`); a value either policy saves is saved. The
  names alone are `flashvjp.RESIDUAL_NAMES`, for `save_only_these_names(*mine,
  *flashvjp.RESIDUAL_NAMES)`. Costs O(seq * head_dim) per layer (out and lse), never
  O(seq^2).
  """
  ours = jax.checkpoint_policies.save_only_these_names(*RESIDUAL_NAMES)
  if base is None:
    return ours
  if not callable(base):
    raise TypeError(f"base must be a jax.checkpoint policy (a callable) or None, got {base!r}")
  return jax.checkpoint_policies.save_from_both_policies(base, ours)
