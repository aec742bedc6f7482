"""Experiment: does cuBLAS run the large-batch decode step's GEMMs with the best kernel it has?

At 7.2B and 256 rows the decode step is ~10 ms, of which the cuBLAS GEMMs take ~6.2 ms at ~75 % of the measured
790 TFLOP/s: the FFN key at ~90 %, r/k/v at 80-83 %, the FFN value (K-major weights, residual added) at ~79 % and
the output projection (residual added: beta = 1) at ~51 % (docs/BENCHMARKS.md, twentieth session). torch calls
cuBLAS's default heuristic, which takes one kernel per shape without timing any. This times, for each GEMM of a
decode step exactly as the fused forward calls it (the same operands' layouts, batch and beta):

* torch as the server runs it (cuBLAS), and torch with cuBLASLt preferred (``preferred_blas_library``);
* every algorithm cuBLASLt's heuristic offers for the problem (up to --algos), each checked against torch's result
  first, called through ctypes (no build: the library torch has loaded).

Each candidate is captured as a CUDA graph of calls that cycle through enough copies of the weights to exceed the
50 MB L2 (a decode step reads each matrix once, from memory), and its median time a call over the replays is kept.
The table shows each GEMM's time and % of 790 TFLOP/s per candidate, and per step (L layers plus the head) what
the best algorithm of each GEMM would save. The kernel names of torch's choice and of the best algorithm come from
the profiler.

    python bench/experiment_blas_algos.py --sizes 7.2b,1.5b --rows 128,256,512,1024 --out bench/results/x.json
"""
from __future__ import annotations

import argparse
import ctypes
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

L2_BYTES = 50 << 20
WORKSPACE_BYTES = 32 << 20
CALLS_PER_GRAPH = 24
REPLAYS = 7
# torch's own candidates: as the server runs (its preferred BLAS library left alone), and cuBLASLt preferred
TORCH_CANDIDATES = {"torch": None, "torch_lt": "cublaslt"}

# cuBLAS / cuBLASLt constants (cublas_api.h, cublasLt.h, library_types.h of CUDA 12 and 13)
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_COMPUTE_32F = 68
CUDA_R_32F, CUDA_R_16F = 0, 2
DESC_TRANSA, DESC_TRANSB = 3, 4
LAYOUT_BATCH_COUNT, LAYOUT_STRIDED_BATCH_OFFSET = 5, 6
PREF_MAX_WORKSPACE_BYTES = 1
# cublasLtMatmulAlgoConfigAttributes_t: name -> (value, ctypes type)
ALGO_CONFIG = {"algo_id": (0, ctypes.c_int32), "tile": (1, ctypes.c_uint32), "split_k": (2, ctypes.c_int32),
               "reduction": (3, ctypes.c_uint32), "swizzle": (4, ctypes.c_uint32), "custom": (5, ctypes.c_uint32),
               "stages": (6, ctypes.c_uint32), "inner_shape": (7, ctypes.c_uint16), "cluster": (8, ctypes.c_uint16)}


class LtAlgo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class LtHeuristic(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", LtAlgo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


@dataclass(frozen=True)
class Gemm:
    """One product of the decode step as the fused forward calls it: y[batch][M, n] (+)= x[batch][M, k] @ W^T, W
    stored [n, k] (layout "nk", nn.Linear's) or [k, n] ("kn": the K-major FFN value); beta 1 adds into y (the
    residual); `per_step`: how many a step runs (once a layer, the head once)."""
    name: str
    n: int
    k: int
    layout: str = "nk"
    batch: int = 1
    beta: float = 0.0
    per_step: int = 1


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


@dataclass(frozen=True)
class LtProblem:
    """The column-major cuBLASLt problem of a row-major Gemm at `rows` rows: D (m x n, ld ldd) = op(A) op(B) + beta C,
    with m = the Gemm's n, n = rows; A the weights as stored (rows_a x cols_a, ld lda), B = x (k x rows, ld k)."""
    trans_a: int
    m: int
    n: int
    k: int
    rows_a: int
    cols_a: int
    lda: int
    batch: int
    stride_a: int
    stride_b: int
    stride_d: int
    beta: float


def lt_problem(gemm: Gemm, rows: int) -> LtProblem:
    """y [rows, n] row-major is y^T [n, rows] column-major: y^T = op(W) x^T. W [n, k] row-major is k x n column-major
    (so op = T); W [k, n] row-major is n x k column-major (op = N). x [rows, k] row-major is k x rows column-major."""
    if gemm.layout == "nk":
        trans_a, rows_a, cols_a = CUBLAS_OP_T, gemm.k, gemm.n
    elif gemm.layout == "kn":
        trans_a, rows_a, cols_a = CUBLAS_OP_N, gemm.n, gemm.k
    else:
        raise ValueError(f"unknown layout {gemm.layout!r}")
    return LtProblem(trans_a, gemm.n, rows, gemm.k, rows_a, cols_a, rows_a, gemm.batch, gemm.n * gemm.k,
                     rows * gemm.k, rows * gemm.n, gemm.beta)


class CublasLt:
    """The cuBLASLt calls this experiment needs, through ctypes on the library torch has loaded."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(_loaded_library("libcublasLt.so"))
        lib = self.lib
        vp, i32, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
        signatures = {
            "cublasLtCreate": [vp],
            "cublasLtMatmulDescCreate": [vp, i32, i32],
            "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatrixLayoutCreate": [vp, i32, u64, u64, i64],
            "cublasLtMatrixLayoutSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatmulPreferenceCreate": [vp],
            "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i32, ctypes.POINTER(LtHeuristic),
                                               ctypes.POINTER(i32)],
            "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(LtAlgo), i32, vp, sz, ctypes.POINTER(sz)],
            "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.POINTER(LtAlgo), vp, sz, vp],
        }
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        lib.cublasLtGetVersion.restype = ctypes.c_size_t
        self.version = int(lib.cublasLtGetVersion())
        self.handle = ctypes.c_void_p()
        self._check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
        self.one, self.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what}: cuBLAS status {status}")

    def _set(self, fn_name: str, obj: ctypes.c_void_p, attr: int, value) -> None:
        self._check(getattr(self.lib, fn_name)(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), fn_name)

    def _layout(self, rows: int, cols: int, ld: int, batch: int, stride: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), CUDA_R_16F, rows, cols, ld),
                    "cublasLtMatrixLayoutCreate")
        if batch > 1:
            self._set("cublasLtMatrixLayoutSetAttribute", layout, LAYOUT_BATCH_COUNT, ctypes.c_int32(batch))
            self._set("cublasLtMatrixLayoutSetAttribute", layout, LAYOUT_STRIDED_BATCH_OFFSET, ctypes.c_int64(stride))
        return layout

    def plan(self, p: LtProblem, max_algos: int) -> "LtPlan":
        """The descriptors of problem p and the heuristic's algorithms for it (at most max_algos)."""
        desc = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F),
                    "cublasLtMatmulDescCreate")
        self._set("cublasLtMatmulDescSetAttribute", desc, DESC_TRANSA, ctypes.c_int32(p.trans_a))
        self._set("cublasLtMatmulDescSetAttribute", desc, DESC_TRANSB, ctypes.c_int32(CUBLAS_OP_N))
        a = self._layout(p.rows_a, p.cols_a, p.lda, p.batch, p.stride_a)
        b = self._layout(p.k, p.n, p.k, p.batch, p.stride_b)
        d = self._layout(p.m, p.n, p.m, p.batch, p.stride_d)
        pref = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        self._set("cublasLtMatmulPreferenceSetAttribute", pref, PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(WORKSPACE_BYTES))
        results = (LtHeuristic * max_algos)()
        count = ctypes.c_int(0)
        self._check(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a, b, d, d, pref, max_algos, results,
                                                            ctypes.byref(count)), "cublasLtMatmulAlgoGetHeuristic")
        algos = [results[i] for i in range(count.value) if results[i].state == 0]
        return LtPlan(self, p, desc, a, b, d, algos)

    def config(self, algo: LtAlgo) -> dict[str, int]:
        out = {}
        for name, (attr, ctype) in ALGO_CONFIG.items():
            value, written = ctype(0), ctypes.c_size_t(0)
            status = self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value),
                                                                    ctypes.sizeof(value), ctypes.byref(written))
            if status == 0:
                out[name] = int(value.value)
        return out


@dataclass
class LtPlan:
    lt: CublasLt
    problem: LtProblem
    desc: ctypes.c_void_p
    a: ctypes.c_void_p
    b: ctypes.c_void_p
    d: ctypes.c_void_p
    algos: list[LtHeuristic]

    def run(self, index: int, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
        """y (+)= x W^T on the current stream with algorithm `index` (raises on a cuBLAS error)."""
        lt, h = self.lt, self.algos[index]
        beta = lt.one if self.problem.beta else lt.zero
        stream = torch.cuda.current_stream().cuda_stream
        lt._check(lt.lib.cublasLtMatmul(lt.handle, self.desc, ctypes.byref(lt.one), w.data_ptr(), self.a, x.data_ptr(),
                                        self.b, ctypes.byref(beta), y.data_ptr(), self.d, y.data_ptr(), self.d,
                                        ctypes.byref(h.algo), lt.workspace.data_ptr(), WORKSPACE_BYTES, stream),
                  "cublasLtMatmul")


def _loaded_library(stem: str) -> str:
    """The path of the shared library `stem` as this process loaded it (torch's cuBLASLt), else one in an nvidia
    wheel on sys.path, else the name for the loader to find."""
    torch.mm(torch.ones(8, 8, device="cuda", dtype=torch.float16), torch.ones(8, 8, device="cuda", dtype=torch.float16))
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if Path(path).name.startswith(stem):
                return path
    major = torch.version.cuda.split(".")[0]
    for root in sys.path:
        for lib in ("cublas/lib", f"cu{major}/lib"):
            candidate = Path(root or ".") / "nvidia" / lib / f"{stem}.{major}"
            if candidate.exists():
                return str(candidate)
    return f"{stem}.{major}"


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
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call(weights[0])  # warm-up (lazy initialisation outside the capture)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(weights[i % len(weights)])
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


def close(y: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference relative to the largest value of the reference."""
    return float((y.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))


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
        plan = lt.plan(lt_problem(gemm, rows), max_algos)
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
            entry["error"] = close(got, want)
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
    lt = CublasLt()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
              "cublaslt_version": lt.version,
              "torch_blas": str(torch.backends.cuda.preferred_blas_library()), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
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
