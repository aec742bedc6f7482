"""The WKV-7 recurrence over a pool of state slots.

Every implementation has the same contract (``WKV``): read each row's state from
``state[slot]``, run the row's tokens through the recurrence in order, write the final
state back to the slot, and return ``y`` for every token (fp32). Per head, with the state
``S`` in [value, key] layout and the kernel convention ``a = -kk``, ``b = kk * a_gate``::

    S <- S * w[None, :] + (S @ a)[:, None] * b[None, :] + v[:, None] * k[None, :]
    y  = S @ r

``w`` is the multiplicative decay in (0, 1), already computed in fp32.
"""
from __future__ import annotations

from typing import Protocol

import torch

from infer.batch import PackedBatch


class WKV(Protocol):
    name: str

    def __call__(self, state: torch.Tensor, batch: PackedBatch, r: torch.Tensor, w: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """state: [S, H, N, N] pool of one layer; r,w,k,v,a,b: [T, C]; returns y [T, C] fp32."""
        ...


class TorchWKV:
    """Portable reference: a step loop in plain torch, fp32 math, any device.

    It gathers the batch's states and scatters them back once per call; the CUDA kernels
    update the pool in place instead.
    """

    name = "torch (portable reference)"

    def __call__(self, state, batch, r, w, k, v, a, b):
        num_slots, H, N, _ = state.shape
        T = r.shape[0]
        order, steps = batch.time_steps()
        slots = batch.slots[order]
        S = state[slots].float()
        r, w, k, v, a, b = (t.float().view(T, H, N) for t in (r, w, k, v, a, b))
        y = torch.empty(T, H, N, dtype=torch.float32, device=r.device)
        for idx in steps:
            n = idx.shape[0]
            s = S[:n]
            sa = (s * a[idx].unsqueeze(2)).sum(-1, keepdim=True)           # [n,H,N,1] uses the old state
            s = s * w[idx].unsqueeze(2) + sa * b[idx].unsqueeze(2) + v[idx].unsqueeze(3) * k[idx].unsqueeze(2)
            y[idx] = (s * r[idx].unsqueeze(2)).sum(-1)                       # read-out from the new state
            S[:n] = s
        state[slots] = S.to(state.dtype)
        return y.view(T, H * N)
