"""The engine on CPU with a tiny random model: continuous batching, stops, cancellation, backpressure.

Most tests drive the engine with ``run_once`` (no thread) so joins happen at known steps.
"""
from __future__ import annotations

import threading

import pytest
import torch

from infer.engine import Engine, GenerationOptions, Phase, QueueFullError, Request, RowFinished, RowText
from infer.model import RWKV7
from infer.random_model import make_config, random_state_dict
from infer.runner import ModelRunner
from infer.sampler import SamplingParams
from infer.tokenizer import load_world_tokenizer

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def model():
    sd = random_state_dict(make_config(2, 128, 65536), seed=21, dtype=torch.float32)
    return RWKV7.from_state_dict(sd, device="cpu")


@pytest.fixture(scope="module")
def tokenizer():
    return load_world_tokenizer()


def make_engine(model, tokenizer, slots=8, chunk=16, queue=64, decode_ahead=False, step_tokens=None) -> Engine:
    return Engine(ModelRunner(model, slots), tokenizer, prefill_chunk_size=chunk, max_queued_requests=queue,
                  decode_ahead=decode_ahead, prefill_step_tokens=step_tokens)


class Collector:
    def __init__(self):
        self.events = []
        self.done = threading.Event()
        self.request: Request | None = None

    def __call__(self, event):
        self.events.append(event)
        if isinstance(event, RowFinished) and self.request.unfinished == 0:
            self.done.set()

    def text(self, index=0) -> str:
        return "".join(e.text for e in self.events if e.index == index)

    def tokens(self, index=0) -> list[int]:
        return [e.token_id for e in self.events if isinstance(e, RowText) and e.index == index]

    def finished(self, index=0) -> RowFinished:
        return next(e for e in self.events if isinstance(e, RowFinished) and e.index == index)


def submit(engine, prompts, **options) -> Collector:
    c = Collector()
    c.request = Request(prompts, GenerationOptions(**options), c)
    engine.submit(c.request)
    return c


def drain(engine, *collectors, limit=2000):
    for _ in range(limit):
        if all(c.done.is_set() for c in collectors):
            return
        engine.run_once()
    raise AssertionError("engine did not finish")


def run_alone(model, tokenizer, prompt, **options) -> Collector:
    engine = make_engine(model, tokenizer)
    c = submit(engine, [prompt], **options)
    drain(engine, c)
    return c


PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away, there lived",
           "def main():\n    print(", "你好，世界", "1, 2, 3, 4, 5,"]


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7,
                                                             alpha_presence=0.5, alpha_frequency=0.2,
                                                             alpha_decay=0.99)])
def test_batch_invariance_with_staggered_joins(model, tokenizer, sampling):
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    alone = [run_alone(model, tokenizer, p, max_tokens=12, sampling=sampling).tokens() for p in prompts]
    engine = make_engine(model, tokenizer, slots=4, chunk=5)
    collectors = []
    for i, p in enumerate(prompts):  # join one by one, at different steps, some while others decode
        collectors.append(submit(engine, [p], max_tokens=12, sampling=sampling))
        for _ in range(i + 1):
            engine.run_once()
    drain(engine, *collectors)
    assert [c.tokens() for c in collectors] == alone
    assert all(len(t) == 12 for t in alone)


def test_one_request_many_rows_equals_separate_requests(model, tokenizer):
    prompts = [tokenizer.encode(p) for p in PROMPTS[:3]]
    engine = make_engine(model, tokenizer)
    c = submit(engine, prompts, max_tokens=8, sampling=GREEDY)
    drain(engine, c)
    for i, p in enumerate(prompts):
        assert c.tokens(i) == run_alone(model, tokenizer, p, max_tokens=8, sampling=GREEDY).tokens()


def test_long_prompt_is_chunked_and_streams_keep_flowing(model, tokenizer):
    engine = make_engine(model, tokenizer, chunk=8)
    streaming = submit(engine, [tokenizer.encode("Hello")], max_tokens=40, sampling=GREEDY)
    engine.run_once()
    engine.run_once()
    long_prompt = tokenizer.encode("A long document. " * 30)
    assert len(long_prompt) > 60
    late = submit(engine, [long_prompt], max_tokens=5, sampling=GREEDY)
    before = len(streaming.tokens())
    steps = 0
    while not late.tokens():
        engine.run_once()
        steps += 1
        assert len(streaming.tokens()) == before + steps, "a running stream missed a step"
    assert steps == -(-len(long_prompt) // 8)  # ceil: one chunk of 8 prompt tokens per step
    drain(engine, streaming, late)
    assert late.tokens() == run_alone(model, tokenizer, long_prompt, max_tokens=5, sampling=GREEDY).tokens()


def test_short_prompts_are_fed_whole_up_to_the_step_budget(model, tokenizer):
    prompts = [tokenizer.encode(p) for p in ["One two", "Three four", "Five six", "Seven eight", "Nine ten"]]
    sizes = [len(p) for p in prompts]
    assert max(sizes) <= 4 and sum(sizes[:4]) <= 8 < sum(sizes)
    engine = make_engine(model, tokenizer, chunk=4, step_tokens=8)
    collectors = [submit(engine, [p], max_tokens=6, sampling=GREEDY) for p in prompts]
    engine.run_once()
    assert [len(c.tokens()) for c in collectors] == [1, 1, 1, 1, 0]  # the fifth is over the step's 8 tokens
    engine.run_once()
    assert [len(c.tokens()) for c in collectors] == [2, 2, 2, 2, 1]
    drain(engine, *collectors)
    assert [c.tokens() for c in collectors] == [run_alone(model, tokenizer, p, max_tokens=6, sampling=GREEDY).tokens()
                                                for p in prompts]


def test_prompts_that_do_not_end_in_a_step_share_one_chunk(model, tokenizer):
    """While a stream decodes, two long prompts get at most 4 tokens a step between them for the
    pieces that do not end their prompt (not 4 each, not the step's 16), while a short prompt
    arriving meanwhile is fed whole in one step."""
    long_prompts = [tokenizer.encode("A long document. " * 4), tokenizer.encode("Another long text here. " * 3)]
    assert min(len(p) for p in long_prompts) > 8
    engine = make_engine(model, tokenizer, chunk=4, step_tokens=16)
    streaming = submit(engine, [tokenizer.encode("Hello")], max_tokens=60, sampling=GREEDY)
    engine.run_once()
    engine.run_once()
    late = [submit(engine, [p], max_tokens=4, sampling=GREEDY) for p in long_prompts]
    short_prompt = tokenizer.encode("Hello there")
    assert 1 < len(short_prompt) <= 4
    short = None
    fed = []  # per step: prompt tokens fed to rows whose prompt did not end in it
    while not all(c.tokens() for c in late):
        before = {row: row.pos for row in engine._running if row.phase is Phase.PREFILL}
        engine.run_once()
        fed.append(sum(row.pos - pos for row, pos in before.items() if row.pos < len(row.feed)))
        if len(fed) == 1:
            short = submit(engine, [short_prompt], max_tokens=4, sampling=GREEDY)
        elif len(fed) == 2:
            assert short.tokens(), "a short prompt waited behind the long ones"
    assert max(fed) == 4 and fed.count(4) >= len(fed) - 2, fed
    assert not streaming.done.is_set()
    drain(engine, short, streaming, *late)
    for c, p in zip(late, long_prompts):
        assert c.tokens() == run_alone(model, tokenizer, p, max_tokens=4, sampling=GREEDY).tokens()


def test_a_prompt_with_no_stream_to_hold_up_takes_the_step_budget(model, tokenizer):
    """No row decodes: a long prompt is fed 16 tokens a step (the step's budget), not the chunk of 4;
    once a row decodes, the next long prompt goes 4 a step."""
    first, second = tokenizer.encode("A long document. " * 9), tokenizer.encode("Another long text here. " * 4)
    assert min(len(first), len(second)) > 16
    engine = make_engine(model, tokenizer, chunk=4, step_tokens=16)

    def steps_to_first_token(c: Collector) -> int:
        steps = 0
        while not c.tokens():
            engine.run_once()
            steps += 1
        return steps
    alone = submit(engine, [first], max_tokens=30, sampling=GREEDY)
    assert steps_to_first_token(alone) == -(-len(first) // 16)
    joined = submit(engine, [second], max_tokens=4, sampling=GREEDY)
    assert steps_to_first_token(joined) == -(-len(second) // 4)
    drain(engine, alone, joined)
    assert alone.tokens() == run_alone(model, tokenizer, first, max_tokens=30, sampling=GREEDY).tokens()
    assert joined.tokens() == run_alone(model, tokenizer, second, max_tokens=4, sampling=GREEDY).tokens()


def test_a_short_prompt_is_not_kept_behind_a_long_one(model, tokenizer):
    """A long prompt alone takes the whole step budget; a short prompt arriving meanwhile is fed
    first (whole) and gets its first token after one step, and from then on the long prompt goes
    one chunk a step."""
    long_prompt, short_prompt = tokenizer.encode("A long document. " * 9), tokenizer.encode("Hello there")
    engine = make_engine(model, tokenizer, chunk=4, step_tokens=16)
    late = submit(engine, [long_prompt], max_tokens=4, sampling=GREEDY)
    engine.run_once()
    short = submit(engine, [short_prompt], max_tokens=8, sampling=GREEDY)
    row = next(r for r in engine._running if r.request is late.request)
    before = row.pos
    engine.run_once()
    assert len(short.tokens()) == 1 and row.pos - before == 16 - len(short_prompt)
    before = row.pos
    engine.run_once()
    assert row.pos - before == 4
    drain(engine, late, short)
    assert late.tokens() == run_alone(model, tokenizer, long_prompt, max_tokens=4, sampling=GREEDY).tokens()
    assert short.tokens() == run_alone(model, tokenizer, short_prompt, max_tokens=8, sampling=GREEDY).tokens()


def reference_output(model, tokenizer, prompt, n=40):
    c = run_alone(model, tokenizer, prompt, max_tokens=n, sampling=GREEDY)
    return c.tokens(), c.text()


def test_finish_length_and_counts(model, tokenizer):
    prompt = tokenizer.encode("Count:")
    c = run_alone(model, tokenizer, prompt, max_tokens=9, sampling=GREEDY)
    done = c.finished()
    assert (done.finish_reason, done.completion_tokens, done.prompt_tokens) == ("length", 9, len(prompt))
    assert c.text() == tokenizer.decode(c.tokens())


def test_long_stop_string_across_many_tokens(model, tokenizer):
    prompt = tokenizer.encode("Stop test")
    tokens, text = reference_output(model, tokenizer, prompt)
    pieces = [tokenizer.decode([t]) for t in tokens]
    start = len("".join(pieces[:5]))
    stop = "".join(pieces[5:17])  # 12 tokens long
    assert len(tokenizer.encode(stop)) > 10
    c = run_alone(model, tokenizer, prompt, max_tokens=40, sampling=GREEDY, stop=[stop])
    assert c.text() == text[:start]
    assert c.finished().finish_reason == "stop" and c.finished().matched_stop == stop
    assert c.finished().completion_tokens == 17


def test_stop_string_ending_mid_token(model, tokenizer):
    prompt = tokenizer.encode("Mid token")
    tokens, text = reference_output(model, tokenizer, prompt)
    pieces = [tokenizer.decode([t]) for t in tokens]
    k = next(i for i in range(3, len(pieces)) if len(pieces[i]) >= 3)  # a multi-character token
    begin = len("".join(pieces[:k - 1]))
    stop = text[begin: len("".join(pieces[:k])) + 1]  # from token k-1 into the first char of token k
    c = run_alone(model, tokenizer, prompt, max_tokens=40, sampling=GREEDY, stop=[stop])
    assert c.text() == text[:begin]
    assert c.finished().completion_tokens == k + 1


def test_stop_string_not_generated_never_truncates(model, tokenizer):
    prompt = tokenizer.encode("No stop")
    tokens, text = reference_output(model, tokenizer, prompt, n=20)
    c = run_alone(model, tokenizer, prompt, max_tokens=20, sampling=GREEDY, stop=["\u2603never-appears\u2603"])
    assert c.text() == text and c.finished().finish_reason == "length"


def test_stop_token_ids_and_end_of_document(model, tokenizer):
    prompt = tokenizer.encode("Token stops")
    tokens, text = reference_output(model, tokenizer, prompt, n=20)
    c = run_alone(model, tokenizer, prompt, max_tokens=20, sampling=GREEDY, stop_token_ids=[tokens[6]])
    assert c.tokens() == tokens[:6] and c.finished().matched_stop == tokens[6]
    assert c.finished().completion_tokens == 7
    eod = run_alone(model, tokenizer, prompt, max_tokens=20,
                    sampling=SamplingParams(temperature=0, logit_bias={0: 1000.0}))
    assert eod.tokens() == [] and eod.finished().finish_reason == "stop" and eod.finished().matched_stop == 0


def test_seeded_sampling_is_reproducible(model, tokenizer):
    prompt = tokenizer.encode("Random words:")
    sampling = lambda seed: SamplingParams(temperature=1.0, seed=seed)  # noqa: E731
    a = run_alone(model, tokenizer, prompt, max_tokens=16, sampling=sampling(1)).tokens()
    b = run_alone(model, tokenizer, prompt, max_tokens=16, sampling=sampling(1)).tokens()
    c = run_alone(model, tokenizer, prompt, max_tokens=16, sampling=sampling(2)).tokens()
    assert a == b and a != c


def test_cancel_while_queued(model, tokenizer):
    engine = make_engine(model, tokenizer, slots=1)
    running = submit(engine, [tokenizer.encode("first")], max_tokens=50, sampling=GREEDY)
    engine.run_once()
    queued = submit(engine, [tokenizer.encode("second")], max_tokens=5)
    engine.run_once()
    assert engine.queued_requests == 1
    engine.cancel(queued.request)
    engine.run_once()
    assert queued.finished().finish_reason == "cancelled" and engine.queued_requests == 0
    assert not running.done.is_set()


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_cancel_frees_the_slot_within_one_step(model, tokenizer, phase):
    engine = make_engine(model, tokenizer, slots=2, chunk=4)
    c = submit(engine, [tokenizer.encode("x " * 40)], max_tokens=100, sampling=GREEDY)
    engine.run_once()
    if phase == "decode":
        while not c.tokens():
            engine.run_once()
    assert engine.free_slots == 1
    steps = engine.steps
    engine.cancel(c.request)
    engine.run_once()
    assert engine.free_slots == 2 and engine.running_rows == 0
    assert engine.steps == steps, "no model work may run for a cancelled row"
    assert c.finished().finish_reason == "cancelled"


def test_queue_full_is_rejected(model, tokenizer):
    engine = make_engine(model, tokenizer, slots=1, queue=2)
    submit(engine, [[1]], max_tokens=5)
    submit(engine, [[2]], max_tokens=5)
    with pytest.raises(QueueFullError):
        submit(engine, [[3]], max_tokens=5)
    engine.run_once()  # one admitted: room again
    submit(engine, [[4]], max_tokens=5)


def test_small_request_not_blocked_behind_large_one(model, tokenizer):
    engine = make_engine(model, tokenizer, slots=2)
    big = submit(engine, [[5, 6]] * 6, max_tokens=30, sampling=GREEDY)
    small = submit(engine, [[7, 8]], max_tokens=2, sampling=GREEDY)
    for _ in range(40):
        engine.run_once()
        if small.done.is_set():
            break
    assert small.done.is_set() and not big.done.is_set()


def state_after(model, tokens):
    pool = model.new_state_pool(1)
    model.prefill([tokens], [0], pool)
    return pool.export_slot(0)


def assert_same_state(a, b, tol=1e-5):
    assert all((x - y).abs().max().item() <= tol for x, y in zip(a.to_official(), b.to_official()))


def test_kept_state_ends_where_visible_text_ends(model, tokenizer):
    prompt = tokenizer.encode("State test")
    tokens, text = reference_output(model, tokenizer, prompt)
    pieces = [tokenizer.decode([t]) for t in tokens]
    # length finish: state includes every generated token
    c = run_alone(model, tokenizer, prompt, max_tokens=6, sampling=GREEDY, keep_state=True)
    assert_same_state(c.finished().state, state_after(model, prompt + tokens[:6]))
    # stop string on a token boundary: state excludes the stop string's tokens
    stop = "".join(pieces[8:11])
    c = run_alone(model, tokenizer, prompt, max_tokens=40, sampling=GREEDY, stop=[stop], keep_state=True)
    assert c.text() == "".join(pieces[:8])
    assert_same_state(c.finished().state, state_after(model, prompt + tokens[:8]))
    # stop token: not part of the state
    c = run_alone(model, tokenizer, prompt, max_tokens=40, sampling=GREEDY, stop_token_ids=[tokens[4]],
                  keep_state=True)
    assert_same_state(c.finished().state, state_after(model, prompt + tokens[:4]))


def test_kept_state_with_stop_inside_a_token(model, tokenizer):
    prompt = tokenizer.encode("State test two")
    tokens, text = reference_output(model, tokenizer, prompt)
    pieces = [tokenizer.decode([t]) for t in tokens]
    k = next(i for i in range(3, len(pieces)) if len(pieces[i]) >= 3)
    visible = "".join(pieces[:k]) + pieces[k][:1]     # stop begins after the first char of token k
    stop = pieces[k][1:] + "".join(pieces[k + 1:k + 3])
    c = run_alone(model, tokenizer, prompt, max_tokens=40, sampling=GREEDY, stop=[stop], keep_state=True)
    assert c.text() == visible
    want = state_after(model, prompt + tokens[:k] + tokenizer.encode(pieces[k][:1]))
    assert_same_state(c.finished().state, want)


def test_worker_thread_serves_concurrent_requests(model, tokenizer):
    engine = make_engine(model, tokenizer)
    engine.start()
    try:
        collectors = [submit(engine, [tokenizer.encode(p)], max_tokens=10, sampling=GREEDY) for p in PROMPTS]
        for c in collectors:
            assert c.done.wait(30)
        assert [c.tokens() for c in collectors] == [run_alone(model, tokenizer, tokenizer.encode(p), max_tokens=10,
                                                              sampling=GREEDY).tokens() for p in PROMPTS]
    finally:
        engine.shutdown()
    text = engine.metrics.registry.get_sample_value("rwkv_generated_tokens_total")
    assert text == 50
    assert engine.metrics.registry.get_sample_value("rwkv_time_to_first_token_seconds_count") == 5


@pytest.mark.parametrize("chunk", [3, 64])
def test_prompt_logprobs_match_log_softmax(model, tokenizer, chunk):
    from infer.engine import PromptLogprobs
    prompt = tokenizer.encode("Scoring a prompt with logprobs, chunked or not.")
    engine = make_engine(model, tokenizer, chunk=chunk)
    c = submit(engine, [prompt], max_tokens=0, prompt_logprobs=3)
    drain(engine, c)
    (scored,) = [e for e in c.events if isinstance(e, PromptLogprobs)]
    assert c.finished().finish_reason == "length" and c.finished().completion_tokens == 0
    assert scored.entries[0] is None and len(scored.entries) == len(prompt)
    logp = torch.log_softmax(model.prefill([prompt], [0], model.new_state_pool(1), all_logits=True), -1)
    for j in range(1, len(prompt)):
        entry = scored.entries[j]
        assert entry.token_id == prompt[j]
        assert abs(entry.logprob - logp[j - 1, prompt[j]].item()) < 1e-4
        assert [t for t, _ in entry.top] == logp[j - 1].topk(3).indices.tolist()


def test_state_snapshot_inside_the_prompt(model, tokenizer):
    from infer.engine import StateSnapshot
    prompt = tokenizer.encode("A system prompt that many requests share. Then the user's own question?")
    at = len(prompt) // 2
    engine = make_engine(model, tokenizer, chunk=5)
    c = submit(engine, [prompt], max_tokens=4, sampling=GREEDY, snapshot_at=at)
    drain(engine, c)
    (snap,) = [e for e in c.events if isinstance(e, StateSnapshot)]
    assert snap.position == at
    assert_same_state(snap.state, state_after(model, prompt[:at]), tol=0)
    # resuming from the snapshot with the rest of the prompt gives the same tokens
    resumed = Collector()
    resumed.request = Request([prompt[at:]], GenerationOptions(max_tokens=4, sampling=GREEDY), resumed,
                              initial_states=[snap.state])
    engine.submit(resumed.request)
    drain(engine, resumed)
    assert resumed.tokens() == c.tokens()
    with pytest.raises(ValueError):
        Request([prompt], GenerationOptions(snapshot_at=len(prompt)), lambda e: None)


def test_stop_token_reports_its_logprob(model, tokenizer):
    prompt = tokenizer.encode("Token stops")
    tokens, _ = reference_output(model, tokenizer, prompt, n=8)
    c = run_alone(model, tokenizer, prompt, max_tokens=8, sampling=GREEDY, stop_token_ids=[tokens[3]], logprobs=True)
    done = c.finished()
    assert done.logprob is not None and done.logprob.token_id == tokens[3]
    assert all(e.logprob is not None for e in c.events if isinstance(e, RowText))
    assert done.logprob.logprob <= 0


def test_is_running_tracks_the_worker(model, tokenizer):
    engine = make_engine(model, tokenizer)
    assert not engine.is_running
    engine.start()
    assert engine.is_running
    engine.shutdown()
    assert not engine.is_running


class ScriptedRunner:
    """Samples a fixed token script; records what is fed, for testing the engine's bookkeeping."""

    num_slots = 2

    def __init__(self, script):
        self.script = list(script)
        self.fed: list[list[int]] = []
        self.imports = 0

    def start_row(self, slot, params, initial=None):
        self.imports += initial is not None

    def end_row(self, slot):
        pass

    def export_state(self, slot):
        return "state"

    def step(self, rows, slots, sample, want_logprobs=False, score=None):
        from infer.runner import StepOutput
        self.fed += [list(r) for r in rows]
        return StepOutput([self.script.pop(0) for s in sample if s], None, None, None)


def test_kept_state_keeps_invalid_byte_tokens_as_sampled(tokenizer):
    """A reply with invalid UTF-8 (shown as U+FFFD) before a stop string: the state keeps the
    model's own tokens, it is not rebuilt from the replacement character's bytes."""
    hello, world, bang = tokenizer.encode("Hello"), tokenizer.encode(" world"), tokenizer.encode("!!")
    assert len(hello) == len(world) == len(bang) == 1
    invalid = 0xFF + 1  # the single byte 0xFF: never valid UTF-8
    runner = ScriptedRunner([hello[0], invalid, world[0], bang[0]])
    engine = Engine(runner, tokenizer, prefill_chunk_size=16)
    c = submit(engine, [[5, 6]], max_tokens=10, stop=["!!"], keep_state=True)
    drain(engine, c)
    assert c.text() == "Hello\ufffd world" and c.finished().finish_reason == "stop"
    assert runner.fed == [[5, 6], [hello[0]], [invalid], [world[0]]]  # no replay was needed
    assert runner.imports == 0 and c.finished().state == "state"


def test_visible_byte_count():
    from infer.engine import visible_byte_count
    raw = "Hello 你好".encode() + b"\xff" + b" x"
    assert visible_byte_count(raw, 0) == 0
    assert visible_byte_count(raw, 6) == 6            # "Hello "
    assert visible_byte_count(raw, 7) == 9            # + 你 (3 bytes)
    assert visible_byte_count(raw, 9) == 13           # + 好 + the invalid byte shown as U+FFFD
    assert visible_byte_count(b"\xe4A", 1) == 1       # an incomplete character cut before the next one
    assert visible_byte_count(raw, 99) == len(raw)


# ---------------------------------------------------------------- decode ahead (next step queued before reading)
def outcome(c: Collector, rows=1) -> list:
    """Per row: tokens, text, (finish reason, completion tokens, matched stop), logprobs."""
    result = []
    for i in range(rows):
        done = c.finished(i)
        lps = [e.logprob for e in c.events if isinstance(e, RowText) and e.index == i and e.logprob is not None]
        result.append((c.tokens(i), c.text(i), (done.finish_reason, done.completion_tokens, done.matched_stop),
                       [(lp.token_id, round(lp.logprob, 4), [t for t, _ in lp.top]) for lp in lps]))
    return result


def mixed_requests(model, tokenizer, decode_ahead):
    """Five requests of different options joining at different steps on 4 slots (one waits for a slot)."""
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    greedy = reference_output(model, tokenizer, prompts[3], n=16)[0]
    stop = "".join(tokenizer.decode([t]) for t in greedy[6:8])
    sampled = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, alpha_presence=0.5, alpha_frequency=0.2,
                             alpha_decay=0.99)
    options = [dict(max_tokens=12, sampling=GREEDY),
               dict(max_tokens=20, sampling=sampled, logprobs=True),
               dict(max_tokens=30, sampling=SamplingParams(temperature=0.8, seed=3, logprobs=3), logprobs=True),
               dict(max_tokens=16, sampling=GREEDY, stop=[stop]),
               dict(max_tokens=25, sampling=SamplingParams(temperature=1.2, seed=11), stop_token_ids=[0])]
    engine = make_engine(model, tokenizer, slots=4, chunk=6, decode_ahead=decode_ahead)
    collectors = []
    for i, (p, o) in enumerate(zip(prompts, options)):
        collectors.append(submit(engine, [p], **o))
        for _ in range(2 * i + 1):
            engine.run_once()
    drain(engine, *collectors)
    return [outcome(c) for c in collectors], engine


def test_decode_ahead_gives_the_same_outputs(model, tokenizer):
    ahead, engine = mixed_requests(model, tokenizer, decode_ahead=True)
    plain, plain_engine = mixed_requests(model, tokenizer, decode_ahead=False)
    assert ahead == plain
    assert engine.steps_ahead > 10 and plain_engine.steps_ahead == 0
    from prometheus_client import generate_latest
    exposed = generate_latest(engine.metrics.registry).decode()
    assert f"rwkv_decode_steps_ahead_total {float(engine.steps_ahead)}" in exposed  # what /metrics serves
    reasons = [rows[0][2][0] for rows in plain]
    assert reasons.count("length") >= 2 and "stop" in reasons  # the stop string ends row 3 early
    assert engine.free_slots == 4 and engine.running_rows == 0


def test_decode_ahead_admits_a_new_request_at_once(model, tokenizer):
    engine = make_engine(model, tokenizer, slots=2, decode_ahead=True)
    first = submit(engine, [tokenizer.encode("Hello")], max_tokens=30, sampling=GREEDY)
    for _ in range(4):
        engine.run_once()
    assert engine.steps_ahead > 0
    late_prompt = tokenizer.encode("The capital of France")
    late = submit(engine, [late_prompt], max_tokens=6, sampling=GREEDY)
    engine.run_once()  # reads the step queued ahead; the late request takes the free slot
    assert engine.running_rows == 2
    ahead = engine.steps_ahead
    engine.run_once()  # its prompt: nothing runs ahead while a row prefills
    assert engine.steps_ahead == ahead and late.tokens()
    drain(engine, first, late)
    assert late.tokens() == run_alone(model, tokenizer, late_prompt, max_tokens=6, sampling=GREEDY).tokens()
    assert first.tokens() == run_alone(model, tokenizer, tokenizer.encode("Hello"), max_tokens=30,
                                       sampling=GREEDY).tokens()


def test_decode_ahead_skips_rows_that_keep_their_state(model, tokenizer):
    prompt = tokenizer.encode("State test")
    tokens, _ = reference_output(model, tokenizer, prompt)
    engine = make_engine(model, tokenizer, decode_ahead=True)
    kept = submit(engine, [prompt], max_tokens=6, sampling=GREEDY, keep_state=True)
    other = submit(engine, [tokenizer.encode("Hello")], max_tokens=12, sampling=GREEDY)
    while not kept.done.is_set():
        engine.run_once()
    assert engine.steps_ahead == 0, "a row that keeps its state must never be fed past its end"
    assert_same_state(kept.finished().state, state_after(model, prompt + tokens[:6]))
    drain(engine, other)
    assert engine.steps_ahead > 0  # once alone, the other row runs ahead
    assert other.tokens() == run_alone(model, tokenizer, tokenizer.encode("Hello"), max_tokens=12,
                                       sampling=GREEDY).tokens()


def test_decode_ahead_cancel_drops_the_queued_step(model, tokenizer):
    engine = make_engine(model, tokenizer, slots=2, decode_ahead=True)
    keep = submit(engine, [tokenizer.encode("Hello")], max_tokens=20, sampling=GREEDY)
    gone = submit(engine, [tokenizer.encode("The quick brown fox")], max_tokens=50, sampling=GREEDY)
    while len(gone.tokens()) < 3 or engine.steps_ahead == 0:
        engine.run_once()
    engine.cancel(gone.request)
    engine.run_once()
    assert gone.finished().finish_reason == "cancelled" and engine.free_slots == 1
    emitted = len(gone.tokens())
    drain(engine, keep)
    assert len(gone.tokens()) == emitted, "a cancelled row got tokens from a step queued ahead"
    assert keep.tokens() == run_alone(model, tokenizer, tokenizer.encode("Hello"), max_tokens=20,
                                      sampling=GREEDY).tokens()
    assert engine.free_slots == 2


def test_decode_ahead_never_feeds_a_slot_handed_to_a_new_row(model, tokenizer):
    """A row ends while its slot's next step is queued; a waiting request takes the slot. The queued step's rows
    then number as many as the running ones, but the step must not run ahead again with the finished row's slot."""
    engine = make_engine(model, tokenizer, slots=2, decode_ahead=True)
    short = submit(engine, [tokenizer.encode("Hello")], max_tokens=5, sampling=GREEDY)
    long_prompt = tokenizer.encode("The quick brown fox")
    running = submit(engine, [long_prompt], max_tokens=20, sampling=GREEDY)
    engine.run_once()
    late_prompt = tokenizer.encode("Once upon a time")
    late = submit(engine, [late_prompt], max_tokens=8, sampling=GREEDY)  # waits for the short row's slot
    drain(engine, short, running, late)
    assert engine.steps_ahead > 0
    assert late.tokens() == run_alone(model, tokenizer, late_prompt, max_tokens=8, sampling=GREEDY).tokens()
    assert running.tokens() == run_alone(model, tokenizer, long_prompt, max_tokens=20, sampling=GREEDY).tokens()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_decode_ahead_random_mixes_match_one_step_at_a_time(model, tokenizer, seed):
    """Random requests (sampling, penalties, stop strings and tokens, lengths from 1, logprobs) joining at random
    steps on fewer slots than requests: every request's outcome is the same with and without decode ahead."""
    import random
    rng = random.Random(seed)
    plans = []
    for _ in range(7):
        sampling = GREEDY if rng.random() < 0.4 else SamplingParams(
            temperature=rng.choice([0.7, 1.0, 1.3]), top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 20]),
            seed=rng.randrange(1 << 30), alpha_presence=rng.choice([0.0, 0.3]), alpha_frequency=rng.choice([0.0, 0.1]))
        options = dict(max_tokens=rng.randint(1, 14), sampling=sampling, logprobs=rng.random() < 0.3)
        if rng.random() < 0.3:
            options["stop"] = [rng.choice([" the", "e", ".", "\n"])]
        if rng.random() < 0.3:
            options["stop_token_ids"] = [rng.randrange(1, 65536) for _ in range(200)]
        plans.append((rng.randrange(12), tokenizer.encode(rng.choice(PROMPTS)), options))

    def run(decode_ahead):
        engine = make_engine(model, tokenizer, slots=3, chunk=5, decode_ahead=decode_ahead)
        collectors = [None] * len(plans)
        for step in range(12):
            for i, (at, prompt, options) in enumerate(plans):
                if at == step:
                    collectors[i] = submit(engine, [prompt], **options)
            engine.run_once()
        drain(engine, *collectors)
        assert engine.free_slots == 3
        return [outcome(c) for c in collectors], engine.steps_ahead

    ahead, steps_ahead = run(True)
    plain, _ = run(False)
    assert ahead == plain
    assert steps_ahead > 0


def test_the_detokenizer_table_is_built_with_the_engine(model):
    """The text of every token id is tabled when the engine is built, not when the first request's detokenizer
    first needs it (which added ~25 ms to the first request's time to first token)."""
    from infer.tokenizer import WorldTokenizer
    fresh = WorldTokenizer()
    assert "token_texts" not in vars(fresh)  # a cached_property: computed on first access
    make_engine(model, fresh)
    assert "token_texts" in vars(fresh)


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0, top_p=0.9, seed=3, alpha_presence=0.5)])
def test_prompt_warm_up_leaves_no_trace(model, tokenizer, sampling):
    """ModelRunner.warm_up_prompts (app.py runs it on a GPU before serving) runs prompt steps through slots 0 and
    1 and leaves them empty: requests served afterwards get the same tokens as on a runner never warmed up."""
    prompts = [tokenizer.encode(p) for p in PROMPTS[:3]]
    options = dict(max_tokens=6, sampling=sampling)
    fresh = make_engine(model, tokenizer)
    want = [submit(fresh, [p], **options) for p in prompts]
    drain(fresh, *want)
    warmed = make_engine(model, tokenizer)
    warmed.runner.warm_up_prompts([5, 16])
    assert all(row is None for row in warmed.runner.sampler._rows)
    state = warmed.runner.state
    assert not any(pool[:, :2].any() for pool in (state.att_shift, state.wkv, state.ffn_shift))
    got = [submit(warmed, [p], **options) for p in prompts]
    drain(warmed, *got)
    assert [c.tokens() for c in got] == [c.tokens() for c in want]


def test_which_steps_replay_a_graph():
    """StepGraphs.covers: decode steps (one token a row), steps feeding one row a prompt of 2 to
    PROMPT_GRAPH_MAX_TOKENS tokens, and such a prompt last after decoding rows (unless mixed steps are off) replay
    CUDA graphs; anything else (several prompt rows, a prompt before a decoding row, a longer prompt) runs eagerly,
    among them the mixed step of the prompt warm-up (it warms the eager forward's shapes)."""
    from types import SimpleNamespace

    from infer.runner import PROMPT_GRAPH_MAX_TOKENS, ModelRunner, StepGraphs
    graphs = SimpleNamespace(prompt_lengths=range(2, PROMPT_GRAPH_MAX_TOKENS + 1), mixed_steps=True)
    covers = lambda rows: StepGraphs.covers(graphs, rows)  # noqa: E731
    warm_up_steps = []
    runner = SimpleNamespace(num_slots=4, start_row=lambda *a: None, end_row=lambda *a: None,
                             state=SimpleNamespace(reset=lambda *a: None),
                             step=lambda rows, slots, sample: warm_up_steps.append(rows))
    ModelRunner.warm_up_prompts(runner, [16, 512])
    assert [len(rows) for rows in warm_up_steps] == [1, 1, 2] and not covers(warm_up_steps[-1])
    assert covers([[5]]) and covers([[5], [6], [7]])
    assert covers([[5, 6]]) and covers([[1] * PROMPT_GRAPH_MAX_TOKENS])
    assert not covers([[1] * (PROMPT_GRAPH_MAX_TOKENS + 1)])
    assert not covers([[5, 6], [7, 8]]) and not covers([[5, 6], [7]])
    assert covers([[5], [6, 7]]) and covers([[5]] * 300 + [[1] * PROMPT_GRAPH_MAX_TOKENS])
    assert not covers([[5], [1] * (PROMPT_GRAPH_MAX_TOKENS + 1)]) and not covers([[5], [6, 7], [8, 9]])
    graphs.mixed_steps = False
    assert covers([[5], [6]]) and covers([[5, 6]]) and not covers([[5], [6, 7]])


def test_a_step_that_scores_prompt_tokens_feeds_a_bounded_number(model, tokenizer, monkeypatch):
    """A step scoring prompt tokens (prompt_logprobs) computes every fed token's logits: it feeds at most
    SCORED_STEP_TOKENS prompt tokens (its own and other prompts'), whatever the step budget, and the scores are those
    of the whole prompt at once."""
    import infer.engine as engine_module
    from infer.engine import PromptLogprobs
    monkeypatch.setattr(engine_module, "SCORED_STEP_TOKENS", 8)
    prompt = tokenizer.encode("Scoring a prompt long enough to need several steps of eight tokens each, at least; "
                              "so it goes on a while longer, with a few more words after the first clause.")
    other = tokenizer.encode("Another prompt, not scored, that arrives with it and would fit in one step.")
    assert len(prompt) > 24 and len(other) > 8
    engine = make_engine(model, tokenizer, chunk=64, step_tokens=256)
    fed = []  # tokens fed by each step while the scored prompt is not through
    step = engine.runner.launch

    def launch(rows, *args, **kwargs):
        if not any(isinstance(e, PromptLogprobs) for e in scored.events):
            fed.append(sum(map(len, rows)))
        return step(rows, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "launch", launch)
    scored = submit(engine, [prompt], max_tokens=0, prompt_logprobs=1)
    plain = submit(engine, [other], max_tokens=2, sampling=GREEDY)
    drain(engine, scored, plain)
    assert len(fed) >= 4 and max(fed) <= 8 + 1  # prompt tokens, and the other row's decode token once it decodes
    (event,) = [e for e in scored.events if isinstance(e, PromptLogprobs)]
    logp = torch.log_softmax(model.prefill([prompt], [0], model.new_state_pool(1), all_logits=True), -1)
    assert all(abs(event.entries[j].logprob - logp[j - 1, prompt[j]].item()) < 1e-4 for j in range(1, len(prompt)))
    assert plain.tokens() == run_alone(model, tokenizer, other, max_tokens=2, sampling=GREEDY).tokens()
