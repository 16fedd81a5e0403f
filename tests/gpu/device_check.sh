#!/usr/bin/env bash
# The GPU checks in one run on a lent CUDA machine (docs/benchmarks/gpu.md): the CUDA tests, then
# the figures, each beside ceilings measured in the same run: the decode step eager and from CUDA
# graphs on a Llama-3-8B shape against its bandwidth bound, KV over CUDA IPC against the device
# copy, the Triton kernels, and 1P1D (CUDA IPC) against colocated under a Poisson load.
# Usage: OUT=DIR tests/gpu/device_check.sh [tests|figures|serving ...]  (default: all three)
# The image's python3 holds torch/triton/transformers/cupy; pdserve's other dependencies come as
# wheels in .whl/ (docs/benchmarks/gpu.md says how).
set -o pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
parts=${*:-tests figures serving}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton, transformers, cupy; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'cupy', cupy.__version__)"
} 2>&1 | tee "$OUT/versions.txt"

if [[ $parts == *tests* ]]; then
    timeout 280 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/kernels/test_torch_attention.py \
        tests/kernels/test_sliding_window_attention.py 2>&1 | tee "$OUT/pytest.log" | tail -40
fi

if [[ $parts == *figures* ]]; then
    timeout 150 python3 -m pdserve.bench.gpu_decode --shape llama3-8b --batches 1,8,32,64 --context 1024 \
        2>&1 | tee "$OUT/gpu_decode.txt"
    timeout 90 python3 -m pdserve.bench.cuda_ipc_transfer --prompt-tokens 2048 --rounds 8 2>&1 | tee "$OUT/cuda_ipc.txt"
fi

if [[ $parts == *serving* ]]; then
    # 1P1D over CUDA IPC against colocated, one GPU, the bench model in bf16, Poisson arrivals
    model=/tmp/bench-model
    python3 -m pdserve.cli make-model --out "$model" --preset bench >/dev/null 2>&1
    for mode in 1P1D colocated; do
        args=(--kv-transport cuda-ipc --prefill-placement remote)
        [ "$mode" = colocated ] && args=(--colocated)
        port=$((18000 + RANDOM % 1000))
        setsid python3 -m pdserve.cli serve --model "$model" --device cuda --dtype bfloat16 --port "$port" \
            --max-model-len 2048 --kv-cache-memory 8GiB --max-num-seqs 128 "${args[@]}" >"$OUT/serve_$mode.log" 2>&1 &
        pid=$!
        for _ in $(seq 120); do
            python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=1)" 2>/dev/null && break
            sleep 0.5
        done
        timeout 120 python3 -m pdserve.cli bench --base-url "http://127.0.0.1:$port" --tokenizer "$model" \
            --dataset-name random --random-input-len 512 --random-output-len 128 --num-prompts 300 \
            --request-rate 20 --ignore-eos --warmup-requests 8 --disable-tqdm --label "$mode" \
            --metric-percentiles 50,90,99 --save-result --result-dir "$OUT" --result-filename "poisson_$mode.json" \
            2>&1 | tail -30 | tee "$OUT/poisson_$mode.txt"
        kill -TERM -- -"$pid" 2>/dev/null
        wait "$pid" 2>/dev/null
    done
fi
