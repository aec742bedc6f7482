"""The random-checkpoint script and the built-in demo model."""
from __future__ import annotations

import subprocess
import sys

import torch

from conftest import ROOT
from infer.checkpoint import open_checkpoint, infer_config
from infer.model import RWKV7
from infer.random_model import ensure_demo_model, lora_rank, make_config


def test_cli_writes_a_loadable_checkpoint_of_any_shape(tmp_path):
    out = tmp_path / "m.safetensors"
    subprocess.run([sys.executable, "-m", "infer.random_model", str(out), "--n-layer", "3", "--n-embd", "320",
                    "--vocab", "512", "--seed", "4"], cwd=ROOT, check=True, capture_output=True)
    config = infer_config(open_checkpoint(str(out)))
    assert (config.n_layer, config.n_embd, config.n_head, config.vocab_size) == (3, 320, 5, 512)
    assert (config.rank_w, config.rank_g) == (lora_rank(320, 2.5), lora_rank(320, 5))
    assert open_checkpoint(str(out)).dtype("emb.weight") == torch.bfloat16  # official releases store bf16


def test_lora_ranks():
    # The trainer's formula gives the 0.1B model's ranks; released larger models use their own.
    assert [lora_rank(768, f) for f in (2.5, 2.5, 1.7, 5)] == [64, 64, 32, 128]
    big = make_config(32, 4096)
    assert (big.rank_w, big.rank_a, big.rank_v, big.rank_g) == (128, 128, 96, 480)


def test_demo_model_is_generated_once_and_deterministic(tmp_path, monkeypatch):
    monkeypatch.setenv("RWKV_SERVER_HOME", str(tmp_path / "a"))
    first = ensure_demo_model()
    mtime = first.stat().st_mtime_ns
    assert ensure_demo_model() == first and first.stat().st_mtime_ns == mtime  # cached, not regenerated
    monkeypatch.setenv("RWKV_SERVER_HOME", str(tmp_path / "b"))
    second = ensure_demo_model()
    a, b = RWKV7.load(str(first), device="cpu"), RWKV7.load(str(second), device="cpu")
    assert a.config.vocab_size == 65536
    prompt = [[11, 22, 33]]
    assert torch.equal(a.prefill(prompt, [0], a.new_state_pool(1)), b.prefill(prompt, [0], b.new_state_pool(1)))
