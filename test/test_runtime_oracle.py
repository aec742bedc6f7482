"""The runtime against the official implementation (CPU fp32), and its own invariances."""
from __future__ import annotations

import copy

import pytest
import torch

from conftest import official_model
from infer.model import RWKV7
from infer.state import SlotState

LOGIT_TOL = 2e-3
STATE_TOL = 1e-3


def random_tokens(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def pair(model_path):
    return RWKV7.load(str(model_path), device="cpu"), official_model(model_path)


def max_state_diff(ours: SlotState, official: list[torch.Tensor]) -> float:
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(ours.to_official(), official))


def test_prefill_and_decode_logits_match_official(pair):
    model, ref = pair
    V = model.config.vocab_size
    prompt = random_tokens(37, V, seed=1)
    ref_logits, ref_state = ref.forward(prompt, None, full_output=True)
    pool = model.new_state_pool(3)
    ours = model.prefill([prompt], [1], pool, all_logits=True)
    assert ours.shape == (37, V)
    assert ref_logits.abs().max() > 3, "random model too flat to be a meaningful test"
    assert (ours - ref_logits).abs().max().item() <= LOGIT_TOL
    assert max_state_diff(pool.export_slot(1), ref_state) <= STATE_TOL
    # teacher-forced decode: every step's logits, then the final state
    for token in random_tokens(16, V, seed=2):
        ref_step, ref_state = ref.forward([token], ref_state)
        ours_step = model.decode([token], [1], pool)[0]
        assert (ours_step - ref_step).abs().max().item() <= LOGIT_TOL
    assert max_state_diff(pool.export_slot(1), ref_state) <= STATE_TOL


def test_last_token_prefill_matches_official(pair):
    """Without all_logits only each row's last token is read out, so the last block's FFN runs on each row's
    last two tokens: the logits and every state (the FFN shift included) still match the official package
    and the every-token prefill."""
    model, ref = pair
    lens = [1, 2, 3, 19]
    prompts = [random_tokens(n, model.config.vocab_size, seed=80 + n) for n in lens]
    pool, every_pool = model.new_state_pool(4), model.new_state_pool(4)
    last = model.prefill(prompts, [3, 2, 1, 0], pool)
    every = model.prefill(prompts, [3, 2, 1, 0], every_pool, all_logits=True)
    ends = torch.tensor(lens).cumsum(0) - 1
    assert last.shape == (4, model.config.vocab_size)
    assert (last - every[ends]).abs().max().item() <= 1e-4
    for row, (prompt, slot) in enumerate(zip(prompts, [3, 2, 1, 0])):
        ref_logits, ref_state = ref.forward(prompt, None)
        assert (last[row] - ref_logits).abs().max().item() <= LOGIT_TOL
        assert max_state_diff(pool.export_slot(slot), ref_state) <= STATE_TOL
        assert max_state_diff(pool.export_slot(slot), every_pool.export_slot(slot).to_official()) <= 1e-5


def test_packed_batch_tails():
    from infer.batch import PackedBatch
    batch = PackedBatch.from_rows([[1, 2, 3, 4], [5], [6, 7, 8]], [4, 0, 2], "cpu")
    tail, positions = batch.tails(2)
    assert positions.tolist() == [2, 3, 4, 6, 7]
    assert tail.tokens.tolist() == [3, 4, 5, 7, 8] and tail.lens == [2, 1, 2]
    assert tail.starts.tolist() == [0, 2, 3] and tail.last.tolist() == [1, 2, 4]
    assert tail.slots.tolist() == [4, 0, 2]
    assert batch.tails(2)[1] is positions  # built once per batch
    assert batch.readout_tail()[1] is positions
    assert batch.tails(1)[1].tolist() == batch.last.tolist()
    assert PackedBatch.from_rows([[1, 2], [3]], [0, 1], "cpu").readout_tail() is None  # nothing to leave out


def test_earlier_tokens_change_the_logits(pair):
    """Guards the random-weights generator: the state path must carry signal."""
    model, _ = pair
    pool = model.new_state_pool(2)
    a = model.prefill([[5, 6, 7, 8]], [0], pool)
    b = model.prefill([[9, 6, 7, 8]], [1], pool)
    assert (a - b).abs().max().item() > 1e-2


def test_greedy_continuation_is_token_identical(pair):
    model, ref = pair
    prompt = random_tokens(12, model.config.vocab_size, seed=3)
    ref_logits, ref_state = ref.forward(prompt, None)
    pool = model.new_state_pool(1)
    logits = model.prefill([prompt], [0], pool)[0]
    ref_tokens, ours_tokens = [], []
    for _ in range(32):
        t_ref, t_ours = int(ref_logits.argmax()), int(logits.argmax())
        ref_tokens.append(t_ref)
        ours_tokens.append(t_ours)
        ref_logits, ref_state = ref.forward([t_ref], ref_state)
        logits = model.decode([t_ours], [0], pool)[0]
    assert ours_tokens == ref_tokens
    assert len(set(ours_tokens)) > 3, "degenerate continuation proves little"


def test_batch_invariance_exact(pair):
    """Each row of a mixed batch gives bit-identical results to running it alone."""
    model, _ = pair
    V = model.config.vocab_size
    prompts = [random_tokens(n, V, seed=10 + n) for n in (1, 9, 23, 4, 17)]
    slots = [4, 0, 2, 6, 1]
    pool = model.new_state_pool(8)
    batch_prefill = model.prefill(prompts, slots, pool)
    steps = [random_tokens(len(prompts), V, seed=100 + s) for s in range(6)]
    batch_decode = [model.decode(step, slots, pool) for step in steps]
    for row, (prompt, slot) in enumerate(zip(prompts, slots)):
        alone_pool = model.new_state_pool(8)
        alone = model.prefill([prompt], [7], alone_pool)
        assert torch.equal(alone[0], batch_prefill[row])
        for s, step in enumerate(steps):
            assert torch.equal(model.decode([step[row]], [7], alone_pool)[0], batch_decode[s][row])
        got, want = pool.export_slot(slot), alone_pool.export_slot(7)
        assert all(torch.equal(x, y) for x, y in zip(got.to_official(), want.to_official()))


def test_rows_join_and_leave_between_steps(pair):
    """An engine adds and removes rows at any step; other rows must not notice."""
    model, _ = pair
    V = model.config.vocab_size
    pool = model.new_state_pool(4)
    solo = model.new_state_pool(1)
    a_prompt, b_prompt = random_tokens(6, V, 20), random_tokens(11, V, 21)
    model.prefill([a_prompt], [2], pool)
    model.prefill([a_prompt], [0], solo)
    tokens = random_tokens(8, V, 22)
    for step, token in enumerate(tokens):
        if step == 3:
            model.prefill([b_prompt], [0], pool)  # joins mid-stream in another call
        if 3 <= step < 6:
            mixed = model.decode([token, 7], [2, 0], pool)[0]
        else:
            mixed = model.decode([token], [2], pool)[0]
        assert torch.equal(mixed, model.decode([token], [0], solo)[0])


@pytest.mark.parametrize("chunk", [1, 3, 7, 16])
def test_chunked_prefill_equals_unchunked(pair, chunk):
    model, _ = pair
    V = model.config.vocab_size
    prompts = [random_tokens(n, V, seed=30 + n) for n in (29, 5, 13)]
    whole_pool, chunk_pool = model.new_state_pool(3), model.new_state_pool(3)
    whole = model.prefill(prompts, [0, 1, 2], whole_pool, all_logits=True)
    chunked = model.prefill(prompts, [0, 1, 2], chunk_pool, chunk_size=chunk, all_logits=True)
    assert torch.equal(whole, chunked)
    for slot in range(3):
        a, b = whole_pool.export_slot(slot), chunk_pool.export_slot(slot)
        assert all(torch.equal(x, y) for x, y in zip(a.to_official(), b.to_official()))


def test_prefill_then_decode_equals_token_by_token(pair):
    model, _ = pair
    prompt = random_tokens(20, model.config.vocab_size, seed=40)
    pool = model.new_state_pool(2)
    seq = model.prefill([prompt], [0], pool, all_logits=True)
    one_by_one = torch.stack([model.decode([t], [1], pool)[0] for t in prompt])
    assert (seq - one_by_one).abs().max().item() <= 1e-4
    assert max_state_diff(pool.export_slot(0), pool.export_slot(1).to_official()) <= 1e-5


def test_state_export_import_continues_exactly(pair):
    model, _ = pair
    V = model.config.vocab_size
    prompt, cont = random_tokens(15, V, 50), random_tokens(10, V, 51)
    pool = model.new_state_pool(4)
    model.prefill([prompt], [3], pool)
    saved = pool.export_slot(3)
    assert saved.att_shift.device.type == "cpu" and saved.nbytes() == pool.bytes_per_slot
    uninterrupted = [model.decode([t], [3], pool)[0] for t in cont]
    other = model.new_state_pool(2)
    other.import_slot(1, copy.deepcopy(saved))
    resumed = [model.decode([t], [1], other)[0] for t in cont]
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed))
    # the official list layout round-trips too
    again = SlotState.from_official(saved.to_official())
    assert all(torch.equal(a, b) for a, b in zip(again.to_official(), saved.to_official()))


def test_reset_gives_empty_context(pair):
    model, _ = pair
    prompt = random_tokens(8, model.config.vocab_size, 60)
    pool = model.new_state_pool(1)
    first = model.prefill([prompt], [0], pool)
    pool.reset([0])
    assert torch.equal(model.prefill([prompt], [0], pool), first)


def test_fp16_state_storage_stays_close(pair):
    """The state is rounded to fp16 whenever it is stored, i.e. between calls."""
    model, _ = pair
    tokens = random_tokens(24, model.config.vocab_size, 70)
    full, half = model.new_state_pool(1), model.new_state_pool(1, wkv_dtype=torch.float16)
    assert half.wkv.dtype == torch.float16
    exact = torch.stack([model.decode([t], [0], full)[0] for t in tokens])
    rounded = torch.stack([model.decode([t], [0], half)[0] for t in tokens])
    assert 0 < (rounded - exact).abs().max().item() < 0.05


def test_half_precision_drift_within_official_drift(model_path):
    """fp16 activations: drift vs the fp32 oracle at most 3x the official package's own fp16 drift."""
    ref32, ref16 = official_model(model_path, "cpu fp32"), official_model(model_path, "cpu fp16")
    model = RWKV7.load(str(model_path), device="cpu", dtype="fp16")
    assert model.dtype == torch.float16
    prompt = random_tokens(30, model.config.vocab_size, 80)
    want, _ = ref32.forward(prompt, None, full_output=True)
    official, _ = ref16.forward(prompt, None, full_output=True)
    ours = model.prefill([prompt], [0], model.new_state_pool(1), all_logits=True)
    official_drift = (official.float() - want).abs().max().item()
    our_drift = (ours - want).abs().max().item()
    assert our_drift <= 3 * max(official_drift, 1e-3), (our_drift, official_drift)
