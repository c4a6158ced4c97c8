"""`flashvjp._delta`: a backward given out=None and rowsum(dO * O) folded into the lse
cotangent (what Ulysses passes, so O never moves to the heads layout) equals the backward
given O, in every backend family."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from flashvjp import _api
from flashvjp import _delta
from flashvjp.pallas.mosaic_gpu import _compat as mgpu_compat

FAMILIES = ["blockwise", "pallas_triton", "pallas_tpu", "pallas_mosaic_gpu"]


def _family(name):
  if name == "blockwise":
    from flashvjp import blockwise as family
  elif name == "pallas_triton":
    from flashvjp.pallas import triton as family  # type: ignore[no-redef]
  elif name == "pallas_tpu":
    from flashvjp.pallas import tpu as family  # type: ignore[no-redef]
  else:
    from flashvjp.pallas.mosaic_gpu import backend as family  # type: ignore[no-redef]
  return family


def test_delta_and_fold():
  rng = np.random.default_rng(0)
  out, dout = (jnp.asarray(rng.standard_normal((2, 3, 5, 4)), jnp.float32) for _ in range(2))
  dlse = jnp.asarray(rng.standard_normal((2, 3, 5)), jnp.float32)
  want = np.sum(np.asarray(out) * np.asarray(dout), -1) - np.asarray(dlse)
  np.testing.assert_allclose(_delta.delta(out, dout, dlse, jnp.float32), want, rtol=1e-6)
  folded = _delta.fold(out, dout, dlse, jnp.float32)
  np.testing.assert_array_equal(_delta.delta(None, dout, folded, jnp.float32),
                                _delta.delta(out, dout, dlse, jnp.float32))
  with pytest.raises(ValueError, match="dlse"):
    _delta.delta(None, dout, None, jnp.float32)


@pytest.mark.parametrize("with_dlse", [False, True])
@pytest.mark.parametrize("name", FAMILIES)
def test_backward_with_delta_folded_into_dlse_equals_backward_with_out(name, with_dlse):
  if name == "pallas_mosaic_gpu" and mgpu_compat.unavailable():
    pytest.skip(mgpu_compat.unavailable())
  dtype = jnp.bfloat16 if name == "pallas_mosaic_gpu" else jnp.float32
  rng = np.random.default_rng(1)
  B, H, Hkv, S, D = 1, 4, 2, 128, 64
  q = jnp.asarray(rng.standard_normal((B, H, S, D)), dtype)
  k, v = (jnp.asarray(rng.standard_normal((B, Hkv, S, D)), dtype) for _ in range(2))
  dout = jnp.asarray(rng.standard_normal((B, H, S, D)), dtype)
  dlse = jnp.asarray(rng.standard_normal((B, H, S)), jnp.float32) if with_dlse else None
  _, cfg, arrays = _api._prepare(
      q, k, v, bias=None, mask=None, causal=True, window=None, segment_ids=None,
      score_mod=None, scale=None, dropout_rate=0.0, dropout_rng=None, deterministic=True,
      implementation=name, block_q=None, block_kv=None, interpret=True)
  q, k, v = arrays[:3]
  family = _family(name)
  common = (cfg, q, k, v, None, None, None, None, None, ())
  out, lse = family.forward(*common)
  acc = jnp.promote_types(dtype, jnp.float32)
  want = family.backward(*common, out, lse, dout, dlse)[:3]
  got = family.backward(*common, None, lse, dout, _delta.fold(out, dout, dlse, acc))[:3]
  for g, w in zip(got, want):
    assert np.all(np.isfinite(np.asarray(g, np.float32)))
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["blockwise", "pallas_triton", "pallas_tpu"])
def test_tangent_without_out_then_tangent_out_equals_tangent_with_out(name):
  """The tangent pass given out=None returns a = t_out + t_lse * O; `_delta.tangent_out`
  applies the O term where O is (what Ulysses does in the sequence layout)."""
  from flashvjp import _vjp
  rng = np.random.default_rng(2)
  B, H, Hkv, S, D = 1, 4, 2, 96, 32
  q, tq = (jnp.asarray(rng.standard_normal((B, H, S, D)), jnp.float32) for _ in range(2))
  k, v, tk, tv = (jnp.asarray(rng.standard_normal((B, Hkv, S, D)), jnp.float32)
                  for _ in range(4))
  _, cfg, arrays = _api._prepare(
      q, k, v, bias=None, mask=None, causal=True, window=None, segment_ids=None,
      score_mod=None, scale=None, dropout_rate=0.0, dropout_rng=None, deterministic=True,
      implementation=name, block_q=32, block_kv=32, interpret=True)
  common = (cfg, *arrays[:3], None, None, None, None, None, ())
  out, lse = _family(name).forward(*common)
  tangent = _vjp._tangent_kernel(name)[0]
  want = tangent(*common, out, lse, tq, tk, tv, None, ())
  a, t_lse = tangent(*common, None, lse, tq, tk, tv, None, ())
  np.testing.assert_array_equal(np.asarray(t_lse), np.asarray(want[1]))
  got = _delta.tangent_out(a, t_lse, out)
  assert got.dtype == want[0].dtype
  np.testing.assert_allclose(np.asarray(got), np.asarray(want[0]), rtol=1e-5, atol=1e-5)
  # and the O term is really left out
  assert np.abs(np.asarray(a) - np.asarray(want[0])).max() > 1e-3
