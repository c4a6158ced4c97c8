"""The program's target decides, and the real compilers compile what users will run.

Part 1 (no compiler needed, 8 virtual CPU devices): the target (platform, device count) is
read from the inputs' shardings, else the abstract mesh in context, else the host; the
partitioning rule runs exactly when the program's mesh has more than one device.

Part 2 (XLA's GPU compiler from the CUDA plugin, libtpu; deviceless, on this CPU): with no
`implementation` and no `interpret`, an ahead-of-time compile for an H100 / B200 gets the
compiled Triton kernels, for a TPU v5e / v6e chip the compiled Mosaic kernels, for every
feature in reverse and forward mode; for 8 H100s with the sequence sharded, the ring or
Ulysses, never an all-gather of the whole sequence. Compile errors fail here.
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
from flashvjp import _api
from flashvjp import _target
from tests import _aot
from tests import _util

SEQ = P(None, None, "sp", None)


def _cpu_mesh(n):
  return Mesh(np.array(jax.devices()[:n]), ("sp",))


def _shapes(mesh, spec=SEQ, B=1, H=4, Hkv=2, S=256, D=64, dtype=jnp.float32):
  q = _aot.sds(mesh, (B, H, S, D), dtype, spec)
  k = _aot.sds(mesh, (B, Hkv, S, D), dtype, spec)
  return q, k, k


def _cfg(q, k, v, **kw):
  _, cfg, _ = _api._prepare(q, k, v, **{**_PREPARE_DEFAULTS, **kw}, allow_shapes=True)
  return cfg


_PREPARE_DEFAULTS = dict(bias=None, mask=None, causal=True, window=None, segment_ids=None,
                         score_mod=None, scale=None, dropout_rate=0.0, dropout_rng=None,
                         deterministic=True, implementation=None, block_q=None, block_kv=None,
                         interpret=None)


# ---- part 1: the target decides, not the host --------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 4])
def test_target_is_the_inputs_mesh_not_the_host(n):
  assert jax.device_count() == 8  # the host (tests/conftest.py)
  q, k, v = _shapes(_cpu_mesh(n))
  d = flashvjp.explain(q, k, v, causal=True)
  assert d.target.num_devices == n and d.target.platform == "cpu"
  assert d.target.source == _target.SOURCES[0]
  assert _cfg(q, k, v).partition == (n > 1)
  assert f"{n} x" in str(d)


def test_target_inside_jit_is_the_jit_inputs_mesh():
  seen = []

  def f(q, k, v):
    seen.append(flashvjp.explain(q, k, v, causal=True).target)
    return flashvjp.flash_attention(q, k, v, causal=True)

  q, k, v = _shapes(_cpu_mesh(2))
  jax.jit(f).lower(q, k, v)
  # jax 0.10.2-0.12: the tracer's type carries the mesh of the jit's input shardings
  assert seen[0].num_devices == 2 and seen[0].source == _target.SOURCES[0]


def test_abstract_mesh_in_context_decides_for_unsharded_inputs():
  use = getattr(jax.sharding, "use_abstract_mesh", None)
  if use is None:  # pragma: no cover
    pytest.skip("this jax has no jax.sharding.use_abstract_mesh")
  q = jax.ShapeDtypeStruct((1, 4, 256, 64), jnp.float32)
  with use(jax.sharding.AbstractMesh((2,), ("sp",))):
    t = flashvjp.explain(q, q, q).target
  assert t.num_devices == 2 and t.source == _target.SOURCES[1]
  assert flashvjp.explain(q, q, q).target.source == _target.SOURCES[2]  # the host


def _grad_hlo(q, k, v):
  loss = lambda q, k, v: flashvjp.flash_attention(q, k, v, causal=True).sum()
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).as_text()


def test_partitioning_rule_runs_exactly_for_a_multi_device_program():
  # one device (on an 8-device host): the rule is skipped; two: the op is partitioned
  one = _grad_hlo(*_shapes(_cpu_mesh(1), P()))
  two = _grad_hlo(*_shapes(_cpu_mesh(2)))
  assert "CustomSPMDPartitioning" not in one
  assert "CustomSPMDPartitioning" in two


def test_same_program_runs_on_the_host_devices():
  # sharded arrays on this host's devices: the target is the host's, results unchanged
  mesh = _cpu_mesh(4)
  rng = np.random.default_rng(0)
  x = [jax.device_put(rng.standard_normal((1, 4, 128, 32), np.float32),
                      NamedSharding(mesh, SEQ)) for _ in range(3)]
  got = jax.jit(lambda q, k, v: flashvjp.flash_attention(q, k, v, causal=True))(*x)
  want = flashvjp.flash_attention(*[np.asarray(a) for a in x], causal=True,
                                  implementation="naive")
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


# ---- part 2: deviceless compiles ------------------------------------------------------------

B, H, HKV, S, D = 2, 8, 2, 1024, 128


def _features(mesh, dtype, B, H, S):
  """name -> (kwargs(*extra) for flash_attention, extra args (ShapeDtypeStructs))."""
  seg = _aot.sds(mesh, (B, S), jnp.int32)
  return {
      "causal": (lambda: dict(causal=True), ()),
      "window": (lambda: dict(causal=True, window=(256, 0)), ()),
      "segments": (lambda s: dict(segment_ids=s), (seg,)),
      "bias": (lambda b: dict(bias=b), (_aot.sds(mesh, (1, H, S, S), dtype),)),
      "dense_mask": (lambda m: dict(mask=m), (_aot.sds(mesh, (B, 1, S, S), jnp.bool_),)),
      "softcap": (lambda: dict(causal=True, score_mod=flashvjp.softcap(30.0)), ()),
      "alibi": (lambda sl: dict(causal=True, score_mod=flashvjp.alibi(sl)),
                (_aot.sds(mesh, (H,), jnp.float32),)),
      "mask_mod": (lambda pl: dict(mask_mod=flashvjp.prefix_lm(pl)),
                   (_aot.sds(mesh, (B,), jnp.int32),)),
      "sinks": (lambda sk: dict(causal=True, sinks=sk), (_aot.sds(mesh, (H,), jnp.float32),)),
      "dropout": (lambda: dict(causal=True, dropout_rate=0.1, deterministic=False,
                               dropout_rng=jax.random.key(0)), ()),
      # mods reading arrays by one position (issue 32: per-position residuals)
      "kv_bias": (lambda bv: dict(causal=True, score_mod=lambda s, b, h, i, j: s + bv[b, j]),
                  (_aot.sds(mesh, (B, S), jnp.float32),)),
      "q_temperature": (lambda t: dict(causal=True, score_mod=lambda s, b, h, i, j: s * t[i]),
                        (_aot.sds(mesh, (S,), jnp.float32),)),
      "document_causal": (lambda d: dict(mask_mod=flashvjp.document_causal(d)), (seg,)),
      # read by kv_idx - q_idx (a row per (b, h) over the differences)
      "relative_position_bias": (
          lambda tb: dict(causal=True, score_mod=flashvjp.relative_position_bias(tb, 64)),
          (_aot.sds(mesh, (H, 129), jnp.float32),)),
      "t5_buckets": (lambda tb: dict(causal=True, score_mod=lambda s, b, h, i, j: s + tb[
          h, _util.t5_bucket(j - i, 32, 128)]), (_aot.sds(mesh, (H, 32), jnp.float32),)),
  }


FEATURES = ["causal", "window", "segments", "bias", "dense_mask", "softcap", "alibi",
            "mask_mod", "sinks", "dropout"]


def _compile(mesh, feature, mode, dtype, spec=_aot.REPLICATED, shape=(B, H, HKV, S, D), **extra_kw):
  b, h, hkv, s, d = shape
  q = _aot.sds(mesh, (b, h, s, d), dtype, spec)
  k = _aot.sds(mesh, (b, hkv, s, d), dtype, spec)
  make, extra = _features(mesh, dtype, b, h, s)[feature]

  decisions = []

  def attn(q, k, v, *xs):
    if not decisions:  # the decision the traced call makes (on tracers)
      decisions.append(flashvjp.explain(q, k, v, **make(*xs), **extra_kw))
    return flashvjp.flash_attention(q, k, v, **make(*xs), **extra_kw)

  floats = tuple(i for i, x in enumerate((q, k, k) + extra)
                 if jnp.issubdtype(x.dtype, jnp.floating))
  grad = jax.value_and_grad(lambda *a: attn(*a).astype(jnp.float32).sum(), argnums=floats)
  jvp = lambda q, k, v, *xs: jax.jvp(lambda q, k, v: attn(q, k, v, *xs), (q, k, v), (q, k, v))
  # "both": one program holding value_and_grad and jvp (one compile: the matrices' cost)
  fn = {"grad": grad, "jvp": jvp, "both": lambda *a: (grad(*a), jvp(*a))}[mode]
  with jax.default_matmul_precision("highest" if dtype == jnp.float32 else "default"):
    compiled = jax.jit(fn).lower(q, k, k, *extra).compile()
  return decisions[0], compiled


# The kernels each mode's program holds, by the names the families give them (in the
# compiled HLO: Triton's and Mosaic's custom calls carry them).
KERNELS = {"grad": ("fwd", "bwd_dkdv", "bwd_dq"), "jvp": ("fwd", "tangent")}
KERNELS["both"] = KERNELS["grad"] + ("tangent",)
KERNEL_PREFIX = {"pallas_triton": "flashvjp_", "pallas_tpu": "flashvjp_tpu_"}


def _assert_compiled_kernels(decision, compiled, family, call, mode):
  """Asserts the family's kernels of `mode` are compiled in; returns the program's kernel
  names."""
  hlo = compiled.as_text()
  assert decision.implementation == family and not decision.interpret, str(decision)
  assert not decision.target.local, str(decision.target)
  n = hlo.count(call)
  assert n >= len(KERNELS[mode]) - (mode == "both"), f"{n} {call} kernels"  # fwd shared
  names = set(re.findall(r"flashvjp_[a-z_0-9]+", hlo))
  missing = [k for k in KERNELS[mode] if KERNEL_PREFIX[family] + k not in names]
  assert not missing, f"kernels {missing} not in the compiled program (it has {sorted(names)})"
  # no interpret-mode loops: the kernels are custom calls
  assert not _aot.interpret_loops(hlo)
  return names


@_aot.needs_cuda
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("gpu,dtype", [("h100", jnp.bfloat16), ("h100", jnp.float32),
                                       ("b200", jnp.bfloat16)],
                         ids=["h100-bf16", "h100-f32", "b200-bf16"])
def test_gpu_compile_matrix(gpu, feature, dtype):
  """Every feature x {value_and_grad, jvp} (one program holding both: one compile) x
  {bf16, float32 at "highest"} on an H100, bf16 on a B200 (float32 at "highest" is the same
  kernels' lowering there; left to the H100 for CI time): the forward, dK/dV, dQ and tangent
  kernels compiled."""
  decision, compiled = _compile(_aot.gpu_mesh(gpu), feature, "both", dtype)
  _assert_compiled_kernels(decision, compiled, "pallas_triton", _aot.TRITON_CALL, "both")


POSITION_FEATURES = ["kv_bias", "q_temperature", "document_causal", "relative_position_bias",
                     "t5_buckets"]


@_aot.needs_cuda
@pytest.mark.parametrize("feature", POSITION_FEATURES)
def test_gpu_compiles_mods_indexing_arrays_by_position(feature):
  """Issue 32: what a mod reads by q or kv position travels as per-position residuals, and
  what it reads by kv_idx - q_idx as a row over the differences, so the Triton kernels
  compile it (before: refused, a gather on the tile), in reverse and forward mode (one
  program). The relative table's gradient adds a kernel over the block diagonals
  ("flashvjp_bwd_drel")."""
  decision, compiled = _compile(_aot.gpu_mesh("h100"), feature, "both", jnp.bfloat16)
  names = _assert_compiled_kernels(decision, compiled, "pallas_triton", _aot.TRITON_CALL,
                                   "both")
  hows = {o.how for o in decision.operands}
  assert hows & {"by q position", "by kv position", "by q position and by kv position",
                 "by kv_idx - q_idx"}, hows
  rel = feature in ("relative_position_bias", "t5_buckets")
  assert ("flashvjp_bwd_drel" in names) == rel


@_aot.needs_tpu
@pytest.mark.parametrize("feature", POSITION_FEATURES)
def test_tpu_compile_matrix_of_mods_indexing_arrays_by_position(feature):
  """The same mods through libtpu's Mosaic compiler (residuals laid out like segment ids).
  ("matrix" in the name: .ci/run's jax 0.11.2 step skips the TPU compiles, its pinned libtpu
  does not take the "v5e:1x1" topology name.)"""
  decision, compiled = _compile(_aot.tpu_mesh("v5e"), feature, "both", jnp.bfloat16)
  names = _assert_compiled_kernels(decision, compiled, "pallas_tpu", _aot.TPU_CALL, "both")
  rel = feature in ("relative_position_bias", "t5_buckets")  # Toeplitz tiles
  assert ("flashvjp_tpu_bwd_drel" in names) == rel


@_aot.needs_tpu
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("tpu", ["v5e", "v6e"])
def test_tpu_compile_matrix(tpu, feature):
  """Every feature x {value_and_grad, jvp} (one program): the Mosaic kernels compiled."""
  decision, compiled = _compile(_aot.tpu_mesh(tpu), feature, "both", jnp.bfloat16)
  _assert_compiled_kernels(decision, compiled, "pallas_tpu", _aot.TPU_CALL, "both")


@_aot.needs_tpu
def test_multichip_tpu_deviceless_is_a_clear_error_and_shard_map_compiles():
  mesh = _aot.tpu_mesh("v5e", "2x2")
  q, k, v = _shapes(mesh, dtype=jnp.bfloat16, D=128, S=1024)
  loss = lambda q, k, v: flashvjp.flash_attention(q, k, v, causal=True).astype(
      jnp.float32).sum()
  with pytest.raises(NotImplementedError, match="libtpu's deviceless compiler"):
    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v)
  sm = lambda q, k, v: flashvjp.sharded_attention(
      q, k, v, mesh=mesh, seq_axis="sp", causal=True).astype(jnp.float32).sum()
  hlo = jax.jit(jax.grad(sm, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
  assert hlo.count(_aot.TPU_CALL) >= 3 and _aot.count(hlo, "collective-permute") > 0


# ---- 8 x H100, the sequence sharded ------------------------------------------------------

SEQ_FEATURES = ["causal", "window", "segments", "mask_mod", "dropout"]


# Each feature compiled with one strategy, each strategy with several (CI time: every pair is
# exact on virtual CPU devices, tests/test_partition_seq.py; here the H100 compile of each).
SEQ_PAIRS = [("causal", "ring"), ("causal", "ulysses"), ("window", "ring"),
             ("segments", "ulysses"), ("mask_mod", "ring"), ("dropout", "ulysses")]
assert {f for f, _ in SEQ_PAIRS} == set(SEQ_FEATURES)


@_aot.needs_cuda
@pytest.mark.parametrize("feature,strategy", SEQ_PAIRS)
def test_h100x8_sequence_sharded_runs_the_strategy(feature, strategy):
  S8 = 65536
  mesh = _aot.gpu_mesh("h100", 8)
  decision, compiled = _compile(mesh, feature, "grad", jnp.bfloat16, spec=SEQ,
                                shape=(1, 16, 8, S8, 128), context_parallel=strategy)
  assert decision.target.num_devices == 8 and decision.implementation == "pallas_triton"
  q, k, v = _shapes(mesh, B=1, H=16, Hkv=8, S=S8, D=128, dtype=jnp.bfloat16)
  plan = flashvjp.explain(q, k, v, causal=True, context_parallel=strategy).context_parallel
  assert plan is not None and plan.name == strategy, str(plan)
  hlo = compiled.as_text()
  assert hlo.count(_aot.TRITON_CALL) >= 3
  gathered = [t for t in _aot.collective_results(hlo, "all-gather") if f",{S8}," in t]
  assert not gathered, f"all-gathers of the whole sequence: {gathered}"
  # the strategy that ran, read from the program: the ring permutes, Ulysses all-to-alls
  permutes, all_to_alls = _aot.count(hlo, "collective-permute"), _aot.count(hlo, "all-to-all")
  assert (permutes > 0) if strategy == "ring" else (all_to_alls > 0 and permutes == 0)


# Per-device temp of the 8 x H100 program at S = 64k against the ideal share (1/8) of the
# one-device program's temp (H=16, Hkv=8, D=128, bf16, causal, jit(value_and_grad)), as XLA's
# GPU compiler reports it (memory_analysis). Measured 2026-12-05, jax 0.12.0.1, since the
# Triton dQ and dK/dV kernels write their gradients in the inputs' dtype (they wrote float32,
# converted after: a float32 copy of dq / dk / dv in temp): one device 1024 -> 520 MiB,
# Ulysses 193 -> 145 MiB per device, ring 433.5 MiB (unchanged). Against the new share
# (65 MiB) that is Ulysses 2.23x, ring 6.67x (before: 1.51x and 3.39x of a 128 MiB share):
# the goal, 1.25x, is not met. Ulysses' peak is the backward kernel's: the heads-layout
# q / k / v / dO it must hold (96 MiB; in the one-device program they are arguments, not
# temporaries) beside the kernel's own buffers; O no longer moves (`flashvjp._delta`). The
# ring holds its float32 dQ / dK / dV accumulators and the K/V chunk in flight; since
# 2026-12-06 each pair's gradients are added to the accumulators inside the ring step's
# switch (before: a float32 copy of the pair's dq / dk / dv as the switch's results):
# 433.5 -> 321.5 MiB (4.95x). With ring_head_groups=8 (the ring once per kv head, one after
# the other: 2026-12-06) the ring holds one head group's state: 112.7 MiB (1.73x). These
# bounds are the measured MiB with a margin: a regression guard, not the goal. Why no
# strategy as built reaches the goal at this shape: docs/distributed.md "Memory per device".
TEMP_MIB = {"one device": 530, "ulysses": 150, "ring": 335, "ring, 8 head groups": 125}


@_aot.needs_cuda
def test_h100x8_per_device_temp_against_the_one_device_share():
  shape = (1, 16, 8, 65536, 128)
  mib = lambda c: c.memory_analysis().temp_size_in_bytes / 2**20
  _, one = _compile(_aot.gpu_mesh("h100", 1), "causal", "grad", jnp.bfloat16, shape=shape)
  share = mib(one) / 8
  # no float32 copy of dq / dk / dv (bf16 [1, 16, 64k, 128] is 256 MiB, float32 512 MiB)
  assert 256 < mib(one) <= TEMP_MIB["one device"], mib(one)
  for strategy, groups in (("ulysses", 1), ("ring", 1), ("ring", 8)):
    _, c = _compile(_aot.gpu_mesh("h100", 8), "causal", "grad", jnp.bfloat16, spec=SEQ,
                    shape=shape, context_parallel=strategy, ring_head_groups=groups)
    name = strategy if groups == 1 else f"{strategy}, {groups} head groups"
    assert share <= mib(c) <= TEMP_MIB[name], (name, mib(c), share)
    if groups > 1:  # the K/V chunks that travel are one kv head's
      moved = [t for t in _aot.collective_results(c.as_text(), "collective-permute")
               if t.startswith("bf16[1,")]
      assert moved and all(t == "bf16[1,1,8192,128]" for t in moved), moved
    if strategy == "ulysses":  # to the heads layout: q in the forward, dO (not O) backward
      to_heads = [t for t in _aot.collective_results(c.as_text(), "all-to-all")
                  if t.startswith("bf16[1,16,8192,128]")]
      assert len(to_heads) == 2, to_heads
