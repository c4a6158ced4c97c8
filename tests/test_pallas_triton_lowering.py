"""The kernels lower to Triton IR, on a machine without a GPU.

`jax.export` with platforms=["cuda"] runs the Pallas Triton lowering (jaxpr ->
Triton MLIR) for every pallas_call of the forward and the backward. That catches
primitives without a Triton rule, non-power-of-2 loads and similar lowering
errors in CI. It does not run Triton's own compiler (TTIR -> PTX) nor execute
anything: benchmarks/gpu_check.py does that on a GPU.

The lowering asks for the GPU's compute capability: jax 0.10 falls back to sm_90
by itself; from 0.11 on we hand it an H100's through a private module attribute.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax._src.pallas.triton import pallas_call_registration as _registration

import flashvjp
from flashvjp import _config
from flashvjp import _dropout
from flashvjp import _score_mod
from flashvjp import _vjp
from tests import _util

# jax >= 0.11 asks gpu_info for the device; 0.10 has no such module and needs no patch.
_NEEDS_GPU_INFO = hasattr(_registration, "gpu_info_lib")


@pytest.fixture(autouse=True)
def _abstract_h100(monkeypatch):
  if not _NEEDS_GPU_INFO:
    return
  from jax._src.pallas.triton import gpu_info as _gpu_info
  info = _gpu_info.get_gpu_info_from_version(_gpu_info.GpuVersion.H100)

  class _Info:
    get_gpu_info = staticmethod(lambda: info)

  monkeypatch.setattr(_registration, "gpu_info_lib", _Info)


def _export_grad(dtype=jnp.bfloat16, B=2, H=4, Hkv=2, Sq=128, Skv=128, D=64, Dv=None,
                 bias_shape=None, mask_shape=None, segments=False, causal=False, window=None,
                 score_mod=None, dropout_rate=0.0, blocks=(64, 32), score_mod_of=None):
  """Export value_and_grad of the Pallas path for CUDA; returns the StableHLO text."""
  Dv = D if Dv is None else Dv
  q = jax.ShapeDtypeStruct((B, H, Sq, D), dtype)
  k = jax.ShapeDtypeStruct((B, Hkv, Skv, D), dtype)
  v = jax.ShapeDtypeStruct((B, Hkv, Skv, Dv), dtype)
  bias = None if bias_shape is None else jax.ShapeDtypeStruct(bias_shape, dtype)
  mask = None if mask_shape is None else jnp.asarray(np.random.default_rng(0).random(mask_shape) > 0.3)
  q_seg = kv_seg = None
  if segments:
    q_seg = jnp.asarray(np.repeat(np.arange(Sq)[None] * 3 // Sq, B, 0), jnp.int32)
    kv_seg = jnp.asarray(np.repeat(np.arange(Skv)[None] * 3 // Skv, B, 0), jnp.int32)
  seed = _dropout.seed_from_key(jax.random.key(0)) if dropout_rate else None
  # score_mod_of = (factory, array): the score_mod closes over a differentiated array.
  sm_arg = None if score_mod_of is None else score_mod_of[1]

  def loss(q, k, v, bias, sm_arg):
    fn, consts, n_diff = None, (), 0
    sm = score_mod if score_mod_of is None else score_mod_of[0](sm_arg)
    if sm is not None:
      fn, consts, n_diff = _score_mod.convert(sm, jnp.float32)
    cfg = _config.AttentionConfig(
        scale=D ** -0.5, causal=causal, window=window, seq_q=Sq, seq_kv=Skv,
        dropout_rate=dropout_rate, blocks=_config.BlockSizes(*blocks), score_mod=fn,
        num_diff_consts=n_diff, interpret=False, implementation="pallas_triton")
    out, lse = _vjp.attention(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed,
                              tuple(consts[:n_diff]), tuple(consts[n_diff:]))
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

  argnums = (0, 1, 2) + (() if bias is None else (3,)) + (() if sm_arg is None else (4,))
  f = jax.jit(jax.value_and_grad(loss, argnums=argnums))
  exp = export.export(
      f, platforms=["cuda"],
      disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
          q, k, v, bias, sm_arg)
  return exp.mlir_module()


CASES = {
    "plain_bf16": dict(),
    "float16": dict(dtype=jnp.float16),
    "float32": dict(dtype=jnp.float32),
    "causal": dict(causal=True),
    "window": dict(window=(40, 8)),
    "padding_and_head_dim_96": dict(Sq=100, Skv=72, D=96, Dv=40),
    "mqa": dict(Hkv=1, causal=True),
    "segments": dict(segments=True),
    "mask_dense": dict(mask_shape=(2, 4, 128, 128)),
    "mask_key_padding": dict(mask_shape=(2, 1, 1, 128)),
    "bias_full": dict(bias_shape=(2, 4, 128, 128)),
    "bias_broadcast": dict(bias_shape=(1, 4, 1, 128)),
    "bias_rows": dict(bias_shape=(1, 1, 128, 1)),
    "softcap": dict(score_mod=flashvjp.softcap(30.0)),
    "dropout": dict(dropout_rate=0.1),
    "combo": dict(causal=True, segments=True, mask_shape=(2, 1, 128, 128),
                  bias_shape=(2, 1, 128, 128), dropout_rate=0.1,
                  score_mod=flashvjp.softcap(20.0)),
    "head_dim_256": dict(D=256, blocks=(32, 32)),
    # ALiBi: slopes[h] is precomputed per head outside the kernels; grads flow to the slopes.
    "alibi_grad": dict(causal=True, score_mod_of=(flashvjp.alibi, flashvjp.alibi_slopes(4))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_lowers_to_triton(name):
  """fwd, dK/dV and dQ kernels (+ dbias with a bias) lower to Triton IR."""
  text = _export_grad(**CASES[name])
  n_kernels = text.count("__gpu$xla.gpu.triton")
  want = 4 if "bias_shape" in CASES[name] else 3  # fwd, dkdv, dq (+ dbias)
  assert n_kernels == want, f"{n_kernels} Triton kernels in the export, want {want}"


@pytest.mark.parametrize("mod", ["prefix_lm", "chunked"])
def test_mask_mod_lowers_to_triton(mod):
  """A mask_mod through the public API, compiled (interpret=False), exported for CUDA:
  prefix_lm's lengths[b] travels as a per-head residual, chunked's integer floor division
  is elementwise; fwd, dK/dV and dQ lower with the block lists as inputs."""
  B, H, S, D = 2, 2, 256, 64
  m = (flashvjp.prefix_lm(jnp.asarray([30, 200], jnp.int32)) if mod == "prefix_lm"
       else flashvjp.chunked(64))
  x = jax.ShapeDtypeStruct((B, H, S, D), jnp.bfloat16)
  f = lambda q, k, v: flashvjp.flash_attention(
      q, k, v, mask_mod=m, implementation="pallas_triton", interpret=False).astype(
          jnp.float32).sum()
  exp = export.export(
      jax.jit(jax.grad(f, (0, 1, 2))), platforms=["cuda"],
      disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(x, x, x)
  assert exp.mlir_module().count("__gpu$xla.gpu.triton") == 3


def test_global_offsets_lower_to_triton():
  """A ring chunk pair's call, compiled: traced global offsets (an int32 [4] kernel operand),
  ALiBi at global positions (with its slopes' gradient), a mask_mod without block classes
  and dropout; the forward, dK/dV, dQ and tangent kernels lower to Triton IR."""
  pair = _util.global_offsets_pair("pallas_triton")

  x = jax.ShapeDtypeStruct((2, 2, 128, 64), jnp.bfloat16)
  exp = export.export(
      jax.jit(pair), platforms=["cuda"],
      disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
          x, x, x, jax.ShapeDtypeStruct((4,), jnp.int32))
  assert exp.mlir_module().count("__gpu$xla.gpu.triton") == 4  # fwd, dkdv, dq, tangent
