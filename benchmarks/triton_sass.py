#!/usr/bin/env python3
"""The Pallas-Triton kernels' main loops at the instruction level, beside tokamax's (no GPU).

The Hopper default today is Pallas-Triton, so it gets the comparison the Mosaic-GPU family gets
in `benchmarks/mosaic_gpu_sass.py`: each case exports `jax.jit(jax.value_and_grad(loss))`
for CUDA (`JAX_PLATFORMS=cpu`, as `benchmarks/triton_sm90.py` does), its Triton kernels are
compiled by pip triton 3.6.0 for sm_90a (`triton_sm90.py --compile-one`, a process per
kernel) and ptxas, and nvdisasm prints the SASS. Per kernel: the steady-state loop (the
innermost SASS loop holding warpgroup MMAs with the most MMA work; the shortest of those, an
unmasked block), and the longest such loop (a masked block) beside it. Per loop: instructions
per iteration by class, MMA FLOP (from the HGMMA shapes) per issued instruction, barrier
waits. Per kernel: registers, spill bytes, shared memory.

Ours: `flashvjp.flash_attention(..., implementation="pallas_triton", interpret=False)` with
the library's default GPU blocks: a forward, a dK/dV and a dQ kernel. The anchor: tokamax
0.0.17's Pallas-Triton op (`PallasTritonFlashAttention` and its VJP, `bypass_device_check`)
at the configs tokamax ships as fastest on an H100 (its autotuning data, bf16, one sequence
of 16384 at that head dim; read from the installed package): a forward and one VJP kernel
holding both the dK/dV loop (four products a step) and the dQ loop (three), told apart by
their MMA work. Shape: bf16, B=1, H=16, S=8192, D = 64 / 128 / 256, full and causal.

The SASS is per warp, so MMA FLOP per instruction compares kernels of different warp counts:
it is the MMA work a warp's issued instruction carries. A proxy for speed, never a measured
speed (no stall, bank conflict, or latency is seen); tokamax measures its Pallas-Triton at
363 / 416 TFLOP/s forward (causal / full) and 344 / 341 VJP on H100 (D=128, 16k).

  python benchmarks/triton_sass.py           # -> benchmarks/results/triton_sass.md, .json
  python benchmarks/triton_sass.py --only ours --out /tmp/t   # ours only (no tokamax)
  python benchmarks/triton_sass.py --gate    # CI: ours at D=128 causal against the record

`--gate` fails when a steady loop has more instructions per iteration than recorded, more
spill bytes, or, where it had reached tokamax's MMA FLOP per instruction, falls below it.

Needs jax 0.11.2 + pip triton 3.6.0 (the venv of `triton_sm90.py`) and, for the anchor,
tokamax (`pip install -e .[bench-anchors]`, or on PYTHONPATH).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
import mosaic_gpu_sass as MS  # noqa: E402  (the SASS loop reading, shared)

from tests import _sass  # noqa: E402

RESULTS = os.path.join(HERE, "results")
S, H = 8192, 16
HEAD_DIMS = (64, 128, 256)
TOKAMAX_DATA = "data/autotuning/nvidia_h100_80gb_hbm3/pallas_triton_flash_attention{}.json"


@dataclasses.dataclass(frozen=True)
class Case:
  impl: str  # ours | tokamax
  D: int
  causal: bool

  @property
  def name(self) -> str:
    return f"{self.impl}:D{self.D}:{'causal' if self.causal else 'full'}"


def cases(only: str) -> list[Case]:
  if only == "gate":  # CI: ours at D=128, causal (its steady loops are the full kernels')
    return [Case("ours", 128, True)]
  impls = {"all": ("ours", "tokamax"), "ours": ("ours",), "anchors": ("tokamax",)}[only]
  return [Case(i, D, c) for i in impls for D in HEAD_DIMS for c in (False, True)]


def gate(results: list[dict], recorded: list[dict]) -> list[str]:
  """Regressions against the recorded run (messages; empty: none): a steady loop longer than
  recorded, more spill bytes, or a kernel that had reached tokamax's MMA FLOP per
  instruction falling below it."""
  rec = {r["case"]: r for r in recorded}
  anchors = {(r["D"], r["causal"]): r for r in recorded if r["impl"] == "tokamax"}
  failures = []
  for r in results:
    old = rec.get(r["case"])
    if old is None:
      failures.append(f"{r['case']}: not in the recorded results")
      continue
    failures += MS.case_regressions(r, old, anchors.get((r["D"], r["causal"])))
  return failures


def tokamax_configs(D: int, causal: bool) -> tuple[dict, dict]:
  """tokamax's fastest H100 configs (forward with residuals, VJP) at bf16, one sequence of
  16384, head dim D: what its autotuning data ships."""
  import tokamax
  base = os.path.dirname(tokamax.__file__)
  out = []
  for suffix, want_res in (("", True), ("_vjp", None)):
    data = json.load(open(os.path.join(base, TOKAMAX_DATA.format(suffix))))
    best = None
    for key, configs in data.items():
      k = json.loads(key)
      if not re.fullmatch(rf"bf16\[1,16384,\d+,{D}\]", k["q"]) or k["bias"] is not None:
        continue
      m = k["mask"]
      if m.get("bool_mask") is not None or bool(m.get("causal_mask")) != causal:
        continue
      if want_res is not None and k.get("return_residuals") != want_res:
        continue
      for c, r in configs.items():
        t = min(r["evaluation_times_ms"])
        if best is None or t < best[0]:
          best = (t, json.loads(c))
    if best is None:
      raise RuntimeError(f"tokamax ships no H100 config{suffix} at D={D} causal={causal}")
    out.append(best[1])
  return out[0], out[1]


_EXPORT = r"""
import json, sys
sys.path.insert(0, sys.argv[3]); sys.path.insert(0, sys.argv[3] + "/benchmarks")
import jax, jax.numpy as jnp
from jax import export
import triton_sm90 as T9
import triton_sass as TS
T9._abstract_h100()
impl, D, mask = sys.argv[1].split(":")
D, causal, S, H = int(D[1:]), mask == "causal", TS.S, TS.H
bf = jnp.bfloat16
config = None
if impl == "ours":
  import flashvjp
  from flashvjp import _config
  for spec in json.loads(sys.argv[4]):  # --launch: a trial entry of the launch table
    role, *p = spec.split(":")
    _config.LAUNCH_TABLE[(D, "16bit", role)] = _config.Launch(*map(int, p))
  q = jax.ShapeDtypeStruct((1, H, S, D), bf)
  attn = lambda q, k, v: flashvjp.flash_attention(q, k, v, causal=causal,
      implementation="pallas_triton", interpret=False)
else:
  from tokamax._src.ops.attention import pallas_triton as T, pallas_triton_vjp as TV
  fc, vc = TS.tokamax_configs(D, causal)
  config = dict(fwd=fc, vjp=vc)
  op = T.PallasTritonFlashAttention(config=T.Config(**fc), bypass_device_check=True,
      vjp=TV.PallasTritonFlashAttentionVjp(config=TV.Config(**vc), bypass_device_check=True))
  q = jax.ShapeDtypeStruct((1, S, H, D), bf)
  attn = lambda q, k, v: op(q, k, v, is_causal=causal)
f = jax.jit(jax.value_and_grad(lambda q, k, v: attn(q, k, v).astype(jnp.float32).sum(),
                               argnums=(0, 1, 2)))
exp = export.export(f, platforms=["cuda"], disabled_checks=[
    export.DisabledSafetyCheck.custom_call(T9.TRITON_TARGET)])(q, q, q)
calls = T9.triton_calls(exp.mlir_module())
print("EXPORT " + json.dumps(dict(config=config, jax=jax.__version__, calls=calls)))
"""


def export_case(case: Case, work: str, launch=()) -> tuple[dict | None, list[dict]]:
  """The case's Triton kernels: (tokamax's config or None, [{name, num_warps, num_stages,
  ttir path}]), exported in a fresh process."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  p = subprocess.run([sys.executable, "-c", _EXPORT, case.name, work, ROOT,
                      json.dumps(list(launch))],
                     capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
  lines = [ln for ln in p.stdout.splitlines() if ln.startswith("EXPORT ")]
  if not lines:
    raise RuntimeError(f"export failed: {p.stderr[-1500:]}")
  data = json.loads(lines[-1][len("EXPORT "):])
  kernels = []
  for i, call in enumerate(data["calls"]):
    ttir = call.pop("ttir")
    key = hashlib.sha256(f"{ttir}{call['num_warps']}{call['num_stages']}".encode()).hexdigest()
    path = os.path.join(work, f"{case.name.replace(':', '_')}_{i}_{key[:12]}.ttir")
    open(path, "w").write(ttir)
    kernels.append(dict(call, ttir=path))
  return data["config"], kernels


def compile_kernel(k: dict) -> dict:
  """pip triton + ptxas for sm_90a (a fresh process), then the SASS loops of its cubin."""
  p = subprocess.run([sys.executable, os.path.join(HERE, "triton_sm90.py"), "--compile-one",
                      k["ttir"], str(k["num_warps"]), str(k["num_stages"])],
                     capture_output=True, text=True, timeout=900)
  lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
  r = json.loads(lines[-1][7:]) if lines else dict(ok=False, error=p.stderr[-1500:])
  if not r.get("ok"):
    raise RuntimeError(f"{k['name']}: compile failed: {r.get('error')}")
  cubin = k["ttir"][:-len(".ttir")] + ".cubin"
  (nvdisasm, *_) = _sass._candidates("nvdisasm")
  text = subprocess.run([nvdisasm, cubin], capture_output=True, text=True, check=True,
                        timeout=300).stdout
  return dict(registers=r["regs"], spill_bytes=(r.get("spill_st") or 0) + (r.get("spill_ld")
              or 0), smem_bytes=r.get("shared") or 0, loops=MS.mma_loops(text),
              num_warps=k["num_warps"], num_stages=k["num_stages"], kernel=k["name"])


def kernel_rows(case: Case, compiled: list[dict]) -> dict:
  """{role: row}: ours' kernels by name; tokamax's VJP kernel split into its two loops."""
  rows = {}
  for c in compiled:
    loops = c.pop("loops")
    if not loops:
      raise RuntimeError(f"{case.name}: no MMA loop in {c['kernel']}")
    name = c["kernel"]
    if case.impl == "ours":
      role = ("dkdv" if "dkdv" in name else "dq" if "bwd_dq" in name else
              "fwd" if name.startswith("flashvjp_fwd") else None)
      if role is None:
        continue
      steady, masked = MS.steady_and_masked(loops)
      rows[role] = dict(c, steady=steady, masked=masked, mma_loops=len(loops))
    elif "vjp" in name:
      # one kernel, two loop families: dK/dV's (S, dP, dV, dK: four products) and dQ's
      # (S, dP, dQ: three), told apart by MMA work per iteration
      work = sorted({x.mma_flop for x in loops}, reverse=True)
      if len(work) < 2:
        raise RuntimeError(f"{case.name}: {name} has {len(work)} loop kinds, expected 2")
      for role, flop in (("dkdv", work[0]), ("dq", work[1])):
        steady, masked = MS.steady_and_masked([x for x in loops if x.mma_flop == flop])
        rows[role] = dict(c, steady=steady, masked=masked, mma_loops=len(loops))
    else:
      steady, masked = MS.steady_and_masked(loops)
      rows["fwd"] = dict(c, steady=steady, masked=masked, mma_loops=len(loops))
  missing = {"fwd", "dq", "dkdv"} - set(rows)
  if missing:
    raise RuntimeError(f"{case.name}: no {sorted(missing)} kernel")
  return rows


def run_case(case: Case, work: str, jobs: int, launch=()) -> dict:
  config, kernels = export_case(case, work, launch)
  with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
    compiled = list(pool.map(compile_kernel, kernels))
  return dict(case=case.name, impl=case.impl, D=case.D, causal=case.causal, config=config,
              kernels=kernel_rows(case, compiled))


def table(results: list[dict]) -> str:
  by = {(r["impl"], r["D"], r["causal"]): r for r in results}
  lines = ["| kernel | D | mask | ours: instructions / MMA MFLOP | tokamax | ours' MMA FLOP"
           " per instruction vs tokamax | ours: warps / stages | tokamax | ours: registers /"
           " spills / smem KiB | tokamax |", "|---|---|---|---|---|---|---|---|---|---|"]
  for D in HEAD_DIMS:
    for causal in (False, True):
      ours, tk = by.get(("ours", D, causal)), by.get(("tokamax", D, causal))
      for role in ("fwd", "dq", "dkdv"):
        if ours is None:
          continue
        k = ours["kernels"][role]
        ak = tk["kernels"][role] if tk else None

        def loop(x):
          return f"{x['instructions']} / {x['mma_flop'] / 1e6:.2f}"

        def res(x):
          return f"{x['registers']} / {x['spill_bytes']} / {x['smem_bytes'] / 1024:.0f}"

        s = k["steady"]
        if ak is None:
          lines.append(f"| {role} | {D} | {'causal' if causal else 'full'} | {loop(s)} | |"
                       f" | {k['num_warps']} / {k['num_stages']} | | {res(k)} | |")
          continue
        a = ak["steady"]
        ratio = s["flop_per_instruction"] / a["flop_per_instruction"]
        lines.append(f"| {role} | {D} | {'causal' if causal else 'full'} | {loop(s)} |"
                     f" {loop(a)} | **{ratio:.2f}x** | {k['num_warps']} / {k['num_stages']} |"
                     f" {ak['num_warps']} / {ak['num_stages']} | {res(k)} | {res(ak)} |")
  return "\n".join(lines)


def class_table(results: list[dict]) -> str:
  lines = []
  for r in results:
    if r["D"] != 128:
      continue
    for role, k in r["kernels"].items():
      s = k["steady"]
      lines.append(f"- {role} D=128 {'causal' if r['causal'] else 'full'}, {r['impl']}"
                   f" ({s['instructions']}): {MS._classes(s['classes'], 14)}")
  return "\n".join(sorted(lines))


def render(results: list[dict], versions: dict) -> str:
  configs = [f"- D={r['D']} {'causal' if r['causal'] else 'full'}: forward {r['config']['fwd']},"
             f" VJP {r['config']['vjp']}" for r in results if r["impl"] == "tokamax"]
  return "\n\n".join([
      "# Pallas-Triton kernels beside tokamax's, SASS per iteration (sm_90a, no GPU)",
      f"`python benchmarks/triton_sass.py` (jax {versions.get('jax')}, pip triton"
      f" {versions.get('triton')}, ptxas + nvdisasm; bf16, B=1, H={H}, S={S}; ours at the"
      " library's default GPU blocks, tokamax at its shipped H100 autotuned configs). Per"
      " kernel, the steady-state loop: the innermost SASS loop holding warpgroup MMAs with the"
      " most MMA work, the shortest such (an unmasked block). SASS is per warp: MMA FLOP per"
      " instruction is the work a warp's issued instruction carries, comparable across warp"
      " counts. A proxy for speed, never a measured one.",
      table(results),
      "## Instructions by class (D=128, the steady loops)",
      class_table(results),
      "## tokamax's configs (its H100 autotuning data, bf16, one sequence of 16384)",
      "\n".join(configs) or "(not compiled)",
  ]) + "\n"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--only", choices=("all", "ours", "anchors", "gate"), default="all")
  ap.add_argument("--gate", action="store_true",
                  help="compile the gated case (ours, D=128, causal) and fail on a regression"
                  " against the recorded results (not rewritten)")
  ap.add_argument("--jobs", type=int, default=2)
  ap.add_argument("--out", default=os.path.join(RESULTS, "triton_sass"),
                  help="results stem (.json and .md)")
  ap.add_argument("--work", default=None, help="kernel files (default: a temporary folder)")
  args = ap.parse_args(argv)
  why = _sass.unavailable()
  if why:
    print(f"triton_sass: {why}")
    return 2
  import triton
  work = args.work or tempfile.mkdtemp(prefix="triton_sass_")
  os.makedirs(work, exist_ok=True)
  results, errors = [], []
  for case in cases("gate" if args.gate else args.only):
    try:
      r = run_case(case, work, args.jobs)
    except Exception as e:  # reported; the run fails
      errors.append(f"{case.name}: {e}")
      print(f"ERROR {case.name}: {str(e)[-600:]}", flush=True)
      continue
    results.append(r)
    for role, k in r["kernels"].items():
      s = k["steady"]
      print(f"{case.name} {role}: {s['instructions']} instructions / {s['mma_flop'] / 1e6:.2f}"
            f" MMA MFLOP ({s['flop_per_instruction']:.0f} per instruction), {k['registers']}"
            f" registers, {k['spill_bytes']} spill bytes", flush=True)
  import jax
  versions = dict(jax=jax.__version__, triton=triton.__version__)
  if args.gate:
    recorded = json.load(open(args.out + ".json"))
    if recorded["versions"] != versions:
      print(f"gate: the counts were recorded with {recorded['versions']}, this is {versions}:"
            " not comparable (re-record with the GPU image's versions)")
      return 1
    failures = gate(results, recorded["results"]) + errors
    for f in failures:
      print("FAIL", f)
    print(f"gate: {len(results)} cases, {len(failures)} failures")
    return 1 if failures else 0
  text = render(results, versions)
  print(text)
  if not errors:
    json.dump(dict(versions=versions, S=S, H=H, results=results),
              open(args.out + ".json", "w"), indent=1)
    open(args.out + ".md", "w").write(text)
  return 1 if errors else 0


if __name__ == "__main__":
  sys.exit(main())
