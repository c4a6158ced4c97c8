"""The Blackwell (sm_100a) forward prototype (flashvjp/pallas/mosaic_gpu_sm100, issue 46).

In the GPU interpreter with race detection (a race raises), against float64 naive attention at
the bf16 tolerance: head dims 64 and 128, one and several kv steps past the 2-slot ring.
Deviceless for sm_100a (the CUDA plugin, the B200 target config): tcgen05 MMAs in the PTX, no
register spill, SMEM within a Blackwell block's 227 KiB. Needs jax >= 0.12 (tcgen05, TMEM).
"""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import _util

plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
if not hasattr(plgpu, "tcgen05_mma") or not hasattr(plgpu.Layout, "TCGEN05_TMEM_NATIVE"):
  pytest.skip(f"jax {jax.__version__} has no tcgen05 / TMEM API (the family needs jax >= 0.12)",
              allow_module_level=True)

from flashvjp.pallas.mosaic_gpu_sm100 import forward as F  # noqa: E402


def _reference(q, k, v):
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  s = q @ k.T * q.shape[1] ** -0.5
  m = s.max(axis=1, keepdims=True)
  e = np.exp(s - m)
  l = e.sum(axis=1, keepdims=True)
  return (e / l) @ v, (m + np.log(l))[:, 0]


@pytest.mark.parametrize("Sq,Skv,D", [(256, 256, 64), (128, 512, 64), (256, 256, 128)])
def test_forward_matches_float64_naive_without_races(Sq, Skv, D):
  kq, kk, kv = jax.random.split(jax.random.key(Sq + Skv + D), 3)
  q = jax.random.normal(kq, (Sq, D), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(kk, (Skv, D), jnp.float32).astype(jnp.bfloat16)
  v = jax.random.normal(kv, (Skv, D), jnp.float32).astype(jnp.bfloat16)
  out, lse = jax.jit(lambda q, k, v: F.forward(q, k, v, interpret=True))(q, k, v)
  ref_out, ref_lse = _reference(q, k, v)
  assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
  _util.assert_close((out, lse), (ref_out, ref_lse), jnp.bfloat16,
                     what=f"sm100 forward Sq={Sq} Skv={Skv} D={D}")


def test_bad_inputs_are_named():
  x = jnp.zeros((128, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="q's sequence length"):
    F.check_inputs(jnp.zeros((100, 64), jnp.bfloat16), x, x)
  with pytest.raises(ValueError, match="head dims"):
    F.check_inputs(jnp.zeros((128, 96), jnp.bfloat16), x, x)
  with pytest.raises(TypeError, match="k must be bfloat16 or float16"):
    F.check_inputs(x, x.astype(jnp.float32), x)
  with pytest.raises(ValueError, match="one batch and head"):
    F.check_inputs(x[None], x, x)


_COMPILE = r"""
import sys
import jax, jax.numpy as jnp
from jax.experimental import topologies
from jax.experimental.mosaic.gpu import utils as mgpu_utils
# Mosaic's Python side infers the arch from a local GPU, 9.0 without one (docs/blackwell.md):
# a deviceless B200 compile sets the target's
mgpu_utils._infer_arch = lambda: (10, 0)
from flashvjp.pallas.mosaic_gpu_sm100 import forward as F
D = int(sys.argv[2])
topo = topologies.get_topology_desc(platform="cuda", target_config=open(sys.argv[1]).read(),
                                    topology="1x1x1")
mesh = topologies.make_mesh(topo, (1,), ("d",))
sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
x = jax.ShapeDtypeStruct((1024, D), jnp.bfloat16, sharding=sh)
jax.jit(lambda q, k, v: F.forward(q, k, v)).lower(x, x, x).compile()
print("COMPILED")
"""


@pytest.mark.parametrize("D", [64, 128])
def test_compiles_for_sm100a_without_spills(D, tmp_path):
  from tests import _aot
  if not _aot.HAS_CUDA_PLUGIN:
    pytest.skip(f"the deviceless sm_100a compile: {_aot.CUDA_PROBLEM}")
  root = pathlib.Path(__file__).resolve().parent.parent
  target = root / "flashvjp" / "targets" / "b200.txtpb"
  env = dict(os.environ, JAX_PLATFORMS="cpu", MOSAIC_GPU_DUMP_TO=str(tmp_path),
             MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1", PYTHONPATH=str(root))
  proc = subprocess.run([sys.executable, "-c", _COMPILE, str(target), str(D)], env=env,
                        cwd=root, capture_output=True, text=True, timeout=600)
  assert "COMPILED" in proc.stdout, proc.stderr[-4000:]
  (ptx,) = tmp_path.glob("*.ptx")
  text = ptx.read_text()
  assert ".target sm_100a" in text
  assert text.count("tcgen05.mma") >= 2 * D // 16, "Q K^T and P V on tcgen05"
  (report,) = tmp_path.glob("*.ptxas")
  log = report.read_text()
  spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
  assert spills and not any(spills), log
  regs = int(re.search(r"Used (\d+) registers", log)[1])
  (resources,) = tmp_path.glob("*.resources.txt")
  smem = int(re.search(r"smem_scratch_bytes=(\d+)", resources.read_text())[1])
  assert smem <= 227 * 1024, smem
  print(f"sm_100a forward prototype D={D}: {regs} registers, 0 spill bytes, {smem} B smem,"
        f" {text.count('tcgen05.mma')} tcgen05.mma in the PTX")
  assert regs <= 255


def test_a_removed_tmem_load_wait_is_caught(monkeypatch):
  """Mutation: without `wait_load_tmem`, a TMEM region is overwritten (the S tile by the next
  Q K^T, an O chunk by its rescaled store) while its load may be in flight: the interpreter's
  race detection must raise."""
  monkeypatch.setattr(F.plgpu, "wait_load_tmem", lambda: None)
  x = jax.random.normal(jax.random.key(3), (128, 64), jnp.float32).astype(jnp.bfloat16)
  with pytest.raises(Exception, match="RACE DETECTED"):
    jax.block_until_ready(F.forward(x, jnp.tile(x, (2, 1)), jnp.tile(x, (2, 1)),
                                    interpret=True))
