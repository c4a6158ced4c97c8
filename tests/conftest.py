"""Test configuration: float64 references, strict promotion, one tolerance table.

Set before jax initialises: the CPU fusion flag makes compiled memory analysis
report the buffers of fused dots (otherwise naive attention reads as 0 bytes).
"""
import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_cpu_experimental_ynn_fusion_type" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_cpu_experimental_ynn_fusion_type=individual_dot"
# XLA:CPU compiles without LLVM's optimisations (-O0) for the tests, unless the caller chose
# a level: most of the suite's time is compiling small programs (interpret-mode kernels, the
# references), which this halves (tests/test_max_logits.py: 71 -> 33 s on 2 cores); results
# are within the stated tolerances either way (the same HLO; the tolerance table covers
# codegen differences). It does not reach the deviceless GPU / TPU compiles' kernels: the
# Mosaic-GPU PTX and its ptxas registers / spills / shared memory are byte-identical with it
# (tests/test_pallas_mosaic_gpu.py's compile), and the top-level op counts and buffer sizes
# come from XLA's HLO passes and buffer assignment, which LLVM's level does not change. The
# benchmarks, `flashvjp check` and CI's compile gates (benchmarks/triton_sm90.py) run at the
# default level. FLASHVJP_TEST_XLA_OPT=1 keeps the default here too.
if (os.environ.get("FLASHVJP_TEST_XLA_OPT", "0") != "1"
    and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]):
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
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
# One persistent compilation cache for the run, shared by its xdist workers (they trace many
# of the same small programs: the eager ops of the same shapes, the same reference
# functions): 9% off tests/test_blockwise.py's wall time on 2 cores. Removed when the run
# ends. Tests that count compiles count its hits too (an executable loaded from it is one
# the program needed). FLASHVJP_TEST_COMPILATION_CACHE=0 turns it off.
_CACHE_DIR = None
if os.environ.get("FLASHVJP_TEST_COMPILATION_CACHE", "1") != "0":
  import tempfile
  # chosen by the controller (its pid); the workers it starts inherit the variable
  _CACHE_DIR = os.environ.setdefault("FLASHVJP_TEST_CACHE_DIR", os.path.join(
      tempfile.gettempdir(), f"flashvjp-test-jax-cache-{os.getpid()}"))
  jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_sessionfinish(session, exitstatus):
  """The controller (or a run without workers) removes the run's cache."""
  del exitstatus
  if _CACHE_DIR is not None and not hasattr(session.config, "workerinput"):
    import shutil
    shutil.rmtree(_CACHE_DIR, ignore_errors=True)
