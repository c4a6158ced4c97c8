"""Mods that read arrays by one position, in the Mosaic-GPU kernels (interpret mode, races on).

A score_mod with a per-query temperature `temp[q_idx]` and a per-(batch, key) bias
`bias_vec[b, kv_idx]` (both differentiable), and a mask_mod with packed-document ids
`ids[b, q_idx] == ids[b, kv_idx]` (causal): their per-position values travel as row words
with Q and column words with K (`_common.PosResiduals`), so the forward, both backward
kernels and the tangent kernel read a [64]-slice per tile. Against float64 naive attention:
out / lse, dq / dk / dv and the arrays' gradients (the dQ kernel's per-row ones for temp,
the dK/dV kernel's per-column ones for bias_vec), and forward-mode tangents along every
input and both arrays; a chunk pair at global offsets reads the global positions' values.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashvjp import _mask_mod
from flashvjp import reference
from flashvjp.pallas.mosaic_gpu import _compat
from tests import _util
from tests import test_pallas_mosaic_gpu_backward as _backward_tests

_WHY = _compat.unavailable()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"Mosaic-GPU Pallas: {_WHY}")

if _WHY is None:
  from flashvjp.pallas.mosaic_gpu import backward as mgpu_backward
  from flashvjp.pallas.mosaic_gpu import forward as mgpu_forward
  from flashvjp.pallas.mosaic_gpu import tangent as mgpu_tangent


def _score_mod(s, b, h, q_idx, kv_idx, bias_vec, temp):
  return s * temp[q_idx] + bias_vec[b, kv_idx]


def _documents(b, h, q_idx, kv_idx, ids):
  return (ids[b, q_idx] == ids[b, kv_idx]) & (kv_idx <= q_idx)


def _problem(S=200, B=2, H=2, Hkv=1, D=64, seed=0):
  rng = np.random.default_rng(seed)
  q, k, v = _util.random_qkv(seed, B, H, Hkv, S, S, D, dtype=jnp.bfloat16)
  bias_vec = jnp.asarray(rng.standard_normal((B, S)), jnp.float32)
  temp = jnp.asarray(rng.uniform(0.5, 1.5, (S,)), jnp.float32)
  ids = jnp.asarray(np.cumsum(rng.random((B, S)) < 0.02, axis=1), jnp.int32)
  cfg = _backward_tests._cfg(S, S, D, score_mod=_score_mod, num_diff_consts=2,
                             mask_mod=_documents, mask_mod_blocks=(32, 64))
  return cfg, (q, k, v), (bias_vec, temp), _mask_mod.ModInputs(None, (ids,))


def _reference(cfg, qkv, consts, mod):
  f64 = _util.as64
  fwd = lambda q, k, v, *c: reference.attention(cfg, q, k, v, None, None, None, None, None, c,
                                                mod)
  return fwd, tuple(f64(x) for x in qkv + consts)


# head dim 256 (two programs share each block); 64, the plainest path, is left out for CI time
@pytest.mark.parametrize("D", [256])
def test_forward_backward_and_array_gradients(D):
  cfg, qkv, consts, mod = _problem(D=D)
  fwd, primals = _reference(cfg, qkv, consts, mod)
  (out, lse), vjp = jax.vjp(fwd, *primals)
  do = jax.random.normal(jax.random.key(1), out.shape, jnp.float64).astype(jnp.bfloat16)
  ref = vjp((_util.as64(do), jnp.zeros_like(lse)))
  _compat.reset_interpret_state()
  got_out, got_lse = jax.block_until_ready(mgpu_forward.forward(
      cfg, *qkv, None, None, None, None, None, consts, mod))
  assert not _compat.interpret_races_found()
  _util.assert_close((got_out, got_lse), (out, lse), jnp.bfloat16, what="positions forward")
  _compat.reset_interpret_state()
  got = jax.block_until_ready(mgpu_backward.backward(
      cfg, *qkv, None, None, None, None, None, consts, out.astype(jnp.float32),
      lse.astype(jnp.float32), do, None, mod))
  assert not _compat.interpret_races_found()
  _util.assert_close(tuple(got[:3]) + tuple(got[4]), ref, jnp.bfloat16,
                     what="positions dq, dk, dv, d bias_vec, d temp")
  assert all(float(jnp.abs(d).max()) > 0 for d in got[4])  # the arrays do get gradients


def test_tangent_along_inputs_and_arrays():
  cfg, qkv, consts, mod = _problem(seed=1)
  fwd, primals = _reference(cfg, qkv, consts, mod)
  rng = np.random.default_rng(2)
  tangents = tuple(jnp.asarray(rng.standard_normal(x.shape), x.dtype) for x in qkv + consts)
  (out, lse), (t_out, t_lse) = jax.jvp(fwd, primals, tuple(_util.as64(t) for t in tangents))
  _compat.reset_interpret_state()
  got = jax.block_until_ready(mgpu_tangent.tangent(
      cfg, *qkv, None, None, None, None, None, consts, out.astype(jnp.bfloat16),
      lse.astype(jnp.float32), *tangents[:3], None, tangents[3:], mod))
  assert not _compat.interpret_races_found()
  _util.assert_close(got, (t_out, t_lse), jnp.bfloat16, what="positions tangent")


def test_forward_chunk_pair_reads_global_positions():
  """Batch 1, head 1, q rows 64.. against kv rows 64.. of a 192-long problem, offsets (1, 1,
  64, 64): the arrays are the global ones; the pair's out / lse are those of its part of the
  global problem restricted to its keys."""
  S, C = 192, 64
  cfg, qkv, consts, mod = _problem(S=S, seed=3)
  rows = (slice(1, 2), slice(1, 2), slice(C, S))
  kv_rows = (slice(1, 2), slice(0, 1), slice(C, S))  # q head 1's kv head (GQA, G = 2)
  q, k, v = qkv
  local = _backward_tests._cfg(S - C, S - C, 64, score_mod=_score_mod, num_diff_consts=2,
                               mask_mod=_documents, mask_mod_blocks=(32, 64))
  _compat.reset_interpret_state()
  out, lse = jax.block_until_ready(mgpu_forward.forward(
      local, q[rows], k[kv_rows], v[kv_rows], None, None, None, None, None, consts, mod,
      offsets=(1, 1, C, C)))
  assert not _compat.interpret_races_found()
  # the reference: the global problem with keys < C masked out (a dense mask)
  keep = jnp.asarray(np.arange(S) >= C)[None, None, None, :]
  f64 = _util.as64
  ro, rl = reference.attention(cfg, *(f64(x) for x in qkv), None, keep, None, None, None,
                               tuple(f64(c) for c in consts), mod)
  _util.assert_close((out, lse), (ro[rows], rl[rows]), jnp.bfloat16, what="positions pair")
