"""cuBLASLt through ctypes on the library torch loaded (no build), for bench/experiment_blas_algos.py: the algorithms
cuBLASLt's heuristic offers for a GEMM, each callable on the current stream (and so inside CUDA graphs).

torch asks cuBLAS's heuristic for one kernel per GEMM shape and never times another; the experiment times every
offered algorithm against that choice for the large-batch decode GEMMs. (A per-shape tuner in the forward built on
this, RWKV_BLAS_TUNE, found nothing >= 3 % faster at 7.2B 256/512 rows and was removed:
bench/variants/blas_tune.patch.)

Row-major torch products map to column-major cuBLASLt problems (:func:`lt_problem`): y [rows, n] = x [rows, k] W^T
is y^T = op(W) x^T, with W [n, k] ("nk", nn.Linear's layout; op = T) or [k, n] ("kn", a K-major matrix; op = N).
"""
from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

WORKSPACE_BYTES = 32 << 20

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


class LtAlgo(ctypes.Structure):  # cublasLtMatmulAlgo_t
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class LtHeuristic(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", LtAlgo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


@dataclass(frozen=True)
class GemmShape:
    """y[batch][rows, n] (+)= x[batch][rows, k] @ W^T (fp16, contiguous), W stored [n, k] (layout "nk") or [k, n]
    ("kn"); `accumulate`: added into y (beta = 1)."""
    rows: int
    n: int
    k: int
    layout: str = "nk"
    batch: int = 1
    accumulate: bool = False


@dataclass(frozen=True)
class LtProblem:
    """A GemmShape as cuBLASLt takes it, column-major: D (m x n, ld m) = op(A) B + beta C, m = the shape's n, n = its
    rows; A the weights as stored (rows_a x cols_a, ld lda), B = x (k x rows, ld k); batch strides in elements."""
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


def lt_problem(shape: GemmShape) -> LtProblem:
    if shape.layout == "nk":
        trans_a, rows_a, cols_a = CUBLAS_OP_T, shape.k, shape.n
    elif shape.layout == "kn":
        trans_a, rows_a, cols_a = CUBLAS_OP_N, shape.n, shape.k
    else:
        raise ValueError(f"unknown layout {shape.layout!r}")
    return LtProblem(trans_a, shape.n, shape.rows, shape.k, rows_a, cols_a, rows_a, shape.batch, shape.n * shape.k,
                     shape.rows * shape.k, shape.rows * shape.n, 1.0 if shape.accumulate else 0.0)


def loaded_library(stem: str) -> str:
    """The path of the shared library `stem` as this process loaded it (torch's cuBLASLt), else one in an nvidia
    wheel on sys.path, else the name for the loader to find."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if Path(path).name.startswith(stem):
                return path
    major = (torch.version.cuda or "13").split(".")[0]
    for root in sys.path:
        for lib in ("cublas/lib", f"cu{major}/lib"):
            candidate = Path(root or ".") / "nvidia" / lib / f"{stem}.{major}"
            if candidate.exists():
                return str(candidate)
    return f"{stem}.{major}"


class CublasLt:
    """The cuBLASLt calls a GEMM with a chosen algorithm needs, through ctypes on the library torch has loaded."""

    def __init__(self, device: torch.device) -> None:
        # a cuBLAS call first, so that torch has loaded (and initialised) its cuBLAS and cuBLASLt
        ones = torch.ones(8, 8, device=device, dtype=torch.float16)
        torch.mm(ones, ones)
        self.lib = lib = ctypes.CDLL(loaded_library("libcublasLt.so"))
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
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
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
        """The descriptors of problem p and the heuristic's algorithms for it (at most max_algos; raises when the
        library has none)."""
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
        self._set("cublasLtMatmulPreferenceSetAttribute", pref, PREF_MAX_WORKSPACE_BYTES,
                  ctypes.c_uint64(WORKSPACE_BYTES))
        results = (LtHeuristic * max_algos)()
        count = ctypes.c_int(0)
        self._check(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a, b, d, d, pref, max_algos, results,
                                                            ctypes.byref(count)), "cublasLtMatmulAlgoGetHeuristic")
        algos = [results[i] for i in range(count.value) if results[i].state == 0]
        return LtPlan(self, p, desc, a, b, d, algos)

    def config(self, algo: LtAlgo) -> dict[str, int]:
        """An algorithm's configuration (tile, split K, stages, ...: cublasLtMatmulAlgoConfigAttributes_t)."""
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
    """One problem's descriptors and the heuristic's algorithms for it (the descriptors live as long as the plan:
    graphs captured with its calls hold only their kernels' parameters)."""
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
        stream = torch.cuda.current_stream(y.device).cuda_stream
        lt._check(lt.lib.cublasLtMatmul(lt.handle, self.desc, ctypes.byref(lt.one), w.data_ptr(), self.a, x.data_ptr(),
                                        self.b, ctypes.byref(beta), y.data_ptr(), self.d, y.data_ptr(), self.d,
                                        ctypes.byref(h.algo), lt.workspace.data_ptr(), WORKSPACE_BYTES, stream),
                  "cublasLtMatmul")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference from the reference relative to its largest value (how a candidate is checked)."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))
