"""The GPU check script (benchmarks/gpu_check.py) without a GPU: its plan and the launch-table
file it writes. CI also runs `gpu_check.py --cpu-smoke` end to end (.ci/run)."""
import dataclasses
import importlib.util
import json
import os
import sys

import jax.numpy as jnp
import pytest

from flashvjp import _config
from flashvjp import _dispatch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "gpu_check", os.path.join(ROOT, "benchmarks", "gpu_check.py"))
G = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("gpu_check", G)  # dataclasses look their module up
_spec.loader.exec_module(G)


def test_dry_run_plan_fits_the_budget(capsys):
  assert G.main(["--dry-run", "--estimates", os.devnull]) == 0
  out = capsys.readouterr().out
  assert "within the budget" in out, out[-2000:]
  for part in G.PART_DEADLINES:  # every part gets rows inside the budget
    line = next(l for l in out.splitlines() if l.startswith(f"{part}: "))
    assert int(line.split()[1]) > 0, line
  # The headline rows come first: flashvjp and cuDNN fwd+bwd at seq 4096, head dim 128.
  assert "SKIP" not in next(l for l in out.splitlines()
                            if "timing cudnn S=4096 D=128 causal=True fwd+bwd" in l)


def test_plan_uses_current_names_and_precisions():
  assert G.BACKEND in _dispatch.CONCRETE
  plan = G.build_plan(False, G.ASSUMED_GPU[1])
  for row in plan.rows:
    if row.part == "sweep" and "launch" in row.args:
      assert (row.args["hd"], G.SWEEP_KIND, row.args["role"]) in _config.LAUNCH_TABLE
  for impl in G.IMPLS:  # each baseline's function builds (nothing runs)
    assert callable(G.make_fn(impl, True, True)[0])
  # float32 rows at each distinct precision, "highest" included; 16-bit rows at the default.
  f32 = [r.args["precision"] for r in plan.rows
         if r.part == "correctness" and r.args.get("dims", {}).get("dtype") == "float32"]
  assert {"default", "highest"} <= set(f32)
  assert len(f32) == len(set(f32)) * (len(f32) // len(set(f32)))
  keys = [r.key for r in plan.rows]
  assert len(keys) == len(set(keys))
  # every feature's first row before the float32 rows at the other precisions
  first_extra = min(n for n, k in enumerate(keys) if "(precision high" in k)
  assert keys.index("correctness score_mod relative_position_bias (grad)") < first_extra
  assert any(r.args.get("mode") == "jvp" for r in plan.rows if r.part == "timing")


def _table_file(tmp_path, entries, **top):
  data = dict(dict(format=_config.LAUNCH_TABLE_FORMAT,
                   machine=dict(device_kind="NVIDIA H200", jax="0.11.2"), entries=entries), **top)
  p = tmp_path / "t.json"
  p.write_text(json.dumps(data))
  return str(p)


def test_launch_table_file_loads_and_applies(tmp_path):
  entry = dict(head_dim=128, kind="16bit", role="fwd", block_q=64, block_kv=32, num_warps=4,
               num_stages=3, transposed=True, ms=1.0)
  table, machine = _config.load_launch_table(_table_file(tmp_path, [entry]))
  assert machine["device_kind"] == "NVIDIA H200"
  assert table == {(128, "16bit", "fwd"): _config.Launch(64, 32, 4, 3, True)}
  before = _config.default_block_sizes("pallas_triton", False, head_dim=128, dtype="bfloat16")
  with _config.launch_overrides(table):
    inside = _config.default_block_sizes("pallas_triton", False, head_dim=128, dtype="bfloat16")
    assert (inside.block_q, inside.block_kv) == (64, 32)
    assert _config.launch(128, "bfloat16", "default", "fwd").num_stages == 3
  after = _config.default_block_sizes("pallas_triton", False, head_dim=128, dtype="bfloat16")
  assert after == before != inside


@pytest.mark.parametrize("change,match", [
    (dict(role="bwd"), "not a key of LAUNCH_TABLE"),
    (dict(head_dim=100), "not a key of LAUNCH_TABLE"),
    (dict(num_warps=0), "num_warps must be a positive int"),
    (dict(block_q="64"), "block_q must be a positive int"),
    (dict(transposed=1), "transposed must be a bool"),
])
def test_launch_table_file_bad_entries(tmp_path, change, match):
  entry = dict(head_dim=64, kind="16bit", role="dq", block_q=64, block_kv=64, num_warps=4,
               num_stages=2)
  with pytest.raises(ValueError, match=match):
    _config.load_launch_table(_table_file(tmp_path, [dict(entry, **change)]))


def test_launch_table_file_bad_header(tmp_path):
  with pytest.raises(ValueError, match="format must be"):
    _config.load_launch_table(_table_file(tmp_path, [], format="other"))
  with pytest.raises(ValueError, match="machine must be"):
    _config.load_launch_table(_table_file(tmp_path, [], machine={}))


def test_best_launch_table_picks_the_fastest_against_the_table():
  run = G.Run.__new__(G.Run)
  run.smoke = False
  launch = lambda bq: dataclasses.asdict(_config.Launch(bq, 64, 8, 2))
  base = dict(part="sweep", status="timed", head_dim=128, kind="16bit", role="fwd", mode="fwd",
              shape={})
  run.data = dict(machine=dict(device_kind="X", jax="j", jaxlib="l", triton=None),
                  started="now", rows=[dict(base, launch=launch(128), is_table=True, ms=2.0),
                                       dict(base, launch=launch(64), is_table=False, ms=1.0)])
  (e,) = G.best_launch_table(run)["entries"]
  assert (e["block_q"], e["speedup"], e["candidates"]) == (64, 2.0, 2)


def test_best_launch_table_keeps_the_table_within_noise():
  run = G.Run.__new__(G.Run)
  run.smoke = False
  launch = lambda bq: dataclasses.asdict(_config.Launch(bq, 64, 8, 2))
  base = dict(part="sweep", status="timed", head_dim=64, kind="16bit", role="dq", mode="fwd+bwd",
              shape={})
  run.data = dict(machine=dict(device_kind="X", jax="j", jaxlib="l", triton=None),
                  started="now", rows=[dict(base, launch=launch(128), is_table=True, ms=2.0),
                                       dict(base, launch=launch(64), is_table=False, ms=1.99)])
  (e,) = G.best_launch_table(run)["entries"]
  assert (e["block_q"], e["speedup"]) == (128, 1.0)


def test_correctness_row_passes_and_fails_on_its_tolerance(monkeypatch):
  """One smoke row end to end (interpret mode): PASS at the library's tolerance, FAIL when
  the tolerance is tighter than the error (the row judges, it does not just run)."""
  plan = G.build_plan(True, G.ASSUMED_GPU[1], skip=("timing", "sweep"))
  row = next(r for r in plan.rows if r.key == "correctness plain f32 (precision default)")
  run = G.Run.__new__(G.Run)
  run.smoke = True
  res = row.fn(run, row)
  assert res["status"] == "PASS", res
  assert res["tol"] == G._check.tolerance("float32", G.BACKEND, precision="default")
  assert set(res["errors"]) >= {"out", "lse", "dq", "dk", "dv", "jvp out", "jvp lse"}
  monkeypatch.setattr(G._check, "tolerance", lambda *a, **k: 1e-9)
  assert row.fn(run, row)["status"] == "FAIL"


def test_mosaic_verdict_names_the_launch_table_entries():
  """A class whose Mosaic rows all passed and whose timings beat Pallas-Triton everywhere is
  `earned`, with the `_config.MOSAIC_GPU_EARNED` key it belongs under; a slower class, or any
  failed correctness row, is not."""
  rows = [dict(part="mosaic_correctness", status="PASS"),
          dict(part="mosaic_timing", status="timed", impl="mosaic", D=128, causal=True,
               vs_triton=1.3),
          dict(part="mosaic_timing", status="timed", impl="mosaic", D=128, causal=False,
               vs_triton=0.9)]
  v = G.mosaic_verdict(rows)
  assert v["D=128 causal=True"]["earned"] and v["D=128 causal=True"]["table_key"] == [128, True]
  assert not v["D=128 causal=False"]["earned"]
  key = tuple(v["D=128 causal=True"]["table_key"])
  assert _config.head_dim_bucket(128) == key[0]
  failed = [dict(rows[0], status="FAIL")] + rows[1:]
  assert not any(x["earned"] for x in G.mosaic_verdict(failed).values())


def test_sass_figures_sit_beside_the_timing_rows(tmp_path):
  """The Mosaic-GPU timing table shows the recorded SASS per iteration of the kernels each row
  runs (ours, tokamax's in parentheses): the forward's for a forward row, the backward's too
  for forward+backward; nothing where no count is recorded."""
  loop = lambda n: {"steady": {"instructions": n}}
  rec = {"results": [
      {"case": "ours:fwd:D128:causal:plain", "kernels": {"fwd": loop(471)}},
      {"case": "tokamax:fwd:D128:causal:plain", "kernels": {"fwd": loop(472)}},
      {"case": "ours:vjp:D128:causal:plain", "kernels": {"dq": loop(283), "dkdv": loop(400)}},
      {"case": "tokamax:vjp:D128:causal:plain", "kernels": {"dq": loop(384), "dkdv": loop(702)}},
  ]}
  path = tmp_path / "sass.json"
  path.write_text(json.dumps(rec))
  assert G.sass_figures(128, True, "fwd", str(path)) == "fwd 471 (472)"
  assert (G.sass_figures(128, True, "fwd+bwd", str(path))
          == "fwd 471 (472), dq 283 (384), dkdv 400 (702)")
  assert G.sass_figures(64, True, "fwd", str(path)) == ""
  assert G.sass_figures(128, True, "fwd", str(tmp_path / "none.json")) == ""


def test_triton_sass_figures_give_the_work_per_iteration_beside_the_count(tmp_path):
  """The Pallas-Triton column: instructions / MMA MFLOP per main-loop iteration (ours and
  tokamax's tiles differ), from benchmarks/triton_sass.py's results."""
  loop = lambda n, f: {"steady": {"instructions": n, "mma_flop": f}}
  rec = {"results": [
      {"case": "ours:D128:causal", "kernels": {"fwd": loop(334, 2_097_152),
                                               "dq": loop(350, 2_621_440),
                                               "dkdv": loop(308, 1_572_864)}},
      {"case": "tokamax:D128:causal", "kernels": {"fwd": loop(1027, 4_194_304),
                                                  "dq": loop(634, 3_145_728),
                                                  "dkdv": loop(824, 4_194_304)}},
  ]}
  path = tmp_path / "triton_sass.json"
  path.write_text(json.dumps(rec))
  assert G.triton_sass_figures(128, True, "fwd", str(path)) == "fwd 334 / 2.10 (1027 / 4.19)"
  assert G.triton_sass_figures(128, True, "fwd+bwd", str(path)) == (
      "fwd 334 / 2.10 (1027 / 4.19), dq 350 / 2.62 (634 / 3.15), dkdv 308 / 1.57 (824 / 4.19)")
  assert G.triton_sass_figures(128, False, "fwd", str(path)) == ""
  assert G.triton_sass_figures(128, True, "fwd", str(tmp_path / "none.json")) == ""


def test_mosaic_part_on_blackwell_lists_what_the_sm100_kernels_refuse(monkeypatch):
  """On a Blackwell GPU part 0 checks the sm_100a kernels: the cases with what they refuse at
  their entry (a bias, a dense mask, segment ids) are not planned, with the reason, and the
  correctness rows compare no jvp (their forward mode is refused)."""
  dims = dict(B=1, H=2, Hkv=1, Sq=64, Skv=64, D=64, Dv=64, dtype="bfloat16")
  why = G.mosaic_refusal(dims, dict(bias=jnp.zeros((1, 2, 64, 64))), blackwell=True)
  assert why is not None and "sm_100a" in why and "bias" in why
  assert "segment_ids" in G.mosaic_refusal(
      dims, dict(segment_ids=(jnp.zeros((1, 64), jnp.int32),) * 2), blackwell=True)
  assert G.mosaic_refusal(dims, dict(causal=True)) is None  # Hopper's limits: taken
  monkeypatch.setattr(G, "blackwell_host", lambda smoke: True)
  plan = G.Plan()
  G.plan_mosaic(plan, smoke=False, mem_bytes=80e9)
  assert any("no tangent kernel" in n for n in plan.not_planned)
  assert any("bias" in n and "sm_100a" in n for n in plan.not_planned)
  rows = [r for r in plan.rows if r.part == "mosaic_correctness"]
  assert rows and all(r.shape.endswith(" grad") for r in rows)
