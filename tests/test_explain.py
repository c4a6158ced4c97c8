"""`explain` answers the questions users ask (issue 31): what a program decided inside jit
(`record_decisions`), the drop-in's layout and keywords, and what would run on a named target
from this CPU host."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flashvjp


@pytest.fixture(scope="module")
def mesh():
  return Mesh(np.array(jax.devices()[:4]), ("sp",))


def test_decisions_made_inside_jit_are_recorded(mesh):
  sh = NamedSharding(mesh, P(None, None, "sp", None))
  x = jnp.ones((1, 4, 256, 16), jnp.float32)

  def loss(x):
    y = jax.lax.with_sharding_constraint(x, sh)  # sharded only inside the program
    return flashvjp.flash_attention(y, y, y, causal=True).sum()

  # before tracing, the unsharded input says nothing about the sequence's sharding
  assert flashvjp.explain(x, x, x, causal=True).context_parallel is None
  f = jax.jit(jax.grad(loss))
  with flashvjp.record_decisions() as events:
    f(x)
  stages = [(e.stage, e.kind) for e in events]
  assert ("dispatch", "call") in stages
  parts = {e.kind: e for e in events if e.stage == "partition"}
  assert set(parts) == {"forward", "backward"}, stages
  for e in parts.values():
    assert e.detail is not None and e.detail.name in ("ring", "ulysses"), str(e)
    assert e.axes[2] == "sp" and "sequence over sp" in str(e)
  with flashvjp.record_decisions() as again:
    f(x)  # cached: nothing is traced or partitioned again
  assert again == []
  f(x)  # no recorder open: nothing recorded anywhere
  assert len(events) == len(stages)


def test_drop_in_layout_and_keywords(mesh):
  bshd = jax.ShapeDtypeStruct((2, 256, 4, 16), jnp.float32,
                              sharding=NamedSharding(mesh, P(None, "sp", None, None)))
  bhsd = jax.ShapeDtypeStruct((2, 4, 256, 16), jnp.float32,
                              sharding=NamedSharding(mesh, P(None, None, "sp", None)))
  got = flashvjp.explain(bshd, bshd, bshd, is_causal=True, local_window_size=32,
                         query_seq_lengths=np.array([100, 256]))
  want = flashvjp.explain(bhsd, bhsd, bhsd, causal=True, window=(32, 32),
                          segment_ids=(np.zeros((2, 256), np.int32),) * 2)
  assert got.implementation == want.implementation
  assert got.context_parallel is not None
  assert got.context_parallel.name == want.context_parallel.name
  assert "BSHD: batch 2, heads 4, seq 256" in str(got)
  assert "BHSD: batch 2, heads 4, seq 256" in str(want)
  # the jax.nn layout said out loud, no keyword needed
  assert "heads 4" in flashvjp.explain(bshd, bshd, bshd, layout="BSHD").reading
  # the jax.nn layout with seq_q != seq_kv and GQA (decoding) is checked as BSHD, not read
  # as [batch, heads, seq, head_dim] (seq_kv taken for the kv heads)
  dec = flashvjp.explain(jax.ShapeDtypeStruct((2, 4, 8, 16), jnp.float32),
                         *(jax.ShapeDtypeStruct((2, 64, 2, 16), jnp.float32),) * 2,
                         is_causal="bottom_right")
  assert "BSHD: batch 2, heads 8, seq 4" in str(dec)
  with pytest.raises(ValueError, match=r"key must have rank 4 \[batch, seq, heads"):
    flashvjp.explain(bshd, jax.ShapeDtypeStruct((2, 256, 4), jnp.float32), bshd,
                     is_causal=True)
  with pytest.raises(TypeError, match="is_causal.*layout='BHSD'"):
    flashvjp.explain(bhsd, bhsd, bhsd, is_causal=True, layout="BHSD")
  with pytest.raises(ValueError, match="layout must be"):
    flashvjp.explain(bhsd, bhsd, bhsd, layout="BTNH")


@pytest.mark.parametrize("target,implementation", [
    ("h100", "pallas_triton"), ("b200", "pallas_triton"), ("v5e", "pallas_tpu"),
    ("v6e", "pallas_tpu"), ("cpu", "blockwise")])
def test_a_named_target_answers_from_this_host(target, implementation):
  q = np.zeros((1, 8, 2048, 128), np.float32).astype(jnp.bfloat16)
  d = flashvjp.explain(q, q, q, causal=True, target=target)
  assert d.implementation == implementation and not d.interpret, str(d)
  assert d.target.source == "a named target"


def test_named_target_errors_and_mosaic_gpu_on_blackwell():
  q = jax.ShapeDtypeStruct((1, 8, 2048, 128), jnp.bfloat16)
  d = flashvjp.explain(q, q, q, target="h100x8", implementation="pallas_mosaic_gpu")
  assert d.target.num_devices == 8 and not d.interpret
  # Blackwell: the family's sm_100a kernels (head dims up to 128 there), never Hopper's
  from flashvjp.pallas.mosaic_gpu import _compat
  if _compat.blackwell_unavailable() is not None:
    with pytest.raises(ValueError, match="jax >= 0.12"):
      flashvjp.explain(q, q, q, target="b200", implementation="pallas_mosaic_gpu")
  else:
    d = flashvjp.explain(q, q, q, target="b200", implementation="pallas_mosaic_gpu")
    assert d.implementation == "pallas_mosaic_gpu" and "sm_100a" in d.reason, str(d)
    wide = jax.ShapeDtypeStruct((1, 8, 2048, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="Blackwell.*head_dim 256.*pallas_triton"):
      flashvjp.explain(wide, wide, wide, target="b200", implementation="pallas_mosaic_gpu")
  with pytest.raises(ValueError, match="target must be one of .*h100"):
    flashvjp.explain(q, q, q, target="a100")
