"""mask_mod against the same mask given densely: fwd+bwd time, compiled memory, tiles computed.

CPU, blockwise (the CPU default), B=1, H=4, D=64, float32, seq 4k-16k; masks: prefix-LM
(prefix = seq/4), chunked (chunk 1024, causal), sliding window 512 + 64 global tokens
(causal). Each mask runs three ways in the same run: `mask_mod=` (block classes computed
inside the call), `mask_mod=` with a `block_mask=` built beforehand (`make_block_mask`,
timed separately), and `mask=` with the dense bool [1, 1, seq, seq] array (block skipping
from its per-block any). Times are the median of --repeats jitted calls of
value_and_grad; memory is the compiled program's (`memory_analysis`: temp bytes, and
argument bytes, which hold the dense mask). "tiles" is the fraction of (q block, kv block)
tiles that are not empty at the blockwise default blocks (256 x 256).

    python benchmarks/mask_mod.py            # seq 4096, 8192, 16384 -> results/mask_mod.md
    python benchmarks/mask_mod.py --quick    # seq 4096 only, nothing written
"""
from __future__ import annotations

import argparse
import functools
import os
import pathlib
import platform
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=individual_dot")

import jax
import jax.numpy as jnp
import numpy as np

import flashvjp

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
B, H, D = 1, 4, 64
MiB = 2.0**20


def masks(seq):
  return {
      "prefix-LM (seq/4)": flashvjp.prefix_lm(jnp.asarray([seq // 4], jnp.int32)),
      "chunked 1024": flashvjp.chunked(1024),
      "window 512 + 64 global": flashvjp.sliding_window_with_global(512, 64),
  }


def dense_of(mod, seq):
  """The mask_mod's dense bool [1, 1, seq, seq] (built row block by row block)."""
  rows = []
  kv = jnp.arange(seq, dtype=jnp.int32)[None, None, None, :]
  for start in range(0, seq, 1024):
    q = jnp.arange(start, min(start + 1024, seq), dtype=jnp.int32)[None, None, :, None]
    rows.append(np.asarray(jnp.broadcast_to(mod(jnp.zeros((1, 1, 1, 1), jnp.int32),
                                                jnp.zeros((1, 1, 1, 1), jnp.int32), q, kv),
                                            (1, 1, q.shape[2], seq))))
  return jnp.asarray(np.concatenate(rows, axis=2))


def measure(fn, args, repeats):
  jitted = jax.jit(fn)
  compiled = jitted.lower(*args).compile()
  mem = compiled.memory_analysis()
  jax.block_until_ready(jitted(*args))  # warm-up
  times = []
  for _ in range(repeats):
    t0 = time.process_time()
    jax.block_until_ready(jitted(*args))
    times.append(time.process_time() - t0)
  return statistics.median(times), mem.temp_size_in_bytes, mem.argument_size_in_bytes


def run(seqs, repeats):
  rows = []
  for seq in seqs:
    kq, kk, kv = jax.random.split(jax.random.key(seq), 3)
    q = jax.random.normal(kq, (B, H, seq, D), jnp.float32)
    k = jax.random.normal(kk, (B, H, seq, D), jnp.float32)
    v = jax.random.normal(kv, (B, H, seq, D), jnp.float32)
    for name, mod in masks(seq).items():
      def loss(q, k, v, **kw):
        return jnp.sum(flashvjp.flash_attention(q, k, v, implementation="blockwise", **kw) ** 2)

      vg = lambda f: jax.value_and_grad(f, (0, 1, 2))
      bm = flashvjp.make_block_mask(mod, B, H, seq, seq, 256, 256)  # compiles
      t0 = time.process_time()
      bm = flashvjp.make_block_mask(mod, B, H, seq, seq, 256, 256)
      jax.block_until_ready(bm.classes)
      t_make = time.process_time() - t0
      tiles = float(bm.fraction_computed())
      dense = dense_of(mod, seq)
      cells = {
          "mask_mod": measure(vg(functools.partial(loss, mask_mod=mod)), (q, k, v), repeats),
          "mask_mod + block_mask": measure(
              vg(lambda q, k, v, c, mod=mod, seq=seq: loss(
                  q, k, v, mask_mod=mod, block_mask=flashvjp.BlockMask(c, 256, 256, seq, seq, B, H))),
              (q, k, v, bm.classes), repeats),
          "dense mask": measure(vg(lambda q, k, v, m: loss(q, k, v, mask=m)), (q, k, v, dense),
                                repeats),
      }
      base = cells["dense mask"][0]
      for how, (t, temp, arg) in cells.items():
        rows.append(dict(seq=seq, mask=name, how=how, ms=1e3 * t, vs_dense=t / base,
                         temp_mib=temp / MiB, arg_mib=arg / MiB, tiles=tiles,
                         make_ms=1e3 * t_make if how == "mask_mod + block_mask" else None))
        print(f"{seq:6d} {name:24s} {how:22s} {1e3 * t:9.1f} ms  x{t / base:5.2f}  temp"
              f" {temp / MiB:7.1f} MiB  args {arg / MiB:7.1f} MiB  tiles {tiles:.3f}", flush=True)
  return rows


def table(rows):
  out = ["| seq | mask | how | fwd+bwd CPU ms | vs dense | temp MiB | args MiB | tiles computed |"
         " make_block_mask ms |", "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    make = "" if r["make_ms"] is None else f"{r['make_ms']:.0f}"
    out.append(f"| {r['seq']} | {r['mask']} | {r['how']} | {r['ms']:.0f} | {r['vs_dense']:.2f} |"
               f" {r['temp_mib']:.1f} | {r['arg_mib']:.1f} | {r['tiles']:.3f} | {make} |")
  return "\n".join(out)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="seq 4096 only; nothing written")
  parser.add_argument("--seqs", type=int, nargs="*", default=None)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  seqs = args.seqs or ([4096] if args.quick else [4096, 8192, 16384])
  rows = run(seqs, args.repeats)
  text = table(rows)
  print(text)
  if not args.quick:
    RESULTS.mkdir(exist_ok=True)
    head = (f"# mask_mod vs the same mask given densely (CPU, blockwise)\n\n"
            f"{time.strftime('%Y-%m-%d')}, jax {jax.__version__}, {platform.processor() or platform.machine()},"
            f" {os.cpu_count()} cores; B={B}, H={H}, D={D}, float32, value_and_grad, median of"
            f" {args.repeats}, CPU time. `python benchmarks/mask_mod.py`.\n\n")
    (RESULTS / "mask_mod.md").write_text(head + text + "\n")


if __name__ == "__main__":
  main()
