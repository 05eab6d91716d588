#!/usr/bin/env bash
# The fp8-pool decode attention on the H200 (issue 19, tenth session), in ONE device call (kind
# nvidia-h200), from the repository root; carry the wheels and the generated protos:
#   run(carry=[".whl", "protos/splitserve/v1"], command="bash bench/gpu_fp8_attn.sh")
# 1. bench/gpu_fp8_attn.py: the kernel with and without DecodeConfig peel + asm_widen, its
#    variants and ceilings, batch 32-256 x context 1k-4k (JSON and log in $OUT/attn.*)
# 2. bench/gpu_fp8.sh tests perf8kv perf16: the GPU tests of the fp8 kernels and of the decode
#    kernel, then the engine (gpu_perf.py T3, T4, T1) with fp8 weights + fp8 KV and in bf16
#    ($OUT/fp8.tgz)
# 3. while under 380 s: Nsight Compute on prod and prod_peel_asm at batch 128, context 4096
#    ($OUT/ncu.txt)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
echo "== attn ($(date -u +%T))"
timeout 150 python3 bench/gpu_fp8_attn.py --out "$OUT/attn.json" 2>&1 | grep -v Warn \
    | tee "$OUT/attn.log"
echo "== gpu_fp8.sh ($(date -u +%T))"
bash bench/gpu_fp8.sh tests perf8kv perf16
if (( SECONDS - t0 < 380 )); then
    echo "== ncu ($(date -u +%T))"
    timeout $(( 580 - (SECONDS - t0) )) ncu --clock-control none -k regex:_decode_split_kernel \
        -s 1 -c 3 --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section SchedulerStats --section LaunchStats python3 bench/gpu_fp8_attn.py --ncu \
        > "$OUT/ncu.txt" 2>&1
    grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Issue \
Slots Busy|No Eligible|Warp Cycles Per Issued|Block Limit Reg" "$OUT/ncu.txt"
fi
echo "== done ($(date -u +%T), $(( SECONDS - t0 )) s)"
