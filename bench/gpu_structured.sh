#!/usr/bin/env bash
# Structured outputs on the GPU, built for ONE device call (from the repository root):
#   1. the GPU tests of tests/common/engine (the CUDA-graph runner, overlap scheduling, the
#      structured-output mask and deferred sampling, n > 1 on CUDA)
#   2. bench/structured_throughput.py with the engine on CUDA (random weights of SmolLM2's
#      shape and vocabulary, its tokenizer): 64 JSON-schema requests against 64 unconstrained
#      ones of the same lengths at batch 32, overlap scheduling on, launches per run
#   3. the same benchmark on an older tree when .whl/old holds one (`git archive <commit> common
#      kernels | tar -x -C .whl/old`; this script's benchmark is copied in), for a same-run
#      before/after
# Needs the wheels and the tokenizer of bench/gpu_suite.sh (.whl/, .whl/tok): carry
# [".whl", "protos/splitserve/v1"]. Logs and JSON go to $OUT (./out when unset).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
EXTRA=/tmp/splitserve-extra
python3 -m pip install -q --no-deps --target "$EXTRA" .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH="$EXTRA:$PWD" PYTHONUNBUFFERED=1 SPLITSERVE_TOKENIZER_DIR="$PWD/.whl/tok"
BENCH=(--model dummy:smollm2-135m --tokenizer-dir "$PWD/.whl/tok" --engine-device cuda
       --requests 64 --batch 32 --rounds 3)

echo "== 1. GPU tests of tests/common/engine ($(date +%T))"
python3 -m pytest -m gpu tests/common/engine -q -p no:cacheprovider -rfE 2>&1 | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}

echo "== 2. structured throughput on CUDA, this tree ($(date +%T))"
python3 bench/structured_throughput.py "${BENCH[@]}" --out "$OUT/structured_cuda.json" 2>&1 \
    | tee "$OUT/structured_cuda.log"
bench_rc=${PIPESTATUS[0]}

if [ -d .whl/old/common ]; then
    echo "== 3. the same on .whl/old ($(date +%T))"
    mkdir -p .whl/old/bench && cp bench/structured_throughput.py .whl/old/bench/
    ln -sfn "$PWD/protos" .whl/old/protos
    (cd .whl/old && PYTHONPATH="$EXTRA:$PWD" python3 bench/structured_throughput.py "${BENCH[@]}" \
        --out "$OUT/structured_cuda_old.json") 2>&1 | tee "$OUT/structured_cuda_old.log"
fi
echo "== rc: tests=$tests_rc bench=$bench_rc ($(date +%T))"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
