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
  1b. the backward's products written as a transposed-operand dot (dS^T Q: contracting the
     tile's first axis) against the same product as a plain [M, K] x [K, N] dot;
  3. flashvjp's blockwise forward and forward+backward, causal and full, float32 and
     bfloat16, at seq 1k-8k (--seqs adds 16k; --quick: 4k), with jax.nn's XLA path timed
     in the same run up to seq 4096 (its S x S scores need 2+ GiB beyond), and the shares
     recorded before this session's changes (BEFORE) next to today's.

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


def transposed_rows(bq=256, bk=256):
  """The backward's dV = P^T dO as a transposed-operand dot vs a plain one, f32 and bf16."""
  rows = []
  for dtype in ("float32", "bfloat16"):
    p = jnp.ones((H, bq, bk), dtype)
    d = jnp.ones((H, bq, D), dtype)
    pt = jnp.ones((H, bk, bq), dtype)
    fl = 2.0 * H * bq * bk * D
    _, s_t = share(fl, jax.jit(lambda a, b: jnp.einsum("hqk,hqd->hkd", a, b,
                                                       preferred_element_type=jnp.float32)),
                   p, d, dtype=dtype)
    _, s_n = share(fl, jax.jit(lambda a, b: jnp.einsum("hkq,hqd->hkd", a, b,
                                                       preferred_element_type=jnp.float32)),
                   pt, d, dtype=dtype)
    rows.append((dtype, s_t, s_n))
    print(f"{dtype} P^T dO: transposed operand {s_t:.2f}, plain {s_n:.2f}", flush=True)
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


JAX_NN_MAX_SEQ = 4096


def jax_nn_attention(q, k, v, causal):
  t = lambda x: jnp.swapaxes(x, 1, 2)  # jax.nn's layout is [B, S, H, D]
  return t(jax.nn.dot_product_attention(t(q), t(k), t(v), is_causal=causal,
                                        implementation="xla"))


def flashvjp_rows(seqs, dtypes):
  rows = []
  for dtype in dtypes:
    for S in seqs:
      q, k, v = (jax.random.normal(jax.random.key(i), (B, H, S, D)).astype(dtype)
                 for i in range(3))
      for causal in (True, False):
        attn = functools.partial(flashvjp.flash_attention, causal=causal,
                                 implementation="blockwise")
        fl = 4.0 * S * S * D * H * (0.5 if causal else 1.0)
        tf, sf = share(fl, jax.jit(attn), q, k, v, dtype=dtype)
        loss = lambda q, k, v, attn=attn: jnp.sum(attn(q, k, v).astype(jnp.float32))
        tb, sb = share(3.5 * fl, jax.jit(jax.grad(loss, (0, 1, 2))), q, k, v, dtype=dtype)
        jn = None
        if S <= JAX_NN_MAX_SEQ:
          jloss = lambda q, k, v, causal=causal: jnp.sum(
              jax_nn_attention(q, k, v, causal).astype(jnp.float32))
          jn = cpu_time(jax.jit(jax.grad(jloss, (0, 1, 2))), q, k, v)
        rows.append((dtype, S, causal, tf, sf, tb, sb, jn))
        ratio = "" if jn is None else f", {tb / jn:.2f}x jax.nn"
        print(f"flashvjp {dtype} S={S} causal={causal}: fwd {1e3 * tf:.0f} ms share {sf:.2f},"
              f" fwd+bwd {1e3 * tb:.0f} ms share {sb:.2f}{ratio}", flush=True)
  return rows


# Shares recorded by this script before the kv-major backward, the per-tile mask and the
# K/V rank change (2026-12-03, earlier the same day; float32 was also what the issue's
# first measurement saw: 0.51 causal / 0.54 full at seq 4096 in wall time).
# (dtype, seq, causal) -> (fwd share, fwd+bwd share)
BEFORE = {
    ("float32", 1024, True): (0.35, 0.37), ("float32", 1024, False): (0.47, 0.45),
    ("float32", 2048, True): (0.39, 0.39), ("float32", 2048, False): (0.50, 0.46),
    ("float32", 4096, True): (0.40, 0.41), ("float32", 4096, False): (0.49, 0.48),
    ("float32", 8192, True): (0.48, 0.45), ("float32", 8192, False): (0.48, 0.47),
    ("bfloat16", 1024, True): (0.12, 0.10), ("bfloat16", 1024, False): (0.18, 0.13),
    ("bfloat16", 2048, True): (0.14, 0.11), ("bfloat16", 2048, False): (0.18, 0.13),
    ("bfloat16", 4096, True): (0.15, 0.11), ("bfloat16", 4096, False): (0.15, 0.13),
    ("bfloat16", 8192, True): (0.20, 0.13), ("bfloat16", 8192, False): (0.17, 0.14),
}


def _before(d, S, c, i):
  b = BEFORE.get((d, S, c))
  return "-" if b is None else f"{b[i]:.2f}"


READING = """
## Reading

- **Where the time went** (perf profiles of one fwd+bwd, float32, seq 4096 causal, before
  the changes): the backward's dK = dS^T Q and dV = P^T dO contract over the first axis of the
  q-major score tile; XLA:CPU's fast dot path (YNNPACK) does not take that form and runs it on
  Eigen with a packing transpose (19% of all samples in `gemm_pack_colmajor_block`), 2-2.5x
  slower than a plain product in float32 and 8-10x in bfloat16 (section 1b). The causal mask's
  predicate was recomputed per head inside the two fusions that read it. The rest is the tile
  products (0.6-0.8 of the matmul rate at 256 x 256, section 1), the online softmax (~30% on
  top of the dots in the forward skeleton, section 2) and thread-pool handoffs between the
  ~12 small ops of each step (~10% of samples).
- **What changed:** (1) the backward computes its tiles kv-major (s^T = k q^T), so dV = P^T dO,
  dK = dS^T Q and dQ^T = K^T dS^T are plain products; dQ is accumulated transposed and
  transposed once at the end; (2) the mask predicate of a tile is materialised once per step
  ([bq, bk] for causal / window / padding, broadcast over batch and heads); (3) K and V are
  carried in the q side's rank, so equal-shaped tile slices and accumulator updates share one
  compiled kernel. Temp memory is unchanged (fwd+bwd 16.3 MiB at seq 4096 as
  `benchmarks/bench_cpu.py` measures it, vjp with dO an argument): K^T is transposed per
  tile; a transposed copy of all of K made bfloat16 fwd+bwd ~20% faster (float32 no faster)
  for 8 MiB more, and was not kept.
- **Still short of the targets** (0.75 fwd+bwd, 0.8 fwd): the 256 x 256 tile products alone
  are at 0.6-0.8 (the q k^T product has depth D = 64), so a loop of them cannot reach 0.8;
  512 x 512 tiles (0.8-1.0) are faster (fwd+bwd float32 causal 760 -> 706 ms, full 1452 ->
  1269 ms at seq 4096) but with all heads in one step they take 35% more temp memory
  (43.5 vs 32.3 MiB), against the "no larger" target. Processing a chunk of kv heads per
  step with 512 x 512 tiles (the same temp memory as 256 x 256) was built and measured: no
  consistent gain (from 12% faster to 11% slower across dtypes and masks), the time
  following the number of steps rather than the tile shape; it was not kept.
- **bfloat16:** the CPU's bf16 matmul rate (AMX) is ~4.6x its float32 rate, so shares of the
  bf16 rate stay low while the softmax runs in float32; in absolute time bf16 is now
  1.4-1.5x faster than float32 forward+backward (1.2-1.3x before).
"""


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="seq 4096 only; nothing written")
  parser.add_argument("--seqs", type=int, nargs="*", default=None,
                      help="default 1024 2048 4096 8192 (16384 takes ~10 more minutes)")
  args = parser.parse_args()
  seqs = args.seqs or ([4096] if args.quick else [1024, 2048, 4096, 8192])
  tiles = tile_rows()
  trans = transposed_rows()
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
      "## 1b. The backward's dV = P^T dO at 256 x 256: transposed operand vs plain",
      "",
      "Share of the same dtype's matmul rate. A q-major backward tile [bq, bk] makes dK and dV"
      " contract over its first axis (left); computing the tile kv-major (s^T = k q^T) makes"
      " all five products plain (right), dQ then accumulating transposed (K^T dS^T).",
      "",
      "| dtype | transposed operand | plain |",
      "|---|---|---|",
      *[f"| {d} | {a:.2f} | {b:.2f} |" for d, a, b in trans],
      "",
      "## 2. A causal forward skeleton at S=4096, 256 x 256 blocks, built up (float32)",
      "",
      "| stage | CPU ms | share |",
      "|---|---|---|",
      *[f"| {n} | {1e3 * t:.0f} | {s:.2f} |" for n, t, s in skel],
      "",
      "## 3. flashvjp blockwise",
      "",
      "Shares before today's changes (BEFORE in the script) in parentheses; x jax.nn:"
      " fwd+bwd CPU time over jax.nn's XLA path in the same run (seq <= 4096).",
      "",
      "| dtype | seq | causal | fwd CPU ms | fwd share (before) | fwd+bwd CPU ms |"
      " fwd+bwd share (before) | fwd+bwd x jax.nn |",
      "|---|---|---|---|---|---|---|---|",
      *[f"| {d} | {S} | {c} | {1e3 * tf:.0f} | {sf:.2f} ({_before(d, S, c, 0)}) |"
        f" {1e3 * tb:.0f} | {sb:.2f} ({_before(d, S, c, 1)}) |"
        f" {'-' if jn is None else f'{tb / jn:.2f}'} |"
        for d, S, c, tf, sf, tb, sb, jn in fv],
      "",
  ]
  text = "\n".join(lines) + READING
  print(text)
  if not args.quick:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu_roofline.md").write_text(text)


if __name__ == "__main__":
  main()
