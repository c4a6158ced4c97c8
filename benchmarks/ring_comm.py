"""What context-parallel ring attention moves and holds per device, from the compiled program.

Nothing is run: every figure comes from compiling `flashvjp.ring_attention` inside
``jax.shard_map`` over 8 virtual CPU devices (mesh axis "sp", the sequence sharded) with
`jax.ShapeDtypeStruct` arguments, and reading the result:

  * collectives: every collective-permute / all-gather / all-reduce / all-to-all /
    reduce-scatter instruction of ``compiled.as_text()`` (an async ``-start`` / ``-done``
    pair counts once), with the bytes of its operands per device (HLO shapes such as
    ``bf16[1,8,2048,64]``), for a forward-only program (out) and a forward + backward
    program (out and the VJP of q, k, v for a given cotangent). The same count of the
    lowered, not yet optimized, HLO (``lowered.as_text(dialect="hlo")``) is kept beside
    it: the dtypes the program asks to send, before the CPU backend's own rewrites;
  * memory: ``compiled.memory_analysis()`` of the forward + backward program per device:
    temp, and temp + arguments + outputs (the peak estimate);
  * the static schedule (`flashvjp.distributed._ring.ring_schedule`): the ring steps taken
    per mask (a step no device needs is never taken: no compute and no transfer).

Masks: causal (contiguous and zigzag layouts), a causal window shorter than a device's
chunk, `flashvjp.chunked` with chunks equal to (and half of) the device chunk,
`flashvjp.prefix_lm`. Each (seq, mask) is its own subprocess with a time limit, so a
compile that runs too long or out of memory becomes a skipped row, not a crash.

    python benchmarks/ring_comm.py           # seq 16k, 32k, 64k; writes benchmarks/results/ring_comm.md
    python benchmarks/ring_comm.py --quick   # seq 16k only; writes the same files
    python benchmarks/ring_comm.py --seqs 16384 32768 --timeout 120 --out /tmp/r.md
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8"
                           + " --xla_cpu_experimental_ynn_fusion_type=individual_dot")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flashvjp
from flashvjp.distributed._ring import ring_schedule

N, B, H, HKV, D = 8, 1, 8, 8, 64
DTYPE = "bfloat16"
BLOCK = 512
SEQS = (16384, 32768, 65536)
RESULTS = pathlib.Path(__file__).resolve().parent / "results"
TARGET = 1 / 3  # window's fwd+bwd collective-permute bytes, x the causal ring's
# (row name, mask, layout): the rows of the table, in order.
CONFIGS = (
    ("causal", "causal", "contiguous"),
    ("causal zigzag", "causal", "zigzag"),
    ("window", "window", "contiguous"),
    ("window zigzag", "window", "zigzag"),
    ("chunked", "chunked", "contiguous"),
    ("chunked/2", "chunked/2", "contiguous"),
    ("prefix", "prefix", "contiguous"),
)
MASK_DOC = {
    "causal": "causal=True",
    "window": "causal=True, window=(chunk_len // 4, 0)",
    "chunked": "mask_mod=flashvjp.chunked(chunk_len)",
    "chunked/2": "mask_mod=flashvjp.chunked(chunk_len // 2)",
    "prefix": "mask_mod=flashvjp.prefix_lm(seq // 16)",
}


def mask_kwargs(mask: str, seq: int) -> dict:
  """ring_attention keyword arguments of a mask at global length seq (chunk_len = seq / N)."""
  chunk_len = seq // N
  if mask == "causal":
    return {"causal": True}
  if mask == "window":
    return {"causal": True, "window": (chunk_len // 4, 0)}
  if mask == "chunked":
    return {"mask_mod": flashvjp.chunked(chunk_len)}
  if mask == "chunked/2":
    return {"mask_mod": flashvjp.chunked(chunk_len // 2)}
  if mask == "prefix":
    return {"mask_mod": flashvjp.prefix_lm(seq // 16)}
  raise ValueError(f"unknown mask {mask!r}")


# ---- HLO text ------------------------------------------------------------------------

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
# `[ROOT] [%]name = <shape or (tuple shape)> opcode(operands...)...` (optimized or not)
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\([^=]*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?)"
                    r"\s+([a-z][a-z0-9\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_COMP = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
COLLECTIVES = ("collective-permute", "all-gather", "all-reduce", "all-to-all", "reduce-scatter")


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string (a tuple shape: the sum of its arrays; token[]: 0)."""
  total = 0
  for dt, dims in _ARRAY.findall(shape):
    if dt not in _BYTES:
      continue
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * _BYTES[dt]
  return total


def _operands(rest: str) -> list[str]:
  """Operand names of `op(a, b, ...)` given the text after `op(` (typed or bare operands)."""
  depth, cur, out = 0, "", []
  for ch in rest:
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      if depth == 0:
        break
      depth -= 1
    if ch == "," and depth == 0:
      out.append(cur)
      cur = ""
    else:
      cur += ch
  out.append(cur)
  return [tok.split()[-1].lstrip("%") for tok in out if tok.strip()]


def collectives(text: str) -> dict:
  """{kind: {"count", "bytes", "nested"}} of the collectives of an HLO module's text.

  bytes: per device, the operands' (what each device sends into the collective); an async
  `-start`/`-done` pair counts once (its start). nested: how many sit outside the entry
  computation (inside a loop body they would run more than once: the count is static)."""
  shapes, found, comp, entry = {}, [], None, None
  for line in text.splitlines():
    line = re.sub(r"/\*.*?\*/", "", line)  # `/*index=5*/` inside long tuple shapes
    m = _INSTR.match(line)
    if not m:
      c = _COMP.match(line)
      if c and "=" not in line.split("{")[0]:
        comp = c.group(2)
        entry = comp if c.group(1) else entry
      continue
    name, shape, op, rest = m.groups()
    shapes[name] = shape
    kind = op[:-len("-start")] if op.endswith("-start") else op
    if kind in COLLECTIVES:
      found.append((kind, shape, _operands(rest), comp))
  out = {k: {"count": 0, "bytes": 0, "nested": 0} for k in COLLECTIVES}
  for kind, shape, ops, c in found:
    nbytes = sum(shape_bytes(shapes[o]) for o in ops if o in shapes)
    if not nbytes:  # operand not found: the result (for a start: its first element)
      first = _ARRAY.search(shape)
      nbytes = shape_bytes(first.group(0)) if first else 0
    out[kind]["count"] += 1
    out[kind]["bytes"] += nbytes
    out[kind]["nested"] += int(c != entry)
  return out


# ---- one (seq, mask, layout): compile and read (runs in a child process) ---------------

def _programs(seq: int, mask: str, layout: str, dtype: str):
  mesh = Mesh(np.asarray(jax.devices()[:N]), ("sp",))
  spec = P(None, None, "sp", None)
  kw = mask_kwargs(mask, seq)
  attn = lambda q, k, v: flashvjp.ring_attention(
      q, k, v, axis_name="sp", layout=layout, implementation="blockwise", block_q=BLOCK,
      block_kv=BLOCK, **kw)

  def fwd_bwd(q, k, v, dout):
    out, vjp = jax.vjp(attn, q, k, v)
    return (out,) + vjp(dout)

  fwd = jax.jit(jax.shard_map(attn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
  both = jax.jit(jax.shard_map(fwd_bwd, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 4))
  sh = NamedSharding(mesh, spec)
  q = jax.ShapeDtypeStruct((B, H, seq, D), jnp.dtype(dtype), sharding=sh)
  kv = jax.ShapeDtypeStruct((B, HKV, seq, D), jnp.dtype(dtype), sharding=sh)
  return (fwd, (q, kv, kv)), (both, (q, kv, kv, q))


def measure(seq: int, mask: str, layout: str, dtype: str = DTYPE) -> dict:
  res = {}
  for tag, (fn, structs) in zip(("fwd", "fwd_bwd"), _programs(seq, mask, layout, dtype)):
    t0 = time.perf_counter()
    lowered = fn.lower(*structs)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    mem = compiled.memory_analysis()
    res[tag] = {
        "lower_s": t1 - t0, "compile_s": t2 - t1,
        "compiled": collectives(compiled.as_text()),
        "lowered": collectives(lowered.as_text(dialect="hlo")),
        "temp": mem.temp_size_in_bytes, "args": mem.argument_size_in_bytes,
        "outputs": mem.output_size_in_bytes, "alias": mem.alias_size_in_bytes,
    }
  return res


def schedule(seq: int, mask: str, layout: str) -> dict:
  """The ring steps taken (shifts) and the K/V / dK/dV moves the schedule implies."""
  kw = mask_kwargs(mask, seq)
  steps = ring_schedule(N, seq // N, layout=layout, causal=kw.get("causal", False),
                        window=kw.get("window"), mask_mod=kw.get("mask_mod"))
  shifts = [st["shift"] for st in steps]
  # forward: K/V to the first step (if it is not the device's own), then between steps;
  # backward: the same K/V moves, dK/dV with their chunk between steps (but the own chunk's,
  # which stay home: a first step at shift 0 sends nothing), and home at the end
  home_first = bool(shifts) and shifts[0] % N == 0
  kv_moves = int(bool(shifts) and not home_first) + max(len(shifts) - 1, 0)
  back = int(bool(shifts) and shifts[-1] % N != 0)
  dkv = max(len(shifts) - 1, 0) - int(home_first and len(shifts) > 1) + back
  return {"shifts": shifts, "kv_moves": kv_moves, "dkv_moves": dkv}


# ---- driver ---------------------------------------------------------------------------

def _run_child(seq, mask, layout, dtype, timeout):
  cmd = [sys.executable, __file__, "--child", str(seq), mask, layout, dtype]
  t0 = time.perf_counter()
  try:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
  except subprocess.TimeoutExpired:
    return None, f"compile over the {timeout:.0f} s limit", time.perf_counter() - t0
  wall = time.perf_counter() - t0
  for line in p.stdout.splitlines():
    if line.startswith("RESULT "):
      return json.loads(line[len("RESULT "):]), None, wall
  tail = (p.stderr.strip().splitlines() or [f"exit code {p.returncode}"])[-1]
  why = "killed (out of memory?)" if p.returncode < 0 else tail[:200]
  return None, f"failed: {why} (exit {p.returncode})", wall


def _mib(b):
  return f"{b / 2**20:.2f}"


def _cp(r, tag, which="compiled"):
  c = r[tag][which]["collective-permute"]
  return c["count"], c["bytes"]


def _others(r):
  n = sum(v["count"] for k, v in r["fwd_bwd"]["compiled"].items() if k != "collective-permute")
  return str(n)


HEAD = ("seq", "mask", "layout", "ring steps (shifts)", "fwd permutes", "fwd MiB",
        "fwd+bwd permutes", "fwd+bwd MiB", "MiB / permute", "x causal (fwd+bwd)",
        "lowered fwd+bwd permutes / MiB", "other collectives", "temp MiB", "peak MiB",
        "compile s (fwd, fwd+bwd)")


def table_rows(rows):
  causal = {r["seq"]: r for r in rows if r["name"] == "causal" and r["res"]}
  out = []
  for r in rows:
    sched = ",".join(map(str, r["sched"]["shifts"]))
    if not r["res"]:
      out.append((str(r["seq"]), r["name"], r["layout"], sched) + ("-",) * 10
                 + (f"skipped: {r['skip']}",))
      continue
    res = r["res"]
    fn, fb = _cp(res, "fwd")
    bn, bb = _cp(res, "fwd_bwd")
    ln, lb = _cp(res, "fwd_bwd", "lowered")
    c = causal.get(r["seq"])
    ratio = "-" if not c or not _cp(c["res"], "fwd_bwd")[1] else f"{bb / _cp(c['res'], 'fwd_bwd')[1]:.3f}"
    m = res["fwd_bwd"]
    out.append((str(r["seq"]), r["name"], r["layout"], sched, str(fn), _mib(fb), str(bn),
                _mib(bb), _mib(bb / bn) if bn else "-", ratio, f"{ln} / {_mib(lb)}",
                _others(res), _mib(m["temp"]), _mib(m["temp"] + m["args"] + m["outputs"]),
                f"{res['fwd']['compile_s']:.1f}, {m['compile_s']:.1f}"))
  return out


def checks(rows):
  """Per seq: window's fwd+bwd collective-permute bytes <= TARGET x the causal ring's."""
  lines = []
  by = {(r["seq"], r["name"]): r for r in rows}
  for seq in sorted({r["seq"] for r in rows}):
    w, c = by.get((seq, "window")), by.get((seq, "causal"))
    if not (w and c and w["res"] and c["res"]):
      lines.append(f"- seq {seq}: SKIPPED (window or causal row missing)")
      continue
    ratio = lambda tag, which="compiled", w=w, c=c: (_cp(w["res"], tag, which)[1]
                                                     / max(_cp(c["res"], tag, which)[1], 1))
    rb, rf, rl = ratio("fwd_bwd"), ratio("fwd"), ratio("fwd_bwd", "lowered")
    verdict = "PASS" if rb <= TARGET else "FAIL"
    lines.append(
        f"- seq {seq}: {verdict}: window moves {_mib(_cp(w['res'], 'fwd_bwd')[1])} MiB vs"
        f" causal {_mib(_cp(c['res'], 'fwd_bwd')[1])} MiB of collective-permute per device,"
        f" forward + backward = {rb:.3f}x (target <= {TARGET:.3f}); forward only {rf:.3f}x;"
        f" lowered (pre-XLA) forward + backward {rl:.3f}x")
  return lines


def _print_table(rows):
  try:
    from rich.console import Console  # pylint: disable=import-outside-toplevel
    from rich.table import Table  # pylint: disable=import-outside-toplevel
  except ImportError:
    print(" | ".join(HEAD))
    for row in table_rows(rows):
      print(" | ".join(row))
    return
  t = Table(title="ring attention: collectives and memory per device (compiled, not run)")
  for h in HEAD:
    t.add_column(h, justify="left" if h in ("mask", "layout", "ring steps (shifts)") else "right")
  for row in table_rows(rows):
    t.add_row(*row)
  Console(width=250).print(t)


def _sentences(rows, seqs):
  s = seqs[0]
  cl = s // N
  return [
      f"- **causal** (contiguous): every one of the {N - 1} shifts is needed by some device, so"
      " the forward moves K and V seven times and the backward moves dK/dV with their chunk"
      " six times (the own chunk's gradient stays home) and home once; the backward's first"
      " K/V move is the forward's (XLA CSE"
      " shares it), the later ones are sent again. zigzag takes the same steps (it balances"
      " compute, not bytes).",
      f"- **window** (W = chunk_len / 4, {cl // 4} at seq {s}): a query reaches at most one"
      " chunk back, so only shift 1 is taken: one K/V move in the forward, one dK/dV return"
      " in the backward (the neighbour's contribution; the own chunk's stays home). Under zigzag the device's second half-chunk's neighbour"
      " lives at shift -1 (= 7), so zigzag takes steps 0, 1, 7 and moves about twice as much.",
      "- **chunked(chunk_len)**: the attention chunks coincide with the device chunks, so"
      " every device attends only to its own K/V: step 0 only, no collective at all.",
      "- **chunked(chunk_len / 2)**: chunks inside a device chunk: likewise no collective.",
      f"- **prefix_lm(seq / 16)** ({s // 16} at seq {s}, inside device 0's chunk): the prefix"
      " adds nothing beyond what causal already sends (the prefix keys are in chunk 0, which"
      " the causal ring brings to every device anyway), so it moves what causal moves.",
  ]


def _notes(rows, dtype):
  """Observations computed from the rows: the CPU backend's dtype of the K/V permutes, CSE,
  the dK/dV accumulators' dtype, zigzag's temp memory."""
  ok = {(r["seq"], r["name"]): r["res"] for r in rows if r["res"]}
  out = []
  c = next((r for (s, n), r in sorted(ok.items()) if n == "causal"), None)
  if c:
    (fn, fb), (ln, lb) = _cp(c, "fwd"), _cp(c, "fwd", "lowered")
    (bn, _), (lbn, _) = _cp(c, "fwd_bwd"), _cp(c, "fwd_bwd", "lowered")
    if fn and ln:
      out.append(
          f"- dtype on the wire: the lowered program sends K/V as {dtype} ({_mib(lb / ln)} MiB"
          f" per permute for causal at seq {min(s for s, n in ok if n == 'causal')}); the"
          f" compiled CPU program sends {_mib(fb / fn)} MiB per K/V permute. XLA:CPU's"
          " `float-normalization-bf16` pass rewrites a bf16 collective-permute to float32"
          " (seen with `--xla_dump_hlo_pass_re`), so the `compiled` bytes are the CPU"
          " backend's; GPU and TPU collectives take bf16 as it is, so the `lowered` column (less"
          " the CSE below) is the better estimate for them (not checked here)." if dtype == "bfloat16" else
          f"- dtype on the wire: {dtype} K/V, {_mib(fb / fn)} MiB per permute (compiled) and"
          f" {_mib(lb / ln)} MiB (lowered).")
    out.append(
        f"- CSE: the compiled fwd+bwd causal program has {bn} permutes against {lbn} in the"
        " lowered one: the backward's first K/V move is the same op on the same operand as the"
        " forward's, and XLA shares it; the later moves are not shared (each step's"
        " optimization barrier gives the backward's chunk its own value), so the backward"
        " re-sends K/V instead of keeping all chunks alive.")
    out.append(
        "- dK/dV travel as float32 accumulators (the ring's accumulation dtype) whatever the"
        " input dtype: in the lowered bf16 program every dK/dV permute is twice a K/V permute,"
        " so the backward moves about 2x the forward's K/V bytes on top of re-sending K/V.")
  zz = [(s, ok[(s, "causal")]["fwd_bwd"]["temp"], ok[(s, "causal zigzag")]["fwd_bwd"]["temp"])
        for s in sorted({s for s, _ in ok}) if (s, "causal") in ok and (s, "causal zigzag") in ok]
  if zz:
    out.append(
        "- zigzag holds more: fwd+bwd temp of causal zigzag vs contiguous "
        + ", ".join(f"{_mib(z)} vs {_mib(t)} MiB ({z / t:.1f}x) at seq {s}" for s, t, z in zz)
        + ": the excess grows with seq (O(local seq), many local-sized buffers), although both"
        " layouts move the same bytes (the same permutes). Not from the transfers, so likely"
        " from the per-step work on two half-chunk pieces (4 pairs per step, each with its"
        " slices and accumulator updates); not investigated further here.")
  return out


def write_md(path, rows, seqs, elapsed, quick, dtype):
  date = subprocess.run(["date", "-u"], capture_output=True, text=True, check=False).stdout.strip()
  head = "| " + " | ".join(HEAD) + " |"
  lines = [
      "# Ring attention: what it moves and holds per device (compiled HLO)",
      "",
      f"`python benchmarks/ring_comm.py{' --quick' if quick else ''}"
      f"{'' if dtype == DTYPE else ' --dtype ' + dtype}`, {date}, jax {jax.__version__},"
      f" {os.cpu_count()} CPU cores; 8 virtual CPU devices; bytes and memory from the compiled"
      f" HLO, not timed. Total {elapsed:.0f} s.",
      "",
      f"Configuration: {N} devices on mesh axis `sp` (the sequence sharded, contiguous chunks"
      f" of chunk_len = seq / {N}, or zigzag half-chunks), batch {B}, {H} heads, {HKV} kv heads"
      f" (MHA), head_dim {D}, {dtype}, `ring_attention(..., implementation=\"blockwise\","
      f" block_q={BLOCK}, block_kv={BLOCK})`. fwd: a program returning out; fwd+bwd: out and"
      " the VJP (dq, dk, dv) for a given cotangent, in one jit(shard_map). Masks: "
      + "; ".join(f"{k}: `{v}`" for k, v in MASK_DOC.items()) + ".",
      "",
      "Columns: permutes = collective-permute instructions of `compiled.as_text()` (static;"
      " none sit inside a loop body unless noted); MiB = the sum of their operands per device;"
      " MiB / permute = fwd+bwd MiB / fwd+bwd permutes; x causal = fwd+bwd bytes over the"
      " contiguous causal ring's at the same seq; lowered = the same count of the HLO before"
      " XLA's passes (`lowered.as_text(dialect=\"hlo\")`); other collectives = all-gather,"
      " all-reduce, all-to-all, reduce-scatter of the fwd+bwd program; temp / peak ="
      " `memory_analysis()` of the fwd+bwd program, temp and temp + arguments + outputs;"
      " compile s = XLA compile (after lowering) of each program.",
      "",
      head,
      "|" + "|".join("---" if h in ("mask", "layout", "ring steps (shifts)") else "---:"
                     for h in HEAD) + "|",
  ]
  lines += ["| " + " | ".join(r) + " |" for r in table_rows(rows)]
  nested = [(r["seq"], r["name"]) for r in rows if r["res"] and any(
      v["nested"] for t in ("fwd", "fwd_bwd") for v in r["res"][t]["compiled"].values())]
  if nested:
    lines += ["", f"Note: collectives inside a nested computation (count is static) in {nested}."]
  lines += ["", "## Check: window moves <= 1/3 of the causal ring's collective-permute bytes", ""]
  lines += checks(rows)
  lines += ["", "## Static schedule (`ring_schedule`): the ring steps taken", ""]
  lines += ["| seq | mask | layout | shifts taken | K/V moves (fwd) | dK/dV moves (bwd) |",
            "|---:|---|---|---|---:|---:|"]
  for r in rows:
    sc = r["sched"]
    lines.append(f"| {r['seq']} | {r['name']} | {r['layout']} | {sc['shifts']} |"
                 f" {sc['kv_moves']} | {sc['dkv_moves']} |")
  lines += ["", "## What each mask moves", ""] + _sentences(rows, seqs)
  lines += ["", "## Notes", ""] + _notes(rows, dtype)
  pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
  pathlib.Path(path).write_text("\n".join(lines) + "\n")


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="seq 16384 only")
  p.add_argument("--seqs", type=int, nargs="+", default=list(SEQS))
  p.add_argument("--timeout", type=float, default=300.0,
                 help="seconds per (seq, mask) subprocess (both compiles) before it is skipped")
  p.add_argument("--out", default=str(RESULTS / "ring_comm.md"))
  p.add_argument("--json", default=str(RESULTS / "ring_comm.json"))
  p.add_argument("--dtype", default=DTYPE, choices=("bfloat16", "float32"))
  p.add_argument("--child", nargs=4, metavar=("SEQ", "MASK", "LAYOUT", "DTYPE"),
                 help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    seq, mask, layout, dtype = args.child
    print("RESULT " + json.dumps(measure(int(seq), mask, layout, dtype)), flush=True)
    return 0
  seqs = [16384] if args.quick else args.seqs
  for seq in seqs:
    if seq % (2 * N):
      p.error(f"seq {seq} must be a multiple of {2 * N}")
  print(f"jax {jax.__version__}, {N} devices, B={B} H={H} Hkv={HKV} D={D} {args.dtype}, block {BLOCK}")
  rows = []
  t0 = time.time()
  for seq in seqs:
    for name, mask, layout in CONFIGS:
      sched = schedule(seq, mask, layout)
      res, skip, wall = _run_child(seq, mask, layout, args.dtype, args.timeout)
      rows.append({"seq": seq, "name": name, "mask": mask, "layout": layout, "sched": sched,
                   "res": res, "skip": skip, "wall_s": wall})
      if res:
        fn, fb = _cp(res, "fwd")
        bn, bb = _cp(res, "fwd_bwd")
        print(f"seq {seq:6d} {name:14s} shifts {sched['shifts']}  fwd {fn:2d} permutes"
              f" {_mib(fb):>8s} MiB  fwd+bwd {bn:2d} permutes {_mib(bb):>8s} MiB  temp"
              f" {_mib(res['fwd_bwd']['temp']):>8s} MiB  compile {res['fwd']['compile_s']:.1f} s +"
              f" {res['fwd_bwd']['compile_s']:.1f} s ({wall:.0f} s with the subprocess)", flush=True)
      else:
        print(f"seq {seq:6d} {name:14s} shifts {sched['shifts']}  SKIPPED: {skip}", flush=True)
  elapsed = time.time() - t0
  _print_table(rows)
  for line in checks(rows):
    print(line)
  write_md(args.out, rows, seqs, elapsed, args.quick, args.dtype)
  pathlib.Path(args.json).write_text(json.dumps(
      {"jax": jax.__version__, "devices": N, "B": B, "H": H, "Hkv": HKV, "D": D, "dtype": args.dtype,
       "block": BLOCK, "elapsed_s": elapsed, "rows": rows}, indent=1) + "\n")
  print(f"wrote {args.out} and {args.json} ({elapsed:.0f} s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
