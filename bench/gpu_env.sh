# Source this on a lent GPU machine (from the repository root, with .whl carried) before the
# benchmarks: installs the carried wheels (fastapi/starlette/pydantic/uvicorn/aiosqlite for the
# server, the official rwkv package, fla-core, gemlite, nvidia-cutlass headers) into /tmp/site and
# puts them on PYTHONPATH; the machine's own torch, triton, numpy, httpx, ... stay as they are.
#
#     . bench/gpu_env.sh && python bench/bench_official.py && bash bench/h200_serving.sh
#
# .whl is filled by bench/fetch_wheels.sh on a machine with pip access; --no-deps: every dependency
# the GPU machine lacks is itself one of the carried wheels.
_gpu_env_repo="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)"
if ! ls "$_gpu_env_repo"/.whl/*.whl >/dev/null 2>&1; then
    echo "gpu_env.sh: no wheels in $_gpu_env_repo/.whl (carry .whl)" >&2
    return 1 2>/dev/null || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$_gpu_env_repo"/.whl/*.whl || { echo "gpu_env.sh: wheel install failed" >&2; return 1 2>/dev/null || exit 1; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/site/bin:$PATH  # py-spy
export RWKV_SERVER_HOME=/tmp/h
export PYTHONUNBUFFERED=1
mkdir -p "$RWKV_SERVER_HOME"
python3 -c 'import fastapi, starlette, pydantic, uvicorn, aiosqlite, rwkv, sys; print("gpu_env: python", sys.version.split()[0], "fastapi", fastapi.__version__, "pydantic", pydantic.VERSION, "uvicorn", uvicorn.__version__)' \
    || { echo "gpu_env.sh: carried packages do not import" >&2; return 1 2>/dev/null || exit 1; }
unset _gpu_env_repo
