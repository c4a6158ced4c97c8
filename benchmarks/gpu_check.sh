#!/usr/bin/env bash
# GPU check of flashvjp's Pallas kernels: correctness via the Triton lowering, then timing.
# Usage (on a GPU machine, from anywhere): bash benchmarks/gpu_check.sh [--budget-s 450] [--skip sweep]
# Results: benchmarks/results/gpu_check.json and gpu_check.md (written as it goes).
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
PYTHONPATH=. exec timeout 475 python3 benchmarks/gpu_check.py "$@"
