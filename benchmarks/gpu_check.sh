#!/usr/bin/env bash
# GPU acceptance check for tessera_ray.kernels, for one H100/H200-class GPU with no network.
#
#   bash benchmarks/gpu_check.sh            # uses python3 from PATH (its torch must see CUDA)
#   PYTHON=/path/to/python bash benchmarks/gpu_check.sh
#
# 1. lists the usable decode backends (FlashMLA / FlashInfer must already be installed: see
#    the README section "FlashMLA on an offline GPU machine");
# 2. runs tests/gpu (FlashMLA and FlashInfer against the float32 reference on bf16 pages);
# 3. runs the decode benchmark (--quick) and writes benchmarks/results/kernels_gpu.json.
# Each step has its own time limit; the whole script stays under 5 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS=${RESULTS_DIR:-benchmarks/results}
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv
"$PY" -c '
import torch
from tessera_ray.kernels import available_backends
assert torch.cuda.is_available(), "this python sees no CUDA device"
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
print("usable decode backends:", available_backends())
'
timeout 180 "$PY" -m pytest tests/gpu -m gpu -q -rs -p no:cacheprovider
timeout 100 "$PY" benchmarks/bench_kernels.py --quick --out "$RESULTS/kernels_gpu.json"
echo "gpu_check: OK"
