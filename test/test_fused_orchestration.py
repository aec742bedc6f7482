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
from infer.ops.fused import (EPI_RELU_SQUARE, EPI_SIGMOID, EPI_TANH, PREFETCH_EARLY, PREFETCH_FFN_VALUE, PREFETCH_LN1,
                             PREFETCH_LN2, PREFETCH_TIME_MIX, FusedKernels, KMajorLinear, KMajorW8A16Linear, batch_weights,
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
    lora_time_mixes = 0  # time_mix launches that computed the LoRA second halves so far
    sparse_int8_launches = 0  # sparse_gemv launches of int8 weights so far
    prefetches: list = []  # (op, tensors, byte counts, early) of every ln_shift_mix / time_mix / sparse_gemv call

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
    def ln_shift_mix(x, ln_w, ln_b, shift, prev, slots, lasts, mixes, outs, _stream, prefetch=(), prefetch_bytes=(),
                     prefetch_early=False) -> None:
        TorchFusedOps.prefetches.append(("ln_shift_mix", list(prefetch), list(prefetch_bytes), prefetch_early))
        xn = F.layer_norm(x.float(), (x.shape[1],), ln_w.float(), ln_b.float(), LN_EPS).half()
        starts = prev < 0
        pv = xn[prev.clamp(min=0).long()]
        pv[starts] = shift[slots[(-prev[starts] - 1).long()]]
        for mix, out in zip(mixes, outs):
            out.copy_((xn.float() + (pv.float() - xn.float()) * mix.float()).half())
        shift[slots] = xn[lasts]

    @staticmethod
    def time_mix(state, slots, starts, lasts, tensors, params, first_layer, max_len, _stream, _blocks=0,
                 loras=(), prefetch=(), prefetch_bytes=(), prefetch_early=False) -> None:
        TorchFusedOps.prefetches.append(("time_mix", list(prefetch), list(prefetch_bytes), prefetch_early))
        r, k, v, dw, da, dv, g, v_first, out = tensors
        w0, r_k, lnx_w, lnx_b, a0, v0, k_k, k_a = params
        T, C = r.shape
        if loras:  # the LoRA second halves first: h W^T into dw, da, dv, g
            assert max_len == 1
            TorchFusedOps.lora_time_mixes += 1
            for h, weight, y in zip(loras[:4], loras[4:], (dw, da, dv, g)):
                if h.numel():
                    y.copy_((h.float() @ weight.float().T).half())
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
    def sparse_gemv(x, weight_t, scale, y, residual, _partial, _arrivals, _stream, prefetch=(), prefetch_bytes=(),
                    prefetch_early=False) -> None:
        TorchFusedOps.prefetches.append(("sparse_gemv", list(prefetch), list(prefetch_bytes), prefetch_early))
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
@pytest.mark.parametrize("time_mix_loras", [True, False])
def test_fused_forward_matches_readable(models, lens, all_logits, gemv_rows, staged, time_mix_loras, monkeypatch):
    """Prefills and decode steps through the GEMV path (up to gemv_rows tokens) and the matmul path; without
    all_logits the last block runs on each row's last two tokens, which can switch a matmul-path prefill to the
    GEMV path for that block ([40]) or shrink a GEMV-path batch's buffers ([3, 2] at 8 rows)."""
    # LoRA second halves in the time mix (rows of one token), else as a second stage: forced on, off, or by default
    # (None: not for fp16 r/k/v)
    monkeypatch.setattr(models[1].fused, "staged_loras", staged)
    monkeypatch.setattr(models[1].fused, "time_mix_loras", time_mix_loras)
    monkeypatch.setattr(TorchFusedOps, "staged_launches", 0)
    monkeypatch.setattr(TorchFusedOps, "lora_time_mixes", 0)
    rows = [[(13 * i + 7 * j) % 512 for j in range(n)] for i, n in enumerate(lens)]
    outs, pools = run(models, rows, all_logits, gemv_rows)
    # every layer of a step on the GEMV path computes its LoRA second halves in the time mix or stages them
    gemv_path = sum(lens) <= gemv_rows
    folded = gemv_path and time_mix_loras and max(lens) == 1
    assert TorchFusedOps.lora_time_mixes == (3 if folded else 0)
    assert TorchFusedOps.staged_launches == (3 if staged is True and gemv_path and not folded else 0)
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
@pytest.mark.parametrize("time_mix_loras", [True, False])
def test_w8a16_forward_stages_loras_by_default(w8a16_models, staged, time_mix_loras, monkeypatch):
    """With int8 r/k/v (a W8A16 model; its LoRAs fp16) every layer of a decode step computes its LoRA second
    halves in the time mix, or without that stages them unless switched off; the same outputs every way."""
    monkeypatch.setattr(w8a16_models[1].fused, "staged_loras", staged)
    monkeypatch.setattr(w8a16_models[1].fused, "time_mix_loras", time_mix_loras)
    monkeypatch.setattr(TorchFusedOps, "staged_launches", 0)
    monkeypatch.setattr(TorchFusedOps, "lora_time_mixes", 0)
    outs, pools = run(w8a16_models, [[5], [77]], gemv_rows=8, steps=2)
    assert TorchFusedOps.lora_time_mixes == (6 if time_mix_loras else 0)  # 3 layers, 2 forwards
    assert TorchFusedOps.staged_launches == (6 if staged is None and not time_mix_loras else 0)
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


@pytest.mark.parametrize("mode", [0, PREFETCH_TIME_MIX, PREFETCH_LN1 | PREFETCH_EARLY, PREFETCH_LN2,
                                  PREFETCH_FFN_VALUE, 31])
def test_l2_prefetch_asks_for_the_next_launches_weights(models, mode, monkeypatch):
    """RWKV_L2_PREFETCH: in a GEMV-sized step each layer's time mix asks L2 for the output projection's and the FFN
    key's weights, its first norm for the r/k/v launch's (in the launch's order), the FFN's norm for the FFN key's (the
    FFN value here is K-major: the sparse GEMV reads only some rows), the sparse FFN value for the next layer's r/k/v
    launch's, at most l2_prefetch_bytes a launch (the last range cut short, 16-byte multiples); larger steps ask for
    nothing; same outputs."""
    fused = models[1].fused
    budget = 100 * 1024  # the output projection (32 KB) and 68 KB of the FFN key (128 KB); r, k, v cut too
    monkeypatch.setattr(fused, "l2_prefetch", mode)
    monkeypatch.setattr(fused, "l2_prefetch_bytes", budget)
    monkeypatch.setattr(TorchFusedOps, "prefetches", [])
    outs, pools = run(models, [[5], [77]], gemv_rows=2, steps=2)
    assert_match(outs, pools)
    calls = TorchFusedOps.prefetches
    # 3 layers, 2 steps
    assert [op for op, *_ in calls] == ["ln_shift_mix", "time_mix", "ln_shift_mix", "sparse_gemv"] * 3 * 2
    blocks = models[1].blocks

    def rkv(layer: int) -> list:
        blk = blocks[layer]
        return [blk.w1.weight, blk.a1.weight, blk.g1.weight] + ([blk.v1.weight] if layer else []) + \
            [blk.receptance.weight, blk.key.weight, blk.value.weight]

    for n, (op, tensors, sizes, early) in enumerate(calls):
        layer = n // 4 % 3
        blk = blocks[layer]
        if op == "time_mix" and mode & PREFETCH_TIME_MIX:
            want = [blk.output.weight, blk.ffn_key.weight]
        elif op == "ln_shift_mix" and n % 4 == 0 and mode & PREFETCH_LN1:
            want = rkv(layer)
        elif op == "ln_shift_mix" and n % 4 == 2 and mode & PREFETCH_LN2:
            assert isinstance(blk.ffn_value, KMajorLinear)
            want = [blk.ffn_key.weight]
        elif op == "sparse_gemv" and layer < 2 and mode & PREFETCH_FFN_VALUE:
            want = rkv(layer + 1)
        else:
            want = []
        full = [t.numel() * t.element_size() for t in want]
        cut = [min(f, budget - sum(full[:i])) for i, f in enumerate(full)]
        cut = [c for c in cut if c > 0]
        assert [t.data_ptr() for t in tensors] == [t.data_ptr() for t in want[:len(cut)]]
        assert sizes == cut and sum(sizes) <= budget and all(size % 16 == 0 for size in sizes)
        assert early == bool(want and mode & PREFETCH_EARLY)
    monkeypatch.setattr(TorchFusedOps, "prefetches", [])
    run(models, [list(range(40))], gemv_rows=2)  # a prompt: the matmul path, nothing asked for, but the last
    calls = TorchFusedOps.prefetches              # block's FFN runs on the GEMV path (the row's last two tokens)
    assert [op for op, *_ in calls[-2:]] == ["ln_shift_mix", "sparse_gemv"]
    assert all(not tensors for _, tensors, _, _ in calls[:-2] + calls[-1:])  # (no layer after the last)
    assert [t.data_ptr() for t in calls[-2][1]] == ([blocks[-1].ffn_key.weight.data_ptr()]
                                                    if mode & PREFETCH_LN2 else [])


def test_l2_prefetch_of_a_w8a16_ffn(w8a16_models, monkeypatch):
    """A W8A16 model's FFN value is dense (int8 bands read all its rows): the FFN's norm asks L2 for the int8 weights
    of the FFN key and value, whole within the budget; same outputs."""
    fused = w8a16_models[1]
    monkeypatch.setattr(fused.fused, "l2_prefetch", PREFETCH_LN2)
    monkeypatch.setattr(fused.fused, "l2_prefetch_bytes", 1 << 20)
    monkeypatch.setattr(TorchFusedOps, "prefetches", [])
    outs, pools = run(w8a16_models, [[5]], gemv_rows=8)
    assert_match(outs, pools)
    asked = [(tensors, sizes) for op, tensors, sizes, _ in TorchFusedOps.prefetches if tensors]
    assert len(asked) == 3  # one FFN norm a layer
    for blk, (tensors, sizes) in zip(fused.blocks, asked):
        want = [fused.fused.operands(lin).weight for lin in (blk.ffn_key, blk.ffn_value)]
        assert all(t.dtype == torch.int8 for t in want)
        assert [t.data_ptr() for t in tensors] == [t.data_ptr() for t in want]
        assert sizes == [t.numel() for t in want]


def test_l2_prefetch_budget_defaults_to_three_quarters_of_l2(models, monkeypatch):
    """Without RWKV_L2_PREFETCH_MB a launch asks for at most three quarters of its device's L2 (read once per device),
    and a CPU tensor's device (no L2 known) for nothing."""
    fused = models[1].fused
    monkeypatch.setattr(fused, "l2_prefetch", PREFETCH_TIME_MIX | PREFETCH_EARLY)
    monkeypatch.setattr(fused, "l2_prefetch_bytes", 0)
    monkeypatch.setattr(fused, "_l2_sizes", {})
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: asked.append(device) or type("Props", (), {"L2_cache_size": 4000})())
    weights = [torch.empty(1000, dtype=torch.float16), torch.empty(4000, dtype=torch.int8)]
    gpu = torch.device("cuda", 0)
    assert fused._prefetch_args(gpu, weights) == (weights, [2000, 992], True)  # 3,000 bytes: 2,000 + 1,000 cut to 16s
    assert fused._prefetch_args(gpu, weights[1:]) == (weights[1:], [2992], True)
    assert asked == [gpu]
    assert fused._prefetch_args(torch.device("cpu"), weights) == ([], [], False)
    assert fused._prefetch_args(gpu, []) == ([], [], False)
