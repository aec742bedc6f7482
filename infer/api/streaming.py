"""Server-sent events and client-disconnect handling shared by the routes.

Both response kinds stop the engine's work when the client goes away: an SSE body is closed
(its EventStream cancels the rows) and a non-stream request is abandoned with status 499. Both
run an ``on_close`` hook (``EventStream.close``) when the response is over, however it ended,
even when the client left before the body generator ever started.
"""
from __future__ import annotations

import asyncio
import json
from json.encoder import encode_basestring
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, TypeVar

from fastapi import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")
Hook = Callable[[], Awaitable[None]]

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE_DATA = "[DONE]"
DONE = f"data: {DONE_DATA}\n\n"
CLIENT_CLOSED_REQUEST = 499  # nginx's code for "client went away"; nobody reads it


def sse_doc(*models: type) -> dict[str, Any]:
    """OpenAPI ``content`` entry for an SSE response: each event's data is JSON of one of ``models``,
    the last one is ``[DONE]``."""
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models]
    chunk = {"type": "string", "contentMediaType": "application/json",
             "contentSchema": refs[0] if len(refs) == 1 else {"anyOf": refs}}
    return {"text/event-stream": {"schema": {
        "type": "object", "required": ["data"],
        "properties": {"data": {"anyOf": [chunk, {"const": DONE_DATA}]}}}}}


# json.dumps with these options builds a new encoder per call; one shared encoder gives the same text.
encode_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
# A str as JSON text, raw UTF-8: the string encoder encode_json itself uses (the same text, without its per-call cost
# for code that writes a stream's small objects out by hand).
json_string = encode_basestring


def sse(payload: Any, event: str | None = None) -> str:
    """One SSE event; raw UTF-8 (not \\u escapes) like the peer server. ``event`` adds an ``event:``
    line (only the Responses API uses one, as OpenAI's does)."""
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {encode_json(payload)}\n\n"


class SseObjects:
    """SSE events of JSON objects made of the fields of ``head``, one field ``key`` that changes and
    the fields of ``tail``; head and tail are encoded once: ``events(value)`` is the same text as
    ``sse({**head, key: value, **tail})`` (a stream's per-step chunks)."""

    def __init__(self, head: dict[str, Any], key: str, tail: dict[str, Any] | None = None):
        if key in head or key in (tail or {}):
            raise ValueError(f"{key!r} is also a head or tail field")
        fields = [part for part in (encode_json(head)[1:-1], encode_json({key: None})[1:-len("null}")]) if part]
        self._prefix = "data: {" + ",".join(fields)      # 'data: {"id":"x",...,"choices":'
        self._suffix = ("," + encode_json(tail)[1:] if tail else "}") + "\n\n"

    def __call__(self, value: Any) -> str:
        return self.encoded(encode_json(value))

    def encoded(self, value_json: str) -> str:
        """The event whose changing field is ``value_json``, JSON text already."""
        return f"{self._prefix}{value_json}{self._suffix}"

    def encoded_array(self, items_json: Iterable[str]) -> str:
        """The event whose changing field is the array of ``items_json``, each JSON text already (a chunk's choices
        written out by hand)."""
        return self.encoded(f"[{','.join(items_json)}]")


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventSourceResponse(StreamingResponse):
    """``text/event-stream`` that always watches for the client leaving, whatever the ASGI server's
    spec version, and always closes the body generator (which cancels the engine request)."""

    def __init__(self, content: AsyncIterator[str], on_close: Hook | None = None):
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({streaming, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, watcher):
                task.cancel()
            await asyncio.gather(streaming, watcher, return_exceptions=True)
            await self.body_iterator.aclose()
            if self.on_close is not None:
                await self.on_close()
        if streaming.done() and not streaming.cancelled() and streaming.exception() is not None:
            raise streaming.exception()


class ClientDisconnected(Exception):
    """Raised by :func:`unless_disconnected`; the app answers it with an empty 499."""


async def unless_disconnected(request: Request, work: Awaitable[T], on_close: Hook | None = None) -> T:
    """Await ``work`` (collecting a non-stream result) but give up as soon as the client disconnects;
    cancelling ``work`` closes its event stream, which cancels the engine request."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise ClientDisconnected
        return task.result()
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
        if on_close is not None:
            await on_close()


def client_gone() -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)
