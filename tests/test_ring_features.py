"""A sharded sequence is the same op: every flash_attention feature through the ring.

8 virtual CPU devices (conftest sets --xla_force_host_platform_device_count=8). Each case
runs `sharded_attention(..., seq_axis="sp")` under jit and value_and_grad and compares out,
lse and the gradient of every differentiable input (q, k, v, bias, sinks, a traced scale,
score_mod's closed-over arrays) with one-device `flash_attention` on the same float32
inputs: the ring re-associates the same sums, so the float32 tolerance is RING_TOL of the
largest magnitude (the issue's bound). Forward mode (jvp) and forward-over-reverse go
through the same op. The communication schedule is checked from the compiled HLO.
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
from flashvjp.distributed._ring import ring_schedule

N = 8
B, H, HKV, S, D = 2, 4, 2, 256, 16
BLOCK = 16
RING_TOL = 2e-5  # float32, ring vs one device, relative to the largest magnitude


def _mesh(n=N):
  if jax.device_count() < n:
    pytest.skip(f"needs {n} devices")
  return Mesh(np.asarray(jax.devices()[:n]), ("sp",))


def _inputs(seed=0):
  ks = jax.random.split(jax.random.key(seed), 8)
  r = lambda i, shape: jax.random.normal(ks[i], shape, jnp.float32)
  return dict(q=r(0, (B, H, S, D)), k=r(1, (B, HKV, S, D)), v=r(2, (B, HKV, S, D)),
              w_out=r(3, (B, H, S, D)), w_lse=r(4, (B, H, S)))


def _zz(x, axis=2, n=N):
  return flashvjp.to_zigzag(x, n, axis) if x.shape[axis] != 1 else x


def _unzz(x, axis=2, n=N):
  return flashvjp.from_zigzag(x, n, axis) if x.shape[axis] != 1 else x


def _run(fn, diff, x, kw):
  """(out, lse, grads of (q, k, v, *diff)) of loss = <out, w_out> + <lse, w_lse>."""
  def loss(q, k, v, *d):
    out, lse = fn(q, k, v, *d, **kw)
    return jnp.sum(out * x["w_out"]) + jnp.sum(jnp.where(jnp.isinf(lse), 0.0, lse) * x["w_lse"]), (
        out, lse)
  args = (x["q"], x["k"], x["v"]) + tuple(diff)
  (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))),
                                                      has_aux=True))(*args)
  return out, lse, grads


def _check(name, got, ref, tol=RING_TOL):
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  assert np.all(np.isfinite(got) == np.isfinite(ref)), f"{name}: non-finite entries differ"
  fin = np.isfinite(ref)
  scale = max(float(np.abs(ref[fin]).max()) if fin.any() else 0.0, 1e-30)
  err = float(np.abs(np.where(fin, got - ref, 0.0)).max()) if fin.any() else 0.0
  assert err <= tol * scale, f"{name}: max error {err:.3g} > {tol} * {scale:.3g}"


def _compare(make_kw, diff=(), layout="contiguous", impl="blockwise", extra=None, tol=RING_TOL,
             n=N, ring_kw=None):
  """make_kw(*diff) -> flash_attention kwargs (closures over the differentiable arrays);
  ring_kw: the ring's own kwargs (not the one-device call's)."""
  x = _inputs()
  mesh = _mesh(n)
  extra = extra or {}
  # dense pair arrays (bias / mask) travel as explicit kwargs (global [.., S, S] arrays)
  def one(q, k, v, *d, **kw):
    return flashvjp.flash_attention(q, k, v, return_lse=True, implementation="blockwise",
                                    block_q=BLOCK, block_kv=BLOCK, **make_kw(*d), **kw)
  ref = _run(one, diff, x, extra)

  zz = layout == "zigzag"
  xr = dict(x)
  if zz:
    xr = {k: _zz(val) for k, val in x.items()}
  extra_r = dict(extra)
  for name in ("bias", "mask"):
    if name in extra_r and zz:
      extra_r[name] = _zz(_zz(extra_r[name], 2), 3)
  if "segment_ids" in extra_r and zz:
    extra_r["segment_ids"] = _zz(extra_r["segment_ids"], 1)

  def ring(q, k, v, *d, **kw):
    return flashvjp.sharded_attention(
        q, k, v, mesh=mesh, seq_axis="sp", layout=layout, return_lse=True,
        implementation=impl, block_q=BLOCK, block_kv=BLOCK, **make_kw(*d), **kw,
        **(ring_kw or {}))
  # a rank-4 differentiable array is a bias: laid out like the sequence on both seq axes
  pair = lambda f, x_: f(f(x_, 2), 3) if zz and jnp.ndim(x_) == 4 else x_
  out, lse, grads = _run(ring, tuple(pair(_zz, d) for d in diff), xr, extra_r)
  if zz:
    out, lse = _unzz(out), _unzz(lse)
    grads = tuple(_unzz(g) for g in grads[:3]) + tuple(pair(_unzz, g) for g in grads[3:])
  _check("out", out, ref[0], tol)
  _check("lse", lse, ref[1], tol)
  for i, (g, r) in enumerate(zip(grads, ref[2])):
    _check(f"grad {('q', 'k', 'v')[i] if i < 3 else f'diff[{i - 3}]'}", g, r, tol)


# ---- every feature, blockwise pairs -----------------------------------------------------

@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("kw", [
    dict(causal=True),
    dict(window=(20, 0)),  # one-sided, shorter than a device chunk (32)
    dict(window=(9, 40)),  # both sides, reaching into the next chunk
    dict(causal=True, window=(45, None)),
], ids=["causal", "window-left", "window-both", "causal-window"])
def test_positional_masks(kw, layout):
  _compare(lambda: kw, layout=layout)


def test_dense_mask_and_bias_with_gradient():
  rng = np.random.default_rng(0)
  mask = jnp.asarray(rng.random((B, 1, S, S)) > 0.3)
  bias = jnp.asarray(rng.standard_normal((1, H, S, S)), jnp.float32)
  _compare(lambda b: {"bias": b}, diff=(bias,), extra={"mask": mask})


def test_bias_zigzag_with_causal():
  bias = jnp.asarray(np.random.default_rng(1).standard_normal((B, H, S, S)), jnp.float32)
  _compare(lambda b: {"bias": b, "causal": True}, diff=(bias,), layout="zigzag")


def test_score_mod_global_positions_and_gradient_to_its_array():
  slopes = flashvjp.alibi_slopes(H)
  _compare(lambda s: {"score_mod": flashvjp.alibi(s), "causal": True}, diff=(slopes,))


def test_score_mod_zigzag():
  _compare(lambda: {"score_mod": flashvjp.softcap(3.0), "window": (30, 30)}, layout="zigzag")


@pytest.mark.parametrize("mod", ["prefix_lm", "chunked", "sliding_global"])
def test_mask_mod_global_positions(mod):
  m = {"prefix_lm": lambda: flashvjp.prefix_lm(jnp.array([40, 100])),
       "chunked": lambda: flashvjp.chunked(48),
       "sliding_global": lambda: flashvjp.sliding_window_with_global(24, 8)}[mod]()
  _compare(lambda: {"mask_mod": m})


def test_mask_mod_zigzag():
  _compare(lambda: {"mask_mod": flashvjp.chunked(40)}, layout="zigzag")


def test_sinks_once_with_gradient():
  sinks = jnp.array([0.5, -1.0, 2.0, 0.0], jnp.float32)
  _compare(lambda s: {"sinks": s, "causal": True}, diff=(sinks,))


def test_traced_scale_with_gradient():
  _compare(lambda sc: {"scale": sc, "window": (40, 0)}, diff=(jnp.float32(0.3),))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_dropout_draws_the_one_device_keep_mask(layout):
  key = jax.random.key(7)
  _compare(lambda: {"dropout_rate": 0.25, "dropout_rng": key, "deterministic": False,
                    "causal": True}, layout=layout)


def test_segments_with_window():
  seg = jnp.asarray(np.repeat(np.array([[0] * 70 + [1] * 120 + [2] * 66]), B, 0), jnp.int32)
  _compare(lambda: {"window": (50, 10)}, extra={"segment_ids": seg})


# ---- forward mode ----------------------------------------------------------------------

def _jvp_case(layout, kw):
  x = _inputs(1)
  mesh = _mesh()
  t = _inputs(2)
  zz = layout == "zigzag"
  f1 = lambda q, k, v: flashvjp.flash_attention(q, k, v, return_lse=True, block_q=BLOCK,
                                                block_kv=BLOCK, implementation="blockwise", **kw)
  fr = lambda q, k, v: flashvjp.sharded_attention(q, k, v, mesh=mesh, seq_axis="sp",
                                                  layout=layout, return_lse=True,
                                                  block_q=BLOCK, block_kv=BLOCK,
                                                  implementation="blockwise", **kw)
  prim = (x["q"], x["k"], x["v"])
  tan = (t["q"], t["k"][:, :HKV], t["w_out"][:, :HKV] * 0 + t["k"][:, :HKV])
  ref = jax.jit(lambda p, t_: jax.jvp(f1, p, t_))(prim, tan)
  cv = (lambda xs: tuple(_zz(a) for a in xs)) if zz else (lambda xs: xs)
  got = jax.jit(lambda p, t_: jax.jvp(fr, p, t_))(cv(prim), cv(tan))
  back = _unzz if zz else (lambda a: a)
  for name, g, r in zip(("out", "lse", "t_out", "t_lse"), (*got[0], *got[1]), (*ref[0], *ref[1])):
    _check(f"jvp {name}", back(g), r)


@pytest.mark.parametrize("layout,kw", [
    ("contiguous", dict(causal=True, score_mod=flashvjp.softcap(4.0))),
    ("zigzag", dict(window=(25, 5))),
])
def test_jvp_through_the_ring(layout, kw):
  _jvp_case(layout, kw)


def test_hvp_forward_over_reverse():
  x = _inputs(3)
  mesh = _mesh()
  loss1 = lambda q: jnp.sum(jnp.sin(flashvjp.flash_attention(
      q, x["k"], x["v"], causal=True, implementation="blockwise", block_q=BLOCK,
      block_kv=BLOCK)))
  lossr = lambda q: jnp.sum(jnp.sin(flashvjp.sharded_attention(
      q, x["k"], x["v"], mesh=mesh, seq_axis="sp", causal=True, implementation="blockwise",
      block_q=BLOCK, block_kv=BLOCK)))
  hvp = lambda f: jax.jit(lambda q, t: jax.jvp(jax.grad(f), (q,), (t,))[1])
  _check("hvp", hvp(lossr)(x["q"], x["w_out"]), hvp(loss1)(x["q"], x["w_out"]), 1e-4)


def test_ring_head_groups_zigzag_every_gradient():
  # one ring per kv head (2 groups of 1 kv head, 2 query heads), zigzag: a per-head bias,
  # ALiBi slopes at the global head (their gradient summed over the groups), dropout
  bias = jax.random.normal(jax.random.key(11), (B, H, S, S), jnp.float32)
  _compare(lambda b, sl: dict(bias=b, causal=True, score_mod=flashvjp.alibi(sl),
                              dropout_rate=0.1, dropout_rng=jax.random.key(3),
                              deterministic=False),
           diff=(bias, flashvjp.alibi_slopes(H)), layout="zigzag",
           ring_kw=dict(ring_head_groups=2))


def test_ring_head_groups_must_divide_the_heads():
  x = _inputs()
  with pytest.raises(ValueError, match=r"ring_head_groups=4 must divide num_heads \(4\)"):
    flashvjp.sharded_attention(x["q"], x["k"], x["v"], mesh=_mesh(), seq_axis="sp",
                               ring_head_groups=4)


# ---- Pallas families (interpret mode), a representative subset --------------------------

@pytest.mark.parametrize("kw,grads", [
    (dict(causal=True, window=(12, None)), True),
    (dict(window=(10, 10), sinks=jnp.array([0.1, 0.2])), False),
], ids=["causal-window+grads", "window-sinks"])
def test_pallas_triton_interpret_pairs(kw, grads):
  """The ring with Pallas-Triton pairs (interpret mode) vs one-device blockwise, at Pallas'
  own (TF32-emulated) accuracy. Small (interpret mode is slow): 2 devices, seq 64."""
  from flashvjp import _check as check_mod
  tol = max(RING_TOL, 4 * check_mod.tolerance(jnp.float32, "pallas_triton"))
  ks = jax.random.split(jax.random.key(5), 5)
  r = lambda i, shape: jax.random.normal(ks[i], shape, jnp.float32)
  x = dict(q=r(0, (1, 2, 64, 16)), k=r(1, (1, 1, 64, 16)), v=r(2, (1, 1, 64, 16)),
           w_out=r(3, (1, 2, 64, 16)), w_lse=r(4, (1, 2, 64)))
  mesh = _mesh(2)
  one = lambda q, k, v: flashvjp.flash_attention(q, k, v, return_lse=True,
                                                 implementation="blockwise", **kw)
  ring = lambda q, k, v: flashvjp.sharded_attention(
      q, k, v, mesh=mesh, seq_axis="sp", return_lse=True, implementation="pallas",
      interpret=True, block_q=BLOCK, block_kv=BLOCK, **kw)
  if grads:
    ro, rl, rg = _run(one, (), x, {})
    go, gl, gg = _run(ring, (), x, {})
    for name, g, r_ in zip("qkv", gg, rg):  # the Pallas hand-written backward per chunk pair
      _check(f"pallas d{name}", g, r_, tol)
  else:
    ro, rl = jax.jit(one)(x["q"], x["k"], x["v"])
    go, gl = jax.jit(ring)(x["q"], x["k"], x["v"])
  _check("pallas out", go, ro, tol)
  _check("pallas lse", gl, rl, tol)


# score_mod, mask_mod and dropout read each chunk pair's global offsets, which the Pallas
# kernels take as scalar operands (`flashvjp.pallas._common.offset_operand`).
_PALLAS_OFFSET_FEATURES = {
    # ALiBi from global positions, with the gradient to its slopes
    "alibi": (lambda s: dict(score_mod=flashvjp.alibi(s), causal=True),
              lambda: (flashvjp.alibi_slopes(2),)),
    # a mask_mod with no block classes in a ring: elementwise on every visited block
    "prefix_lm": (lambda: dict(mask_mod=flashvjp.prefix_lm(jnp.array([20]))), tuple),
    "dropout": (lambda: dict(dropout_rate=0.25, dropout_rng=jax.random.key(7),
                             deterministic=False, window=(20, 20)), tuple),
    # arrays read by one global position (issue 32: per-position residuals), with gradients
    "kv_bias_q_temperature": (
        lambda bv, t: dict(score_mod=lambda s, b, h, i, j: s * t[i] + bv[b, j], causal=True),
        lambda: (jnp.linspace(-1.0, 1.0, 64)[None], 1.0 + 0.5 * jnp.cos(jnp.arange(64.0)))),
    "document_causal": (lambda: dict(mask_mod=flashvjp.document_causal(
        jnp.asarray([[0] * 20 + [1] * 30 + [2] * 14], jnp.int32))), tuple),
    # a table read by the global kv_idx - q_idx, with its gradient (a row of differences
    # per pair: offsets kv0 - q0 shift it)
    "relative_position_bias": (
        lambda tb: dict(score_mod=flashvjp.relative_position_bias(tb, 24), causal=True),
        lambda: (jnp.sin(jnp.arange(2 * 49.0)).reshape(2, 49),)),
}


def _pallas_small_inputs():
  ks = jax.random.split(jax.random.key(5), 5)
  r = lambda i, shape: jax.random.normal(ks[i], shape, jnp.float32)
  return dict(q=r(0, (1, 2, 64, 16)), k=r(1, (1, 1, 64, 16)), v=r(2, (1, 1, 64, 16)),
              w_out=r(3, (1, 2, 64, 16)), w_lse=r(4, (1, 2, 64)))


@pytest.mark.parametrize("family", ["pallas_triton", "pallas_tpu"])
@pytest.mark.parametrize("feature", list(_PALLAS_OFFSET_FEATURES))
def test_pallas_pairs_take_global_offsets(family, feature):
  """score_mod / mask_mod / dropout with Pallas pairs (interpret mode): out, lse and every
  gradient == the one-device call of the same family, at the family's tolerance. Small
  (interpret mode is slow): 2 devices, seq 64."""
  from flashvjp import _check as check_mod
  tol = max(RING_TOL, 4 * check_mod.tolerance(jnp.float32, family))
  make_kw, make_diff = _PALLAS_OFFSET_FEATURES[feature]
  x = _pallas_small_inputs()
  mesh = _mesh(2)
  common = dict(return_lse=True, implementation=family, interpret=True, block_q=BLOCK,
                block_kv=BLOCK)
  one = lambda q, k, v, *d: flashvjp.flash_attention(q, k, v, **common, **make_kw(*d))
  ring = lambda q, k, v, *d: flashvjp.sharded_attention(q, k, v, mesh=mesh, seq_axis="sp",
                                                        **common, **make_kw(*d))
  ro, rl, rg = _run(one, make_diff(), x, {})
  go, gl, gg = _run(ring, make_diff(), x, {})
  _check(f"{family} out", go, ro, tol)
  _check(f"{family} lse", gl, rl, tol)
  for i, (g, r_) in enumerate(zip(gg, rg)):  # the family's hand-written backward per pair
    _check(f"{family} grad {('q', 'k', 'v')[i] if i < 3 else f'diff[{i - 3}]'}", g, r_, tol)


def test_pallas_pairs_forward_mode_with_global_offsets():
  """jax.jvp through the ring with Pallas-TPU pairs (the family's fused tangent pass per
  pair, with offsets): score_mod at global positions and dropout."""
  from flashvjp import _check as check_mod
  tol = max(RING_TOL, 4 * check_mod.tolerance(jnp.float32, "pallas_tpu"))
  x, t = _pallas_small_inputs(), _inputs(2)
  mesh = _mesh(2)
  kw = dict(return_lse=True, implementation="pallas_tpu", interpret=True, block_q=BLOCK,
            block_kv=BLOCK, score_mod=flashvjp.alibi(flashvjp.alibi_slopes(2)),
            dropout_rate=0.2, dropout_rng=jax.random.key(1), deterministic=False)
  f1 = lambda q, k, v: flashvjp.flash_attention(q, k, v, **kw)
  fr = lambda q, k, v: flashvjp.sharded_attention(q, k, v, mesh=mesh, seq_axis="sp", **kw)
  prim = (x["q"], x["k"], x["v"])
  tan = (t["q"][:1, :2, :64], t["k"][:1, :1, :64], t["v"][:1, :1, :64])
  ref = jax.jit(lambda p, t_: jax.jvp(f1, p, t_))(prim, tan)
  got = jax.jit(lambda p, t_: jax.jvp(fr, p, t_))(prim, tan)
  for name, g, r in zip(("out", "lse", "t_out", "t_lse"), (*got[0], *got[1]), (*ref[0], *ref[1])):
    _check(f"pallas_tpu jvp {name}", g, r, tol)


@pytest.mark.parametrize("family", ["pallas_triton", "pallas_tpu"])
def test_pallas_backend_offsets_are_global_positions(family):
  """A Pallas backend called on a slice with its global offsets (batch 1, heads 2-3, q rows
  [32, 64)) gives that slice of the one-device call: score_mod (h, q_idx), mask_mod (b)
  and dropout (b, h, q, kv) see global indices; traced offsets, a mask_mod without classes
  (as in a ring). With a kv offset too, forward and backward equal the blockwise backend's
  with the same offsets."""
  from flashvjp import _api
  from flashvjp import _check as check_mod
  from flashvjp import _mask_mod
  from flashvjp import blockwise
  from flashvjp.pallas import tpu
  from flashvjp.pallas import triton
  tol = max(RING_TOL, 4 * check_mod.tolerance(jnp.float32, family))
  backend = {"pallas_triton": triton, "pallas_tpu": tpu}[family]
  ks = jax.random.split(jax.random.key(11), 3)
  q = jax.random.normal(ks[0], (2, 4, 64, 16), jnp.float32)
  k = jax.random.normal(ks[1], (2, 2, 64, 16), jnp.float32)
  v = jax.random.normal(ks[2], (2, 2, 64, 16), jnp.float32)
  kw = dict(score_mod=flashvjp.alibi(flashvjp.alibi_slopes(4)),
            mask_mod=flashvjp.prefix_lm(jnp.array([20, 40])), dropout_rate=0.3,
            dropout_rng=jax.random.key(3), deterministic=False, block_q=BLOCK, block_kv=BLOCK,
            interpret=True)
  ref_out, ref_lse = flashvjp.flash_attention(q, k, v, return_lse=True, implementation=family,
                                              **kw)

  def call(impl, be, ql, kl, vl, offsets, grads=False):
    _, cfg, arrays = _api._prepare(ql, kl, vl, bias=None, mask=None, causal=False, window=None,
                                   segment_ids=None, scale=None, implementation=impl, **kw)
    _, _, _, _, _, qs, kvs, seed, consts, _, mm_consts, _, _ = arrays
    mod = _mask_mod.ModInputs(None, tuple(mm_consts))  # a ring pair's: no block classes
    out, lse = be.forward(cfg, ql, kl, vl, None, None, qs, kvs, seed, consts, mod,
                          offsets=offsets)
    if not grads:
      return out, lse
    g = be.backward(cfg, ql, kl, vl, None, None, qs, kvs, seed, consts, out, lse, 0.5 * out + 1,
                    0.3 + 0 * lse, mod, offsets=offsets)
    return out, lse, g[:3], g[4]

  offs = lambda kv0: tuple(jnp.int32(o) for o in (1, 2, 32, kv0))  # traced in the jit
  sl = (slice(1, 2), slice(2, 4), slice(32, 64))
  ql, kl, vl = q[sl], k[1:, 1:], v[1:, 1:]
  out, lse = jax.jit(lambda o: call(family, backend, ql, kl, vl, o))(offs(0))
  _check(f"{family} offsets out", out, ref_out[sl], tol)
  _check(f"{family} offsets lse", lse, ref_lse[sl], tol)
  kl, vl = kl[:, :, 16:], vl[:, :, 16:]
  got = jax.jit(lambda o: call(family, backend, ql, kl, vl, o, True))(offs(16))
  want = jax.jit(lambda o: call("blockwise", blockwise, ql, kl, vl, o, True))(offs(16))
  for n, (g_, w_) in enumerate(zip(jax.tree_util.tree_leaves(got),
                                   jax.tree_util.tree_leaves(want))):
    _check(f"{family} kv offset, leaf {n}", g_, w_, tol)


# ---- communication follows the mask ---------------------------------------------------

def _permute_bytes(compiled) -> tuple[int, int]:
  """(collective-permutes, their result bytes) in a compiled program's HLO."""
  count = total = 0
  sizes = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "f64": 8, "pred": 1}
  for line in compiled.as_text().splitlines():
    m = re.search(r"= \(?(\w+)\[([\d,]*)\][^=]*collective-permute(-start)?\(", line)
    if not m:
      continue
    count += 1
    dims = [int(d) for d in m.group(2).split(",") if d]
    total += sizes.get(m.group(1), 4) * int(np.prod(dims or [1]))
  return count, total


def _ring_hlo(kw, seq=512):
  mesh = _mesh()
  spec = NamedSharding(mesh, P(None, None, "sp", None))
  arg = jax.ShapeDtypeStruct((1, 2, seq, 16), jnp.float32, sharding=spec)

  def f(q, k, v):
    return jnp.sum(flashvjp.sharded_attention(q, k, v, mesh=mesh, seq_axis="sp",
                                              implementation="blockwise", block_q=32,
                                              block_kv=32, **kw))
  return jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(arg, arg, arg).compile()


def test_window_shorter_than_a_chunk_moves_a_third_of_causal():
  causal = _permute_bytes(_ring_hlo(dict(causal=True)))
  window = _permute_bytes(_ring_hlo(dict(causal=True, window=(16, 0))))  # chunk = 64
  assert causal[0] > 0 and window[0] > 0
  assert window[1] <= causal[1] / 3, (window, causal)
  # and no step is taken that no device needs: the schedule says which
  assert [s["shift"] for s in ring_schedule(N, 64, causal=True, window=(16, 0))] == [0, 1]


def test_chunked_mask_mod_skips_the_steps_nobody_needs():
  sched = ring_schedule(N, 64, mask_mod=flashvjp.chunked(64))
  assert [s["shift"] for s in sched] == [0]
  sched = ring_schedule(N, 64, mask_mod=flashvjp.chunked(128))
  assert [s["shift"] for s in sched] == [0, 1]
  # without a static hint (traced prefix lengths) every step is kept
  assert len(ring_schedule(N, 64, mask_mod=lambda b, h, q, kv: kv <= q)) == N


def test_schedule_zigzag_causal_is_balanced():
  sched = ring_schedule(4, 32, layout="zigzag", causal=True)
  assert [s["shift"] for s in sched] == [0, 1, 2, 3]
  for st in sched[1:]:  # after the diagonal step every device does the same work
    work = [sum(p["masks"][d] != "skip" for p in st["pairs"]) for d in range(4)]
    assert len(set(work)) == 1, work
