"""The fused forward's own Python (infer/ops/fused.py: FusedKernels.forward) on the CPU, with the compiled ops
replaced by plain-torch versions of their contracts (cuda/rwkv7_fused_op.cpp): which buffers each step reads and
writes, the GEMV and matmul paths, the last block on each row's last two tokens, against the readable forward.
The kernels themselves are tested by test_fused_emulated.py (CPU emulator) and test_fused_cuda.py (GPU)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from infer.batch import PackedBatch
from infer.checkpoint import W8A16_MARKER, W8A16_VERSION
from infer.model import EXP_MINUS_HALF, GROUPNORM_EPS_PER_CHANNEL, LN_EPS, RWKV7
from infer.ops.fused import (EPI_RELU_SQUARE, EPI_SIGMOID, EPI_TANH, FusedKernels, KMajorW8A16Linear, batch_weights,
                             store_ffn_value_k_major)
from infer.ops.wkv import TorchWKV
from infer.quant.export_quant import quantize_matrix
from infer.random_model import make_config, random_state_dict
from op_binding import BindingCheckedOps, build_cpu_binding
from test_fused_cuda import assert_close_pools, run_both

GEMV_ROWS = 8


class TorchFusedOps:
    """The extension module's ops as their contracts say, in torch (fp32 math, fp16 results)."""

    staged_launches = 0  # gemv launches with stages so far
    sparse_int8_launches = 0  # sparse_gemv launches of int8 weights so far

    @staticmethod
    def gemv_max_rows() -> int:
        return GEMV_ROWS

    @staticmethod
    def gemv_max_tasks() -> int:
        return 12

    @staticmethod
    def sparse_gemv_max_rows(int8: bool = False) -> int:
        return 1 if int8 else GEMV_ROWS

    @staticmethod
    def sparse_gemv_workspace(in_features: int, out_features: int, int8: bool = False) -> tuple[int, int]:
        return 1, 1

    @staticmethod
    def ln_shift_mix(x, ln_w, ln_b, shift, prev, slots, lasts, mixes, outs, _stream) -> None:
        xn = F.layer_norm(x.float(), (x.shape[1],), ln_w.float(), ln_b.float(), LN_EPS).half()
        starts = prev < 0
        pv = xn[prev.clamp(min=0).long()]
        pv[starts] = shift[slots[(-prev[starts] - 1).long()]]
        for mix, out in zip(mixes, outs):
            out.copy_((xn.float() + (pv.float() - xn.float()) * mix.float()).half())
        shift[slots] = xn[lasts]

    @staticmethod
    def time_mix(state, slots, starts, lasts, tensors, params, first_layer, max_len, _stream, _blocks=0) -> None:
        r, k, v, dw, da, dv, g, v_first, out = tensors
        w0, r_k, lnx_w, lnx_b, a0, v0, k_k, k_a = params
        T, C = r.shape
        H, N = state.shape[1], state.shape[2]
        w = torch.exp(-EXP_MINUS_HALF * torch.sigmoid(w0 + dw.float()))
        a = torch.sigmoid(a0.float() + da.float())
        kk = F.normalize((k.float() * k_k.float()).view(T, H, N), dim=-1, p=2.0, eps=1e-12).view(T, C)
        k_mod = k.float() * (1 + (a - 1) * k_a.float())
        if first_layer:
            v_first.copy_(v)
            v_mixed = v.float()
        else:
            v_mixed = v.float() + (v_first.float() - v.float()) * torch.sigmoid(v0.float() + dv.float())
        lens = (lasts - starts + 1).tolist()
        batch = PackedBatch(tokens=torch.zeros(T, dtype=torch.long), slots=slots, lens=lens, starts=starts, last=lasts)
        y = TorchWKV()(state, batch, r, w, k_mod, v_mixed, -kk, kk * a)
        y = F.group_norm(y, H, lnx_w, lnx_b, eps=GROUPNORM_EPS_PER_CHANNEL * N)
        bonus = (r.float() * k_mod * r_k.view(C)).view(T, H, N).sum(-1, keepdim=True)
        y = y + (bonus * v_mixed.view(T, H, N)).view(T, C)
        out.copy_(y.half() * g)

    @staticmethod
    def gemv(ws, scales, zeros, xs, ys, residuals, groups, epilogues, _stream, stages=(), sync=None) -> None:
        # a staged launch: every producer (1) before every consumer (2) in the order given (others anywhere)
        stages = list(stages)
        assert not stages or (sync is not None and 1 in stages and 2 in stages and
                              max(i for i, st in enumerate(stages) if st == 1) < stages.index(2))
        TorchFusedOps.staged_launches += bool(stages)
        for w, scale, x, y, residual, epilogue in zip(ws, scales, xs, ys, residuals, epilogues):
            weight = w.float() * scale.float()[:, None] if scale.numel() else w.float()
            product = (x.float() @ weight.T).half().float()
            if epilogue == EPI_RELU_SQUARE:
                product = torch.relu(product) ** 2
            elif epilogue == EPI_TANH:
                product = torch.tanh(product)
            elif epilogue == EPI_SIGMOID:
                product = torch.sigmoid(product)
            y.copy_((product + residual.float() if residual.numel() else product).half())

    @staticmethod
    def sparse_gemv(x, weight_t, scale, y, residual, _partial, _arrivals, _stream) -> None:
        int8 = scale.numel() > 0
        if x.shape[0] > TorchFusedOps.sparse_gemv_max_rows(int8):
            raise RuntimeError("sparse_gemv: too many rows")  # the launcher refuses them too
        product = x.float() @ weight_t.float()
        if int8:
            product = product * scale.float()
            TorchFusedOps.sparse_int8_launches += 1
        y.copy_((residual.float() + product.half().float()).half())

    @staticmethod
    def relu_square_(x, _stream) -> None:
        x.copy_(torch.relu(x.float()).square().half())


@pytest.fixture(scope="module")
def binding(tmp_path_factory):
    """cuda/rwkv7_fused_op.cpp built for the CPU: every op call of the fused forward goes through it first."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler to build the binding")
    source = Path(__file__).resolve().parent.parent / "cuda" / "rwkv7_fused_op.cpp"
    return build_cpu_binding(source, tmp_path_factory.mktemp("fused_binding"))


def fused_pair(sd: dict, binding, engine: str = "fp16") -> tuple[RWKV7, RWKV7]:
    """The model of ``sd`` twice on the CPU: the readable forward, and the fused one on torch ops (each call checked
    against the real binding's argument types)."""
    readable = RWKV7.from_state_dict({k: v.clone() for k, v in sd.items()}, device="cpu", dtype="fp16", engine=engine)
    fused = RWKV7.from_state_dict(sd, device="cpu", dtype="fp16", engine=engine)
    kernels = FusedKernels(BindingCheckedOps(TorchFusedOps(), binding))
    kernels._stream = lambda _tensor: 0  # no CUDA stream on the CPU
    for blk in fused.blocks:
        blk.batched = batch_weights(blk)
    store_ffn_value_k_major(fused, kernels)
    fused.fused = kernels
    return readable, fused


@pytest.fixture(scope="module")
def models(binding):
    """A random fp16 model, readable and fused."""
    return fused_pair(random_state_dict(make_config(3, 128, 512), seed=4, dtype=torch.float32), binding)


@pytest.fixture(scope="module")
def w8a16_models(binding):
    """A random W8A16 model (int8 matrices, fp16 LoRAs), readable and fused."""
    config = make_config(3, 128, 512)
    sd = random_state_dict(config, seed=5, dtype=torch.float32)
    for key in config.linear_keys():
        sd.update(quantize_matrix(key, sd.pop(key)))
    sd[W8A16_MARKER] = torch.tensor(W8A16_VERSION, dtype=torch.int32)
    return fused_pair(sd, binding, engine="cutlass")


def run(models, rows, all_logits=False, gemv_rows=2, steps=1):
    models[1].fused.gemv_rows = gemv_rows
    return run_both(models, rows, [2 * i + 1 for i in range(len(rows))], all_logits=all_logits, steps=steps,
                    num_slots=8)


def assert_match(outs, pools):
    for ref, got in outs:
        assert got.shape == ref.shape and got.dtype == torch.float32
        assert (got - ref).abs().max().item() <= 0.02 * ref.abs().max().item() + 0.02
    assert_close_pools(*pools, wkv_tol=0.05)


@pytest.mark.parametrize("lens", [[1, 1, 1], [5, 1, 12], [40], [3, 2]])
@pytest.mark.parametrize("all_logits", [True, False])
@pytest.mark.parametrize("gemv_rows", [2, 8])
@pytest.mark.parametrize("staged", [False, True, None])
def test_fused_forward_matches_readable(models, lens, all_logits, gemv_rows, staged, monkeypatch):
    """Prefills and decode steps through the GEMV path (up to gemv_rows tokens) and the matmul path; without
    all_logits the last block runs on each row's last two tokens, which can switch a matmul-path prefill to the
    GEMV path for that block ([40]) or shrink a GEMV-path batch's buffers ([3, 2] at 8 rows)."""
    # LoRA second halves as a second stage: forced on, off, or by default (None: not for fp16 r/k/v)
    monkeypatch.setattr(models[1].fused, "staged_loras", staged)
    monkeypatch.setattr(TorchFusedOps, "staged_launches", 0)
    rows = [[(13 * i + 7 * j) % 512 for j in range(n)] for i, n in enumerate(lens)]
    outs, pools = run(models, rows, all_logits, gemv_rows)
    # every layer of a step on the GEMV path stages its LoRAs (the first layer has no value LoRA: 3 second halves)
    assert TorchFusedOps.staged_launches == (3 if staged is True and sum(lens) <= gemv_rows else 0)
    assert outs[0][1].shape[0] == (sum(lens) if all_logits else len(lens))
    assert_match(outs, pools)


@pytest.mark.parametrize("rows", [[[5]], [[5], [77], [300]]])
def test_w8a16_forward_with_sparse_int8_ffn_value(binding, rows, monkeypatch):
    """RWKV_SPARSE_FFN_INT8's path: each W8A16 FFN value K-major too, a row alone through the sparse-input GEMV
    (int8 weights, their scale), more rows through the W8A16 linear, against the readable forward."""
    config = make_config(3, 128, 512)
    sd = random_state_dict(config, seed=6, dtype=torch.float32)
    for key in config.linear_keys():
        sd.update(quantize_matrix(key, sd.pop(key)))
    sd[W8A16_MARKER] = torch.tensor(W8A16_VERSION, dtype=torch.int32)
    readable, fused = fused_pair(sd, binding, engine="cutlass")
    fused.fused.sparse_ffn_int8 = True
    assert store_ffn_value_k_major(fused, fused.fused) == 3
    assert all(isinstance(blk.ffn_value, KMajorW8A16Linear) for blk in fused.blocks)
    monkeypatch.setattr(TorchFusedOps, "sparse_int8_launches", 0)
    outs, pools = run((readable, fused), rows, gemv_rows=8, steps=2)
    assert TorchFusedOps.sparse_int8_launches == (3 * 2 if len(rows) == 1 else 0)  # 3 layers, 2 forwards
    assert_match(outs, pools)


@pytest.mark.parametrize("staged", [None, False])
def test_w8a16_forward_stages_loras_by_default(w8a16_models, staged, monkeypatch):
    """With int8 r/k/v (a W8A16 model) every layer of a decode step stages its LoRAs unless switched off; the
    same outputs either way."""
    monkeypatch.setattr(w8a16_models[1].fused, "staged_loras", staged)
    monkeypatch.setattr(TorchFusedOps, "staged_launches", 0)
    outs, pools = run(w8a16_models, [[5], [77]], gemv_rows=8, steps=2)
    assert TorchFusedOps.staged_launches == (6 if staged is None else 0)
    assert_match(outs, pools)


def test_fused_decode_steps_match_readable(models):
    outs, pools = run(models, [[5], [77], [300]], steps=3)
    assert_match(outs, pools)


def test_last_block_tail_changes_only_the_work(models, monkeypatch):
    """Without all_logits the fused forward's last block runs on 2 tokens per row, not all of them: the FFN key
    products it computes there have those rows."""
    _, fused = models
    shapes = []
    key = fused.blocks[-1].ffn_key
    real = type(key).__call__

    def counted(self, x):
        shapes.append(x.shape[0])
        return real(self, x)

    monkeypatch.setattr(type(key), "__call__", counted)
    run(models, [[1, 2, 3, 4, 5, 6], [7, 8, 9]], all_logits=False)
    assert shapes[-1] == 4 and 9 in shapes  # the earlier blocks: all 9 tokens; the last: 2 + 2
