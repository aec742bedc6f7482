"""A checkpoint's identity for stored states: cheap enough to compute at every start.

A stored recurrent state is only meaningful for the weights that produced it. Hashing a 14 GB
checkpoint at startup would take a minute, so the fingerprint hashes, in key order, every
tensor's name, dtype and shape, the whole content of every small tensor (layer norms, token-shift
mixes, decay biases, ``r_k``: they differ between any two trainings) and the first row of every
large one (so a fine-tune that changed only the matrices differs too). Tensors are read lazily
(memory map, safetensors slices), so only those bytes are touched. The file name and format are
not part of it: a renamed file, or the same weights as ``.pth`` and ``.safetensors``, keep their
sessions; the same weights stored in another dtype (bf16 vs fp16) count as another model.

    fingerprint(open_checkpoint(path))  # 'L24-C2048-V65536:3f9a…' (shape, then 16 hex digits)
"""
from __future__ import annotations

import hashlib
import math

import torch

from infer.checkpoint import TensorSource, infer_config

SMALL_ELEMENTS = 1 << 16   # tensors up to this many elements are hashed whole


def fingerprint(src: TensorSource) -> str:
    """``L{layers}-C{width}-V{vocab}:{hash}`` of a checkpoint (see the module docstring)."""
    config = infer_config(src)
    digest = hashlib.sha256()
    for key in sorted(src.keys()):
        shape, dtype = src.shape(key), src.dtype(key)
        digest.update(f"{key}|{dtype}|{shape}|".encode())
        part = src.get(key) if math.prod(shape) <= SMALL_ELEMENTS else src.first_row(key)
        digest.update(part.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return f"L{config.n_layer}-C{config.n_embd}-V{config.vocab_size}:{digest.hexdigest()[:16]}"
