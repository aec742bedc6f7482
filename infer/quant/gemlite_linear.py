"""GemLite 0.6.x weight-only linear layers rebuilt from the packed tensors of a GemLite checkpoint (CUDA only).

gemlite imports Triton and queries the GPU when it is imported, so this module imports it only inside
:func:`require_gemlite`; nothing on the CPU server's or the tests' paths imports this module at all
(``infer.quant.engines`` does, lazily, for ``--inference-engine gemlite``).

A layer is rebuilt with ``GemLiteLinearTriton.load_state_dict`` from the entries
``export_quant_gemlite`` stored, so loading never quantizes or repacks. The forward pass calls GemLite's
Triton kernel for the batch size directly instead of ``forward_functional``, which in gemlite 0.6.0
reads the data-contiguity flag from the wrong metadata slot (the bit width); the arguments are built
once per layer. GemLite autotunes each kernel per (matrix, batch bucket) on first use: :meth:`warmup`
does that before serving (``infer.quant.engines.warm_up``), and :func:`load_tuning` / :func:`save_tuning`
keep the chosen configurations in a file per GPU model, so only the first start on a GPU tunes.

A16W8_INT8 is the W8A16 layout (int8 [out, in] rows, a scale per output channel after the sum), so its
tensors are also read in place by the fused decode GEMV and, where the Hopper GEMM is built, by the
W8A16 kernels for batches of more than 32 rows (``infer.ops.linear_w8a16``; faster there than GemLite's
kernels, and nothing to tune for those sizes).
"""
from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch

from infer.ops.cuda_ext import env_flag, env_int
from infer.ops.linear_w8a16 import (SPLIT_MAX_ROWS, W8A16Linear, aligned, hopper_gemm_buildable,
                                    load_w8a16_kernels, gemm_splits)

log = logging.getLogger(__name__)

SUPPORTED_VERSION = "0.6."
W8A16_ABOVE_ROWS = 32  # A16W8_INT8 batches above this run on the W8A16 Hopper GEMM (see GemLiteLinear)
W4_HOPPER_ABOVE_ROWS = 8  # A16W4 batches above this run on the 4-bit Hopper GEMM (see GemLiteLinear)
HOPPER_K_STEP = 64  # the Hopper GEMM's K step: 4-bit groups must be a multiple of it
# The shortest K slice of a split 4-bit Hopper GEMM (the int8 one keeps linear_w8a16.SPLIT_MIN_K). Only 1.5B's
# r/k/v/output (2,048 x 2,048: 32 tiles) split at 1,024 and not at 2,048; 1.5B W4 decode with slices of >= 1,024
# against >= 2,048 in one call: 5,795 / 20,184 / 34,218 / 50,318 against 5,403 / 19,165 / 32,868 / 49,746 tok/s at
# batch 16 / 64 / 128 / 256, equal at 512 (bench/results/experiment_w4_split_min{1024,2048}_1.5b_h200.json).
W4_SPLIT_MIN_K = 1024


def require_gemlite(device: torch.device | str, act: torch.dtype = torch.float16,
                    purpose: str = "--inference-engine gemlite"):
    """The gemlite module, or a RuntimeError that says what is missing for ``purpose``."""
    device = torch.device(device)
    if not torch.cuda.is_available() or device.type != "cuda":
        where = "torch sees no CUDA device" if not torch.cuda.is_available() else f"the device is {device}"
        raise RuntimeError(f"{purpose} needs a CUDA GPU and gemlite {SUPPORTED_VERSION}x ({where}); the W8A16 format "
                           "(python -m infer.quant.export_quant, --inference-engine cutlass) also runs on CPU")
    if act != torch.float16:
        raise RuntimeError(f"GemLite checkpoints are packed for fp16 activations; run with --dtype fp16, not "
                           f"{str(act).removeprefix('torch.')}")
    try:
        import gemlite
    except Exception as exc:  # noqa: BLE001 - ImportError, or Triton failing to initialise
        raise RuntimeError(f"{purpose} needs gemlite {SUPPORTED_VERSION}x (pip install 'gemlite>=0.6,<0.7'): "
                           f"importing it failed: {type(exc).__name__}: {exc}") from None
    if not gemlite.__version__.startswith(SUPPORTED_VERSION):
        raise RuntimeError(f"{purpose} needs gemlite {SUPPORTED_VERSION}x, found {gemlite.__version__} "
                           "(pip install 'gemlite>=0.6,<0.7')")
    return gemlite


def read_pre_scaled(layer) -> bool:
    """Switch a post-scaled 8-bit GemLite layer (as export_quant_gemlite packs A16W8) to pre-scaled reading;
    returns whether it was post-scaled (other layers are left alone).

    GemLite's kernels round a post-scaled layer's sum over the codes, sum_k x_k q_kn, to the scales' fp16 before
    applying the scale (gemm_kernels.py: acc.to(meta_dtype) * scales_b): past 65,504 that is inf, then NaN. H200,
    a random 1024 x 1024 matrix, activations of |x| ~ 100: 3 % of the outputs non-finite in int8 and over half in
    fp8, whose codes reach 448 (bench/results/experiment_gemlite_fp8_range_first_h200.json); the trained tiny
    model's logits went NaN on A16W8_FP8. Read as a pre-scaled layer (GemLite's default for A16W8: the same
    packed codes and per-channel scales, one group of in_features columns) every code gets its scale before the
    fp32 sum."""
    post_scaled = layer.W_nbits == 8 and layer.channel_scale_mode == 1 and layer.W_group_mode == 0
    if post_scaled:
        layer.W_group_mode, layer.channel_scale_mode = 2, 0
    return post_scaled


class GemLiteLinear:
    """One packed GemLite layer; ``packed`` holds the entries of its ``state_dict()`` (already on the GPU)."""

    def __init__(self, packed: dict[str, torch.Tensor]):
        import gemlite
        from gemlite.core import GEMLITE_TRITON_MAPPING, get_matmul_type

        layer = gemlite.GemLiteLinearTriton()
        layer.load_state_dict(dict(packed))  # GemLite's own loader: sets every attribute from the entries
        if layer.scaled_activations:
            raise RuntimeError("activation-quantized GemLite layers are not supported (weight-only formats only)")
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.dtype = layer.compute_dtype
        self.kind = f"gemlite A16W{layer.W_nbits}" + (f" group {layer.group_size}" if layer.W_nbits < 8 else "")
        self._kernels = GEMLITE_TRITON_MAPPING
        self._matmul_type = get_matmul_type
        w_q, scales, zeros, _ = layer.get_tensor_args()
        # (the fused GEMV and the W8A16 GEMM below scale after an fp32 sum and keep reading the post-scaled layout)
        post_scaled_8bit = read_pre_scaled(layer)
        meta = layer.get_meta_args()
        # Kernel arguments after x: W_q, scales, zeros, activation scales (none: weight-only), then
        # W_nbits .. W_group_mode and data_contiguous (meta[1:], the last slot read correctly), and the
        # autotune type id, which GemLite shares between fp16 and bf16.
        input_dtype = layer.input_dtype.value
        if input_dtype == gemlite.DType.BF16.value:
            input_dtype = gemlite.DType.FP16.value
        self._args = (w_q, scales, zeros, None, *meta[1:], input_dtype * 100 + layer.W_nbits)
        self._nbits = layer.W_nbits
        # 4-bit layers take GemLite's GEMM kernel at every batch size left to GemLite, never its split-K or GEMV
        # kernels (chosen below 64 rows): on the H200 those gave non-finite outputs intermittently, at 8 decode
        # rows and a 13-token prefill, while the GEMM (64+ rows) never did (pending_trained-accuracy_h200.log,
        # pending_w4-cublas_h200.log). With the fused kernels, batches of up to 8 rows skip GemLite altogether.
        # RWKV_W4_GEMM_ONLY=0 gives GemLite its own choice back (for A/B timing).
        self._gemm_only = layer.W_nbits == 4 and env_flag("RWKV_W4_GEMM_ONLY", True)
        # A16W8_INT8 stores its int8 matrix as GemLite's [in, out] view of an [out, in] array, with one fp16
        # scale per output channel applied after the sum: the W8A16 layout. The fused decode GEMV
        # (infer.ops.fused.gemv_operands) reads the same memory, so batch-1 steps skip GemLite's kernels.
        self.int8_rows: tuple[torch.Tensor, torch.Tensor] | None = None
        if (w_q.dtype == torch.int8 and post_scaled_8bit and w_q.t().is_contiguous()
                and scales.dtype == torch.float16 and scales.numel() == self.out_features):
            self.int8_rows = (w_q.t(), scales.reshape(-1))
            self.kind += " (decode: fused int8 GEMV)"
        # The same int8 rows through the W8A16 kernels for batches above W8A16_ABOVE_ROWS where they have the
        # Hopper GEMM: on the H200 it ran 7.2B batches of 128/256 rows at 13.1k/18.7k tok/s against
        # 8.6k/11.0k through GemLite's kernels, whose split-K GEMV won at 8 rows (1,352 against 974) and
        # tied at 32 (4,152 against 4,041).
        self._w8a16: W8A16Linear | None = None
        if self.int8_rows is not None and hopper_gemm_buildable(w_q.device):  # else the extension is not built
            w8a16 = W8A16Linear(*self.int8_rows)
            if w8a16.hopper_gemm:
                self._w8a16 = w8a16
                self.kind += f" (batches above {W8A16_ABOVE_ROWS}: {w8a16.kind})"
        # A16W4_HQQ_INT with groups narrower than a row (W_group_mode 4, "fma mode") packs 8 weights of a row
        # along K into each int32 word, the words of consecutive output channels side by side ([in/8, out]),
        # with fp16 scales and zeros [in/group, out], zero = -zero_point * scale: W = fp16(q * scale + zero).
        # The fused decode GEMV reads these tensors in place too. Anything else (other packings, group ==
        # in_features, which GemLite stores as mode 3) stays on GemLite's kernels.
        self.uint4_groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None
        group = layer.group_size
        if (layer.W_nbits == 4 and layer.elements_per_sample == 8 and layer.unpack_mask == 15
                and layer.W_group_mode == 4 and layer.channel_scale_mode == 0 and w_q.dtype == torch.int32
                and w_q.shape == (self.in_features // 8, self.out_features) and w_q.is_contiguous()
                and 0 < group and group % 8 == 0 and self.in_features % group == 0
                and all(t.dtype == torch.float16 and t.shape == (self.in_features // group, self.out_features)
                        and t.is_contiguous() for t in (scales, zeros))):
            self.uint4_groups = (w_q, scales, zeros, group)
            self.kind += " (decode: fused 4-bit GEMV)"
        # The same 4-bit matrix on the Hopper mixed-input GEMM (cuda/w8a16_gemm_sm90.cuh) for batches above
        # W4_HOPPER_ABOVE_ROWS. It reads the words K-major, GemLite's [K/8, N] transposed, so the layer keeps a
        # second copy of its 4-bit codes (the fused GEMV and GemLite read the first): the 4-bit matrices then take
        # about what int8 ones do, half of fp16. RWKV_W4_HOPPER_GEMM=0 leaves the copy out (GemLite's GEMM and
        # cuBLAS chunks serve those batches, at about half the fp16 engine's speed). Matrices with few output tiles
        # and a long K (the FFN value; at 7.2B r/k/v/output too) split K for batches up to SPLIT_MAX_ROWS rows
        # (gemm_splits; RWKV_W4_SPLIT_K=0 never splits, RWKV_W4_SPLIT_MIN_K sets the shortest slice).
        self._w4_gemm: tuple[Callable[..., None], torch.Tensor] | None = None
        self._w4_splits = 1
        if (self.uint4_groups is not None and group % HOPPER_K_STEP == 0 and self.out_features % 8 == 0
                and env_flag("RWKV_W4_HOPPER_GEMM", True)
                and hopper_gemm_buildable(w_q.device)):
            kernels = load_w8a16_kernels()
            if kernels is not None and kernels.gemm_w4 is not None:
                self._w4_gemm = (kernels.gemm_w4, w_q.t().contiguous())
                if env_flag("RWKV_W4_SPLIT_K", True):
                    sms = torch.cuda.get_device_properties(w_q.device).multi_processor_count
                    min_k = env_int("RWKV_W4_SPLIT_MIN_K", W4_SPLIT_MIN_K)
                    self._w4_splits = gemm_splits(self.out_features, self.in_features, group, sms, min_k)
                split = f", K in {self._w4_splits} slices up to {SPLIT_MAX_ROWS}" if self._w4_splits > 1 else ""
                self.kind += f" (batches above {W4_HOPPER_ABOVE_ROWS}: 4-bit Hopper GEMM{split})"
        # (rows, matmul): batches above `rows` go to matmul(x, words, scale, zero); set by select_fused to the
        # fused kernels' uint4_matmul (fp16 chunks of W^T for cuBLAS)
        self.large_batch: tuple[int, Callable[..., torch.Tensor]] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._w8a16 is not None and x.shape[0] > W8A16_ABOVE_ROWS:
            return self._w8a16(x)
        if self._w4_gemm is not None and x.shape[0] > W4_HOPPER_ABOVE_ROWS:
            op, words = self._w4_gemm
            _, scale, zero, group = self.uint4_groups
            x = aligned(x)
            rows = x.shape[0]
            y = torch.empty((rows, self.out_features), dtype=torch.float16, device=x.device)
            partials = None
            if self._w4_splits > 1 and rows <= SPLIT_MAX_ROWS:
                partials = torch.empty((self._w4_splits, rows, self.out_features), dtype=torch.float32,
                                       device=x.device)
            op(x, words, scale, zero, group, y, torch.cuda.current_stream(x.device).cuda_stream, -1, partials)
            return y
        if self.large_batch is not None and x.shape[0] > self.large_batch[0]:
            return self.large_batch[1](x.contiguous(), *self.uint4_groups[:3])
        kernel = self._kernels["GEMM" if self._gemm_only else self._matmul_type(x.shape[0], self._nbits)]
        # meta_scale is only read by NVFP4 layers (GemLite passes 0.0 for every other format). RWKV-7 has
        # no biases (the layout validation admits no bias entry).
        return kernel.forward(x.contiguous(), *self._args, meta_scale=0.0)

    def warmup(self, batch_sizes: list[int]) -> None:
        """Run (and so autotune) the kernel of each batch size once."""
        if self._w8a16 is not None:  # GemLite's kernels run only the smaller batches
            batch_sizes = [rows for rows in batch_sizes if rows <= W8A16_ABOVE_ROWS]
        if self._w4_gemm is not None:
            batch_sizes = [rows for rows in batch_sizes if rows <= W4_HOPPER_ABOVE_ROWS]
        device = self._args[0].device
        for rows in batch_sizes:
            self(torch.zeros((rows, self.in_features), dtype=self.dtype, device=device))
        torch.cuda.synchronize(device)


def tuning_file(directory: Path, device: torch.device | str) -> Path:
    """Where the autotuned GemLite configurations for this GPU model and gemlite version are kept."""
    import gemlite
    gpu = re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name(torch.device(device))).strip("-").lower()
    return Path(directory) / f"gemlite-tuning-{gpu}-{gemlite.__version__}.json"


def load_tuning(path: Path) -> bool:
    """Reuse the configurations an earlier start saved: GemLite then skips tuning every shape it finds."""
    import gemlite
    if not path.is_file():
        return False
    loaded = bool(gemlite.GemLiteLinearTriton.load_config(str(path), print_error=False))
    log.info("GemLite tuning %s %s", "loaded from" if loaded else "unreadable, re-tuning:", path)
    return loaded


def save_tuning(path: Path) -> None:
    """Store the configurations GemLite has chosen so far (merged into the file's earlier ones)."""
    import gemlite
    path.parent.mkdir(parents=True, exist_ok=True)
    gemlite.GemLiteLinearTriton.cache_config(str(path))
