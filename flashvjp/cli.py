"""flashvjp's command line: `python -m flashvjp check`, `bench` and `plan`.

  check   compare the output and gradients of every implementation that runs on this
          machine with naive attention computed in float64, feature by feature
  bench   time and compiled memory of each implementation against jax.nn
  plan    compile one layer for a named GPU / TPU target without that hardware: per-device
          memory, strategy, collectives, kernels (registers, spills) as its compiler says

Run `python -m flashvjp check --help` (or bench, plan) for the options.
"""
from __future__ import annotations

import argparse
import sys
import textwrap
import time

# Importing _bench adds the CPU flag that compiled-memory numbers need; it must happen
# before the backend starts (before any jax computation), so it is imported here.
from flashvjp import _bench
from flashvjp import _plan
from flashvjp.testing._compare import PASS_RULE

_CHECK_HELP = "check the output and gradients of every implementation against float64 naive"
_CHECK_DESCRIPTION = """\
Check that flashvjp computes attention and its gradients correctly on this machine.

For each feature (plain, causal, local window, segment ids, a dense mask with an
empty row, an additive bias, the softcap and ALiBi score_mods, dropout, a prefix-LM
mask_mod, attention sinks) it runs each implementation available here on a small
problem (batch 1, 4 query heads on 2 kv heads, seq 70, head_dim 32) and compares the output and the gradients dq, dk, dv with
naive attention computed in float64 and differentiated by jax autodiff (also the
gradients of the bias, the sinks and the arrays a score_mod closes over: the "more"
column). Each row is one flashvjp.testing.check, the check your own test suite can call
(docs/testing.md).

{rule}

Your own function: `python -m flashvjp check my_module:attention_fn` checks
my_module.attention_fn (any function with flash_attention's signature; the current
directory is importable) on the same features instead of flashvjp's implementations.
--json prints one JSON document (every row, every quantity) instead of the table.

Implementations: "blockwise" (pure JAX) always; the Pallas kernels of this platform
(Triton on GPU, Mosaic on TPU) where they run. On a CPU both kernel families
("pallas_triton" and "pallas_tpu") run in interpret mode (how the test suite checks
them without a GPU or TPU). On an idle 2-core CPU
the whole check takes about a minute with jax 0.12 and about four minutes with jax
0.10; several times longer when the machine is busy; a third with --skip-pallas.
Each row is printed as soon as it finishes, with its time.

Exit status: 0 when every row passes, 1 otherwise.
""".format(rule=textwrap.fill(
    f"The pass rule: {PASS_RULE} (numpy's allclose with rtol = tolerance and atol = tolerance x"
    " max |ref|; the tolerance follows the input dtype). A row passes when every quantity"
    " does; the columns show each quantity's error.", 88, break_on_hyphens=False))


def _fmt_seconds(s: float) -> str:
  return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


def _load_function(spec: str):
  """'package.module:function' (or 'module:obj.attr') -> the callable."""
  import importlib
  import os
  mod_name, sep, attr = spec.partition(":")
  if not sep or not mod_name or not attr:
    raise SystemExit(f"error: function must be 'module:function', got {spec!r}")
  if os.getcwd() not in sys.path and "" not in sys.path:
    sys.path.insert(0, os.getcwd())
  try:
    obj = importlib.import_module(mod_name)
  except ImportError as e:
    raise SystemExit(f"error: cannot import module {mod_name!r} of {spec!r}: {e}") from e
  for part in attr.split("."):
    if not hasattr(obj, part):
      raise SystemExit(f"error: module {mod_name!r} has no attribute {attr!r}")
    obj = getattr(obj, part)
  if not callable(obj):
    raise SystemExit(f"error: {spec!r} is not callable ({type(obj).__name__})")
  return obj


def _check(args) -> int:
  if args.json:  # one JSON document on stdout, nothing else
    import contextlib
    import io
    import json
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
      code, doc = _check_rows(args)
    print(json.dumps(doc, indent=1))
    return code
  return _check_rows(args)[0]


def _check_rows(args):
  import jax
  jax.config.update("jax_enable_x64", True)
  import jax.numpy as jnp

  import flashvjp
  from flashvjp import _check
  from flashvjp import _selfcheck as check

  start = time.perf_counter()
  plat = jax.default_backend()
  x = jax.ShapeDtypeStruct((1, 4, 70, 32), jnp.float32)
  default = flashvjp.explain(x, x, x)
  impls = ["blockwise"]
  pallas_note = None
  user_fn = _load_function(args.function) if args.function else None
  if user_fn is not None:
    impls = [args.function]
    pallas_note = f"Checking your function {args.function} (flashvjp's own implementations: not run)"
  elif args.skip_pallas:
    pallas_note = "Pallas kernels: not checked (--skip-pallas)"
  else:
    try:
      family = flashvjp.explain(x, x, x, implementation="pallas")
    except ValueError as e:  # no Pallas family runs here: say why, check blockwise
      pallas_note = f"Pallas kernels: not checked ({e})"
    else:
      impls.append(family.implementation)
      if family.interpret:
        # Off their platforms both kernel families run in interpret mode (how the test
        # suite checks them): check both, the Triton (GPU) and the Mosaic (TPU) kernels.
        for other in ("pallas_triton", "pallas_tpu"):
          if other not in impls:
            impls.append(flashvjp.explain(x, x, x, implementation=other).implementation)
        pallas_note = (f"{', '.join(impls[1:])}: the Pallas kernels run in interpret mode on this"
                       f" {plat.upper()} (how the test suite checks every kernel line)")
  features = args.feature or list(check.FEATURES)
  dtype = jnp.dtype(args.dtype)
  n_rows = len(features) * len(impls)
  print(f"flashvjp {flashvjp.__version__}, jax {jax.__version__}, platform {plat}")
  print(f"Checking output and gradients (dq, dk, dv and more) of {', '.join(impls)} against naive"
        f" attention in float64: {len(features)} features x {len(impls)} = {n_rows} rows.")
  tols = {impl: _check.tolerance(dtype, impl) for impl in impls}
  if len(set(tols.values())) == 1:
    tol_text = f"{tols[impls[0]]:g}"
  else:  # float32 through TF32 matmuls (Pallas-Triton's default precision) gets a wider one
    tol_text = ", ".join(f"{t:g} ({impl})" for impl, t in tols.items()) + (
        "; the wider one is for float32 matmuls in TF32, the GPU's default precision, which"
        " interpret mode reproduces (jax.default_matmul_precision('highest') for IEEE float32, 'high' for"
        " 3xTF32)")
  print(f"Inputs {dtype.name}, tolerance {tol_text}. The pass rule: {PASS_RULE}; a row passes"
        " when every quantity does.")
  if pallas_note:
    print(pallas_note)
  if plat == "cpu":
    print(f"Expect about {round(2.5 * n_rows)} s on an idle 2-core CPU (up to 4x that with jax 0.10,"
          " or when the machine is busy); each row prints as it finishes.")
  print(flush=True)
  w = max(15, max(len(i) for i in impls) + 1)
  head = (f"{'implementation':<{w}}{'feature':<19}{'out':>10}{'dq':>10}{'dk':>10}{'dv':>10}"
          f"  {'more':<24}{'result':<7}{'time':>8}")
  print(head)
  print("-" * len(head), flush=True)
  done = [0]

  def on_row(r):
    done[0] += 1
    more = ""
    if r.skipped is not None or r.error is not None:
      cells, result = f"{'-':>10}" * 4, "n/a" if r.skipped is not None else "FAIL"
    else:
      cells, result = "".join(f"{e:>10.2e}" for e in r.errors), "PASS" if r.passed else "FAIL"
      if r.others():
        worst = max(r.others(), key=lambda q: q.error / q.tolerance)
        more = f"{worst.name} {worst.error:.2e}"
    print(f"{r.implementation:<{w}}{r.feature:<19}{cells}  {more:<24}{result:<7}"
          f"{r.seconds:>6.1f} s   [{done[0]}/{n_rows},"
          f" {_fmt_seconds(time.perf_counter() - start)} elapsed]", flush=True)
    if r.skipped is not None:
      print(f"    not run: {r.skipped}", flush=True)
    if r.error is not None:
      print(f"    raised {r.error}", flush=True)
    if r.report is not None and not r.report.passed:
      print("    " + str(r.report).replace("\n", "\n    "), flush=True)

  rows = check.run(impls, dtype=dtype, on_row=on_row, features=features, fn=user_fn)
  failed = [r for r in rows if r.skipped is None and not r.passed]
  skipped = [r for r in rows if r.skipped is not None]
  print()
  print(f"implementation=None (the default) runs here: {default}")
  summary = f"{len(rows) - len(failed) - len(skipped)} passed, {len(failed)} failed"
  if skipped:
    summary += f", {len(skipped)} not run (unsupported here)"
  print(f"{summary} in {_fmt_seconds(time.perf_counter() - start)}")
  if failed:
    print("FAILED: " + ", ".join(f"{r.implementation} {r.feature}" for r in failed))
  doc = dict(flashvjp=flashvjp.__version__, jax=jax.__version__, platform=plat,
             dtype=dtype.name, default=str(default), passed=not failed,
             rows=[r.to_dict() for r in rows])
  return (1 if failed else 0), doc


def _feature_arg(name: str) -> str:
  """A feature name, or an unambiguous start of one ("window", "mask", "dropout")."""
  from flashvjp import _selfcheck as check
  if name in check.FEATURES:
    return name
  hits = [f for f in check.FEATURES if f.startswith(name)]
  if len(hits) != 1:
    raise argparse.ArgumentTypeError(
        f"{'ambiguous' if hits else 'unknown'} feature {name!r}; choose from:"
        f" {', '.join(check.FEATURES)}")
  return hits[0]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m flashvjp", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True, metavar="{check,bench,plan}")
  c = sub.add_parser("check", help=_CHECK_HELP, description=_CHECK_DESCRIPTION,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
  c.add_argument("function", nargs="?", metavar="MODULE:FUNCTION",
                 help="check your own function (flash_attention's signature), e.g."
                 " my_model:attention_fn, instead of flashvjp's implementations")
  c.add_argument("--json", action="store_true",
                 help="print one JSON document (every row and quantity) instead of the table")
  c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                 help="input dtype; the tolerance follows it (default: float32)")
  c.add_argument("--skip-pallas", action="store_true",
                 help="check the blockwise path only (fast on a CPU, where Pallas is interpreted)")
  c.add_argument("--feature", nargs="+", type=_feature_arg, metavar="NAME",
                 help="check only these features (a name or its start), e.g."
                 " --feature causal window dropout")
  c.set_defaults(func=_check)
  b = _bench.add_bench_parser(sub)
  b.set_defaults(func=_bench.run_bench)
  pl = _plan.add_plan_parser(sub)
  pl.set_defaults(func=_plan.run_plan)
  args = parser.parse_args(argv)
  sys.exit(args.func(args))
