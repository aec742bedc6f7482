"""Hand engine events (produced on the engine thread) to an asyncio consumer without blocking either side."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import weakref
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import AsyncIterator, Awaitable, Callable, Sequence

from infer.engine import Engine, Event, GenerationOptions, QueueFullError, Request, RowFinished, RowText, StateSnapshot
from infer.prefix_cache import CachePart, PrefixCache, whole_group
from infer.state import SlotState

log = logging.getLogger(__name__)


class _Mailbox:
    """The events one engine sends to the streams of one event loop.

    The engine thread appends to a deque; the loop is woken once per engine step, at the engine's
    flush point (``Engine.call_at_flush``: after the next step is launched), instead of one
    ``call_soon_threadsafe`` (a self-pipe write, a GIL hand-off) per event. Order is kept: one
    deque, drained in order on the loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._items: deque[tuple[EventStream, int, Event]] = deque()
        self._armed = False  # a wake-up is registered with the engine or scheduled on the loop

    def post(self, engine: Engine, stream: "EventStream", request: int, event: Event) -> None:  # engine thread
        self._items.append((stream, request, event))
        if not self._armed:  # read after the append: a drain that cleared it will still see the item
            self._armed = True
            engine.call_at_flush(self._wake)

    def _wake(self) -> None:  # engine thread, at its flush point
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody reads these streams any more
            log.warning("event loop closed; cancelling the requests of %d undelivered events", len(self._items))
            while self._items:
                stream, request, _ = self._items.popleft()
                stream.requests[request].cancelled = True
            self._armed = False

    def _drain(self) -> None:  # loop thread
        self._armed = False  # before reading: an event appended from now on arms a new wake-up
        items = self._items
        while items:
            stream, request, event = items.popleft()
            stream._deliver(request, event)


# engine -> event loop -> mailbox (an engine that is gone takes its mailboxes along)
_MAILBOXES: "weakref.WeakKeyDictionary[Engine, dict[asyncio.AbstractEventLoop, _Mailbox]]" = weakref.WeakKeyDictionary()


def _mailbox(loop: asyncio.AbstractEventLoop, engine: Engine) -> _Mailbox:
    boxes = _MAILBOXES.get(engine)
    if boxes is None:
        boxes = _MAILBOXES[engine] = {}
    box = boxes.get(loop)
    if box is None:
        for old in [old for old in boxes if old.is_closed()]:
            del boxes[old]
        box = boxes[loop] = _Mailbox(loop)
    return box


@dataclass
class RowGroup:
    """Prompts that share options. A stream may span several groups (e.g. OpenAI ``n`` choices with
    distinct seeds); their rows are numbered consecutively across the groups."""

    prompts: Sequence[Sequence[int]]
    options: GenerationOptions
    initial_states: Sequence[SlotState | None] | None = None  # per prompt; None: an empty context
    boundaries: Sequence[int] = ()  # prompt positions later prompts are likely to share (prefix-cache hints)


class EventStream:
    """Submit rows to the engine and iterate their events; cancels them if the consumer goes away.

    With a prefix cache, rows that start from an empty context are looked up first: a hit feeds
    only the rest of the prompt (``prompt_tokens`` in events still counts the whole prompt) and the
    snapshots the cache asks for are stored, not passed on.

    ``on_finish`` is awaited for each finished row before its event is passed on (a session turn
    stores its state there, so the client sees the end only once it is stored); ``on_close`` once
    when the response is over, however it ended (``close``).

    ``interval``: the reader is woken for text only once about that many tokens per unfinished row
    are waiting (every other event, and the stream's first text, wake it at once). Each wake-up costs
    the event loop a chunk formatted and written per stream; with many streams of a small model that
    work, not the GPU, sets the step rate (``--stream-interval``).
    """

    def __init__(self, engine: Engine, groups: Sequence[RowGroup], prefix_cache: PrefixCache | None = None,
                 on_finish: Callable[[RowFinished], Awaitable[None]] | None = None,
                 on_close: Callable[[], Awaitable[None]] | None = None, interval: int = 1):
        if interval < 1:
            raise ValueError(f"interval must be at least 1, got {interval}")
        self._engine = engine
        self._interval = interval
        self._cache = prefix_cache
        self._on_finish, self._on_close = on_finish, on_close
        self._loop = asyncio.get_running_loop()
        self._mailbox = _mailbox(self._loop, engine)
        self._inbox: list[tuple[int, Event]] = []   # delivered, not yet read (loop side)
        self._ready = False       # the inbox holds what wakes the reader (loop side)
        self._held_text = 0       # RowText events in the inbox (with interval > 1)
        self._text_seen = False   # the reader has been woken for text before
        self._waiter: asyncio.Future | None = None  # set while batches() waits for the inbox
        self.requests: list[Request] = []
        self._parts: list[tuple[list[int], CachePart]] = []  # per request: stream row numbers, cache plan
        offset = 0
        for group in groups:
            for part in self._plan(group):
                options = group.options
                if part.snapshot_at is not None:
                    options = dataclasses.replace(options, snapshot_at=part.snapshot_at)
                sink = partial(self._sink, len(self.requests))
                self.requests.append(Request(part.prompts, options, sink, part.initial_states))
                self._parts.append(([offset + row for row in part.rows], part))
            offset += len(group.prompts)
        self.rows = offset
        self._open = [len(r.prompts) for r in self.requests]  # unfinished rows per request (loop side)

    def _plan(self, group: RowGroup) -> list[CachePart]:
        cacheable = (self._cache is not None and group.options.prompt_logprobs is None
                     and all(s is None for s in group.initial_states or ()))
        if cacheable:
            return self._cache.split(group.prompts, group.boundaries)
        return [whole_group(group.prompts, group.initial_states)]

    def _sink(self, request: int, event: Event) -> None:  # engine thread
        self._mailbox.post(self._engine, self, request, event)

    def _deliver(self, request: int, event: Event) -> None:  # loop thread
        self._inbox.append((request, event))
        if self._interval > 1 and isinstance(event, RowText) and self._text_seen:
            self._held_text += 1
            if self._held_text < self._interval * max(1, sum(self._open)):
                return
        self._ready = True
        self._text_seen = self._text_seen or isinstance(event, RowText)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def submit(self) -> None:
        """All or nothing: raises QueueFullError (with nothing left queued) when the engine is full."""
        for n, request in enumerate(self.requests):
            try:
                self._engine.submit(request)
            except QueueFullError:
                for submitted in self.requests[:n]:
                    self._engine.cancel(submitted)
                self._open = [0] * len(self.requests)
                raise

    def cancel(self) -> None:
        for request, open_rows in zip(self.requests, self._open):
            if open_rows:
                self._engine.cancel(request)

    async def close(self) -> None:
        """The response is over (sent, failed or abandoned, even before it was read): stop the rows
        still running and run ``on_close`` (once)."""
        self.cancel()
        hook, self._on_close = self._on_close, None
        if hook is not None:
            await hook()

    async def collect(self, on_event: Callable[[Event], None]) -> list[RowFinished]:
        """Read the whole stream, handing every event to ``on_event``; returns each row's finish event."""
        finished: list[RowFinished | None] = [None] * self.rows
        async for events in self.batches():
            for event in events:
                on_event(event)
                if isinstance(event, RowFinished):
                    finished[event.index] = event
        return finished  # type: ignore[return-value]

    async def batches(self) -> AsyncIterator[list[Event]]:
        """Events as they arrive, grouped by what is already waiting (rows of one engine step arrive
        together), with ``index`` numbered across the whole stream."""
        try:
            while any(self._open):
                if not self._ready:
                    self._waiter = self._loop.create_future()
                    try:
                        await self._waiter
                    finally:
                        self._waiter = None
                items, self._inbox = self._inbox, []
                self._ready, self._held_text = False, 0
                events = []
                for request, event in items:
                    rows, part = self._parts[request]
                    if isinstance(event, StateSnapshot):
                        self._cache.store(part.keys[event.index], event.state)
                        continue
                    index = rows[event.index]
                    if isinstance(event, RowFinished):
                        self._open[request] -= 1
                        skipped = part.skipped[event.index]
                        if index != event.index or skipped:
                            event = dataclasses.replace(event, index=index, prompt_tokens=event.prompt_tokens + skipped)
                        if self._on_finish is not None:
                            await self._on_finish(event)
                    elif index != event.index:
                        event = dataclasses.replace(event, index=index)
                    events.append(event)
                if events:
                    yield events
        finally:
            self.cancel()  # consumer stopped early (client gone): free the slots
