"""The serving engine: a queue, a continuous-batching scheduler and one worker thread.

The worker thread is the only code that runs the model. Each step it admits waiting rows
into free state slots, feeds every decoding row one token and the prefilling rows up to
``prefill_chunk_size`` prompt tokens (packed into the same forward), samples, detokenizes,
applies stops and hands events to each request's sink. Rows join and leave at any step.
Knows requests, rows and slots; tensors stay inside the runner.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Sequence

from infer.metrics import EngineMetrics
from infer.runner import ModelRunner
from infer.sampler import SamplingParams
from infer.state import SlotState
from infer.stops import StopMatcher
from infer.tokenizer import IncrementalDecoder, WorldTokenizer

log = logging.getLogger(__name__)

EOD_TOKEN = 0  # end of document: always stops a row


class QueueFullError(RuntimeError):
    """The engine's request queue is at its bound; the client should retry later (HTTP 429)."""


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RowText:
    """New output of one row: released text (may be empty while a stop string is pending)."""

    index: int
    text: str
    token_id: int
    logprob: TokenLogprob | None = None


@dataclass
class RowFinished:
    index: int
    finish_reason: str          # "stop", "length", "cancelled" or "error"
    prompt_tokens: int
    completion_tokens: int
    text: str = ""              # last released text (held-back characters at the end)
    state: SlotState | None = None  # with keep_state: the state where the visible text ends
    matched_stop: str | int | None = None
    logprob: TokenLogprob | None = None  # of the stop token that ended the row (with options.logprobs)


@dataclass
class PromptLogprobs:
    """Log-probabilities of a row's prompt tokens (``entries[0]`` is None: nothing predicts the first)."""

    index: int
    entries: list[TokenLogprob | None]


@dataclass
class StateSnapshot:
    """The row's state after its first ``position`` prompt tokens (for a prefix cache)."""

    index: int
    position: int
    state: SlotState


Event = RowText | RowFinished | PromptLogprobs | StateSnapshot


@dataclass
class GenerationOptions:
    max_tokens: int = 256
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logprobs: bool = False       # report the chosen token's logprob (and sampling.logprobs alternatives)
    keep_state: bool = False     # hand back the final state (sessions); it ends where the visible text ends
    prompt_logprobs: int | None = None  # score the prompt: None = off, N = also the top N alternatives
    snapshot_at: int | None = None      # emit a StateSnapshot after this many prompt tokens (< prompt length)


class Request:
    """One client request: N prompts (rows) sharing options; events go to ``sink`` from the engine thread."""

    _ids = itertools.count()

    def __init__(self, prompts: Sequence[Sequence[int]], options: GenerationOptions, sink: Callable[[Event], None],
                 initial_states: Sequence[SlotState | None] | None = None):
        if not prompts:
            raise ValueError("a request needs at least one prompt")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if initial_states is not None and len(initial_states) != len(prompts):
            raise ValueError("one initial state per prompt")
        if options.snapshot_at is not None and not 0 < options.snapshot_at < min(len(p) for p in prompts):
            raise ValueError("snapshot_at must lie inside every prompt (1 .. length-1)")
        self.id = next(self._ids)
        self.prompts = [list(p) for p in prompts]
        self.options = options
        self.sink = sink
        self.initial_states = list(initial_states) if initial_states is not None else [None] * len(prompts)
        self.submitted_at = time.monotonic()
        self.cancelled = False
        self.unfinished = len(prompts)


class Phase(Enum):
    PREFILL = 1   # feeding the prompt; samples when the last chunk is in
    DECODE = 2    # one token per step
    REPLAY = 3    # rebuilding the state that ends at the visible text (keep_state), no sampling


class _Row:
    def __init__(self, request: Request, index: int, slot: int, tokenizer: WorldTokenizer):
        self.request = request
        self.index = index
        self.slot = slot
        self.phase = Phase.PREFILL
        self.feed: list[int] = request.prompts[index]   # tokens this phase still has to feed
        self.pos = 0
        self.generated: list[int] = []
        self.next_input = -1
        self.decoder = IncrementalDecoder(tokenizer)
        self.stops = StopMatcher(list(request.options.stop))
        self.released: list[str] = []                  # visible text so far
        self.decoded_chars = 0
        # per generated token: characters decoded up to and including it, or -1 when it ends
        # inside a character (no clean cut for rebuilding a state after a stop string)
        self.boundaries: list[int] = []
        self.initial: SlotState | None = None           # kept for REPLAY
        self.last_token_at = 0.0
        self.pending_finish: RowFinished | None = None
        self.prompt_scores: list[TokenLogprob | None] = [None]


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer: WorldTokenizer, prefill_chunk_size: int = 512,
                 max_queued_requests: int = 1024, metrics: EngineMetrics | None = None):
        if prefill_chunk_size < 1:
            raise ValueError("prefill_chunk_size must be >= 1")
        self.runner = runner
        self.tokenizer = tokenizer
        self.prefill_chunk_size = prefill_chunk_size
        self.max_queued_requests = max_queued_requests
        self.metrics = metrics or EngineMetrics()
        self._inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._queued_lock = threading.Lock()
        self._queued = 0                          # requests submitted and not fully admitted
        self._waiting: deque[tuple[Request, deque[int]]] = deque()  # request, row indices not yet admitted
        self._running: list[_Row] = []
        self._free_slots = list(range(runner.num_slots - 1, -1, -1))
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.metrics.free_slots.set(len(self._free_slots))

    # ------------------------------------------------------------------ public, any thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="rwkv-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, request: Request) -> None:
        """Queue a request; raises QueueFullError when ``max_queued_requests`` are already waiting."""
        with self._queued_lock:
            if self._queued >= self.max_queued_requests:
                self.metrics.rejected_requests.inc()
                raise QueueFullError(f"the request queue is full ({self.max_queued_requests} waiting)")
            self._queued += 1
            self.metrics.queued_requests.set(self._queued)
        self._inbox.put(request)
        self._wake.set()

    def cancel(self, request: Request) -> None:
        """Stop a request wherever it is (queued, prefilling, decoding); its slots free within one step."""
        request.cancelled = True
        self._wake.set()

    @property
    def is_running(self) -> bool:
        """The worker thread is alive (health checks)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def queued_requests(self) -> int:
        return self._queued

    @property
    def running_rows(self) -> int:
        return len(self._running)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        while not self._stop:
            if not self.run_once():
                self._wake.wait(timeout=1.0)
                self._wake.clear()

    def run_once(self) -> bool:
        """One scheduling round and, if any row is running, one model step. Returns False when idle.

        Called by the worker thread; tests call it directly (without ``start``) to control timing.
        """
        self._take_inbox()
        self._drop_cancelled()
        self._admit()
        if not self._running:
            return False
        started = time.monotonic()
        try:
            self._step()
        except Exception:
            log.exception("engine step failed; failing every running row")
            for row in list(self._running):
                self._finish(row, "error", replay=False)
        self.steps += 1
        self.metrics.step_seconds.observe(time.monotonic() - started)
        return True

    def _take_inbox(self) -> None:
        while True:
            try:
                request = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._waiting.append((request, deque(range(len(request.prompts)))))

    def _dequeued(self, n: int = 1) -> None:
        with self._queued_lock:
            self._queued -= n
            self.metrics.queued_requests.set(self._queued)

    def _drop_cancelled(self) -> None:
        for request, pending in list(self._waiting):
            if request.cancelled:
                self._waiting.remove((request, pending))
                self._dequeued()
                for index in pending:
                    self._emit(request, RowFinished(index, "cancelled", len(request.prompts[index]), 0))
        for row in [r for r in self._running if r.request.cancelled]:
            self._finish(row, "cancelled", replay=False)

    def _admit(self) -> None:
        """Round-robin over waiting requests, one row each per turn, so a small request is never
        stuck behind a large one that does not fit."""
        while self._free_slots and self._waiting:
            request, pending = self._waiting.popleft()
            index = pending.popleft()
            slot = self._free_slots.pop()
            row = _Row(request, index, slot, self.tokenizer)
            self.runner.start_row(slot, request.options.sampling, request.initial_states[index])
            if request.options.keep_state:
                row.initial = self.runner.export_state(slot)
            self._running.append(row)
            if pending:
                self._waiting.append((request, pending))
            else:
                self._dequeued()
        self.metrics.running_rows.set(len(self._running))
        self.metrics.free_slots.set(len(self._free_slots))

    def _step(self) -> None:
        feeds, slots, samples, rows = [], [], [], []
        for row in self._running:
            if row.phase is Phase.DECODE:
                feeds.append([row.next_input])
                slots.append(row.slot)
                samples.append(True)
                rows.append(row)
        budget = self.prefill_chunk_size
        score: dict[int, tuple[list[int], int]] = {}
        for row in self._running:
            if row.phase is Phase.DECODE or budget <= 0:
                continue
            n = min(budget, len(row.feed) - row.pos)
            snapshot_at = row.request.options.snapshot_at
            if row.phase is Phase.PREFILL and snapshot_at is not None and row.pos < snapshot_at:
                n = min(n, snapshot_at - row.pos)  # end a chunk exactly at the snapshot position
            feeds.append(row.feed[row.pos:row.pos + n])
            slots.append(row.slot)
            top_n = row.request.options.prompt_logprobs
            if row.phase is Phase.PREFILL and top_n is not None:
                score[len(rows)] = (row.feed[row.pos + 1:row.pos + n + 1], top_n)
            row.pos += n
            budget -= n
            done = row.pos == len(row.feed)
            samples.append(row.phase is Phase.PREFILL and done and row.request.options.max_tokens > 0)
            rows.append(row)
            if row.phase is Phase.PREFILL:
                self.metrics.prompt_tokens.inc(n)
        want_logprobs = any(r.request.options.logprobs for r, s in zip(rows, samples) if s)
        out = self.runner.step(feeds, slots, samples, want_logprobs=want_logprobs, score=score)
        self.metrics.step_rows.observe(len(rows))
        now = time.monotonic()
        sampled = iter(range(len(out.tokens)))
        for position, (row, sample) in enumerate(zip(rows, samples)):
            if position in out.scores:
                row.prompt_scores += [TokenLogprob(t, lp, top) for t, (lp, top) in
                                      zip(score[position][0], out.scores[position])]
            prompt_done = row.phase is Phase.PREFILL and row.pos == len(row.feed)
            if row.phase is Phase.PREFILL and row.pos == row.request.options.snapshot_at:
                self._emit(row.request, StateSnapshot(row.index, row.pos, self.runner.export_state(row.slot)))
            if prompt_done and row.request.options.prompt_logprobs is not None:
                self._emit(row.request, PromptLogprobs(row.index, row.prompt_scores))
            if sample:
                i = next(sampled)
                lp = None
                if row.request.options.logprobs and out.logprobs is not None:
                    top = list(zip(out.top_ids[i], out.top_logprobs[i])) if out.top_ids is not None else []
                    lp = TokenLogprob(out.tokens[i], out.logprobs[i], top[: row.request.options.sampling.logprobs])
                self._on_token(row, out.tokens[i], lp, now)
            elif prompt_done:  # max_tokens == 0: scoring only
                self._finish(row, "length")
            elif row.phase is Phase.REPLAY and row.pos == len(row.feed):
                finished = row.pending_finish
                finished.state = self.runner.export_state(row.slot)
                self._release(row, finished)

    def _on_token(self, row: _Row, token: int, logprob: TokenLogprob | None, now: float) -> None:
        request, options = row.request, row.request.options
        if not row.generated:
            self.metrics.time_to_first_token.observe(now - request.submitted_at)
        else:
            self.metrics.inter_token_latency.observe(now - row.last_token_at)
        row.last_token_at = now
        row.generated.append(token)
        self.metrics.generated_tokens.inc()
        if token == EOD_TOKEN or token in options.stop_token_ids:
            self._finish(row, "stop", matched_stop=token, logprob=logprob)
            return
        piece = row.decoder.push(token)
        row.decoded_chars += len(piece)
        row.boundaries.append(-1 if row.decoder.pending else row.decoded_chars)
        result = row.stops.push(piece)
        row.released.append(result.text)
        self._emit(request, RowText(row.index, result.text, token, logprob))
        if result.stopped:
            self._finish(row, "stop", matched_stop=result.stop)
        elif len(row.generated) >= options.max_tokens:
            self._finish(row, "length")
        else:
            row.phase = Phase.DECODE
            row.next_input = token

    def _finish(self, row: _Row, reason: str, replay: bool = True, matched_stop: str | int | None = None,
                logprob: TokenLogprob | None = None) -> None:
        drain = reason == "length" or (reason == "stop" and isinstance(matched_stop, int))
        tail = self._drain_text(row) if drain else ""
        row.released.append(tail)
        finished = RowFinished(row.index, reason, len(row.request.prompts[row.index]), len(row.generated), tail,
                               matched_stop=matched_stop, logprob=logprob)
        if replay and row.request.options.keep_state and reason in ("stop", "length"):
            replay_from_initial, tokens = self._replay_plan(row, reason, matched_stop)
            if tokens:
                if replay_from_initial:
                    self.runner.start_row(row.slot, row.request.options.sampling, row.initial)
                row.phase, row.feed, row.pos = Phase.REPLAY, tokens, 0
                row.pending_finish = finished
                return
            finished.state = self.runner.export_state(row.slot)
        self._release(row, finished)

    @staticmethod
    def _drain_text(row: _Row) -> str:
        """Release what the decoder and the stop matcher still hold when a row ends without a stop string."""
        result = row.stops.push(row.decoder.flush())
        return result.text if result.stopped else result.text + row.stops.flush()

    def _replay_plan(self, row: _Row, reason: str, matched_stop: str | int | None) -> tuple[bool, list[int]]:
        """Tokens to feed so the slot's state ends exactly at the visible text.

        The slot holds prompt + generated[:-1] (the last sampled token is never fed). A stop
        token must stay out; a length finish needs the last token in; after a stop string the
        state is rebuilt from the row's initial state with the visible text only.
        """
        if not row.generated:
            return False, []
        if reason == "length":
            return False, [row.generated[-1]]
        if isinstance(matched_stop, int):
            return False, []
        # Keep the model's own tokens up to the last clean character boundary inside the visible
        # text (so invalid bytes stay as sampled), then re-encode the visible rest of the cut token.
        visible = "".join(row.released)
        kept, done = 0, 0
        for k, chars in enumerate(row.boundaries[:-1], 1):  # the fed tokens
            if chars > len(visible):
                break
            if chars >= 0:
                kept, done = k, chars
        rest = self.tokenizer.encode(visible[done:])
        if kept == len(row.generated) - 1:  # only the unfed last token differs: extend the current state
            return False, rest
        return True, row.request.prompts[row.index] + row.generated[:kept] + rest

    def _release(self, row: _Row, finished: RowFinished) -> None:
        self._running.remove(row)
        self.runner.end_row(row.slot)
        self._free_slots.append(row.slot)
        self.metrics.finished_rows.labels(finished.finish_reason).inc()
        self.metrics.running_rows.set(len(self._running))
        self.metrics.free_slots.set(len(self._free_slots))
        self._emit(row.request, finished)

    def _emit(self, request: Request, event: Event) -> None:
        if isinstance(event, RowFinished):
            request.unfinished -= 1
        try:
            request.sink(event)
        except Exception:  # a broken consumer must not take the engine down
            log.exception("event sink of request %d failed; cancelling it", request.id)
            request.cancelled = True
