"""What one attention layer needs on an 8xH100 node and on a TPU v5e chip, planned on a CPU.

Nothing runs on a GPU or TPU: each row is `flashvjp.plan` (docs/plan.md), a deviceless
compile with the target's real compiler (the CUDA plugin's XLA GPU pipeline with its embedded
Triton and ptxas; libtpu), of jit(value_and_grad) and jit(jvp) of a causal GQA layer (batch 1,
32 query heads on 8 kv heads, head_dim 128, bfloat16):

  * h100x8: the sequence sharded over the 8 GPUs (P(None, None, "sp", None)), seq 16k..128k
    with the strategy flashvjp picks, and the ring asked for at 128k (one ring for every
    head, and one per kv head: ring_head_groups=8);
  * v5e: one chip, seq 8k and 32k.

Per row: per-device memory (`compiled.memory_analysis()`: arguments + outputs + temp), the
implementation and context-parallel strategy flashvjp chose (explain), the collective bytes of
the compiled program per device (result bytes x executions, loop trip counts included), the
kernels and their resources (GPU: shared memory from XLA's thunk sequence, registers and
spills from ptxas -v), and the compile time. Each row is its own subprocess (a fresh process,
so ptxas runs for every kernel and its report is read; and a time limit).

    python benchmarks/plan_targets.py                 # writes benchmarks/results/plan_targets.md
    python benchmarks/plan_targets.py --quick         # h100x8 at 16k, v5e at 8k only
    python benchmarks/plan_targets.py --out /tmp/p.md --timeout 900
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYER = dict(batch=1, num_heads=32, num_kv_heads=8, head_dim=128, causal=True)
# (target, seq, context_parallel[/ring_head_groups]): "auto" picks Ulysses for 32 / 8 heads on
# 8 GPUs; the ring at 128k is there to compare, in one ring and in one ring per kv head.
ROWS = ([("h100x8", s, "auto") for s in (16384, 32768, 65536, 131072)]
        + [("h100x8", 131072, "ring"), ("h100x8", 131072, "ring/8")]
        + [("v5e", s, "auto") for s in (8192, 32768)])
QUICK = [("h100x8", 16384, "auto"), ("v5e", 8192, "auto")]


def _child(target: str, seq: int, cp: str) -> None:
  import flashvjp
  cp, _, groups = cp.partition("/")
  p = flashvjp.plan(target, seq_len=seq, context_parallel=cp,
                    ring_head_groups=int(groups or 1), **LAYER)
  doc = dict(report=str(p), device_kind=p.device_kind, hbm=p.hbm_bytes, modes=[])
  for m in p.modes:
    cp = m.decision.context_parallel
    doc["modes"].append(dict(
        mode=m.mode, seconds=m.compile_seconds, total=m.total_bytes, temp=m.temp_bytes,
        arguments=m.argument_bytes, outputs=m.output_bytes,
        implementation=m.decision.implementation, interpret=m.decision.interpret,
        strategy=None if cp is None else cp.name,
        estimate=None if cp is None else cp.bytes_forward + cp.bytes_backward,
        collective_bytes=sum(c.total_bytes for c in m.collectives),
        whole_sequence=any(c.whole_sequence for c in m.collectives),
        collectives=[dataclasses.asdict(c) for c in m.collectives],
        kernels=[dataclasses.asdict(k) for k in m.kernels]))
  print("PLAN_JSON " + json.dumps(doc))


def _run(target: str, seq: int, cp: str, timeout: float):
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="0",
             TF_CPP_VMODULE="subprocess_compilation=2", PYTHONPATH=str(ROOT))
  start = time.perf_counter()
  try:
    res = subprocess.run([sys.executable, __file__, "--child", target, str(seq), cp], env=env,
                         capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return None, f"did not compile within {timeout:.0f} s"
  for line in res.stdout.splitlines():
    if line.startswith("PLAN_JSON "):
      doc = json.loads(line[len("PLAN_JSON "):])
      doc["wall"] = time.perf_counter() - start
      return doc, None
  return None, (res.stderr.strip().splitlines() or ["no output"])[-1][:300]


def _mib(b) -> str:
  return "-" if b is None else f"{b / 2**20:,.0f}"


def _kernels(m) -> str:
  out: list[str] = []
  seen: dict[str, int] = {}
  for k in m["kernels"]:
    key = json.dumps(k, sort_keys=True)
    seen[key] = seen.get(key, 0) + 1
  for key, times in seen.items():
    k = json.loads(key)
    bits = [k["name"] + (f" x{times}" if times > 1 else "")]
    if k["registers"] is not None:
      bits.append(f"{k['registers']} regs")
    if k["spill_stores"] is not None:
      bits.append(f"{k['spill_stores']}/{k['spill_loads']} B spill")
    if k["shared_memory"] is not None:
      bits.append(f"{k['shared_memory'] // 1024} KiB smem")
    out.append(" ".join(bits))
  return "; ".join(out) or "none"


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
  ap.add_argument("--quick", action="store_true", help="h100x8 at 16k and v5e at 8k only")
  ap.add_argument("--timeout", type=float, default=900, help="seconds per row (default 900)")
  ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "plan_targets.md"))
  args = ap.parse_args()
  if args.child:
    _child(args.child[0], int(args.child[1]), args.child[2])
    return
  import jax

  import flashvjp
  rows = QUICK if args.quick else ROWS
  head = ("| target | seq | mode | implementation | strategy | memory / device MiB (temp) |"
          " collectives / device MiB (estimate) | whole-seq gather | kernels | compile s |")
  lines = [head, "|" + "---|" * 10]
  reports = {}
  for target, seq, cp in rows:
    doc, err = _run(target, seq, cp, args.timeout)
    if doc is None:
      line = f"| {target} | {seq:,} | - | not planned ({cp}): {err} | | | | | | |"
      print(line, flush=True)
      lines.append(line)
      continue
    if cp == "auto":
      reports[(target, seq)] = doc["report"]
    for m in doc["modes"]:
      impl = m["implementation"] + (" (interpret)" if m["interpret"] else "")
      groups = cp.partition("/")[2]
      strategy = ((m["strategy"] or "-") + (f", {groups} head groups" if groups else "")
                  + ("" if cp == "auto" else " (asked)"))
      line = (f"| {target} | {seq:,} | {m['mode']} | {impl} | {strategy} |"
              f" {_mib(m['total'])} ({_mib(m['temp'])}) | {_mib(m['collective_bytes'])}"
              f" ({_mib(m['estimate'])}) | {'YES' if m['whole_sequence'] else 'no'} |"
              f" {_kernels(m)} | {m['seconds']:.1f} |")
      print(line, flush=True)
      lines.append(line)
  big = max((k for k in reports if k[0] == "h100x8"), key=lambda k: k[1], default=None)
  small = next((k for k in reports if k[0] == "v5e"), None)
  doc_lines = [
      "# Planned on a CPU: one attention layer on 8xH100 and on a TPU v5e",
      "",
      "`python benchmarks/plan_targets.py` (BUILD.md): each row is `flashvjp.plan`"
      " ([Plan a run on a laptop](../../docs/plan.md)), a deviceless compile with the target's"
      " real compiler on a machine with neither a GPU nor a TPU. Layer: batch 1, 32 query"
      " heads on 8 kv heads, head_dim 128, bfloat16, causal; h100x8 shards the sequence over"
      " the 8 GPUs, v5e is one chip.",
      "",
      f"flashvjp {flashvjp.__version__}, jax {jax.__version__}; recorded"
      f" {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
      "",
      "Columns: memory = arguments + outputs + temporaries per device"
      " (`compiled.memory_analysis()`), temp in brackets; collectives = result bytes of every"
      " collective of the compiled HLO per device, times its executions (while-loop trip counts"
      " included), with flashvjp's own estimate of the strategy's bytes (forward + backward) in"
      " brackets; whole-seq gather = an all-gather whose result holds the whole sequence;"
      " kernels = registers per thread and spill stores / loads (ptxas -v) and shared memory"
      " (XLA's thunk sequence) per kernel.",
      "",
      *lines,
      "",
  ]
  for key, title in ((big, "h100x8"), (small, "v5e")):
    if key is not None:
      doc_lines += [f"## The report: {title}, seq {key[1]:,}", "", "```text", reports[key],
                    "```", ""]
  pathlib.Path(args.out).write_text("\n".join(doc_lines))
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
