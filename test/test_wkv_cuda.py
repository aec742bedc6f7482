"""The CUDA WKV kernel (cuda/wkv7_slots.cu) against the torch reference, and implementation choice.

The kernel tests need a CUDA device (and nvcc + ninja to build the extension); they are skipped
elsewhere. The selection tests run everywhere.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from infer.batch import PackedBatch
from infer.ops.wkv import TorchWKV
from infer.ops.wkv_cuda import CudaWKV, load_cuda_wkv, select_wkv

N = 64
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# --------------------------------------------------------------------------- selection (any machine)
def test_select_on_cpu_is_torch():
    assert isinstance(select_wkv(torch.device("cpu")), TorchWKV)
    assert isinstance(select_wkv("cpu", "auto"), TorchWKV)
    assert isinstance(select_wkv(torch.device("cpu"), "torch"), TorchWKV)


def test_select_cuda_on_cpu_raises_clearly():
    with pytest.raises(RuntimeError, match="CUDA WKV kernel.*cpu"):
        select_wkv(torch.device("cpu"), "cuda")


def test_select_fla_on_cpu_is_torch():
    assert isinstance(select_wkv("cpu", "fla", heads=4), TorchWKV)


def test_select_rejects_unknown_preference():
    with pytest.raises(ValueError, match="unknown WKV implementation"):
        select_wkv(torch.device("cpu"), "triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback without a CUDA device")
def test_load_without_cuda_returns_none():
    assert load_cuda_wkv() is None
    with pytest.raises(RuntimeError, match="unavailable"):
        select_wkv(torch.device("cuda"), "cuda")


# --------------------------------------------------------------------------- kernel (CUDA only)
@pytest.fixture(scope="module")
def kernel() -> CudaWKV:
    k = load_cuda_wkv()
    if k is None:
        from infer.ops.wkv_cuda import cuda_wkv_error
        pytest.fail(f"the CUDA WKV kernel did not load on a CUDA machine: {cuda_wkv_error()}")
    return k


def make_inputs(T: int, H: int, act: torch.dtype, seed: int):
    """Inputs with the model's value ranges: a = -kk, b = kk * gate, kk unit-norm per head."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    C = H * N

    def randn(scale=1.0):
        return torch.randn(T, C, generator=gen, device="cuda") * scale

    r, k, v = randn(), randn(), randn()
    w = torch.exp(-0.606531 * torch.rand(T, C, generator=gen, device="cuda"))          # (0.545, 1]
    kk = F.normalize(randn().view(T, H, N), dim=-1).view(T, C)
    gate = torch.rand(T, C, generator=gen, device="cuda")
    a, b = -kk, kk * gate
    return r.to(act), w, k.to(act), v.to(act), a.to(act), b.to(act)


def random_pool(num_slots: int, H: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(num_slots, H, N, N, generator=gen, device="cuda") * 0.3).to(dtype)


def run_both(kernel, pool, batch, inputs):
    """(y, pool) from the kernel and from the reference, each on its own copy of the pool."""
    ref_pool = pool.clone()
    got_pool = pool.clone()
    ref_y = TorchWKV()(ref_pool, batch, *inputs)
    got_y = kernel(got_pool, batch, *inputs)
    torch.cuda.synchronize()
    return got_y, got_pool, ref_y, ref_pool


def assert_matches(got_y, got_pool, ref_y, ref_pool, pool_before, used_slots, state_dtype):
    assert got_y.dtype == torch.float32 and got_y.shape == ref_y.shape
    scale = ref_y.abs().max().item()
    torch.testing.assert_close(got_y, ref_y, rtol=1e-4, atol=1e-4 * scale)
    # an fp16 pool is rounded once at the end on both sides: allow one fp16 ulp
    tol = 1e-4 if state_dtype == torch.float32 else 2e-3
    pscale = ref_pool.float().abs().max().item()
    torch.testing.assert_close(got_pool.float(), ref_pool.float(), rtol=tol, atol=tol * pscale)
    untouched = [s for s in range(pool_before.shape[0]) if s not in set(used_slots)]
    assert torch.equal(got_pool[untouched], pool_before[untouched]), "a slot outside the batch changed"


@needs_cuda
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16], ids=["state32", "state16"])
@pytest.mark.parametrize("act,H", [(torch.float16, 2), (torch.bfloat16, 3), (torch.float32, 4)],
                         ids=["fp16-H2", "bf16-H3", "fp32-H4"])
def test_prefill_matches_reference(kernel, state_dtype, act, H):
    lens = [5, 1, 17, 3, 64, 2]
    slots = [7, 2, 9, 0, 4, 11]                      # unordered, with gaps; slots 1,3,5,6,8,10,12 untouched
    batch = PackedBatch.from_rows([[0] * n for n in lens], slots, "cuda")
    pool = random_pool(13, H, state_dtype, seed=1)
    inputs = make_inputs(sum(lens), H, act, seed=2)
    got_y, got_pool, ref_y, ref_pool = run_both(kernel, pool, batch, inputs)
    assert_matches(got_y, got_pool, ref_y, ref_pool, pool, slots, state_dtype)
    assert not torch.equal(got_pool[slots], pool[slots]), "the batch's slots were not updated"


@needs_cuda
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16], ids=["state32", "state16"])
def test_decode_steps_match_reference(kernel, state_dtype):
    H, slots = 4, [12, 3, 0, 7, 5, 9, 1, 14, 10]
    pool = random_pool(16, H, state_dtype, seed=3)
    ref_pool, got_pool = pool.clone(), pool.clone()
    batch = PackedBatch.from_rows([[0]] * len(slots), slots, "cuda")
    for step in range(4):                              # the state carries over between steps
        inputs = make_inputs(len(slots), H, torch.float16, seed=10 + step)
        ref_y = TorchWKV()(ref_pool, batch, *inputs)
        got_y = kernel(got_pool, batch, *inputs)
        torch.cuda.synchronize()
        assert_matches(got_y, got_pool, ref_y, ref_pool, pool, slots, state_dtype)


@needs_cuda
def test_pool_view_of_one_layer(kernel):
    """The model passes ``StatePool.wkv[layer]``, a contiguous view into [L, S, H, N, N]."""
    L, S, H = 3, 5, 2
    full = torch.randn(L, S, H, N, N, device="cuda") * 0.3
    before = full.clone()
    batch = PackedBatch.from_rows([[0] * 4, [0] * 2], [4, 1], "cuda")
    inputs = make_inputs(6, H, torch.float16, seed=4)
    ref_layer = full[1].clone()
    ref_y = TorchWKV()(ref_layer, batch, *inputs)
    got_y = kernel(full[1], batch, *inputs)
    torch.cuda.synchronize()
    torch.testing.assert_close(got_y, ref_y, rtol=1e-4, atol=1e-4 * ref_y.abs().max().item())
    torch.testing.assert_close(full[1], ref_layer, rtol=1e-4, atol=1e-4 * ref_layer.abs().max().item())
    assert torch.equal(full[0], before[0]) and torch.equal(full[2], before[2])


@needs_cuda
def test_graph_capture_replays_on_current_stream(kernel):
    H, slots = 2, [3, 0, 2]
    pool = random_pool(4, H, torch.float32, seed=5)
    batch = PackedBatch.from_rows([[0]] * 3, slots, "cuda")
    static = [t.clone() for t in make_inputs(3, H, torch.float16, seed=6)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                      # warm up off the default stream, as torch advises
        kernel(pool.clone(), batch, *static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    start = pool.clone()
    with torch.cuda.graph(graph):
        y_static = kernel(pool, batch, *static)
    pool.copy_(start)                                  # capture ran nothing; be explicit anyway
    for step in range(3):
        fresh = make_inputs(3, H, torch.float16, seed=20 + step)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        ref_pool = pool.clone()
        ref_y = TorchWKV()(ref_pool, batch, *fresh)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y_static, ref_y, rtol=1e-4, atol=1e-4 * ref_y.abs().max().item())
        torch.testing.assert_close(pool, ref_pool, rtol=1e-4, atol=1e-4 * ref_pool.abs().max().item())


@needs_cuda
def test_out_of_range_slot_gives_nan_and_touches_nothing(kernel):
    H = 2
    pool = random_pool(3, H, torch.float32, seed=7)
    before = pool.clone()
    batch = PackedBatch.from_rows([[0] * 2, [0] * 3], [1, 0], "cuda")
    batch.slots = torch.tensor([1, 3], dtype=torch.long, device="cuda")   # slot 3 does not exist
    y = kernel(pool, batch, *make_inputs(5, H, torch.float16, seed=8))
    torch.cuda.synchronize()
    assert torch.isfinite(y[:2]).all() and torch.isnan(y[2:]).all()
    assert torch.equal(pool[[0, 2]], before[[0, 2]])


@needs_cuda
def test_rejects_bad_arguments(kernel):
    batch = PackedBatch.from_rows([[0]], [0], "cuda")
    inputs = make_inputs(1, 2, torch.float16, seed=9)
    with pytest.raises(RuntimeError, match="float32 or float16"):
        kernel(torch.zeros(1, 2, N, N, device="cuda", dtype=torch.bfloat16), batch, *inputs)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel(torch.zeros(1, 2, N, 2 * N, device="cuda")[..., :N], batch, *inputs)
    with pytest.raises(RuntimeError, match="shape"):
        kernel(torch.zeros(1, 3, N, N, device="cuda"), batch, *inputs)        # 3 heads, inputs have 2


@needs_cuda
def test_select_on_cuda_prefers_kernel(kernel):
    assert isinstance(select_wkv(torch.device("cuda")), CudaWKV)
    assert isinstance(select_wkv(torch.device("cuda"), "cuda"), CudaWKV)
    assert isinstance(select_wkv(torch.device("cuda"), "torch"), TorchWKV)


@needs_cuda
@pytest.mark.parametrize("dtype,wkv_dtype,atol", [("fp32", torch.float32, 2e-3), ("fp16", torch.float32, 3e-2),
                                                  ("fp16", torch.float16, 5e-2)],
                         ids=["fp32", "fp16", "fp16-state16"])
def test_model_logits_match_torch_wkv(kernel, dtype, wkv_dtype, atol):
    from infer.model import RWKV7
    from infer.random_model import make_config, random_state_dict

    config = make_config(n_layer=2, n_embd=192, vocab_size=1024)
    model = RWKV7.from_state_dict(random_state_dict(config, seed=31), device="cuda", dtype=dtype)
    gen = torch.Generator().manual_seed(32)
    rows = [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in (9, 1, 23, 4)]
    slots = [5, 0, 3, 6]
    results = []
    for impl in (TorchWKV(), kernel):
        model.wkv = impl
        pool = model.new_state_pool(8, wkv_dtype)
        logits = [model.prefill(rows, slots, pool, chunk_size=8)]
        for step in range(3):
            logits.append(model.decode([(7 * step + i) % 1024 for i in range(len(slots))], slots, pool))
        torch.cuda.synchronize()
        results.append((torch.stack(logits), pool.wkv.float().clone()))
    (ref_logits, ref_state), (got_logits, got_state) = results
    assert ref_logits.abs().max() > 1.0
    torch.testing.assert_close(got_logits, ref_logits, rtol=1e-2, atol=atol)
    torch.testing.assert_close(got_state, ref_state, rtol=1e-2, atol=atol)


def test_build_lock_clears_a_dead_builds_lock_file(tmp_path):
    """torch's JIT loader waits forever on a `lock` file a killed build left behind."""
    from infer.ops.cuda_ext import build_lock
    (tmp_path / "lock").write_text("")
    with build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_build_lock_waits_for_a_live_build(tmp_path):
    import threading
    from infer.ops.cuda_ext import build_lock
    building, release, seen = threading.Event(), threading.Event(), []

    def first():
        with build_lock(tmp_path):
            (tmp_path / "lock").write_text("")  # a build in progress
            building.set()
            release.wait(10)
            (tmp_path / "lock").unlink()       # the build finished

    def second():
        building.wait(10)
        with build_lock(tmp_path):
            seen.append("entered")

    a, b = threading.Thread(target=first), threading.Thread(target=second)
    a.start()
    b.start()
    building.wait(10)
    b.join(0.3)
    assert b.is_alive() and (tmp_path / "lock").exists()  # the second waits; the live lock is kept
    release.set()
    a.join(10)
    b.join(10)
    assert seen == ["entered"] and not (tmp_path / "lock").exists()


def test_build_once_load_keeps_only_self_tested_objects(monkeypatch):
    from infer.ops import cuda_ext
    monkeypatch.setattr(cuda_ext, "why_unavailable", lambda: None)
    rejected = cuda_ext.BuildOnce("thing")
    assert rejected.load(lambda: 1, lambda value: "wrong answer") is None
    assert rejected.error == "wrong answer"
    accepted = cuda_ext.BuildOnce("thing")
    assert accepted.load(lambda: 2, lambda value: None) == 2 and accepted.error is None
    assert cuda_ext.BuildOnce("thing").load(lambda: 3) == 3  # no self-test
