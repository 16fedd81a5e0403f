#!/usr/bin/env bash
# Random models of the sizes CPU users run, as the GGUF files they download: written by llama.cpp's
# own converter and `llama-quantize` (so no pdserve code makes the file), for the benchmarks that
# serve them beside llama-server (docs/benchmarks/quantized.md). Needs deploy/setup-peers.sh's
# llama.cpp build and converter venv. Idempotent.
#
#   deploy/make-gguf-models.sh PRESET:TYPE[,TYPE...] ... [-- MAKE-MODEL FLAGS]   (PEERS=/opt/peers)
#   deploy/make-gguf-models.sh llama3.2-1b:Q4_K_M,Q8_0 llama3.2-3b:Q4_K_M
#   deploy/make-gguf-models.sh qwen3-30b-a3b:Q4_K_M -- --arch qwen3_moe --layers 16
#
# PRESET is a `pdserve make-model --preset` (llama3.2-1b, llama3.2-3b, llama3.1-8b, qwen3-30b-a3b);
# flags after `--` go to every make-model call (and `--layers N` into the names). Each writes
# $PEERS/<preset>[-L<N>]-<type>.gguf, e.g. llama3.2-1b-q4_k_m.gguf.
set -euo pipefail

specs=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do specs+=("$1"); shift; done
[ $# -gt 0 ] && shift
extra=("$@")
suffix=""
for ((i = 0; i < ${#extra[@]}; i++)); do
    [ "${extra[$i]}" = "--layers" ] && suffix="-L${extra[$((i + 1))]}"
done

PEERS=${PEERS:-/opt/peers}
log() { echo "[make-gguf-models $(date +%H:%M:%S)] $*"; }
LLAMA_SRC=$(ls -d "$PEERS"/src/llama_cpp_python-*/vendor/llama.cpp 2>/dev/null | head -1 || true)
QUANTIZE=$LLAMA_SRC/build/bin/llama-quantize
CONVERT_PY=$PEERS/convert/bin/python
if [ -z "$LLAMA_SRC" ] || [ ! -x "$QUANTIZE" ] || [ ! -x "$CONVERT_PY" ]; then
    echo "run deploy/setup-peers.sh first (llama.cpp's llama-quantize and the converter's venv)" >&2
    exit 1
fi

for spec in "${specs[@]}"; do
    preset=${spec%%:*}
    types=${spec#*:}
    name=$preset$suffix
    hf=$PEERS/models/$name
    if [ ! -f "$hf/config.json" ]; then
        log "$name: random HF model (bf16) -> $hf"
        pdserve make-model --out "$hf" --preset "$preset" --stream "${extra[@]}"
    fi
    f16=$PEERS/models/$name-f16.gguf
    if [ ! -f "$f16" ]; then
        log "$name: f16 GGUF with llama.cpp's convert_hf_to_gguf.py"
        "$CONVERT_PY" "$(dirname "$0")/convert_hf_to_gguf.py" "$LLAMA_SRC" "$hf" --outtype f16 --outfile "$f16"
    fi
    for t in ${types//,/ }; do
        out=$PEERS/$name-${t,,}.gguf
        if [ ! -f "$out" ]; then
            log "$name: $t with llama-quantize -> $out"
            "$QUANTIZE" "$f16" "$out" "$t" >/dev/null
        fi
    done
done
log "done"
