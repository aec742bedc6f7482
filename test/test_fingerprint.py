"""The checkpoint fingerprint that stored states carry: stable across names and file formats,
different for other weights, read without loading the matrices."""
from __future__ import annotations

import torch

from infer.checkpoint import DictSource, open_checkpoint
from infer.fingerprint import fingerprint
from infer.random_model import make_config, random_state_dict, save_checkpoint

CONFIG = make_config(2, 128, 1024)


def test_same_weights_same_fingerprint_whatever_the_file(tmp_path):
    sd = random_state_dict(CONFIG, seed=3)
    save_checkpoint(sd, tmp_path / "a.pth")
    save_checkpoint(sd, tmp_path / "renamed.safetensors")
    expected = fingerprint(DictSource(dict(sd)))
    assert expected.startswith("L2-C128-V1024:") and len(expected.split(":")[1]) == 16
    assert fingerprint(open_checkpoint(str(tmp_path / "a.pth"))) == expected
    assert fingerprint(open_checkpoint(str(tmp_path / "renamed.safetensors"))) == expected


def test_other_weights_other_fingerprint():
    sd = random_state_dict(CONFIG, seed=3)
    base = fingerprint(DictSource(dict(sd)))
    assert fingerprint(DictSource(random_state_dict(CONFIG, seed=4))) != base
    tuned = dict(sd)
    tuned["emb.weight"] = sd["emb.weight"].clone()
    tuned["emb.weight"][0, 0] += 1  # a large matrix (only its first row is read) changed
    assert fingerprint(DictSource(tuned)) != base
    assert fingerprint(DictSource({k: v.to(torch.float32) for k, v in sd.items()})) != base  # another dtype
