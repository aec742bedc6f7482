"""The CUDA sampler kernel (cuda/sampler.cu) against the torch path of infer/sampler.py, and its selection.

What must hold, for every sampled row (greedy rows are skipped by the kernel and take the argmax):

* tau and the token equal the kernel's exact definition (test/sampler_model.py: the torch path's
  formulas with exact fixed-point sums rounded once to fp64), bit for bit;
* tau and the token equal the torch path's bit for bit whenever the torch path's fp64 sums are
  exact (every probability taking part -- those >= tau and the top k -- a multiple of 2^-52; true of
  every row whose kept probabilities are >= 2^-29).

The one tolerated exception: rows where those sums are not exact (the kept set reaches probabilities
below ~2^-29, e.g. top-k over a very peaked row). There the torch answer carries its own fp64
rounding and the kernel gives the exactly rounded one: tau can differ (the torch cumsum of the k
largest stops growing once the remaining ones are below its ulp, so it keeps fewer of them), and
with it the token when u is exactly 0 (the first kept token in vocabulary order) or, with
probability ~1e-10 per row, when u lands within the rounding of a CDF step. Such rows are counted
and printed (-s), never failed on; test_kernel_exact_sums_agree_on_common_settings and the
end-to-end test still require identical tokens.

The kernel tests need a CUDA device and the extension to build (nvcc + ninja); they are skipped
otherwise (the skip reason says why: run with -rs). The selection tests run everywhere;
test_sampler_emulated.py runs the kernel source itself on the CPU.
"""
from __future__ import annotations

import logging

import pytest
import torch

from infer.ops.sampler_cuda import (CudaSampler, cuda_sampler_error, load_cuda_sampler, prepare_case, prepare_mismatch,
                                    self_test_batch)
from infer.sampler import Sampler, SamplingParams, _draw
from sampler_model import KINDS, exact_tau_draw, probability_rows, row_params, torch_sums_exact

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# --------------------------------------------------------------------------- selection (any machine)
def test_cpu_sampler_takes_the_torch_path():
    s = Sampler(100, 2, "cpu")
    assert s.name == "torch" and s._kernel is None
    assert Sampler(100, 2, "cpu", impl="torch").name == "torch"


def test_asking_for_the_kernel_off_cuda_raises():
    with pytest.raises(RuntimeError, match="CUDA sampler kernel.*cpu"):
        Sampler(100, 2, "cpu", impl="cuda")


def test_unknown_implementation_rejected(monkeypatch):
    with pytest.raises(ValueError, match="unknown sampler implementation"):
        Sampler(100, 2, "cpu", impl="triton")
    monkeypatch.setenv("RWKV_SAMPLER", "bogus")
    with pytest.raises(ValueError, match="unknown sampler implementation"):
        Sampler(100, 2, "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback without a CUDA device")
def test_load_without_cuda_returns_none():
    assert load_cuda_sampler() is None
    assert "CUDA" in (cuda_sampler_error() or "")


# --------------------------------------------------------------------------- kernel (CUDA only)
@pytest.fixture(scope="module")
def kernel() -> CudaSampler:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    k = load_cuda_sampler()
    if k is None:
        pytest.skip(f"the CUDA sampler kernel is unavailable: {cuda_sampler_error()}")
    return k


def torch_path(p: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor):
    """The torch path on the same device: full-sort thresholds (every row resolved) and the draw."""
    V = p.shape[1]
    tau = Sampler(V, 1, p.device, valid_vocab=V, impl="torch")._thresholds(p, top_k, top_p, V)[0]
    return tau, _draw(p.clone(), tau, u)


def compare(kernel, p, top_k, top_p, u, greedy, label="") -> int:
    """Kernel vs exact definition (all sampled rows) and vs the torch path (rows with exact fp64
    sums); returns the number of tolerated differences from the torch path."""
    tau, drawn = kernel(p, top_k, top_p, u, greedy)
    live = greedy == 0
    assert (tau[~live] == 0).all() and (drawn[~live] == 0).all()
    t_ex, d_ex = exact_tau_draw(p, top_k, top_p, u)
    bad = live & ((tau != t_ex) | (drawn != d_ex))
    if bad.any():
        rows = bad.nonzero().flatten()[:8]
        pytest.fail(f"{label}: rows {rows.tolist()} differ from the exact definition: tau {tau[rows].tolist()} vs "
                    f"{t_ex[rows].tolist()}, token {drawn[rows].tolist()} vs {d_ex[rows].tolist()}, top_k "
                    f"{top_k[rows].tolist()}, top_p {top_p[rows].tolist()}")
    t_ref, d_ref = torch_path(p, top_k, top_p, u)
    differ = live & ((tau != t_ref) | (drawn != d_ref))
    strict = differ & torch_sums_exact(p, top_k, tau, t_ref)
    if strict.any():
        rows = strict.nonzero().flatten()[:8]
        pytest.fail(f"{label}: rows {rows.tolist()} (exact fp64 sums) differ from the torch path: tau "
                    f"{tau[rows].tolist()} vs {t_ref[rows].tolist()}, token {drawn[rows].tolist()} vs "
                    f"{d_ref[rows].tolist()}")
    n = int(differ.sum())
    if n:
        print(f"{label}: {n} row(s) round differently from the torch path's inexact fp64 sums "
              f"(tokens differ in {int((live & (drawn != d_ref)).sum())})")
    return n


@needs_cuda
@pytest.mark.parametrize("V", [65536, 1000, 333, 5])
@pytest.mark.parametrize("kind", list(KINDS))
def test_kernel_matches_definition_and_torch_path(kernel, kind, V):
    gen = torch.Generator().manual_seed(1000 * len(kind) + V)
    for B in ((1, 32, 256, 512) if V == 65536 else (1, 7, 64, 300)):
        p = probability_rows(kind, B, V, gen, valid=V - 6 if V == 65536 else None)
        args = [t.cuda() for t in (p, *row_params(B, V, gen))]
        compare(kernel, *args, label=f"{kind} B={B} V={V}")


@needs_cuda
def test_kernel_exact_sums_agree_on_common_settings(kernel):
    """Sampling settings clients use, on rows like the random-weight model's: no difference at all."""
    gen = torch.Generator().manual_seed(5)
    V, B = 65536, 512
    for kind in ("flat", "normal", "spread"):
        p = probability_rows(kind, B, V, gen, valid=65530).cuda()
        for k, tp in ((0, 0.9), (0, 0.95), (40, 0.9), (50, 1.0), (0, 1.0), (1000, 0.8)):
            top_k = torch.full((B,), k, dtype=torch.int64, device="cuda")
            top_p = torch.full((B,), tp, dtype=torch.float32, device="cuda")
            u = torch.rand(B, generator=gen).cuda()
            greedy = torch.zeros(B, dtype=torch.int64, device="cuda")
            assert compare(kernel, p, top_k, top_p, u, greedy, label=f"{kind} k={k} p={tp}") == 0


@needs_cuda
def test_self_test_batch_is_exact(kernel):
    for V in (1000, 4099):
        p, top_k, top_p, u, greedy = self_test_batch(torch.device("cuda"), V)
        assert compare(kernel, p, top_k, top_p, u, greedy, label=f"self-test V={V}") == 0


@needs_cuda
def test_kernel_is_batch_invariant(kernel):
    """A row's result does not depend on the other rows of the launch."""
    gen = torch.Generator().manual_seed(11)
    B, V = 64, 65536
    p = torch.cat([probability_rows(kind, B // 8, V, gen) for kind in KINDS]).cuda()
    params = [t.cuda() for t in row_params(B, V, gen)]
    tau, drawn = kernel(p, *params)
    for i in range(B):
        t1, d1 = kernel(p[i:i + 1], *(t[i:i + 1] for t in params))
        assert t1.item() == tau[i].item() and d1.item() == drawn[i].item(), i


@needs_cuda
def test_strided_inputs(kernel):
    """Row strides other than V (float4 and scalar loads) and strided parameter columns."""
    gen = torch.Generator().manual_seed(12)
    for V, pad in ((4096, 4), (4096, 1), (4095, 0)):
        big = torch.zeros(16, V + pad)
        big[:, :V] = probability_rows("spread", 16, V, gen)
        top_k, top_p, u, greedy = row_params(16, V, gen)
        ip = torch.stack([greedy, top_k, top_k, top_k], dim=1).cuda()
        fp = torch.stack([top_p, top_p, top_p], dim=1).cuda()
        p = big.cuda()[:, :V]
        got = kernel(p, ip[:, 1], fp[:, 1], u.cuda(), ip[:, 0])
        want = kernel(p.contiguous(), ip[:, 1].contiguous(), fp[:, 1].contiguous(), u.cuda(), ip[:, 0].contiguous())
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        compare(kernel, p, ip[:, 1], fp[:, 1], u.cuda(), ip[:, 0], label=f"strided V={V}+{pad}")


@needs_cuda
def test_kernel_in_cuda_graph(kernel):
    """Captured on a side stream and replayed: same as eager, and it follows new inputs."""
    gen = torch.Generator().manual_seed(13)
    B, V = 32, 65536
    p = probability_rows("spread", B, V, gen).cuda()
    params = [t.cuda() for t in row_params(B, V, gen, greedy_share=0.0)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernel(p, *params)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_tau, out_drawn = kernel(p, *params)
    p.copy_(probability_rows("normal", B, V, gen).cuda())
    params[2].copy_(torch.rand(B, generator=gen).cuda())
    graph.replay()
    want = kernel(p, *params)
    torch.cuda.synchronize()
    assert torch.equal(out_tau, want[0]) and torch.equal(out_drawn, want[1])


@needs_cuda
def test_kernel_rejects_bad_arguments(kernel):
    p = torch.softmax(torch.randn(2, 10, device="cuda"), dim=1)
    k = torch.zeros(2, dtype=torch.int64, device="cuda")
    tp = torch.ones(2, device="cuda")
    with pytest.raises(RuntimeError, match="float32"):
        kernel(p.double(), k, tp, tp, k)
    with pytest.raises(RuntimeError, match="top_k must have shape"):
        kernel(p, k[:1], tp, tp, k)
    with pytest.raises(RuntimeError, match="top_p must be"):
        kernel(p, k, tp.double(), tp, k)
    with pytest.raises(RuntimeError, match="is on"):
        kernel(p, k.cpu(), tp, tp, k)


# --------------------------------------------------------------------------- Sampler (CUDA only)
@needs_cuda
def test_kernel_is_chosen_and_logged(kernel, caplog, monkeypatch):
    with caplog.at_level(logging.INFO, logger="infer.sampler"):
        s = Sampler(65536, 4, "cuda", impl="auto")
    assert s.name == CudaSampler.name == "cuda kernel (sampler)"
    assert getattr(s, "name", "torch") == CudaSampler.name  # what ModelRunner.implementations() reports
    assert any("sampler on cuda" in r.getMessage() and CudaSampler.name in r.getMessage() for r in caplog.records)
    assert Sampler(65536, 4, "cuda", impl="cuda").name == CudaSampler.name
    assert Sampler(65536, 4, "cuda", impl="torch").name == "torch"
    monkeypatch.delenv("RWKV_SAMPLER", raising=False)
    assert Sampler(65536, 4, "cuda").name == CudaSampler.name  # the default since it was timed on the H200
    monkeypatch.setenv("RWKV_SAMPLER", "torch")
    assert Sampler(65536, 4, "cuda").name == "torch"


ROW_PARAMS = [
    dict(temperature=0.0, logprobs=3),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=1.0, top_p=0.9, alpha_presence=0.4, alpha_frequency=0.2, alpha_decay=0.99),
    dict(temperature=0.8, top_k=40, top_p=0.95, logit_bias={11: 2.0, 70000 % 65530: -5.0}),
    dict(temperature=1.2, alpha_frequency=0.3, logprobs=5),
    dict(temperature=2.0, top_k=2000),
    dict(temperature=0.7, top_p=0.5, logprobs=2),
    dict(temperature=1.0, top_k=50),
    dict(temperature=0.3, top_k=1, top_p=0.9),  # greedy through top_k == 1
    dict(temperature=1.5, top_p=0.0),  # greedy through top_p == 0
    dict(temperature=0.5, top_k=5, top_p=0.3, logit_bias={3: 100.0}),
]


@needs_cuda
@pytest.mark.parametrize("B", [1, 37, 256, 512])
def test_sampler_end_to_end_matches_torch_path(kernel, B):
    """Two samplers, torch path and kernel, fed the same logits: same tokens, logprobs, top
    alternatives, penalty tables and step counters, step after step (dead rows included)."""
    V = 65536
    samplers = [Sampler(V, 600, "cuda", impl=impl) for impl in ("torch", "cuda")]
    assert samplers[1].name == CudaSampler.name
    slots = (torch.arange(B) * 7 + 3) % 600
    for s in samplers:
        for i, slot in enumerate(slots.tolist()):
            s.reset_slot(slot, SamplingParams(**ROW_PARAMS[i % len(ROW_PARAMS)], seed=1000 + i))
    gen = torch.Generator().manual_seed(B)
    slots = slots.cuda()
    for step in range(6):
        x = torch.randn(B, V, generator=gen) * (3.0 if step % 2 else 1.0)
        if step == 3:
            x[:, :64] += torch.linspace(30, 3, 64)  # very peaked: tiny probabilities in the tail
        if B > 4:
            x[2] = float("-inf")  # dead row: raw-argmax fallback
            x[4, ::2] = float("nan")
        x = x.cuda()
        a, b = (s.sample(x.clone(), slots, want_logprob=True) for s in samplers)
        assert torch.equal(a.tokens, b.tokens), f"step {step}: {(a.tokens != b.tokens).nonzero().flatten().tolist()}"
        assert torch.equal(a.logprobs, b.logprobs)
        assert torch.equal(a.top_ids, b.top_ids) and torch.equal(a.top_logprobs, b.top_logprobs)
        assert (a.tokens < 65530).all()
    assert torch.equal(samplers[0].penalty, samplers[1].penalty)
    assert torch.equal(samplers[0].step, samplers[1].step)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("V", [1000, 4099, 65536])
def test_prepare_matches_the_torch_steps(kernel, dtype, V):
    """The logits' preparation kernel: s, the greedy token, dead rows and their fallback bit for bit the torch
    steps' (Sampler._prepare), with penalties, biases, NaN/inf, masked ids, temperatures and a dead row."""
    assert prepare_mismatch(kernel, *prepare_case(torch.device("cuda"), V, dtype)) is None


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_sampler_without_logprobs_matches_torch_path(kernel, dtype):
    """Without log-probabilities the kernel path prepares the logits in its own kernel: the same tokens,
    penalty tables and step counters as the torch path, step after step (dead rows included)."""
    B, V = 200, 65536
    samplers = [Sampler(V, 256, "cuda", impl=impl) for impl in ("torch", "cuda")]
    slots = (torch.arange(B) * 5 + 1) % 256
    params = [{k: v for k, v in p.items() if k != "logprobs"} for p in ROW_PARAMS]
    for s in samplers:
        for i, slot in enumerate(slots.tolist()):
            s.reset_slot(slot, SamplingParams(**params[i % len(params)], seed=500 + i))
    gen = torch.Generator().manual_seed(9)
    slots = slots.cuda()
    for step in range(5):
        x = torch.randn(B, V, generator=gen) * (3.0 if step % 2 else 1.0)
        x[2] = float("-inf")
        x[4, ::2] = float("nan")
        x[6, 100] = float("inf")
        x = x.to(dtype).cuda()
        a, b = (s.sample(x.clone(), slots) for s in samplers)
        assert torch.equal(a.tokens, b.tokens), f"step {step}: {(a.tokens != b.tokens).nonzero().flatten().tolist()}"
    assert torch.equal(samplers[0].penalty, samplers[1].penalty)
    assert torch.equal(samplers[0].step, samplers[1].step)


@needs_cuda
def test_sampler_batch_invariance_with_kernel(kernel):
    """A row's token sequence is the same alone and inside a batch (kernel path)."""
    V, steps = 65536, 40
    gen = torch.Generator().manual_seed(21)
    seq = [torch.randn(V, generator=gen) * 3 for _ in range(steps)]
    extra = [torch.randn(9, V, generator=gen) * 3 for _ in range(steps)]
    params = SamplingParams(temperature=1.0, top_p=0.9, alpha_frequency=0.2, seed=4242)
    alone_s = Sampler(V, 16, "cuda", impl="cuda")
    alone_s.reset_slot(5, params)
    alone = [int(alone_s.sample(row[None].cuda(), torch.tensor([5], device="cuda")).tokens[0]) for row in seq]
    s = Sampler(V, 16, "cuda", impl="cuda")
    batch_slots = [0, 2, 5, 7, 8, 9, 11, 12, 14]
    for i, sl in enumerate(batch_slots):
        s.reset_slot(sl, params if sl == 5 else SamplingParams(**ROW_PARAMS[i % len(ROW_PARAMS)], seed=i))
    pos = batch_slots.index(5)
    inside = []
    for t in range(steps):
        batch = extra[t].clone()
        batch[pos] = seq[t]
        inside.append(int(s.sample(batch.cuda(), torch.tensor(batch_slots, device="cuda")).tokens[pos]))
    assert alone == inside
    assert len(set(alone)) > 10
