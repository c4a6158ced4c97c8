"""flashvjp.plan / `python -m flashvjp plan`: a layer compiled for a GPU / TPU target on a CPU.

The compiles need the target's compiler (the CUDA plugin, libtpu): those tests skip, saying
so, where it is not installed (pip install 'flashvjp[aot-gpu,aot-tpu]'). The HLO reading and
the argument checks run everywhere. About a minute on a 2-core CPU.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

import flashvjp
from flashvjp import _plan
from flashvjp import cli
from tests import _aot

# the compile tests' one reading of the installed compilers (tests/_aot.py)
CUDA_PROBLEM, HAS_CUDA, needs_cuda = _aot.CUDA_PROBLEM, _aot.HAS_CUDA_PLUGIN, _aot.needs_cuda
HAS_TPU, needs_tpu = _aot.HAS_LIBTPU, _aot.needs_tpu

# The layer of the GPU tests: causal GQA, small enough to compile in seconds on a CPU.
SMALL = dict(batch=1, num_heads=8, num_kv_heads=2, seq_len=8192, head_dim=64, causal=True)


@pytest.fixture(scope="module")
def h100x8():
  if not HAS_CUDA:
    pytest.skip(str(CUDA_PROBLEM))
  try:
    return flashvjp.plan("h100x8", **SMALL)
  except RuntimeError as e:
    if "JAX_PLATFORMS=cpu" in str(e):  # another test started jax's backends on this host
      pytest.skip(str(e))
    raise


def test_unknown_target_names_the_argument_and_the_targets():
  with pytest.raises(ValueError, match="target") as info:
    flashvjp.plan("h900", **SMALL)
  for name in ("h100", "h100x8", "h200", "b200", "v5e", "v6e"):
    assert name in str(info.value)


def test_bad_arguments():
  with pytest.raises(ValueError, match="modes"):
    flashvjp.plan("h100", modes=("grad",))
  with pytest.raises(ValueError, match="mesh"):
    flashvjp.plan("h100x8", mesh={"sp": 4})
  with pytest.raises(ValueError, match="'tp'"):
    flashvjp.plan("h100x8", spec=(None, "tp", "sp", None))


def test_missing_compiler_names_the_extra(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda n, *a: None if n.startswith(("jax_plugins", "libtpu")) else real(n))
  with pytest.raises(RuntimeError, match=r"flashvjp\[aot-gpu\]"):
    flashvjp.plan("h100", **SMALL)
  with pytest.raises(RuntimeError, match=r"flashvjp\[aot-tpu\]"):
    flashvjp.plan("v5e", **SMALL)


def test_plugin_at_another_jaxlib_version_is_named(monkeypatch):
  """jax reaches the index before its CUDA plugin: a newer jaxlib beside the older plugin
  (jaxlib refuses to load it) is an error naming both versions and the fix, not a Triton
  parse failure deep in the compile."""
  versions = {"jaxlib": "0.12.1", "jax-cuda12-plugin": "0.12.0.1", "jax-cuda12-pjrt": "0.12.0.1"}
  monkeypatch.setattr(_plan, "_version", versions.get)
  monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object())
  problem = _plan.compiler_problem("gpu")
  assert problem is not None and "0.12.1" in problem and "0.12.0.1" in problem
  assert "pip install 'jax==0.12.0.1' 'jaxlib==0.12.0.1'" in problem
  with pytest.raises(RuntimeError, match=r"jax-cuda12-plugin 0\.12\.0\.1 is installed but jaxlib"):
    flashvjp.plan("h100", **SMALL)
  versions["jaxlib"] = "0.12.0.1"  # the same release (jaxlib's check: the numeric prefix)
  assert _plan.compiler_problem("gpu") is None
  versions["jax-cuda12-pjrt"] = "0.11.2"
  assert "jax-cuda12-pjrt 0.11.2" in _plan.compiler_problem("gpu")


def test_target_configs_ship_with_the_package():
  for name, (platform, what, _, _) in _plan.TARGETS.items():
    if platform == "gpu":
      text = (_plan._TARGET_DIR / what).read_text()
      assert "gpu_device_info" in text and "cuda_compute_capability" in text, name
  h200 = _plan._resolve_target("h200", None)
  assert h200[4] == 143771 * 2**20  # 141 GB, what nvidia-smi reports of an H200
  assert "major: 9" in h200[2]  # the H100's sm_90a


HLO = """\
HloModule m

%body (p: (s32[], bf16[2,1024,64])) -> (s32[], bf16[2,1024,64]) {
  %p = (s32[], bf16[2,1024,64]{2,1,0}) parameter(0)
  %cp-start = (bf16[2,1024,64]{2,1,0}, bf16[2,1024,64]{2,1,0}, u32[], u32[]) collective-permute-start(%x), channel_id=1
  %cp-done = bf16[2,1024,64]{2,1,0} collective-permute-done(%cp-start)
  ROOT %t = (s32[], bf16[2,1024,64]{2,1,0}) tuple(%i, %cp-done)
}

%cond (p: (s32[], bf16[2,1024,64])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: bf16[2,1024,64]) -> bf16[2,8192,64] {
  %a = bf16[2,1024,64]{2,1,0} parameter(0)
  %w = (s32[], bf16[2,1024,64]{2,1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"}}
  %ag-start = ((bf16[2,1024,64]{2,1,0}), (bf16[2,8192,64]{2,1,0})) all-gather-start(%a), dimensions={1}
  %ag-done = bf16[2,8192,64]{2,1,0} all-gather-done(%ag-start)
  %ar = f32[] all-reduce(%s), to_apply=%add
  ROOT %k = bf16[2,8192,64]{2,1,0} custom-call(%ag-done), custom_call_target="__gpu$xla.gpu.triton"
}
"""


def test_collectives_are_read_from_the_compiled_hlo():
  got = {c.op: c for c in _plan.collectives(HLO, seq_len=8192, seq_sharded=True)}
  assert set(got) == {"collective-permute", "all-gather", "all-reduce"}
  cp = got["collective-permute"]
  assert (cp.count, cp.bytes, cp.shapes) == (7, 2 * 1024 * 64 * 2, ("bf16[2,1024,64]",))
  assert cp.total_bytes == 7 * cp.bytes and not cp.whole_sequence  # the loop's trip count
  ag = got["all-gather"]
  assert ag.count == 1 and ag.bytes == 2 * 8192 * 64 * 2 and ag.whole_sequence
  assert got["all-reduce"].bytes == 4
  assert [k[:2] for k in _plan._kernel_calls(HLO, "gpu")] == [("k", "triton")]
  assert not _plan.collectives(HLO, seq_len=8192, seq_sharded=False)[1].whole_sequence


def test_ptxas_report_is_parsed():
  log = """I1204 subprocess_compilation.cc:356] ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'flashvjp_fwd' for 'sm_90a'
ptxas info    : Function properties for flashvjp_fwd
    8 bytes stack frame, 16 bytes spill stores, 24 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 32 bytes smem
"""
  assert _plan.ptxas_report(log) == {"flashvjp_fwd": (255, 8, 16, 24)}


@needs_cuda
def test_h100x8_reports_memory_strategy_and_collectives(h100x8):
  assert h100x8.num_devices == 8 and h100x8.device_kind == "NVIDIA H100 80GB HBM3"
  m = h100x8.mode("value_and_grad")
  assert m.argument_bytes > 0 and m.output_bytes > 0 and m.temp_bytes > 0
  # per device: q + k + v of one eighth of the sequence (bf16)
  assert m.argument_bytes == (8 + 2 + 2) * (8192 // 8) * 64 * 2
  assert m.decision.context_parallel is not None  # the sequence is sharded: a strategy
  assert m.collectives and all(c.bytes > 0 for c in m.collectives)
  assert h100x8.mode("jvp").compile_seconds > 0
  text = str(h100x8)
  for part in ("h100x8", "[value_and_grad]", "[jvp]", "memory per device", "decision:",
               "collectives per device"):
    assert part in text


@needs_cuda
def test_h100x8_compiles_the_kernels_and_no_whole_sequence_gather(h100x8):
  for m in h100x8.modes:
    assert m.decision.implementation == "pallas_triton" and not m.decision.interpret
    assert m.kernels and all(k.kind == "triton" for k in m.kernels)
    assert all(k.shared_memory and k.grid for k in m.kernels)
    assert not any(c.whole_sequence for c in m.collectives), m.collectives
    assert m.decision.context_parallel.name in ("ring", "ulysses")


@needs_tpu
def test_v5e_single_chip():
  p = flashvjp.plan("v5e", **SMALL)
  assert p.platform == "tpu" and p.num_devices == 1 and "v5" in p.device_kind
  assert p.hbm_bytes == 16 * 2**30
  for m in p.modes:
    assert m.argument_bytes > 0 and m.total_bytes > 0
    assert not m.collectives
  assert "[jvp]" in str(p)


@needs_tpu
def test_v5e_compiles_the_mosaic_kernels():
  p = flashvjp.plan("v5e", **SMALL, modes=("value_and_grad",))
  m = p.mode("value_and_grad")
  assert m.decision.implementation == "pallas_tpu" and not m.decision.interpret
  assert m.kernels and all(k.kind == "tpu_custom_call" for k in m.kernels)


@needs_tpu
def test_multichip_tpu_is_a_clear_error_or_a_plan():
  # libtpu cannot compile a custom_partitioning op deviceless on several chips: the plan
  # says so instead of a stack trace (or plans, when the op does not partition).
  try:
    p = flashvjp.plan("v5ex4", **SMALL, modes=("jvp",))
  except RuntimeError as e:
    assert "deviceless" in str(e) and "v5e" in str(e)
  else:
    assert p.num_devices == 4


def _cli(*argv):
  env = dict(os.environ)
  for k in ("JAX_PLATFORMS", "TF_CPP_MIN_LOG_LEVEL", "TF_CPP_VMODULE"):
    env.pop(k, None)
  return subprocess.run([sys.executable, "-m", "flashvjp", "plan", *argv], capture_output=True,
                        text=True, timeout=300, env=env)


def test_cli_help_and_bad_target(capsys):
  with pytest.raises(SystemExit) as info:
    cli.main(["plan", "--help"])
  assert info.value.code == 0
  out = capsys.readouterr().out
  assert "usage: python -m flashvjp plan" in out and "aot-gpu" in out and "--seq-len" in out
  with pytest.raises(SystemExit) as info:
    cli.main(["plan", "--target", "h900"])
  assert info.value.code == 2
  err = capsys.readouterr().err
  assert "unknown target 'h900'" in err and "h100x8" in err


@needs_cuda
def test_cli_prints_the_report():
  res = _cli("--target", "h100", "--num-heads", "4", "--num-kv-heads", "2", "--seq-len", "2048",
             "--head-dim", "64", "--causal")
  assert res.returncode == 0, res.stderr[-3000:]
  out = res.stdout
  assert "plan: h100 (1 x NVIDIA H100 80GB HBM3" in out and "memory per device" in out
  assert "[value_and_grad]" in out and "[jvp]" in out
  assert "ptxas info" not in out + res.stderr  # the compiler's report is read, not echoed


@needs_cuda
def test_cli_reports_registers_and_spills():
  res = _cli("--target", "h100", "--num-heads", "4", "--num-kv-heads", "2", "--seq-len", "2048",
             "--head-dim", "64", "--causal", "--modes", "value_and_grad")
  assert res.returncode == 0, res.stderr[-3000:]
  assert re.search(r"flashvjp_fwd .*smem \d+ KiB, \d+ registers, spills \d+ B stored", res.stdout)
  assert "not reported" not in res.stdout


def test_deviceless_tpu_limit_is_a_clear_error():
  e = _plan._compile_error(
      RuntimeError("INTERNAL: Custom emitter for CustomSPMDPartitioning not found"), "tpu",
      "v5ex4", 4)
  assert isinstance(e, RuntimeError)
  assert "deviceless" in str(e) and "'v5e'" in str(e) and "TPU host" in str(e)


def test_cli_mesh_and_spec_arguments():
  assert _plan._mesh_arg("dp=2,sp=4") == {"dp": 2, "sp": 4}
  assert _plan._spec_arg("dp,None,sp+tp,-") == ("dp", None, ("sp", "tp"), None)
  for bad in ("sp", "sp=x"):
    with pytest.raises(Exception, match="NAME=SIZE"):
      _plan._mesh_arg(bad)
  with pytest.raises(Exception, match="4 comma-separated"):
    _plan._spec_arg("None,sp")


@needs_cuda
def test_cli_ring_head_groups():
  args = ("--target", "h100x8", "--num-heads", "8", "--num-kv-heads", "2", "--seq-len", "8192",
          "--head-dim", "64", "--causal", "--context-parallel", "ring", "--modes",
          "value_and_grad")
  res = _cli(*args, "--ring-head-groups", "2")
  assert res.returncode == 0, res.stderr[-3000:]
  assert "ring_head_groups=2" in res.stdout and "in 2 head groups" in res.stdout
  # the K/V chunks that move are one group's: [1, 1, 1024, 64] (one kv head of 2)
  assert re.search(r"collective-permute\s+x\d+\s+bf16\[1,1,1024,64\]", res.stdout), res.stdout
  bad = _cli(*args, "--ring-head-groups", "3")
  assert bad.returncode == 2 and "ring_head_groups=3 must divide" in bad.stderr, bad.stderr[-2000:]


@needs_cuda
def test_h100x32_four_nodes_picks_the_hierarchical_split():
  """4 nodes x 8 H100 (the topology's processes are the nodes): "auto" picks usp (Ulysses
  over the GPUs of a node, the ring over the nodes); in the compiled HLO the busiest
  device sends >= 8x fewer bytes across nodes than the ring over all 32, with no more
  memory per device."""
  layer = dict(batch=1, num_heads=32, num_kv_heads=8, seq_len=16384, head_dim=64,
               causal=True, modes=("value_and_grad",))
  auto = flashvjp.plan("h100x32", **layer)
  ring = flashvjp.plan("h100x8", nodes=4, context_parallel="ring", **layer)
  assert auto.nodes == ring.nodes == 4 and auto.num_devices == ring.num_devices == 32
  assert auto.mesh == {"node": 4, "gpu": 8} and auto.spec[2] == ("node", "gpu")
  a, r = auto.mode("value_and_grad"), ring.mode("value_and_grad")
  st = a.decision.context_parallel
  assert st.name == "usp" and st.ulysses_axes == ("gpu",) and st.ring_axes == ("node",), st
  across = lambda m: dict(m.links)["across_nodes"]
  assert across(r) >= 8 * across(a), (a.links, r.links)
  assert a.total_bytes <= r.total_bytes, (a.total_bytes, r.total_bytes)
  text = str(auto)
  assert "in 4 nodes of 8" in text and "per link class (compiled HLO" in text
  assert "Ulysses over ('gpu',), the ring over ('node',)" in text
