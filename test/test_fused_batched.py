"""The large-batch side of the fused forward that is plain torch (infer/ops/fused.py): the stacked
weights behind its batched matmuls, and what those matmuls compute, against the model's own linears.
Runs on the CPU; test_fused_cuda.py runs the whole fused forward on a GPU."""
from __future__ import annotations

import torch

from infer.ops.fused import BatchedWeights, KMajorLinear, add_product, batch_weights, batched_projections
from infer.ops.linear_w8a16 import W8A16Linear
from infer.model import RWKV7
from infer.random_model import make_config, random_state_dict

ROWS = 5


def model_fp16() -> RWKV7:
    # width 768: the released LoRA ranks (w 64, a 64, v 32, g 128), so the v factors are padded
    config = make_config(2, 768, 1024)
    return RWKV7.from_state_dict(random_state_dict(config, seed=3, dtype=torch.float16), device="cpu", dtype="fp16")


def test_stacks_share_the_linears_storage_and_keep_their_values():
    model = model_fp16()
    blk = model.blocks[1]
    names = ("receptance", "key", "value", "w1", "w2", "a1", "a2", "v1", "v2")
    before = {n: getattr(blk, n).weight.clone() for n in names}
    stacked = batch_weights(blk)
    assert isinstance(stacked, BatchedWeights)
    assert stacked.rkv.shape == (3, 768, 768)
    assert stacked.lora_down.shape == (3, 64, 768) and stacked.lora_up.shape == (3, 768, 64)
    for n in names:
        assert torch.equal(getattr(blk, n).weight, before[n]), n
        assert getattr(blk, n).weight.is_contiguous(), n
    stores = {"rkv": stacked.rkv, "down": stacked.lora_down, "up": stacked.lora_up}
    shared = {"receptance": "rkv", "key": "rkv", "value": "rkv", "v1": "down", "w1": "down", "a1": "down",
              "w2": "up", "a2": "up"}
    for n, where in shared.items():
        assert getattr(blk, n).weight.untyped_storage().data_ptr() == stores[where].untyped_storage().data_ptr(), n
    # v2 (rank 32 of 64) keeps its own contiguous copy; its padding columns in the stack are zero
    assert torch.count_nonzero(stacked.lora_up[0, :, 32:]) == 0
    assert torch.count_nonzero(stacked.lora_down[0, 32:]) == 0
    assert torch.equal(stacked.lora_up[0, :, :32], blk.v2.weight)


def test_batched_projections_match_the_linears():
    model = model_fp16()
    gen = torch.Generator().manual_seed(4)
    for layer, blk in enumerate(model.blocks):
        mixed = torch.randn(6, ROWS, 768, generator=gen).half()  # r, k, v, w, a, g
        xr, xk, xv, xw, xa, xg = mixed.unbind(0)
        want = [blk.receptance(xr), blk.key(xk), blk.value(xv), blk.w2(torch.tanh(blk.w1(xw))), blk.a2(blk.a1(xa))]
        want.append(blk.v2(blk.v1(xv)) if layer else None)
        want.append(blk.g2(torch.sigmoid(blk.g1(xg))))
        blk.batched = batch_weights(blk)
        got = batched_projections(blk, mixed, first_layer=layer == 0)
        assert len(got) == 7
        for name, g, w in zip(("r", "k", "v", "dw", "da", "dv", "g"), got, want):
            if w is None:
                assert g is None, name
                continue
            assert g.shape == w.shape and g.is_contiguous(), name
            scale = float(w.abs().max())
            assert float((g.float() - w.float()).abs().max()) <= 2e-3 * scale + 1e-3, (layer, name)


def test_quantized_blocks_stack_only_the_lora_factors():
    """A block with a quantized r/k/v matrix: its LoRA factors are still stacked (they stay fp16), r/k/v are not
    (nothing re-pointed), and the projections take each r/k/v linear on its own."""
    model = model_fp16()
    gen = torch.Generator().manual_seed(6)
    for layer, blk in enumerate(model.blocks):
        weight = blk.key.weight
        q = torch.randint(-127, 128, weight.shape, dtype=torch.int8, generator=gen)
        blk.key = W8A16Linear(q, torch.full((weight.shape[0],), 0.002, dtype=torch.float16))
        receptance = blk.receptance.weight
        blk.batched = batch_weights(blk)
        assert blk.batched.rkv is None and blk.receptance.weight is receptance
        assert blk.batched.lora_down.shape == ((3 if layer else 2), 64, 768)
        assert blk.w1.weight.untyped_storage().data_ptr() == blk.batched.lora_down.untyped_storage().data_ptr()
        mixed = torch.randn(6, ROWS, 768, generator=gen).half()
        xr, xk, xv, xw, xa, _ = mixed.unbind(0)
        r, k, v, dw, da, dv, _ = batched_projections(blk, mixed, first_layer=layer == 0)
        assert torch.equal(k, blk.key(xk)) and torch.equal(r, blk.receptance(xr)) and torch.equal(v, blk.value(xv))
        want_dw = blk.w2(torch.tanh(blk.w1(xw)))
        assert float((dw.float() - want_dw.float()).abs().max()) <= 2e-3 * float(want_dw.abs().max()) + 1e-3
        assert (dv is None) == (layer == 0)


def test_blocks_with_quantized_lora_factors_are_not_stacked():
    for name in ("a1", "g2"):  # a stacked factor, and the gate's (the chain multiplies its weight directly)
        model = model_fp16()
        blk = model.blocks[1]
        weight = getattr(blk, name).weight
        setattr(blk, name, W8A16Linear(torch.zeros(weight.shape, dtype=torch.int8),
                                       torch.ones(weight.shape[0], dtype=torch.float16)))
        receptance = blk.receptance.weight
        assert batch_weights(blk) is None, name
        assert blk.receptance.weight is receptance  # nothing was re-pointed


def test_add_product_adds_the_product_in_place():
    model = model_fp16()
    lin = model.blocks[0].output
    gen = torch.Generator().manual_seed(5)
    y = torch.randn(ROWS, 768, generator=gen).half()
    x = torch.randn(ROWS, 768, generator=gen).half()
    want = x.float() + y.float() @ lin.weight.float().t()
    target = x.clone()
    add_product(target, lin, y)
    assert float((target.float() - want).abs().max()) <= 1e-2 * float(want.abs().max())
    assert not torch.equal(target, x)
    value = model.blocks[0].ffn_value  # a K-major matrix (the FFN value's sparse-input layout): W^T is its storage
    hidden = torch.randn(ROWS, value.in_features, generator=gen).half()
    want = x.float() + hidden.float() @ value.weight.float().t()
    target = x.clone()
    add_product(target, KMajorLinear(value.weight, (None, None)), hidden)
    assert float((target.float() - want).abs().max()) <= 1e-2 * float(want.abs().max())
    q = torch.randint(-127, 128, (768, 768), dtype=torch.int8, generator=gen)
    quant = W8A16Linear(q, torch.full((768,), 1e-3, dtype=torch.float16))
    target = x.clone()
    add_product(target, quant, y)  # a quantized linear adds its own product
    assert torch.equal(target, x + quant(y))


def test_a_failed_4bit_self_test_switches_off_only_the_4bit_tasks():
    """FusedKernels.operands: the grouped GEMV's operands of each linear; 4-bit GemLite words drop out (to
    GemLite's kernels) once the 4-bit self-test failed, while fp16 and int8 layers keep the GEMV."""
    from types import SimpleNamespace

    from infer.ops.fused import FusedKernels
    from infer.ops.linear import DenseLinear
    kernels = FusedKernels(SimpleNamespace(gemv_max_rows=lambda: 8, sparse_gemv_max_rows=lambda int8=False: 4))
    words = torch.zeros(16, 48, dtype=torch.int32)
    meta = torch.zeros(4, 48, dtype=torch.float16)
    uint4 = SimpleNamespace(uint4_groups=(words, meta, meta, 32), in_features=128, out_features=48)
    dense = DenseLinear(torch.zeros(48, 128, dtype=torch.float16))
    int8 = W8A16Linear(torch.zeros(48, 128, dtype=torch.int8), torch.ones(48, dtype=torch.float16))
    assert kernels.operands(uint4).weight is words
    kernels.uint4 = False
    assert kernels.operands(uint4) is None
    assert kernels.operands(dense).weight is dense.weight and kernels.operands(int8).scale is int8.scale


def test_ffn_value_stored_k_major_keeps_the_product():
    """store_ffn_value_k_major: each dense fp16 FFN value linear becomes a KMajorLinear over the transposed
    weights ([in, out], contiguous; ``weight`` a view with the same values), one workspace for the model; the
    GEMV operands say K-major; the linear and add_product still compute x W^T; a second call and non-fp16
    linears swap nothing."""
    from types import SimpleNamespace

    from infer.ops.fused import FusedKernels, KMajorLinear, store_ffn_value_k_major
    model = model_fp16()
    asked = []
    kernels = FusedKernels(SimpleNamespace(gemv_max_rows=lambda: 8, sparse_gemv_max_rows=lambda int8=False: 4,
                                           sparse_gemv_workspace=lambda k, n, int8: asked.append((k, n)) or [7, 3]))
    before = [blk.ffn_value.weight.clone() for blk in model.blocks]
    assert store_ffn_value_k_major(model, kernels) == len(model.blocks) == 2
    assert asked == [(3072, 768)]  # one workspace, of the FFN value shape
    gen = torch.Generator().manual_seed(6)
    for blk, weight in zip(model.blocks, before):
        lin = blk.ffn_value
        assert isinstance(lin, KMajorLinear) and lin.workspace is model.blocks[0].ffn_value.workspace
        assert lin.workspace[0].shape == (7,) and lin.workspace[1].dtype == torch.int32
        assert lin.weight_t.shape == (3072, 768) and lin.weight_t.is_contiguous()
        assert torch.equal(lin.weight, weight) and lin.weight.data_ptr() == lin.weight_t.data_ptr()
        ops = kernels.operands(lin)
        assert ops.k_major and ops.weight is lin.weight_t
        x = torch.randn(ROWS, 3072, generator=gen).relu().square().half()
        want = x.float() @ weight.float().t()
        assert float((lin(x).float() - want).abs().max()) <= 1e-2 * float(want.abs().max())
        target = torch.zeros(ROWS, 768, dtype=torch.float16)
        add_product(target, lin, x)
        assert float((target.float() - want).abs().max()) <= 1e-2 * float(want.abs().max())
    assert store_ffn_value_k_major(model, kernels) == 0
    assert not kernels.operands(model.blocks[0].output).k_major
    w8 = model_fp16()
    w8.blocks[0].ffn_value = W8A16Linear(torch.zeros(768, 3072, dtype=torch.int8), torch.ones(768, dtype=torch.float16))
    assert store_ffn_value_k_major(w8, kernels) == 1  # the fp16 one of block 1 only (int8 ones: switched on below)


def test_int8_ffn_value_stored_k_major_when_switched_on():
    """With sparse_ffn_int8 a W8A16 FFN value becomes a KMajorW8A16Linear: the int8 weights transposed and
    contiguous beside the [out, in] ones (which larger batches read), the same scale, a workspace asked for int8
    weights; its product is still x (q * scale)^T."""
    from types import SimpleNamespace

    from infer.ops.fused import FusedKernels, KMajorW8A16Linear, store_ffn_value_k_major
    from infer.ops.linear_w8a16 import dequantize_matmul
    asked = []
    kernels = FusedKernels(SimpleNamespace(
        gemv_max_rows=lambda: 8, sparse_gemv_max_rows=lambda int8=False: 1 if int8 else 4,
        sparse_gemv_workspace=lambda k, n, int8: asked.append((k, n, int8)) or [7, 3]))
    kernels.sparse_ffn, kernels.sparse_ffn_int8 = False, True
    gen = torch.Generator().manual_seed(8)
    q = torch.randint(-127, 128, (768, 3072), generator=gen, dtype=torch.int8)
    scale = (torch.rand(768, generator=gen) * 0.01).half()
    model = model_fp16()
    model.blocks[0].ffn_value = W8A16Linear(q, scale)
    assert store_ffn_value_k_major(model, kernels) == 1  # the W8A16 one only: fp16 ones are switched off here
    lin = model.blocks[0].ffn_value
    assert isinstance(lin, KMajorW8A16Linear) and asked == [(3072, 768, True)]
    assert lin.weight_t.dtype == torch.int8 and lin.weight_t.is_contiguous() and torch.equal(lin.weight_t, q.t())
    assert torch.equal(lin.qweight, q) and lin.scale is scale and "K-major" in lin.kind
    x = torch.randn(ROWS, 3072, generator=gen).relu().square().half()
    assert torch.equal(lin(x), dequantize_matmul(x, q, scale))


def test_sparse_ffn_value_switch(monkeypatch):
    """RWKV_SPARSE_FFN=0 keeps the FFN value matrices dense (the A/B switch the benchmarks use); by default
    the fused forward stores them K-major, and the sparse GEMV takes up to the kernel's row limit."""
    from types import SimpleNamespace

    from infer.ops.fused import FusedKernels
    module = SimpleNamespace(gemv_max_rows=lambda: 8, sparse_gemv_max_rows=lambda int8=False: 1 if int8 else 4)
    monkeypatch.delenv("RWKV_SPARSE_FFN", raising=False)
    monkeypatch.delenv("RWKV_SPARSE_FFN_INT8", raising=False)
    kernels = FusedKernels(module)
    assert kernels.sparse_ffn and kernels.sparse_rows == 4
    assert not kernels.sparse_ffn_int8 and kernels.sparse_int8_rows == 1  # int8: off (memory against gain)
    monkeypatch.setenv("RWKV_SPARSE_FFN", "0")
    assert not FusedKernels(module).sparse_ffn
    monkeypatch.setenv("RWKV_SPARSE_FFN_INT8", "1")
    assert FusedKernels(module).sparse_ffn_int8
    no_int8 = SimpleNamespace(gemv_max_rows=lambda: 8, sparse_gemv_max_rows=lambda int8=False: 0 if int8 else 4)
    assert not FusedKernels(no_int8).sparse_ffn_int8  # a source without the int8 kernel (the HIP port)


def test_lora_side_streams_switch(monkeypatch):
    """RWKV_LORA_STREAM: how many side streams the large-batch LoRA chains take (default 2, one per chain; clamped to
    0-2), and none for tensors off CUDA, whatever the setting (the GPU test checks the results are the same)."""
    from types import SimpleNamespace

    from infer.ops.fused import FusedKernels
    module = SimpleNamespace(gemv_max_rows=lambda: 8, sparse_gemv_max_rows=lambda int8=False: 4)
    monkeypatch.delenv("RWKV_LORA_STREAM", raising=False)
    assert FusedKernels(module).lora_streams == 2
    for value, want in (("0", 0), ("1", 1), ("7", 2)):
        monkeypatch.setenv("RWKV_LORA_STREAM", value)
        kernels = FusedKernels(module)
        assert kernels.lora_streams == want, value
        assert kernels._lora_sides(torch.device("cpu")) == ()
