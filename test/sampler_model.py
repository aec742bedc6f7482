"""Test helpers for the sampler kernel (cuda/sampler.cu): its exact definition in torch, the rows on
which the torch path must agree with it bit for bit, and batches of probability rows to try.

Used by test_sampler_cuda.py (the kernel on a GPU) and test_sampler_emulated.py (the kernel source
run on the CPU).
"""
from __future__ import annotations

import torch

_Q = 2.0**62


def q62(p: torch.Tensor) -> torch.Tensor:
    """The kernel's fixed-point value of each probability: floor(p * 2^62), at least 1 when p > 0."""
    q = torch.floor(p.double() * _Q).to(torch.int64)  # exact: p * 2^62 < 2^63 is an integer-valued double
    return torch.where(p > 0, q.clamp(min=1), q)


def _round(q: torch.Tensor) -> torch.Tensor:
    return q.double() * (1.0 / _Q)  # int64 -> double rounds to nearest; the scaling is exact


def exact_tau_draw(p: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor):
    """(tau, drawn) as the kernel defines them: the torch path's formulas (Sampler._thresholds with a
    full sort, then the inverse CDF) with every fp64 cumsum replaced by an exact integer cumsum of
    q62, rounded once. Works on any device (int64 cumsums are exact everywhere)."""
    B, V = p.shape
    q = q62(p)
    vals, order = p.sort(dim=1, descending=True, stable=True)
    qs = q.gather(1, order)
    has_k = top_k > 0
    k_in = torch.where(has_k, top_k.clamp(max=V), V)
    pos = torch.arange(V, device=p.device)
    cs = _round(qs.masked_fill(pos >= k_in[:, None], 0).cumsum(dim=1))
    mass = torch.where(has_k, cs.gather(1, (k_in - 1)[:, None]).squeeze(1), 1.0)
    need = top_p.double() * mass
    j = torch.searchsorted(cs, need[:, None]).squeeze(1)
    tau = vals.gather(1, j.clamp(max=V - 1)[:, None]).squeeze(1)
    tau = torch.where(~has_k & (top_p >= 1.0), 0.0, tau)
    cdf = _round((q * (p >= tau[:, None])).cumsum(dim=1))
    total = cdf[:, -1:]
    target = torch.minimum(u.double()[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    drawn = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=V - 1)
    return tau, drawn


def torch_sums_exact(p: torch.Tensor, top_k: torch.Tensor, *taus: torch.Tensor) -> torch.Tensor:
    """Rows on which the torch path's fp64 sums are exact, so that it must match the kernel bit for
    bit: every probability that takes part -- those >= each tau given and, with top-k, the k
    largest -- is a multiple of 2^-52 (then every partial sum, being < 2, is a double)."""
    B, V = p.shape
    floor = torch.stack(taus).min(dim=0).values if taus else torch.zeros(B, device=p.device)
    has_k = top_k > 0
    kth = p.sort(dim=1, descending=True).values.gather(1, (top_k.clamp(1, V) - 1)[:, None]).squeeze(1)
    floor = torch.where(has_k, torch.minimum(floor, kth), floor)
    scaled = p.double() * 2.0**52
    fine = (scaled == scaled.floor()) | (p < floor[:, None])
    return fine.all(dim=1)


# Kinds of rows: (logit scale, temperature, transform)
KINDS = {
    "flat": (0.05, 1.0, None),        # near-uniform: all p close to 1/V
    "normal": (1.0, 1.0, None),
    "spread": (3.0, 1.0, None),       # like the random-weight model's logits (std ~3)
    "peaked": (10.0, 0.5, None),      # probabilities down to far below 2^-29: inexact torch sums
    "ties": (1.0, 1.0, "round"),      # many exactly equal probabilities
    "bf16": (2.0, 0.8, "bf16"),       # logits quantized like a half-precision head's
    "masked": (1.0, 1.0, "mask"),     # most ids at -inf (p = 0): top_k beyond the support
    "uniform": (0.0, 1.0, None),      # exactly uniform (a dead row looks like this)
}


def probability_rows(kind: str, B: int, V: int, gen: torch.Generator, valid: int | None = None) -> torch.Tensor:
    """softmax(logits / T) rows of one kind (CPU, fp32), ids >= valid at -inf."""
    scale, temp, how = KINDS[kind]
    x = torch.randn(B, V, generator=gen) * scale
    if how == "round":
        x = (x * 2).round() / 2
    elif how == "bf16":
        x = x.bfloat16().float()
    elif how == "mask":
        x[torch.rand(B, V, generator=gen) < 0.95] = float("-inf")
        x[:, 0] = 0.0  # keep every row alive
    if valid is not None and valid < V:
        x[:, valid:] = float("-inf")
    return torch.softmax(x / temp, dim=1)


TOP_K = (0, 0, 0, 1, 2, 5, 40, 50, 1000, 5000)
TOP_P = (1.0, 0.9, 0.9, 0.95, 0.5, 0.99, 0.1, 0.99999994, 1e-30)


def row_params(B: int, V: int, gen: torch.Generator, greedy_share: float = 0.1):
    """Random (top_k, top_p, u, greedy) for B rows, with u = 0 and the largest u among them."""
    k = torch.tensor(TOP_K)[torch.randint(len(TOP_K), (B,), generator=gen)]
    top_k = torch.where(k >= V, torch.randint(1, V + 1, (B,), generator=gen), k)  # also k == V (off by reset)
    top_p = torch.tensor(TOP_P, dtype=torch.float32)[torch.randint(len(TOP_P), (B,), generator=gen)]
    u = torch.rand(B, generator=gen)
    u[0] = 0.0
    if B > 1:
        u[1] = 1.0 - 2.0**-24
    greedy = (torch.rand(B, generator=gen) < greedy_share).long()
    return top_k, top_p, u, greedy
