"""Ring attention on virtual CPU devices: per-device compiled memory and wall time.

Measures forward + backward (a VJP with given cotangents, so the program holds no
loss reduction) of `flashvjp.ring_attention` over 1, 2, 4 and 8 virtual CPU devices,
and of single-device `flashvjp.flash_attention` (blockwise), at a fixed global shape:
  * memory: `compile().memory_analysis()` per device (temp, and arguments+outputs),
    compile only, for every seq up to 64k;
  * time: median of a few runs where seq is small enough for this machine.

    python benchmarks/ring_bench.py                 # writes benchmarks/results/ring_cpu.md
    python benchmarks/ring_bench.py --quick         # two seqs, one timing run

Virtual CPU devices share the host's cores and memory: the time column shows the
ring's overhead (extra kernel launches, copies for the permutes), not a speedup, and
says nothing about compute/communication overlap (see the notes in the results file).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
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

B, H, HKV, D = 1, 4, 4, 64
BLOCK = 512
DEVICES = (1, 2, 4, 8)
RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "ring_cpu.md"


def _ring_program(n, causal, layout):
  mesh = Mesh(np.asarray(jax.devices()[:n]), ("sp",))
  s4, s3 = P(None, None, "sp", None), P(None, None, "sp")

  def local(q, k, v, dout, dlse):
    f = lambda q, k, v: flashvjp.ring_attention(
        q, k, v, axis_name="sp", causal=causal, layout=layout, return_lse=True,
        implementation="blockwise", block_q=BLOCK, block_kv=BLOCK)
    (out, lse), vjp = jax.vjp(f, q, k, v)
    return (out, lse) + tuple(vjp((dout, dlse)))

  fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(s4, s4, s4, s4, s3),
                             out_specs=(s4, s3, s4, s4, s4)))
  shard = lambda nd: NamedSharding(mesh, s4 if nd == 4 else s3)
  return fn, shard


def _single_program(causal):
  def f(q, k, v, dout, dlse):
    g = lambda q, k, v: flashvjp.flash_attention(
        q, k, v, causal=causal, return_lse=True, implementation="blockwise", block_q=BLOCK,
        block_kv=BLOCK)
    (out, lse), vjp = jax.vjp(g, q, k, v)
    return (out, lse) + tuple(vjp((dout, dlse)))
  dev = jax.devices()[0]
  return jax.jit(f), lambda nd: jax.sharding.SingleDeviceSharding(dev)


def _shapes(seq):
  return [(B, H, seq, D), (B, HKV, seq, D), (B, HKV, seq, D), (B, H, seq, D), (B, H, seq)]


def measure(program, shard, seq, runs):
  """(temp bytes, args+outputs bytes per device, median seconds or None)."""
  structs = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=shard(len(s))) for s in _shapes(seq)]
  compiled = program.lower(*structs).compile()
  mem = compiled.memory_analysis()
  io = mem.argument_size_in_bytes + mem.output_size_in_bytes
  if not runs:
    return mem.temp_size_in_bytes, io, None
  rng = np.random.default_rng(0)
  args = [jax.device_put(rng.standard_normal(s).astype(np.float32), shard(len(s)))
          for s in _shapes(seq)]
  jax.block_until_ready(compiled(*args))  # warm-up
  times = []
  for _ in range(runs):
    t = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t)
  return mem.temp_size_in_bytes, io, statistics.median(times)


def _mib(b):
  return f"{b / 2**20:.2f}"


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true")
  p.add_argument("--out", default=str(RESULTS))
  args = p.parse_args()
  seqs = (2048, 8192) if args.quick else (2048, 4096, 16384, 65536)
  timed = {2048: 1 if args.quick else 3, 4096: 2}  # seq -> timing runs; others: memory only
  configs = [("single device flash_attention", None, None)] + [
      (f"ring, {n} devices, {layout}", n, layout) for n in DEVICES
      for layout in (("contiguous", "zigzag") if n > 1 else ("contiguous",))]
  rows = []
  t0 = time.time()
  for seq in seqs:
    for name, n, layout in configs:
      prog, shard = _single_program(True) if n is None else _ring_program(n, True, layout)
      temp, io, secs = measure(prog, shard, seq, timed.get(seq, 0))
      rows.append((seq, name, temp, io, secs))
      print(f"seq {seq:6d} {name:34s} temp {_mib(temp):>9s} MiB  args+out {_mib(io):>8s} MiB"
            f"  {'-' if secs is None else f'{secs * 1e3:.0f} ms'}", flush=True)
  elapsed = time.time() - t0

  lines = [
      "# Ring attention on virtual CPU devices",
      "",
      f"`python benchmarks/ring_bench.py{' --quick' if args.quick else ''}` on jax {jax.__version__},"
      f" {os.cpu_count()} CPU cores, 8 virtual CPU devices (`--xla_force_host_platform_device_count=8`);"
      f" {elapsed:.0f} s.",
      "",
      f"Forward + backward (VJP with given cotangents for out and lse) of causal attention,"
      f" float32, batch {B}, {H} heads ({HKV} kv heads), head_dim {D}, blockwise kernels with"
      f" {BLOCK}x{BLOCK} blocks. Memory is XLA's compiled `memory_analysis()` per device:"
      " temp (scratch) and arguments + outputs (q, k, v, cotangents in; out, lse, dq, dk, dv out)."
      " Time is the median wall time of the whole SPMD program; `-` = memory only.",
      "",
      "| global seq | program | temp MiB / device | args+out MiB / device | total MiB / device | time ms |",
      "|---:|---|---:|---:|---:|---:|",
  ]
  for seq, name, temp, io, secs in rows:
    lines.append(f"| {seq} | {name} | {_mib(temp)} | {_mib(io)} | {_mib(temp + io)} |"
                 f" {'-' if secs is None else f'{secs * 1e3:.0f}'} |")
  lines += [
      "",
      "## What this shows, and what it cannot",
      "",
      "- Per-device memory is O(local seq) plus a constant: the constant is the kernels' score"
      f" tiles (batch x heads x {BLOCK} x {BLOCK} float32, a few of them live in the backward,"
      " ~16 MiB here), the O(local seq) part is the local q, k, v, out, the kv chunk in hand and"
      " the one arriving (double buffering), and the dK/dV accumulators travelling with their"
      " chunk. Nothing is O(seq^2) and K/V are never all-gathered. At short sequences the"
      " constant dominates and the ring's extra buffers (about 2-3 local-sized arrays more than"
      " one device keeps) show; at long sequences the per-device total falls ~1/devices. With"
      " one device XLA removes the ring's buffers (the permute is the identity).",
      "- Time: the 8 virtual devices are threads on the same few cores, so the ring cannot be"
      " faster than one device here; the rows measure its overhead (more, smaller kernel calls,"
      " the permute copies, merging partial results through lse). Contiguous and zigzag do the"
      " same total work (skipped future chunks are not computed), so on shared cores they cost"
      " about the same; zigzag's gain is balance across devices (every device does one causal"
      " chunk pair and P-1 half pairs instead of device P-1 doing P full pairs), which only"
      " shows on real parallel devices.",
      "- The timings come from a small machine that may be shared with other jobs: differences"
      " below about 2x between rows are noise.",
      "- Overlap of the K/V transfer with compute cannot be observed on CPU: a CPU"
      " collective-permute is a memcpy between buffers of the same process. The program issues"
      " the next step's ppermute before the current step's compute (no data dependence between"
      " them), which is what lets XLA's GPU/TPU latency-hiding scheduler run them concurrently;"
      " measure that on GPUs (NCCL) with a profiler.",
  ]
  pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  pathlib.Path(args.out).write_text("\n".join(lines) + "\n")
  print(f"wrote {args.out} ({elapsed:.0f} s)")


if __name__ == "__main__":
  sys.exit(main())
