"""Blockwise on CPU against the machine's matmul rate: where the time goes.

Every time here is CPU time of the process (`time.process_time`, all threads), not wall
time: on a shared machine another process's load stretches wall time but hardly the
CPU time our threads spend, so shares measured this way are stable where wall-time shares
are not. The reference rate is a 2048 x 2048 float32 `jnp.dot`, measured in the same run
before and after each row (its mean). FLOPs count matmul work only: fwd = 4 S^2 D H
(x 0.5 causal), fwd+bwd = 3.5 x fwd.

Parts:
  1. the attention tile products alone ([H, bq, D] x [H, bk, D]^T and [H, bq, bk] x
     [H, bk, D]) at several tile sizes: the ceiling a blockwise loop of such dots has;
  2. a blockwise causal forward skeleton with the same loop structure as flashvjp's,
     built up step by step: dots only; + online softmax (max, exp, sum); + the causal mask;
  3. flashvjp's blockwise forward and forward+backward, causal and full, float32 and
     bfloat16, at seq 1k-8k (--seqs adds 16k; --quick: 4k).

    python benchmarks/cpu_roofline.py            # -> benchmarks/results/cpu_roofline.md
    python benchmarks/cpu_roofline.py --quick    # seq 4096 only, nothing written
"""
from __future__ import annotations

import argparse
import functools
import os
import pathlib
import platform
import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax

import flashvjp

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
B, H, D = 1, 8, 64


def cpu_time(f, *args, repeats=3):
  jax.block_until_ready(f(*args))
  ts = []
  for _ in range(repeats):
    t0 = time.process_time()
    jax.block_until_ready(f(*args))
    ts.append(time.process_time() - t0)
  return statistics.median(ts)


_MM = {}


def matmul_rate(dtype="float32"):
  if dtype not in _MM:
    a = jnp.ones((2048, 2048), dtype)
    _MM[dtype] = (jax.jit(jnp.dot), a)
  f, a = _MM[dtype]
  return 2.0 * 2048 ** 3 / cpu_time(f, a, a)


def share(flops, fn, *args, dtype="float32"):
  r0 = matmul_rate(dtype)
  t = cpu_time(fn, *args)
  r1 = matmul_rate(dtype)
  return t, flops / t / (0.5 * (r0 + r1))


def tile_rows():
  rows = []
  for bq, bk in [(128, 128), (256, 256), (512, 512), (256, 1024), (1024, 1024)]:
    q, k, p = jnp.ones((H, bq, D)), jnp.ones((H, bk, D)), jnp.ones((H, bq, bk))
    fl = 2.0 * H * bq * bk * D
    _, s_qk = share(fl, jax.jit(lambda a, b: jnp.einsum("hqd,hkd->hqk", a, b)), q, k)
    _, s_pv = share(fl, jax.jit(lambda a, b: jnp.einsum("hqk,hkd->hqd", a, b)), p, k)
    rows.append((f"{bq} x {bk}", s_qk, s_pv))
    print(f"tile {bq}x{bk}: q k^T {s_qk:.2f}, p v {s_pv:.2f}", flush=True)
  return rows


def skeleton(q, k, v, *, stage, block=256):
  """A causal blockwise forward with flashvjp's loop structure (flat pair list, in-place
  row carries), up to `stage`: "dots", "softmax" (+ running max, exp, sum), "mask"."""
  S = q.shape[2]
  n = S // block
  pairs = [(i, j) for i in range(n) for j in range(i + 1)]
  ii = jnp.asarray([p[0] for p in pairs], jnp.int32)
  jj = jnp.asarray([p[1] for p in pairs], jnp.int32)

  def body(t, carry):
    ml, o = carry
    i, j = ii[t], jj[t]
    qb = lax.dynamic_slice_in_dim(q, i * block, block, 2)
    kb = lax.dynamic_slice_in_dim(k, j * block, block, 2)
    vb = lax.dynamic_slice_in_dim(v, j * block, block, 2)
    s = jnp.einsum("bhqd,bhkd->bhqk", qb, kb)
    rows = lax.dynamic_slice_in_dim(ml, i * block, block, 2)
    m, l = rows[..., 0], rows[..., 1]
    if stage == "dots":
      p, m_new, alpha = s, m, jnp.ones_like(m)
    else:
      if stage == "mask":
        qi = i * block + jnp.arange(block)[:, None]
        ki = j * block + jnp.arange(block)[None, :]
        s = jnp.where(ki <= qi, s, -jnp.inf)
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.exp(s - m_new[..., None])
      alpha = jnp.exp(m - m_new)
    l = alpha * l + p.sum(-1)
    ob = lax.dynamic_slice_in_dim(o, i * block, block, 2)
    ob = alpha[..., None] * ob + jnp.einsum("bhqk,bhkd->bhqd", p, vb)
    return (lax.dynamic_update_slice_in_dim(ml, jnp.stack([m_new, l], -1), i * block, 2),
            lax.dynamic_update_slice_in_dim(o, ob, i * block, 2))

  ml0 = jnp.stack([jnp.full(q.shape[:3], -1e30), jnp.zeros(q.shape[:3])], -1)
  return lax.fori_loop(0, len(pairs), body, (ml0, jnp.zeros(q.shape)))[1]


def skeleton_rows(S=4096):
  q, k, v = (jax.random.normal(jax.random.key(i), (B, H, S, D)) for i in range(3))
  n = S // 256
  fl = 4.0 * S * S * D * H * 0.5 * (n + 1) / n  # the visited blocks, diagonal included
  rows = []
  for stage in ("dots", "softmax", "mask"):
    t, s = share(fl, jax.jit(functools.partial(skeleton, stage=stage)), q, k, v)
    rows.append((stage, t, s))
    print(f"skeleton {stage}: {1e3 * t:.0f} ms, share {s:.2f}", flush=True)
  return rows


def flashvjp_rows(seqs, dtypes):
  rows = []
  for dtype in dtypes:
    for S in seqs:
      q, k, v = (jax.random.normal(jax.random.key(i), (B, H, S, D)).astype(dtype)
                 for i in range(3))
      for causal in (True, False):
        attn = lambda q, k, v: flashvjp.flash_attention(q, k, v, causal=causal,
                                                        implementation="blockwise")
        fl = 4.0 * S * S * D * H * (0.5 if causal else 1.0)
        tf, sf = share(fl, jax.jit(attn), q, k, v, dtype=dtype)
        loss = lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32))
        tb, sb = share(3.5 * fl, jax.jit(jax.grad(loss, (0, 1, 2))), q, k, v, dtype=dtype)
        rows.append((dtype, S, causal, tf, sf, tb, sb))
        print(f"flashvjp {dtype} S={S} causal={causal}: fwd {1e3 * tf:.0f} ms share {sf:.2f},"
              f" fwd+bwd {1e3 * tb:.0f} ms share {sb:.2f}", flush=True)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="seq 4096 only; nothing written")
  parser.add_argument("--seqs", type=int, nargs="*", default=None,
                      help="default 1024 2048 4096 8192 (16384 takes ~10 more minutes)")
  args = parser.parse_args()
  seqs = args.seqs or ([4096] if args.quick else [1024, 2048, 4096, 8192])
  tiles = tile_rows()
  skel = skeleton_rows()
  fv = flashvjp_rows(seqs, ["float32"] if args.quick else ["float32", "bfloat16"])
  lines = [
      "# Blockwise on CPU against the matmul rate (CPU-time shares)",
      "",
      f"{time.strftime('%Y-%m-%d')}, jax {jax.__version__}, {platform.machine()},"
      f" {os.cpu_count()} cores; B={B}, H={H}, D={D}. `python benchmarks/cpu_roofline.py`."
      " Share = matmul FLOP rate of the row / the 2048 x 2048 `jnp.dot` rate of the same"
      " dtype measured around it, both in CPU time (see the script's docstring).",
      "",
      "## 1. Tile products alone (float32)",
      "",
      "| tile (bq x bk) | q k^T | p v |",
      "|---|---|---|",
      *[f"| {n} | {a:.2f} | {b:.2f} |" for n, a, b in tiles],
      "",
      "## 2. A causal forward skeleton at S=4096, 256 x 256 blocks, built up (float32)",
      "",
      "| stage | CPU ms | share |",
      "|---|---|---|",
      *[f"| {n} | {1e3 * t:.0f} | {s:.2f} |" for n, t, s in skel],
      "",
      "## 3. flashvjp blockwise",
      "",
      "| dtype | seq | causal | fwd CPU ms | fwd share | fwd+bwd CPU ms | fwd+bwd share |",
      "|---|---|---|---|---|---|---|",
      *[f"| {d} | {S} | {c} | {1e3 * tf:.0f} | {sf:.2f} | {1e3 * tb:.0f} | {sb:.2f} |"
        for d, S, c, tf, sf, tb, sb in fv],
      "",
  ]
  text = "\n".join(lines)
  print(text)
  if not args.quick:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu_roofline.md").write_text(text)


if __name__ == "__main__":
  main()
