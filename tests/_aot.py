"""Deviceless targets for the ahead-of-time compile tests (tests/test_aot.py).

A `jax.experimental.topologies` mesh of GPUs (XLA's GPU compiler from the CUDA plugin, with
the target configs shipped in flashvjp/targets) or TPU chips (libtpu), built on this CPU
host. Tests that need a compiler skip, naming the pip package, where it is not installed;
CI installs both (.ci/run).
"""
from __future__ import annotations

import functools
import importlib.resources
import os
import re

import jax
import pytest
from jax.experimental import topologies
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flashvjp import _plan

# Why this environment cannot compile deviceless for GPU / TPU (None: it can). The CUDA plugin
# counts only at jaxlib's exact version (jax ignores another), so a newer jax beside an older
# plugin skips the GPU compiles, saying so, instead of failing them.
CUDA_PROBLEM = _plan.compiler_problem("gpu")
TPU_PROBLEM = _plan.compiler_problem("tpu")
HAS_CUDA_PLUGIN = CUDA_PROBLEM is None
HAS_LIBTPU = TPU_PROBLEM is None

needs_cuda = pytest.mark.skipif(not HAS_CUDA_PLUGIN, reason=f"needs XLA's GPU compiler: {CUDA_PROBLEM}")
needs_tpu = pytest.mark.skipif(not HAS_LIBTPU, reason=f"needs the TPU compiler: {TPU_PROBLEM}")

GPU_CONFIGS = {"h100": "h100_sxm.txtpb", "b200": "b200.txtpb"}
TPU_NAMES = {"v5e": "v5e", "v6e": "v6e"}

# Custom calls of the compiled kernels in a compiled program's HLO.
TRITON_CALL = "__gpu$xla.gpu.triton"
TPU_CALL = "tpu_custom_call"


@functools.cache
def gpu_mesh(name: str, n: int = 1, axis: str = "sp"):
  text = (importlib.resources.files("flashvjp") / "targets" / GPU_CONFIGS[name]).read_text()
  topo = topologies.get_topology_desc(platform="cuda", target_config=text,
                                      topology=f"1x{n}x1")
  return topologies.make_mesh(topo, (n,), (axis,))


@functools.cache
def tpu_mesh(name: str, shape: str = "1x1", axis: str = "sp"):
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # xdist workers share libtpu
  topo = topologies.get_topology_desc(topology_name=f"{TPU_NAMES[name]}:{shape}",
                                      platform="tpu")
  return topologies.make_mesh(topo, (len(topo.devices),), (axis,))


REPLICATED = P()


def sds(mesh, shape, dtype, spec=REPLICATED):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def count(hlo: str, op: str) -> int:
  """Instructions of `op` (sync or async start) in compiled HLO text."""
  return len(re.findall(rf"\s{re.escape(op)}(?:-start)?\(", hlo))


def collective_results(hlo: str, op: str) -> list[str]:
  """The result types of every `op` instruction (e.g. 'bf16[1,16,65536,128]')."""
  pat = rf"=\s*\(*([a-z0-9]+\[[0-9,]*\])[^=]*?\s{re.escape(op)}(?:-start)?\("
  return re.findall(pat, hlo)


def interpret_loops(hlo: str) -> list[str]:
  """While loops traced from one of our kernels (op_name '.../flashvjp_fwd/while'): what a
  Pallas kernel in interpret mode (or run as a loop) leaves; a compiled one is a custom call.
  The blockwise passes' loops count too (named scopes '.../flashvjp_blockwise_fwd/...'): a
  program meant to run compiled kernels has none. XLA's own loops (a scatter-add, a
  mask_mod's classification) are not counted."""
  ops = re.findall(r"\swhile\([^\n]*?op_name=\"([^\"]*)\"", hlo)
  return [o for o in ops if re.search(r"/flashvjp_\w+/", o)]
