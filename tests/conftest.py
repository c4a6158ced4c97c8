"""Test configuration: float64 references, strict promotion, one tolerance table.

Set before jax initialises: the CPU fusion flag makes compiled memory analysis
report the buffers of fused dots (otherwise naive attention reads as 0 bytes).
"""
import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_cpu_experimental_ynn_fusion_type" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_cpu_experimental_ynn_fusion_type=individual_dot"
# Eight virtual CPU devices for the sharding and ring tests (tests/test_distributed.py).
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

# The CUDA plugin and libtpu (the deviceless compilers of tests/test_aot.py) are installed
# with the test extra: jax must not try to start a GPU or TPU here, and the xdist workers
# may each load libtpu (its lockfile otherwise lets one process in).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# The Mosaic-GPU interpreter runs each warpgroup of a CTA as a program on XLA's CPU client
# pool, which XLA sizes from NPROC (else the CPU count): on a 2-core machine a 3-warpgroup
# kernel can deadlock at a barrier (mosaic_gpu._compat.interpret_threads_problem).
os.environ.setdefault("NPROC", "8")

import jax

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")
