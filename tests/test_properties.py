"""hypothesis: random shapes, masks with empty rows and segment layouts; blockwise == naive."""
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import flashvjp
from tests import _util


@st.composite
def problems(draw):
  hkv = draw(st.sampled_from([1, 2]))
  group = draw(st.sampled_from([1, 2, 3]))
  sq = draw(st.integers(1, 300))
  skv = draw(st.one_of(st.just(sq), st.integers(1, 300)))
  d = draw(st.sampled_from([1, 3, 5, 8, 17]))
  dv = draw(st.sampled_from([d, 2, 7]))
  kind = draw(st.sampled_from(["none", "causal", "window", "mask", "segments"]))
  kw = {}
  rng = np.random.default_rng(draw(st.integers(0, 2**16)))
  if kind == "causal":
    kw["causal"] = True
  elif kind == "window":
    kw["window"] = (draw(st.one_of(st.none(), st.integers(0, 40))),
                    draw(st.one_of(st.none(), st.integers(0, 40))))
    kw["causal"] = draw(st.booleans())
  elif kind == "mask":
    m = rng.random((1, 1, sq, skv)) < draw(st.floats(0.05, 1.0))
    m[..., rng.integers(0, sq), :] = False  # at least one empty row
    kw["mask"] = jnp.asarray(m)
  elif kind == "segments":
    qs = np.sort(rng.integers(0, 4, (1, sq)), axis=1).astype(np.int32)
    ks = np.sort(rng.integers(0, 4, (1, skv)), axis=1).astype(np.int32)
    kw["segment_ids"] = (jnp.asarray(qs), jnp.asarray(ks))
  blocks = (draw(st.sampled_from([1, 16, 32, 128, 512])), draw(st.sampled_from([3, 16, 64, 512])))
  return dict(hkv=hkv, h=hkv * group, sq=sq, skv=skv, d=d, dv=dv, kw=kw, blocks=blocks,
              seed=draw(st.integers(0, 1000)))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_blockwise_equals_naive(p):
  q, k, v = _util.random_qkv(p["seed"], 1, p["h"], p["hkv"], p["sq"], p["skv"], p["d"], p["dv"])
  w = jax.random.normal(jax.random.key(p["seed"]), (1, p["h"], p["sq"], p["dv"]), jnp.float64)

  def f(q, k, v, impl, **blocks):
    out, lse = flashvjp.flash_attention(q, k, v, implementation=impl, return_lse=True, **p["kw"], **blocks)
    return jnp.sum(out * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)

  got = jax.value_and_grad(f, (0, 1, 2), has_aux=True)(
      q, k, v, "blockwise", block_q=p["blocks"][0], block_kv=p["blocks"][1])
  ref = jax.value_and_grad(f, (0, 1, 2), has_aux=True)(*_util.as64((q, k, v)), "naive")
  _util.assert_close(got, ref, jnp.float32)
