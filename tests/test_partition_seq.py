"""Sequence sharding under plain jax.jit: a context-parallel strategy, never a whole-sequence gather.

8 virtual CPU devices (conftest). q / k / v [B, H, S, D] are placed with
NamedSharding(mesh, P(..., "sp", ...)) and `jax.jit(jax.value_and_grad(loss))` runs around
plain `flash_attention`: the custom_partitioning rule (flashvjp/_partition.py) runs the
strategy chosen by flashvjp/_strategy.py inside the partition. Each case compares out, lse
and every gradient with the same call on unsharded inputs (one device; float32, RING_TOL of
the largest magnitude) and parses the compiled HLO: no all-gather whose result holds the
whole sequence of an attention array.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flashvjp
from flashvjp import _strategy

B, H, HKV, S, D = 2, 4, 2, 256, 16
BLOCK = 32
RING_TOL = 2e-5  # float32, sharded vs one device, relative to the largest magnitude


def _mesh(shape=(8,), names=("sp",)):
  n = int(np.prod(shape))
  if jax.device_count() < n:
    pytest.skip(f"needs {n} devices")
  return Mesh(np.asarray(jax.devices()[:n]).reshape(shape), names)


def _inputs(h=H, hkv=HKV, seed=0, s=S):
  ks = jax.random.split(jax.random.key(seed), 6)
  r = lambda i, shape: jax.random.normal(ks[i], shape, jnp.float32)
  return dict(q=r(0, (B, h, s, D)), k=r(1, (B, hkv, s, D)), v=r(2, (B, hkv, s, D)),
              w_out=r(3, (B, h, s, D)), w_lse=r(4, (B, h, s)))


def _loss_fn(kw, n_diff):
  def loss(q, k, v, *d):
    extra = kw(*d) if callable(kw) else kw
    out, lse = flashvjp.flash_attention(q, k, v, return_lse=True, block_q=BLOCK,
                                        block_kv=BLOCK, **extra)
    return jnp.sum(out * W["out"]) + jnp.sum(jnp.where(jnp.isinf(lse), 0.0, lse) * W["lse"]), (
        out, lse)
  return loss


W: dict = {}


def _check(name, got, ref, tol=RING_TOL):
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  assert got.shape == ref.shape, f"{name}: shape {got.shape} != {ref.shape}"
  assert np.all(np.isfinite(got) == np.isfinite(ref)), f"{name}: non-finite entries differ"
  fin = np.isfinite(ref)
  scale = max(float(np.abs(ref[fin]).max()) if fin.any() else 0.0, 1e-30)
  err = float(np.abs(np.where(fin, got - ref, 0.0)).max()) if fin.any() else 0.0
  assert err <= tol * scale, f"{name}: max error {err:.3g} > {tol} * {scale:.3g}"


def whole_sequence_gathers(hlo: str, seq: int):
  """all-gather ops whose result has rank >= 3 and a dim of the whole sequence length."""
  bad = []
  for line in hlo.splitlines():
    if not re.search(r"\ball-gather(-start)?\(", line):
      continue
    m = re.search(r"=\s*\(?\w+\[([\d,]*)\]", line)
    dims = [int(d) for d in m.group(1).split(",") if d] if m else []
    if len(dims) >= 3 and seq in dims:
      bad.append(line.strip()[:200])
  return bad


def collectives(hlo: str) -> dict:
  ops = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")
  return {op: sum(1 for line in hlo.splitlines()
                 if "=" in line and re.search(rf"\s{op}(-start)?\(", line)) for op in ops}


def _compare(kw, diff=(), spec=(None, None, "sp", None), mesh=None, h=H, hkv=HKV, pairs=(),
             mode="grad", s=S):
  """Sharded jit(value_and_grad) (or jit(jvp)) == the same on unsharded inputs; returns the HLO.

  kw: flash_attention kwargs, or a callable diff arrays -> kwargs. pairs: names of rank-4
  [B, H, S, S] arrays among `diff` placed with their rows sharded like the queries.
  """
  mesh = mesh or _mesh()
  x = _inputs(h, hkv, s=s)
  W["out"], W["lse"] = x["w_out"], x["w_lse"]
  sh = NamedSharding(mesh, P(*spec))
  loss = _loss_fn(kw, len(diff))
  args = (x["q"], x["k"], x["v"]) + tuple(diff)
  if mode == "grad":
    fn = jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True)
  else:
    ts = tuple(jax.random.normal(jax.random.key(50 + i), a.shape, a.dtype)
               for i, a in enumerate(args[:3]))

    def fn(q, k, v, *d):
      extra = kw(*d) if callable(kw) else kw
      f = lambda q, k, v: flashvjp.flash_attention(q, k, v, return_lse=True, block_q=BLOCK,
                                                   block_kv=BLOCK, **extra)
      return jax.jvp(f, (q, k, v), ts)
  pair_sh = NamedSharding(mesh, P(spec[0], spec[1], spec[2], None))
  placed = [jax.device_put(a, sh) for a in args[:3]]
  placed += [jax.device_put(a, pair_sh if i in pairs else NamedSharding(mesh, P()))
             for i, a in enumerate(args[3:])]
  jitted = jax.jit(fn)
  got = jitted(*placed)
  one = jax.devices()[0]
  ref = jax.jit(fn)(*[jax.device_put(a, one) for a in args])
  got, ref = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)
  if mode == "grad":  # (loss, (out, lse)), grads: the loss is a cancelling sum, not checked
    got, ref = got[1:], ref[1:]
  names = ["out", "lse", "dq", "dk", "dv"] + [f"d extra {i}" for i in range(len(diff))]
  for name, g, r in zip(names if mode == "grad" else ["out", "lse", "t_out", "t_lse"], got, ref):
    _check(name, g, r)
  hlo = jitted.lower(*placed).compile().as_text()
  bad = whole_sequence_gathers(hlo, s)
  return hlo, bad


def _no_gather(kw, **k):
  hlo, bad = _compare(kw, **k)
  assert not bad, "all-gather of the whole sequence:\n" + "\n".join(bad)
  return hlo


# ---- every feature, the default strategy ---------------------------------------------------

def test_causal_ring_default():
  hlo = _no_gather(dict(causal=True))
  c = collectives(hlo)
  assert c["collective-permute"] > 0 and c["all-to-all"] == 0, c


def test_segments():
  seg = jnp.repeat(jnp.arange(4, dtype=jnp.int32), S // 4)[None].repeat(B, 0)
  _no_gather(dict(causal=True, segment_ids=seg))


def test_mask_mod_prefix_lm():
  _no_gather(dict(mask_mod=flashvjp.prefix_lm(jnp.array([40, 150]))))


def test_mask_mod_chunked_moves_nothing():
  hlo = _no_gather(dict(mask_mod=flashvjp.chunked(32)))
  assert collectives(hlo)["collective-permute"] == 0  # every chunk within a device chunk


def test_sinks():
  _no_gather(lambda s: dict(causal=True, sinks=s), diff=(jnp.linspace(-1.0, 1.0, H),))


def test_window_both_sides():
  hlo = _no_gather(dict(window=(20, 12)))
  causal = collectives(_compare(dict(causal=True))[0])["collective-permute"]
  assert 0 < collectives(hlo)["collective-permute"] < causal


def test_dropout():
  _no_gather(dict(causal=True, dropout_rate=0.2, dropout_rng=jax.random.key(7),
                  deterministic=False))


def test_score_mod_alibi_grad_to_slopes():
  _no_gather(lambda sl: dict(causal=True, score_mod=flashvjp.alibi(sl)),
             diff=(flashvjp.alibi_slopes(H),))


def test_bias_and_dense_mask_rows_sharded():
  kb, km = jax.random.split(jax.random.key(3))
  bias = jax.random.normal(kb, (B, H, S, S), jnp.float32)
  mask = jax.random.bernoulli(km, 0.8, (1, 1, S, S))
  _no_gather(lambda b: dict(bias=b, mask=mask), diff=(bias,), pairs=(0,))


def test_traced_scale():
  _no_gather(lambda sc: dict(causal=True, scale=sc), diff=(jnp.float32(0.3),))


def test_two_d_mesh_batch_and_sequence():
  mesh = _mesh((2, 4), ("dp", "sp"))
  _no_gather(dict(causal=True, dropout_rate=0.1, dropout_rng=jax.random.key(1),
                  deterministic=False), spec=("dp", None, "sp", None), mesh=mesh)


def test_sequence_over_two_mesh_axes():
  mesh = _mesh((2, 2, 2), ("dp", "s1", "s2"))
  _no_gather(lambda sl: dict(causal=True, score_mod=flashvjp.alibi(sl)),
             diff=(flashvjp.alibi_slopes(H),), spec=("dp", None, ("s1", "s2"), None), mesh=mesh)


def test_heads_and_sequence():
  mesh = _mesh((2, 4), ("tp", "sp"))
  _no_gather(dict(window=(40, 0), dropout_rate=0.1, dropout_rng=jax.random.key(2),
                  deterministic=False), spec=(None, "tp", "sp", None), mesh=mesh)


def test_forward_mode_jvp():
  hlo = _no_gather(dict(causal=True), mode="jvp")
  assert collectives(hlo)["collective-permute"] > 0


# ---- the other strategies ------------------------------------------------------------------

def test_ulysses_auto_when_heads_divide():
  hlo = _no_gather(lambda sl: dict(causal=True, score_mod=flashvjp.alibi(sl)),
                   diff=(flashvjp.alibi_slopes(8),), h=8, hkv=8)
  c = collectives(hlo)
  assert c["all-to-all"] > 0 and c["collective-permute"] == 0, c


def test_ulysses_forward_mode_and_mask_mod():
  _no_gather(dict(mask_mod=flashvjp.prefix_lm(jnp.array([40, 150])), context_parallel="ulysses",
                  dropout_rate=0.1, dropout_rng=jax.random.key(4), deterministic=False),
             h=8, hkv=8)
  hlo = _no_gather(dict(causal=True, context_parallel="ulysses"), h=8, hkv=8, mode="jvp")
  # 4-D all-to-alls of jit(jvp): the primal's q, k, v to heads and out back (4), the tangent
  # pass's q, k, v, tq, tk, tv to heads and t_out back (7); O itself never moves (its term
  # of t_out is applied in the sequence layout, `_delta.tangent_out`): 11, not 12
  moved = [line for line in hlo.splitlines()
           if "=" in line and re.search(r"\sall-to-all(-start)?\(", line)
           and re.search(r"=\s*\(?\w+\[\d+,\d+,\d+,\d+\]", line)]
  assert len(moved) == 11, "\n".join(moved)


def test_ulysses_bias_rows_and_key_padding_bias():
  kb, kp = jax.random.split(jax.random.key(5))
  bias = jax.random.normal(kb, (B, 8, S, S), jnp.float32)  # full heads and rows: all_to_all
  pad = jax.random.normal(kp, (B, 1, 1, S), jnp.float32)  # broadcast over heads and rows: psum
  _no_gather(lambda b, p: dict(bias=b + p, context_parallel="ulysses"), diff=(bias, pad),
             pairs=(0,), h=8, hkv=8)
  _no_gather(lambda p: dict(bias=p, causal=True, context_parallel="ulysses"), diff=(pad,), h=8,
             hkv=8)


def test_all_gather_only_when_asked():
  hlo, bad = _compare(dict(causal=True, window=(30, 30), context_parallel="all_gather"))
  assert bad, "all_gather moves K/V whole: its all-gathers hold the whole sequence"
  assert collectives(hlo)["collective-permute"] == 0


def test_ring_requested_with_heads_that_divide():
  hlo = _no_gather(dict(causal=True, context_parallel="ring"), h=8, hkv=8)
  assert collectives(hlo)["all-to-all"] == 0


# ---- the ring per group of kv heads (ring_head_groups) ---------------------------------------

def _kv_head_slices(hlo: str) -> int:
  """Collective-permutes of K/V chunks holding exactly one kv head ([B, 1, S / 8, D])."""
  return sum(1 for line in hlo.splitlines() if "=" in line
             and re.search(r"\scollective-permute(-start)?\(", line)
             and re.search(rf"\w+\[{B},1,{S // 8},{D}\]", line))


def test_ring_head_groups_every_gradient():
  # two groups of (1 kv head, 2 query heads): a per-head bias (dbias per group), ALiBi slopes
  # read by the global head (d slopes summed over the groups), dropout hashed at the global
  # head, a mask_mod
  kb = jax.random.key(8)
  bias = jax.random.normal(kb, (B, H, S, S), jnp.float32)
  kw = lambda b, sl: dict(
      bias=b, score_mod=flashvjp.alibi(sl), mask_mod=flashvjp.prefix_lm(jnp.array([40, 150])),
      dropout_rate=0.2, dropout_rng=jax.random.key(7), deterministic=False,
      context_parallel="ring", ring_head_groups=2)
  hlo = _no_gather(kw, diff=(bias, flashvjp.alibi_slopes(H)), pairs=(0,))
  assert _kv_head_slices(hlo) > 0  # the chunks that travel are one group's
  assert " while(" in hlo or "while(" in hlo


def test_ring_head_groups_forward_mode_and_broadcast_bias():
  pad = jax.random.normal(jax.random.key(9), (B, 1, 1, S), jnp.float32)
  _no_gather(lambda p: dict(bias=p, causal=True, context_parallel="ring", ring_head_groups=2),
             diff=(pad,))
  hlo = _no_gather(dict(causal=True, context_parallel="ring", ring_head_groups=2), mode="jvp")
  assert _kv_head_slices(hlo) > 0


def test_ring_head_groups_all_gather_and_heads_sharded():
  _no_gather(dict(causal=True, context_parallel="ring", ring_head_groups=4), h=8, hkv=4)
  mesh = _mesh((2, 4), ("tp", "sp"))
  _no_gather(dict(window=(40, 0), dropout_rate=0.1, dropout_rng=jax.random.key(2),
                  deterministic=False, context_parallel="ring", ring_head_groups=2),
             spec=(None, "tp", "sp", None), mesh=mesh, h=8, hkv=4)
  _compare(dict(causal=True, context_parallel="all_gather", ring_head_groups=2))


def test_ring_head_groups_errors():
  x = jnp.zeros((B, H, S, D), jnp.float32)
  kv = jnp.zeros((B, HKV, S, D), jnp.float32)
  with pytest.raises(ValueError, match="ring_head_groups must be a positive int"):
    flashvjp.flash_attention(x, kv, kv, context_parallel="ring", ring_head_groups=0)
  with pytest.raises(ValueError, match="ring_head_groups=2 needs context_parallel='ring'"):
    flashvjp.flash_attention(x, kv, kv, ring_head_groups=2)
  with pytest.raises(ValueError, match=r"ring_head_groups=4 must divide num_heads \(4\) and"
                                       r" num_kv_heads \(2\)"):
    flashvjp.flash_attention(x, kv, kv, context_parallel="ring", ring_head_groups=4)
  # per device: 2 kv heads over a 2-way head axis leave 1, which 2 groups cannot split
  with pytest.raises(ValueError, match="ring_head_groups=2 must divide"):
    _strategy.choose("ring", _problem(kv_heads=1, head_groups=2), ("sp",))
  st = _strategy.choose("ring", _problem(head_groups=2), ("sp",))
  assert st.head_groups == 2 and "2 head groups" in str(st) and "1/2 of the heads" in str(st)


# ---- the choice: visible, tested, overridable -----------------------------------------------

def _problem(**kw):
  base = dict(num_shards=8, batch=1, heads=8, kv_heads=8, seq_q=16384, seq_kv=16384,
              head_dim=64, head_dim_v=64, itemsize=2)
  base.update(kw)
  return _strategy.Problem(**base)


def test_choice_table():
  pick = lambda **kw: _strategy.choose("auto", _problem(**kw), ("sp",)).name
  assert pick(causal=True) == "ulysses"  # MHA, every step taken: all-to-all moves less
  assert pick(causal=True, kv_heads=1) == "ring"  # GQA 8:1: K/V chunks are small
  assert pick(heads=4, kv_heads=4) == "ring"  # heads do not divide the 8 shards
  # a local mask: one neighbour step
  assert pick(causal=True, window=(512, 0)) == "ring"
  assert pick(causal=True, window=(512, 0), itemsize=4) == "ring"
  assert pick(causal=True, mask_mod_hint=flashvjp.chunked(1024).kv_intervals) == "ring"
  assert pick(causal=True, has_segments=True) == "ring"
  assert pick(causal=True, pairs_not_split_by_heads=("bias",)) == "ring"
  # auto never gathers K/V whole
  assert all(pick(**kw) != "all_gather" for kw in ({}, {"kv_heads": 1}, {"causal": True}))


def test_choice_bytes_follow_the_mask():
  full = _strategy.costs(_problem(causal=True, kv_heads=1))["ring"]
  local = _strategy.costs(_problem(causal=True, kv_heads=1, window=(512, 0)))["ring"]
  assert local[0] * 3 <= full[0] and local[1] * 3 <= full[1]
  chunked = flashvjp.chunked(1024)
  none = _strategy.costs(_problem(causal=True, mask_mod_hint=chunked.kv_intervals))["ring"]
  assert none == (0, 0)


def test_requested_strategy_that_cannot_run():
  with pytest.raises(ValueError, match="context_parallel='ulysses'.*divisible"):
    _strategy.choose("ulysses", _problem(heads=4, kv_heads=4), ("sp",))
  with pytest.raises(ValueError, match="context_parallel must be one of"):
    _strategy.choose("zigzag", _problem(), ("sp",))


def test_explain_shows_the_strategy():
  mesh = _mesh()
  sh = NamedSharding(mesh, P(None, None, "sp", None))
  q = jax.ShapeDtypeStruct((B, 8, S, D), jnp.float32, sharding=sh)
  kv = jax.ShapeDtypeStruct((B, 1, S, D), jnp.float32, sharding=sh)
  d = flashvjp.explain(q, kv, kv, causal=True)
  assert d.context_parallel.name == "ring" and d.context_parallel.seq_axes == ("sp",)
  assert "ring over ('sp',)" in str(d)
  d = flashvjp.explain(q, kv, kv, causal=True, context_parallel="all_gather")
  assert d.context_parallel.name == "all_gather" and "requested" in d.context_parallel.reason
  unsharded = flashvjp.explain(jax.ShapeDtypeStruct((B, 8, S, D), jnp.float32), kv, kv)
  assert unsharded.context_parallel is None


def test_bad_context_parallel_argument():
  x = jnp.zeros((1, 2, 16, 8), jnp.float32)
  with pytest.raises(ValueError, match="context_parallel must be one of"):
    flashvjp.flash_attention(x, x, x, context_parallel="rings")


def test_indivisible_sequence_is_a_clear_error():
  mesh = _mesh()
  x = jax.ShapeDtypeStruct((1, 2, 8 * 5 + 4, 8), jnp.float32)
  _, cfg, _ = flashvjp._api._prepare(
      x, x, x, bias=None, mask=None, causal=True, window=None, segment_ids=None,
      score_mod=None, scale=None, dropout_rate=0.0, dropout_rng=None, deterministic=True,
      implementation=None, block_q=None, block_kv=None, interpret=None, allow_shapes=True)
  with pytest.raises(ValueError, match="divisible by 8 for context parallelism"):
    flashvjp._partition.strategy_for(cfg, mesh, P(None, None, "sp", None), x.shape, x.shape,
                                     x.shape, 4, {}, False)


def test_indivisible_sequence_inside_jit_is_a_value_error():
  """A sharding applied inside jit is checked while XLA partitions: still a ValueError."""
  mesh = _mesh((4,))
  sh = NamedSharding(mesh, P(None, None, "sp", None))
  x = jnp.ones((1, 2, 4 * 255 + 2, 8), jnp.float32)  # S = 1022 over 4 devices
  f = jax.jit(lambda x: flashvjp.flash_attention(
      *(jax.lax.with_sharding_constraint(x, sh),) * 3, causal=True, implementation="blockwise"))
  with pytest.raises(ValueError, match=r"seq_q \(1022\).*divisible by 4 for context") as e:
    f(x)
  assert "custom_partitioner" not in str(e.value) and "Traceback" not in str(e.value)
  g = jax.jit(lambda x: flashvjp.flash_attention(  # a strategy that cannot run: the same
      *(jax.lax.with_sharding_constraint(x, sh),) * 3, context_parallel="ulysses"))
  with pytest.raises(ValueError, match="context_parallel='ulysses' cannot run"):
    g(jnp.ones((1, 2, 64, 8), jnp.float32))  # 2 heads on 4 sequence shards


def test_explicit_mesh_axes_are_a_clear_error():
  if not hasattr(jax.sharding, "AxisType"):
    pytest.skip("no explicit sharding in this jax")
  mesh = jax.make_mesh((8,), ("sp",), axis_types=(jax.sharding.AxisType.Explicit,))
  x = jax.device_put(jnp.zeros((1, 2, 64, 8), jnp.float32),
                     NamedSharding(mesh, P(None, None, "sp", None)))
  with pytest.raises(ValueError, match="query is sharded over Explicit mesh axes"):
    jax.jit(lambda x: flashvjp.flash_attention(x, x, x, causal=True))(x)


# ---- the Pallas families (interpret mode), a representative subset ---------------------------

@pytest.mark.parametrize("impl,kw", [
    ("pallas_triton", dict(causal=True, dropout_rate=0.2, dropout_rng=jax.random.key(3),
                           deterministic=False)),
    ("pallas_tpu", dict(window=(20, 12), mask_mod=flashvjp.prefix_lm(jnp.array([30, 70])))),
    ("pallas_triton", dict(causal=True, context_parallel="ulysses",
                           score_mod=flashvjp.alibi(flashvjp.alibi_slopes(8)))),
])
def test_pallas_families_seq_sharded(impl, kw):
  """The same strategies around the Pallas kernels (IEEE float32 at "highest", so the
  sharded and one-device kernels differ only by the order of their sums)."""
  seq = 128  # interpret mode is slow
  seg = jnp.repeat(jnp.arange(2, dtype=jnp.int32), seq // 2)[None].repeat(B, 0)
  h = 8 if kw.get("context_parallel") == "ulysses" else H
  with jax.default_matmul_precision("highest"):
    _no_gather(lambda s: dict(kw, implementation=impl, segment_ids=seg, sinks=s),
               diff=(jnp.linspace(-1.0, 1.0, h),), h=h, hkv=h if h == 8 else HKV, s=seq)


def test_heads_that_do_not_divide_are_a_visible_gather(caplog):
  """8 query heads on 4 devices, but 2 kv heads: no whole GQA group per device."""
  mesh = _mesh((4,), ("tp",))
  q = jax.random.normal(jax.random.key(0), (1, 8, 32, 8), jnp.float32)
  kv = jax.random.normal(jax.random.key(1), (1, 2, 32, 8), jnp.float32)
  qs = jax.device_put(q, NamedSharding(mesh, P(None, "tp", None, None)))
  with caplog.at_level("WARNING"):
    out = jax.jit(lambda q, k: flashvjp.flash_attention(q, k, k, causal=True))(qs, kv)
  assert "attention gathers the heads on every device" in caplog.text
  ref = flashvjp.flash_attention(q, kv, kv, causal=True)
  _check("out", out, ref)


@pytest.mark.parametrize("impl,cp", [("pallas_triton", None), ("pallas_tpu", "ulysses")])
def test_pallas_families_seq_sharded_tables_by_position(impl, cp):
  """Plain-jit sequence sharding (the ring; Ulysses) of the Pallas families with a
  relative-position table (read by kv_idx - q_idx) and a per-key bias (by kv position):
  each device evaluates them at its global positions; out, lse and the gradients to q, k, v
  and both arrays equal the one-device program's."""
  seq = 128
  h = 8 if cp == "ulysses" else H
  table = jnp.sin(jnp.arange(h * 33.0)).reshape(h, 33)
  kv_bias = jnp.cos(jnp.arange(B * seq, dtype=jnp.float32)).reshape(B, seq)
  extra = {} if cp is None else dict(context_parallel=cp)

  def kw(tb, bv):
    rel = flashvjp.relative_position_bias(tb, 16)
    return dict(causal=True, implementation=impl, **extra,
                score_mod=lambda s, b, hh, i, j: rel(s, b, hh, i, j) + bv[b, j])

  with jax.default_matmul_precision("highest"):
    _no_gather(kw, diff=(table, kv_bias), h=h, hkv=h if h == 8 else HKV, s=seq)


def _whole_length_collectives(hlo: str, seq: int, ops=("all-gather", "all-reduce")):
  """Collectives (`ops`) whose result has a dim of the whole sequence length (any rank)."""
  bad = []
  for line in hlo.splitlines():
    m = re.search(r"\b(" + "|".join(ops) + r")(-start)?\(", line)
    if m is None or "=" not in line[:m.start()]:
      continue
    result = line[line.index("=") + 1:m.start()]  # "f32[256]{0}" or a tuple of shapes
    dims = [[int(d) for d in x.split(",") if d] for x in re.findall(r"\w+\[([\d,]*)\]", result)]
    if any(seq in d for d in dims):
      bad.append(line.strip()[:160])
  return bad


@pytest.mark.parametrize("impl,cp", [("pallas_triton", "ring"), ("pallas_tpu", "ring"),
                                     ("pallas_triton", "ulysses")])
def test_position_arrays_split_like_the_sequence(impl, cp):
  """Arrays a mod reads at the query / key position (document_causal's ids, a per-key bias
  vector, a per-query temperature), placed sharded like the tokens, stay split
  (`flashvjp._aligned`): the ring reads each device's slice and sends the key-aligned ones
  round with K/V, so no all-gather or all-reduce holds a whole-sequence array (before:
  each array all-gathered, both gradients all-reduced whole); Ulysses gathers them for its
  heads like segment ids and reduce-scatters the gradients (no whole all-reduce). Values
  and gradients equal the one-device program's."""
  mesh = _mesh()
  h = 8
  x = _inputs(h, h)
  doc = jnp.repeat(jnp.arange(4, dtype=jnp.int32), S // 4)[None].repeat(B, 0)
  kvb = jnp.cos(jnp.arange(S, dtype=jnp.float32))
  tq = 1.0 + 0.1 * jnp.sin(jnp.arange(S, dtype=jnp.float32))

  def loss(q, k, v, kvb, tq, doc):
    out = flashvjp.flash_attention(
        q, k, v, implementation=impl, context_parallel=cp, block_q=BLOCK, block_kv=BLOCK,
        mask_mod=flashvjp.document_causal(doc),
        score_mod=lambda s, b, hh, i, j: s * tq[i] + kvb[j])
    return jnp.sum(out * x["w_out"]), out

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
  seq = NamedSharding(mesh, P(None, None, "sp", None))
  placed = [jax.device_put(x[n], seq) for n in "qkv"]
  placed += [jax.device_put(kvb, NamedSharding(mesh, P("sp"))),
             jax.device_put(tq, NamedSharding(mesh, P("sp"))),
             jax.device_put(doc, NamedSharding(mesh, P(None, "sp")))]
  with jax.default_matmul_precision("highest"):
    got = fn(*placed)
    one = jax.devices()[0]
    ref = fn(*[jax.device_put(a, one) for a in (x["q"], x["k"], x["v"], kvb, tq, doc)])
    hlo = fn.lower(*placed).compile().as_text()
  (_, out), grads = got
  (_, out_r), grads_r = ref
  for name, g, r in zip(["out", "dq", "dk", "dv", "d kv bias", "d temperature"],
                        [out, *grads], [out_r, *grads_r]):
    _check(name, g, r)
  assert not _whole_length_collectives(hlo, S, ("all-reduce",)), hlo
  # explain says which arrays are split (doc ids both ways: a key-aligned copy)
  d = flashvjp.explain(*placed[:3], implementation=impl, context_parallel=cp,
                       mask_mod=flashvjp.document_causal(doc),
                       score_mod=lambda s, b, hh, i, j: s * tq[i] + kvb[j])
  assert sorted(o.split for o in d.operands) == ["kv", "q", "q and kv"], str(d)
  assert "split like the queries and (a copy) like the keys" in str(d)
  gathers = _whole_length_collectives(hlo, S, ("all-gather",))
  if cp == "ring":
    assert not gathers, "\n".join(gathers)
  else:
    assert gathers, "Ulysses runs the whole sequence of its heads: the arrays gathered"


def test_position_arrays_split_on_a_batch_and_sequence_mesh():
  """(dp=2, sp=4), the ring: a per-(batch, key) bias `kvb[b, kv_idx]` (gradient) and a
  per-query temperature split like the tokens' sequence (whole over batch: each dp shard
  reads its own batches' rows, the gradient summed over dp); equal to one device."""
  mesh = _mesh((2, 4), ("dp", "sp"))
  x = _inputs(H, HKV)
  kvb = jnp.cos(jnp.arange(B * S, dtype=jnp.float32)).reshape(B, S)
  tq = 1.0 + 0.1 * jnp.sin(jnp.arange(S, dtype=jnp.float32))

  def loss(q, k, v, kvb, tq):
    out = flashvjp.flash_attention(
        q, k, v, implementation="pallas_triton", context_parallel="ring", causal=True,
        block_q=BLOCK, block_kv=BLOCK, score_mod=lambda s, b, h, i, j: s * tq[i] + kvb[b, j])
    return jnp.sum(out * x["w_out"])

  fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
  tok = NamedSharding(mesh, P("dp", None, "sp", None))
  placed = [jax.device_put(x[n], tok) for n in "qkv"]
  placed += [jax.device_put(kvb, NamedSharding(mesh, P(None, "sp"))),
             jax.device_put(tq, NamedSharding(mesh, P("sp")))]
  with jax.default_matmul_precision("highest"):
    got = fn(*placed)
    ref = fn(*[jax.device_put(a, jax.devices()[0]) for a in (x["q"], x["k"], x["v"], kvb, tq)])
    hlo = fn.lower(*placed).compile().as_text()
  for name, g, r in zip(["dq", "dk", "dv", "d kv bias", "d temperature"], got, ref):
    _check(name, g, r)
  assert not _whole_length_collectives(hlo, S), "\n".join(_whole_length_collectives(hlo, S))
