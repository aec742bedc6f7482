"""infer/ops/persistent.py's bookkeeping without a GPU: which steps the persistent kernel covers, one program per
model and state pool, built once and released with its model, and the refusal of models it cannot run. The kernel
itself: test_step_emulated.py (CPU emulation) and test_step_cuda.py (GPU)."""
from __future__ import annotations

import gc

import torch

from infer.batch import PackedBatch
from infer.model import RWKV7
from infer.ops.persistent import DIMS, LAYER_ENTRIES, MODEL_ENTRIES, PersistentStep
from infer.random_model import make_config, random_state_dict


class FakeKernel:
    """The compiled module's interface: counts the programs built."""

    def __init__(self):
        self.built = []

    def entries(self, which: int) -> int:
        return (len(MODEL_ENTRIES), len(LAYER_ENTRIES), DIMS)[which]

    def workspace(self, dims: torch.Tensor, which: int) -> int:
        return 16

    def build(self, dims: torch.Tensor, model: torch.Tensor, layers: torch.Tensor) -> torch.Tensor:
        assert model.shape == (len(MODEL_ENTRIES),) and layers.shape == (int(dims[0]), len(LAYER_ENTRIES))
        self.built.append(dims.clone())
        return torch.zeros(8, dtype=torch.uint8)


def _model(dtype: str) -> RWKV7:
    return RWKV7.from_state_dict(random_state_dict(make_config(2, 128, 256), seed=1, dtype=torch.float32),
                                 device="cpu", dtype=dtype)


def test_one_program_per_model_and_pool_built_once():
    kernel = FakeKernel()
    step = PersistentStep(kernel)
    model = _model("fp16")
    pool, other = model.new_state_pool(3), model.new_state_pool(5, torch.float16)
    one = PackedBatch.from_rows([[7]], [1], "cpu")
    assert step.covers(model, one, pool) and step.covers(model, one, pool)
    assert len(kernel.built) == 1
    assert step.covers(model, one, other)
    assert len(kernel.built) == 2
    assert kernel.built[1][9] == 1 and kernel.built[1][10] == 5  # fp16 states, 5 slots
    # steps of more than one token take the launches
    assert not step.covers(model, PackedBatch.from_rows([[7, 8]], [1], "cpu"), pool)
    assert not step.covers(model, PackedBatch.from_rows([[7], [8]], [1, 2], "cpu"), pool)
    assert len(kernel.built) == 2
    del model, pool, other
    gc.collect()
    assert len(step._plans) == 0  # the programs hold the model's addresses: they go with it


def test_models_it_cannot_run_are_refused_once():
    kernel = FakeKernel()
    step = PersistentStep(kernel)
    model = _model("fp32")
    pool = model.new_state_pool(2)
    one = PackedBatch.from_rows([[7]], [0], "cpu")
    assert not step.covers(model, one, pool) and not step.covers(model, one, pool)
    assert kernel.built == []
