"""GPU check of flashvjp's Pallas kernels: correctness through the real Triton lowering, then timing.

Run on a GPU machine (jax with CUDA; chex; no package registry needed)::

    PYTHONPATH=. python3 benchmarks/gpu_check.py          # or: bash benchmarks/gpu_check.sh

1. Correctness: every feature, forward + lse + gradients of the compiled Pallas
   kernels (interpret=False) against naive attention in float64 on the host CPU,
   with the library's tolerance table (flashvjp._check.TOL); bitwise determinism;
   and the dispatcher's refusal of a score_mod that cannot lower (a relative-position
   table indexed by kv - q is a gather).
2. Timing (bfloat16, head_dim 64 and 128, seq 1k..16k, causal and not, batch*heads
   sized to fill the GPU): forward and forward+backward for flashvjp pallas,
   jax.nn.dot_product_attention(implementation="cudnn") and ("xla"), and
   jax.experimental.pallas.ops.gpu.attention.mha. TFLOP/s and ratio to cuDNN.
3. A small block-size sweep of the flashvjp kernels at one shape (tuning data).

Everything is written incrementally to benchmarks/results/gpu_check.json and
gpu_check.md, so a run that is stopped still leaves its results. Each entry is
guarded: a failing baseline records its error instead of ending the run. The whole
run keeps to a time budget (--budget-s, default 450 s) and records what it skipped.

`--cpu-smoke` runs the same code paths on CPU in interpret mode with tiny shapes
(to check the script itself without a GPU).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time
import traceback

import jax

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import flashvjp  # noqa: E402
from flashvjp import _check  # noqa: E402
from flashvjp import _config  # noqa: E402
from flashvjp import _dropout  # noqa: E402
from flashvjp import _score_mod  # noqa: E402
from flashvjp import _vjp  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


class Run:
  """Results so far, the time budget, and incremental JSON + markdown output."""

  def __init__(self, budget_s, smoke, out_prefix):
    self.t0 = time.perf_counter()
    self.budget_s = budget_s
    self.smoke = smoke
    self.prefix = out_prefix
    self.data = dict(
        started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        jax=jax.__version__, python=platform.python_version(),
        devices=[str(d) for d in jax.devices()],
        device_kind=jax.devices()[0].device_kind, backend=jax.default_backend(),
        smoke=smoke, correctness=[], benchmarks=[], sweep=[], skipped=[])

  def elapsed(self):
    return time.perf_counter() - self.t0

  def left(self):
    return self.budget_s - self.elapsed()

  def save(self):
    os.makedirs(RESULTS_DIR, exist_ok=True)
    self.data["elapsed_s"] = round(self.elapsed(), 1)
    with open(os.path.join(RESULTS_DIR, self.prefix + ".json"), "w") as f:
      json.dump(self.data, f, indent=1, default=str)
    with open(os.path.join(RESULTS_DIR, self.prefix + ".md"), "w") as f:
      f.write(markdown(self.data))


def _err(e: BaseException) -> str:
  return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


# ---- correctness ---------------------------------------------------------------------

def _inputs(seed, B, H, Hkv, Sq, Skv, D, Dv, dtype):
  ks = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(ks[0], (B, H, Sq, D), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (B, Hkv, Skv, D), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (B, Hkv, Skv, Dv), jnp.float32).astype(dtype)
  w_out = jax.random.normal(ks[3], (B, H, Sq, Dv), jnp.float32)
  w_lse = jax.random.normal(ks[4], (B, H, Sq), jnp.float32)
  return q, k, v, w_out, w_lse


def correctness_cases(smoke):
  S = 40 if smoke else 300  # not a multiple of the blocks: padding is exercised
  S2 = 33 if smoke else 257
  rng = np.random.default_rng(0)
  mask = rng.random((2, 1, S, S2)) > 0.3
  mask[:, :, 3] = False  # an empty row
  seg_q = np.repeat(np.arange(S)[None] * 3 // S, 2, 0).astype(np.int32)
  seg_kv = np.repeat(np.arange(S2)[None] * 3 // S2, 2, 0).astype(np.int32)
  bias = lambda shape: 0.5 * jax.random.normal(jax.random.key(9), shape, jnp.float32)
  drop = dict(dropout_rate=0.2, dropout_rng=jax.random.key(3), deterministic=False)
  base = dict(B=2, H=4, Hkv=2, Sq=S, Skv=S2, D=64, Dv=64, dtype=jnp.bfloat16)
  c = [
      ("plain bf16", {}, {}),
      ("plain f16", dict(dtype=jnp.float16), {}),
      ("plain f32", dict(dtype=jnp.float32), {}),
      ("causal", {}, dict(causal=True)),
      ("causal f32 square", dict(dtype=jnp.float32, Skv=S), dict(causal=True)),
      ("window(48,16)", {}, dict(window=(48, 16))),
      ("head_dim 96/40 (padded)", dict(D=96, Dv=40), dict(causal=True)),
      ("head_dim 128", dict(D=128, Dv=128), {}),
      ("head_dim 256", dict(D=256, Dv=256), dict(causal=True)),
      ("mqa", dict(Hkv=1), dict(causal=True)),
      ("mha", dict(Hkv=4), {}),
      ("segment_ids", {}, dict(segment_ids=(jnp.asarray(seg_q), jnp.asarray(seg_kv)))),
      ("mask dense + empty row", {}, dict(mask=jnp.asarray(mask))),
      ("mask key padding", {}, dict(mask=jnp.asarray(mask[:, :, :1]))),
      ("bias full (grad)", {}, dict(bias=bias((2, 4, S, S2)))),
      ("bias [1,H,1,Skv] (grad)", {}, dict(bias=bias((1, 4, 1, S2)))),
      ("softcap score_mod", {}, dict(score_mod=flashvjp.softcap(5.0))),
      ("alibi score_mod (slopes[h] per head)", {}, dict(causal=True,
                                                       score_mod=flashvjp.alibi(flashvjp.alibi_slopes(4)))),
      ("dropout", {}, drop),
      ("combo", {}, dict(causal=True, segment_ids=(jnp.asarray(seg_q), jnp.asarray(seg_kv)),
                         mask=jnp.asarray(mask), bias=bias((1, 4, S, S2)),
                         score_mod=flashvjp.softcap(5.0), **drop)),
  ]
  return [(name, {**base, **shape}, kw) for name, shape, kw in c]


def _loss_fn(impl, kw, interpret, w_out, w_lse):
  kw = dict(kw)
  has_bias = "bias" in kw
  bias0 = kw.pop("bias", None)

  def loss(q, k, v, bias):
    args = dict(kw)
    if has_bias:
      args["bias"] = bias
    if impl == "pallas":
      args.update(interpret=interpret)
    out, lse = flashvjp.flash_attention(q, k, v, implementation=impl, return_lse=True, **args)
    total = jnp.sum(out.astype(jnp.float64) * w_out) + jnp.sum(
        jnp.where(jnp.isfinite(lse), lse, 0.0).astype(jnp.float64) * w_lse)
    return total, (out, lse)

  return loss, bias0


def check_case(name, dims, kw, smoke):
  """(errors dict, tol, passed, deterministic) of one feature case."""
  dtype = dims["dtype"]
  q, k, v, w_out, w_lse = _inputs(0, dims["B"], dims["H"], dims["Hkv"], dims["Sq"], dims["Skv"],
                                  dims["D"], dims["Dv"], dtype)
  loss, bias = _loss_fn("pallas", kw, smoke, w_out, w_lse)
  argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
  f = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))
  (_, (out, lse)), grads = f(q, k, v, bias)
  (_, (out2, lse2)), grads2 = f(q, k, v, bias)
  leaves1 = jax.tree_util.tree_leaves((out, lse, grads))
  leaves2 = jax.tree_util.tree_leaves((out2, lse2, grads2))
  deterministic = all(np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)
                      for a, b in zip(leaves1, leaves2))

  cpu = jax.devices("cpu")[0]
  to64 = lambda x: None if x is None else jax.device_put(jnp.asarray(x, jnp.float64), cpu)
  kw_cpu = jax.tree_util.tree_map(
      lambda x: jax.device_put(x, cpu) if isinstance(x, jax.Array) else x, kw)
  loss_ref, _ = _loss_fn("naive", kw_cpu, False, to64(w_out), to64(w_lse))
  with jax.default_device(cpu):
    (_, (out_r, lse_r)), grads_r = jax.jit(jax.value_and_grad(loss_ref, argnums=argnums,
                                                              has_aux=True))(
        to64(q), to64(k), to64(v), to64(bias))
  names = ["out", "lse", "dq", "dk", "dv"] + (["dbias"] if bias is not None else [])
  got = [out, lse] + list(grads)
  ref = [out_r, lse_r] + list(grads_r)
  errors = {n: _check.max_rel_err(jax.device_get(g), jax.device_get(r))
            for n, g, r in zip(names, got, ref)}
  tol = _check.TOL[jnp.dtype(dtype)]
  return errors, tol, all(e <= tol for e in errors.values()), deterministic


def run_correctness(run: Run):
  for name, dims, kw in correctness_cases(run.smoke):
    if run.left() < 0.45 * run.budget_s:
      run.data["skipped"].append(f"correctness {name}: time budget")
      continue
    t = time.perf_counter()
    row = dict(case=name, dtype=jnp.dtype(dims["dtype"]).name,
               shape=[dims[x] for x in ("B", "H", "Hkv", "Sq", "Skv", "D", "Dv")])
    try:
      errors, tol, passed, det = check_case(name, dims, kw, run.smoke)
      row.update(errors={n: float(f"{e:.3g}") for n, e in errors.items()}, tol=tol,
                 passed=passed, deterministic=det)
    except Exception as e:  # record the failure of this case; the run goes on
      row.update(passed=False, error=_err(e), trace=traceback.format_exc()[-2000:])
    row["seconds"] = round(time.perf_counter() - t, 1)
    print(f"[{run.elapsed():6.1f}s] correctness {name}: "
          f"{'PASS' if row.get('passed') else 'FAIL'} {row.get('errors', row.get('error'))}",
          flush=True)
    run.data["correctness"].append(row)
    run.save()
  # The dispatcher must refuse what cannot lower (a table indexed by kv - q: a gather).
  if run.smoke:
    run.data["skipped"].append("relative-bias refusal: a GPU-only check (interpret runs it)")
    return
  row = dict(case="relative_position_bias refused on Triton (ValueError for 'pallas', "
                  "blockwise for None)")
  try:
    q, k, v, *_ = _inputs(0, 1, 4, 4, 64, 64, 64, 64, jnp.bfloat16)
    sm = flashvjp.relative_position_bias(jnp.zeros((4, 9), jnp.float32), 4)
    decision = flashvjp.explain(q, k, v, score_mod=sm)
    refused = False
    try:
      flashvjp.flash_attention(q, k, v, score_mod=sm, implementation="pallas",
                               interpret=run.smoke)
    except ValueError as e:
      refused = "cannot run" in str(e)
    row.update(passed=refused and (run.smoke or decision.implementation == "blockwise"),
               decision=str(decision), refused=refused)
  except Exception as e:  # record and go on
    row.update(passed=False, error=_err(e))
  run.data["correctness"].append(row)
  run.save()


# ---- benchmarks ------------------------------------------------------------------------

def _time(f, args, iters):
  """Median seconds per call of a jitted f (compiled first); calls queued `iters` at a time."""
  jax.block_until_ready(f(*args))
  samples = []
  for _ in range(3):
    t = time.perf_counter()
    for _ in range(iters):
      r = f(*args)
    jax.block_until_ready(r)
    samples.append((time.perf_counter() - t) / iters)
  return float(np.median(samples))


def _flops(B, H, S, D, causal, mode):
  f = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)
  return f if mode == "fwd" else 3.5 * f  # backward = 2.5x forward (5 matmuls vs 2)


def _make(impl, causal, smoke, blocks=None):
  """f(q, k, v) in that implementation's native layout; returns (f, layout)."""
  if impl == "flashvjp":
    if blocks is None:
      return (lambda q, k, v: flashvjp.flash_attention(
          q, k, v, causal=causal, implementation="pallas", interpret=smoke)), "BHSD"
    return _pallas_with_blocks(causal, smoke, blocks), "BHSD"
  if impl in ("cudnn", "xla"):
    return (lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation=impl)), "BSHD"
  if impl == "jax_pallas_mha":
    import warnings
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      from jax.experimental.pallas.ops.gpu import attention as jax_attention
    return (lambda q, k, v: jax_attention.mha(
        q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=causal, interpret=smoke)), "BSHD"
  raise ValueError(f"unknown implementation {impl!r}")


def _pallas_with_blocks(causal, smoke, blocks: _config.BlockSizes):
  """flashvjp's Pallas custom_vjp with explicit forward / backward block sizes (sweep only)."""
  def f(q, k, v):
    S, D = q.shape[2], q.shape[3]
    cfg = _config.AttentionConfig(
        scale=D ** -0.5, causal=causal, window=None, seq_q=S, seq_kv=k.shape[2], dropout_rate=0.0,
        blocks=blocks, interpret=smoke, implementation="pallas")
    return _vjp.attention(cfg, q, k, v, None, None, None, None, None, (), ())[0]
  return f


def bench_one(impl, B, H, S, D, causal, mode, smoke, blocks=None):
  f, layout = _make(impl, causal, smoke, blocks)
  shape = (B, H, S, D) if layout == "BHSD" else (B, S, H, D)
  ks = jax.random.split(jax.random.key(1), 4)
  q, k, v, do = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in ks)
  if mode == "fwd":
    g = jax.jit(f)
  else:
    g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) *
                                                  do.astype(jnp.float32)), argnums=(0, 1, 2)))
  return _time(g, (q, k, v), iters=2 if smoke else 10)


def bench_shapes(smoke):
  if smoke:
    return [(64, 64, False), (64, 64, True)]
  # Priority order: the time budget cuts from the end.
  out = []
  for S in (4096, 1024, 16384, 2048, 8192):
    for D in (128, 64):
      for causal in (True, False):
        out.append((S, D, causal))
  return out


def run_benchmarks(run: Run, impls):
  tokens = 256 if run.smoke else 16384  # batch * seq; heads * head_dim = 2048
  for S, D, causal in bench_shapes(run.smoke):
    B = max(1, tokens // S)
    H = 2 if run.smoke else 2048 // D
    for mode in ("fwd", "fwd+bwd"):
      results = {}
      for impl in impls:
        key = f"{impl} S={S} D={D} causal={causal} {mode}"
        if run.left() < 20:
          run.data["skipped"].append(f"bench {key}: time budget")
          continue
        if impl == "xla" and S > 8192:
          run.data["skipped"].append(f"bench {key}: O(seq^2) scores do not fit")
          continue
        row = dict(impl=impl, B=B, H=H, S=S, D=D, causal=causal, mode=mode, dtype="bfloat16")
        t = time.perf_counter()
        try:
          sec = bench_one(impl, B, H, S, D, causal, mode, run.smoke)
          row.update(ms=round(sec * 1e3, 4),
                     tflops=round(_flops(B, H, S, D, causal, mode) / sec / 1e12, 2))
          results[impl] = sec
        except Exception as e:  # a failing baseline is recorded, not fatal
          row.update(error=_err(e))
        row["wall_s"] = round(time.perf_counter() - t, 1)
        run.data["benchmarks"].append(row)
        print(f"[{run.elapsed():6.1f}s] {key}: {row.get('tflops', row.get('error'))}", flush=True)
      for row in run.data["benchmarks"]:
        if (row["S"], row["D"], row["causal"], row["mode"]) == (S, D, causal, mode) and \
            "ms" in row and "cudnn" in results:
          row["vs_cudnn"] = round(results["cudnn"] / (row["ms"] / 1e3), 3)
      run.save()


def run_sweep(run: Run):
  """Forward and backward block sizes of the flashvjp kernels at one shape."""
  S, D, causal = (64, 64, True) if run.smoke else (4096, 128, True)
  B, H = (1, 2) if run.smoke else (4, 16)
  fwd = [(128, 64), (64, 64), (128, 128), (64, 32)]
  bwd = [(32, 128, 128, 32), (64, 64, 64, 64), (64, 128, 128, 64), (128, 64, 64, 128), (32, 64, 64, 32)]
  configs = [("fwd", _config.BlockSizes(bq, bk)) for bq, bk in fwd]
  configs += [("fwd+bwd", _config.BlockSizes(128, 64, a, b, c, d)) for a, b, c, d in bwd]
  for mode, blocks in configs:
    if run.left() < 15:
      run.data["skipped"].append(f"sweep {mode} {blocks}: time budget")
      continue
    row = dict(mode=mode, blocks=dataclasses.asdict(blocks), S=S, D=D, B=B, H=H, causal=causal)
    try:
      sec = bench_one("flashvjp", B, H, S, D, causal, mode, run.smoke, blocks=blocks)
      row.update(ms=round(sec * 1e3, 4),
                 tflops=round(_flops(B, H, S, D, causal, mode) / sec / 1e12, 2))
    except Exception as e:  # record and go on
      row.update(error=_err(e))
    print(f"[{run.elapsed():6.1f}s] sweep {mode} {blocks}: {row.get('tflops', row.get('error'))}",
          flush=True)
    run.data["sweep"].append(row)
    run.save()


# ---- report ------------------------------------------------------------------------------

def markdown(d) -> str:
  lines = [f"# flashvjp GPU check ({d['started']})", "",
           f"jax {d['jax']}, python {d['python']}, backend {d['backend']}, device "
           f"{d['device_kind']}, {d.get('elapsed_s', '?')} s" + (" (CPU smoke run)" if d["smoke"] else ""),
           "", "## Correctness (compiled Pallas kernels vs float64 naive)", "",
           "| case | dtype | passed | deterministic | max rel err (out, lse, dq, dk, dv, dbias) | tol | s |",
           "|---|---|---|---|---|---|---|"]
  for r in d["correctness"]:
    errs = r.get("errors")
    errs = ", ".join(f"{k} {v:.2g}" for k, v in errs.items()) if errs else r.get("error", r.get("decision", ""))
    lines.append(f"| {r['case']} | {r.get('dtype', '')} | {'yes' if r.get('passed') else '**NO**'} | "
                 f"{r.get('deterministic', '')} | {errs} | {r.get('tol', '')} | {r.get('seconds', '')} |")
  lines += ["", "## Timing (bfloat16; TFLOP/s; ratio = cuDNN time / this time)", "",
            "| S | D | causal | mode | impl | B x H | ms | TFLOP/s | vs cuDNN |",
            "|---|---|---|---|---|---|---|---|---|"]
  for r in d["benchmarks"]:
    val = r.get("tflops", "")
    lines.append(f"| {r['S']} | {r['D']} | {r['causal']} | {r['mode']} | {r['impl']} | "
                 f"{r['B']}x{r['H']} | {r.get('ms', '')} | {val if val != '' else r.get('error', '')} | "
                 f"{r.get('vs_cudnn', '')} |")
  if d["sweep"]:
    lines += ["", "## flashvjp block-size sweep", "", "| mode | blocks | ms | TFLOP/s |",
              "|---|---|---|---|"]
    for r in d["sweep"]:
      b = r["blocks"]
      desc = (f"fwd {b['block_q']}x{b['block_kv']}, dkdv {b['block_q_dkv']}x{b['block_kv_dkv']}, "
              f"dq {b['block_q_dq']}x{b['block_kv_dq']}")
      lines.append(f"| {r['mode']} | {desc} | {r.get('ms', '')} | {r.get('tflops', r.get('error', ''))} |")
  if d["skipped"]:
    lines += ["", "## Skipped", ""] + [f"- {s}" for s in d["skipped"]]
  return "\n".join(lines) + "\n"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--budget-s", type=float, default=450.0, help="stop starting new work after this")
  p.add_argument("--cpu-smoke", action="store_true", help="interpret mode, tiny shapes, on CPU")
  p.add_argument("--skip", nargs="*", default=[], choices=["correctness", "bench", "sweep"])
  p.add_argument("--out", default="gpu_check", help="results/<out>.json and .md")
  args = p.parse_args(argv)
  if not args.cpu_smoke and jax.default_backend() != "gpu":
    print(f"no GPU (backend {jax.default_backend()!r}); use --cpu-smoke to test the script",
          file=sys.stderr)
    return 2
  run = Run(args.budget_s, args.cpu_smoke, args.out)
  print(f"jax {jax.__version__} on {run.data['device_kind']}", flush=True)
  if "correctness" not in args.skip:
    # float64 references on the host; the kernels' inputs stay bf16/f16/f32.
    jax.config.update("jax_enable_x64", True)
    try:
      run_correctness(run)
    finally:
      # Timing runs without x64, as users do (jax's own mha breaks under x64).
      jax.config.update("jax_enable_x64", False)
  impls = ["flashvjp", "cudnn", "xla", "jax_pallas_mha"]
  if "bench" not in args.skip:
    run_benchmarks(run, impls)
  if "sweep" not in args.skip:
    run_sweep(run)
  run.save()
  failed = [r["case"] for r in run.data["correctness"] if not r.get("passed")]
  print(f"done in {run.elapsed():.0f} s; correctness failures: {failed or 'none'}; results in "
        f"{os.path.join(RESULTS_DIR, args.out)}.json/.md", flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
