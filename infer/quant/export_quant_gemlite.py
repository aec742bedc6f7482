"""Export a plain float RWKV-7 x070 checkpoint as packed GemLite 0.6.x layers, for ``--inference-engine gemlite``.

    python -m infer.quant.export_quant_gemlite IN.pth OUT.pth --format A16W8_INT8|A16W8_FP8|A16W4_HQQ_INT
           [--group-size 64] [--no-hqq-optimize] [--device cuda:0]

Formats (fp16 activations, weight-only):
  A16W8_INT8     int8, one scale per output channel applied after accumulation (recommended)
  A16W8_FP8      float8 e4m3, one scale per output channel applied after accumulation
  A16W4_HQQ_INT  asymmetric 4-bit, a scale and zero point per group of --group-size input columns,
                 zero points refined with HQQ unless --no-hqq-optimize

The values come from ``infer.quant.quantize`` (plain torch, the same math as the W8A16 export for
int8); only GemLite's packing needs the GPU and gemlite, so without them this tool stops with a
clear message before reading any weight. Every entry of each packed layer's state dict is stored as
``<matrix>.gemlite.<entry>``, with the markers ``__gemlite_format__``, ``__gemlite_group_size__`` and
``__gemlite_checkpoint_version__``; loading never quantizes or repacks. Other tensors are copied unchanged.
"""
from __future__ import annotations

import argparse
import sys

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


def packer(fmt: str, group_size: int, optimize: bool, device: torch.device) -> MatrixConverter:
    """Quantize a matrix on ``device`` and pack it with GemLite; returns the prefixed state-dict entries."""
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
            q, scale, zero = quantize_uint4_groups(w, group_size, optimize)
            layer = helper.A16W4_HQQ_INT(device=where, dtype=torch.float16).from_weights(q, scale, zero)
        return {key + GEMLITE_INFIX + entry: t.detach().cpu() for entry, t in layer.state_dict().items()}

    return convert


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
    args = ap.parse_args(argv)
    try:
        src, config = open_float_checkpoint(args.input)
        if args.fmt == W4:
            check_group_size(args.group_size, config)
        convert = packer(args.fmt, args.group_size, not args.no_hqq_optimize, torch.device(args.device))
        export(src, config, args.output, convert, markers(args.fmt, args.group_size), desc=f"packing {args.fmt}")
    except (CheckpointError, RuntimeError, ValueError) as e:
        sys.exit(f"export_quant_gemlite: {e}")


if __name__ == "__main__":
    main()
