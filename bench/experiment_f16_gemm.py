"""Experiment: can CUTLASS's Hopper fp16 GEMM (data-parallel or stream-K tiles) beat cuBLAS on the products of a
large-batch decode step? (Issue 6: 7.2B batch 256 at 25,300 tok/s with fp16 state against 30,000; the cuBLAS
GEMMs take ~6.9 ms of its 10.4 ms step where 4.2 ms is the peak, the r/k/v and output products worst.)

For each product of a decode step at 128/256/512 rows -- r/k/v as one batched product of three matrices, the
output projection and the FFN value with the residual added (beta = 1), the FFN key, the head -- the time of the
cuBLAS call the fused forward makes (torch.bmm / addmm_ / mm) and of each CUTLASS configuration of
bench/experiment_f16_gemm_sm90*.cu, all replayed from CUDA graphs (no host time between kernels), weights rotating
over enough copies to overflow the 50 MB L2. Each CUTLASS result is checked against cuBLAS's (fp32 sums in a
different order, one fp16 rounding: relative 2e-3). Needs an sm_90 GPU and the CUTLASS headers (nvidia-cutlass).

    python bench/experiment_f16_gemm.py --sizes 7.2b,1.5b --rows 128,256,512 \\
        --out bench/results/experiment_f16_gemm_h200.json
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_w8_gemm import H200_FP16_TFLOPS, WIDTHS, time_op  # noqa: E402
from infer.ops.cuda_ext import compile_extension  # noqa: E402
from infer.ops.linear_w8a16 import cutlass_include_dir  # noqa: E402

L2_BYTES = 256 * 2**20  # weights in rotation per product: far more than the L2


def build():
    include = cutlass_include_dir()
    if include is None:
        sys.exit("CUTLASS headers not found (pip install --no-deps nvidia-cutlass)")
    flags = ["-O3", "-DNDEBUG", "-gencode=arch=compute_90a,code=sm_90a", "-isystem", str(include)]
    sources = [ROOT / "bench" / name for name in ("experiment_f16_gemm_sm90.cu", "experiment_f16_gemm_sm90_streamk.cu",
                                                  "experiment_f16_gemm_op.cpp")]
    return compile_extension("rwkv7_f16_gemm_experiment", sources, flags, "the fp16 CUTLASS GEMM experiment")


def products(c: int) -> dict[str, tuple[int, int, int, float]]:
    """(L, out, in, beta) of each product of a decode step of a model of width c."""
    return {"rkv": (3, c, c, 0.0), "output+res": (1, c, c, 1.0), "ffn_key": (1, 4 * c, c, 0.0),
            "ffn_value+res": (1, c, 4 * c, 1.0), "head": (1, 65536, c, 0.0)}


def cublas_call(name: str, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
    """The fused forward's cuBLAS call for product ``name`` (x [L, M, K], w [L, N, K], y [L, M, N])."""
    if name == "rkv":
        torch.bmm(x, w.transpose(1, 2), out=y)
    elif name.endswith("+res"):
        y[0].addmm_(x[0], w[0].t())
    else:
        torch.mm(x[0], w[0].t(), out=y[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="7.2b,1.5b")
    ap.add_argument("--rows", default="128,256,512")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--splits", default="2,4", help="split-K factors also timed on the stream-K configurations")
    ap.add_argument("--out", default="bench/results/experiment_f16_gemm_h200.json")
    args = ap.parse_args()
    ext = build()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    configs = [(i, ext.name(i), 0) for i in range(ext.configs())]
    configs += [(i, f"{name} split {s}", s) for i, name, _ in list(configs) if "stream-K" in name
                for s in map(int, filter(None, args.splits.split(",")))]
    results = []
    for size in args.sizes.split(","):
        for name, (l, n_out, n_in, beta) in products(WIDTHS[size]).items():
            copies = max(2, -(-L2_BYTES // (2 * l * n_out * n_in)))
            weights = [torch.randn(l, n_out, n_in, generator=gen, device="cuda").half() * 0.02 for _ in range(copies)]
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(l, rows, n_in, generator=gen, device="cuda").half()
                y0 = torch.randn(l, rows, n_out, generator=gen, device="cuda").half()
                y = y0.clone()
                flops = 2.0 * l * rows * n_out * n_in
                row = {"size": size, "product": name, "L": l, "rows": rows, "out": n_out, "in": n_in}
                want = y0.clone()
                cublas_call(name, x, weights[0], want)
                row["cublas_us"] = round(1e6 * time_op(lambda i: cublas_call(name, x, weights[i], y), copies,
                                                       args.reps, graph=True), 2)
                for index, label, splits in configs:
                    try:
                        need = ext.workspace_size(index, x, weights[0], y, splits, sms)
                        workspace = torch.empty(max(need, 1), dtype=torch.uint8, device="cuda")
                        got = y0.clone()
                        ext.gemm(index, x, weights[0], got, beta, splits, workspace, sms,
                                 torch.cuda.current_stream().cuda_stream)
                        torch.cuda.synchronize()
                        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                        if not err <= 2e-3:
                            row[label] = f"wrong (max relative difference {err:.3g})"
                            continue
                        seconds = time_op(lambda i: ext.gemm(index, x, weights[i], y, beta, splits, workspace, sms,
                                                             torch.cuda.current_stream().cuda_stream),  # capture's
                                          copies, args.reps, graph=True)
                        row[label] = round(1e6 * seconds, 2)
                    except RuntimeError as e:
                        row[label] = f"failed: {str(e).splitlines()[0][:120]}"
                timed = {label: row[label] for _, label, _ in configs}
                best = min(((v, k) for k, v in timed.items() if isinstance(v, float)), default=(None, None))
                row["best_cutlass"], row["best_cutlass_us"] = best[1], best[0]
                row["cublas_pct_peak"] = round(100 * flops / (row["cublas_us"] * 1e-6) / 1e12 / H200_FP16_TFLOPS, 1)
                if best[0]:
                    row["best_pct_peak"] = round(100 * flops / (best[0] * 1e-6) / 1e12 / H200_FP16_TFLOPS, 1)
                results.append(row)
                print(json.dumps(row), flush=True)
            del weights
    out = {"gpu": torch.cuda.get_device_name(0), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "fp16_tflops_limit": H200_FP16_TFLOPS, "results": results}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"\n{'size':>5} {'product':>14} {'rows':>5} {'cuBLAS us':>10} {'%peak':>6} {'best CUTLASS':>26} {'us':>8} "
          f"{'%peak':>6}")
    for r in results:
        print(f"{r['size']:>5} {r['product']:>14} {r['rows']:>5} {r['cublas_us']:>10} {r['cublas_pct_peak']:>6} "
              f"{str(r['best_cutlass']):>26} {str(r['best_cutlass_us']):>8} {str(r.get('best_pct_peak', '')):>6}")


if __name__ == "__main__":
    main()
