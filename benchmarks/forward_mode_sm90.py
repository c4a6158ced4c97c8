"""sm_90 compile check of the Pallas-Triton tangent kernel (forward mode), no GPU.

The machinery of benchmarks/triton_sm90.py (jax.export for CUDA -> the kernels' TTIR ->
pip triton's sm_90 pipeline -> ptxas -v) applied to `jax.jit(jax.jvp(flash_attention))`
with `implementation="pallas_triton", interpret=False` at the library's default blocks.
Reports, per case, the tangent kernel's registers, spills, shared memory, the MMA kind of
its dots and the findings that would fail triton_sm90.py's gate.

    # venv: jax==0.11.2 jaxlib==0.11.2 triton==3.6.0, the project on the path
    python benchmarks/forward_mode_sm90.py     # -> benchmarks/results/forward_mode_sm90.md
    python benchmarks/forward_mode_sm90.py --gate --out-md /tmp/x.md   # CI: exit 1 on a finding
"""
from __future__ import annotations

import datetime
import os
import pathlib
import sys
import tempfile

ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import triton_sm90 as T  # noqa: E402  (the shared compile-check machinery)

# name -> (dtype, head_dim, seq, kwargs)
CASES = {
    "bf16_d64_causal": ("bfloat16", 64, 4096, dict(causal=True)),
    "bf16_d128_causal": ("bfloat16", 128, 4096, dict(causal=True)),
    "bf16_d128_full": ("bfloat16", 128, 4096, {}),
    "bf16_d64_segments_bias": ("bfloat16", 64, 2048, dict(segments=True, bias=True)),
    "bf16_d64_alibi_dropout": ("bfloat16", 64, 2048, dict(causal=True, alibi=True, dropout=True)),
    "f16_d128_softcap_window": ("float16", 128, 2048, dict(softcap=True, window=(256, 0))),
    "f32_d64_causal_tf32": ("float32", 64, 2048, dict(causal=True)),
    "f32_d128_causal_tf32": ("float32", 128, 2048, dict(causal=True)),
    "bf16_d256_causal": ("bfloat16", 256, 2048, dict(causal=True)),
}


def export_jvp(dtype, D, S, kw) -> str:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import export

  import flashvjp
  B, H, Hkv = 1, 8, 8
  dt = jnp.dtype(dtype)
  sd = lambda *s: jax.ShapeDtypeStruct(s, dt)
  q, k, v = sd(B, H, S, D), sd(B, Hkv, S, D), sd(B, Hkv, S, D)
  bias = sd(1, H, S, S) if kw.get("bias") else None
  slopes = jax.ShapeDtypeStruct((H,), jnp.float32) if kw.get("alibi") else None
  opts = dict(causal=kw.get("causal", False), window=kw.get("window"))
  if kw.get("segments"):
    opts["segment_ids"] = jnp.asarray(np.repeat(np.arange(S)[None] * 3 // S, B, 0), jnp.int32)
  if kw.get("dropout"):
    opts.update(dropout_rate=0.1, dropout_rng=jax.random.key(0), deterministic=False)
  if kw.get("softcap"):
    opts["score_mod"] = flashvjp.softcap(30.0)

  def f(q, k, v, bias, slopes):
    extra = dict(opts)
    if slopes is not None:
      extra["score_mod"] = flashvjp.alibi(slopes)
    return flashvjp.flash_attention(q, k, v, bias=bias, implementation="pallas_triton",
                                    interpret=False, return_lse=True, **extra)
  prim = (q, k, v, bias, slopes)
  exp = export.export(jax.jit(lambda p, t: jax.jvp(f, p, t)), platforms=["cuda"], disabled_checks=[
      export.DisabledSafetyCheck.custom_call(T.TRITON_TARGET)])(prim, prim)
  return exp.mlir_module()


def main():
  import argparse
  import warnings
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out-md", default=None,
                      help="where to write the table (default benchmarks/results/forward_mode_sm90.md)")
  parser.add_argument("--gate", action="store_true",
                      help="exit 1 when a tangent kernel fails to compile or has a finding (CI)")
  args = parser.parse_args()
  warnings.simplefilter("ignore")
  T._abstract_h100()  # pylint: disable=protected-access
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for name, (dtype, D, S, kw) in CASES.items():
      calls = [c for c in T.triton_calls(export_jvp(dtype, D, S, kw))
               if "tangent" in c["name"]]
      for n, call in enumerate(calls):
        path = os.path.join(tmp, f"{name}_{n}.ttir")
        with open(path, "w") as f:
          f.write(call["ttir"])
        res = T.compile_one(path, call["num_warps"], call["num_stages"])
        k = dict(result=res)
        fails = T.findings(k)
        row = dict(case=name, kernel=call["name"], warps=call["num_warps"],
                   stages=call["num_stages"], ok=res.get("ok"), regs=res.get("regs"),
                   spill=f"{res.get('spill_st')}/{res.get('spill_ld')}",
                   smem=res.get("shared"), mma=T._mma(res.get("dots", [])),  # pylint: disable=protected-access
                   findings="; ".join(fails) or "none", error=res.get("error"))
        rows.append(row)
        print(row, flush=True)
  when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  md = [f"# sm_90 compile check of the Pallas-Triton tangent kernel ({when})", "",
        "`python benchmarks/forward_mode_sm90.py` (jax 0.11.2, triton 3.6.0, ptxas for sm_90a;"
        " no GPU). jit(jvp(flash_attention)), B=1, H=8, default blocks. Findings as in"
        " benchmarks/triton_sm90.py (spills, shared memory > 227 KiB, unpipelined loads,"
        " >= 64-row 16-bit/tf32 dots off wgmma).", "",
        "| case | warps/stages | ok | registers | spill st/ld (B) | shared (B) | dots | findings |",
        "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    md.append(f"| {r['case']} | {r['warps']}/{r['stages']} | {r['ok']} | {r['regs']} |"
              f" {r['spill']} | {r['smem']} | {r['mma']} | {r['findings']} |")
  out = pathlib.Path(args.out_md or pathlib.Path(ROOT) / "benchmarks" / "results" /
                     "forward_mode_sm90.md")
  out.write_text("\n".join(md) + "\n")
  print("wrote", out)
  bad = [r for r in rows if not r["ok"] or r["findings"] != "none"]
  if not rows:
    bad = [dict(case="(none)", kernel="no tangent kernel found")]
  for r in bad:
    print(f"FAILING: {r['case']} / {r['kernel']}: {r.get('findings')} {r.get('error') or ''}")
  print(f"{len(bad)} failing tangent kernel(s) of {len(rows)}")
  if args.gate and bad:
    sys.exit(1)


if __name__ == "__main__":
  main()
