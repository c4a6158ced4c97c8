"""GPU check of flashvjp's Pallas kernels: correctness, headline timings, block-size sweep.

Run on a GPU machine (jax with CUDA, chex, numpy; no other package, no registry needed)::

    bash benchmarks/gpu_check.sh                   # this script, then the sm_90a compile check
    PYTHONPATH=. python3 benchmarks/gpu_check.py   # this script alone
    python benchmarks/gpu_check.py --dry-run       # the plan and its time estimate; runs nothing

The parts, in order of value (each row is recorded as it finishes, so a run that is stopped
still leaves its results):

0. The Mosaic-GPU family (`implementation="pallas_mosaic_gpu"`: its sm_90a kernels on Hopper,
   its sm_100a ones on Blackwell, where forward mode and the per-entry features they refuse
   are listed as not planned), first because it has never run on a GPU: (a) correctness of every feature it takes (the same comparison as part
   1: out, lse, every gradient and the jvp tangents against float64 naive, bitwise
   determinism; a feature the family refuses is listed as not planned, with the refusal),
   (b) timing, bfloat16, head_dim 128, seq 4k and 16k, causal and not, forward and
   forward+backward, against Pallas-Triton and cuDNN in the same run. The results file's
   `mosaic_verdict` says, per (head_dim, causal) class, whether the family was valid (every
   correctness row passed) and faster than Pallas-Triton at every timed shape: what a launch
   table for choosing between the two NVIDIA families would record.
1. Correctness: every feature through the compiled Triton kernels (interpret=False) on
   bfloat16, float16 and float32: out, lse, every gradient (value_and_grad) and the jvp
   tangents of out and lse, against naive attention in float64 on the host CPU, plus bitwise
   determinism. float32 rows run at each distinct float32 matmul precision (the default,
   TF32 on the GPU, and jax.default_matmul_precision("highest")), judged at
   flashvjp._check.tolerance(dtype, "pallas_triton", precision) for the precision in effect.
   The dispatcher's refusals of what cannot lower (a gather in a score_mod / mask_mod) are
   checked without running a kernel.
2. Headline timings, bfloat16, head_dim 128 and 64, causal and not, seq 1k-16k (32k where
   memory allows): forward, forward+backward and jvp of flashvjp against
   jax.nn.dot_product_attention(implementation="cudnn"), its "xla" path and JAX's Pallas
   `mha`, in TFLOP/s (FlashAttention convention; jvp = 3x forward) with ratios measured in
   the same run. cuDNN and `mha` are custom_vjp functions without forward mode: their jvp is
   not planned (recorded as skipped).
3. Block-size sweep of the launch table (flashvjp._config.LAUNCH_TABLE) for bfloat16 at head
   dims 128 and 64, per kernel role (fwd timed by the forward, dkdv / dq by forward+backward,
   the other roles at the table's values): the fastest entry per role is written as a launch
   table file (<out>_launch_table.json, with the machine it came from) that
   flashvjp._config.load_launch_table reads.
4. (gpu_check.sh, after this script) the sm_90a compile check with the GPU image's Triton,
   compared with the CI's pip-Triton figures (benchmarks/results/triton_sm90.json).

The run keeps to --budget-s: part 0 must end by 36% of it (its correctness by 18%), part 1
by 55%, part 2 by 85%, part 3 by 100%
(time a part leaves unused goes to the next). A row starts only if its estimated seconds fit
before its part's deadline; what was skipped, and why, is recorded. Estimates are a model
(compile + run at assumed rates) unless a previous GPU run's results file holds the row's
measured seconds (--estimates).

`--cpu-smoke` runs every part on CPU in interpret mode with tiny shapes (CI runs it: any row
that errors or fails fails CI). Exit status: 1 when any row is FAIL or ERROR, else 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable

if "--cpu-smoke" in sys.argv:
  # The Mosaic-GPU interpreter runs each warpgroup as a program on XLA's CPU pool (sized from
  # NPROC when XLA's CPU client starts): fewer threads than warpgroups deadlocks it
  # (flashvjp.pallas.mosaic_gpu._compat.interpret_threads_problem).
  os.environ.setdefault("NPROC", "8")

import jax
import jax.numpy as jnp
import numpy as np

import flashvjp
from flashvjp import _api
from flashvjp import _check
from flashvjp import _config
from flashvjp import _dispatch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS_DIR = os.path.join(HERE, "results")
SMOKE_RESULTS_DIR = os.path.join(ROOT, "build", "gpu_check_smoke")  # git-ignored
BACKEND = "pallas_triton"  # the Pallas family under test
MOSAIC = "pallas_mosaic_gpu"  # the Hopper family, checked first (part 0)
for _b in (BACKEND, MOSAIC):
  if _b not in _dispatch.CONCRETE:  # renamed backends: fail at once, not on a lent GPU
    raise ImportError(f"gpu_check: backend {_b!r} is not in flashvjp._dispatch.CONCRETE "
                      f"{_dispatch.CONCRETE}")
IMPLS = ("flashvjp", "cudnn", "xla", "jax_pallas_mha")
MOSAIC_IMPLS = ("mosaic", "flashvjp", "cudnn")  # part 0's timing: the family, Triton, cuDNN
MODES = ("fwd", "fwd+bwd", "jvp")
JVP_IMPLS = ("flashvjp", "xla")  # cuDNN and JAX's mha are custom_vjp: no forward mode
PART_DEADLINES = {"mosaic_correctness": 0.18, "mosaic_timing": 0.36, "correctness": 0.55,
                  "timing": 0.85, "sweep": 1.00}  # share of the budget
DEFAULT_BUDGET_S = 360.0  # gpu_check.sh gives the compile check the rest of 480 s
TOTAL_S = 480  # gpu_check.sh: this script + the compile check (about 8 minutes)
ASSUMED_GPU = ("NVIDIA H200 (assumed: no GPU here)", 141e9)  # device, memory bytes (dry run)
JVP_FLOP_FACTOR = 3.0  # forward (2 matmuls) + tangent (dQ K^T + Q dK^T, dP V + P dV)


def _err(e: BaseException) -> str:
  msg = str(e).strip().splitlines()
  return f"{type(e).__name__}: {msg[0][:300] if msg else ''}"


def precisions():
  """The distinct float32 matmul precisions to check: [(name, canonical)], default first.

  A name that flashvjp maps to an already listed canonical precision is not repeated, so a
  precision policy with more levels (e.g. "high" as its own) adds rows by itself.
  """
  out, seen = [], set()
  for name in ("default", "high", "highest"):
    try:
      canon = _config.canonical_precision(name)
    except ValueError:
      continue
    if canon not in seen:
      seen.add(canon)
      out.append((name, canon))
  return out


def flops(B, H, S, D, causal, mode):
  f = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)
  return {"fwd": f, "fwd+bwd": 3.5 * f, "jvp": JVP_FLOP_FACTOR * f}[mode]


# ---- the plan -----------------------------------------------------------------------------

@dataclasses.dataclass
class Row:
  part: str  # a key of PART_DEADLINES
  key: str  # unique within the run; the results' name of the row
  shape: str  # what runs, for the plan
  est_s: float  # estimated wall seconds
  fn: Callable[[Run, Row], dict]  # runs it; returns the result fields (status included)
  args: dict = dataclasses.field(default_factory=dict)


class Plan:
  def __init__(self):
    self.rows: list[Row] = []
    self.not_planned: list[str] = []  # "key: why" for rows left out before any run


# -- part 1: correctness

def _case_arrays(smoke):
  """(S, S2, dense mask [2, 1, S, S2] with an empty row, q / kv segment ids [2, S] / [2, S2])
  shared by the correctness cases of parts 0 and 1."""
  S = 40 if smoke else 300  # not a multiple of the blocks: padding is exercised
  S2 = 33 if smoke else 257
  rng = np.random.default_rng(0)
  mask = rng.random((2, 1, S, S2)) > 0.3
  mask[:, :, 3] = False  # an empty row
  seg_q = np.repeat(np.arange(S)[None] * 3 // S, 2, 0).astype(np.int32)
  seg_kv = np.repeat(np.arange(S2)[None] * 3 // S2, 2, 0).astype(np.int32)
  return S, S2, mask, seg_q, seg_kv


def correctness_cases(smoke):
  """[(name, dims, kwargs, precision name or None)] in priority order (budget cuts the end)."""
  S, S2, mask, seg_q, seg_kv = _case_arrays(smoke)
  bias = lambda shape: 0.5 * jax.random.normal(jax.random.key(9), shape, jnp.float32)
  drop = dict(dropout_rate=0.2, dropout_rng=jax.random.key(3), deterministic=False)
  prefix = jnp.asarray([S // 3, S // 2], jnp.int32)
  kv_bias = jnp.cos(jnp.arange(2 * S2, dtype=jnp.float32)).reshape(2, S2)  # read by kv position
  rel_table = 0.5 * jnp.sin(jnp.arange(4 * 65, dtype=jnp.float32)).reshape(4, 65)  # by kv - q
  base = dict(B=2, H=4, Hkv=2, Sq=S, Skv=S2, D=64, Dv=64, dtype="bfloat16")
  f32 = dict(dtype="float32")
  combo = dict(causal=True, segment_ids=(jnp.asarray(seg_q), jnp.asarray(seg_kv)),
               mask=jnp.asarray(mask), bias=bias((1, 4, S, S2)), score_mod=flashvjp.softcap(5.0))
  c = [  # every feature once first, then more dtypes / head dims / layouts
      ("plain bf16", {}, {}),
      ("plain f32", f32, {}),
      ("causal", {}, dict(causal=True)),
      ("causal f32 square", dict(f32, Skv=S), dict(causal=True)),
      ("head_dim 128", dict(D=128, Dv=128), {}),
      ("window(48,16)", {}, dict(window=(48, 16))),
      ("segment_ids", {}, dict(segment_ids=(jnp.asarray(seg_q), jnp.asarray(seg_kv)))),
      ("mask dense + empty row", {}, dict(mask=jnp.asarray(mask))),
      ("bias full (grad)", {}, dict(bias=bias((2, 4, S, S2)))),
      ("softcap score_mod", {}, dict(score_mod=flashvjp.softcap(5.0))),
      ("alibi score_mod (slopes[h] per head)", {},
       dict(causal=True, score_mod=flashvjp.alibi(flashvjp.alibi_slopes(4)))),
      ("mask_mod prefix_lm", dict(Skv=S), dict(mask_mod=flashvjp.prefix_lm(prefix))),
      ("score_mod kv bias by position (grad)", {},
       dict(causal=True, score_mod=lambda s, b, h, i, j: s + kv_bias[b, j])),
      ("mask_mod document_causal", dict(Skv=S),
       dict(mask_mod=flashvjp.document_causal(jnp.asarray(seg_q)))),
      ("score_mod relative_position_bias (grad)", {},
       dict(causal=True, score_mod=flashvjp.relative_position_bias(rel_table, 32))),
      ("sinks (grad)", {}, dict(causal=True, sinks=jnp.linspace(-1.0, 2.0, 4))),
      ("dropout", {}, drop),
      ("combo", {}, dict(combo, **drop)),
      ("plain f16", dict(dtype="float16"), {}),
      ("head_dim 96/40 (padded)", dict(D=96, Dv=40), dict(causal=True)),
      ("head_dim 256", dict(D=256, Dv=256), dict(causal=True)),
      ("mqa", dict(Hkv=1), dict(causal=True)),
      ("mha", dict(Hkv=4), {}),
      ("mask key padding", {}, dict(mask=jnp.asarray(mask[:, :, :1]))),
      ("bias [1,H,1,Skv] (grad)", {}, dict(bias=bias((1, 4, 1, S2)))),
      ("head_dim 128 f32 causal", dict(f32, D=128, Dv=128), dict(causal=True)),
      ("combo f32", f32, combo),
  ]
  # float32 cases at the default precision in place, their other precisions after every
  # case: the budget cuts the end, and each feature's first row on the GPU is worth more
  out, later = [], []
  for name, shape, kw in c:
    dims = {**base, **shape}
    if dims["dtype"] == "float32":
      for n, (pname, _) in enumerate(precisions()):
        (later if n else out).append((f"{name} (precision {pname})", dims, kw, pname))
    else:
      out.append((name, dims, kw, None))
  return out + later


def _est_correctness(smoke, dims):
  if smoke:  # interpret mode: tracing + CPU compile dominate
    return 4.0 if dims["D"] <= 128 else 6.0
  return 5.0 if dims["D"] <= 128 else 7.0  # Triton compile of 4 kernels + host reference


def plan_correctness(plan: Plan, smoke):
  for name in ("refusal: pair-indexed score_mod (gather)",
               "refusal: pair-indexed mask_mod (gather)"):
    plan.rows.append(Row("correctness", f"correctness {name}", "explain() only, no kernel",
                         0.5, run_refusal_row, dict(name=name)))
  for name, dims, kw, pname in correctness_cases(smoke):
    shape = (f"B{dims['B']} H{dims['H']}/{dims['Hkv']} S{dims['Sq']}x{dims['Skv']} "
             f"D{dims['D']}/{dims['Dv']} {dims['dtype']}"
             + (f" @{pname}" if pname else "") + " grad+jvp")
    plan.rows.append(Row("correctness", f"correctness {name}", shape,
                         _est_correctness(smoke, dims), run_correctness_row,
                         dict(name=name, dims=dims, kw=kw, precision=pname)))


# -- part 0: the Mosaic-GPU family

def mosaic_cases(smoke):
  """[(name, dims, kwargs, None)] of the Mosaic-GPU family in priority order (16-bit only)."""
  S, S2, mask, seg_q, seg_kv = _case_arrays(smoke)
  bias = 0.5 * jax.random.normal(jax.random.key(9), (2, 4, S, S2), jnp.float32)
  kv_bias = jnp.cos(jnp.arange(2 * S2, dtype=jnp.float32)).reshape(2, S2)  # read by kv position
  rel_table = 0.3 * jax.random.normal(jax.random.key(11), (4, 65), jnp.float32)  # by kv - q
  base = dict(B=2, H=4, Hkv=2, Sq=S, Skv=S2, D=64, Dv=64, dtype="bfloat16")
  c = [
      ("plain bf16", {}, {}),
      ("causal", {}, dict(causal=True)),
      ("head_dim 128 causal", dict(D=128, Dv=128), dict(causal=True)),
      ("window(48,16)", {}, dict(window=(48, 16))),
      ("segment_ids", {}, dict(segment_ids=(jnp.asarray(seg_q), jnp.asarray(seg_kv)))),
      ("mask dense + empty row", {}, dict(mask=jnp.asarray(mask))),
      ("bias full (grad)", {}, dict(bias=bias)),
      ("dropout", {}, dict(dropout_rate=0.2, dropout_rng=jax.random.key(3),
                           deterministic=False)),
      ("sinks (grad)", {}, dict(causal=True, sinks=jnp.linspace(-1.0, 2.0, 4))),
      ("alibi score_mod (slopes[h] per head)", {},
       dict(causal=True, score_mod=flashvjp.alibi(flashvjp.alibi_slopes(4)))),
      ("mask_mod prefix_lm", dict(Skv=S),
       dict(mask_mod=flashvjp.prefix_lm(jnp.asarray([S // 3, S // 2], jnp.int32)))),
      ("score_mod kv_bias[b, kv] (per kv position)", {},
       dict(causal=True, score_mod=lambda s, b, h, i, j: s + kv_bias[b, j])),
      ("mask_mod document_causal (ids by position)", dict(Skv=S),
       dict(mask_mod=flashvjp.document_causal(jnp.asarray(seg_q)))),
      ("score_mod relative_position_bias (grad; by kv - q)", {},
       dict(causal=True, score_mod=flashvjp.relative_position_bias(rel_table, 32))),
      ("plain f16", dict(dtype="float16"), {}),
      ("mqa", dict(Hkv=1), dict(causal=True)),
      ("head_dim 256 causal", dict(D=256, Dv=256), dict(causal=True)),
      ("head_dim 96/40 (padded)", dict(D=96, Dv=40), dict(causal=True)),
  ]
  if smoke:  # interpret mode simulates every warpgroup: two cases keep CI's smoke run short
    c = c[:2]
  return [(name, {**base, **shape}, kw, None) for name, shape, kw in c]


def mosaic_refusal(dims, kw, blackwell=False):
  """Why the family refuses this case (its limits, asked as in interpret mode: what the
  kernels take on any host; on a Blackwell GPU, `blackwell`, what its sm_100a kernels take),
  or None."""
  if blackwell:
    untaken = [n for n in BLACKWELL_UNTAKEN if kw.get(n) is not None]
    if untaken:
      return f"the Blackwell (sm_100a) kernels take no {', '.join(untaken)} yet"
  q = jax.ShapeDtypeStruct((dims["B"], dims["H"], dims["Sq"], dims["D"]), dims["dtype"])
  k = jax.ShapeDtypeStruct((dims["B"], dims["Hkv"], dims["Skv"], dims["D"]), dims["dtype"])
  v = jax.ShapeDtypeStruct((dims["B"], dims["Hkv"], dims["Skv"], dims["Dv"]), dims["dtype"])
  try:
    flashvjp.explain(q, k, v, implementation=MOSAIC, interpret=None if blackwell else True,
                     **kw)
  except (ValueError, TypeError) as e:
    return _err(e)
  return None


def plan_mosaic(plan: Plan, smoke, mem_bytes):
  blackwell = blackwell_host(smoke)
  if blackwell:
    plan.not_planned.append("mosaic jvp: the Blackwell (sm_100a) kernels have no tangent kernel"
                            " yet (forward mode is refused there); the rows check out, lse"
                            " and every gradient")
  for name, dims, kw, _ in mosaic_cases(smoke):
    key = f"mosaic correctness {name}"
    why = mosaic_refusal(dims, kw, blackwell=blackwell)
    if why is not None:
      plan.not_planned.append(f"{key}: the family refuses it ({why})")
      continue
    shape = (f"B{dims['B']} H{dims['H']}/{dims['Hkv']} S{dims['Sq']}x{dims['Skv']} "
             f"D{dims['D']}/{dims['Dv']} {dims['dtype']} grad{'' if blackwell else '+jvp'}")
    est = 40.0 if smoke else _est_correctness(smoke, dims) + 2.0
    plan.rows.append(Row("mosaic_correctness", key, shape, est, run_correctness_row,
                         dict(name=name, dims=dims, kw=kw, precision=None, impl=MOSAIC)))
  impls = [i for i in MOSAIC_IMPLS if not (smoke and i == "cudnn")]
  if smoke:
    plan.not_planned.append("mosaic timing cudnn: cuDNN runs on NVIDIA GPUs only")
  for S in ((64,) if smoke else (4096, 16384)):
    D = 64 if smoke else 128
    B, H = timing_dims(S, D, smoke)
    for causal in ((True,) if smoke else (True, False)):  # smoke: one row per impl
      for mode in (("fwd",) if smoke else ("fwd+bwd", "fwd")):
        for impl in impls:
          key = f"mosaic timing {impl} S={S} D={D} causal={causal} {mode}"
          need = _mem_bytes(impl, B, H, S, D, mode)
          if need > 0.5 * mem_bytes:
            plan.not_planned.append(f"{key}: needs ~{need / 1e9:.0f} GB")
            continue
          i = MODES.index(mode)
          est = ((20.0 if impl == "mosaic" else 2.0) if smoke else _COMPILE_S[impl][i]) \
              + (SAMPLES + 2) * SAMPLE_S \
              + (0.0 if smoke else flops(B, H, S, D, causal, mode) / (_TFLOPS[impl] * 1e12))
          plan.rows.append(Row("mosaic_timing", key, f"B{B} H{H} S{S} D{D} bf16", round(est, 2),
                               run_timing_row, dict(impl=impl, B=B, H=H, S=S, D=D,
                                                    causal=causal, mode=mode)))


def mosaic_verdict(rows) -> dict:
  """Per (head_dim, causal) class: valid (every Mosaic correctness row passed, and at least
  one ran) and faster (its fwd+bwd and fwd beat Pallas-Triton's at every timed shape), and
  `earned`: both, so the class belongs in `flashvjp._config.MOSAIC_GPU_EARNED` under
  `table_key` (then `implementation=None` / "pallas" runs the family there on Hopper)."""
  checked = [r for r in rows if r.get("part") == "mosaic_correctness"]
  valid = bool(checked) and all(r["status"] == "PASS" for r in checked)
  out = {}
  timed = [r for r in rows if r.get("part") == "mosaic_timing" and r.get("status") == "timed"]
  for r in timed:
    if r["impl"] != "mosaic":
      continue
    cls = f"D={r['D']} causal={r['causal']}"
    v = out.setdefault(cls, dict(valid=valid, faster=True, vs_triton=[]))
    if "vs_triton" not in r:
      v["faster"] = False
      continue
    v["vs_triton"].append(r["vs_triton"])
    v["faster"] = v["faster"] and r["vs_triton"] > 1.0
  for cls, v in out.items():
    D, causal = (x.split("=")[1] for x in cls.split())
    v["table_key"] = [_config.head_dim_bucket(int(D)), causal == "True"]
    v["earned"] = v["valid"] and v["faster"]
  return out


# -- part 2: timing

# Priority tiers of (seqs, head dims, modes): the budget cuts from the end.
TIERS = [
    ((4096, 16384), (128,), ("fwd+bwd", "fwd", "jvp")),
    ((1024,), (128,), ("fwd+bwd", "fwd", "jvp")),
    ((4096, 16384, 1024), (64,), ("fwd+bwd", "fwd", "jvp")),
    ((2048, 8192), (128, 64), ("fwd+bwd", "fwd", "jvp")),
    ((32768,), (128, 64), ("fwd+bwd", "fwd", "jvp")),
]
SMOKE_TIERS = [((64,), (64,), MODES)]
TOKENS = 16384  # batch * seq (batch >= 1); heads * head_dim = 2048
# Model of one timing row on an H200 (bf16): compile seconds and TFLOP/s. Guesses until a GPU
# run records measured seconds (then --estimates uses those).
_COMPILE_S = {"flashvjp": (2.5, 5.0, 4.0), "cudnn": (1.5, 3.0, 0.0), "xla": (1.5, 3.0, 3.0),
              "jax_pallas_mha": (2.5, 5.0, 0.0), "mosaic": (4.0, 8.0, 0.0)}
_TFLOPS = {"flashvjp": 250.0, "cudnn": 400.0, "xla": 80.0, "jax_pallas_mha": 200.0,
           "mosaic": 450.0}
SAMPLES = 5
SAMPLE_S = 0.05  # each sample queues calls for about this long


def timing_dims(S, D, smoke):
  return (max(1, (256 if smoke else TOKENS) // S), 2 if smoke else 2048 // D)


def _mem_bytes(impl, B, H, S, D, mode):
  """Rough peak device bytes of one timing row (inputs, outputs, gradients, temps)."""
  act = B * H * S * D * 2  # one bfloat16 [B, H, S, D] tensor
  total = 12 * act
  if impl == "xla":  # materialised [B, H, S, S] scores and probabilities
    total += B * H * S * S * {"fwd": 6, "fwd+bwd": 16, "jvp": 12}[mode]
  return total


def plan_timing(plan: Plan, smoke, mem_bytes):
  impls = [i for i in IMPLS if not (smoke and i == "cudnn")]
  if smoke:
    plan.not_planned.append("timing cudnn: cuDNN runs on NVIDIA GPUs only")
  plan.not_planned.append(
      f"timing {', '.join(i for i in impls if i not in JVP_IMPLS)} jvp, every shape: custom_vjp "
      "functions (no forward mode)")
  for seqs, dims, modes in (SMOKE_TIERS if smoke else TIERS):
    for S in seqs:
      for D in dims:
        B, H = timing_dims(S, D, smoke)
        for causal in (True, False):
          for mode in modes:
            for impl in impls:
              key = f"timing {impl} S={S} D={D} causal={causal} {mode}"
              if mode == "jvp" and impl not in JVP_IMPLS:
                continue  # (one not_planned line below)
              need = _mem_bytes(impl, B, H, S, D, mode)
              if need > 0.5 * mem_bytes:
                plan.not_planned.append(
                    f"{key}: needs ~{need / 1e9:.0f} GB, over half the device's "
                    f"{mem_bytes / 1e9:.0f} GB")
                continue
              i = MODES.index(mode)
              est = (0.5 if smoke else _COMPILE_S[impl][i]) + (SAMPLES + 2) * SAMPLE_S \
                  + (0.0 if smoke else flops(B, H, S, D, causal, mode) / (_TFLOPS[impl] * 1e12))
              plan.rows.append(Row("timing", key, f"B{B} H{H} S{S} D{D} bf16", round(est, 2),
                                   run_timing_row, dict(impl=impl, B=B, H=H, S=S, D=D,
                                                        causal=causal, mode=mode)))


# -- part 3: sweep

SWEEP_KIND = "16bit"  # bfloat16: the headline dtype
SWEEP_NOISE = 0.03  # a variant replaces the table's entry only when > 3% faster
SWEEP_ROLES = (("fwd", "fwd"), ("dkdv", "fwd+bwd"), ("dq", "fwd+bwd"))  # (role, timed mode)


def sweep_candidates(default: _config.Launch, smoke) -> list:
  """The table's launch first (the same run's baseline), then variants of it."""
  d = default
  cands = [d, dataclasses.replace(d, num_stages=3),
           dataclasses.replace(d, num_warps=4 if d.num_warps == 8 else 8),
           dataclasses.replace(d, block_kv=d.block_kv * 2)]
  out = []
  for c in cands:
    if c not in out:
      out.append(c)
  return out[:2] if smoke else out


def plan_sweep(plan: Plan, smoke):
  S, causal = (64, True) if smoke else (4096, True)
  for hd in ((64,) if smoke else (128, 64)):
    B, H = (1, 2) if smoke else (max(1, TOKENS // S), 2048 // hd)
    for role, mode in SWEEP_ROLES:
      default = _config.LAUNCH_TABLE[(hd, SWEEP_KIND, role)]
      for i, launch in enumerate(sweep_candidates(default, smoke)):
        desc = (f"{launch.block_q}x{launch.block_kv} w{launch.num_warps} s{launch.num_stages}"
                + ("" if launch.transposed else " not transposed"))
        key = f"sweep d{hd} {role} {desc}" + (" (table)" if i == 0 else "")
        est = (0.6 if smoke else (3.0 if mode == "fwd" else 5.5)) + (SAMPLES + 2) * SAMPLE_S
        plan.rows.append(Row("sweep", key, f"B{B} H{H} S{S} D{hd} bf16 causal {mode}",
                             round(est, 2), run_sweep_row,
                             dict(hd=hd, role=role, mode=mode, launch=launch, B=B, H=H, S=S,
                                  causal=causal, is_table=i == 0)))
  plan.rows.append(Row("sweep", "sweep launch table file (written, reloaded)",
                       "flashvjp._config.load_launch_table", 0.1, run_table_row))


def build_plan(smoke, mem_bytes, skip=()) -> Plan:
  plan = Plan()
  if "mosaic" not in skip:
    plan_mosaic(plan, smoke, mem_bytes)
  if "correctness" not in skip:
    plan_correctness(plan, smoke)
  if "timing" not in skip:
    plan_timing(plan, smoke, mem_bytes)
  if "sweep" not in skip:
    plan_sweep(plan, smoke)
  return plan


def load_estimates(path) -> dict:
  """{row key: measured seconds} of a previous GPU run's results file ({} if none / a smoke run)."""
  try:
    with open(path) as f:
      d = json.load(f)
  except (OSError, ValueError):
    return {}
  if d.get("smoke", True):
    return {}
  return {r["key"]: float(r["seconds"]) for r in d.get("rows", []) if "seconds" in r}


def fits(row: Row, elapsed: float, budget_s: float) -> bool:
  """Whether `row` may start at `elapsed`: its estimate ends before its part's deadline.

  The first row of a part that does not fit ends the part (the budget cuts from the end of
  each part's priority order, never a stray row from the middle).
  """
  return elapsed + row.est_s <= PART_DEADLINES[row.part] * budget_s


def dry_run(plan: Plan, budget_s, smoke, device, sm90_s) -> str:
  """The plan as text: rows with estimated seconds, what the budget cuts, the total."""
  lines = [f"plan ({'CPU smoke run' if smoke else 'GPU run'}; device {device}); "
           f"budget {budget_s:.0f} s for gpu_check.py"]
  t, ran, cut = 0.0, {}, []
  for part in PART_DEADLINES:
    rows = [r for r in plan.rows if r.part == part]
    if not rows:
      continue
    lines.append(f"\n== {part}: {len(rows)} rows, must end by {PART_DEADLINES[part] * budget_s:.0f} s")
    ended = False
    for r in rows:
      ok = not ended and fits(r, t, budget_s)
      ended = not ok
      if ok:
        t += r.est_s
        ran[part] = ran.get(part, 0) + 1
      else:
        cut.append(r.key)
      lines.append(f"  {r.est_s:6.1f} s  {'' if ok else 'SKIP (budget) '}{r.key}  [{r.shape}]"
                   + (f"  -> {t:.0f} s" if ok else ""))
  lines.append("")
  for part in PART_DEADLINES:
    n = sum(r.part == part for r in plan.rows)
    if n:
      lines.append(f"{part}: {ran.get(part, 0)} of {n} rows fit")
  lines.append(f"not planned: {len(plan.not_planned)} rows")
  lines += [f"  - {s}" for s in plan.not_planned]
  total = t + sm90_s
  lines.append(f"estimated: {t:.0f} s of the {budget_s:.0f} s budget (gpu_check.py), "
               f"{len(cut)} rows cut by the budget"
               + ("" if smoke else f"; + sm_90a compile check (gpu_check.sh) {sm90_s:.0f} s "
                  f"= {total:.0f} s of {TOTAL_S} s: "
                  f"{'within' if total <= TOTAL_S else 'OVER'} the budget"))
  return "\n".join(lines)


# ---- the run -------------------------------------------------------------------------------

def machine_info(smoke) -> dict:
  info = dict(jax=jax.__version__, jaxlib=getattr(jax.lib, "__version__", None) or
              _version("jaxlib"), python=platform.python_version(), backend=jax.default_backend(),
              device_kind=jax.devices()[0].device_kind, devices=len(jax.devices()),
              host=platform.node(), triton=_version("triton"), chex=_version("chex"))
  if not smoke:
    try:
      out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
      info["nvidia_smi"] = out.stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
      info["nvidia_smi"] = _err(e)
  return info


def _version(pkg):
  try:
    from importlib import metadata
    return metadata.version(pkg)
  except Exception:  # not installed: record that
    return None


def device_memory() -> float:
  try:
    return float(jax.devices()[0].memory_stats()["bytes_limit"])
  except Exception:  # CPU devices have no memory_stats: plan with the assumed GPU's memory
    return ASSUMED_GPU[1]


class Run:
  """The results so far, the time budget, and incremental JSON + markdown output."""

  def __init__(self, budget_s, smoke, out_dir, prefix, plan: Plan):
    self.t0 = time.perf_counter()
    self.budget_s, self.smoke = budget_s, smoke
    self.out_dir, self.prefix = out_dir, prefix
    self.data = dict(
        started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        smoke=smoke, budget_s=budget_s, part_deadlines_s={
            p: round(s * budget_s) for p, s in PART_DEADLINES.items()},
        machine=machine_info(smoke), precisions=[p for p, _ in precisions()],
        planned=len(plan.rows), rows=[], skipped=list(plan.not_planned), launch_table=None)

  def elapsed(self):
    return time.perf_counter() - self.t0

  def path(self, suffix):
    return os.path.join(self.out_dir, self.prefix + suffix)

  def save(self):
    os.makedirs(self.out_dir, exist_ok=True)
    self.data["elapsed_s"] = round(self.elapsed(), 1)
    with open(self.path(".json"), "w") as f:
      json.dump(self.data, f, indent=1, default=str)
    with open(self.path(".md"), "w") as f:
      f.write(markdown(self.data))


def execute(run: Run, plan: Plan):
  ended = set()  # parts the budget has ended
  for row in plan.rows:
    if row.part in ended or not fits(row, run.elapsed(), run.budget_s):
      ended.add(row.part)
      run.data["skipped"].append(f"{row.key}: time budget (est {row.est_s} s at "
                                 f"{run.elapsed():.0f} s)")
      continue
    t = time.perf_counter()
    try:
      res = row.fn(run, row)
    except Exception as e:  # record this row's failure; the run goes on
      res = dict(status="ERROR", error=_err(e), trace=traceback.format_exc()[-2000:])
    res = dict(key=row.key, part=row.part, **res, est_s=row.est_s,
               seconds=round(time.perf_counter() - t, 2))
    run.data["rows"].append(res)
    show = res.get("error") or res.get("summary", "")
    print(f"[{run.elapsed():6.1f}s] {res['status']:7s} {row.key}: {show}", flush=True)
    run.save()


# -- part 1

def _inputs(seed, B, H, Hkv, Sq, Skv, D, Dv, dtype):
  ks = jax.random.split(jax.random.key(seed), 9)
  shapes = [(B, H, Sq, D), (B, Hkv, Skv, D), (B, Hkv, Skv, Dv)]
  prim = [jax.random.normal(kk, s, jnp.float32).astype(dtype) for kk, s in zip(ks[:3], shapes)]
  tang = [jax.random.normal(kk, s, jnp.float32).astype(dtype) for kk, s in zip(ks[3:6], shapes)]
  w_out = jax.random.normal(ks[6], (B, H, Sq, Dv), jnp.float32)
  w_lse = jax.random.normal(ks[7], (B, H, Sq), jnp.float32)
  return prim, tang, w_out, w_lse, ks[8]


def _diff_args(kw):
  """The differentiable array options of a case ({name: array}) and the rest."""
  diff = {n: kw[n] for n in ("bias", "sinks") if n in kw}
  return diff, {n: v for n, v in kw.items() if n not in diff}


def _checked_fn(impl, fixed, interpret, w_out, w_lse, jvp=True):
  """f(q, k, v, diff, tq, tk, tv, tdiff) -> out, lse, grads of a weighted loss, jvp tangents
  (zeros, not compared, with jvp=False: a path that refuses forward mode)."""
  def att(q, k, v, diff):
    extra = dict(interpret=interpret) if impl in (BACKEND, MOSAIC) else {}
    return flashvjp.flash_attention(q, k, v, implementation=impl, return_lse=True, **fixed,
                                    **diff, **extra)

  def finite(lse):
    return jnp.where(jnp.isfinite(lse), lse, 0.0)

  def loss(q, k, v, diff):
    out, lse = att(q, k, v, diff)
    total = jnp.sum(out.astype(jnp.float64) * w_out) + jnp.sum(
        finite(lse).astype(jnp.float64) * w_lse)
    return total, (out, lse)

  def f(q, k, v, diff, tq, tk, tv, tdiff):
    (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
        q, k, v, diff)
    if not jvp:
      return out, lse, grads, jnp.zeros_like(out), jnp.zeros_like(lse)
    _, (t_out, t_lse) = jax.jvp(att, (q, k, v, diff), (tq, tk, tv, tdiff))
    return out, lse, grads, t_out, finite(t_lse)
  return f


def blackwell_host(smoke) -> bool:
  """Whether this run's GPU is a Blackwell one, where the Mosaic-GPU family runs its sm_100a
  kernels (no forward mode, no per-entry feature yet: part 0 skips their jvp and lists what
  they refuse)."""
  if smoke or jax.default_backend() != "gpu":
    return False
  from flashvjp.pallas.mosaic_gpu import _limits as mgpu_limits
  return mgpu_limits.gpu_arch(jax.devices()[0].device_kind) == "sm_100a"


# what the sm_100a kernels refuse at their entry (dispatch does not see these arguments)
BLACKWELL_UNTAKEN = ("bias", "mask", "segment_ids")


def check_case(dims, kw, precision, smoke, impl=BACKEND):
  """({name: max rel err}, tol, deterministic) of one correctness case through `impl`."""
  dtype = jnp.dtype(dims["dtype"])
  (q, k, v), (tq, tk, tv), w_out, w_lse, kt = _inputs(
      0, *(dims[x] for x in ("B", "H", "Hkv", "Sq", "Skv", "D", "Dv")), dtype)
  diff, fixed = _diff_args(kw)
  tdiff = {n: jax.random.normal(jax.random.fold_in(kt, i), a.shape, a.dtype)
           for i, (n, a) in enumerate(sorted(diff.items()))}
  jvp = not (impl == MOSAIC and blackwell_host(smoke))
  f = jax.jit(_checked_fn(impl, fixed, smoke, w_out, w_lse, jvp=jvp))
  with jax.default_matmul_precision(precision or "default"):
    res = f(q, k, v, diff, tq, tk, tv, tdiff)
    res2 = f(q, k, v, diff, tq, tk, tv, tdiff)
    tol = _check.tolerance(dtype, impl, precision=precision or "default")
  deterministic = all(np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)
                      for a, b in zip(jax.tree_util.tree_leaves(res),
                                      jax.tree_util.tree_leaves(res2)))
  cpu = jax.devices("cpu")[0]
  to64 = lambda t: jax.tree_util.tree_map(
      lambda x: jax.device_put(jnp.asarray(x, jnp.float64), cpu)
      if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating) else jax.device_put(x, cpu), t)
  fixed_cpu = jax.tree_util.tree_map(
      lambda x: jax.device_put(x, cpu) if isinstance(x, jax.Array) else x, fixed)
  ref_f = jax.jit(_checked_fn("naive", fixed_cpu, False, to64(w_out), to64(w_lse)))
  with jax.default_device(cpu):
    ref = ref_f(*to64((q, k, v, diff, tq, tk, tv, tdiff)))
  names = (["out", "lse"] + ["dq", "dk", "dv"] + [f"d{n}" for n in sorted(diff)]
           + ["jvp out", "jvp lse"])
  flat = lambda r: [r[0], r[1], *r[2][:3], *[r[2][3][n] for n in sorted(diff)], r[3], r[4]]
  errors = {n: _check.max_rel_err(jax.device_get(g), jax.device_get(r))
            for n, g, r in zip(names, flat(res), flat(ref)) if jvp or not n.startswith("jvp")}
  return errors, tol, deterministic


def run_correctness_row(run: Run, row: Row) -> dict:
  a = row.args
  errors, tol, det = check_case(a["dims"], a["kw"], a["precision"], run.smoke,
                                a.get("impl", BACKEND))
  passed = all(e <= tol for e in errors.values()) and det
  worst = max(errors, key=errors.get)
  return dict(status="PASS" if passed else "FAIL", dtype=a["dims"]["dtype"],
              precision=a["precision"], shape={x: a["dims"][x] for x in
                                               ("B", "H", "Hkv", "Sq", "Skv", "D", "Dv")},
              errors={n: float(f"{e:.3g}") for n, e in errors.items()}, tol=tol,
              deterministic=det,
              summary=f"max rel err {errors[worst]:.3g} ({worst}) vs tol {tol:g}"
                      + ("" if det else "; NOT deterministic"))


def run_refusal_row(run: Run, row: Row) -> dict:
  """The compiled Triton path refuses a gather in a score_mod / mask_mod, before any kernel;
  the default choice on this platform is then not Pallas-Triton."""
  q = jax.ShapeDtypeStruct((1, 4, 64, 64), jnp.bfloat16)
  # read at both positions at once (by one position, or by kv_idx - q_idx, compiles)
  if "score_mod" in row.args["name"]:
    table = jnp.zeros((64, 64), jnp.float32)
    opts = dict(score_mod=lambda s, b, h, i, j: s + table[i, j])
  else:
    pairs = jnp.zeros((64, 64), jnp.bool_)
    opts = dict(mask_mod=lambda b, h, i, j: pairs[i, j], causal=True)
  try:
    flashvjp.explain(q, q, q, implementation=BACKEND, interpret=False, **opts)
    refused, why = False, "accepted"
  except ValueError as e:
    refused, why = "cannot run" in str(e), _err(e)
  chosen = flashvjp.explain(q, q, q, **opts)
  passed = refused and chosen.implementation != BACKEND
  return dict(status="PASS" if passed else "FAIL", refused=refused, reason=why,
              default_choice=str(chosen), summary=f"refused: {refused}; default: "
                                                  f"{chosen.implementation}")


# -- part 2

def _blocks_fn(causal, interpret, blocks: _config.BlockSizes):
  """flashvjp with explicit forward / backward block sizes (the sweep), via its own prepare."""
  def f(q, k, v):
    _, cfg, arrays = _api._prepare(
        q, k, v, bias=None, mask=None, causal=causal, window=None, segment_ids=None,
        score_mod=None, scale=None, dropout_rate=0.0, dropout_rng=None, deterministic=True,
        implementation=BACKEND, block_q=None, block_kv=None, interpret=interpret)
    cfg = dataclasses.replace(cfg, blocks=blocks)
    return _api._run(cfg, *arrays, return_lse=False)[0]
  return f


def make_fn(impl, causal, smoke, blocks=None):
  """f(q, k, v) in that implementation's native layout; returns (f, layout)."""
  if impl == "mosaic":
    return (lambda q, k, v: flashvjp.flash_attention(
        q, k, v, causal=causal, implementation=MOSAIC, interpret=smoke)), "BHSD"
  if impl == "flashvjp":
    if blocks is not None:
      return _blocks_fn(causal, smoke, blocks), "BHSD"
    return (lambda q, k, v: flashvjp.flash_attention(
        q, k, v, causal=causal, implementation=BACKEND, interpret=smoke)), "BHSD"
  if impl in ("cudnn", "xla"):
    return (lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation=impl)), "BSHD"
  if impl == "jax_pallas_mha":
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      from jax.experimental.pallas.ops.gpu import attention as jax_attention
    return (lambda q, k, v: jax_attention.mha(
        q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=causal, interpret=smoke)), "BSHD"
  raise ValueError(f"unknown implementation {impl!r}")


def time_samples(g, args):
  """Seconds per call of a jitted g: compile + 1 call, then SAMPLES samples of queued calls."""
  t = time.perf_counter()
  jax.block_until_ready(g(*args))
  first = time.perf_counter() - t
  t = time.perf_counter()
  jax.block_until_ready(g(*args))
  one = max(time.perf_counter() - t, 1e-6)
  iters = int(min(50, max(1, SAMPLE_S // one)))
  samples = []
  for _ in range(SAMPLES):
    t = time.perf_counter()
    for _ in range(iters):
      r = g(*args)
    jax.block_until_ready(r)
    samples.append((time.perf_counter() - t) / iters)
  return first, iters, samples


def bench_one(impl, B, H, S, D, causal, mode, smoke, blocks=None):
  f, layout = make_fn(impl, causal, smoke, blocks)
  shape = (B, H, S, D) if layout == "BHSD" else (B, S, H, D)
  ks = jax.random.split(jax.random.key(1), 7)
  q, k, v, do, tq, tk, tv = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in ks)
  if mode == "fwd":
    g, args = jax.jit(f), (q, k, v)
  elif mode == "fwd+bwd":
    g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) *
                                                  do.astype(jnp.float32)), argnums=(0, 1, 2)))
    args = (q, k, v)
  else:
    g = jax.jit(lambda q, k, v, tq, tk, tv: jax.jvp(f, (q, k, v), (tq, tk, tv)))
    args = (q, k, v, tq, tk, tv)
  return time_samples(g, args)


def _timed(res_fields, B, H, S, D, causal, mode):
  first, iters, samples = res_fields
  med = float(np.median(samples))
  fl = flops(B, H, S, D, causal, mode)
  return dict(status="timed", ms=round(med * 1e3, 4),
              ms_range=[round(min(samples) * 1e3, 4), round(max(samples) * 1e3, 4)],
              tflops=round(fl / med / 1e12, 3), compile_and_first_s=round(first, 2),
              iters=iters, samples=len(samples))


def run_timing_row(run: Run, row: Row) -> dict:
  a = row.args
  res = _timed(bench_one(a["impl"], a["B"], a["H"], a["S"], a["D"], a["causal"], a["mode"],
                         run.smoke), a["B"], a["H"], a["S"], a["D"], a["causal"], a["mode"])
  res.update(impl=a["impl"], B=a["B"], H=a["H"], S=a["S"], D=a["D"], causal=a["causal"],
             mode=a["mode"], dtype="bfloat16")
  # Ratios against the baselines measured in this run (same part) at the same shape.
  same = [r for r in run.data["rows"] if r.get("part") == row.part and r.get("status") == "timed"
          and (r["S"], r["D"], r["causal"], r["mode"]) == (a["S"], a["D"], a["causal"], a["mode"])]
  bases = (("cudnn", "cudnn"), ("xla", "xla"), ("triton", "flashvjp"))
  for r in same + [res]:
    for name, base in bases:
      b = next((x for x in same + [res] if x["impl"] == base), None)
      if b is not None and (name != "triton" or r["impl"] == "mosaic"):
        r[f"vs_{name}"] = round(b["ms"] / r["ms"], 3)  # > 1: faster than the baseline
  res["summary"] = f"{res['ms']} ms, {res['tflops']} TFLOP/s" + "".join(
      f", x{res[k]} vs {k[3:]}" for k in ("vs_cudnn", "vs_xla", "vs_triton")
      if k in res and a["impl"] != dict(bases)[k[3:]])
  return res


# -- part 3

def run_sweep_row(run: Run, row: Row) -> dict:
  a = row.args
  key = (a["hd"], SWEEP_KIND, a["role"])
  with _config.launch_overrides({key: a["launch"]}):  # clears jax's caches on entry and exit
    blocks = _config.default_block_sizes(BACKEND, False, head_dim=a["hd"], dtype="bfloat16")
    res = _timed(bench_one("flashvjp", a["B"], a["H"], a["S"], a["hd"], a["causal"], a["mode"],
                           run.smoke, blocks=blocks),
                 a["B"], a["H"], a["S"], a["hd"], a["causal"], a["mode"])
  res.update(head_dim=a["hd"], kind=SWEEP_KIND, role=a["role"], mode=a["mode"],
             launch=dataclasses.asdict(a["launch"]), is_table=a["is_table"],
             shape=dict(B=a["B"], H=a["H"], S=a["S"], causal=a["causal"]))
  table = next((r for r in run.data["rows"] if r.get("part") == "sweep" and r.get("is_table")
                and (r["head_dim"], r["role"]) == (a["hd"], a["role"]) and "ms" in r), None)
  if table is not None and not a["is_table"]:
    res["vs_table"] = round(table["ms"] / res["ms"], 3)
  res["summary"] = f"{res['ms']} ms" + (f", x{res['vs_table']} vs the table's launch"
                                        if "vs_table" in res else "")
  return res


def best_launch_table(run: Run) -> dict:
  """The launch table file's content: per swept (head dim, kind, role) the fastest launch."""
  entries = []
  groups = {}
  for r in run.data["rows"]:
    if r.get("part") == "sweep" and "launch" in r and r.get("status") == "timed":
      groups.setdefault((r["head_dim"], r["kind"], r["role"]), []).append(r)
  for (hd, kind, role), rs in sorted(groups.items()):
    table = next((r for r in rs if r["is_table"]), None)
    if table is None:
      continue  # no same-run baseline: nothing to compare with
    best = min(rs, key=lambda r: r["ms"])
    if table["ms"] / best["ms"] < 1.0 + SWEEP_NOISE:
      best = table  # within the noise of the same run's samples: keep the table's entry
    entries.append(dict(head_dim=hd, kind=kind, role=role, **best["launch"], ms=best["ms"],
                        table_ms=table["ms"], speedup=round(table["ms"] / best["ms"], 3),
                        candidates=len(rs), timed_mode=best["mode"], shape=best["shape"]))
  m = run.data["machine"]
  return dict(format=_config.LAUNCH_TABLE_FORMAT,
              machine=dict(device_kind=m["device_kind"], nvidia_smi=m.get("nvidia_smi"),
                           jax=m["jax"], jaxlib=m["jaxlib"], triton=m["triton"],
                           date=run.data["started"], smoke=run.smoke),
              entries=entries)


def run_table_row(run: Run, row: Row) -> dict:
  content = best_launch_table(run)
  path = run.path("_launch_table.json")
  os.makedirs(run.out_dir, exist_ok=True)
  with open(path, "w") as f:
    json.dump(content, f, indent=1)
  table, machine = _config.load_launch_table(path)
  ok = len(table) == len(content["entries"]) > 0 and machine == content["machine"]
  run.data["launch_table"] = dict(path=os.path.relpath(path, ROOT), entries=content["entries"])
  changed = [f"d{e['head_dim']} {e['role']} x{e['speedup']}" for e in content["entries"]
             if e["speedup"] > 1.0]
  return dict(status="PASS" if ok else "FAIL", path=os.path.relpath(path, ROOT),
              entries=len(table), summary=f"{len(table)} entries; faster than the table: "
                                          f"{', '.join(changed) or 'none'}")


# ---- report --------------------------------------------------------------------------------

def _correctness_table(rows, part, prefix) -> list:
  lines = ["| case | dtype | precision | status | deterministic | max rel err | tol | s |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    if r["part"] != part:
      continue
    errs = r.get("errors")
    errs = ", ".join(f"{k} {v:.2g}" for k, v in errs.items()) if errs else \
        r.get("error") or r.get("summary", "")
    lines.append(f"| {r['key'][len(prefix):]} | {r.get('dtype', '')} | "
                 f"{r.get('precision') or ''} | {r['status']} | {r.get('deterministic', '')} | "
                 f"{errs} | {r.get('tol', '')} | {r['seconds']} |")
  return lines


SASS_RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                            "mosaic_gpu_sass.json")
TRITON_SASS_RESULTS = os.path.join(os.path.dirname(SASS_RESULTS), "triton_sass.json")


def _recorded_cases(path) -> dict | None:
  """{case name: result row} of a SASS benchmark's results json; None where unreadable."""
  try:
    with open(path) as f:
      return {r["case"]: r for r in json.load(f)["results"]}
  except (OSError, ValueError, KeyError):
    return None


def sass_figures(D, causal, mode, path=SASS_RESULTS) -> str:
  """The recorded instructions per main-loop iteration of the kernels a timing row runs
  (benchmarks/mosaic_gpu_sass.py, deviceless sm_90a), ours (tokamax's): the proxy beside the
  measured TFLOP/s, so that one GPU run calibrates it. '' where none is recorded."""
  rec = _recorded_cases(path)
  if rec is None:
    return ""
  mask = "causal" if causal else "full"
  parts = []
  for kind, roles in (("fwd", ("fwd",)), ("vjp", ("dq", "dkdv"))):
    if kind == "vjp" and mode == "fwd":
      continue
    ours = rec.get(f"ours:{kind}:D{D}:{mask}:plain", {}).get("kernels", {})
    anchor = rec.get(f"tokamax:{kind}:D{D}:{mask}:plain", {}).get("kernels", {})
    for role in roles:
      if role in ours:
        a = anchor.get(role, {}).get("steady", {}).get("instructions", "?")
        parts.append(f"{role} {ours[role]['steady']['instructions']} ({a})")
  return ", ".join(parts)


def triton_sass_figures(D, causal, mode, path=TRITON_SASS_RESULTS) -> str:
  """The Pallas-Triton kernels' recorded main loops (benchmarks/triton_sass.py, deviceless
  sm_90a): instructions / MMA MFLOP per iteration, ours (tokamax's at its H100 configs; the
  tiles differ, so the work per iteration is given too). '' where none is recorded."""
  rec = _recorded_cases(path)
  if rec is None:
    return ""
  mask = "causal" if causal else "full"
  ours = rec.get(f"ours:D{D}:{mask}", {}).get("kernels", {})
  anchor = rec.get(f"tokamax:D{D}:{mask}", {}).get("kernels", {})

  def loop(k):
    s = k.get("steady", {})
    return f"{s['instructions']} / {s['mma_flop'] / 1e6:.2f}" if s else "?"
  roles = ("fwd",) if mode == "fwd" else ("fwd", "dq", "dkdv")
  return ", ".join(f"{role} {loop(ours[role])} ({loop(anchor.get(role, {}))})"
                   for role in roles if role in ours)


def markdown(d) -> str:
  m = d["machine"]
  rows = d["rows"]
  lines = [f"# flashvjp GPU check ({d['started']})" + (" -- CPU smoke run" if d["smoke"] else ""),
           "",
           f"Device {m['device_kind']} ({m.get('nvidia_smi') or 'no nvidia-smi'}), jax {m['jax']},"
           f" jaxlib {m['jaxlib']}, triton {m['triton']}, python {m['python']}; "
           f"{d.get('elapsed_s', '?')} s of a {d['budget_s']:.0f} s budget "
           f"(part deadlines {d['part_deadlines_s']}); {len(rows)} of {d['planned']} planned rows"
           f" ran. Float32 precisions: {', '.join(d['precisions'])}."]
  mosaic = [r for r in rows if r["part"].startswith("mosaic")]
  if mosaic:
    lines += ["", "## 0. The Mosaic-GPU family (pallas_mosaic_gpu)", ""]
    lines += _correctness_table(rows, "mosaic_correctness", "mosaic correctness ")
    lines += ["", "| S | D | causal | mode | Mosaic TFLOP/s | Triton TFLOP/s | cuDNN TFLOP/s | "
              "Mosaic vs Triton | Mosaic vs cuDNN | Mosaic SASS per iteration, ours (tokamax) |"
              " Triton SASS instructions / MMA MFLOP per iteration, ours (tokamax) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    groups = {}
    for r in mosaic:
      if r["part"] == "mosaic_timing" and "impl" in r:
        groups.setdefault((r["S"], r["D"], r["causal"], r["mode"]), {})[r["impl"]] = r
    for (S, D, causal, mode), by in groups.items():
      tf = lambda i, by=by: by[i].get("tflops", by[i]["status"]) if i in by else ""
      m = by.get("mosaic", {})
      lines.append(f"| {S} | {D} | {causal} | {mode} | {tf('mosaic')} | {tf('flashvjp')} | "
                   f"{tf('cudnn')} | {m.get('vs_triton', '')} | {m.get('vs_cudnn', '')} |"
                   f" {sass_figures(D, causal, mode)} | {triton_sass_figures(D, causal, mode)} |")
    lines += ["", f"Verdict per class (valid and faster than Pallas-Triton): "
              f"{d.get('mosaic_verdict') or 'none (no Mosaic timing ran)'}"]
  lines += ["", "## 1. Correctness (compiled Pallas-Triton kernels vs float64 naive)", ""]
  lines += _correctness_table(rows, "correctness", "correctness ")
  lines += ["", "## 2. Timing (bfloat16; TFLOP/s, FlashAttention convention, jvp = 3x forward;"
            " ratio = baseline time / flashvjp time, > 1: flashvjp faster)", "",
            "| S | D | causal | mode | B x H | flashvjp | cuDNN | xla | JAX Pallas mha | "
            "flashvjp vs cuDNN | flashvjp vs xla | flashvjp ms (range) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  groups = {}
  for r in rows:
    if r["part"] == "timing":
      a = r.get("impl") or r["key"].split()[1]
      groups.setdefault(r["key"].split(" ", 2)[2], {})[a] = r
  for g, by in groups.items():
    any_r = next(iter(by.values()))
    cell = lambda i, by=by: (f"{by[i]['tflops']}" if i in by and "tflops" in by[i]
                             else ("ERROR" if i in by else ""))
    fv = by.get("flashvjp", {})
    S, D, causal, mode = g.split(" ")
    lines.append(f"| {S[2:]} | {D[2:]} | {causal[7:]} | {mode} | "
                 f"{any_r.get('B', '')}x{any_r.get('H', '')} | {cell('flashvjp')} | {cell('cudnn')}"
                 f" | {cell('xla')} | {cell('jax_pallas_mha')} | {fv.get('vs_cudnn', '')} | "
                 f"{fv.get('vs_xla', '')} | {fv.get('ms', '')} {fv.get('ms_range', '')} |")
  errs = [r for r in rows if r["part"] == "timing" and r["status"] == "ERROR"]
  if errs:
    lines += ["", "Timing errors:", ""] + [f"- {r['key']}: {r['error']}" for r in errs]
  sweep = [r for r in rows if r["part"] == "sweep"]
  if sweep:
    lines += ["", "## 3. Launch-table sweep (bfloat16, causal; ratio = the table's time / this)",
              "", "| head dim | role | launch (bq x bk, warps, stages) | timed | ms | vs table |",
              "|---|---|---|---|---|---|"]
    for r in sweep:
      if "launch" in r:
        L = r["launch"]
        lines.append(f"| {r['head_dim']} | {r['role']} | {L['block_q']}x{L['block_kv']}, "
                     f"{L['num_warps']}, {L['num_stages']}{'' if L['transposed'] else ', not transposed'}"
                     f"{' (table)' if r['is_table'] else ''} | {r['mode']} | {r.get('ms', '')} | "
                     f"{r.get('vs_table', r.get('error', ''))} |")
      elif r["status"] == "ERROR":
        lines.append(f"| | | {r['key']} | | ERROR | {r.get('error', '')} |")
    if d.get("launch_table"):
      lines += ["", f"Launch table file: `{d['launch_table']['path']}` "
                f"(`flashvjp._config.load_launch_table`)."]
  if d["skipped"]:
    lines += ["", "## Skipped", ""] + [f"- {s}" for s in d["skipped"]]
  return "\n".join(lines) + "\n"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                 help="wall seconds for this script's parts (rows start only if they fit)")
  p.add_argument("--cpu-smoke", action="store_true", help="interpret mode, tiny shapes, on CPU")
  p.add_argument("--dry-run", action="store_true",
                 help="print the plan (rows, shapes, estimated seconds, total vs budget); run nothing")
  p.add_argument("--skip", nargs="*", default=[],
                 choices=["mosaic", "correctness", "timing", "bench", "sweep"])
  p.add_argument("--out", default=None, help="results file prefix (default gpu_check, "
                                             "gpu_check_smoke with --cpu-smoke)")
  p.add_argument("--results-dir", default=None, help="default benchmarks/results "
                                                     "(build/gpu_check_smoke with --cpu-smoke)")
  p.add_argument("--estimates", default=os.path.join(RESULTS_DIR, "gpu_check.json"),
                 help="a previous GPU run's results: its measured row seconds replace the model")
  p.add_argument("--sm90-s", type=float, default=TOTAL_S - DEFAULT_BUDGET_S,
                 help="(dry run) the compile check's share, for the total")
  args = p.parse_args(argv)
  skip = {"timing" if s == "bench" else s for s in args.skip}
  smoke = args.cpu_smoke
  on_gpu = jax.default_backend() == "gpu"
  if not (smoke or on_gpu or args.dry_run):
    print(f"no GPU (backend {jax.default_backend()!r}); --cpu-smoke checks the script on CPU, "
          "--dry-run prints the plan", file=sys.stderr)
    return 2
  mem = device_memory() if on_gpu else ASSUMED_GPU[1]
  plan = build_plan(smoke, mem, skip)
  measured = {} if smoke else load_estimates(args.estimates)
  for r in plan.rows:
    r.est_s = measured.get(r.key, r.est_s)
  if args.dry_run:
    device = jax.devices()[0].device_kind if on_gpu else ("CPU" if smoke else ASSUMED_GPU[0])
    print(dry_run(plan, args.budget_s, smoke, device, args.sm90_s))
    if measured:
      print(f"(estimates: measured seconds of {len(measured)} rows from {args.estimates})")
    return 0
  out_dir = args.results_dir or (SMOKE_RESULTS_DIR if smoke else RESULTS_DIR)
  prefix = args.out or ("gpu_check_smoke" if smoke else "gpu_check")
  run = Run(args.budget_s, smoke, out_dir, prefix, plan)
  print(f"jax {jax.__version__} on {run.data['machine']['device_kind']}; {len(plan.rows)} rows "
        f"planned, budget {args.budget_s:.0f} s", flush=True)
  # float64 references on the host; the kernels' inputs stay bf16/f16/f32. Timing and the
  # sweep run without x64, as users do (JAX's own mha breaks under x64).
  for parts, x64 in ((("mosaic_correctness",), True), (("mosaic_timing",), False),
                     (("correctness",), True), (("timing", "sweep"), False)):
    jax.config.update("jax_enable_x64", x64)
    try:
      execute(run, _part(plan, *parts))
    finally:
      jax.config.update("jax_enable_x64", False)
  run.data["mosaic_verdict"] = mosaic_verdict(run.data["rows"])
  run.save()
  counts = {}
  for r in run.data["rows"]:
    counts[r["status"]] = counts.get(r["status"], 0) + 1
  bad = [r["key"] for r in run.data["rows"] if r["status"] in ("FAIL", "ERROR")]
  cut = sum("time budget" in s for s in run.data["skipped"])
  print(f"done in {run.elapsed():.0f} s: {counts}; {cut} rows cut by the budget; "
        f"FAIL/ERROR: {bad or 'none'}; results in {run.path('.json')} and .md", flush=True)
  return 1 if bad else 0


def _part(plan: Plan, *parts) -> Plan:
  sub = Plan()
  sub.rows = [r for r in plan.rows if r.part in parts]
  return sub


if __name__ == "__main__":
  sys.exit(main())
