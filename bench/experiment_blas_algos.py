"""Experiment: does cuBLAS run the large-batch decode step's GEMMs with the best kernel it has?

At 7.2B and 256 rows the decode step is ~10 ms, of which the cuBLAS GEMMs take ~6.2 ms at ~75 % of the measured
790 TFLOP/s: the FFN key at ~90 %, r/k/v at 80-83 %, the FFN value (K-major weights, residual added) at ~79 % and
the output projection (residual added: beta = 1) at ~51 % (docs/BENCHMARKS.md, twentieth session). torch calls
cuBLAS's default heuristic, which takes one kernel per shape without timing any. This times, for each GEMM of a
decode step exactly as the fused forward calls it (the same operands' layouts, batch and beta):

* torch as the server runs it (cuBLAS), and torch with cuBLASLt preferred (``preferred_blas_library``);
* every algorithm cuBLASLt's heuristic offers for the problem (up to --algos), each checked against torch's result
  first, called through ctypes (bench/cublaslt.py; no build).

Each candidate is captured as a CUDA graph of calls that cycle through enough copies of the weights to exceed the
50 MB L2 (a decode step reads each matrix once, from memory), and its median time a call over the replays is kept.
The table shows each GEMM's time and % of 790 TFLOP/s per candidate, and per step (L layers plus the head) what
the best algorithm of each GEMM would save. The kernel names of torch's choice and of the best algorithm come from
the profiler.

    python bench/experiment_blas_algos.py --sizes 7.2b,1.5b --rows 128,256,512,1024 --out bench/results/x.json
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import limits  # noqa: E402
from bench.bench_decode import capture_calls  # noqa: E402
from bench.cublaslt import ALGO_CONFIG, CublasLt, GemmShape, lt_problem, relative_error  # noqa: E402

L2_BYTES = 50 << 20
CALLS_PER_GRAPH = 24
REPLAYS = 7
# torch's own candidates: as the server runs (its preferred BLAS library left alone), and cuBLASLt preferred
TORCH_CANDIDATES = {"torch": None, "torch_lt": "cublaslt"}


@dataclass(frozen=True)
class Gemm:
    """One product of the decode step as the fused forward calls it: y[batch][M, n] (+)= x[batch][M, k] @ W^T, W
    stored [n, k] (layout "nk", nn.Linear's) or [k, n] ("kn": the K-major FFN value); beta 1 adds into y (the
    residual); `per_step`: how many a step runs (once a layer, the head once; 0: timed for comparison only)."""
    name: str
    n: int
    k: int
    layout: str = "nk"
    batch: int = 1
    beta: float = 0.0
    per_step: int = 1

    def shape(self, rows: int) -> GemmShape:
        return GemmShape(rows, self.n, self.k, self.layout, self.batch, bool(self.beta))


def decode_gemms(layers: int, width: int, vocab: int = limits.VOCAB) -> list[Gemm]:
    """The step's GEMMs at large batches (infer/ops/fused.py): r/k/v as one strided-batched product, the output
    projection and the FFN value adding into the residual, the FFN key, the head."""
    ffn = 4 * width
    return [Gemm("rkv", width, width, batch=3, per_step=layers),
            Gemm("output", width, width, beta=1.0, per_step=layers),
            Gemm("ffn_key", ffn, width, per_step=layers),
            Gemm("ffn_value", width, ffn, layout="kn", beta=1.0, per_step=layers),
            Gemm("head", vocab, width)]


def variant_gemms(width: int) -> list[Gemm]:
    """Other forms of two of them, timed for comparison only (per_step 0): the output projection without the residual
    add (beta 0: the add would move into the next layer norm's kernel) and the FFN value with nn.Linear's layout
    (the K-major storage is there for the sparse batch-1 GEMV)."""
    return [Gemm("output_beta0", width, width, per_step=0),
            Gemm("ffn_value_nk", width, 4 * width, beta=1.0, per_step=0)]


def torch_call(gemm: Gemm) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """The product as infer/ops/fused.py calls it: torch.bmm for r/k/v, addmm_ into the residual, mm otherwise."""
    if gemm.batch > 1:
        return lambda w, x, y: torch.bmm(x, w.transpose(1, 2), out=y)
    wt = (lambda w: w.t()) if gemm.layout == "nk" else (lambda w: w)
    if gemm.beta:
        return lambda w, x, y: y.addmm_(x, wt(w))
    return lambda w, x, y: torch.mm(x, wt(w), out=y)


def operands(gemm: Gemm, rows: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Copies of the weights (together over 3x the L2, at most 16), x and y for `rows` rows."""
    shape = (gemm.n, gemm.k) if gemm.layout == "nk" else (gemm.k, gemm.n)
    if gemm.batch > 1:
        shape = (gemm.batch, *shape)
    one = math.prod(shape) * 2
    copies = max(2, min(16, math.ceil(3 * L2_BYTES / one)))
    weights = [torch.randn(shape, device="cuda", dtype=torch.float16) * (gemm.k ** -0.5) for _ in range(copies)]
    lead = (gemm.batch,) if gemm.batch > 1 else ()
    x = torch.randn(*lead, rows, gemm.k, device="cuda", dtype=torch.float16)
    y = torch.randn(*lead, rows, gemm.n, device="cuda", dtype=torch.float16)
    return weights, x, y


def time_call(call: Callable[[torch.Tensor], None], weights: list[torch.Tensor]) -> float:
    """Median seconds a call, over REPLAYS replays of one CUDA graph of calls cycling through the weight copies."""
    calls = max(CALLS_PER_GRAPH, len(weights))

    def cycle() -> None:
        for i in range(calls):
            call(weights[i % len(weights)])
    graph, _ = capture_calls(cycle)  # (warmed up first: lazy initialisation outside the capture)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000 / calls)
    del graph
    return statistics.median(times)


def kernel_names(call: Callable[[], None]) -> list[str]:
    """The CUDA kernels one call launches (the profiler's names; the error if the profiler fails)."""
    call()
    torch.cuda.synchronize()
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        return sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
    except Exception as exc:  # noqa: BLE001 - a name is a nicety, the timing is the result
        return [f"profiler failed: {exc}"]


def with_backend(backend: str | None, fn: Callable[[], object]) -> object:
    """fn() with torch's preferred BLAS library set to `backend` (None: as it is, the server's)."""
    previous = torch.backends.cuda.preferred_blas_library()
    if backend is not None:
        torch.backends.cuda.preferred_blas_library(backend)
    try:
        return fn()
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def measure(lt: CublasLt, gemm: Gemm, rows: int, max_algos: int) -> dict:
    flops = 2 * gemm.batch * rows * gemm.n * gemm.k
    weights, x, y0 = operands(gemm, rows)
    torch_fn = torch_call(gemm)
    want = y0.clone()
    torch_fn(weights[0], x, want)  # the reference: what the server computes
    y = y0.clone()

    def pct(seconds: float) -> float:
        return round(100 * flops / seconds / limits.PEAK_FLOPS, 1)

    row = {"gemm": gemm.name, "rows": rows, "n": gemm.n, "k": gemm.k, "batch": gemm.batch, "layout": gemm.layout,
           "beta": gemm.beta, "per_step": gemm.per_step, "gflop": round(flops / 1e9, 3), "candidates": []}
    for key, backend in TORCH_CANDIDATES.items():
        seconds = with_backend(backend, lambda: time_call(lambda w: torch_fn(w, x, y), weights))
        row[f"{key}_us"], row[f"{key}_pct_of_peak"] = round(seconds * 1e6, 2), pct(seconds)
        row[f"{key}_kernels"] = with_backend(backend, lambda: kernel_names(lambda: torch_fn(weights[0], x, y)))
    try:
        plan = lt.plan(lt_problem(gemm.shape(rows)), max_algos)
    except RuntimeError as exc:  # no algorithm for the problem: torch's figures stand alone
        row["lt_error"] = str(exc)
        return row
    best = None
    for i, h in enumerate(plan.algos):
        entry = {"index": i, "workspace": int(h.workspace_size), "waves": round(float(h.waves_count), 3),
                 **lt.config(h.algo)}
        try:
            got = y0.clone()
            plan.run(i, weights[0], x, got)
            torch.cuda.synchronize()
            entry["error"] = relative_error(got, want)
            if not entry["error"] <= 2e-2:
                entry["rejected"] = "result differs from torch's"
            else:
                seconds = time_call(lambda w: plan.run(i, w, x, y), weights)
                entry["us"], entry["pct_of_peak"] = round(seconds * 1e6, 2), pct(seconds)
                if best is None or seconds < best[0]:
                    best = (seconds, i)
        except RuntimeError as exc:  # an algorithm the library offers but cannot run here
            entry["rejected"] = str(exc)
            torch.cuda.synchronize()
        row["candidates"].append(entry)
    if best is not None:
        row["best_us"], row["best_pct_of_peak"], row["best_index"] = round(best[0] * 1e6, 2), pct(best[0]), best[1]
        row["best_kernels"] = kernel_names(lambda: plan.run(best[1], weights[0], x, y))
    return row


def step_summary(size: str, rows: int, gemm_rows: list[dict]) -> dict:
    """The step's GEMM time per candidate (each GEMM times how many a step runs) and what the best saves."""
    def total(pick: Callable[[dict], float]) -> float:
        return sum(pick(r) * r["per_step"] for r in gemm_rows if r["per_step"]) / 1000

    default_ms, lt_ms = total(lambda r: r["torch_us"]), total(lambda r: r["torch_lt_us"])
    best_ms = total(lambda r: min(r.get("best_us", r["torch_us"]), r["torch_us"], r["torch_lt_us"]))
    return {"size": size, "rows": rows, "gemm_ms_torch": round(default_ms, 3), "gemm_ms_torch_lt": round(lt_ms, 3),
            "gemm_ms_best": round(best_ms, 3), "saved_ms": round(default_ms - best_ms, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="7.2b,1.5b")
    parser.add_argument("--rows", default="128,256,512,1024")
    parser.add_argument("--algos", type=int, default=64, help="at most this many of the heuristic's algorithms")
    parser.add_argument("--out", default="bench/results/experiment_blas_algos.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    lt = CublasLt(torch.device("cuda"))
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
              "cublaslt_version": lt.version, "torch_blas": str(torch.backends.cuda.preferred_blas_library()),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "peak_flops": limits.PEAK_FLOPS, "gemms": [], "steps": []}
    for size in args.sizes.split(","):
        shape = limits.SHAPES[size]
        for rows in [int(r) for r in args.rows.split(",")]:
            gemms = decode_gemms(shape.layers, shape.width) + variant_gemms(shape.width)
            gemm_rows = [measure(lt, gemm, rows, args.algos) for gemm in gemms]
            for r in gemm_rows:
                r["size"] = size
            result["gemms"] += gemm_rows
            result["steps"].append(step_summary(size, rows, gemm_rows))
            Path(args.out).write_text(json.dumps(result, indent=1))  # what is done so far survives a timeout
    print(f"{result['gpu']}, torch {result['torch']}, cuBLASLt {lt.version}; us a call (% of "
          f"{limits.PEAK_FLOPS / 1e12:.0f} TFLOP/s)")
    print(f"{'size':>5} {'rows':>5} {'gemm':>12} {'torch':>18} {'torch, Lt preferred':>18} {'best Lt algo':>18} "
          f"{'algos':>5}  best config")
    for r in result["gemms"]:
        cells = [f"{r[k + '_us']:8.1f} ({r[k + '_pct_of_peak']:5.1f} %)" if k + "_us" in r else f"{'-':>18}"
                 for k in ("torch", "torch_lt", "best")]
        timed = sum("us" in c for c in r["candidates"])
        config = {k: v for k, v in r["candidates"][r["best_index"]].items() if k in ALGO_CONFIG} if "best_index" in r \
            else {}
        print(f"{r['size']:>5} {r['rows']:>5} {r['gemm']:>12} {cells[0]:>18} {cells[1]:>18} {cells[2]:>18} "
              f"{timed:>5}  {config}")
    print("\nper step (L layers + head), ms of GEMMs: torch / torch, Lt preferred / the best of torch and Lt each")
    for s in result["steps"]:
        print(f"{s['size']:>5} {s['rows']:>5}  {s['gemm_ms_torch']:7.3f} / {s['gemm_ms_torch_lt']:7.3f} / "
              f"{s['gemm_ms_best']:7.3f}  (saves {s['saved_ms']:.3f} ms)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
