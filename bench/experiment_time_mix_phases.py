"""Where time_mix_split_kernel's time goes: the kernel as it is, and variants with one of its parts taken out
(A, B, the loads of the chunk after next) or its layout changed (blocks per head, threads per state row, A's
warps), each timed alone on one prompt of a 7.2B layer's shape (1 row x
1,024 tokens, 64 heads, fp32 state), with time_mix_finish_kernel and time_mix_prefill_kernel beside them.

The variants are textual edits of cuda/rwkv7_fused.cu (cut before its C launchers), each compiled into a
namespace of its own; their outputs are meaningless, only their times count. An experiment, not a benchmark
of the product: it says which part a faster kernel has to cut.

    python bench/experiment_time_mix_phases.py --out bench/results/experiment_time_mix_phases_h200.json
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

ROOT = Path(__file__).resolve().parent.parent
ROW_THREADS = "constexpr int kRowThreads = 4;"
A_WARPS = "constexpr int kSplitAWarps = 4;"
SPLIT_A = "split_prepare(p, in, buf[cur ^ 1], cp, warp_a, t1, chunk_count(t1, last), C, col0, part == 0);"
SPLIT_B = ("            if (count == kChunkTokens)  // (block-uniform)\n"
           "                split_recurrence<true>(s, buf[cur], q, row, count, y_out, C);\n"
           "            else\n"
           "                split_recurrence<false>(s, buf[cur], q, row, count, y_out, C);\n")
SPLIT_LOAD = "if (t1 + kChunkTokens <= last) split_load(p, t1 + kChunkTokens, last, C, col0, warp_a, in);"


def layout(row_threads: int, a_warps: int) -> list[tuple[str, str]]:
    """Edits giving the split kernel ``row_threads`` B threads per state row and ``a_warps`` A warps (the file's
    values are 4 and 4)."""
    return [(ROW_THREADS, ROW_THREADS.replace("4", str(row_threads))), (A_WARPS, A_WARPS.replace("4", str(a_warps)))]


VARIANTS = {  # name: (what is taken out or changed, blocks per (row, head), [(old, new)])
    "parts4": ("nothing; 4 blocks per head", 4, []),
    "parts2": ("nothing; 2 blocks per head", 2, []),
    "no_phase_a": ("A (the next chunk's vectors); 2 blocks per head", 2, [(SPLIT_A, "")]),
    "no_phase_b": ("B (the recurrence); 2 blocks per head", 2, [(SPLIT_B, "")]),
    "no_loads": ("the next chunk's global loads; 2 blocks per head", 2, [(SPLIT_LOAD, "")]),
    "parts2_rows8": ("nothing; 2 blocks per head, 8 threads per state row", 2, layout(8, 4)),
    "parts2_a8": ("nothing; 2 blocks per head, 8 A warps (a token each)", 2, layout(4, 8)),
    "parts4_a8": ("nothing; 4 blocks per head, 8 A warps (a token each)", 4, layout(4, 8)),
}

LAUNCHERS = r"""
extern "C" int VARIANT_run(int which, int64_t H, int64_t num_tokens, float* state, const int64_t* slots,
                           const int64_t* starts, const int64_t* lasts, const void* const* tensors,
                           const void* const* params, float* scratch, int64_t rows, int64_t max_len, int reps,
                           float* ms) {
    using namespace fused;
    const TimeMixArgs p = make_time_mix_args(tensors, params, 0);
    const unsigned grid = static_cast<unsigned>(rows * H);
    const unsigned finish = static_cast<unsigned>(finish_blocks(rows, H, max_len));
    cudaEvent_t start, end;
    cudaEventCreate(&start);
    cudaEventCreate(&end);
    for (int rep = -2; rep < reps; ++rep) {
        if (rep == 0) cudaEventRecord(start);
        if (which == 0)
            time_mix_split_kernel<float, PARTS><<<grid * PARTS, split_threads(PARTS)>>>(int(H), rows, num_tokens,
                                                                                       state, slots, starts, lasts, p,
                                                                                       scratch);
        else if (which == 1)
            time_mix_finish_kernel<<<finish, N>>>(int(H), rows, rows, num_tokens, slots, starts, lasts, p, scratch);
        else
            time_mix_prefill_kernel<float><<<grid, kPrefillThreads>>>(int(H), rows, num_tokens, state, slots, starts,
                                                                     lasts, p);
    }
    cudaEventRecord(end);
    cudaEventSynchronize(end);
    cudaEventElapsedTime(ms, start, end);
    *ms /= reps;
    cudaEventDestroy(start);
    cudaEventDestroy(end);
    return static_cast<int>(cudaGetLastError());
}

// The split kernel's registers per thread, threads per block and resident blocks per multiprocessor
extern "C" void VARIANT_info(int* out) {
    using namespace fused;
    cudaFuncAttributes attr;
    cudaFuncGetAttributes(&attr, time_mix_split_kernel<float, PARTS>);
    int blocks = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, time_mix_split_kernel<float, PARTS>, split_threads(PARTS), 0);
    out[0] = attr.numRegs;
    out[1] = split_threads(PARTS);
    out[2] = blocks;
}
"""

BINDING = r"""
#include <torch/extension.h>
#include <vector>
#define DECLARE(V) extern "C" int V##_run(int, int64_t, int64_t, float*, const int64_t*, const int64_t*, \
    const int64_t*, const void* const*, const void* const*, float*, int64_t, int64_t, int, float*); \
    extern "C" void V##_info(int*);
VARIANT_DECLS
double run(std::string variant, int64_t which, torch::Tensor state, torch::Tensor slots, torch::Tensor starts,
           torch::Tensor lasts, std::vector<torch::Tensor> tensors, std::vector<torch::Tensor> params,
           torch::Tensor scratch, int64_t max_len, int64_t reps) {
    std::vector<const void*> t, q;
    for (auto& x : tensors) t.push_back(x.data_ptr());
    for (auto& x : params) q.push_back(x.data_ptr());
    float ms = 0;
    int err = -1;
VARIANT_CALLS
    TORCH_CHECK(err == 0, "launch failed: ", err);
    return ms;
}

std::vector<int64_t> info(std::string variant) {
    int out[3] = {0, 0, 0};
VARIANT_INFOS
    return {out[0], out[1], out[2]};
}
"""


def kernel_body(edits: list[tuple[str, str]]) -> tuple[str, str]:
    """(the includes, the fused namespace) of cuda/rwkv7_fused.cu with ``edits`` applied."""
    text = (ROOT / "cuda" / "rwkv7_fused.cu").read_text()
    text = text[:text.index('extern "C"')]
    for old, new in edits:
        assert text.count(old) == 1, f"edit target not found once: {old[:60]!r}"
        text = text.replace(old, new)
    cut = text.index("namespace fused {")
    return text[:cut], text[cut:]


def build():
    includes, parts, decls, calls, infos = None, [], [], [], []
    for name, (_, blocks, edits) in VARIANTS.items():
        head, body = kernel_body(edits)
        includes = includes or head
        launchers = LAUNCHERS.replace("VARIANT", name).replace("PARTS", str(blocks))
        parts.append(f"namespace {name} {{\n{body}\n{launchers}\n}}  // namespace {name}\n")
        decls.append(f"DECLARE({name})")
        calls.append(f'    if (variant == "{name}") err = {name}_run(int(which), state.size(1), tensors[0].size(0), '
                     "state.data_ptr<float>(), slots.data_ptr<int64_t>(), starts.data_ptr<int64_t>(), "
                     "lasts.data_ptr<int64_t>(), t.data(), q.data(), scratch.data_ptr<float>(), slots.numel(), "
                     "max_len, int(reps), &ms);")
        infos.append(f'    if (variant == "{name}") {name}_info(out);')
    cuda = includes.replace('#include "', f'#include "{ROOT / "cuda"}/') + "\n".join(parts)
    cpp = BINDING.replace("VARIANT_DECLS", "\n".join(decls)).replace("VARIANT_CALLS", "\n".join(calls))
    cpp = cpp.replace("VARIANT_INFOS", "\n".join(infos))
    return load_inline("time_mix_phases", cpp_sources=[cpp], cuda_sources=[cuda], functions=["run", "info"],
                       extra_cuda_cflags=["-O3", "--use_fast_math", "-lineinfo"], verbose=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="bench/results/experiment_time_mix_phases_h200.json")
    args = ap.parse_args()
    ext = build()
    T, H = args.tokens, args.heads
    C = H * 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    half = lambda *s: torch.randn(*s, generator=gen, device="cuda").half()  # noqa: E731
    tensors = [half(T, C) for _ in range(9)]
    params = [torch.randn(C, generator=gen, device="cuda") * 0.1 for _ in range(4)] + [half(C) for _ in range(4)]
    state = torch.randn(1, H, 64, 64, generator=gen, device="cuda") * 0.1
    ints = lambda v: torch.tensor(v, dtype=torch.int64, device="cuda")  # noqa: E731
    slots, starts, lasts = ints([0]), ints([0]), ints([T - 1])
    scratch = torch.zeros(T * C, device="cuda")
    rows = []
    for name, (what, _, _) in VARIANTS.items():
        ms = ext.run(name, 0, state, slots, starts, lasts, tensors, params, scratch, T, args.reps)
        regs, threads, per_sm = ext.info(name)
        rows.append({"kernel": "time_mix_split_kernel", "variant": name, "taken_out": what, "us": round(ms * 1e3, 1),
                     "us_per_token": round(ms * 1e3 / T, 3), "registers": regs, "threads": threads,
                     "blocks_per_sm": per_sm})
    for which, kernel in ((1, "time_mix_finish_kernel"), (2, "time_mix_prefill_kernel")):
        ms = ext.run("parts4", which, state, slots, starts, lasts, tensors, params, scratch, T, args.reps)
        rows.append({"kernel": kernel, "variant": "full", "taken_out": "nothing", "us": round(ms * 1e3, 1),
                     "us_per_token": round(ms * 1e3 / T, 3)})
    print(f"{'kernel':<26} {'variant':<13} {'us':>9} {'us/token':>9} {'regs':>5} {'thr':>4} {'/SM':>4}  taken out")
    for r in rows:
        occupancy = f"{r['registers']:>5} {r['threads']:>4} {r['blocks_per_sm']:>4}" if "registers" in r else " " * 15
        print(f"{r['kernel']:<26} {r['variant']:<13} {r['us']:>9.1f} {r['us_per_token']:>9.3f} {occupancy}  "
              f"{r['taken_out']}")
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "shape": {"tokens": T, "heads": H, "rows": 1, "state": "fp32"}, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
