#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the wheels that bench/gpu_env.sh installs on a lent GPU machine
# (Python 3.12, x86-64, no network there; it has torch, triton, numpy, httpx, anyio, h11, click,
# tokenizers, einops, tqdm, ... but not the server's web stack nor the official rwkv package).
# Run where pip can reach an index. One version per package; --no-deps, so every dependency the
# GPU machine lacks is listed here explicitly. About 11 MB in all.
#
#     bash bench/fetch_wheels.sh [DIR]     # default .whl
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
mkdir -p "$DIR"
PIP=${PIP:-python3 -m pip}
PLATFORM=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# The server's web stack, the versions CI tests (fastapi 0.165 needs starlette >= 1.6, pydantic >= 2.9,
# annotated-doc, typing-inspection and opentelemetry-api; pydantic 2.14.4 pins pydantic-core 2.50.5 and
# needs typing-extensions >= 4.16). rwkv 0.8.32 (oracle / peer column) needs tokenizers (on the machine).
# fla-core 0.6.0 needs einops (on the machine); nvidia-cutlass: C++ headers for the W8A16 GEMM.
# httptools: uvicorn's fast HTTP parser (uvloop is already on the machine). py-spy: bench_serving.py --profile.
$PIP download --no-deps --only-binary=:all: "${PLATFORM[@]}" -d "$DIR" \
    fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 typing-extensions==4.16.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2 \
    uvicorn==0.54.0 httptools==0.7.1 aiosqlite==0.22.1 rwkv==0.8.32 fla-core==0.6.0 nvidia-cutlass==4.2.0.0 \
    py-spy==0.4.1
# GemLite is published as an sdist only (pure Python: builds anywhere); needs numpy, tqdm, triton >= 3.6.
ls "$DIR"/gemlite-0.6.0.post2-*.whl >/dev/null 2>&1 || $PIP wheel --no-deps gemlite==0.6.0.post2 -w "$DIR"
du -ch "$DIR"/*.whl
