#!/usr/bin/env bash
# A/B of versions of cuda/rwkv7_fused.cu on one machine (a lent GPU may differ from the last one by a few percent,
# so a comparison holds only within one call). The tree's own source runs first, then each FILE in turn (a copy of
# the kernel file, left untracked so that it travels to the machine: from a branch, git show
# wip/x:cuda/rwkv7_fused.cu > x.cu, or the tree with a prepared patch applied:
# cp cuda/rwkv7_fused.cu x.cu && patch x.cu < x.patch): the fused kernels are rebuilt from it and
# COMMAND runs ROUNDS times (default 3), with
# {out} replaced by bench/results/experiment_ab_<name>_<round>_h200.json, <name> "tree" or the file's stem, and
# {name} and {round} by those alone (for a COMMAND of several runs, each writing
# bench/results/experiment_ab_{name}_{round}_<what>_h200.json). The tree's source is put back at the end; every
# bench/results/experiment_ab_* file is archived into $OUT/ab_kernels.tgz when OUT is set.
#
#   . bench/gpu_env.sh && OUT=$OUT bash bench/ab_kernels.sh "python bench/bench_decode.py --engine cutlass \
#       --sizes 7.2b --batches 1,2 --steps 30 --wkv cuda --no-checks --out {out}" tail.cu lnmix.cu
set -uo pipefail
cd "$(dirname "$0")/.."
COMMAND=${1:?usage: ab_kernels.sh COMMAND FILE...}
shift
ROUNDS=${ROUNDS:-3}
SOURCE=cuda/rwkv7_fused.cu
KEEP=$(mktemp)
cp "$SOURCE" "$KEEP"
trap 'cp "$KEEP" "$SOURCE"; rm -f "$KEEP"' EXIT
for variant in tree "$@"; do
    name=tree
    if [ "$variant" != tree ]; then
        name=$(basename "$variant" .cu)
        cp "$variant" "$SOURCE" || exit 1
    fi
    echo "=== $name: build $(date +%T)"
    python -c "from infer.ops.fused import load_fused_kernels; assert load_fused_kernels()" || { echo "=== $name: build failed"; continue; }
    for round in $(seq 1 "$ROUNDS"); do
        out=bench/results/experiment_ab_${name}_${round}_h200.json
        echo "=== $name, round $round $(date +%T)"
        command=${COMMAND//\{out\}/$out}
        command=${command//\{name\}/$name}
        bash -c "${command//\{round\}/$round}" 2>&1 | tail -8
    done
done
if [ -n "${OUT:-}" ]; then
    compgen -G "bench/results/experiment_ab_*" >/dev/null && tar czf "$OUT/ab_kernels.tgz" bench/results/experiment_ab_*
fi
