"""The persistent batch-1 decode step (cuda/rwkv7_step.cu, infer/ops/persistent.py) on the CPU emulation of
test/kernel_emu, against the readable forward.

The kernel runs on co-resident grids of 1-3 blocks (emu::run_resident_grid interleaves every block's threads, so
its grid barriers really wait for the other blocks), from the entries infer/ops/persistent.py builds for a tiny
random fp16 model (two heads, LoRA rows of 32-64 halves, several GEMV units a warp), token by token:
- logits against the fp32 readable forward of the same (fp16-rounded) weights: within 3x the drift of the
  readable forward run in fp16 itself (the issue's criterion for the half-precision paths), greedy tokens equal;
  the slot's states after the prompt likewise;
- the same bits on every grid and with the prefetch ahead of the barriers on or off (a unit's sums do not depend
  on the warp or block that computes it, the sparse FFN value's chunks are fixed by the shape);
- the FFN value K-major (partial sums + reduce) and row-major (one GEMV phase); fp32 and fp16 WKV states;
- another slot's state untouched, an out-of-range slot: NaN logits and no state written, and the grid barrier's
  counters zero after every step;
- infer/ops/persistent.py's PersistentStep end to end on the emulated kernel, through the self-test the server runs
  before using the kernel (which must fail a kernel that computes nothing).
Skipped without g++ (C++20, <ucontext.h>).
"""
from __future__ import annotations

import ctypes

import pytest
import torch

from infer.batch import PackedBatch
from infer.model import RWKV7
from infer.ops.fused import KMajorLinear
from infer.ops.persistent import (DIMS, LAYER_ENTRIES, MODEL_ENTRIES, PersistentStep, Workspace, phase_names,
                                  self_test, step_dims, step_entries, unsupported)
from infer.random_model import make_config, random_state_dict
from kernel_emu import emu_build

L, C, V = 2, 128, 256
PROMPT = [5, 77, 3, 190, 42, 11]
SLOTS = 3


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> ctypes.CDLL:
    d = tmp_path_factory.mktemp("kernel_emu_step")
    reason = emu_build.usable(d)
    if reason:
        pytest.skip(reason)
    job = emu_build.build_command("cuda/rwkv7_step.cu", "emu_step.cpp", 32, d, "step")
    so = ctypes.CDLL(str(emu_build.build_all({"step": job})["step"]))
    p = ctypes.c_void_p
    so.emu_step_workspace.argtypes = [p, ctypes.c_int]
    so.emu_step_workspace.restype = ctypes.c_int64
    so.emu_step_run.argtypes = [p, p, p, p, p, p, ctypes.c_int, ctypes.c_int, ctypes.c_uint, p,
                                ctypes.c_int]
    return so


def _sd() -> dict[str, torch.Tensor]:
    # fp16-rounded weights, so the fp32 reference multiplies by the very weights the kernel reads
    sd = random_state_dict(make_config(L, C, V), seed=11, dtype=torch.float32)
    return {k: v.half().float() for k, v in sd.items()}


def _model(dtype: str, k_major: bool = False) -> RWKV7:
    model = RWKV7.from_state_dict(_sd(), device="cpu", dtype=dtype)
    if k_major:
        for blk in model.blocks:
            blk.ffn_value = KMajorLinear(blk.ffn_value.weight, (None, None))
    return model


class Stepper:
    """The emulated kernel stepping one model on its own state pool."""

    def __init__(self, lib, model: RWKV7, wkv_dtype: torch.dtype, merge: bool = True):
        self.lib, self.model = lib, model
        self.pool = model.new_state_pool(SLOTS, wkv_dtype)
        self.dims = step_dims(model, self.pool, merge)
        self.ws = Workspace(model, lib.emu_step_workspace(self.dims.data_ptr(), 0),
                            lib.emu_step_workspace(self.dims.data_ptr(), 1))
        self.model_entries, self.layer_entries = step_entries(model, self.pool, self.ws)

    def step(self, token: int, slot: int, grid: int, prefetch: bool = True, seed: int = 1,
             timeline: torch.Tensor | None = None) -> torch.Tensor:
        tok, sl = torch.tensor([token]), torch.tensor([slot])
        rc = self.lib.emu_step_run(self.dims.data_ptr(), self.model_entries.data_ptr(), self.layer_entries.data_ptr(),
                                   tok.data_ptr(), sl.data_ptr(), self.ws.sync.data_ptr(), int(prefetch), grid, seed,
                                   None if timeline is None else timeline.data_ptr(),
                                   0 if timeline is None else timeline.shape[2])
        assert rc == 0, f"emulated step failed: {rc}"
        assert self.ws.sync.tolist() == [0, 0], "the grid barrier's counters must be zero after a step"
        assert not self.ws.deps.any(), "the merged phases' counters must be zero after a step"
        return self.ws.logits.clone()

    def run(self, tokens: list[int], slot: int, grid: int, prefetch: bool = True) -> list[torch.Tensor]:
        return [self.step(t, slot, grid, prefetch, seed=grid * 31 + i) for i, t in enumerate(tokens)]


def _reference(model: RWKV7, tokens: list[int], slot: int, wkv_dtype=torch.float32):
    pool = model.new_state_pool(SLOTS, wkv_dtype)
    return [model.decode([t], [slot], pool)[0].float() for t in tokens], pool


@pytest.fixture(scope="module")
def references():
    ref32, pool32 = _reference(_model("fp32"), PROMPT, 1)
    ref16, _ = _reference(_model("fp16"), PROMPT, 1)
    drift = max(float((a - b).abs().max()) for a, b in zip(ref16, ref32))
    assert drift > 0
    return ref32, pool32, drift


def test_entries_match_the_kernel_build(lib):
    assert lib.emu_step_entries(0) == len(MODEL_ENTRIES)
    assert lib.emu_step_entries(1) == len(LAYER_ENTRIES)
    assert lib.emu_step_entries(2) == DIMS


@pytest.mark.parametrize("k_major,merge", [(True, True), (True, False), (False, True)],
                         ids=["ffn-k-major", "ffn-k-major-barriers", "ffn-row-major"])
def test_step_matches_the_readable_forward(lib, references, k_major, merge):
    ref32, pool32, drift = references
    stepper = Stepper(lib, _model("fp16", k_major), torch.float32, merge)
    assert unsupported(stepper.model, stepper.pool) is None
    ours = stepper.run(PROMPT, 1, grid=3)
    worst = max(float((a - b).abs().max()) for a, b in zip(ours, ref32))
    assert worst <= 3 * drift, (worst, drift)
    assert [int(x.argmax()) for x in ours] == [int(x.argmax()) for x in ref32]
    # the slot's states after the prompt; the other slots untouched
    for name, tol in (("att_shift", 2e-2), ("ffn_shift", 2e-2), ("wkv", 2e-2)):
        got, want = getattr(stepper.pool, name), getattr(pool32, name)
        torch.testing.assert_close(got[:, 1].float(), want[:, 1].float(), atol=tol, rtol=tol)
        assert not got[:, 0].any() and not got[:, 2].any(), name


@pytest.mark.parametrize("k_major", [True, False], ids=["ffn-k-major", "ffn-row-major"])
def test_same_bits_on_every_grid_prefetch_and_merge(lib, k_major):
    """Merged phases only change who waits for whom: the same bits as grid barriers."""
    model = _model("fp16", k_major)
    runs = {}
    for grid, prefetch, merge in ((1, True, True), (2, True, True), (3, False, True), (3, True, True),
                                  (2, True, False), (3, False, False)):
        stepper = Stepper(lib, model, torch.float32, merge)
        logits = stepper.run(PROMPT[:3], 0, grid, prefetch)
        runs[(grid, prefetch, merge)] = (torch.stack(logits), stepper.pool.wkv.clone(),
                                         stepper.pool.att_shift.clone(), stepper.pool.ffn_shift.clone())
    first = next(iter(runs.values()))
    for key, got in runs.items():
        for a, b in zip(got, first):
            assert torch.equal(a, b), key


def test_fp16_states(lib, references):
    ref32, pool32, drift = references
    stepper = Stepper(lib, _model("fp16", True), torch.float16)
    ours = stepper.run(PROMPT, 1, grid=2)
    ref16state, _ = _reference(_model("fp32"), PROMPT, 1, torch.float16)
    state_drift = max(float((a - b).abs().max()) for a, b in zip(ref16state, ref32))
    worst = max(float((a - b).abs().max()) for a, b in zip(ours, ref32))
    assert worst <= 3 * (drift + state_drift), (worst, drift, state_drift)
    assert [int(x.argmax()) for x in ours] == [int(x.argmax()) for x in ref32]
    torch.testing.assert_close(stepper.pool.wkv[:, 1].float(), pool32.wkv[:, 1], atol=2e-2, rtol=2e-2)


def test_bad_slot_gives_nan_and_writes_nothing(lib):
    stepper = Stepper(lib, _model("fp16", True), torch.float32)
    stepper.step(PROMPT[0], 0, grid=2)
    before = [t.clone() for t in (stepper.pool.wkv, stepper.pool.att_shift, stepper.pool.ffn_shift)]
    for slot in (SLOTS, -1):
        logits = stepper.step(PROMPT[1], slot, grid=2)
        assert torch.isnan(logits).all()
    for a, b in zip(before, (stepper.pool.wkv, stepper.pool.att_shift, stepper.pool.ffn_shift)):
        assert torch.equal(a, b)


class EmulatedKernel:
    """The compiled module's interface (infer/ops/persistent.py: PersistentStep) over the emulation: `build` keeps the
    entries (the harness builds the program from them on each run), `launch` runs the kernel on a 2-block grid."""

    def __init__(self, lib):
        self.lib, self.programs = lib, {}

    def entries(self, which: int) -> int:
        return self.lib.emu_step_entries(which)

    def workspace(self, dims: torch.Tensor, which: int) -> int:
        return self.lib.emu_step_workspace(dims.data_ptr(), which)

    def build(self, dims, model, layers) -> torch.Tensor:
        program = torch.zeros(8, dtype=torch.uint8)  # stands for the program's bytes
        self.programs[program.data_ptr()] = (dims, model, layers, program)
        return program

    def launch(self, program, dims, token, slot, emb, x, logits, sync, deps, prefetch, blocks, timeline,
               stream) -> None:
        d, model, layers, _ = self.programs[program.data_ptr()]
        rc = self.lib.emu_step_run(d.data_ptr(), model.data_ptr(), layers.data_ptr(), token.data_ptr(),
                                   slot.data_ptr(), sync.data_ptr(), prefetch, 2, 5,
                                   timeline.data_ptr() if timeline.numel() else None, timeline.shape[-1])
        assert rc == 0


def test_persistent_step_and_its_self_test_on_the_emulation(lib):
    """PersistentStep (plans, workspace, entries, logits) end to end on the emulated kernel, through the self-test the
    server runs before it uses the kernel; the self-test fails a kernel that computes nothing."""
    step = PersistentStep(EmulatedKernel(lib))
    assert self_test(step, torch.device("cpu")) is None

    class Idle(EmulatedKernel):
        def launch(self, *args) -> None:
            pass

    assert "self-test" in self_test(PersistentStep(Idle(lib)), torch.device("cpu"))


@pytest.mark.parametrize("k_major,merge", [(True, True), (True, False), (False, True), (False, False)])
def test_timeline_orders_the_phases_at_the_grid_barriers(lib, k_major, merge):
    """The timeline (bench/profile_persistent.py) has a row per phase_names entry, every block's start and end of
    each; every block's end of a phase precedes every block's start of the next (the grid barrier between them: the
    emulation's clock orders events across blocks); a timed step computes the same bits."""
    model, grid = _model("fp16", k_major), 3
    plain, timed = Stepper(lib, model, torch.float32, merge), Stepper(lib, model, torch.float32, merge)
    names = phase_names(plain.dims)
    assert len(names) == 2 + L * (5 if merge else 6 + k_major)
    for i, token in enumerate(PROMPT[:2]):
        timeline = torch.full((len(names) + 1, 2, grid + 1), -1, dtype=torch.int64)
        want = plain.step(token, 1, grid, seed=i)
        assert torch.equal(timed.step(token, 1, grid, seed=i, timeline=timeline), want)
        assert (timeline[len(names):] == -1).all() and (timeline[:, :, grid] == -1).all()  # nothing past the ends
        t = timeline[:len(names), :, :grid]
        assert (t > 0).all() and (t[:, 1] > t[:, 0]).all()
        assert (t[:-1, 1].amax(dim=1) < t[1:, 0].amin(dim=1)).all()
    # the PersistentStep side: rows named by phase_names, columns past the grid left as they were
    step = PersistentStep(EmulatedKernel(lib))
    pool = model.new_state_pool(SLOTS)
    out = step.timeline(model, PackedBatch.from_rows([[PROMPT[0]]], [0], "cpu"), pool, blocks=2)
    assert out.shape == (len(phase_names(step_dims(model, pool, step.merge))), 2, 2) and (out > 0).all()


def test_unsupported_models_are_refused():
    model = _model("fp32")
    assert "float16" in unsupported(model, model.new_state_pool(1))
