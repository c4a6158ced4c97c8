"""Forward mode (issue 12): jax.jvp / linearize / jacfwd, HVPs and second order, against JAX
autodiff of naive attention in float64 (tolerances: flashvjp._check, via tests/_util).

Shapes and feature cases come from the shared base (tests/attention_base.py). Pallas runs in
interpret mode (slow op by op: few cases, under jit).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashvjp
from flashvjp import _vjp
from tests import _util
from tests import attention_base
from tests.attention_base import BLOCK_KV
from tests.attention_base import BLOCK_Q
from tests.attention_base import CASES
from tests.attention_base import DV
from tests.attention_base import HKV
from tests.attention_base import SQ
from tests.attention_base import B
from tests.attention_base import D
from tests.attention_base import H

# Every feature of the shared base (ragged lengths 37/45 with blocks of 16: padding).
BLOCKWISE_CASES = sorted(CASES)
PALLAS_CASES = ("causal", "segments", "mask_dense", "bias_full", "alibi", "relative_bias",
                "dropout", "combo")
TPU_CASES = ("causal", "mask_dense", "alibi", "dropout", "combo")  # (the rest: via combo / Triton)


def _problem(name, dtype, seed=0):
  """(q, k, v, diff arrays, with_diff(d) -> kwargs with the diff arrays): the shared base's."""
  q, k, v, _, arrays, with_diff = attention_base.case_problem(name, dtype, seed)
  return q, k, v, arrays, with_diff


def _tangents_like(tree, seed):
  leaves, td = jax.tree_util.tree_flatten(tree)
  keys = jax.random.split(jax.random.key(seed), max(len(leaves), 1))
  return jax.tree_util.tree_unflatten(td, [
      jax.random.normal(kk, x.shape, jnp.float64).astype(x.dtype) for kk, x in zip(keys, leaves)])


def _jvp_case(impl, name, dtype=jnp.float32, **extra):
  q, k, v, d, with_diff = _problem(name, dtype)
  primals = (q, k, v, d)
  tangents = _tangents_like(primals, 42)
  if impl == "naive":
    primals, tangents = _util.as64(primals), _util.as64(tangents)
  else:
    extra = dict(block_q=BLOCK_Q, block_kv=BLOCK_KV, **extra)

  def f(q, k, v, d):
    return flashvjp.flash_attention(q, k, v, implementation=impl, return_lse=True,
                                    **with_diff(d), **extra)
  return jax.jit(lambda p, t: jax.jvp(f, p, t))(primals, tangents)


def _check_jvp(impl, name, dtype=jnp.float32, **extra):
  got = _jvp_case(impl, name, dtype, **extra)
  ref = _jvp_case("naive", name, dtype)
  _util.assert_close(got, ref, dtype, what=f"jvp {impl}/{name}", impl=impl)


@pytest.mark.parametrize("name", BLOCKWISE_CASES)
def test_jvp_blockwise(name):
  _check_jvp("blockwise", name)


@pytest.mark.parametrize("impl,name", [("pallas_triton", n) for n in PALLAS_CASES]
                         + [("pallas_tpu", n) for n in TPU_CASES])
def test_jvp_pallas_interpret(impl, name):
  _check_jvp(impl, name)


def test_jvp_blockwise_bfloat16():
  _check_jvp("blockwise", "alibi", jnp.bfloat16)


# ---- tiny float64 problems: jacfwd, check_grads, empty rows ------------------------------

def _tiny(impl="blockwise", **kw):
  q, k, v = _util.random_qkv(3, 1, 2, 1, 5, 6, 3, 2, jnp.float64)
  bias = 0.3 * jax.random.normal(jax.random.key(1), (1, 2, 5, 6), jnp.float64)
  mask = jnp.asarray(np.random.default_rng(4).random((5, 6)) > 0.2)
  opts = dict(mask=mask, causal=True, window=(3, None), block_q=2, block_kv=4) if impl != "naive" \
      else dict(mask=mask, causal=True, window=(3, None))
  opts.update(kw)

  def f(q, k, v, bias):
    out, lse = flashvjp.flash_attention(q, k, v, bias=bias, implementation=impl,
                                        return_lse=True, **opts)
    return out, jnp.where(jnp.isfinite(lse), lse, 0.0)
  return f, (q, k, v, bias)


def test_jacfwd_matches_naive():
  f, args = _tiny()
  fn, _ = _tiny("naive")
  got = jax.jit(jax.jacfwd(f, argnums=(0, 1, 2, 3)))(*args)
  ref = jax.jacfwd(fn, argnums=(0, 1, 2, 3))(*args)
  _util.assert_close(got, ref, jnp.float64, what="jacfwd")
  # and the reverse-mode Jacobian agrees (both modes, one function)
  rev = jax.jit(jax.jacrev(f, argnums=(0, 1, 2, 3)))(*args)
  _util.assert_close(rev, ref, jnp.float64, what="jacrev")


@pytest.mark.parametrize("impl", ["blockwise", "pallas_triton"])
def test_check_grads_order2_fwd(impl):
  # Order 2 in forward mode (jvp of jvp, and the fwd leg of grad); the order-2 "rev" leg
  # is reverse-over-reverse, refused with a clear error (test_reverse_over_reverse_*).
  f, args = _tiny(impl, mask=None)
  g = jax.jit(lambda q, k, v, bias: jnp.sum(f(q, k, v, bias)[0] ** 2) + jnp.sum(
      jnp.sin(f(q, k, v, bias)[1])))
  jax.test_util.check_grads(g, args, order=2, modes=("fwd",), atol=1e-6, rtol=1e-6)
  jax.test_util.check_grads(g, args, order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


def _ror_features():
  seg = jnp.asarray([[0] * 5 + [1] * 7], jnp.int32)
  mask = jnp.asarray(np.random.default_rng(0).random((1, 1, 12, 12)) > 0.3)
  return {
      "plain": {}, "causal": dict(causal=True), "window": dict(window=(3, 2)),
      "segment_ids": dict(segment_ids=seg), "mask": dict(mask=mask),
      "bias": dict(bias=0.1 * jnp.ones((1, 2, 12, 12))),
      "score_mod": dict(score_mod=flashvjp.alibi(jnp.asarray([0.5, 0.25]))),
      "mask_mod": dict(mask_mod=flashvjp.prefix_lm(jnp.asarray([4], jnp.int32))),
      "sinks": dict(sinks=jnp.asarray([0.3, -0.2])),
      "dropout": dict(dropout_rate=0.2, dropout_rng=jax.random.key(1), deterministic=False),
      "traced_scale": dict(scale=jnp.asarray(0.4)), "lse": dict(return_lse=True),
  }


@pytest.mark.parametrize("feature", sorted(_ror_features()))
def test_reverse_over_reverse_raises_naming_forward_over_reverse(feature):
  """grad of grad is refused with an error naming jax.jvp(jax.grad(f)), per feature; the
  supported forward-over-reverse HVP runs and matches naive float64 autodiff."""
  kw = _ror_features()[feature]
  q, k, v = _util.random_qkv(0, 1, 2, 1, 12, 12, 4, dtype=jnp.float64)

  def f(impl):
    def loss(q):
      res = flashvjp.flash_attention(q, k, v, implementation=impl, block_q=4, block_kv=4, **kw)
      out = res[0] if isinstance(res, tuple) else res
      return jnp.sum(jnp.sin(out))
    return loss

  with pytest.raises(NotImplementedError, match=r"jax\.jvp\(jax\.grad\(f\)"):
    jax.grad(lambda q: jnp.sum(jax.grad(f("blockwise"))(q) ** 2))(q)
  hvp = lambda impl: jax.jvp(jax.grad(f(impl)), (q,), (v[:, :1].repeat(2, 1),))[1]
  _util.assert_close(hvp("blockwise"), hvp("naive"), jnp.float64, what=f"hvp/{feature}")


@pytest.mark.parametrize("impl", ["pallas_triton", "pallas_tpu"])
def test_reverse_over_reverse_raises_for_pallas_and_jacrev(impl):
  q, k, v = _util.random_qkv(0, 1, 2, 1, 8, 8, 4, dtype=jnp.float32)
  f = lambda q: jnp.sum(jnp.sin(flashvjp.flash_attention(q, k, v, causal=True,
                                                         implementation=impl)))
  with pytest.raises(NotImplementedError, match="forward-over-reverse"):
    jax.jacrev(jax.grad(f))(q)
  with pytest.raises(NotImplementedError, match="forward-over-reverse"):
    jax.grad(lambda q: jnp.sum(jax.grad(f)(q)))(q)


def test_linearize_matches_jvp():
  f, args = _tiny()
  t = _tangents_like(args, 5)
  out, lin = jax.linearize(f, *args)
  _, ref = jax.jvp(f, args, t)
  _util.assert_close(lin(*t), ref, jnp.float64, what="linearize")
  _util.assert_close(out, f(*args), jnp.float64, what="linearize primal")


@pytest.mark.parametrize("impl", ["blockwise", "pallas_triton", "pallas_tpu"])
def test_empty_rows_zero_finite_tangents(impl):
  q, k, v = _util.random_qkv(1, 1, 2, 1, 8, 8, 4)
  mask = jnp.ones((1, 1, 8, 8), bool).at[:, :, 2].set(False)
  f = lambda q, k, v: flashvjp.flash_attention(q, k, v, mask=mask, return_lse=True,
                                               implementation=impl, block_q=4, block_kv=4)
  t = _tangents_like((q, k, v), 9)
  (out, lse), (t_out, t_lse) = jax.jit(lambda p, t: jax.jvp(f, p, t))((q, k, v), t)
  assert np.all(np.asarray(lse[:, :, 2]) == -np.inf)
  for x in (t_out, t_lse):
    assert np.isfinite(np.asarray(x)).all()
  np.testing.assert_array_equal(np.asarray(t_out[:, :, 2]), 0.0)
  np.testing.assert_array_equal(np.asarray(t_lse[:, :, 2]), 0.0)
  assert np.abs(np.asarray(t_out[:, :, [0, 1, 3]])).max() > 0  # the rest is not all zero


# ---- second order ---------------------------------------------------------------------

def _hvp_loss(impl, name="combo"):
  q, k, v, d, with_diff = _problem(name, jnp.float32)
  extra = {} if impl == "naive" else dict(block_q=BLOCK_Q, block_kv=BLOCK_KV)
  w = jax.random.normal(jax.random.key(8), (q.shape[0], q.shape[1], q.shape[2], v.shape[3]),
                        jnp.float64)

  def loss(p):
    q, k, v, d = p
    out, lse = flashvjp.flash_attention(q, k, v, implementation=impl, return_lse=True,
                                        **with_diff(d), **extra)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return jnp.sum(jnp.tanh(out.astype(jnp.float64)) * w) + jnp.sum(lse.astype(jnp.float64) ** 2)
  return loss, (q, k, v, d)


@pytest.mark.parametrize("impl", ["blockwise", "pallas_triton", "pallas_tpu"])
def test_hvp_forward_over_reverse(impl):
  loss, p = _hvp_loss(impl)
  loss_n, _ = _hvp_loss("naive")
  t = _tangents_like(p, 13)
  hvp = lambda L, p, t: jax.jvp(jax.grad(L), (p,), (t,))
  got = jax.jit(functools.partial(hvp, loss))(p, t)
  ref = jax.jit(functools.partial(hvp, loss_n))(_util.as64(p), _util.as64(t))
  _util.assert_close(got, ref, jnp.float32, what=f"hvp {impl}", impl=impl)


def test_vmap_of_jvp_and_jvp_of_vmap():
  f, args = _tiny()
  fn, _ = _tiny("naive")
  ts = [_tangents_like(args, s) for s in (1, 2, 3)]
  ts = jax.tree_util.tree_map(lambda *x: jnp.stack(x), *ts)
  vj = lambda f: jax.vmap(lambda t: jax.jvp(f, args, t)[1])(ts)
  _util.assert_close(jax.jit(lambda: vj(f))(), vj(fn), jnp.float64, what="vmap(jvp)")
  # jvp of a vmapped function: batched primals (the batching rule of the primitives)
  qs = jnp.stack([args[0], 2 * args[0]])
  fv = lambda g: (lambda qs: jax.vmap(lambda q: g(q, *args[1:]))(qs))
  got = jax.jit(lambda: jax.jvp(fv(f), (qs,), (jnp.ones_like(qs),)))()
  _util.assert_close(got, jax.jvp(fv(fn), (qs,), (jnp.ones_like(qs),)), jnp.float64,
                     what="jvp(vmap)")


def test_reverse_over_forward():
  f, args = _tiny()
  fn, _ = _tiny("naive")
  t = _tangents_like(args, 21)
  # sCM-style: the tangent under stop_gradient is a constant of the loss.
  def scm(f):
    def loss(p):
      (out, _), (t_out, _) = jax.jvp(f, p, t)
      return jnp.sum(out * jax.lax.stop_gradient(t_out))
    return loss
  _util.assert_close(jax.jit(jax.grad(scm(f)))(args), jax.grad(scm(fn))(args), jnp.float64,
                     what="grad with stop_gradient(tangent)")
  # A gradient w.r.t. the tangent direction runs the backward.
  dir_loss = lambda f: (lambda t: jnp.sum(jnp.sin(jax.jvp(f, args, t)[1][0])))
  _util.assert_close(jax.jit(jax.grad(dir_loss(f)))(t), jax.grad(dir_loss(fn))(t), jnp.float64,
                     what="grad w.r.t. the tangent direction")
  # A gradient through the tangent w.r.t. the primals (and the direction at once).
  through = lambda f: (lambda p, t: jnp.sum(jnp.sin(jax.jvp(f, p, t)[1][0])) + jnp.sum(
      jax.jvp(f, p, t)[1][1] ** 2))
  _util.assert_close(jax.jit(jax.grad(through(f), (0, 1)))(args, t),
                     jax.grad(through(fn), (0, 1))(args, t), jnp.float64,
                     what="grad through the tangent")


def test_jvp_under_remat_scan_and_value_dtype():
  q, k, v = _util.random_qkv(4, 1, 2, 1, 24, 24, 8)
  t = _tangents_like((q, k, v), 3)

  def step(c, _):
    out = jax.checkpoint(lambda q: flashvjp.flash_attention(q, k, v, causal=True,
                                                            implementation="blockwise",
                                                            block_q=8, block_kv=8))(c)
    return out, None

  def step_n(c, _):
    return flashvjp.flash_attention(c, k, v, causal=True, implementation="naive"), None
  run = lambda st: (lambda q: jax.lax.scan(st, q, None, length=2)[0])
  got = jax.jit(lambda: jax.jvp(run(step), (q,), (t[0],)))()
  ref = jax.jvp(run(step_n), (q,), (t[0],))
  _util.assert_close(got, ref, jnp.float32, what="jvp(scan(remat))")
  assert got[1].dtype == q.dtype


# ---- structure and memory -------------------------------------------------------------

def _eqns(jaxpr):
  for e in jaxpr.eqns:
    yield e
    for p in e.params.values():
      for sub in (p if isinstance(p, (tuple, list)) else (p,)):
        if hasattr(sub, "jaxpr") and hasattr(sub, "consts"):
          yield from _eqns(sub.jaxpr)
        elif hasattr(sub, "eqns"):
          yield from _eqns(sub)


def _prim_names(closed):
  return [e.primitive.name for e in _eqns(closed.jaxpr)]


def _max_array(closed):
  sizes = [int(np.prod(v.aval.shape)) for e in _eqns(closed.jaxpr) for v in e.outvars
           if hasattr(v.aval, "shape")]
  return max(sizes)


@pytest.mark.parametrize("impl", ["blockwise", "pallas_triton", "pallas_tpu"])
def test_structure_grad_runs_backward_jvp_runs_tangent_pass(impl):
  Sq = Skv = 512  # (the TPU family pads head dims to 128 lanes: O(seq * 128) arrays)
  q, k, v = _util.random_qkv(0, 1, 2, 2, Sq, Skv, 8)
  f = lambda q, k, v: flashvjp.flash_attention(q, k, v, implementation=impl, causal=True,
                                               block_q=16, block_kv=16)
  grad_jaxpr = jax.make_jaxpr(jax.grad(lambda *a: f(*a).sum(), (0, 1, 2)))(q, k, v)
  names = _prim_names(grad_jaxpr)
  # grad: the tangent pass was transposed into the hand-written backward; no tangent pass,
  # and the forward is run once, not differentiated.
  assert "flashvjp_tangent" not in names and "flashvjp_tangent_jvp" not in names
  assert "custom_vjp_call" in str(grad_jaxpr) or "custom_vjp_call_jaxpr" in str(grad_jaxpr)
  if impl != "blockwise":
    kernels = [str(e.params.get("name", e.params.get("name_and_src_info")))
               for e in _eqns(grad_jaxpr.jaxpr) if e.primitive.name == "pallas_call"]
    assert any("dkdv" in n or "dk" in n for n in kernels), kernels
    assert any("fwd" in n or "forward" in n for n in kernels), kernels
    assert not any("tangent" in n for n in kernels), kernels
  assert _max_array(grad_jaxpr) < Sq * Skv
  # jvp: the tangent primitive, and nothing of size [seq_q, seq_kv] inside it either.
  t = _tangents_like((q, k, v), 1)
  jvp_jaxpr = jax.make_jaxpr(lambda p, t: jax.jvp(f, p, t))((q, k, v), t)
  eqns = [e for e in _eqns(jvp_jaxpr.jaxpr) if e.primitive.name == "flashvjp_tangent"]
  assert len(eqns) == 1
  assert _max_array(jvp_jaxpr) < Sq * Skv
  e = eqns[0]
  inner = jax.make_jaxpr(functools.partial(_vjp._tangent_impl, **e.params))(
      *[jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in e.invars])
  assert _max_array(inner) < Sq * Skv, "tangent pass materialises an O(seq^2) array"
  kernels = [str(x.params.get("name", x.params.get("name_and_src_info")))
             for x in _eqns(inner.jaxpr) if x.primitive.name == "pallas_call"]
  if impl != "blockwise":  # the family's fused tangent kernel, not the blockwise pass
    assert len(kernels) == 1 and "tangent" in kernels[0], kernels
  else:
    assert not kernels


def _temp_bytes(fn, seq, causal):
  x = jax.ShapeDtypeStruct((1, 4, seq, 32), jnp.float32)
  return jax.jit(fn(causal)).lower(x, x, x).compile().memory_analysis().temp_size_in_bytes


def _jvp_fn(impl):
  def make(causal):
    f = lambda q, k, v: flashvjp.flash_attention(q, k, v, causal=causal, implementation=impl)
    return lambda q, k, v: jax.jvp(f, (q, k, v), (q, k, v))[1]
  return make


@pytest.mark.parametrize("causal", [True, False])
def test_jvp_temp_memory_is_linear_in_seq(causal):
  m1, m2, m4 = (_temp_bytes(_jvp_fn("blockwise"), s, causal) for s in (1024, 2048, 4096))
  assert m2 <= 2.2 * m1 and m4 <= 2.2 * m2, (m1, m2, m4)
  assert m4 < 4 * 4096 * 4096 * 4 / 8


@pytest.mark.parametrize("impl", ["pallas_triton", "pallas_tpu"])
def test_pallas_interpret_jvp_temp_memory_is_linear_in_seq(impl):
  m1, m2 = (_temp_bytes(_jvp_fn(impl), s, True) for s in (1024, 2048))
  assert m2 <= 2.2 * m1, (m1, m2)
  # (interpret mode keeps the kernels' padded layouts: the TPU family's 128-lane head dims
  # and lse rows make its constant large, but not quadratic)
  assert m2 < _temp_bytes(_jvp_fn("naive"), 2048, True) / 3


def test_naive_jvp_memory_is_quadratic_so_the_measurement_can_fail():
  n1, n2 = (_temp_bytes(_jvp_fn("naive"), s, False) for s in (512, 1024))
  assert n2 > 3.0 * n1, (n1, n2)


def test_hvp_temp_memory_is_linear_in_seq():
  def make(causal):
    f = lambda q, k, v: jnp.sum(flashvjp.flash_attention(q, k, v, causal=causal,
                                                         implementation="blockwise") ** 2)
    return lambda q, k, v: jax.jvp(jax.grad(f), (q, k, v), (q, k, v))[1]
  m1, m2 = (_temp_bytes(make, s, True) for s in (1024, 2048))
  assert m2 <= 2.2 * m1, (m1, m2)


def test_explain_says_what_forward_mode_runs():
  q = jax.ShapeDtypeStruct((1, 2, 128, 64), jnp.float32)
  paths = flashvjp.explain(q, q, q, implementation="blockwise").forward_mode
  assert "tangent pass" in paths["jvp"] and "backward" in paths["grad"]
  paths = flashvjp.explain(q, q, q, implementation="pallas_triton").forward_mode
  assert "jvp" in paths and "hvp" in paths


@pytest.mark.parametrize("impl", ["blockwise", "pallas_triton", "pallas_tpu"])
def test_jvp_mask_mod_and_sinks(impl):
  """mask_mod (its block classes travel as `mod`) and sinks (plain JAX after the op)."""
  q, k, v = _util.random_qkv(6, B, H, HKV, SQ, SQ, D, DV)
  sinks = jnp.linspace(-1.0, 1.0, H)
  mm = flashvjp.prefix_lm(jnp.asarray([5, 20], jnp.int32))
  primals = (q, k, v, sinks)
  tangents = _tangents_like(primals, 17)

  def run(impl, primals, tangents):
    extra = {} if impl == "naive" else dict(block_q=BLOCK_Q, block_kv=BLOCK_KV)
    f = lambda q, k, v, s: flashvjp.flash_attention(q, k, v, mask_mod=mm, sinks=s,
                                                    implementation=impl, return_lse=True, **extra)
    return jax.jit(lambda p, t: jax.jvp(f, p, t))(primals, tangents)
  got = run(impl, primals, tangents)
  ref = run("naive", _util.as64(primals), _util.as64(tangents))
  _util.assert_close(got, ref, jnp.float32, what=f"jvp mask_mod+sinks {impl}", impl=impl)


# ---- the Triton tangent kernel lowers for CUDA (no GPU; as tests/test_pallas_triton_lowering) --

@pytest.mark.parametrize("feature", ["causal_gqa", "segments_bias", "alibi_dropout", "softcap_window"])
def test_triton_tangent_kernel_lowers_for_cuda(feature, monkeypatch):
  from jax import export
  from jax._src.pallas.triton import pallas_call_registration as registration
  if hasattr(registration, "gpu_info_lib"):  # jax >= 0.11 asks for the device's capability
    from jax._src.pallas.triton import gpu_info
    info = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    monkeypatch.setattr(registration, "gpu_info_lib",
                        type("_Info", (), {"get_gpu_info": staticmethod(lambda: info)}))
  Bn, Hn, Hk, S, Dn = 2, 4, 2, 256, 64
  dt = jnp.bfloat16
  sd = lambda *s: jax.ShapeDtypeStruct(s, dt)
  q, k, v = sd(Bn, Hn, S, Dn), sd(Bn, Hk, S, Dn), sd(Bn, Hk, S, Dn)
  bias = sd(1, Hn, S, S) if feature == "segments_bias" else None
  slopes = jax.ShapeDtypeStruct((Hn,), jnp.float32) if feature == "alibi_dropout" else None
  kw = dict(causal_gqa=dict(causal=True),
            segments_bias=dict(segment_ids=jnp.asarray(
                np.repeat(np.arange(S)[None] * 3 // S, Bn, 0), jnp.int32)),
            alibi_dropout=dict(causal=True, dropout_rate=0.1, dropout_rng=jax.random.key(0),
                               deterministic=False),
            softcap_window=dict(window=(64, 0), score_mod=flashvjp.softcap(30.0)))[feature]

  def f(q, k, v, bias, slopes):
    extra = dict(kw)
    if slopes is not None:
      extra["score_mod"] = flashvjp.alibi(slopes)
    return flashvjp.flash_attention(q, k, v, bias=bias, implementation="pallas_triton",
                                    interpret=False, return_lse=True, block_q=64, block_kv=64,
                                    **extra)
  jvp = jax.jit(lambda p, t: jax.jvp(f, p, t))
  prim = (q, k, v, bias, slopes)
  exp = export.export(jvp, platforms=["cuda"], disabled_checks=[
      export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(prim, prim)
  text = exp.mlir_module()
  assert "flashvjp_tangent" in text and "flashvjp_fwd" in text


@pytest.mark.parametrize("feature", ["causal_gqa", "segments_bias", "alibi_dropout"])
def test_tpu_tangent_kernel_lowers_for_tpu(feature):
  """jax.export of jit(jvp) for TPU (no libtpu): the Mosaic lowering of the tangent kernel."""
  Bn, Hn, Hk, S, Dn = 2, 4, 2, 256, 128
  sd = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  q, k, v = sd(Bn, Hn, S, Dn), sd(Bn, Hk, S, Dn), sd(Bn, Hk, S, Dn)
  bias = sd(1, Hn, S, S) if feature == "segments_bias" else None
  slopes = jax.ShapeDtypeStruct((Hn,), jnp.float32) if feature == "alibi_dropout" else None
  kw = dict(causal_gqa=dict(causal=True),
            segments_bias=dict(segment_ids=jnp.asarray(
                np.repeat(np.arange(S)[None] * 3 // S, Bn, 0), jnp.int32)),
            alibi_dropout=dict(causal=True, dropout_rate=0.1, dropout_rng=jax.random.key(0),
                               deterministic=False))[feature]

  def f(q, k, v, bias, slopes):
    extra = dict(kw)
    if slopes is not None:
      extra["score_mod"] = flashvjp.alibi(slopes)
    return flashvjp.flash_attention(q, k, v, bias=bias, implementation="pallas_tpu",
                                    interpret=False, return_lse=True, block_q=128,
                                    block_kv=128, **extra)
  prim = (q, k, v, bias, slopes)
  exp = jax.export.export(jax.jit(lambda p, t: jax.jvp(f, p, t)), platforms=["tpu"])(prim, prim)
  text = exp.mlir_module()
  assert "flashvjp_tpu_tangent" in text and "flashvjp_tpu_fwd" in text


def test_eager_jvp_and_hvp_compile_once():
  """Outside jit, repeated jvp / HVP calls reuse their executables (as tests/test_compile)."""
  counter = _util.CompileCounter()
  q, k, v = _util.random_qkv(0, 1, 4, 2, 40, 40, 16)
  f = lambda q, k, v: flashvjp.flash_attention(q, k, v, causal=True, implementation="blockwise",
                                               block_q=16, block_kv=16)
  runs = {"jvp": lambda: jax.jvp(f, (q, k, v), (q, k, v)),
          "hvp": lambda: jax.jvp(jax.grad(lambda q: f(q, k, v).sum()), (q,), (q,))}
  for name, run in runs.items():
    counts = [counter.count(run) for _ in range(3)]
    assert counts[0] >= 1 and counts[1:] == [0, 0], (name, counts)
