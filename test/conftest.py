"""Shared fixtures: tiny random RWKV-7 checkpoints and the official implementation as oracle."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from infer.random_model import make_config, random_state_dict, save_checkpoint  # noqa: E402

# Two shapes: a minimal one with a small vocabulary, and one with the real 65536 vocabulary,
# three heads and four layers.
MODEL_SHAPES = {
    "L2-C128-V1024": dict(n_layer=2, n_embd=128, vocab_size=1024, seed=11),
    "L4-C192-V65536": dict(n_layer=4, n_embd=192, vocab_size=65536, seed=12),
}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


def make_model_file(directory: Path, name: str, dtype: torch.dtype = torch.float32, suffix: str = ".pth") -> Path:
    shape = dict(MODEL_SHAPES[name])
    seed = shape.pop("seed")
    path = directory / f"{name}-{str(dtype).removeprefix('torch.')}{suffix}"
    if not path.exists():
        save_checkpoint(random_state_dict(make_config(**shape), seed=seed, dtype=dtype), path)
    return path


@pytest.fixture(scope="session", params=list(MODEL_SHAPES))
def model_path(request, model_dir) -> Path:
    return make_model_file(model_dir, request.param)


def official_model(path: Path, strategy: str = "cpu fp32"):
    """The official rwkv package (CPU, no CUDA kernels) on the same checkpoint."""
    pytest.importorskip("rwkv")
    os.environ["RWKV_V7_ON"] = "1"
    os.environ["RWKV_CUDA_ON"] = "0"
    from rwkv.model import RWKV
    return RWKV(model=str(path)[: -len(".pth")], strategy=strategy)
