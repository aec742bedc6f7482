"""GPTQ: 4-bit weights calibrated on text (Frantar et al. 2022), for the GemLite A16W4 export.

Round-to-nearest treats every input column alike. GPTQ quantizes a matrix one input column at a time
and, after each, moves the column's rounding error onto the columns not yet quantized, weighted by how
the layer's inputs correlate (the Hessian ``H = X^T X / n`` of ``||X W^T - X Wq^T||^2`` over calibration
activations X), so the layer's *outputs* on text like the calibration text stay close.

The format is 4-bit per group of input columns, ``W ~ (q - zero) * scale`` with ``q`` in 0..15 and one
fp16 scale and zero point per group, chosen from the group's weights as they are when the group is
reached (after the error of earlier columns has been added): symmetric (zero 8, scale
``2 * max|w| / 15``) or, with zero points, the group's [min, max] onto [0, 15]. It is stored as GemLite's
``A16W4_HQQ_INT``, so the same kernels serve it.

The Hessians are collected with the float model on unquantized inputs, for all matrices at once or in
several passes over the calibration rows when they do not fit ``memory_bytes`` (7.2B: 45 GB in fp32 in
all, the FFN value matrices 1 GB each), instead of quantizing layer after layer on quantized inputs.
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch

from infer.quant.quantize import UINT4_MAX, uint4_grid

DAMPING = 0.01              # of the Hessian's mean diagonal, added to its diagonal (keeps it invertible)
BLOCK_COLUMNS = 128         # columns whose error updates are applied to the rest of the matrix at once


def quantize_uint4_gptq(weight: torch.Tensor, hessian: torch.Tensor, group_size: int = 64, symmetric: bool = True,
                        damping: float = DAMPING) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale, zero)`` in :func:`infer.quant.quantize.quantize_uint4_groups`' convention (uint8
    ``[out, in]`` 0..15, fp16 ``[out, in / group_size]`` twice, ``W ~ (q - zero) * scale``), each group's
    grid chosen as round-to-nearest chooses it (:func:`infer.quant.quantize.uint4_grid`).
    ``hessian`` is ``[in, in]``, e.g. from :func:`collect_hessians`; the work runs on its device."""
    n_out, n_in = weight.shape
    if group_size < 1 or n_in % group_size:
        raise ValueError(f"in_features {n_in} is not a multiple of the group size {group_size}")
    if hessian.shape != (n_in, n_in):
        raise ValueError(f"Hessian of shape {tuple(hessian.shape)} for a matrix of {n_in} input columns")
    w = weight.to(device=hessian.device, dtype=torch.float32).clone()
    h = hessian.to(torch.float32).clone()
    dead = h.diagonal() == 0                 # columns no calibration token ever used
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h.diagonal().add_(damping * h.diagonal().mean())
    # upper Cholesky factor of H^-1: row i holds how column i's error spreads to the later columns
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    q = torch.empty(n_out, n_in, dtype=torch.uint8, device=w.device)
    scale = torch.empty(n_out, n_in // group_size, dtype=torch.float32, device=w.device)
    zero = torch.empty_like(scale)
    for start in range(0, n_in, BLOCK_COLUMNS):
        end = min(start + BLOCK_COLUMNS, n_in)
        errors = torch.empty(n_out, end - start, device=w.device)
        for i in range(start, end):
            g = i // group_size
            if i % group_size == 0:  # later columns of the group already carry earlier errors
                group_scale, group_zero = uint4_grid(w[:, i:i + group_size], symmetric)
                scale[:, g], zero[:, g] = group_scale[:, 0], group_zero[:, 0]
            s, z = scale[:, g], zero[:, g]
            column = w[:, i]
            code = torch.round(column / s + z).clamp_(0, UINT4_MAX)
            q[:, i] = code.to(torch.uint8)
            error = (column - (code - z) * s) / inverse[i, i]
            w[:, i + 1:end] -= error[:, None] * inverse[i, i + 1:end][None, :]
            errors[:, i - start] = error
        w[:, end:] -= errors @ inverse[start:end, end:]
    return q.cpu(), scale.half().cpu(), zero.half().cpu()


class _Recorder:
    """Stands in for one linear layer during calibration: adds its inputs' ``X^T X`` to a running sum."""

    def __init__(self, linear, hessian: torch.Tensor) -> None:
        self.linear, self.hessian, self.tokens = linear, hessian, 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(self.hessian.device, torch.float32)
        self.hessian.addmm_(rows.t(), rows)
        self.tokens += rows.shape[0]
        return self.linear(x)

    def __getattr__(self, name: str):
        return getattr(self.linear, name)


def _owner(model, key: str) -> tuple[object, str]:
    """The object and attribute holding the linear layer of checkpoint matrix ``key``."""
    if key == "head.weight":
        return model, "head"
    _, layer, part, name, _ = key.split(".")
    attribute = {"att": {"receptance": "receptance", "key": "key", "value": "value", "output": "output"},
                 "ffn": {"key": "ffn_key", "value": "ffn_value"}}[part][name]
    return model.blocks[int(layer)], attribute


def collect_hessians(model, keys: Iterable[str], rows: Sequence[Sequence[int]], chunk_size: int = 512,
                     device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """``X^T X / n`` of the inputs of each matrix in ``keys`` (checkpoint names, e.g.
    ``blocks.3.ffn.value.weight``) over one pass of the token ``rows`` through ``model``'s readable
    forward; on ``device`` (default: the model's)."""
    device = torch.device(device) if device is not None else model.device
    recorders: dict[str, _Recorder] = {}
    originals = []
    try:
        for key in keys:
            owner, attribute = _owner(model, key)
            linear = getattr(owner, attribute)
            recorders[key] = _Recorder(linear, torch.zeros(linear.in_features, linear.in_features, device=device))
            originals.append((owner, attribute, linear))
            setattr(owner, attribute, recorders[key])
        fused, model.fused = model.fused, None  # the recorders see the readable forward's calls
        try:
            with torch.no_grad():
                for begin in range(0, len(rows), 8):
                    part = rows[begin:begin + 8]
                    # every position's logits, so that the head sees every token's input, not the last one's
                    model.prefill(part, list(range(len(part))), model.new_state_pool(len(part)), chunk_size,
                                  all_logits=True)
        finally:
            model.fused = fused
    finally:
        for owner, attribute, linear in originals:
            setattr(owner, attribute, linear)
    return {key: rec.hessian / max(rec.tokens, 1) for key, rec in recorders.items()}


class HessianCache:
    """Hessians on demand, in order of use: asking for a key not collected yet runs one calibration pass
    for it and the keys after it, as many as fit ``memory_bytes`` of fp32 Hessians (at least one)."""

    def __init__(self, collect: Callable[[list[str]], dict[str, torch.Tensor]], keys: Sequence[str],
                 widths: dict[str, int], memory_bytes: int) -> None:
        self._collect, self._keys, self._widths, self._memory = collect, list(keys), widths, memory_bytes
        self._ready: dict[str, torch.Tensor] = {}
        self.passes = 0

    def pop(self, key: str) -> torch.Tensor:
        if key not in self._ready:
            start = self._keys.index(key)
            batch, used = [], 0
            for k in self._keys[start:]:
                size = 4 * self._widths[k] ** 2
                if batch and used + size > self._memory:
                    break
                batch.append(k)
                used += size
            self._ready.update(self._collect(batch))
            self.passes += 1
        self._keys.remove(key)
        return self._ready.pop(key)


def calibration_rows(text: str, encode: Callable[[str], list[int]], rows: int, tokens: int) -> list[list[int]]:
    """Up to ``rows`` consecutive pieces of ``tokens`` tokens of ``text`` (the last may be shorter)."""
    ids = encode(text)
    if not ids:
        raise ValueError("the calibration text has no tokens")
    return [ids[i:i + tokens] for i in range(0, min(len(ids), rows * tokens), tokens)]


def calibrated_quantizer(model, keys: Sequence[str], rows: Sequence[Sequence[int]], group_size: int = 64,
                         symmetric: bool = True, memory_bytes: int = 16 << 30
                         ) -> Callable[[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``quantize(key, weight) -> (q, scale, zero)`` for the matrices ``keys`` of the float ``model``, asked
    for in that order: each Hessian is collected on the model's device when first needed (in passes of
    at most ``memory_bytes`` of Hessians) and dropped once its matrix is quantized."""
    widths = {key: getattr(*_owner(model, key)).in_features for key in keys}
    cache = HessianCache(lambda batch: collect_hessians(model, batch, rows), keys, widths, memory_bytes)

    def quantize(key: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return quantize_uint4_gptq(weight, cache.pop(key), group_size, symmetric)

    return quantize
