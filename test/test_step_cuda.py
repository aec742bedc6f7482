"""The persistent batch-1 step (cuda/rwkv7_step.cu, RWKV_PERSISTENT=1) on a CUDA GPU, against the fused launches and
the CPU fp32 forward: logits, greedy tokens, states, CUDA graph replay, batch invariance (a row stepped alone by
the persistent kernel and inside batches by the launches), fp16 states, a bad slot. test_step_emulated.py checks
the same kernel's logic on the CPU. Needs a CUDA GPU (skipped elsewhere)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from infer.batch import PackedBatch
from infer.model import RWKV7
from infer.ops.fused import select_fused
from infer.ops.wkv_cuda import select_wkv
from infer.random_model import make_config, random_state_dict
from greedy_batches import greedy_in_batch

PROMPT = [4, 8, 15, 16, 23, 42, 99, 7]


@pytest.fixture(scope="module")
def step_kernel():
    if not torch.cuda.is_available() or torch.version.hip is not None:
        pytest.skip("needs CUDA")
    mp = pytest.MonkeyPatch()
    mp.setenv("RWKV_PERSISTENT", "1")
    from infer.ops.persistent import _step, load_persistent_step
    kernel = load_persistent_step()
    mp.undo()
    if kernel is None:
        pytest.fail(f"persistent step unavailable on a CUDA machine: {_step.error}")
    return kernel


def build(seed: int, device: str = "cuda", dtype: str = "fp16", L: int = 3, C: int = 256, V: int = 1024) -> RWKV7:
    sd = random_state_dict(make_config(L, C, V), seed=seed, dtype=torch.float32)
    model = RWKV7.from_state_dict(sd, device=device, dtype=dtype)
    if device == "cuda":
        model.wkv = select_wkv(model.device, "cuda")
    return model


@contextlib.contextmanager
def persistent(model: RWKV7, kernel):
    """One-token steps of ``model`` (fused) on the persistent kernel inside the block (the fused kernels are one
    object for every model: it is switched back off after), and a check that it did take them."""
    model.fused.persistent = kernel
    try:
        yield
    finally:
        model.fused.persistent = None
    assert any(plan is not None for plan in kernel._plans.get(model, {}).values()), "the persistent step never ran"


def fused(seed: int = 5, **shape) -> RWKV7:
    model = build(seed, **shape)
    select_fused(model, "on").persistent = None
    return model


def decode_all(model: RWKV7, tokens: list[int], slot: int, wkv_dtype=torch.float32):
    pool = model.new_state_pool(4, wkv_dtype)
    return [model.decode([t], [slot], pool)[0].float().cpu() for t in tokens], pool


@pytest.mark.parametrize("wkv_dtype", [torch.float32, torch.float16], ids=["fp32-state", "fp16-state"])
def test_matches_launches_and_cpu(step_kernel, wkv_dtype):
    model = fused()
    cpu = build(5, device="cpu", dtype="fp32")
    ref, _ = decode_all(cpu, PROMPT, 2)
    base, base_pool = decode_all(model, PROMPT, 2, wkv_dtype)
    with persistent(model, step_kernel):
        ours, pool = decode_all(model, PROMPT, 2, wkv_dtype)
    drift = max(float((a - b).abs().max()) for a, b in zip(base, ref))
    worst = max(float((a - b).abs().max()) for a, b in zip(ours, ref))
    assert worst <= 3 * drift + 1e-3, (worst, drift)
    assert [int(x.argmax()) for x in ours] == [int(x.argmax()) for x in base] == [int(x.argmax()) for x in ref]
    for name in ("att_shift", "ffn_shift", "wkv"):
        torch.testing.assert_close(getattr(pool, name).float(), getattr(base_pool, name).float(), atol=3e-2, rtol=3e-2)
        assert not getattr(pool, name)[:, 0].any()


def test_graph_replay_and_batch_invariance(step_kernel):
    """A row decoded alone (the persistent kernel, from a CUDA graph) and inside batches (the launches) gets the same
    greedy tokens; graph replay equals eager."""
    model = fused(seed=21, L=2, C=128)
    with persistent(model, step_kernel):
        alone = greedy_in_batch(model, PROMPT, 1)
        assert greedy_in_batch(model, PROMPT, 1, cuda_graphs=False) == alone
        for size in (3, 8):
            assert greedy_in_batch(model, PROMPT, size) == alone, size


def test_bad_slot_gives_nan(step_kernel):
    model = fused()
    pool = model.new_state_pool(2)
    before = pool.wkv.clone()
    batch = PackedBatch.from_rows([[3]], [0], model.device)
    batch.slots.fill_(7)  # past the pool: the kernel must not write
    with persistent(model, step_kernel):
        logits = model.forward(batch, pool)
    assert torch.isnan(logits).all()
    assert torch.equal(pool.wkv, before)


@pytest.mark.parametrize("width", [2048, 4096])
def test_real_widths_build_and_run(step_kernel, width):
    """Steps at the 1.5B and 7.2B widths (one layer, a small vocabulary): the launch configuration (shared memory,
    grid) of a real shape works and agrees with the launches (at 4096 the sparse FFN value's chunks are 128 rows, two
    loads of hidden values each, which the emulated tests' width does not reach)."""
    model = fused(seed=9, L=1, C=width, V=4096)
    base, _ = decode_all(model, PROMPT[:3], 0)
    with persistent(model, step_kernel):
        ours, _ = decode_all(model, PROMPT[:3], 0)
    for a, b in zip(ours, base):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)
    assert [int(x.argmax()) for x in ours] == [int(x.argmax()) for x in base]


def test_timeline_on_the_gpu(step_kernel):
    """The timeline (bench/profile_persistent.py): every block of the grid stamps each phase; by the device's global
    timer every block's end of a phase precedes every block's start of the next; a timed step gives the logits of an
    untimed one."""
    from infer.ops.persistent import phase_names
    model = fused()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    pools = [model.new_state_pool(2) for _ in range(2)]
    batch = PackedBatch.from_rows([[PROMPT[0]]], [1], model.device)
    want = step_kernel.logits(model, batch, pools[0])
    t = step_kernel.timeline(model, batch, pools[1], blocks=sms * step_kernel.blocks_per_sm + 3)
    assert torch.equal(step_kernel._plan(model, pools[1])[2].logits.view(1, -1), want)
    dims = step_kernel._plan(model, pools[1])[1]
    assert t.shape[0] == len(phase_names(dims))
    grid = int((t[0, 0] >= 0).sum())
    assert grid >= sms and (t[:, :, grid:] == -1).all() and (t[:, :, :grid] > 0).all()
    t = t[:, :, :grid]
    assert (t[:, 1] >= t[:, 0]).all()
    assert (t[:-1, 1].amax(dim=1) <= t[1:, 0].amin(dim=1)).all()
