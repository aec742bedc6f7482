"""PackedBatch's index tensors: their values, and the 16-byte alignment the fused kernels' binding requires of
each (they are copied to the device in one piece, then viewed)."""
from __future__ import annotations

import pytest
import torch

from infer.batch import PackedBatch, to_device_parts


def assert_aligned(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.data_ptr() % 16 == 0, "a part does not start on a 16-byte boundary"
        assert t.dtype == torch.long and t.is_contiguous()


@pytest.mark.parametrize("parts", [[[1], [2, 3], [4, 5, 6]], [[7, 8, 9], [], [10]], [[11]]])
def test_parts_keep_their_values_and_start_aligned(parts):
    got = to_device_parts(parts, "cpu")
    assert [t.tolist() for t in got] == parts
    assert_aligned(*got)


@pytest.mark.parametrize("lens", [[1, 1, 1], [5, 1, 12], [3], [2, 7]])
def test_packed_rows(lens):
    rows = [[100 * i + j for j in range(n)] for i, n in enumerate(lens)]
    slots = [7, 3, 5][:len(lens)]
    batch = PackedBatch.from_rows(rows, slots, "cpu")
    starts = [sum(lens[:i]) for i in range(len(lens))]
    assert batch.tokens.tolist() == [t for r in rows for t in r]
    assert batch.slots.tolist() == slots
    assert batch.starts.tolist() == starts
    assert batch.last.tolist() == [s + n - 1 for s, n in zip(starts, lens)]
    assert_aligned(batch.tokens, batch.slots, batch.starts, batch.last)
    tail, positions = batch.tails(2)
    assert tail.lens == [min(n, 2) for n in lens]
    assert tail.tokens.tolist() == [t for r in rows for t in r[-2:]]
    assert batch.tokens[positions].tolist() == tail.tokens.tolist()
    assert_aligned(positions, tail.starts, tail.last)
    order, steps = batch.time_steps()
    assert [lens[i] for i in order.tolist()] == sorted(lens, reverse=True)
    assert [len(s) for s in steps] == [sum(n > t for n in lens) for t in range(max(lens))]
    assert sorted(p for s in steps for p in s.tolist()) == list(range(sum(lens)))
