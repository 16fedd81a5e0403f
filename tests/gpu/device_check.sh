#!/usr/bin/env bash
# The GPU checks in one run on a lent CUDA machine (docs/benchmarks/gpu.md): the CUDA tests, then
# the Triton kernels' figures and the engine's, each beside ceilings measured in the same run.
# Usage: OUT=DIR tests/gpu/device_check.sh  (the image's python3 holds torch/triton/transformers;
# pdserve's other dependencies come as wheels in .whl/, see docs/benchmarks/gpu.md)
set -o pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/versions.txt"
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/kernels/test_torch_attention.py \
    tests/kernels/test_sliding_window_attention.py 2>&1 | tee "$OUT/pytest.log"
timeout 150 python3 -m pdserve.cli.main bench-gpu --json >"$OUT/bench_gpu.json" 2>"$OUT/bench_gpu.err"
tail -c 3000 "$OUT/bench_gpu.err"
timeout 120 python3 -m pdserve.cli.main bench-engine --device cuda --dtype bfloat16 --batches 1,8,32,128 \
    --prompt-len 512 --context 512 2>&1 | tee "$OUT/bench_engine_bf16.txt"
