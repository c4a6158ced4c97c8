"""The SASS gate of the Mosaic-GPU kernels (benchmarks/mosaic_gpu_sass.py), no GPU needed.

The benchmark records, per kernel, the steady-state main loop's instructions per iteration
beside tokamax's sm90 kernels (`benchmarks/results/mosaic_gpu_sass.json`). Here the gated
cases (ours, D=128, causal, forward and VJP: their steady loops are the unmasked
blocks', the full kernels' loops) compile again and must not regress: no
loop longer than recorded, no more spills, and no kernel that had reached its anchor's MMA
FLOP per instruction falling below it. The gate's own logic is checked on made-up rows.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import sys

import jax
import pytest

from tests import _aot
from tests import _sass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "mosaic_gpu_sass", os.path.join(ROOT, "benchmarks", "mosaic_gpu_sass.py"))
M = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("mosaic_gpu_sass", M)  # its dataclasses look their module up
_spec.loader.exec_module(M)
RECORDED = os.path.join(ROOT, "benchmarks", "results", "mosaic_gpu_sass.json")
_RECORDED_JAX = json.load(open(RECORDED))["jax"] if os.path.exists(RECORDED) else None


def _row(case, role, instructions, flop=4_194_304, spills=0):
  c = M.Case.parse(case)
  loop = dict(instructions=instructions, mma_flop=flop,
              flop_per_instruction=flop / instructions, mbarrier_waits=2, bar_syncs=1,
              classes={})
  return dict(case=case, impl=c.impl, kind=c.kind, D=c.D, causal=c.causal, feature=c.feature,
              kernels={role: dict(steady=loop, masked=None, spill_bytes=spills, registers=168,
                                  smem_bytes=0)})


def test_gate_flags_growth_spills_and_a_fall_below_the_anchor():
  ours, anchor = "ours:fwd:D128:full:plain", "tokamax:fwd:D128:full:plain"
  recorded = [_row(ours, "fwd", 500), _row(anchor, "fwd", 470)]
  assert M.gate([_row(ours, "fwd", 500)], recorded) == []
  assert M.gate([_row(ours, "fwd", 480)], recorded) == []  # fewer: fine
  (msg,) = M.gate([_row(ours, "fwd", 501)], recorded)
  assert "501 instructions" in msg and "recorded 500" in msg
  (msg,) = M.gate([_row(ours, "fwd", 500, spills=8)], recorded)
  assert "spill" in msg
  # once at or above the anchor (460 <= 470 instructions for the same work), falling back
  # below it fails even where the count does not grow past the recorded one
  passed = [_row(ours, "fwd", 460), _row(anchor, "fwd", 470)]
  assert M.gate([_row(ours, "fwd", 460)], passed) == []
  msgs = M.gate([_row(ours, "fwd", 480)], passed)
  assert any("below tokamax" in m for m in msgs) and any("recorded 460" in m for m in msgs)
  # not yet at the anchor: only growth counts
  assert M.gate([_row(ours, "fwd", 490)], recorded) == []


def test_loop_parser_counts_one_loop_and_its_mma_work():
  text = "\n".join([
      "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
      ".L_x_1:",
      "        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ ;",
      *[f"        /*{0x20 + 16 * n:04x}*/                   FFMA R{n}, R{n}, R2, R3 ;"
        for n in range(40)],
      "        /*0300*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR6], R24 ;",
      "        /*0310*/                   BAR.SYNC.DEFER_BLOCKING R0, 0x80 ;",
      "        /*0320*/              @P0 BRA `(.L_x_1) ;",
      "        /*0330*/                   EXIT ;",
  ])
  (loop,) = M.mma_loops(text)
  assert loop.instructions == 44  # HGMMA, 40 FFMA, the wait, the sync, the branch
  assert loop.mma_flop == 2 * 64 * 128 * 16
  assert loop.classes["FFMA"] == 40 and loop.mbarrier_waits == 1 and loop.bar_syncs == 1


def test_recorded_results_hold_every_gated_case_and_its_anchor():
  recorded = {r["case"]: r for r in json.load(open(RECORDED))["results"]}
  for c in M.cases("gate"):
    assert c.name in recorded, c.name
    anchor = M.Case("tokamax", c.kind, c.D, c.causal).name
    assert anchor in recorded, anchor
    assert set(recorded[c.name]["kernels"]) == ({"fwd"} if c.kind == "fwd" else {"dq", "dkdv"})
  # every kernel of ours the benchmark compiled (each head dim, mask and feature) without spills
  spilled = [(name, role) for name, r in recorded.items() if r["impl"] == "ours"
             for role, k in r["kernels"].items() if k["spill_bytes"]]
  assert not spilled, spilled


@pytest.mark.skipif(not _aot.HAS_CUDA_PLUGIN,
                    reason=f"the deviceless sm_90a compile: {_aot.CUDA_PROBLEM}")
@pytest.mark.skipif(_sass.unavailable() is not None, reason=str(_sass.unavailable()))
@pytest.mark.skipif(_RECORDED_JAX != jax.__version__,
                    reason=f"the counts were recorded with jax {_RECORDED_JAX} (its Mosaic-GPU"
                    f" compiler); this is jax {jax.__version__}")
@pytest.mark.parametrize("case", [c.name for c in M.cases("gate")])
def test_mosaic_gpu_loops_do_not_regress(case, tmp_path):
  """Compile the case for sm_90a and hold its loops to the recorded counts (and the anchor,
  once reached). The counts print, to read beside the recorded table."""
  result = M.run_case(M.Case.parse(case), str(tmp_path))
  recorded = json.load(open(RECORDED))["results"]
  for role, k in result["kernels"].items():
    s = k["steady"]
    print(f"{case} {role}: {s['instructions']} instructions per iteration,"
          f" {s['flop_per_instruction']:.0f} MMA FLOP per instruction, {k['spill_bytes']}"
          f" spill bytes")
  assert result["kernels"], case
  assert M.gate([result], recorded) == []
  # the gate would see this case's loops one instruction past the recorded ones
  (old,) = [r for r in recorded if r["case"] == case]
  worse = copy.deepcopy(result)
  for role, k in worse["kernels"].items():
    k["steady"]["instructions"] = old["kernels"][role]["steady"]["instructions"] + 1
  assert len(M.gate([worse], recorded)) == len(worse["kernels"])
