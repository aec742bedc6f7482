#!/usr/bin/env bash
# Compile-check the kernel sources without a GPU:
#   cuda/*.cu        nvcc -c for sm_90, the device code (-cubin) for sm_80 (with torch's no-implicit-half-conversion
#                    flags), and no byte-wide global loads in their PTX
#   cuda/w8a16_gemm.cu once more with its CUTLASS GEMM (-DW8A16_WITH_CUTLASS), when the headers of the
#                    nvidia-cutlass wheel are installed (found like the JIT build finds them), and the
#                    Hopper GEMMs cuda/w8a16_gemm_sm90.cu (+ tiles, int8 and 4-bit) for sm_90a (which need
#                    those headers)
#   cuda/*_op.cpp    g++ -fsyntax-only against torch's headers (a CPU build of torch is enough)
#   hip/*.hip        hipcc -c for two AMD targets (HIP_PLATFORM=amd)
#   and for both: the object defines every extern "C" function its torch binding (cuda/<name>_op.cpp)
#                    declares (one missing links, but the extension then fails to import)
#   cuda/sampler.cu and hip/sampler.hip once more with the flags of their JIT build
#                    (infer/ops/sampler_cuda.py: no fast math, no FMA contraction), spills as errors
# Each tool that is missing is skipped with a note. Exits non-zero if anything fails to compile. The checks
# run side by side (CHECK_JOBS at a time, default the CPU count) and are reported in order at the end, each with
# its seconds.
# Usage: bash cuda/check_compile.sh   (PYTHON=... to pick the interpreter that has torch)
set -uo pipefail

cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
failures=0
checked=0

# The checks run side by side, up to CHECK_JOBS at a time (default: the CPU count), and are reported in
# the order they were queued once all are done: say() queues a line of text, run() a check.
JOBS=${CHECK_JOBS:-$(nproc 2>/dev/null || echo 1)}
entries=0
next_entry() {  # sets ENTRY (not through $(...): the count must survive in this shell)
    ENTRY=$(printf 'e%03d' "$entries")
    entries=$((entries + 1))
}
say() {
    next_entry
    printf '%s\n' "$1" >"$TMP/$ENTRY.say"
}
run() {  # run LABEL CMD...: queue the command (output kept for the report)
    local label=$1 id
    shift
    next_entry
    id=$ENTRY
    printf '%s\n' "$label" >"$TMP/$id.label"
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
    (started=$SECONDS
     if "$@" >"$TMP/$id.log" 2>&1; then echo ok; else echo FAILED; fi >"$TMP/$id.rc"
     echo $((SECONDS - started)) >"$TMP/$id.seconds") &
}
# with_entry_points OBJ CMD...: run CMD (a compile writing OBJ), then require OBJ to define every extern "C"
# function declared by the torch binding of its source (cuda/<base>_op.cpp, where there is one)
with_entry_points() {
    local obj=$1 base name status=0
    shift
    "$@" || return 1
    base=$(basename "$obj")
    base=${base%%.*}
    [ -e "cuda/${base}_op.cpp" ] || return 0
    # the symbol table into a file first: piped into grep -q (which stops at the first match), nm could die of
    # SIGPIPE and, under pipefail, fail the check for a symbol that is there
    nm -g --defined-only "$obj" >"$obj.symbols" || return 1
    for name in $(grep -oP 'extern "C" [^(]*?\b\K\w+(?=\()' "cuda/${base}_op.cpp" | sort -u); do
        grep -qw "$name" "$obj.symbols" || { echo "$obj lacks $name (cuda/${base}_op.cpp)"; status=1; }
    done
    return $status
}
report() {  # wait for every queued check, print the results in order
    wait
    local i id result
    for ((i = 0; i < entries; i++)); do
        id=$(printf 'e%03d' "$i")
        if [ -e "$TMP/$id.say" ]; then
            cat "$TMP/$id.say"
            continue
        fi
        result=$(cat "$TMP/$id.rc" 2>/dev/null || echo FAILED)
        printf '  %-58s %-6s %4s s\n' "$(cat "$TMP/$id.label")" "$result" "$(cat "$TMP/$id.seconds" 2>/dev/null || echo '?')"
        if [ "$result" != ok ]; then
            sed 's/^/      /' "$TMP/$id.log" | tail -40
            failures=$((failures + 1))
        fi
        checked=$((checked + 1))
    done
}

# the flags torch.utils.cpp_extension adds to every nvcc/hipcc compile
TORCH_NVCC_DEFINES=(-D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
                    -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__)
TORCH_HIP_DEFINES=(-D__HIP_NO_HALF_OPERATORS__=1 -D__HIP_NO_HALF_CONVERSIONS__=1)

say "CUDA kernels (cuda/*.cu):"
if command -v nvcc >/dev/null 2>&1; then
    for src in cuda/*.cu; do
        [ -e "$src" ] || continue
        case $src in cuda/w8a16_gemm_sm90* | cuda/w4a16_gemm_sm90*) continue ;; esac  # CUTLASS only: checked below
        base=$(basename "$src" .cu)
        run "$src  sm_90 (+ binding's entry points)" with_entry_points "$TMP/$base.sm90.o" nvcc -std=c++17 -O3 \
            --use_fast_math -arch=sm_90 "${TORCH_NVCC_DEFINES[@]}" \
            -Xptxas -warn-spills,-warn-lmem-usage,--warning-as-error -Werror all-warnings -c "$src" -o "$TMP/$base.sm90.o"
        # device code only (-cubin: no host compile, a third less time): the sm_90 object above covers the host code
        run "$src  sm_80" nvcc -std=c++17 -O3 --use_fast_math -arch=sm_80 "${TORCH_NVCC_DEFINES[@]}" \
            -cubin "$src" -o "$TMP/$base.sm80.cubin"
        # Every global load of these kernels is 16 bytes or an fp16/fp32 scalar: a byte load means a
        # vector was copied out of global memory by reference (memcpy from a uint4&), which once made
        # the GEMV 2-4x slower without changing a result.
        run "$src  no byte-wide global loads (PTX)" bash -c '! nvcc -std=c++17 -O3 -arch=sm_90 "${@:2}" -ptx "$1" -o - \
            | grep -E "ld\.global(\.[a-z0-9]+)*\.[us]8[ ;]"' _ "$src" "${TORCH_NVCC_DEFINES[@]}"
    done
else
    say "  nvcc not found, skipping"
fi

say "CUTLASS W8A16 GEMM (cuda/w8a16_gemm.cu -DW8A16_WITH_CUTLASS):"
CUTLASS_INCLUDE=$("$PYTHON" -c "from infer.ops.linear_w8a16 import cutlass_include_dir; print(cutlass_include_dir() or '')" \
                  2>/dev/null)
if ! command -v nvcc >/dev/null 2>&1; then
    say "  nvcc not found, skipping"
elif [ -z "$CUTLASS_INCLUDE" ]; then
    say "  CUTLASS headers not installed (pip install --no-deps nvidia-cutlass), skipping"
else
    for arch in 90 80; do
        # -isystem: warnings inside CUTLASS's headers are not ours; our code stays under -Werror. Device code only
        # (-cubin): the sm_90a object below compiles the same host code
        run "cuda/w8a16_gemm.cu +CUTLASS  sm_$arch" nvcc -std=c++17 -O3 --use_fast_math -arch=sm_$arch \
            "${TORCH_NVCC_DEFINES[@]}" -DW8A16_WITH_CUTLASS -isystem "$CUTLASS_INCLUDE" \
            -Xptxas -warn-spills,-warn-lmem-usage,--warning-as-error -Werror all-warnings \
            -cubin cuda/w8a16_gemm.cu -o "$TMP/w8a16_gemm.cutlass.sm$arch.cubin"
    done
    # the sm_90a build of infer/ops/linear_w8a16.py (SM90_FLAGS), ptxas warnings as errors (so C7510, a
    # serialized WGMMA pipeline, fails the check); the Hopper GEMM's tiles compile side by side
    SM90A=(nvcc -std=c++17 -O3 --use_fast_math -DNDEBUG -gencode=arch=compute_90a,code=sm_90a
           "${TORCH_NVCC_DEFINES[@]}" -DW8A16_WITH_CUTLASS -DW8A16_WITH_CUTLASS_SM90 -isystem "$CUTLASS_INCLUDE"
           -Xptxas -warn-spills,-warn-lmem-usage,--warning-as-error -Werror all-warnings)
    for src in cuda/w8a16_gemm.cu cuda/w8a16_gemm_sm90.cu; do
        run "$src +CUTLASS  sm_90a" "${SM90A[@]}" -c "$src" -o "$TMP/$(basename "$src" .cu).sm90a.o"
    done
    # one check per tile and format, queued like the others: each compile takes ~3 GB, so no more than CHECK_JOBS
    # at a time (all eight at once exhausted a 24 GB machine). The tiles differ in template arguments only: the first
    # of each format compiles whole, the others their device code only (-cubin: 32 s against 50 for a tile here, cicc
    # and ptxas with its warnings as errors, without the host compile)
    for src in cuda/w8a16_gemm_sm90_*x*.cu cuda/w4a16_gemm_sm90_*x*.cu; do
        case $src in
        cuda/w8a16_gemm_sm90_64x64.cu | cuda/w4a16_gemm_sm90_64x64.cu)
            run "$src  sm_90a" "${SM90A[@]}" -c "$src" -o "$TMP/$(basename "$src" .cu).o" ;;
        *) run "$src  sm_90a (device code)" "${SM90A[@]}" -cubin "$src" -o "$TMP/$(basename "$src" .cu).cubin" ;;
        esac
    done
fi

say "torch bindings (cuda/*_op.cpp):"
if TORCH_FLAGS=$("$PYTHON" - 2>/dev/null <<'EOF'
import sysconfig
import torch
from torch.utils.cpp_extension import include_paths
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
std = "-std=c++20" if (major, minor) >= (2, 10) else "-std=c++17"   # what cpp_extension builds with
print(std, " ".join("-I" + p for p in include_paths()), "-I" + sysconfig.get_paths()["include"])
EOF
); then
    CXX=${CXX:-g++}
    if command -v "$CXX" >/dev/null 2>&1; then
        for src in cuda/*_op.cpp; do
            [ -e "$src" ] || continue
            # shellcheck disable=SC2086
            run "$src  $CXX -fsyntax-only" "$CXX" -fsyntax-only $TORCH_FLAGS -DTORCH_EXTENSION_NAME=check_ext \
                -Wall -Wno-unused-function "$src"
        done
    else
        say "  $CXX not found, skipping"
    fi
else
    say "  torch is not importable by $PYTHON, skipping"
fi

say "HIP kernels (hip/*.hip):"
if command -v hipcc >/dev/null 2>&1; then
    for src in hip/*.hip; do
        [ -e "$src" ] || continue
        base=$(basename "$src" .hip)
        run "$src  gfx90a,gfx1030 (+ entry points)" with_entry_points "$TMP/$base.hip.o" \
            env HIP_PLATFORM=amd hipcc -std=c++17 -O3 --offload-arch=gfx90a \
            --offload-arch=gfx1030 "${TORCH_HIP_DEFINES[@]}" -Wall -c "$src" -o "$TMP/$base.hip.o"
    done
else
    say "  hipcc not found, skipping"
fi

say "sampler kernel with its JIT flags (infer/ops/sampler_cuda.py):"
if command -v nvcc >/dev/null 2>&1; then
    for arch in 90 80; do
        run "cuda/sampler.cu --fmad=false  sm_$arch" nvcc -std=c++17 -O3 --fmad=false -arch=sm_$arch \
            "${TORCH_NVCC_DEFINES[@]}" -Xptxas -warn-spills,-warn-lmem-usage,--warning-as-error -Werror all-warnings \
            -c cuda/sampler.cu -o "$TMP/sampler.jit.sm$arch.o"
    done
else
    say "  nvcc not found, skipping"
fi
if command -v hipcc >/dev/null 2>&1; then
    run "hip/sampler.hip -ffp-contract=off  gfx90a,gfx1030" env HIP_PLATFORM=amd hipcc -std=c++17 -O3 \
        -ffp-contract=off --offload-arch=gfx90a --offload-arch=gfx1030 "${TORCH_HIP_DEFINES[@]}" -Wall \
        -c hip/sampler.hip -o "$TMP/sampler.jit.hip.o"
else
    say "  hipcc not found, skipping"
fi

report
if [ "$failures" -gt 0 ]; then
    echo "$failures of $checked compile checks FAILED"
    exit 1
fi
echo "all $checked compile checks passed"
