#!/usr/bin/env bash
# The GPU validation for one H100/H200-class GPU with no network (benchmarks/gpu_check.py lists
# the checks: --dry-run). FlashMLA / FlashInfer must already be installed (README, "FlashMLA on
# an offline GPU machine"); a backend that is not is skipped with its reason.
#
#   bash benchmarks/gpu_check.sh [--dry-run]    # python3 from PATH; its torch must see CUDA
#   PYTHON=/path/to/python bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv
exec "${PYTHON:-python3}" benchmarks/gpu_check.py "$@"
