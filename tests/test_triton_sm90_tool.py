"""The compile check's parsing (benchmarks/triton_sm90.py), on recorded compiler output.

Needs neither triton nor a GPU: the strings below are excerpts of what pip triton 3.6.0 and its
ptxas printed for flashvjp's kernels. One end-to-end test compiles a real kernel and is skipped
where pip triton is not installed (the jax 0.11.2 + triton 3.6.0 environment runs it).
"""
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "triton_sm90", os.path.join(ROOT, "benchmarks", "triton_sm90.py"))
T = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("triton_sm90", T)  # dataclasses look their module up
_spec.loader.exec_module(T)

PTXAS_SPILL = """\
ptxas info    : 11 bytes gmem
ptxas info    : Compiling entry function 'flashvjp_bwd_dkdv' for 'sm_90a'
ptxas info    : Function properties for flashvjp_bwd_dkdv
    2992 bytes stack frame, 6948 bytes spill stores, 6804 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 2992 bytes cumulative stack size
ptxas info    : Compile time = 9904.572 ms
"""

PTXAS_CLEAN = """\
ptxas info    : Compiling entry function 'flashvjp_fwd' for 'sm_90a'
ptxas info    : Function properties for flashvjp_fwd
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 176 registers, used 1 barriers, 1024 bytes smem
"""

# TTGIR: a wgmma dot (v3 encoding), an mma.sync dot (v2), an FMA dot (blocked), an f32 tf32 dot;
# one pipelined loop (async copy inside) and one loop loading without async copies. The loop's
# first line holds braces of its own (#ttg.slice<{...}>) before the region's.
TTGIR = """\
#blocked1 = #ttg.blocked<{sizePerThread = [1, 4], threadsPerWarp = [4, 8], warpsPerCTA = [4, 1], order = [1, 0]}>
#mma = #ttg.nvidia_mma<{versionMajor = 2, versionMinor = 0, warpsPerCTA = [1, 8], instrShape = [16, 8]}>
#mma1 = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [8, 1], instrShape = [16, 64, 16]}>
module {
  tt.func public @k() {
    %94:2 = scf.for %arg5 = %44 to %61 step %c1_i32 iter_args(%arg6 = %cst, %arg7 = %t) -> (tensor<128xf32, #ttg.slice<{dim = 1, parent = #mma1}>>, !ttg.async.token)  : i32 {
      %88 = ttg.async_copy_global_to_local %85, %86 mask %87 {contiguity = 8 : i32} : tensor<64x128x!tt.ptr<bf16>, #blocked> -> <64x128xbf16, #shared, #smem, mutable> loc(#loc71)
      %172 = ttng.warp_group_dot %24, %171, %cst_5 {inputPrecision = 0 : i32, isAsync = true} : !ttg.memdesc<128x128xbf16, #shared, #smem> * !ttg.memdesc<128x64xbf16, #shared1, #smem, mutable> -> tensor<128x64xf32, #mma1> loc(#loc82)
      %204 = ttng.warp_group_dot %203, %197, %201 {inputPrecision = 0 : i32, isAsync = true} : tensor<128x64xf32, #ttg.dot_op<{opIdx = 0, parent = #mma1, kWidth = 1}>> * !ttg.memdesc<64x128xf32, #shared, #smem, mutable> -> tensor<128x128xf32, #mma1> loc(#loc119)
      scf.yield %185, %207 : tensor<128xf32, #ttg.slice<{dim = 1, parent = #mma1}>>, !ttg.async.token loc(#loc73)
    } loc(#loc70)
    %95 = scf.for %arg5 = %c0 to %n step %c1_i32 iter_args(%arg6 = %cst) -> (tensor<32x64xf32, #mma>)  : i32 {
      %x = scf.if %c -> (tensor<64x256xf16, #blocked1>) {
        %l = tt.load %p : tensor<64x256x!tt.ptr<f16>, #blocked1> loc(#loc5)
        scf.yield %l : tensor<64x256xf16, #blocked1> loc(#loc5)
      } else {
        scf.yield %z : tensor<64x256xf16, #blocked1> loc(#loc5)
      } loc(#loc5)
      %89 = tt.dot %88, %84, %cst_4, inputPrecision = tf32 : tensor<32x256xf16, #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 2}>> * tensor<256x64xf16, #ttg.dot_op<{opIdx = 1, parent = #mma, kWidth = 2}>> -> tensor<32x64xf32, #mma> loc(#loc55)
      %207 = tt.dot %199, %206, %cst_4 : tensor<64x64xf32, #ttg.dot_op<{opIdx = 0, parent = #blocked1}>> * tensor<64x64xf32, #ttg.dot_op<{opIdx = 1, parent = #blocked1}>> -> tensor<64x64xf32, #blocked1> loc(#loc96)
      scf.yield %89 : tensor<32x64xf32, #mma> loc(#loc6)
    } loc(#loc7)
    tt.return
  }
}
"""

TTIR = """\
      %262 = tt.dot %78, %260, %261, inputPrecision = tf32 : tensor<128x128xf32> * tensor<128x64xf32> -> tensor<128x64xf32> loc(#loc1)
      %263 = tt.dot %78, %260, %261 : tensor<64x32xf32> * tensor<32x16xf32> -> tensor<64x16xf32> loc(#loc2)
      %344 = tt.dot %342, %338, %343, inputPrecision = tf32 : tensor<128x64xbf16> * tensor<64x128xbf16> -> tensor<128x128xf32>
"""

PTX = """\
	wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 {%f1}, %rd1, %rd2, p, 1, 1;
	mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1}, {%r1}, {%r2}, {%f2};
	cp.async.cg.shared.global [ %r3 + 0 ], [ %rd4 + 0 ], 0x10, %r5;
	st.local.u32 [%rd9], %r1;
"""


def test_ptxas_spills_registers_stack():
  f = T.ptxas_facts(PTXAS_SPILL)
  assert (f["regs"], f["stack"], f["spill_st"], f["spill_ld"]) == (255, 2992, 6948, 6804)
  assert f["barriers"] == 1 and f["static_smem"] == 0
  g = T.ptxas_facts(PTXAS_CLEAN)
  assert (g["regs"], g["spill_st"], g["spill_ld"], g["static_smem"]) == (176, 0, 0, 1024)


def test_ttgir_dots_mma_kind_and_precision():
  dots = T.ttgir_dots(TTGIR)
  got = [(d["M"], d["N"], d["K"], d["operand"], d["kind"], d["precision"]) for d in dots]
  assert got == [
      (128, 64, 128, "bf16", "wgmma", None),
      (128, 128, 64, "f32", "wgmma", "tf32"),  # enum 0 of warp_group_dot's inputPrecision
      (32, 64, 256, "f16", "mma.sync", None),
      (64, 64, 64, "f32", "fma", "ieee"),  # the printer elides the ieee default
  ]


def test_ttir_dots_precision():
  got = [(d["M"], d["N"], d["K"], d["operand"], d["precision"]) for d in T.ttir_dots(TTIR)]
  assert got == [(128, 64, 128, "f32", "tf32"), (64, 16, 32, "f32", "ieee"),
                 (128, 128, 64, "bf16", None)]


def test_loops_pipelined_or_not():
  loops = T.ttgir_loops(TTGIR)
  assert [(l["async_copies"], l["global_loads"]) for l in loops] == [(1, 0), (0, 1)]


def test_ptx_counts():
  f = T.ptx_facts(PTX)
  assert (f["ptx_wgmma"], f["ptx_mma_sync"], f["ptx_cp_async"], f["ptx_tf32"],
          f["ptx_local"]) == (1, 1, 1, 1, 1)


def _kernel(**result):
  return dict(result=dict(ok=True, **result))


def test_findings_fail_on_each_rule_and_pass_clean():
  facts = T.ttgir_facts(TTGIR)
  assert facts["tf32_dots"] == 1 and facts["cp_async"] == 1 and facts["dot_ops"] == 4
  clean = dict(spill_st=0, spill_ld=0, shared=100 * 1024, loops=[], dots=[])
  assert T.findings(_kernel(**clean)) == []
  assert T.findings(dict(result=dict(ok=False, stage="ptxas"))) == ["compile failed at ptxas"]
  assert T.findings(_kernel(**{**clean, "spill_ld": 4}))[0].startswith("spills")
  assert T.findings(_kernel(**{**clean, "shared": T.SMEM_LIMIT + 1}))[0].startswith("smem")
  # the TTGIR above: one loop loads without async copies; the 64-row f32 ieee FMA dot and the
  # 32-row mma.sync dot are allowed (no wgmma for ieee f32; wgmma needs 64 rows).
  assert T.findings(_kernel(**{**clean, **facts})) == ["1 loop(s) load without async copies"]
  bad_dot = dict(M=64, N=64, K=64, operand="bf16", kind="mma.sync", precision=None, count=2)
  assert T.findings(_kernel(**{**clean, "dots": [bad_dot]})) == [
      "2 dot(s) of >= 64 rows without wgmma"]


def test_render_and_summary():
  k = dict(index=0, key="abc", name="flashvjp_fwd", num_warps=4, num_stages=2, grid=[1, 2, 3],
           result=dict(ok=True, regs=255, spill_st=8, spill_ld=8, stack=8, shared=2048,
                       num_warps_final=4, loops=[], dots=[], cp_async=0, tma=0, tf32_dots=0))
  data = dict(date="d", versions={}, cases=[dict(case="c1", kernels=[k]),
                                            dict(case="c2", error="ValueError: no")])
  data["summary"] = T.summarize(data, 1.0, 2)
  s = data["summary"]
  assert (s["kernels"], s["failing_kernels"], s["spilling"], s["case_failures"]) == (1, 1, 1, 1)
  assert [T.exit_status(data, m) for m in ("all", "compile", "none")] == [1, 1, 0]
  data["cases"].pop()  # no export failure: spills fail "all" only
  data["summary"] = T.summarize(data, 1.0, 2)
  assert [T.exit_status(data, m) for m in ("all", "compile", "none")] == [1, 0, 0]
  data["cases"].append(dict(case="c2", error="ValueError: no"))
  data["summary"] = T.summarize(data, 1.0, 2)
  data.update(fail_on="none", exit_status=0)
  md = T.render_md(data)
  assert "| c1 | 0 | flashvjp_fwd | 4/2 | 1x2x3 | ok | 255 | 8/8 |" in md
  assert "**spills 8/8 B**" in md and "| c2 | | (export) |" in md
  assert "exit status 0 (--fail-on none; --fail-on all would exit 1)" in md
  # JAX's mha rows are reported, never gated
  data["cases"] = [dict(case="jax_mha_x", baseline="jax_mha", kernels=[k])]
  data["summary"] = T.summarize(data, 1.0, 2)
  assert (data["summary"]["failing_kernels"], data["summary"]["baseline_failing"]) == (0, 1)
  assert T.exit_status(data, "all") == 0
  assert "spills 8/8 B; stack 8 B; regs at 255 cap (baseline, not gated)" in T.render_md(data)


def test_compare_before_after():
  def data(regs, spill, case="c1"):
    k = dict(index=0, key="k", name="flashvjp_bwd_dkdv", num_warps=8, num_stages=2, grid=[1, 1, 1],
             result=dict(ok=True, regs=regs, spill_st=spill, spill_ld=spill, stack=0,
                         shared=1024, num_warps_final=8, loops=[], cp_async=2, tma=0,
                         tf32_dots=0, dots=[dict(M=64, N=64, K=64, operand="bf16",
                                                 kind="wgmma", precision=None, count=2)]))
    d = dict(date="d", source="s", versions={}, cases=[dict(case=case, kernels=[k])])
    d["summary"] = T.summarize(d, 1.0, 1)
    return d
  before, after = data(255, 588), data(232, 0)
  before["cases"].append(data(1, 0, case="other")["cases"][0])  # not in the after run: left out
  rows = [l for l in T.render_compare(before, after) if l.startswith(("| c1", "| other"))]
  assert rows == ["| c1 | flashvjp_bwd_dkdv | 8/2 | 255 -> **232** | 588/588 -> **0/0** | 1.0 "
                  "| 2/0 | - | 2 wgmma | 0 | 1 -> **0** |"]
  assert "| c1 |" in T.render_md(dict(after, compare=before, fail_on="all", exit_status=0))


def test_matrix_covers_the_issue():
  names = [c.name for c in T.matrix()]
  assert len(names) == len(set(names))
  cases = T.matrix()
  for dt in ("bf16", "f16", "f32"):
    for D in (64, 80, 96, 128, 192, 256):
      assert {c.causal for c in cases if c.dtype == dt and c.D == D and not c.baseline
              and c.name.endswith(("_causal", "_full"))} == {True, False}
  has = lambda f: any(f(c) for c in cases)
  assert has(lambda c: c.Dv and c.Dv != c.D) and has(lambda c: c.window)
  assert has(lambda c: c.segments) and has(lambda c: c.mask == "dense")
  assert has(lambda c: c.mask == "key_padding") and has(lambda c: c.bias == "full")
  assert has(lambda c: c.bias == "broadcast") and has(lambda c: c.dropout)
  assert has(lambda c: c.softcap) and has(lambda c: c.alibi)
  assert has(lambda c: c.Hkv and c.Hkv < c.H) and has(lambda c: c.return_lse)
  assert has(lambda c: c.precision == "highest") and has(lambda c: c.baseline == "jax_mha")
  assert has(lambda c: c.mask_mod == "prefix_lm") and has(lambda c: c.mask_mod == "chunked")


def test_compiles_one_case_end_to_end(tmp_path):
  """The real pipeline on one small case (skipped without pip triton, e.g. on jax 0.12)."""
  pytest.importorskip("triton")
  pytest.importorskip("jaxlib.triton")
  out = tmp_path / "r.md"
  p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "triton_sm90.py"),
                      "--cases", "^bf16_d64_causal$", "--jobs", "1", "--no-fail",
                      "--out-md", str(out), "--work", str(tmp_path / "work")],
                     capture_output=True, text=True, cwd=ROOT, timeout=600)
  assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
  import json
  data = json.loads((tmp_path / "r.json").read_text())
  [case] = data["cases"]
  names = [k["name"] for k in case["kernels"]]
  assert names == ["flashvjp_fwd", "flashvjp_bwd_dkdv", "flashvjp_bwd_dq"]
  for k in case["kernels"]:
    r = k["result"]
    assert r["ok"] and r["regs"] > 0 and r["shared"] > 0, r
    assert all(d["kind"] in ("wgmma", "mma.sync", "fma") for d in r["dots"])
