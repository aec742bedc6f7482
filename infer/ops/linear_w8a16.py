"""W8A16 linear layers: int8 weights with one scale per output channel, 16-bit (or fp32) activations.

Checkpoint layout (``python -m infer.quant.export_quant``): each quantized matrix is stored as an int8
``[out, in]`` tensor ``q`` and ``name + ".scale"`` ``[out]``; output channel n's weights are
``q[n] * scale[n]``. Every path below computes ``x @ (q * scale[:, None]).T``:

* CUDA, fp16 activations, at most ``gemv_rows`` rows (8, or 4 where the Hopper GEMM is built;
  ``RWKV_W8A16_GEMV_ROWS`` overrides): the GEMV of ``cuda/w8a16_gemm.cu``, which reads each weight byte
  once (decode at small batch is bound by exactly that read).
* CUDA, fp16, more rows: a CUTLASS mixed-input tensor-core GEMM, compiled only when the CUTLASS headers
  of the ``nvidia-cutlass`` wheel are installed (found through importlib, never downloaded at run time);
  without them those batches take the next path, with a logged warning. On a compute-capability 9.0 GPU
  the extension is built for sm_90a with the Hopper TMA + WGMMA kernel of ``cuda/w8a16_gemm_sm90.cu``
  (the SM80 kernel of ``cuda/w8a16_gemm.cu`` stays as its fallback); elsewhere the SM80 kernel runs.
* Everything else (CPU; other activation dtypes; shapes the kernels cannot take): convert a slice of
  output channels at a time to the activation dtype and matmul. On CPU (torch 2.13, fp32, one thread)
  this beat ``torch._weight_int8pack_mm`` at every batch size measured: 2.5 ms against 14 ms for one
  row of a 4096x4096 matrix, 16 ms against 440 ms for 32 rows (``_weight_int8pack_mm`` costs grow with
  each row). A whole decode step of a 12-layer C768 model (65536 vocabulary) was 10-30 % faster than
  fp32 at batch 1 and on par at batch 8 and 32 (noisy shared 2-core machine). It keeps the CPU
  batch-invariance rule of :class:`infer.ops.linear.DenseLinear`: a row's result does not depend on the
  other rows of the call.

On Hopper builds the same extension also holds the WGMMA GEMM for 4-bit GemLite weights (``gemm_w4_sm90``: words
[N, K/8] K-major, fp16 scale and zero per group; :func:`uint4_weights` is its reference), which
``infer.quant.gemlite_linear`` uses for larger batches. Both Hopper GEMMs may split K in slices summed from fp32
partial products (:func:`gemm_splits`: matrices of few output tiles, batches of up to ``SPLIT_MAX_ROWS`` rows;
``RWKV_W8_SPLIT_K=0`` / ``RWKV_W4_SPLIT_K=0`` never split).

The extension is built on first use like the WKV kernel (``infer.ops.cuda_ext``) and checked against
the dequantizing reference once; :func:`load_w8a16_kernels` never raises, it logs why and returns None.
"""
from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import torch

from infer.ops.cuda_ext import BuildOnce, compile_extension, env_flag, env_int
from infer.ops.linear import cpu_row_blocks

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent.parent
CUDA_SOURCES = [ROOT / "cuda" / "w8a16_gemm_op.cpp", ROOT / "cuda" / "w8a16_gemm.cu"]
# The Hopper GEMMs: their tile choice and one file per tile and kernel (int8, 4-bit, 4-bit split K), so ninja
# compiles the tiles in parallel.
SM90_TILES = ("64x256", "128x128", "64x128", "64x64")
SM90_SOURCES = [ROOT / "cuda" / "w8a16_gemm_sm90.cu"] + [ROOT / "cuda" / f"{kernel}_{tile}.cu" for kernel in (
    "w8a16_gemm_sm90", "w4a16_gemm_sm90", "w8a16_gemm_sm90_split", "w4a16_gemm_sm90_split") for tile in SM90_TILES]
# CUTLASS 3's Hopper kernels need the architecture-specific target (wgmma, setmaxnreg); an explicit
# -gencode also stops torch from adding its own arch flags. NDEBUG: CUTLASS's device-side asserts are
# calls that make ptxas serialize the WGMMA pipeline (warning C7510).
SM90_FLAGS = ["-DW8A16_WITH_CUTLASS_SM90", "-DNDEBUG", "-gencode=arch=compute_90a,code=sm_90a"]
HIP_SOURCES = [ROOT / "cuda" / "w8a16_gemm_op.cpp", ROOT / "hip" / "w8a16_gemm.hip"]
EXTENSION_NAME = "rwkv7_w8a16"
# Weight elements dequantized per matmul on the fallback path. On CPU a 4 MB fp32 slice stays in cache:
# dequantizing a whole 4096x4096 matrix per call was 12x slower, spending its time faulting in fresh
# pages. On a GPU one large slice keeps each matmul big while bounding the temporary (128 MB in fp16).
CPU_CHUNK_ELEMENTS = 1 << 20
GPU_CHUNK_ELEMENTS = 1 << 26
# Batches of more rows than this take the Hopper GEMM instead of the GEMV: on the H200 the GEMV was faster
# for every 7.2B matrix at 1-4 rows (FFN value at 4 rows: 41.0 us against 64.5), the GEMM at 8 (59.4
# against 102.2) (bench/results/w8_gemm_small_h200.json).
SM90_GEMV_ROWS = 4
# The kernels load 16 bytes at a time (K) and the CUTLASS epilogue stores 8 fp16 at a time (N).
K_MULTIPLE, N_MULTIPLE = 16, 8
# Split K for the Hopper GEMMs, int8 and 4-bit (gemm_splits): a slice keeps at least SPLIT_MIN_K of K (4-bit
# layers: gemlite_linear.W4_SPLIT_MIN_K, shorter), and batches of more rows than SPLIT_MAX_ROWS are not split.
# Measured on the H200 for 4-bit weights, the GEMMs replayed from CUDA graphs
# (bench/results/w4_gemm_split_graph_*_h200.json): 7.2B FFN value (K = 16,384) at 16-256 rows 70-83 -> 40-65 us,
# 7.2B r/k/v/output 20-24 -> 14-22 us, 1.5B FFN value 38-39 -> 16-23 us in four slices; at 512 rows every split
# was slower (7.2B FFN value 109 -> 122 us). W4 decode, 7.2B batch 128: 14,276 tok/s with slices of >= 2,048
# against 13,482 with >= 4,096 (which leaves r/k/v/output whole; 11,674 unsplit on the machine of another call).
SPLIT_MIN_K = 2048
SPLIT_MAX_ROWS = 256
SPLIT_STEP = 64  # int8 slices: whole K steps of the Hopper GEMM


def dequantize_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ (qweight * scale[:, None]).T`` in x's dtype, converting one slice of output channels at a
    time; on CPU each row's result is independent of the batch (fixed-size row blocks)."""
    rows = x.shape[0]
    on_cpu = x.device.type == "cpu"
    blocks = cpu_row_blocks(x) if on_cpu else [x]
    n_out, n_in = qweight.shape
    out = x.new_empty((sum(b.shape[0] for b in blocks), n_out))
    step = max(1, (CPU_CHUNK_ELEMENTS if on_cpu else GPU_CHUNK_ELEMENTS) // n_in)
    # Scaling the outputs instead of the weights saves a pass over every weight (decode 1.5x faster on
    # CPU), but the unscaled sums reach 127 * sum|x|, which can overflow fp16 (max 65504): fp16 scales
    # the weights first. fp32 and bf16 have the range.
    scale_weights = x.dtype == torch.float16
    for begin in range(0, n_out, step):
        weight = qweight[begin:begin + step].to(x.dtype)
        if scale_weights:
            weight.mul_(scale[begin:begin + step, None])
        first = 0
        for block in blocks:
            torch.matmul(block, weight.T, out=out[first:first + block.shape[0], begin:begin + step])
            first += block.shape[0]
    return out[:rows] if scale_weights else out[:rows].mul_(scale)


def aligned(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels read it: contiguous, 16-byte aligned (a row slice of a larger buffer is copied)."""
    x = x.contiguous()
    return x.clone() if x.data_ptr() % 16 else x


def random_uint4(gen: torch.Generator, n_out: int, n_in: int,
                 group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random 4-bit matrix as the Hopper GEMM takes it, on ``gen``'s device: words [N, K/8] (any codes), scale
    [K/group, N] in [0.001, 0.011) and zero in (-15 scale, 0] (for checks and benchmarks)."""
    device = gen.device
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (n_out, n_in // 8), generator=gen, device=device, dtype=torch.int32)
    scale = (torch.rand(n_in // group, n_out, generator=gen, device=device) * 0.01 + 1e-3).half()
    zero = (torch.rand(n_in // group, n_out, generator=gen, device=device) * -15 * scale.float()).half()
    return words, scale, zero


def gemm_splits(n_out: int, n_in: int, group: int, sms: int, min_k: int = SPLIT_MIN_K) -> int:
    """Into how many slices of K a Hopper GEMM cuts an [n_out, n_in] matrix (``group``: the 4-bit group, or the
    K step, 64, for int8): doubling while its 64-channel
    output tiles (times the slices) give fewer than 90 % of the ``sms`` multiprocessors one each, and each slice
    stays a whole number of groups and of the K step, at least ``min_k`` long. A function of the matrix alone, so
    a row's sums do not depend on how many rows share the call."""
    splits = 1
    while (10 * (n_out // 64) * splits < 9 * sms and n_in % (2 * splits * group) == 0
           and (n_in // (2 * splits)) % 64 == 0 and n_in // (2 * splits) >= min_k):
        splits *= 2
    return splits


def uint4_weights(words: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The fp16 weights [N, K] of a 4-bit GemLite matrix held K-major: ``words`` [N, K/8] int32 (k in bits
    4 (k % 8) .. 4 (k % 8) + 3 of word k / 8), ``scale`` and ``zero`` [K/group, N]: fp16(q * scale + zero), one
    rounding as the kernels' fused multiply-add. (GemLite stores the words [K/8, N]: pass ``words.t()``.)"""
    n, k = words.shape[0], words.shape[1] * 8
    group = k // scale.shape[0]
    shifts = 4 * torch.arange(8, device=words.device, dtype=torch.int32)
    q = ((words[:, :, None] >> shifts) & 15).reshape(n, k).float()
    return (q * scale.float().t().repeat_interleave(group, 1) + zero.float().t().repeat_interleave(group, 1)).half()


class W8A16Linear:
    """A W8A16 matrix; the path is chosen per call from the device, dtype and row count."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor):
        if qweight.dtype != torch.int8 or qweight.ndim != 2:
            raise ValueError(f"W8A16 weights must be a 2-D int8 tensor, got {qweight.dtype} {list(qweight.shape)}")
        if tuple(scale.shape) != (qweight.shape[0],) or not scale.is_floating_point():
            raise ValueError(f"W8A16 scale must be a float [{qweight.shape[0]}] tensor, got "
                             f"{scale.dtype} {list(scale.shape)}")
        self.qweight = qweight.contiguous()
        self.scale = scale.contiguous()
        self.out_features, self.in_features = qweight.shape
        self._kernels: W8A16Kernels | None = None
        if qweight.is_cuda and scale.dtype == torch.float16 and self.in_features % K_MULTIPLE == 0 \
                and self.out_features % N_MULTIPLE == 0:
            self._kernels = load_w8a16_kernels()
        # Hopper GEMM batches of up to SPLIT_MAX_ROWS rows split K when the matrix has few output tiles
        self._splits = 1
        if self._kernels is not None and self._kernels.hopper_gemm and env_flag("RWKV_W8_SPLIT_K", True):
            sms = torch.cuda.get_device_properties(qweight.device).multi_processor_count
            self._splits = gemm_splits(self.out_features, self.in_features, SPLIT_STEP, sms,
                                       env_int("RWKV_W8_SPLIT_MIN_K", SPLIT_MIN_K))
        if self._kernels is None:
            self.kind = "w8a16 int8 (dequantize + matmul)"
        elif self._kernels.gemm_available:
            self.kind = f"w8a16 int8 (cuda gemv <= {self._kernels.gemv_rows} rows, {self._kernels.gemm_name} gemm)"
        else:
            self.kind = (f"w8a16 int8 (cuda gemv <= {self._kernels.gemv_max_rows} rows, dequantize + matmul above: "
                         "no CUTLASS headers)")

    @property
    def hopper_gemm(self) -> bool:
        """Whether batches above the GEMV's rows run on the Hopper GEMM."""
        return self._kernels is not None and self._kernels.hopper_gemm

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        kernels, rows = self._kernels, x.shape[0]
        if kernels is None or x.dtype != torch.float16 or (rows > kernels.gemv_max_rows
                                                          and not kernels.gemm_available):
            return dequantize_matmul(x, self.qweight, self.scale)
        x = aligned(x)
        y = torch.empty((rows, self.out_features), dtype=torch.float16, device=x.device)
        stream = torch.cuda.current_stream(x.device).cuda_stream
        if rows <= kernels.gemv_rows or not kernels.gemm_available:
            kernels.gemv(x, self.qweight, self.scale, y, stream)
        elif kernels.hopper_gemm and self._splits > 1 and rows <= SPLIT_MAX_ROWS:
            partials = torch.empty((self._splits, rows, self.out_features), dtype=torch.float32, device=x.device)
            kernels.gemm(x, self.qweight, self.scale, y, stream, -1, partials)
        else:
            kernels.gemm(x, self.qweight, self.scale, y, stream)
        return y


# --------------------------------------------------------------------------- the CUDA extension
class W8A16Kernels:
    """The compiled ops (see ``cuda/w8a16_gemm_op.cpp``)."""

    def __init__(self, module) -> None:
        self.gemv = module.gemv
        self.gemv_max_rows: int = module.gemv_max_rows()
        self.gemm_available: bool = module.gemm_available()
        self.gemm_sm80 = module.gemm
        self.gemm_sm90 = module.gemm_sm90  # (x, w, scale, y, stream, tile=-1, partials=None)
        self.sm90_tiles: list[tuple[int, int]] = module.gemm_sm90_tiles()  # (channels, rows); [] unless sm_90a
        # 4-bit weights on the Hopper GEMM, (x, words, scale, zero, group, y, stream, tile=-1); None unless built
        # (or after a failed self-test)
        self.gemm_w4 = module.gemm_w4_sm90 if self.sm90_tiles else None
        # The GEMM larger batches use: the Hopper kernel when this build has it (set back to the SM80
        # one if it fails its self-test).
        self.gemm = self.gemm_sm90 if self.sm90_tiles else self.gemm_sm80
        # Rows up to this many take the GEMV, more the GEMM (when built): the GEMV's cost grows with each
        # row, the Hopper GEMM's barely changes below its tile.
        default = SM90_GEMV_ROWS if self.sm90_tiles else self.gemv_max_rows
        self.gemv_rows: int = min(env_int("RWKV_W8A16_GEMV_ROWS", default), self.gemv_max_rows)

    @property
    def hopper_gemm(self) -> bool:
        """Whether larger batches run on the Hopper GEMM (built, and passed its self-test)."""
        return self.gemm is self.gemm_sm90

    @property
    def gemm_name(self) -> str:
        return "cutlass sm90 wgmma" if self.hopper_gemm else "cutlass sm80"


_kernels: BuildOnce[W8A16Kernels] = BuildOnce("W8A16 CUDA kernels")


def cutlass_include_dir() -> Path | None:
    """The CUTLASS C++ headers shipped in the ``nvidia-cutlass`` wheel (``cutlass_library/source/include``),
    found without importing the package (its Python side needs cuda-python and more)."""
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    include = Path(list(spec.submodule_search_locations)[0]) / "source" / "include"
    return include if (include / "cutlass" / "cutlass.h").is_file() else None


def hopper_gemm_buildable(device: torch.device | int) -> bool:
    """Whether the extension built for ``device`` has the Hopper GEMM: compute capability 9.0 and the
    CUTLASS headers (:func:`_compile` then builds for sm_90a)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device) == (9, 0) \
        and cutlass_include_dir() is not None


def _compile():
    hip = torch.version.hip is not None
    include = None if hip else cutlass_include_dir()
    flags = ["-O3"] if hip else ["-O3", "--use_fast_math", "-lineinfo"]
    sources = HIP_SOURCES if hip else CUDA_SOURCES
    hopper = hopper_gemm_buildable(torch.cuda.current_device())
    if include is not None:
        flags += ["-DW8A16_WITH_CUTLASS", "-isystem", str(include)]
    elif not hip:
        log.warning("CUTLASS headers not found (pip install --no-deps nvidia-cutlass): W8A16 batches larger than "
                    "the GEMV's will dequantize and use cuBLAS")
    if hopper:
        flags += SM90_FLAGS
        sources = sources + SM90_SOURCES
    # Builds with and without CUTLASS (and for sm_90a) differ, so they are cached under different names.
    name = EXTENSION_NAME + ("_hip" if hip else "_cutlass_sm90a" if hopper else "_cutlass" if include else "")
    what = "the W8A16 kernels (" + ("HIP GEMV" if hip else "CUDA GEMV + CUTLASS GEMMs (SM80, Hopper)" if hopper
                                    else "CUDA GEMV + CUTLASS GEMM" if include else "CUDA GEMV") + ")"
    return compile_extension(name, sources, flags, what)


def _check(op, rows: int, splits: int = 1) -> str | None:
    """Run ``op`` on a random problem with ``rows`` rows against :func:`dequantize_matmul`; a reason if they disagree.
    With ``splits`` (the Hopper GEMM), K = 768 in that many slices, the rows 128 at a time."""
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(rows)
    n_out, n_in = 264, 720 if splits == 1 else 768  # 720: not a multiple of the GEMV's 512-weight step or a tile
    qweight = torch.randint(-127, 128, (n_out, n_in), generator=gen, device=device, dtype=torch.int8)
    scale = (torch.rand(n_out, generator=gen, device=device) * 0.01 + 1e-3).half()
    x = torch.randn(rows, n_in, generator=gen, device=device).half()
    expect = dequantize_matmul(x.float(), qweight, scale.float())
    y = torch.empty((rows, n_out), dtype=torch.float16, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream
    if splits == 1:
        op(x, qweight, scale, y, stream)
    else:
        op(x, qweight, scale, y, stream, -1, torch.empty((splits, min(rows, 128), n_out), device=device))
    torch.cuda.synchronize(device)
    return _disagreement(y, expect, rows)


def _disagreement(y: torch.Tensor, expect: torch.Tensor, rows: int) -> str | None:
    """Why a kernel's fp16 ``y`` is not ``expect`` (None if it is): one fp16 rounding (relative 2^-11) on top of
    fp32 sums that differ only in order."""
    err = ((y.float() - expect).abs().max() / expect.abs().max()).item()
    return None if err <= 2e-3 else f"{rows} rows: max relative difference {err:.3g} from the reference"


def _check_w4(op, rows: int, splits: int = 1) -> str | None:
    """:func:`_check` for the 4-bit Hopper GEMM against :func:`uint4_weights` + matmul (264 channels: not a
    multiple of the tiles; K = 704: 11 groups of 64, the kernel's K step). With ``splits``, K = 768 in that many
    slices, the rows 128 at a time."""
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(rows)
    n_out, n_in, group = 264, 704 if splits == 1 else 768, 64
    words, scale, zero = random_uint4(gen, n_out, n_in, group)
    x = torch.randn(rows, n_in, generator=gen, device=device).half()
    expect = x.float() @ uint4_weights(words, scale, zero).float().T
    y = torch.empty((rows, n_out), dtype=torch.float16, device=device)
    partials = torch.empty((splits, min(rows, 128), n_out), device=device) if splits > 1 else None
    op(x, words, scale, zero, group, y, torch.cuda.current_stream(device).cuda_stream, -1, partials)
    torch.cuda.synchronize(device)
    return _disagreement(y, expect, rows)


def load_w8a16_kernels(verify: bool = True) -> W8A16Kernels | None:
    """The compiled kernels, building them on the first call; None (with a logged warning) if they cannot
    be had. A CUTLASS GEMM that fails its check is switched off alone (the GEMV stays)."""
    def build() -> tuple[W8A16Kernels | None, str | None]:
        kernels = W8A16Kernels(_compile())
        if verify and (reason := _check(kernels.gemv, 1) or _check(kernels.gemv, kernels.gemv_max_rows)):
            return None, f"GEMV self-test failed ({reason}); dequantizing instead"
        if verify and kernels.hopper_gemm and (gemm_error := _check(kernels.gemm, 40) or _check(kernels.gemm, 300)
                                               or _check(kernels.gemm, 300, splits=2)):
            log.warning("W8A16 Hopper GEMM switched off: self-test failed (%s); using the SM80 GEMM", gemm_error)
            kernels.gemm = kernels.gemm_sm80
        if verify and kernels.gemm_w4 is not None and (w4_error := _check_w4(kernels.gemm_w4, 40)
                                                       or _check_w4(kernels.gemm_w4, 300)
                                                       or _check_w4(kernels.gemm_w4, 300, splits=2)):
            log.warning("4-bit Hopper GEMM switched off: self-test failed (%s)", w4_error)
            kernels.gemm_w4 = None
        # (a Hopper GEMM that passed its own check above needs no second one)
        if verify and kernels.gemm_available and not kernels.hopper_gemm and (gemm_error := _check(kernels.gemm, 40)):
            log.warning("W8A16 CUTLASS GEMM switched off: self-test failed (%s); larger batches will dequantize",
                        gemm_error)
            kernels.gemm_available = False
        return kernels, None
    return _kernels.get(build)


def w8a16_kernels_error() -> str | None:
    """Why :func:`load_w8a16_kernels` returned None (None if it was not tried or succeeded)."""
    return _kernels.error
