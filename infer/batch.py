"""The packed token layout shared by the model and the WKV implementations."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[float], device: torch.device | str,
              dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` as a tensor on ``device``, copied without waiting for the device. A copy from pageable host memory
    with ``non_blocking`` returns once the driver has staged the values; ``torch.tensor(values, device=...)`` waits
    for everything queued on the stream first (on an H200 7.6 ms behind a queued sleep kernel, against 0.06 ms:
    bench/results/experiment_h2d_sync_h200.json), so the host could not queue a step while the last one runs."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def to_device_parts(parts: Sequence[Sequence[int]], device: torch.device | str) -> list[torch.Tensor]:
    """Each of ``parts`` as an int64 tensor on ``device``, all in one ``to_device`` copy. Every part starts on a
    16-byte boundary of the copy: the fused kernels read index tensors 16 bytes at a time."""
    values: list[int] = []
    offsets = []
    for part in parts:
        offsets.append(len(values))
        values.extend(part)
        values.extend([0] * (len(part) % 2))
    copied = to_device(values, device)
    return [copied[offset:offset + len(part)] for offset, part in zip(offsets, parts)]


def row_starts(lens: Sequence[int]) -> list[int]:
    """Each packed row's first position, from the host's row lengths."""
    return [0] + list(itertools.accumulate(lens))[:-1]


@dataclass
class PackedBatch:
    """B rows of different lengths packed end to end (no padding).

    Row ``i`` owns tokens ``tokens[starts[i] : starts[i] + lens[i]]`` and reads/writes state
    slot ``slots[i]``. A decode step is the special case where every length is 1.
    """

    tokens: torch.Tensor   # [T] int64, on the model's device
    slots: torch.Tensor    # [B] int64
    lens: list[int]        # host copy of the row lengths
    starts: torch.Tensor   # [B] index of each row's first token
    last: torch.Tensor     # [B] index of each row's last token
    _steps: list[torch.Tensor] | None = field(default=None, repr=False)
    _order: torch.Tensor | None = field(default=None, repr=False)
    _prev: torch.Tensor | None = field(default=None, repr=False)
    _tails: tuple[int, "PackedBatch", torch.Tensor] | None = field(default=None, repr=False)

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[int]], slots: Sequence[int], device: torch.device | str) -> "PackedBatch":
        if len(rows) != len(slots):
            raise ValueError(f"{len(rows)} rows but {len(slots)} slots")
        if len(set(slots)) != len(slots):
            raise ValueError("a slot may appear only once in a batch")
        lens = [len(r) for r in rows]
        if not lens or min(lens) < 1:
            raise ValueError("every row needs at least one token")
        flat = [t for r in rows for t in r]
        starts = row_starts(lens)
        last = [s + n - 1 for s, n in zip(starts, lens)]
        tokens, slot_ids, starts_t, last_t = to_device_parts([flat, list(slots), starts, last], device)
        return cls(tokens=tokens, slots=slot_ids, lens=lens, starts=starts_t, last=last_t)

    @classmethod
    def decode(cls, tokens: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> "PackedBatch":
        """A decode step: one token per row, row i at position i (``rows`` = arange over the rows, on
        the tokens' device); the tensors are used as they are (a CUDA graph's static buffers)."""
        return cls(tokens=tokens, slots=slots, lens=[1] * len(tokens), starts=rows, last=rows)

    @property
    def num_rows(self) -> int:
        return len(self.lens)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def prev_index(self) -> torch.Tensor:
        """[T] int32 for the fused kernels: each token's previous token in its row, or ``-(row + 1)``
        for a row's first token (whose previous input is the slot's saved state). Built once per batch
        from the host lengths, so a CUDA graph that captured it keeps reading the same buffer."""
        if self._prev is None:
            prev = torch.arange(-1, self.num_tokens - 1, dtype=torch.int32)
            starts = torch.tensor(row_starts(self.lens), dtype=torch.long)
            prev[starts] = -1 - torch.arange(self.num_rows, dtype=torch.int32)
            self._prev = prev.to(self.tokens.device, non_blocking=True)
        return self._prev

    def tails(self, n: int) -> tuple["PackedBatch", torch.Tensor]:
        """Each row's last ``n`` tokens (all of a shorter row) as a batch on the same slots, and their
        positions in this batch ([T'] int64). Built once per batch, as ``prev_index``."""
        if self._tails is None or self._tails[0] != n:
            lens = [min(length, n) for length in self.lens]
            ends = itertools.accumulate(self.lens)
            index = [p for end, k in zip(ends, lens) for p in range(end - k, end)]
            starts = row_starts(lens)
            positions, tail_starts, tail_last = to_device_parts(
                [index, starts, [s + k - 1 for s, k in zip(starts, lens)]], self.tokens.device)
            tail = PackedBatch(tokens=self.tokens[positions], slots=self.slots, lens=lens, starts=tail_starts,
                               last=tail_last)
            self._tails = (n, tail, positions)
        return self._tails[1], self._tails[2]

    def readout_tail(self) -> tuple["PackedBatch", torch.Tensor] | None:
        """What the last block of a forward that reads out only each row's last token needs: each row's last two
        tokens (that token's FFN shifts in the one before it), ``tails(2)``; None when no row is longer."""
        return self.tails(2) if max(self.lens) > 2 else None

    def time_steps(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """For step-by-step recurrences: rows ordered longest first, and for each time step
        the packed indices of that step's tokens for the rows still running (a prefix of
        the order)."""
        if self._steps is None:
            order = sorted(range(self.num_rows), key=lambda i: -self.lens[i])
            starts = row_starts(self.lens)  # the host's copy: no read from the device
            steps = []
            for t in range(max(self.lens)):
                steps.append([starts[i] + t for i in order if self.lens[i] > t])
            device = self.tokens.device
            self._order = to_device(order, device)
            self._steps = to_device_parts(steps, device)
        return self._order, self._steps
