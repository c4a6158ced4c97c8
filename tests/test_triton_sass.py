"""The Pallas-Triton SASS comparison (benchmarks/triton_sass.py): its parsing and gate logic,
no triton or GPU needed. CI runs the gate itself (`triton_sass.py --gate`, step 2b) in the
venv that has pip triton."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks",
                                                                   name + ".py"))
  mod = importlib.util.module_from_spec(spec)
  sys.modules.setdefault(name, mod)  # dataclasses look their module up
  spec.loader.exec_module(mod)
  return sys.modules[name]


M = _load("mosaic_gpu_sass")
T = _load("triton_sass")
RECORDED = os.path.join(ROOT, "benchmarks", "results", "triton_sass.json")


def _loop(instructions, flop):
  return M.Loop(instructions, flop, {}, 0, 0)


def _row(impl, instructions, flop=2_097_152, spills=0, D=128, causal=True):
  loop = dict(instructions=instructions, mma_flop=flop,
              flop_per_instruction=flop / instructions, classes={})
  return dict(case=T.Case(impl, D, causal).name, impl=impl, D=D, causal=causal,
              kernels={"fwd": dict(steady=loop, masked=None, spill_bytes=spills)})


def test_gate_flags_growth_spills_and_a_fall_below_tokamax():
  # tokamax: 4194304 / 500 = 8389 MMA FLOP per instruction; ours 2097152 / 400 = 5243
  recorded = [_row("ours", 400), _row("tokamax", 500, flop=4_194_304)]
  assert T.gate([_row("ours", 400)], recorded) == []
  assert T.gate([_row("ours", 390)], recorded) == []
  (msg,) = T.gate([_row("ours", 401)], recorded)
  assert "401 instructions" in msg and "recorded 400" in msg
  (msg,) = T.gate([_row("ours", 400, spills=4)], recorded)
  assert "spill" in msg
  ahead = [_row("ours", 200), _row("tokamax", 500, flop=4_194_304)]  # 10486 >= 8389
  assert T.gate([_row("ours", 200)], ahead) == []
  msgs = T.gate([_row("ours", 260)], ahead)  # 8066 < 8389: fell below it, and grew
  assert any("below tokamax" in m for m in msgs) and any("recorded 200" in m for m in msgs)
  assert T.gate([_row("ours", 250, D=64)], recorded) == ["ours:D64:causal: not in the"
                                                        " recorded results"]


def test_tokamax_vjp_kernel_splits_into_its_dkdv_and_dq_loops():
  def compiled(name, *loops):
    return dict(kernel=name, loops=list(loops), registers=255, spill_bytes=0, smem_bytes=0,
                num_warps=4, num_stages=2)
  rows = T.kernel_rows(T.Case("tokamax", 128, True), [
      compiled("pallas_flash_attention_fwd_res", _loop(1000, 4_194_304)),
      # dK/dV: four products a step (its masked and unmasked loops), dQ: three
      compiled("pallas_flash_attention_vjp", _loop(900, 4_194_304), _loop(820, 4_194_304),
               _loop(700, 3_145_728), _loop(630, 3_145_728))])
  assert rows["dkdv"]["steady"]["instructions"] == 820
  assert rows["dkdv"]["masked"]["instructions"] == 900
  assert rows["dq"]["steady"]["instructions"] == 630
  assert rows["fwd"]["steady"]["instructions"] == 1000 and rows["fwd"]["masked"] is None
  ours = T.kernel_rows(T.Case("ours", 128, True), [
      compiled("flashvjp_fwd", _loop(330, 2_097_152)),
      compiled("flashvjp_bwd_dkdv", _loop(300, 1_572_864)),
      compiled("flashvjp_bwd_dq", _loop(350, 2_621_440))])
  assert {k: v["steady"]["instructions"] for k, v in ours.items()} == dict(
      fwd=330, dkdv=300, dq=350)


def test_warp_level_mma_counts_four_warps_of_work():
  """An HMMA (Triton's tiles under 64 rows) is one warp's m16n8k16; the loops count MMA work
  per warpgroup, as an HGMMA's."""
  text = "\n".join([
      ".L_x_1:",
      "        /*0000*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;",
      "        /*0010*/                   HMMA.1688.F32.TF32 R4, R8, R12, R4 ;",
      *[f"        /*{0x20 + 16 * n:04x}*/                   FADD R{n}, R{n}, R2 ;"
        for n in range(40)],
      "        /*0300*/              @P0 BRA `(.L_x_1) ;",
  ])
  (loop,) = M.mma_loops(text)
  assert loop.instructions == 43
  assert loop.mma_flop == 4 * (2 * 16 * 8 * 16 + 2 * 16 * 8 * 8)


def test_recorded_results_hold_the_gated_case_its_anchor_and_no_spill_of_ours():
  data = json.load(open(RECORDED))
  recorded = {r["case"]: r for r in data["results"]}
  for c in T.cases("gate"):
    assert set(recorded[c.name]["kernels"]) == {"fwd", "dq", "dkdv"}
    assert T.Case("tokamax", c.D, c.causal).name in recorded
  spilled = [(n, role) for n, r in recorded.items() if r["impl"] == "ours"
             for role, k in r["kernels"].items() if k["spill_bytes"]]
  assert not spilled, spilled
  assert T.gate([recorded[c.name] for c in T.cases("gate")], data["results"]) == []
