"""Benchmark measurements: compiled memory, timing as ratios, FLOP counts, matmul rate.

Room: benchmarking. Reads the public API (`flashvjp.flash_attention`, `explain`) and
jax.nn; no kernel imports this module. Used by `benchmarks/bench_cpu.py` and by
`python -m flashvjp bench` (`add_bench_parser` / `run_bench`).

Conventions, stated once:

* Memory is what XLA reserves for one compiled call,
  ``jax.jit(f).lower(*args).compile().memory_analysis()``: ``temp`` (scratch, the
  number that shows O(seq) vs O(seq^2)), ``argument`` and ``output`` sizes. It is read
  from the compiled executable, so it is available even where running would not fit.
  On CPU the XLA flag ``--xla_cpu_experimental_ynn_fusion_type=individual_dot`` must be
  in ``XLA_FLAGS`` before the backend starts, otherwise fused dots hide their buffers;
  `ensure_cpu_memory_flag` adds it (importing this module calls it).
* Time is the median of several calls of the compiled function with
  ``block_until_ready``, after one warm-up call. Implementations of one shape are timed
  round-robin, and reported as a ratio to ``jax.nn.dot_product_attention(
  implementation="xla")`` timed in the same round-robin, because the machines are shared.
  A time budget (``SuiteConfig.budget_seconds``) lowers the number of timed calls of the
  costliest cells, down to none (then the warm-up call is the time, flagged ``runs == 0``);
  it never drops a cell.
* Attention FLOPs (the FlashAttention benchmark convention): forward
  ``4 * B * H * Sq * Skv * D`` (two matmuls), halved when causal (the ideal count, not
  what a block-sparse kernel executes on the diagonal); backward ``2.5x`` forward (five
  matmuls, including the recomputation of ``q @ k^T``), so forward+backward is ``3.5x``.
  The same count is used for every implementation, so FLOP/s compares times.
* Matmul rate: FLOP/s of ``jnp.dot`` on square matrices in the benchmark dtype, timed in
  the same round-robin as the attention calls of each shape, so that it samples the load
  over the whole run; attention FLOP/s is reported as a fraction of the median of those
  rates. (Not of the rate beside each call: beside multi-GiB naive/jax.nn calls the
  matmul reads up to 2x slower even on an idle machine, which would flatter the fraction.)
"""
from __future__ import annotations

import os

XLA_CPU_MEMORY_FLAG = "--xla_cpu_experimental_ynn_fusion_type=individual_dot"


def ensure_cpu_memory_flag() -> bool:
  """Add the CPU flag that makes memory analysis see fused dots; True if it was added.

  XLA reads XLA_FLAGS when the backend starts, so this works until the first jax
  computation runs (importing jax is fine). Scripts call it before importing jax.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_cpu_experimental_ynn_fusion_type" in flags:
    return False
  os.environ["XLA_FLAGS"] = (flags + " " + XLA_CPU_MEMORY_FLAG).strip()
  return True


_FLAG_ADDED_AT_IMPORT = ensure_cpu_memory_flag()

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform as _platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import flashvjp  # noqa: E402
from flashvjp._config import default_block_sizes  # noqa: E402


def _check_flag_took_effect():
  from jax._src import xla_bridge  # private: the only way to ask whether the backend started
  started = getattr(xla_bridge, "backends_are_initialized", lambda: False)()
  if _FLAG_ADDED_AT_IMPORT and started:
    warnings.warn(
        "flashvjp._bench set XLA_FLAGS after the jax backend had started: on CPU, compiled"
        f" memory of fused dots may read too low. Set XLA_FLAGS='{XLA_CPU_MEMORY_FLAG}'"
        " before the first jax computation.", RuntimeWarning, stacklevel=3)


_check_flag_took_effect()

IMPLEMENTATIONS = ("naive", "blockwise", "pallas", "jax.nn")
BASELINE = "jax.nn"  # jax.nn.dot_product_attention(implementation="xla")
MODES = ("fwd", "fwd+bwd")
BWD_FACTOR = 2.5  # backward FLOPs / forward FLOPs
MiB = 2 ** 20
GiB = 2 ** 30


# ---- FLOPs -------------------------------------------------------------------------------

def attention_flops(batch: int, heads: int, seq_q: int, seq_kv: int, head_dim: int, *,
                    causal: bool, mode: str = "fwd", head_dim_v: int | None = None) -> float:
  """Attention FLOPs by the FlashAttention convention (see the module docstring).

  Forward: 2 * B * H * Sq * Skv * (D + Dv) (= 4 * B * H * Sq * Skv * D when Dv = D),
  x0.5 when causal; "fwd+bwd" is 3.5x that (backward = 2.5x forward).
  """
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  dv = head_dim if head_dim_v is None else head_dim_v
  fwd = 2.0 * batch * heads * seq_q * seq_kv * (head_dim + dv)
  if causal:
    fwd *= 0.5
  return fwd if mode == "fwd" else fwd * (1.0 + BWD_FACTOR)


# ---- functions under test ----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Shape:
  """One benchmark shape. flashvjp layout [batch, heads, seq, head_dim]."""

  batch: int
  heads: int
  seq: int
  head_dim: int
  dtype: str = "float32"
  causal: bool = False

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)


def parse_impl(name: str) -> tuple:
  """"blockwise" -> ("blockwise", None, None); "blockwise:256x512" -> ("blockwise", 256, 512).

  The ":BQxBK" suffix (blockwise and pallas) benchmarks one block-size choice, so that
  several can be compared against the same jax.nn timing.
  """
  impl, _, blocks = name.partition(":")
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} (optionally"
                     f" blockwise:BQxBK or pallas:BQxBK), got {name!r}")
  if not blocks:
    return impl, None, None
  bq, _, bk = blocks.partition("x")
  if impl not in ("blockwise", "pallas") or not (bq.isdigit() and bk.isdigit()):
    raise ValueError(f"block sizes are written blockwise:BQxBK or pallas:BQxBK (e.g."
                     f" blockwise:256x512), got {name!r}")
  if int(bq) <= 0 or int(bk) <= 0:
    raise ValueError(f"block sizes must be positive, got {name!r}")
  return impl, int(bq), int(bk)


def attention_fn(impl: str, causal: bool, block_q: int | None = None,
                 block_kv: int | None = None) -> Callable:
  """(q, k, v) -> out for `impl` (see parse_impl); "jax.nn" takes [batch, seq, heads, dim].

  Block sizes written in `impl` ("blockwise:256x512") win over block_q / block_kv.
  """
  impl, bq, bk = parse_impl(impl)
  if impl == BASELINE:
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                        implementation="xla")
  blocks: dict[str, Any] = ({} if impl == "naive"
                            else dict(block_q=bq or block_q, block_kv=bk or block_kv))
  return lambda q, k, v: flashvjp.flash_attention(q, k, v, causal=causal,
                                                  implementation=impl, **blocks)


def benchmark_fn(impl: str, causal: bool, mode: str, **blocks) -> Callable:
  """The function timed: "fwd" (q, k, v) -> out; "fwd+bwd" (q, k, v, do) -> (dq, dk, dv)."""
  attn = attention_fn(impl, causal, **blocks)
  if mode == "fwd":
    return attn
  if mode != "fwd+bwd":
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")

  def fwd_bwd(q, k, v, do):
    _, vjp = jax.vjp(attn, q, k, v)
    return vjp(do)

  return fwd_bwd


def input_specs(impl: str, shape: Shape, mode: str) -> tuple:
  """ShapeDtypeStructs of the arguments of benchmark_fn(impl, ..., mode)."""
  if parse_impl(impl)[0] == BASELINE:
    dims = (shape.batch, shape.seq, shape.heads, shape.head_dim)
  else:
    dims = (shape.batch, shape.heads, shape.seq, shape.head_dim)
  spec = jax.ShapeDtypeStruct(dims, shape.jnp_dtype)
  return (spec,) * (3 if mode == "fwd" else 4)


def _normal(rng, dims, dtype):
  return jnp.asarray(rng.standard_normal(dims, dtype=np.float32)).astype(dtype)


def make_inputs(shape: Shape, seed: int = 0) -> dict[str, tuple]:
  """Random q, k, v, do in both layouts: {"bhsd": (...), "bshd": (...)}."""
  rng = np.random.default_rng(seed)  # numpy: eager jax.random would compile per shape
  dims = (shape.batch, shape.heads, shape.seq, shape.head_dim)
  bhsd = tuple(_normal(rng, dims, shape.jnp_dtype) for _ in range(4))
  bshd = tuple(jnp.swapaxes(x, 1, 2) for x in bhsd)
  jax.block_until_ready((bhsd, bshd))
  return {"bhsd": bhsd, "bshd": bshd}


def args_for(impl: str, mode: str, inputs: dict[str, tuple]) -> tuple:
  xs = inputs["bshd" if impl == BASELINE else "bhsd"]
  return xs[:3] if mode == "fwd" else xs


# ---- memory ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Memory:
  """Bytes of one compiled call (from memory_analysis)."""

  temp: int
  argument: int
  output: int
  alias: int

  @property
  def total(self) -> int:
    return self.temp + self.argument + self.output - self.alias


def memory_of(compiled) -> Memory:
  stats = compiled.memory_analysis()
  if stats is None:
    raise RuntimeError(f"this backend ({jax.default_backend()}) reports no memory analysis")
  return Memory(temp=int(stats.temp_size_in_bytes), argument=int(stats.argument_size_in_bytes),
                output=int(stats.output_size_in_bytes), alias=int(stats.alias_size_in_bytes))


def compile_fn(fn: Callable, *args):
  """jax.jit(fn).lower(*args).compile(); args may be arrays or ShapeDtypeStructs."""
  return jax.jit(fn).lower(*args).compile()


def compiled_memory(fn: Callable, *args) -> Memory:
  """Compiled memory of fn(*args), without running it."""
  return memory_of(compile_fn(fn, *args))


# ---- timing ------------------------------------------------------------------------------

def time_call(fn: Callable, *args) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - t0


def time_round_robin(calls: Sequence[tuple], *, repeats: int = 5, max_seconds: float = 20.0,
                     min_seconds: float = 0.5, max_repeats: int = 50,
                     total_seconds: float | None = None,
                     warm: Sequence[float] | None = None,
                     cheap_seconds: float = 0.05, keep_one_below: float = 0.25) -> list[dict]:
  """Times each (fn, args) round-robin; returns one dict per call.

  Each dict: "median", "min" (seconds), "runs" (timed calls), "times", "warmup" (the
  warm-up call's time) and "warmup_only" (True when no timed call fitted the budget).

  One warm-up call each (pass `warm` if they were already made; it also estimates the
  cost), then `repeats` timed rounds; more (up to `max_repeats`) for a fast call, until
  about `min_seconds` of timed calls; fewer for a call whose warm-up says its rounds
  would exceed `max_seconds`, and fewer for the most expensive calls until all timed
  calls together fit in `total_seconds` (a call whose runs cost under `cheap_seconds`
  in all keeps them: they cost nothing; a call whose warm-up took under `keep_one_below`
  keeps one: a first call can be several times slower than the next ones, and that is
  noticeable on short calls). A call with no timed call left is timed by its
  warm-up (a compiled call, no tracing): every call gets a time. Interleaving makes
  the ratios between calls robust to load from other users.
  """
  if warm is None:
    warm = [time_call(fn, *args) for fn, args in calls]
  warm = [max(float(t), 1e-9) for t in warm]
  runs = []
  for t0 in warm:
    n = max(repeats, min(max_repeats, int(min_seconds / t0)))
    runs.append(max(0, min(n, int(max_seconds // t0))))
  if total_seconds is not None:  # trim the costliest calls first, one run at a time
    floor = [min(n, 1) if t < keep_one_below else 0 for n, t in zip(runs, warm)]
    while sum(n * t for n, t in zip(runs, warm)) > total_seconds:
      trimmable = [i for i in range(len(runs)) if runs[i] > floor[i]]
      if not trimmable:
        break
      i = max(trimmable, key=lambda i: runs[i] * warm[i])
      if runs[i] * warm[i] <= cheap_seconds:
        break
      runs[i] -= 1
  times: list[list[float]] = [[] for _ in calls]
  for r in range(max(runs, default=0)):
    for i, (fn, args) in enumerate(calls):
      if r < runs[i]:
        times[i].append(time_call(fn, *args))
  out = []
  for t0, ts in zip(warm, times):
    only = not ts
    ts = ts or [t0]  # nothing fitted: the warm-up (a compiled call, no tracing) is the time
    out.append({"median": statistics.median(ts), "min": min(ts), "runs": 0 if only else len(ts),
                "times": ts, "warmup": t0, "warmup_only": only})
  return out


class CpuMeter:
  """Wraps a function: accumulates the wall time and this process's CPU time of its calls.

  cores_used = CPU seconds / wall seconds: about the core count for a multi-threaded
  matmul on an idle machine, much less when other processes hold the cores.
  """

  def __init__(self, fn: Callable):
    self.fn, self.cpu, self.wall = fn, 0.0, 0.0

  def __call__(self, *args):
    c0, w0 = time.process_time(), time.perf_counter()
    out = jax.block_until_ready(self.fn(*args))
    self.cpu += time.process_time() - c0
    self.wall += time.perf_counter() - w0
    return out

  @property
  def cores_used(self) -> float | None:
    return self.cpu / self.wall if self.wall > 0 else None


def matmul_call(n: int = 2048, dtype="float32"):
  """(compiled jnp.dot, (a, b), flops) for [n, n] x [n, n], to time beside attention."""
  rng = np.random.default_rng(1)
  a, b = _normal(rng, (n, n), dtype), _normal(rng, (n, n), dtype)
  return compile_fn(jnp.dot, a, b), (a, b), 2.0 * n ** 3


def matmul_rate(n: int = 2048, dtype="float32", repeats: int = 5) -> float:
  """Measured FLOP/s of jnp.dot on [n, n] x [n, n] (median of `repeats` after a warm-up)."""
  f, args, flops = matmul_call(n, dtype)
  (res,) = time_round_robin([(f, args)], repeats=repeats, max_seconds=60.0)
  return flops / res["median"]


def tile_matmul_rate(heads: int, block: int, head_dim: int, dtype="float32",
                     repeats: int = 5) -> float:
  """Measured FLOP/s of the attention tile product [H, block, D] x [H, block, D]^T."""
  rng = np.random.default_rng(1)
  a, b = (_normal(rng, (heads, block, head_dim), dtype) for _ in range(2))
  f = compile_fn(lambda x, y: jnp.einsum("hqd,hkd->hqk", x, y,
                                         preferred_element_type=jnp.float32), a, b)
  (res,) = time_round_robin([(f, (a, b))], repeats=repeats, max_seconds=30.0)
  return 2.0 * heads * block * block * head_dim / res["median"]


# ---- the suite ---------------------------------------------------------------------------

@dataclasses.dataclass
class Result:
  """One (implementation, shape, mode) measurement. Times in seconds, memory in bytes."""

  impl: str
  batch: int
  heads: int
  seq: int
  head_dim: int
  dtype: str
  causal: bool
  mode: str
  flops: float
  temp_bytes: int | None = None
  argument_bytes: int | None = None
  output_bytes: int | None = None
  time_s: float | None = None  # median
  time_min_s: float | None = None
  runs: int = 0  # timed calls after the warm-up; 0 with time_s set: the warm-up is the time
  warmup_s: float | None = None  # the first call of the compiled function
  compile_s: float | None = None  # lower + compile (also gives the memory numbers)
  skip_reason: str | None = None  # why time_s is None
  ratio_to_baseline: float | None = None  # time_s / jax.nn's time_s, same round-robin
  flops_per_s: float | None = None
  matmul_flops_per_s: float | None = None  # timed in the same round-robin (for reference)
  matmul_fraction: float | None = None  # flops_per_s / the run's median matmul rate


@dataclasses.dataclass
class SuiteConfig:
  seqs: Sequence[int]
  impls: Sequence[str] = ("naive", "blockwise", BASELINE)
  causals: Sequence[bool] = (True, False)
  modes: Sequence[str] = MODES
  batch: int = 1
  heads: int = 8
  head_dim: int = 64
  dtype: str = "float32"
  repeats: int = 5
  block_q: int | None = None
  block_kv: int | None = None
  # Timing is skipped (memory still read) where the compiled call needs more than this...
  max_time_memory_bytes: int = 3 * GiB
  # ...or where one call is predicted to take longer (from the same config at seq / 2).
  max_call_seconds: float = 10.0
  # Budget for the timed rounds of one call (warm-up excluded); fast calls are repeated
  # (up to 50 times) until about min_seconds_per_case.
  max_seconds_per_case: float = 20.0
  min_seconds_per_case: float = 0.5
  # Target wall time of the whole suite (compiles, warm-ups and timed rounds). It lowers
  # the number of timed rounds (down to none: then the warm-up call is the time), never
  # the cells: every (impl, seq, causal, mode) that fits in memory gets a time.
  budget_seconds: float | None = None
  # ...except that a call whose repeats cost less than this in all keeps them.
  cheap_seconds: float = 0.1
  # ...and a call whose warm-up took less than this keeps one timed call.
  keep_one_below: float = 0.25
  matmul_n: int = 2048


def machine_info() -> dict:
  devs = jax.devices()
  return {
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      "platform": jax.default_backend(),
      "device": devs[0].device_kind if devs else "none",
      "nproc": os.cpu_count(),
      "machine": _platform.machine(),
      "python": _platform.python_version(),
      "jax": jax.__version__,
      "flashvjp": flashvjp.__version__,
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }


def cases(cfg: SuiteConfig):
  """The (seq, causal, mode) groups, in the order they are measured (small seq first)."""
  return [(s, c, m) for s in sorted(cfg.seqs) for c in cfg.causals for m in cfg.modes]


def _cost_weight(seq: int, mode: str) -> float:
  """Relative cost of one (seq, mode) group, for sharing the time budget (naive and jax.nn,
  the costliest calls, do seq^2 work whether causal or not)."""
  return float(seq) ** 2 * (1.0 + BWD_FACTOR if mode == "fwd+bwd" else 1.0)


BUSY_RATE_FRACTION = 0.7  # the run's median matmul rate below this x its best: "busy"
BUSY_CORE_FRACTION = 0.5  # the matmul got less than this fraction of the cores: "busy"


def busy_warning(meta: dict) -> str | None:
  """One line when the reference matmul measured during the run says the machine was busy.

  The matmul is timed beside every group. On an idle machine its median rate stays near
  the best one seen in the run, and its threads get all the cores (CPU time / wall time
  ~ core count). Other processes show up as a lower median or fewer cores.
  """
  best, median = meta.get("matmul_flops_per_s_best"), meta.get("matmul_flops_per_s")
  cores, nproc = meta.get("matmul_cores_used"), meta.get("nproc") or 1
  slow = bool(best and median and median < BUSY_RATE_FRACTION * best)
  starved = meta.get("platform") == "cpu" and cores is not None and (
      cores < BUSY_CORE_FRACTION * nproc)
  if not (slow or starved):
    return None
  got = [f"{cores:.1f} of {nproc} cores"] if cores is not None and meta.get("platform") == "cpu" else []
  if best and median:  # absent when only the core count was measured
    got.append(f"{median / 1e9:.0f} GFLOP/s median vs {best / 1e9:.0f} at best during the run")
  return (f"warning: this machine looks busy (the reference matmul got {', '.join(got)}):"
          " absolute times are inflated and noisy; the ratios to jax.nn, timed round-robin,"
          " much less so")


def run_suite(cfg: SuiteConfig, progress: Callable[[str], None] | None = None) -> dict:
  """Measures every implementation at every (seq, causal, mode); returns a JSON-able dict.

  `progress(description)` is called once per finished group (tqdm's update, say).
  With `cfg.budget_seconds`, the timed rounds of each group get a share of the time left
  (after the predicted compiles and warm-ups of the groups still to come) proportional to
  the group's cost, so every group gets about the same number of rounds; a group with no
  time left is timed by its warm-up calls. No cell is dropped for time.
  """
  for impl in cfg.impls:
    parse_impl(impl)  # a ValueError naming the bad one, before anything runs
  impls = list(dict.fromkeys(cfg.impls))
  if BASELINE not in impls:
    impls.append(BASELINE)  # ratios need it
  start = time.perf_counter()
  meta = machine_info()
  mm_fn, mm_args, mm_flops = matmul_call(cfg.matmul_n, cfg.dtype)
  mm_fn = CpuMeter(mm_fn)
  (mm0,) = time_round_robin([(mm_fn, mm_args)], repeats=cfg.repeats, max_seconds=2.0,
                            min_seconds=min(cfg.min_seconds_per_case, 0.25))
  rates = [mm_flops / mm0["median"]]
  best_mm = mm0["min"]
  block = cfg.block_q or default_block_sizes("blockwise", False).block_q
  tile = tile_matmul_rate(cfg.heads, min(block, min(cfg.seqs)), cfg.head_dim, cfg.dtype)
  meta.update(matmul_shape=f"[{cfg.matmul_n}, {cfg.matmul_n}]^2 {cfg.dtype}",
              tile_matmul_flops_per_s=tile,
              tile_matmul_shape=f"[{cfg.heads}, {min(block, min(cfg.seqs))}, {cfg.head_dim}] x^T")
  meta["config"] = {k: (list(v) if isinstance(v, (tuple, list)) else v)
                    for k, v in dataclasses.asdict(cfg).items()}
  meta["flops_convention"] = ("fwd = 4*B*H*Sq*Skv*D (x0.5 causal); fwd+bwd = 3.5x fwd"
                              " (bwd = 2.5x fwd, recomputation included)")
  results: list[Result] = []
  last_time: dict[tuple, tuple] = {}  # (impl, causal, mode) -> (seq, seconds)
  inputs_cache: dict[int, dict] = {}
  groups = cases(cfg)
  compile_seconds: list[float] = []  # per group
  for gi, (seq, causal, mode) in enumerate(groups):
    shape = Shape(cfg.batch, cfg.heads, seq, cfg.head_dim, cfg.dtype, causal)
    flops = attention_flops(cfg.batch, cfg.heads, seq, seq, cfg.head_dim, causal=causal, mode=mode)
    group: list[Result] = []
    to_time = []
    t_compile = time.perf_counter()
    for impl in impls:
      r = Result(impl, cfg.batch, cfg.heads, seq, cfg.head_dim, cfg.dtype, causal, mode, flops)
      fn = benchmark_fn(impl, causal, mode, block_q=cfg.block_q, block_kv=cfg.block_kv)
      t0 = time.perf_counter()
      compiled = compile_fn(fn, *input_specs(impl, shape, mode))
      r.compile_s = time.perf_counter() - t0
      mem = memory_of(compiled)
      r.temp_bytes, r.argument_bytes, r.output_bytes = mem.temp, mem.argument, mem.output
      prev = last_time.get((impl, causal, mode))
      prev_seq, predicted = (None, None) if prev is None else (
          prev[0], prev[1] * (seq / prev[0]) ** 2)
      if mem.total > cfg.max_time_memory_bytes:
        r.skip_reason = (f"compiled memory {mem.total / GiB:.1f} GiB >"
                         f" {cfg.max_time_memory_bytes / GiB:.1f} GiB timing limit")
      elif predicted is not None and predicted > cfg.max_call_seconds:
        r.skip_reason = (f"predicted {predicted:.0f} s per call (from seq {prev_seq}) >"
                         f" {cfg.max_call_seconds:.0f} s limit")
      else:
        to_time.append((r, compiled))
      group.append(r)
    compile_seconds.append(time.perf_counter() - t_compile)
    if to_time:
      if seq not in inputs_cache:
        inputs_cache.clear()  # one seq at a time
        inputs_cache[seq] = make_inputs(shape)
      calls = [(c, args_for(r.impl, mode, inputs_cache[seq])) for r, c in to_time]
      calls.append((mm_fn, mm_args))  # the reference rate, under the same load
      warm = [time_call(fn, *args) for fn, args in calls]
      total = None
      if cfg.budget_seconds is not None:
        rest = groups[gi + 1:]
        w_now = _cost_weight(seq, mode)
        # Still to come: compiles (as so far) and warm-ups (this group's, scaled by cost).
        later = (statistics.mean(compile_seconds) * len(rest)
                 + sum(warm) * sum(_cost_weight(s, m) for s, _, m in rest) / w_now)
        left = cfg.budget_seconds - (time.perf_counter() - start) - later
        share = w_now / (w_now + sum(_cost_weight(s, m) for s, _, m in rest))
        total = max(0.0, left) * share
      *timed, mm = time_round_robin(calls, repeats=cfg.repeats,
                                    max_seconds=cfg.max_seconds_per_case,
                                    min_seconds=cfg.min_seconds_per_case, total_seconds=total,
                                    warm=warm, cheap_seconds=cfg.cheap_seconds,
                                    keep_one_below=cfg.keep_one_below)
      rates.append(mm_flops / mm["median"])
      best_mm = min(best_mm, mm["min"])
      for (r, _), t in zip(to_time, timed):
        r.time_s, r.time_min_s, r.runs, r.warmup_s = t["median"], t["min"], t["runs"], t["warmup"]
        r.flops_per_s = flops / r.time_s
        r.matmul_flops_per_s = rates[-1]
        last_time[(r.impl, causal, mode)] = (seq, r.time_s)
    base = next(r for r in group if r.impl == BASELINE)
    for r in group:
      if r.time_s is not None and base.time_s is not None:
        r.ratio_to_baseline = r.time_s / base.time_s
      results.append(r)
    if progress is not None:
      progress(f"seq {seq} {'causal' if causal else 'full'} {mode}")
  rate = statistics.median(rates)
  meta.update(matmul_flops_per_s=rate, matmul_flops_per_s_min=min(rates),
              matmul_flops_per_s_max=max(rates), matmul_flops_per_s_best=mm_flops / best_mm,
              matmul_cores_used=mm_fn.cores_used, seconds=time.perf_counter() - start,
              load_average=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
              compile_seconds=sum(r.compile_s or 0.0 for r in results),
              warmup_only_cells=sum(r.time_s is not None and r.runs == 0 for r in results))
  meta["busy_warning"] = busy_warning(meta)
  for r in results:
    if r.flops_per_s is not None:
      r.matmul_fraction = r.flops_per_s / rate
  return {"meta": meta, "results": [dataclasses.asdict(r) for r in results]}


# ---- reporting ---------------------------------------------------------------------------

def _fmt_bytes(b):
  if b is None:
    return "-"
  return f"{b / GiB:.2f} GiB" if b >= GiB else f"{b / MiB:.1f} MiB"


def _fmt_time(t, runs=None):
  if t is None:
    return "skipped"
  mark = "*" if runs == 0 else ""  # the warm-up call is the time (no timed call fitted)
  return (f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s") + mark


def _fmt_rate(x):
  return "-" if x is None else f"{x / 1e9:.1f}"


def results_table(report: dict) -> str:
  """A markdown table: one row per (impl, seq, causal), fwd and fwd+bwd side by side."""
  rows: dict[tuple, dict[str, dict]] = {}
  for r in report["results"]:
    rows.setdefault((r["seq"], r["causal"], r["impl"]), {})[r["mode"]] = r
  head = ["impl", "seq", "causal", "time fwd", "x jax.nn fwd", "time fwd+bwd",
          "x jax.nn fwd+bwd", "temp mem fwd", "temp mem fwd+bwd", "GFLOP/s fwd+bwd",
          "% matmul fwd+bwd"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for (seq, causal, impl), by_mode in sorted(rows.items(), key=lambda kv: (not kv[0][1], kv[0][0],
                                                                            kv[0][2])):
    f, fb = by_mode.get("fwd", {}), by_mode.get("fwd+bwd", {})
    ratio = lambda r: "-" if r.get("ratio_to_baseline") is None else f"{r['ratio_to_baseline']:.2f}"
    frac = fb.get("matmul_fraction")
    lines.append("| " + " | ".join([
        impl, str(seq), "yes" if causal else "no",
        _fmt_time(f.get("time_s"), f.get("runs")) if f else "-", ratio(f) if f else "-",
        _fmt_time(fb.get("time_s"), fb.get("runs")) if fb else "-", ratio(fb) if fb else "-",
        _fmt_bytes(f.get("temp_bytes")), _fmt_bytes(fb.get("temp_bytes")),
        _fmt_rate(fb.get("flops_per_s")), "-" if frac is None else f"{100 * frac:.0f}%",
    ]) + " |")
  return "\n".join(lines)


def skipped_lines(report: dict) -> list[str]:
  return [f"- {r['impl']} seq {r['seq']} {'causal' if r['causal'] else 'full'} {r['mode']}:"
          f" {r['skip_reason']}" for r in report["results"] if r["skip_reason"]]


def meta_lines(report: dict, warning: bool = True) -> list[str]:
  m = report["meta"]
  return [
      f"- date: {m['date']}",
      f"- machine: {m['platform']} ({m['device']}), {m['nproc']} cores, {m['machine']};"
      f" python {m['python']}, jax {m['jax']}, flashvjp {m['flashvjp']}",
      f"- XLA_FLAGS: `{m['xla_flags']}`",
      f"- matmul rate: {m['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s median ({m['matmul_shape']};"
      f" {m['matmul_flops_per_s_min'] / 1e9:.1f} to {m['matmul_flops_per_s_max'] / 1e9:.1f} over"
      " the run; \"% matmul\" is of the median);"
      f" attention-tile matmul {m['tile_matmul_flops_per_s'] / 1e9:.1f} GFLOP/s"
      f" ({m['tile_matmul_shape']})"
      + (f"; the matmul got {m['matmul_cores_used']:.1f} of {m['nproc']} cores (CPU time /"
         " wall time)" if m.get("matmul_cores_used") and m["platform"] == "cpu" else "")
      + (f"; load average {m['load_average']:.1f}" if m.get("load_average") is not None else ""),
      f"- FLOPs: {m['flops_convention']}",
      f"- suite wall time: {m['seconds']:.0f} s" + (
          f" (of which compiling: {m['compile_seconds']:.0f} s)" if "compile_seconds" in m else "")
      + (f"; time budget {m['config']['budget_seconds']:.0f} s"
         if m.get("config", {}).get("budget_seconds") else ""),
      "- time: median of the compiled call after a warm-up; \"x jax.nn\" = time /"
      " jax.nn.dot_product_attention(implementation=\"xla\") timed round-robin in the same run"
      + (f"; * = {m['warmup_only_cells']} cell{'s' if m['warmup_only_cells'] > 1 else ''} timed"
         " by the warm-up call alone (the time budget left no repeat)"
         if m.get("warmup_only_cells") else ""),
      "- temp mem: compiled temp_size_in_bytes (arguments and outputs excluded)",
  ] + ([f"- {m['busy_warning']}"] if warning and m.get("busy_warning") else [])


def plot(report: dict, path: str) -> dict[str, dict[str, list[int]]]:
  """Time and temp memory against seq (log-log): fwd and fwd+bwd columns, one line per impl.

  Returns what each panel shows: {panel title: {line label: [seq, ...]}}.
  """
  try:
    import matplotlib
  except ImportError as e:
    raise SystemExit("--plot needs matplotlib: pip install 'flashvjp[bench]'") from e
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib import ticker

  res = report["results"]
  modes = [m for m in MODES if any(r["mode"] == m for r in res)]
  impls = list(dict.fromkeys(r["impl"] for r in res))
  causals = sorted({r["causal"] for r in res}, reverse=True)
  fig, axes = plt.subplots(2, len(modes), figsize=(6.5 * len(modes), 9), squeeze=False)
  colors = dict(zip(impls, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
  m = report["meta"]
  drawn: dict[str, dict[str, list[int]]] = {}
  for col, mode in enumerate(modes):
    for row, (key, scale, label) in enumerate([("time_s", 1e3, "time per call (ms)"),
                                               ("temp_bytes", 1 / MiB, "compiled temp memory (MiB)")]):
      ax = axes[row][col]
      for impl in impls:
        for causal in causals:
          pts = sorted((r["seq"], r[key] * scale) for r in res
                       if r["impl"] == impl and r["mode"] == mode and r["causal"] == causal
                       and r[key] is not None and r[key] > 0)
          if not pts:
            continue
          xs, ys = zip(*pts)
          drawn.setdefault(f"{mode}: {label.split(' (')[0]}", {})[
              f"{impl} ({'causal' if causal else 'full'})"] = list(xs)
          ax.plot(xs, ys, marker="o" if causal else "s", color=colors[impl],
                  linestyle="-" if causal else "--", markerfacecolor=None if causal else "none",
                  label=f"{impl} ({'causal' if causal else 'full'})")
      ax.set_xscale("log", base=2)
      ax.set_yscale("log")
      seqs = sorted({r["seq"] for r in res})
      ax.set_xticks(seqs)
      ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x:g}"))
      ax.xaxis.set_minor_formatter(ticker.NullFormatter())
      ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _: f"{y:g}"))
      lo, hi = ax.get_ylim()
      ax.yaxis.set_minor_formatter(ticker.FuncFormatter(lambda y, _: f"{y:g}") if hi / lo < 30
                                   else ticker.NullFormatter())
      ax.set_xlabel("sequence length")
      ax.set_ylabel(label)
      ax.set_title(f"{mode}: {label.split(' (')[0]}")
      ax.grid(True, which="both", alpha=0.3)
      ax.legend(fontsize=8)
  cfg = m["config"]
  n_skipped = sum(r["time_s"] is None for r in res)
  fig.suptitle(f"flashvjp attention, B={cfg['batch']} H={cfg['heads']} D={cfg['head_dim']}"
               f" {cfg['dtype']} on {m['platform']} ({m['device']}, {m['nproc']} cores),"
               f" jax {m['jax']}, {m['date']}, {m['seconds']:.0f} s\njax.nn ="
               " dot_product_attention(implementation='xla'); time = median of the compiled call"
               + (f"; {n_skipped} cells not timed (memory limit)" if n_skipped else "")
               + ("\nthe machine was busy during this run (other processes held the cores):"
                  " absolute times are inflated and noisy" if m.get("busy_warning") else ""),
               fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return drawn


# ---- the CLI: python -m flashvjp bench ---------------------------------------------------

def default_config(platform: str) -> SuiteConfig:
  """CPU: about a minute on 2 cores, even busy; GPU: bigger shapes in bfloat16, Pallas if it runs.

  Every cell of the default grid is timed: the budget lowers the repeats, never the cells.
  """
  if platform == "cpu":
    return SuiteConfig(seqs=(256, 512, 1024, 2048), impls=("naive", "blockwise", BASELINE),
                       heads=4, head_dim=64, dtype="float32", repeats=5,
                       max_time_memory_bytes=3 * GiB, max_call_seconds=60.0,
                       max_seconds_per_case=5.0, min_seconds_per_case=0.2, budget_seconds=50.0,
                       matmul_n=1024)
  impls = ["naive", "blockwise", BASELINE]
  probe = jax.ShapeDtypeStruct((1, 16, 4096, 128), jnp.bfloat16)
  if flashvjp.explain(probe, probe, probe, causal=True).is_pallas:
    impls.insert(0, "pallas")
  return SuiteConfig(seqs=(1024, 2048, 4096, 8192, 16384), impls=tuple(impls), batch=4, heads=16,
                     head_dim=128, dtype="bfloat16", repeats=10,
                     max_time_memory_bytes=32 * GiB, max_call_seconds=10.0,
                     max_seconds_per_case=5.0, budget_seconds=120.0, matmul_n=8192)


def add_bench_parser(subparsers):
  """Adds `bench` to the subparsers of `python -m flashvjp`; returns the parser."""
  p = subparsers.add_parser(
      "bench", help="time and compiled memory of each implementation against jax.nn",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      description="""\
Benchmark flashvjp's implementations against jax.nn.dot_product_attention
(implementation="xla"): compiled temp memory, and the time of the forward and of
forward+backward (median of the compiled call, and its ratio to jax.nn timed
round-robin in the same run), attention FLOP/s and its fraction of a matmul rate
measured during the run.

Defaults on a CPU: batch 1, 4 heads, head_dim 64, float32, seq 256..2048, causal and
not, naive / blockwise / jax.nn: about a minute on a 2-core machine, even a busy one.
The time budget (--budget-seconds) lowers the number of repeats, never the cells:
every cell is timed (a cell with no time left is timed by its warm-up call, marked *).
On a GPU: batch 4, 16 heads, head_dim 128, bfloat16, seq 1k..16k, with Pallas.
A one-line warning says when the matmul rate measured during the run shows that
other work was competing for the machine.""")
  p.add_argument("--seq", type=int, nargs="+", help="sequence lengths (seq_q = seq_kv)")
  p.add_argument("--impl", nargs="+", type=_impl_arg, metavar="IMPL",
                 help=f"implementations, of {', '.join(IMPLEMENTATIONS)}; blockwise:BQxBK or"
                 " pallas:BQxBK fixes block sizes, and several can be compared in one run"
                 " (jax.nn is always measured: it is the baseline)")
  p.add_argument("--causal", choices=("both", "yes", "no"), default="both",
                 help="causal attention, full attention, or both (default)")
  p.add_argument("--mode", choices=("both",) + MODES, default="both",
                 help="time the forward, forward+backward, or both (default)")
  p.add_argument("--batch", type=int, help="batch size")
  p.add_argument("--heads", type=int, help="number of heads (query and kv)")
  p.add_argument("--head-dim", type=int, help="head dim")
  p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="input dtype")
  p.add_argument("--budget-seconds", type=float,
                 help="target wall time of the whole run (CPU default 50, GPU 120); 0 = no"
                 " budget: every cell gets --repeats timed calls")
  p.add_argument("--repeats", type=int,
                 help="timed calls per cell, of which the median is reported (fast calls get"
                 " more, up to 50; a short budget gives slow ones fewer)")
  p.add_argument("--min-seconds", type=float,
                 help="repeat fast calls (up to 50 times) until about this many seconds")
  p.add_argument("--matmul-size", type=int, help="n of the [n, n] x [n, n] reference matmul")
  p.add_argument("--block-q", type=int, help="block_q for blockwise/pallas (default: tuned)")
  p.add_argument("--block-kv", type=int, help="block_kv for blockwise/pallas (default: tuned)")
  p.add_argument("--max-call-seconds", type=float,
                 help="skip timing where one call is predicted (from the seq below) to take"
                 " longer")
  p.add_argument("--max-time-memory-gib", type=float,
                 help="skip timing (memory is still read) where a call needs more memory")
  p.add_argument("--json", metavar="FILE", help="write the results as JSON")
  p.add_argument("--plot", metavar="FILE.png", help="plot time and memory against seq (matplotlib)")
  p.add_argument("--no-progress", action="store_true", help="no progress bar or lines")
  p.set_defaults(func=run_bench)
  return p


def _impl_arg(name: str) -> str:
  try:
    parse_impl(name)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from e
  return name


def config_from_args(args) -> SuiteConfig:
  cfg = default_config(jax.default_backend())
  over: dict[str, Any] = {}
  for name, field in (("seq", "seqs"), ("impl", "impls"), ("batch", "batch"), ("heads", "heads"),
                      ("head_dim", "head_dim"), ("dtype", "dtype"), ("repeats", "repeats"),
                      ("block_q", "block_q"), ("block_kv", "block_kv"),
                      ("max_call_seconds", "max_call_seconds"),
                      ("budget_seconds", "budget_seconds"),
                      ("min_seconds", "min_seconds_per_case"), ("matmul_size", "matmul_n")):
    v = getattr(args, name, None)
    if v is not None:
      over[field] = tuple(v) if isinstance(v, list) else v
  if over.get("budget_seconds") is not None and over["budget_seconds"] <= 0:
    over["budget_seconds"] = None  # 0: no budget
  if getattr(args, "max_time_memory_gib", None) is not None:
    over["max_time_memory_bytes"] = int(args.max_time_memory_gib * GiB)
  causal = getattr(args, "causal", "both")
  over["causals"] = {"both": (True, False), "yes": (True,), "no": (False,)}[causal]
  mode = getattr(args, "mode", "both")
  over["modes"] = MODES if mode == "both" else (mode,)
  for name in ("batch", "heads", "head_dim", "repeats", "block_q", "block_kv", "matmul_n"):
    if name in over and over[name] <= 0:
      raise SystemExit(f"--{name.replace('_', '-')} must be positive, got {over[name]}")
  if "seqs" in over and min(over["seqs"]) <= 0:
    raise SystemExit(f"--seq must be positive, got {list(over['seqs'])}")
  return dataclasses.replace(cfg, **over)


class _PlainProgress:
  """Progress as plain lines on stderr (when tqdm is not installed)."""

  def __init__(self, total: int, desc: str):
    self.total, self.desc, self.n, self.start = total, desc, 0, time.perf_counter()

  def set_postfix_str(self, text: str):
    self.text = text

  def update(self, n: int = 1):
    self.n += n
    print(f"{self.desc} {self.n}/{self.total}: {getattr(self, 'text', '')} done"
          f" ({time.perf_counter() - self.start:.0f} s)", file=sys.stderr, flush=True)

  def close(self):
    pass


def progress_bar(total: int, desc: str = "bench"):
  """A tqdm bar, or plain progress lines on stderr when tqdm is not installed."""
  try:
    from tqdm.auto import tqdm
  except ImportError:
    return _PlainProgress(total, desc)
  return tqdm(total=total, desc=desc, unit="group")


def run_bench(args) -> int:
  """`python -m flashvjp bench`: measure, print a table, optionally write JSON and a plot."""
  cfg = config_from_args(args)
  if getattr(args, "plot", None):
    try:
      import matplotlib  # noqa: F401  (fail before measuring, not after)
    except ImportError as e:
      raise SystemExit("--plot needs matplotlib: pip install 'flashvjp[bench]'") from e
  groups = cases(cfg)
  impls = list(dict.fromkeys(list(cfg.impls) + [BASELINE]))
  budget = (f"about {cfg.budget_seconds:.0f} s (the time budget; a busy machine adds some)"
            if cfg.budget_seconds else f"{cfg.repeats} timed calls per cell, no time budget")
  print(f"bench: {len(groups)} groups (seq x causal x mode) x {len(impls)} implementations"
        f" ({', '.join(impls)}), B={cfg.batch} H={cfg.heads} D={cfg.head_dim} {cfg.dtype};"
        f" {budget}", flush=True)
  bar = None if getattr(args, "no_progress", False) else progress_bar(len(groups))

  def progress(desc):
    if bar is not None:
      bar.set_postfix_str(desc)
      bar.update(1)

  report = run_suite(cfg, progress)
  if bar is not None:
    bar.close()
  print("\n".join(meta_lines(report, warning=False)))  # the warning comes last, once
  print()
  print(results_table(report))
  skipped = skipped_lines(report)
  if skipped:
    print("\ntiming skipped (memory still read from the compiled call):")
    print("\n".join(skipped))
  if getattr(args, "json", None):
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1, default=_json_default)
    print(f"\nwrote {args.json}")
  if getattr(args, "plot", None):
    plot(report, args.plot)
    print(f"wrote {args.plot}")
  if report["meta"].get("busy_warning"):
    print(report["meta"]["busy_warning"])
  return 0


def _json_default(x):
  if isinstance(x, (np.floating, np.integer)):
    return x.item()
  raise TypeError(f"not JSON serialisable: {type(x).__name__}")
