"""The W8A16 GEMMs (or, with --weights uint4, the 4-bit Hopper GEMM) alone against cuBLAS fp16 on the matrix
shapes of a decode step at large batch.

For each (batch rows, out, in) shape of the 7.2B model (r/k/v/output 4096x4096, FFN key 16384x4096,
FFN value 4096x16384, head 65536x4096): the time of y = x @ (w * scale)^T through the SM80 mixed-input
CUTLASS GEMM, the Hopper WGMMA one (sm_90a builds) with its own tile choice and in each of its tiles,
and torch.matmul on the dequantized fp16 matrix
(cuBLAS, the fp16 engine's GEMM), and at up to 8 rows the W8A16 GEMV, with TFLOP/s and each kernel's largest difference from the float
reference. Weights rotate over enough copies to overflow the 50 MB L2, so every call reads them from
HBM as a decode step does.

    python bench/bench_w8_gemm.py --rows 128,256,512 --out bench/results/w8_gemm_h200.json

With --weights uint4 the matrices are GemLite A16W4 ones (group 64; words K-major as the Hopper GEMM reads them)
and the rows also compare the fused kernels' fp16 chunks + cuBLAS (``uint4_matmul``, GemLite's [K/8, N] words) and
the Hopper GEMM with K split in 2 and 4 slices (fp32 partials allocated per call, as the layer does; int8 too).
--size 1.5b takes the 1.5B model's shapes; --no-tiles leaves out the runs in each fixed tile; --graph times calls
replayed from a CUDA graph (eager calls of the shortest kernels measure the host's launch path).
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infer.ops.linear_w8a16 import load_w8a16_kernels, random_uint4, uint4_weights  # noqa: E402

def model_shapes(c: int) -> dict[str, tuple[int, int]]:
    """(out, in) of each kind of matrix of a model of width c."""
    return {"rkvo": (c, c), "ffn_key": (4 * c, c), "ffn_value": (c, 4 * c), "head": (65536, c)}


WIDTHS = {"7.2b": 4096, "1.5b": 2048}
H200_FP16_TFLOPS = 790.0  # measured dense 16-bit matmul on an H200 (performance-limits.md; spec sheet 989)


def time_op(fn, copies: int, reps: int, graph: bool = False) -> float:
    """Mean seconds per call of fn(i) over reps calls, cycling through the weight copies; with ``graph`` the calls
    are captured in one CUDA graph and replayed (no host time between kernels, as in a decode step's graph:
    eagerly a kernel of ~20 us can be bound by the host's launch path instead)."""
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()

    def calls() -> None:
        for r in range(reps):
            fn(r % copies)

    run = calls
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            calls()
        run = captured.replay
        run()
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def int8_operands(gen: torch.Generator, n_out: int, n_in: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """A random int8 matrix as the W8A16 ops take it, (q, scale), and its fp16 weights."""
    q = torch.randint(-127, 128, (n_out, n_in), generator=gen, device="cuda", dtype=torch.int8)
    scale = (torch.rand(n_out, generator=gen, device="cuda") * 0.01 + 1e-3).half()
    return (q, scale), q.half() * scale[:, None]


def uint4_operands(gen: torch.Generator, n_out: int, n_in: int,
                   group: int = 64) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """A random 4-bit GemLite matrix as the 4-bit Hopper GEMM takes it, (words [N, K/8], scale, zero, group), and
    its fp16 weights."""
    words, scale, zero = random_uint4(gen, n_out, n_in, group)
    return (words, scale, zero, group), uint4_weights(words, scale, zero)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="128,256,512")
    ap.add_argument("--weights", default="int8", choices=("int8", "uint4"))
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--size", default="7.2b", choices=tuple(WIDTHS))
    ap.add_argument("--no-tiles", action="store_true")
    ap.add_argument("--graph", action="store_true", help="time each kernel's calls replayed from a CUDA graph")
    ap.add_argument("--out", default="bench/results/w8_gemm_h200.json")
    args = ap.parse_args()
    kernels = load_w8a16_kernels()
    uint4 = args.weights == "uint4"
    if kernels is None or not kernels.gemm_available or (uint4 and kernels.gemm_w4 is None):
        sys.exit(f"the {'4-bit Hopper' if uint4 else 'W8A16 CUTLASS'} GEMM is not available here")
    # op(x, *operands, y, stream): operands (q, scale) for int8, (words, scale, zero, group) for 4-bit
    gemlite_words: dict[int, torch.Tensor] = {}  # 4-bit: GemLite's [K/8, N] copy of each K-major matrix, by address
    if uint4:
        from infer.ops.fused import load_fused_kernels
        ops = {"cutlass_sm90": kernels.gemm_w4}
        for tile, (channels, rows) in enumerate([] if args.no_tiles else kernels.sm90_tiles):
            ops[f"sm90_{channels}x{rows}"] = lambda *a, tile=tile: kernels.gemm_w4(*a, tile)
        for splits in (2, 4):
            ops[f"sm90_split{splits}"] = lambda x, w, s, z, g, y, stream, splits=splits: kernels.gemm_w4(
                x, w, s, z, g, y, stream, -1, torch.empty((splits, x.shape[0], y.shape[1]), device=x.device))
        fused = load_fused_kernels()
        if fused is not None:
            ops["fp16_chunks_cublas"] = lambda x, w, s, z, g, y, stream: y.copy_(
                fused.uint4_matmul(x, gemlite_words[w.data_ptr()], s, z))
        make = uint4_operands
    else:
        ops = {"cutlass_sm80": kernels.gemm_sm80}
        if kernels.sm90_tiles:
            ops["cutlass_sm90"] = kernels.gemm_sm90
            for tile, (channels, rows) in enumerate([] if args.no_tiles else kernels.sm90_tiles):
                ops[f"sm90_{channels}x{rows}"] = lambda *a, tile=tile: kernels.gemm_sm90(*a, tile)
            for splits in (2, 4):
                ops[f"sm90_split{splits}"] = lambda x, q, s, y, stream, splits=splits: kernels.gemm_sm90(
                    x, q, s, y, stream, -1, torch.empty((splits, x.shape[0], y.shape[1]), device=x.device))
        make = int8_operands
    stream = torch.cuda.current_stream().cuda_stream
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for name, (n_out, n_in) in model_shapes(WIDTHS[args.size]).items():
        bytes_per_weight = 0.5 if uint4 else 1
        copies = max(2, -(-256 * 2**20 // int(n_out * n_in * bytes_per_weight)))  # >= 256 MB of weights in rotation
        operands, dense = zip(*(make(gen, n_out, n_in) for _ in range(copies)))
        if uint4:
            gemlite_words.update((o[0].data_ptr(), o[0].t().contiguous()) for o in operands)
        for rows in rows_list:
            x = torch.randn(rows, n_in, generator=gen, device="cuda").half()
            y = torch.empty(rows, n_out, dtype=torch.float16, device="cuda")
            ref = x.float() @ dense[0].float().T
            row = {"size": args.size, "graph": args.graph, "shape": name, "rows": rows, "out": n_out, "in": n_in, "weights": args.weights}
            flops = 2.0 * rows * n_out * n_in
            row_ops = dict(ops, **({"w8a16_gemv": kernels.gemv} if not uint4 and rows <= kernels.gemv_max_rows else {}))
            for label, op in row_ops.items():
                op(x, *operands[0], y, stream)
                row[f"{label}_max_rel_err"] = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                # the stream read at each call: a graph is captured on a stream of its own
                t = time_op(lambda i, op=op: op(x, *operands[i], y, torch.cuda.current_stream().cuda_stream), copies,
                            args.reps, args.graph)
                row[f"{label}_us"], row[f"{label}_tflops"] = t * 1e6, flops / t / 1e12
            t = time_op(lambda i: torch.matmul(x, dense[i].T, out=y), copies, args.reps, args.graph)
            row["cublas_fp16_us"], row["cublas_fp16_tflops"] = t * 1e6, flops / t / 1e12
            results.append(row)
            cols = [f"{label} {row[f'{label}_us']:8.1f} us {row[f'{label}_tflops']:6.1f} TF/s" for label in row_ops]
            print(f"{name:9s} rows {rows:4d}: " + " | ".join(cols)
                  + f" | cublas fp16 {row['cublas_fp16_us']:8.1f} us {row['cublas_fp16_tflops']:6.1f} TF/s", flush=True)
        del operands, dense
        gemlite_words.clear()
        torch.cuda.empty_cache()
    out = {"gpu": torch.cuda.get_device_name(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "fp16_tflops_limit": H200_FP16_TFLOPS, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
