"""`python -m flashvjp`: `check` (gradient check on this platform) and `bench`.

Room: command line. Uses the public API only.
"""
from __future__ import annotations

import argparse
import sys

# Importing _bench adds the CPU flag that compiled-memory numbers need; it must happen
# before the backend starts (before any jax computation), so it is imported here.
from flashvjp import _bench


def _check(args) -> int:
  import jax
  jax.config.update("jax_enable_x64", True)
  import jax.numpy as jnp

  import flashvjp
  from flashvjp import _check as check
  from flashvjp import _dispatch

  x = jax.ShapeDtypeStruct((1, 4, 70, 32), jnp.float32)
  impls = ["blockwise"]
  try_pallas = flashvjp.explain(x, x, x, implementation=None)
  from flashvjp.pallas.triton import _limits
  ok, why = _limits.supports(platform=_dispatch.platform(), interpret=_dispatch.platform() == "cpu",
                             query_shape=x.shape, key_shape=x.shape, value_shape=x.shape,
                             dtype=x.dtype, has_score_mod=True, has_dropout=True)
  if ok and not args.skip_pallas:
    impls.append("pallas")
  dtype = jnp.dtype(args.dtype)
  print(f"flashvjp {flashvjp.__version__} on jax {jax.__version__}, platform {_dispatch.platform()}")
  print(f"gradient check against naive attention in float64; inputs {dtype.name},"
        f" tolerance {check.TOL[dtype]:g} x max|ref|")
  if "pallas" not in impls:
    print(f"pallas: not checked ({'--skip-pallas' if ok else why})")
  elif _dispatch.platform() == "cpu":
    print("pallas: the kernels run in interpret mode on this CPU (how CI tests every kernel line)")
  rows = check.run(impls, dtype=dtype)
  head = f"{'implementation':<15}{'feature':<16}{'out':>10}{'dq':>10}{'dk':>10}{'dv':>10}  result"
  print(head)
  print("-" * len(head))
  for r in rows:
    e = "".join(f"{x:>10.2e}" for x in r.errors)
    print(f"{r.implementation:<15}{r.feature:<16}{e}  {'PASS' if r.passed else 'FAIL'}")
  print()
  print(f"implementation=None here takes: {try_pallas}")
  failed = sum(not r.passed for r in rows)
  print(f"{len(rows) - failed} passed, {failed} failed")
  return 1 if failed else 0


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m flashvjp", description=__doc__)
  sub = parser.add_subparsers(dest="command", required=True)
  c = sub.add_parser("check", help="gradient check of every implementation against naive (float64)")
  c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
  c.add_argument("--skip-pallas", action="store_true", help="check blockwise only (faster on CPU)")
  c.set_defaults(func=_check)
  b = _bench.add_bench_parser(sub)
  b.set_defaults(func=_bench.run_bench)
  args = parser.parse_args(argv)
  sys.exit(args.func(args))
