"""Export a plain float RWKV-7 x070 checkpoint as packed GemLite 0.6.x layers, for ``--inference-engine gemlite``.

    python -m infer.quant.export_quant_gemlite IN.pth OUT.pth --format A16W8_INT8|A16W8_FP8|A16W4_HQQ_INT
           [--group-size 64] [--no-hqq-optimize] [--device cuda:0]
           [--gptq CALIBRATION.txt [--gptq-zero-points] [--calibration-rows 128] [--calibration-tokens 512]]

Formats (fp16 activations, weight-only):
  A16W8_INT8     int8, one scale per output channel applied after accumulation (recommended)
  A16W8_FP8      float8 e4m3, one scale per output channel applied after accumulation
  A16W4_HQQ_INT  asymmetric 4-bit, a scale and zero point per group of --group-size input columns,
                 zero points refined with HQQ unless --no-hqq-optimize; with --gptq, calibrated
                 instead: GPTQ on the inputs the float model gives each matrix for the text
                 of CALIBRATION.txt (symmetric, zero point 8, unless --gptq-zero-points), see
                 infer/quant/gptq.py

The values come from ``infer.quant.quantize`` (plain torch, the same math as the W8A16 export for
int8); only GemLite's packing needs the GPU and gemlite, so without them this tool stops with a
clear message before reading any weight. Every entry of each packed layer's state dict is stored as
``<matrix>.gemlite.<entry>``, with the markers ``__gemlite_format__``, ``__gemlite_group_size__`` and
``__gemlite_checkpoint_version__``; loading never quantizes or repacks. Other tensors are copied unchanged.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

import torch

from infer.checkpoint import (GEMLITE_FORMAT_KEY, GEMLITE_FORMATS, GEMLITE_GROUP_SIZE_KEY, GEMLITE_INFIX,
                              GEMLITE_VERSION, GEMLITE_VERSION_KEY, CheckpointError, ModelConfig)
from infer.quant.export import MatrixConverter, export, open_float_checkpoint
from infer.quant.gemlite_linear import require_gemlite
from infer.quant.quantize import quantize_fp8, quantize_int8, quantize_uint4_groups

W4 = "A16W4_HQQ_INT"


def check_group_size(group_size: int, config: ModelConfig) -> None:
    """GemLite's grouped kernels need groups of a multiple of 8, at least 16, dividing every in_features."""
    if group_size < 16 or group_size % 8:
        raise ValueError(f"--group-size {group_size}: must be a multiple of 8 and at least 16")
    widths = sorted({config.n_embd, config.ffn_dim})
    if any(width % group_size for width in widths):
        raise ValueError(f"--group-size {group_size} does not divide the input widths {widths} of the matrices")


def packer(fmt: str, group_size: int, optimize: bool, device: torch.device,
           quantize4: Callable[[str, torch.Tensor], tuple[torch.Tensor, ...]] | None = None) -> MatrixConverter:
    """Quantize a matrix on ``device`` and pack it with GemLite; returns the prefixed state-dict entries.
    ``quantize4(key, weight)`` replaces round-to-nearest for the 4-bit format (GPTQ)."""
    gemlite = require_gemlite(device, purpose="GemLite export (packing)")
    helper = gemlite.helper
    index = device.index if device.index is not None else torch.cuda.current_device()
    where = f"cuda:{index}"

    def convert(key: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        w = weight.to(device)
        if fmt == "A16W8_INT8":
            q, scale = quantize_int8(w)
            layer = helper.A16W8_INT8(device=where, dtype=torch.float16, post_scale=True).from_weights(q, scales=scale)
        elif fmt == "A16W8_FP8":
            q, scale = quantize_fp8(w)
            layer = helper.A16W8_FP8(device=where, dtype=torch.float16, post_scale=True).from_weights(q, scales=scale)
        else:
            q, scale, zero = quantize4(key, w) if quantize4 else quantize_uint4_groups(w, group_size, optimize)
            layer = helper.A16W4_HQQ_INT(device=where, dtype=torch.float16).from_weights(q, scale, zero)
        return {key + GEMLITE_INFIX + entry: t.detach().cpu() for entry, t in layer.state_dict().items()}

    return convert


def gptq_quantizer(args: argparse.Namespace, text: str,
                   keys: list[str]) -> Callable[[str, torch.Tensor], tuple[torch.Tensor, ...]]:
    """GPTQ for the matrices ``keys`` (in the order the export meets them), calibrated with the float model
    on ``args.device`` in fp16 on ``text`` (the file ``args.gptq``)."""
    from infer.model import RWKV7
    from infer.quant.gptq import calibrated_quantizer, calibration_rows
    from infer.tokenizer import load_world_tokenizer
    rows = calibration_rows(text, load_world_tokenizer().encode, args.calibration_rows, args.calibration_tokens)
    model = RWKV7.load(args.input, device=args.device, dtype="fp16")
    largest = max(max(row) for row in rows)
    if largest >= model.config.vocab_size:
        raise ValueError(f"--gptq: the model's vocabulary has {model.config.vocab_size} tokens, but the World "
                         f"tokenizer gives the calibration text token {largest}")
    print(f"GPTQ calibration: {len(rows)} rows, {sum(map(len, rows)):,} tokens of {args.gptq}")
    return calibrated_quantizer(model, keys, rows, args.group_size, symmetric=not args.gptq_zero_points,
                                memory_bytes=int(args.gptq_memory_gb * 2**30))


def read_calibration(path: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--gptq {path}: cannot read the calibration text ({e})") from None
    if not text.strip():
        raise ValueError(f"--gptq {path}: the calibration text is empty")
    return text


def markers(fmt: str, group_size: int) -> dict[str, torch.Tensor]:
    """The layout marker entries of a GemLite checkpoint of ``fmt``."""
    values = {GEMLITE_FORMAT_KEY: GEMLITE_FORMATS[fmt], GEMLITE_GROUP_SIZE_KEY: group_size if fmt == W4 else 0,
              GEMLITE_VERSION_KEY: GEMLITE_VERSION}
    return {key: torch.tensor(value, dtype=torch.int32) for key, value in values.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m infer.quant.export_quant_gemlite", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("input", help="plain float x070 checkpoint (.pth or .safetensors)")
    ap.add_argument("output", help="GemLite checkpoint to write (.pth)")
    ap.add_argument("--format", required=True, choices=tuple(GEMLITE_FORMATS), dest="fmt")
    ap.add_argument("--group-size", type=int, default=64, help=f"input columns per scale/zero group ({W4} only)")
    ap.add_argument("--no-hqq-optimize", action="store_true", help=f"{W4}: plain round-to-nearest zero points")
    ap.add_argument("--device", default="cuda", help="the GPU that quantizes and packs")
    ap.add_argument("--gptq", metavar="CALIBRATION.txt", help=f"{W4}: GPTQ calibrated on this UTF-8 text")
    ap.add_argument("--gptq-zero-points", action="store_true", help="GPTQ with a zero point per group (default: "
                    "symmetric, zero point 8)")
    ap.add_argument("--calibration-rows", type=int, default=128, help="GPTQ: pieces of the text fed to the model")
    ap.add_argument("--calibration-tokens", type=int, default=512, help="GPTQ: tokens per piece")
    ap.add_argument("--gptq-memory-gb", type=float, default=16.0,
                    help="GPTQ: Hessians (fp32, in_features^2 each) held at once; more passes over the text if less")
    args = ap.parse_args(argv)
    try:
        if args.gptq and args.fmt != W4:
            raise ValueError(f"--gptq calibrates the 4-bit format only: use it with --format {W4}")
        if args.gptq and (min(args.calibration_rows, args.calibration_tokens) < 1 or args.gptq_memory_gb <= 0):
            raise ValueError("--calibration-rows, --calibration-tokens and --gptq-memory-gb must be positive")
        text = read_calibration(args.gptq) if args.gptq else ""  # fails before any weight is read
        src, config = open_float_checkpoint(args.input)
        if args.fmt == W4:
            check_group_size(args.group_size, config)
        require_gemlite(torch.device(args.device), purpose="GemLite export (packing)")
        quantize4 = None
        if args.gptq:
            matrices = set(config.linear_keys())
            quantize4 = gptq_quantizer(args, text, [key for key in src.keys() if key in matrices])
        convert = packer(args.fmt, args.group_size, not args.no_hqq_optimize, torch.device(args.device), quantize4)
        export(src, config, args.output, convert, markers(args.fmt, args.group_size), desc=f"packing {args.fmt}")
    except (CheckpointError, RuntimeError, ValueError) as e:
        sys.exit(f"export_quant_gemlite: {e}")


if __name__ == "__main__":
    main()
