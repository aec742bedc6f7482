"""Linear layers of the runtime. Quantized formats plug in by providing another class with
the same call signature; the model code never changes.

All weights are kept in ``nn.Linear`` layout ``[out, in]`` and applied as ``x @ W.T``.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

# CPU BLAS picks different kernels (and summation orders) for small row counts, so a row's
# result would depend on how many other rows share the call. Measured on oneDNN/MKL sgemm
# (torch 2.13, x86-64): calls of 4, 8 and >= 12 rows give every row the same bits; 1-3, 5-7
# and 9-11 rows do not. Padding small calls up to a multiple of 4 makes every row's result
# independent of the batch; test_runtime_oracle.py checks this bit-exactly.
CPU_EXACT_ROWS = 12
CPU_ROW_MULTIPLE = 4


class Linear(Protocol):
    """``y = x @ W.T`` for x of shape [M, in]; implementations may store W in any format."""

    in_features: int
    out_features: int
    kind: str  # shown in the startup log

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class DenseLinear:
    """Plain weights in the activation dtype (fp32 on CPU, fp16/bf16 on GPU)."""

    kind = "dense"

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.contiguous()
        self.out_features, self.in_features = weight.shape
        self.kind = f"dense {str(weight.dtype).removeprefix('torch.')}"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(pad_rows_for_cpu(x), self.weight)[:x.shape[0]]


def pad_rows_for_cpu(x: torch.Tensor) -> torch.Tensor:
    """``x`` with zero rows appended where CPU BLAS would otherwise make a row's result depend on
    the row count (see CPU_EXACT_ROWS); the caller keeps the first ``x.shape[0]`` output rows."""
    rows = x.shape[0]
    if x.device.type != "cpu" or rows >= CPU_EXACT_ROWS or rows % CPU_ROW_MULTIPLE == 0:
        return x
    padded = x.new_zeros((rows + CPU_ROW_MULTIPLE - rows % CPU_ROW_MULTIPLE, x.shape[1]))
    padded[:rows] = x
    return padded
