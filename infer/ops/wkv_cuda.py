"""The WKV-7 recurrence as a CUDA kernel (``cuda/wkv7_slots.cu``) that updates the slot pool in place.

Same contract as :class:`infer.ops.wkv.TorchWKV`, but no state is gathered or scattered: the
kernel reads ``state[slot]`` once per row, runs the row's tokens in registers and writes the
final state back to the slot. It is both the prefill and the decode kernel (decode = all rows
of length 1), launched on the current stream, so it can be captured in a CUDA graph.

The extension is JIT-compiled on first use and cached (``infer.ops.cuda_ext``), so later starts
reuse the build. On a ROCm build of torch the HIP port (``hip/wkv7_slots.hip``) is compiled instead. :func:`load_cuda_wkv` never raises: it logs why and returns None when the
kernel cannot be had; :func:`select_wkv` picks the implementation for a device.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from infer.batch import PackedBatch
from infer.ops.cuda_ext import BuildOnce, compile_kernels
from infer.ops.wkv import WKV, TorchWKV

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent.parent
CUDA_SOURCES = [ROOT / "cuda" / "wkv7_slots_op.cpp", ROOT / "cuda" / "wkv7_slots.cu"]
HIP_SOURCES = [ROOT / "cuda" / "wkv7_slots_op.cpp", ROOT / "hip" / "wkv7_slots.hip"]
EXTENSION_NAME = "rwkv7_wkv7_slots"
HEAD_SIZE = 64
ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
STATE_DTYPES = (torch.float32, torch.float16)
PREFERENCES = ("auto", "cuda", "fla", "torch")
# Rows this long or longer (prefill chunks) go to the chunked fla kernel when it is available:
# the per-token kernel's time grows with a row's length, the chunked one's mostly with its FLOPs.
LONG_ROW = 64


class CudaWKV:
    """WKV over the slot pool with the compiled kernel; see the module docstring."""

    name = "cuda kernel (wkv7_slots)"

    def __init__(self, module) -> None:
        self._op = module.wkv7_slots

    def __call__(self, state: torch.Tensor, batch: PackedBatch, r: torch.Tensor, w: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        T, C = r.shape
        acts = (r, k, v, a, b)
        if r.dtype not in ACT_DTYPES or any(t.dtype != r.dtype for t in acts):
            acts = tuple(t.float() for t in acts)     # exact widening; the usual path has one dtype
        r, k, v, a, b = (t.contiguous() for t in acts)  # no-ops for the model's tensors
        w = w.float().contiguous()
        y = torch.empty(T, C, dtype=torch.float32, device=r.device)
        stream = torch.cuda.current_stream(state.device).cuda_stream
        # Row i owns tokens starts[i]..last[i]: both already live on the device in PackedBatch.
        self._op(state, batch.slots, batch.starts, batch.last, r, w, k, v, a, b, y, stream)
        return y


# --------------------------------------------------------------------------- loading
_kernel: BuildOnce[CudaWKV] = BuildOnce("CUDA WKV kernel")


def _compile():
    return compile_kernels(EXTENSION_NAME, CUDA_SOURCES, HIP_SOURCES, "the WKV kernel")


def _self_test(kernel: CudaWKV) -> str | None:
    """Compare one small batch with the torch reference; a reason string if they disagree."""
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(0)
    H, lens, slots = 2, [3, 1], [2, 0]
    T, C = sum(lens), H * HEAD_SIZE
    batch = PackedBatch.from_rows([[0] * n for n in lens], slots, device)
    r, k, v = (torch.randn(T, C, generator=gen, device=device).half() for _ in range(3))
    w = torch.rand(T, C, generator=gen, device=device) * 0.45 + 0.55
    kk = torch.nn.functional.normalize(torch.randn(T, H, HEAD_SIZE, generator=gen, device=device), dim=-1)
    kk = kk.view(T, C).half()
    gate = torch.rand(T, C, generator=gen, device=device).half()
    pool = torch.randn(3, H, HEAD_SIZE, HEAD_SIZE, generator=gen, device=device) * 0.1
    expect_pool = pool.clone()
    expect = TorchWKV()(expect_pool, batch, r, w, k, v, -kk, kk * gate)
    got = kernel(pool, batch, r, w, k, v, -kk, kk * gate)
    torch.cuda.synchronize(device)
    err = max((got - expect).abs().max().item(), (pool - expect_pool).abs().max().item())
    if not err <= 1e-3:
        return f"self-test against the torch reference failed (max |diff| {err:.3g})"
    return None


def load_cuda_wkv(verify: bool = True) -> CudaWKV | None:
    """The compiled kernel, building it on the first call; None (with a logged warning) if it
    cannot be had: no CUDA device, no nvcc/ninja, a failed build, or a failed self-test."""
    return _kernel.load(lambda: CudaWKV(_compile()), _self_test if verify else None)


def cuda_wkv_error() -> str | None:
    """Why :func:`load_cuda_wkv` returned None (None if it was not tried or succeeded)."""
    return _kernel.error


def select_wkv(device: torch.device | str, prefer: str = "auto", heads: int | None = None) -> WKV:
    """The WKV implementation for ``device``: ``auto`` takes the CUDA kernel on CUDA devices when it
    loads and the torch reference otherwise; ``cuda`` insists on the kernel (RuntimeError if it cannot
    be had); ``fla`` is ``auto`` plus fla-core's chunked kernel for rows of at least ``LONG_ROW``
    tokens (given the model's ``heads``; skipped with a warning when fla is missing or fails its
    self-test; opt-in until its prefill speed is measured against the per-token kernel); ``torch``
    always takes the reference."""
    if prefer not in PREFERENCES:
        raise ValueError(f"unknown WKV implementation {prefer!r}; choose one of {', '.join(PREFERENCES)}")
    device = torch.device(device)
    chosen: WKV
    if prefer == "torch":
        chosen = TorchWKV()
    elif device.type != "cuda":
        if prefer == "cuda":
            raise RuntimeError(f"the CUDA WKV kernel was asked for, but the model runs on {device}; "
                               "it needs a CUDA device (prefer 'auto' or 'torch' instead)")
        chosen = TorchWKV()
    else:
        kernel = load_cuda_wkv()
        if kernel is None:
            if prefer == "cuda":
                raise RuntimeError(f"the CUDA WKV kernel was asked for but is unavailable: {cuda_wkv_error()}")
            chosen = TorchWKV()
        else:
            chosen = kernel
        if prefer == "fla" and heads is not None:
            from infer.ops.wkv_fla import SplitWKV, load_fla_wkv  # fla/triton are imported only here
            chunked = load_fla_wkv(heads=heads)
            if chunked is not None:
                chosen = SplitWKV(chosen, chunked, LONG_ROW)
    log.info("WKV implementation on %s: %s", device, chosen.name)
    return chosen
