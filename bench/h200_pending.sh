#!/usr/bin/env bash
# The GPU measurements still owed to issues 6 and 7, in priority order, in four parts that each fit
# one 10-minute device call (every step has its own timeout, so a slow step cannot eat the others;
# results land in bench/results/ and, when set, in $OUT):
#
#   . bench/gpu_env.sh && bash bench/h200_pending.sh 1   # GPU tests, fla vs per-token WKV, sampler kernel
#   . bench/gpu_env.sh && bash bench/h200_pending.sh 2   # decode grid, tensor-core GEMV, prefill (cuda vs fla)
#   . bench/gpu_env.sh && bash bench/h200_pending.sh 3   # W8A16 decode on the fused path, quantized GPU tests
#   . bench/gpu_env.sh && bash bench/h200_pending.sh 4   # HTTP serving with the sampler kernel + fla, official 1.5B
#
# Carry .whl (bench/fetch_wheels.sh). Commit what comes back and re-run bench/summarize.py.
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:?usage: h200_pending.sh 1|2|3|4}
OUT=${OUT:-}
export FLA_TILELANG=0
log() { if [ -n "$OUT" ]; then tee -a "$OUT/pending_$PART.log"; else cat; fi; }
step() {  # step SECONDS NAME CMD...: run with a timeout, keep going on failure
    local limit=$1 name=$2; shift 2
    echo "=== $name (limit ${limit}s) $(date +%T)" | log
    timeout -k 10 "$limit" "$@" 2>&1 | log | tail -25
    echo "=== $name: exit ${PIPESTATUS[0]}" | log
}
copy() { [ -n "$OUT" ] && cp "$@" "$OUT/" 2>/dev/null; true; }

case $PART in
1)
    step 240 "GPU tests" python -m pytest -q -rs test/test_fused_cuda.py test/test_wkv_cuda.py test/test_wkv_fla.py \
        test/test_graphs_cuda.py test/test_sampler_cuda.py
    step 150 "fla vs per-token WKV (prefill)" python bench/bench_wkv_prefill.py --variants c64-fp16,c16-fp16
    step 90 "sampler kernel vs torch" python bench/bench_sampler.py --out bench/results/sampler_h200.json
    copy bench/results/wkv_prefill_h200.json bench/results/sampler_h200.json
    ;;
2)
    step 200 "decode grid" python bench/bench_decode.py --sizes 1.5b,7.2b --batches 1,8,32,64,128,256,512,1024 \
        --states fp32,fp16 --steps 20 --wkv cuda --out bench/results/decode_h200_grid.json
    step 60 "tensor-core GEMV, 2-8 rows" env RWKV_TC_GEMV_ROWS=8 python bench/bench_decode.py --sizes 7.2b \
        --batches 2,3,4,8 --no-checks --wkv cuda --out bench/results/experiment_tc_gemv_h200.json
    step 120 "prefill, fla" python bench/bench_decode.py --sizes 7.2b --batches "" --prefill 128,1024,4096 \
        --prefill-rows 1,16 --wkv fla --no-checks --out bench/results/decode_h200_prefill_fla.json
    step 60 "prefill 16k" python bench/bench_decode.py --sizes 7.2b --batches "" --prefill 16384 --prefill-rows 1 \
        --wkv fla --no-checks --out bench/results/decode_h200_prefill_16k.json
    copy bench/results/decode_h200_grid.json bench/results/decode_h200_prefill_fla.json \
        bench/results/decode_h200_prefill_16k.json bench/results/experiment_tc_gemv_h200.json
    ;;
3)
    step 240 "W8A16 decode (first run builds the CUTLASS GEMM)" python bench/bench_decode.py --engine cutlass \
        --sizes 7.2b --batches 1,8,32,128,256 --no-checks --wkv cuda --out bench/results/decode_h200_w8_fused.json
    step 240 "quantized GPU tests (W8A16 kernels, GemLite)" python -m pytest -q -rs test/test_quant_cuda.py
    copy bench/results/decode_h200_w8_fused.json
    ;;
4)
    step 330 "HTTP serving (sampler kernel, fla prefill)" env RWKV_SAMPLER=auto LEVELS=1,32,256 MAX_TOKENS=128 \
        EXTRA_SERVER_ARGS="--wkv fla" bash bench/h200_serving.sh
    step 150 "official rwkv 1.5B" python bench/bench_official.py --sizes 1.5b --modes 0 \
        --out bench/results/official_h200_1.5b.json
    copy bench/results/serving_h200_7.2b.json bench/results/official_h200_1.5b.json
    ;;
*)
    echo "unknown part $PART" >&2
    exit 2
    ;;
esac
