"""The forward pass with fused CUDA kernels (``cuda/rwkv7_fused.cu``): same math as ``RWKV7.forward``,
about nine launches per layer instead of ~60.

Per layer: ``ln_shift_mix`` (layer norm + token shift + the six mixes, and the shift-state update),
the projections and LoRAs, ``time_mix`` (decay/gates/normalisation + the WKV recurrence on the
slot state + group norm + bonus + output gate), the output projection with the residual added,
then ``ln_shift_mix`` and the two FFN matrices. Up to ``gemv_rows`` tokens (decode; 8 for 4-bit models) the matrix
products go through the kernel's grouped GEMV: seven matrices of the time-mix in one launch (the decay and
gate LoRAs' tanh/sigmoid applied to their outputs), the four LoRA second halves in another, relu^2 and the
residual add folded in; the FFN value matrix, stored K-major (:class:`KMajorLinear`), through the
sparse-input GEMV, which reads only the weight rows of the nonzero entries of relu(k)^2.
Larger batches use the model's own linears (cuBLAS, CUTLASS, GemLite; 4-bit GemLite layers above 512 rows take
:meth:`FusedKernels.uint4_matmul`: fp16 chunks of W^T for cuBLAS); with fp16 dense weights the
receptance/key/value matrices and the w/a/v LoRA factors go through three strided-batched matmuls
(:class:`BatchedWeights`) and the residual adds into the output and FFN-value products. Prefills take time-mix
kernels built for them (the token-independent work of a chunk of tokens side by side, then the recurrence alone):
a prompt alone one that splits each head's state rows over four blocks, a few rows one with a block per head, many
rows one with a quarter of the shared-memory traffic; decode steps the one-token kernel (the launcher chooses by
the grid; see cuda/rwkv7_fused.cu). When only each row's last token is read out, the last block's output
projection and FFN run on each row's last two tokens alone (``PackedBatch.tails``).

Tiers: this path when the extension builds and passes its self-test, on a CUDA device with fp16
activations; otherwise ``RWKV7.forward``'s readable code (with the CUDA WKV kernel or torch).
:func:`select_fused` decides and logs; nothing here raises on a missing compiler or GPU.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from infer.batch import PackedBatch
from infer.ops.cuda_ext import BuildOnce, compile_kernels, env_flag, env_int
from infer.ops.linear import DenseLinear
from infer.ops.linear_w8a16 import W8A16Linear, uint4_weights
from infer.ops.persistent import PersistentStep, load_persistent_step
from infer.state import StatePool

if TYPE_CHECKING:
    from infer.model import RWKV7, Block

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent.parent
CUDA_SOURCES = [ROOT / "cuda" / "rwkv7_fused_op.cpp", ROOT / "cuda" / "rwkv7_fused.cu"]
HIP_SOURCES = [ROOT / "cuda" / "rwkv7_fused_op.cpp", ROOT / "hip" / "rwkv7_fused.hip"]
EXTENSION_NAME = "rwkv7_fused"
PREFERENCES = ("auto", "on", "off")
EPI_NONE, EPI_RELU_SQUARE, EPI_TANH, EPI_SIGMOID = 0, 1, 2, 3
DEFAULT_GEMV_ROWS = 2
# 4-bit GemLite layers above this many rows: W^T rebuilt in fp16 chunks of at most UINT4_CHUNK_BYTES (to stay in
# the H200's 50 MB L2 until cuBLAS reads them) and multiplied by cuBLAS, instead of GemLite's GEMM. H200, 7.2B
# (experiment_w4_cublas_above64_h200.json against experiment_w4_gemlite_gemm_h200.json): prompts of 1 x 1,024 and
# 16 x 1,024 tokens 44.1 / 461.7 ms against 64.6 / 973.5 ms, but decode steps of 128 and 256 rows 22.4 / 25.5 ms
# against 15.6 / 24.7 (a chunk's product has too few output tiles to fill the GPU); 257-1,023 rows not measured.
UINT4_CUBLAS_ABOVE_ROWS = 512
UINT4_CHUNK_BYTES = 16 << 20
_EMPTY: dict[torch.device, torch.Tensor] = {}


def _empty(device: torch.device) -> torch.Tensor:
    if device not in _EMPTY:
        _EMPTY[device] = torch.empty(0, dtype=torch.float16, device=device)
    return _EMPTY[device]


class GemvOperands(NamedTuple):
    """What the grouped GEMV reads for one linear layer: fp16 weights [out, in]; int8 weights [out, in] with
    an fp16 scale [out]; or GemLite's packed 4-bit words [in/8, out] int32 with fp16 scale and zero
    [in/group, out] (the kernel tells them apart by the weights' dtype). ``k_major``: fp16 weights [in, out]
    of a :class:`KMajorLinear`, which the sparse-input GEMV reads instead."""
    weight: torch.Tensor
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    group: int = 0
    k_major: bool = False


class KMajorLinear(DenseLinear):
    """fp16 weights stored transposed, ``[in, out]`` row-major, for the FFN value matrix: its input
    relu(k)^2 is zero wherever the key projection was negative (about half the channels of a random
    model, most of a trained one's), and in this layout each zero input column is a contiguous weight row
    that the sparse-input GEMV does not read at decode. Larger batches multiply by the same storage
    (cuBLAS takes either layout); ``weight`` is the ``[out, in]`` view of it, as for any dense linear."""

    kind = "dense float16, K-major (sparse-input GEMV)"

    def __init__(self, weight: torch.Tensor, workspace: tuple[torch.Tensor, torch.Tensor]):
        """``weight``: ``[out, in]`` (nn.Linear layout), stored here transposed."""
        self.weight_t = weight.t().contiguous()
        self.weight = self.weight_t.t()  # not DenseLinear's contiguous copy: a view of the K-major storage
        self.out_features, self.in_features = self.weight.shape
        self.workspace = workspace  # (fp32 partial sums, int32 arrival counters), shared by a model's layers


class KMajorW8A16Linear(W8A16Linear):
    """A W8A16 FFN value matrix with a K-major copy of its int8 weights (``weight_t`` [in, out]) for the
    sparse-input GEMV at decode, which then skips the weight rows of relu(k)^2's zero entries as for fp16
    (:class:`KMajorLinear`). Larger batches multiply by the [out, in] int8 matrix as any W8A16 layer (the Hopper
    GEMM reads that layout), so the matrix is stored twice: 67 MB more a 7.2B layer (2.1 GB for 32), for one
    row at a time (the kernel's limit: slower than the int8 bands at 2+ rows). Off unless RWKV_SPARSE_FFN_INT8=1:
    on an H200 7.2B batch 1 took 400.7 against 384.2 tok/s, but 1.5B 998 against 1,091
    (bench/results/experiment_sparse_int8_*_h200.json)."""

    def __init__(self, linear: W8A16Linear, workspace: tuple[torch.Tensor, torch.Tensor]):
        super().__init__(linear.qweight, linear.scale)
        self.weight_t = linear.qweight.t().contiguous()
        self.workspace = workspace  # (fp32 partial sums, int32 arrival counters), shared by a model's layers
        self.kind += ", K-major copy (sparse-input GEMV)"


K_MAJOR_LINEARS = (KMajorLinear, KMajorW8A16Linear)


def gemv_operands(linear) -> GemvOperands | None:
    """The tensors the grouped GEMV (or for K-major weights the sparse-input GEMV) computes this linear layer
    from, or None when it cannot."""
    if isinstance(linear, KMajorLinear):
        return GemvOperands(linear.weight_t, k_major=True)
    if isinstance(linear, DenseLinear) and linear.weight.dtype == torch.float16 and linear.in_features % 8 == 0:
        return GemvOperands(linear.weight)
    if isinstance(linear, W8A16Linear) and linear.scale.dtype == torch.float16 and linear.in_features % 16 == 0:
        return GemvOperands(linear.qweight, linear.scale)
    int8_rows = getattr(linear, "int8_rows", None)  # GemLite A16W8_INT8 layers (infer.quant.gemlite_linear)
    if int8_rows is not None and linear.in_features % 16 == 0:
        return GemvOperands(*int8_rows)
    uint4 = getattr(linear, "uint4_groups", None)  # GemLite A16W4_HQQ_INT layers: (words, scale, zero, group)
    if uint4 is not None and linear.out_features % 4 == 0 and uint4[3] % 8 == 0:  # 16-byte loads of 4 channels
        return GemvOperands(*uint4)
    return None


@dataclass
class BatchedWeights:
    """One block's same-shaped matrices stacked, for the large-batch path: one strided-batched matmul
    each instead of one GEMM per matrix. At 256 rows a single 4096 x 4096 product fills one wave of
    the H200's multiprocessors and the LoRA factors fill almost none, so three launches of three
    matrices beat ten small ones (bench/results/profile_h200.json). Quantized engines stack only the LoRA
    factors (always fp16): their r/k/v stay one quantized product each."""
    rkv: torch.Tensor | None  # [3, C, C]: receptance, key, value; None unless all three are dense fp16
    lora_down: torch.Tensor   # [n, R, C]: (v1,) w1, a1; rows past a factor's rank are zero
    lora_up: torch.Tensor     # [n, C, R]: (v2,) w2, a2; columns past a factor's rank are zero


def _dense_fp16(lin) -> bool:
    return isinstance(lin, DenseLinear) and lin.weight.dtype == torch.float16


def batch_weights(blk: "Block") -> BatchedWeights | None:
    """Stack ``blk``'s matrices and point its linears at views of the stacks (every other path reads the
    same storage, nothing is stored twice, except the padded copy of a LoRA up-factor narrower than the
    widest); r/k/v only when they are dense fp16; None unless the LoRA factors (the gate's too) are (or, with
    quantized r/k/v, when RWKV_STACK_LORA=0, the A/B switch)."""
    loras = ([(blk.v1, blk.v2)] if blk.v1 is not None else []) + [(blk.w1, blk.w2), (blk.a1, blk.a2)]
    dense_rkv = all(_dense_fp16(lin) for lin in (blk.receptance, blk.key, blk.value))
    dense_loras = all(_dense_fp16(lin) for pair in loras + [(blk.g1, blk.g2)] for lin in pair)
    if not dense_loras or not (dense_rkv or env_flag("RWKV_STACK_LORA", True)):
        return None
    rkv = None
    if dense_rkv:
        rkv = torch.stack([blk.receptance.weight, blk.key.weight, blk.value.weight])
        for i, lin in enumerate((blk.receptance, blk.key, blk.value)):
            lin.weight = rkv[i]
    template = blk.w1.weight
    rank, width = max(down.out_features for down, _ in loras), blk.w1.in_features
    lora_down, lora_up = template.new_zeros(len(loras), rank, width), template.new_zeros(len(loras), width, rank)
    for i, (down, up) in enumerate(loras):
        lora_down[i, :down.out_features] = down.weight
        down.weight = lora_down[i, :down.out_features]  # leading rows: still contiguous
        lora_up[i, :, :up.in_features] = up.weight
        if up.in_features == rank:
            up.weight = lora_up[i]
    return BatchedWeights(rkv, lora_down, lora_up)


def batched_projections(blk: "Block", mixed: torch.Tensor, first_layer: bool,
                        sides: Sequence[torch.cuda.Stream] = ()) -> tuple[torch.Tensor, ...]:
    """r, k, v, dw, da, dv (None in layer 0), g of ``blk`` (``blk.batched`` set) from ``mixed`` [6, T, C], the mixed
    inputs in the order r, k, v, w, a, g: one batched matmul for r/k/v (with quantized r/k/v, one product each) and
    two LoRA chains: w/a/v (two batched matmuls and tanh) and g (two products and sigmoid). ``sides``: CUDA streams
    on which the LoRA chains run beside the r/k/v product (their small products fill few multiprocessors), one for
    both chains or one each; the current stream waits for them before returning. The results are the same."""
    weights = blk.batched
    # allocated on the current stream, which reads them afterwards
    ups = mixed.new_empty(len(weights.lora_down), mixed.shape[1], mixed.shape[2])
    g = mixed.new_empty(mixed.shape[1:])
    main = torch.cuda.current_stream(mixed.device) if sides else None
    if sides:
        for side in sides:
            side.wait_stream(main)
        with torch.cuda.stream(sides[0]):
            _stacked_loras(blk, mixed, first_layer, ups)
        with torch.cuda.stream(sides[-1]):
            _gate_lora(blk, mixed[5], g)
    else:
        _stacked_loras(blk, mixed, first_layer, ups)
        _gate_lora(blk, mixed[5], g)
    if weights.rkv is not None:
        r, k, v = torch.bmm(mixed[:3], weights.rkv.transpose(1, 2)).unbind(0)
    else:
        r, k, v = blk.receptance(mixed[0]), blk.key(mixed[1]), blk.value(mixed[2])
    for side in sides:
        main.wait_stream(side)
    *dv, dw, da = ups.unbind(0)
    return r, k, v, dw, da, (dv[0] if dv else None), g


def _stacked_loras(blk: "Block", mixed: torch.Tensor, first_layer: bool, ups: torch.Tensor) -> None:
    """The (v,) w, a LoRAs of batched_projections into ``ups``."""
    weights = blk.batched
    hidden = torch.bmm(mixed[3:5] if first_layer else mixed[2:5], weights.lora_down.transpose(1, 2))
    torch.tanh_(hidden[-2])  # the decay LoRA's nonlinearity (zero-padded columns stay zero)
    torch.bmm(hidden, weights.lora_up.transpose(1, 2), out=ups)


def _gate_lora(blk: "Block", xg: torch.Tensor, g: torch.Tensor) -> None:
    """The gate LoRA of batched_projections into ``g``."""
    torch.mm(torch.sigmoid(torch.mm(xg, blk.g1.weight.t())), blk.g2.weight.t(), out=g)


def add_product(x: torch.Tensor, linear, y: torch.Tensor) -> None:
    """x += y W^T; with dense weights one cuBLAS call with the add folded in (beta = 1: the product and then an add of
    its own was slower, bench/results/experiment_blas_ab_residual_h100.json). A K-major matrix's W^T is its storage."""
    if isinstance(linear, DenseLinear):
        x.addmm_(y, linear.weight.t())
    else:
        x.add_(linear(y))


class FusedKernels:
    """The compiled ops plus the fused forward built on them."""

    name = "fused cuda kernels (rwkv7_fused)"

    def __init__(self, module) -> None:
        self._m = module
        # Batches of at most this many tokens take the grouped GEMV (weights read once, CUDA cores),
        # larger ones the model's linears (tensor cores); set from the decode grid in BENCHMARKS.md.
        self.gemv_rows: int = min(env_int("RWKV_GEMV_ROWS", DEFAULT_GEMV_ROWS), module.gemv_max_rows())
        # The same for models of quantized matrices, whose GEMV tasks run on the tensor cores at any row count
        # up to the GEMV's largest. H200, 7.2B at 8 rows: the 4-bit GEMV took 4.4 ms for a step's matrices,
        # GemLite's whole step 7.9; W8A16 ran 2,250 tok/s on the int8 GEMV against 1,017 on its own kernels
        # (bench/results/experiment_w8_gemv_rows8_h200.json). The HIP port's int8 tasks are per-thread code.
        self.quantized_gemv_rows: int = min(env_int("RWKV_GEMV_ROWS", module.gemv_max_rows()), module.gemv_max_rows())
        # Whether 4-bit tasks are taken: switched off alone (those layers then use GemLite's kernels) if
        # they fail their self-test, so the fp16 and int8 paths do not depend on them.
        self.uint4: bool = True
        # Rows up to which a K-major FFN value matrix takes the sparse-input GEMV (beyond: cuBLAS), and
        # whether select_fused stores fp16 FFN value matrices K-major at all: RWKV_SPARSE_FFN=0 or a failed
        # self-test keep them dense (for A/B timing, and so that the other paths do not depend on it).
        self.sparse_rows: int = module.sparse_gemv_max_rows()
        self.sparse_ffn: bool = env_flag("RWKV_SPARSE_FFN", True)
        # The same for int8 (W8A16) FFN value matrices, stored twice then (KMajorW8A16Linear; 0 rows: the source has
        # no such kernel, as the HIP port); off unless RWKV_SPARSE_FFN_INT8=1 (its memory against its gain).
        self.sparse_int8_rows: int = module.sparse_gemv_max_rows(True)
        self.sparse_ffn_int8: bool = env_flag("RWKV_SPARSE_FFN_INT8", False) and self.sparse_int8_rows > 0
        # 4-bit GemLite layers take uint4_matmul above this many rows (RWKV_UINT4_CUBLAS_ROWS, for A/B timing)
        self.uint4_cublas_rows: int = env_int("RWKV_UINT4_CUBLAS_ROWS", UINT4_CUBLAS_ABOVE_ROWS)
        self._uint4_scratch: dict[torch.device, torch.Tensor] = {}
        # Decode time mixes of many (row, head) items walk them on a fixed grid, prefetching each next state block
        # (time_mix_pipelined_kernel; same results): 0 lets the launcher choose by the grid's size and the state's
        # dtype (RWKV_TIME_MIX_PIPELINED: 0 never, 1 fp16 states, 2 both), -1 never, > 0 always, on that many
        # blocks (tests).
        self.time_mix_blocks: int = 0
        # Whether a layer's LoRA second halves run in the launch of their first halves, as a second stage (see
        # gemv's `then`), instead of a launch of their own. None: when its r/k/v matrices are quantized. H200,
        # 7.2B, batch 1 / 2, two rounds each (bench/results/experiment_gemv_staged{0,1}_*_h200.json): W8A16
        # 376.6 -> 379.2 / 669.3 -> 679.2 tok/s, W4 392.0 -> 398.5 / 691.6 -> 704.7, but fp16 269.6 -> 263.9 /
        # 430.9 -> 427.4 (1.5B fp16: 820 either way). RWKV_GEMV_STAGED=0/1 forces it off/on; the CUDA source only.
        staged = os.environ.get("RWKV_GEMV_STAGED")
        self.staged_loras: bool | None = (False if torch.version.hip is not None else
                                          None if not staged else env_flag("RWKV_GEMV_STAGED", False))
        self._stage_sync: dict[torch.device, torch.Tensor] = {}
        # Above the GEMV's rows, how many side streams the LoRA chains run on beside the r/k/v product
        # (batched_projections; same results): 0 none, 1 both chains on one, 2 one each. H200, tok/s at batch 32 /
        # 128 / 256 (fp32 state): 1.5B 17,453 / 45,740 / 63,214 on 2, 15,662 / 42,905 / 60,791 on 1, 14,279 / 40,885
        # / 58,881 on none; 7.2B 6,098 / 16,404 / 21,490, 5,725 / 15,983 / 21,177, 5,498 / 15,494 / 20,906
        # (bench/results/experiment_lora_streams*_h200.json). RWKV_LORA_STREAM=0/1 for A/B runs.
        self.lora_streams: int = min(max(env_int("RWKV_LORA_STREAM", 2), 0), 2)
        self._side_streams: dict[torch.device, tuple[torch.cuda.Stream, ...]] = {}
        self._forward_stream: int | None = None  # the stream handle of the forward running (forward)
        # Steps of one token of one row as one persistent kernel (infer.ops.persistent; RWKV_PERSISTENT=1, set by
        # select_fused), where it covers the model; None: the launches below.
        self.persistent: PersistentStep | None = None

    # -------------------------------------------------------------- ops
    def _stream(self, t: torch.Tensor) -> int:
        """The handle of the stream to launch on: in a forward, the one current when it started (read once: each
        read costs microseconds of host time, a hundred a 7.2B forward), else the current one."""
        if self._forward_stream is not None:
            return self._forward_stream
        return torch.cuda.current_stream(t.device).cuda_stream

    def ln_shift_mix(self, x: torch.Tensor, ln_w: torch.Tensor, ln_b: torch.Tensor, shift: torch.Tensor,
                     batch: PackedBatch, mixes: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        self._m.ln_shift_mix(x, ln_w, ln_b, shift, batch.prev_index(), batch.slots, batch.last, mixes, outs,
                             self._stream(x))

    def gemv(self, tasks: list[tuple], then: list[tuple] = ()) -> None:
        """tasks: (linear, x, y, epilogue, residual or None); every x has the same rows. `then`: tasks reading the
        outputs of `tasks`, in the same launch (a second stage: its blocks wait for the blocks of the tasks whose
        outputs they read)."""
        ws, scales, zeros, xs, ys, res, groups, epis = [], [], [], [], [], [], [], []
        read = {x.data_ptr() for _, x, _, _, _ in then}
        # The consumers' blocks go last in the grid. Right after the producers' instead (waiting while r/k/v
        # stream) was slower on an H200: 7.2B fp16 batch 1 259.8 against 264.0 tok/s, W8A16 378.6 against 384.6
        # (bench/results/experiment_consumers_*_h200.json).
        stages = [1 if y.data_ptr() in read else 0 for _, _, y, _, _ in tasks] + [2] * len(then)
        for linear, x, y, epi, residual in [*tasks, *then]:
            w, scale, zero, group, k_major = self.operands(linear)
            if k_major:
                raise ValueError("a K-major linear takes the sparse-input GEMV (sparse_gemv), not the grouped one")
            empty = _empty(x.device)
            ws.append(w)
            scales.append(scale if scale is not None else empty)
            zeros.append(zero if zero is not None else empty)
            xs.append(x)
            ys.append(y)
            res.append(residual if residual is not None else empty)
            groups.append(group)
            epis.append(epi)
        staging = (stages, self._stage_counters(xs[0].device)) if then else ()
        self._m.gemv(ws, scales, zeros, xs, ys, res, groups, epis, self._stream(xs[0]), *staging)

    def _lora_sides(self, device: torch.device) -> tuple[torch.cuda.Stream, ...]:
        """The side streams of the large-batch LoRA chains (batched_projections): none when off or not CUDA."""
        if self.lora_streams == 0 or device.type != "cuda":
            return ()
        if len(self._side_streams.get(device, ())) != self.lora_streams:
            self._side_streams[device] = tuple(torch.cuda.Stream(device) for _ in range(self.lora_streams))
        return self._side_streams[device]

    def _stage_counters(self, device: torch.device) -> torch.Tensor:
        """The staged launches' two counters on ``device``: zero, and every staged launch leaves them zero."""
        if device not in self._stage_sync:
            self._stage_sync[device] = torch.zeros(2, dtype=torch.int32, device=device)
        return self._stage_sync[device]

    def sparse_gemv(self, linear: KMajorLinear | KMajorW8A16Linear, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += x W^T for a K-major linear, reading only the weight rows of x's nonzero columns; more rows than
        the kernel takes go through the linear's own product."""
        int8 = isinstance(linear, KMajorW8A16Linear)
        if x.shape[0] > (self.sparse_int8_rows if int8 else self.sparse_rows):
            add_product(y, linear, x)
            return
        partial, arrivals = linear.workspace
        scale = linear.scale if int8 else _empty(x.device)
        self._m.sparse_gemv(x, linear.weight_t, scale, y, y, partial, arrivals, self._stream(x))

    def sparse_workspace(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A zeroed workspace for the sparse-input GEMV of a ``weight`` [out, in] (fp16, or int8) of this shape
        (reusable by same-shaped ones), on its device."""
        out_features, in_features = weight.shape
        partial, arrivals = self._m.sparse_gemv_workspace(in_features, out_features, weight.dtype == torch.int8)
        return (torch.zeros(partial, dtype=torch.float32, device=weight.device),
                torch.zeros(arrivals, dtype=torch.int32, device=weight.device))

    def uint4_matmul(self, x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor,
                     zero: torch.Tensor) -> torch.Tensor:
        """x W^T for a 4-bit GemLite matrix (the GEMV's operands: words [K/8, N], scale and zero [K/group, N]):
        W^T rebuilt in fp16 a chunk of columns at a time into one scratch buffer per device, each chunk
        multiplied by cuBLAS right after (same stream), so HBM streams the 4-bit words and L2 the fp16 chunk."""
        K, N = words.shape[0] * 8, words.shape[1]
        width = min(N, max(64, UINT4_CHUNK_BYTES // (2 * K) // 64 * 64))
        scratch = self._uint4_scratch.get(x.device)
        if scratch is None or scratch.numel() < K * width:
            scratch = torch.empty(max(K * width, UINT4_CHUNK_BYTES // 2), dtype=torch.float16, device=x.device)
            self._uint4_scratch[x.device] = scratch
        y = x.new_empty(x.shape[0], N)
        stream = self._stream(x)
        for n0 in range(0, N, width):
            chunk = scratch[:K * min(width, N - n0)].view(K, -1)
            self._m.uint4_dequantize(words, scale, zero, n0, chunk, stream)
            y[:, n0:n0 + chunk.shape[1]] = x @ chunk
        return y

    def relu_square_(self, x: torch.Tensor) -> torch.Tensor:
        """x = relu(x)^2 in place, in one pass (torch's relu_ and square_ take one each); returns x."""
        if x.dtype == torch.float16 and x.is_contiguous() and x.data_ptr() % 16 == 0:
            self._m.relu_square_(x, self._stream(x))
            return x
        return torch.relu_(x).square_()

    def time_mix(self, state: torch.Tensor, batch: PackedBatch, blk: "Block", first_layer: bool,
                 tensors: list[torch.Tensor]) -> None:
        empty = _empty(state.device)
        params = [blk.w0, blk.r_k.view(-1), blk.lnx_w, blk.lnx_b, blk.a0,
                  blk.v0 if blk.v0 is not None else empty, blk.k_k, blk.k_a]
        # the longest row: the launcher takes a prefill kernel when it is over 1, by the grid's size
        self._m.time_mix(state, batch.slots, batch.starts, batch.last, tensors, params, first_layer, max(batch.lens),
                         self._stream(state), self.time_mix_blocks)

    # -------------------------------------------------------------- forward
    def forward(self, model: "RWKV7", batch: PackedBatch, state: StatePool, all_logits: bool) -> torch.Tensor:
        device = model.emb.device
        self._forward_stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
        try:
            return self._forward(model, batch, state, all_logits)
        finally:
            self._forward_stream = None

    def _forward(self, model: "RWKV7", batch: PackedBatch, state: StatePool, all_logits: bool) -> torch.Tensor:
        if self.persistent is not None and self.persistent.covers(model, batch, state):
            return self.persistent.logits(model, batch, state)
        T, C = batch.num_tokens, model.config.n_embd
        small = T <= self.rows_for(model) and all(self._gemv_ok(b) for b in model.blocks)
        cfg = model.config
        x = model.emb[batch.tokens]
        new = lambda *shape: x.new_empty(shape)  # noqa: E731
        mixed = new(6, T, C)  # r, k, v adjacent for the batched r/k/v product, v, w, a for the LoRAs'
        xr, xk, xv, xw, xa, xg = mixed.unbind(0)
        v_first, y = new(T, C), new(T, C)
        if small:  # every layer writes the same buffers
            r, k, v, dw, da, dv, g = (new(T, C) for _ in range(7))
            hw, ha, hv, hg = new(T, cfg.rank_w), new(T, cfg.rank_a), new(T, cfg.rank_v), new(T, cfg.rank_g)
            hidden = new(T, cfg.ffn_dim)
        sides = () if small else self._lora_sides(x.device)  # the LoRA chains' streams (batched_projections)
        for i, blk in enumerate(model.blocks):
            first = i == 0
            self.ln_shift_mix(x, blk.ln1_w, blk.ln1_b, state.att_shift[i], batch,
                              [blk.x_r, blk.x_w, blk.x_k, blk.x_v, blk.x_a, blk.x_g], [xr, xw, xk, xv, xa, xg])
            if small:
                # The decay and gate LoRAs' tanh/sigmoid as epilogues of their first halves. Those come first in
                # the grid: last, their few blocks ran after the big matrices' at low occupancy, 38.9 us per 7.2B
                # layer against 34.0 first (bench/results/gemv_h200_split_rows_16k.json).
                tasks = [(blk.w1, xw, hw, EPI_TANH), (blk.a1, xa, ha, EPI_NONE), (blk.g1, xg, hg, EPI_SIGMOID)]
                if not first:
                    tasks.append((blk.v1, xv, hv, EPI_NONE))
                tasks += [(blk.receptance, xr, r, EPI_NONE), (blk.key, xk, k, EPI_NONE), (blk.value, xv, v, EPI_NONE)]
                second = [(blk.w2, hw, dw, EPI_NONE, None), (blk.a2, ha, da, EPI_NONE, None),
                          (blk.g2, hg, g, EPI_NONE, None)]
                if not first:
                    second.append((blk.v2, hv, dv, EPI_NONE, None))
                tasks = [(lin, a, b, epi, None) for lin, a, b, epi in tasks]
                if self._stages_loras(blk) and len(tasks) + len(second) <= self._m.gemv_max_tasks():
                    self.gemv(tasks, then=second)
                else:
                    self.gemv(tasks)
                    self.gemv(second)
            elif isinstance(blk.batched, BatchedWeights):
                r, k, v, dw, da, dv, g = batched_projections(blk, mixed, first, sides)
                dv = _empty(x.device) if dv is None else dv
            else:
                r, k, v = blk.receptance(xr), blk.key(xk), blk.value(xv)
                dw = blk.w2(torch.tanh(blk.w1(xw)))
                da = blk.a2(blk.a1(xa))
                dv = _empty(x.device) if first else blk.v2(blk.v1(xv))
                g = blk.g2(torch.sigmoid(blk.g1(xg)))
            self.time_mix(state.wkv[i], batch, blk, first, [r, k, v, dw, da, dv, g, v_first, y])
            if i == len(model.blocks) - 1 and not all_logits and (tail := batch.readout_tail()) is not None:
                # Only each row's last token is read out: the last block's output projection and FFN run on each
                # row's last two tokens. A 7.2B prompt skips 1/32 of its FFN work, and that layer's shift state is
                # the same.
                batch, positions = tail
                x, y = x[positions], y[positions]
                if small:
                    hidden = hidden[:batch.num_tokens]
                elif batch.num_tokens <= self.rows_for(model) and self._gemv_ok(blk):
                    small, hidden = True, new(batch.num_tokens, cfg.ffn_dim)
            kf = xr[:batch.num_tokens]  # the mix buffers are free again: reuse one for the channel-mix input
            if small:
                self.gemv([(blk.output, y, x, EPI_NONE, x)])
                self.ln_shift_mix(x, blk.ln2_w, blk.ln2_b, state.ffn_shift[i], batch, [blk.ffn_x_k], [kf])
                self.gemv([(blk.ffn_key, kf, hidden, EPI_RELU_SQUARE, None)])
                if isinstance(blk.ffn_value, K_MAJOR_LINEARS):
                    self.sparse_gemv(blk.ffn_value, hidden, x)
                else:
                    self.gemv([(blk.ffn_value, hidden, x, EPI_NONE, x)])
            else:
                add_product(x, blk.output, y)
                self.ln_shift_mix(x, blk.ln2_w, blk.ln2_b, state.ffn_shift[i], batch, [blk.ffn_x_k], [kf])
                add_product(x, blk.ffn_value, self.relu_square_(blk.ffn_key(kf)))
        if not all_logits:
            x = x[batch.last]
        x = F.layer_norm(x, (C,), model.ln_out_w, model.ln_out_b, 1e-5)
        rows = x.shape[0]
        if rows <= self.rows_for(model) and self.operands(model.head) is not None:
            logits = x.new_empty(rows, model.head.out_features)
            self.gemv([(model.head, x.contiguous(), logits, EPI_NONE, None)])
            return logits.float()
        return model.head(x).float()

    def gemv_covers(self, model: "RWKV7") -> int:
        """Steps of up to this many tokens run every matrix of ``model`` on the grouped GEMV (0 when some
        matrix has no GEMV form): the linears' own kernels need no tuning for those batch sizes."""
        if all(self._gemv_ok(b) for b in model.blocks) and self.operands(model.head) is not None:
            return self.rows_for(model)
        return 0

    def rows_for(self, model: "RWKV7") -> int:
        """Steps of up to this many tokens take the grouped GEMV: ``quantized_gemv_rows`` for a model of 4-bit
        or (CUDA) int8 matrices (one checkpoint has one format, so its head tells), else ``gemv_rows``."""
        head = self.operands(model.head)
        quantized = head is not None and (head.weight.dtype == torch.int32 or
                                          (head.weight.dtype == torch.int8 and torch.version.hip is None))
        return self.quantized_gemv_rows if quantized else self.gemv_rows

    def operands(self, linear) -> GemvOperands | None:
        """:func:`gemv_operands`, unless they are 4-bit words and the 4-bit tasks are switched off."""
        ops = gemv_operands(linear)
        return None if ops is not None and ops.weight.dtype == torch.int32 and not self.uint4 else ops

    def _stages_loras(self, blk: "Block") -> bool:
        """Whether ``blk``'s LoRA second halves go into their first halves' launch (see ``staged_loras``)."""
        if self.staged_loras is not None:
            return self.staged_loras
        return self.operands(blk.receptance).weight.dtype != torch.float16

    def _gemv_ok(self, blk: "Block") -> bool:
        linears = [blk.receptance, blk.key, blk.value, blk.output, blk.ffn_key, blk.ffn_value,
                   blk.w1, blk.w2, blk.a1, blk.a2, blk.g1, blk.g2] + [lin for lin in (blk.v1, blk.v2) if lin]
        return all(self.operands(lin) is not None for lin in linears)


# --------------------------------------------------------------------------- loading
_kernels: BuildOnce[FusedKernels] = BuildOnce("fused CUDA kernels")


def _compile():
    return compile_kernels(EXTENSION_NAME, CUDA_SOURCES, HIP_SOURCES, "the fused forward kernels")


def _self_test(kernels: FusedKernels) -> str | None:
    """A tiny random model: the fused forward (GEMV and matmul paths, prefill and decode) against the
    readable one; a reason string if they disagree beyond fp16 rounding."""
    from infer.model import RWKV7
    from infer.random_model import make_config, random_state_dict
    device = torch.device("cuda", torch.cuda.current_device())
    config = make_config(2, 128, 512)
    model = RWKV7.from_state_dict(random_state_dict(config, seed=1, dtype=torch.float16, device=str(device)),
                                  device=str(device), dtype="fp16")
    if kernels.sparse_ffn and (sparse_error := _self_test_sparse(kernels, device, int8=False)):
        log.warning("sparse-input FFN value GEMV switched off (%s): FFN value matrices stay dense", sparse_error)
        kernels.sparse_ffn = False
    if kernels.sparse_ffn_int8 and (sparse_error := _self_test_sparse(kernels, device, int8=True)):
        log.warning("int8 sparse-input FFN value GEMV switched off (%s)", sparse_error)
        kernels.sparse_ffn_int8 = False
    for blk in model.blocks:  # as select_fused does: the prefill below takes the batched matmuls
        blk.batched = batch_weights(blk)
    if kernels.sparse_ffn:
        store_ffn_value_k_major(model, kernels)
    from infer.ops.wkv_cuda import load_cuda_wkv
    model.wkv = load_cuda_wkv() or model.wkv
    rows = [[5, 9, 200, 7, 3, 11, 13, 90, 4, 2], [77, 1], [300]]
    worst = 0.0
    for chunk in (rows, [[1], [2], [3]]):  # a mixed prefill (matmul path), then a decode step (GEMV path)
        slots = [0, 1, 2]
        pools = [model.new_state_pool(3) for _ in range(2)]
        batch = PackedBatch.from_rows(chunk, slots, device)
        expect = model.forward_reference(batch, pools[0])
        got = kernels.forward(model, PackedBatch.from_rows(chunk, slots, device), pools[1], False)
        torch.cuda.synchronize(device)
        scale = float(expect.abs().max()) + 1.0
        worst = max(worst, float((got - expect).abs().max()) / scale,
                    float((pools[0].wkv - pools[1].wkv).abs().max()),
                    float((pools[0].att_shift.float() - pools[1].att_shift.float()).abs().max()))
    if not worst <= 0.05:
        return f"self-test against the readable forward failed (relative max |diff| {worst:.3g})"
    reason = _self_test_int8(kernels, device)
    if reason is None and (uint4_error := _self_test_uint4(kernels, device)):
        log.warning("fused 4-bit GEMV switched off (%s): 4-bit layers use GemLite's kernels", uint4_error)
        kernels.uint4 = False
    return reason


def _self_test_sparse(kernels: FusedKernels, device: torch.device, int8: bool) -> str | None:
    """The sparse-input GEMV (fp16 or int8 weights) against a matmul, at 1 and 2 rows of an input with half its
    columns zero."""
    gen = torch.Generator(device=device).manual_seed(4)
    weight = (torch.randn(264, 1000, generator=gen, device=device) * 0.03).half()
    if int8:
        from infer.ops.linear_w8a16 import dequantize_matmul
        from infer.quant.quantize import quantize_int8
        q, scale = quantize_int8(weight)
        linear = KMajorW8A16Linear(W8A16Linear(q, scale), kernels.sparse_workspace(q))
    else:
        linear = KMajorLinear(weight, kernels.sparse_workspace(weight))
    for rows in (1, 2):
        x = torch.randn(rows, 1000, generator=gen, device=device).relu().square().half()
        y = torch.randn(rows, 264, generator=gen, device=device).half()
        expect = y.float() + (dequantize_matmul(x, q, scale).float() if int8 else x.float() @ weight.float().T)
        kernels.sparse_gemv(linear, x, y)
        err = float((y.float() - expect).abs().max()) / (float(expect.abs().max()) + 1e-6)
        if not err <= 1e-2:
            return (f"self-test of the {'int8 ' if int8 else ''}sparse-input GEMV against a matmul failed ({rows} "
                    f"rows: relative max |diff| {err:.3g})")
    return None


def _self_test_int8(kernels: FusedKernels, device: torch.device) -> str | None:
    """The GEMV's int8 (W8A16) tasks against dequantize + matmul."""
    from infer.ops.linear_w8a16 import dequantize_matmul
    gen = torch.Generator(device=device).manual_seed(2)
    q = torch.randint(-127, 128, (40, 96), generator=gen, device=device, dtype=torch.int8)
    scale = (torch.rand(40, generator=gen, device=device) * 0.01 + 0.001).half()
    x = torch.randn(2, 96, generator=gen, device=device).half()
    y = torch.empty(2, 40, device=device, dtype=torch.float16)
    kernels.gemv([(W8A16Linear(q, scale), x, y, EPI_NONE, None)])
    expect = dequantize_matmul(x, q, scale)
    err = float((y.float() - expect.float()).abs().max()) / (float(expect.abs().max()) + 1e-6)
    if not err <= 1e-2:
        return f"self-test of the int8 GEMV against dequantize + matmul failed (relative max |diff| {err:.3g})"
    return None


def _self_test_uint4(kernels: FusedKernels, device: torch.device) -> str | None:
    """The GEMV's 4-bit tasks (GemLite's A16W4 words, scales and zeros) against unpacking + matmul: a short
    row in a whole band, and rows of 2048 (the length from which a lone task's band is halved) at 1 and 2
    rows of x (the launch bounds differ)."""
    gen = torch.Generator(device=device).manual_seed(3)
    for n, k, group, rows in ((48, 128, 32, 2), (64, 2048, 64, 1), (64, 2048, 64, 2)):
        words = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // 8, n), generator=gen, device=device, dtype=torch.int32)
        scale = (torch.rand(k // group, n, generator=gen, device=device) * 0.01 + 0.001).half()
        zero = (torch.rand(k // group, n, generator=gen, device=device) * -15 * scale.float()).half()
        x = torch.randn(rows, k, generator=gen, device=device).half()
        y = torch.empty(rows, n, device=device, dtype=torch.float16)
        layer = SimpleNamespace(uint4_groups=(words, scale, zero, group), in_features=k, out_features=n)  # as GemLiteLinear
        kernels.gemv([(layer, x, y, EPI_NONE, None)])
        expect = x.float() @ uint4_weights(words.t(), scale, zero).float().T
        err = float((y.float() - expect).abs().max()) / (float(expect.abs().max()) + 1e-6)
        if not err <= 1e-2:
            return (f"self-test of the 4-bit GEMV against unpacking + matmul failed ({rows} x {k} -> {n}: "
                    f"relative max |diff| {err:.3g})")
        product = kernels.uint4_matmul(x, words, scale, zero)
        err = float((product.float() - expect).abs().max()) / (float(expect.abs().max()) + 1e-6)
        if not err <= 1e-2:
            return (f"self-test of the 4-bit dequantization + matmul failed ({rows} x {k} -> {n}: relative max "
                    f"|diff| {err:.3g})")
    return None


def load_fused_kernels(verify: bool = True) -> FusedKernels | None:
    """The compiled kernels, building them on the first call; None (with a logged warning) if they
    cannot be had: no CUDA device, no nvcc/ninja, a failed build, or a failed self-test."""
    return _kernels.load(lambda: FusedKernels(_compile()), _self_test if verify else None)


def fused_kernels_error() -> str | None:
    """Why :func:`load_fused_kernels` returned None (None if it was not tried or succeeded)."""
    return _kernels.error


def fused_unsupported(model: "RWKV7") -> str | None:
    """Why ``model`` cannot use the fused forward (None if it can)."""
    if model.device.type != "cuda":
        return f"the model runs on {model.device}"
    if model.dtype != torch.float16:
        return f"activations are {model.dtype}, the fused kernels take float16"
    if model.config.head_size != 64:
        return f"head size {model.config.head_size} (the kernels take 64)"
    if model.config.n_embd % 8 or model.config.n_embd > 8192:
        return f"width {model.config.n_embd} (the kernels take multiples of 8 up to 8192)"
    return None


def store_ffn_value_k_major(model: "RWKV7", kernels: FusedKernels) -> int:
    """Swap each block's dense fp16 FFN value linear for a :class:`KMajorLinear` of the same weights (one
    matrix transposed at a time: the peak is one extra matrix), and with ``kernels.sparse_ffn_int8`` each W8A16 one
    for a :class:`KMajorW8A16Linear` (a K-major copy more); returns how many were swapped."""
    workspaces: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
    swapped = 0
    for blk in model.blocks:
        lin = blk.ffn_value
        if lin.out_features % 8:
            continue
        if type(lin) is DenseLinear and lin.weight.dtype == torch.float16 and kernels.sparse_ffn:
            weight, make, source = lin.weight, KMajorLinear, lin.weight
        elif type(lin) is W8A16Linear and lin.scale.dtype == torch.float16 and kernels.sparse_ffn_int8:
            weight, make, source = lin.qweight, KMajorW8A16Linear, lin
        else:
            continue
        if weight.dtype not in workspaces:
            workspaces[weight.dtype] = kernels.sparse_workspace(weight)
        blk.ffn_value = make(source, workspaces[weight.dtype])
        swapped += 1
    if swapped:
        log.info("FFN value matrices stored K-major: %d (the sparse-input GEMV at up to %d rows, int8 %d)", swapped,
                 kernels.sparse_rows, kernels.sparse_int8_rows)
    return swapped


def select_fused(model: "RWKV7", prefer: str = "auto") -> FusedKernels | None:
    """Turn the fused forward on for ``model`` when possible: ``auto`` uses it when the model qualifies
    and the kernels load, ``on`` insists (RuntimeError otherwise), ``off`` keeps the readable forward."""
    if prefer not in PREFERENCES:
        raise ValueError(f"unknown fused-kernel setting {prefer!r}; choose one of {', '.join(PREFERENCES)}")
    chosen: FusedKernels | None = None
    if prefer != "off":
        probe = fused_unsupported(model)
        if probe is None:
            chosen = load_fused_kernels()
            probe = None if chosen else fused_kernels_error()
        if chosen is None and prefer == "on":
            raise RuntimeError(f"the fused CUDA kernels were asked for but cannot be used: {probe}")
        if chosen is None and probe:
            log.info("fused kernels not used: %s", probe)
    model.fused = chosen
    if chosen is not None:
        chosen.persistent = load_persistent_step()
        for blk in model.blocks:
            if blk.batched is None:
                blk.batched = batch_weights(blk)
        if chosen.sparse_ffn or chosen.sparse_ffn_int8:
            store_ffn_value_k_major(model, chosen)
        if chosen.uint4:
            for lin in model.projections():
                if getattr(lin, "uint4_groups", None) is not None:
                    lin.large_batch = (chosen.uint4_cublas_rows, chosen.uint4_matmul)
    log.info("forward on %s: %s%s", model.device, chosen.name if chosen else "readable (per-op) forward",
             f"; one-token steps: {chosen.persistent.name}" if chosen and chosen.persistent else "")
    return chosen
