"""Linear layers of the runtime. Quantized formats plug in by providing another class with
the same call signature; the model code never changes.

All weights are kept in ``nn.Linear`` layout ``[out, in]`` and applied as ``x @ W.T``.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

# CPU BLAS picks its kernel (and with it the summation order) by the shape of the call, so a row's
# result would depend on how many other rows share it: on oneDNN/MKL sgemm (torch 2.13, x86-64) calls
# of 1-3, 5-7 and 9-11 rows round differently from larger ones. On CPU every matrix product therefore
# runs on blocks of exactly CPU_ROW_BLOCK rows (the last one zero-padded): every row is computed by a
# call of the same shape whatever the batch; that relies only on one call treating its rows alike.
# test_linear.py and test_runtime_oracle.py check the invariance bit-exactly.
CPU_ROW_BLOCK = 16


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
        if x.device.type != "cpu":
            return F.linear(x, self.weight)
        return torch.cat([F.linear(block, self.weight) for block in cpu_row_blocks(x)])[:x.shape[0]]


def cpu_row_blocks(x: torch.Tensor) -> list[torch.Tensor]:
    """``x`` cut into blocks of CPU_ROW_BLOCK rows, the last one zero-padded; the caller keeps the first
    ``x.shape[0]`` rows of the concatenated results."""
    rows = x.shape[0]
    if rows % CPU_ROW_BLOCK:
        x = torch.cat([x, x.new_zeros((CPU_ROW_BLOCK - rows % CPU_ROW_BLOCK, x.shape[1]))])
    return list(x.split(CPU_ROW_BLOCK))
