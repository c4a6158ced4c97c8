"""Hierarchical context parallelism ("usp"): Ulysses over the inner mesh axes, the ring over
the outer ones, chosen from the links.

8 virtual CPU devices as a (node=2, gpu=4) mesh with the sequence sharded over
("node", "gpu"): every feature equals the same call on one device (forward, every gradient,
tangent; `test_partition_seq._compare`, float32, RING_TOL), and the compiled HLO holds the
all-to-alls on "gpu" and the collective-permutes on "node", with no whole-sequence gather.
The cost model's choice (`flashvjp._strategy`) and the links read from the devices'
placement (`flashvjp._partition.axis_links`) and from the compiled HLO
(`flashvjp._plan.link_bytes`) are checked on their own, without a compile.
"""
from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flashvjp
from flashvjp import _partition
from flashvjp import _plan
from flashvjp import _strategy
from tests.test_partition_seq import BLOCK
from tests.test_partition_seq import B
from tests.test_partition_seq import S
from tests.test_partition_seq import _check
from tests.test_partition_seq import _compare
from tests.test_partition_seq import _inputs
from tests.test_partition_seq import _mesh

SEQ = (None, None, ("node", "gpu"), None)
H8, HKV4 = 8, 4  # heads divide the 4 inner devices, not all 8: Ulysses alone cannot run


def _two_level():
  return _mesh((2, 4), ("node", "gpu"))


def _placement(hlo: str) -> None:
  """Every all-to-all runs over "gpu" (devices of one node: ids 4n..4n+3), every
  collective-permute over "node" (d -> d +- 4); no whole-sequence gather."""
  a2a = [l for l in hlo.splitlines() if "=" in l and re.search(r"\sall-to-all(-start)?\(", l)]
  perm = [l for l in hlo.splitlines()
          if "=" in l and re.search(r"\scollective-permute(-start)?\(", l)]
  assert a2a and perm, (len(a2a), len(perm))
  for line in a2a:
    groups = _plan.replica_groups(line, 8)
    assert groups and all(len({d // 4 for d in g}) == 1 and len(g) == 4 for g in groups), line
  for line in perm:
    pairs = _plan._pairs(line)
    assert pairs and all(abs(s - t) == 4 for s, t in pairs), line


def _usp(kw, **k):
  kw_fn = kw if callable(kw) else (lambda: kw)
  full = lambda *d: dict(kw_fn(*d), context_parallel="usp")
  hlo, bad = _compare(full, spec=SEQ, mesh=_two_level(), h=k.pop("h", H8),
                      hkv=k.pop("hkv", HKV4), **k)
  assert not bad, "all-gather of the whole sequence:\n" + "\n".join(bad)
  _placement(hlo)
  return hlo


# ---- exact on a (2, 4) mesh, every feature ----------------------------------------------------

def test_causal_segments_dropout_traced_scale():
  seg = jnp.repeat(jnp.arange(4, dtype=jnp.int32), S // 4)[None].repeat(B, 0)
  _usp(lambda sc: dict(causal=True, segment_ids=seg, scale=sc, dropout_rate=0.2,
                       dropout_rng=jax.random.key(7), deterministic=False),
       diff=(jnp.float32(0.3),))


def test_mask_mod_score_mod_and_sinks():
  _usp(lambda sl, sk: dict(mask_mod=flashvjp.prefix_lm(jnp.array([40, 150])),
                           score_mod=flashvjp.alibi(sl), sinks=sk),
       diff=(flashvjp.alibi_slopes(H8), jnp.linspace(-1.0, 1.0, H8)))


def test_bias_rows_and_key_padding_bias():
  kb, kp = jax.random.split(jax.random.key(5))
  bias = jax.random.normal(kb, (B, H8, S, S), jnp.float32)  # full heads and rows: all-to-all
  pad = jax.random.normal(kp, (B, 1, 1, S), jnp.float32)  # shared by heads and rows
  _usp(lambda b, p: dict(bias=b + p, window=(60, 10)), diff=(bias, pad), pairs=(0,))


def test_forward_mode_window_dropout():
  _usp(dict(window=(70, 0), dropout_rate=0.1, dropout_rng=jax.random.key(4),
            deterministic=False), mode="jvp")


def test_ring_head_groups():
  _usp(dict(causal=True, ring_head_groups=2), hkv=8)  # 2 kv heads a device after Ulysses


def test_heads_batch_and_both_sequence_axes():
  """(tp, node, gpu) = (2, 2, 2), heads over tp: the global head of dropout and the
  score_mod is (tp index, gpu index) over the device's heads."""
  mesh = _mesh((2, 2, 2), ("tp", "node", "gpu"))
  hlo, bad = _compare(lambda sl: dict(causal=True, score_mod=flashvjp.alibi(sl),
                                      dropout_rate=0.1, dropout_rng=jax.random.key(2),
                                      deterministic=False, context_parallel="usp"),
                      diff=(flashvjp.alibi_slopes(H8),), spec=(None, "tp", ("node", "gpu"), None),
                      mesh=mesh, h=H8, hkv=HKV4)
  assert not bad


def test_position_arrays_and_max_logits():
  """A mod's position-aligned arrays (document ids, a per-key bias) gathered over the inner
  axis only and sent round the ring; max logits the max over every shard."""
  mesh = _two_level()
  x = _inputs(H8, HKV4)
  doc = jnp.repeat(jnp.arange(4, dtype=jnp.int32), S // 4)[None].repeat(B, 0)
  kvb = jnp.cos(jnp.arange(S, dtype=jnp.float32))

  def loss(q, k, v, kvb, doc):
    out, ml = flashvjp.flash_attention(
        q, k, v, context_parallel="usp", block_q=BLOCK, block_kv=BLOCK,
        mask_mod=flashvjp.document_causal(doc), score_mod=lambda s, b, h, i, j: s + kvb[j],
        return_max_logits=True)
    return jnp.sum(out * x["w_out"]), (out, ml)

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
  seq = NamedSharding(mesh, P(*SEQ))
  placed = [jax.device_put(x[n], seq) for n in "qkv"]
  placed += [jax.device_put(kvb, NamedSharding(mesh, P(("node", "gpu")))),
             jax.device_put(doc, NamedSharding(mesh, P(None, ("node", "gpu"))))]
  with jax.default_matmul_precision("highest"):
    (_, (out, ml)), grads = fn(*placed)
    (_, (out_r, ml_r)), grads_r = fn(*[jax.device_put(a, jax.devices()[0])
                                       for a in (x["q"], x["k"], x["v"], kvb, doc)])
    hlo = fn.lower(*placed).compile().as_text()
  for name, g, r in zip(["out", "max_logits", "dq", "dk", "dv", "d kv bias"],
                        [out, ml, *grads], [out_r, ml_r, *grads_r]):
    _check(name, g, r)
  _placement(hlo)


def test_bottom_right_causal_unequal_lengths():
  mesh = _two_level()
  from flashvjp import testing
  k0, k1, k2 = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(k0, (1, 4, 64, 16), jnp.float32)
  k = jax.random.normal(k1, (1, 4, 128, 16), jnp.float32)
  v = jax.random.normal(k2, (1, 4, 128, 16), jnp.float32)
  xs = [jax.device_put(a, NamedSharding(mesh, P(*SEQ))) for a in (q, k, v)]
  d = flashvjp.explain(*xs, causal="bottom_right", context_parallel="usp")
  assert d.context_parallel.name == "usp", str(d)
  # the reference's mask (full heads: Ulysses splits a pair array by heads), ANDed with
  # causal="bottom_right" in the call under test
  allowed = np.arange(128)[None, :] <= np.arange(64)[:, None] + 64
  mask = jnp.broadcast_to(jnp.asarray(allowed), (1, 4, 64, 128))

  def fn(q, k, v, **kw):
    return flashvjp.flash_attention(q, k, v, causal="bottom_right", context_parallel="usp",
                                    block_q=16, block_kv=16, **kw)
  rep = testing.check(fn, query=xs[0], key=xs[1], value=xs[2], mask=mask)
  assert rep.passed, str(rep)


def test_inside_shard_map():
  """`ring_attention(axis_name="node", ulysses_axis="gpu")` in the user's shard_map equals
  one device (out, lse and every gradient) and moves what plain jit moves."""
  from flashvjp.distributed import _compat
  mesh = _two_level()
  x = _inputs(H8, HKV4)
  spec = P(*SEQ)

  def local(q, k, v):
    return flashvjp.ring_attention(q, k, v, axis_name="node", ulysses_axis="gpu", causal=True,
                                   dropout_rate=0.1, dropout_rng=jax.random.key(9),
                                   deterministic=False, return_lse=True, block_q=BLOCK,
                                   block_kv=BLOCK)

  ring = _compat.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, P(*SEQ[:3])))

  def loss(f):
    def inner(q, k, v):
      out, lse = f(q, k, v)
      return jnp.sum(out * x["w_out"]) + jnp.sum(lse * x["w_lse"]), (out, lse)
    return jax.jit(jax.value_and_grad(inner, argnums=(0, 1, 2), has_aux=True))

  one = lambda q, k, v: flashvjp.flash_attention(
      q, k, v, causal=True, dropout_rate=0.1, dropout_rng=jax.random.key(9),
      deterministic=False, return_lse=True, block_q=BLOCK, block_kv=BLOCK)
  placed = [jax.device_put(x[n], NamedSharding(mesh, spec)) for n in "qkv"]
  (_, got_aux), got = loss(ring)(*placed)
  (_, ref_aux), ref = loss(one)(x["q"], x["k"], x["v"])
  for name, g, r in zip(["out", "lse", "dq", "dk", "dv"], [*got_aux, *got], [*ref_aux, *ref]):
    _check(name, g, r)
  _placement(loss(ring).lower(*placed).compile().as_text())


# ---- the choice ---------------------------------------------------------------------------

def _cluster(links=("across_nodes", "in_node"), **kw):
  """The issue's case: 4 nodes x 8 H100, 128k tokens, 32 / 8 heads, D=128, bf16, causal."""
  base = dict(num_shards=32, batch=1, heads=32, kv_heads=8, seq_q=131072, seq_kv=131072,
              head_dim=128, head_dim_v=128, itemsize=2, causal=True,
              axes=(("node", 4, links[0]), ("gpu", 8, links[1])),
              bandwidth=_strategy.bandwidths("NVIDIA H100 80GB HBM3"))
  base.update(kw)
  return _strategy.Problem(**base)


def test_auto_picks_the_split_with_8x_fewer_inter_node_bytes():
  p = _cluster()
  st = _strategy.choose("auto", p, ("node", "gpu"))
  assert st.name == "usp" and st.ulysses_axes == ("gpu",) and st.ring_axes == ("node",), st
  ring = _strategy.choose("ring", p, ("node", "gpu"))
  across = lambda s: dict(s.link_bytes)["across_nodes"]
  assert across(ring) >= 8 * across(st), (across(ring), across(st))
  assert st.link_seconds < ring.link_seconds
  assert "Ulysses over ('gpu',), the ring over ('node',)" in str(st)
  assert "across_nodes" in str(st) and "slowest link" in st.reason


def test_links_unknown_weigh_bytes_and_say_so():
  st = _strategy.choose("auto", _cluster(links=(None, None)), ("node", "gpu"))
  assert st.name == "usp" and st.link_seconds is None and "links unknown" in st.reason
  assert dict(st.link_bytes) == {"unknown": st.bytes_forward + st.bytes_backward}


def test_links_decide_what_bytes_would_not():
  """MHA (32 heads divide all 32 shards) with an 8k sliding window: Ulysses over every
  device moves the fewest bytes, but 24/31 of them cross nodes; usp keeps its all-to-alls
  in the node and its ring needs one neighbour step across."""
  kw = dict(heads=32, kv_heads=32, window=(8192, 0))
  by_bytes = _strategy.choose("auto", _cluster(links=(None, None), **kw), ("node", "gpu"))
  by_links = _strategy.choose("auto", _cluster(**kw), ("node", "gpu"))
  assert by_bytes.name == "ulysses", by_bytes
  assert by_links.name == "usp", by_links
  ulysses = _strategy.choose("ulysses", _cluster(**kw), ("node", "gpu"))
  assert by_links.link_seconds < ulysses.link_seconds
  assert by_links.bytes_forward + by_links.bytes_backward > (
      ulysses.bytes_forward + ulysses.bytes_backward)


def test_usp_refusals_name_the_argument():
  one_axis = _strategy.Problem(num_shards=8, batch=1, heads=8, kv_heads=8, seq_q=4096,
                               seq_kv=4096, head_dim=64, head_dim_v=64, itemsize=2,
                               axes=(("sp", 8, "in_node"),))
  with pytest.raises(ValueError, match="context_parallel='usp' needs the sequence sharded"
                                       " over two or more mesh axes"):
    _strategy.choose("usp", one_axis, ("sp",))
  with pytest.raises(ValueError, match="context_parallel='usp' cannot run.*divisible"):
    _strategy.choose("usp", _cluster(heads=12, kv_heads=4), ("node", "gpu"))
  st = _strategy.choose("usp", _cluster(head_groups=2, kv_heads=16), ("node", "gpu"))
  assert st.head_groups == 2
  with pytest.raises(ValueError, match="ring_head_groups=3"):
    _strategy.choose("usp", _cluster(head_groups=3), ("node", "gpu"))


def test_axis_links_from_placement():
  dev = lambda i, proc: types.SimpleNamespace(id=i, process_index=proc, slice_index=0,
                                              platform="gpu")
  mesh = types.SimpleNamespace(axis_names=("node", "gpu"),
                               devices=np.array([[dev(4 * n + g, n) for g in range(4)]
                                                 for n in range(2)], dtype=object))
  assert _partition.axis_links(mesh, ("node", "gpu")) == ("across_nodes", "in_node")
  # one device per process: a process is no node, nothing known
  solo = types.SimpleNamespace(axis_names=("node", "gpu"),
                               devices=np.array([[dev(4 * n + g, 4 * n + g) for g in range(4)]
                                                 for n in range(2)], dtype=object))
  assert _partition.axis_links(solo, ("node", "gpu")) == (None, None)
  # TPU: a slice is the node (its hosts are joined by ICI)
  tpu = lambda i, proc, sl: types.SimpleNamespace(id=i, process_index=proc, slice_index=sl,
                                                  platform="tpu")
  pod = types.SimpleNamespace(axis_names=("dcn", "ici"),
                              devices=np.array([[tpu(4 * s + c, 2 * s + c // 2, s)
                                                 for c in range(4)] for s in range(2)],
                                               dtype=object))
  assert _partition.axis_links(pod, ("dcn", "ici")) == ("across_nodes", "in_node")
  cpu = _two_level()  # one process: every axis in the node
  assert _partition.axis_links(cpu, ("node", "gpu")) == ("in_node", "in_node")
  assert _partition.axis_links(jax.sharding.AbstractMesh((2, 4), ("node", "gpu")),
                               ("node", "gpu")) == (None, None)


def test_replica_groups_every_spelling_and_link_bytes():
  assert _plan.replica_groups("x, replica_groups={{0,1},{2,3}}, y", 4) == [[0, 1], [2, 3]]
  assert _plan.replica_groups("replica_groups=[2,4]<=[8], x", 8) == [[0, 1, 2, 3],
                                                                     [4, 5, 6, 7]]
  assert _plan.replica_groups("replica_groups=[4,2]<=[2,4]T(1,0)", 8) == [
      [0, 4], [1, 5], [2, 6], [3, 7]]
  assert _plan.replica_groups("replica_groups=mesh['node'=2,'gpu'=4] {'node'}, x", 8) == [
      [0, 4], [1, 5], [2, 6], [3, 7]]
  hlo = "\n".join([
      "ENTRY %main (p: f32[4]) -> f32[4] {",
      "  %a = f32[1024]{0} all-to-all(%p), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}",
      "  %c = f32[256]{0} collective-permute(%p), channel_id=2,"
      " source_target_pairs={{0,4},{4,0},{1,2}}",
      "}"])
  nodes = [0, 0, 0, 0, 1, 1, 1, 1]
  got = _plan.link_bytes(hlo, nodes)
  # all-to-all in the node: 3/4 of 4 KiB sent; the permute 0 -> 4 crosses nodes with 1 KiB
  assert got == {"in_node": 3 * 1024 + 1024, "across_nodes": 1024}, got


def test_intra_node_axes_say_the_links():
  """On one host every axis is in the node (the placement); `intra_node_axes` says which
  are, the others then cross nodes: the choice and explain follow."""
  mesh = _two_level()
  sh = NamedSharding(mesh, P(*SEQ))
  q = jax.ShapeDtypeStruct((1, 32, 4096, 64), jnp.bfloat16, sharding=sh)
  kv = jax.ShapeDtypeStruct((1, 8, 4096, 64), jnp.bfloat16, sharding=sh)
  placed = flashvjp.explain(q, kv, kv, causal=True).context_parallel
  assert set(dict(placed.link_bytes)) == {"in_node"}, placed
  said = flashvjp.explain(q, kv, kv, causal=True, intra_node_axes="gpu").context_parallel
  assert said.name == "usp" and said.ulysses_axes == ("gpu",), said
  assert dict(said.link_bytes)["across_nodes"] > 0 and "slowest link" in str(said)
  ring = flashvjp.explain(q, kv, kv, causal=True, intra_node_axes=("gpu",),
                          context_parallel="ring").context_parallel
  assert ring.link_seconds > said.link_seconds
  with pytest.raises(TypeError, match="intra_node_axes must be a mesh axis name"):
    flashvjp.explain(q, kv, kv, intra_node_axes=3)


def test_record_decisions_shows_the_split():
  mesh = _two_level()
  x = _inputs(H8, HKV4)
  placed = [jax.device_put(x[n], NamedSharding(mesh, P(*SEQ))) for n in "qkv"]
  f = jax.jit(lambda q, k, v: flashvjp.flash_attention(q, k, v, causal=True, block_q=BLOCK,
                                                       block_kv=BLOCK, intra_node_axes="gpu"))
  with flashvjp.record_decisions() as events:
    f.lower(*placed).compile()
  parts = [e for e in events if e.stage == "partition"]
  assert parts and all(e.detail.name == "usp" for e in parts), [str(e) for e in events]
  text = str(parts[0])
  assert "Ulysses over ('gpu',), the ring over ('node',)" in text and "across_nodes" in text
