"""The first jit(grad) / jit(forward) of a fresh process: flashvjp (default CPU path) vs jax.nn.

What a user pays on a new training run or notebook restart. Every figure is its own
Python process (jax and flashvjp imported before the clock starts, so imports are
excluded) that traces + lowers and XLA-compiles ``jax.jit(jax.grad(loss))`` (or
``jax.jit(loss)``) once, B=1 H=8 D=64, causal, at seq 512 / 2048 / 8192 / 32768, float32
and bfloat16. flashvjp's and jax.nn's (``implementation="xla"``) processes alternate, the
medians of --repeats rounds are reported with their ranges, and the ratio is of the
medians. Wall and CPU seconds are both recorded (other work shares this 2-core machine).
The breakdown counts the fused kernels (distinct fused computations) and while loops of
each compiled module.

    python benchmarks/compile_time.py            # table + benchmarks/results/compile_time.md
    python benchmarks/compile_time.py --quick    # seq 2048 and 8192, float32, grad; nothing written
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import time

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
ROOT = pathlib.Path(__file__).resolve().parents[1]
B, H, D = 1, 8, 64
TARGET = 1.5  # first jit(grad) at seq 2048 and 8192, x jax.nn's xla path
LOWER_TARGET = 0.3  # flashvjp trace + lower seconds at seq 8192

# One fresh process: imports first (not timed), then one trace + lower and one compile.
_CHILD = """
import json, sys, time
import jax, jax.numpy as jnp
import flashvjp
sys.path.insert(0, {bench!r})
import compile_time as ct
kind, seq, mode, dtype = {args!r}
x = jax.ShapeDtypeStruct(({B}, {H}, seq, {D}), jnp.dtype(dtype))
loss = ct.loss(kind)
fn = jax.jit(jax.grad(loss, (0, 1, 2)) if mode == "grad" else loss)
c0, t0 = time.process_time(), time.perf_counter()
lowered = fn.lower(x, x, x)
c1, t1 = time.process_time(), time.perf_counter()
compiled = lowered.compile()
c2, t2 = time.process_time(), time.perf_counter()
loops, ops = ct.program_stats(compiled)
print("RESULT " + json.dumps(dict(lower=t1 - t0, compile=t2 - t1, lower_cpu=c1 - c0,
                                  compile_cpu=c2 - c1, kernels=ct.fused_kernels(compiled),
                                  loops=loops, ops=ops)))
"""


def loss(kind):
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  import flashvjp  # pylint: disable=import-outside-toplevel
  if kind == "flashvjp":
    attn = lambda q, k, v: flashvjp.flash_attention(q, k, v, causal=True)
  else:
    def attn(q, k, v):  # jax.nn's layout is [B, S, H, D]
      t = lambda x: jnp.swapaxes(x, 1, 2)
      return t(jax.nn.dot_product_attention(t(q), t(k), t(v), is_causal=True,
                                            implementation="xla"))
  return lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32) ** 2)


# One instruction of an optimized HLO module: `%name = <shape or (tuple shape)> opcode(`.
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(?:\([^()]*\)|\S+)\s+([a-z][a-z0-9\-]*)\(")
_FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while"})


def fused_kernels(compiled) -> int:
  """Distinct fused computations of the optimized module (XLA:CPU compiles each once)."""
  return len(set(re.findall(r"\bfusion\(.*?calls=%([^,\s]+)", compiled.as_text())))


def program_stats(compiled):
  """(while loops, compiled ops) of an optimized module: deterministic, unlike the times.

  Compiled ops are the instructions of the entry computation and of the while loops'
  bodies and conditions that XLA:CPU emits as code (fusions, dots, copies, slices, ...;
  not parameters, constants, tuples, bitcasts). XLA:CPU's compile time follows them.
  """
  blocks, name = {}, None
  for line in compiled.as_text().splitlines():
    m = re.match(r"^(ENTRY\s+)?%(\S+)\s.*\{\s*$", line)
    if m:
      name = "ENTRY" if m.group(1) else m.group(2)
      blocks[name] = []
    elif line.startswith("}"):
      name = None
    elif name is not None:
      blocks[name].append(line)
  run = {"ENTRY"}
  for lines in blocks.values():
    for line in lines:
      run.update(re.findall(r"(?:body|condition)=%([^,\s]+)", line))
  loops = ops = 0
  for n in run:
    for line in blocks.get(n, ()):
      m = _INSTR.match(line)
      if m:
        loops += m.group(1) == "while"
        ops += m.group(1) not in _FREE
  return loops, ops


def fresh(kind, seq, mode, dtype):
  """One fresh-process measurement (dict of seconds and counts)."""
  code = _CHILD.format(bench=str(pathlib.Path(__file__).resolve().parent),
                       args=(kind, seq, mode, dtype), B=B, H=H, D=D)
  env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=1200, check=False)
  lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
  if out.returncode != 0 or not lines:
    raise RuntimeError(f"{kind} {seq} {mode} {dtype} failed:\n{out.stderr[-3000:]}")
  return json.loads(lines[-1][len("RESULT "):])


def _med(runs, key):
  vals = [r[key] for r in runs]
  return statistics.median(vals), min(vals), max(vals)


def summarize(runs):
  total = [dict(t=r["lower"] + r["compile"], c=r["lower_cpu"] + r["compile_cpu"]) for r in runs]
  return dict(lower=_med(runs, "lower"), lower_cpu=_med(runs, "lower_cpu"),
              compile=_med(runs, "compile"),
              total=_med(total, "t"), cpu=_med(total, "c"), kernels=runs[0]["kernels"],
              loops=runs[0]["loops"], ops=runs[0]["ops"])


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="seq 2048 / 8192, float32 grad; no file")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--seqs", type=int, nargs="*", default=None)
  args = ap.parse_args()
  seqs = args.seqs or ([2048, 8192] if args.quick else [512, 2048, 8192, 32768])
  cases = [(s, m, d) for m in ("grad", "forward") for d in ("float32", "bfloat16") for s in seqs]
  if args.quick:
    cases = [(s, "grad", "float32") for s in seqs]
  runs = {}
  for rep in range(args.repeats):  # rounds; within a round flashvjp and jax.nn alternate
    for case in cases:
      for kind in ("flashvjp", "jax.nn"):
        runs.setdefault((kind,) + case, []).append(fresh(kind, *case))
    print(f"round {rep + 1}/{args.repeats} done", flush=True)
  rows = []
  hdr = (f"{'seq':>6} {'mode':>7} {'dtype':>8} | {'lower s':>7} {'compile s':>9} {'total s':>7}"
         f" {'(range)':>11} | {'jax.nn s':>8} {'(range)':>11} | {'ratio':>5} {'cpu ratio':>9}"
         f" | {'kernels':>7} {'jax.nn':>6}")
  print(hdr)
  for case in cases:
    f, j = summarize(runs[("flashvjp",) + case]), summarize(runs[("jax.nn",) + case])
    r = dict(seq=case[0], mode=case[1], dtype=case[2], f=f, j=j,
             ratio=f["total"][0] / j["total"][0], cpu_ratio=f["cpu"][0] / j["cpu"][0])
    rows.append(r)
    rng = lambda m: f"{m[1]:.2f}-{m[2]:.2f}"
    print(f"{case[0]:>6} {case[1]:>7} {case[2]:>8} | {f['lower'][0]:>7.2f} {f['compile'][0]:>9.2f}"
          f" {f['total'][0]:>7.2f} {rng(f['total']):>11} | {j['total'][0]:>8.2f}"
          f" {rng(j['total']):>11} | {r['ratio']:>5.2f} {r['cpu_ratio']:>9.2f} |"
          f" {f['kernels']:>7} {j['kernels']:>6}", flush=True)
  checks = []
  for r in rows:
    if r["mode"] == "grad" and r["dtype"] == "float32" and r["seq"] in (2048, 8192):
      checks.append((f"jit(grad) ratio at seq {r['seq']}", r["ratio"], TARGET))
    if r["mode"] == "grad" and r["dtype"] == "float32" and r["seq"] == 8192:
      checks.append(("trace + lower s at seq 8192", r["f"]["lower"][0], LOWER_TARGET))
      checks.append(("(CPU s)", r["f"]["lower_cpu"][0], LOWER_TARGET))
  verdicts = [f"{n} {v:.2f} (target <= {t}): {'PASS' if v <= t else 'FAIL'}" for n, v, t in checks]
  print("\n".join(verdicts))
  if args.quick:
    return
  import jax  # pylint: disable=import-outside-toplevel
  lines = [
      "# Compile time: the first jit(grad) / jit(forward) of a fresh process, flashvjp vs jax.nn",
      "",
      f"`python benchmarks/compile_time.py` on {platform.machine()} CPU ({os.cpu_count()} cores,"
      f" shared with other work), jax {jax.__version__}, {time.strftime('%Y-%m-%d %H:%M')}."
      f" B={B} H={H} D={D}, causal, default implementation (blockwise on CPU) vs"
      " `jax.nn.dot_product_attention(implementation=\"xla\")`. Each figure is its own"
      " process (imports excluded): `jax.jit(f).lower(...)` (trace + lower) then"
      f" `.compile()` (XLA); median of {args.repeats} interleaved rounds, range in brackets."
      " Ratio: of the median wall totals; CPU ratio: of the median CPU-second totals.",
      "",
      "| seq | pass | dtype | flashvjp trace+lower s | (CPU s) | compile s | total s | (CPU s)"
      " | jax.nn total s | (CPU s) | ratio | CPU ratio | fused kernels (flashvjp / jax.nn)"
      " | while loops |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  br = lambda m: f"{m[0]:.2f} [{m[1]:.2f}-{m[2]:.2f}]"
  for r in rows:
    f, j = r["f"], r["j"]
    lines.append(f"| {r['seq']} | {r['mode']} | {r['dtype']} | {br(f['lower'])} |"
                 f" {f['lower_cpu'][0]:.2f} | {br(f['compile'])} | {br(f['total'])} |"
                 f" {f['cpu'][0]:.2f} | {br(j['total'])} | {j['cpu'][0]:.2f} |"
                 f" {r['ratio']:.2f} | {r['cpu_ratio']:.2f} | {f['kernels']} / {j['kernels']} |"
                 f" {f['loops']} / {j['loops']} |")
  lines += ["", "Targets: " + "; ".join(verdicts) + ".", ""]
  (RESULTS / "compile_time.md").write_text("\n".join(lines) + NOTES)
  print(f"wrote {RESULTS / 'compile_time.md'}")


NOTES = """
## Where XLA's compile time goes, and fewer kernels (issue 20, second round)

XLA:CPU (jax 0.12) hands dots and reductions (and the elementwise ops next to them that
have no other user) to YNNPACK, whose fusions cost about 1 ms of compile each; every other
fusion is a kernel it generates with MLIR + LLVM, each compiled once per distinct fused
computation, at 10-15 ms CPU each almost independently of its size (a synthetic module of
41 one-multiply kernels: 0.62 s; of 40 YNNPACK exp / max / divide fusions: 0.04 s). Per
`perf` over 10 compiles at seq 2048, LLVM passes and machine code are 41% of the samples,
MLIR fusion emission 18%, HLO passes 2%. So the compile follows the number of distinct
LLVM kernels: the object files in `XLA_FLAGS=--xla_dump_to` (jit(grad), float32, causal;
the table's "fused kernels" column counts every distinct fused computation, YNNPACK's too):

| program | seq 2048 | seq 8192 |
|---|---|---|
| jax.nn xla path | 16 (24 KB) | 16 |
| flashvjp before (34ab578) | 29 (58 KB) | 32 (61 KB) |
| + no negative-index wrap on the tile slices / updates | 28 | 30 |
| + backward walks the forward's row-major pair list | 26 | 28 |
| + delta from dO in the loop's layout | 25 (55 KB) | 27 (55 KB) |

1. **No negative-index wrap.** `lax.dynamic_slice` normalises a traced start with
   `select(i < 0, i + n, i)`; the blockwise tile slices and in-place updates pass
   `allow_negative_indices=False` (their starts are in range by construction).
2. **The backward walks the forward's pairs**, row-major (`_pairs(..., "q")`): the pair
   index arithmetic that XLA copies into every kernel reading it is then the same in both
   loops, and the tile-slice kernels are shared. dK_j / dV_j still receive their tiles in
   increasing i and dQ_i in increasing j, so dq, dk, dv are bitwise those of the kv-major
   walk.
3. **delta = rowsum(dO * O) from dO in the loop's layout**: a dO the caller computes (here
   2 * out) is then one kernel, not one per layout.

Outputs and gradients bitwise equal to 34ab578's (causal seq 1024 and 4096, full, padded
seq 1000 with GQA, window, bfloat16, segment ids, 128 x 64 blocks). Run time: the same
work per step; measured in fresh processes alternated with 34ab578's, CPU s of one
jit(grad) call (median of 3-5 calls per process; per figure the median and the minimum
over 3-5 processes), B=1 H=8 D=64 causal, at load average 5-9 on 2 cores (the medians
move by 10% between runs; the minima agree within 4%, the new code's lower in two rows and
2.5-3% higher in two, no trend resolved at this load):

| seq | dtype | 34ab578 median (min) | now median (min) |
|---|---|---|---|
| 4096 | float32 | 0.91 (0.87) | 0.91 (0.85) |
| 4096 | bfloat16 | 0.64 (0.63) | 0.65 (0.62) |
| 8192 | float32 | 3.27 (3.16) | 3.60 (3.24) |
| 8192 | bfloat16 | 2.36 (2.27) | 2.48 (2.34) |

The forward alone (unchanged but for the index wrap): 0.27 / 0.19 / 1.01 / 0.72 s before
and after. At seq 8192 float32 the backward's walk order alone (row-major now, kv-major
before, otherwise identical code): median 3.93 vs 3.59 s, minimum 3.24 vs 3.25 s; at seq
4096 float32, 5 processes each: median 0.91 vs 0.92 s, minimum 0.85 vs 0.83 s (the
2026-12-03 session measured no difference either).

Tried and not kept:
- the backward reading the forward's mask tile transposed (one mask kernel instead of two,
  -1 kernel): fwd+bwd 10% slower at seq 4096 float32;
- the output kept normalised in the loop (FlashAttention-1's update; no o / l epilogue):
  -1 kernel, but not bitwise (1 ulp) and a divide per step;
- a select-free epilogue (o / max(l, 1), lse = m + log l, max(lse, -finfo.max) in the
  backward; l is 0 or >= 1): 0 kernels, YNNPACK does not take small elementwise ops with
  several users;
- dQ^T carried in dK's shape (one zero fill): 0, the in-loop reshape split the dQ^T update
  into two kernels;
- an inner `jax.jit` around the forward so that the jvp rule's second trace of it hits the
  cache: trace + lower -0.02 s, not kept (an inner jit's -inf lse of an empty row becomes
  visible to `jax.debug_infs`' op-by-op re-run).

What remains of the ratio (1.65-1.85x CPU in the table above, taken at load average ~9
on the 2 cores, walls about twice the quiet machine's): 25-27 LLVM kernels against
jax.nn's 16 (about 0.1-0.15 s CPU), and trace + lower, 0.21-0.23 s CPU against jax.nn's
0.13-0.15 (the forward is traced twice, for the jit of `_run` and again by the jvp rule,
~0.05 s each). Per pass the loop keeps the tile slices (shared), the mask tile (one per
pass: sharing it costs run time), the masked scores that feed YNNPACK's row max, exp(s - m),
the running-max rescale, two in-place updates (forward) or the K^T tile, dS and three
accumulator updates (backward); around the loops, the carries' fills, 1 / l, lse, out for
its two consumers and dQ's final transpose. Each of those is a kernel jax.nn's
straight-line program does not need.

## What changed in issue 20 (static work in numpy, the pair walk)

Before (44c9c70), tracing jit(grad) at seq 8192 spent most of its 0.7-1.1 s in eager jnp
ops on concrete values: `_pairs` evaluated `MaskSpec.kv_block_range` per row under
`jax.ensure_compile_time_eval()` (2,432 dispatches of tiny ops, 13 XLA compiles in a fresh
process), and a mask_mod's elementwise check evaluated it eagerly (23 more compiles with
`flashvjp.chunked`; a score_mod's check likewise). Now:

1. **Static work in numpy.** `MaskSpec`'s block-bound methods compute in numpy and
   return Python ints when their inputs are static (jnp only for traced ones: a kernel's
   program id, an iota in the graph); per-row ranges are cached per static configuration
   (`_mask.static_block_ranges`), `_pairs`' walk too (`_static_walk`), and the Pallas-TPU
   list widths read the same cache. A mask_mod / score_mod is proven elementwise from its
   jaxpr (`_score_mod.provably_elementwise`: pointwise index arithmetic and table lookups)
   instead of being evaluated; one that cannot be proven is still checked numerically.
   `tests/test_compile.py::test_tracing_runs_no_jax_op`: trace + lower of jit(grad) /
   jit(jvp) run no XLA compile and no host transfer, in a fresh process, for causal,
   window, segment ids, mask_mod, document_causal, block_mask, score_mod and the tangent
   pass (blockwise) and for both Pallas families in interpret mode. Fresh-process
   trace + lower at seq 8192: 0.16 s CPU (0.17-0.35 s wall on the loaded machine);
   Pallas interpret mode at seq 512, B=1 H=2: causal 0.72 -> 0.46 s (Triton) and 0.85 ->
   0.51 s (TPU), with `chunked(64)` 1.35 -> 0.61 s and 1.33 -> 0.62 s (single runs).
2. **The static walk's scalar steps in lax** (trace+lower 0.186 -> 0.160 s CPU at 8192,
   compiled HLO identical).
3. **A carried walk past 8 block rows.** Pair t's (row, col) was a chain of one scalar
   step per row, which XLA copies into every fusion reading the indices: the compile grew
   with seq (0.43 s CPU at 2048, 0.53 s at 8192, 0.95 s at 32768). Past 8 rows (row, col)
   is carried in the loop state: 0.46 s CPU at 8192 and 32768 (+6 fused kernels, each
   small). Run time unchanged, A/B in one process, medians of 5-7 alternated runs, CPU s:
   fwd+bwd causal seq 4096 f32 0.634 (chain) vs 0.638 (carried), seq 8192 f32 2.487 vs
   2.473, seq 4096 bf16 0.431 vs 0.428, outputs bitwise equal. Programs of <= 8 rows
   (seq <= 2048 with the default blocks) are unchanged: their optimized HLO is identical
   to 44c9c70's.

Not reached: the 1.5x target. What remains is XLA's compile of the loop program: 47-58
fused kernels against jax.nn's 25-28 (0.41-0.46 s CPU against jax.nn's whole ~0.3 s),
and a trace that runs the forward twice (the jit's trace of the custom_jvp and the jvp
rule's; ~25% of trace time; an inner jit would share it, but changes what
`jax.debug_infs` sees). Measured wall times on this shared 2-core machine vary 2x between
runs; the CPU-time ratio is the steadier figure.

## Earlier: warm compile time inside one process (issue 9)

XLA:CPU compiles every fusion of the optimized module into its own kernel, and its
compile time follows the number of those kernels (and how many loop bodies hold them);
the trace + lower part is small (0.05-0.2 s). The last two columns above count, in the
optimized module (`program_stats`: deterministic, unlike the times on this shared
2-core machine), the while loops and the ops XLA:CPU emits as code in the entry
computation and the loop bodies (fusions, dots, slices, copies; the counts do not
depend on seq at 512-4096):

| program (f32; bf16) | while loops | compiled ops |
|---|---|---|
| jax.nn xla path | 0 | 25; 28 |
| flashvjp with masked/unmasked split loops (before 185f834) | 8 | - |
| flashvjp with one masked body, nested row/column loops (5f31064's parent) | 4 | 71; 72 |
| flashvjp, one loop per pass over a flat block-pair list (702184c) | 2 | 49; 52 |
| flashvjp now: + per-tile mask, kv-major backward with plain products | 2 | 53; 58 |

Run time is not worse: jit(grad) at seq 4096, causal f32, nested loops vs flat pair list
vs jax.nn's xla path in one process, 5 alternated runs: min 0.56 / 0.53 / 2.56 s, median
0.61 / 0.53 / 2.58 s (load average ~4 on 2 cores; an earlier run at load 5-9: min 1.69 /
1.25 / 7.9 s).

What changed, in order:

1. **Split loops** (`_mask.split_loop`: masked edge blocks, unmasked interior, masked
   edge blocks) gave each pass two distinct loop bodies in three while loops; one masked
   body per pass (masked only where some block can need it: causal, window, segment ids,
   dense mask or padding) halved the loop kernels at ~3% causal run time.
2. **custom_partitioning on one device**: `_vjp` calls the backend directly when there
   is one device (the partitioning wrapper traced the backend again at lowering).
3. **In-place outputs**: each block writes its rows of the carried output
   (`dynamic_update_slice`) instead of a stacked `lax.map`/`scan` output that needed a
   transposing copy.
4. **One loop per pass over a flat list of block pairs** (`_impl._pairs`): the forward
   walks the (q block, kv block) pairs row-major, the backward column-major, in a single
   `fori_loop` each. The running max and sum (one [.., Sq, 2] carry), the output
   accumulator, and dQ, dK, dV (accumulation dtype) are O(seq) carries updated in place
   per step, so no per-row init / finalise / write-back code sits between two loops and
   the backward's dQ is not a separate carried scan. With static bounds (causal, window,
   padding) pair t's (row, column) is a sum of scalar steps with Python-int thresholds
   (no index arrays: custom_partitioning refuses jaxpr constants); with a block table
   (segment ids, dense mask) the static list is compacted (`_mask._compact`), so empty
   blocks cost no `lax.cond` and no iteration. Dropout and score_mod code is emitted only
   when used. 4 -> 2 while loops, 71 -> 49 compiled ops; run time unchanged or better.
5. Eager calls (no jit) are jitted on the static config: only the first call compiles.

Today (2026-12-03, second session): the compile is dominated by code generation for the
fusion kernels (perf over 20 compiles of jit(grad) at seq 2048: LLVM passes and machine
code 41% of samples, MLIR fusion emission 18%, HLO passes ~2%, Python tracing and lowering
~10%; jax.nn's 32% / 20%). XLA:CPU compiles each distinct fused computation once (equal
ones are shared), so the cost follows the distinct kernels and their size: jax.nn's module
has 16 kernels (21 KB of object code); flashvjp's had 26, and has 29 (59 KB) now:

- K and V are carried in the q side's rank ([B, Hkv, 1, S, D]), so their tile slices and
  the dK / dV updates compile to the same kernels as Q's and dQ's (26 -> 23 kernels,
  compile -10%);
- the mask predicate of a tile is materialised once per step (+2 kernels, compile +5%;
  causal forward 10-15% faster, A/B in CPU time at seq 4096 and 8192: XLA had recomputed
  it per head in both fusions reading it);
- the backward is kv-major (all five products plain matmuls; fwd+bwd 14-16% faster in
  float32 and 23-24% in bfloat16 at seq 4096, `cpu_roofline.md`): the per-tile K^T, the
  transposed dQ accumulator's zero fill and update, and its final transpose add kernels,
  compile +15-20%.

So the ratio rose from ~1.7-1.8 to ~2.0-2.1: the run-time gain was taken over the compile
time. Tried without gain: the pair index in closed form (a float square root for the
causal triangle: +1 kernel, +4 KB, since XLA copies scalar producers into every fusion
that reads them); an optimization barrier on the (row, column) index (more scalar
kernels); a transposed copy of all of K instead of per-tile K^T (+2 kernels, 8 MiB more
temp memory, bfloat16 fwd+bwd ~20% faster); walking the backward row-major like the
forward (no change). Earlier: packing dK and dV (and the output with its row max and
sum) into one carry each (XLA keeps the concatenates and slices as their own kernels: 59
-> 67 ops); carrying the (row, column) walk in the loop state (scalar copies: +10 ops);
building the pair list as index arrays from iotas (cumsum and gathers: +16 ops). An
online-softmax loop needs at least a tile slice per operand, the running-max rescaling
and an in-place write-back per step, so its kernel count cannot fall to jax.nn's
straight-line program's without dropping the loop (O(seq^2) memory). XLA:CPU flags are
not an option (users do not set them).
"""


if __name__ == "__main__":
  main()
