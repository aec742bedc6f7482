"""Export a plain float RWKV-7 x070 checkpoint as W8A16, for ``--inference-engine cutlass``.

    python -m infer.quant.export_quant IN.pth OUT.pth --bits 8

The head and the six projection matrices of every block become symmetric per-output-channel int8
(``name``: int8 [out, in]; ``name.scale``: fp16 [out]; see ``infer.quant.quantize.quantize_int8``);
embeddings, norms, token-shift mixers and the LoRA factors are copied unchanged. A marker tensor
``__w8a16_version__`` names the layout. Prints the compression ratio.
"""
from __future__ import annotations

import argparse
import sys

import torch

from infer.checkpoint import SCALE_SUFFIX, W8A16_MARKER, W8A16_VERSION, CheckpointError
from infer.quant.export import export, open_float_checkpoint
from infer.quant.quantize import quantize_int8


def quantize_matrix(key: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    q, scale = quantize_int8(weight)
    return {key: q, key + SCALE_SUFFIX: scale}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m infer.quant.export_quant", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("input", help="plain float x070 checkpoint (.pth or .safetensors)")
    ap.add_argument("output", help="W8A16 checkpoint to write (.pth or .safetensors)")
    ap.add_argument("--bits", type=int, choices=(8,), default=8, help="weight bits (8 is the only W8A16 width)")
    args = ap.parse_args(argv)
    try:
        src, config = open_float_checkpoint(args.input)
        export(src, config, args.output, quantize_matrix,
               {W8A16_MARKER: torch.tensor(W8A16_VERSION, dtype=torch.int32)}, desc="quantizing to W8A16")
    except (CheckpointError, ValueError) as e:
        sys.exit(f"export_quant: {e}")


if __name__ == "__main__":
    main()
