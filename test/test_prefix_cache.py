"""Prefix state cache: lookup and snapshot planning, bounds, and (through the engine) hits that give
exactly the tokens and states of misses (CPU fp32, greedy and seeded sampling)."""
from __future__ import annotations

import asyncio

import pytest
import torch

from infer.api.bridge import EventStream, RowGroup
from infer.engine import Engine, GenerationOptions, RowFinished, RowText
from infer.prefix_cache import PrefixCache, prefix_keys, token_positions
from infer.runner import ModelRunner
from infer.sampler import SamplingParams
from infer.state import SlotState
from infer.tokenizer import load_world_tokenizer
from test_api_support import tiny_model


def fake_state(value: float, n: int = 4) -> SlotState:
    return SlotState(torch.full((1, n), value), torch.full((1, 1, 2, 2), value), torch.full((1, n), value))


def metric(cache: PrefixCache, name: str) -> float:
    return getattr(cache, name)._value.get()


def test_prefix_keys_hash_whole_prefixes():
    a, b = [5, 6, 7, 8, 9], [5, 6, 7, 1, 9]
    assert prefix_keys(a, [2, 3, 5])[:2] == prefix_keys(b, [2, 3, 5])[:2]
    assert prefix_keys(a, [5]) != prefix_keys(b, [5])
    assert prefix_keys(a, [3]) == prefix_keys(a[:3] + [42], [3])


def test_first_sight_snapshots_only_at_a_route_boundary():
    cache = PrefixCache(8, block=4, min_tokens=2)
    prompt = list(range(1, 12))
    (part,) = cache.split([prompt])
    assert part.snapshot_at is None and part.skipped == [0]  # block prefixes are new: not yet worth a copy
    (part,) = cache.split([list(range(1, 12))], boundaries=[6, 9, 40])
    # 8 was seen by the first call (a shared prefix), which beats the hint 9
    assert part.snapshot_at == 8
    (part,) = cache.split([[99] + prompt], boundaries=[3, 7])
    assert part.snapshot_at == 7  # nothing seen twice: the longest hint inside the prompt


def test_hit_starts_from_the_longest_cached_prefix_and_plans_the_next_snapshot():
    cache = PrefixCache(8, block=4, min_tokens=2)
    prompt = list(range(1, 20))
    cache.split([prompt])                       # seen
    (part,) = cache.split([prompt])             # seen twice: snapshot at the longest block below 19
    assert part.snapshot_at == 16
    cache.store(part.keys[0], fake_state(1.0))
    (part,) = cache.split([prompt[:18] + [77, 78]])
    assert part.skipped == [16] and part.prompts == [[17, 18, 77, 78]]
    assert torch.equal(part.initial_states[0].wkv, fake_state(1.0).wkv)
    assert part.snapshot_at is None              # nothing beyond 16 was seen before (20 is not < 20)
    (part,) = cache.split([prompt[:3]])          # shorter than any candidate
    assert part.skipped == [0] and part.prompts == [prompt[:3]]
    assert (metric(cache, "hits"), metric(cache, "misses"), metric(cache, "hit_tokens")) == (1, 3, 16)


def test_rows_are_grouped_by_snapshot_position():
    cache = PrefixCache(8, block=4, min_tokens=2)
    shared = list(range(1, 10))
    cache.split([shared + [50]])
    parts = cache.split([shared + [60], [200, 201, 202], shared + [70, 71, 72, 73]])
    by_rows = {tuple(p.rows): p.snapshot_at for p in parts}
    assert by_rows == {(0, 2): 8, (1,): None}
    assert [p.rows[0] for p in parts] == [0, 1]
    (part,) = cache.split([[300, 301, 302, 303, 304]] * 3)  # n choices of one new prompt: one plan
    assert part.rows == [0, 1, 2] and part.snapshot_at is None and metric(cache, "misses") == 7  # per row


def test_capacity_by_count_and_bytes_is_lru():
    cache = PrefixCache(2, block=4)
    for i in range(3):
        cache.store(bytes([i]), fake_state(float(i)))
    assert list(cache._entries) == [b"\x01", b"\x02"]
    size = fake_state(0).nbytes()
    cache = PrefixCache(f"{2 * size}B", block=4)
    cache.store(b"a", fake_state(0))
    cache.store(b"b", fake_state(1))
    cache._entries.move_to_end(b"a")  # as a hit does
    cache.store(b"c", fake_state(2))
    assert list(cache._entries) == [b"a", b"c"] and metric(cache, "bytes") == 2 * size
    cache.store(b"big", fake_state(3, n=1000))  # larger than the whole cache: not kept, nothing evicted
    assert list(cache._entries) == [b"a", b"c"] and metric(cache, "entries") == 2


def test_token_positions_never_cut_a_token():
    tokenizer = load_world_tokenizer()
    text = "System: Be brief. 你好\n\nUser: hi there\n\nAssistant: <think>\n</think>\n"
    tokens = tokenizer.encode(text)
    offsets = [len("System: Be brief. 你好"), text.index("\n\nAssistant:") + len("\n\nAssistant:"), len(text)]
    positions = token_positions(tokenizer, tokens, text, offsets)
    assert positions[-1] == len(tokens)
    for offset, n in zip(offsets, positions):
        assert text[:offset].encode().startswith(tokenizer.decode_bytes(tokens[:n]))
        assert len(tokenizer.decode_bytes(tokens[:n + 1])) > len(text[:offset].encode()) or n == len(tokens)


# ---------------------------------------------------------------------------- through the engine
@pytest.fixture(scope="module")
def model():
    return tiny_model()


def run(model, groups: list[RowGroup], cache: PrefixCache | None) -> list[RowFinished | list[int]]:
    """Per row: (sampled tokens, finish event), from a real engine thread behind an EventStream."""
    engine = Engine(ModelRunner(model, 4), load_world_tokenizer(), prefill_chunk_size=24)
    engine.start()

    async def go():
        stream = EventStream(engine, groups, cache)
        stream.submit()
        tokens: dict[int, list[int]] = {}
        finished: dict[int, RowFinished] = {}
        async for events in stream.batches():
            for e in events:
                if isinstance(e, RowText):
                    tokens.setdefault(e.index, []).append(e.token_id)
                elif isinstance(e, RowFinished):
                    finished[e.index] = e
        return [(tokens.get(i, []), finished[i]) for i in range(stream.rows)]
    try:
        return asyncio.run(go())
    finally:
        engine.shutdown()


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0),
                                      SamplingParams(temperature=1.0, top_p=0.9, seed=7)], ids=["greedy", "seeded"])
def test_hits_give_exactly_the_tokens_and_states_of_misses(model, sampling):
    tokenizer = load_world_tokenizer()
    header = tokenizer.encode("System: You are a careful assistant. Answer in one line, cite nothing.\n\n")
    prompts = [header + tokenizer.encode(f"User: question number {i}?\n\nAssistant:") for i in range(4)]
    options = GenerationOptions(max_tokens=6, sampling=sampling, keep_state=True)
    cache = PrefixCache(16, block=8, min_tokens=4)
    hinted = [len(header)]
    cached = [run(model, [RowGroup([p], options, boundaries=hinted)], cache)[0] for p in prompts]
    assert metric(cache, "hits") == 3 and metric(cache, "hit_tokens") == 3 * len(header)
    # A group whose rows plan differently (a hit that snapshots further on, a row sharing nothing)
    # runs as two engine requests; the snapshot is stored.
    entries = metric(cache, "entries")
    mixed = run(model, [RowGroup([prompts[0], tokenizer.encode("Unrelated text entirely")], options,
                                 boundaries=[len(header), len(header) + 3])], cache)
    assert metric(cache, "hits") == 4 and metric(cache, "entries") == entries + 1
    plain = [run(model, [RowGroup([p], options)], None)[0] for p in prompts]
    plain.append(run(model, [RowGroup([tokenizer.encode("Unrelated text entirely")], options)], None)[0])
    for (tokens, done), (want_tokens, want) in zip(cached + mixed[1:], plain):
        assert tokens == want_tokens
        assert (done.finish_reason, done.prompt_tokens, done.completion_tokens) == \
               (want.finish_reason, want.prompt_tokens, want.completion_tokens)
        for name in ("att_shift", "wkv", "ffn_shift"):
            assert torch.equal(getattr(done.state, name), getattr(want.state, name)), name
    assert mixed[0][0] == plain[0][0]
