"""Hand engine events (produced on the engine thread) to an asyncio consumer without blocking either side."""
from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import AsyncIterator, Awaitable, Callable, Sequence

from infer.engine import Engine, Event, GenerationOptions, QueueFullError, Request, RowFinished, StateSnapshot
from infer.prefix_cache import CachePart, PrefixCache, whole_group
from infer.state import SlotState


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
    """

    def __init__(self, engine: Engine, groups: Sequence[RowGroup], prefix_cache: PrefixCache | None = None,
                 on_finish: Callable[[RowFinished], Awaitable[None]] | None = None,
                 on_close: Callable[[], Awaitable[None]] | None = None):
        self._engine = engine
        self._cache = prefix_cache
        self._on_finish, self._on_close = on_finish, on_close
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
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
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (request, event))

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
                items = [await self._queue.get()]
                while not self._queue.empty():
                    items.append(self._queue.get_nowait())
                events = []
                for request, event in items:
                    rows, part = self._parts[request]
                    if isinstance(event, StateSnapshot):
                        self._cache.store(part.keys[event.index], event.state)
                        continue
                    changes: dict = {"index": rows[event.index]}
                    if isinstance(event, RowFinished):
                        self._open[request] -= 1
                        changes["prompt_tokens"] = event.prompt_tokens + part.skipped[event.index]
                    event = dataclasses.replace(event, **changes)
                    if isinstance(event, RowFinished) and self._on_finish is not None:
                        await self._on_finish(event)
                    events.append(event)
                if events:
                    yield events
        finally:
            self.cancel()  # consumer stopped early (client gone): free the slots
