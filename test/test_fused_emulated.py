"""The fused forward kernels (cuda/rwkv7_fused.cu: ln_shift_mix, time_mix, the grouped GEMV) and the WKV
slot kernel (cuda/wkv7_slots.cu), and their HIP ports, run on the CPU against the torch reference math.

The kernel sources are compiled with g++ against the emulation in test/kernel_emu (shared with
test_sampler_emulated.py): a block's threads are fibers run in a random order between barriers, warp
shuffles go through per-warp buffers, the blocks of a grid run one after another in a shuffled order,
and a block whose threads end at different barriers is reported as deadlocked. The HIP ports run with
64-wide (CDNA) and 32-wide (RDNA) wavefronts. So the kernels' indexing, reductions, barriers, fp16
packing, early exits (bad slots, empty rows) and state round trip are checked without a GPU;
test_fused_cuda.py and test_wkv_cuda.py check the compiled kernels on a device.

References and tolerances (ulp: the spacing of fp16 numbers at the magnitude compared):
- ln_shift_mix: infer/model.py's own steps (F.layer_norm in fp16, _token_shift, ``xin + dx * mix`` in
  fp16). The kernel computes LN(x) in fp32 and rounds it once, as F.layer_norm's fp16 result is; fp32
  statistics summed in another order can flip that rounding: the LN values (and so the new shift
  state) within 1 ulp, also of a float64 layer norm. The kernel rounds each mix once, the model rounds
  dx, dx * mix and the sum: within 4 ulp of max(|LN(x)|, |prev|) (three roundings of values up to
  twice that, plus the LN flips), and within 2 ulp, mostly identical, of the mix in fp32 rounded once.
  Plus 2^-20 absolute: the fp32 LN's error where its result is tiny (cancellation against the bias).
- time_mix: RWKV7._time_mix itself (stand-in linears return the projections) with TorchWKV. The
  model rounds a, kk, k', v' and y * g to fp16 (2^-11 relative each) and feeds them through the
  recurrence and the group norm, the kernel keeps them in fp32: outputs (size up to ~10) and state
  within 1e-2 + 1e-2 relative (seen: 0.016 and 0.007). Held tightly to the same math with fp32
  intermediates (the kernel's rounding points): outputs within 2 ulp (+2^-20 where an output is tiny:
  yn and bonus * v' cancel) and >99% identical (fp32 summation order only moves values across an fp16
  rounding boundary), state within 1e-5 (+1e-5
  relative) for an fp32 pool, 1 ulp (+2^-20 where a state value is tiny) for an fp16 pool.
- gemv: act(x) @ W^T (* scale) in float64; the kernel's fp16 product must lie between the fp16
  roundings of the exact product -/+ a bound on its fp32 accumulation error (K * 2^-23 * sum|w x|), and
  relu^2 and the residual add must follow exactly (both monotone and exact in fp32 before the final
  rounding); >95% of the outputs are the exact product rounded. 4-bit tasks take W as GemLite's kernels
  rebuild it from its packed layout (fp16(q * scale + zero), rounded once; the test packs and unpacks
  that layout itself, without gemlite) and sum on the (emulated) tensor cores, whose operands are fp16:
  an activated x is rounded to fp16 first, within one ulp. One-hot rows of x check every rebuilt weight
  bit for bit.
- wkv7_slots: TorchWKV (fp32 math): y within 3e-5 (+1e-5 relative) and an fp32 state within 1e-5
  (+1e-5 relative): summation order (seen: 8e-6, 1e-6); an fp16 state pool within 1 ulp (+2^-20),
  >99% identical.
On a GPU the kernels are built with --use_fast_math (approximate __expf, rsqrtf, division): this
emulation computes those exactly, so it checks the logic, not the last bits of the device's math.
Skipped without g++ (C++20, <ucontext.h>).
"""
from __future__ import annotations

import ctypes
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from infer.batch import PackedBatch
from infer.model import EXP_MINUS_HALF, GROUPNORM_EPS_PER_CHANNEL, LN_EPS, RWKV7, _token_shift
from infer.ops.wkv import TorchWKV
from kernel_emu import emu_build

N = 64
EPI_NONE, EPI_RELU_SQUARE, EPI_TANH, EPI_SIGMOID = 0, 1, 2, 3
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
FUSED = {"cuda": ("cuda/rwkv7_fused.cu", 32, ()), "hip-wave64": ("hip/rwkv7_fused.hip", 64, ()),
         "hip-wave32": ("hip/rwkv7_fused.hip", 32, ())}
VARIANTS = ("cuda", "hip-wave64", "hip-wave32")
SLOTS = {"cuda": ("cuda/wkv7_slots.cu", 32, ()), "hip-wave64": ("hip/wkv7_slots.hip", 64, ("EMU_HIP",)),
         "hip-wave32": ("hip/wkv7_slots.hip", 32, ("EMU_HIP",))}


# --------------------------------------------------------------------------------------------- build
@pytest.fixture(scope="session")
def libs(tmp_path_factory) -> dict[str, ctypes.CDLL]:
    d = tmp_path_factory.mktemp("kernel_emu")
    reason = emu_build.usable(d)
    if reason:
        pytest.skip(reason)
    jobs = {}
    for v, (src, warp, defines) in FUSED.items():
        jobs[f"fused-{v}"] = emu_build.build_command(src, "emu_fused.cpp", warp, d, f"fused-{v}", defines)
    for v, (src, warp, defines) in SLOTS.items():
        jobs[f"slots-{v}"] = emu_build.build_command(src, "emu_wkv7_slots.cpp", warp, d, f"slots-{v}", defines)
    out = {}
    for name, path in emu_build.build_all(jobs).items():
        so = ctypes.CDLL(str(path))
        i64, i32, p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        if name.startswith("fused"):
            so.emu_fused_ln_shift_mix.argtypes = [i64, i64, i64, p, p, p, p, p, p, p, p, p, i32, i32]
            so.emu_ln_span_for.argtypes = [i64, i64, i64]
            so.emu_fused_time_mix.argtypes = [i32, i64, i64, i64, i64, p, p, p, p, p, p, i32, i32, i64, i32]
            so.emu_time_mix_kernel_for.argtypes = [p, i32, ctypes.c_uint, i32]
            so.emu_split_parts.argtypes = [ctypes.c_uint, i32]
            so.emu_fused_relu_square.argtypes = [i64, p]
            so.emu_fused_uint4_dequantize.argtypes = [p, p, p, i64, i64, i64, i64, i64, p]
            so.emu_fused_gemv.argtypes = [i64, i32, p, p, p, p, p, p, p, p, p, p, p, i32]
            so.emu_fused_gemv_splits.argtypes = [i32, p, p, p, p, p]
            if hasattr(so, "emu_fused_gemv_staged"):
                so.emu_fused_gemv_staged.argtypes = [i64, i32, p, p, p, p, p, p, p, p, p, p, p, p, p]
            if hasattr(so, "emu_fused_gemv_stream"):
                so.emu_fused_gemv_stream.argtypes = [i64, i32, p, p, p, p, p, p, p, i32]
                so.emu_plan_stream_gemv.argtypes = [i32, p, p, i32, i32, p]
            so.emu_fused_sparse_gemv.argtypes = [i64, p, p, p, p, p, p, p, i64, i64, i64, ctypes.c_uint]
            so.emu_fused_sparse_gemv_plan.argtypes = [i64, i64, i64, p]
            so.emu_f32_to_f16.argtypes = [p, p, i64]
            so.emu_f16_to_f32.argtypes = [p, p, i64]
            so.emu_f16_fma.argtypes = [p, p, p, p, i64]
        else:
            so.emu_wkv7_slots.argtypes = [i32, i32, i64, i64, i64, i64, p, p, p, p, p, p, p, p, p, p, p]
        out[name] = so
    return out


def _ptr(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    assert t.is_contiguous() and t.data_ptr() % 16 == 0
    return t.data_ptr()


def _ptrs(ts) -> ctypes.Array:
    return (ctypes.c_void_p * len(ts))(*[_ptr(t) for t in ts])


def _ints(values, ctype):
    return (ctype * len(values))(*values)


def _check_rc(rc: int) -> None:
    assert rc != -1, "the harness refused the arguments"
    assert rc == 0, f"block {rc - 1} deadlocked: its threads reached different barriers"


# --------------------------------------------------------------------------------------------- fp16
def ulp16(t: torch.Tensor) -> torch.Tensor:
    """The spacing of fp16 numbers at |t| (2^-24 in the subnormal range)."""
    a = t.double().abs()
    _, e = torch.frexp(a)
    return torch.where(a < 2.0 ** -14, torch.full_like(a, 2.0 ** -24), torch.ldexp(torch.ones_like(a), e - 11))


def assert_ulps(got: torch.Tensor, want: torch.Tensor, ulps: float, what: str, scale: torch.Tensor | None = None,
                atol: float = 0.0):
    got, want = got.double(), want.double()
    scale = torch.maximum(got.abs(), want.abs()) if scale is None else scale.double().abs()
    err = (got - want).abs()
    bad = ~(err <= ulps * ulp16(scale) + atol)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} values beyond {ulps} fp16 ulp, e.g. "
                           f"{got[bad][:4].tolist()} vs {want[bad][:4].tolist()}")


def assert_close(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float, what: str):
    got, want = got.double(), want.double()
    err = (got - want).abs()
    bad = ~(err <= atol + rtol * want.abs())
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} values differ, worst {float(err.max()):.3g}: "
                           f"{got[bad][:4].tolist()} vs {want[bad][:4].tolist()}")


def f16_step(h: torch.Tensor, up: bool) -> torch.Tensor:
    """The fp16 neighbour of each finite fp16 value of h, above or below."""
    bits = h.view(torch.int16).to(torch.int32) & 0xFFFF
    magnitude = bits & 0x7FFF
    ordered = torch.where(bits >= 0x8000, -magnitude, magnitude) + (1 if up else -1)  # -0 and +0 are both 0
    bits = torch.where(ordered < 0, (-ordered) | 0x8000, ordered)
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(torch.float16)


def f16_floor(x: torch.Tensor) -> torch.Tensor:
    h = x.to(torch.float16)
    return torch.where(h.double() > x, f16_step(h, False), h)


def f16_ceil(x: torch.Tensor) -> torch.Tensor:
    h = x.to(torch.float16)
    return torch.where(h.double() < x, f16_step(h, True), h)


def test_half_conversions_match_torch(libs):
    """The emulation's __half2float / __float2half_rn against torch's .float() / .half(): every fp16
    bit pattern, the midpoints between neighbouring fp16 numbers (ties to even) and their fp32
    neighbours, and random fp32 bit patterns around and beyond the fp16 range."""
    so = libs["fused-cuda"]
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    halves = bits.view(torch.float16)
    widened = torch.empty(bits.numel(), dtype=torch.float32)
    so.emu_f16_to_f32(_ptr(bits), _ptr(widened), bits.numel())
    want = halves.float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(widened), nan) and torch.equal(widened[~nan].view(torch.int32),
                                                                    want[~nan].view(torch.int32))

    finite = want[torch.isfinite(want)].double().unique()  # sorted; -0.0 and 0.0 collapse
    mids = ((finite[1:] + finite[:-1]) / 2).float()  # exact in fp32
    gen = torch.Generator().manual_seed(0)
    rand_bits = torch.randint(0x2E000000, 0x48000000, (1 << 20,), generator=gen, dtype=torch.int32)  # ~1e-11..131072
    rand_bits[::2] |= torch.tensor(-(1 << 31), dtype=torch.int32)
    wild = torch.randint(-(1 << 31), (1 << 31) - 1, (1 << 18,), generator=gen, dtype=torch.int32).view(torch.float32)
    special = torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, -65520.0, float("inf"), -float("inf"),
                            float("nan"), 2.0 ** -24, 2.0 ** -25, 2.0 ** -25 * 1.0000001, 2.0 ** -26, 6.1e-5])
    values = torch.cat([mids, torch.nextafter(mids, torch.full_like(mids, math.inf)),
                        torch.nextafter(mids, torch.full_like(mids, -math.inf)), rand_bits.view(torch.float32), wild,
                        special]).contiguous()
    got = torch.empty(values.numel(), dtype=torch.int16)
    so.emu_f32_to_f16(_ptr(values), _ptr(got), values.numel())
    want = values.half()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got.view(torch.float16)), nan)
    diff = (got != want.view(torch.int16)) & ~nan
    assert not diff.any(), f"fp16 rounding differs from torch for {values[diff][:8].tolist()}"


# --------------------------------------------------------------------------------------------- ln_shift_mix
def run_ln_shift_mix(so, x, ln_w, ln_b, shift, batch: PackedBatch, mixes, span: bool = False):
    T, C = x.shape
    outs = [torch.full((T, C), float("nan"), dtype=torch.float16) for _ in mixes]
    prev = batch.prev_index()
    _check_rc(so.emu_fused_ln_shift_mix(T, C, shift.shape[0], _ptr(x), _ptr(ln_w), _ptr(ln_b), _ptr(shift),
                                        _ptr(prev), _ptr(batch.slots), _ptr(batch.last), _ptrs(mixes), _ptrs(outs),
                                        len(mixes), int(span)))
    return outs


def ln_shift_mix_reference(x, ln_w, ln_b, shift, batch: PackedBatch, mixes):
    """forward_reference's steps: F.layer_norm (fp16), infer.model._token_shift, the mixes in fp16. A row
    whose slot is out of range reads a zero shift state and stores none (the kernel's contract): it gets
    a zero slot of its own past the end of a copy of the pool."""
    S, C = shift.shape
    xin = F.layer_norm(x, (C,), ln_w, ln_b, LN_EPS)
    bad = (batch.slots < 0) | (batch.slots >= S)
    slots = batch.slots.clone()
    slots[bad] = S + torch.arange(int(bad.sum()))
    pool = torch.cat([shift, torch.zeros(int(bad.sum()), C, dtype=shift.dtype)])
    prev = _token_shift(xin, pool, PackedBatch(batch.tokens, slots, batch.lens, batch.starts, batch.last))
    dx = prev - xin
    return xin, prev, [xin + dx * m for m in mixes], pool[:S]


# LN(x) = (x - mean) * rstd * w + b in fp32, evaluated in another order than torch's: the difference (a few
# fp32 ulp of terms up to ~4) only shows beside the fp16 ulp where the result is tiny (cancellation with b)
LN_ATOL = 2.0 ** -20
LN_ROWS = [3, 1, 4, 1, 2]
LN_SLOTS = [2, 1, 5, -1, 3]  # a pool of 5: slots 5 and -1 are out of range, 0 and 4 are not in the batch
# for the span kernel (4 tokens a block) also rows that cross blocks, so that a row start's block does not hold
# the row's last token
LN_LONG_ROWS = [6, 1, 9, 2, 1]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("C,count", [(128, 6), (192, 1), (2112, 2), (8192, 3)])
@pytest.mark.parametrize("kernel,rows", [("token", LN_ROWS), ("span", LN_ROWS), ("span", LN_LONG_ROWS)])
def test_ln_shift_mix(variant, C, count, kernel, rows, libs):
    """Layer norm + token shift + 1 or 6 mixes, rows of 1-9 tokens on a nonzero shift pool, two rows
    with out-of-range slots; C = 2112 gives some threads a second 8-vector, C = 8192 (the largest) four. The
    per-token kernel and the span kernel (prompts: 4 tokens per block), with the same assertions."""
    gen = torch.Generator().manual_seed(C + count)
    T, S = sum(rows), 5
    spread, offset = torch.rand(T, 1, generator=gen) * 3, torch.randn(T, 1, generator=gen)  # per token
    x = (torch.randn(T, C, generator=gen) * spread + offset).half()
    ln_w = (torch.randn(C, generator=gen) * 0.1 + 1).half()
    ln_b = (torch.randn(C, generator=gen) * 0.1).half()
    shift = torch.randn(S, C, generator=gen).half()
    mixes = [torch.rand(C, generator=gen).half() for _ in range(count)]
    batch = PackedBatch.from_rows([[0] * n for n in rows], LN_SLOTS, "cpu")

    got_shift = shift.clone()
    outs = run_ln_shift_mix(libs[f"fused-{variant}"], x, ln_w, ln_b, got_shift, batch, mixes, kernel == "span")
    xin, prev, want, want_shift = ln_shift_mix_reference(x, ln_w, ln_b, shift.clone(), batch, mixes)

    untouched = [0, 4]
    assert torch.equal(got_shift[untouched], shift[untouched]), "a slot outside the batch was written"
    assert_ulps(got_shift, want_shift, 1, "new shift state (LN of each row's last token)", atol=LN_ATOL)
    exact_ln = F.layer_norm(x.double(), (C,), ln_w.double(), ln_b.double(), LN_EPS).half()
    assert_ulps(got_shift[[2, 1, 3]], exact_ln[batch.last[[0, 1, 4]]], 1, "shift state vs float64 layer norm",
                atol=LN_ATOL)
    scale = torch.maximum(xin.abs(), prev.abs())
    for m in range(count):
        assert not torch.isnan(outs[m]).any()
        assert_ulps(outs[m], want[m], 4, f"mix {m}", scale=scale, atol=LN_ATOL)
        once = (xin.float() + (prev.float() - xin.float()) * mixes[m].float()).half()  # rounded once, as the kernel
        assert_ulps(outs[m], once, 2, f"mix {m} (fp32 mix)", scale=scale, atol=LN_ATOL)
        assert (outs[m] == once).float().mean() > 0.98


@pytest.mark.parametrize("variant", VARIANTS)
def test_ln_shift_mix_span_kernel_matches_per_token_kernel(variant, libs):
    """The span kernel normalises each token once and carries it to the next token: bit for bit the per-token
    kernel's outputs and shift states (rows crossing blocks, single tokens, out-of-range slots)."""
    gen = torch.Generator().manual_seed(7)
    C, S = 2112, 5
    batch = PackedBatch.from_rows([[0] * n for n in LN_LONG_ROWS], LN_SLOTS, "cpu")
    x = (torch.randn(batch.num_tokens, C, generator=gen) * 2 + 0.5).half()
    ln_w, ln_b = (torch.randn(C, generator=gen) * 0.1 + 1).half(), (torch.randn(C, generator=gen) * 0.1).half()
    shift = torch.randn(S, C, generator=gen).half()
    mixes = [torch.rand(C, generator=gen).half() for _ in range(6)]
    shifts = [shift.clone(), shift.clone()]
    outs = [run_ln_shift_mix(libs[f"fused-{variant}"], x, ln_w, ln_b, pool, batch, mixes, span)
            for pool, span in zip(shifts, (False, True))]
    assert torch.equal(shifts[0], shifts[1])
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_ln_shift_mix_takes_the_span_kernel_for_prompts(libs):
    """Launches whose rows average 4 tokens or more (prompts) take the span kernel where a thread holds two
    8-vectors of the row or more (C > 2,048: 7.2B); decode steps (a token per row), mostly-decode batches and
    narrower models (1.5B, 0.1B: slower with it on the H200) keep the per-token kernel."""
    so = libs["fused-cuda"]
    assert so.emu_ln_span_for(1024, 1, 4096) == 1 and so.emu_ln_span_for(16 * 4096, 16, 4096) == 1
    assert so.emu_ln_span_for(8, 2, 4096) == 1 and so.emu_ln_span_for(7, 2, 4096) == 0
    assert so.emu_ln_span_for(256, 256, 4096) == 0 and so.emu_ln_span_for(1, 1, 4096) == 0
    assert so.emu_ln_span_for(1024, 1, 2056) == 1 and so.emu_ln_span_for(1024, 1, 8192) == 1
    assert so.emu_ln_span_for(1024, 1, 2048) == 0 and so.emu_ln_span_for(1024, 1, 768) == 0


# --------------------------------------------------------------------------------------------- time_mix
class Fixed:
    """A stand-in linear layer: returns what the real projection produced (its input is ignored)."""

    def __init__(self, out: torch.Tensor):
        self.out = out

    def __call__(self, _x: torch.Tensor) -> torch.Tensor:
        return self.out


def time_mix_inputs(C: int, T: int, layer: int, gen: torch.Generator) -> dict:
    h = lambda *s, std=1.0, mean=0.0: (torch.randn(*s, generator=gen) * std + mean).half()  # noqa: E731
    u = lambda *s, lo=0.0, hi=1.0: torch.rand(*s, generator=gen) * (hi - lo) + lo  # noqa: E731
    p = dict(r=h(T, C), k=h(T, C), v=h(T, C), dw=h(T, C), da=h(T, C), g=h(T, C, std=0.5, mean=0.5),
             dv=h(T, C) if layer else None, v_first=h(T, C) if layer else None,
             w0=u(C, lo=-6.0, hi=3.0), r_k=torch.randn(C, generator=gen) * 0.3,
             lnx_w=torch.randn(C, generator=gen) * 0.1 + 1, lnx_b=torch.randn(C, generator=gen) * 0.1,
             a0=h(C, std=0.5), v0=h(C, std=0.5) if layer else None, k_k=u(C, lo=0.5, hi=1.2).half(),
             k_a=u(C, lo=0.5, hi=1.5).half())
    return p


TIME_MIX_KERNELS = {"decode": 0, "prefill": 1, "chunked": 2, "split": 3, "tc": 4}  # TimeMixKernel
# the kernels the tests run: the split kernel with 4 blocks per (row, head) ("split") or 2 ("split2"); "tc" (the
# chunked kernel on tensor cores) and "pipelined" (time_mix_pipelined_kernel, the launcher's choice for large
# fp16-state decode batches; here on two blocks per head) exist in the CUDA source only
TIME_MIX_RUNS = {**TIME_MIX_KERNELS, "split2": TIME_MIX_KERNELS["split"], "pipelined": 5}
# The tensor-core kernel's fp16 operands (the chunk's starting state, x, v', and the decayed key-axis vectors)
# put its outputs and states ~1e-3 relative from the fp32 recurrence: measured against the fp32-intermediate
# math, outputs within TC_OUT_ULPS fp16 ulp of the head's largest output and states within TC_STATE_TOL of the
# largest state value (seen: 2 ulp and 9e-4).
TC_OUT_ULPS, TC_STATE_TOL = 4, 2e-3


def skip_unless_cuda(variant: str, kernel: str) -> None:
    if kernel in ("tc", "pipelined") and variant != "cuda":
        pytest.skip(f"the {kernel} time mix has no HIP port")


def run_time_mix(so, layer, p, pool, slots, starts, lasts, kernel="decode"):
    T, C = p["r"].shape
    v_first = p["v_first"].clone() if layer else torch.full((T, C), -7.0, dtype=torch.float16)
    out = torch.full((T, C), 1234.0, dtype=torch.float16)
    tensors = [p["r"], p["k"], p["v"], p["dw"], p["da"], p["dv"], p["g"], v_first, out]
    params = [p["w0"], p["r_k"], p["lnx_w"], p["lnx_b"], p["a0"], p["v0"], p["k_k"], p["k_a"]]
    B = len(slots)
    ints = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    slots_t, starts_t, lasts_t = ints(slots), ints(starts), ints(lasts)
    max_len = max(1, max(last - start + 1 for start, last in zip(starts, lasts)))
    _check_rc(so.emu_fused_time_mix(DTYPE_CODE[pool.dtype], B, C // N, pool.shape[0], T, _ptr(pool), _ptr(slots_t),
                                    _ptr(starts_t), _ptr(lasts_t), _ptrs(tensors), _ptrs(params), int(layer == 0),
                                    TIME_MIX_RUNS[kernel], max_len, 2 if kernel == "split2" else 4))
    return out, v_first


def time_mix_model(layer, p, batch, pool):
    """RWKV7._time_mix itself on the projections in ``p`` (the stand-in linears return them; the output
    projection is the identity, so the result is ``y.to(fp16) * g``, what the kernel writes)."""
    T, C = p["r"].shape
    H = C // N
    zeros, hidden = torch.zeros(C, dtype=torch.float16), torch.zeros(T, 1, dtype=torch.float16)
    blk = SimpleNamespace(x_r=zeros, x_w=zeros, x_k=zeros, x_v=zeros, x_a=zeros, x_g=zeros, w0=p["w0"], a0=p["a0"],
                          v0=p["v0"], k_k=p["k_k"], k_a=p["k_a"], r_k=p["r_k"].view(H, N), w1=Fixed(hidden),
                          w2=Fixed(p["dw"]), a1=Fixed(hidden), a2=Fixed(p["da"]), v1=Fixed(hidden), v2=Fixed(p["dv"]),
                          g1=Fixed(hidden), g2=Fixed(p["g"]), receptance=Fixed(p["r"]), key=Fixed(p["k"]),
                          value=Fixed(p["v"]), output=lambda y: y, lnx_w=p["lnx_w"], lnx_b=p["lnx_b"])
    model = SimpleNamespace(config=SimpleNamespace(n_head=H, head_size=N), wkv=TorchWKV())
    state = SimpleNamespace(att_shift={layer: torch.zeros(pool.shape[0], C, dtype=torch.float16)}, wkv={layer: pool})
    xin = torch.zeros(T, C, dtype=torch.float16)
    return RWKV7._time_mix(model, layer, blk, xin, batch, state, p["v_first"])


def time_mix_fp32(layer, p, batch, pool):
    """The same math with every intermediate in fp32 and the kernel's two fp16 roundings at the end."""
    T, C = p["r"].shape
    H = C // N
    r, k, v = p["r"].float(), p["k"].float(), p["v"].float()
    w = torch.exp(-EXP_MINUS_HALF * torch.sigmoid(p["w0"] + p["dw"].float()))
    a = torch.sigmoid(p["a0"].float() + p["da"].float())
    kkr = (k * p["k_k"].float()).view(T, H, N)
    kk = (kkr / kkr.norm(dim=-1, keepdim=True).clamp_min(1e-12)).view(T, C)
    kn = k * (1 + (a - 1) * p["k_a"].float())
    if layer:
        v = v + (p["v_first"].float() - v) * torch.sigmoid(p["v0"].float() + p["dv"].float())
    y = TorchWKV()(pool, batch, r, w, kn, v, -kk, kk * a).view(T, H, N)
    mean = y.mean(-1, keepdim=True)
    var = ((y - mean) ** 2).mean(-1, keepdim=True)
    yn = ((y - mean) / torch.sqrt(var + GROUPNORM_EPS_PER_CHANNEL * N)).view(T, C) * p["lnx_w"] + p["lnx_b"]
    bonus = (r * kn * p["r_k"]).view(T, H, N).sum(-1, keepdim=True)
    res = yn + (bonus * v.view(T, H, N)).view(T, C)
    return (res.half().float() * p["g"].float()).half()


# The state in fp32 in another summation order differs by ~1e-6 at most: beside the fp16 ulp, that only
# shows where a state value is tiny (cancellation)
STATE_ATOL = 2.0 ** -20

# rows of 4, 1, 11, 2, 19 tokens (T = 37) on slots 3, 0, 9 (out of range: NaN output), 1, 5; then an empty
# row on slot 2 and a row whose tokens run past T on slot 4 (the kernel's guards: both leave everything
# alone). The prefill kernel works in chunks of 8 tokens: 19 is two whole chunks and a partial one.
TM_LENS, TM_SLOTS = [4, 1, 11, 2, 19], [3, 0, 9, 1, 5]
TM_EXTRA = [(2, 37, 36), (4, 35, 37)]  # (slot, start, last)
TM_POOL = 6


def _sub(p: dict, idx: torch.Tensor) -> dict:
    return {name: (t[idx].contiguous() if t is not None and t.dim() == 2 else t) for name, t in p.items()}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kernel", list(TIME_MIX_RUNS))
@pytest.mark.parametrize("C,layer,state_dtype", [(128, 0, torch.float32), (192, 3, torch.float16),
                                                 (192, 0, torch.float16), (128, 1, torch.float32)])
def test_time_mix(variant, kernel, C, layer, state_dtype, libs):
    skip_unless_cuda(variant, kernel)
    gen = torch.Generator().manual_seed(C * 10 + layer)
    T = sum(TM_LENS)
    p = time_mix_inputs(C, T, layer, gen)
    H = C // N
    pool = (torch.randn(TM_POOL, H, N, N, generator=gen) * 0.3).to(state_dtype)
    starts = [sum(TM_LENS[:i]) for i in range(len(TM_LENS))]
    lasts = [s + n - 1 for s, n in zip(starts, TM_LENS)]
    slots = TM_SLOTS + [e[0] for e in TM_EXTRA]
    got_pool = pool.clone()
    out, v_first = run_time_mix(libs[f"fused-{variant}"], layer, p, got_pool, slots, starts + [e[1] for e in TM_EXTRA],
                                lasts + [e[2] for e in TM_EXTRA], kernel=kernel)

    good = [i for i, s in enumerate(TM_SLOTS) if 0 <= s < TM_POOL]
    idx = torch.cat([torch.arange(starts[i], lasts[i] + 1) for i in good])
    bad_tokens = torch.arange(starts[2], lasts[2] + 1)
    sub = _sub(p, idx)
    batch = PackedBatch.from_rows([[0] * TM_LENS[i] for i in good], [TM_SLOTS[i] for i in good], "cpu")
    model_pool, fp32_pool = pool.clone(), pool.clone()
    want, want_v_first = time_mix_model(layer, sub, batch, model_pool)
    want32 = time_mix_fp32(layer, sub, batch, fp32_pool)

    assert torch.isnan(out[bad_tokens]).all(), "a row on an out-of-range slot must get NaN outputs"
    touched = [TM_SLOTS[i] for i in good]
    untouched = [s for s in range(TM_POOL) if s not in touched]
    assert torch.equal(got_pool[untouched], pool[untouched]), "a slot of a skipped row was written"
    if layer == 0:
        assert torch.equal(v_first[idx], p["v"][idx]), "layer 0 must store v as v_first"
        assert (v_first[bad_tokens] == -7.0).all()
    else:
        assert torch.equal(v_first, p["v_first"]), "v_first is read-only after layer 0"

    assert_close(out[idx], want, 1e-2, 1e-2, "output vs RWKV7._time_mix")
    assert_close(got_pool[touched], model_pool[touched], 1e-2, 1e-2, "state vs RWKV7._time_mix")
    if kernel == "tc":
        assert_tc_close(out[idx], want32, got_pool[touched], fp32_pool[touched])
        return
    assert_ulps(out[idx], want32, 2, "output vs the fp32-intermediate math", atol=STATE_ATOL)
    assert (out[idx] == want32).float().mean() > 0.99
    if state_dtype == torch.float32:
        assert_close(got_pool[touched], fp32_pool[touched], 1e-5, 1e-5, "state vs the fp32-intermediate math")
    else:
        assert_ulps(got_pool[touched], fp32_pool[touched], 1, "fp16 state vs the fp32-intermediate math",
                    atol=STATE_ATOL)


def assert_tc_close(out: torch.Tensor, want: torch.Tensor, pool: torch.Tensor, want_pool: torch.Tensor) -> None:
    """The tensor-core kernel against the fp32 recurrence: outputs within TC_OUT_ULPS ulp of the head's largest
    |output| (token by token), states within TC_STATE_TOL of the largest |state| of their head."""
    T, C = out.shape
    head_max = want.float().abs().view(T, C // N, N).amax(-1, keepdim=True).expand(T, C // N, N).reshape(T, C)
    assert_ulps(out, want, TC_OUT_ULPS, "output vs the fp32-intermediate math", scale=head_max, atol=STATE_ATOL)
    scale = want_pool.float().abs().amax(dim=(-2, -1), keepdim=True)
    assert_close(pool.float() / scale, want_pool.float() / scale, TC_STATE_TOL, 0.0, "state vs the fp32 math")


def run_kernels_on_rows(so, layer: int, state_dtype: torch.dtype, lens: list[int], slots: list[int], seed: int,
                        kernels: tuple[str, ...]) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
    """Random time-mix inputs for rows of ``lens`` tokens on ``slots`` (C = 128), run through each of ``kernels``
    from the same starting state: (that state, [(out, v_first, state after) per kernel])."""
    C, T = 128, sum(lens)
    gen = torch.Generator().manual_seed(seed)
    p = time_mix_inputs(C, T, layer, gen)
    pool = (torch.randn(len(slots), C // N, N, N, generator=gen) * 0.3).to(state_dtype)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    lasts = [s + n - 1 for s, n in zip(starts, lens)]
    runs = []
    for kernel in kernels:
        got = pool.clone()
        out, v_first = run_time_mix(so, layer, p, got, slots, starts, lasts, kernel=kernel)
        runs.append((out, v_first, got))
    return pool, runs


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kernel", ["chunked", "split", "split2", "tc"])
@pytest.mark.parametrize("layer,state_dtype", [(0, torch.float32), (2, torch.float32), (1, torch.float16)])
def test_time_mix_chunk_kernels_match_decode_kernel(variant, kernel, layer, state_dtype, libs):
    """The chunked and split prefill kernels against time_mix_kernel on rows of whole chunks, partial ones and
    single tokens: the same math, only the dot products over the state rows summed in another order (the
    tensor-core kernel: the same math in matrix form, within its fp16 operands' tolerance)."""
    skip_unless_cuda(variant, kernel)
    pool, ((out_d, vf_d, pool_d), (out_c, vf_c, pool_c)) = run_kernels_on_rows(
        libs[f"fused-{variant}"], layer, state_dtype, [8, 3, 16, 1, 9, 13], [4, 0, 2, 5, 1, 3], 99 + layer,
        ("decode", kernel))
    assert torch.equal(vf_d, vf_c), "v_first"
    if kernel == "tc":
        assert_tc_close(out_c, out_d, pool_c, pool_d)
        assert not torch.equal(pool_c, pool), "the state must have been updated"
        return
    assert_ulps(out_c, out_d, 2, f"output, {kernel} vs decode kernel", atol=STATE_ATOL)
    assert (out_c == out_d).float().mean() > 0.98
    if state_dtype == torch.float32:
        assert_close(pool_c, pool_d, 1e-5, 1e-5, f"state, {kernel} vs decode kernel")
    else:
        assert_ulps(pool_c, pool_d, 1, f"fp16 state, {kernel} vs decode kernel", atol=STATE_ATOL)
    assert not torch.equal(pool_c, pool), "the state must have been updated"


@pytest.mark.parametrize("layer,state_dtype", [(0, torch.float32), (2, torch.float32), (1, torch.float16)])
def test_pipelined_kernel_equals_decode_kernel_bit_for_bit(layer, state_dtype, libs):
    """time_mix_pipelined_kernel (blocks walking several rows, each next row's state, inputs and indices copied
    ahead) gives time_mix_kernel's bits on rows of one and of several tokens: the launcher may take either for a
    row by the size of the batch around it."""
    pool, (decode, pipelined) = run_kernels_on_rows(libs["fused-cuda"], layer, state_dtype,
                                                    [1, 1, 3, 1, 9, 1, 1, 2, 1], [4, 0, 2, 5, 1, 3, 8, 6, 7],
                                                    31 + layer, ("decode", "pipelined"))
    for a, b in zip(decode, pipelined):
        assert torch.equal(a, b)
    assert not torch.equal(pipelined[2], pool), "the state must have been updated"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layer,state_dtype", [(0, torch.float32), (2, torch.float16)])
def test_split_kernel_parts_agree_bit_for_bit(variant, layer, state_dtype, libs):
    """The split kernel's 2 and 4 blocks per (row, head) give the same bits: each state row keeps its threads'
    columns and sums, so a prompt's result does not depend on which count the batch around it leads to."""
    pool, runs = run_kernels_on_rows(libs[f"fused-{variant}"], layer, state_dtype, [8, 3, 19, 1], [2, 0, 3, 1],
                                     5 + layer, ("split", "split2"))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert not torch.equal(runs[0][2], pool)


@pytest.mark.parametrize("variant", VARIANTS)
def test_time_mix_kernel_choice(variant, libs):
    """Single-token steps take the decode kernel; prefills the split kernel on small grids, the 256-thread kernel
    on middling ones and the chunked one on large grids (in CUDA its tensor-core form); the split and chunked
    kernels only when every input is 16-byte aligned (their 16-byte loads need it), and the split kernel's output
    too (its finishing kernel stores 16 bytes)."""
    so = libs[f"fused-{variant}"]
    chunked = "tc" if variant == "cuda" else "chunked"
    buf = torch.zeros(4096, dtype=torch.float16)
    aligned = [buf[8 * j:] for j in range(9)]

    def choice(tensors, layer0, grid, prefill):
        ptrs = (ctypes.c_void_p * 9)(*[t.data_ptr() for t in tensors])
        return so.emu_time_mix_kernel_for(ptrs, int(layer0), grid, int(prefill))

    assert choice(aligned, False, 4096, False) == TIME_MIX_KERNELS["decode"]
    assert choice(aligned, False, 32, False) == TIME_MIX_KERNELS["decode"]
    assert choice(aligned, False, 64, True) == TIME_MIX_KERNELS["split"]
    assert choice(aligned, False, 128, True) == TIME_MIX_KERNELS["split"]
    assert choice(aligned, False, 129, True) == TIME_MIX_KERNELS["prefill"]
    assert choice(aligned, False, 511, True) == TIME_MIX_KERNELS["prefill"]
    assert choice(aligned, False, 512, True) == TIME_MIX_KERNELS[chunked]
    for j in range(8):  # r, k, v, dw, da, dv, g, v_first
        shifted = list(aligned)
        shifted[j] = buf[8 * j + 1:]
        # layer 0 reads neither dv (5) nor v_first (7): their alignment does not matter there
        reads = j not in (5, 7)
        assert choice(shifted, True, 512, True) == TIME_MIX_KERNELS["decode" if reads else chunked]
        assert choice(shifted, False, 512, True) == TIME_MIX_KERNELS["decode"], j
        assert choice(shifted, True, 64, True) == TIME_MIX_KERNELS["prefill" if reads else "split"]
        assert choice(shifted, False, 64, True) == TIME_MIX_KERNELS["prefill"], j
    shifted_out = aligned[:8] + [buf[8 * 8 + 1:]]
    assert choice(shifted_out, False, 64, True) == TIME_MIX_KERNELS["prefill"]
    assert choice(shifted_out, False, 512, True) == TIME_MIX_KERNELS[chunked]


@pytest.mark.parametrize("variant", VARIANTS)
def test_split_parts(variant, libs):
    """Two blocks per (row, head) exactly when that gives each multiprocessor one block where four would give
    it two (H200: a 7.2B prompt alone, 64 heads on 132 multiprocessors), else four; four when the count is
    unknown (0)."""
    parts = libs[f"fused-{variant}"].emu_split_parts
    assert [parts(grid, 132) for grid in (1, 32, 33, 34, 64, 66, 67, 128)] == [4, 4, 4, 2, 2, 2, 4, 4]
    assert parts(64, 0) == 4 and parts(16, 40) == 2 and parts(8, 40) == 4


KNOB_VALUES = [None, "", "0", "12", "007", "abc", "-3", "+5", " 5", "5 ", "4x", "1.5", "99999999999"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_env_knobs_parse_as_in_python(variant, libs, monkeypatch):
    """The kernels' env_int/env_flag read an environment knob as infer.ops.cuda_ext does: decimal digits, else
    the default (a sign, a space, a fraction or garbage is ignored, not read as 0); a switch is off at 0 only."""
    from infer.ops.cuda_ext import env_flag, env_int
    so = libs[f"fused-{variant}"]
    so.emu_env_int.argtypes, so.emu_env_int.restype = [ctypes.c_char_p, ctypes.c_longlong], ctypes.c_longlong
    so.emu_env_flag.argtypes, so.emu_env_flag.restype = [ctypes.c_char_p, ctypes.c_int], ctypes.c_int
    name = "RWKV_TEST_KNOB"
    want_int = {None: 9, "": 9, "0": 0, "12": 12, "007": 7, "99999999999": 99999999999}
    for value in KNOB_VALUES:
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        expect = want_int.get(value, 9)
        assert env_int(name, 9) == expect, value
        assert so.emu_env_int(name.encode(), 9) == expect, value
        for default in (True, False):
            flag = default if value not in want_int or value in (None, "") else want_int[value] != 0
            assert env_flag(name, default) is flag, (value, default)
            assert so.emu_env_flag(name.encode(), int(default)) == int(flag), (value, default)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n", [8, 4100, 8 * 256 * 4096 + 24 + 5])  # one vector; a tail; more than one grid-stride pass
def test_relu_square_matches_torch(variant, n, libs):
    """One pass of relu(x)^2 in place, as torch's relu_ then square_ round it (specials included)."""
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=gen) * 40).half()  # some squares overflow to inf
    x[:4] = torch.tensor([float("nan"), float("-inf"), float("inf"), -0.0]).half()
    want = torch.relu_(x.clone()).square_()
    got = x.clone()
    _check_rc(libs[f"fused-{variant}"].emu_fused_relu_square(n, _ptr(got)))
    assert torch.equal(got.isnan(), x.isnan()), "NaN must stay NaN (as torch.relu keeps it)"
    assert torch.equal(got[~x.isnan()], want[~x.isnan()])


# --------------------------------------------------------------------------------------------- gemv
F16, I8, I8_BAND = "f16", "i8", "i8-band"
# I8_BAND: int8 weights on the tensor cores (gemv_int8_band); the CUDA launcher gives int8 tasks this type
WEIGHT_TYPE = {F16: 0, I8: 1, "u4": 2, I8_BAND: 3}


def U4(group: int) -> tuple[str, int]:  # noqa: N802 - reads as a weight kind beside F16 and I8
    """GemLite's 4-bit layout with a scale and zero per `group` input columns."""
    return "u4", group


def f16_round(x: torch.Tensor) -> torch.Tensor:
    """float64 values rounded once to the nearest fp16 number, ties to even (torch's .half() of a float64
    goes through fp32: two roundings); as fp16."""
    a = x.abs()
    _, e = torch.frexp(a)
    ulp = torch.ldexp(torch.ones_like(a), (e - 1).clamp_min(-14) - 10)
    r = torch.round(a / ulp) * ulp  # exact scaling; round() is half-to-even
    r = torch.where(r >= 65520.0, torch.full_like(r, math.inf), r)
    return torch.copysign(r, x).half()  # r is an fp16 number: exact


def pack_gemlite_uint4(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What gemlite 0.6's A16W4_HQQ_INT packing stores for q (uint8 [N, K], 0..15) and a scale and zero point
    per group (fp16 [N, K / group]), written from its source (core.py pack, bitpack.py): 32-bit words
    [K/8, N], contiguous, W[n][8c + j] in bits 4j..4j+3 of word (c, n); scale and zero [K/group, N],
    zero = fp16(-zero_point * scale) (fma mode: W = q * scale + zero)."""
    N, K = q.shape
    words = (q.to(torch.int64).view(N, K // 8, 8) << (4 * torch.arange(8))).sum(-1)  # disjoint bits
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    zero = (-zero_point.float() * scale.float()).half()  # the fp32 product of two fp16 numbers is exact
    return words.t().contiguous(), scale.t().contiguous(), zero.t().contiguous()


def dequantize_gemlite_uint4(words: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """GemLite's W [N, K] from its packed tensors: fp16(q * scale + zero) rounded once (its fp16 fma), as
    float64. The packer above is not read back: the bits are unpacked here independently."""
    rows, N = words.shape
    group = rows * 8 // scale.shape[0]
    shifts = 4 * torch.arange(8, dtype=torch.int64)
    q = ((words.to(torch.int64) & 0xFFFFFFFF)[:, :, None] >> shifts) & 0xF  # [K/8, N, 8]
    q = q.permute(1, 0, 2).reshape(N, rows * 8).double()
    s = scale.t().double().repeat_interleave(group, dim=1)
    z = zero.t().double().repeat_interleave(group, dim=1)
    return f16_round(q * s + z).double()  # q * s + z is exact in float64 (at most 44 significant bits)


def uint4_layer(gen, n: int, k: int, group: int) -> tuple[torch.Tensor, ...]:
    """Random 4-bit weights of magnitude ~k^-0.5 in GemLite's layout: (words, scale, zero, dense W).
    Zero points are real numbers in [0, 15] (HQQ), some exactly 0 or tiny (the fp16 fma's ties)."""
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = ((torch.rand(n, k // group, generator=gen) + 0.5) * k ** -0.5 / 4).half()
    zero_point = torch.rand(n, k // group, generator=gen) * 15
    zero_point[:, ::3] = torch.rand(n, len(range(0, k // group, 3)), generator=gen) * 2.0 ** -9
    zero_point[::4, ::5] = 0.0
    words, scale, zero = pack_gemlite_uint4(q, scale, zero_point.half())
    return words, scale, zero, dequantize_gemlite_uint4(words, scale, zero)


def gemv_task(gen, M, n, k, kind=F16, epi=EPI_NONE, residual=False) -> dict:
    zero, dense, group = None, None, 0
    if kind in (I8, I8_BAND):
        w = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        scale = (torch.rand(n, generator=gen) * 0.02 + 0.001).half()
    elif kind == F16:
        w, scale = (torch.randn(n, k, generator=gen) * k ** -0.5).half(), None
    else:
        kind, group = kind
        w, scale, zero, dense = uint4_layer(gen, n, k, group)
    x = torch.randn(M, k, generator=gen).half()
    res = torch.randn(M, n, generator=gen).half() if residual else None
    return dict(w=w, scale=scale, zero=zero, dense=dense, n=n, k=k, group=group, type=WEIGHT_TYPE[kind], x=x,
                residual=res, epi=epi)


def run_gemv(so, tasks, M, wide=False):
    """wide: gemv_wide_band_kernel (bands only, 16 warps a block; CUDA), else gemv_kernel."""
    ys = []
    for t in tasks:
        # a residual task adds into y in place (the fused forward's x += W y): residual aliases y
        ys.append(t["residual"].clone() if t["residual"] is not None else torch.full((M, t["n"]), 777.0).half())
    residual = [y if t["residual"] is not None else None for t, y in zip(tasks, ys)]
    _check_rc(so.emu_fused_gemv(M, len(tasks), _ptrs([t["w"] for t in tasks]), _ptrs([t["scale"] for t in tasks]),
                                _ptrs([t["zero"] for t in tasks]), _ptrs([t["x"] for t in tasks]), _ptrs(ys),
                                _ptrs(residual), _ints([t["n"] for t in tasks], ctypes.c_int64),
                                _ints([t["k"] for t in tasks], ctypes.c_int64),
                                _ints([t["group"] for t in tasks], ctypes.c_int64),
                                _ints([t["type"] for t in tasks], ctypes.c_int),
                                _ints([t["epi"] for t in tasks], ctypes.c_int), int(wide)))
    return ys


def check_gemv(t: dict, y: torch.Tensor, what: str) -> None:
    """y = fp16(epi(fp16(x W^T * scale)) + residual), the inner fp16 product being one of the fp16 numbers
    around the exact product +- a bound on the fp32 accumulation error. 4-bit weights: W is GemLite's
    dequantized matrix (dequantize_gemlite_uint4)."""
    x = t["x"].double()
    w = t["dense"] if t["dense"] is not None else t["w"].double()
    int8 = t["type"] in (WEIGHT_TYPE[I8], WEIGHT_TYPE[I8_BAND])
    scale = t["scale"].double() if int8 else torch.ones(w.shape[0], dtype=torch.float64)
    exact = (x @ w.T) * scale
    K = w.shape[1]
    err = (x.abs() @ w.abs().T) * scale * (K + 4) * 2.0 ** -23 + 1e-30

    def finish(val16: torch.Tensor) -> torch.Tensor:
        val = val16.float()
        if t["epi"] == EPI_RELU_SQUARE:
            val = val.clamp_min(0.0) ** 2
        if t["residual"] is not None:
            val = val + t["residual"].float()
        return val.half()

    got = y.double()
    if t["epi"] in (EPI_TANH, EPI_SIGMOID):  # monotone: between the function's values at the product's bounds
        assert t["residual"] is None, "the forward adds no residual to an activated output"
        fn = torch.tanh if t["epi"] == EPI_TANH else torch.sigmoid
        at_lo, at_hi = fn(f16_floor(exact - err).double()), fn(f16_ceil(exact + err).double())
        lo = f16_floor(at_lo - 1e-6 * at_lo.abs()).double()  # + the fp32 function's own error
        hi = f16_ceil(at_hi + 1e-6 * at_hi.abs()).double()
        bad = ~((lo <= got) & (got <= hi))
        assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} outputs outside their range, e.g. "
                               f"{got[bad][:4].tolist()} not in [{lo[bad][:4].tolist()}, {hi[bad][:4].tolist()}]")
        exact_share = (got == f16_round(fn(f16_round(exact).double())).double()).float().mean()
        assert exact_share > 0.95, f"{what}: only {float(exact_share):.3f} of the outputs are the rounded exact value"
        return
    lo, hi = finish(f16_floor(exact - err)).double(), finish(f16_ceil(exact + err)).double()
    bad = ~((lo <= got) & (got <= hi))
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} outputs outside their fp16 rounding range, "
                           f"e.g. {got[bad][:4].tolist()} not in [{lo[bad][:4].tolist()}, {hi[bad][:4].tolist()}]")
    exact_share = (got == finish(exact.float().half()).double()).float().mean()
    assert exact_share > 0.95, f"{what}: only {float(exact_share):.3f} of the outputs are the rounded exact value"


GEMV_CASES = {
    # M, tasks: (n, k, weights, epi, residual)
    "one-row": (1, [(37, 136, F16, EPI_NONE, False)]),  # a partly idle last block, lanes past k
    "lora-and-ffn": (2, [(64, 128, F16, EPI_NONE, False), (40, 160, I8, EPI_NONE, False),
                         (48, 96, F16, EPI_RELU_SQUARE, False), (24, 512, I8, EPI_NONE, True),
                         (20, 264, F16, EPI_NONE, True)]),
    "eight-rows": (8, [(9, 8, F16, EPI_NONE, False), (16, 16, I8, EPI_RELU_SQUARE, True),
                       (33, 272, I8, EPI_RELU_SQUARE, False), (8, 1032, F16, EPI_NONE, True),
                       (3, 64, F16, EPI_NONE, False), (5, 48, I8, EPI_NONE, False),
                       (17, 24, F16, EPI_NONE, False), (2, 32, I8, EPI_NONE, True)]),
    "three-rows": (3, [(11, 40, F16, EPI_RELU_SQUARE, True), (13, 32, I8, EPI_NONE, False)]),
    "five-rows": (5, [(7, 56, F16, EPI_NONE, False)]),
    "seven-rows": (7, [(10, 48, I8, EPI_NONE, True)]),
    # rows longer than one batch of loads per lane (256 vectors): a full batch, then a partial one
    "long-rows": (2, [(5, 2312, F16, EPI_NONE, True), (3, 4112, I8, EPI_NONE, False),
                      (2, 4096, F16, EPI_RELU_SQUARE, False)]),
    # the same at one row (the batch-1 kernel instance), int8 and fp16
    "long-rows-batch1": (1, [(6, 4112, I8, EPI_NONE, False), (4, 2312, F16, EPI_NONE, True)]),
    # few long rows: split among 8, 2 and 4 warps of a block (GEMV_SPLITS), idle warps in the last blocks
    "split-rows": (2, [(5, 16384, F16, EPI_NONE, True), (3, 8192, I8, EPI_NONE, False),
                       (9, 8192, F16, EPI_RELU_SQUARE, False)]),
    "split-rows-batch1": (1, [(6, 4096, F16, EPI_NONE, False), (7, 8192, I8, EPI_NONE, True)]),
    # 4-bit (GemLite) bands of 32 channels: 36 leaves 8 of a block's 9 channel quads idle; k = 64: fewer rows
    # of words than slices; 16-column groups: batches of 2 rows
    "u4-one-row": (1, [(36, 64, U4(16), EPI_NONE, False), (32, 128, U4(64), EPI_NONE, True)]),
    # groups of 3 rows of words (24 columns) that straddle the slices' 4-row chunks; 8 channels: one quad
    "u4-two-rows": (2, [(16, 960, U4(24), EPI_NONE, False),
                        (8, 256, U4(128), EPI_RELU_SQUARE, True),
                        (44, 96, U4(32), EPI_RELU_SQUARE, True)]),
    "u4-three-rows": (3, [(28, 136, U4(8), EPI_NONE, False)]),  # one row of words per group
    "u4-five-rows": (5, [(20, 320, U4(32), EPI_NONE, True)]),  # two passes over x: 3 and 2 rows
    # fp16, int8 and 4-bit tasks in one launch; 8 rows (two passes of 4)
    "u4-eight-rows": (8, [(40, 256, U4(64), EPI_RELU_SQUARE, True), (9, 8, F16, EPI_NONE, False),
                          (16, 16, I8, EPI_NONE, True), (12, 520, U4(40), EPI_NONE, False),
                          (4, 8, U4(8), EPI_NONE, False), (33, 272, I8, EPI_RELU_SQUARE, False),
                          (64, 1024, U4(128), EPI_NONE, True), (17, 24, F16, EPI_NONE, False)]),
    "u4-mixed": (1, [(37, 136, F16, EPI_NONE, False), (24, 512, I8, EPI_NONE, True),
                     (32, 4096, U4(128), EPI_NONE, True),
                     (12, 64, U4(64), EPI_RELU_SQUARE, False)]),
    # long 4-bit rows (a 16384-wide FFN value scaled down in width): bands halved to 16 channels (GEMV_SPLITS),
    # 32 rows of words per thread; a short one beside them keeps its 32-channel band
    "u4-long": (2, [(32, 16384, U4(128), EPI_NONE, True),
                    (64, 2048, U4(64), EPI_RELU_SQUARE, False),
                    (40, 1024, U4(32), EPI_NONE, False)]),
    "u4-long-batch1": (1, [(48, 8192, U4(64), EPI_NONE, True), (8, 4096, F16, EPI_NONE, False)]),
    # the LoRA first halves' activations as epilogues (fp16, int8, 4-bit)
    "epilogue-activations": (2, [(24, 256, F16, EPI_TANH, False), (40, 512, I8, EPI_SIGMOID, False),
                                 (20, 128, U4(64), EPI_TANH, False),
                                 (96, 4096, F16, EPI_SIGMOID, False)]),
    # the LoRA second halves of a 7.2B layer scaled down in height: short rows packed 4-16 to a warp, heights
    # that leave the last warp part-filled
    "lora-up": (2, [(300, 128, F16, EPI_NONE, False), (260, 96, F16, EPI_NONE, False),
                    (100, 480, F16, EPI_NONE, False), (130, 64, I8, EPI_NONE, True)]),
}
# the planner halves the longest slices (vectors of 16 bytes per warp) while each keeps >= 256 of them; a
# 4-bit task halves its band (at most once) while each thread keeps >= 4 rows of words
GEMV_SPLITS = {"split-rows": [8, 2, 4], "split-rows-batch1": [2, 2], "long-rows": [1, 1, 2], "one-row": [1],
               "u4-long": [2, 2, 1], "u4-long-batch1": [2, 2], "u4-mixed": [1, 1, 2, 1]}
# rows of fewer than 256 vectors take the fewest lanes (a power of two) with at most 8 loads each: 32 / lanes
# rows per warp (one vector: 32 rows; 4-bit tasks and split rows: 1)
GEMV_ROWS_PER_WARP = {"one-row": [8], "lora-and-ffn": [16, 16, 16, 8, 4], "eight-rows": [32, 32, 8, 1, 32, 32, 32, 32],
                      "long-rows": [1, 1, 1], "split-rows": [1, 1, 1], "u4-mixed": [8, 8, 1, 1],
                      "lora-up": [16, 16, 4, 32]}


def gemv_plan(so: ctypes.CDLL, tasks: list[tuple[int, int, int]]) -> tuple[list[int], list[int]]:
    """pack_gemv's plan (plan_gemv_splits) of a launch of (n, k, weight type code) tasks: each task's splits and rows
    per warp."""
    splits, rows_per_warp = (ctypes.c_int * len(tasks))(), (ctypes.c_int * len(tasks))()
    so.emu_fused_gemv_splits(len(tasks), _ints([n for n, _, _ in tasks], ctypes.c_int64),
                             _ints([k for _, k, _ in tasks], ctypes.c_int64),
                             _ints([w for _, _, w in tasks], ctypes.c_int), splits, rows_per_warp)
    return list(splits), list(rows_per_warp)


# The 4-bit model's GEMV launches at batch 1 (RELEASED_LORA_RANKS; W4 r/k/v, output, FFN and head, fp16 LoRAs, whose
# second halves join the r/k/v launch when staged, the default): which 4-bit tasks halve their band (splits 2).
# Launches of fewer than kUint4HalveBelowBlocks (448) blocks of full bands halve those of 2,048 columns or more;
# larger ones keep full bands (thirty-eighth session, docs/BENCHMARKS.md).
def _w4_launches(C: int, ranks: tuple[int, int, int, int]) -> dict[str, list[tuple[int, int, str]]]:
    rw, ra, rv, rg = ranks
    firsts, seconds = [(r, C, F16) for r in (rw, ra, rg, rv)], [(C, r, F16) for r in (rw, ra, rg, rv)]
    rkv = [(C, C, "u4")] * 3
    return {"r/k/v + LoRAs": firsts + rkv, "r/k/v + LoRAs, staged": firsts + rkv + seconds, "output": [(C, C, "u4")],
            "FFN key": [(4 * C, C, "u4")], "FFN value": [(C, 4 * C, "u4")], "head": [(65536, C, "u4")]}


W4_HALVED = {2048: {"r/k/v + LoRAs": True, "r/k/v + LoRAs, staged": True, "output": True, "FFN key": True,
                    "FFN value": True, "head": False},
             4096: {"r/k/v + LoRAs": False, "r/k/v + LoRAs, staged": False, "output": True, "FFN key": False,
                    "FFN value": True, "head": False}}


@pytest.mark.parametrize("C", sorted(W4_HALVED))
def test_uint4_bands_halve_in_small_launches(C, libs):
    from infer.random_model import RELEASED_LORA_RANKS
    so = libs["fused-cuda"]
    for launch, specs in _w4_launches(C, RELEASED_LORA_RANKS[C]).items():
        splits, _ = gemv_plan(so, [(n, k, WEIGHT_TYPE[w]) for n, k, w in specs])
        uint4 = [s for s, (_, _, w) in zip(splits, specs) if w == "u4"]
        assert uint4 == [2 if W4_HALVED[C][launch] else 1] * len(uint4), (C, launch, splits)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", GEMV_CASES)
def test_gemv(variant, case, libs):
    """Grouped GEMV: fp16, int8 (+ scale) and GemLite 4-bit weights, relu^2, tanh and sigmoid epilogues, residual
    add (in place), 1-8 rows, up to 8 tasks per launch, widths that leave warps of the last block without
    a row (or lanes without a band's channels), short rows several to a warp, long rows split."""
    M, specs = GEMV_CASES[case]
    so = libs[f"fused-{variant}"]
    gen = torch.Generator().manual_seed(len(case) * 31 + M)
    tasks = [gemv_task(gen, M, *spec) for spec in specs]
    splits, rows_per_warp = gemv_plan(so, [(t["n"], t["k"], t["type"]) for t in tasks])
    if case in GEMV_SPLITS:
        assert splits == GEMV_SPLITS[case]
    if case in GEMV_ROWS_PER_WARP:
        assert rows_per_warp == GEMV_ROWS_PER_WARP[case]
    ys = run_gemv(so, tasks, M)
    for i, (t, y) in enumerate(zip(tasks, ys)):
        check_gemv(t, y, f"task {i}")


# int8 bands of 16 channels on the tensor cores (CUDA only): 8 warps per block over slices of whole quads of
# 16-byte vectors, 3 vectors per lane and channel in flight
GEMV_INT8_BAND_CASES = {
    # 37 channels: a band of 5 (rows g + 8 all past n); 9 vectors: warps 0-1 busy, 2 with one vector, 3-7 idle
    "one-row": (1, [(37, 144, I8_BAND, EPI_NONE, False)]),
    # 7.2B-like rows at one row: slices of 32 and 128 vectors (batches of 12, the last partial); one channel
    "long-rows-batch1": (1, [(20, 4096, I8_BAND, EPI_NONE, True), (16, 16384, I8_BAND, EPI_NONE, False),
                             (1, 2048, I8_BAND, EPI_NONE, True)]),
    # 100 vectors: slices of 16 (a batch of 12 and one of 4), the last warp idle; one vector per row
    "two-rows": (2, [(24, 1600, I8_BAND, EPI_RELU_SQUARE, False), (8, 16, I8_BAND, EPI_NONE, True)]),
    "three-rows": (3, [(33, 272, I8_BAND, EPI_RELU_SQUARE, True)]),
    "five-rows": (5, [(17, 528, I8_BAND, EPI_NONE, False)]),
    # beside fp16, per-thread int8 and 4-bit tasks in one launch, with the LoRA epilogues; eight rows
    "mixed-eight-rows": (8, [(40, 256, U4(64), EPI_RELU_SQUARE, True), (9, 8, F16, EPI_NONE, False),
                             (48, 512, I8_BAND, EPI_TANH, False), (33, 272, I8, EPI_RELU_SQUARE, False),
                             (16, 1024, I8_BAND, EPI_SIGMOID, False), (64, 1040, I8_BAND, EPI_NONE, True)]),
}


def check_launch(launch, tasks, M):
    """check_gemv for every task of a launch (``launch(tasks, M)`` gives the outputs), and its last row run alone
    giving the same outputs (batch invariance)."""
    ys = launch(tasks, M)
    for i, (t, y) in enumerate(zip(tasks, ys)):
        check_gemv(t, y, f"task {i}")
    alone = launch([dict(t, x=t["x"][-1:].clone(), residual=None if t["residual"] is None else
                         t["residual"][-1:].clone()) for t in tasks], 1)
    for i, (y, y1) in enumerate(zip(ys, alone)):
        assert torch.equal(y[-1:], y1), f"task {i}: the last row alone differs from the same row in a batch of {M}"


def check_bands(so, tasks, M, wide):
    check_launch(lambda ts, m: run_gemv(so, ts, m, wide), tasks, M)


@pytest.mark.parametrize("case", GEMV_INT8_BAND_CASES)
def test_gemv_int8_band(case, libs):
    """int8 tasks on the tensor cores: every output within check_gemv's bound of the exact product (int8 times
    fp16 is exact, summed in fp32), partial bands and slices, idle warps, 1-8 rows, beside the other kinds."""
    M, specs = GEMV_INT8_BAND_CASES[case]
    gen = torch.Generator().manual_seed(len(case) * 17 + M)
    check_bands(libs["fused-cuda"], [gemv_task(gen, M, *spec) for spec in specs], M, wide=False)


# Launches of bands only on gemv_wide_band_kernel (16 warps a block, CUDA): slices of K half as long as on 8 warps
GEMV_WIDE_BAND_CASES = {
    # 9 vectors: warps 0-1 busy, 2 with one vector, the rest idle; a band of 5 channels
    "int8-one-row": (1, [(37, 144, I8_BAND, EPI_NONE, False)]),
    # 7.2B-like rows: slices of 16 and 64 vectors (batches of 12, the last partial)
    "int8-long-rows": (1, [(20, 4096, I8_BAND, EPI_NONE, True), (16, 16384, I8_BAND, EPI_NONE, False)]),
    "int8-two-rows": (2, [(24, 1600, I8_BAND, EPI_RELU_SQUARE, False), (8, 16, I8_BAND, EPI_NONE, True)]),
    # 4-bit: whole bands of 32 and halved ones (rows of 2,048 and more), groups of 64 and 128; 64 slices of groups
    "uint4-one-row": (1, [(40, 256, U4(64), EPI_NONE, True), (64, 2048, U4(64), EPI_NONE, False)]),
    "uint4-long-rows": (1, [(32, 8192, U4(128), EPI_NONE, False), (12, 4096, U4(64), EPI_SIGMOID, False)]),
    # 4-bit slices cut short by K (8 warps: slices of 16 and 24 rows of words; 16 warps: 8 and 16), channels past n:
    # a row alone takes the loop without bound checks (uint4_rows) and must give the bits of the same row among two
    "uint4-short-slices": (2, [(24, 2112, U4(64), EPI_NONE, True), (40, 4160, U4(64), EPI_RELU_SQUARE, False),
                               (36, 1600, U4(64), EPI_NONE, False), (20, 1088, U4(32), EPI_NONE, True)]),
    # 4-bit and int8 bands in one launch, eight rows
    "mixed-eight-rows": (8, [(40, 256, U4(64), EPI_RELU_SQUARE, True), (48, 512, I8_BAND, EPI_TANH, False),
                             (64, 2048, U4(64), EPI_NONE, False), (64, 1040, I8_BAND, EPI_NONE, True)]),
}


@pytest.mark.parametrize("case", GEMV_WIDE_BAND_CASES)
def test_gemv_wide_bands(case, libs):
    """gemv_wide_band_kernel: int8 and 4-bit bands on 16 warps, every output within check_gemv's bound, 1-8 rows, a
    row alone as in the batch; and the same launch on gemv_kernel (8 warps) within the bound too."""
    M, specs = GEMV_WIDE_BAND_CASES[case]
    so = libs["fused-cuda"]
    gen = torch.Generator().manual_seed(len(case) * 23 + M)
    tasks = [gemv_task(gen, M, *spec) for spec in specs]
    check_bands(so, tasks, M, wide=True)
    check_bands(so, tasks, M, wide=False)


def run_gemv_staged(so, tasks, M, stages, sync):
    """One staged launch (stages: 0, 1 producer, 2 consumer); a consumer task's "x" may be another task's "y"."""
    ys = [t["y"] for t in tasks]
    return so.emu_fused_gemv_staged(M, len(tasks), _ptrs([t["w"] for t in tasks]), _ptrs([t["scale"] for t in tasks]),
                                    _ptrs([t["zero"] for t in tasks]), _ptrs([t["x"] for t in tasks]), _ptrs(ys),
                                    _ptrs([None] * len(tasks)), _ints([t["n"] for t in tasks], ctypes.c_int64),
                                    _ints([t["k"] for t in tasks], ctypes.c_int64),
                                    _ints([t["group"] for t in tasks], ctypes.c_int64),
                                    _ints([t["type"] for t in tasks], ctypes.c_int),
                                    _ints([t["epi"] for t in tasks], ctypes.c_int), _ints(stages, ctypes.c_int),
                                    _ptr(sync))


@pytest.mark.parametrize("M,rkv,early", [(1, F16, False), (3, I8_BAND, False), (8, F16, False), (2, F16, True),
                                         (3, I8_BAND, True)])
def test_gemv_staged_launch_equals_two_launches(M, rkv, early, libs):
    """A launch of the LoRA first halves (producers: tanh/sigmoid epilogues), r/k/v-like tasks (fp16 or int8 bands)
    and the second halves reading the first halves' outputs (consumers, after every producer in the grid: last, as
    the forward orders them, or before the r/k/v tasks, which the kernel allows too) gives the bits of the two
    launches it replaces, and leaves its counters at zero; twice in a row (the counters reused)."""
    so = libs["fused-cuda"]
    gen = torch.Generator().manual_seed(71 + M)
    C, ranks = 256, (32, 48, 96)
    first = [gemv_task(gen, M, rank, C, F16, epi) for rank, epi in zip(ranks, (EPI_TANH, EPI_NONE, EPI_SIGMOID))]
    rkv_tasks = [gemv_task(gen, M, C, C, rkv) for _ in range(3)]
    for t in first + rkv_tasks:
        t["y"] = torch.full((M, t["n"]), 777.0).half()
    second = []
    for producer in first:
        t = gemv_task(gen, M, C, producer["n"], F16)
        t["x"], t["y"] = producer["y"], torch.full((M, C), 777.0).half()
        second.append(t)
    if early:
        tasks, stages = first + second + rkv_tasks, [1] * len(first) + [2] * len(second) + [0] * len(rkv_tasks)
    else:
        tasks, stages = first + rkv_tasks + second, [1] * len(first) + [0] * len(rkv_tasks) + [2] * len(second)
    sync = torch.zeros(2, dtype=torch.int32)
    for _ in range(2):
        for t in tasks:
            t["y"].fill_(777.0)
        _check_rc(run_gemv_staged(so, tasks, M, stages, sync))
        assert sync.tolist() == [0, 0], "the last consumer block resets the counters"
        staged = [t["y"].clone() for t in tasks]
        for t in tasks:
            t["y"].fill_(777.0)
        _check_rc(run_gemv_staged(so, first + rkv_tasks, M, [0] * 6, sync))
        _check_rc(run_gemv_staged(so, second, M, [0] * 3, sync))
        for i, (a, t) in enumerate(zip(staged, tasks)):
            assert torch.equal(a, t["y"]), f"task {i}"
            assert not torch.equal(a, torch.full_like(a, 777.0)), f"task {i} was not computed"


def test_gemv_staged_launch_rejects_bad_orders(libs):
    """A consumer before a producer (it could wait for a block that has not started), a launch of producers alone,
    and an unknown stage are refused before anything runs."""
    so = libs["fused-cuda"]
    gen = torch.Generator().manual_seed(5)
    a, b = gemv_task(gen, 1, 32, 64), gemv_task(gen, 1, 64, 32)
    for t in (a, b):
        t["y"] = torch.zeros(1, t["n"]).half()
    b["x"] = a["y"]
    sync = torch.zeros(2, dtype=torch.int32)
    assert run_gemv_staged(so, [b, a], 1, [2, 1], sync) == -1
    assert run_gemv_staged(so, [a, b], 1, [1, 0], sync) == -1
    assert run_gemv_staged(so, [a, b], 1, [1, 3], sync) == -1
    assert sync.tolist() == [0, 0]


def run_gemv_stream(so, tasks, M, multiprocessors):
    """One launch on gemv_stream_kernel as the launcher plans it for `multiprocessors` (fp16 tasks of one width);
    the outputs, or None where the launch would not stream."""
    ys = [t["residual"].clone() if t["residual"] is not None else torch.full((M, t["n"]), 777.0).half()
          for t in tasks]
    residual = [y if t["residual"] is not None else None for t, y in zip(tasks, ys)]
    rc = so.emu_fused_gemv_stream(M, len(tasks), _ptrs([t["w"] for t in tasks]), _ptrs([t["x"] for t in tasks]),
                                  _ptrs(ys), _ptrs(residual), _ints([t["n"] for t in tasks], ctypes.c_int64),
                                  _ints([t["k"] for t in tasks], ctypes.c_int64),
                                  _ints([t["epi"] for t in tasks], ctypes.c_int), multiprocessors)
    if rc == -1:
        return None
    _check_rc(rc)
    return ys


# Streamed launches (gemv_stream_kernel, CUDA): M, multiprocessors, tasks (n, k, epi, residual). Few
# multiprocessors make blocks of many channels: more stages than the ring's 5 slots, each slot refilled.
GEMV_STREAM_CASES = {
    # 1.5B-like r/k/v launch: the LoRA first halves' epilogues, blocks straddling no task; 30 channels a block
    "rkv-one-row": (1, 4, [(24, 2048, EPI_TANH, False), (16, 2048, EPI_NONE, False), (40, 2048, EPI_SIGMOID, False),
                           (96, 2048, EPI_NONE, False)]),
    # residual in place (the output projection), a last block of one channel (the stage half full)
    "output-two-rows": (2, 3, [(33, 2048, EPI_NONE, True)]),
    # 7.2B width: a channel a stage; relu^2 (the FFN key); four rows: x held in registers up to 2 x 2 vectors
    "ffn-key-7b": (2, 2, [(29, 4096, EPI_RELU_SQUARE, False)]),
    "four-rows": (4, 2, [(21, 2048, EPI_RELU_SQUARE, False), (18, 2048, EPI_NONE, True)]),
    # more rows than registers hold: x read again through L1 (8 x 1 and 3 x 2 vectors)
    "eight-rows": (8, 2, [(19, 2048, EPI_NONE, True), (10, 2048, EPI_TANH, False)]),
    "three-rows-7b": (3, 3, [(13, 4096, EPI_NONE, True), (8, 4096, EPI_SIGMOID, False)]),
}


@pytest.mark.parametrize("case", GEMV_STREAM_CASES)
def test_gemv_stream(case, libs):
    """gemv_stream_kernel: every output within check_gemv's bound of the exact product (epilogues, residual in place),
    the last row alone giving the same bits as in the batch, and no output left unwritten."""
    M, multiprocessors, specs = GEMV_STREAM_CASES[case]
    so = libs["fused-cuda"]
    gen = torch.Generator().manual_seed(len(case) * 29 + M)

    def streamed(tasks, rows):
        ys = run_gemv_stream(so, tasks, rows, multiprocessors)
        assert ys is not None, "the launch does not stream"
        return ys
    check_launch(streamed, [gemv_task(gen, M, n, k, F16, epi, residual) for n, k, epi, residual in specs], M)


def test_gemv_stream_plan(libs):
    """plan_stream_gemv: fp16 tasks of one streamed width (2,048 or 4,096) on about two blocks a multiprocessor,
    whole stages a block, every channel in exactly one block; what it refuses."""
    so = libs["fused-cuda"]

    def plan(shapes, residual=False, multiprocessors=132):
        rows = (ctypes.c_int * len(shapes))()
        blocks = so.emu_plan_stream_gemv(len(shapes), _ints([n for n, _ in shapes], ctypes.c_int64),
                                         _ints([k for _, k in shapes], ctypes.c_int64), int(residual),
                                         multiprocessors, rows)
        return blocks, list(rows)

    rkv = [(64, 2048), (64, 2048), (128, 2048), (32, 2048), (2048, 2048), (2048, 2048), (2048, 2048)]  # 1.5B
    blocks, rows = plan(rkv)
    assert rows == [26] * 7 and blocks == sum(-(-n // 26) for n, _ in rkv) <= 264
    assert plan([(8192, 2048)]) == (256, [32])                    # 1.5B FFN key
    assert plan([(2048, 2048)], residual=True) == (256, [8])      # 1.5B output projection
    assert plan([(16384, 4096)]) == (261, [63])                   # 7.2B FFN key: a channel a stage
    assert plan([(65536, 2048)], residual=True)[1] == [32]        # residuals fit 256 values at 8 rows
    assert plan([(2048, 2048), (64, 4096)])[0] == 0               # two widths
    assert plan([(2048, 768)])[0] == 0 and plan([(2048, 8192)])[0] == 0  # not a streamed width
    assert plan([(2048, 2048)] * 3, multiprocessors=1)[0] == 0    # no more blocks than tasks


def test_gemv_wide_band_routing(libs):
    """A launch takes gemv_wide_band_kernel when all its tasks are bands and there are at most 256 of them: the 7.2B
    output projection and FFN value (int8 and 4-bit), not the r/k/v launch (its LoRA tasks are fp16) nor the FFN key
    (1,024 bands). The rule reads the shapes alone (no rows of x): the two kernels add in different orders."""
    takes = libs["fused-cuda"].emu_gemv_wide_bands
    u4 = "u4"

    def wide(*tasks):  # (n, k, weight kind, group)
        return takes(len(tasks), _ints([t[0] for t in tasks], ctypes.c_int64), _ints([t[1] for t in tasks], ctypes.c_int64),
                     _ints([t[3] for t in tasks], ctypes.c_int64), _ints([WEIGHT_TYPE[t[2]] for t in tasks], ctypes.c_int))
    assert wide((4096, 4096, I8_BAND, 0)) == 1       # 7.2B output projection
    assert wide((4096, 16384, I8_BAND, 0)) == 1      # 7.2B FFN value
    assert wide((16384, 4096, I8_BAND, 0)) == 0      # 7.2B FFN key
    assert wide((2048, 2048, I8_BAND, 0)) == 1       # 1.5B output projection
    assert wide((65536, 2048, I8_BAND, 0)) == 0      # a head
    assert wide((4096, 4096, u4, 64)) == 1           # 4-bit output projection: 256 halved bands
    assert wide((4096, 16384, u4, 64)) == 1
    assert wide((16384, 4096, u4, 64)) == 0
    assert wide((128, 4096, F16, 0), (4096, 4096, I8_BAND, 0)) == 0  # a LoRA factor beside
    assert wide((4096, 4096, I8, 0)) == 0            # per-thread int8


# ------------------------------------------------------------------------------------ sparse-input gemv
SPARSE_MIN_BLOCKS = 256  # the launcher's threshold for two ballots (64 input rows) per warp


def sparse_plan(so, n: int, k: int, min_blocks: int = SPARSE_MIN_BLOCKS) -> dict:
    out = (ctypes.c_int64 * 4)()
    so.emu_fused_sparse_gemv_plan(n, k, min_blocks, out)
    return dict(zip(("ballots", "slices", "strips", "partial"), out))


SPARSE_MAX_ROWS = {False: 4, True: 8}  # rows of x the sparse GEMV takes: fp16, int8 weights


def run_sparse_gemv(so, x: torch.Tensor, w_t: torch.Tensor, residual: torch.Tensor | None, min_blocks: int,
                    seed: int = 1, workspace: tuple | None = None,
                    scale: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple]:
    """y = x @ w_t (* scale: int8 weights) (+ residual, added in place as the forward does) through the emulated
    kernel; returns y and the workspace (partial sums, arrival counters), reusable by a later call."""
    M, (k, n) = x.shape[0], w_t.shape
    if workspace is None:
        plan = sparse_plan(so, n, k, min_blocks)
        partial = plan["slices"] * SPARSE_MAX_ROWS[scale is not None] * n
        workspace = (torch.full((partial,), 555.0), torch.zeros(plan["strips"], dtype=torch.int32))
    y = residual.clone() if residual is not None else torch.full((M, n), 777.0).half()
    _check_rc(so.emu_fused_sparse_gemv(M, _ptr(x), _ptr(w_t), _ptr(scale), _ptr(y),
                                       _ptr(y if residual is not None else None), _ptr(workspace[0]),
                                       _ptr(workspace[1]), n, k, min_blocks, seed))
    return y, workspace


def relu_square_input(gen, M: int, k: int, zero_share: float = 0.5) -> torch.Tensor:
    """Rows as the FFN key's relu^2 leaves them: about `zero_share` exact zeros (some -0.0), the rest
    positive; whole runs of 32 and 64 columns zero in every row (ballots with nothing to load)."""
    x = torch.rand(M, k, generator=gen).half() * 2.0
    x[torch.rand(M, k, generator=gen) < zero_share] = 0.0
    x[:, 64:128] = 0.0
    x[:, 320:352] = -0.0
    return x


SPARSE_CASES = {
    # M, n, k, min_blocks: one strip, one slice of 256 rows (one ballot per warp)
    "one-block": (1, 256, 256, SPARSE_MIN_BLOCKS),
    # a partial strip (lanes past n), k not a multiple of 32 (rows past k), several slices
    "ragged": (2, 264, 1000, SPARSE_MIN_BLOCKS),
    # two ballots per warp (64 rows), forced on a small shape by the threshold
    "two-ballots": (3, 72, 1500, 2),
    "four-rows": (4, 520, 2100, SPARSE_MIN_BLOCKS),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", SPARSE_CASES)
def test_sparse_gemv(variant, case, libs):
    """The sparse-input GEMV (K-major weights, zero input columns skipped) against the exact product: every
    output one of the fp16 numbers around it (check_gemv's bound), the residual added in place; each row
    bit-identical to the same row launched alone (its terms are summed in the same order whatever the other
    rows are); the arrival counters left at zero, and a second launch on the same workspace, with the blocks
    in another order, bit-identical to the first."""
    M, n, k, min_blocks = SPARSE_CASES[case]
    so = libs[f"fused-{variant}"]
    gen = torch.Generator().manual_seed(M * 1009 + n + k)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).half()
    w_t = w.t().contiguous()
    x = relu_square_input(gen, M, k)
    residual = torch.randn(M, n, generator=gen).half() if M % 2 == 0 else None
    plan = sparse_plan(so, n, k, min_blocks)
    assert plan["ballots"] == (2 if case == "two-ballots" else 1)
    y, workspace = run_sparse_gemv(so, x, w_t, residual, min_blocks)
    check_gemv(dict(w=w, dense=None, scale=None, type=WEIGHT_TYPE[F16], x=x, residual=residual,
                    epi=EPI_NONE), y, case)
    assert not workspace[1].any(), "the arrival counters must be left at zero"
    again, _ = run_sparse_gemv(so, x, w_t, residual, min_blocks, seed=7, workspace=workspace)
    assert torch.equal(again.view(torch.int16), y.view(torch.int16))
    for m in range(M):
        alone, _ = run_sparse_gemv(so, x[m:m + 1].clone(), w_t, None if residual is None else residual[m:m + 1].clone(),
                                   min_blocks)
        assert torch.equal(alone.view(torch.int16), y[m:m + 1].view(torch.int16)), f"row {m} alone differs"


SPARSE_INT8_CASES = {  # one row: the kernel's limit for int8 weights
    "one-block": (1, 256, 256, SPARSE_MIN_BLOCKS),
    "ragged": (1, 264, 1000, SPARSE_MIN_BLOCKS),
    "two-ballots": (1, 72, 1500, 2),
    "strips": (1, 520, 2100, SPARSE_MIN_BLOCKS),
}


@pytest.mark.parametrize("case", SPARSE_INT8_CASES)
def test_sparse_gemv_int8(case, libs):
    """int8 K-major weights (a W8A16 FFN value) with their per-channel scale, one row: the bounds of the exact
    product times the scale (check_gemv), counters left at zero; two rows are refused (slower than the int8 bands
    there), and the HIP port refuses int8 at all."""
    M, n, k, min_blocks = SPARSE_INT8_CASES[case]
    so = libs["fused-cuda"]
    gen = torch.Generator().manual_seed(M * 7919 + n + k)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = (torch.rand(n, generator=gen) * 0.01 + 0.001).half()
    q_t = q.t().contiguous()
    x = relu_square_input(gen, M, k)
    residual = torch.randn(M, n, generator=gen).half() if case in ("ragged", "strips") else None
    y, workspace = run_sparse_gemv(so, x, q_t, residual, min_blocks, scale=scale)
    check_gemv(dict(w=q, dense=None, scale=scale, type=WEIGHT_TYPE[I8], x=x, residual=residual, epi=EPI_NONE), y,
               case)
    assert not workspace[1].any(), "the arrival counters must be left at zero"
    x2, y2 = x.repeat(2, 1), y.repeat(2, 1)
    assert so.emu_fused_sparse_gemv(2, _ptr(x2), _ptr(q_t), _ptr(scale), _ptr(y2), None, _ptr(workspace[0]),
                                    _ptr(workspace[1]), n, k, min_blocks, 1) == -1
    for hip in ("fused-hip-wave64", "fused-hip-wave32"):
        assert libs[hip].emu_fused_sparse_gemv(M, _ptr(x), _ptr(q_t), _ptr(scale), _ptr(y), None,
                                               _ptr(workspace[0]), _ptr(workspace[1]), n, k, min_blocks, 1) == -1


@pytest.mark.parametrize("variant", VARIANTS)
def test_sparse_gemv_nan_and_plan(variant, libs):
    """A NaN input (not a zero) reaches every output of its row and no other row; the planner takes two
    ballots per warp for the 7.2B FFN value matrix (512 blocks) and one for 1.5B's (256 blocks)."""
    so = libs[f"fused-{variant}"]
    gen = torch.Generator().manual_seed(5)
    w_t = (torch.randn(512, 264, generator=gen) * 0.05).half()
    x = relu_square_input(gen, 2, 512)
    x[1, 70] = math.nan  # inside a run of zeros in the other row
    y, _ = run_sparse_gemv(so, x, w_t, None, SPARSE_MIN_BLOCKS)
    assert y[1].isnan().all() and not y[0].isnan().any()
    assert sparse_plan(so, 4096, 16384) == dict(ballots=2, slices=32, strips=16, partial=32 * 4 * 4096)
    assert sparse_plan(so, 2048, 8192) == dict(ballots=1, slices=32, strips=8, partial=32 * 4 * 2048)


@pytest.mark.parametrize("variant", VARIANTS)
def test_gemv_uint4_rebuilds_gemlite_weights_exactly(variant, libs):
    """x = one-hot rows picks single weights: y[m][n] = W[n][k_m] exactly (one product, the rest zeros), so
    every 4-bit weight the kernel rebuilds (bit order in the word, word and group indexing, the fp16 fma's
    single rounding) must equal GemLite's, bit for bit. 8 rows per launch, all k covered. Planted ties:
    in group 1 of every other channel q = 3 and the scale lies in [0.5, 2/3) with its last bit set, so
    q * scale in [1, 2) falls halfway between two fp16 numbers, and zero = +-2^-24 decides the rounding
    (a sum rounded to fp32 first loses it)."""
    so = libs[f"fused-{variant}"]
    gen = torch.Generator().manual_seed(7)
    n, k, group = 40, 96, 24
    words, scale, zero, _ = uint4_layer(gen, n, k, group)
    ties = slice(None, None, 2)
    words[3:6, ties] = 0x33333333  # rows of words 3..5: k = 24..47, group 1
    scale[1, ties] = (torch.randint(512, 683, (n // 2,), generator=gen) * 2 + 1).double().mul(2.0 ** -11).half()
    zero[1, ties] = torch.where(torch.rand(n // 2, generator=gen) < 0.5, -1.0, 1.0).mul(2.0 ** -24).half()
    dense = dequantize_gemlite_uint4(words, scale, zero)
    twice = (3 * scale[1, ties].float() + zero[1, ties].float()).half().double()  # rounded in fp32, then fp16
    assert (dense[ties, group] != twice).sum() >= 5, "too few ties that double rounding gets wrong"
    for first in range(0, k, 8):
        x = torch.zeros(8, k, dtype=torch.float16)
        x[torch.arange(8), first + torch.arange(8)] = 1.0
        task = dict(w=words, scale=scale, zero=zero, dense=dense, n=n, k=k, group=group, type=WEIGHT_TYPE["u4"],
                    x=x, residual=None, epi=EPI_NONE)
        (y,) = run_gemv(so, [task], 8)
        want = dense[:, first:first + 8].t().half()
        assert torch.equal(y.view(torch.int16), want.view(torch.int16)), \
            f"columns {first}..{first + 7}: {int((y != want).sum())} weights differ from GemLite's"


@pytest.mark.parametrize("variant", VARIANTS)
def test_uint4_dequantize_rebuilds_gemlite_columns(variant, libs):
    """Column chunks of a 4-bit GemLite matrix rebuilt as fp16 W^T [K, width] equal GemLite's weights bit for
    bit: a chunk from column 0, one in the middle with a width that is not a multiple of a warp, the last."""
    so = libs[f"fused-{variant}"]
    gen = torch.Generator().manual_seed(11)
    n, k, group = 72, 96, 24
    words, scale, zero, dense = uint4_layer(gen, n, k, group)
    want = dense.t().half()  # [K, N]
    for n0, width in ((0, 32), (29, 19), (40, 32)):
        out = torch.full((k, width), 7.0, dtype=torch.float16)
        _check_rc(so.emu_fused_uint4_dequantize(_ptr(words), _ptr(scale), _ptr(zero), n, k, group, n0, width,
                                                _ptr(out)))
        assert torch.equal(out.view(torch.int16), want[:, n0:n0 + width].contiguous().view(torch.int16)), (n0, width)
    out = torch.zeros(k, 8, dtype=torch.float16)
    assert so.emu_fused_uint4_dequantize(_ptr(words), _ptr(scale), _ptr(zero), n, k, group, 68, 8, _ptr(out)) != 0


def test_half_fma_rounds_once(libs):
    """The emulation's fp16 fma (its __hfma2) against the exact q * s + z rounded once, for the kernel's
    operands (q = 0..15): random scales and zeros of every magnitude, and ties (q * s halfway between two
    fp16 numbers) pushed off by a tiny zero, where rounding the sum twice would go wrong."""
    gen = torch.Generator().manual_seed(3)
    count = 1 << 16
    q = torch.randint(0, 16, (count,), generator=gen).half()
    s = (torch.randn(count, generator=gen) * torch.exp2(torch.randint(-12, 6, (count,), generator=gen))).half()
    z = (torch.randn(count, generator=gen) * torch.exp2(torch.randint(-24, 6, (count,), generator=gen))).half()
    # q = 3, s in [0.5, 1) with its last mantissa bit set: q * s in [1.5, 2) needs 12 bits, a tie at fp16's
    # 11; z = +-2^-24 decides it, 24 bits below: lost to an fp32 sum first
    s[:4096] = (torch.randint(1025, 2048, (4096,), generator=gen) | 1).double().mul(2.0 ** -11).half()
    q[:4096] = 3.0
    z[:4096] = torch.where(torch.rand(4096, generator=gen) < 0.5, -1.0, 1.0).half() * 2.0 ** -24
    got = torch.empty(count, dtype=torch.int16)
    libs["fused-cuda"].emu_f16_fma(_ptr(q), _ptr(s), _ptr(z), _ptr(got), count)
    want = f16_round(q.double() * s.double() + z.double())
    assert torch.equal(got, want.view(torch.int16)), f"{int((got != want.view(torch.int16)).sum())} fma results differ"
    assert not torch.equal(want[:4096], (q.float() * s.float() + z.float())[:4096].half()), "no double-rounding case"


# --------------------------------------------------------------------------------------------- wkv7_slots
def run_wkv7_slots(so, pool, slots, starts, lasts, r, w, k, v, a, b):
    T, C = r.shape
    y = torch.full((T, C), 4321.0)
    ints = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    slots_t, starts_t, lasts_t = ints(slots), ints(starts), ints(lasts)
    _check_rc(so.emu_wkv7_slots(DTYPE_CODE[r.dtype], DTYPE_CODE[pool.dtype], len(slots), C // N, pool.shape[0], T,
                                _ptr(pool), _ptr(slots_t), _ptr(starts_t), _ptr(lasts_t), _ptr(r), _ptr(w), _ptr(k),
                                _ptr(v), _ptr(a), _ptr(b), _ptr(y)))
    return y


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("act,state_dtype", [(torch.float16, torch.float32), (torch.bfloat16, torch.float16),
                                             (torch.float32, torch.float32), (torch.float16, torch.float16)])
def test_wkv7_slots(variant, act, state_dtype, libs):
    """The slot kernel against TorchWKV: rows of 4, 1, 3, 2 tokens on a nonzero pool (C = 192), a row on
    an out-of-range slot (NaN y, no state write), an empty row and a row running past T (both touch
    nothing)."""
    gen = torch.Generator().manual_seed(DTYPE_CODE[act] * 2 + DTYPE_CODE[state_dtype])
    C, T = 192, sum(TM_LENS)
    H = C // N
    r, k, v = (torch.randn(T, C, generator=gen).to(act) for _ in range(3))
    w = torch.rand(T, C, generator=gen) * 0.45 + 0.55
    kk = F.normalize(torch.randn(T, H, N, generator=gen), dim=-1).view(T, C).to(act)
    gate = torch.rand(T, C, generator=gen).to(act)
    a, b = (-kk.float()).to(act), (kk.float() * gate.float()).to(act)
    pool = (torch.randn(TM_POOL, H, N, N, generator=gen) * 0.3).to(state_dtype)
    starts = [sum(TM_LENS[:i]) for i in range(len(TM_LENS))]
    lasts = [s + n - 1 for s, n in zip(starts, TM_LENS)]
    got_pool = pool.clone()
    y = run_wkv7_slots(libs[f"slots-{variant}"], got_pool, TM_SLOTS + [e[0] for e in TM_EXTRA],
                       starts + [e[1] for e in TM_EXTRA], lasts + [e[2] for e in TM_EXTRA], r, w, k, v, a, b)

    good = [i for i, s in enumerate(TM_SLOTS) if 0 <= s < TM_POOL]
    idx = torch.cat([torch.arange(starts[i], lasts[i] + 1) for i in good])
    batch = PackedBatch.from_rows([[0] * TM_LENS[i] for i in good], [TM_SLOTS[i] for i in good], "cpu")
    want_pool = pool.clone()
    want = TorchWKV()(want_pool, batch, *(t[idx] for t in (r, w, k, v, a, b)))

    assert torch.isnan(y[starts[2]:lasts[2] + 1]).all(), "a row on an out-of-range slot must get NaN outputs"
    touched = [TM_SLOTS[i] for i in good]
    untouched = [s for s in range(TM_POOL) if s not in touched]
    assert torch.equal(got_pool[untouched], pool[untouched]), "a slot of a skipped row was written"
    assert_close(y[idx], want, 3e-5, 1e-5, "y vs TorchWKV")
    if state_dtype == torch.float32:
        assert_close(got_pool[touched], want_pool[touched], 1e-5, 1e-5, "state vs TorchWKV")
    else:
        assert_ulps(got_pool[touched], want_pool[touched], 1, "fp16 state vs TorchWKV", atol=STATE_ATOL)
        assert (got_pool[touched] == want_pool[touched]).float().mean() > 0.99
