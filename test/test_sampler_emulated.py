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

from infer.ops.sampler_cuda import prepare_case, prepare_mismatch, self_test_batch
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
        so.emu_sampler_prepare.argtypes = [i64, i64, i64, ctypes.c_int, ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64,
                                           ptr, i64, ptr, ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr]
        so.emu_sampler_prepare.restype = ctypes.c_int
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


class EmulatedPrepare:
    """``prepare`` of infer.ops.sampler_cuda.CudaSampler, run by the emulated kernel of one variant."""

    def __init__(self, variant: str, emu_dir: Path):
        emulated(variant, emu_dir)
        self._so = _libs[variant]

    def prepare(self, logits, penalty, slots, bias_ids, bias_vals, valid_vocab, temperature, k1, k2, steps):
        B, V = logits.shape
        assert logits.dtype in (torch.float16, torch.float32) and logits.stride(1) == 1
        s = torch.full((B, V), -7.0)
        tok, fallback = torch.full((B,), -1, dtype=torch.int64), torch.full((B,), -1, dtype=torch.int64)
        dead = torch.zeros(B, dtype=torch.bool)
        u = torch.full((B,), -1.0)
        slots, steps = slots.contiguous(), steps.contiguous()
        assert k1.stride(0) == k2.stride(0)
        ids_ptr, vals_ptr, n_bias, bias_stride = None, None, 0, 0
        if bias_ids is not None:
            ids_ptr, vals_ptr, n_bias, bias_stride = (bias_ids.data_ptr(), bias_vals.data_ptr(), bias_ids.shape[1],
                                                      bias_ids.stride(0))
        rc = self._so.emu_sampler_prepare(
            B, V, valid_vocab, int(logits.dtype == torch.float16), logits.data_ptr(), logits.stride(0),
            None if penalty is None else penalty.data_ptr(), 0 if penalty is None else penalty.stride(0),
            slots.data_ptr(), ids_ptr, vals_ptr, n_bias, bias_stride, temperature.data_ptr(), temperature.stride(0),
            k1.data_ptr(), k2.data_ptr(), k1.stride(0), steps.data_ptr(), s.data_ptr(), s.stride(0), tok.data_ptr(),
            dead.data_ptr(), fallback.data_ptr(), u.data_ptr())
        assert rc == 0, f"row {rc - 1}: the block deadlocked"
        return s, tok, dead, fallback, u


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("V", [1000, 4099])
def test_prepare_matches_the_torch_steps(variant, dtype, V, emu_dir):
    """The logits' preparation (penalties, biases with token 0's beside padding entries, NaN and +-inf, the
    valid vocabulary, temperatures, a dead row) bit for bit what Sampler._prepare computes; the loader's
    self-test case."""
    assert prepare_mismatch(EmulatedPrepare(variant, emu_dir), *prepare_case(torch.device("cpu"), V, dtype)) is None


def test_prepare_mismatch_sees_a_wrong_kernel(emu_dir):
    """The comparison the loader and the tests rely on fails for a preparation that skips the bias."""
    class NoBias(EmulatedPrepare):
        def prepare(self, logits, penalty, slots, bias_ids, bias_vals, valid_vocab, temperature, k1, k2, steps):
            return super().prepare(logits, penalty, slots, None, None, valid_vocab, temperature, k1, k2, steps)
    assert "tok" in prepare_mismatch(NoBias("cuda", emu_dir), *prepare_case(torch.device("cpu"), 1000, torch.float32))


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
