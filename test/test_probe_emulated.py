"""bench/probe_persistent.cu (the persistent-kernel probe for batch-1 decode) on the CPU emulation of
test/kernel_emu: one decode step of a tiny model through the probe's phases, against a float64 reference of
the same synthetic math (LN mixes, the GEMV tasks with their activations, the time mix per head, the head),
and every chaining the probe times (one launch per phase on several blocks, the persistent kernel, folded
norms, the prefetch before a phase on and off) bit for bit against each other. The GPU run compares its
variants' bits the same way; this checks the indexing (units of short and long rows, lanes per row, the
time-mix threads' columns) and that prefetched and loaded first batches agree, without a GPU.

The persistent kernel runs here on a one-block grid: the emulation runs a grid's blocks one after another,
so its grid barriers complete only when there is one block.
Skipped without g++ (C++20, <ucontext.h>).
"""
from __future__ import annotations

import ctypes

import pytest
import torch

from kernel_emu import emu_build

# L, C, F, V, ranks w/a/v/g: two heads, rows of 16..128 halves (lanes per row 4..16), a 4-row-per-unit LoRA
DIMS = (2, 128, 512, 256, 32, 32, 16, 64)
LAYER_BUFFERS = 15


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> ctypes.CDLL:
    d = tmp_path_factory.mktemp("kernel_emu_probe")
    reason = emu_build.usable(d)
    if reason:
        pytest.skip(reason)
    job = emu_build.build_command("bench/probe_persistent.cu", "emu_probe.cpp", 32, d, "probe")
    so = ctypes.CDLL(str(emu_build.build_all({"probe": job})["probe"]))
    p, i32 = ctypes.c_void_p, ctypes.c_int
    so.emu_probe_buffer_count.argtypes = [p]
    so.emu_probe_buffer_shape.argtypes = [p, i32, p, p]
    so.emu_probe_phase_count.argtypes = [p, i32]
    so.emu_probe_step.argtypes = [p, p, i32, i32, i32, i32, ctypes.c_uint]
    return so


def _dims_arg():
    return (ctypes.c_int * len(DIMS))(*DIMS)


def _buffers(lib: ctypes.CDLL) -> list[torch.Tensor]:
    """The probe's buffers (its order), weights ~ U(-1, 1)/sqrt(fan-in) in fp16, states small, x ~ U(-1, 1)."""
    gen = torch.Generator().manual_seed(7)
    dims = _dims_arg()
    out = []
    for i in range(lib.emu_probe_buffer_count(dims)):
        elems, half = ctypes.c_int64(), ctypes.c_int()
        lib.emu_probe_buffer_shape(dims, i, ctypes.byref(elems), ctypes.byref(half))
        u = torch.rand(elems.value, generator=gen, dtype=torch.float64) * 2 - 1
        if half.value:
            out.append((u * 1.7 / 16).to(torch.float16))
        else:
            out.append((u * (0.1 if i < DIMS[0] * LAYER_BUFFERS else 1.0)).to(torch.float32))
    return out


def _step(lib: ctypes.CDLL, bufs: list[torch.Tensor], *, fold: int, persistent: int, prefetch: int,
          grid: int) -> None:
    ptrs = (ctypes.c_void_p * len(bufs))(*[t.data_ptr() for t in bufs])
    rc = lib.emu_probe_step(_dims_arg(), ptrs, fold, persistent, prefetch, grid, 3)
    assert rc == 0, f"emulated probe step failed: {rc}"


def _ln_mixes(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    mean = x.mean()
    var = torch.clamp((x * x).mean() - mean * mean, min=0.0)
    xn = (x - mean) / torch.sqrt(var + 1e-5)
    return [xn * (1.0 + 0.05 * m) for m in range(n)]


def _reference(bufs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One step of the probe's synthetic math in float64: logits, x and the new states."""
    L, C, F, V, rw, ra, rv, rg = DIMS
    H = C // 64
    f64 = [t.to(torch.float64) for t in bufs]
    acts = f64[L * LAYER_BUFFERS + 1:]
    x = acts[0].clone()
    states = []
    for layer in range(L):
        w = f64[layer * LAYER_BUFFERS:(layer + 1) * LAYER_BUFFERS]
        m = _ln_mixes(x, 6)
        r, k, v = w[0].view(C, C) @ m[0], w[1].view(C, C) @ m[2], w[2].view(C, C) @ m[3]
        hw, ha = torch.tanh(w[3].view(rw, C) @ m[1]), w[4].view(ra, C) @ m[4]
        hv, hg = w[5].view(rv, C) @ m[3], torch.sigmoid(w[6].view(rg, C) @ m[5])
        dw, da = w[7].view(C, rw) @ hw, w[8].view(C, ra) @ ha
        dv, g = w[9].view(C, rv) @ hv, w[10].view(C, rg) @ hg
        S = w[14].view(H, 64, 64).clone()
        out = torch.empty(C, dtype=torch.float64)
        for h in range(H):
            c = slice(h * 64, (h + 1) * 64)
            a = torch.sigmoid(da[c])
            decay = torch.exp(-0.606531 * torch.sigmoid(dw[c]))
            kk = k[c] / torch.sqrt(torch.clamp((k[c] * k[c]).sum(), min=1e-12))
            kp = k[c] * (1 + (a - 1) * 0.5)
            vv = v[c] * torch.sigmoid(dv[c])
            sa = S[h] @ -kk
            S[h] = S[h] * decay[None, :] + sa[:, None] * (kk * a)[None, :] + vv[:, None] * kp[None, :]
            y = S[h] @ r[c]
            mean = y.mean()
            var = torch.clamp((y * y).mean() - mean * mean, min=0.0)
            out[c] = ((y - mean) / torch.sqrt(var + 64e-5) + (r[c] * kp).sum() * vv * 0.1) * g[c]
        states.append(S.reshape(-1))
        x = x + w[11].view(C, C) @ out
        fh = torch.relu(w[12].view(F, C) @ _ln_mixes(x, 1)[0]) ** 2
        x = x + w[13].view(C, F)[:, :F // 2] @ fh[:F // 2]
    logits = f64[L * LAYER_BUFFERS].view(V, C) @ _ln_mixes(x, 1)[0]
    return logits, x, states


VARIANTS = {  # name: (fold, persistent, prefetch, grid)
    "launches, 3 blocks": (0, 0, 1, 3),
    "launches, 3 blocks, no prefetch": (0, 0, 0, 3),
    "launches, folded norms, 2 blocks": (1, 0, 1, 2),
    "persistent": (0, 1, 1, 1),
    "persistent, no prefetch": (0, 1, 0, 1),
    "persistent, folded norms": (1, 1, 1, 1),
}


def test_probe_phase_counts(lib):
    L = DIMS[0]
    assert lib.emu_probe_phase_count(_dims_arg(), 0) == 8 * L + 2  # norm1 rkv lora2 tmix out norm2 ffnk ffnv; head
    assert lib.emu_probe_phase_count(_dims_arg(), 1) == 6 * L + 1  # the norms folded into the phases reading them


def test_probe_step_matches_the_reference_and_every_variant_gives_the_same_bits(lib):
    L = DIMS[0]
    initial = _buffers(lib)
    logits_ref, x_ref, states_ref = _reference(initial)
    results = {}
    for name, (fold, persistent, prefetch, grid) in VARIANTS.items():
        bufs = [t.clone() for t in initial]
        _step(lib, bufs, fold=fold, persistent=persistent, prefetch=prefetch, grid=grid)
        acts = bufs[L * LAYER_BUFFERS + 1:]
        results[name] = (acts[12].clone(), acts[0].clone(),
                         [bufs[layer * LAYER_BUFFERS + 14].clone() for layer in range(L)])
    first = next(iter(results.values()))
    for name, (logits, x, states) in results.items():
        scale = float(logits_ref.abs().max())
        torch.testing.assert_close(logits.double(), logits_ref, rtol=1e-4, atol=1e-4 * scale, msg=name)
        torch.testing.assert_close(x.double(), x_ref, rtol=1e-4, atol=1e-4 * float(x_ref.abs().max()), msg=name)
        for got, want in zip(states, states_ref):
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5, msg=name)
        assert torch.equal(logits, first[0]) and torch.equal(x, first[1]), name
        assert all(torch.equal(a, b) for a, b in zip(states, first[2])), name


def test_probe_refuses_a_persistent_grid_the_emulation_cannot_run(lib):
    bufs = _buffers(lib)
    ptrs = (ctypes.c_void_p * len(bufs))(*[t.data_ptr() for t in bufs])
    assert lib.emu_probe_step(_dims_arg(), ptrs, 0, 1, 1, 2, 3) == -1
