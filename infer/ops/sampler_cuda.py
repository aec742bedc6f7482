"""The sampler's top-k/top-p keep threshold and inverse-CDF draw as one CUDA kernel (``cuda/sampler.cu``).

:class:`infer.sampler.Sampler` on a CUDA device hands the softmax probabilities of its sampled
rows to this kernel instead of sorting them: one thread block per row finds the k-th largest
probability and the nucleus boundary by range refinement over the float bit patterns, with exact
fixed-point sums, then draws the token. Same semantics as the torch path (see ``cuda/sampler.cu``
for the one documented difference: the torch path's fp64 cumsum rounding). Launched on the current
stream, no host sync, graph-capturable.

The extension is JIT-compiled on first use and cached (``infer.ops.cuda_ext``); on a ROCm build of
torch the HIP port (``hip/sampler.hip``) is compiled instead. :func:`load_cuda_sampler` never
raises: it logs why and returns None when the kernel cannot be had (no CUDA device, no toolkit, a
failed build, or a failed self-test against the torch path).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from infer.ops.cuda_ext import BuildOnce, compile_kernels

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent.parent
CUDA_SOURCES = [ROOT / "cuda" / "sampler_op.cpp", ROOT / "cuda" / "sampler.cu"]
HIP_SOURCES = [ROOT / "cuda" / "sampler_op.cpp", ROOT / "hip" / "sampler.hip"]
EXTENSION_NAME = "rwkv7_sampler"


class CudaSampler:
    """``(tau, drawn) = kernel(p, top_k, top_p, u, greedy)`` for the sampled rows of a step.

    p [B, V] fp32 (unit column stride), top_k [B] int64 (0 = off), top_p [B] fp32 (>= 1 = off),
    u [B] fp32, greedy [B] int64 (non-zero: row skipped, 0 returned). tau [B] fp32 is the keep
    threshold (keep p >= tau), drawn [B] int64 the token.
    """

    name = "cuda kernel (sampler)"

    def __init__(self, module) -> None:
        self._op = module.sampler_tau_draw
        self._prepare = module.sampler_prepare

    def __call__(self, p: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor,
                 greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B = p.shape[0]
        tau = torch.empty(B, dtype=torch.float32, device=p.device)
        drawn = torch.empty(B, dtype=torch.int64, device=p.device)
        stream = torch.cuda.current_stream(p.device).cuda_stream
        self._op(p, top_k, top_p, u, greedy, tau, drawn, stream)
        return tau, drawn

    def prepare(self, logits: torch.Tensor, penalty: torch.Tensor | None, slots: torch.Tensor,
                bias_ids: torch.Tensor | None, bias_vals: torch.Tensor | None, valid_vocab: int,
                temperature: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor,
                steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(s, tok, dead, fallback, u)`` of the rows of ``logits`` [B, V] (fp16 or fp32), in two passes: what
        :meth:`infer.sampler.Sampler.sample`'s torch steps compute before the softmax and its uniforms, bit for
        bit (see ``prepare_kernel`` in cuda/sampler.cu). ``penalty`` [slots, V], the bias rows [slots, n] and the
        step counters ``steps`` [slots] are indexed by ``slots`` [B] int64 (None: none); ``temperature`` [B] fp32,
        ``k1``/``k2`` [B] int64 the rows' RNG keys."""
        B, V = logits.shape
        dev = logits.device
        s = torch.empty(B, V, dtype=torch.float32, device=dev)
        tok = torch.empty(B, dtype=torch.int64, device=dev)
        fallback = torch.empty(B, dtype=torch.int64, device=dev)
        dead = torch.empty(B, dtype=torch.bool, device=dev)
        u = torch.empty(B, dtype=torch.float32, device=dev)
        stream = torch.cuda.current_stream(dev).cuda_stream
        self._prepare(logits, penalty, slots.contiguous(), bias_ids, bias_vals, valid_vocab, temperature, k1, k2,
                      steps, s, tok, dead, fallback, u, stream)
        return s, tok, dead, fallback, u


# --------------------------------------------------------------------------- loading
_kernel: BuildOnce[CudaSampler] = BuildOnce("CUDA sampler kernel")


def _compile():
    # No fast math and no FMA contraction: the kernel's doubles must round exactly like torch's.
    return compile_kernels(EXTENSION_NAME, CUDA_SOURCES, HIP_SOURCES, "the sampler kernel",
                           cuda_flags=["-O3", "-lineinfo", "--fmad=false"], hip_flags=["-O3", "-ffp-contract=off"])


def self_test_batch(device: torch.device, V: int, seed: int = 0):
    """A small batch (p, top_k, top_p, u, greedy) on ``device`` whose torch-path sums are exact
    (every probability is well above 2^-29), covering ties, top-k, top-p, both, neither and greedy."""
    gen = torch.Generator().manual_seed(seed)
    rows = 12
    x = torch.randn(rows, V, generator=gen)
    x[1] = (x[1] * 2).round() / 2  # many exact ties
    x[2] = 0.0  # uniform
    x[3, : V // 2] += 2.0  # two levels
    x[:, -3:] = float("-inf")  # masked ids (p = 0)
    p = torch.softmax(x, dim=1)
    top_k = torch.tensor([0, 5, 0, 40, 1, 7, 0, V - 1, 3, 0, 2, 100][:rows], dtype=torch.int64)
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.8, 1.0, 0.95, 1.0, 0.7, 0.3, 0.99, 1.0, 1.0][:rows], dtype=torch.float32)
    u = torch.rand(rows, generator=gen)
    u[0] = 0.0
    greedy = torch.zeros(rows, dtype=torch.int64)
    greedy[10] = 1
    return tuple(t.to(device) for t in (p, top_k, top_p, u, greedy))


def prepare_case(device: torch.device, V: int, dtype: torch.dtype, seed: int = 0):
    """``(sampler, logits, slots)``: a torch-path Sampler whose slots mix penalties, logit biases (token 0's among
    them), greedy and sampled rows at several temperatures, and logits of ``dtype`` with NaN, +-inf, ties, ids
    past the valid vocabulary and a row with nothing finite (dead), for checking the kernel's ``prepare``."""
    from infer.sampler import Sampler, SamplingParams

    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=1, logit_bias={0: -100.0, 7: 3.5}),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.3, alpha_presence=0.5, alpha_frequency=0.2, seed=2),
              SamplingParams(temperature=1.0, logit_bias={V - 6: 50.0}),
              SamplingParams(temperature=0.5, top_k=5, alpha_presence=1.0, logit_bias={3: -2.0}),
              SamplingParams(temperature=2.0, seed=3)]
    slots = [7, 0, 3, 1, 5, 2]
    sampler = Sampler(V, 8, device, valid_vocab=V - 5, impl="torch")
    for slot, p in zip(slots, params):
        sampler.reset_slot(slot, p)
    gen = torch.Generator().manual_seed(seed)
    sampler.penalty.copy_(torch.rand(8, V, generator=gen) * 2)
    sampler.step.copy_(torch.tensor([0, 1, 7, 2**32 - 1, 2**32 + 5, 2**40 + 3, 12345, 99]))  # both halves count
    logits = torch.randn(len(slots), V, generator=gen) * 4
    logits[0, 10:20] = float("nan")
    logits[0, 20] = float("inf")
    logits[1, 30:40] = float("-inf")
    logits[1, [41, 42]] = float("inf")  # tied +inf: the first wins
    logits[3] = (logits[3] * 2).round() / 2  # many exact ties
    logits[4, V - 5:] = 1e4  # past the valid vocabulary: never chosen
    logits[5] = float("nan")  # nothing finite: dead
    return sampler, logits.to(dtype).to(device), torch.tensor(slots, dtype=torch.int64, device=device)


def prepare_mismatch(kernel, sampler, logits: torch.Tensor, slots: torch.Tensor) -> str | None:
    """Where ``kernel.prepare`` differs from the sampler's torch steps (None: bit for bit the same)."""
    from infer.sampler import _I_K1, _I_K2, _uniform

    fp, ip = sampler._fparams[slots], sampler._iparams[slots]
    _, s_ref, tok_ref, dead_ref, fallback_ref, *_ = sampler._prepare(logits, slots, fp)
    u_ref = _uniform(ip[:, _I_K1], ip[:, _I_K2], sampler.step[slots])
    s, tok, dead, fallback, u = sampler._prepare_on(kernel, logits, slots, fp, ip)
    same_s = bool(((s == s_ref) | (s.isnan() & s_ref.isnan())).all()) and torch.equal(s.signbit(), s_ref.signbit())
    for name, a, b in (("tok", tok, tok_ref), ("dead", dead, dead_ref), ("fallback", fallback, fallback_ref),
                       ("u", u, u_ref)):
        if not torch.equal(a, b):
            return f"prepare against the torch steps ({logits.dtype}): {name} {a.tolist()} vs {b.tolist()}"
    return None if same_s else f"prepare against the torch steps ({logits.dtype}): s differs"


def _self_test(kernel: CudaSampler) -> str | None:
    """Compare small batches (both the vectorized and the scalar path) with the torch path, and the logits'
    preparation in fp16 and fp32."""
    from infer.sampler import Sampler, _draw

    device = torch.device("cuda", torch.cuda.current_device())
    for dtype in (torch.float16, torch.float32):
        error = prepare_mismatch(kernel, *prepare_case(device, 1000, dtype))
        if error is not None:
            return error
    for V in (1000, 4099):
        p, top_k, top_p, u, greedy = self_test_batch(device, V)
        ref = Sampler(V, 1, device, valid_vocab=V, impl="torch")
        tau_ref = ref._thresholds(p, top_k, top_p, V)[0]
        drawn_ref = _draw(p.clone(), tau_ref, u)
        tau, drawn = kernel(p, top_k, top_p, u, greedy)
        torch.cuda.synchronize(device)
        live = greedy == 0
        if not torch.equal(tau[live], tau_ref[live]) or not torch.equal(drawn[live], drawn_ref[live]):
            return (f"self-test against the torch path failed (V={V}): tau {tau.tolist()} vs {tau_ref.tolist()}, "
                    f"tokens {drawn.tolist()} vs {drawn_ref.tolist()}")
    return None


def load_cuda_sampler(verify: bool = True) -> CudaSampler | None:
    """The compiled kernel, building it on the first call; None (with a logged warning) if it
    cannot be had: no CUDA device, no nvcc/ninja, a failed build, or a failed self-test."""
    return _kernel.load(lambda: CudaSampler(_compile()), _self_test if verify else None)


def cuda_sampler_error() -> str | None:
    """Why :func:`load_cuda_sampler` returned None (None if it was not tried or succeeded)."""
    return _kernel.error
