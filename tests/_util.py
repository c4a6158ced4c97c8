"""Shared test helpers: tolerances (stated once), input factories, comparison against naive.

Tolerances are relative to the largest magnitude of the float64 reference tensor
(attention gradients have many entries near zero, where elementwise relative error
means nothing). NaN never passes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import flashvjp
from flashvjp._check import tolerance  # the one tolerance table, stated in the package
from flashvjp.testing._compare import compare_trees  # the one comparison


def assert_close(got, ref, dtype, what="", impl="naive"):
  """Every leaf of `got` matches the float64 `ref` within the tolerance of its scale; no NaN.

  The comparison is flashvjp.testing's (one criterion for the suite, the CLI and users):
  |got - ref| <= tol * (max |ref| + |ref|) per leaf, infs only where the reference has
  them. The tolerance is `flashvjp._check.tolerance(dtype, impl)`: TOL[dtype], or TOL_TF32
  for float32 through Pallas-Triton at the default matmul precision (TF32 on the GPU,
  emulated in interpret mode).
  """
  got_l, ref_l = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)
  assert len(got_l) == len(ref_l), f"{what}: {len(got_l)} leaves != {len(ref_l)}"
  report = compare_trees(got_l, ref_l, tolerance(dtype, impl), title=what)
  assert report.passed, "\n" + str(report)


def t5_bucket(rel, num_buckets=8, max_distance=24):
  """T5's bidirectional bucket of a relative position kv_idx - q_idx (exact near, log-spaced
  far): a user-written score_mod's index, `table[h, t5_bucket(kv_idx - q_idx)]`."""
  half = num_buckets // 2
  exact = half // 2
  n = jnp.abs(rel)
  far = exact + (jnp.log(n.astype(jnp.float32) / exact + 1e-6) / np.log(max_distance / exact)
                 * (half - exact)).astype(jnp.int32)
  return (rel > 0).astype(jnp.int32) * half + jnp.where(n < exact, n, jnp.minimum(far, half - 1))


def random_qkv(seed, B, H, Hkv, Sq, Skv, D, Dv=None, dtype=jnp.float32):
  """float64 draws rounded to `dtype` (so the reference sees exactly the same values)."""
  Dv = D if Dv is None else Dv
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (B, H, Sq, D), jnp.float64).astype(dtype)
  k = jax.random.normal(kk, (B, Hkv, Skv, D), jnp.float64).astype(dtype)
  v = jax.random.normal(kv, (B, Hkv, Skv, Dv), jnp.float64).astype(dtype)
  return q, k, v


def as64(x):
  return jax.tree_util.tree_map(
      lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, x)


def check_debug_infs_grads(impl):
  """Random float64 inputs, key lengths and a causal mask (padded rows and masked entries
  in every kernel): forward and backward of `impl` run op by op under jax.debug_infs
  (jax.disable_jit: every pallas_call's outputs and every XLA op outside are checked),
  and match float64 naive attention."""
  rng = np.random.default_rng(3)
  q, k, v = (rng.standard_normal((2, n, 4, 8)) for n in (7, 9, 9))
  lengths = np.array([4, 9], np.int32)

  def loss(impl_, q, k, v):
    out = flashvjp.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, is_causal=True,
                                         implementation=impl_)
    return jnp.sum(jnp.sin(out))

  with jax.debug_infs(True), jax.disable_jit():
    got = jax.value_and_grad(lambda *a: loss(impl, *a), (0, 1, 2))(q, k, v)
  ref = jax.value_and_grad(lambda *a: loss("naive", *a), (0, 1, 2))(q, k, v)
  assert_close(got, ref, jnp.float64, what=f"{impl}/debug_infs")


def global_offsets_pair(implementation: str):
  """(q, k, v, off) -> (out, lse, grads, tangents): one ring chunk pair of a Pallas family,
  compiled, with traced global offsets `off` (int32 [4]): ALiBi at global positions, a
  mask_mod without block classes (prefix_lm) and dropout, through the family's forward,
  backward and tangent kernels. For the lowering tests of both families."""
  from flashvjp import _api
  from flashvjp import _mask_mod
  if implementation == "pallas_tpu":
    from flashvjp.pallas import tpu as family
    from flashvjp.pallas.tpu import tangent as family_tangent
  else:
    from flashvjp.pallas import triton as family  # type: ignore[no-redef]
    from flashvjp.pallas.triton import tangent as family_tangent  # type: ignore[no-redef]
  kw = dict(score_mod=flashvjp.alibi(flashvjp.alibi_slopes(2)),
            mask_mod=flashvjp.prefix_lm(jnp.asarray([30, 200], jnp.int32)), dropout_rate=0.1,
            dropout_rng=jax.random.key(0), deterministic=False, implementation=implementation,
            interpret=False, block_q=None, block_kv=None)

  def pair(q, k, v, off):
    _, cfg, arrays = _api._prepare(q, k, v, bias=None, mask=None, causal=False, window=None,
                                   segment_ids=None, scale=None, **kw)
    _, _, _, _, _, qs, kvs, seed, consts, _, mm_consts, _, _ = arrays
    mod = _mask_mod.ModInputs(None, tuple(mm_consts))
    offsets = tuple(off[n] for n in range(4))
    out, lse = family.forward(cfg, q, k, v, None, None, qs, kvs, seed, consts, mod,
                              offsets=offsets)
    g = family.backward(cfg, q, k, v, None, None, qs, kvs, seed, consts, out, lse, out, None, mod,
                        offsets=offsets)
    t = family_tangent.tangent(cfg, q, k, v, None, None, qs, kvs, seed, consts, out, lse, q, k, v,
                               None, None, mod, offsets=offsets)
    return out, lse, g, t

  return pair


def segment_ids(B, S, cuts):
  """int32 [B, S]: id n + 1 from position cuts[b][n] on (batch b cycles through cuts)."""
  ids = np.zeros((B, S), np.int32)
  for b in range(B):
    for c in cuts[b % len(cuts)]:
      ids[b, c:] += 1
  return jnp.asarray(ids)


COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class CompileCounter:
  """Executables a program needed: XLA compiles plus loads from the persistent compilation
  cache (tests/conftest.py shares one between the xdist workers, so a worker may load what
  the other compiled). Listens from its creation on."""

  def __init__(self):
    self.n = 0
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)
    jax.monitoring.register_event_listener(self._on_event)

  def _on_duration(self, event, duration, **kwargs):
    del duration, kwargs
    if event == COMPILE_EVENT:
      self.n += 1

  def _on_event(self, event, **kwargs):
    del kwargs
    if event == CACHE_HIT_EVENT:
      self.n += 1

  def count(self, fn):
    """Executables needed while running fn() to completion."""
    before = self.n
    jax.block_until_ready(fn())
    return self.n - before
