"""Inside training loops: a checkpointed layer never re-runs attention's forward.

The op names the residuals its backward needs (out, lse; a mask_mod's block classes) with
`checkpoint_name` (flashvjp._remat). A layer checkpointed with a policy that saves the
user's own names only (MaxText's `save_only_these_names("q", "k", "v", "context")`) re-runs
the attention forward in the backward: the backward's lse is no value the user can name.
With `flashvjp.checkpoint_policy(that_policy)` the compiled program runs the forward once,
as many forward passes as the same layer without remat. Counted in the compiled program:
blockwise by its loops (named scope `flashvjp_blockwise_fwd`), on one device and with the
sequence sharded over 4 virtual devices; the Triton and Mosaic-GPU kernels compiled for an
H100 and the Mosaic-TPU kernels for a v5e without the hardware (tests/_aot.py).
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flashvjp
from tests import _aot

USER_NAMES = jax.checkpoint_policies.save_only_these_names("q", "k", "v", "context")
POLICIES = {
    "no remat": None,
    "user names only": USER_NAMES,
    "with flashvjp.checkpoint_policy": flashvjp.checkpoint_policy(USER_NAMES),
}


def _layer(B, S, E, H, **attn_kw):
  """x -> q, k, v (named) -> causal attention -> "context" -> out projection."""
  D = E // H

  def layer(x, w):
    heads = lambda t: t.reshape(B, S, H, D).transpose(0, 2, 1, 3)
    q, k, v = (checkpoint_name(heads(x @ w[i]), n) for i, n in enumerate("qkv"))
    o = flashvjp.flash_attention(q, k, v, causal=True, **attn_kw)
    o = checkpoint_name(o, "context")
    return o.transpose(0, 2, 1, 3).reshape(B, S, E) @ w[3]
  return layer


def _grad(layer, policy):
  f = layer if policy is None else jax.checkpoint(layer, policy=policy)
  return jax.jit(jax.grad(lambda x, w: f(x, w).astype(jnp.float32).sum(), argnums=(0, 1)))


def _blockwise_loops(hlo: str, which: str) -> int:
  ops = re.findall(r"\swhile\([^\n]*?op_name=\"([^\"]*)\"", hlo)
  return sum(f"flashvjp_blockwise_{which}/" in o for o in ops)


B, S, E, H = 1, 1024, 64, 2


@pytest.mark.parametrize("sharded", [False, True], ids=["one device", "seq sharded x4"])
def test_blockwise_checkpointed_layer_runs_the_forward_once(sharded):
  layer = _layer(B, S, E, H, implementation="blockwise", block_q=64, block_kv=64)
  rng = np.random.default_rng(0)
  x = rng.standard_normal((B, S, E)).astype(np.float32)
  w = (rng.standard_normal((4, E, E)) / 8).astype(np.float32)
  if sharded:
    mesh = Mesh(np.array(jax.devices()[:4]), ("sp",))
    x = jax.device_put(x, NamedSharding(mesh, P(None, "sp", None)))
  counts, grads = {}, {}
  for name, policy in POLICIES.items():
    fn = _grad(layer, policy)
    hlo = fn.lower(x, w).compile().as_text()
    counts[name] = (_blockwise_loops(hlo, "fwd"), _blockwise_loops(hlo, "bwd"))
    grads[name] = fn(x, w)
  fwd, bwd = counts["no remat"]
  assert fwd >= 1 and bwd >= 1, counts
  # the absence of the names re-runs the forward (what the helper exists for) ...
  assert counts["user names only"] == (2 * fwd, bwd), counts
  # ... and with them the checkpointed layer runs exactly what the plain layer runs
  assert counts["with flashvjp.checkpoint_policy"] == (fwd, bwd), counts
  for name in POLICIES:  # remat changes what is stored, never the result
    for got, want in zip(grads[name], grads["no remat"]):
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def _kernel_counts(mesh, call, **attn_kw):
  x = _aot.sds(mesh, (2, 2048, 512), jnp.bfloat16)
  w = _aot.sds(mesh, (4, 512, 512), jnp.bfloat16)
  layer = _layer(2, 2048, 512, 4, **attn_kw)
  return {name: _grad(layer, policy).lower(x, w).compile().as_text().count(call)
          for name, policy in POLICIES.items()}


def _assert_forward_once(counts):
  plain = counts["no remat"]
  assert plain >= 3, counts  # forward, dK/dV, dQ
  assert counts["user names only"] == plain + 1, counts  # the forward kernel again
  assert counts["with flashvjp.checkpoint_policy"] == plain, counts


@_aot.needs_cuda
@pytest.mark.parametrize("implementation,call", [
    ("pallas_triton", _aot.TRITON_CALL), ("pallas_mosaic_gpu", 'custom_call_target="mosaic_gpu')])
def test_h100_checkpointed_layer_compiles_one_forward_kernel(implementation, call):
  _assert_forward_once(_kernel_counts(_aot.gpu_mesh("h100"), call, implementation=implementation))


@_aot.needs_tpu
def test_v5e_checkpointed_layer_compiles_one_forward_kernel():
  _assert_forward_once(_kernel_counts(_aot.tpu_mesh("v5e"), _aot.TPU_CALL))


def test_policy_combines_with_a_base_policy_and_rejects_a_non_policy():
  names = set(flashvjp.RESIDUAL_NAMES)
  assert {"flashvjp_out", "flashvjp_lse"} <= names
  pol = flashvjp.checkpoint_policy(jax.checkpoint_policies.dots_saveable)
  # checkpoint_name binds `name_p`; a policy sees (prim, *avals, **params)
  name_p = jax.make_jaxpr(lambda x: checkpoint_name(x, "flashvjp_lse"))(1.0).eqns[0].primitive
  aval = jax.core.ShapedArray((), jnp.float32)
  assert pol(name_p, aval, name="flashvjp_lse")
  assert not pol(name_p, aval, name="somebody_else")
  dot = jax.make_jaxpr(jnp.dot)(np.ones((2, 2)), np.ones((2, 2))).eqns[0]
  assert pol(dot.primitive, aval, aval, **dot.params)  # what the base saves is saved
  assert not flashvjp.checkpoint_policy()(dot.primitive, aval, aval, **dot.params)
  with pytest.raises(TypeError, match="base"):
    flashvjp.checkpoint_policy("q")
