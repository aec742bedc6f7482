"""Dense linear layers: every row's result is independent of how many rows share the call (CPU)."""
from __future__ import annotations

import pytest
import torch

from infer.ops.linear import DenseLinear


@pytest.mark.parametrize("in_f,out_f", [(128, 128), (192, 768), (768, 192), (128, 32), (32, 128), (256, 65536)])
def test_rows_are_batch_invariant(in_f, out_f):
    g = torch.Generator().manual_seed(in_f * 7 + out_f)
    layer = DenseLinear(torch.randn(out_f, in_f, generator=g))
    x = torch.randn(40, in_f, generator=g)
    full = layer(x)
    assert torch.allclose(full, x @ layer.weight.T, atol=1e-4, rtol=1e-4)
    for rows in range(1, 40):
        assert torch.equal(layer(x[:rows]), full[:rows]), f"{rows} rows differ from the same rows in a batch of 40"
        assert torch.equal(layer(x[rows:rows + 1])[0], full[rows])
