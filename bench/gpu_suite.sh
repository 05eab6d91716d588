#!/usr/bin/env bash
# The GPU suite, built for ONE device call (run it from the repository root on the GPU machine):
#   1. the GPU tests (marked `gpu`) of tests/kernels (real shapes) and tests/common (the CUDA
#      runner and model, the KV transports with CUDA IPC, the sampler). The image lacks some
#      packages that tests/common imports (redis, cryptography, grpcio-health-checking, ...):
#      carry the wheels gpu_disagg.sh lists in .whl/ and the generated protos, e.g.
#      run(carry=[".whl", "protos/splitserve/v1"]); the structured-output tests also need
#      SmolLM2's tokenizer: copy tokenizer.json, tokenizer_config.json, config.json and
#      generation_config.json from the converted model's cache directory into .whl/tok and set
#      SPLITSERVE_TOKENIZER_DIR=$PWD/.whl/tok there (done below when .whl/tok exists)
#   2. the kernel benchmark: copy bandwidth, decode-attention bandwidth table (T5), block copy
#      (T7), extend attention; table on stdout, full numbers in $OUT/kernels.json
#   3. the model-vs-HF check (bench/gpu_model_check.py)
# Logs and JSON go to $OUT (the device tool's output folder; ./out when unset).
# Arguments are passed to bench/gpu_kernels.py (e.g. --sweep to time launch configurations).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"
mkdir -p "$OUT"
EXTRA=/tmp/splitserve-extra
if ls .whl/*.whl >/dev/null 2>&1; then  # the wheels gpu_disagg.sh lists (redis, grpc, ...)
    python3 -m pip install -q --no-deps --target "$EXTRA" .whl/*.whl 2>&1 | grep -v WARNING | tail -2
fi
export PYTHONPATH="$EXTRA:$PWD" PYTHONUNBUFFERED=1
if [ -f .whl/tok/tokenizer.json ]; then export SPLITSERVE_TOKENIZER_DIR="$PWD/.whl/tok"; fi
# tests/common imports these at collection; without them pytest stops before running anything.
if ! python3 -c 'import redis, cryptography, grpc_health, grpc_reflection' 2>/dev/null \
        || ! ls protos/splitserve/v1/*_pb2.py >/dev/null 2>&1; then
    echo "missing the carried wheels or the generated protos: see the top of this file" >&2
    exit 2
fi

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv 2>&1 | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' \
    | tee -a "$OUT/gpu.txt"

echo "== 1. GPU tests ($(date +%T))"
python3 -m pytest -m gpu tests/kernels tests/common -q -p no:cacheprovider -rfE 2>&1 \
    | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}

echo "== 2. kernel benchmark ($(date +%T))"
python3 bench/gpu_kernels.py --out "$OUT/kernels.json" "$@" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}

echo "== 3. model check ($(date +%T))"
# Our model (engine path: paged cache, Triton kernels, CUDA graphs) against HF transformers on
# random weights of the llama-3.2-1b shape: bf16 logits within tolerance, greedy tokens equal
# up to the first near-tie.
python3 bench/gpu_model_check.py --out "$OUT/model_check.json" 2>&1 | tee "$OUT/model_check.log"
model_rc=${PIPESTATUS[0]}

echo "== rc: tests=$tests_rc bench=$bench_rc model=$model_rc ($(date +%T))"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$model_rc" -eq 0 ]
