"""The compiled Mosaic-TPU kernels lower for TPU on a CPU host (jax.export, no libtpu).

For every feature case of the shared base, value_and_grad through the public API
(`implementation="pallas_tpu", interpret=False`) is exported with
``jax.export(..., platforms=["tpu"])``. The Pallas TPU lowering runs in full here: it
checks block shapes against the (8, 128) rule and emits each kernel's Mosaic MLIR into
a ``tpu_custom_call``. The module must hold exactly one forward kernel and the separate
hand-written backward kernels (dK/dV, dQ, and dbias when there is a bias): the forward
is never differentiated by XLA. What only a TPU checks (VMEM budget, vector layouts,
Mosaic's own compilation) is not covered; see docs/pallas_tpu.md.
"""
import re

import jax
import jax.numpy as jnp
import pytest

import flashvjp
from tests import _util
from tests import attention_base as AB

# Cases whose score_mod reads a table by kv_idx - q_idx: a row per (b, h) read as Toeplitz
# tiles, and its gradient's kernel over the block diagonals (issue 32; refused before).
REL = {"relative_bias"}


def _abstract_case(name, dtype):
  shape, make = AB.CASES[name]
  dims = dict(B=AB.B, H=AB.H, Hkv=AB.HKV, Sq=AB.SQ, Skv=AB.SKV, D=AB.D, Dv=AB.DV)
  dims.update(shape)
  kw = make(dtype)
  diff = kw.pop("diff", {})
  sds = jax.ShapeDtypeStruct
  q = sds((dims["B"], dims["H"], dims["Sq"], dims["D"]), dtype)
  k = sds((dims["B"], dims["Hkv"], dims["Skv"], dims["D"]), dtype)
  v = sds((dims["B"], dims["Hkv"], dims["Skv"], dims["Dv"]), dtype)
  d = {n: (x[1] if isinstance(x, tuple) else x) for n, x in diff.items()}
  d = jax.tree_util.tree_map(lambda x: sds(x.shape, x.dtype), d)

  def loss(q, k, v, d):
    args = dict(kw)
    if "bias" in d:
      args["bias"] = d["bias"]
    if "score_mod" in d:
      args["score_mod"] = diff["score_mod"][0](d["score_mod"])
    out, lse = flashvjp.flash_attention(q, k, v, implementation="pallas_tpu", interpret=False,
                                        return_lse=True, **args)
    return (jnp.sum(out.astype(jnp.float32))
            + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0).astype(jnp.float32)))

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))), (q, k, v, d), "bias" in d


def export_case(name, dtype):
  fn, args, has_bias = _abstract_case(name, dtype)
  return jax.export.export(fn, platforms=["tpu"])(*args), has_bias


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("name", sorted(AB.CASES))
def test_value_and_grad_lowers_for_tpu(name, dtype):
  exported, has_bias = export_case(name, dtype)
  assert exported.platforms == ("tpu",)
  text = exported.mlir_module()
  kernels = re.findall(r'kernel_name = "([^"]+)"', text)
  want = ["flashvjp_tpu_fwd", "flashvjp_tpu_bwd_dkdv", "flashvjp_tpu_bwd_dq"]
  if has_bias:
    want.append("flashvjp_tpu_bwd_dbias")
  if name in REL:
    want.append("flashvjp_tpu_bwd_drel")
  assert sorted(kernels) == sorted(want), kernels
  assert text.count("stablehlo.custom_call @tpu_custom_call") == len(want)


def test_blocks_that_break_the_tiling_rule_are_rounded_not_rejected():
  """Odd user blocks (block_q=13, block_kv=5) become (16, 128): the export still lowers."""
  x = jax.ShapeDtypeStruct((1, 2, 100, 64), jnp.bfloat16)
  f = lambda q, k, v: flashvjp.flash_attention(
      q, k, v, causal=True, block_q=13, block_kv=5, implementation="pallas_tpu",
      interpret=False).astype(jnp.float32).sum()
  exported = jax.export.export(jax.jit(jax.grad(f, (0, 1, 2))), platforms=["tpu"])(x, x, x)
  assert exported.mlir_module().count("@tpu_custom_call") == 3


@pytest.mark.parametrize("mod", ["prefix_lm", "chunked"])
def test_mask_mod_lowers_for_tpu_at_default_blocks(mod):
  """prefix_lm (per-batch lengths[b]: an SMEM residual) and chunked (integer floor division,
  lowered without knowing the TPU generation) through the compiled kernels, several blocks."""
  B, H, S, D = 2, 2, 1024, 64
  m = (flashvjp.prefix_lm(jnp.asarray([100, 700], jnp.int32)) if mod == "prefix_lm"
       else flashvjp.chunked(256))
  x = jax.ShapeDtypeStruct((B, H, S, D), jnp.bfloat16)
  f = lambda q, k, v: flashvjp.flash_attention(
      q, k, v, mask_mod=m, implementation="pallas_tpu", interpret=False).astype(jnp.float32).sum()
  exported = jax.export.export(jax.jit(jax.grad(f, (0, 1, 2))), platforms=["tpu"])(x, x, x)
  kernels = re.findall(r'kernel_name = "([^"]+)"', exported.mlir_module())
  assert sorted(kernels) == ["flashvjp_tpu_bwd_dkdv", "flashvjp_tpu_bwd_dq", "flashvjp_tpu_fwd"]


@pytest.mark.parametrize("precision", ["high", "highest"])
def test_float32_precisions_lower_for_tpu(precision):
  """Mosaic lowers every kernel's float32 dots at HIGH (bf16x3) and HIGHEST (fp32), the
  contraction precisions "high" / "highest" request (docs/implementations.md "Precision")."""
  with jax.default_matmul_precision(precision):
    exported, _ = export_case("combo", jnp.float32)
  kernels = re.findall(r'kernel_name = "([^"]+)"', exported.mlir_module())
  assert len(kernels) == 4, kernels


def test_global_offsets_lower_for_tpu():
  """A ring chunk pair's call, compiled: traced global offsets (int32 [4] in SMEM), ALiBi at
  global positions, a mask_mod without block classes and dropout; the forward, dK/dV, dQ
  and tangent kernels lower for TPU."""
  pair = _util.global_offsets_pair("pallas_tpu")

  x = jax.ShapeDtypeStruct((2, 2, 256, 64), jnp.bfloat16)
  exported = jax.export.export(jax.jit(pair), platforms=["tpu"])(
      x, x, x, jax.ShapeDtypeStruct((4,), jnp.int32))
  kernels = re.findall(r'kernel_name = "([^"]+)"', exported.mlir_module())
  assert sorted(kernels) == ["flashvjp_tpu_bwd_dkdv", "flashvjp_tpu_bwd_dq", "flashvjp_tpu_fwd",
                             "flashvjp_tpu_tangent"]
