"""The recurrent state of every running sequence, kept in a preallocated pool of slots.

Layout (per layer ``l`` and slot ``s``; one running row owns one slot for its life):

- ``att_shift[l, s]``  [C]          last normalised input of the time-mix (token shift), activation dtype
- ``wkv[l, s]``        [H, N, N]    WKV matrix ``S[h, value, key]``, fp32 (or fp16 by option)
- ``ffn_shift[l, s]``  [C]          last normalised input of the channel-mix, activation dtype

This is the official ``rwkv`` package's per-layer state ``[3l+0], [3l+1], [3l+2]`` with a slot
axis added; a zero state is an empty context. ``v_first`` is not state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from infer.batch import to_device
from infer.checkpoint import ModelConfig


@dataclass
class SlotState:
    """One sequence's state, detached from the pool (host copies by default)."""

    att_shift: torch.Tensor  # [L, C]
    wkv: torch.Tensor        # [L, H, N, N]
    ffn_shift: torch.Tensor  # [L, C]

    def to_official(self) -> list[torch.Tensor]:
        """The official package's state list: for each layer att_x_prev, S (fp32), ffn_x_prev."""
        out: list[torch.Tensor] = []
        for layer in range(self.wkv.shape[0]):
            out += [self.att_shift[layer].clone(), self.wkv[layer].float().clone(), self.ffn_shift[layer].clone()]
        return out

    @classmethod
    def from_official(cls, state: Sequence[torch.Tensor]) -> "SlotState":
        return cls(att_shift=torch.stack(list(state[0::3])), wkv=torch.stack(list(state[1::3])),
                   ffn_shift=torch.stack(list(state[2::3])))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.att_shift, self.wkv, self.ffn_shift))


class StatePool:
    def __init__(self, config: ModelConfig, num_slots: int, device: torch.device | str,
                 dtype: torch.dtype, wkv_dtype: torch.dtype = torch.float32):
        L, C, H, N = config.n_layer, config.n_embd, config.n_head, config.head_size
        self.config = config
        self.num_slots = num_slots
        self.att_shift = torch.zeros(L, num_slots, C, dtype=dtype, device=device)
        self.wkv = torch.zeros(L, num_slots, H, N, N, dtype=wkv_dtype, device=device)
        self.ffn_shift = torch.zeros(L, num_slots, C, dtype=dtype, device=device)

    @property
    def bytes_per_slot(self) -> int:
        return sum(t[:, 0].numel() * t.element_size() for t in (self.att_shift, self.wkv, self.ffn_shift))

    def reset(self, slots: Sequence[int]) -> None:
        """Zero the given slots (a fresh, empty context)."""
        idx = to_device(list(slots), self.wkv.device)
        for pool in (self.att_shift, self.wkv, self.ffn_shift):
            pool.index_fill_(1, idx, 0)

    def export_slot(self, slot: int, device: torch.device | str = "cpu") -> SlotState:
        return SlotState(att_shift=self.att_shift[:, slot].to(device, copy=True),
                         wkv=self.wkv[:, slot].to(device, copy=True),
                         ffn_shift=self.ffn_shift[:, slot].to(device, copy=True))

    def import_slot(self, slot: int, state: SlotState) -> None:
        expected = (tuple(self.att_shift[:, slot].shape), tuple(self.wkv[:, slot].shape))
        got = (tuple(state.att_shift.shape), tuple(state.wkv.shape))
        if got != expected or state.ffn_shift.shape != state.att_shift.shape:
            raise ValueError(f"state shape {got} does not fit this model's slots {expected}")
        self.att_shift[:, slot].copy_(state.att_shift)
        self.wkv[:, slot].copy_(state.wkv)
        self.ffn_shift[:, slot].copy_(state.ffn_shift)
