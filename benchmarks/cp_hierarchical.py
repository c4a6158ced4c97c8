"""Context parallelism across nodes: ring over all, Ulysses where it can run, and usp.

Nothing runs on a GPU: each row compiles `jax.jit(jax.value_and_grad(loss))` of one causal
attention layer for 4 nodes x 8 H100 WITHOUT the hardware (`flashvjp.plan("h100x32")`: the
CUDA plugin's deviceless topology, one process per node, the sequence sharded over
("node", "gpu")), and reads what the compiler says:

  * bytes per link class: what the busiest device sends inside its node (NVLink) and to
    other nodes (InfiniBand), from the compiled HLO's collectives and their device groups
    (`flashvjp._plan.link_bytes`), beside the cost model's estimate (`flashvjp._strategy`,
    what `"auto"` weighs);
  * per-device memory (`memory_analysis()`: arguments + outputs + temp);
  * a step-time floor from the links alone: max(in-node bytes / 450 GB/s, across-node bytes
    / 50 GB/s) per device (H100 NVLink 4 and one 400 Gb/s NIC per GPU): communication only,
    no compute and no overlap: a bound, not a measured time;
  * the compile time on this machine.

Rows: seq 128k and 512k x heads (32 / 8 GQA: Ulysses over all 32 cannot run; 32 / 32 MHA:
it can) x strategy; the one "auto" picks is marked.

    python benchmarks/cp_hierarchical.py            # -> results/cp_hierarchical.md (+ .json)
    python benchmarks/cp_hierarchical.py --quick    # seq 128k only
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flashvjp
from flashvjp import _strategy

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
TARGET = "h100x32"
SEQS = (131072, 524288)
HEADS = ((32, 8), (32, 32))
STRATEGIES = ("ring", "ulysses", "usp")
IN_BW, ACROSS_BW = _strategy.BANDWIDTHS["H100"]


def measure(seq: int, heads: int, kv_heads: int, strategy: str) -> dict:
  row = dict(seq=seq, heads=heads, kv_heads=kv_heads, strategy=strategy)
  start = time.perf_counter()
  try:
    p = flashvjp.plan(TARGET, batch=1, num_heads=heads, num_kv_heads=kv_heads, seq_len=seq,
                      head_dim=128, causal=True, context_parallel=strategy,
                      modes=("value_and_grad",))
  except (ValueError, RuntimeError) as e:
    row["refused"] = str(e).split(";")[0][:160]
    return row
  m = p.mode("value_and_grad")
  st = m.decision.context_parallel
  links = dict(m.links)
  row.update(
      name=st.name, split=(f"Ulysses {st.ulysses_axes}, ring {st.ring_axes}"
                           if st.name == "usp" else f"{st.name} {st.seq_axes}"),
      in_node=links.get("in_node", 0), across=links.get("across_nodes", 0),
      est=dict(st.link_bytes), memory=m.total_bytes, temp=m.temp_bytes,
      floor=max(links.get("in_node", 0) / IN_BW, links.get("across_nodes", 0) / ACROSS_BW),
      compile=m.compile_seconds, wall=time.perf_counter() - start)
  return row


def auto_choice(seq: int, heads: int, kv_heads: int) -> str:
  import jax
  import jax.numpy as jnp
  from jax.experimental import topologies
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from flashvjp import _plan
  _, _, what, n, _ = _plan._resolve_target(TARGET, None)
  topo = _plan._topology("gpu", what, n, 4)
  mesh = topologies.make_mesh(topo, (4, 8), ("node", "gpu"))
  sh = NamedSharding(mesh, P(None, None, ("node", "gpu"), None))
  q = jax.ShapeDtypeStruct((1, heads, seq, 128), jnp.bfloat16, sharding=sh)
  kv = jax.ShapeDtypeStruct((1, kv_heads, seq, 128), jnp.bfloat16, sharding=sh)
  return flashvjp.explain(q, kv, kv, causal=True).context_parallel.name


def _b(x: float) -> str:
  return f"{x / 2**30:.2f} GiB" if x >= 2**30 else f"{x / 2**20:.1f} MiB"


def table(rows: list[dict]) -> str:
  out = ["| seq | heads (kv) | strategy | split | across nodes (HLO / model) | in node (HLO / model)"
         " | memory per device (temp) | link floor | compile |",
         "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    head = f"| {r['seq'] // 1024}k | {r['heads']} ({r['kv_heads']}) | "
    mark = " **(auto)**" if r.get("auto") else ""
    if "refused" in r:
      out.append(head + f"{r['strategy']} | refused: {r['refused']} | | | | | |")
      continue
    est = r["est"]
    out.append(
        head + f"{r['strategy']}{mark} | {r['split']} | {_b(r['across'])} /"
        f" {_b(est.get('across_nodes', 0))} | {_b(r['in_node'])} / {_b(est.get('in_node', 0))}"
        f" | {_b(r['memory'])} ({_b(r['temp'])}) | {r['floor'] * 1e3:.1f} ms |"
        f" {r['compile']:.1f} s |")
  return "\n".join(out)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--out", default=str(RESULTS / "cp_hierarchical.md"))
  args = ap.parse_args()
  seqs = SEQS[:1] if args.quick else SEQS
  rows = []
  for seq in seqs:
    for heads, kv_heads in HEADS:
      chosen = auto_choice(seq, heads, kv_heads)
      for strategy in STRATEGIES:
        r = measure(seq, heads, kv_heads, strategy)
        r["auto"] = strategy == chosen
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "est"}), flush=True)
  # the done-when figures: usp against the ring over all 32 (GQA 32 / 8, the plan's case)
  notes = []
  for seq in seqs:
    by = {r["strategy"]: r for r in rows if r["seq"] == seq and r["kv_heads"] == 8}
    ring, usp = by["ring"], by["usp"]
    if "refused" not in ring and "refused" not in usp:
      notes.append(f"- {seq // 1024}k, 32 / 8 heads: the busiest device sends"
                   f" {ring['across'] / max(usp['across'], 1):.1f}x fewer bytes across nodes"
                   f" with usp than with the ring over all 32 ({_b(usp['across'])} vs"
                   f" {_b(ring['across'])}); memory per device {_b(usp['memory'])} vs"
                   f" {_b(ring['memory'])}; compile {usp['compile']:.1f} s vs"
                   f" {ring['compile']:.1f} s.")
  import jax
  import jaxlib
  text = "\n".join([
      "# Context parallelism across nodes: 4 nodes x 8 H100 (deviceless)",
      "",
      f"`python benchmarks/cp_hierarchical.py` ({time.strftime('%Y-%m-%d')}, jax"
      f" {jax.__version__}, jaxlib {jaxlib.__version__}; compiled on this CPU, no GPU). One"
      " causal layer, batch 1, head_dim 128, bf16, `jit(value_and_grad)`, the sequence over"
      " (node=4, gpu=8). Bytes: what the busiest device sends, from the compiled HLO's"
      " collectives and their device groups, beside the cost model's estimate. Link floor:"
      f" max(in-node / {IN_BW / 1e9:.0f} GB/s, across-node / {ACROSS_BW / 1e9:.0f} GB/s),"
      " communication only (no compute, no overlap): a bound, not a measured time. **(auto)**:"
      " what `context_parallel=\"auto\"` picks.",
      "",
      table(rows),
      "",
      *notes,
      ""])
  pathlib.Path(args.out).write_text(text)
  pathlib.Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1))
  print(text)


if __name__ == "__main__":
  main()
