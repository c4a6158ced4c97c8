"""CPU benchmark: naive, blockwise and jax.nn (XLA), forward and forward+backward.

B=1, H=8, D=64, float32, seq 1k..16k, causal and not. Records the compiled temp memory
of every case (read from the compiled executable, so also where running would not fit),
the time where it is affordable, as a ratio to jax.nn timed in the same run, attention
FLOP/s and its fraction of a matmul rate measured in the same run, and checks the
targets. Writes benchmarks/results/cpu.md and cpu.json. Conventions: flashvjp/_bench.py.

    python benchmarks/bench_cpu.py            # the full run, < 10 minutes on 2 cores
    python benchmarks/bench_cpu.py --quick    # seq 1k..4k, no files written (for tuning)
    python benchmarks/bench_cpu.py --quick --seq 4096 --causal yes \
        --impl blockwise blockwise:256x512 blockwise:1024x512   # compare block sizes
"""
from __future__ import annotations

import os
import sys

# Before jax starts: make CPU memory analysis see the buffers of fused dots.
_FLAG = "--xla_cpu_experimental_ynn_fusion_type=individual_dot"
if "xla_cpu_experimental_ynn_fusion_type" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

# pylint: disable=wrong-import-position
import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402

from flashvjp import _bench  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
SEQS = (1024, 2048, 4096, 8192, 16384)
TARGET_CASE = dict(impl="blockwise", causal=True, mode="fwd+bwd")
MEM_SEQ, MEM_LIMIT = 8192, 64 * _bench.MiB
TIME_SEQ, TIME_RATIO = 4096, 0.4
FLOPS_SEQ, FLOPS_FRACTION = 4096, 0.60
LINEAR_EXPONENT = 1.2  # temp(2S) / temp(S) <= 2 ** 1.2 at every doubling from 4096 up


def _find(report, seq, **kw):
  for r in report["results"]:
    if r["seq"] == seq and all(r[k] == v for k, v in kw.items()):
      return r
  return None


def check_targets(report) -> list:
  """[(target, measured, PASS/FAIL/n/a)] for B=1, H=8, D=64, f32, causal fwd+bwd blockwise."""
  out = []
  r = _find(report, MEM_SEQ, **TARGET_CASE)
  if r is None:
    out.append((f"temp memory at seq {MEM_SEQ} <= 64 MiB", "not measured", "n/a"))
  else:
    naive = _find(report, MEM_SEQ, impl="naive", causal=True, mode="fwd+bwd")
    base = _find(report, MEM_SEQ, impl="jax.nn", causal=True, mode="fwd+bwd")
    others = ", ".join(f"{x['impl']} {_bench._fmt_bytes(x['temp_bytes'])}"
                       for x in (naive, base) if x is not None)
    out.append((f"temp memory at seq {MEM_SEQ} <= 64 MiB",
                f"{_bench._fmt_bytes(r['temp_bytes'])} ({others})",
                "PASS" if r["temp_bytes"] <= MEM_LIMIT else "FAIL"))
  mems = sorted((x["seq"], x["temp_bytes"]) for x in report["results"]
                if all(x[k] == v for k, v in TARGET_CASE.items()) and x["seq"] >= 4096)
  if len(mems) >= 2:
    exps = [math.log2(m2 / m1) / math.log2(s2 / s1) for (s1, m1), (s2, m2) in zip(mems, mems[1:])]
    out.append((f"temp memory linear in seq (exponent <= {LINEAR_EXPONENT} per doubling, seq >= 4096)",
                ", ".join(f"{s2}: {e:.2f}" for (_, _), (s2, _), e in zip(mems, mems[1:], exps)),
                "PASS" if max(exps) <= LINEAR_EXPONENT else "FAIL"))
  else:
    out.append(("temp memory linear in seq", "needs two seqs >= 4096", "n/a"))
  r = _find(report, TIME_SEQ, **TARGET_CASE)
  if r is None or r["ratio_to_baseline"] is None:
    out.append((f"time at seq {TIME_SEQ} <= {TIME_RATIO}x jax.nn (XLA)",
                "not timed" if r is None else r["skip_reason"] or "jax.nn not timed", "n/a"))
  else:
    out.append((f"time at seq {TIME_SEQ} <= {TIME_RATIO}x jax.nn (XLA)",
                f"{r['ratio_to_baseline']:.2f}x ({_bench._fmt_time(r['time_s'])})",
                "PASS" if r["ratio_to_baseline"] <= TIME_RATIO else "FAIL"))
  r = _find(report, FLOPS_SEQ, **TARGET_CASE)
  if r is None or r["matmul_fraction"] is None:
    out.append((f"attention FLOP/s at seq {FLOPS_SEQ} >= {FLOPS_FRACTION:.0%} of matmul rate",
                "not timed", "n/a"))
  else:
    out.append((f"attention FLOP/s at seq {FLOPS_SEQ} >= {FLOPS_FRACTION:.0%} of matmul rate",
                f"{r['matmul_fraction']:.0%} ({r['flops_per_s'] / 1e9:.1f} of"
                f" {report['meta']['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s matmul, median over"
                " the run)",
                "PASS" if r["matmul_fraction"] >= FLOPS_FRACTION else "FAIL"))
  return out


def targets_table(targets) -> str:
  lines = ["| target (B=1, H=8, D=64, f32, causal, fwd+bwd, blockwise) | measured | result |",
           "|---|---|---|"]
  lines += [f"| {t} | {m} | {v} |" for t, m, v in targets]
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--quick", action="store_true",
                 help="seq 1024..4096 only, and write no files (for tuning)")
  p.add_argument("--seq", type=int, nargs="+", help="override the sequence lengths")
  p.add_argument("--impl", nargs="+", default=["naive", "blockwise", "jax.nn"],
                 help="implementations; blockwise:BQxBK compares block sizes in one run"
                 " (targets are checked on plain 'blockwise')")
  p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--budget-seconds", type=float, default=420.0,
                 help="target wall time: lowers the repeats of the largest cases (down to the"
                 " warm-up call alone), never drops a case; 0 = no budget")
  p.add_argument("--no-write", action="store_true", help="print only; write no files")
  p.add_argument("--out-dir", default=str(RESULTS))
  args = p.parse_args(argv)
  for name in args.impl:
    try:
      _bench.parse_impl(name)
    except ValueError as e:
      p.error(str(e))
  seqs = tuple(args.seq) if args.seq else ((1024, 2048, 4096) if args.quick else SEQS)
  cfg = _bench.SuiteConfig(
      seqs=seqs, impls=tuple(args.impl),
      causals={"both": (True, False), "yes": (True,), "no": (False,)}[args.causal],
      modes=_bench.MODES, batch=1, heads=8, head_dim=64, dtype="float32", repeats=args.repeats,
      # jax.nn / naive fwd+bwd at seq 4096 need 2.1 GiB; at 8192, 8 GiB: memory only there.
      max_time_memory_bytes=3 * _bench.GiB,
      max_call_seconds=30.0, max_seconds_per_case=15.0,
      budget_seconds=args.budget_seconds or None)
  bar = _bench.progress_bar(len(_bench.cases(cfg)), "bench_cpu")  # plain lines without tqdm

  def progress(desc):
    bar.set_postfix_str(desc)
    bar.update(1)

  report = _bench.run_suite(cfg, progress)
  bar.close()

  targets = check_targets(report)
  report["targets"] = [dict(target=t, measured=m, result=v) for t, m, v in targets]
  skipped = _bench.skipped_lines(report)
  md = "\n".join([
      "# flashvjp CPU benchmark",
      "",
      "Regenerate: `python benchmarks/bench_cpu.py` (conventions: `flashvjp/_bench.py`).",
      "",
      *_bench.meta_lines(report),  # (with the busy-machine warning, if any)
      "",
      "## Targets",
      "",
      targets_table(targets),
      "",
      "## Results (B=1, H=8, D=64, float32)",
      "",
      _bench.results_table(report),
      "",
      "## Timing skipped (compiled memory still read)",
      "",
      *(skipped or ["- none"]),
      "",
  ])
  print(md)
  if not (args.quick or args.no_write):
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu.md").write_text(md)
    (out / "cpu.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out / 'cpu.md'} and {out / 'cpu.json'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
