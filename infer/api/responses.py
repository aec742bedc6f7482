"""OpenAI Responses API, text subset: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

The Responses API is stateful, like RWKV. A stored response (``store``, the default) keeps the
model state where its output ends, together with the response object, under its id in the
caller's namespace; ``previous_response_id`` continues from that state, so a follow-up feeds
only its new input (rendered with the chat template after ``"\\n\\n"``) whatever the length of
the conversation. Responses are never modified: two follow-ups of one response are two branches.

Fields: ``input`` (a string or messages with text parts), ``instructions`` (system text placed
before this turn's input), ``previous_response_id``, ``max_output_tokens``, ``temperature``,
``top_p``, ``stream``, ``store``; the rest of the request is accepted and ignored. Sampling
defaults are those of chat (infer/api/openai.py). Streams are OpenAI's event sequence with
``event:`` lines, ending with ``response.completed`` (``response.incomplete`` after
``max_output_tokens``, ``response.failed``), without ``[DONE]``.
"""
from __future__ import annotations

import itertools
import json
import time
import uuid
from typing import Annotated, Any, AsyncIterator

from fastapi import APIRouter, Depends, Path, Request
from fastapi.responses import JSONResponse, Response

from infer.api.bridge import EventStream, RowGroup
from infer.api.chat_template import TURN_STOPS, render_chat_parts
from infer.api.context import ServerContext, get_ctx
from infer.api.errors import ApiError
from infer.api.openai import CHAT_DEFAULTS, CHAT_MAX_TOKENS
from infer.api.schemas import (ChatMessage, OpenAIError, ResponseDeleted, ResponseEvent,
                               ResponseObject, ResponseRequest)
from infer.api.state import continuation, session_call, sessions
from infer.api.streaming import EventSourceResponse, sse, sse_doc, unless_disconnected
from infer.engine import GenerationOptions, RowFinished, RowText
from infer.sampler import SamplingParams
from infer.sessions import MAX_ID_CHARS, Turn

TEXT_PARTS = ("input_text", "output_text", "text")
STATUS = {"stop": "completed", "length": "incomplete"}  # any other finish: failed
ERRORS = {status: {"model": OpenAIError} for status in (400, 401, 404, 409, 410, 413, 422, 429, 503)}
ResponseId = Annotated[str, Path(max_length=MAX_ID_CHARS)]

router = APIRouter(tags=["OpenAI"])


def chat_messages(body: ResponseRequest) -> list[ChatMessage]:
    if isinstance(body.input, str):
        return [ChatMessage(role="user", content=body.input)]
    return [ChatMessage(role=m.role, content=m.content if isinstance(m.content, str) else
                        "".join(p.text or "" for p in m.content if p.type in TEXT_PARTS)) for m in body.input]


class ResponseRun:
    """One response's output as it grows, and its response object (the same for stream and JSON)."""

    def __init__(self, response_id: str, body: ResponseRequest, model: str, sampling: SamplingParams,
                 prompt_tokens: int):
        self.id, self.message_id = response_id, f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self._body, self._model, self._sampling, self._prompt_tokens = body, model, sampling, prompt_tokens
        self.text = ""
        self.finished: RowFinished | None = None

    def add(self, events: list[Any]) -> str:
        """The text these engine events add."""
        delta = "".join(e.text for e in events if isinstance(e, (RowText, RowFinished)))
        self.text += delta
        self.finished = next((e for e in events if isinstance(e, RowFinished)), self.finished)
        return delta

    async def collect(self, stream: EventStream) -> None:
        async for events in stream.batches():
            self.add(events)

    def message(self, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": self.text, "annotations": []}] if status != "in_progress" else []
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    def response(self) -> dict[str, Any]:
        """The response object: in progress until the row has finished."""
        done = self.finished
        status = "in_progress" if done is None else STATUS.get(done.finish_reason, "failed")
        obj = ResponseObject(
            id=self.id, created_at=self.created_at, status=status, model=self._model,
            output=[self.message("incomplete" if status == "failed" else status)] if done is not None else [],
            usage={"input_tokens": self._prompt_tokens, "output_tokens": done.completion_tokens,
                   "total_tokens": self._prompt_tokens + done.completion_tokens} if done is not None else None,
            previous_response_id=self._body.previous_response_id, instructions=self._body.instructions,
            max_output_tokens=self._body.max_output_tokens, temperature=self._sampling.temperature,
            top_p=self._sampling.top_p, store=bool(self._body.store),
            incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
            error={"code": "server_error", "message": "generation failed"} if status == "failed" else None)
        return obj.model_dump()

    async def conclude(self, turn: Turn | None) -> dict[str, Any]:
        """The final response object, stored with the state first when asked."""
        final = self.response()
        if turn is not None and self._body.store:
            await turn.finish(self.finished, meta=json.dumps(final, ensure_ascii=False))
        return final


@router.post("/v1/responses", response_model=None, responses={
    200: {"model": ResponseObject, "content": sse_doc(ResponseEvent)}, **ERRORS},
    summary="OpenAI Responses API (text): chained by previous_response_id through the stored RWKV state")
async def create_response(body: ResponseRequest, request: Request, ctx: ServerContext = Depends(get_ctx)) -> Response:
    rendered = render_chat_parts(chat_messages(body), body.instructions)
    if not rendered.text:
        raise ApiError(400, "input: no message has text content", param="input")
    sampling = SamplingParams(
        temperature=CHAT_DEFAULTS.temperature if body.temperature is None else body.temperature,
        top_p=CHAT_DEFAULTS.top_p if body.top_p is None else body.top_p, top_k=CHAT_DEFAULTS.top_k,
        alpha_presence=CHAT_DEFAULTS.alpha_presence, alpha_frequency=CHAT_DEFAULTS.alpha_frequency,
        alpha_decay=CHAT_DEFAULTS.alpha_decay)
    options = GenerationOptions(max_tokens=ctx.max_tokens(body.max_output_tokens, CHAT_MAX_TOKENS, "max_output_tokens"),
                                stop=list(TURN_STOPS), sampling=sampling, keep_state=bool(body.store))
    response_id = f"resp_{uuid.uuid4().hex}"
    turn = None  # follow() never locks: responses are never overwritten
    if body.store or body.previous_response_id is not None:
        turn = await session_call(sessions(ctx).follow(ctx.namespace, body.previous_response_id, response_id),
                                  "previous_response_id")
    state = turn.state if turn is not None else None
    if state is None:
        prompt, boundaries = await ctx.encode_with_boundaries(rendered.text, rendered.boundaries, "input")
    else:
        (prompt,), boundaries = await ctx.encode([continuation(rendered.text, turn)], "input", indexed=False), []
    stream = ctx.start([RowGroup([prompt], options, [state], boundaries)])
    run = ResponseRun(response_id, body, body.model or ctx.model_name, sampling, len(prompt))
    if body.stream:
        return EventSourceResponse(_events(stream, run, turn), on_close=stream.close)
    await unless_disconnected(request, run.collect(stream), on_close=stream.close)
    return JSONResponse(await run.conclude(turn))


async def _events(stream: EventStream, run: ResponseRun, turn: Turn | None) -> AsyncIterator[str]:
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> str:
        return sse({"type": kind, "sequence_number": next(numbers), **fields}, event=kind)
    where = {"item_id": run.message_id, "output_index": 0, "content_index": 0}
    yield event("response.created", response=run.response())
    yield event("response.in_progress", response=run.response())
    yield event("response.output_item.added", output_index=0, item=run.message("in_progress"))
    yield event("response.content_part.added", **where, part={"type": "output_text", "text": "", "annotations": []})
    async for events in stream.batches():
        if delta := run.add(events):
            yield event("response.output_text.delta", **where, delta=delta, logprobs=[])
    final = await run.conclude(turn)
    item = final["output"][0]
    yield event("response.output_text.done", **where, text=run.text, logprobs=[])
    yield event("response.content_part.done", **where, part=item["content"][0])
    yield event("response.output_item.done", output_index=0, item=item)
    yield event(f"response.{final['status']}", response=final)


@router.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=ERRORS,
            summary="A stored response")
async def get_response(response_id: ResponseId, ctx: ServerContext = Depends(get_ctx)) -> JSONResponse:
    return JSONResponse(json.loads(await _stored(ctx, response_id)))


@router.delete("/v1/responses/{response_id}", response_model=ResponseDeleted, responses=ERRORS,
               summary="Delete a stored response (and its state)")
async def delete_response(response_id: ResponseId, ctx: ServerContext = Depends(get_ctx)) -> ResponseDeleted:
    await _stored(ctx, response_id)
    await session_call(sessions(ctx).delete(ctx.namespace, response_id), "response_id")
    return ResponseDeleted(id=response_id)


async def _stored(ctx: ServerContext, response_id: str) -> str:
    meta = await session_call(sessions(ctx).store.get_meta(ctx.namespace, response_id), "response_id")
    if meta is None:
        raise ApiError(404, f"no stored response {response_id!r}", param="response_id", code="not_found")
    return meta
