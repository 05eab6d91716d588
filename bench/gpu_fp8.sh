#!/usr/bin/env bash
# FP8 on the H200 (issue 19), built for ONE device call (kind nvidia-h200), from the repository
# root; carry the wheels and the generated protos as gpu_suite.sh says:
#   run(carry=[".whl", "protos/splitserve/v1"], command="bash bench/gpu_fp8.sh [parts]")
# Parts (default: all, in this order; each under its own time limit, so one that hangs or fails
# leaves the others their numbers):
#   tests     the GPU tests of the fp8 kernels and of the kernels that grew an fp8 path
#   gtests    those of the GEMV kernels alone (fp8 kernels, skinny GEMM, fused GEMVs, fused qkv)
#   kernels   bench/gpu_fp8.py: ceilings, projections bf16 vs fp8 at M = 1/256/8192, decode
#             attention on an fp8 pool vs bf16
#   dsweep    bench/gpu_fp8.py --sweep decode: the fp8-pool decode kernel's launch parameters
#   mmtests   the GPU tests of the fp8 GEMM above batch 1 (_scaled_mm, norm / activation first)
#   atests    the GPU tests of decode attention (both pools, the fp8 pool byte-wise and as pairs)
#   pairs     bench/gpu_fp8_attn.py --pairs: decode attention on an fp8 pool read byte-wise and
#             as 16-bit pairs (launch shape variants), the bf16 pool and a copy, T4's shape and
#             batch 32-256 x context 1k-4k
#   step      bench/gpu_fp8_step.py --promoted: _scaled_mm's fast accumulation off and on (time,
#             error), decode attention's split count and tile at T4's shape, the engine's
#             batch-256 step profiled without and with fast accumulation
#   tgemm     bench/gpu_fp8_step.py --parts tgemm: fp8_linear.scaled_mm_triton's tiles beside
#             _scaled_mm on the four projections at M = 256 and 1024
#   gemv      bench/gpu_fp8.py --sweep gemv --engine: the batch-1 fp8 GEMVs' launch parameters
#             and reductions (weights rotating over > L2), then the engine's batch-1 fp8 step
#             profiled with the default configs and with the sweep's best
#   check     bench/gpu_model_check.py with --quantization fp8 (llama-3.2-1b shape): logits vs
#             HF float32 on the same weights, next to what W8A8 quantization alone predicts
#   checkkv   the same with --kv-cache-dtype fp8 as well (reported, not judged)
#   perf8     bench/gpu_perf.py (llama-3-8b, random weights) T3, T4, T1 with fp8 weights
#   perf8kv   the same with fp8 weights and an fp8 KV cache
#   perf8kvs  perf8kv with the batch-1 GEMV configs the gemv part chose (run gemv before)
#   perf16    the same in bf16: the table beside them
#   perf16q   perf16's T3 and T4 alone (no T1)
#   t4bytes   perf8kv's T4 alone with decode attention reading the fp8 pool byte-wise (the
#             kernel before DecodeConfig.fp8_pairs): the same call's A/B
#   t4pick    perf8kv's T4 alone with the pairs part's fastest launch at T4's shape, when that
#             is not DecodeConfig.for_batch's (gpu_fp8_attn.T4_OVERRIDES)
# Logs and JSON go to $OUT/fp8 (./out when OUT is unset), packed at the end into $OUT/fp8.tgz
# (the device tool returns at most 8 files); a summary of each part closes the output.
set -uo pipefail
cd "$(dirname "$0")/.."
TOP="${OUT:-out}"
OUT="$TOP/fp8"
mkdir -p "$OUT"
EXTRA=/tmp/splitserve-extra
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d "$EXTRA" ]; then
    python3 -m pip install -q --no-deps --target "$EXTRA" .whl/*.whl 2>&1 | grep -v WARNING | tail -2
fi
export PYTHONPATH="$EXTRA:$PWD" PYTHONUNBUFFERED=1
PARTS="${*:-tests kernels check checkkv perf8 perf8kv perf16}"

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tail -1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
declare -A rc
for part in $PARTS; do
    echo "== $part ($(date +%T))"
    case $part in
    tests) timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE \
            tests/kernels/test_fp8_kernels.py tests/kernels/test_skinny_gemm.py \
            tests/kernels/test_fused_gemv.py tests/kernels/test_fused_qkv.py \
            tests/kernels/test_kv_store.py tests/kernels/test_norm_act.py \
            tests/kernels/test_decode_attention.py 2>&1 | tee "$OUT/fp8_tests.log" ;;
    gtests) timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE \
            tests/kernels/test_fp8_kernels.py tests/kernels/test_skinny_gemm.py \
            tests/kernels/test_fused_gemv.py tests/kernels/test_fused_qkv.py 2>&1 \
            | tee "$OUT/fp8_tests.log" ;;
    mmtests) timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE \
            tests/kernels/test_fp8_kernels.py -k "scaled_mm or many_rows or quantize" 2>&1 \
            | tee "$OUT/fp8_mmtests.log" ;;
    atests) timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE \
            tests/kernels/test_decode_attention.py tests/kernels/test_fp8_kernels.py \
            -k decode_attention 2>&1 \
            | tee "$OUT/fp8_atests.log" ;;
    pairs) timeout 200 python3 bench/gpu_fp8_attn.py --pairs --out "$OUT/fp8_pairs.json" 2>&1 \
            | grep -v Warn | tee "$OUT/fp8_pairs.log" ;;
    step) timeout 240 python3 bench/gpu_fp8_step.py --promoted --out "$OUT/fp8_step.json" 2>&1 \
            | tee "$OUT/fp8_step.log" ;;
    tgemm) timeout 150 python3 bench/gpu_fp8_step.py --parts tgemm --out "$OUT/fp8_tgemm.json" \
            2>&1 | grep -v Warn | tee "$OUT/fp8_tgemm.log" ;;
    gemv) timeout 240 python3 bench/gpu_fp8.py --sweep gemv --engine \
            --out "$OUT/fp8_gemv.json" 2>&1 | tee "$OUT/fp8_gemv.log" ;;
    kernels) timeout 150 python3 bench/gpu_fp8.py --out "$OUT/fp8_kernels.json" 2>&1 \
            | tee "$OUT/fp8_kernels.log" ;;
    dsweep) timeout 150 python3 bench/gpu_fp8.py --sweep decode --out "$OUT/fp8_dsweep.json" \
            2>&1 | tee "$OUT/fp8_dsweep.log" ;;
    check) timeout 120 python3 bench/gpu_model_check.py --quantization fp8 \
            --out "$OUT/fp8_model_check.json" 2>&1 | grep -v Warning | tee "$OUT/fp8_check.log" ;;
    checkkv) timeout 120 python3 bench/gpu_model_check.py --quantization fp8 \
            --kv-cache-dtype fp8 --out "$OUT/fp8kv_model_check.json" 2>&1 | grep -v Warning \
            | tee "$OUT/fp8kv_check.log" ;;
    perf8|perf8kv|perf8kvs|perf16|perf16q)
        flags=(); [ "${part#perf16}" = "$part" ] && flags+=(--quantization fp8)
        [ "${part#perf8kv}" != "$part" ] && flags+=(--kv-cache-dtype fp8)
        [ "$part" = perf8kvs ] && flags+=(--gemv-configs "$OUT/fp8_gemv.json")
        sections=T3,T4,T1; [ "$part" = perf16q ] && sections=T3,T4
        timeout 170 python3 bench/gpu_perf.py --skip-hf --sections $sections --budget 160 \
            "${flags[@]}" --out "$OUT/perf_$part.json" 2>&1 | tee "$OUT/perf_$part.log" ;;
    t4pick)
        pick=$(python3 -c 'import json, sys
sys.path.insert(0, "bench")
from gpu_fp8_attn import T4_OVERRIDES as opts
r = json.load(open(sys.argv[1]))["rows"][0]
ok = [n for n in opts if n in r and not r[n]["nan"] and r[n]["rel_err_vs_bytes"] < 1e-2]
best = min(ok, key=lambda n: r[n]["us"]) if ok else "default"
print(opts[best] if r[best]["us"] < 0.98 * r["default"]["us"] else "")' "$OUT/fp8_pairs.json")
        echo "t4pick: decode config '$pick' (the pairs part's fastest at T4's shape, if 2% faster)"
        [ -n "$pick" ] && timeout 120 python3 bench/gpu_perf.py --skip-hf --sections T4 \
            --budget 110 --quantization fp8 --kv-cache-dtype fp8 --decode-config "$pick" \
            --out "$OUT/perf_$part.json" 2>&1 | tee "$OUT/perf_$part.log" ;;
    t4bytes) timeout 120 python3 bench/gpu_perf.py --skip-hf --sections T4 --budget 110 \
            --quantization fp8 --kv-cache-dtype fp8 --decode-config fp8_pairs=0 \
            --out "$OUT/perf_$part.json" 2>&1 | tee "$OUT/perf_$part.log" ;;
    *) echo "unknown part $part"; false ;;
    esac
    rc[$part]=${PIPESTATUS[0]}
done
echo "== summary"
tail -n 3 "$OUT/fp8_tests.log" "$OUT/fp8_mmtests.log" "$OUT/fp8_atests.log" 2>/dev/null
sed -n '/^fraction of copy/,$p' "$OUT/fp8_pairs.log" 2>/dev/null | grep -v "^batch 1"
grep "^batch 1" "$OUT/fp8_pairs.log" 2>/dev/null
grep -E "^copy|^gemm|^attn|^engine|^    " "$OUT/fp8_step.log" 2>/dev/null
grep -E "^tgemm" "$OUT/fp8_tgemm.log" 2>/dev/null
grep -E "^copy|x[0-9.]+ *$|x[0-9.]+  |decode B=" "$OUT/fp8_kernels.log" 2>/dev/null
grep -E "^decode fp8" "$OUT/fp8_dsweep.log" 2>/dev/null
grep -E "^gemv fp8|^engine batch|^    " "$OUT/fp8_gemv.log" 2>/dev/null
for f in "$OUT"/fp8*_check.log; do [ -f "$f" ] && sed -n '/^model check/,$p' "$f"; done
for f in "$OUT"/perf_*.log; do [ -f "$f" ] && echo "-- $f" && sed -n '/^ours:/,$p' "$f"; done
tar czf "$TOP/fp8.tgz" -C "$TOP" fp8 && rm -rf "$OUT"
echo "== rc: $(for p in $PARTS; do printf '%s=%s ' "$p" "${rc[$p]}"; done)($(date +%T))"
