"""libtpu's static cycle estimates of each Mosaic-TPU kernel beside splash attention's (no TPU).

libtpu estimates, per compiled HLO op, the cycles its LLO program takes
(`LIBTPU_INIT_ARGS=--xla_jf_dump_static_llo_profile_to=DIR`: one textproto per op, with
`estimated_cycles`). This compiles `jit(flash_attention)` and `jit(value_and_grad)` deviceless
(`benchmarks/program_ops.py`'s programs: B=1, H=8, S=4096, D=128, bfloat16; masks none,
causal, window (512, 0), segment ids) for flashvjp and for JAX's splash attention, each in
its own process (the flag is read when libtpu starts), and tabulates each kernel's estimate
and the program's total. Where the profiler fails on an op, the table says so with libtpu's
message. An estimate of a compiler's cost model, not a measured time.

    python benchmarks/tpu_static_profile.py            # -> benchmarks/results/tpu_static_profile.md
"""
from __future__ import annotations

import argparse
import datetime
import glob
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
MASKS = ("none", "causal", "window", "segment_ids")
MODES = ("forward", "value_and_grad")


def _one(impl: str, target: str, mask: str, mode: str) -> None:
  """(In a child process, the flag already in LIBTPU_INIT_ARGS): compile one program."""
  sys.path.insert(0, HERE)
  import program_ops
  ops = (program_ops.ours if impl == "flashvjp" else program_ops.splash)(target, mask, mode)
  print("OPS", len(ops))


def _estimates(out_dir: str) -> dict[str, int]:
  found: dict[str, int] = {}
  for path in glob.glob(os.path.join(out_dir, "*.textproto")):
    text = open(path).read()
    for name, cycles in re.findall(r'hlo_op_name: "([^"]+)"\s+estimated_cycles: (\d+)', text):
      found[name] = found.get(name, 0) + int(cycles)
  return found


def profile(impl: str, target: str, mask: str, mode: str):
  """({op name: estimated cycles}, [profiler failures])."""
  with tempfile.TemporaryDirectory() as d:
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1",
               LIBTPU_INIT_ARGS=(os.environ.get("LIBTPU_INIT_ARGS", "")
                                 + f" --xla_jf_dump_static_llo_profile_to={d}").strip())
    r = subprocess.run([sys.executable, __file__, "--one", impl, target, mask, mode], env=env,
                       capture_output=True, text=True, timeout=900)
    failures = sorted(set(m.split("] ", 1)[-1] for m in re.findall(
        r"[^\n]*Static LLO profiling of [^\n]*failed[^\n]*", r.stderr)))
    if "OPS" not in r.stdout and not failures:
      failures = [f"compile failed (exit {r.returncode})"]
    return _estimates(d), failures  # the ops profiled before a failure stay


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--one", nargs=4, metavar=("IMPL", "TARGET", "MASK", "MODE"),
                  help=argparse.SUPPRESS)
  ap.add_argument("--targets", default="v5e")
  ap.add_argument("--out", default=os.path.join(HERE, "results", "tpu_static_profile.md"))
  args = ap.parse_args(argv)
  if args.one:
    _one(*args.one)
    return 0
  rows = []
  for target in args.targets.split(","):
    for mask in MASKS:
      for mode in MODES:
        cells = []
        for impl in ("flashvjp", "splash"):
          est, failures = profile(impl, target, mask, mode)
          kernels = {k: v for k, v in est.items() if "flashvjp" in k or "splash" in k
                     or "mha" in k}
          total = None if failures else sum(est.values())  # incomplete where one failed
          text = ", ".join(f"{k}: {v:,}" for k, v in sorted(kernels.items())) or "-"
          if failures:
            text += "; " + "; ".join(f.replace("Static LLO profiling of ", "the profiler: ")
                                     for f in failures)
          cells.append((total, text))
        fmt = lambda t: "incomplete" if t is None else f"{t:,}"
        ratio = (f"{cells[0][0] / cells[1][0]:.2f}" if cells[0][0] and cells[1][0] else "-")
        rows.append((target, mask, mode, fmt(cells[0][0]), fmt(cells[1][0]), ratio,
                     cells[0][1], cells[1][1]))
        print(*rows[-1], sep=" | ", flush=True)
  import jax
  lines = [
      "# libtpu static cycle estimates, flashvjp beside splash (benchmarks/tpu_static_profile.py)",
      "",
      f"Recorded {datetime.date.today()} with jax {jax.__version__}; compiled deviceless on a"
      " CPU host (`--xla_jf_dump_static_llo_profile_to`). B=1, H=8, S=4096, D=128, bfloat16;"
      " value_and_grad of `out.astype(float32).sum()`; flashvjp's segment ids without causal,"
      " splash's as `FullMask` + `SegmentIds`. Totals: every op the profiler estimated in the"
      " program (kernels and the ops beside them), \"incomplete\" where it failed on one (its"
      " message in the kernels' cell; the ops before the failure are listed). A cost model's"
      " estimate, not a measured time.",
      "",
      "| target | mask | program | flashvjp cycles | splash cycles | ratio | flashvjp kernels |"
      " splash kernels |",
      "|---|---|---|---|---|---|---|---|",
  ]
  lines += ["| " + " | ".join(r) + " |" for r in rows]
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    f.write("\n".join(lines) + "\n")
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
