"""The sampler kernel's own source (cuda/sampler.cu, hip/sampler.hip) run on the CPU, against its exact
definition and the torch path.

The kernel code is compiled with g++ against a small emulation of the device features it uses
(test/kernel_emu, shared with test_fused_emulated.py: a block's 512 threads are fibers run in a random
order between barriers, shuffles go through per-warp buffers), so its logic, block reductions and
barriers are exercised without a GPU; the HIP port runs with 64-wide (CDNA) and 32-wide (RDNA) warps.
Memory-model and performance questions need the real device: test_sampler_cuda.py. Skipped without g++
(C++20, <ucontext.h>).
"""
from __future__ import annotations

import ctypes
import zlib
from pathlib import Path

import pytest
import torch

from infer.ops.sampler_cuda import self_test_batch
from infer.sampler import Sampler, _draw
from kernel_emu import emu_build
from sampler_model import exact_tau_draw, probability_rows, row_params, torch_sums_exact

VARIANTS = {"cuda": ("cuda/sampler.cu", 32), "hip-wave64": ("hip/sampler.hip", 64),
            "hip-wave32": ("hip/sampler.hip", 32)}


@pytest.fixture(scope="session")
def emu_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("sampler_emu")
    reason = emu_build.usable(d)
    if reason:
        pytest.skip(reason)
    return d


_libs: dict[str, ctypes.CDLL] = {}


def emulated(variant: str, emu_dir: Path):
    """Build (once) the kernel source of ``variant`` for the CPU emulation; a callable like CudaSampler."""
    if variant not in _libs:
        src, warp = VARIANTS[variant]
        cmd, lib = emu_build.build_command(src, "emu_sampler.cpp", warp, emu_dir, variant)
        emu_build.build_all({variant: (cmd, lib)})
        so = ctypes.CDLL(str(lib))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        so.emu_sampler.argtypes = [i64, i64, i64, ptr, ptr, i64, ptr, i64, ptr, i64, ptr, i64, ptr, ptr]
        so.emu_sampler.restype = ctypes.c_int
        _libs[variant] = so
    so = _libs[variant]

    def run(p, top_k, top_p, u, greedy):
        assert p.dtype == torch.float32 and p.stride(1) == 1
        B, V = p.shape
        tau = torch.full((B,), -1.0)
        drawn = torch.full((B,), -1, dtype=torch.int64)
        rc = so.emu_sampler(B, V, p.stride(0), p.data_ptr(), top_k.data_ptr(), top_k.stride(0), top_p.data_ptr(),
                            top_p.stride(0), u.data_ptr(), u.stride(0), greedy.data_ptr(), greedy.stride(0),
                            tau.data_ptr(), drawn.data_ptr())
        assert rc == 0, f"row {rc - 1}: the block deadlocked (its threads reached different barriers)"
        return tau, drawn

    return run


def torch_path(p, top_k, top_p, u):
    """The torch path as it runs on CUDA (full-sort thresholds, fp64 CDF), on the CPU."""
    V = p.shape[1]
    tau = Sampler(V, 1, "cpu", valid_vocab=V, impl="torch")._thresholds(p, top_k, top_p, V)[0]
    kept = p.masked_fill(p < tau[:, None], 0.0).double().cumsum(dim=1)
    total = kept[:, -1:]
    target = torch.minimum(u.double()[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return tau, torch.searchsorted(kept, target, right=True).squeeze(1).clamp(max=V - 1)


def check(run, p, top_k, top_p, u, greedy) -> int:
    """Kernel == exact definition on every sampled row, == torch path where its sums are exact.
    Returns how many sampled rows the torch path rounds differently (allowed, see cuda/sampler.cu)."""
    tau, drawn = run(p, top_k, top_p, u, greedy)
    live = greedy == 0
    assert (tau[~live] == 0).all() and (drawn[~live] == 0).all()
    t_ex, d_ex = exact_tau_draw(p, top_k, top_p, u)
    bad = live & ((tau != t_ex) | (drawn != d_ex))
    assert not bad.any(), (f"rows {bad.nonzero().flatten().tolist()}: kernel {tau[bad].tolist()} {drawn[bad].tolist()}"
                           f" exact {t_ex[bad].tolist()} {d_ex[bad].tolist()} top_k {top_k[bad].tolist()} "
                           f"top_p {top_p[bad].tolist()}")
    t_ref, d_ref = torch_path(p, top_k, top_p, u)
    differ = live & ((tau != t_ref) | (drawn != d_ref))
    exact = torch_sums_exact(p, top_k, tau, t_ref)
    assert not (differ & exact).any(), f"rows {(differ & exact).nonzero().flatten().tolist()} differ from torch"
    return int(differ.sum())


@pytest.mark.parametrize("variant,V", [("cuda", 1000), ("cuda", 4099), ("hip-wave64", 1000), ("hip-wave32", 4099)])
def test_loader_self_test_batch(variant, V, emu_dir):
    """The batch the loader checks on first build (float4 loads at V=1000, scalar at 4099), through the
    emulated kernel, against the torch path."""
    p, top_k, top_p, u, greedy = self_test_batch(torch.device("cpu"), V)
    tau, drawn = emulated(variant, emu_dir)(p, top_k, top_p, u, greedy)
    t_ref, d_ref = torch_path(p, top_k, top_p, u)
    live = greedy == 0
    assert torch.equal(tau[live], t_ref[live]) and torch.equal(drawn[live], d_ref[live])
    assert torch.equal(drawn[live], _draw(p.clone(), t_ref, u)[live])  # the CPU torch draw agrees too


CASES = [  # (kind, B, V)
    ("normal", 6, 65536), ("spread", 6, 65536), ("flat", 4, 65536), ("peaked", 6, 65536), ("bf16", 4, 65536),
    ("ties", 4, 4096), ("masked", 6, 4099), ("uniform", 3, 1000), ("spread", 6, 333), ("peaked", 6, 100),
    ("normal", 4, 5), ("normal", 3, 2), ("normal", 2, 1),
]


@pytest.mark.parametrize("kind,B,V", CASES)
def test_cuda_source_matches_definition(kind, B, V, emu_dir):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kind}-{B}-{V}".encode()))
    p = probability_rows(kind, B, V, gen, valid=V - 6 if V > 64 else None)
    check(emulated("cuda", emu_dir), p, *row_params(B, V, gen))


@pytest.mark.parametrize("variant", ["hip-wave64", "hip-wave32"])
def test_hip_source_matches_definition(variant, emu_dir):
    gen = torch.Generator().manual_seed(7)
    run = emulated(variant, emu_dir)
    for kind, B, V in [("spread", 4, 65536), ("peaked", 3, 4099), ("ties", 3, 1000), ("masked", 3, 333)]:
        check(run, probability_rows(kind, B, V, gen), *row_params(B, V, gen))


def test_strided_rows(emu_dir):
    """Rows with a row stride other than V (float4 and scalar paths), strided parameter vectors."""
    gen = torch.Generator().manual_seed(3)
    run = emulated("cuda", emu_dir)
    for pad in (4, 1):
        V = 2048
        big = torch.zeros(3, V + pad)
        big[:, :V] = probability_rows("spread", 3, V, gen)
        top_k, top_p, u, greedy = row_params(3, V, gen, greedy_share=0.0)
        ip = torch.stack([greedy, top_k, top_k, top_k], dim=1)  # like Sampler's packed columns
        fp = torch.stack([top_p, top_p], dim=1)
        p = big[:, :V]
        check(run, p, ip[:, 1], fp[:, 1], u, ip[:, 0])
