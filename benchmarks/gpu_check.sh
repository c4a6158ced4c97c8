#!/usr/bin/env bash
# GPU check of flashvjp's Pallas-Triton kernels, in order of value: (1) correctness of every
# feature through the compiled Triton kernels, (2) headline timings against cuDNN / XLA / JAX's
# Pallas mha, (3) the launch-table sweep (benchmarks/gpu_check.py), then (4) the sm_90a compile
# check with this image's Triton, compared with the CI's pip-Triton figures (triton_sm90.json).
# Usage (on a GPU machine, from anywhere): bash benchmarks/gpu_check.sh [gpu_check.py options]
#   bash benchmarks/gpu_check.sh --dry-run     # the plan and its estimated seconds; runs nothing
# Results: benchmarks/results/gpu_check.json, .md and gpu_check_launch_table.json (written as
# it goes), and benchmarks/results/triton_sm90_gpu.md/.json (compile check).
# Everything stays within 480 s (about 8 minutes). FLASHVJP_SM90 chooses the compile check's share:
#   auto (default): gpu_check.py gets --budget-s 360 (killed at 390 s), the compile check the rest;
#   only: just the compile check; off: just gpu_check.py (--budget-s 450, killed at 480 s).
#   FLASHVJP_SM90_CASES=REGEX limits the compile check to matching cases.
set -euo pipefail
cd "$(dirname "$0")/.."
TOTAL=480
SM90=${FLASHVJP_SM90:-auto}
for a in "$@"; do
  if [[ $a == --dry-run ]]; then
    PYTHONPATH=. exec python3 benchmarks/gpu_check.py --sm90-s $((TOTAL - 360)) "$@"
  fi
done
if [[ $SM90 != off ]] && ! python3 -c 'import triton, jaxlib.triton' >/dev/null 2>&1; then
  echo "compile check skipped: triton (or jaxlib.triton) is not importable"
  SM90=off
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
rc=0
if [[ $SM90 == off ]]; then
  PYTHONPATH=. exec timeout $TOTAL python3 benchmarks/gpu_check.py --budget-s 450 "$@"
elif [[ $SM90 == auto ]]; then
  # the caller's --budget-s comes last and wins
  PYTHONPATH=. timeout 390 python3 benchmarks/gpu_check.py --budget-s 360 "$@" || rc=$?
fi
left=$((TOTAL - SECONDS))
if (( left >= 30 )); then
  # report only (the CI run on a CPU host is the gate); one job per core; the before -> after
  # table compares this image's Triton with the CI's pip triton (benchmarks/results/triton_sm90.json)
  PYTHONPATH=. timeout "$left" python3 benchmarks/triton_sm90.py --jobs "$(nproc)" --no-fail \
      ${FLASHVJP_SM90_CASES:+--cases "$FLASHVJP_SM90_CASES"} \
      --compare benchmarks/results/triton_sm90.json \
      --out-md benchmarks/results/triton_sm90_gpu.md || echo "compile check: exit status $?"
else
  echo "compile check skipped: ${left} s left of ${TOTAL} s (FLASHVJP_SM90=only runs it alone)"
fi
exit $rc
