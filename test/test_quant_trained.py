"""W8A16 accuracy on a trained model (issue #7's target: greedy agreement with the float model >= 99 %).

Random weights give near-ties at most positions, so their top-1 token flips under any rounding (the random-model
tests in test_quant.py can only ask for 90 %). ``test/data/tiny_trained_l4c128.pth`` is a small byte-level
RWKV-7 trained on the CPU by ``bench/train_tiny.py`` on the Python standard library; its held-out modules give
the prompts. The W8A16 model is the real export (``export_quant``) loaded by the ``cutlass`` engine's CPU path.
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT
from infer.model import RWKV7
from infer.quant import export_quant

sys.path.insert(0, str(ROOT))
from bench.quant_accuracy import (GREEDY_PROMPT_BYTES, greedy_agreement, greedy_continuations,  # noqa: E402
                                  held_out_prompts)
from bench.train_tiny import TrainingWKV, corpus_bytes, logits_of  # noqa: E402
from infer.batch import PackedBatch  # noqa: E402
from infer.ops.wkv import TorchWKV  # noqa: E402
from infer.random_model import make_config, random_state_dict  # noqa: E402

CHECKPOINT = ROOT / "test" / "data" / "tiny_trained_l4c128.pth"
PROMPTS, GREEDY_TOKENS = 16, 128  # as bench/quant_accuracy.py --checkpoint --greedy-prompts 16


@pytest.fixture(scope="module")
def held_out() -> list[int]:
    return list(corpus_bytes(held_out=True))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The trained model (fp32 activations) and its W8A16 export (cutlass engine, CPU)."""
    out = tmp_path_factory.mktemp("trained") / "tiny-w8a16.pth"
    export_quant.main([str(CHECKPOINT), str(out), "--bits", "8"])
    return (RWKV7.load(str(CHECKPOINT), device="cpu", progress=False),
            RWKV7.load(str(out), device="cpu", engine="cutlass", progress=False))


def test_the_checkpoint_is_trained(models, held_out):
    """The premise: on text it never saw, the model predicts far better than chance (ln 256 = 5.55 nats per
    byte) and is confident at most positions, as trained models are and random ones are not."""
    model, _ = models
    tokens = held_out[:1024]
    logits = model.prefill([tokens[:-1]], [0], model.new_state_pool(1), all_logits=True)
    loss = F.cross_entropy(logits, torch.tensor(tokens[1:])).item()
    top1 = logits.softmax(-1).max(-1).values
    assert loss < 2.0, loss
    assert (top1 > 0.5).float().mean().item() > 0.5


def test_w8a16_greedy_agreement_on_the_trained_model(models, held_out):
    """The float model continues held-out prompts greedily; the W8A16 model, fed the same bytes, picks the
    same next byte at >= 99 % of those positions."""
    model, w8 = models
    prompts = held_out_prompts(held_out, PROMPTS)
    rows = greedy_continuations(model, prompts, GREEDY_TOKENS)
    # code's indentation makes some continuations runs of spaces; together they must still be varied text
    assert len({byte for row in rows for byte in row[GREEDY_PROMPT_BYTES:]}) >= 20, "degenerate continuations"
    agreement = greedy_agreement(w8, rows, GREEDY_PROMPT_BYTES)
    print(f"\nW8A16 greedy agreement on the trained model: {agreement:.2f} % of {PROMPTS * GREEDY_TOKENS} tokens")
    assert agreement >= 99.0


# --------------------------------------------------------------------------- the training tool
def test_training_wkv_is_the_inference_recurrence():
    """bench/train_tiny.py's differentiable step loop gives the portable WKV's y and final states."""
    gen = torch.Generator().manual_seed(0)
    B, T, H, N = 3, 7, 2, 64
    r, k, v = (torch.randn(B * T, H * N, generator=gen) for _ in range(3))
    w = torch.rand(B * T, H * N, generator=gen) * 0.5 + 0.45
    kk = torch.nn.functional.normalize(torch.randn(B * T, H, N, generator=gen), dim=-1).view(B * T, H * N)
    a, b = -kk, kk * torch.rand(B * T, H * N, generator=gen)
    batch = PackedBatch.from_rows([[0] * T] * B, [2, 0, 3], "cpu")
    start = torch.randn(4, H, N, N, generator=gen) * 0.1
    want_state, got_state = start.clone(), start.clone()
    want = TorchWKV()(want_state, batch, r, w, k, v, a, b)
    got = TrainingWKV()(got_state, batch, r, w, k, v, a, b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5)


def test_training_forward_has_gradients_for_every_tensor():
    """The model assembled from the checkpoint tensors is differentiable end to end: after one backward
    pass every tensor the checkpoint holds has a nonzero gradient (none is cut off by an in-place or
    inference-mode step), and the logits are the inference forward's."""
    config = make_config(2, 128, vocab_size=256)
    params = {key: t.float().requires_grad_(True) for key, t in random_state_dict(config, 0).items()}
    rows = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    logits = logits_of(params, rows[:, :-1])
    torch.nn.functional.cross_entropy(logits, rows[:, 1:].reshape(-1)).backward()
    missing = [key for key, t in params.items() if t.grad is None or not t.grad.abs().sum() > 0]
    assert not missing, missing
    model = RWKV7.from_state_dict({k: v.detach() for k, v in params.items()}, device="cpu", dtype="fp32")
    want = model.prefill(rows[:, :-1].tolist(), [0, 1], model.new_state_pool(2), all_logits=True)
    torch.testing.assert_close(logits.detach(), want, rtol=1e-4, atol=1e-4)
