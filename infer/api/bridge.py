"""Hand engine events (produced on the engine thread) to an asyncio consumer without blocking either side."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Sequence

from infer.engine import Engine, Event, GenerationOptions, Request, RowFinished
from infer.state import SlotState


class EventStream:
    """Submit one request and iterate its events; cancels the request if the consumer goes away."""

    def __init__(self, engine: Engine, prompts: Sequence[Sequence[int]], options: GenerationOptions,
                 initial_states: Sequence[SlotState | None] | None = None):
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self.request = Request(prompts, options, self._sink, initial_states)
        self._open = len(prompts)

    def _sink(self, event: Event) -> None:  # engine thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    def submit(self) -> None:
        """Raises QueueFullError when the engine's queue is full."""
        self._engine.submit(self.request)

    def cancel(self) -> None:
        if self._open:
            self._engine.cancel(self.request)

    async def __aiter__(self) -> AsyncIterator[Event]:
        try:
            while self._open:
                event = await self._queue.get()
                if isinstance(event, RowFinished):
                    self._open -= 1
                yield event
        finally:
            self.cancel()  # consumer stopped early (client gone): free the slots
