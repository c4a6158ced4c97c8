"""The shared test base run against the blockwise pure-JAX path, plus its own structure checks."""
import jax
import jax.numpy as jnp

import flashvjp
from tests import _util
from tests.attention_base import AttentionTests


class TestBlockwise(AttentionTests):
  IMPLEMENTATION = "blockwise"


def test_backward_is_hand_written_not_autodiff():
  """The grad jaxpr holds the custom_vjp; blockwise forward has no O(seq^2) residual."""
  q, k, v = _util.random_qkv(0, 1, 2, 2, 64, 64, 8)
  f = lambda q, k, v: flashvjp.flash_attention(q, k, v, implementation="blockwise", block_q=16,
                                               block_kv=16).sum()
  jaxpr = str(jax.make_jaxpr(jax.grad(f, (0, 1, 2)))(q, k, v))
  assert "custom_vjp_call" in jaxpr
  # Residuals saved for the backward: inputs, out and lse only (nothing of size seq^2).
  _, vjp = jax.vjp(lambda q, k, v: flashvjp.flash_attention(
      q, k, v, implementation="blockwise", block_q=16, block_kv=16), q, k, v)
  leaves = jax.tree_util.tree_leaves(vjp)
  assert leaves, "vjp closure holds no residuals"
  assert max(x.size for x in leaves if hasattr(x, "size")) < 64 * 64 * 2
