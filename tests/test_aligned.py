"""`flashvjp._aligned`: which arrays a mod reads at exactly the query / key position, and
reading them as local slices (what lets sequence sharding split them instead of copying)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from flashvjp import _aligned

S = 64
F32 = jnp.float32


def _align(fn, consts, n_diff=0, mask=False, seq_q=S, seq_kv=S):
  return _aligned.align(fn, consts, F32, seq_q, seq_kv, n_diff, mask=mask)


def test_per_key_vector_and_per_query_temperature():
  kvb, tq = jnp.cos(jnp.arange(S, dtype=F32)), jnp.sin(jnp.arange(S, dtype=F32))
  mod, consts = _align(lambda s, b, h, q, kv, a, t: s * t[q] + a[kv], (kvb, tq), n_diff=2)
  assert mod.axes == ((0, "kv"), (0, "q")) and len(consts) == 2
  assert mod.tags(0) == ("s",) and mod.tags(1) == ("q",)


def test_document_ids_read_at_both_positions_get_a_key_copy():
  doc = jnp.repeat(jnp.arange(4, dtype=jnp.int32), S // 4)[None].repeat(2, 0)
  mod, consts = _align(lambda b, h, q, kv, d: (d[b, q] == d[b, kv]) & (kv <= q), (doc,),
                       mask=True)
  assert mod.axes == ((1, "q"), (1, "kv")) and len(consts) == 2
  assert consts[1] is doc and mod.source == (0, 0)
  assert mod.tags(0) == (None, "q") and mod.tags(1) == (None, "s")


@pytest.mark.parametrize("name,fn,const", [
    # by kv_idx - q_idx: a table of differences, whole
    ("difference", lambda s, b, h, q, kv, t: s + t[h, jnp.clip(kv - q, -8, 8) + 8],
     jnp.ones((4, 17), F32)),
    # the sequence's length, but not at the raw position
    ("clamped", lambda s, b, h, q, kv, t: s + t[jnp.minimum(kv + 1, S - 1)],
     jnp.ones((S,), F32)),
    # at the position, but another length (the index is then not the slice's own)
    ("longer", lambda s, b, h, q, kv, t: s + t[kv], jnp.ones((2 * S,), F32)),
    # read at the position and elsewhere
    ("also elementwise", lambda s, b, h, q, kv, t: s + t[kv] + t.sum(), jnp.ones((S,), F32)),
])
def test_other_reads_stay_whole(name, fn, const):
  assert _align(fn, (const,)) is None, name


def test_a_differentiable_array_read_at_both_positions_stays_whole():
  v = jnp.ones((S,), F32)
  assert _align(lambda s, b, h, q, kv, a: s + a[q] * a[kv], (v,), n_diff=1) is None
  mod, consts = _align(lambda s, b, h, q, kv, a: s + a[q] * a[kv], (v,), n_diff=0)
  assert mod.axes == ((0, "q"), (0, "kv")) and len(consts) == 2


def test_local_slices_give_the_global_values():
  """shifted((b0, h0, q0, kv0)) on the slices starting at q0 / kv0 equals the mod on the
  whole arrays at the global positions, including a mod that reads an array's shape."""
  rng = np.random.default_rng(0)
  kvb = jnp.asarray(rng.normal(size=S), F32)
  tq = jnp.asarray(rng.normal(size=(2, S)), F32)

  def fn(s, b, h, q, kv, a, t):
    return s * t[b, q] + a[kv] + a.shape[0]  # the global length, not the slice's

  mod, consts = _align(fn, (kvb, tq), n_diff=2)
  q0, kv0, n = 16, 40, 8
  local = (kvb[kv0:kv0 + n], tq[:, q0:q0 + n])
  shifted = mod.shifted((0, 0, jnp.int32(q0), jnp.int32(kv0)))
  for qi in range(q0, q0 + n):
    for ki in (kv0, kv0 + 3, kv0 + n - 1):
      args = (F32(0.5), jnp.int32(1), jnp.int32(0), jnp.int32(qi), jnp.int32(ki))
      want = fn(*args, *consts)
      np.testing.assert_allclose(mod(*args, *consts), want, rtol=1e-6)
      np.testing.assert_allclose(shifted(*args, *local), want, rtol=1e-6)


def test_a_mask_reads_its_key_copy_as_the_chunk_in_hand():
  """The key-aligned copy is what the kv reads use: a slice of another part of the
  sequence than the query copy's."""
  doc = jnp.asarray(np.repeat(np.arange(4), S // 4)[None], jnp.int32)  # 16 per document
  mod, _ = _align(lambda b, h, q, kv, d: d[b, q] == d[b, kv], (doc,), mask=True)
  q0, kv0, n = 16, 24, 16
  shifted = mod.shifted((0, 0, q0, kv0))
  dq, dkv = doc[:, q0:q0 + n], doc[:, kv0:kv0 + n]
  got = [bool(shifted(jnp.int32(0), jnp.int32(0), jnp.int32(qi), jnp.int32(ki), dq, dkv))
         for qi, ki in [(20, 28), (20, 35), (31, 24), (16, 39)]]
  assert got == [True, False, True, False]
