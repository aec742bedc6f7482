"""Batched token sampler: penalties, logit bias, temperature, top-k / top-p, seeded RNG, logprobs.

Everything per step runs as a fixed number of vectorized torch ops on the logits' device
(CPU or CUDA); there is no Python loop over the rows of a batch.  Per-row parameters live in
device tensors indexed by *slot id* and are written once in :meth:`Sampler.reset_slot`, so a
step copies nothing host->device except the slot index vector.

Semantics (see docs spec §4.1 and DESIGN §5):

* ``adjusted = clean(logits) - penalty[slot] + logit_bias`` (fp32).  NaN becomes -inf, +inf is
  clamped to the largest finite fp32.  Ids ``>= valid_vocab`` (65530..65535 in the 65536-row
  head, which the tokenizer cannot decode) are set to -inf and are never sampled.
* Greedy rows (``temperature <= 0``, ``top_p == 0`` or ``top_k == 1``) take
  ``argmax(adjusted)``; penalties and bias still apply.  The peer server rejects temperature 0;
  we treat it as greedy like OpenAI-compatible servers do.
* Sampled rows: ``p = softmax(adjusted / T)`` in fp32, then top-k, then standard nucleus
  top-p on the top-k renormalized distribution: keep the smallest prefix of the descending
  probabilities whose cumulative mass reaches ``top_p`` *including* the boundary token.
  NOTE: the peer's CUDA kernel ("Rapid-Sampling", spec §4.1 step 3) instead keeps the
  boundary token with a *fractional* weight so the kept mass is exactly ``top_p`` (sharper
  than textbook nucleus).  We deliberately implement standard nucleus sampling, which is what
  OpenAI clients expect.
* Truncation is expressed as a probability threshold ``tau`` per row (keep ``p >= tau``), and
  the draw is an inverse CDF over the kept probabilities in *vocabulary order*.  Both the
  threshold (a value) and the vocabulary-order CDF are independent of how candidates were
  found (``topk`` vs full ``sort``) and of tie order, so a row's result never depends on which
  other rows share the batch.  Consequence: tokens whose probability exactly equals the
  boundary probability are all kept (top-k may keep more than k tokens on exact ties).
* Penalty update after the choice (all rows): ``pen *= alpha_decay``; the chosen token then
  gets ``+alpha_presence`` if its penalty was exactly 0 before this step, else
  ``+alpha_frequency``.  Prompt tokens are not penalized (a slot starts at zero).
* RNG: counter-based.  The uniform for a row at step ``n`` is ``hash(seed, n)`` (see
  :func:`_uniform`), so it depends only on the row's seed and its own step counter — never on
  the batch composition — and is bit-identical on CPU and CUDA.  (Sampled tokens match between
  CPU and CUDA except in rare cases where softmax rounding moves a CDF boundary past u.)
* Logprobs: reported under the model's distribution *after penalties and logit bias, at
  temperature 1, before top-k/top-p truncation*: ``log_softmax(adjusted)`` over the valid ids
  (fp32), as OpenAI-style clients expect (truncation never turns a logprob into 0).  Rows
  whose adjusted logits are all -inf use the raw logits (where the fallback token comes from).
  ``top_ids``/``top_logprobs`` have N = max ``logprobs`` over live slots for every row; rows
  that asked for fewer just use the first ones.  ``sample(..., want_logprob=True)`` returns the
  chosen token's logprob even when no slot asked for alternatives.
* A row whose adjusted logits are all -inf (e.g. NaN everywhere or everything biased away)
  falls back to the argmax of the raw logits among the valid ids.

Per-step path decisions (skip sampling when all greedy, ``topk`` vs sort, penalties/bias/
logprobs on or off) come from host-side counters over *live* slots (reset and not released), so
a step does O(1) Python work and no device->host sync on CUDA.  A finished slot that is never
released or reset only makes steps take a wider (still correct) path: call ``release_slot``.

Slots in one ``sample`` call must be distinct (the penalty pool is updated by index_put), except that a CUDA graph's
padding rows all sample one scratch slot, whose tables nothing reads. On CUDA the runner replays ``sample`` from CUDA
graphs for decode steps (``infer.runner.StepGraphs``); :meth:`Sampler.graph_key` says what such a graph fixes.

On CUDA the keep threshold and the draw (the top-k/top-p truncation and the inverse CDF above) run
in one kernel without sorting (``infer/ops/sampler_cuda.py``, ``cuda/sampler.cu``) when it builds;
``Sampler.name`` tells which path a sampler takes (``impl``/``RWKV_SAMPLER``: auto (the default: the
kernel where it loads), cuda (the kernel or an error), torch). Unless a row asks for log-probabilities,
a second kernel of the same extension prepares the logits before the softmax (penalties, biases, cleaning,
temperature, the greedy argmax: ``_prepare``'s torch steps bit for bit, in two passes instead of ~10) and
computes the rows' uniforms (``_uniform``, ~40 small torch ops) in the same launch.
The kernel sums probabilities exactly (fixed point) where this torch path uses an fp64 cumsum: the
results are identical whenever those fp64 sums are exact (all kept probabilities >= 2^-29 or so),
otherwise they differ only by the fp64 rounding (see cuda/sampler.cu).
"""

from __future__ import annotations

import logging
import os
import secrets
from collections import Counter
from dataclasses import dataclass

import torch
from torch import Tensor

from infer.batch import to_device

__all__ = ["SamplingParams", "SampleOutput", "Sampler", "uniform_reference"]

log = logging.getLogger(__name__)

_FMAX = torch.finfo(torch.float32).max
_PREPARED_DTYPES = (torch.float16, torch.float32)  # logits the CUDA kernel's preparation reads
_NEG_INF = float("-inf")
_M32 = 0xFFFFFFFF
# With top_k in (0, _TOPK_MAX] for every sampled slot the candidates come from torch.topk;
# otherwise (top_p without top_k, or a huge top_k) a full sort is needed.
_TOPK_MAX = 1024
# CPU only: first look for the nucleus among this many top candidates, sort only leftovers.
_CPU_STAGE_K = 256


@dataclass
class SamplingParams:  # per request row, validated by the API layer later
    temperature: float = 1.0  # 0 => greedy (argmax)
    top_k: int = 0  # 0 => off
    top_p: float = 1.0  # 1 => off; 0 => greedy
    alpha_presence: float = 0.0
    alpha_frequency: float = 0.0
    alpha_decay: float = 1.0  # penalty table multiplied by this each step (1.0 = no decay)
    seed: int | None = None  # None => a random seed is drawn at row creation
    logit_bias: dict[int, float] | None = None
    logprobs: int = 0  # number of top alternatives to report (0 => none)


@dataclass
class SampleOutput:
    tokens: Tensor  # LongTensor[B] on the logits' device
    logprobs: Tensor | None = None  # [B] fp32, log-prob of the chosen token (see module doc)
    top_ids: Tensor | None = None  # LongTensor[B, N], sorted by descending logprob
    top_logprobs: Tensor | None = None  # [B, N] fp32


# --------------------------------------------------------------------------------------------
# Counter-based RNG.  Only 32-bit quantities are ever multiplied, and multiplications are split
# so every intermediate stays below 2**49: no signed int64 overflow, no arithmetic-shift
# surprises (all values are non-negative), hence bit-identical results on every device and a
# pure-Python reference that matches exactly.
# --------------------------------------------------------------------------------------------
_C1, _C2 = 0x7FEB352D, 0x846CA68B  # "lowbias32" constants (C. Wellons, hash-prospector)
_K3 = 0x9E3779B9


def _mul32_py(x: int, c: int) -> int:
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32_py(x: int) -> int:
    x ^= x >> 16
    x = _mul32_py(x, _C1)
    x ^= x >> 15
    x = _mul32_py(x, _C2)
    x ^= x >> 16
    return x


def _mul32(x: Tensor, c: int) -> Tensor:
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: Tensor) -> Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def _seed_keys(seed: int) -> tuple[int, int]:
    s = seed & 0xFFFFFFFFFFFFFFFF
    lo, hi = s & _M32, s >> 32
    k1 = _mix32_py(lo ^ _mix32_py(hi ^ _K3))
    k2 = _mix32_py(k1 ^ hi ^ 0x85EBCA6B)
    return k1, k2


def _hash_step(k1, k2, step, mix, m32=_M32):
    lo, hi = step & m32, (step >> 32) & m32
    h = mix(lo ^ k1)
    h = mix(h ^ hi ^ k2)
    return mix(h ^ _K3)


def _uniform(k1: Tensor, k2: Tensor, step: Tensor) -> Tensor:
    """fp32 uniform in [0, 1) with 24 random bits, from int64 keys and step counters."""
    h = _hash_step(k1, k2, step, _mix32)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def uniform_reference(seed: int, step: int) -> float:
    """Pure-Python value of the uniform a row with ``seed`` uses at its ``step``-th sample."""
    k1, k2 = _seed_keys(seed)
    return (_hash_step(k1, k2, step, _mix32_py) >> 8) / float(1 << 24)


def _draw(p: Tensor, tau: Tensor, u: Tensor) -> Tensor:
    """Inverse CDF over the kept probabilities (p >= tau) in vocabulary order at uniforms u (overwrites p)."""
    V = p.shape[1]
    # A parallel fp32 scan (CUDA) errs by ~1e-6, as large as tail-token probabilities, so use fp64
    # there; the CPU kernel is sequential and already accumulates fp32 in double.
    p.masked_fill_(p < tau[:, None], 0.0)
    cdf = p.cumsum_(dim=1) if p.device.type == "cpu" else p.to(torch.float64).cumsum_(dim=1)
    total = cdf[:, -1:]
    target = torch.minimum(u.to(cdf.dtype)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=V - 1)


# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _RowInfo:  # host mirror of one slot's parameters: drives O(1) per-step path decisions
    sampled: bool
    top_k: int  # 0 = off
    needs_sort: bool  # sampled and (top_k off or > _TOPK_MAX) and truncating
    has_pen: bool
    n_bias: int
    logprobs: int
    seed: int


_F_TEMP, _F_TOPP, _F_PRES, _F_FREQ, _F_DECAY = range(5)
_I_GREEDY, _I_TOPK, _I_K1, _I_K2 = range(4)


DEFAULT_IMPLEMENTATION = "auto"  # the kernel where it loads (H200: 1.7x faster at batch 1, 3.9x at 512)


class Sampler:
    IMPLEMENTATIONS = ("auto", "cuda", "torch")

    def __init__(self, vocab_size: int, max_slots: int, device, valid_vocab: int = 65530,
                 impl: str | None = None):
        self.vocab_size = int(vocab_size)
        self.max_slots = int(max_slots)
        self.device = torch.device(device)
        self.valid_vocab = min(int(valid_vocab), self.vocab_size)
        dev = self.device
        self.penalty = torch.zeros(max_slots, vocab_size, dtype=torch.float32, device=dev)
        # Packed per-slot parameters so a step needs two gathers.  Unused slots are greedy.
        self._fparams = torch.zeros(max_slots, 5, dtype=torch.float32, device=dev)
        self._fparams[:, _F_TEMP] = 1.0
        self._fparams[:, _F_TOPP] = 1.0
        self._fparams[:, _F_DECAY] = 1.0
        self._iparams = torch.zeros(max_slots, 4, dtype=torch.int64, device=dev)
        self._iparams[:, _I_GREEDY] = 1
        self.step = torch.zeros(max_slots, dtype=torch.int64, device=dev)
        # Sparse logit bias: [S, Kb] ids/values, padded with (id 0, +0.0); Kb grows on demand.
        self._bias_ids = torch.zeros(max_slots, 0, dtype=torch.int64, device=dev)
        self._bias_vals = torch.zeros(max_slots, 0, dtype=torch.float32, device=dev)
        # Host mirror and aggregate counters over live slots.
        self._rows: list[_RowInfo | None] = [None] * max_slots
        self._n_sampled = 0
        self._n_sort = 0
        self._n_pen = 0
        self._n_bias = 0
        self._topks: Counter[int] = Counter()  # top_k of sampled slots with top_k in (1, _TOPK_MAX]
        self._lps: Counter[int] = Counter()  # logprobs > 0
        self._kernel = self._select_kernel(impl or os.environ.get("RWKV_SAMPLER") or DEFAULT_IMPLEMENTATION)
        self.name = "torch" if self._kernel is None else self._kernel.name

    def _select_kernel(self, impl: str):
        """The CUDA threshold-and-draw kernel, or None for the torch path (see the module doc)."""
        if impl not in self.IMPLEMENTATIONS:
            raise ValueError(f"unknown sampler implementation {impl!r}; "
                             f"choose one of {', '.join(self.IMPLEMENTATIONS)}")
        kernel = None
        if impl != "torch" and self.device.type == "cuda":
            from infer.ops.sampler_cuda import cuda_sampler_error, load_cuda_sampler
            kernel = load_cuda_sampler()
            if kernel is None and impl == "cuda":
                raise RuntimeError(f"the CUDA sampler kernel was asked for but is unavailable: {cuda_sampler_error()}")
        elif impl == "cuda":
            raise RuntimeError(f"the CUDA sampler kernel was asked for, but the sampler runs on {self.device}")
        log.info("sampler on %s: %s", self.device, "torch" if kernel is None else kernel.name)
        return kernel

    # ---------------------------------------------------------------- slot management
    def _account(self, info: _RowInfo, sign: int) -> None:
        def bump(counter: Counter, key: int) -> None:
            counter[key] += sign
            if counter[key] <= 0:
                del counter[key]

        self._n_sampled += sign * info.sampled
        self._n_sort += sign * info.needs_sort
        self._n_pen += sign * info.has_pen
        self._n_bias += sign * (info.n_bias > 0)
        if info.sampled and 0 < info.top_k <= _TOPK_MAX:
            bump(self._topks, info.top_k)
        if info.logprobs > 0:
            bump(self._lps, info.logprobs)

    def release_slot(self, slot: int) -> None:
        """Forget a finished slot so its parameters no longer widen the per-step paths."""
        old = self._rows[slot]
        if old is not None:
            self._account(old, -1)
            self._rows[slot] = None
        self._iparams[slot, _I_GREEDY].fill_(1)  # not `= 1`: a host scalar's copy waits for the stream

    def slot_seed(self, slot: int) -> int | None:
        info = self._rows[slot]
        return None if info is None else info.seed

    def reset_slot(self, slot: int, params: SamplingParams) -> None:
        if not 0 <= slot < self.max_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.max_slots})")
        V = self.vocab_size
        temp = float(params.temperature)
        top_k = int(params.top_k)
        top_p = float(params.top_p)
        if top_k <= 0 or top_k >= V:
            top_k = 0
        if top_p >= 1.0 or top_p < 0.0:
            top_p = 1.0
        greedy = not (temp > 0.0) or top_p == 0.0 or top_k == 1
        if greedy:
            temp, top_k, top_p = 1.0, 0, 1.0
        pres, freq = float(params.alpha_presence), float(params.alpha_frequency)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        k1, k2 = _seed_keys(int(seed))
        bias = params.logit_bias or {}
        for tid in bias:
            if not 0 <= int(tid) < V:
                raise ValueError(f"logit_bias token id {tid} out of range [0, {V})")

        info = _RowInfo(
            sampled=not greedy,
            top_k=top_k,
            needs_sort=(not greedy) and (top_k > _TOPK_MAX or (top_k == 0 and top_p < 1.0)),
            has_pen=(pres != 0.0 or freq != 0.0),
            n_bias=len(bias),
            logprobs=max(0, int(params.logprobs)),
            seed=int(seed),
        )
        old = self._rows[slot]
        if old is not None:
            self._account(old, -1)
        self._rows[slot] = info
        self._account(info, +1)

        dev = self.device
        self.penalty[slot].zero_()
        self.step[slot].zero_()  # a fill: `= 0` would copy a host scalar and wait for the stream
        # copies that do not wait for the steps queued before this row's start (infer.batch.to_device)
        self._fparams[slot] = to_device([temp, top_p, pres, freq, float(params.alpha_decay)], dev, torch.float32)
        self._iparams[slot] = to_device([int(greedy), top_k, k1, k2], dev, torch.int64)
        n = len(bias)
        if n > self._bias_ids.shape[1]:
            kb = max(n, 2 * self._bias_ids.shape[1])
            ids = torch.zeros(self.max_slots, kb, dtype=torch.int64, device=dev)
            vals = torch.zeros(self.max_slots, kb, dtype=torch.float32, device=dev)
            ids[:, : self._bias_ids.shape[1]] = self._bias_ids
            vals[:, : self._bias_vals.shape[1]] = self._bias_vals
            self._bias_ids, self._bias_vals = ids, vals
        if self._bias_ids.shape[1]:
            row_ids = torch.zeros(self._bias_ids.shape[1], dtype=torch.int64)
            row_vals = torch.zeros(self._bias_ids.shape[1], dtype=torch.float32)
            if n:
                row_ids[:n] = torch.tensor([int(t) for t in bias.keys()], dtype=torch.int64)
                row_vals[:n] = torch.tensor([float(v) for v in bias.values()], dtype=torch.float32)
            self._bias_ids[slot] = row_ids.to(dev, non_blocking=True)
            self._bias_vals[slot] = row_vals.to(dev, non_blocking=True)

    # ---------------------------------------------------------------- sampling
    def _thresholds(self, p: Tensor, top_k: Tensor, top_p: Tensor, K: int) -> tuple[Tensor, Tensor]:
        """Per-row keep threshold tau (keep p >= tau) from the K largest probabilities.

        Returns (tau, resolved).  A row is unresolved when its boundary may lie beyond the K
        candidates (only possible when K < V); the caller then redoes it with a full sort.
        The result for a resolved row is the same for every K (values only, ties irrelevant).
        """
        V = p.shape[1]
        if K >= V:
            vals = p.sort(dim=1, descending=True).values
            K = V
        else:
            vals = p.topk(K, dim=1, sorted=True).values
        has_k = top_k > 0
        k_eff = torch.where(has_k, top_k, V)
        k_in = k_eff.clamp(max=K)
        pos = torch.arange(K, device=p.device)
        # fp64 prefix sums: the prefix of the sorted values is the same whatever K is, and fp64
        # keeps the boundary decision insensitive to the scan's summation order.
        cs = vals.masked_fill(pos >= k_in[:, None], 0.0).to(torch.float64).cumsum(dim=1)
        # Nucleus is applied to the top-k renormalized distribution (HF/vLLM convention).
        mass_k = torch.where(has_k, cs.gather(1, (k_in - 1)[:, None]).squeeze(1), 1.0)
        need = top_p.to(torch.float64) * mass_k
        j = torch.searchsorted(cs, need[:, None]).squeeze(1)
        # With top-k the boundary is inside the candidates iff k <= K (mass_k needs all k);
        # without it, iff the prefix mass reached `need` within the K candidates.
        resolved = torch.where(has_k, k_eff <= K, j < K)
        tau = vals.gather(1, j.clamp(max=K - 1)[:, None]).squeeze(1)
        no_trunc = (~has_k) & (top_p >= 1.0)
        tau = torch.where(no_trunc, 0.0, tau)
        return tau, resolved | no_trunc

    def _torch_draw(self, p: Tensor, top_k: Tensor, top_p: Tensor, u: Tensor) -> Tensor:
        """The torch path of the top-k/top-p threshold and the draw of the sampled rows (overwrites p)."""
        B, V = p.shape
        if self._n_sort:
            if p.device.type == "cpu":
                # Full CPU sorts are slow; look in the top candidates first and sort only
                # the rows whose nucleus extends beyond them (exactly the same tau).
                K = max(_CPU_STAGE_K, max(self._topks, default=0))
                tau, ok = self._thresholds(p, top_k, top_p, min(K, V))
                bad = (~ok).nonzero().squeeze(1)
                if bad.numel():
                    tau[bad] = self._thresholds(p[bad], top_k[bad], top_p[bad], V)[0]
            else:
                tau = self._thresholds(p, top_k, top_p, V)[0]
        elif self._topks:
            tau = self._thresholds(p, top_k, top_p, min(max(self._topks), V))[0]
        else:
            tau = torch.zeros(B, dtype=torch.float32, device=p.device)
        return _draw(p, tau, u)

    def _prepare(self, logits: Tensor, slots: Tensor, fp: Tensor) -> tuple:
        """Step 1 of :meth:`sample` in torch: ``(x, s, tok, dead, fallback, raw, pen, any_dead)``: the adjusted
        logits x (fp32, a fresh tensor: the caller's logits are never mutated), s = x over the temperature (None
        when no row samples), the greedy token, the rows with nothing left (dead) and their token from the raw
        logits (fallback, from raw), the slots' penalty rows (pen, None without penalties), and whether dead rows
        may exist (on CUDA always True: checking would sync the host). The CUDA kernel's ``prepare`` computes
        s, tok, dead and fallback bit for bit the same."""
        V, vv, cpu = logits.shape[1], self.valid_vocab, logits.device.type == "cpu"
        pen = None
        if self._n_pen:
            pen = self.penalty[slots]  # (CPU index_select is ~60x slower for wide rows)
            lg = logits if logits.dtype != torch.float64 else logits.float()
            x = torch.sub(lg, pen)  # one pass; promotes fp16/bf16 logits to fp32
        else:
            x = logits.to(torch.float32, copy=True)
        if self._n_bias and self._bias_ids.shape[1]:
            x.scatter_add_(1, self._bias_ids[slots], self._bias_vals[slots])
        x.nan_to_num_(nan=_NEG_INF, posinf=_FMAX, neginf=_NEG_INF)
        if vv < V:
            x[:, vv:] = _NEG_INF
        tok = x.argmax(dim=1)  # greedy choice; also tells whether anything is left
        dead = x.gather(1, tok[:, None]).squeeze(1) == _NEG_INF
        # Rows with nothing left fall back to the raw logits: on CPU only when there are some.
        any_dead = bool(dead.any()) if cpu else True
        raw = fallback = s = None
        if any_dead:
            raw = torch.nan_to_num(logits[:, :vv].float(), nan=_NEG_INF, posinf=_FMAX, neginf=_NEG_INF)
            fallback = raw.argmax(dim=1)
        if self._n_sampled:
            s = x / fp[:, _F_TEMP : _F_TEMP + 1]
            s.clamp_(max=_FMAX)
            if any_dead:
                s.masked_fill_(dead[:, None], 0.0)
        return x, s, tok, dead, fallback, raw, pen, any_dead

    def _prepare_on(self, kernel, logits: Tensor, slots: Tensor, fp: Tensor,
                    ip: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``(s, tok, dead, fallback, u)``: :meth:`_prepare`'s s, tok, dead and fallback and the rows' uniforms
        (``_uniform``) from ``kernel.prepare`` (the CUDA kernel, or its CPU emulation in the tests), with this
        sampler's penalties, biases, temperatures, keys and step counters (``fp``/``ip``: the slots' rows)."""
        biased = bool(self._n_bias and self._bias_ids.shape[1])
        return kernel.prepare(logits, self.penalty if self._n_pen else None, slots,
                              self._bias_ids if biased else None, self._bias_vals if biased else None,
                              self.valid_vocab, fp[:, _F_TEMP], ip[:, _I_K1], ip[:, _I_K2], self.step)

    @property
    def bias_width(self) -> int:
        """Columns of the logit-bias tables (they grow, reallocated, when a row brings more biases)."""
        return self._bias_ids.shape[1]

    def graph_key(self, logits: Tensor, want_logprob: bool = False) -> tuple | None:
        """What a CUDA graph of :meth:`sample` on ``logits`` (a static buffer) fixes besides the contents of its
        inputs: the host-side branches the live slots choose, and the bias tables' width (they are reallocated
        wider when a row brings more biases). None: sample these eagerly (no kernel, or log-probabilities
        wanted: their top-n width comes from the live slots, and the torch path may read results on the host)."""
        if (self._kernel is None or want_logprob or self._lps or logits.dtype not in _PREPARED_DTYPES
                or logits.stride(1) != 1):
            return None
        return self._n_sampled > 0, self._n_pen > 0, self.bias_width if self._n_bias else 0

    def sample(self, logits: Tensor, slots: Tensor, want_logprob: bool = False) -> SampleOutput:
        B, V = logits.shape
        if V != self.vocab_size:
            raise ValueError(f"logits have {V} columns, sampler vocab is {self.vocab_size}")
        dev = logits.device
        vv = self.valid_vocab
        slots = torch.as_tensor(slots, dtype=torch.int64).to(dev)
        fp = self._fparams[slots]
        ip = self._iparams[slots]

        n_top = min(max(self._lps, default=0), vv)
        wants_logprobs = n_top > 0 or want_logprob
        # The kernel does step 1 and the temperature in two passes over the logits (the torch steps make ~10); the
        # log-probabilities need x itself, which it does not keep.
        if (self._kernel is not None and not wants_logprobs and logits.dtype in _PREPARED_DTYPES
                and logits.stride(1) == 1):
            s, tok, dead, fallback, u = self._prepare_on(self._kernel, logits, slots, fp, ip)
            x = raw = pen = None
            any_dead = True
        else:
            x, s, tok, dead, fallback, raw, pen, any_dead = self._prepare(logits, slots, fp)
            u = None

        # 2. choose
        if self._n_sampled:
            p = torch.softmax(s, dim=1)
            del s
            top_k, top_p = ip[:, _I_TOPK], fp[:, _F_TOPP]
            if u is None:
                u = _uniform(ip[:, _I_K1], ip[:, _I_K2], self.step[slots])
            if self._kernel is not None:  # threshold and draw in one kernel, no sort
                drawn = self._kernel(p, top_k, top_p, u, ip[:, _I_GREEDY])[1]
            else:
                drawn = self._torch_draw(p, top_k, top_p, u)
            del p
            tok = torch.where(ip[:, _I_GREEDY].bool(), tok, drawn)
        if any_dead:
            tok = torch.where(dead, fallback, tok)

        # 3. logprobs (before the penalty update: they describe this step's distribution)
        out = SampleOutput(tokens=tok)
        if wants_logprobs:
            lp = torch.log_softmax(torch.where(dead[:, None], raw, x[:, :vv]) if any_dead else x[:, :vv], dim=1)
            lp.nan_to_num_(nan=_NEG_INF)
            out.logprobs = lp.gather(1, tok[:, None]).squeeze(1)
            if n_top > 0:
                out.top_logprobs, out.top_ids = lp.topk(n_top, dim=1, sorted=True)

        # 4. state updates: penalties, RNG step counters
        if self._n_pen and pen is None:
            pen = self.penalty[slots]
        if pen is not None:
            t = tok[:, None]
            before = pen.gather(1, t)
            pen.mul_(fp[:, _F_DECAY : _F_DECAY + 1])
            add = torch.where(before == 0.0, fp[:, _F_PRES : _F_PRES + 1], fp[:, _F_FREQ : _F_FREQ + 1])
            pen.scatter_add_(1, t, add)
            self.penalty[slots] = pen
        self.step.index_add_(0, slots, torch.ones_like(slots))
        return out
