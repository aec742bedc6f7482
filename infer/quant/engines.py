"""Inference engines: which checkpoint layout each one serves and which linear layer it builds.

Quantization swaps the linear layers of the big matrices (the head and six per block) and nothing else:
the model code, state layout and WKV kernels are the same for every engine.

    fp16     plain float checkpoints; DenseLinear in the activation dtype
    cutlass  W8A16 checkpoints (export_quant); W8A16Linear: CUDA GEMV + CUTLASS GEMM, dequantize on CPU
    gemlite  GemLite 0.6.x packed A16W8 / A16W4 checkpoints (export_quant_gemlite); CUDA only
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

import torch

from infer.checkpoint import (GEMLITE_INFIX, LAYOUT_FLOAT, LAYOUT_GEMLITE, LAYOUT_W8A16, SCALE_SUFFIX,
                              CheckpointError)
from infer.ops.linear import DenseLinear, Linear

if TYPE_CHECKING:
    from infer.model import RWKV7

ENGINES = ("fp16", "cutlass", "gemlite")
LAYOUT_OF_ENGINE = {"fp16": LAYOUT_FLOAT, "cutlass": LAYOUT_W8A16, "gemlite": LAYOUT_GEMLITE}
ENGINE_OF_LAYOUT = {layout: engine for engine, layout in LAYOUT_OF_ENGINE.items()}
DESCRIPTIONS = {LAYOUT_FLOAT: "plain float", LAYOUT_W8A16: "W8A16 (int8 weights + fp16 scales)",
                LAYOUT_GEMLITE: "GemLite (packed A16W8/A16W4)"}
EXPORT_COMMANDS = {LAYOUT_W8A16: "python -m infer.quant.export_quant {src} OUT.pth --bits 8",
                   LAYOUT_GEMLITE: "python -m infer.quant.export_quant_gemlite {src} OUT.pth --format A16W8_INT8"}

# Builds the Linear of one matrix from the converted tensors, taking (popping) its entries.
LinearFactory = Callable[[str, dict[str, torch.Tensor]], Linear]


def check_engine(layout: str, engine: str, path: str) -> None:
    """Raise a CheckpointError naming the right engine (and the export command) when ``engine`` cannot
    serve a checkpoint of ``layout``."""
    if engine not in LAYOUT_OF_ENGINE:
        raise ValueError(f"unknown inference engine {engine!r}; choose one of {', '.join(ENGINES)}")
    wanted = LAYOUT_OF_ENGINE[engine]
    if layout == wanted:
        return
    message = (f"{path} is a {DESCRIPTIONS[layout]} checkpoint, which --inference-engine {engine} cannot serve: "
               f"serve it with --inference-engine {ENGINE_OF_LAYOUT[layout]}")
    if wanted in EXPORT_COMMANDS:
        command = EXPORT_COMMANDS[wanted].format(src=path if layout == LAYOUT_FLOAT else "FLOAT.pth")
        source = "this file" if layout == LAYOUT_FLOAT else "the original float checkpoint"
        message += f", or export a {DESCRIPTIONS[wanted]} checkpoint for {engine} from {source}: `{command}`"
    raise CheckpointError(message)


def linear_factory(engine: str, device: torch.device, act: torch.dtype) -> LinearFactory:
    """The factory of ``engine``'s linear layers; fails early (before any weight is read) when the
    engine cannot run here."""
    if engine == "fp16":
        return lambda name, t: DenseLinear(t.pop(name))
    if engine == "cutlass":
        from infer.ops.linear_w8a16 import W8A16Linear
        return lambda name, t: W8A16Linear(t.pop(name), t.pop(name + SCALE_SUFFIX))
    if engine == "gemlite":
        from infer.quant.gemlite_linear import GemLiteLinear, require_gemlite
        require_gemlite(device, act)
        return lambda name, t: GemLiteLinear(_pop_prefixed(t, name + GEMLITE_INFIX))
    raise ValueError(f"unknown inference engine {engine!r}; choose one of {', '.join(ENGINES)}")


def _pop_prefixed(t: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {key[len(prefix):]: t.pop(key) for key in [k for k in t if k.startswith(prefix)]}


def warm_up(linears: Iterable[Linear], batch_sizes: Iterable[int]) -> None:
    """Let every layer that tunes itself per batch size (GemLite autotunes its Triton kernels on first
    use of a shape) do so now, before serving and before CUDA graphs are captured."""
    sizes = sorted(set(batch_sizes))
    for linear in linears:
        warmup = getattr(linear, "warmup", None)
        if warmup is not None:
            warmup(sizes)


def warm_up_gemlite(model: "RWKV7", batch_sizes: Iterable[int], directory: Path) -> None:
    """A GemLite model before serving: reuse the tuning an earlier start on this GPU model saved in
    ``directory``, tune the batch sizes still missing (not those the fused GEMV serves: those steps never
    call GemLite), and save the result for the next start."""
    from infer.quant.gemlite_linear import load_tuning, save_tuning, tuning_file
    tuning = tuning_file(directory, model.device)
    load_tuning(tuning)
    on_gemv = model.fused.gemv_covers(model) if model.fused else 0
    warm_up(model.projections(), [rows for rows in batch_sizes if rows > on_gemv])
    save_tuning(tuning)
