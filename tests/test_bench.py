"""Fast tests of the benchmark helpers (flashvjp/_bench.py) and of `python -m flashvjp bench`."""
import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import pytest

from flashvjp import _bench
from flashvjp import cli


def test_cpu_memory_flag_is_set():
  assert "--xla_cpu_experimental_ynn_fusion_type=individual_dot" in os.environ["XLA_FLAGS"]
  assert _bench.ensure_cpu_memory_flag() is False  # already there: not added twice
  assert os.environ["XLA_FLAGS"].count("xla_cpu_experimental_ynn_fusion_type") == 1


def test_attention_flops_formula():
  B, H, S, D = 2, 8, 1024, 64
  fwd = _bench.attention_flops(B, H, S, S, D, causal=False, mode="fwd")
  assert fwd == 4 * B * H * S * S * D
  assert _bench.attention_flops(B, H, S, S, D, causal=True, mode="fwd") == fwd / 2
  assert _bench.attention_flops(B, H, S, S, D, causal=False, mode="fwd+bwd") == 3.5 * fwd
  assert _bench.attention_flops(B, H, S, S, D, causal=True, mode="fwd+bwd") == 1.75 * fwd
  # Rectangular and Dv != D: 2 * B * H * Sq * Skv * (D + Dv).
  assert _bench.attention_flops(1, 1, 3, 5, 4, causal=False, head_dim_v=6) == 2 * 3 * 5 * (4 + 6)
  with pytest.raises(ValueError, match="mode"):
    _bench.attention_flops(B, H, S, S, D, causal=False, mode="bwd")


@pytest.mark.parametrize("mode", _bench.MODES)
def test_naive_compiled_memory_exceeds_blockwise(mode):
  shape = _bench.Shape(batch=1, heads=4, seq=512, head_dim=64, dtype="float32", causal=True)
  mem = {}
  for impl in ("naive", "blockwise"):
    fn = _bench.benchmark_fn(impl, True, mode, **({"block_q": 128, "block_kv": 128}
                                                  if impl == "blockwise" else {}))
    mem[impl] = _bench.compiled_memory(fn, *_bench.input_specs(impl, shape, mode))
  scores = 4 * 512 * 512 * 4  # one float32 [1, 4, 512, 512] score matrix
  assert mem["naive"].temp >= scores
  assert mem["naive"].temp > 2 * mem["blockwise"].temp
  assert mem["naive"].argument == mem["blockwise"].argument > 0
  assert mem["naive"].output == mem["blockwise"].output > 0


def test_baseline_takes_jax_nn_layout():
  shape = _bench.Shape(batch=1, heads=2, seq=8, head_dim=4)
  (q_spec, *_), = [_bench.input_specs("jax.nn", shape, "fwd")]
  assert q_spec.shape == (1, 8, 2, 4)
  inputs = _bench.make_inputs(shape)
  q, k, v = _bench.args_for("naive", "fwd", inputs)
  qt, kt, vt = _bench.args_for("jax.nn", "fwd", inputs)
  ours = jax.jit(_bench.benchmark_fn("naive", True, "fwd"))(q, k, v)
  theirs = jax.jit(_bench.benchmark_fn("jax.nn", True, "fwd"))(qt, kt, vt)
  assert jnp.max(jnp.abs(jnp.swapaxes(theirs, 1, 2) - ours)) < 1e-5


def test_time_round_robin_respects_budget():
  def sleep(t):
    time.sleep(t)  # returns None: nothing to block on, no jax dispatch in the timing
  fast, slow = (lambda: sleep(0.001)), (lambda: sleep(0.05))
  res = _bench.time_round_robin([(fast, ()), (slow, ())], repeats=3, max_seconds=0.12,
                                min_seconds=0.02)
  assert res[0]["runs"] >= 3 and res[0]["median"] >= 0.001
  assert 1 <= res[1]["runs"] <= 2 and res[1]["median"] >= 0.05
  (too_slow,) = _bench.time_round_robin([(slow, ())], repeats=3, max_seconds=0.01)
  assert too_slow["runs"] == 0 and too_slow["warmup_only"]  # the warm-up is the time
  assert too_slow["median"] == too_slow["warmup"] >= 0.05


def test_time_round_robin_total_budget_trims_costliest_first():
  calls = []
  def make(t):
    return (lambda: calls.append(t), ())
  fast, slow = make("fast"), make("slow")
  # Given warm-ups (nothing runs for them): 5 rounds would cost 5 * (0.01 + 0.1) = 0.55 s;
  # 0.25 s of budget keeps the cheap call's runs and trims the costly one.
  res = _bench.time_round_robin([fast, slow], repeats=5, min_seconds=0.0, total_seconds=0.25,
                                warm=[0.01, 0.1])
  assert res[0]["runs"] == 5 and res[1]["runs"] == 2
  assert calls.count("fast") == 5 and calls.count("slow") == 2  # no extra warm-up call
  (none,) = _bench.time_round_robin([slow], repeats=5, total_seconds=0.0, warm=[0.1],
                                    keep_one_below=0.05)
  assert none["runs"] == 0 and none["median"] == 0.1 and none["warmup_only"]
  (one,) = _bench.time_round_robin([slow], repeats=5, total_seconds=0.0, warm=[0.1])
  assert one["runs"] == 1 and not one["warmup_only"]  # a short call keeps one timed call


def test_budget_lowers_repeats_never_cells():
  """With no time at all, every cell is still timed (by its warm-up) and none is skipped."""
  cfg = _bench.SuiteConfig(seqs=(32,), impls=("naive", "blockwise"), causals=(True,),
                           heads=1, head_dim=16, repeats=5, budget_seconds=0.0,
                           cheap_seconds=0.0, keep_one_below=0.0, min_seconds_per_case=0.0,
                           matmul_n=64)
  report = _bench.run_suite(cfg)
  res = report["results"]
  assert len(res) == 3 * len(_bench.MODES)
  assert all(r["skip_reason"] is None and r["time_s"] > 0 and r["runs"] == 0 for r in res)
  assert all(r["time_s"] == r["warmup_s"] and r["compile_s"] > 0 for r in res)
  assert report["meta"]["warmup_only_cells"] == len(res)
  assert "cells timed by the warm-up call alone" in "\n".join(_bench.meta_lines(report))
  assert "ms*" in _bench.results_table(report)
  # An ample budget gives every cell its repeats; so does no budget at all.
  cfg = dataclasses.replace(cfg, impls=("blockwise",), modes=("fwd",), repeats=3,
                            budget_seconds=60.0)
  assert all(r["runs"] >= 3 for r in _bench.run_suite(cfg)["results"])
  cfg = dataclasses.replace(cfg, budget_seconds=None)
  assert all(r["runs"] >= 3 for r in _bench.run_suite(cfg)["results"])


def test_busy_warning():
  assert _bench.busy_warning({"matmul_flops_per_s": 90e9, "matmul_flops_per_s_best": 100e9}) is None
  line = _bench.busy_warning({"matmul_flops_per_s": 40e9, "matmul_flops_per_s_best": 100e9})
  assert "busy" in line and "40 GFLOP/s" in line and "100" in line and "\n" not in line
  # Starved of cores with no matmul rate recorded: the line names the cores (it divided None).
  line = _bench.busy_warning({"platform": "cpu", "matmul_cores_used": 0.6, "nproc": 2})
  assert "0.6 of 2 cores" in line and "GFLOP/s" not in line


def test_run_suite_skips_timing_over_memory_limit_but_reads_memory():
  cfg = _bench.SuiteConfig(seqs=(64,), impls=("naive",), causals=(True,), modes=("fwd",),
                           heads=1, head_dim=16, repeats=1, max_time_memory_bytes=1,
                           min_seconds_per_case=0.0,
                           matmul_n=128)
  report = _bench.run_suite(cfg)
  impls = sorted(r["impl"] for r in report["results"])
  assert impls == ["jax.nn", "naive"]  # the baseline is always measured
  for r in report["results"]:
    assert r["time_s"] is None and r["ratio_to_baseline"] is None
    assert "compiled memory" in r["skip_reason"]
    assert r["temp_bytes"] > 0


def _bench_args(argv):
  parser = argparse.ArgumentParser()
  _bench.add_bench_parser(parser.add_subparsers(dest="command"))
  return parser.parse_args(["bench"] + argv)


def test_cpu_defaults():
  if jax.default_backend() != "cpu":
    pytest.skip("CPU defaults")
  cfg = _bench.config_from_args(_bench_args([]))
  assert tuple(cfg.seqs) == (256, 512, 1024, 2048)
  assert cfg.dtype == "float32" and cfg.heads == 4 and cfg.head_dim == 64
  assert "pallas" not in cfg.impls  # interpret mode is not a benchmark
  assert cfg.budget_seconds is not None and cfg.budget_seconds <= 60  # about a minute in all
  # Nothing in the default grid is skipped for memory or for a predicted slow call: the
  # largest default cell (jax.nn / naive fwd+bwd at seq 2048) needs ~0.3 GiB.
  shape = _bench.Shape(cfg.batch, cfg.heads, max(cfg.seqs), cfg.head_dim, cfg.dtype)
  for impl in ("naive", "jax.nn"):
    mem = _bench.compiled_memory(_bench.benchmark_fn(impl, False, "fwd+bwd"),
                                 *_bench.input_specs(impl, shape, "fwd+bwd"))
    assert mem.total < cfg.max_time_memory_bytes
  assert cfg.max_call_seconds >= 30
  assert _bench.config_from_args(_bench_args(["--budget-seconds", "0"])).budget_seconds is None


def test_run_bench_writes_json_and_png(tmp_path, capsys, monkeypatch):
  """Also: without tqdm, progress comes as plain lines on stderr (one per group)."""
  pytest.importorskip("matplotlib")
  monkeypatch.setitem(sys.modules, "tqdm", None)  # `import tqdm...` raises ImportError
  monkeypatch.setitem(sys.modules, "tqdm.auto", None)
  js, png = tmp_path / "bench.json", tmp_path / "bench.png"
  with pytest.raises(SystemExit) as exit_info:  # through `python -m flashvjp bench`'s parser
    cli.main(["bench", "--seq", "32", "64", "--impl", "blockwise", "--heads", "1", "--head-dim", "16",
              "--causal", "yes",
              "--repeats", "1", "--min-seconds", "0", "--matmul-size", "256",
              "--json", str(js), "--plot", str(png)])
  assert exit_info.value.code == 0
  report = json.loads(js.read_text())
  assert report["meta"]["matmul_flops_per_s"] > 0
  rows = {(r["impl"], r["seq"], r["mode"]): r for r in report["results"]}
  assert set(rows) == {(i, s, m) for i in ("blockwise", "jax.nn")
                       for s in (32, 64) for m in _bench.MODES}
  for (impl, seq, mode), r in rows.items():
    assert r["causal"] is True and r["temp_bytes"] >= 0 and r["skip_reason"] is None
    assert r["time_s"] > 0 and r["flops_per_s"] > 0 and r["matmul_fraction"] > 0
    assert r["flops"] == _bench.attention_flops(1, 1, seq, seq, 16, causal=True, mode=mode)
    if impl == "jax.nn":
      assert r["ratio_to_baseline"] == 1.0
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
  captured = capsys.readouterr()
  out = captured.out
  assert "| impl | seq | causal |" in out and "blockwise" in out
  assert out.startswith("bench: 4 groups")  # what runs, said before it runs
  progress = [l for l in captured.err.splitlines() if l.startswith("bench ")]
  assert [l.split(":")[0] for l in progress] == [f"bench {i}/4" for i in range(1, 5)]


def test_plot_panels_show_every_implementation(tmp_path):
  pytest.importorskip("matplotlib")
  res = []
  for impl in ("naive", "blockwise", "jax.nn"):
    for seq in (256, 512, 1024):
      for causal in (True, False):
        for mode in _bench.MODES:
          res.append(dict(impl=impl, seq=seq, causal=causal, mode=mode, time_s=1e-3 * seq,
                          temp_bytes=seq * 1000 * (3 if impl == "naive" else 1)))
  meta = dict(platform="cpu", device="cpu", nproc=2, jax=jax.__version__, date="today",
              seconds=1.0, config=dict(batch=1, heads=4, head_dim=64, dtype="float32"))
  drawn = _bench.plot({"meta": meta, "results": res}, str(tmp_path / "p.png"))
  assert len(drawn) == 4  # time and memory, fwd and fwd+bwd
  for panel, lines in drawn.items():
    assert set(lines) == {f"{i} ({c})" for i in ("naive", "blockwise", "jax.nn")
                          for c in ("causal", "full")}, panel
    assert all(seqs == [256, 512, 1024] for seqs in lines.values()), panel


def test_parse_impl():
  assert _bench.parse_impl("blockwise") == ("blockwise", None, None)
  assert _bench.parse_impl("blockwise:256x512") == ("blockwise", 256, 512)
  assert _bench.parse_impl("jax.nn") == ("jax.nn", None, None)
  for bad in ("flash", "naive:64x64", "blockwise:256", "blockwise:0x64", "blockwise:ax64"):
    with pytest.raises(ValueError, match="blockwise"):
      _bench.parse_impl(bad)
  # Block sizes in the name reach flash_attention: 4 x 4 blocks of 16 at seq 64 need less
  # temp memory than one 64 x 64 block.
  shape = _bench.Shape(batch=1, heads=2, seq=64, head_dim=16)
  small, big = (_bench.compiled_memory(_bench.benchmark_fn(name, False, "fwd"),
                                       *_bench.input_specs(name, shape, "fwd"))
                for name in ("blockwise:16x16", "blockwise:64x64"))
  assert small.temp < big.temp
