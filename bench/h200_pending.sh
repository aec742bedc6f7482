#!/usr/bin/env bash
# The GPU measurements still owed to issues 6 and 7, in parts that each fit one 10-minute device call
# (every step has its own timeout, so a slow step cannot eat the others; results land in
# bench/results/ and, when set, in $OUT). On a two-GPU machine run two parts side by side, one per GPU:
#
#   . bench/gpu_env.sh && bash bench/h200_pending.sh tests     # every GPU test (fused, graphs, sampler, WKV, fla, quant)
#   . bench/gpu_env.sh && bash bench/h200_pending.sh profile   # per-kernel time, PDL A/B, sampler, fla prefill
#   . bench/gpu_env.sh && bash bench/h200_pending.sh grid      # decode grid, prefill (cuda vs fla), 16k prompt
#   . bench/gpu_env.sh && bash bench/h200_pending.sh w8        # W8A16 decode on the fused path
#   . bench/gpu_env.sh && bash bench/h200_pending.sh serving   # HTTP serving, official 1.5B
#   . bench/gpu_env.sh && bash bench/h200_pending.sh quick     # after a kernel change: decode, PDL A/B, profile, prefill, W8
#   . bench/gpu_env.sh && bash bench/h200_pending.sh check-serve  # after a kernel change: fused GPU tests, then serving
#   . bench/gpu_env.sh && bash bench/h200_pending.sh batched   # the large-batch path: GPU tests, decode, profile, prefill
#   . bench/gpu_env.sh && bash bench/h200_pending.sh split     # GEMV row splitting: fused GPU tests, decode A/B, profile
#   . bench/gpu_env.sh && bash bench/h200_pending.sh gemlite-gemv  # GemLite A16W8_INT8 decode on the fused GEMV
#   . bench/gpu_env.sh && bash bench/h200_pending.sh hopper-w8 # the Hopper W8A16 GEMM: GPU tests, GEMMs alone, decode
#   . bench/gpu_env.sh && bash bench/h200_pending.sh hopper-gemlite  # W8A16 small batches, GemLite int8 on the W8A16 kernels
#   . bench/gpu_env.sh && bash bench/h200_pending.sh w4-gemv   # 4-bit GemLite layers on the fused GEMV: GPU tests, decode
#   . bench/gpu_env.sh && bash bench/h200_pending.sh ttft      # where a prompt's prefill time goes (7.2B, profiler)
#   . bench/gpu_env.sh && bash bench/h200_pending.sh prefill   # after a time-mix change: GPU tests, profile, prefill
#   . bench/gpu_env.sh && bash bench/h200_pending.sh sparse-ffn  # the sparse-input FFN value GEMV: GPU tests, decode A/B
#   . bench/gpu_env.sh && bash bench/h200_pending.sh decode-b1   # builds first, then GPU tests, decode, A/B of the GEMV plans
#   . bench/gpu_env.sh && bash bench/h200_pending.sh chunked   # the chunked prefill time mix: GPU tests, prefill, A/B
#   . bench/gpu_env.sh && bash bench/h200_pending.sh gemv-order  # batch-1 GEMV launches: GPU tests, decode, split A/B
#   . bench/gpu_env.sh && bash bench/h200_pending.sh trained-accuracy  # engines on the trained tiny model; 4-bit test x3
#   . bench/gpu_env.sh && bash bench/h200_pending.sh split-parts   # split time mix on 2 or 4 blocks per head
#   . bench/gpu_env.sh && bash bench/h200_pending.sh prefill-split   # a head's state rows over four blocks: tests, prefill
#   . bench/gpu_env.sh && bash bench/h200_pending.sh prefill-gaps    # split time mix A/B; the batched prefill's idle time
#   . bench/gpu_env.sh && bash bench/h200_pending.sh prefill-split2  # split time mix, A on warps of its own: phases, A/B
#   . bench/gpu_env.sh && bash bench/h200_pending.sh gemlite-8bit  # GemLite 8-bit layers pre-scaled: overflow, accuracy
#   . bench/gpu_env.sh && bash bench/h200_pending.sh tail      # the last block on each row's last 2 tokens: tests, prefill
#   . bench/gpu_env.sh && bash bench/h200_pending.sh streams   # large decode batches as parts on separate streams
#   . bench/gpu_env.sh && bash bench/h200_pending.sh w4-cublas     # 4-bit layers on cuBLAS above 64 rows: tests, A/B
#   . bench/gpu_env.sh && bash bench/h200_pending.sh w4-gemm   # 4-bit layers on GemLite's GEMM only: tests x3, A/B
#   . bench/gpu_env.sh && bash bench/h200_pending.sh ln-span   # ln_shift_mix on 4 tokens a block: tests, prefill A/B
#   . bench/gpu_env.sh && bash bench/h200_pending.sh b1-bounds # W8A16 and 4-bit batch-1 steps per kernel; prompts again
#   . bench/gpu_env.sh && bash bench/h200_pending.sh tc        # prompts' time mix on tensor cores: A/B, GPU tests
#   . bench/gpu_env.sh && bash bench/h200_pending.sh int8-band  # int8 GEMV tasks on the tensor cores: W8 decode A/B
#   . bench/gpu_env.sh && bash bench/h200_pending.sh int8-sums  # int8 bands' rounding per way of summing, W8 decode
#   . bench/gpu_env.sh && bash bench/h200_pending.sh int8-final  # W8A16 decode against per-thread int8, GPU tests
#   . bench/gpu_env.sh && bash bench/h200_pending.sh int8-profile  # W8A16 batch-1/2 steps per kernel, bands and per-thread
#   . bench/gpu_env.sh && bash bench/h200_pending.sh warps16   # every GEMV launch on 16 warps against 8: launches, decode
#   . bench/gpu_env.sh && bash bench/h200_pending.sh wide      # few-band launches on 16 warps: tests, launches, W8/W4 A/B
#   . bench/gpu_env.sh && bash bench/h200_pending.sh engines-b1  # GemLite int8 decode, fp16 batch 1 and TTFT beside it
#   . bench/gpu_env.sh && bash bench/h200_pending.sh w4-hopper # the 4-bit Hopper GEMM: tests, GEMMs alone, W4 vs fp16
#   . bench/gpu_env.sh && bash bench/h200_pending.sh w4-prompts  # Hopper GEMMs' tile order: GEMM tests, W4/W8 prompts
#   . bench/gpu_env.sh && bash bench/h200_pending.sh w4-split  # split K for the 4-bit Hopper GEMM: tests, GEMMs, W4 A/B
#   . bench/gpu_env.sh && bash bench/h200_pending.sh quant-batched  # quantized engines' stacked LoRAs: tests, W4/W8 A/B
#   . bench/gpu_env.sh && bash bench/h200_pending.sh w4-split-rule  # 4-bit split K: GEMMs in CUDA graphs, W4 decode
#                                                                     # with slices of >= 2,048 against >= 4,096
#   . bench/gpu_env.sh && bash bench/h200_pending.sh w4-split-1.5b  # 1.5B r/k/v/output in two slices of 1,024 too:
#                                                                     # W4 decode A/B, fp16 beside
#   . bench/gpu_env.sh && bash bench/h200_pending.sh large-batch  # 7.2B/1.5B decode at 128-512 rows, fp32 and fp16
#                                                                   # state; 7.2B batch 256 per kernel (fp16 state)
#   . bench/gpu_env.sh && bash bench/h200_pending.sh w8-split  # split K for the int8 Hopper GEMM: tests, GEMMs, W8 A/B
#   . bench/gpu_env.sh && bash bench/h200_pending.sh time-mix-pipelined  # decode time mix on a fixed grid: GPU tests,
#                                                                   # decode A/B at 64-512 rows (fp32/fp16 state), profile
#   . bench/gpu_env.sh && bash bench/h200_pending.sh time-mix-fp32  # the pipelined time mix for fp32 states too
#                                                                    # (RWKV_TIME_MIX_PIPELINED=2): decode A/B, profile
#   . bench/gpu_env.sh && bash bench/h200_pending.sh fused-verify  # the fused GPU tests (prefill too), 7.2B batch
#                                                                    # 256/512 with fp16 state twice
#   . bench/gpu_env.sh && bash bench/h200_pending.sh time-mix-ncu  # Nsight Compute on the decode time mix (7.2B b256)
#   . bench/gpu_env.sh && bash bench/h200_pending.sh staged-loras  # LoRA second halves staged in one launch: GPU
#                                                                   # tests, batch-1/2 decode A/B (fp16, W8A16)
#   . bench/gpu_env.sh && bash bench/h200_pending.sh staged-quant  # the staged GPU tests (W8A16 too), batch-1/2 W8A16
#                                                                   # and W4 decode A/B of RWKV_GEMV_STAGED
#   . bench/gpu_env.sh && bash bench/h200_pending.sh sparse-int8  # int8 sparse FFN value: GPU tests, W8A16 decode at
#                                                                   # 1/2/8 rows with RWKV_SPARSE_FFN_INT8=1 and 0
#   . bench/gpu_env.sh && bash bench/h200_pending.sh int8-loads  # int8 band bytes in flight (kInt8Loads 3 vs 4
#                                                               # vs 2): int8 launches alone, W8A16 decode b1/b2
#   . bench/gpu_env.sh && bash bench/h200_pending.sh lora-stream  # large batches' LoRA products on a side stream:
#                                                               # GPU tests, decode/prompt/W8A16 A/B, profile
#   . bench/gpu_env.sh && bash bench/h200_pending.sh lora-streams2  # LoRA chains on a stream each: tests, decode A/B
#   . bench/gpu_env.sh && bash bench/h200_pending.sh int8-ring  # int8 bands' cp.async rings (rejected) against the
#                                                               # register batches: GPU tests, launches, W8A16 A/B
#   . bench/gpu_env.sh && bash bench/h200_pending.sh decode-ahead  # graph/engine GPU tests, then HTTP serving
#                                                                   # with --decode-ahead on / off, twice each
#   . bench/gpu_env.sh && bash bench/h200_pending.sh serving-steps  # serving with the prompt-token defaults x3,
#                                                                    # 512 a step between; a 16k prompt mid-level
#   . bench/gpu_env.sh && bash bench/h200_pending.sh lone-prompt  # TTFT of one 19 / 1k / 16k-token prompt (16k: step budget 2048 vs 512)
#   . bench/gpu_env.sh && bash bench/h200_pending.sh serving-ratio  # 7.2B batch-256 forward, then serving, one machine
#   . bench/gpu_env.sh && bash bench/h200_pending.sh ttft-host  # a lone request's TTFT in the engine (cProfile), server
#   . bench/gpu_env.sh && bash bench/h200_pending.sh prompt-graphs  # short one-row prompts from graphs: tests, TTFT
#   . bench/gpu_env.sh && bash bench/h200_pending.sh graphs-http  # graph GPU tests, lone 19/1k prompts and 1/32/256
#                                                                  # streams through HTTP (NAME_TAG names the results)
#   . bench/gpu_env.sh && bash bench/h200_pending.sh mixed-graphs  # mixed steps from graphs: tests, eager vs graphs
#                                                                   # by decoding rows, HTTP staggered and at once
#   . bench/gpu_env.sh && bash bench/h200_pending.sh mixed-stagger  # graph tests; streams arriving apart, eager vs
#                                                                    # graphed mixed steps, 1.5B and 7.2B
#   . bench/gpu_env.sh && bash bench/h200_pending.sh mixed-ab  # graph tests; 1.5B, 128 streams 4 ms apart x3,
#                                                               # eager vs graphed mixed steps
#   . bench/gpu_env.sh && bash bench/h200_pending.sh admission-ab  # graph tests; streams arriving apart with the
#                                                                   # host's copies waiting for the stream and not
#   . bench/gpu_env.sh && bash bench/h200_pending.sh gil-switch  # serving 1.5B/7.2B, --gil-switch-ms 5 against 0.5
#   . bench/gpu_env.sh && bash bench/h200_pending.sh stream-interval  # serving 1.5B/7.2B, --stream-interval 1, 2, 4
#   . bench/gpu_env.sh && bash bench/h200_pending.sh sampler-cost  # sample() device time by kernel; admission A/B x2
#   . bench/gpu_env.sh && bash bench/h200_pending.sh sampler-prepare  # sampler prepare kernel: tests, A/B, serving
#   . bench/gpu_env.sh && bash bench/h200_pending.sh sampler-graphs  # sampler in graphs: tests, engine A/B (1.5B)
#   . bench/gpu_env.sh && bash bench/h200_pending.sh sampler-graphs-serving  # 1.5B serving, sampler eager vs graphs
#   . bench/gpu_env.sh && bash bench/h200_pending.sh serving-profile  # py-spy of 1.5B serving; 7.2B sampler A/B
#   . bench/gpu_env.sh && bash bench/h200_pending.sh serving-gil  # 1.5B serving's GIL time a step; sampler device time
#   . bench/gpu_env.sh && bash bench/h200_pending.sh gemv-ncu  # Nsight Compute on one 7.2B layer's batch-1 GEMV
#                                                               # launches: 4-bit, W8A16
#   . bench/gpu_env.sh && bash bench/h200_pending.sh b1-ab FILE  # builds, GEMV/W8A16 GPU tests, batch-1 fp16 and W8A16
#                                                                   # decode A/B of the tree against FILE (a kernel file)
#   . bench/gpu_env.sh && bash bench/h200_pending.sh verify    # after a kernel change: builds, fused, graph, W8A16 GPU tests
#                                                               # (the quick part skips bench_decode's own checks)
#   . bench/gpu_env.sh && bash bench/h200_pending.sh gemv-stream  # streamed fp16 GEMV: GPU tests, decode A/B round 1
#   . bench/gpu_env.sh && bash bench/h200_pending.sh gemv-stream-more  # its round 2, per-kernel steps without PDL
#   . bench/gpu_env.sh && bash bench/h200_pending.sh verify-fused  # builds, every fused/graph GPU test
#   . bench/gpu_env.sh && bash bench/h200_pending.sh sse-json  # 1.5B serving, 256 streams: chunks by hand vs encoder
#   . bench/gpu_env.sh && bash bench/h200_pending.sh w4-dequant-bound  # W4 batch 1 without most of its dequantization
#                                                                   # (timing only, in a copy of the tree)
#   . bench/gpu_env.sh && bash bench/h200_pending.sh w4-bands  # ~9 min on a fresh machine: W4 at one row with full
#                                                                   # 4-bit bands, halved ones, and halved ones reading x
#                                                                   # from shared memory (uint4_x_staged.patch)
#   . bench/gpu_env.sh && bash bench/h200_pending.sh graphs-recheck  # graph GPU tests, then the sampler-capture test x3
#   . bench/gpu_env.sh && bash bench/h200_pending.sh admission-check  # graph GPU tests, 1.5B 128 streams 4 ms apart x3
#   . bench/gpu_env.sh && bash bench/h200_pending.sh w4-halve  # ~7 min on a fresh machine: which 4-bit launches
#                                                                   # halve their bands, A/B, then the 4-bit GPU tests
#   . bench/gpu_env.sh && bash bench/h200_pending.sh grid-w4   # ~9 min on a fresh machine: the decode grid of the
#                                                                   # tree (every row against its limit), W4 at 1-8 rows
#   . bench/gpu_env.sh && bash bench/h200_pending.sh engine-256  # ~6 min on a fresh machine: the 1.5B engine alone
#                                                                   # at 256 requests (ramp, steady rate, its steps)
#   . bench/gpu_env.sh && bash bench/h200_pending.sh persistent-step  # ~7 min on a fresh machine: the persistent
#                                                                   # batch-1 step (RWKV_PERSISTENT=1) against the launches
#   . bench/gpu_env.sh && bash bench/h200_pending.sh persistent-profile  # ~7 min on a fresh machine: GPU tests of
#                                                                   # the step and the fused path, the step per phase
#   . bench/gpu_env.sh && bash bench/h200_pending.sh blas-algos  # ~4 min, no build: each large-batch decode GEMM as
#                                                                   # torch runs it against every algorithm cuBLASLt's
#                                                                   # heuristic offers (7.2B/1.5B, 128-1,024 rows)
#   . bench/gpu_env.sh && bash bench/h200_pending.sh blas-ab   # ~3 min on a fresh machine: 7.2B decode at 256/512
#                                                                   # rows (fp16 state): the tree, cuBLASLt preferred,
#                                                                   # the tree again
#   . bench/gpu_env.sh && bash bench/h200_pending.sh verify-tree  # ~7 min on a fresh machine: the fused and graph
#                                                                   # GPU tests, the cuBLASLt calls, decode at batch 1
#                                                                   # (1.5B/7.2B) and 7.2B 256/512 rows (fp16 state)
#
#   CUDA_VISIBLE_DEVICES=1 bash bench/h200_pending.sh tests >/dev/null & p=$!
#   CUDA_VISIBLE_DEVICES=0 bash bench/h200_pending.sh profile >/dev/null; wait $p
#
# Carry .whl (bench/fetch_wheels.sh). Commit what comes back and re-run bench/summarize.py.
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:?usage: h200_pending.sh PART (the parts are listed at the top of this file)}
OUT=${OUT:-}
export FLA_TILELANG=0
log() { if [ -n "$OUT" ]; then tee -a "$OUT/pending_$PART.log"; else cat; fi; }
step() {  # step SECONDS NAME CMD...: run with a timeout, keep going on failure
    local limit=$1 name=$2; shift 2
    echo "=== $name (limit ${limit}s) $(date +%T)" | log
    timeout -k 10 "$limit" "$@" 2>&1 | log | tail -25
    echo "=== $name: exit ${PIPESTATUS[0]} $(date +%T)" | log
}
copy() { [ -n "$OUT" ] && cp "$@" "$OUT/" 2>/dev/null; true; }
# JIT builds of a fresh machine, outside the time limits of the test steps that follow (a test step that built them
# ran out of time before), side by side: the fused kernels are one long compile, the W8A16 kernels (the Hopper GEMM's
# tiles) many short ones: ~100 s on a fresh H200 machine against ~230 one after the other.
build() {
    step 420 "build the extensions" bash -c 'python -c "from infer.ops.fused import load_fused_kernels; \
assert load_fused_kernels()" & f=$!; python -c "from infer.ops.linear_w8a16 import load_w8a16_kernels; \
assert load_w8a16_kernels()"; w=$?; wait $f && exit $w'
}

build_fused() {
    step 240 "build the fused kernels" python -c "from infer.ops.fused import load_fused_kernels; assert load_fused_kernels()"
}

# the fused kernels and the persistent step (cuda/rwkv7_step.cu) side by side
build_step() {
    step 300 "build the fused kernels and the persistent step" bash -c 'python -c "from infer.ops.fused import \
load_fused_kernels; assert load_fused_kernels()" & f=$!; RWKV_PERSISTENT=1 python -c "from infer.ops.persistent import \
load_persistent_step; assert load_persistent_step()"; p=$?; wait $f && exit $p'
}

# profile_b256_fp16 OUT: the 7.2B batch-256 decode step per kernel with fp16 state, into OUT
profile_b256_fp16() {
    step 150 "7.2B batch 256 per kernel, fp16 state" python bench/profile_decode.py --sizes 7.2b --batches 256 \
        --state fp16 --out "$1"
}

# blas_decode RUN [VAR=VALUE]: the 7.2B decode step at 256 and 512 rows (fp16 state), with that variable if given,
# into bench/results/experiment_blas_ab_RUN_h200.json
blas_decode() {
    local out=bench/results/experiment_blas_ab_$1_h200.json
    step 100 "7.2B decode, fp16 state, $1 (${2:-as the tree runs it})" env ${2:+"$2"} python bench/bench_decode.py \
        --sizes 7.2b --batches 256,512 --states fp16 --steps 20 --wkv cuda --no-checks --out $out
    copy $out
}

# The fused GPU tests of the prefill and decode paths (without the 4-bit and GemLite ones).
fused_tests() {
    step 200 "fused GPU tests (prefill, decode, oracle, greedy, invariance)" python -m pytest -q -rs -p no:cacheprovider \
        test/test_fused_cuda.py -k "(prefill or decode_matches or cpu_fp32 or greedy or invariance or relu_square) and not uint4 and not gemlite"
}

# prefill_bench ROWS OUT: 7.2B and 1.5B prompts of 1,024 and 4,096 tokens, ROWS of them per forward, into OUT.
prefill_bench() {
    step 200 "prefill" python bench/bench_decode.py --sizes 7.2b,1.5b --batches "" --prefill 1024,4096 \
        --prefill-rows "$1" --wkv cuda --no-checks --out "bench/results/$2"
    copy "bench/results/$2"
}

# w8_decode LIMIT NAME SIZES BATCHES OUT [VAR=VALUE ...]: W8A16 decode (30 steps, CUDA graphs) of the SIZES at the
# BATCHES with those environment variables, into bench/results/OUT
w8_decode() {
    local limit=$1 name=$2 sizes=$3 batches=$4 out=$5
    shift 5
    step "$limit" "$name" env "$@" python bench/bench_decode.py --engine cutlass --sizes "$sizes" --batches "$batches" \
        --steps 30 --wkv cuda --no-checks --out "bench/results/$out"
    copy "bench/results/$out"
}

# switch_ab VAR TAG W8_BATCHES: decode with VAR=1 and VAR=0, two rounds: fp16 1.5B and 7.2B at batch 1 and 2, W8A16
# 7.2B at W8_BATCHES, into bench/results/experiment_TAG{1,0}_{round}[_w8]_h200.json
switch_ab() {
    local var=$1 tag=$2 w8_batches=$3 round value out
    for round in 1 2; do
        for value in 1 0; do
            out=bench/results/experiment_${tag}${value}_${round}_h200.json
            step 90 "decode, $var=$value, round $round" env "$var=$value" python bench/bench_decode.py \
                --sizes 1.5b,7.2b --batches 1,2 --steps 40 --wkv cuda --no-checks --out "$out"
            copy "$out"
            w8_decode 90 "W8A16 decode, $var=$value, round $round" 7.2b "$w8_batches" \
                "experiment_${tag}${value}_${round}_w8_h200.json" "$var=$value"
        done
    done
}

# ttft LIMIT NAME OUT: one forward over a 7.2B prompt of 1,024 tokens, into bench/results/OUT
ttft() {
    step "$1" "$2" python bench/bench_decode.py --sizes 7.2b --batches "" --prefill 1024 --prefill-rows 1 --wkv cuda \
        --no-checks --out "bench/results/$3"
    copy "bench/results/$3"
}

# The GPU tests of the int8 GEMV: the fused GEMV ones, the fused W8A16 model, decode and greedy, GemLite int8 decode
int8_tests() {
    step 120 "GEMV and W8A16 GPU tests" python -m pytest -q -rf --tb=short -p no:cacheprovider test/test_fused_cuda.py \
        test/test_quant_cuda.py -k "((gemv or w8a16 or decode_matches or greedy) and not uint4 and not gemlite) or gemlite_int8_decode"
}

# time_mix_layouts NAME: the split time mix's variants alone on a 7.2B and a 1.5B prompt's shape
time_mix_layouts() {
    step 150 "time-mix layouts, 7.2B prompt shape" python bench/experiment_time_mix_phases.py \
        --out "bench/results/experiment_time_mix_$1_h200.json"
    step 60 "time-mix layouts, 1.5B prompt shape" python bench/experiment_time_mix_phases.py --heads 32 \
        --out "bench/results/experiment_time_mix_$1_1.5b_h200.json"
    copy "bench/results/experiment_time_mix_$1_h200.json" "bench/results/experiment_time_mix_$1_1.5b_h200.json"
}

# GemLite's Triton tuning and the server's home inside the work tree, kept between the steps of a part
tuning_cache() {
    export TRITON_CACHE_DIR=$PWD/.cache/triton RWKV_SERVER_HOME=$PWD/.cache/home
    mkdir -p "$TRITON_CACHE_DIR" "$RWKV_SERVER_HOME"
}

# trained_accuracy OUT: every quantized engine on the trained tiny model against the fp16 engine, into OUT
trained_accuracy() {
    step 240 "engine accuracy on the trained model" python bench/quant_accuracy.py --checkpoint \
        test/data/tiny_trained_l4c128.pth --tokens 2048 --greedy-prompts 16 --greedy-tokens 128 \
        --engines cutlass,gemlite:A16W8_INT8,gemlite:A16W8_FP8,gemlite:A16W4_HQQ_INT --out "bench/results/$1"
    copy "bench/results/$1"
}

# serving_ab NAME LEVELS STAGGER_MS SIZE LAYERS EMBD CHANGE A B FILE...: HTTP serving of the random SIZE model (LAYERS x
# EMBD), streams of a level arriving STAGGER_MS apart: run A on the tree changed by the shell function CHANGE (which
# edits the FILEs, put back afterwards), then run B on the tree as it is; into bench/results/serving_h200_NAME_{A,B}.json
serving_ab() {
    local name=$1 levels=$2 stagger=$3 size=$4 layers=$5 embd=$6 change=$7 first=$8 second=$9
    shift 9
    tar cf /tmp/serving_ab.tar "$@" || return 1
    for run in "$first" "$second"; do
        if [ "$run" = "$first" ]; then "$change" || { tar xf /tmp/serving_ab.tar; return 1; }; fi
        step 100 "HTTP $size, streams $stagger ms apart, $run" env NAME=h200_${name}_$run LEVELS=$levels \
            MAX_TOKENS=256 STAGGER_MS=$stagger MODEL=/tmp/rwkv7-$size-random-fp16.pth N_LAYER=$layers N_EMBD=$embd \
            bash bench/h200_serving.sh
        copy bench/results/serving_h200_${name}_$run.json
        tar xf /tmp/serving_ab.tar
    done
}

# steps of decoding rows and one short prompt eager (StepGraphs.mixed_steps off)
mixed_steps_off() {
    sed -i "s/mixed_steps: bool = True/mixed_steps: bool = False/" infer/runner.py
    grep -q "mixed_steps: bool = False" infer/runner.py || { echo "mixed_steps default not found"; return 1; }
}

# mixed_ab NAME LEVELS STAGGER_MS SIZE LAYERS EMBD: serving_ab of eager mixed steps, then graphed ones
mixed_ab() { serving_ab "$@" mixed_steps_off eager mixed infer/runner.py; }

# the host's small copies to the device as they were while they waited for the stream (commit 4940d7d), from ab_before/
# (git-ignored: carry it):
#   mkdir -p ab_before/infer && for f in batch runner sampler state; do git show 4940d7d:infer/$f.py > ab_before/infer/$f.py; done
blocking_copies() { cp ab_before/infer/*.py infer/; }
ADMISSION_FILES=(infer/batch.py infer/runner.py infer/sampler.py infer/state.py)

# the streamed chunks' choices through json's encoder, as before commit 98d9890, from ab_before/ (git-ignored: carry it):
#   mkdir -p ab_before/infer/api && for f in openai streaming; do git show 98d9890~1:infer/api/$f.py > ab_before/infer/api/$f.py; done
sse_json_before() { cp ab_before/infer/api/openai.py ab_before/infer/api/streaming.py infer/api/; }

# option_ab SIZE LAYERS EMBD LEVELS OPTION TAG VALUE...: the SIZE model's decode forward at 32 and 256 rows (CUDA graphs,
# fp32 state), then HTTP serving at the LEVELS (streams arriving at once) with the server's --OPTION at each VALUE in
# turn, two rounds; into serving_h200_SIZE_TAG{VALUE}_{1,2}.json
option_ab() {  # option_ab SIZE LAYERS EMBD LEVELS OPTION TAG VALUE...: OPTION a server option, or env:VAR a variable
    local size=$1 layers=$2 embd=$3 levels=$4 option=$5 tag=$6 setting
    shift 6
    step 150 "$size decode, batch 32 and 256" python bench/bench_decode.py --sizes "$size" --batches 32,256 --wkv cuda \
        --no-checks --out "bench/results/decode_h200_${size}_b256_$tag.json"
    copy "bench/results/decode_h200_${size}_b256_$tag.json"
    for round in 1 2; do
        for value in "$@"; do
            if [[ $option == env:* ]]; then setting=("${option#env:}=$value"); else setting=(EXTRA_SERVER_ARGS="--$option $value"); fi
            step 100 "HTTP $size, $option $value, round $round" env NAME="h200_${size}_$tag${value}_$round" \
                LEVELS="$levels" MAX_TOKENS=256 MODEL="/tmp/rwkv7-$size-random-fp16.pth" N_LAYER="$layers" \
                N_EMBD="$embd" "${setting[@]}" bash bench/h200_serving.sh
            copy "bench/results/serving_h200_${size}_$tag${value}_$round.json"
        done
    done
}

sampler_graphs_engine() {  # sampler_graphs_engine ROUND...: the engine (1.5B, fused kernels, graphs, decode ahead) at
    # 1 and 256 requests with the decode steps' sampler eager (RWKV_SAMPLER_GRAPHS=0) and from graphs (1)
    local round value
    for round in "$@"; do
        for value in 0 1; do
            step 120 "engine 1.5B, sampler graphs $value, round $round" env RWKV_SAMPLER_GRAPHS=$value \
                python bench/bench_engine.py --device cuda --n-layer 24 --n-embd 2048 --requests 1,256 --slots 256 \
                --max-tokens 128 --graphs --decode-ahead --long-prompt 1024 \
                --out "bench/results/engine_h200_1.5b_sgraphs${value}_$round.json"
            copy "bench/results/engine_h200_1.5b_sgraphs${value}_$round.json"
        done
    done
}

gemv_stream_ab() {  # gemv_stream_ab ROUND: fp16 decode at batch 1, 2, 4, 8 with the streamed GEMV and without
    local streamed out
    for streamed in 1 0; do
        out=bench/results/experiment_gemv_stream${streamed}_$1_h200.json
        step 100 "decode, RWKV_GEMV_STREAM=$streamed, round $1" env RWKV_GEMV_STREAM=$streamed python \
            bench/bench_decode.py --sizes 1.5b,7.2b --batches 1,2,4,8 --steps 40 --wkv cuda --no-checks --out $out
        copy $out
    done
}

# the sampler's torch steps before the softmax on every path (as before its preparation kernel)
torch_preparation() {
    sed -i "s/        if (self._kernel is not None and not wants_logprobs/        if (False and not wants_logprobs/" infer/sampler.py
    grep -q "if (False and not wants_logprobs" infer/sampler.py || { echo "sampler preparation switch not found"; return 1; }
}

case $PART in
tests)  # one 300 s step for all of them was cut in the twenty-eighth session (fused and graph tests alone: 163 s)
    build
    step 300 "fused and graph GPU tests" python -m pytest -q -rf --tb=short -p no:cacheprovider \
        test/test_fused_cuda.py test/test_graphs_cuda.py
    step 240 "sampler, WKV and quantized GPU tests" python -m pytest -q -rf --tb=short -p no:cacheprovider \
        test/test_sampler_cuda.py test/test_wkv_cuda.py test/test_quant_cuda.py
    step 200 "fla tests" python -m pytest -q -rf --tb=short -p no:cacheprovider test/test_wkv_fla.py
    ;;
verify-tree)  # after removing rejected switches: the fused and graph GPU tests, the experiment's cuBLASLt calls, then
    # the headline decode figures (batch 1 of 1.5B and 7.2B; 7.2B at 256/512 rows with fp16 state)
    build_fused
    step 300 "fused and graph GPU tests" python -m pytest -q -rf --tb=short -p no:cacheprovider \
        test/test_fused_cuda.py test/test_graphs_cuda.py
    step 60 "cuBLASLt through ctypes (bench/cublaslt.py)" python -m pytest -q -rf --tb=short -p no:cacheprovider \
        test/test_experiment_blas_algos.py
    step 100 "decode, batch 1" python bench/bench_decode.py --sizes 1.5b,7.2b --batches 1 --steps 20 --wkv cuda \
        --no-checks --out bench/results/decode_h200_b1_verify.json
    copy bench/results/decode_h200_b1_verify.json
    blas_decode verify
    ;;
profile)
    step 200 "per-kernel profile" python bench/profile_decode.py --sizes 1.5b,7.2b --batches 1,8,256 \
        --out bench/results/profile_h200.json
    step 60 "PDL off, batch 1" env RWKV_PDL=0 python bench/bench_decode.py --sizes 1.5b,7.2b --batches 1 --no-checks \
        --wkv cuda --out bench/results/experiment_nopdl_h200.json
    step 60 "sampler kernel vs torch" python bench/bench_sampler.py --out bench/results/sampler_h200.json
    step 120 "fla vs per-token WKV (prefill)" python bench/bench_wkv_prefill.py --variants c64-fp16,c16-fp16
    copy bench/results/profile_h200.json bench/results/experiment_nopdl_h200.json bench/results/sampler_h200.json \
        bench/results/wkv_prefill_h200.json
    ;;
grid)
    step 200 "decode grid" python bench/bench_decode.py --sizes 1.5b,7.2b --batches 1,8,32,64,128,256,512,1024 \
        --states fp32,fp16 --steps 20 --wkv cuda --out bench/results/decode_h200_grid.json
    step 120 "prefill, fla" python bench/bench_decode.py --sizes 7.2b --batches "" --prefill 128,1024,4096 \
        --prefill-rows 1,16 --wkv fla --no-checks --out bench/results/decode_h200_prefill_fla.json
    step 60 "prefill 16k" python bench/bench_decode.py --sizes 7.2b --batches "" --prefill 16384 --prefill-rows 1 \
        --wkv fla --no-checks --out bench/results/decode_h200_prefill_16k.json
    copy bench/results/decode_h200_grid.json bench/results/decode_h200_prefill_fla.json \
        bench/results/decode_h200_prefill_16k.json
    ;;
w8)
    step 300 "W8A16 decode (first run builds the CUTLASS GEMM)" python bench/bench_decode.py --engine cutlass \
        --sizes 1.5b,7.2b --batches 1,8,32,128,256 --no-checks --wkv cuda --out bench/results/decode_h200_w8_fused.json
    copy bench/results/decode_h200_w8_fused.json
    ;;
serving)
    step 330 "HTTP serving" env LEVELS=1,32,256 MAX_TOKENS=256 OUT= bash bench/h200_serving.sh
    step 150 "official rwkv 1.5B" python bench/bench_official.py --sizes 1.5b --modes 0 \
        --out bench/results/official_h200_1.5b.json
    copy bench/results/serving_h200_7.2b.json bench/results/official_h200_1.5b.json
    ;;
quick)
    step 150 "decode" python bench/bench_decode.py --sizes 1.5b,7.2b --batches 1,8,64,256,512 --wkv cuda \
        --no-checks --out bench/results/decode_h200_fused.json
    copy bench/results/decode_h200_fused.json
    step 40 "PDL off, batch 1" env RWKV_PDL=0 python bench/bench_decode.py --sizes 1.5b,7.2b --batches 1 --no-checks \
        --wkv cuda --out bench/results/experiment_nopdl_h200.json
    copy bench/results/experiment_nopdl_h200.json
    step 90 "per-kernel profile, PDL off (clean kernel times)" env RWKV_PDL=0 python bench/profile_decode.py \
        --sizes 1.5b,7.2b --batches 1,256 --out bench/results/profile_nopdl_h200.json
    copy bench/results/profile_nopdl_h200.json
    step 60 "prefill, fused kernels at every row length" env RWKV_FUSED_LONG_ROW=1000000000 python bench/bench_decode.py \
        --sizes 7.2b --batches "" --prefill 128,1024 --prefill-rows 1,16 --wkv cuda --no-checks \
        --out bench/results/experiment_prefill_fused_h200.json
    copy bench/results/experiment_prefill_fused_h200.json
    step 120 "W8A16 decode" python bench/bench_decode.py --engine cutlass --sizes 1.5b,7.2b --batches 1,8,128,256 \
        --no-checks --wkv cuda --out bench/results/decode_h200_w8_fused.json
    copy bench/results/decode_h200_w8_fused.json
    ;;
verify)  # the GemLite-backed tests (which tune Triton kernels on first use) have their own parts
    build
    step 200 "fused and graph GPU tests" python -m pytest -q -rs -p no:cacheprovider test/test_fused_cuda.py \
        test/test_graphs_cuda.py -k "not uint4 and not gemlite"
    step 200 "W8A16 GPU tests" python -m pytest -q -rs -p no:cacheprovider test/test_quant_cuda.py -k "not gemlite"
    ;;
verify-fused)  # after a change to the fused kernels or their tests: both builds, then every fused and
    # graph GPU test (the 4-bit GemLite ones too, which tune their Triton kernels first)
    build
    step 420 "fused and graph GPU tests" python -m pytest -q -rf --tb=short -p no:cacheprovider test/test_fused_cuda.py \
        test/test_graphs_cuda.py
    ;;
w4-dequant-bound)  # TIMING ONLY in a copy of the tree (wrong results there): what the 4-bit bands' per-weight
    # dequantization costs at batch 1 with the tree's bytes in flight: 7.2B W4 decode at batch 1 and 2 on this tree
    # and on a copy with bench/variants/uint4_no_bias.patch (the nibbles go to the mma as they are masked, one fma a
    # word); W4_DEQUANT_VARIANTS="no_scale no_bias" adds uint4_no_scale.patch (one scale fma a word instead of four),
    # ~3 more minutes (three parallel builds ran past 420 s on one machine). Batch 2 takes the unchanged kernel: the
    # control
    tuning_cache
    variants=${W4_DEQUANT_VARIANTS:-no_bias}
    for v in $variants; do
        rm -rf "/tmp/w4_$v" && mkdir -p "/tmp/w4_$v"
        tar --exclude=./.whl --exclude=./.cache --exclude=./.git -cf - . | tar -xf - -C "/tmp/w4_$v"
        (cd "/tmp/w4_$v" && git apply "bench/variants/uint4_$v.patch") || echo "uint4_$v.patch does not apply" | log
    done
    # each copy builds its own W8A16 extension too (its own home; the 4-bit models load it for batches above 8)
    kernels="from infer.ops.fused import load_fused_kernels as f; from infer.ops.linear_w8a16 import \
load_w8a16_kernels as w; assert f() and w()"
    step 420 "builds: the extensions of this tree and of the copies" bash -c 'for v in '"$variants"'; do
(cd /tmp/w4_$v && RWKV_SERVER_HOME=/tmp/w4_home_$v python -c "$0") & done; python -c "$0"; f=$?; wait; exit $f' \
        "$kernels"
    for v in tree $variants; do
        out=$PWD/bench/results/experiment_w4_dequant_${v}_h200.json
        dir=$PWD home=$RWKV_SERVER_HOME limit=150  # the first run compiles GemLite's Triton kernels (one cache)
        [ $v = tree ] || dir=/tmp/w4_$v home=/tmp/w4_home_$v limit=90
        step $limit "W4 decode, batch 1 and 2, $v" bash -c "cd $dir && RWKV_SERVER_HOME=$home python bench/bench_decode.py \
--engine gemlite:A16W4_HQQ_INT --sizes 7.2b --batches 1,2 --steps 30 --wkv cuda --no-checks --out $out"
        copy "$out"
    done
    ;;
sse-json)  # streamed chunks' choices written out as JSON text (98d9890) against json's encoder (sse_json_before: carry
    # ab_before/): the 1.5B forward at 32 and 256 rows, then 1.5B serving at 256 streams before / after, twice
    build_fused
    step 150 "1.5b decode, batch 32 and 256" python bench/bench_decode.py --sizes 1.5b --batches 32,256 --wkv cuda \
        --no-checks --out bench/results/decode_h200_1.5b_b256_ssejson.json
    copy bench/results/decode_h200_1.5b_b256_ssejson.json
    for round in 1 2; do
        serving_ab "1.5b_ssejson_$round" 256 0 1.5b 24 2048 sse_json_before encoder written infer/api/openai.py \
            infer/api/streaming.py
    done
    ;;
persistent-step)  # the batch-1 decode step as one persistent kernel (cuda/rwkv7_step.cu, RWKV_PERSISTENT=1) against the
    # fused launches: its GPU tests, then 1.5B and 7.2B batch 1 (CUDA graphs) with the launches, the persistent kernel
    # (merged phases, 2 blocks a multiprocessor), with a grid barrier before every phase instead, on 1 block a
    # multiprocessor, and without its loads ahead of the barriers; the launches and the default twice
    build_step
    step 200 "persistent step GPU tests" python -m pytest -q -rs -p no:cacheprovider test/test_step_cuda.py
    for variant in launches:0:2:1:1 merged:1:2:1:1 barriers:1:2:1:0 blocks1:1:1:1:1 noprefetch:1:2:0:1 \
        launches_2:0:2:1:1 merged_2:1:2:1:1; do
        IFS=: read -r tag on blocks prefetch merge <<<"$variant"
        out=bench/results/experiment_persistent_${tag}_h200.json
        step 120 "batch 1, $tag" env RWKV_PERSISTENT="$on" RWKV_PERSISTENT_BLOCKS="$blocks" \
            RWKV_PERSISTENT_PREFETCH="$prefetch" RWKV_PERSISTENT_MERGE="$merge" python bench/bench_decode.py \
            --sizes 1.5b,7.2b --batches 1 --steps 40 --wkv cuda --no-checks --out "$out"
        copy "$out"
    done
    ;;
persistent-profile)  # where the persistent step's time goes (bench/profile_persistent.py: each block's start and end
    # of every phase, the global timer): its GPU tests and the fused path's, then 1.5B and 7.2B batch 1 per phase with
    # merged phases or a barrier before each, the FFN value K-major (sparse) or row-major; then decode (CUDA graphs)
    # with the launches and the persistent step; the fused path's GPU tests
    build_step
    step 200 "persistent step GPU tests" python -m pytest -q -rs -p no:cacheprovider test/test_step_cuda.py
    step 300 "persistent step per phase" python bench/profile_persistent.py --sizes 1.5b,7.2b --merge 1,0 \
        --ffn kmajor,rowmajor --out bench/results/profile_persistent_h200.json
    copy bench/results/profile_persistent_h200.json
    for variant in launches:0 persistent:1; do
        IFS=: read -r tag on <<<"$variant"
        out=bench/results/experiment_persistent2_${tag}_h200.json
        step 120 "batch 1, $tag" env RWKV_PERSISTENT="$on" python bench/bench_decode.py --sizes 1.5b,7.2b --batches 1 \
            --steps 40 --wkv cuda --no-checks --out "$out"
        copy "$out"
    done
    fused_tests
    ;;
w4-bands)  # the 4-bit bands at one row, three ways in one call: halved bands (8-byte words, the one-row loop 394 SASS
    # instructions a batch of 16 words) from 2,048 columns (the default RWKV_UINT4_SPLIT_MIN_K: at 7.2B every matrix),
    # full bands of 32 channels (16-byte words: 337) everywhere (RWKV_UINT4_SPLIT_MIN_K=1000000), and halved bands
    # reading x's pairs from a copy staged in shared memory (bench/variants/uint4_x_staged.patch: 319). Its 4-bit GPU
    # tests first (experiment_ab_x_staged_tests.txt); then per variant and round the 7.2B 4-bit launches alone
    # (round 1) and W4 decode at 1 and 2 rows (7.2B, 1.5B), two rounds. The 4-bit models load the W8A16 extension too
    cp cuda/rwkv7_fused.cu x_staged.cu && patch -s x_staged.cu < bench/variants/uint4_x_staged.patch || exit 1
    build
    tuning_cache
    step 480 "A/B of full, halved and x-staged 4-bit bands" env ROUNDS=2 bash bench/ab_kernels.sh '{ [ {name} = tree ] \
|| [ {round} = 2 ] || { python -m pytest -q -x -p no:cacheprovider test/test_fused_cuda.py -k "uint4 or gemv" \
> bench/results/experiment_ab_{name}_tests.txt 2>&1; tail -1 bench/results/experiment_ab_{name}_tests.txt; }; } && \
for mk in 2048 1000000; do [ {name} = tree ] || [ $mk = 2048 ] || continue; tag={name}_k$mk; \
[ {round} = 2 ] || RWKV_UINT4_SPLIT_MIN_K=$mk python bench/bench_gemv.py --size 7.2b --weights uint4 \
--out bench/results/experiment_ab_${tag}_gemv_h200.json; RWKV_UINT4_SPLIT_MIN_K=$mk python bench/bench_decode.py \
--engine gemlite:A16W4_HQQ_INT --sizes 7.2b,1.5b --batches 1,2 --steps 30 --wkv cuda --no-checks \
--out bench/results/experiment_ab_${tag}_{round}_h200.json; done' x_staged.cu
    rm -f x_staged.cu
    ;;
w4-halve)  # which 4-bit launches halve their bands (kUint4HalveBelowBlocks: launches of fewer than 448 blocks of full
    # bands, at 7.2B the output projection and FFN value, at 1.5B every layer launch) against halving every 4-bit
    # task of 2,048 columns or more (RWKV_UINT4_HALVE_BELOW_BLOCKS=1000000, as before): W4 decode at 1-8 rows (7.2B,
    # 1.5B), round 1; the 4-bit and GEMV GPU tests; round 2; the 7.2B launches alone
    build
    tuning_cache
    for round in 1 2; do
        for below in 448 1000000; do
            out=bench/results/experiment_w4_halve${below}_${round}_h200.json
            step 90 "W4 decode, halve below $below blocks, round $round" env RWKV_UINT4_HALVE_BELOW_BLOCKS=$below \
                python bench/bench_decode.py --engine gemlite:A16W4_HQQ_INT --sizes 7.2b,1.5b --batches 1,2,4,8 \
                --steps 30 --wkv cuda --no-checks --out "$out"
            copy "$out"
        done
        [ $round = 2 ] || step 150 "4-bit and GEMV GPU tests" python -m pytest -q -rf -p no:cacheprovider \
            test/test_fused_cuda.py test/test_quant_cuda.py -k "uint4 or gemv or w4 or A16W4 or invariance"
    done
    step 60 "4-bit launches alone" python bench/bench_gemv.py --size 7.2b --weights uint4 \
        --out bench/results/experiment_w4_halve448_gemv_h200.json
    copy bench/results/experiment_w4_halve448_gemv_h200.json
    # the rule's round 2 as the summary's W4 figure (bench/summarize.py reads decode_h200*), on an H200 only
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
        cp bench/results/experiment_w4_halve448_2_h200.json bench/results/decode_h200_w4_halve.json &&
            copy bench/results/decode_h200_w4_halve.json
    fi
    ;;
grid-w4)  # issue 6's decode grid on the tree (the last full one is of 2026-12-01, before most kernel work), each row
    # against the H200 limit of its shape, batch and state dtype (bench/limits.py), then the W4 figure with the
    # tree's 4-bit band rule (the w4-halve part's A/B ran on an H100 only); the W4 rows go to the summary on an H200
    build
    tuning_cache
    step 230 "decode grid" python bench/bench_decode.py --sizes 1.5b,7.2b --batches 1,8,32,64,128,256,512,1024 \
        --states fp32,fp16 --steps 20 --wkv cuda --no-checks --out bench/results/decode_h200_grid.json
    copy bench/results/decode_h200_grid.json
    step 170 "W4 decode at 1-8 rows" python bench/bench_decode.py --engine gemlite:A16W4_HQQ_INT --sizes 7.2b,1.5b \
        --batches 1,2,4,8 --steps 30 --wkv cuda --no-checks --out bench/results/decode_h200_w4_halve.json
    copy bench/results/decode_h200_w4_halve.json
    ;;
engine-256)  # Is 1.5B serving at 256 streams bound by the engine itself? The HTTP server's steps take 5.2-5.3 ms against
    # the GPU's 4.4 (forward 4.0 + sampler 0.35), and a quarter of the chunks (--stream-interval 4) did not shorten them
    # (twenty-sixth session). The engine alone (no HTTP, no event loop), 256 requests of 256 tokens, twice: its ramp
    # (last first token), steady tok/s after it, its steps' mean duration and how many ran ahead; the forward at 256
    # rows and the HTTP server at 256 streams in the same call
    build_fused
    step 120 "1.5b decode, batch 256" python bench/bench_decode.py --sizes 1.5b --batches 256 --wkv cuda --no-checks \
        --out bench/results/decode_h200_1.5b_b256_engine.json
    copy bench/results/decode_h200_1.5b_b256_engine.json
    for round in 1 2; do
        step 150 "engine 1.5B, 256 requests, round $round" python bench/bench_engine.py --device cuda --n-layer 24 \
            --n-embd 2048 --requests 1,256 --slots 256 --max-tokens 256 --graphs --decode-ahead --long-prompt 1024 \
            --out "bench/results/engine_h200_1.5b_256_$round.json"
        copy "bench/results/engine_h200_1.5b_256_$round.json"
    done
    # the HTTP server on the same machine: 256 streams of 256 tokens, the engine's and the forward's figures beside it
    step 110 "HTTP 1.5B, 256 streams" env NAME=h200_1.5b_engine256 LEVELS=256 MAX_TOKENS=256 \
        MODEL=/tmp/rwkv7-1.5b-random-fp16.pth N_LAYER=24 N_EMBD=2048 bash bench/h200_serving.sh
    copy bench/results/serving_h200_1.5b_engine256.json
    ;;
graphs-recheck)  # the graph GPU tests alone, then the sampler-capture test (it failed once after the fused tests
    # in one process, verify-fused) three times alone: order or chance?
    build_fused
    step 200 "graph GPU tests" python -m pytest -q -rf --tb=short -p no:cacheprovider test/test_graphs_cuda.py
    for i in 1 2 3; do
        step 60 "sampler capture test alone ($i)" python -m pytest -q -rf --tb=short -p no:cacheprovider \
            test/test_graphs_cuda.py -k sampler_capture_does_not_wait
    done
    ;;
check-serve)
    step 150 "fused GPU tests" python -m pytest -q -rs -p no:cacheprovider test/test_fused_cuda.py test/test_graphs_cuda.py
    step 280 "HTTP serving" env LEVELS=1,32,256 MAX_TOKENS=256 OUT= bash bench/h200_serving.sh
    copy bench/results/serving_h200_7.2b.json
    ;;
split)
    step 150 "fused GPU tests" python -m pytest -q -rs -p no:cacheprovider test/test_fused_cuda.py
    step 60 "decode, rows split" python bench/bench_decode.py --sizes 1.5b,7.2b --batches 1,8 --steps 20 --wkv cuda \
        --no-checks --out bench/results/decode_h200_split.json
    step 60 "decode, rows whole (RWKV_GEMV_SPLIT=0)" env RWKV_GEMV_SPLIT=0 python bench/bench_decode.py --sizes 1.5b,7.2b \
        --batches 1,8 --steps 20 --wkv cuda --no-checks --out bench/results/experiment_nosplit_h200.json
    step 60 "per-kernel profile, PDL off, rows split" env RWKV_PDL=0 python bench/profile_decode.py --sizes 7.2b \
        --batches 1 --out bench/results/profile_split_nopdl_h200.json
    copy bench/results/decode_h200_split.json bench/results/experiment_nosplit_h200.json \
        bench/results/profile_split_nopdl_h200.json
    ;;
gemlite-gemv)
    step 150 "GemLite int8 decode on the fused GEMV, GPU test" python -m pytest -q -rs -p no:cacheprovider \
        test/test_quant_cuda.py -k int8_decode_runs_on_the_fused_gemv
    step 130 "GemLite A16W8_INT8 decode, batch 1-2 on the fused GEMV" python bench/bench_decode.py --sizes 7.2b \
        --engine gemlite:A16W8_INT8 --batches 1,2 --steps 20 --wkv cuda --no-checks \
        --out bench/results/decode_h200_gemlite_w8_gemv.json
    copy bench/results/decode_h200_gemlite_w8_gemv.json
    ;;
hopper-w8)  # the sm_90a W8A16 build: GPU tests (the first builds it), GEMMs alone, decode against fp16
    step 300 "W8A16 GPU tests (first run builds the sm_90a extension)" python -m pytest -q -rs -p no:cacheprovider \
        test/test_quant_cuda.py -k "not gemlite"
    step 120 "W8A16 GEMMs vs cuBLAS fp16" python bench/bench_w8_gemm.py --rows 128,256,512 \
        --out bench/results/w8_gemm_h200.json
    copy bench/results/w8_gemm_h200.json
    step 200 "W8A16 decode" python bench/bench_decode.py --engine cutlass --sizes 7.2b,1.5b --batches 1,8,32,128,256,512 \
        --steps 20 --no-checks --wkv cuda --out bench/results/decode_h200_w8_fused.json
    copy bench/results/decode_h200_w8_fused.json
    step 100 "W8A16 decode, grouped GEMV up to 8 rows" env RWKV_GEMV_ROWS=8 python bench/bench_decode.py --engine cutlass \
        --sizes 7.2b --batches 2,4,8 --steps 20 --no-checks --wkv cuda --out bench/results/experiment_w8_gemv_rows8_h200.json
    copy bench/results/experiment_w8_gemv_rows8_h200.json
    ;;
hopper-gemlite)  # W8A16 GEMV vs Hopper GEMM at small batches, GemLite int8 layers on the W8A16 kernels
    step 300 "W8A16 + GemLite int8 GPU tests" python -m pytest -q -rs -p no:cacheprovider test/test_quant_cuda.py \
        -k "hopper or int8_decode or every_cutlass or kernels_match"
    step 100 "W8A16 GEMV vs GEMMs, small batches" python bench/bench_w8_gemm.py --rows 1,2,3,4,8,16,32 \
        --out bench/results/w8_gemm_small_h200.json
    copy bench/results/w8_gemm_small_h200.json
    step 120 "W8A16 decode, small batches" python bench/bench_decode.py --engine cutlass --sizes 7.2b --batches 2,3,4,8,16,32 \
        --steps 20 --no-checks --wkv cuda --out bench/results/decode_h200_w8_small.json
    copy bench/results/decode_h200_w8_small.json
    step 200 "GemLite A16W8_INT8 decode on the W8A16 kernels" python bench/bench_decode.py --engine gemlite:A16W8_INT8 \
        --sizes 7.2b --batches 1,8,32,128,256,512 --steps 20 --wkv cuda --no-checks \
        --out bench/results/decode_h200_gemlite_w8.json
    copy bench/results/decode_h200_gemlite_w8.json
    ;;
ttft)  # per-kernel time of prefill forwards (7.2B): one prompt of 1k and of 128 tokens, 16 prompts of 1k
    step 150 "prefill profile, 7.2B" python bench/profile_decode.py --sizes 7.2b --batches "" \
        --prompts 1x1024,1x128,16x1024 --out bench/results/profile_prefill_h200.json
    copy bench/results/profile_prefill_h200.json
    ;;
prefill)  # after a time-mix change: fused GPU tests, prefill profile, prefill fused vs readable (7.2B, 1.5B)
    step 240 "fused + WKV GPU tests (decode, prefill, oracle, invariance)" python -m pytest -q -rs -p no:cacheprovider \
        test/test_fused_cuda.py test/test_wkv_cuda.py -k "prefill or cpu_fp32 or greedy or invariance or decode_matches or wkv"
    step 120 "prefill profile, 7.2B" python bench/profile_decode.py --sizes 7.2b --batches "" \
        --prompts 1x1024,1x128,16x1024 --out bench/results/profile_prefill_h200.json
    copy bench/results/profile_prefill_h200.json
    step 120 "prefill, fused" python bench/bench_decode.py --sizes 7.2b,1.5b --batches "" --prefill 128,1024,4096 \
        --prefill-rows 1,4,16 --wkv cuda --no-checks --out bench/results/decode_h200_prefill.json
    copy bench/results/decode_h200_prefill.json
    step 90 "prefill, readable forward" python bench/bench_decode.py --sizes 7.2b --batches "" --prefill 128,1024,4096 \
        --prefill-rows 1 --forward readable --wkv cuda --no-checks --out bench/results/experiment_prefill_readable_h200.json
    copy bench/results/experiment_prefill_readable_h200.json
    ;;
sparse-ffn)  # the FFN value matrix K-major through the sparse-input GEMV: GPU tests, decode on/off, prefill
    step 170 "fused GPU tests (sparse GEMV, decode, greedy)" python -m pytest -q -rs -p no:cacheprovider \
        test/test_fused_cuda.py -k "sparse or decode_matches or greedy or k_major"
    step 130 "decode, sparse FFN value" python bench/bench_decode.py --sizes 7.2b,1.5b --batches 1,2,4 --steps 30 \
        --wkv cuda --no-checks --out bench/results/decode_h200_sparse_ffn.json
    copy bench/results/decode_h200_sparse_ffn.json
    step 100 "decode, dense FFN value (RWKV_SPARSE_FFN=0)" env RWKV_SPARSE_FFN=0 python bench/bench_decode.py \
        --sizes 7.2b,1.5b --batches 1,2 --steps 30 --wkv cuda --no-checks \
        --out bench/results/experiment_dense_ffn_h200.json
    copy bench/results/experiment_dense_ffn_h200.json
    step 80 "prefill with the K-major FFN value" python bench/bench_decode.py --sizes 7.2b --batches "" \
        --prefill 1024 --prefill-rows 1,16 --wkv cuda --no-checks --out bench/results/experiment_prefill_kmajor_h200.json
    copy bench/results/experiment_prefill_kmajor_h200.json
    ;;
decode-b1)  # after a small-batch GEMV change: builds (outside the test limit), GPU tests, decode, A/B, W8
    build
    step 240 "fused GPU tests (GEMV, decode, prefill, oracle, greedy, invariance, sparse)" python -m pytest -q -rs \
        -p no:cacheprovider test/test_fused_cuda.py \
        -k "(gemv or decode_matches or prefill or cpu_fp32 or greedy or invariance or sparse or k_major) and not uint4 and not gemlite"
    step 90 "decode" python bench/bench_decode.py --sizes 7.2b,1.5b --batches 1,2,4,8 --steps 30 \
        --wkv cuda --no-checks --out bench/results/decode_h200_sparse_ffn.json
    copy bench/results/decode_h200_sparse_ffn.json
    step 60 "per-kernel profile, batch 1, PDL off" env RWKV_PDL=0 python bench/profile_decode.py --sizes 1.5b,7.2b \
        --batches 1 --out bench/results/profile_nopdl_sparse_h200.json
    copy bench/results/profile_nopdl_sparse_h200.json
    step 40 "A/B: one ballot per warp in the sparse GEMV" env RWKV_SPARSE_MIN_BLOCKS=1000000 python bench/bench_decode.py \
        --sizes 7.2b,1.5b --batches 1 --steps 30 --wkv cuda --no-checks --out bench/results/experiment_sparse_ballots1_h200.json
    copy bench/results/experiment_sparse_ballots1_h200.json
    step 40 "A/B: no GEMV row splitting" env RWKV_GEMV_SPLIT=0 python bench/bench_decode.py --sizes 7.2b,1.5b \
        --batches 1 --steps 30 --wkv cuda --no-checks --out bench/results/experiment_nosplit_b1_h200.json
    copy bench/results/experiment_nosplit_b1_h200.json
    step 60 "W8A16 decode" python bench/bench_decode.py --engine cutlass --sizes 7.2b,1.5b --batches 1,2 --steps 30 \
        --wkv cuda --no-checks --out bench/results/decode_h200_w8_small_rows.json
    copy bench/results/decode_h200_w8_small_rows.json
    ;;
chunked)  # the chunked time mix for prefills of many rows: GPU tests, prefill, A/B against the per-token kernel
    build_fused
    fused_tests
    prefill_bench 1,16 decode_h200_prefill_chunked.json
    step 90 "A/B: per-token time mix for many rows (RWKV_TIME_MIX_CHUNKED=0)" env RWKV_TIME_MIX_CHUNKED=0 \
        python bench/bench_decode.py --sizes 7.2b --batches "" --prefill 1024 --prefill-rows 16 --wkv cuda --no-checks \
        --out bench/results/experiment_prefill_per_token_h200.json
    copy bench/results/experiment_prefill_per_token_h200.json
    step 90 "A/B: chunked time mix for few rows too (RWKV_PREFILL_MAX_BLOCKS=0)" env RWKV_PREFILL_MAX_BLOCKS=0 \
        python bench/bench_decode.py --sizes 7.2b --batches "" --prefill 1024 --prefill-rows 1,4 --wkv cuda --no-checks \
        --out bench/results/experiment_prefill_chunked_small_h200.json
    copy bench/results/experiment_prefill_chunked_small_h200.json
    ;;
prefill-split)  # a head's state rows over four blocks for prompts alone: GPU tests, prefill and TTFT
    build_fused
    fused_tests
    prefill_bench 1,2,4,16 decode_h200_prefill_split.json
    ;;
prefill-gaps)  # A/B of the split time mix against the 256-thread kernel; where the batched prefill's idle time is
    build_fused
    step 120 "A/B: the 256-thread kernel for prompts alone (RWKV_SPLIT_MAX_BLOCKS=0)" env RWKV_SPLIT_MAX_BLOCKS=0 \
        python bench/bench_decode.py --sizes 7.2b,1.5b --batches "" --prefill 1024 --prefill-rows 1,2,4 --wkv cuda \
        --no-checks --out bench/results/experiment_prefill_split_off_h200.json
    copy bench/results/experiment_prefill_split_off_h200.json
    step 200 "prefill profile, 7.2B (idle gaps, CUDA graph)" python bench/profile_decode.py --sizes 7.2b --batches "" \
        --prompts 1x1024,16x1024 --out bench/results/profile_prefill_split_h200.json
    copy bench/results/profile_prefill_split_h200.json
    ;;
prefill-split2)  # the split time mix with A on warps of its own: phases, GPU tests, prefill, the bound's A/B
    build_fused
    step 120 "time-mix phases, 7.2B prompt shape" python bench/experiment_time_mix_phases.py \
        --out bench/results/experiment_time_mix_phases_ws_h200.json
    copy bench/results/experiment_time_mix_phases_ws_h200.json
    fused_tests
    prefill_bench 1,16 decode_h200_prefill_split_ws.json
    step 120 "A/B: the split kernel for more rows (RWKV_SPLIT_MAX_BLOCKS=4096)" env RWKV_SPLIT_MAX_BLOCKS=4096 \
        python bench/bench_decode.py --sizes 7.2b,1.5b --batches "" --prefill 1024 --prefill-rows 2,4,8 --wkv cuda \
        --no-checks --out bench/results/experiment_prefill_split_ws_rows_h200.json
    copy bench/results/experiment_prefill_split_ws_rows_h200.json
    ;;
gemv-order)  # batch-1 GEMV launches (LoRA tasks first, split to 32,768 units): GPU tests, decode, A/B at 16,384
    build_fused
    step 100 "fused GPU tests (decode, greedy, invariance)" python -m pytest -q -rs -p no:cacheprovider \
        test/test_fused_cuda.py -k "(decode_matches or greedy or invariance or gemv_tasks) and not uint4 and not gemlite"
    step 80 "decode" python bench/bench_decode.py --sizes 7.2b,1.5b --batches 1,2,4,8 --steps 30 \
        --wkv cuda --no-checks --out bench/results/decode_h200_lora_first_split32k.json
    copy bench/results/decode_h200_lora_first_split32k.json
    step 80 "A/B: GEMV launches split to 16384 units (RWKV_GEMV_SPLIT_ROWS=16384)" env RWKV_GEMV_SPLIT_ROWS=16384 \
        python bench/bench_decode.py --sizes 7.2b,1.5b --batches 1,2,4,8 --steps 30 --wkv cuda --no-checks \
        --out bench/results/experiment_lora_first_split16k_h200.json
    copy bench/results/experiment_lora_first_split16k_h200.json
    step 40 "GEMV launches alone" python bench/bench_gemv.py --size 7.2b --out bench/results/gemv_h200_split_rows_32k.json
    copy bench/results/gemv_h200_split_rows_32k.json
    ;;
split-parts)  # the split time mix on 2 blocks per head where that fills the multiprocessors once: layouts, tests, prefill
    build_fused
    time_mix_layouts parts
    fused_tests
    prefill_bench 1,2,4,16 decode_h200_prefill_split_parts.json
    step 120 "prefill profile, 7.2B, one 1k prompt" python bench/profile_decode.py --sizes 7.2b --batches "" \
        --prompts 1x1024 --out bench/results/profile_prefill_split_parts_h200.json
    copy bench/results/profile_prefill_split_parts_h200.json
    ;;
tail)  # prefill reads out each row's last token only: fused GPU tests, prefill, TTFT three more times
    build_fused
    fused_tests
    prefill_bench 1,16 decode_h200_prefill_tail.json
    for run in 1 2 3; do
        step 60 "TTFT repeat $run" python bench/bench_decode.py --sizes 7.2b --batches "" --prefill 1024 \
            --prefill-rows 1 --wkv cuda --no-checks --out "bench/results/ttft_tail_repeat_$run.json"
        copy "bench/results/ttft_tail_repeat_$run.json"
    done
    ;;
streams)  # decode batches of 128-512 as 2 or 4 parts on their own streams in one graph, against one forward
    build_fused
    step 400 "decode in parts on separate streams" python bench/experiment_split_streams.py --sizes 7.2b,1.5b \
        --batches 128,256,512 --parts 2,4 --out bench/results/experiment_split_streams_h200.json
    copy bench/results/experiment_split_streams_h200.json
    ;;
blas-algos)  # does cuBLAS's heuristic pick the best kernel it has for the batch-256/512 GEMMs? (no build: ctypes)
    out=bench/results/experiment_blas_algos_h200.json
    step 500 "decode GEMMs: torch against cuBLASLt's algorithms" python bench/experiment_blas_algos.py \
        --sizes 7.2b,1.5b --rows 256,512,128,1024 --out $out
    copy $out
    ;;
blas-ab)  # the whole 7.2B step at 256/512 rows (fp16 state) as the tree runs it, with cuBLASLt preferred for torch's
    # GEMMs (its one heuristic choice), then the tree again (the machine's noise). (Its first run also timed the
    # residual products as a product then an add, RWKV_RESIDUAL_ADDMM=0: slower, removed; experiment_blas_ab_residual_h100.json.)
    build_fused
    blas_decode tree
    blas_decode lt TORCH_BLAS_PREFER_CUBLASLT=1
    blas_decode tree2
    ;;
gemlite-8bit)  # GemLite 8-bit layers read pre-scaled: the range experiment, GPU tests, engines on the trained model
    tuning_cache
    build
    step 200 "GemLite 8-bit layers against growing activations" python bench/experiment_gemlite_fp8_range.py \
        --out bench/results/experiment_gemlite_fp8_range_h200.json
    copy bench/results/experiment_gemlite_fp8_range_h200.json
    # (the first run ran out of 120 and 200 s here, GemLite tuning; its accuracy step is done:
    # quant_accuracy_trained_prescaled_h200.json)
    step 360 "GemLite 8-bit GPU tests" python -m pytest -q -rf --tb=short -p no:cacheprovider test/test_quant_cuda.py \
        -k "gemlite and (8bit or int8 or export)"
    ;;
w4-cublas)  # 4-bit GemLite layers above 64 rows as fp16 chunks for cuBLAS: GPU tests, decode and prefill A/B
    tuning_cache
    build_fused
    step 200 "4-bit GPU tests" python -m pytest -q -rf --tb=short -p no:cacheprovider test/test_fused_cuda.py -k uint4
    step 150 "W4 decode and prefill, 4-bit layers on cuBLAS above 64 rows" env RWKV_UINT4_CUBLAS_ROWS=64 python bench/bench_decode.py \
        --engine gemlite:A16W4_HQQ_INT --sizes 7.2b --batches 1,64,128,256 --prefill 1024 --prefill-rows 1,16 \
        --steps 20 --wkv cuda --no-checks --out bench/results/experiment_w4_cublas_above64_h200.json
    copy bench/results/experiment_w4_cublas_above64_h200.json
    step 150 "A/B: GemLite's own kernels at every batch (RWKV_UINT4_CUBLAS_ROWS=1000000)" \
        env RWKV_UINT4_CUBLAS_ROWS=1000000 python bench/bench_decode.py --engine gemlite:A16W4_HQQ_INT --sizes 7.2b \
        --batches 64,128,256 --prefill 1024 --prefill-rows 1,16 --steps 20 --wkv cuda --no-checks \
        --out bench/results/experiment_w4_gemlite_gemm_h200.json
    copy bench/results/experiment_w4_gemlite_gemm_h200.json
    ;;
w4-gemm)  # 4-bit GemLite layers on GemLite's GEMM at every size: the test that caught split-K's NaN x3, then decode
    # at 9-64 rows against GemLite's own choice (split-K below 64 rows)
    tuning_cache
    build_fused
    for run in 1 2 3; do
        step 150 "4-bit decode on the fused GEMV against GemLite's GEMM, run $run" python -m pytest -q -rf --tb=short \
            -p no:cacheprovider test/test_fused_cuda.py -k gemlite_uint4_decode_runs_on_the_fused_gemv
    done
    step 150 "W4 decode, GemLite's GEMM at 16-64 rows" python bench/bench_decode.py --engine gemlite:A16W4_HQQ_INT \
        --sizes 7.2b --batches 16,32,64 --steps 20 --wkv cuda --no-checks --out bench/results/decode_h200_w4_gemm_only.json
    copy bench/results/decode_h200_w4_gemm_only.json
    step 150 "A/B: GemLite's own choice (RWKV_W4_GEMM_ONLY=0)" env RWKV_W4_GEMM_ONLY=0 python bench/bench_decode.py \
        --engine gemlite:A16W4_HQQ_INT --sizes 7.2b --batches 16,32,64 --steps 20 --wkv cuda --no-checks \
        --out bench/results/experiment_w4_splitk_h200.json
    copy bench/results/experiment_w4_splitk_h200.json
    ;;
ln-span)  # prompts' ln_shift_mix on 4 tokens a block: fused GPU tests, prefill, A/B against per token, profile
    build_fused
    fused_tests
    prefill_bench 1,16 decode_h200_prefill_ln_span.json
    step 200 "A/B: ln_shift_mix per token (RWKV_LN_SPAN=0)" env RWKV_LN_SPAN=0 python bench/bench_decode.py \
        --sizes 7.2b,1.5b --batches "" --prefill 1024,4096 --prefill-rows 1,16 --wkv cuda --no-checks \
        --out bench/results/experiment_ln_per_token_h200.json
    copy bench/results/experiment_ln_per_token_h200.json
    step 150 "prefill profile, 7.2B, 1 and 16 prompts of 1k" python bench/profile_decode.py --sizes 7.2b --batches "" \
        --prompts 1x1024,16x1024 --out bench/results/profile_prefill_ln_span_h200.json
    copy bench/results/profile_prefill_ln_span_h200.json
    ;;
b1-bounds)  # where the W8A16 and 4-bit batch-1 steps' time goes (PDL off, as profile_nopdl_sparse_h200.json for
    # fp16), then the 7.2B prompt figures (TTFT three times, 16 rows) on the final code
    tuning_cache
    build
    step 150 "fused GPU tests of a 4,096-wide model's prompts (the span kernel)" python -m pytest -q -rf --tb=short \
        -p no:cacheprovider test/test_fused_cuda.py -k wide_model
    step 120 "per-kernel profile, 7.2B W8A16, batch 1, PDL off" env RWKV_PDL=0 python bench/profile_decode.py \
        --engine cutlass --sizes 7.2b --batches 1 --out bench/results/profile_nopdl_w8_h200.json
    copy bench/results/profile_nopdl_w8_h200.json
    step 90 "per-kernel profile, 7.2B fp16, batch 1, PDL off (this machine's reference)" env RWKV_PDL=0 \
        python bench/profile_decode.py --sizes 7.2b --batches 1 --out bench/results/profile_nopdl_fp16_b1_h200.json
    copy bench/results/profile_nopdl_fp16_b1_h200.json
    step 200 "per-kernel profile, 7.2B A16W4, batch 1, PDL off" env RWKV_PDL=0 python bench/profile_decode.py \
        --engine gemlite:A16W4_HQQ_INT --sizes 7.2b --batches 1 --out bench/results/profile_nopdl_w4_h200.json
    copy bench/results/profile_nopdl_w4_h200.json
    step 120 "prefill, 7.2B" python bench/bench_decode.py --sizes 7.2b --batches "" --prefill 1024,4096 \
        --prefill-rows 1,16 --wkv cuda --no-checks --out bench/results/decode_h200_prefill_final.json
    copy bench/results/decode_h200_prefill_final.json
    for run in 1 2 3; do
        ttft 60 "TTFT repeat $run" "ttft_final_repeat_$run.json"
    done
    ;;
tc)  # many-row prompts' time mix on the tensor cores (the default since it ran; RWKV_TIME_MIX_TC=1 kept for when it
    # was not) against the CUDA-core chunked kernel: prefill A/B first, then the fused GPU tests with it, its profile
    build_fused
    step 120 "prefill, tensor-core time mix" env RWKV_TIME_MIX_TC=1 python bench/bench_decode.py --sizes 7.2b,1.5b \
        --batches "" --prefill 1024,4096 --prefill-rows 16 --wkv cuda --no-checks \
        --out bench/results/experiment_time_mix_tc_h200.json
    copy bench/results/experiment_time_mix_tc_h200.json
    step 120 "A/B: the chunked kernel on the CUDA cores" env RWKV_TIME_MIX_TC=0 python bench/bench_decode.py \
        --sizes 7.2b,1.5b --batches "" --prefill 1024,4096 --prefill-rows 16 --wkv cuda --no-checks \
        --out bench/results/experiment_time_mix_chunked_ab_h200.json
    copy bench/results/experiment_time_mix_chunked_ab_h200.json
    step 150 "fused GPU tests, tensor-core time mix" env RWKV_TIME_MIX_TC=1 python -m pytest -q -rf --tb=short \
        -p no:cacheprovider test/test_fused_cuda.py \
        -k "(prefill or cpu_fp32 or greedy or invariance) and not uint4 and not gemlite"
    step 90 "prefill profile, 7.2B 16 x 1k, tensor-core time mix" env RWKV_TIME_MIX_TC=1 python bench/profile_decode.py \
        --sizes 7.2b --batches "" --prompts 16x1024 --out bench/results/profile_prefill_tc_h200.json
    copy bench/results/profile_prefill_tc_h200.json
    ;;
int8-band)  # int8 GEMV tasks on the tensor cores (gemv_int8_band; RWKV_GEMV_INT8_TC=0: the per-thread code): W8A16
    # decode first, its A/B, the GPU tests, up to 8 rows on the GEMV, the batch-1 profile, then TTFT once more
    tuning_cache
    build
    w8_decode 90 "W8A16 decode, int8 on the tensor cores" 7.2b,1.5b 1,2,4,8 decode_h200_w8_int8_band.json
    w8_decode 60 "A/B: per-thread int8" 7.2b 1,2 experiment_w8_int8_per_thread_h200.json RWKV_GEMV_INT8_TC=0
    int8_tests
    w8_decode 60 "W8A16 decode, up to 8 rows on the GEMV" 7.2b 4,8 experiment_w8_gemv_rows8_h200.json RWKV_GEMV_ROWS=8
    step 90 "per-kernel profile, 7.2B W8A16, batch 1, PDL off" env RWKV_PDL=0 python bench/profile_decode.py \
        --engine cutlass --sizes 7.2b --batches 1 --out bench/results/profile_nopdl_w8_band_h200.json
    copy bench/results/profile_nopdl_w8_band_h200.json
    ttft 40 "TTFT, 7.2B 1 x 1,024" ttft_int8_band_call.json
    ;;
int8-sums)  # the int8 bands' sums promoted out of the tensor cores per vector (default) against the mma accumulators
    # only (RWKV_GEMV_INT8_TC=2) and the per-thread code (0): rounding against the exact product, W8A16 decode with
    # int8 models on the GEMV up to 8 rows, the GPU tests, the batch-1 profile
    tuning_cache
    build
    step 120 "int8 GEMV rounding per way of summing" python bench/experiment_gemv_int8_error.py \
        --out bench/results/experiment_gemv_int8_error_h200.json
    copy bench/results/experiment_gemv_int8_error_h200.json
    w8_decode 90 "W8A16 decode (int8 GEMV up to 8 rows)" 7.2b,1.5b 1,2,4,8 decode_h200_w8_int8_sums.json
    w8_decode 60 "A/B: mma accumulators only" 7.2b 1,2,8 experiment_w8_int8_mma_sums_h200.json RWKV_GEMV_INT8_TC=2
    int8_tests
    step 60 "per-kernel profile, 7.2B W8A16, batch 1, PDL off" env RWKV_PDL=0 python bench/profile_decode.py \
        --engine cutlass --sizes 7.2b --batches 1 --out bench/results/profile_nopdl_w8_sums_h200.json
    copy bench/results/profile_nopdl_w8_sums_h200.json
    ;;
int8-final)  # the int8 bands as merged: W8A16 decode and its A/B against the per-thread int8 code in one call, the
    # fused, graph and W8A16/GemLite-int8 GPU tests, TTFT once more
    tuning_cache
    build
    w8_decode 60 "W8A16 decode" 7.2b,1.5b 1,2,4,8 decode_h200_w8_int8_final.json
    w8_decode 40 "A/B: per-thread int8" 7.2b 1,2 experiment_w8_int8_per_thread_final_h200.json RWKV_GEMV_INT8_TC=0
    step 200 "fused, graph, W8A16 and GemLite int8 GPU tests" python -m pytest -q -rf --tb=short -p no:cacheprovider \
        test/test_fused_cuda.py test/test_graphs_cuda.py test/test_quant_cuda.py -k "not uint4 and (not gemlite or gemlite_int8)"
    ttft 40 "TTFT, 7.2B 1 x 1,024" decode_h200_ttft_twelfth.json
    ;;
int8-profile)  # where the W8A16 batch-1 step goes with the int8 bands and with the per-thread int8 code, one machine
    build
    step 60 "per-kernel profile, 7.2B W8A16, batch 1, PDL off, int8 bands" env RWKV_PDL=0 python bench/profile_decode.py \
        --engine cutlass --sizes 7.2b --batches 1,2 --out bench/results/profile_nopdl_w8_bands_h200.json
    copy bench/results/profile_nopdl_w8_bands_h200.json
    step 60 "the same, per-thread int8" env RWKV_PDL=0 RWKV_GEMV_INT8_TC=0 python bench/profile_decode.py \
        --engine cutlass --sizes 7.2b --batches 1,2 --out bench/results/profile_nopdl_w8_per_thread_h200.json
    copy bench/results/profile_nopdl_w8_per_thread_h200.json
    ;;
warps16)  # every GEMV launch on 16 warps a block (a build of its own: sed on this copy) against 8: launches alone at
    # one row (7.2B, 1.5B), W8A16 and fp16 decode
    build
    for warps in 8 16; do
        if [ $warps = 16 ]; then
            cp cuda/rwkv7_fused.cu /tmp/rwkv7_fused_8warps.cu
            sed -i 's/^constexpr int kGemvWarps = 8;/constexpr int kGemvWarps = 16;/' cuda/rwkv7_fused.cu
            build_fused
        fi
        for w in int8 uint4; do
            for size in 7.2b 1.5b; do
                out=bench/results/experiment_gemv_${w}_warps${warps}$([ $size = 1.5b ] && echo _1.5b)_h200.json
                step 40 "$w launches alone, $size, 1 row, $warps warps" python bench/bench_gemv.py --size $size --weights $w \
                    --only "rkv+lora (forward),output,ffn key,ffn value" --out "$out"
                copy "$out"
            done
        done
        w8_decode 40 "W8A16 decode, $warps warps" 7.2b,1.5b 1,2 experiment_w8_warps${warps}_h200.json
        step 40 "fp16 decode, batch 1, $warps warps" python bench/bench_decode.py --sizes 7.2b,1.5b --batches 1 --steps 30 \
            --wkv cuda --no-checks --out bench/results/experiment_warps${warps}_fp16_h200.json
        copy bench/results/experiment_warps${warps}_fp16_h200.json
    done
    cp /tmp/rwkv7_fused_8warps.cu cuda/rwkv7_fused.cu
    ;;
wide)  # launches of few bands on 16 warps a block (gemv_wide_band_kernel; RWKV_GEMV_WIDE_BANDS=0: all on gemv_kernel):
    # GPU tests, W8A16 and GemLite A16W4 decode A/B, launches alone; the results come back as one archive
    tuning_cache
    build
    int8_tests
    step 100 "fused 4-bit GEMV GPU tests (GemLite's layers)" python -m pytest -q -rf --tb=short -p no:cacheprovider \
        test/test_fused_cuda.py -k "gemv_uint4"
    results=()
    for mode in wide narrow; do
        vars=(); [ $mode = narrow ] && vars=(RWKV_GEMV_WIDE_BANDS=0)
        w8_decode 40 "W8A16 decode, $mode" 7.2b,1.5b 1,2,8 experiment_w8_${mode}_h200.json "${vars[@]}"
        step 60 "GemLite A16W4_HQQ_INT decode, $mode" env "${vars[@]}" python bench/bench_decode.py \
            --engine gemlite:A16W4_HQQ_INT --sizes 7.2b,1.5b --batches 1,2,8 --steps 30 --wkv cuda --no-checks \
            --out bench/results/experiment_w4_${mode}_h200.json
        results+=("bench/results/experiment_w8_${mode}_h200.json" "bench/results/experiment_w4_${mode}_h200.json")
    done
    for mode in wide narrow; do
        vars=(); [ $mode = narrow ] && vars=(RWKV_GEMV_WIDE_BANDS=0)
        for w in int8 uint4; do
            out=bench/results/experiment_gemv_${w}_${mode}_h200.json
            step 30 "$w launches alone, 7.2b, 1 row, $mode" env "${vars[@]}" python bench/bench_gemv.py --weights $w \
                --only "output,ffn value" --steps 10 --out $out
            results+=("$out")
        done
        out=bench/results/experiment_gemv_int8_${mode}_2rows_h200.json
        step 30 "int8 launches alone, 7.2b, 2 rows, $mode" env "${vars[@]}" python bench/bench_gemv.py --weights int8 \
            --rows 2 --only "output,ffn value" --steps 10 --out $out
        results+=("$out")
    done
    [ -n "$OUT" ] && tar czf "$OUT/wide_results.tgz" "${results[@]}"
    ;;
engines-b1)  # after the wide bands: GemLite A16W8_INT8 decode (its int8 matrices on the same bands), fp16 decode and
    # TTFT beside it (one machine), archived into one file
    tuning_cache
    build
    step 150 "GemLite A16W8_INT8 decode" python bench/bench_decode.py --engine gemlite:A16W8_INT8 --sizes 7.2b,1.5b \
        --batches 1,2,8 --steps 30 --wkv cuda --no-checks --out bench/results/decode_h200_gemlite_w8_wide.json
    step 40 "fp16 decode, batch 1" python bench/bench_decode.py --sizes 7.2b,1.5b --batches 1 --steps 30 --wkv cuda \
        --no-checks --out bench/results/decode_h200_fp16_b1_thirteenth.json
    ttft 40 "TTFT, 7.2B 1 x 1,024" decode_h200_ttft_thirteenth.json
    [ -n "$OUT" ] && tar czf "$OUT/engines_b1.tgz" bench/results/decode_h200_gemlite_w8_wide.json \
        bench/results/decode_h200_fp16_b1_thirteenth.json bench/results/decode_h200_ttft_thirteenth.json
    ;;
trained-accuracy)  # every engine on the tiny trained model (greedy agreement), then the intermittent 4-bit test
    tuning_cache
    build
    trained_accuracy quant_accuracy_trained_h200.json
    for run in 1 2 3; do
        step 100 "4-bit decode on the fused GEMV against GemLite, run $run" python -m pytest -q -rf --tb=short \
            -p no:cacheprovider test/test_fused_cuda.py -k gemlite_uint4_decode_runs_on_the_fused_gemv
    done
    ;;
w4-gemv)  # GemLite A16W4 on the fused GEMV's 4-bit tasks: GPU tests, then decode at batch 1-8
    tuning_cache
    step 300 "fused 4-bit GEMV GPU tests" python -m pytest -q -rs -p no:cacheprovider test/test_fused_cuda.py \
        test/test_quant_cuda.py -k "uint4 or gemlite"
    step 150 "GemLite A16W4_HQQ_INT decode on the fused GEMV" python bench/bench_decode.py --engine gemlite:A16W4_HQQ_INT \
        --sizes 7.2b,1.5b --batches 1,2,4,8 --steps 20 --wkv cuda --no-checks --out bench/results/decode_h200_gemlite_w4_gemv.json
    copy bench/results/decode_h200_gemlite_w4_gemv.json
    ;;
batched)
    step 150 "fused and graph GPU tests" python -m pytest -q -rs -p no:cacheprovider test/test_fused_cuda.py \
        test/test_graphs_cuda.py
    step 150 "decode" python bench/bench_decode.py --sizes 1.5b,7.2b --batches 1,64,256,512 --states fp32,fp16 \
        --steps 20 --wkv cuda --no-checks --out bench/results/decode_h200_fused.json
    copy bench/results/decode_h200_fused.json
    step 90 "per-kernel profile, PDL off, with the launch order" env RWKV_PDL=0 python bench/profile_decode.py \
        --sizes 1.5b,7.2b --batches 1,256 --out bench/results/profile_nopdl_h200.json
    copy bench/results/profile_nopdl_h200.json
    step 70 "prefill" python bench/bench_decode.py --sizes 7.2b --batches "" --prefill 128,1024 --prefill-rows 1,16 \
        --wkv cuda --no-checks --out bench/results/decode_h200_prefill.json
    copy bench/results/decode_h200_prefill.json
    ;;
gemlite|gemlite2)  # GemLite tunes its Triton kernels on first use: keep the compiled kernels and the tuning
    tuning_cache
    if [ "$PART" = gemlite ]; then
        step 240 "GemLite GPU tests" python -m pytest -q -rs -p no:cacheprovider test/test_quant_cuda.py -k gemlite
        step 300 "GemLite A16W8_INT8 decode" python bench/bench_decode.py --engine gemlite:A16W8_INT8 --sizes 7.2b \
            --batches 1,8,32,128,256 --steps 20 --wkv cuda --no-checks --out bench/results/decode_h200_gemlite_w8.json
        copy bench/results/decode_h200_gemlite_w8.json
    else
        step 280 "GemLite A16W4_HQQ_INT decode" python bench/bench_decode.py --engine gemlite:A16W4_HQQ_INT \
            --sizes 7.2b --batches 1,8,32,128,256 --steps 20 --wkv cuda --no-checks \
            --out bench/results/decode_h200_gemlite_w4.json
        copy bench/results/decode_h200_gemlite_w4.json
        step 280 "engine accuracy, 1.5B shape" python bench/quant_accuracy.py --engines \
            cutlass,gemlite:A16W8_INT8,gemlite:A16W8_FP8,gemlite:A16W4_HQQ_INT --n-layer 24 --n-embd 2048 \
            --out bench/results/quant_accuracy_h200.json
        copy bench/results/quant_accuracy_h200.json
    fi
    ;;
w4-hopper)  # GemLite A16W4 layers on the 4-bit Hopper GEMM above 8 rows: build, GPU tests, the GEMMs alone, W4 decode
    # and prompts with fp16 beside them (one machine); the results are archived after each step (a call cut short
    # still brings back what was done)
    tuning_cache
    build
    results=()
    archive() { [ -n "$OUT" ] && [ ${#results[@]} -gt 0 ] && tar czf "$OUT/w4_hopper.tgz" "${results[@]}" 2>/dev/null; true; }
    step 200 "4-bit GPU tests (Hopper GEMM, fused GEMV, GemLite)" python -m pytest -q -rf --tb=short \
        -p no:cacheprovider test/test_quant_cuda.py test/test_fused_cuda.py -k "w4 or uint4"
    step 120 "4-bit GEMMs alone, 7.2B shapes" python bench/bench_w8_gemm.py --weights uint4 --rows 16,64,128,256,1024 \
        --reps 20 --out bench/results/w4_gemm_h200.json
    results+=(bench/results/w4_gemm_h200.json); archive
    step 150 "W4 decode and prompts on the Hopper GEMM" python bench/bench_decode.py --engine gemlite:A16W4_HQQ_INT \
        --sizes 7.2b --batches 16,64,128,256 --prefill 1024 --prefill-rows 1,16 --steps 20 --wkv cuda --no-checks \
        --out bench/results/decode_h200_w4_hopper.json
    results+=(bench/results/decode_h200_w4_hopper.json); archive
    step 120 "fp16 decode and prompts beside it" python bench/bench_decode.py --sizes 7.2b --batches 16,64,128,256 \
        --prefill 1024 --prefill-rows 1,16 --steps 20 --wkv cuda --no-checks \
        --out bench/results/experiment_fp16_beside_w4_h200.json
    results+=(bench/results/experiment_fp16_beside_w4_h200.json); archive
    ;;
w4-prompts)  # after the Hopper GEMMs' tile order changed (channels first): their GPU tests, W4 and W8 prompts (the
    # tables are printed: this part's results come back in the log)
    tuning_cache
    build
    step 150 "Hopper GEMM GPU tests (int8 and 4-bit)" python -m pytest -q -rf --tb=short -p no:cacheprovider \
        test/test_quant_cuda.py -k "w4_hopper or every_cutlass or hopper_uses"
    for engine in gemlite:A16W4_HQQ_INT cutlass; do
        step 100 "$engine prompts" python bench/bench_decode.py --engine $engine --sizes 7.2b --batches "" \
            --prefill 1024 --prefill-rows 1,16 --wkv cuda --no-checks --out "bench/results/decode_h200_prompts_${engine%%:*}.json"
        cat "bench/results/decode_h200_prompts_${engine%%:*}.json"
    done
    ;;
w4-split)  # split K for the 4-bit Hopper GEMM (few output tiles, long K): build, 4-bit GPU tests, the GEMMs alone
    # (7.2B and 1.5B shapes, 2 and 4 slices), W4 decode and prompts with and without it, fp16 beside them (one machine;
    # every table is printed, so the log alone carries the results)
    tuning_cache
    build
    step 200 "4-bit GPU tests (Hopper GEMM and split K, fused GEMV, GemLite)" python -m pytest -q -rf --tb=short \
        -p no:cacheprovider test/test_quant_cuda.py test/test_fused_cuda.py -k "w4 or uint4"
    for size in 7.2b 1.5b; do
        step 120 "4-bit GEMMs alone, $size shapes" python bench/bench_w8_gemm.py --weights uint4 --size $size \
            --rows 16,64,128,256,512,1024 --reps 20 --no-tiles --out bench/results/w4_gemm_split_${size}_h200.json
    done
    for split in 1 0; do
        out=bench/results/decode_h200_w4_split.json
        [ $split = 0 ] && out=bench/results/experiment_w4_no_split_h200.json  # the A/B's off side
        step 150 "W4 decode and prompts, split K $split" env RWKV_W4_SPLIT_K=$split python bench/bench_decode.py \
            --engine gemlite:A16W4_HQQ_INT --sizes 7.2b,1.5b --batches 16,64,128,256,512 --prefill 1024 \
            --prefill-rows 1,16 --steps 20 --wkv cuda --no-checks --out $out
    done
    step 120 "fp16 decode and prompts beside them" python bench/bench_decode.py --sizes 7.2b,1.5b \
        --batches 16,64,128,256,512 --prefill 1024 --prefill-rows 1,16 --steps 20 --wkv cuda --no-checks \
        --out bench/results/experiment_fp16_beside_w4_split_h200.json
    results=(bench/results/w4_gemm_split_7.2b_h200.json bench/results/w4_gemm_split_1.5b_h200.json
             bench/results/decode_h200_w4_split.json bench/results/experiment_w4_no_split_h200.json
             bench/results/experiment_fp16_beside_w4_split_h200.json)
    [ -n "$OUT" ] && tar czf "$OUT/w4_split.tgz" "${results[@]}" 2>/dev/null
    python bench/brief.py "${results[@]}"
    ;;
quant-batched)  # quantized engines above the GEMV's rows with their LoRA factors stacked (RWKV_STACK_LORA) and the
    # 4-bit split rule as measured: build, the quantized GPU tests, W4 and W8 decode with and without the stacking,
    # fp16 beside them (every table printed)
    tuning_cache
    build
    step 240 "quantized GPU tests (4-bit, split K, W8A16 model, int8 GEMV)" python -m pytest -q -rf --tb=short \
        -p no:cacheprovider test/test_quant_cuda.py test/test_fused_cuda.py \
        -k "w4 or uint4 or w8a16 or every_cutlass or hopper_uses or graph"
    results=()
    for engine in gemlite:A16W4_HQQ_INT cutlass; do
        for stack in 1 0; do
            out=bench/results/decode_h200_${engine%%:*}_stacked_lora.json
            # the A/B's off side is an experiment (bench/summarize.py takes headline figures from decode_h200*)
            [ $stack = 0 ] && out=bench/results/experiment_${engine%%:*}_unstacked_lora_h200.json
            step 150 "$engine decode, stacked LoRAs $stack" env RWKV_STACK_LORA=$stack python bench/bench_decode.py \
                --engine $engine --sizes 7.2b,1.5b --batches 16,64,128,256,512 --prefill 1024 --prefill-rows 1,16 \
                --steps 20 --wkv cuda --no-checks --out $out
            results+=($out)
        done
    done
    step 120 "fp16 decode and prompts beside them" python bench/bench_decode.py --sizes 7.2b,1.5b \
        --batches 16,64,128,256,512 --prefill 1024 --prefill-rows 1,16 --steps 20 --wkv cuda --no-checks \
        --out bench/results/experiment_fp16_beside_quant_batched_h200.json
    results+=(bench/results/experiment_fp16_beside_quant_batched_h200.json)
    [ -n "$OUT" ] && tar czf "$OUT/quant_batched.tgz" "${results[@]}" 2>/dev/null
    python bench/brief.py "${results[@]}"
    ;;
w4-split-rule)  # which 4-bit matrices split K: the GEMMs alone replayed from CUDA graphs (eagerly the ~20 us ones
    # measured the host's launch path), W4 decode with slices of at least 2,048 (7.2B r/k/v/output split too) and
    # of 4,096, fp16 decode beside them (every table printed)
    build
    results=()
    for size in 7.2b 1.5b; do
        out=bench/results/w4_gemm_split_graph_${size}_h200.json
        step 120 "4-bit GEMMs in CUDA graphs, $size shapes" python bench/bench_w8_gemm.py --weights uint4 --size $size \
            --rows 16,64,128,256,512 --reps 20 --no-tiles --graph --out $out
        results+=($out)
    done
    for min_k in 2048 4096; do
        out=bench/results/experiment_w4_split_min${min_k}_h200.json
        step 150 "W4 decode, slices of >= $min_k" env RWKV_W4_SPLIT_MIN_K=$min_k python bench/bench_decode.py \
            --engine gemlite:A16W4_HQQ_INT --sizes 7.2b,1.5b --batches 16,64,128,256,512 --steps 20 --wkv cuda \
            --no-checks --out $out
        results+=($out)
    done
    out=bench/results/experiment_fp16_beside_w4_split_rule_h200.json
    step 120 "fp16 decode beside them" python bench/bench_decode.py --sizes 7.2b,1.5b --batches 16,64,128,256,512 \
        --steps 20 --wkv cuda --no-checks --out $out
    results+=($out)
    [ -n "$OUT" ] && tar czf "$OUT/w4_split_rule.tgz" "${results[@]}" 2>/dev/null
    python bench/brief.py "${results[@]}"
    ;;
w4-split-1.5b)  # the 1.5B r/k/v/output matrices in two slices of 1,024 (RWKV_W4_SPLIT_MIN_K=1024; 11.9-12.6 -> 9.4-10.9
    # us alone up to 128 rows in CUDA graphs) against the default slices of >= 2,048, 1.5B W4 decode, fp16 beside
    build
    results=()
    for min_k in 1024 2048; do
        out=bench/results/experiment_w4_split_min${min_k}_1.5b_h200.json
        step 60 "1.5B W4 decode, slices of >= $min_k" env RWKV_W4_SPLIT_MIN_K=$min_k python bench/bench_decode.py \
            --engine gemlite:A16W4_HQQ_INT --sizes 1.5b --batches 16,64,128,256,512 --steps 20 --wkv cuda --no-checks \
            --out $out
        results+=($out)
    done
    out=bench/results/experiment_fp16_beside_w4_split_1.5b_h200.json
    step 60 "1.5B fp16 decode beside them" python bench/bench_decode.py --sizes 1.5b --batches 16,64,128,256,512 \
        --steps 20 --wkv cuda --no-checks --out $out
    results+=($out)
    [ -n "$OUT" ] && tar czf "$OUT/w4_split_1.5b.tgz" "${results[@]}" 2>/dev/null
    python bench/brief.py "${results[@]}"
    ;;
large-batch)  # where the batch-256/512 targets (fp16 state, performance-limits.md S2) stand, and where the step goes
    build_fused
    results=()
    out=bench/results/decode_h200_large_batch.json
    step 200 "fp16 decode, fp32 and fp16 state" python bench/bench_decode.py --sizes 7.2b,1.5b --batches 128,256,512 \
        --states fp32,fp16 --steps 20 --wkv cuda --no-checks --out $out
    results+=($out)
    out=bench/results/profile_b256_fp16_state_h200.json
    profile_b256_fp16 $out
    results+=($out)
    [ -n "$OUT" ] && tar czf "$OUT/large_batch.tgz" "${results[@]}" 2>/dev/null
    python bench/brief.py "${results[0]}"
    ;;
w8-split)  # split K for the int8 Hopper GEMM: build, the Hopper GEMM GPU tests, W8A16 decode with it (and 1.5B
    # without it), fp16 beside
    build
    step 200 "Hopper GEMM GPU tests (int8 and 4-bit, split K)" python -m pytest -q -rf --tb=short -p no:cacheprovider \
        test/test_quant_cuda.py test/test_fused_cuda.py -k "split or w8a16 or every_cutlass or hopper_uses or w4_hopper"
    results=()
    out=bench/results/decode_h200_w8_split.json
    step 150 "W8A16 decode, split K" python bench/bench_decode.py --engine cutlass \
        --sizes 7.2b,1.5b --batches 64,128,256 --steps 20 --wkv cuda --no-checks --out $out
    results+=($out)
    out=bench/results/experiment_w8_no_split_h200.json  # the A/B's off side
    step 100 "W8A16 decode, no split K" env RWKV_W8_SPLIT_K=0 python bench/bench_decode.py --engine cutlass \
        --sizes 1.5b --batches 64,128,256 --steps 20 --wkv cuda --no-checks --out $out
    results+=($out)
    out=bench/results/experiment_fp16_beside_w8_split_h200.json
    step 120 "fp16 decode beside them" python bench/bench_decode.py --sizes 7.2b,1.5b --batches 64,128,256 \
        --steps 20 --wkv cuda --no-checks --out $out
    results+=($out)
    [ -n "$OUT" ] && tar czf "$OUT/w8_split.tgz" "${results[@]}" 2>/dev/null
    python bench/brief.py "${results[@]}"
    ;;
time-mix-pipelined)  # time_mix_pipelined_kernel: GPU tests (bit-exact, fused, WKV, graphs), fp16-state decode with and
    # without it, 7.2B batch-256 profile
    build_fused
    step 200 "GPU tests (pipelined time mix, fused, WKV kernels, graphs)" python -m pytest -q -rf --tb=short \
        -p no:cacheprovider test/test_fused_cuda.py test/test_wkv_cuda.py test/test_graphs_cuda.py \
        -k "not uint4 and not gemlite and not w4 and not w8a16 and not int8"
    results=()
    out=bench/results/decode_h200_time_mix_pipelined_rows.json
    step 150 "decode, pipelined time mix" python bench/bench_decode.py --sizes 7.2b,1.5b --batches 128,256,512 \
        --states fp16 --steps 20 --wkv cuda --no-checks --out $out
    results+=($out)
    out=bench/results/experiment_time_mix_per_row_rows_h200.json  # the A/B's off side
    step 150 "decode, per-row time mix" env RWKV_TIME_MIX_PIPELINED=0 python bench/bench_decode.py --sizes 7.2b,1.5b \
        --batches 128,256,512 --states fp16 --steps 20 --wkv cuda --no-checks --out $out
    results+=($out)
    out=bench/results/profile_b256_fp16_state_pipelined_rows_h200.json
    profile_b256_fp16 $out
    results+=($out)
    [ -n "$OUT" ] && tar czf "$OUT/time_mix_pipelined.tgz" "${results[@]}" 2>/dev/null
    python bench/brief.py "${results[0]}" "${results[1]}"
    ;;
time-mix-fp32)  # the pipelined time mix (with its input and row prefetches) for fp32 states: decode A/B, profile
    build_fused
    results=()
    for mode in 2 1; do
        out=bench/results/experiment_time_mix_fp32_pipelined_h200.json
        [ $mode = 1 ] && out=bench/results/experiment_time_mix_fp32_per_row_h200.json  # the A/B's off side
        step 150 "decode, fp32 state, RWKV_TIME_MIX_PIPELINED=$mode" env RWKV_TIME_MIX_PIPELINED=$mode \
            python bench/bench_decode.py --sizes 7.2b,1.5b --batches 128,256,512 --states fp32 --steps 20 --wkv cuda \
            --no-checks --out $out
        results+=($out)
    done
    out=bench/results/profile_b256_fp32_state_pipelined_h200.json
    step 150 "7.2B batch 256 per kernel, fp32 state, pipelined" env RWKV_TIME_MIX_PIPELINED=2 \
        python bench/profile_decode.py --sizes 7.2b --batches 256 --out $out
    results+=($out)
    [ -n "$OUT" ] && tar czf "$OUT/time_mix_fp32.tgz" "${results[@]}" 2>/dev/null
    python bench/brief.py "${results[0]}" "${results[1]}"
    ;;
fused-verify)  # after a change to the fused kernels' shared code: every fused GPU test but the quantized ones, then
    # the large-batch fp16-state figures twice (machine noise between the runs)
    build_fused
    step 240 "fused GPU tests" python -m pytest -q -rf --tb=short -p no:cacheprovider test/test_fused_cuda.py \
        -k "not uint4 and not gemlite and not w4 and not w8a16 and not int8"
    results=()
    for run in 1 2; do
        out=bench/results/decode_h200_fp16_state_run${run}.json
        step 100 "7.2B decode, fp16 state, run $run" python bench/bench_decode.py --sizes 7.2b --batches 256,512 \
            --states fp16 --steps 30 --wkv cuda --no-checks --out $out
        results+=($out)
    done
    [ -n "$OUT" ] && tar czf "$OUT/fused_verify.tgz" "${results[@]}" 2>/dev/null
    python bench/brief.py "${results[@]}"
    ;;
time-mix-ncu)  # what bounds the decode time mix at 7.2B batch 256 (fp16 state): Nsight Compute's speed of light,
    # occupancy, warp stalls and memory sections on one launch of the pipelined kernel and one of the per-row kernel
    build_fused
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    for kernel in time_mix_pipelined_kernel time_mix_kernel; do
        mode=1
        [ $kernel = time_mix_kernel ] && mode=0
        out=bench/results/ncu_${kernel}_b256_fp16_state_h200.txt
        step 200 "ncu $kernel" env RWKV_TIME_MIX_PIPELINED=$mode "$NCU" --clock-control none -k "regex:^${kernel}" \
            --launch-skip 40 --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats \
            --section MemoryWorkloadAnalysis --section SchedulerStats --section LaunchStats --log-file $out \
            python bench/bench_decode.py --sizes 7.2b --batches 256 --states fp16 --steps 2 --wkv cuda --no-checks \
            --out /tmp/ncu_decode.json
        copy $out
        grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Stall|Issued Warp|No Eligible|Registers Per|Block Limit" $out | head -40
    done
    ;;
b1-ab)  # after a batch-1 change to the fused kernels: builds, the GEMV and W8A16 GPU tests, then batch-1 decode (fp16
    # 1.5B and 7.2B, W8A16 7.2B) of the tree against FILE (the kernel file before the change), two rounds
    build
    int8_tests
    step 400 "A/B at batch 1" env ROUNDS=2 bash bench/ab_kernels.sh "python bench/bench_decode.py --sizes 1.5b,7.2b \
--batches 1 --steps 40 --wkv cuda --no-checks --out {out} && python bench/bench_decode.py --engine cutlass --sizes 7.2b \
--batches 1 --steps 40 --wkv cuda --no-checks --out bench/results/experiment_ab_{name}_{round}_w8_h200.json" "${2:?b1-ab FILE}"
    ;;
staged-loras)  # each layer's LoRA second halves as a second stage of their first halves' launch (RWKV_GEMV_STAGED=1):
    # builds, the staged GPU tests (real concurrency: consumers wait on the GPU) and the GEMV ones, then batch-1 and
    # batch-2 decode (fp16 1.5B and 7.2B, W8A16 7.2B) with and without it, two rounds each. Flip the default if it wins.
    build
    step 200 "staged GEMV GPU tests" python -m pytest -q -rf --tb=short -p no:cacheprovider test/test_fused_cuda.py \
        -k "staged or gemv or decode_matches or greedy or invariance"
    switch_ab RWKV_GEMV_STAGED gemv_staged 1,2
    ;;
staged-quant)  # staged LoRAs for quantized models: fp16 7.2B lost 2 % with them, W8A16 gained 1.3 % (staged-loras)
    build
    step 200 "staged GPU tests" python -m pytest -q -rf --tb=short -p no:cacheprovider test/test_fused_cuda.py -k staged
    for round in 1 2; do
        for staged in 1 0; do
            w8_decode 90 "W8A16 decode, RWKV_GEMV_STAGED=$staged, round $round" 7.2b 1,2 \
                experiment_gemv_staged${staged}_${round}_w8_b_h200.json RWKV_GEMV_STAGED=$staged
            out=bench/results/experiment_gemv_staged${staged}_${round}_w4_h200.json
            step 150 "W4 decode, RWKV_GEMV_STAGED=$staged, round $round" env RWKV_GEMV_STAGED=$staged python \
                bench/bench_decode.py --engine gemlite:A16W4_HQQ_INT --sizes 7.2b --batches 1,2 --steps 30 --wkv cuda \
                --no-checks --out $out
            copy $out
        done
    done
    ;;
sparse-int8)  # W8A16 FFN values also stored K-major, decode through the sparse-input GEMV (RWKV_SPARSE_FFN_INT8=1):
    # the GPU tests, then W8A16 decode at 1/2/8 rows (tok/s and peak memory) with and without, two rounds. If it
    # wins, decide the default (it costs 67 MB a 7.2B layer).
    build
    step 200 "sparse GEMV and W8A16 GPU tests" python -m pytest -q -rf --tb=short -p no:cacheprovider \
        test/test_fused_cuda.py -k "sparse or w8a16 or int8"
    for round in 1 2; do
        for sparse in 1 0; do
            w8_decode 90 "W8A16 decode, RWKV_SPARSE_FFN_INT8=$sparse, round $round" 7.2b,1.5b 1,2,8 \
                experiment_sparse_int8_${sparse}_${round}_h200.json RWKV_SPARSE_FFN_INT8=$sparse
        done
    done
    for sparse in 1 0; do  # the FFN value's own time per layer (PDL off: clean kernel times)
        out=bench/results/profile_nopdl_w8_sparse${sparse}_h200.json
        step 90 "W8A16 7.2B batch 1 per kernel, RWKV_SPARSE_FFN_INT8=$sparse" env RWKV_PDL=0 \
            RWKV_SPARSE_FFN_INT8=$sparse python bench/profile_decode.py --engine cutlass --sizes 7.2b --batches 1 --out $out
        copy $out
    done
    ;;
int8-loads)  # bytes in flight per int8 band lane (kInt8Loads 3; 4 spills 12-20 bytes in the 64-register kernels, 2 for
    # the slope): the int8 bands are bound by memory latency at batch 1 (ncu_gemv_b1_cutlass_h200.txt)? Run in the
    # twenty-fifth session as 3 against 4 (and 4 with x read beside each mma, 4-12 bytes of spills): every int8
    # launch slower with 4 (experiment_int8_loads*_h200.json), so 3 stays.
    build
    for n in 4 2; do
        sed "s/^constexpr int kInt8Loads = 3;/constexpr int kInt8Loads = $n;/" cuda/rwkv7_fused.cu > /tmp/int8_loads$n.cu
        grep -q "^constexpr int kInt8Loads = $n;" /tmp/int8_loads$n.cu || { echo "kInt8Loads not found"; exit 1; }
    done
    step 520 "A/B of kInt8Loads" env ROUNDS=2 bash bench/ab_kernels.sh "python bench/bench_gemv.py --size 7.2b \
--weights int8 --only 'rkv+lora (forward),output,ffn key,ffn value' \
--out bench/results/experiment_ab_{name}_{round}_gemv_h200.json && python bench/bench_decode.py --engine cutlass \
--sizes 7.2b,1.5b --batches 1,2 --steps 30 --wkv cuda --no-checks --out {out}" /tmp/int8_loads4.cu /tmp/int8_loads2.cu
    ;;
lora-stream)  # above the GEMV's rows, the LoRAs' chain of small products on a side stream beside the r/k/v product
    # (RWKV_LORA_STREAM=1: one side stream for both chains; the default is 2 since lora-streams2) against 0: GPU tests,
    # decode A/B at 128-512 rows (fp16 state) in two rounds,
    # prompts, W8A16, the batch-256 step per kernel. (Its first run also timed the residual products as mm + add
    # instead of addmm, a switch since removed: slower, experiment_lora_stream1_mm_*_h200.json.)
    build
    step 200 "GPU tests (side stream, large-batch fused forward, graphs, W8A16)" python -m pytest -q -rf --tb=short \
        -p no:cacheprovider test/test_fused_cuda.py test/test_graphs_cuda.py \
        -k "lora_side_stream or decode_matches or prefill or invariance or graph or w8a16_model"
    results=()
    for round in 1 2; do
        for on in 1 0; do
            out=bench/results/experiment_lora_stream${on}_addmm_${round}_h200.json
            step 120 "decode, LoRA stream $on, round $round" env RWKV_LORA_STREAM=$on \
                python bench/bench_decode.py --sizes 7.2b,1.5b --batches 128,256,512 --states fp16 --steps 20 \
                --wkv cuda --no-checks --out $out
            results+=($out)
        done
    done
    for on in 1 0; do
        out=bench/results/experiment_lora_stream${on}_prefill_h200.json
        step 150 "prompts, LoRA stream $on" env RWKV_LORA_STREAM=$on python bench/bench_decode.py --sizes 7.2b \
            --batches "" --prefill 1024,4096 --prefill-rows 1,16 --wkv cuda --no-checks --out $out
        results+=($out)
        out=bench/results/experiment_lora_stream${on}_w8_h200.json
        step 150 "W8A16 decode, LoRA stream $on" env RWKV_LORA_STREAM=$on python bench/bench_decode.py --engine cutlass \
            --sizes 7.2b --batches 128,256 --steps 20 --wkv cuda --no-checks --out $out
        results+=($out)
    done
    out=bench/results/profile_b256_fp16_state_lora_stream_h200.json
    profile_b256_fp16 $out
    results+=($out)
    [ -n "$OUT" ] && tar czf "$OUT/lora_stream.tgz" "${results[@]}" 2>/dev/null
    python bench/brief.py "${results[@]}"
    ;;
lora-streams2)  # the large-batch LoRA chains on a stream each (RWKV_LORA_STREAM=2) against both on one (1, the default)
    # and none (0): GPU tests of the large-batch path, decode at 32-256 rows (fp32 state) in two rounds, W4
    build
    step 240 "GPU tests (side streams, large-batch fused forward, graphs, W8A16)" python -m pytest -q -rf --tb=short \
        -p no:cacheprovider test/test_fused_cuda.py test/test_graphs_cuda.py test/test_quant_cuda.py \
        -k "(lora_side_stream or decode_matches or prefill or invariance or graph or w8a16_model or replay) and not uint4 and not gemlite"
    results=()
    for round in 1 2; do
        for n in 2 1 0; do
            out=bench/results/experiment_lora_streams${n}_${round}_h200.json
            step 120 "decode, $n LoRA streams, round $round" env RWKV_LORA_STREAM=$n python bench/bench_decode.py \
                --sizes 7.2b,1.5b --batches 32,128,256 --states fp32 --steps 20 --wkv cuda --no-checks --out $out
            results+=($out)
        done
    done
    for n in 2 1; do
        out=bench/results/experiment_lora_streams${n}_w4_h200.json
        step 120 "W4 decode, $n LoRA streams" env RWKV_LORA_STREAM=$n python bench/bench_decode.py \
            --engine gemlite:A16W4_HQQ_INT --sizes 7.2b --batches 128,256 --steps 20 --wkv cuda --no-checks --out $out
        results+=($out)
    done
    [ -n "$OUT" ] && tar czf "$OUT/lora_streams2.tgz" "${results[@]}" 2>/dev/null
    python bench/brief.py "${results[@]}"
    ;;
int8-ring)  # the int8 bands' weights through a cp.async ring in shared memory per lane (int8_ring.cu: git show
    # bc47347:cuda/rwkv7_fused.cu > int8_ring.cu, left untracked so that it travels) against the tree's register
    # batches: GEMV and W8A16 GPU tests, then the A/B: int8 launches alone (7.2B, one row) and W8A16 decode. Ran once
    # (bench/results/experiment_int8_{ring,regs}_*): the ring was 13 % slower at 7.2B batch 1 and was not kept.
    [ -f int8_ring.cu ] || { echo "int8_ring.cu missing"; exit 1; }
    build
    int8_tests
    step 420 "A/B of the int8 bands: registers vs ring" env ROUNDS=2 bash bench/ab_kernels.sh "python bench/bench_gemv.py \
--size 7.2b --weights int8 --only 'rkv+lora (forward),output,ffn key,ffn value' \
--out bench/results/experiment_ab_{name}_{round}_gemv_h200.json && python bench/bench_decode.py --engine cutlass \
--sizes 7.2b,1.5b --batches 1,2,8 --steps 30 --wkv cuda --no-checks --out {out}" int8_ring.cu
    ;;
decode-ahead)  # the engine's decode ahead with its results copied to pinned memory right behind each step (the
    # first version read them with .tolist(), a copy queued behind the step launched ahead, so it waited for that
    # step too: neutral on the H200 in the twenty-first session), GPU tests (among them the ordering test), then
    # HTTP serving on / off / on / off
    step 200 "graph and engine GPU tests" python -m pytest -q -rs -p no:cacheprovider test/test_graphs_cuda.py
    build_fused
    for run in on:1 off:1 on:2 off:2; do
        mode=${run%%:*}
        step 120 "HTTP serving, decode ahead $mode (${run#*:})" env NAME=h200_7.2b_ahead_${mode}_${run#*:} \
            EXTRA_SERVER_ARGS="--decode-ahead $mode" LEVELS=1,32,256 MAX_TOKENS=256 bash bench/h200_serving.sh
        copy bench/results/serving_h200_7.2b_ahead_${mode}_${run#*:}.json
    done
    ;;
serving-steps)  # prompt tokens a step: --prefill-step-tokens (prompts that end in the step, fed whole) and
    # --prefill-chunk-size (pieces of prompts that do not end in it). Replaces the twenty-second session's
    # serving-chunk / serving-default parts, which had one knob (a step's prompt tokens, 512 vs 2048).
    # 1/32/256 streams of 256 tokens with the defaults (2048 / 512) three times, the last into
    # serving_h200_7.2b.json, 512 / 512 between; 32 streams with a 16k-token prompt mid-level with the defaults, twice
    build_fused
    for run in default:1 512:1 default:2 default:final; do
        kind=${run%%:*} name=h200_7.2b_steps_${run#*:} args=""
        [ "$kind" = 512 ] && name=h200_7.2b_steps512_${run#*:} args="--prefill-step-tokens 512 --prefill-chunk-size 512"
        [ "${run#*:}" = final ] && name=h200_7.2b
        step 120 "HTTP serving, prompt tokens a step: $kind (${run#*:})" env NAME=$name LEVELS=1,32,256 \
            MAX_TOKENS=256 EXTRA_SERVER_ARGS="$args" bash bench/h200_serving.sh
        copy bench/results/serving_$name.json
    done
    for run in 1 2; do
        step 120 "HTTP serving, 16k prompt mid-level, defaults ($run)" env NAME=h200_7.2b_long_steps_$run LEVELS=32 \
            MAX_TOKENS=256 LONG_PROMPT=16384 bash bench/h200_serving.sh
        copy bench/results/serving_h200_7.2b_long_steps_$run.json
    done
    ;;
lone-prompt)  # one prompt with no stream decoding (since the twenty-second session fed 2,048 tokens a step, the
    # step budget, instead of 512): TTFT of 19-, 1,024- and 16,384-token prompts with the defaults, the 16k one also
    # with --prefill-step-tokens 512; the prefix cache off (the same prompt again would hit it); each level also
    # reports the server's own TTFT (submit to first sampled token) beside the client's
    build_fused
    for run in 19:default 1024:default 16384:default 16384:512; do
        tokens=${run%:*} kind=${run#*:}
        args="--prefix-cache 0" && [ $kind = 512 ] && args="$args --prefill-step-tokens 512"
        prompt=$tokens && [ $tokens = 19 ] && prompt=0  # 0: the 19-token story request
        step 120 "lone $tokens-token prompt, step tokens $kind" env NAME=h200_7.2b_lone${tokens}_$kind LEVELS=1,1,1,1 \
            MAX_TOKENS=8 PROMPT_TOKENS=$prompt EXTRA_SERVER_ARGS="$args" bash bench/h200_serving.sh
        copy bench/results/serving_h200_7.2b_lone${tokens}_$kind.json
    done
    ;;
serving-ratio)  # the serving target's two sides on one machine: the 7.2B forward at batch 256 (fp32 state, the
    # server's default; CUDA graphs) and 1/32/256 HTTP streams of 256 tokens with the server's defaults
    build_fused
    step 150 "7.2B decode, batch 256" python bench/bench_decode.py --sizes 7.2b --batches 256 --wkv cuda --no-checks \
        --out bench/results/decode_h200_b256_twentysecond.json
    copy bench/results/decode_h200_b256_twentysecond.json
    step 120 "HTTP serving, defaults" env NAME=h200_7.2b_ratio LEVELS=1,32,256 MAX_TOKENS=256 bash bench/h200_serving.sh
    copy bench/results/serving_h200_7.2b_ratio.json
    ;;
ttft-host)  # a lone short request's TTFT inside the engine (first and steady, without and with the prompt warm-up,
    # cProfile of the prompt step), then the server's first and later TTFTs with the warm-up (19-token prompts)
    build_fused
    step 240 "engine TTFT, 7.2B, 19 tokens" python bench/profile_ttft.py --size 7.2b --cprofile \
        --out bench/results/profile_ttft_h200.json
    copy bench/results/profile_ttft_h200.json
    step 120 "lone 19-token prompt, warmed up" env NAME=h200_7.2b_lone19_warmed LEVELS=1,1,1,1 MAX_TOKENS=8 \
        EXTRA_SERVER_ARGS="--prefix-cache 0" bash bench/h200_serving.sh
    copy bench/results/serving_h200_7.2b_lone19_warmed.json
    ;;
prompt-graphs)  # one-row prompt steps of 2-64 tokens replayed from CUDA graphs: graph GPU tests, then a lone
    # 19-token request's TTFT in the engine (7.2B)
    build_fused
    step 120 "graph GPU tests" python -m pytest -q -p no:cacheprovider test/test_graphs_cuda.py
    step 100 "engine TTFT, prompt graphs" python bench/profile_ttft.py --size 7.2b --runs warmed_up --requests 12 \
        --out bench/results/profile_ttft_prompt_graphs_h200.json
    copy bench/results/profile_ttft_prompt_graphs_h200.json
    ;;
graphs-http)  # the prompt graphs through HTTP: graph GPU tests (the fused-kernel prompt graphs too), a lone 19- and
    # 1,024-token prompt four times each, then 1/32/256 streams of 256 tokens (defaults); NAME_TAG names the results
    build_fused
    step 120 "graph GPU tests" python -m pytest -q -p no:cacheprovider test/test_graphs_cuda.py
    tag=${NAME_TAG:-graphs}
    for tokens in 19 1024; do
        prompt=$tokens && [ $tokens = 19 ] && prompt=0
        step 120 "lone $tokens-token prompt" env NAME=h200_7.2b_lone${tokens}_$tag LEVELS=1,1,1,1 MAX_TOKENS=8 \
            PROMPT_TOKENS=$prompt EXTRA_SERVER_ARGS="--prefix-cache 0" bash bench/h200_serving.sh
        copy bench/results/serving_h200_7.2b_lone${tokens}_$tag.json
    done
    step 150 "HTTP serving, defaults" env NAME=h200_7.2b_$tag LEVELS=1,32,256 MAX_TOKENS=256 bash bench/h200_serving.sh
    copy bench/results/serving_h200_7.2b_$tag.json
    ;;
mixed-graphs)  # a step of decoding rows and one short prompt replayed as the decode graph, then the prompt's: graph GPU
    # tests, eager against replayed at 1-256 decoding rows (7.2B, 1.5B), then HTTP: 32 streams arriving 20 ms apart
    # (each arrival a mixed step) and 1/32/256 at once
    build_fused
    step 150 "graph GPU tests" python -m pytest -q -p no:cacheprovider test/test_graphs_cuda.py
    step 200 "mixed steps, eager against graphs" python bench/bench_mixed_steps.py --sizes 7.2b,1.5b \
        --out bench/results/mixed_steps_h200.json
    copy bench/results/mixed_steps_h200.json
    mixed_ab 7.2b_stagger 32,32 20 7.2b 32 4096
    step 150 "HTTP serving, defaults" env NAME=h200_7.2b_mixed LEVELS=1,32,256 MAX_TOKENS=256 bash bench/h200_serving.sh
    copy bench/results/serving_h200_7.2b_mixed.json
    ;;
mixed-stagger)  # graph GPU tests, then streams arriving apart (each arrival a step of decoding rows and one prompt),
    # eager mixed steps against graphed ones, 1.5B and 7.2B: 32 streams 20 ms apart and 128 streams 4 ms apart
    build_fused
    step 150 "graph GPU tests" python -m pytest -q -p no:cacheprovider test/test_graphs_cuda.py
    mixed_ab 1.5b_stagger2 32,128 20,4 1.5b 24 2048
    mixed_ab 7.2b_stagger2 32,128 20,4 7.2b 32 4096
    ;;
mixed-ab)  # graph GPU tests, then 1.5B: 128 streams arriving 4 ms apart three times, eager mixed steps then graphed
    build_fused
    step 150 "graph GPU tests" python -m pytest -q -p no:cacheprovider test/test_graphs_cuda.py
    mixed_ab 1.5b_stagger3 128,128,128 4 1.5b 24 2048
    ;;
admission-ab)  # copies to the device that waited for the stream (blocking_copies) against the tree's, which do not: graph
    # GPU tests (the test of not waiting among them), streams arriving apart (each arrival starts a row) before and
    # after, 1.5B and 7.2B; then 7.2B eager mixed steps against graphed ones (the final mixed steps' 7.2B rows)
    build_fused
    step 200 "graph GPU tests" python -m pytest -q -p no:cacheprovider test/test_graphs_cuda.py
    serving_ab 1.5b_admission 128,128,128 4 1.5b 24 2048 blocking_copies blocking async "${ADMISSION_FILES[@]}"
    serving_ab 7.2b_admission 32,128 20,4 7.2b 32 4096 blocking_copies blocking async "${ADMISSION_FILES[@]}"
    mixed_ab 7.2b_stagger4 32,128 20,4 7.2b 32 4096
    ;;
admission-check)  # after the sampler's last waiting copies went: graph GPU tests, then 1.5B 128 streams 4 ms apart x3
    build_fused
    step 200 "graph GPU tests" python -m pytest -q -p no:cacheprovider test/test_graphs_cuda.py
    step 100 "HTTP 1.5b, streams 4 ms apart" env NAME=h200_1.5b_admission_async2 LEVELS=128,128,128 MAX_TOKENS=256 \
        STAGGER_MS=4 MODEL=/tmp/rwkv7-1.5b-random-fp16.pth N_LAYER=24 N_EMBD=2048 bash bench/h200_serving.sh
    copy bench/results/serving_h200_1.5b_admission_async2.json
    ;;
gil-switch)  # the server's GIL switch interval (--gil-switch-ms): Python's 5 ms against the server's default 0.5, twice
    # each, 1.5B at 32 and 256 streams arriving at once, 7.2B at 256; beside them each model's forward at 32 and 256 rows
    build_fused
    option_ab 1.5b 24 2048 32,256 gil-switch-ms gil 5 0.5
    option_ab 7.2b 32 4096 256 gil-switch-ms gil 5 0.5
    ;;
stream-interval)  # --stream-interval: a chunk a token against one every 2 and 4 tokens after the first, twice each;
    # 1.5B at 32 and 256 streams arriving at once (where the event loop's chunks set the step rate), 7.2B at 256
    build_fused
    option_ab 1.5b 24 2048 32,256 stream-interval interval 1 2 4
    option_ab 7.2b 32 4096 256 stream-interval interval 1 2
    ;;
sampler-cost)  # the sampler's share of a serving step: sample() with fp16 logits at 1, 32 and 256 rows, its device time
    # by kernel; then the admission A/B of the twenty-fifth session again (1.5B, 128 streams 4 ms apart, two rounds of
    # the waiting copies from ab_before/ against the tree's; carry ab_before)
    build_fused
    step 200 "sampler cost" python bench/bench_sampler.py --fp16-logits --profile --batches 1,32,256 \
        --out bench/results/sampler_h200_cost.json
    copy bench/results/sampler_h200_cost.json
    serving_ab 1.5b_admission_r2 128,128 4 1.5b 24 2048 blocking_copies blocking async "${ADMISSION_FILES[@]}"
    serving_ab 1.5b_admission_r3 128,128 4 1.5b 24 2048 blocking_copies blocking async "${ADMISSION_FILES[@]}"
    ;;
sampler-prepare)  # the logits' preparation kernel of the sampler: its GPU tests, sample() with and without it at 1,
    # 32 and 256 rows, then 1.5B serving at 32 and 256 streams without it (the torch steps) and with it, twice
    build_fused
    step 200 "sampler GPU tests" python -m pytest -q -rs -p no:cacheprovider test/test_sampler_cuda.py
    step 150 "sampler cost" python bench/bench_sampler.py --fp16-logits --profile --batches 1,32,256 \
        --out bench/results/sampler_h200_prepare.json
    copy bench/results/sampler_h200_prepare.json
    serving_ab 1.5b_prepare_r1 32,256 0 1.5b 24 2048 torch_preparation torch kernel infer/sampler.py
    serving_ab 1.5b_prepare_r2 32,256 0 1.5b 24 2048 torch_preparation torch kernel infer/sampler.py
    ;;
sampler-graphs)  # decode steps' sampler replayed from CUDA graphs: graph and sampler GPU tests, then the engine (1.5B,
    # decode ahead) at 1 and 256 requests with RWKV_SAMPLER_GRAPHS=0 (eager sampling) and 1
    build_fused
    step 240 "graph and sampler GPU tests" python -m pytest -q -rs -p no:cacheprovider test/test_graphs_cuda.py \
        test/test_sampler_cuda.py
    sampler_graphs_engine 1 2
    ;;
sampler-graphs-serving)  # the engine A/B above once, then 1.5B serving at 1, 32 and 256 streams with the sampler eager
    # (RWKV_SAMPLER_GRAPHS=0) and from graphs, twice, beside the forward at 32 and 256 rows
    build_fused
    sampler_graphs_engine 3
    option_ab 1.5b 24 2048 1,32,256 env:RWKV_SAMPLER_GRAPHS sgraphs 0 1
    ;;
serving-profile)  # where the server's threads spend a step at 1.5B and 256 streams (py-spy), then 7.2B serving at 256
    # streams with the sampler eager and from graphs, twice, beside the 7.2B forward at 32 and 256 rows
    build_fused
    step 150 "HTTP 1.5b, py-spy" env NAME=h200_1.5b_profile LEVELS=256 MAX_TOKENS=256 \
        MODEL=/tmp/rwkv7-1.5b-random-fp16.pth N_LAYER=24 N_EMBD=2048 PROFILE=1 bash bench/h200_serving.sh
    copy bench/results/serving_h200_1.5b_profile.json
    option_ab 7.2b 32 4096 256 env:RWKV_SAMPLER_GRAPHS sgraphs 0 1
    ;;
serving-gil)  # 1.5B, 256 streams: how long the event loop and the engine hold the GIL a step (py-spy --gil), with a
    # chunk a token and with --stream-interval 2; the sampler's device time at 1, 32 and 256 rows (in-kernel uniforms)
    build_fused
    for interval in 1 2; do
        step 150 "HTTP 1.5b, py-spy --gil, interval $interval" env NAME="h200_1.5b_gil_interval$interval" LEVELS=256 \
            MAX_TOKENS=256 MODEL=/tmp/rwkv7-1.5b-random-fp16.pth N_LAYER=24 N_EMBD=2048 PROFILE=1 \
            EXTRA_SERVER_ARGS="--stream-interval $interval" bash bench/h200_serving.sh
        copy "bench/results/serving_h200_1.5b_gil_interval$interval.json"
    done
    step 150 "sampler cost" python bench/bench_sampler.py --fp16-logits --profile --batches 1,32,256 \
        --out bench/results/sampler_h200_uniforms.json
    copy bench/results/sampler_h200_uniforms.json
    ;;
gemv-stream)  # fp16 GEMV launches of 2,048/4,096-wide rows streamed through shared memory by bulk copies
    # (gemv_stream_kernel; RWKV_GEMV_STREAM=0: gemv_kernel): builds, the GEMV/decode/graph GPU tests, decode at batch
    # 1, 2 (the fp16 GEMV's rows), 4 and 8 (cuBLAS) with and without, then 4 and 8 rows on the streamed GEMV
    # (RWKV_GEMV_ROWS=8). gemv-stream-more: a second round and the batch-1 steps per kernel. Flip the default if it
    # loses.
    build_fused
    step 200 "GEMV GPU tests" python -m pytest -q -rf --tb=short -p no:cacheprovider test/test_fused_cuda.py \
        -k "(stream or gemv or decode or wide or greedy or invariance or cpu_fp32) and not uint4 and not gemlite"
    gemv_stream_ab 1
    out=bench/results/experiment_gemv_stream_rows8_h200.json
    step 100 "decode, 4 and 8 rows on the streamed GEMV" env RWKV_GEMV_ROWS=8 python bench/bench_decode.py \
        --sizes 1.5b,7.2b --batches 4,8 --steps 40 --wkv cuda --no-checks --out $out
    copy $out
    ;;
gemv-stream-more)
    build_fused
    gemv_stream_ab 2
    for streamed in 1 0; do
        out=bench/results/profile_nopdl_stream${streamed}_h200.json
        step 120 "per kernel without PDL, RWKV_GEMV_STREAM=$streamed" env RWKV_PDL=0 RWKV_GEMV_STREAM=$streamed \
            python bench/profile_decode.py --sizes 1.5b,7.2b --batches 1 --out $out
        copy $out
    done
    ;;
gemv-ncu)  # what bounds the batch-1 GEMV launches (7.2B, one layer, staging off): Nsight Compute on the r/k/v launch,
    # the LoRA second halves, the output projection, FFN key and FFN value, for 4-bit GemLite and W8A16 weights
    build
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    for engine in gemlite:A16W4_HQQ_INT cutlass; do
        tag=${engine#gemlite:}
        out=bench/results/ncu_gemv_b1_${tag}_h200.txt
        step 240 "ncu GEMV launches, $engine" env RWKV_GEMV_STAGED=0 "$NCU" --clock-control none -k "regex:gemv" \
            --launch-skip 40 --launch-count 5 --section SpeedOfLight --section Occupancy --section WarpStateStats \
            --section MemoryWorkloadAnalysis --section SchedulerStats --section LaunchStats --log-file $out \
            python bench/bench_decode.py --engine $engine --sizes 7.2b --batches 1 --steps 2 --wkv cuda --no-checks \
            --out /tmp/ncu_decode.json
        copy $out
        grep -E "^  [a-z_:]+.*gemv|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Grid Size|Block Size|Issued Warp|No Eligible|Warp Cycles Per Issued|stall|Stall" $out | head -80
    done
    ;;
*)
    echo "unknown part $PART" >&2
    exit 2
    ;;
esac
