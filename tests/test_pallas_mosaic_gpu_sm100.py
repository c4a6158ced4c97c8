"""The Blackwell (sm_100a) forward kernel (flashvjp/pallas/mosaic_gpu_sm100, issue 46).

In the GPU interpreter with race detection, against float64 naive attention (the shared
reference) at the family's tolerances: head dims 64 and 128 (and padded ones), GQA, causal and
window masks (masked edge blocks, fully visible blocks between, rows and CTAs that attend
nothing), ragged lengths, a value head dim of its own; what it does not implement yet is refused
by name. Deviceless for sm_100a (the CUDA plugin, the B200 target config): tcgen05 MMAs in the
PTX, no register spill, SMEM within a Blackwell block's 227 KiB. Needs jax >= 0.12 (tcgen05,
TMEM).
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from flashvjp import reference
from flashvjp._config import AttentionConfig
from flashvjp._config import BlockSizes
from flashvjp.pallas.mosaic_gpu import _compat
from tests import _util

if _compat.blackwell_unavailable() is not None:
  pytest.skip(_compat.blackwell_unavailable(), allow_module_level=True)
from flashvjp.pallas.mosaic_gpu_sm100 import backward as Bw
from flashvjp.pallas.mosaic_gpu_sm100 import forward as F


def _cfg(Sq, Skv, D, causal=False, window=None, **kw):
  return AttentionConfig(scale=D ** -0.5, causal=causal, window=window, seq_q=Sq, seq_kv=Skv,
                         dropout_rate=0.0, blocks=BlockSizes(), interpret=True,
                         implementation="pallas_mosaic_gpu", **kw)


# name -> (B, H, Hkv, Sq, Skv, D, Dv, dtype, mask kwargs); few and small (interpret time)
CASES = {
    # one CTA, the 2-slot ring refilled (4 kv blocks), GQA
    "full_gqa_ring_d64": (1, 2, 1, 128, 512, 64, 64, jnp.bfloat16, {}),
    # causal: CTA 0 one masked block, CTA 1 a fully visible one then a masked one; ragged
    "causal_ragged_d128_f16": (1, 1, 1, 200, 200, 128, 128, jnp.float16, dict(causal=True)),
    # a window: rows q >= 97 attend nothing (kv >= q + 3), and the second CTA no kv block at
    # all; padded head dims and a value head dim of its own
    "window_empty_rows_dv": (1, 1, 1, 230, 100, 80, 48, jnp.bfloat16, dict(window=(-3, 5))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_matches_float64_reference_without_races(name):
  B, H, Hkv, Sq, Skv, D, Dv, dtype, mkw = CASES[name]
  q, k, v = _util.random_qkv(sorted(CASES).index(name), B, H, Hkv, Sq, Skv, D, Dv, dtype=dtype)
  cfg = _cfg(Sq, Skv, D, **mkw)
  _compat.reset_interpret_state()
  out, lse = jax.jit(lambda q, k, v: F.forward(cfg, q, k, v))(q, k, v)
  assert not _compat.interpret_races_found()
  assert out.shape == (B, H, Sq, Dv) and out.dtype == dtype
  assert lse.shape == (B, H, Sq) and lse.dtype == jnp.float32
  ref_out, ref_lse = reference.attention(cfg, *_util.as64((q, k, v)), None, None, None, None,
                                         None, ())
  _util.assert_close(out, ref_out, dtype, what=f"{name}/out")
  _util.assert_close(lse, ref_lse, dtype, what=f"{name}/lse")


@pytest.mark.parametrize("name", sorted(CASES))
def test_dq_and_dkdv_match_float64_autodiff_without_races(name):
  """The dQ and dK / dV kernels against float64 autodiff of naive attention (out and lse
  cotangents; GQA: the group's heads summed), fed the reference's out and lse as the forward
  would give them (16-bit out, float32 lse)."""
  B, H, Hkv, Sq, Skv, D, Dv, dtype, mkw = CASES[name]
  seed = 10 + sorted(CASES).index(name)
  q, k, v = _util.random_qkv(seed, B, H, Hkv, Sq, Skv, D, Dv, dtype=dtype)
  do = jax.random.normal(jax.random.key(seed), (B, H, Sq, Dv), jnp.float32).astype(dtype)
  dlse = jax.random.normal(jax.random.key(seed + 1), (B, H, Sq), jnp.float32)
  cfg = _cfg(Sq, Skv, D, **mkw)
  fwd = lambda q, k, v: reference.attention(cfg, q, k, v, None, None, None, None, None, ())
  (out, lse), vjp = jax.vjp(fwd, *_util.as64((q, k, v)))
  # an empty row's lse is -inf: its cotangent reaches nothing (the kernels fold dlse into delta)
  ref = vjp((_util.as64(do), jnp.where(jnp.isfinite(lse), _util.as64(dlse), 0.0)))
  args = (q, k, v, out.astype(dtype), lse.astype(jnp.float32), do, dlse)
  _compat.reset_interpret_state()
  got_dq = jax.jit(lambda *a: Bw.dq(cfg, *a))(*args)
  got_dk, got_dv = jax.jit(lambda *a: Bw.dkdv(cfg, *a))(*args)
  assert not _compat.interpret_races_found()
  for got, want, x, n in ((got_dq, ref[0], q, "dq"), (got_dk, ref[1], k, "dk"),
                          (got_dv, ref[2], v, "dv")):
    assert got.shape == x.shape and got.dtype == dtype, n
    _util.assert_close(got, want, dtype, what=f"{name}/{n}")


def test_what_it_lacks_is_refused_by_name():
  x = jnp.zeros((1, 2, 128, 64), jnp.bfloat16)
  cfg = _cfg(128, 128, 64)
  with pytest.raises(NotImplementedError, match="bias"):
    F.forward(cfg, x, x, x, bias=jnp.zeros((1, 1, 128, 128), jnp.float32))
  with pytest.raises(NotImplementedError, match="segment ids"):
    seg = jnp.zeros((1, 128), jnp.int32)
    F.forward(cfg, x, x, x, q_seg=seg, kv_seg=seg)
  with pytest.raises(NotImplementedError, match="dropout"):
    F.forward(dataclasses.replace(cfg, dropout_rate=0.1), x, x, x)
  with pytest.raises(NotImplementedError, match="head_dim 256"):
    y = jnp.zeros((1, 2, 128, 256), jnp.bfloat16)
    F.forward(_cfg(128, 128, 256), y, y, y)
  with pytest.raises(NotImplementedError, match="k is float32"):
    F.forward(cfg, x, x.astype(jnp.float32), x)
  with pytest.raises(NotImplementedError, match="query heads"):
    F.forward(cfg, x[:, :1].repeat(3, 1), x, x)
  with pytest.raises(NotImplementedError, match="rank 4"):
    F.forward(cfg, x[0], x, x)


_COMPILE = r"""
import sys
import jax, jax.numpy as jnp
from jax.experimental import topologies
from jax.experimental.mosaic.gpu import utils as mgpu_utils
# Mosaic's Python side infers the arch from a local GPU, 9.0 without one (docs/blackwell.md):
# a deviceless B200 compile sets the target's
mgpu_utils._infer_arch = lambda: (10, 0)
from flashvjp._config import AttentionConfig, BlockSizes
from flashvjp.pallas.mosaic_gpu_sm100 import forward as F
D = int(sys.argv[2])
topo = topologies.get_topology_desc(platform="cuda", target_config=open(sys.argv[1]).read(),
                                    topology="1x1x1")
mesh = topologies.make_mesh(topo, (1,), ("d",))
sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
S = 1024
cfg = AttentionConfig(scale=D ** -0.5, causal=True, window=None, seq_q=S, seq_kv=S,
                      dropout_rate=0.0, blocks=BlockSizes())
x = jax.ShapeDtypeStruct((1, 2, S, D), jnp.bfloat16, sharding=sh)
kv = jax.ShapeDtypeStruct((1, 1, S, D), jnp.bfloat16, sharding=sh)
if sys.argv[3] == "fwd":
  jax.jit(lambda q, k, v: F.forward(cfg, q, k, v)).lower(x, kv, kv).compile()
else:
  from flashvjp.pallas.mosaic_gpu_sm100 import backward as Bw
  lse = jax.ShapeDtypeStruct((1, 2, S), jnp.float32, sharding=sh)
  f = getattr(Bw, sys.argv[3])
  jax.jit(lambda q, k, v, o, l, do: f(cfg, q, k, v, o, l, do)).lower(
      x, kv, kv, x, lse, x).compile()
print("COMPILED")
"""


@pytest.mark.parametrize("kind", ["fwd", "dq", "dkdv"])
@pytest.mark.parametrize("D", [64, 128])
def test_compiles_for_sm100a_without_spills(D, kind, tmp_path):
  from tests import _aot
  if not _aot.HAS_CUDA_PLUGIN:
    pytest.skip(f"the deviceless sm_100a compile: {_aot.CUDA_PROBLEM}")
  root = pathlib.Path(__file__).resolve().parent.parent
  target = root / "flashvjp" / "targets" / "b200.txtpb"
  env = dict(os.environ, JAX_PLATFORMS="cpu", MOSAIC_GPU_DUMP_TO=str(tmp_path),
             MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1", PYTHONPATH=str(root))
  proc = subprocess.run([sys.executable, "-c", _COMPILE, str(target), str(D), kind], env=env,
                        cwd=root, capture_output=True, text=True, timeout=600)
  assert "COMPILED" in proc.stdout, proc.stderr[-4000:]
  (ptx,) = tmp_path.glob("*.ptx")
  text = ptx.read_text()
  assert ".target sm_100a" in text
  assert text.count("tcgen05.mma") >= 2 * D // 16, "two products a step on tcgen05"
  (report,) = tmp_path.glob("*.ptxas")
  log = report.read_text()
  spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
  assert spills and not any(spills), log
  regs = int(re.search(r"Used (\d+) registers", log)[1])
  (resources,) = tmp_path.glob("*.resources.txt")
  smem = int(re.search(r"smem_scratch_bytes=(\d+)", resources.read_text())[1])
  assert smem <= 227 * 1024, smem
  print(f"sm_100a {kind} D={D} causal GQA: {regs} registers, 0 spill bytes, {smem} B smem,"
        f" {text.count('tcgen05.mma')} tcgen05.mma in the PTX")
  assert regs <= 255


def _reports_race(run) -> bool:
  """Whether the interpreter's race detection reports `run()` (recorded or raised)."""
  _compat.reset_interpret_state()
  try:
    jax.block_until_ready(run())
    return _compat.interpret_races_found()
  except Exception as e:  # the detector may raise instead of recording
    return "RACE DETECTED" in str(e)
  finally:
    _compat.reset_interpret_state()


def test_dq_kernel_a_removed_tmem_load_wait_is_caught(monkeypatch):
  """Mutation (the dQ kernel): without `wait_load_tmem`, S and dP are overwritten by the next
  step's MMAs while their loads may be in flight: race detection must report it."""
  monkeypatch.setattr(Bw.plgpu, "wait_load_tmem", lambda: None)
  q, k, v = _util.random_qkv(4, 1, 1, 1, 128, 256, 64, dtype=jnp.bfloat16)
  lse = jnp.zeros((1, 1, 128), jnp.float32)
  assert _reports_race(lambda: Bw.dq(_cfg(128, 256, 64), q, k, v, q, lse, q))


def test_dkdv_kernel_a_removed_proxy_fence_is_caught(monkeypatch):
  """Mutation (the dK / dV kernel): without `commit_smem` (the proxy fence), the TMA refill of
  an lse2 / delta slot is not ordered after the grad warpgroup's generic loads of it (nor the
  epilogue's stores before their TMA): race detection must report it."""
  monkeypatch.setattr(Bw.plgpu, "commit_smem", lambda: None)
  q, k, v = _util.random_qkv(5, 1, 2, 1, 256, 128, 64, dtype=jnp.bfloat16)
  lse = jnp.zeros((1, 2, 256), jnp.float32)
  assert _reports_race(lambda: Bw.dkdv(_cfg(256, 128, 64), q, k, v, q, lse, q))


def test_a_removed_tmem_load_wait_is_caught(monkeypatch):
  """Mutation: without `wait_load_tmem`, a TMEM region is overwritten (the S tile by the next
  Q K^T, an O chunk by its rescaled store) while its load may be in flight: the interpreter's
  race detection must report it."""
  monkeypatch.setattr(F.plgpu, "wait_load_tmem", lambda: None)
  q, k, v = _util.random_qkv(3, 1, 1, 1, 128, 256, 64, dtype=jnp.bfloat16)
  assert _reports_race(lambda: F.forward(_cfg(128, 256, 64), q, k, v))
