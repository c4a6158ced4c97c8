"""Sequence sharding under plain jax.jit: what each context-parallel strategy moves and holds.

Nothing is run: every figure comes from compiling `jax.jit(jax.value_and_grad(loss))` around
plain `flashvjp.flash_attention` with q / k / v `jax.ShapeDtypeStruct`s placed with
`NamedSharding(mesh, P(None, None, "sp", None))` over 8 virtual CPU devices (the
partitioning rule, flashvjp/_partition.py, runs the strategy inside the partition):

  * collectives of ``compiled.as_text()`` (kind, count, bytes of their operands per device;
    `benchmarks/ring_comm.py`'s parser), forward-only and forward + backward programs;
  * per-device memory: ``compiled.memory_analysis()`` of the forward + backward program
    (temp, and temp + arguments + outputs);
  * the cost model's estimate (`flashvjp._strategy`, what `"auto"` weighs) beside the
    compiled bytes, and which strategy `"auto"` picks.

Rows: strategy in (ring, ulysses, all_gather) x mask in (causal, window, chunked, prefix)
x seq. Each row is its own subprocess with a time limit (a compile that runs too long
becomes a skipped row).

    python benchmarks/cp_strategies.py            # seq 16k, 32k, 64k -> results/cp_strategies.md
    python benchmarks/cp_strategies.py --quick    # seq 16k only
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8"
                           + " --xla_cpu_experimental_ynn_fusion_type=individual_dot")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from ring_comm import MASK_DOC  # the ring benchmark's masks, the same definitions
from ring_comm import collectives
from ring_comm import mask_kwargs

import flashvjp

N, B, H, HKV, D = 8, 1, 8, 8, 64
DTYPE = "bfloat16"
BLOCK = 512
SEQS = (16384, 32768, 65536)
STRATEGIES = ("ring", "ulysses", "all_gather")
MASKS = ("causal", "window", "chunked", "prefix")
RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def measure(seq: int, mask: str, strategy: str) -> dict:
  mesh = Mesh(np.asarray(jax.devices()[:N]), ("sp",))
  sh = NamedSharding(mesh, P(None, None, "sp", None))
  kw = dict(mask_kwargs(mask, seq), block_q=BLOCK, block_kv=BLOCK)
  q = jax.ShapeDtypeStruct((B, H, seq, D), jnp.dtype(DTYPE), sharding=sh)
  kv = jax.ShapeDtypeStruct((B, HKV, seq, D), jnp.dtype(DTYPE), sharding=sh)
  attn = lambda q, k, v: flashvjp.flash_attention(q, k, v, context_parallel=strategy, **kw)
  loss = lambda q, k, v, w: jnp.sum((attn(q, k, v) * w).astype(jnp.float32))
  progs = {"fwd": (jax.jit(attn), (q, kv, kv)),
           "fwd_bwd": (jax.jit(jax.value_and_grad(loss, (0, 1, 2))), (q, kv, kv, q))}
  res = {"auto": flashvjp.explain(q, kv, kv, **kw).context_parallel.name,
         "model": {}}
  chosen = flashvjp.explain(q, kv, kv, context_parallel=strategy, **kw).context_parallel
  res["model"] = {"fwd": chosen.bytes_forward, "bwd": chosen.bytes_backward}
  for tag, (fn, structs) in progs.items():
    t0 = time.perf_counter()
    compiled = fn.lower(*structs).compile()
    mem = compiled.memory_analysis()
    res[tag] = {"compile_s": time.perf_counter() - t0,
                "collectives": collectives(compiled.as_text()),
                "temp": mem.temp_size_in_bytes, "args": mem.argument_size_in_bytes,
                "outputs": mem.output_size_in_bytes}
  return res


def _child(seq, mask, strategy, timeout):
  cmd = [sys.executable, __file__, "--child", str(seq), mask, strategy]
  try:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
  except subprocess.TimeoutExpired:
    return {"error": f"timeout after {timeout} s"}
  if p.returncode:
    return {"error": (p.stderr.strip().splitlines() or ["?"])[-1][:200]}
  return json.loads(p.stdout.strip().splitlines()[-1])


def _mib(b):
  return f"{b / 2**20:.2f}"


# Bytes a device receives per byte of its operand, by collective kind (P = N devices; a
# ring all-reduce sends and receives 2 (P-1)/P of its operand).
WIRE = {"collective-permute": 1.0, "all-gather": N - 1, "all-to-all": (N - 1) / N,
        "reduce-scatter": (N - 1) / N, "all-reduce": 2 * (N - 1) / N}


def _moved(r, tag):
  """Bytes each device receives over the wire (operand bytes x WIRE of its kind)."""
  return sum(v["bytes"] * WIRE[k] for k, v in r[tag]["collectives"].items())


def _kinds(r, tag):
  return ", ".join(f"{k} {v['count']}" for k, v in r[tag]["collectives"].items() if v["count"])


def table(rows):
  head = ("| seq | mask | strategy | auto picks | collectives (fwd+bwd) | fwd MiB | fwd+bwd MiB"
          " | model fwd+bwd MiB | x ring (fwd+bwd) | temp MiB | peak MiB | compile s |")
  lines = [head, "|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  ring = {(s, m): r for s, m, st, r in rows if st == "ring" and "error" not in r}
  for seq, mask, st, r in rows:
    if "error" in r:
      lines.append(f"| {seq} | {mask} | {st} | | {r['error']} | | | | | | | |")
      continue
    tot = _moved(r, "fwd_bwd")
    base = ring.get((seq, mask))
    x = "-" if base is None or _moved(base, "fwd_bwd") < 2**10 else \
        f"{tot / _moved(base, 'fwd_bwd'):.2f}"
    fb = r["fwd_bwd"]
    lines.append(
        f"| {seq} | {mask} | {st} | {r['auto']} | {_kinds(r, 'fwd_bwd') or 'none'} |"
        f" {_mib(_moved(r, 'fwd'))} | {_mib(tot)} | {_mib(r['model']['fwd'] + r['model']['bwd'])}"
        f" | {x} | {_mib(fb['temp'])} | {_mib(fb['temp'] + fb['args'] + fb['outputs'])} |"
        f" {r['fwd']['compile_s']:.1f}, {fb['compile_s']:.1f} |")
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--child", nargs=3)
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--seqs", type=int, nargs="*")
  ap.add_argument("--timeout", type=int, default=300)
  ap.add_argument("--out", default=str(RESULTS / "cp_strategies.md"))
  a = ap.parse_args()
  if a.child:
    seq, mask, st = a.child
    print(json.dumps(measure(int(seq), mask, st)))
    return
  seqs = a.seqs or ((SEQS[0],) if a.quick else SEQS)
  t0 = time.time()
  rows = []
  for seq in seqs:
    for mask in MASKS:
      for st in STRATEGIES:
        r = _child(seq, mask, st, a.timeout)
        rows.append((seq, mask, st, r))
        print(seq, mask, st, "error" if "error" in r else _mib(_moved(r, "fwd_bwd")), flush=True)
  md = f"""# Sequence sharding under plain jit: what each strategy moves and holds (compiled HLO)

`python benchmarks/cp_strategies.py`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())},
jax {jax.__version__}, 2 CPU cores; 8 virtual CPU devices; bytes and memory from the compiled
program, nothing timed. Total {time.time() - t0:.0f} s.

Configuration: `jax.jit(jax.value_and_grad(loss))` around plain
`flashvjp.flash_attention(q, k, v, context_parallel=<strategy>, block_q={BLOCK},
block_kv={BLOCK}, <mask>)` with q / k / v placed with `NamedSharding(mesh, P(None, None,
"sp", None))`, mesh axis `sp` of 8 devices, batch {B}, {H} heads, {HKV} kv heads (MHA, so
Ulysses is eligible), head_dim {D}, {DTYPE}. Masks (chunk_len = seq / 8): """ + "; ".join(
      f"{m}: `{MASK_DOC[m]}`" for m in MASKS) + """.

Columns: collectives = kind and count in the fwd+bwd program (an async start/done pair once);
MiB = what each device receives over the wire: the operand bytes of each collective times
(P-1) for an all-gather, (P-1)/P for an all-to-all or a reduce-scatter, 1 for a
collective-permute, 2 (P-1)/P for an all-reduce; model = the cost model's estimate
(`flashvjp._strategy`, what `"auto"` weighs; bf16 K/V, float32 dK/dV; the same wire count);
x ring = fwd+bwd bytes over the ring's at the same seq and mask; temp / peak =
`memory_analysis()` of the fwd+bwd program per device (temp; temp + arguments + outputs);
auto picks = `flashvjp.explain(...).context_parallel.name` for the same call. XLA:CPU
computes bf16 collectives in float32 where it converts (the compiled bytes of a bf16 ring
chunk are a float32 chunk's), so compiled MiB can exceed the model's.

Reading it: for MHA (8 heads on 8 shards) with a dense mask (causal, prefix) Ulysses moves
about a quarter of the ring's bytes and `"auto"` takes it; with a local mask (a window
shorter than a chunk, chunked) the ring takes one neighbour step or none and `"auto"` takes
the ring; all-gather moves what the ring moves for a dense mask but holds K/V (and dK/dV)
whole: its temp memory is the one that grows as O(seq) per device. With GQA, or heads that
the shard count does not divide, Ulysses is not eligible (tests/test_partition_seq.py's
choice table).

""" + table(rows) + "\n"
  pathlib.Path(a.out).write_text(md)
  (pathlib.Path(a.out).with_suffix(".json")).write_text(json.dumps(
      [{"seq": s, "mask": m, "strategy": st, **r} for s, m, st, r in rows], indent=1))
  print(md)


if __name__ == "__main__":
  main()
