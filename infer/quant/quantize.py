"""Weight quantization math in plain torch (any device; the tests run it on CPU).

All functions take one ``[out, in]`` matrix (nn.Linear layout) of any float dtype, work in fp32 and
return what a checkpoint stores:

* :func:`quantize_int8`: symmetric per output channel, ``W[n] ~ q[n] * scale[n]`` (W8A16 and
  GemLite ``A16W8_INT8``).
* :func:`quantize_fp8`: the same with float8 e4m3 values (GemLite ``A16W8_FP8``).
* :func:`quantize_uint4_groups`: 4-bit with a scale and zero point per group of input columns,
  ``W ~ (q - zero) * scale``, optionally with HQQ's zero-point refinement, or symmetric (zero point 8)
  (GemLite ``A16W4_HQQ_INT``); :func:`uint4_grid` is the per-group choice of scale and zero point,
  which GPTQ (``infer.quant.gptq``) shares.

Scales are returned in fp16, the dtype they are stored and applied in, and the values are rounded
against the fp16 scale, so dequantizing with the stored scale is exactly what was optimised. A scale
is never below fp16's smallest normal number: smaller ones would lose precision or flush to zero; an
all-zero channel or group still quantizes to zeros, and a channel whose largest weight is below
127 * 6.1e-5 gets an absolute error of at most 3.1e-5 per weight.
"""
from __future__ import annotations

import torch

INT8_MAX = 127                       # symmetric: -128 is never used, so -q is always representable
FP8_DTYPE = torch.float8_e4m3fn
UINT4_MAX = 15
SYMMETRIC_ZERO = 8                   # symmetric 4-bit: q - 8 spans -8..7
SCALE_FLOOR = torch.finfo(torch.float16).tiny
# HQQ's proximal zero-point refinement (Badri & Shaji 2023): an lp-norm (p < 1) shrinkage treats the
# few large rounding residuals as outliers, the zero point is re-fit to the rest, and the penalty
# weight beta grows by kappa each step.
HQQ_P, HQQ_BETA, HQQ_KAPPA, HQQ_ITERS = 0.7, 10.0, 1.01, 20


def _per_channel_scale(weight: torch.Tensor, qmax: float) -> torch.Tensor:
    return (weight.abs().amax(dim=1) / qmax).clamp_min(SCALE_FLOOR).half()


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: int8 ``[out, in]`` in [-127, 127] and fp16 ``[out]``; ``scale[n] = max|W[n]| / 127``
    and ``q = round(W / scale)`` (half to even). Rounding the scale to fp16 can shrink it by 2^-11, so
    |W / scale| can reach 127.06; that still rounds to 127, and the clamp guarantees the int8 cast can
    never wrap (128 would become -128)."""
    w = weight.float()
    scale = _per_channel_scale(w, INT8_MAX)
    q = torch.round(w / scale.float()[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: float8 e4m3 ``[out, in]`` and fp16 ``[out]`` with ``scale[n] = max|W[n]| / 448``."""
    w = weight.float()
    fp8_max = torch.finfo(FP8_DTYPE).max
    scale = _per_channel_scale(w, fp8_max)
    q = (w / scale.float()[:, None]).clamp_(-fp8_max, fp8_max).to(FP8_DTYPE)
    return q, scale


def uint4_grid(groups: torch.Tensor, symmetric: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point (fp16 values, as fp32, ``[..., 1]``) of each row of ``groups [..., group_size]``:
    its [min, max] mapped onto [0, 15], or with ``symmetric`` zero point 8 and scale ``2 * max|w| / 15``."""
    if symmetric:
        scale = (2 * groups.abs().amax(dim=-1, keepdim=True) / UINT4_MAX).clamp_min(SCALE_FLOOR).half().float()
        return scale, torch.full_like(scale, SYMMETRIC_ZERO)
    lo, hi = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
    scale = ((hi - lo) / UINT4_MAX).clamp_min(SCALE_FLOOR).half().float()
    return scale, (-lo / scale).half().float()


def quantize_uint4_groups(weight: torch.Tensor, group_size: int = 64, optimize: bool = True,
                          symmetric: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale, zero)``: uint8 ``[out, in]`` holding 0..15, fp16 ``[out, in / group_size]`` twice, with
    ``W ~ (q - zero) * scale`` per group of ``group_size`` consecutive input columns.

    Round to nearest maps each group's [min, max] onto [0, 15] (the zero point is a real number, as in
    HQQ). With ``optimize`` the zero points are then refined (HQQ) and the best ones seen are kept, so
    the mean absolute error never exceeds round-to-nearest's. With ``symmetric`` every zero point is 8
    and nothing is refined.
    """
    n_out, n_in = weight.shape
    if group_size < 1 or n_in % group_size:
        raise ValueError(f"in_features {n_in} is not a multiple of the group size {group_size}")
    w = weight.float().reshape(-1, group_size)
    scale, zero = uint4_grid(w, symmetric)
    if optimize and not symmetric:
        zero = _refine_zero(w, scale, zero)

    def as_groups(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(n_out, n_in // group_size).half()

    q = _round_uint4(w, scale, zero).to(torch.uint8).reshape(n_out, n_in)
    return q, as_groups(scale), as_groups(zero)


def dequantize_uint4_groups(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """fp32 ``(q - zero) * scale`` for the group layout of :func:`quantize_uint4_groups`."""
    n_out, n_in = q.shape
    groups = q.float().reshape(n_out, scale.shape[1], -1)
    return ((groups - zero.float()[..., None]) * scale.float()[..., None]).reshape(n_out, n_in)


def _round_uint4(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return torch.round(w / scale + zero).clamp_(0, UINT4_MAX)


def _mean_error(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> float:
    return (w - (_round_uint4(w, scale, zero) - zero) * scale).abs().mean().item()


def _refine_zero(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """HQQ's zero-point refinement on groups ``w [groups, group_size]``; returns the best (fp16-exact)
    zero points, stopping early once the error stops improving."""
    best_zero, best_error = zero, _mean_error(w, scale, zero)
    beta = HQQ_BETA
    for _ in range(HQQ_ITERS):
        q = _round_uint4(w, scale, zero)
        residual = w - (q - zero) * scale
        # generalised soft threshold: shrink each residual by |r|^(p-1) / beta, never past zero
        outliers = torch.sign(residual) * torch.relu(residual.abs() - residual.abs().pow(HQQ_P - 1) / beta)
        zero = (q - (w - outliers) / scale).mean(dim=1, keepdim=True).half().float()
        beta *= HQQ_KAPPA
        error = _mean_error(w, scale, zero)
        if error >= best_error:
            break
        best_zero, best_error = zero, error
    return best_zero
