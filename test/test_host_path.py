"""The host side of a decode step: the engine's flush points, the bridge's one wake-up per step,
batched metrics, the decoder's fast path and the SSE chunk encoder (bench/bench_host.py measures them)."""
from __future__ import annotations

import asyncio
import codecs
import json
import random
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from infer.api.bridge import EventStream, RowGroup
from infer.api.lightning import batch_delta_json, batch_finish_json
from infer.api.openai import ChatDelta, completion_choice_json
from infer.api.streaming import SseObjects, encode_json, sse
from infer.engine import Engine, GenerationOptions, Request, RowFinished, RowText
from infer.metrics import EngineMetrics, observe_many
from infer.model import RWKV7
from infer.random_model import make_config, random_state_dict
from infer.runner import ModelRunner, StepOutput
from infer.sampler import SamplingParams
from infer.tokenizer import IncrementalDecoder, load_world_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_world_tokenizer()


class CountingRunner:
    """Samples ``token`` for every sampled row; records the order of launches and flushes."""

    def __init__(self, token: int, slots: int = 8):
        self.num_slots, self.token, self.trace = slots, token, []

    def start_row(self, slot, params, initial=None):
        pass

    def end_row(self, slot):
        pass

    def export_state(self, slot):
        return "state"

    def step(self, rows, slots, sample, want_logprobs=False, score=None, on_launched=None):
        self.trace.append("launch")
        if on_launched is not None:
            on_launched()
        self.trace.append("sync")
        return StepOutput([self.token for s in sample if s], None, None, None)


class RunnerWithoutHook(CountingRunner):
    def step(self, rows, slots, sample, want_logprobs=False, score=None):
        return super().step(rows, slots, sample, want_logprobs, score)


def test_observe_many_matches_repeated_observe():
    a, b = EngineMetrics(), EngineMetrics()
    for value, count in [(0.0001, 3), (0.001, 2), (0.0042, 5), (0.01, 1), (0.7, 4), (100.0, 2), (60.0, 3)]:
        observe_many(a.inter_token_latency, value, count)
        for _ in range(count):
            b.inter_token_latency.observe(value)
    lines = [[line for line in generate_latest(m.registry).decode().splitlines() if "inter_token" in line
              and "_created" not in line] for m in (a, b)]
    assert lines[0] == lines[1] and any("_count 20.0" in line for line in lines[0])


@pytest.mark.parametrize("hook", [True, False])
def test_flush_points(tokenizer, hook):
    """Hooks run once the next step is launched (or before it, for a runner without on_launched),
    and when the engine goes idle; events themselves still reach a plain sink at once."""
    (token,) = tokenizer.encode(" the")
    runner = CountingRunner(token) if hook else RunnerWithoutHook(token)
    engine = Engine(runner, tokenizer)
    events = []

    def sink(event):
        events.append(event)
        engine.call_at_flush(lambda n=len(events): runner.trace.append(f"flush {n}"))

    engine.submit(Request([[5, 6]], GenerationOptions(max_tokens=2), sink))
    while engine.run_once():
        pass
    assert [type(e) for e in events] == [RowText, RowText, RowFinished]
    if hook:
        assert runner.trace == ["launch", "sync", "launch", "flush 1", "sync", "flush 2", "flush 3"]
    else:
        assert runner.trace == ["launch", "sync", "flush 1", "launch", "sync", "flush 2", "flush 3"]


def test_engine_metrics_count_every_token(tokenizer):
    (token,) = tokenizer.encode(" the")
    engine = Engine(CountingRunner(token), tokenizer)
    for _ in range(3):
        engine.submit(Request([[5, 6]], GenerationOptions(max_tokens=4), lambda e: None))
    while engine.run_once():
        pass
    value = engine.metrics.registry.get_sample_value
    assert value("rwkv_generated_tokens_total") == 12
    assert value("rwkv_time_to_first_token_seconds_count") == 3
    assert value("rwkv_inter_token_latency_seconds_count") == 9


def test_event_stream_wakes_the_loop_once_per_step(tokenizer):
    """Many streams on one loop: a handful of wake-ups per engine step, every event in order."""
    sd = random_state_dict(make_config(2, 64, 65536), seed=3, dtype=torch.float32)
    runner = ModelRunner(RWKV7.from_state_dict(sd, device="cpu"), 16)
    engine = Engine(runner, tokenizer)
    sampling = SamplingParams(temperature=1.0, top_p=0.9, seed=7, logit_bias={0: -100.0})
    options = GenerationOptions(max_tokens=12, sampling=sampling)
    wakeups = 0

    async def main():
        loop = asyncio.get_running_loop()
        plain = loop.call_soon_threadsafe

        def counting(*args, **kwargs):
            nonlocal wakeups
            wakeups += 1
            return plain(*args, **kwargs)
        loop.call_soon_threadsafe = counting
        streams = [EventStream(engine, [RowGroup([[5, 6, 7], [8]], options)]) for _ in range(6)]
        for s in streams:
            s.submit()

        async def read(stream):
            got = []
            async for events in stream.batches():
                got += events
            return got
        return await asyncio.gather(*(read(s) for s in streams))

    engine.start()
    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    for got in results:
        for index in (0, 1):
            row = [e for e in got if e.index == index]
            assert [type(e) for e in row] == [RowText] * 12 + [RowFinished]
            assert row[-1].finish_reason == "length" and row[-1].completion_tokens == 12
    assert wakeups <= engine.steps + 2  # was one per event: 6 * 2 * 13 = 156


@pytest.mark.parametrize("rows", [1, 2])
def test_a_stream_interval_wakes_the_reader_once_per_interval(tokenizer, rows):
    """--stream-interval 3: the reader gets the first tokens at once, then every 3 tokens a row, and any
    other event (a row's end) at once with what is held."""
    engine = Engine(CountingRunner(1), tokenizer)  # never run: the events are delivered by hand, as drains do

    async def main():
        stream = EventStream(engine, [RowGroup([[5, 6]] * rows, GenerationOptions(max_tokens=50))], interval=3)
        batches = []

        async def reader():
            async for events in stream.batches():
                batches.append(events)
        task = asyncio.ensure_future(reader())

        async def deliver(*events) -> int:  # one engine step's events; how many batches the reader has had
            for event in events:
                stream._deliver(0, event)
            for _ in range(3):
                await asyncio.sleep(0)
            return len(batches)

        def step(i):
            return [RowText(r, f"<{i}>", 7) for r in range(rows)]
        assert await deliver(*step(0)) == 1 and len(batches[0]) == rows  # the first tokens at once
        assert await deliver(*step(1)) == 1 and await deliver(*step(2)) == 1  # held
        assert await deliver(*step(3)) == 2 and [e.text for e in batches[1]] == [e.text for i in (1, 2, 3)
                                                                                 for e in step(i)]
        assert await deliver(*step(4)) == 2
        ends = [RowFinished(r, "length", 2, 5) for r in range(rows)]
        assert await deliver(*ends) == 3 and batches[2] == step(4) + ends  # the end at once, with what was held
        await task
    asyncio.run(main())


def test_a_stream_interval_changes_no_event(tokenizer):
    (token,) = tokenizer.encode(" the")

    def read(interval: int) -> list:
        engine = Engine(CountingRunner(token), tokenizer)

        async def main():
            stream = EventStream(engine, [RowGroup([[5, 6], [7]], GenerationOptions(max_tokens=11))],
                                 interval=interval)
            stream.submit()
            events = []

            async def reader():
                async for batch in stream.batches():
                    events.extend(batch)
            task = asyncio.ensure_future(reader())
            while not task.done():
                engine.run_once()
                for _ in range(5):
                    await asyncio.sleep(0)
            return events
        return asyncio.run(main())
    assert read(4) == read(1)


def test_a_stream_interval_below_one_is_refused(tokenizer):
    async def make():
        EventStream(Engine(CountingRunner(1), tokenizer), [RowGroup([[5]], GenerationOptions())], interval=0)
    with pytest.raises(ValueError, match="interval"):
        asyncio.run(make())


def test_event_stream_on_a_closed_loop_cancels_the_request(tokenizer):
    (token,) = tokenizer.encode(" the")
    engine = Engine(CountingRunner(token), tokenizer)
    loop = asyncio.new_event_loop()

    async def make():
        stream = EventStream(engine, [RowGroup([[5, 6]], GenerationOptions(max_tokens=50))])
        stream.submit()
        return stream
    stream = loop.run_until_complete(make())
    loop.close()
    for _ in range(4):
        engine.run_once()
    assert stream.requests[0].cancelled
    assert not engine.run_once() and engine.running_rows == 0


def test_incremental_decoder_fast_path_matches_the_codec(tokenizer):
    rng = random.Random(5)
    partial = [i for i in range(1, 65530) if i not in tokenizer.token_texts]
    assert 200 < len(partial) < 1000  # single bytes >= 0x80 and cut characters
    pool = partial + list(range(1, 3000)) + [0]
    for _ in range(500):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 20))]
        fast, plain = IncrementalDecoder(tokenizer), codecs.getincrementaldecoder("utf-8")(errors="replace")
        assert [fast.push(i) for i in ids] == [plain.decode(tokenizer.decode_bytes([i])) for i in ids]
        assert fast.flush() == plain.decode(b"", final=True)
    with pytest.raises(ValueError):
        IncrementalDecoder(tokenizer).push(70000)


@pytest.mark.parametrize("tail", [None, {}, {"usage": None}, {"usage": None, "x": [1, "\u4f60"]}])
@pytest.mark.parametrize("head", [{}, {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m\u00e9"}])
def test_sse_objects_match_sse(head, tail):
    chunk = SseObjects(head, "choices", tail)
    for value in ([], [{"index": 0, "text": "h\u00e9 \"x\"\n\u2028", "logprobs": None, "finish_reason": None}], None):
        text = chunk(value)
        assert text == sse({**head, "choices": value, **(tail or {})})
        if value is not None:
            assert chunk.encoded_array(encode_json(item) for item in value) == text
        assert json.loads(text.removeprefix("data: ")) == {**head, "choices": value, **(tail or {})}
    with pytest.raises(ValueError):
        SseObjects({"choices": 1}, "choices")


# Texts with what JSON escapes (quotes, backslashes, control characters), what it passes through raw (non-ASCII,
# U+2028), and lone surrogates (a cut pair in a token's bytes never reaches here, but the encoders agree on them too).
JSON_TEXT = st.text(st.characters(codec=None, categories=None), max_size=12) | st.sampled_from(
    ["", "\"", "\\", "\n\t\x00\x1f\x7f", "h\u00e9 \u2028\u4f60", "\ud800", "\U0001f600"])
LOGPROB_ENTRIES = st.lists(st.fixed_dictionaries({"token": JSON_TEXT, "logprob": st.floats(-50, 0),
                                                  "bytes": st.lists(st.integers(0, 255), max_size=3)}), max_size=2)


@settings(max_examples=300, deadline=None)
@given(index=st.integers(0, 127), text=JSON_TEXT, reason=st.sampled_from([None, "stop", "length"]),
       logprobs=st.none() | st.fixed_dictionaries({"tokens": st.lists(JSON_TEXT, max_size=2),
                                                   "token_logprobs": st.lists(st.floats(-50, 0), max_size=2)}))
def test_completion_choice_json_is_the_encoders_text(index, text, reason, logprobs):
    """The streamed /v1/completions choice written out by hand is encode_json's text of the same fields."""
    want = encode_json({"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason})
    assert completion_choice_json(index, text, logprobs, reason) == want


@settings(max_examples=300, deadline=None)
@given(index=st.integers(0, 127), reasoning=JSON_TEXT, content=JSON_TEXT, logprobs=LOGPROB_ENTRIES)
def test_chat_delta_choice_json_is_the_encoders_text(index, reasoning, content, logprobs):
    """A streamed chat choice written out by hand is encode_json's text of the OpenAI chunk's choice (the non-empty
    texts in the delta, logprobs as {"content": [...]} or null), and nothing when the delta shows nothing."""
    delta = {k: v for k, v in (("reasoning_content", reasoning), ("content", content)) if v}
    got = ChatDelta(reasoning, content, logprobs).choice_json(index)
    if not delta and not logprobs:
        assert got is None
    else:
        assert got == encode_json({"index": index, "delta": delta,
                                   "logprobs": {"content": logprobs} if logprobs else None, "finish_reason": None})


@settings(max_examples=300, deadline=None)
@given(index=st.integers(0, 4095), text=JSON_TEXT, reason=st.sampled_from(["stop", "length", "error"]))
def test_batch_stream_json_is_the_encoders_text(index, text, reason):
    """The lightning batch stream's row delta and finish chunk written out by hand are encode_json's text."""
    assert batch_delta_json(index, text) == encode_json({"index": index, "delta": {"content": text}})
    assert batch_finish_json(index, reason) == encode_json({"index": index, "delta": {}, "finish_reason": reason})


def test_model_runner_calls_on_launched_once_before_a_cpu_forward():
    sd = random_state_dict(make_config(2, 64, 1024), seed=3, dtype=torch.float32)
    runner = ModelRunner(RWKV7.from_state_dict(sd, device="cpu"), 4)
    for slot in (0, 1):
        runner.start_row(slot, SamplingParams(temperature=0))
    calls = []
    out = runner.step([[1, 2], [3]], [0, 1], [True, False], on_launched=lambda: calls.append(1))
    assert calls == [1] and len(out.tokens) == 1
    out = runner.step([[4]], [0], [False], on_launched=lambda: calls.append(2))
    assert calls == [1, 2] and out.tokens == []
    out = runner.step([[5, 6]], [1], [True], score={0: ([6], 2)}, on_launched=lambda: calls.append(3))
    assert calls == [1, 2, 3] and len(out.scores[0]) == 1


def test_worker_thread_delivers_final_events_on_shutdown(tokenizer):
    """Events still waiting for a flush when the worker stops are handed over."""
    (token,) = tokenizer.encode(" the")
    engine = Engine(CountingRunner(token), tokenizer)
    done = threading.Event()
    flushed = []

    def sink(event):
        engine.call_at_flush(lambda: flushed.append(event))
        if isinstance(event, RowFinished):
            done.set()
    engine.submit(Request([[5]], GenerationOptions(max_tokens=3), sink))
    engine.start()
    assert done.wait(10)
    engine.shutdown()
    assert [type(e) for e in flushed] == [RowText, RowText, RowText, RowFinished]
