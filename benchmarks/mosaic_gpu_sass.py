"""The Mosaic-GPU kernels' main loops at the instruction level, beside the anchors' (no GPU).

Each case compiles deviceless for sm_90a (the CUDA plugin's Mosaic compiler, the H100 target
config, `JAX_PLATFORMS=cpu`) in a fresh process with `MOSAIC_GPU_DUMP_TO`; ptxas assembles
each dumped kernel and nvdisasm prints its SASS (`tests/_sass.py` finds both). Per kernel it
reports the steady-state loop: the innermost SASS loop holding warpgroup MMAs (HGMMA) with the
most MMA work, the shortest of those (an unmasked block), and beside it the longest such loop
(a masked block, where the kernel has one). Per loop: instructions per iteration, by class;
MMA FLOP (from the HGMMA shapes) per issued instruction; the barrier waits per iteration
(mbarrier try-waits, `SYNCS.PHASECHK`, and named-barrier syncs, `BAR.SYNC`). Per kernel:
registers, spill bytes and shared memory (ptxas and Mosaic's resources).

Anchors at the same shape (bf16, B=1, H=16, S=8192) and their own heuristic tiles: tokamax's
sm90 Mosaic-GPU forward (`flash_attention_kernel`: 2 consumer warpgroups of 64 rows, block_kv
128, or 64 where 128 overflows shared memory, 2 stages, not persistent) and VJP
(`flash_attention_vjp_kernel`: blocks of 64, 2 stages), called directly (their op wrappers ask
for a device); JAX's `attention_mgpu` forward (float16, the only dtype it takes). tokamax is
the benchmark's extra (`pip install -e .[bench-anchors]`), not the library's dependency.

What it shows, and what it does not: the same MMA work in fewer issued instructions leaves the
softmax more room to hide under the other warpgroup's MMAs. It is a proxy for speed, never a
measured speed: it sees no stall, bank conflict or TMA latency. `benchmarks/gpu_check.py`
times the kernels on a lent GPU.

  python benchmarks/mosaic_gpu_sass.py                    # every case, results recorded
  python benchmarks/mosaic_gpu_sass.py --only ours        # ours only (no tokamax needed)
  python benchmarks/mosaic_gpu_sass.py --gate --only gate # CI: ours' gated loops against
                                                          # the recorded counts
  python benchmarks/mosaic_gpu_sass.py --only ours --merge [--cases NAME,...]
                                                          # re-record ours, anchors kept

`--gate` compares with `benchmarks/results/mosaic_gpu_sass.json`: a kernel fails when its
steady-state loop has more instructions per iteration than recorded, or, where it had already
reached its anchor's MMA FLOP per instruction, falls below it.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tests import _sass  # noqa: E402  (ptxas / nvdisasm lookup and the SASS listing)

RESULTS = os.path.join(ROOT, "benchmarks", "results")
S, H = 8192, 16
FEATURES = ("plain", "segments", "mask", "bias", "score_mod", "rel", "positions", "mask_mod",
            "dropout", "sinks")
HEAD_DIMS = (64, 128, 256)
MMA = re.compile(r"HGMMA\.(\d+)x(\d+)x(\d+)")
HMMA = re.compile(r"HMMA\.(16)(8)(8|16)\b")  # warp-level m16n8k16 / m16n8k8 (Triton's tiles < 64 rows)


@dataclasses.dataclass(frozen=True)
class Case:
  impl: str  # "ours", "tokamax", "jax"
  kind: str  # "fwd" or "vjp"
  D: int
  causal: bool
  feature: str = "plain"

  @property
  def name(self) -> str:
    return (f"{self.impl}:{self.kind}:D{self.D}:{'causal' if self.causal else 'full'}"
            f":{self.feature}")

  @classmethod
  def parse(cls, name: str) -> Case:
    impl, kind, d, mask, feature = name.split(":")
    return cls(impl, kind, int(d[1:]), mask == "causal", feature)


def cases(only: str) -> list[Case]:
  out = []
  for D in HEAD_DIMS:
    for causal in (False, True):
      for kind in ("fwd", "vjp"):
        out.append(Case("ours", kind, D, causal))
        out.append(Case("tokamax", kind, D, causal))
      out.append(Case("jax", "fwd", D, causal))
  for feature in FEATURES[1:]:
    for kind in ("fwd", "vjp"):
      out.append(Case("ours", kind, 128, True, feature))
  out.append(Case("ours", "vjp", 256, True, "segments"))  # the backward's largest registers
  if only == "ours":
    out = [c for c in out if c.impl == "ours"]
  elif only == "anchors":
    out = [c for c in out if c.impl != "ours"]
  elif only == "gate":  # what CI compiles: ours, D=128, plain, causal (its steady loops are
    # the unmasked blocks' loops, the full kernel's)
    out = [c for c in out if c.impl == "ours" and c.D == 128 and c.feature == "plain"
           and c.causal]
  return out


# ---- the compile (a fresh process per case) --------------------------------------------------

_COMPILE = textwrap.dedent("""
    import math, os, sys
    import jax, jax.numpy as jnp
    from jax.experimental import topologies
    impl, kind, D, mask, feature = sys.argv[1].split(":")
    D, causal, S, H = int(D[1:]), mask == "causal", int(sys.argv[2]), int(sys.argv[3])
    tc = open(os.path.join(sys.argv[4], "flashvjp", "targets", "h100_sxm.txtpb")).read()
    topo = topologies.get_topology_desc(platform="cuda", target_config=tc, topology="1x1x1")
    mesh = topologies.make_mesh(topo, (1,), ("x",))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
    bf, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    if impl == "ours":
      import flashvjp
      q = sds((1, H, S, D), bf)
      extra, kw = {}, {}
      if feature == "segments":
        extra["segment_ids"] = sds((1, S), i32)
      elif feature == "mask":
        extra["mask"] = sds((1, 1, S, S), jnp.bool_)
      elif feature == "bias":
        extra["bias"] = sds((1, 1, S, S), bf)
      elif feature == "sinks":
        extra["sinks"] = sds((H,), f32)
      elif feature == "dropout":
        extra["dropout_rng"] = sds((2,), jnp.uint32)
        kw = dict(dropout_rate=0.1, deterministic=False)
      elif feature == "score_mod":  # softcap, ALiBi slopes per head
        extra["slopes"] = sds((H,), f32)
      elif feature == "rel":  # a table read by kv_idx - q_idx
        extra["table"] = sds((H, 129), f32)
      elif feature == "positions":  # a per-key bias, document ids (arrays read by position)
        extra["key_bias"] = sds((1, S), f32)
        extra["docs"] = sds((1, S), i32)
      elif feature == "mask_mod":  # prefix LM lengths per batch row
        extra["prefix"] = sds((1,), i32)

      def attn(q, k, v, ex):
        kw2 = dict(kw)
        for n in ("segment_ids", "mask", "bias", "sinks", "dropout_rng"):
          if n in ex:
            kw2[n] = ex[n]
        if "slopes" in ex:
          sl = ex["slopes"]
          kw2["score_mod"] = lambda s, b, h, i, j: 30.0 * jnp.tanh(
              (s - sl[h] * jnp.abs(i - j).astype(s.dtype)) / 30.0)
        if "table" in ex:
          t = ex["table"]
          kw2["score_mod"] = lambda s, b, h, i, j: s + t[h, jnp.clip(j - i, -64, 64) + 64]
        if "key_bias" in ex:
          kb, d = ex["key_bias"], ex["docs"]
          kw2["score_mod"] = lambda s, b, h, i, j: s + kb[b, j]
          kw2["mask_mod"] = lambda b, h, i, j: (d[b, i] == d[b, j]) & (j <= i)
        if "prefix" in ex:
          n = ex["prefix"]
          kw2["mask_mod"] = lambda b, h, i, j: (j <= i) | (j < n[b])
        use_causal = causal and feature not in ("positions", "mask_mod")
        return flashvjp.flash_attention(q, k, v, causal=use_causal,
                                        implementation="pallas_mosaic_gpu", **kw2)
      if kind == "fwd":
        f = attn
      else:
        f = jax.grad(lambda q, k, v, ex: attn(q, k, v, ex).astype(f32).sum(),
                     argnums=(0, 1, 2))
      jax.jit(f).lower(q, q, q, extra).compile()
    elif impl == "tokamax":
      from tokamax._src.ops.attention import pallas_mosaic_gpu_kernel_sm90 as K
      from tokamax._src.ops.attention import pallas_mosaic_gpu_vjp_kernel_sm90 as V
      from tokamax._src.ops.attention import pallas_mosaic_gpu_vjp_common as VC
      q = sds((S, H, D), bf)
      def fwd(q, k, v, block_kv):
        return K.flash_attention_kernel(
            q, k, v, None, None, None, None, is_causal=causal, logits_soft_cap=None,
            logits_scale=D ** -0.5, out_dtype=jnp.dtype(bf), normalize_output=True,
            return_residuals=True, use_stable_softmax=True, rescale_threshold=1.0,
            config=K.Config(block_q=64, block_kv=block_kv, num_stages=2, persistent=False))
      if kind == "fwd":
        err = None
        for block_kv in (128, 64):  # tokamax's heuristic: 128 unless shared memory overflows
          try:
            jax.jit(lambda q, k, v: fwd(q, k, v, block_kv)).lower(q, q, q).compile()
            print("BLOCK_KV", block_kv)
            break
          except Exception as e:  # the smem overflow of 128 at D=256
            err = e
        else:
          raise err
      else:
        r = sds((H, S), f32)
        for stages in (2, 1):
          try:
            jax.jit(lambda q, k, v, m, l, o, do: V.flash_attention_vjp_kernel(
                q, k, v, (m, l), o, do, None, None, None, None, logits_scale=D ** -0.5,
                logits_soft_cap=None, is_causal=causal, ds_dtype=None,
                config=VC.Config(block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64, num_stages=stages))).lower(
                    q, q, q, r, r, q, q).compile()
            print("STAGES", stages)
            break
          except Exception as e:
            err = e
        else:
          raise err
    else:
      from jax.experimental.pallas.ops.gpu import attention_mgpu as A
      q = sds((1, S, H, D), jnp.float16)
      cfg = A.TuningConfig(block_q=64, block_kv=128 if D <= 128 else 64,
                           max_concurrent_steps=2, causal=causal)
      jax.jit(lambda q, k, v: A.attention(q, k, v, cfg)).lower(q, q, q).compile()
    print("COMPILED")
""")


def compile_case(case: Case, dump: str) -> str:
  """Compile `case` in a fresh process, its kernels dumped in `dump`; its stdout."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", MOSAIC_GPU_DUMP_TO=dump, MOSAIC_GPU_DUMP_PTX="1",
             MOSAIC_GPU_DUMP_PTXAS="1", PYTHONPATH=os.pathsep.join(
                 [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  os.makedirs(dump, exist_ok=True)
  r = subprocess.run([sys.executable, "-c", _COMPILE, case.name, str(S), str(H), ROOT],
                     env=env, capture_output=True, text=True, timeout=1200)
  for log in glob.glob(os.path.join(dump, "*.mlir-passes.log")):
    os.unlink(log)
  if "COMPILED" not in r.stdout:
    raise RuntimeError(f"{case.name}: compile failed: {r.stderr[-3000:]}")
  return r.stdout


# ---- the SASS ---------------------------------------------------------------------------------

@dataclasses.dataclass
class Loop:
  instructions: int
  mma_flop: int
  classes: dict  # opcode (before the first '.') -> count
  mbarrier_waits: int
  bar_syncs: int

  @property
  def flop_per_instruction(self) -> float:
    return self.mma_flop / self.instructions

  def row(self) -> dict:
    return dict(instructions=self.instructions, mma_flop=self.mma_flop,
                flop_per_instruction=round(self.flop_per_instruction, 1),
                mbarrier_waits=self.mbarrier_waits, bar_syncs=self.bar_syncs,
                classes=self.classes)


def mma_loops(text: str) -> list[Loop]:
  """The innermost loops holding MMAs (warpgroup HGMMA, or warp-level HMMA where a Triton
  tile is under 64 rows), as `Loop`s."""
  lines = [ln for ln in text.splitlines() if _sass._INSTR.match(ln)]
  full = [ln.split("*/", 1)[1].strip().rstrip(";").strip() for ln in lines]
  listing = _sass.Listing.parse(text)
  assert len(full) == len(listing.opcodes)
  spans = [(a, b) for a, b in listing.loops
           if any(listing.opcodes[i].startswith(("HGMMA", "HMMA")) for i in range(a, b + 1))]
  inner = [x for x in spans if not any(y != x and y[0] >= x[0] and y[1] <= x[1] for y in spans)]
  loops = []
  for a, b in sorted(set(inner)):
    ops = listing.opcodes[a:b + 1]
    # per warpgroup: an HGMMA is its warpgroup's product, an HMMA one warp's (x4: the four
    # warps of a warpgroup issuing the same stream)
    flop = sum(2 * int(m[1]) * int(m[2]) * int(m[3]) * (1 if m.re is MMA else 4)
               for t in full[a:b + 1] for m in [MMA.search(t) or HMMA.search(t)] if m)
    classes = collections.Counter(op.split(".")[0] for op in ops)
    loops.append(Loop(len(ops), flop, dict(classes.most_common()),
                      sum(1 for t in full[a:b + 1] if "SYNCS.PHASECHK" in t),
                      sum(1 for op in ops if op.startswith("BAR.SYNC"))))
  return loops


def steady_and_masked(loops: list[Loop]) -> tuple[dict, dict | None]:
  """Rows of the steady-state loop (of the loops with the most MMA work, the shortest: an
  unmasked block) and of the longest of the same work (a masked block; None if the same)."""
  top = max(x.mma_flop for x in loops)
  best = [x for x in loops if x.mma_flop == top]
  steady = min(best, key=lambda x: x.instructions)
  masked = max(best, key=lambda x: x.instructions)
  return steady.row(), (masked.row() if masked is not steady else None)


def kernel_rows(case: Case, dump: str) -> dict:
  """{kernel role: row} of the kernels dumped for `case`."""
  rows = {}
  for ptx in sorted(glob.glob(os.path.join(dump, "*.ptx"))):
    base = ptx[:-4]
    name = os.path.basename(base)
    role = _role(case, name)
    if role is None:
      continue
    report = open(base + ".ptxas").read()
    regs = int(re.search(r"Used (\d+) registers", report)[1])
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", report))
    smem = _smem(dump, name)
    loops = mma_loops(_sass.sass(ptx))
    if not loops:
      raise RuntimeError(f"{case.name}: no MMA loop in {name}")
    steady, masked = steady_and_masked(loops)
    rows[role] = dict(kernel=name, registers=regs, spill_bytes=spills, smem_bytes=smem,
                      steady=steady, masked=masked, mma_loops=len(loops))
  if case.impl == "tokamax" and case.kind == "vjp":
    # tokamax's two VJP kernels are unnamed: at equal 64 x 64 tiles dK/dV's loop has four
    # products (S, dP, dV, dK) and dQ's three (S, dP, dQ)
    if len(rows) != 2:
      raise RuntimeError(f"{case.name}: {len(rows)} kernels, expected dq and dkdv")
    dq, dkdv = sorted(rows.values(), key=lambda k: k["steady"]["mma_flop"])
    rows = dict(dq=dq, dkdv=dkdv)
  return rows


def _smem(dump: str, name: str) -> int:
  """The kernel's shared memory (Mosaic's resources dump). Its lowering and its PTX are
  numbered apart (flashvjp_bwd_dq_2.resources.txt beside flashvjp_bwd_dq_1.ptx), so it is
  found by the kernel's name; where a name has several (the forward's value halves at head
  dim 256), the largest."""
  stem = re.sub(r"_\d+$", "", name)
  found = [int(re.search(r"smem_scratch_bytes=(\d+)", open(f).read())[1])
           for f in glob.glob(os.path.join(dump, f"{stem}_*.resources.txt"))
           if re.fullmatch(re.escape(stem) + r"_\d+\.resources\.txt", os.path.basename(f))]
  if not found:
    raise RuntimeError(f"no resources dump for {name} in {dump}")
  return max(found)


def _role(case: Case, name: str) -> str | None:
  if case.impl == "ours":
    if "bwd_dq" in name:
      return "dq"
    if "bwd_dkdv" in name:
      return "dkdv"
    if name.startswith("entry"):  # the forward kernel (in a VJP case, the fwd case's again)
      return "fwd" if case.kind == "fwd" else None
    return None
  return "fwd" if case.kind == "fwd" else name  # the anchors: one forward kernel, or the two VJP kernels (see kernel_rows)


def run_case(case: Case, work: str) -> dict:
  dump = os.path.join(work, case.name.replace(":", "_"))
  out = compile_case(case, dump)
  rows = kernel_rows(case, dump)
  tiles = dict(re.findall(r"^(BLOCK_KV|STAGES) (\d+)$", out, re.M))
  return dict(case=case.name, impl=case.impl, kind=case.kind, D=case.D, causal=case.causal,
              feature=case.feature, config={k.lower(): int(v) for k, v in tiles.items()},
              kernels=rows)


# ---- the table --------------------------------------------------------------------------------

def _classes(classes: dict, k: int = 8) -> str:
  return ", ".join(f"{c} {n}" for c, n in list(classes.items())[:k])


def table(results: list[dict]) -> str:
  by = {(r["impl"], r["kind"], r["D"], r["causal"], r["feature"]): r for r in results}
  lines = ["| kernel | D | mask | ours: instructions / MMA MFLOP | anchor | ours' MMA FLOP per"
           " instruction vs the anchor | ours: waits (mbarrier / bar.sync) | anchor | ours:"
           " registers / spills / smem KiB | anchor |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for D in HEAD_DIMS:
    for causal in (False, True):
      for kind, role, anchors in (("fwd", "fwd", (("tokamax", "fwd"), ("jax", "fwd"))),
                                  ("vjp", "dq", (("tokamax", "dq"),)),
                                  ("vjp", "dkdv", (("tokamax", "dkdv"),))):
        ours = by.get(("ours", kind, D, causal, "plain"))
        if ours is None or role not in ours["kernels"]:
          continue
        k = ours["kernels"][role]
        for impl, arole in anchors:
          a = by.get((impl, kind, D, causal, "plain"))
          ak = a["kernels"].get(arole) if a else None
          lines.append(_row(f"{role} vs {impl}", D, causal, k, ak))
  return "\n".join(lines)


def _row(label, D, causal, k, ak) -> str:
  s = k["steady"]

  def loop(x):
    return f"{x['instructions']} / {x['mma_flop'] / 1e6:.2f}"

  def res(x):
    return f"{x['registers']} / {x['spill_bytes']} / {x['smem_bytes'] / 1024:.0f}"

  if ak is None:
    return (f"| {label} | {D} | {'causal' if causal else 'full'} | {loop(s)} | (not compiled)"
            f" | | {s['mbarrier_waits']} / {s['bar_syncs']} | | {res(k)} | |")
  a = ak["steady"]
  ratio = s["flop_per_instruction"] / a["flop_per_instruction"]
  return (f"| {label} | {D} | {'causal' if causal else 'full'} | {loop(s)} | {loop(a)} |"
          f" **{ratio:.2f}x** | {s['mbarrier_waits']} / {s['bar_syncs']} |"
          f" {a['mbarrier_waits']} / {a['bar_syncs']} | {res(k)} | {res(ak)} |")


def feature_table(results: list[dict]) -> str:
  by = {(r["kind"], r["feature"]): r for r in results
        if r["impl"] == "ours" and r["D"] == 128 and r["causal"]}
  lines = ["| feature | kernel | steady loop: instructions (over plain) | masked loop:"
           " instructions (over plain) | MMA FLOP per instruction (steady) | registers /"
           " spills / smem KiB |", "|---|---|---|---|---|---|"]
  for feature in FEATURES:
    for kind, roles in (("fwd", ("fwd",)), ("vjp", ("dq", "dkdv"))):
      r = by.get((kind, feature))
      p = by.get((kind, "plain"))
      if r is None:
        continue
      for role in roles:
        k = r["kernels"].get(role)
        if k is None:
          continue
        pk = p["kernels"][role] if p else None

        def over(x, px):
          if x is None:
            return "-"
          if px is None:
            return str(x["instructions"])
          if x["mma_flop"] != px["mma_flop"]:  # another tile (e.g. dK/dV's q tiles of 32)
            return (f"{x['instructions']} (plain's tile: {px['mma_flop'] / 1e6:.2f} MFLOP,"
                    f" this one {x['mma_flop'] / 1e6:.2f})")
          return f"{x['instructions']} ({x['instructions'] - px['instructions']:+d})"
        pm = (pk["masked"] or pk["steady"]) if pk else None
        lines.append(f"| {feature} | {role} | {over(k['steady'], pk and pk['steady'])} |"
                     f" {over(k['masked'], pm)} | {k['steady']['flop_per_instruction']:.0f} |"
                     f" {k['registers']} / {k['spill_bytes']} / {k['smem_bytes'] / 1024:.0f} |")
  return "\n".join(lines)


def class_table(results: list[dict]) -> str:
  """The steady loops' instructions by class: ours beside tokamax's, D=128."""
  by = {(r["impl"], r["kind"], r["D"], r["causal"], r["feature"]): r for r in results}
  lines = []
  for causal in (False, True):
    for kind, role in (("fwd", "fwd"), ("vjp", "dq"), ("vjp", "dkdv")):
      for impl in ("ours", "tokamax", "jax"):
        r = by.get((impl, kind, 128, causal, "plain"))
        if r and role in r["kernels"]:
          s = r["kernels"][role]["steady"]
          lines.append(f"- {role} D=128 {'causal' if causal else 'full'}, {impl}"
                       f" ({s['instructions']}): {_classes(s['classes'], 16)}")
  return "\n".join(lines)


# ---- the gate ---------------------------------------------------------------------------------

def gate(results: list[dict], recorded: list[dict]) -> list[str]:
  """Regressions of `results` against the recorded run (messages; empty: none)."""
  rec = {r["case"]: r for r in recorded}
  anchors = {(r["kind"], r["D"], r["causal"]): r for r in recorded
             if r["impl"] == "tokamax" and r["feature"] == "plain"}
  failures = []
  for r in results:
    old = rec.get(r["case"])
    if old is None:
      continue
    a = anchors.get((r["kind"], r["D"], r["causal"]))
    failures += case_regressions(r, old, a)
  return failures


def case_regressions(r: dict, old: dict, anchor: dict | None) -> list[str]:
  """Per kernel of case row `r` against its recorded row `old` (and the anchor's recorded
  row): a steady loop longer than recorded, more spill bytes, or a fall below the anchor's
  MMA FLOP per instruction once reached. Shared with `triton_sass.gate`."""
  failures = []
  for role, k in r["kernels"].items():
    o = old["kernels"].get(role)
    if o is None:
      continue
    now, was = k["steady"]["instructions"], o["steady"]["instructions"]
    if now > was:
      failures.append(f"{r['case']} {role}: {now} instructions per iteration, recorded {was}")
    if k["spill_bytes"] > o["spill_bytes"]:
      failures.append(f"{r['case']} {role}: {k['spill_bytes']} spill bytes, recorded"
                      f" {o['spill_bytes']}")
    ak = anchor["kernels"].get(role) if anchor else None
    if ak is not None:
      af = ak["steady"]["flop_per_instruction"]
      if (o["steady"]["flop_per_instruction"] >= af
              and k["steady"]["flop_per_instruction"] < af):
        failures.append(f"{r['case']} {role}: fell below tokamax's MMA FLOP per instruction"
                        f" ({k['steady']['flop_per_instruction']:.0f} < {af:.0f})")
  return failures


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--only", choices=("all", "ours", "anchors", "gate"), default="all")
  ap.add_argument("--jobs", type=int, default=2)
  ap.add_argument("--cases", default=None,
                  help="comma-separated case names (impl:kind:D<d>:full|causal:feature) to run"
                  " of the --only set")
  ap.add_argument("--gate", action="store_true",
                  help="fail on a regression against the recorded results (not rewritten)")
  ap.add_argument("--out", default=os.path.join(RESULTS, "mosaic_gpu_sass"),
                  help="results stem: .json and .md are written (not with --gate)")
  ap.add_argument("--work", default=None, help="dump directory (default: a temporary one)")
  ap.add_argument("--merge", action="store_true",
                  help="with --only: replace these cases in the recorded results (the others"
                  " kept) and rewrite them")
  args = ap.parse_args(argv)
  why = _sass.unavailable()
  if why:
    print(f"mosaic_gpu_sass: {why}")
    return 2
  todo = cases(args.only)
  if args.cases:
    names = set(args.cases.split(","))
    unknown = names - {c.name for c in todo}
    if unknown:
      ap.error(f"--cases: not among the --only {args.only} cases: {sorted(unknown)}")
    todo = [c for c in todo if c.name in names]
  work = args.work or tempfile.mkdtemp(prefix="mosaic_gpu_sass_")
  results, errors = [], []
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    futures = {pool.submit(run_case, c, work): c for c in todo}
    for fut in concurrent.futures.as_completed(futures):
      c = futures[fut]
      try:
        r = fut.result()
      except Exception as e:  # reported, and the run fails
        errors.append(f"{c.name}: {e}")
        print(f"ERROR {c.name}: {str(e)[-400:]}", flush=True)
        continue
      results.append(r)
      for role, k in r["kernels"].items():
        s = k["steady"]
        print(f"{c.name} {role}: {s['instructions']} instructions / {s['mma_flop'] / 1e6:.2f}"
              f" MMA MFLOP ({s['flop_per_instruction']:.0f} per instruction), waits"
              f" {s['mbarrier_waits']} / {s['bar_syncs']}, {k['registers']} registers,"
              f" {k['spill_bytes']} spill bytes, {k['smem_bytes']} B smem", flush=True)
  order = {c.name: n for n, c in enumerate(todo)}
  results.sort(key=lambda r: order[r["case"]])
  if args.gate:
    recorded = json.load(open(args.out + ".json"))["results"]
    failures = gate(results, recorded) + errors
    for f in failures:
      print("FAIL", f)
    print(f"gate: {len(results)} cases, {len(failures)} failures")
    return 1 if failures else 0
  import jax
  if args.merge and not errors:
    recorded = json.load(open(args.out + ".json"))
    if recorded["jax"] != jax.__version__:
      print(f"--merge: the recorded results are of jax {recorded['jax']}, this is"
            f" {jax.__version__}: run every case instead")
      return 1
    new = {r["case"]: r for r in results}
    kept = [r for r in recorded["results"] if r["case"] not in new]
    every = {c.name: n for n, c in enumerate(cases("all"))}
    results = sorted(kept + results, key=lambda r: every.get(r["case"], len(every)))
  text = render(results, jax.__version__)
  print(text)
  if (args.only == "all" or args.merge) and not errors:
    json.dump(dict(jax=jax.__version__, S=S, H=H, results=results),
              open(args.out + ".json", "w"), indent=1)
    open(args.out + ".md", "w").write(text)
  return 1 if errors else 0


def render(results: list[dict], jax_version: str) -> str:
  return "\n\n".join([
      "# Mosaic-GPU kernels beside tokamax's and JAX's, SASS per iteration (sm_90a, no GPU)",
      f"`python benchmarks/mosaic_gpu_sass.py` (jax {jax_version}, deviceless H100 compile,"
      f" ptxas + nvdisasm; bf16, B=1, H={H}, S={S}; anchors at their own heuristic tiles)."
      " Per kernel, the steady-state loop: the innermost SASS loop holding warpgroup MMAs"
      " with the most MMA work (the shortest such loop: an unmasked block). A proxy for"
      " speed, never a measured one: the same MMA work in fewer issued instructions leaves"
      " the softmax more room under the other warpgroup's MMAs; stalls, bank conflicts and"
      " TMA latency are not seen. Waits: mbarrier try-waits / named-barrier syncs per"
      " iteration.",
      table(results),
      "## Instructions by class (D=128, the steady loops)",
      class_table(results),
      "## Each feature's loop (ours, D=128, causal; masked loop: the longest MMA loop of"
      " the same work, the PARTIAL / edge blocks)",
      feature_table(results),
      "## Spills and registers, every kernel compiled here",
      spill_list(results),
  ]) + "\n"


def spill_list(results: list[dict]) -> str:
  lines = []
  for r in results:
    for role, k in r["kernels"].items():
      lines.append(f"- {r['case']} {role}: {k['registers']} registers, {k['spill_bytes']}"
                   f" spill bytes, {k['smem_bytes'] / 1024:.0f} KiB smem"
                   + ("  **spills**" if k["spill_bytes"] else ""))
  spilled = sum(1 for ln in lines if "**spills**" in ln)
  return f"{spilled} of {len(lines)} kernels spill.\n\n" + "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())
