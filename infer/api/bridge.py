"""Hand engine events (produced on the engine thread) to an asyncio consumer without blocking either side."""
from __future__ import annotations

import asyncio
import dataclasses
from functools import partial
from typing import AsyncIterator, Sequence

from infer.engine import Engine, Event, GenerationOptions, QueueFullError, Request, RowFinished

# One engine request: prompts that share options. A stream may span several (e.g. OpenAI ``n``
# choices with distinct seeds); their rows are numbered consecutively across the groups.
RowGroup = tuple[Sequence[Sequence[int]], GenerationOptions]


class EventStream:
    """Submit rows to the engine and iterate their events; cancels them if the consumer goes away."""

    def __init__(self, engine: Engine, groups: Sequence[RowGroup]):
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self.requests: list[Request] = []
        offset = 0
        for prompts, options in groups:
            self.requests.append(Request(prompts, options, partial(self._sink, offset)))
            offset += len(prompts)
        self.rows = offset
        self._open = [len(r.prompts) for r in self.requests]  # unfinished rows per request (loop side)
        self._group_of = [g for g, r in enumerate(self.requests) for _ in r.prompts]

    def _sink(self, offset: int, event: Event) -> None:  # engine thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (offset, event))

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

    async def batches(self) -> AsyncIterator[list[Event]]:
        """Events as they arrive, grouped by what is already waiting (rows of one engine step arrive
        together), with ``index`` numbered across the whole stream."""
        try:
            while any(self._open):
                items = [await self._queue.get()]
                while not self._queue.empty():
                    items.append(self._queue.get_nowait())
                events = []
                for offset, event in items:
                    if offset:
                        event = dataclasses.replace(event, index=event.index + offset)
                    if isinstance(event, RowFinished):
                        self._open[self._group_of[event.index]] -= 1
                    events.append(event)
                yield events
        finally:
            self.cancel()  # consumer stopped early (client gone): free the slots
