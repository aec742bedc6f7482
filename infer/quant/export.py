"""The steps the export tools share: open and validate a plain float checkpoint, convert it one tensor
at a time behind a progress bar, write the result atomically and report the compression.

Memory: the input is memory-mapped (``.pth``) or read lazily (``.safetensors``) and each matrix is
converted on its own, so at most one float matrix is materialised at a time; the output is collected
and written once (it is what the server will load anyway). Tensors that are copied unchanged stay
file-backed until they are written.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from infer.checkpoint import (LAYOUT_FLOAT, CheckpointError, ModelConfig, TensorSource, infer_config,
                              iter_tensors, open_checkpoint, weight_layout)
from infer.quant.engines import DESCRIPTIONS
from infer.random_model import save_checkpoint

# One matrix (by key) -> the tensors that replace it in the output.
MatrixConverter = Callable[[str, torch.Tensor], dict[str, torch.Tensor]]


def open_float_checkpoint(path: str) -> tuple[TensorSource, ModelConfig]:
    """The checkpoint and its shape; a CheckpointError unless it is a valid plain float x070 checkpoint."""
    src = open_checkpoint(path)
    layout = weight_layout(src)
    if layout != LAYOUT_FLOAT:
        raise CheckpointError(f"{src.path} is already a {DESCRIPTIONS[layout]} checkpoint; quantized checkpoints "
                              "are not quantized again: export from the original float checkpoint")
    return src, infer_config(src)


def export(src: TensorSource, config: ModelConfig, out_path: str, convert: MatrixConverter,
           markers: dict[str, torch.Tensor], desc: str) -> tuple[int, int]:
    """Write ``out_path``: every quantizable matrix through ``convert``, every other tensor unchanged, plus
    the layout ``markers``. Prints and returns (input bytes, output bytes) on disk."""
    if Path(out_path).resolve() == Path(src.path).resolve():
        raise ValueError(f"the output {out_path} is the input checkpoint; write to another file")
    matrices = set(config.linear_keys())
    keys = src.keys()
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tqdm(iter_tensors(src, keys), total=len(keys), desc=desc, unit="tensor"):
        if key in matrices:
            out.update(convert(key, tensor))
        else:
            # A view into a larger storage would be saved with that whole storage: copy just the view.
            out[key] = tensor.clone() if tensor.untyped_storage().nbytes() > tensor.nbytes else tensor
    out.update(markers)
    save_checkpoint(out, out_path)
    in_bytes, out_bytes = os.path.getsize(src.path), os.path.getsize(out_path)
    print(f"wrote {out_path}: {in_bytes / 2**20:,.1f} MiB -> {out_bytes / 2**20:,.1f} MiB, "
          f"compression ratio {in_bytes / out_bytes:.2f}x")
    return in_bytes, out_bytes
