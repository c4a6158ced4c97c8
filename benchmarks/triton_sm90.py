#!/usr/bin/env python3
"""Compile check: every Pallas-Triton kernel of flashvjp compiled for sm_90a, without a GPU.

What a GPU user runs is what is checked: for each case of a feature matrix,
``jax.jit(jax.value_and_grad(loss))`` where ``loss`` calls the public
``flashvjp.flash_attention(..., implementation="pallas_triton", interpret=False)`` with the
library's default (GPU) block sizes, exported with ``jax.export(..., platforms=["cuda"])``.
Every ``__gpu$xla.gpu.triton`` custom call of the export (forward, dK/dV, dQ, dbias ...) is a
kernel; its backend_config holds the Triton MLIR as jaxlib bytecode, which is re-printed as
TTIR text with jaxlib's Triton dialect (pip triton cannot read jaxlib's bytecode), then
compiled with pip ``triton`` for ``GPUTarget("cuda", 90, 32)`` (TTIR -> TTGIR -> LLVM -> PTX)
and its bundled ``ptxas -v --gpu-name=sm_90a``.

Per kernel it records: compile ok, registers, spill stores/loads, stack, shared memory,
the MMA kind of each dot (wgmma / mma.sync / fma), async copies (cp.async, TMA), tf32 dots,
and each loop's software pipelining (async copies inside the loop body).

It fails (exit 1) on: a compile failure (export, Triton or ptxas), any spill, shared memory
over 227 KiB (H100/H200 opt-in limit), a loop that loads from global memory with no async
copy inside it (not software-pipelined), and a dot of >= 64 rows on 16-bit or tf32 operands
that does not use wgmma. ``--fail-on compile`` fails only on export/compile failures (the other
findings are reported); ``--no-fail`` (alias ``--report-only``, = ``--fail-on none``) records the
same report and exits 0, for a baseline while findings remain.

Caveat: on a GPU, XLA compiles these kernels with the Triton built into jaxlib's CUDA plugin,
not pip triton 3.6.0 (the GPU image's version), so registers and shared memory there may differ a
little; the TTIR is the same.

Processes: jax and pip triton each bundle their own MLIR, so extraction (jax) runs in
``--jobs`` shard processes and every kernel compiles in its own process (a compiler crash is a
recorded failure). Kernels are compiled once per (TTIR, warps, stages, triton) hash and cached
under ``--cache``.

Usage (from the project root; jax 0.11.2 + jaxlib 0.11.2 + triton 3.6.0, the GPU image's
versions)::

    python benchmarks/triton_sm90.py                   # whole matrix -> benchmarks/results/triton_sm90.md, .json
    python benchmarks/triton_sm90.py --cases 'bf16_d128' --out-md /tmp/x.md --no-fail

Exports run with JAX_PLATFORMS=cpu, on a GPU host too (same result, no device memory used).
JAX's Pallas-Triton lowering then asks for the GPU's compute capability: this tool registers
the CPU device kind as an H100 in ``jax._src.pallas.triton.gpu_info.registry`` (jax >= 0.11;
jax 0.10 assumes sm_90 by itself). ``jax.sharding.use_abstract_mesh`` with an
``AbstractDevice`` would be the public way, but it refuses jaxprs holding
``custom_partitioning`` (flashvjp's batch/head partitioning on several devices) and any eager
array creation while tracing (flashvjp's score_mod check). That registration is the only
private hook: flashvjp is called through its public API, with its default block sizes.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SMEM_LIMIT = 232448  # 227 KiB: cudaDevAttrMaxSharedMemoryPerBlockOptin on H100/H200
MAX_REGS = 255
TOOL_VERSION = "1"  # part of the cache key: bump when the recorded facts change
TRITON_TARGET = "__gpu$xla.gpu.triton"


# ================================================================= the matrix (public API only)
@dataclasses.dataclass(frozen=True)
class Case:
  """One exported value_and_grad. All fields are static, so a case name identifies it."""

  name: str
  dtype: str = "bf16"  # bf16 | f16 | f32
  D: int = 128
  Dv: int | None = None
  B: int = 1
  H: int = 4
  Hkv: int | None = None
  Sq: int = 4096
  Skv: int | None = None
  causal: bool = False
  window: tuple | None = None
  segments: bool = False
  mask: str | None = None  # "dense" [B, 1, Sq, Skv] | "key_padding" [B, 1, 1, Skv]
  bias: str | None = None  # "full" [B, H, Sq, Skv] | "broadcast" [1, H, 1, Skv]
  dropout: float = 0.0
  softcap: float | None = None
  alibi: bool = False  # score_mod closing over differentiated slopes
  mask_mod: str | None = None  # "prefix_lm" (per-batch lengths, a traced input) | "chunked"
  rel_bias: bool = False  # relative_position_bias(table [H, 129], 64): a row read by kv - q
  return_lse: bool = False
  precision: str | None = None  # jax.default_matmul_precision for the export
  baseline: str | None = None  # "jax_mha": jax.experimental.pallas.ops.gpu.attention.mha


def matrix() -> list[Case]:
  """A base sweep of dtype x head dim (causal and full) plus each feature at 1-2 points."""
  cases = []
  for dt in ("bf16", "f16", "f32"):
    for D in (64, 80, 96, 128, 192, 256):
      for causal in (True, False):
        cases.append(Case(f"{dt}_d{D}_{'causal' if causal else 'full'}", dtype=dt, D=D,
                          causal=causal))
  F = Case
  cases += [
      F("bf16_d192_dv128_causal", D=192, Dv=128, causal=True),
      F("bf16_d128_dv64_cross_q2048_kv4096", Dv=64, Sq=2048, Skv=4096),
      F("bf16_d128_window", window=(512, 0)),
      F("bf16_d64_window_sym", D=64, window=(256, 256)),
      F("bf16_d128_segments", segments=True),
      F("bf16_d128_causal_segments", causal=True, segments=True),
      F("bf16_d64_segments", D=64, segments=True),
      F("bf16_d128_mask_dense", mask="dense"),
      F("f16_d64_mask_dense", dtype="f16", D=64, mask="dense"),
      F("bf16_d128_mask_key_padding", mask="key_padding"),
      F("bf16_d128_bias_full", bias="full"),
      F("bf16_d128_bias_broadcast", bias="broadcast"),
      F("f32_d64_bias_broadcast", dtype="f32", D=64, bias="broadcast"),
      F("bf16_d128_dropout", dropout=0.1),
      F("bf16_d64_causal_dropout", D=64, causal=True, dropout=0.1),
      F("bf16_d128_softcap", softcap=30.0),
      F("bf16_d128_softcap_window", softcap=30.0, window=(1024, 0)),
      F("bf16_d128_alibi_causal", alibi=True, causal=True),
      F("f16_d64_alibi", dtype="f16", D=64, alibi=True),
      F("bf16_d128_gqa_h8_kv2_causal", H=8, Hkv=2, causal=True),
      F("bf16_d64_mqa_h8_kv1", D=64, H=8, Hkv=1),
      F("bf16_d128_causal_lse", causal=True, return_lse=True),
      F("f32_d64_causal_lse", dtype="f32", D=64, causal=True, return_lse=True),
      F("f32_d64_causal_high", dtype="f32", D=64, causal=True, precision="high"),
      F("f32_d128_full_high", dtype="f32", D=128, precision="high"),
      F("f32_d64_causal_highest", dtype="f32", D=64, causal=True, precision="highest"),
      F("f32_d128_full_highest", dtype="f32", D=128, precision="highest"),
      F("f32_d128_causal_highest", dtype="f32", D=128, causal=True, precision="highest"),
      F("bf16_d128_combo", causal=True, segments=True, dropout=0.1, softcap=30.0,
        bias="broadcast"),
      # mask_mod: block lists from its classes, its tile part on PARTIAL blocks only.
      F("bf16_d128_mask_mod_prefix_lm", B=2, mask_mod="prefix_lm"),
      F("bf16_d64_mask_mod_prefix_lm", D=64, B=2, mask_mod="prefix_lm"),
      F("bf16_d128_mask_mod_chunked", mask_mod="chunked"),
      # a table read by kv_idx - q_idx: gather loads of a per-(b, h) row; its gradient's
      # kernel over the block diagonals (flashvjp_bwd_drel)
      F("bf16_d128_rel_bias_causal", causal=True, rel_bias=True),
      F("bf16_d64_rel_bias", D=64, rel_bias=True),
      F("bf16_d128_rel_bias_segments", causal=True, rel_bias=True, segments=True),
  ]
  for D in (64, 128):
    for causal in (True, False):
      cases.append(F(f"jax_mha_bf16_d{D}_{'causal' if causal else 'full'}", D=D,
                     causal=causal, baseline="jax_mha"))
  return cases


def _abstract_h100():
  """Let the Pallas-Triton lowering target sm_90 on a host without a GPU (see module doc)."""
  import jax
  if jax.default_backend() == "gpu":
    return
  try:
    from jax._src.pallas.triton import gpu_info
  except ImportError:  # jax 0.10: the lowering falls back to sm_90 by itself
    return
  info = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
  gpu_info.registry[jax.devices()[0].device_kind] = lambda: info


def export_case(case: Case) -> str:
  """StableHLO text of jax.jit(jax.value_and_grad(loss)) exported for CUDA."""
  import contextlib

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import export

  import flashvjp

  dt = dict(bf16=jnp.bfloat16, f16=jnp.float16, f32=jnp.float32)[case.dtype]
  B, H, D = case.B, case.H, case.D
  Hkv = case.Hkv or H
  Dv = case.Dv or D
  Sq, Skv = case.Sq, case.Skv or case.Sq
  S = jax.ShapeDtypeStruct
  specs = {}
  if case.baseline == "jax_mha":
    from jax.experimental.pallas.ops.gpu import attention as jax_attention
    specs = dict(q=S((B, Sq, H, D), dt), k=S((B, Skv, Hkv, D), dt), v=S((B, Skv, Hkv, Dv), dt))

    def loss(a):
      o = jax_attention.mha(a["q"], a["k"], a["v"], None, sm_scale=D ** -0.5,
                            causal=case.causal)
      return jnp.sum(o.astype(jnp.float32))
  else:
    specs = dict(q=S((B, H, Sq, D), dt), k=S((B, Hkv, Skv, D), dt), v=S((B, Hkv, Skv, Dv), dt))
    nondiff = {}
    if case.bias == "full":
      specs["bias"] = S((B, H, Sq, Skv), dt)
    elif case.bias == "broadcast":
      specs["bias"] = S((1, H, 1, Skv), dt)
    if case.alibi:
      specs["slopes"] = S((H,), jnp.float32)
    if case.rel_bias:
      specs["rel_table"] = S((H, 129), jnp.float32)
    if case.mask == "dense":
      nondiff["mask"] = S((B, 1, Sq, Skv), jnp.bool_)
    elif case.mask == "key_padding":
      nondiff["mask"] = S((B, 1, 1, Skv), jnp.bool_)
    if case.segments:
      nondiff["segment_ids"] = ((S((B, Sq), jnp.int32), S((B, Skv), jnp.int32))
                                if Sq != Skv else S((B, Sq), jnp.int32))
    if case.mask_mod == "prefix_lm":
      nondiff["prefix_lengths"] = S((B,), jnp.int32)

    def loss(a, nd):
      score_mod = None
      if case.alibi + bool(case.softcap) + case.rel_bias > 1:
        raise ValueError("one score_mod per case")
      if case.alibi:
        score_mod = flashvjp.alibi(a["slopes"])
      elif case.rel_bias:
        score_mod = flashvjp.relative_position_bias(a["rel_table"], 64)
      elif case.softcap:
        score_mod = flashvjp.softcap(case.softcap)
      mask_mod = None
      if case.mask_mod == "prefix_lm":
        mask_mod = flashvjp.prefix_lm(nd["prefix_lengths"])
      elif case.mask_mod == "chunked":
        mask_mod = flashvjp.chunked(1024)
      elif case.mask_mod is not None:
        raise ValueError(f"unknown mask_mod {case.mask_mod!r}")
      kw = {}
      if case.dropout:
        kw = dict(dropout_rate=case.dropout, dropout_rng=jax.random.key(0),
                  deterministic=False)
      r = flashvjp.flash_attention(
          a["q"], a["k"], a["v"], bias=a.get("bias"), mask=nd.get("mask"),
          causal=case.causal, window=case.window, segment_ids=nd.get("segment_ids"),
          score_mod=score_mod, return_lse=case.return_lse, implementation="pallas_triton",
          interpret=False, mask_mod=mask_mod, **kw)
      if case.return_lse:
        o, lse = r
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))
      return jnp.sum(r.astype(jnp.float32))

    specs = (specs, nondiff)
  del np
  f = jax.jit(jax.value_and_grad(loss))
  ctx = (jax.default_matmul_precision(case.precision) if case.precision
         else contextlib.nullcontext())
  with ctx:
    exp = export.export(
        f, platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_TARGET)])(
            *(specs if isinstance(specs, tuple) else (specs,)))
  return exp.mlir_module()


def triton_calls(stablehlo_text: str) -> list[dict]:
  """Each Triton custom call: {name, num_warps, num_stages, grid, ttir (text)}."""
  from jax._src.interpreters import mlir
  from jax._src.lib.mlir import ir
  from jaxlib.triton import dialect as tt_dialect

  ctx = mlir.make_ir_context()
  tt_dialect.register_dialect(ctx)
  out = []
  with ctx:
    module = ir.Module.parse(stablehlo_text)

    def walk(op):
      for region in op.regions:
        for block in region.blocks:
          for o in block.operations:
            o = o.operation
            if (o.name == "stablehlo.custom_call" and ir.StringAttr(
                o.attributes["call_target_name"]).value == TRITON_TARGET):
              bc = ir.DictAttr(o.attributes["mhlo.backend_config"])
              call = dict(name=ir.StringAttr(bc["name"]).value,
                          num_warps=ir.IntegerAttr(bc["num_warps"]).value,
                          num_stages=ir.IntegerAttr(bc["num_stages"]).value,
                          grid=[ir.IntegerAttr(bc[f"grid_{a}"]).value for a in "xyz"])
              blob = ir.StringAttr(bc["ir"]).value_bytes
              call["ttir"] = ir.Module.parse(blob).operation.get_asm(enable_debug_info=False)
              out.append(call)
            walk(o)

    walk(module.operation)
  return out


def _extract_shard(out_dir: str, names: list[str]):
  """Runs in a jax process: export each case, write its kernels, stream one line per kernel."""
  import warnings
  warnings.simplefilter("ignore")
  sys.path.insert(0, ROOT)
  import jax
  import jaxlib
  _abstract_h100()
  by_name = {c.name: c for c in matrix()}
  for name in names:
    t0 = time.time()
    try:
      calls = triton_calls(export_case(by_name[name]))
    except Exception as e:  # an export failure is a result
      msg = f"{type(e).__name__}: {e}"
      print("CASE " + json.dumps(dict(case=name, baseline=by_name[name].baseline,
                                      error=msg[:3000],
                                      seconds=round(time.time() - t0, 1))), flush=True)
      continue
    kernels = []
    for i, call in enumerate(calls):
      ttir = call.pop("ttir")
      sha = hashlib.sha256(
          f"{ttir}\n{call['num_warps']}\n{call['num_stages']}\n{TOOL_VERSION}".encode()
      ).hexdigest()[:20]
      path = os.path.join(out_dir, "kernels", sha + ".ttir")
      if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
          f.write(ttir)
        os.replace(tmp, path)
      kernels.append(dict(index=i, key=sha, dots_ttir=count_same(ttir_dots(ttir)), **call))
    print("CASE " + json.dumps(dict(case=name, baseline=by_name[name].baseline,
                                    kernels=kernels, jax=jax.__version__,
                                    jaxlib=jaxlib.__version__,
                                    seconds=round(time.time() - t0, 1))), flush=True)


# ================================================================= parsing (no jax, no triton)
_PRECISIONS = {"0": "tf32", "1": "tf32x3", "2": "ieee", "3": "bf16x3", "4": "bf16x6"}
_TYPE = re.compile(r"(?:tensor|memdesc)<(?P<dims>\d+(?:x\d+)*)x(?P<elt>[a-z]\w*)")


def _dot_line(line: str) -> dict | None:
  """M, N, K, operand element type and inputPrecision of one tt.dot / warp_group_dot line."""
  m = re.search(r"\b(ttng\.warp_group_dot|tt\.dot)\s", line)
  if not m:
    return None
  sig = line[m.end():].rsplit(" loc(", 1)[0]
  parts = sig.rsplit(" -> ", 1)
  ab = parts[0].split(" * ")
  types = [_TYPE.search(x) for x in (ab[0], ab[-1])] if len(ab) == 2 else [None]
  if len(parts) != 2 or not all(types):
    return dict(unparsed=line.strip()[:200])
  a_dims = [int(d) for d in types[0]["dims"].split("x")]
  b_dims = [int(d) for d in types[1]["dims"].split("x")]
  a = types[0]["elt"]
  p = re.search(r"inputPrecision = (\w+)", line)
  prec = _PRECISIONS.get(p.group(1), p.group(1)) if p else "ieee"  # ieee: elided default
  return dict(op=m.group(1), M=a_dims[-2], K=a_dims[-1], N=b_dims[-1], operand=a,
              precision=prec if a == "f32" else None, result=parts[1])


def ttir_dots(ttir: str) -> list[dict]:
  """Each tt.dot of a TTIR module: M, N, K, operand type and (f32 operands) inputPrecision."""
  res = []
  for line in ttir.splitlines():
    d = _dot_line(line)
    if d is not None:
      d.pop("op", None)
      d.pop("result", None)
      res.append(d)
  return res


_ENC = re.compile(r"^#(?P<alias>[\w.]+) = #ttg\.nvidia_mma<\{versionMajor = (?P<v>\d+)", re.M)


def ttgir_dots(ttgir: str) -> list[dict]:
  """Each dot after Triton's matmul acceleration: M, N, K, operand and MMA kind.

  ttng.warp_group_dot is wgmma; a tt.dot whose result has an nvidia_mma v2 encoding is
  mma.sync; any other tt.dot (blocked encoding) is an FMA loop.
  """
  mma_version = {m["alias"]: int(m["v"]) for m in _ENC.finditer(ttgir)}
  res = []
  for line in ttgir.splitlines():
    d = _dot_line(line)
    if d is None:
      continue
    if "unparsed" in d:
      d["kind"] = "?"
      res.append(d)
      continue
    enc = d.pop("result").rsplit(",", 1)[-1].strip().rstrip(">").lstrip("#")
    if d.pop("op") == "ttng.warp_group_dot" or mma_version.get(enc, 0) >= 3:
      d["kind"] = "wgmma"
    elif enc in mma_version:
      d["kind"] = "mma.sync"
    else:
      d["kind"] = "fma"
    res.append(d)
  return res


def _body(text: str, start: int) -> str:
  """The region that opens at the first '{' ending a line at or after `start` (brace matched).

  Types before the region hold braces too (#ttg.slice<{dim = 1, ...}>): balanced, but the
  region's own brace is the one that ends the op's first line.
  """
  i = text.index("{\n", start)
  depth = 0
  for j in range(i, len(text)):
    if text[j] == "{":
      depth += 1
    elif text[j] == "}":
      depth -= 1
      if depth == 0:
        return text[i:j + 1]
  return text[i:]


_ASYNC = ("ttg.async_copy_global_to_local", "ttng.async_tma_copy_global_to_local")


def ttgir_loops(ttgir: str) -> list[dict]:
  """Each scf.for / scf.while: global loads and async copies inside its body (nested included)."""
  loops = []
  for m in re.finditer(r"\bscf\.(for|while)\b", ttgir):
    body = _body(ttgir, m.end())
    if m.group(1) == "while":  # scf.while: the condition region, then `do { body }`
      end = ttgir.index(body, m.end()) + len(body)
      if ttgir[end:end + 5] == " do {":
        body += _body(ttgir, end)
    loops.append(dict(
        op=f"scf.{m.group(1)}",
        global_loads=len(re.findall(r"\btt\.load\b", body)),
        async_copies=sum(body.count(a) for a in _ASYNC)))
  return loops


def count_same(items: list[dict]) -> list[dict]:
  """Identical dicts merged into one with a "count" (loop versioning repeats each dot)."""
  c = collections.Counter(json.dumps(d, sort_keys=True) for d in items)
  return [dict(json.loads(k), count=n) for k, n in c.items()]


def ttgir_facts(ttgir: str) -> dict:
  dots = ttgir_dots(ttgir)
  loops = ttgir_loops(ttgir)
  return dict(
      dots=count_same(dots),
      loops=loops,
      cp_async=ttgir.count(_ASYNC[0]),
      tma=ttgir.count(_ASYNC[1]),
      tf32_dots=sum(d.get("precision") == "tf32" for d in dots),
      dot_ops=len(dots),
  )


def ptx_facts(ptx: str) -> dict:
  return dict(
      ptx_wgmma=len(re.findall(r"\bwgmma\.mma_async\b", ptx)),
      ptx_mma_sync=len(re.findall(r"\bmma\.sync\b", ptx)),
      ptx_cp_async=len(re.findall(r"\bcp\.async\.(?:ca|cg)\b", ptx)),
      ptx_tma=len(re.findall(r"\bcp\.async\.bulk\.tensor\b", ptx)),
      ptx_tf32=len(re.findall(r"^[^\n]*\.tf32\b", ptx, re.M)),  # instructions, not operands
      ptx_local=len(re.findall(r"\b(?:ld|st)\.local\b", ptx)),
  )


def ptxas_facts(log: str) -> dict:
  """Registers, spills, stack, static smem and barriers from `ptxas -v` output."""
  f = dict(regs=None, stack=None, spill_st=None, spill_ld=None, static_smem=0, barriers=0)
  m = re.search(r"Used (\d+) registers", log)
  if m:
    f["regs"] = int(m.group(1))
  m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                log)
  if m:
    f["stack"], f["spill_st"], f["spill_ld"] = map(int, m.groups())
  m = re.search(r"used (\d+) barriers", log)
  if m:
    f["barriers"] = int(m.group(1))
  m = re.search(r"(\d+) bytes smem", log)
  if m:
    f["static_smem"] = int(m.group(1))
  f["ptxas_warnings"] = [l.strip() for l in log.splitlines() if "warning" in l.lower()]
  return f


# ================================================================= compile (pip triton, own process)
def compile_one(ttir_path: str, num_warps: int, num_stages: int) -> dict:
  """pip triton's NVIDIA stages for sm_90 + ptxas for one kernel; artifacts beside the TTIR."""
  import triton
  from triton._C.libtriton import ir
  from triton.backends.compiler import GPUTarget
  from triton.backends.nvidia.compiler import CUDABackend
  from triton.backends.nvidia.compiler import get_ptxas
  from triton.backends.nvidia.compiler import sm_arch_from_capability
  from triton.compiler.compiler import Language

  base = ttir_path[:-len(".ttir")]
  res = dict(ok=False, stage="setup", error=None, triton=triton.__version__)
  t_start = time.time()
  try:
    target = GPUTarget("cuda", 90, 32)
    be = CUDABackend(target)
    opts = be.parse_options(dict(num_warps=num_warps, num_stages=num_stages))
    ctx = ir.context()
    ir.load_dialects(ctx)
    be.load_dialects(ctx)
    stages = {}
    be.add_stages(stages, opts, Language.TRITON)
    md = {}
    res["stage"] = "parse"
    cur = ir.parse_mlir_module(ttir_path, ctx)
    cur.context = ctx
    for name in ("ttir", "ttgir", "llir", "ptx"):
      res["stage"] = name
      cur = stages[name](cur, md)
      if name == "ttgir":
        text = str(cur)
        with open(base + ".ttgir", "w") as f:
          f.write(text)
        res.update(ttgir_facts(text))
    ptx = cur
    with open(base + ".ptx", "w") as f:
      f.write(ptx)
    res.update(ptx_facts(ptx))
    res["shared"] = md.get("shared")
    res["num_warps_final"] = md.get("num_warps", num_warps)
    res["stage"] = "ptxas"
    ptxas = get_ptxas(target.arch).path
    cmd = [ptxas, "-lineinfo", "-v", f"--gpu-name={sm_arch_from_capability(90)}",
           base + ".ptx", "-o", base + ".cubin"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    log = p.stdout + p.stderr
    with open(base + ".ptxas.log", "w") as f:
      f.write(" ".join(cmd) + "\n" + log)
    if p.returncode != 0:
      raise RuntimeError(f"ptxas exit {p.returncode}: {log[-1500:]}")
    res.update(ptxas_facts(log))
    res["ptxas_version"] = _ptxas_version(ptxas)
    res.update(ok=True, stage="done")
  except Exception as e:  # a compile failure is a result
    res["error"] = f"{type(e).__name__}: {e}"[-3000:]
  res["seconds"] = round(time.time() - t_start, 1)
  return res


def _ptxas_version(path: str) -> str:
  try:
    out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    return re.findall(r"V([\d.]+)", out)[-1]
  except Exception:
    return "?"


# ================================================================= verdict and report
def findings(k: dict) -> list[str]:
  """What fails a kernel (empty list: it passes). k = kernel row (meta + result)."""
  r = k.get("result") or {}
  if not r.get("ok"):
    return [f"compile failed at {r.get('stage')}"]
  out = []
  if r.get("spill_st") or r.get("spill_ld"):
    out.append(f"spills {r.get('spill_st')}/{r.get('spill_ld')} B")
  if (r.get("shared") or 0) > SMEM_LIMIT:
    out.append(f"smem {r['shared']} B > {SMEM_LIMIT}")
  unpiped = [l for l in r.get("loops", []) if l["global_loads"] and not l["async_copies"]]
  if unpiped:
    out.append(f"{len(unpiped)} loop(s) load without async copies")
  no_wgmma = sum(d.get("count", 1) for d in r.get("dots", [])
                 if d.get("M", 0) >= 64 and d.get("kind") != "wgmma"
                 and (d.get("operand") in ("bf16", "f16") or d.get("precision") == "tf32"))
  if no_wgmma:
    out.append(f"{no_wgmma} dot(s) of >= 64 rows without wgmma")
  return out


def notes(k: dict) -> list[str]:
  """Worth knowing, not failing."""
  r = k.get("result") or {}
  if not r.get("ok"):
    return []
  out = []
  if r.get("stack"):
    out.append(f"stack {r['stack']} B")
  if (r.get("regs") or 0) >= MAX_REGS:
    out.append("regs at 255 cap")
  if r.get("tf32_dots"):
    out.append(f"{r['tf32_dots']} f32 dot(s) as tf32")
  small = sum(d.get("count", 1) for d in r.get("dots", [])
              if d.get("kind") in ("mma.sync", "fma") and d.get("precision") != "ieee")
  if small:
    out.append(f"{small} dot(s) without wgmma (< 64 rows)")
  ieee = sum(d.get("count", 1) for d in r.get("dots", []) if d.get("precision") == "ieee")
  if ieee:
    out.append(f"{ieee} ieee f32 dot(s)")
  if r.get("ptxas_warnings"):
    out.append("ptxas warning")
  return out


def _mma(dots: list[dict]) -> str:
  c = collections.Counter()
  for d in dots:
    c[f"{d.get('M')}x{d.get('N')}x{d.get('K')} {d.get('kind')}"] += d.get("count", 1)
  return ", ".join(f"{k}" + (f" x{v}" if v > 1 else "") for k, v in c.items()) or "-"


def _loops(r: dict) -> str:
  loops = r.get("loops", [])
  if not loops:
    return "-"
  piped = sum(1 for l in loops if l["async_copies"])
  loading = sum(1 for l in loops if l["global_loads"] or l["async_copies"])
  return f"{piped}/{loading}"


def _kib(b):
  return "-" if b is None else f"{b / 1024:.1f}"


def render_md(data: dict) -> str:
  s = data["summary"]
  L = ["# Pallas-Triton kernels compiled for sm_90a, no GPU (`benchmarks/triton_sm90.py`)", ""]
  L.append(f"- source {data.get('source')}; date {data['date']}; jax {data['versions'].get('jax')}, jaxlib "
           f"{data['versions'].get('jaxlib')}, pip triton {data['versions'].get('triton')}, ptxas "
           f"{data['versions'].get('ptxas')} (`-v --gpu-name=sm_90a`); target "
           "`GPUTarget('cuda', 90, 32)`; shared-memory limit 227 KiB")
  L.append(f"- cases {s['cases']} ({s['case_failures']} export failures) + "
           f"{s.get('baseline_cases', 0)} baseline (JAX's Pallas `mha`: "
           f"{s.get('baseline_failing', 0)} kernel(s) with findings, not gated), "
           f"kernels {s['kernels']} "
           f"({s['unique_kernels']} distinct), compiled {s['compiled_now']} now / "
           f"{s['cached']} from cache; run time {s['seconds']:.0f} s with {s['jobs']} jobs")
  L.append(f"- **{s['failing_kernels']} failing kernel(s)** (compile failure, spill, smem > 227 "
           "KiB, a loading loop without async copies, a >= 64-row 16-bit/tf32 dot without wgmma)"
           f"; exit status {data.get('exit_status')} (--fail-on {data.get('fail_on')}"
           + (f"; --fail-on all would exit {exit_status(data, 'all')})"
              if data.get("fail_on") != "all" else ")"))
  L.append(f"- spilling kernels {s['spilling']}, non-pipelined loading loops in {s['unpipelined']} "
           f"kernels, kernels with tf32 dots {s['tf32_kernels']}, kernels with 16-bit/tf32 dots "
           f"off wgmma (tiles < 64 rows, not gated) {s.get('non_wgmma_kernels', '?')}, "
           f"max registers {s['max_regs']}, "
           f"max shared memory {_kib(s['max_smem'])} KiB")
  L.append("")
  L.append("Columns: regs = registers per thread; spill = spill stores/loads (bytes); smem = "
           "Triton's shared memory (KiB); async = cp.async / TMA copies in the TTGIR; loops = "
           "pipelined / loading loops (a loop is pipelined when its body holds an async copy); "
           "dots = MxNxK and MMA kind per dot (wgmma, mma.sync, fma); f32 dots show their "
           "precision.")
  L.append("")
  L.append("| case | # | kernel | warps/stages | grid | ok | regs | spill | stack | smem | async "
           "| loops | dots | tf32 | findings |")
  L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  for c in data["cases"]:
    if c.get("error"):
      L.append(f"| {c['case']} | | (export) | | | **FAIL** | | | | | | | | | "
               f"{c['error'].splitlines()[0][:200]} |")
      continue
    for k in c["kernels"]:
      r = k.get("result") or {}
      fail = findings(k)
      note = notes(k)
      if c.get("baseline"):  # JAX's kernels: reported, never gated
        flag = "; ".join(fail + note) + (" (baseline, not gated)" if fail else "")
      else:
        flag = "; ".join([f"**{x}**" for x in fail] + note)
      name = k["name"].replace("|", "/")
      if not r.get("ok"):
        err = (r.get("error") or "").strip().splitlines()
        L.append(f"| {c['case']} | {k['index']} | {name} | {k['num_warps']}/{k['num_stages']} "
                 f"| {'x'.join(map(str, k['grid']))} | **FAIL** | | | | | | | | | "
                 f"{flag}: {(err[0] if err else '')[:160]} |")
        continue
      dots = _mma(r.get("dots", []))
      precs = sorted({d["precision"] for d in r.get("dots", []) if d.get("precision")})
      if precs:
        dots += f" (f32 {'/'.join(precs)})"
      L.append(
          f"| {c['case']} | {k['index']} | {name} | {r.get('num_warps_final')}/{k['num_stages']} "
          f"| {'x'.join(map(str, k['grid']))} | ok | {r.get('regs')} "
          f"| {r.get('spill_st')}/{r.get('spill_ld')} | {r.get('stack')} | {_kib(r.get('shared'))} "
          f"| {r.get('cp_async', 0)}/{r.get('tma', 0)} | {_loops(r)} | {dots} "
          f"| {r.get('tf32_dots', 0)} | {flag} |")
  L.append("")
  if data.get("compare"):
    L += render_compare(data["compare"], data)
  return "\n".join(L)


def _kernel_index(data: dict) -> dict:
  """(case, kernel name, n-th kernel of that name in the case) -> kernel row."""
  out = {}
  for c in data["cases"]:
    seen = collections.Counter()
    for k in c.get("kernels", []):
      out[(c["case"], k["name"], seen[k["name"]])] = k
      seen[k["name"]] += 1
  return out


def _brief(k: dict | None) -> dict:
  """The compared facts of a kernel row, as strings."""
  if k is None:
    return dict(regs="(none)")
  r = k.get("result") or {}
  if not r.get("ok"):
    return dict(regs="FAIL")
  kinds = collections.Counter()
  for d in r.get("dots", []):
    kinds[d.get("kind")] += d.get("count", 1)
  return dict(regs=str(r.get("regs")), spill=f"{r.get('spill_st')}/{r.get('spill_ld')}",
              smem=_kib(r.get("shared")), warps=f"{r.get('num_warps_final')}/{k['num_stages']}",
              dots=", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())) or "-",
              asyn=f"{r.get('cp_async', 0)}/{r.get('tma', 0)}", loops=_loops(r),
              tf32=str(r.get("tf32_dots", 0)), fail=str(len(findings(k))))


def render_compare(before: dict, data: dict) -> list[str]:
  """Per kernel, before -> after (only the facts that changed are shown as a -> b)."""
  b_idx, a_idx = _kernel_index(before), _kernel_index(data)
  cases = {c["case"] for c in data["cases"]}
  order = list(a_idx) + [k for k in b_idx if k not in a_idx and k[0] in cases]
  bs = before.get("summary", {})
  s = data["summary"]
  L = ["## Before -> after", "",
       f"Before: {before.get('source')} ({before.get('date')}): {bs.get('failing_kernels')} "
       f"failing kernels, {bs.get('spilling')} spilling, {bs.get('unpipelined')} with unpipelined "
       f"loops, {bs.get('tf32_kernels')} with tf32 dots, max smem {_kib(bs.get('max_smem'))} KiB. "
       f"After: {s['failing_kernels']} failing, {s['spilling']} spilling, {s['unpipelined']} "
       f"unpipelined, {s['tf32_kernels']} with tf32 dots, max smem {_kib(s['max_smem'])} KiB.", "",
       "| case | kernel | warps/stages | regs | spill st/ld (B) | smem (KiB) | async cp/TMA "
       "| loops piped/loading | dots by MMA kind | tf32 dots | findings |",
       "|---|---|---|---|---|---|---|---|---|---|---|"]
  cols = ("warps", "regs", "spill", "smem", "asyn", "loops", "dots", "tf32", "fail")
  for key in order:
    b, a = _brief(b_idx.get(key)), _brief(a_idx.get(key))
    cells = []
    for col in cols:
      x, y = b.get(col, ""), a.get(col, "")
      cells.append(y if x == y else f"{x or '-'} -> **{y or '-'}**")
    name = key[1] + (f" #{key[2] + 1}" if key[2] else "")
    L.append(f"| {key[0]} | {name} | " + " | ".join(cells) + " |")
  L.append("")
  return L


def summarize(data: dict, seconds: float, jobs: int) -> dict:
  """Counts over flashvjp's cases; baseline cases (JAX's mha) only in baseline_*."""
  ours = [c for c in data["cases"] if not c.get("baseline")]
  base = [c for c in data["cases"] if c.get("baseline")]
  ks = [k for c in ours for k in c.get("kernels", [])]
  ok = [k for k in ks if (k.get("result") or {}).get("ok")]
  res = [k["result"] for k in ok]
  return dict(
      cases=len(ours),
      case_failures=sum(1 for c in ours if c.get("error")),
      baseline_cases=len(base),
      baseline_failing=sum(1 for c in base for k in c.get("kernels", []) if findings(k))
      + sum(1 for c in base if c.get("error")),
      kernels=len(ks),
      unique_kernels=len({k["key"] for k in ks}),
      compiled_now=data.pop("_compiled_now", 0),
      cached=data.pop("_cached", 0),
      compile_failures=len(ks) - len(ok),
      failing_kernels=sum(1 for k in ks if findings(k)),
      spilling=sum(1 for r in res if r.get("spill_st") or r.get("spill_ld")),
      unpipelined=sum(1 for r in res if any(l["global_loads"] and not l["async_copies"]
                                            for l in r.get("loops", []))),
      tf32_kernels=sum(1 for r in res if r.get("tf32_dots")),
      non_wgmma_kernels=sum(1 for r in res if any(
          d.get("kind") in ("mma.sync", "fma") and d.get("precision") != "ieee"
          for d in r.get("dots", []))),
      max_regs=max((r.get("regs") or 0 for r in res), default=0),
      max_smem=max((r.get("shared") or 0 for r in res), default=0),
      seconds=round(seconds, 1), jobs=jobs)


# ================================================================= driver
def run(case_re: str, jobs: int, out_dir: str, cache_dir: str, timeout_s: float) -> dict:
  os.makedirs(os.path.join(out_dir, "kernels"), exist_ok=True)
  os.makedirs(cache_dir, exist_ok=True)
  by_name = {c.name: c for c in matrix()}
  names = [n for n in by_name if not case_re or re.search(case_re, n)]
  if not names:
    raise SystemExit(f"no case matches {case_re!r}")
  shards = [names[i::max(1, jobs)] for i in range(max(1, jobs))]
  shards = [s for s in shards if s]
  pool = cf.ThreadPoolExecutor(max_workers=max(1, jobs))
  futures = {}  # cache key -> future of the result
  lock = threading.Lock()
  counts = collections.Counter()
  case_rows = {}
  versions = {}

  def compile_key(k):
    cached = os.path.join(cache_dir, k["key"] + ".json")
    if os.path.exists(cached):
      with open(cached) as f:
        counts["cached"] += 1
        return json.load(f)
    cmd = [sys.executable, os.path.abspath(__file__), "--compile-one",
           os.path.join(out_dir, "kernels", k["key"] + ".ttir"),
           str(k["num_warps"]), str(k["num_stages"])]
    try:
      p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
      lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
      r = (json.loads(lines[-1][7:]) if lines else
           dict(ok=False, stage="crash", error=f"exit {p.returncode}: {p.stderr[-2000:]}"))
    except subprocess.TimeoutExpired:
      r = dict(ok=False, stage="timeout", error=f"compile took over {timeout_s:g} s")
    counts["compiled_now"] += 1
    if r.get("ok") or r.get("stage") not in ("timeout", "crash"):
      with open(cached + ".tmp", "w") as f:
        json.dump(r, f)
      os.replace(cached + ".tmp", cached)
    print(f"[compile] {k['name']} {k['key']}: " + (
        f"regs={r.get('regs')} spill={r.get('spill_st')}/{r.get('spill_ld')} "
        f"smem={r.get('shared')} {r.get('seconds')}s" if r.get("ok")
        else f"FAIL at {r.get('stage')}: {(r.get('error') or '')[:200]}"), flush=True)
    return r

  def read_shard(shard):
    code = (f"import sys; sys.path.insert(0, {HERE!r}); import triton_sm90 as T; "
            f"T._extract_shard({out_dir!r}, {shard!r})")
    # Exports run on the CPU backend everywhere: identical on a GPU host (no device memory, no
    # CUDA context per shard), and the lowering for CUDA needs no device.
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    err = []
    t = threading.Thread(target=lambda: err.extend(p.stderr), daemon=True)
    t.start()
    seen = set()
    for line in p.stdout:
      if not line.startswith("CASE "):
        continue
      row = json.loads(line[5:])
      seen.add(row["case"])
      print(f"[export] {row['case']}: " + (
          f"{len(row['kernels'])} kernels ({row['seconds']}s)" if "kernels" in row
          else f"FAILED {row['error'][:300]}"), flush=True)
      with lock:
        case_rows[row["case"]] = row
        if "jax" in row:
          versions.update(jax=row["jax"], jaxlib=row["jaxlib"])
        for k in row.get("kernels", []):
          if k["key"] not in futures:
            futures[k["key"]] = pool.submit(compile_key, k)
    p.wait()
    t.join(5)
    for name in shard:
      if name not in seen:  # the extraction process died
        case_rows[name] = dict(case=name, baseline=by_name[name].baseline,
                               error=f"extract process exit {p.returncode}: "
                               + "".join(err)[-2000:])

  t0 = time.time()
  readers = [threading.Thread(target=read_shard, args=(s,)) for s in shards]
  for t in readers:
    t.start()
  for t in readers:
    t.join()
  pool.shutdown(wait=True)
  cases = []
  for name in names:
    row = case_rows[name]
    for k in row.get("kernels", []):
      k["result"] = futures[k["key"]].result()
      if k["result"].get("ok"):
        k.pop("dots_ttir", None)  # the TTGIR's dots (with precision) say it all
      for v in ("triton", "ptxas_version"):
        if k["result"].get(v):
          versions["ptxas" if v == "ptxas_version" else v] = k["result"][v]
    cases.append(row)
  import datetime
  data = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              source=_source_state(), versions=versions, cases=cases, _compiled_now=counts["compiled_now"],
              _cached=counts["cached"])
  data["summary"] = summarize(data, time.time() - t0, jobs)
  return data


def exit_status(data: dict, fail_on: str) -> int:
  s = data["summary"]
  if fail_on == "none":
    return 0
  if fail_on == "compile":
    return 1 if s["case_failures"] or s["compile_failures"] else 0
  return 1 if s["case_failures"] or s["failing_kernels"] else 0


def _source_state() -> str:
  """'<commit>', or '<commit> + uncommitted changes in <files under flashvjp/>' (what was measured)."""
  try:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                          capture_output=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "flashvjp"], cwd=ROOT, text=True,
                           capture_output=True).stdout.rstrip()
  except OSError:
    return "?"
  if not head:
    return "? (not a git checkout)"
  files = [l[3:] for l in dirty.splitlines()]
  return head + (f" + uncommitted changes in {', '.join(files[:6])}"
                 + (" ..." if len(files) > 6 else "") if files else "")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter,
                               epilog=__doc__.split("\n\n", 1)[1])
  ap.add_argument("--cases", default="", help="regex on case names (default: all)")
  ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2,
                  help="parallel export shards and compile processes")
  ap.add_argument("--out-md", default=os.path.join(HERE, "results", "triton_sm90.md"))
  ap.add_argument("--out-json", default=None, help="default: --out-md with .json")
  ap.add_argument("--work", default=os.path.join(ROOT, "build", "triton_sm90"),
                  help="TTIR/TTGIR/PTX/ptxas logs per kernel")
  ap.add_argument("--cache", default=None, help="compile results by kernel hash "
                  "(default: WORK/cache; triton and ptxas versions are in the key via WORK)")
  ap.add_argument("--timeout", type=float, default=300.0, help="per-kernel compile limit (s)")
  ap.add_argument("--fail-on", choices=("all", "compile", "none"), default="all",
                  help="all: any finding fails (exit 1); compile: only export/compile failures; "
                  "none: report only")
  ap.add_argument("--no-fail", "--report-only", dest="fail_on", action="store_const",
                  const="none", help="= --fail-on none: write the report and exit 0")
  ap.add_argument("--compare", help="a previous run's .json: adds a before -> after table")
  ap.add_argument("--list", action="store_true", help="print the case names and exit")
  ap.add_argument("--compile-one", nargs=3, help=argparse.SUPPRESS)
  a = ap.parse_args(argv)
  if a.compile_one:
    path, w, s = a.compile_one
    print("RESULT " + json.dumps(compile_one(path, int(w), int(s))), flush=True)
    return 0
  if a.list:
    print("\n".join(c.name for c in matrix() if not a.cases or re.search(a.cases, c.name)))
    return 0
  try:
    import triton
    tv = triton.__version__
  except ImportError:
    print("triton_sm90: pip triton is not importable (pip install triton==3.6.0)", file=sys.stderr)
    return 2
  cache = a.cache or os.path.join(a.work, "cache", f"triton-{tv}-tool{TOOL_VERSION}")
  data = run(a.cases, a.jobs, a.work, cache, a.timeout)
  data["fail_on"] = a.fail_on
  data["cases_regex"] = a.cases
  data["exit_status"] = exit_status(data, a.fail_on)
  if a.compare:
    with open(a.compare) as f:
      before = json.load(f)
    before.pop("compare", None)
    md_data = dict(data, compare=before)
  else:
    md_data = data
  out_json = a.out_json or os.path.splitext(a.out_md)[0] + ".json"
  os.makedirs(os.path.dirname(os.path.abspath(a.out_md)), exist_ok=True)
  md = render_md(md_data)
  with open(a.out_md, "w") as f:
    f.write(md)
  with open(out_json, "w") as f:
    json.dump(data, f, indent=1)
  print(md.split("Columns:")[0])
  for c in data["cases"]:
    tag = "BASELINE (not gated)" if c.get("baseline") else "FAIL"
    if c.get("error"):
      print(f"{tag} {c['case']}: export: {c['error'].splitlines()[0][:300]}")
    for k in c.get("kernels", []):
      if findings(k):
        print(f"{tag} {c['case']} / {k['name']}: {'; '.join(findings(k))}")
  print(f"wrote {a.out_md} and {out_json}; exit status {data['exit_status']} "
        f"(--fail-on {a.fail_on})")
  return data["exit_status"]


if __name__ == "__main__":
  sys.exit(main())
