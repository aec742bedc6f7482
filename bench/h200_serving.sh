#!/usr/bin/env bash
# End-to-end HTTP serving benchmark of a random 7.2B model (L32 C4096, fp16) on one GPU:
# writes the checkpoint to /tmp unless it is there (bench_official.py leaves the same file), then
# runs bench/bench_serving.py at 1, 32 and 256 concurrent streams of 128 tokens against app.py
# with 256 slots and CUDA graphs. Source bench/gpu_env.sh first (the server's packages).
#
#     . bench/gpu_env.sh && bash bench/h200_serving.sh
#
# Result: bench/results/serving_$NAME.json, rewritten after each level (+ a copy and the log in $OUT
# when $OUT is set).
# Everything is an environment variable, e.g. the CPU plumbing check with the built-in demo model:
#     MODEL=demo LEVELS=1,2 MAX_TOKENS=16 MAX_BATCH=8 GRAPHS=off NAME=cpu_dryrun RESULTS=/tmp/dry bash bench/h200_serving.sh
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-/tmp/rwkv7-7.2b-random-fp16.pth}   # "demo": the server's built-in demo model, no file
N_LAYER=${N_LAYER:-32}
N_EMBD=${N_EMBD:-4096}
GEN_DEVICE=${GEN_DEVICE:-cuda}                     # where the random weights are drawn
LEVELS=${LEVELS:-1,32,256}
MAX_TOKENS=${MAX_TOKENS:-128}
LONG_PROMPT=${LONG_PROMPT:-0}                      # tokens of one extra prompt sent mid-level (0: none)
PROMPT_TOKENS=${PROMPT_TOKENS:-0}                  # each stream's prompt length (0: a 19-token request)
STAGGER_MS=${STAGGER_MS:-0}                        # streams of a level start this far apart (0: all at once; a list: per level)
MAX_BATCH=${MAX_BATCH:-256}
GRAPHS=${GRAPHS:-on}
NAME=${NAME:-h200_7.2b}
RESULTS=${RESULTS:-bench/results}
EXTRA_SERVER_ARGS=${EXTRA_SERVER_ARGS:-}
PROFILE=${PROFILE:-0}                              # 1: the largest level once more under py-spy (bench_serving --profile)
PY=${PYTHON:-python3}

start=$(date +%s)
stamp() { echo "[h200_serving +$(( $(date +%s) - start ))s] $*"; }
LOG=/dev/null
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then LOG="$OUT/serving_$NAME.log"; fi

model_args=()
if [ "$MODEL" != demo ]; then
    if [ ! -f "$MODEL" ]; then
        stamp "writing random checkpoint $MODEL (L$N_LAYER C$N_EMBD, fp16, drawn on $GEN_DEVICE)"
        $PY -m infer.random_model "$MODEL" --n-layer "$N_LAYER" --n-embd "$N_EMBD" --dtype fp16 --device "$GEN_DEVICE" \
            2>&1 | tee -a "$LOG"
        ls -la "$MODEL"
    else
        stamp "reusing $MODEL"
    fi
    model_args=(--model-path "$MODEL")
fi

stamp "bench_serving: levels $LEVELS, $MAX_TOKENS tokens, $MAX_BATCH slots, cuda graphs $GRAPHS"
# shellcheck disable=SC2086  # EXTRA_SERVER_ARGS is a word list on purpose
$PY bench/bench_serving.py --levels "$LEVELS" --max-tokens "$MAX_TOKENS" --long-prompt "$LONG_PROMPT" \
    --prompt-tokens "$PROMPT_TOKENS" --stagger-ms "$STAGGER_MS" --name "$NAME" $([ "$PROFILE" = 1 ] && echo --profile) \
    --out-dir "$RESULTS" -- \
    "${model_args[@]}" --max-batch-size "$MAX_BATCH" --cuda-graphs "$GRAPHS" $EXTRA_SERVER_ARGS 2>&1 | tee -a "$LOG"
stamp "done: $RESULTS/serving_$NAME.json"
