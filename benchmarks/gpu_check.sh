#!/usr/bin/env bash
# GPU check of flashvjp's Pallas kernels: correctness via the Triton lowering, then timing; then
# the sm_90a compile check (registers, spills, shared memory, pipelining per kernel).
# Usage (on a GPU machine, from anywhere): bash benchmarks/gpu_check.sh [--budget-s 450] [--skip sweep]
# Results: benchmarks/results/gpu_check.json and gpu_check.md (written as it goes), and
# benchmarks/results/triton_sm90_gpu.md/.json (compile check) when pip triton is importable.
# Everything stays within 475 s. FLASHVJP_SM90 chooses the compile check's share:
#   auto (default): gpu_check.py gets --budget-s 340 (killed at 365 s), the compile check the rest;
#   only: just the compile check; off: just gpu_check.py (--budget-s 450, killed at 475 s).
#   FLASHVJP_SM90_CASES=REGEX limits the compile check to matching cases.
set -euo pipefail
cd "$(dirname "$0")/.."
TOTAL=475
SM90=${FLASHVJP_SM90:-auto}
if [[ $SM90 != off ]] && ! python3 -c 'import triton, jaxlib.triton' >/dev/null 2>&1; then
  echo "compile check skipped: pip triton (or jaxlib.triton) is not importable"
  SM90=off
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
rc=0
if [[ $SM90 == off ]]; then
  PYTHONPATH=. exec timeout $TOTAL python3 benchmarks/gpu_check.py "$@"
elif [[ $SM90 == auto ]]; then
  # the caller's --budget-s comes last and wins
  PYTHONPATH=. timeout 365 python3 benchmarks/gpu_check.py --budget-s 340 "$@" || rc=$?
fi
left=$((TOTAL - SECONDS))
if (( left >= 30 )); then
  # report only (the CI run on a CPU host is the gate); one job per core
  PYTHONPATH=. timeout "$left" python3 benchmarks/triton_sm90.py --jobs "$(nproc)" --no-fail \
      ${FLASHVJP_SM90_CASES:+--cases "$FLASHVJP_SM90_CASES"} \
      --out-md benchmarks/results/triton_sm90_gpu.md || echo "compile check: exit status $?"
else
  echo "compile check skipped: ${left} s left of ${TOTAL} s (FLASHVJP_SM90=only runs it alone)"
fi
exit $rc
