"""Arrays a mod reads by position, under sequence sharding: split like the tokens, or copied whole.

Issue 32: `document_causal(doc_ids)` and a per-key bias vector `s + bias[kv_idx]`, with the
arrays placed sharded like the tokens, compiled deviceless for 8 x H100 (the CUDA plugin's
XLA GPU pipeline; `jax.experimental.topologies`) as jit(value_and_grad) of one attention
layer under the ring. Two rows, the same program and one process:

* "whole copies": the partitioning rule told that no family reads aligned arrays
  (`flashvjp._partition._ALIGNS = ()`): what every version before `flashvjp/_aligned.py` did;
* "split (default)": the arrays keep the tokens' sharding.

Read from the compiled per-device HLO: the collectives whose result holds a
whole-sequence array (their count and bytes per device), and `memory_analysis()`. Usage:

    JAX_PLATFORMS=cpu python benchmarks/position_arrays_cp.py [--seq-len 131072]

Needs the CUDA plugin (pip install 'flashvjp[aot-gpu]'). Results:
benchmarks/results/position_arrays_cp.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flashvjp
from flashvjp import _partition
from flashvjp import _plan

RESULTS = pathlib.Path(__file__).parent / "results" / "position_arrays_cp.md"


def _compile(seq: int, heads: int, kv_heads: int, dim: int, split: bool):
  _plan._cpu_host()  # pylint: disable=protected-access
  _, platform, what, n, _ = _plan._resolve_target("h100x8", None)  # pylint: disable=protected-access
  topo = _plan._topology(platform, what, n)  # pylint: disable=protected-access
  from jax.experimental import topologies
  mesh = topologies.make_mesh(topo, (8,), ("sp",))
  tok = NamedSharding(mesh, P(None, None, "sp", None))
  q = jax.ShapeDtypeStruct((1, heads, seq, dim), jnp.bfloat16, sharding=tok)
  kv = jax.ShapeDtypeStruct((1, kv_heads, seq, dim), jnp.bfloat16, sharding=tok)
  doc = jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=NamedSharding(mesh, P(None, "sp")))
  bias = jax.ShapeDtypeStruct((seq,), jnp.float32, sharding=NamedSharding(mesh, P("sp")))

  def loss(q, k, v, bias, doc):
    out = flashvjp.flash_attention(
        q, k, v, implementation="pallas_triton", interpret=False, context_parallel="ring",
        mask_mod=flashvjp.document_causal(doc),
        score_mod=lambda s, b, h, i, j: s + bias[j])
    return jnp.sum(out.astype(jnp.float32))

  saved = _partition._ALIGNS  # pylint: disable=protected-access
  _partition._ALIGNS = saved if split else ()  # pylint: disable=protected-access
  try:
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).lower(
        q, kv, kv, bias, doc).compile()
  finally:
    _partition._ALIGNS = saved  # pylint: disable=protected-access
  hlo = compiled.as_text()
  mem = compiled.memory_analysis()
  whole = []
  for c in _plan.collectives(hlo, seq, True):
    dims = [tuple(int(d) for d in s.split("[")[1].rstrip("]").split(",") if d) for s in c.shapes]
    if any(seq in d for d in dims):
      whole.append(c)
  return whole, mem


def _row(args, split: bool) -> dict:
  whole, mem = _compile(args.seq_len, args.num_heads, args.num_kv_heads, args.head_dim, split)
  return dict(ops=", ".join(f"{c.count} x {c.op} {'/'.join(c.shapes)}" for c in whole) or "none",
              bytes=sum(c.bytes * c.count for c in whole), arg=mem.argument_size_in_bytes,
              temp=mem.temp_size_in_bytes)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--seq-len", type=int, default=131072)
  ap.add_argument("--num-heads", type=int, default=32)
  ap.add_argument("--num-kv-heads", type=int, default=8)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--out", type=pathlib.Path, default=RESULTS)
  ap.add_argument("--row", choices=("whole", "split"), help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.row:  # one row, in its own process (jax caches compiled programs per process)
    print("ROW " + json.dumps(_row(args, args.row == "split")))
    return 0
  rows = []
  for name, row in (("whole copies (before)", "whole"), ("split (default)", "split")):
    cmd = [sys.executable, __file__, "--row", row, "--seq-len", str(args.seq_len),
           "--num-heads", str(args.num_heads), "--num-kv-heads", str(args.num_kv_heads),
           "--head-dim", str(args.head_dim)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    r = json.loads(next(line[4:] for line in out.splitlines() if line.startswith("ROW ")))
    rows.append((name, r["ops"], r["bytes"], r["arg"], r["temp"]))
  mib = lambda b: f"{b / 2**20:.2f}"
  lines = [
      "# Position-indexed arrays under sequence sharding (issue 32)", "",
      f"{datetime.date.today()}, jax {jax.__version__}, deviceless 8 x H100 (CUDA plugin),"
      f" `benchmarks/position_arrays_cp.py`. One layer, B=1 H={args.num_heads}/"
      f"{args.num_kv_heads} S={args.seq_len} D={args.head_dim} bf16, jit(value_and_grad),"
      " pallas_triton compiled, ring over 8 devices; `mask_mod=document_causal(doc)` (int32"
      " [1, S], placed P(None, 'sp')) and `score_mod=s + bias[kv_idx]` (float32 [S], placed"
      " P('sp')). Per device, from the compiled HLO and `memory_analysis()`.", "",
      "| arrays | collectives holding a whole-sequence array | their bytes (MiB) |"
      " arguments (MiB) | temp (MiB) |",
      "|---|---|---|---|---|"]
  for name, ops, nbytes, arg, tmp in rows:
    lines.append(f"| {name} | {ops} | {mib(nbytes)} | {mib(arg)} | {mib(tmp)} |")
  lines += ["", "'whole copies' is the partitioning rule told that no family reads aligned"
            " arrays (`flashvjp._partition._ALIGNS = ()`), i.e. every version before"
            " `flashvjp/_aligned.py`: the rule demanded the arrays replicated, so XLA"
            " all-gathered them (one tuple all-gather of both) and every device held whole"
            " copies. Split: the ring reads each device's slice and sends the key-aligned ones"
            " round with K/V (in the collective-permutes, not counted here: S/8 elements per"
            " array per step). Each row is compiled in its own process (in one process the"
            " second compile reused the first's program)."]
  text = "\n".join(lines) + "\n"
  print(text)
  args.out.write_text(text)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
