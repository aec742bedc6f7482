"""The WKV-7 recurrence for long prefill with fla-core's chunked Triton kernel (``chunk_rwkv7``).

Same contract as :class:`infer.ops.wkv.TorchWKV` and :class:`infer.ops.wkv_cuda.CudaWKV`: read each
row's state from ``state[slot]``, run the row's tokens, write the final state back to the slot,
return ``y`` fp32 ``[T, C]``. The per-token kernels walk the tokens one after another; the chunked
form processes 16 or 64 tokens of a row at once with matrix products (exact math, other rounding),
which is what a long prompt needs.

What fla-core 0.6.0 expects (read from ``fla/ops/rwkv7/chunk.py`` and
``fla/ops/generalized_delta_rule/dplr/*``), and what this adapter does about it:

- ``chunk_rwkv7(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens,
  cu_seqlens_cpu, safe_gate, chunk_size, disable_recompute, cp_context, lower_bound)``;
  tensors are ``[B, T, H, K]`` (no ``head_first`` any more). Variable-length rows go packed
  end to end with ``B = 1`` and ``cu_seqlens`` ``[N+1]``: exactly :class:`PackedBatch`'s layout.
- ``w`` is the *log* decay (``S <- exp(w) * S ...``): we pass ``log(w)`` in fp32, floored at
  :data:`LOG_DECAY_FLOOR` (RWKV-7's own decays are >= exp(-e^-0.5) = 0.545, far above it).
- ``a``/``b`` are the kernel's ``-kk`` and ``kk * a_gate`` as in our contract; ``scale`` must be
  1.0 for RWKV-7 (fla's generic delta-rule default would be K^-1/2).
- The state is ``[N, H, K, V]``, the transpose of our ``S[h][value][key]``: the batch's slots
  are gathered and transposed on the way in, and the final state (always fp32 from fla) is
  transposed and written back in the pool's dtype. That is 2 x 16 KiB per head and row, nothing
  next to the token work of a long prompt; for decode keep the in-place CUDA kernel.
- All intermediates (gated q/k/a/b, the per-chunk states, the output) are kept in the dtype of
  ``r``; with fp32 inputs Triton's dots run in TF32 on NVIDIA unless ``TRITON_F32_DEFAULT=ieee``
  is set before the kernels compile. The log-decay cumsum is a dot too (fp32 input, so TF32).
- ``chunk_size=64`` needs ``lower_bound`` (licensing fla's "safe gate" path: intra-chunk products
  as fp32/TF32 dots, the triangular inverse in fp16 steps) and Triton >= 3.4 (else fla falls
  back to 16 with a warning). ``chunk_size=16`` without a bound takes fla's default path: the
  intra-chunk products as fp32 element-wise sums, no tensor cores.
- Head size: the kernels take K = V <= 256 (one block); RWKV-7 has 64.
- Not capturable in a CUDA graph: fla builds its chunk indices on the host and copies them to
  the device (once per batch and chunk size: fla caches them by the identity of cu_seqlens,
  which we keep for all layers of a batch). That copy waits for the GPU once per batch.

Importing this module does not import fla or Triton: :class:`FlaWKV` imports them when it is
constructed. :func:`load_fla_wkv` never raises: it returns None and logs why (no CUDA device,
fla-core missing, import error, failed self-test against the torch reference).
"""
from __future__ import annotations

import logging
import threading
import time
import warnings
import weakref
from typing import Callable, Sequence

import torch

from infer.batch import PackedBatch
from infer.ops.wkv import WKV, TorchWKV

log = logging.getLogger(__name__)

FLA_VERSION = "0.6.0"                 # the version this adapter was written against
HEAD_SIZE = 64
STATE_DTYPES = (torch.float32, torch.float16)
COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CHUNK_SIZES = (16, 64)
# Floor of the log decay handed to fla: licenses its chunk-64 tensor-core path, whose exponents
# reach (chunk/2 + 1) * |floor| / ln 2 <= 124 bits (fla's gate_bound_is_safe), and keeps the
# chunk-16 path's exp2 of in-chunk decay sums finite. RWKV-7 decays are >= exp(-0.6066).
LOG_DECAY_FLOOR = -2.5

ChunkFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def import_chunk_rwkv7() -> ChunkFn:
    """fla-core's chunked RWKV-7 kernel (imports fla and Triton)."""
    from fla.ops.rwkv7 import chunk_rwkv7
    return chunk_rwkv7


def log_decay(w: torch.Tensor) -> torch.Tensor:
    """fla's gate: the natural log of the multiplicative decay, fp32, floored at LOG_DECAY_FLOOR
    (so also a zero decay gives a finite gate)."""
    return torch.log(w.float()).clamp_min_(LOG_DECAY_FLOOR)


def cu_seqlens_of(lens: Sequence[int], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``cu_seqlens`` ``[B+1]`` int32 on ``device`` and its host copy: row i owns tokens
    ``cu[i]:cu[i+1]`` (PackedBatch packs rows end to end in order)."""
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + int(n))
    host = torch.tensor(offsets, dtype=torch.int32)
    return host.to(device), host


class FlaWKV:
    """WKV over the slot pool with fla-core's ``chunk_rwkv7``; see the module docstring.

    ``chunk_size``: 64 (fla's tensor-core "safe gate" path, licensed by :data:`LOG_DECAY_FLOOR`)
    or 16 (fla's default path: fp32 element-wise intra-chunk products, no bound). ``compute_dtype``:
    the dtype that r, k, v, a, b are cast to (None: theirs, if they share one of fp16/bf16/fp32,
    else fp32). ``chunk_fn``: a stand-in for fla's function with the same signature (tests).
    """

    def __init__(self, chunk_size: int = 64, compute_dtype: torch.dtype | None = None,
                 chunk_fn: ChunkFn | None = None) -> None:
        if chunk_size not in CHUNK_SIZES:
            raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, not {chunk_size}")
        if compute_dtype is not None and compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {COMPUTE_DTYPES}, not {compute_dtype}")
        self.chunk_size = chunk_size
        self.compute_dtype = compute_dtype
        self.lower_bound = LOG_DECAY_FLOOR if chunk_size == 64 else None
        self._chunk = chunk_fn if chunk_fn is not None else import_chunk_rwkv7()
        if chunk_fn is None:
            # fla warns on every fp32 call that fp32 "is not supported on some platforms"; we
            # choose fp32 deliberately (and test it), so hush that one warning.
            warnings.filterwarnings("ignore", message="ChunkDeltaRuleFunction does not support float32",
                                    category=RuntimeWarning)
        dtype = "" if compute_dtype is None else f", {str(compute_dtype).removeprefix('torch.')}"
        self.name = f"fla-core chunk_rwkv7 (Triton, chunk {chunk_size}{dtype})"
        # cu_seqlens of the last batch: the model calls us once per layer with the same batch,
        # and fla caches its chunk indices by the identity of these tensors.
        self._last: tuple[weakref.ref, tuple[int, ...], torch.device, torch.Tensor, torch.Tensor] | None = None

    def _seqlens(self, batch: PackedBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        lens = tuple(batch.lens)
        last = self._last
        if last is not None and last[0]() is batch and last[1] == lens and last[2] == device:
            return last[3], last[4]
        # On the device from batch.starts (a host-to-device copy would wait for the GPU to drain).
        cu = torch.nn.functional.pad(batch.starts.to(device=device, dtype=torch.int32), (0, 1),
                                     value=batch.num_tokens)
        host = cu_seqlens_of(lens, "cpu")[1]
        self._last = (weakref.ref(batch), lens, device, cu, host)
        return cu, host

    def _dtype(self, acts: Sequence[torch.Tensor]) -> torch.dtype:
        if self.compute_dtype is not None:
            return self.compute_dtype
        first = acts[0].dtype
        if first in COMPUTE_DTYPES and all(t.dtype == first for t in acts):
            return first
        return torch.float32

    def __call__(self, state: torch.Tensor, batch: PackedBatch, r: torch.Tensor, w: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if state.dim() != 4 or state.shape[2] != state.shape[3]:
            raise ValueError(f"state must be [slots, H, N, N], got {tuple(state.shape)}")
        if state.dtype not in STATE_DTYPES:
            raise ValueError(f"the state pool must be float32 or float16, got {state.dtype}")
        _, H, N, _ = state.shape
        T, C = r.shape
        if C != H * N or T != batch.num_tokens:
            raise ValueError(f"inputs [{T}, {C}] do not fit {batch.num_tokens} tokens of {H} heads x {N}")
        acts = (r, k, v, a, b)
        if any(t.shape != (T, C) for t in (*acts, w)):
            raise ValueError("r, w, k, v, a, b must all be [T, C]")
        dtype = self._dtype(acts)
        q, k, v, a, b = (t.to(dtype).reshape(1, T, H, N) for t in acts)
        g = log_decay(w).reshape(1, T, H, N)
        slots = batch.slots
        h0 = state.index_select(0, slots).transpose(-1, -2).contiguous()     # [B, H, K, V]
        cu, host = self._seqlens(batch, r.device)
        o, ht = self._chunk(q, g, k, v, a, b, scale=1.0, initial_state=h0, output_final_state=True,
                            cu_seqlens=cu, cu_seqlens_cpu=host, chunk_size=self.chunk_size,
                            lower_bound=self.lower_bound)
        state.index_copy_(0, slots, ht.transpose(-1, -2).to(state.dtype))
        return o.reshape(T, C).float()


class SplitWKV:
    """Per call: ``long`` (FlaWKV) when the batch's longest row has at least ``min_len`` tokens,
    else ``short`` (the per-token kernel, also the decode kernel)."""

    def __init__(self, short: WKV, long: WKV, min_len: int = 64) -> None:
        if min_len < 1:
            raise ValueError("min_len must be >= 1")
        self.short, self.long, self.min_len = short, long, min_len
        self.name = f"{short.name} below {min_len} tokens a row, {long.name} from there"

    def __call__(self, state, batch, r, w, k, v, a, b):
        impl = self.long if max(batch.lens) >= self.min_len else self.short
        return impl(state, batch, r, w, k, v, a, b)


# --------------------------------------------------------------------------- loading
def _self_test(wkv: FlaWKV, heads: int, dtype: torch.dtype) -> str | None:
    """One small varlen batch (rows of 1, 37 and 150 tokens: crossing chunk boundaries, nonzero
    initial states) against the torch reference; a reason string if they disagree."""
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(0)
    lens, slots = [1, 37, 150], [2, 0, 3]
    T, C = sum(lens), heads * HEAD_SIZE
    batch = PackedBatch.from_rows([[0] * n for n in lens], slots, device)
    r, k, v = (torch.randn(T, C, generator=gen, device=device).to(dtype) for _ in range(3))
    w = torch.exp(-0.606531 * torch.rand(T, C, generator=gen, device=device))
    kk = torch.nn.functional.normalize(torch.randn(T, heads, HEAD_SIZE, generator=gen, device=device), dim=-1)
    kk = kk.view(T, C).to(dtype)
    gate = torch.rand(T, C, generator=gen, device=device).to(dtype)
    pool = torch.randn(4, heads, HEAD_SIZE, HEAD_SIZE, generator=gen, device=device) * 0.3
    expect_pool = pool.clone()
    expect = TorchWKV()(expect_pool, batch, r, w, k, v, -kk, kk * gate)
    got = wkv(pool, batch, r, w, k, v, -kk, kk * gate)
    torch.cuda.synchronize(device)
    if not (torch.isfinite(got).all() and torch.isfinite(pool).all()):
        return "self-test against the torch reference gave non-finite values"
    err_y = ((got - expect).abs().max() / expect.abs().max()).item()
    err_s = ((pool - expect_pool).abs().max() / expect_pool.abs().max()).item()
    tol = 4e-2 if dtype == torch.bfloat16 else 1.5e-2
    if not max(err_y, err_s) <= tol:
        return (f"self-test against the torch reference failed: max |diff| / max |ref| "
                f"{err_y:.3g} (y), {err_s:.3g} (state), allowed {tol:g}")
    log.info("fla WKV self-test: max |diff| / max |ref| %.2g (y), %.2g (state)", err_y, err_s)
    return None


class _Loader:
    """The process-wide FlaWKV: built and self-tested on the first call, or None with a reason."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value: FlaWKV | None = None
        self.error: str | None = None
        self.seconds: float | None = None   # import + first compile + self-test

    def reset(self) -> None:
        with self._lock:
            self.value, self.error, self.seconds = None, None, None

    def get(self, verify: bool, heads: int, dtype: torch.dtype) -> FlaWKV | None:
        with self._lock:
            if self.value is not None or self.error is not None:
                return self.value
            start = time.perf_counter()
            self.value, self.error = _build(verify, heads, dtype)
            self.seconds = time.perf_counter() - start
            if self.value is None:
                log.warning("fla-core WKV unavailable: %s", self.error)
            else:
                log.info("fla-core WKV ready in %.1f s (%s)", self.seconds, self.value.name)
            return self.value


def _build(verify: bool, heads: int, dtype: torch.dtype) -> tuple[FlaWKV | None, str | None]:
    if not torch.cuda.is_available():
        return None, "torch sees no CUDA device (fla's kernels are Triton GPU kernels)"
    try:
        wkv = FlaWKV()
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] in ("fla", "triton", "einops"):
            return None, f"{exc.name} is not installed (pip install fla-core=={FLA_VERSION} einops; triton comes with CUDA torch)"
        return None, f"importing fla-core failed: {type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - any import problem means "use the other kernels"
        return None, f"importing fla-core failed: {type(exc).__name__}: {str(exc).strip()[-2000:]}"
    try:
        import fla
        version = getattr(fla, "__version__", "?")
        if version != FLA_VERSION:
            log.warning("fla-core %s found; this adapter was written and tested against %s", version, FLA_VERSION)
    except Exception:  # noqa: BLE001 - the version is information only
        pass
    if verify:
        try:
            reason = _self_test(wkv, heads, dtype)
        except Exception as exc:  # noqa: BLE001 - a Triton compile error etc.
            reason = f"self-test raised {type(exc).__name__}: {str(exc).strip()[-2000:]}"
        if reason:
            return None, reason
    return wkv, None


_loader = _Loader()


def load_fla_wkv(verify: bool = True, heads: int = 32, dtype: torch.dtype = torch.float16) -> FlaWKV | None:
    """The chunk-64 FlaWKV (compute dtype: the activations'), built on the first call; None (with a
    logged warning) if it cannot be had. Never raises.

    The self-test compiles and autotunes the kernels. fla's autotune keys ignore H and T, and fla
    caches the choice on disk (``FLA_CACHE_RESULTS=1``), so the self-test runs with the model's
    head count and activation dtype (``heads``, ``dtype``) on a few hundred tokens: the configs it
    picks are then used for real prompts.
    """
    return _loader.get(verify, heads, dtype)


def fla_wkv_error() -> str | None:
    """Why :func:`load_fla_wkv` returned None (None if it was not tried or succeeded)."""
    return _loader.error
